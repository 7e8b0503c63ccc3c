"""Must show: 64 concurrent sessions on different tasks give the same results as one by one.

48 telecom tasks (solo mode, the agent also holds the user's phone tools) and 16 retail
tasks (dual control, scripted user) are replayed from their golden actions over one gRPC
server, first one at a time, then all 64 at once. Every session's wire trajectory,
termination and final DBs (agent and user) must be identical. (The reward is a pure
function of the trajectory: tau2's evaluator re-runs it; test_env_replay checks rewards.)
"""

from concurrent.futures import ThreadPoolExecutor

from env_service.replay import replay_golden


def _run(client, core, env, task_id, solo):
    r = replay_golden(client, env, task_id, solo_mode=solo, close=False, evaluate=False)
    environment = core.session(r.session_id).orchestrator.environment
    db = (environment.get_db_hash(), environment.get_user_db_hash())
    client.close(r.session_id)
    return {"messages": [m.SerializeToString(deterministic=True) for m in r.messages], "termination": r.termination_reason, "db": db}


def test_64_concurrent_sessions_equal_sequential(env_fast):
    client, core = env_fast
    jobs = [("telecom", t, True) for t in client.list_tasks("telecom", "train")[:48]]
    jobs += [("retail", t, False) for t in client.list_tasks("retail", "train")[:16]]
    assert len({(e, t) for e, t, _ in jobs}) == 64

    sequential = [_run(client, core, *job) for job in jobs]
    assert core.num_sessions == 0
    with ThreadPoolExecutor(max_workers=64) as pool:
        concurrent = list(pool.map(lambda job: _run(client, core, *job), jobs))

    for job, a, b in zip(jobs, sequential, concurrent):
        assert a == b, f"{job}: concurrent run differs from sequential"
    assert core.num_sessions == 0
    assert all(r["termination"] == "agent_stop" for r in sequential)
    assert all(len(r["messages"]) >= 3 for r in sequential)
    assert len({r["db"] for r in sequential}) >= 20  # different tasks leave different DBs (25 distinct)
