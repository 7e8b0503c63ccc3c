"""Must show (issue 30): a dual-control episode with the real user-simulator endpoint, and one RL
step on it, on tiny budgets.

The user is τ²-Bench's `UserSimulator` in the env service, calling SmolLM2 through litellm on
vLLM's OpenAI server in its own process, started as the local launcher starts it
(`user_sim_vllm_server`: `python -m vllm.entrypoints.openai.api_server`, served name "user-sim").
Two episodes of one generated dual-control task (`tau2_adapter.generate_dual`) run through the
rollout service's own agent loop: one sampled from the policy (the session's vLLM engine), one
played by the golden script (`sinkflex_rl.warm_start.GoldenEngine`, the warm start's
demonstration policy). Both are scored by the reward service (τ²-Bench's evaluator); the group of
the two goes through one GRPO step of the SmolLM2 learner (old log-probs recomputed: the golden
turns carry none).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from sinkflex.api.common.v1 import common_pb2

pytestmark = [pytest.mark.usefixtures("torch_one_thread")]


def test_dual_episode_with_the_user_simulator_endpoint_and_one_rl_step(tmp_path, smollm2_dir, user_sim_vllm_server,
                                                                       rollout_engine, rollout_tokenizer):
    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from learner_service.trainer import Learner
    from reward_service.client import LocalRewardClient
    from reward_service.scoring import TaskCatalog
    from rollout_service.agent import AgentLoop
    from rollout_service.engine import Sampling
    from rollout_service.formatting import ChatTemplateFormatter
    from sinkflex_rl.controller import user_turn_counts
    from sinkflex_rl.warm_start import GoldenEngine, dialogue_turns
    from tau2_adapter.generate import write_task_dir
    from tau2_adapter.generate_dual import generate_dual_tasks, golden_dialogue
    from tau2_adapter.logs import quiet_tau2_logs
    from tests.fixtures.learner import learner_config

    quiet_tau2_logs("WARNING")
    tasks = generate_dual_tasks(train=1, test=0, seed=0)
    task = tasks.tasks["dual_ask_create_0000"]
    task_dir = str(write_task_dir(tasks, tmp_path / "tasks"))
    server = user_sim_vllm_server
    server.wait()  # started in the background while the engine started
    env = LocalEnvClient(EnvServiceConfig(domains=("mock",), task_files={"mock": [task_dir]}, user_model=server.model,
                                          user_base_url=server.base_url, user_max_tokens=24))
    reward = LocalRewardClient(TaskCatalog(task_files={"mock": [task_dir]}))
    tok = rollout_tokenizer
    fmt = ChatTemplateFormatter(tok)
    script = dialogue_turns(fmt, [t for role, t in golden_dialogue(task) if role == "agent"])

    def requests() -> int:  # the server's access log: one line per chat completion it answered
        return server.log.read_text(errors="replace").count('"POST /v1/chat/completions HTTP/1.1" 200')

    requests_before = requests()

    def group(engine, max_turns, run, max_new_tokens=24):
        loop = AgentLoop(engine, tok, env, reward=reward, tool_format="hermes")
        return run(loop.run_group("mock", task.id, 1, Sampling(temperature=1.0, max_new_tokens=max_new_tokens, seed=0),
                                  max_turns, 4096, solo_mode=False, publish=False))

    # the vLLM engine's coroutines run on the engine's own loop (Engine.run); the script's on a new one
    sampled = group(rollout_engine, 2, rollout_engine.run).trajectories[0]
    # the golden turns whole (the create_task call is longer than the sampled budget)
    golden = group(GoldenEngine(script, fmt.eot_id), len(script), asyncio.run, max(map(len, script))).trajectories[0]

    user_turns = 0
    for traj in (sampled, golden):
        messages = list(traj.messages)
        users = [m.content for m in messages if m.role == common_pb2.ROLE_USER]
        assert users and traj.metrics["user_turns"] == len(users) >= 1
        assert all(u.strip() for u in users), users  # the simulator said something every time
        user_turns += len(users)
        assert not math.isnan(traj.reward) and traj.termination_reason != common_pb2.TERMINATION_REASON_INFRASTRUCTURE_ERROR
        # the user's turns that an agent turn followed, whole, are in the token stream, outside the
        # loss mask (the reply to the last agent turn of a max_turns episode is in the messages only)
        last_agent = max(i for i, m in enumerate(messages) if m.role == common_pb2.ROLE_ASSISTANT)
        before_agent = [m.content for m in messages[:last_agent] if m.role == common_pb2.ROLE_USER]
        assert before_agent
        masked_out = tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m == 0])
        trained = tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m == 1])
        for text in before_agent:
            assert text in masked_out
            assert text not in trained
    # every user turn came from the vLLM server (τ²-Bench's simulator writes the opening line too)
    assert requests() - requests_before >= user_turns
    assert golden.metrics["user_turns"] >= 2  # the opening line and the answer to the agent's question
    # what the driver writes into its "train" and "val" records
    counts = user_turn_counts([sampled, golden])
    assert counts == {"user_turns_mean": user_turns / 2, "episodes_without_user_turns": 0.0}
    # the golden trajectory trains on exactly the script's turns, each at its full length
    assert [t for t, m in zip(golden.token_ids, golden.loss_mask) if m == 1] == [t for turn in script for t in turn]
    # the golden script created the task with the scenario's facts: τ²-Bench's DB and ACTION checks
    assert golden.reward == 1.0, golden.reward_breakdown
    assert sampled.reward == 0.0  # the untrained policy does not ask, then create (a group with signal)

    batch = common_pb2.TrajectoryGroup(group_id="dual-0", task_id=task.id, env="mock", trajectories=[golden, sampled])
    cfg = learner_config(tmp_path / "learner", None, model={"path": str(smollm2_dir), "arch": None, "attn_implementation": "sinkflex"},
                         grpo={"old_logprobs": "recompute"}, optim={"lr": 1e-5}, batch={"groups_per_step": 1})
    learner = Learner(cfg, metrics=False)
    w0 = learner.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    m = learner.train_step([batch])
    assert m["policy_version"] == 1 and math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert not learner.model.model.layers[0].self_attn.q_proj.weight.detach().equal(w0)
