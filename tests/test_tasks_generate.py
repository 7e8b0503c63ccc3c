"""Must show: every generated task family passes golden replay (1.0) and fails with one wrong
argument (0.0), through the real env service over gRPC, in solo mode; generation is
deterministic and train/test are disjoint in content (titles, title words, users).

The generator is `tau2_adapter.generate`; the CLI is `sinkflex-rl tasks generate / check`.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sinkflex.api.common.v1 import common_pb2

from tau2_adapter.generate import FAMILIES, _POOLS, family_of, generate_mock_tasks, summary, write_task_dir
from tau2_adapter.tasks import golden_actions, load_task_dir

SEED = 7


@pytest.fixture(scope="module")
def task_set():
    return generate_mock_tasks(train=16, test=8, seed=SEED)


@pytest.fixture(scope="module")
def task_dir(task_set, tmp_path_factory):
    return write_task_dir(task_set, tmp_path_factory.mktemp("generated"))


@pytest.fixture(scope="module")
def env_grpc_gen(task_dir):
    """A real gRPC env server serving tau2's mock domain plus the generated task dir."""
    from env_service.client import GrpcEnvClient
    from env_service.config import EnvServiceConfig
    from tau2_adapter.logs import quiet_tau2_logs
    from env_service.server import build_server

    quiet_tau2_logs("WARNING")
    config = EnvServiceConfig(domains=("mock",), task_files={"mock": [str(task_dir)]})
    server, _core = build_server(config, port=0)
    client = GrpcEnvClient(f"127.0.0.1:{server.port}", timeout=60, wait_ready=True)
    yield client
    client.shutdown()
    server.stop()


# --------------------------------------------------------------------------- generation


def test_generation_is_deterministic_for_a_seed(task_set, tmp_path):
    again = generate_mock_tasks(train=16, test=8, seed=SEED)
    dump = lambda ts: [t.model_dump(mode="json") for t in ts.tasks.values()]  # noqa: E731
    assert dump(again) == dump(task_set) and again.splits == task_set.splits
    assert dump(generate_mock_tasks(train=16, test=8, seed=SEED + 1)) != dump(task_set)
    a, b = write_task_dir(task_set, tmp_path / "a"), write_task_dir(again, tmp_path / "b")
    assert (a / "tasks.json").read_bytes() == (b / "tasks.json").read_bytes()


def test_splits_ids_and_families_spread_evenly(task_set):
    assert set(task_set.splits) == {"train", "test"}
    assert len(task_set.splits["train"]) == 16 and len(task_set.splits["test"]) == 8
    assert not set(task_set.splits["train"]) & set(task_set.splits["test"])
    assert summary(task_set) == {"train": {f: 4 for f in FAMILIES}, "test": {f: 2 for f in FAMILIES}}
    assert summary(generate_mock_tasks(train=6, test=0, seed=0))["train"] == {"create": 2, "status": 2, "create_update": 1, "forbidden": 1}
    for task_id in task_set.tasks:
        assert task_id.startswith(f"gen_{family_of(task_id)}_") and task_id[-4:].isdigit()
    assert "gen_create_update_0003" in task_set.tasks


def _content(task) -> tuple[set[str], set[str], set[str], set[str]]:
    """(title words, titles, user ids, user names) a task mentions: its initial DB (minus
    tau2's own user_1 / task_1), its ticket's title and its golden actions."""
    data = task.initial_state.initialization_data.agent_data
    titles = {t["title"] for t in data["tasks"].values()}
    titles |= {a["arguments"]["title"] for a in golden_actions(task) if "title" in a["arguments"]}
    users = set(data["users"]) | {a["arguments"]["user_id"] for a in golden_actions(task) if "user_id" in a["arguments"]}
    names = {u["name"] for u in data["users"].values()}
    words = {w for t in titles for w in t.split()}
    return words, titles, users, names


def test_train_and_test_are_disjoint_in_titles_and_users():
    big = generate_mock_tasks(train=200, test=60, seed=1)
    train = [_content(big.tasks[i]) for i in big.splits["train"]]
    test = [_content(big.tasks[i]) for i in big.splits["test"]]
    for k, what in enumerate(("title words", "titles", "user ids", "user names")):
        seen_train = set().union(*(c[k] for c in train))
        seen_test = set().union(*(c[k] for c in test))
        assert seen_test and seen_train and not seen_train & seen_test, what
    # test-only users exist only in test tasks' initial state, and never user_1 (tau2's own)
    test_users = {f"user_{n}" for n in _POOLS["test"]["users"]}
    for task_id in big.splits["train"]:
        assert test_users.isdisjoint(json.dumps(big.tasks[task_id].model_dump(mode="json")).replace('"', " ").split())
    assert "user_1" not in set().union(*(c[2] for c in train + test))


def test_tickets_state_what_the_agent_needs(task_set):
    for task in task_set.tasks.values():
        family, actions = family_of(task.id), golden_actions(task)
        ticket = task.ticket
        assert ticket and len(ticket) < 120, ticket
        assert [r.value for r in task.evaluation_criteria.reward_basis] == ["DB", "ACTION"]
        assert not task.evaluation_criteria.nl_assertions and not task.evaluation_criteria.communicate_info
        data = task.initial_state.initialization_data.agent_data
        if family in ("create", "create_update"):
            a = actions[0]
            assert a["name"] == "create_task" and f"'{a['arguments']['title']}'" in ticket and a["arguments"]["user_id"] in ticket
        if family == "status":
            (a,) = actions
            assert a["arguments"]["task_id"] in ticket and a["arguments"]["status"] in ticket
            assert data["tasks"][a["arguments"]["task_id"]]["status"] != a["arguments"]["status"]
        if family == "create_update":
            # create_task names the new task task_{len(tasks)+1}: the update must use that id
            assert actions[1]["arguments"] == {"task_id": f"task_{len(data['tasks']) + 2}", "status": "completed"}
            assert actions[1]["arguments"]["task_id"] not in data["tasks"]
        if family == "forbidden":
            (a,) = actions
            assert a["name"] == "transfer_to_human_agents" and a["arguments"] == {"summary": ticket}
            assert task.evaluation_criteria.actions[0].compare_args == ["summary"]
            assert "compare_args" in task.description.notes


def test_written_dir_is_taus_own_format(task_set, task_dir):
    raw = json.loads((task_dir / "tasks.json").read_text())
    assert isinstance(raw, list) and [t["id"] for t in raw] == list(task_set.tasks)
    assert json.loads((task_dir / "split_tasks.json").read_text()) == task_set.splits
    loaded = load_task_dir(task_dir)
    assert loaded.tasks == task_set.tasks and loaded.splits == task_set.splits


# --------------------------------------------------------------------------- golden replay


def _wrong_value(key: str, value):
    """A plausible wrong value: the call still succeeds (an existing user/task, a valid status)."""
    if key == "user_id":
        return "user_1"  # exists in tau2's mock DB
    if key == "task_id":
        return "task_1"
    if key == "status":
        return "pending" if value == "completed" else "completed"
    if key == "title":
        return value.split()[0] + " Notes"
    if key == "summary":
        return "The user wants to delete a task."
    raise AssertionError(f"no wrong value for {key}")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_golden_replay_is_1_and_each_wrong_argument_is_0(family, task_set, env_grpc_gen):
    from env_service.replay import replay_golden

    ids = [i for i in task_set.tasks if family_of(i) == family]
    assert len(ids) == 6  # 4 train + 2 test
    for task_id in ids:
        task = task_set.tasks[task_id]
        r = replay_golden(env_grpc_gen, "mock", task_id, solo_mode=True, task=task)
        assert (r.reward, r.server_reward, r.termination_reason) == (1.0, 1.0, "agent_stop"), (task_id, r.breakdown)
        assert r.breakdown == {"DB": 1.0, "ACTION": 1.0}
        answers = [m for m in r.messages if m.role == common_pb2.ROLE_TOOL]
        assert answers and not any(a.error for a in answers)
    task = task_set.tasks[ids[0]]
    for i, action in enumerate(golden_actions(task)):
        for key, value in action["arguments"].items():
            wrong = _wrong_value(key, value)

            def edit(j, name, args, i=i, key=key, wrong=wrong):
                return {**args, key: wrong} if j == i else args

            r = replay_golden(env_grpc_gen, "mock", task.id, solo_mode=True, task=task, edit=edit)
            assert r.termination_reason == "agent_stop"
            assert (r.reward, r.server_reward) == (0.0, 0.0), (task.id, i, key, r.breakdown)


def test_generated_tasks_do_not_run_without_their_initial_state(task_set, env_grpc_gen):
    """The varied users/tasks live only in the task's initial state: tau2's plain mock DB
    has user_1 only, so a generated create for user_N fails against it."""
    from tau2.registry import registry

    task = task_set.tasks["gen_create_0000"]
    env = registry.get_env_constructor("mock")(solo_mode=True)
    call = golden_actions(task)[0]
    assert call["arguments"]["user_id"] not in env.tools.db.users


# --------------------------------------------------------------------------- CLI


def test_cli_generate_then_check(tmp_path):
    from sinkflex_rl.cli import app

    out = tmp_path / "tasks"
    r = CliRunner().invoke(app, ["tasks", "generate", "mock", "--train", "8", "--test", "4", "--seed", "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "create_update" in r.output and "wrote 12 tasks" in r.output
    rows = {line.split("│")[1].strip(): line.split("│")[2:4] for line in r.output.splitlines() if line.count("│") == 4}
    assert [c.strip() for c in rows["forbidden"]] == ["2", "1"] and [c.strip() for c in rows["total"]] == ["8", "4"]
    assert load_task_dir(out).tasks == generate_mock_tasks(8, 4, 3).tasks
    r = CliRunner().invoke(app, ["tasks", "check", str(out), "--env", "mock"])
    assert r.exit_code == 0, r.output
    assert "all 12 tasks" in r.output and "reach reward 1.0" in r.output

    # break two tasks: a golden call that fails, an env assertion that does not hold
    raw = json.loads((out / "tasks.json").read_text())
    assert [raw[1]["id"], raw[2]["id"]] == ["gen_status_0000", "gen_create_update_0000"]
    raw[1]["evaluation_criteria"]["actions"][0]["arguments"]["task_id"] = "task_99"  # no such task
    raw[2]["evaluation_criteria"]["env_assertions"] = [
        {"env_type": "assistant", "func_name": "assert_task_status", "arguments": {"task_id": "task_1", "expected_status": "completed"}}]
    raw[2]["evaluation_criteria"]["reward_basis"] = ["DB", "ACTION", "ENV_ASSERTION"]
    (out / "tasks.json").write_text(json.dumps(raw))
    r = CliRunner().invoke(app, ["tasks", "check", str(out), "--env", "mock", "--solo"])
    assert r.exit_code == 1, r.output
    assert "2 of 12 tasks" in r.output and "gen_status_0000" in r.output and "gen_create_update_0000" in r.output
    assert "task_99 not found" in r.output and "ENV_ASSERTION" in r.output


def test_cli_check_over_grpc(task_dir, env_grpc_gen):
    from sinkflex_rl.cli import app

    r = CliRunner().invoke(app, ["tasks", "check", str(task_dir), "--env", "mock", "--address", env_grpc_gen.address])
    assert r.exit_code == 0, r.output
    assert "all 24 tasks" in r.output


def test_cli_generate_refuses_other_domains(tmp_path):
    from sinkflex_rl.cli import app

    r = CliRunner().invoke(app, ["tasks", "generate", "retail", "--train", "1", "--test", "1", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "only the mock domain" in r.output


def test_generate_and_check_refuse_bad_input_clearly(tmp_path):
    """Clear errors (exit 2, no traceback) for an --out that is a file, an existing task set
    without --force, nothing to generate, too many tasks, and an --address with no server."""
    from typer.testing import CliRunner

    from sinkflex_rl.cli import app

    runner = CliRunner()
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = runner.invoke(app, ["tasks", "generate", "mock", "--train", "2", "--test", "2", "--out", str(afile)])
    assert r.exit_code == 2 and "is not a directory" in r.output
    r = runner.invoke(app, ["tasks", "generate", "mock", "--train", "2", "--test", "2", "--out", str(afile / "sub")])
    assert r.exit_code == 2 and f"cannot write the task set to {afile / 'sub'}" in r.output, r.output
    r = runner.invoke(app, ["tasks", "generate", "mock", "--train", "0", "--test", "0", "--out", str(tmp_path / "z")])
    assert r.exit_code == 2 and "nothing to generate" in r.output
    r = runner.invoke(app, ["tasks", "generate", "mock", "--train", "200000", "--test", "1", "--out", str(tmp_path / "h")])
    assert r.exit_code == 2 and "100000" in r.output
    out = tmp_path / "ok"
    assert runner.invoke(app, ["tasks", "generate", "mock", "--train", "4", "--test", "2", "--out", str(out)]).exit_code == 0
    r = runner.invoke(app, ["tasks", "generate", "mock", "--train", "4", "--test", "2", "--out", str(out)])
    assert r.exit_code == 2 and "--force" in r.output
    assert runner.invoke(app, ["tasks", "generate", "mock", "--train", "4", "--test", "2", "--out", str(out), "--force"]).exit_code == 0
    from sinkflex_rl.launcher import free_port

    r = runner.invoke(app, ["tasks", "check", str(out), "--env", "mock", "--address", f"127.0.0.1:{free_port()}",
                            "--ready-timeout", "1"])
    assert r.exit_code == 2 and "no env server SERVING" in r.output
