"""Task files in τ²-Bench's own format (`tau2_adapter.tasks`), served by the env service and
scored by the reward service: the files' splits over real gRPC ListTasks, Reset and golden
replay of their ids, the reward service scoring a generated task's golden trajectory 1.0,
and clear errors (file and id named) for bad files, at load and at service start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.reward.v1 import reward_pb2
from tau2_adapter.generate import generate_mock_tasks, write_task_dir
from tau2_adapter.tasks import domain_tasks, golden_actions, load_task_dir, shipped_tasks

ROOT = Path(__file__).resolve().parents[1]
MOCK_DATA = Path(__import__("tau2").__file__).parent / "data" / "tau2" / "domains" / "mock"


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory):
    return write_task_dir(generate_mock_tasks(train=8, test=4, seed=11), tmp_path_factory.mktemp("gen"))


def _copy_shipped(dst: Path, rename: str = "x_") -> Path:
    """tau2's mock tasks.json/split_tasks.json with ids prefixed (so they do not clash with the shipped ones)."""
    dst.mkdir(parents=True, exist_ok=True)
    tasks = json.loads((MOCK_DATA / "tasks.json").read_text())
    for t in tasks:
        t["id"] = rename + t["id"]
    splits = {rename + k: [rename + i for i in v] for k, v in json.loads((MOCK_DATA / "split_tasks.json").read_text()).items()}
    (dst / "tasks.json").write_text(json.dumps(tasks))
    (dst / "split_tasks.json").write_text(json.dumps(splits))
    return dst


# --------------------------------------------------------------------------- tau2_adapter.tasks


def test_load_task_dir_reads_taus_own_files():
    ts = load_task_dir(MOCK_DATA)  # tau2's own mock data dir is a task dir
    assert list(ts.tasks)[:2] == ["create_task_1", "create_task_1_with_env_assertions"]
    assert ts.splits == {"base": list(ts.tasks)}
    from tau2.data_model.tasks import Task

    assert all(isinstance(t, Task) for t in ts.tasks.values())
    single = load_task_dir(MOCK_DATA / "tasks.json")  # a tasks file: splits from split_tasks.json beside it
    assert single.tasks == ts.tasks and single.splits == ts.splits


def test_a_tasks_file_without_split_file_has_no_named_split(tmp_path):
    f = tmp_path / "more.json"
    f.write_text((MOCK_DATA / "tasks.json").read_text().replace('"id": "', '"id": "more_'))
    ts = load_task_dir(f)
    assert len(ts) == 9 and ts.splits == {}
    (tmp_path / "split_more.json").write_text(json.dumps({"few": ["more_update_task_1"]}))
    assert load_task_dir(f).split("few")[0].id == "more_update_task_1"


def test_domain_tasks_merges_shipped_and_files_and_caches(gen_dir, tmp_path):
    shipped = shipped_tasks("mock")
    merged = domain_tasks("mock", [gen_dir])
    assert list(merged.tasks)[: len(shipped)] == list(shipped.tasks)  # shipped first, in tau2's order
    assert len(merged) == len(shipped) + 12
    assert merged.splits["base"] == shipped.splits["base"]
    assert len(merged.splits["train"]) == 8 and len(merged.splits["test"]) == 4
    assert domain_tasks("mock", [str(gen_dir)]) is merged  # cached per (domain, resolved files)
    assert domain_tasks("mock") is shipped
    other = _copy_shipped(tmp_path / "other")
    both = domain_tasks("mock", [gen_dir, other])
    assert len(both) == len(merged) + 9 and set(both.splits) == {"base", "train", "test", "x_base"}


def test_golden_actions():
    task = shipped_tasks("mock").tasks["create_task_1"]
    acts = golden_actions(task)
    assert acts == [{"name": "create_task", "arguments": {"user_id": "user_1", "title": "Important Meeting"}, "requestor": "assistant"}]
    acts[0]["arguments"]["title"] = "changed"
    assert task.evaluation_criteria.actions[0].arguments["title"] == "Important Meeting"  # a copy
    assert golden_actions(shipped_tasks("mock").tasks["create_task_1_nl_eval"]) == []


@pytest.mark.parametrize(
    "breakage, words",
    [
        ("dup_shipped", ["tasks.json", "'create_task_1'", "already defined by tau2's shipped mock tasks"]),
        ("dup_in_file", ["tasks.json", "duplicate task id 'x_update_task_1'"]),
        ("unknown_id_in_split", ["split_tasks.json", "split 'x_base'", "unknown task id 'x_nope'"]),
        ("split_exists", ["split 'base' already exists", "different task ids"]),
        ("not_a_task", ["tasks.json", "task 'x_update_task_1'", "not a valid tau2 Task", "evaluation_criteria"]),
        ("bad_json", ["tasks.json", "not valid JSON"]),
        ("no_tasks_file", ["no tasks.json"]),
    ],
)
def test_bad_task_files_give_clear_errors(breakage, words, tmp_path):
    d = _copy_shipped(tmp_path / breakage)
    tasks = json.loads((d / "tasks.json").read_text())
    splits = json.loads((d / "split_tasks.json").read_text())
    if breakage == "dup_shipped":
        tasks[0]["id"] = "create_task_1"
        splits = {}
    elif breakage == "dup_in_file":
        tasks.append(dict(tasks[3]))
    elif breakage == "unknown_id_in_split":
        splits["x_base"].append("x_nope")
    elif breakage == "split_exists":
        splits = {"base": ["x_update_task_1"]}
    elif breakage == "not_a_task":
        tasks[3]["evaluation_criteria"] = {"actions": "not a list"}
    (d / "tasks.json").write_text(json.dumps(tasks))
    (d / "split_tasks.json").write_text(json.dumps(splits))
    if breakage == "bad_json":
        (d / "tasks.json").write_text("[{")
    if breakage == "no_tasks_file":
        (d / "tasks.json").unlink()
    with pytest.raises(ValueError) as err:
        domain_tasks("mock", [d])
    msg = str(err.value)
    assert str(d) in msg, msg
    for w in words:
        assert w in msg, msg


def test_same_split_with_same_ids_is_allowed_and_unknown_domain_is_refused(tmp_path):
    a, b = _copy_shipped(tmp_path / "a", "a_"), _copy_shipped(tmp_path / "b", "b_")
    for d in (a, b):
        (d / "split_tasks.json").write_text(json.dumps({"none_yet": []}))
    assert domain_tasks("mock", [a, b]).splits["none_yet"] == []
    with pytest.raises(ValueError, match="unknown tau2 domain 'nope'"):
        domain_tasks("nope")


def test_adapter_imports_no_service_and_not_the_driver():
    from tests.test_layering import SERVICES, imported_top_levels

    bad = {m: sorted(t & {*SERVICES, "driver"}) for m, t in imported_top_levels("tau2_adapter").items()}
    assert not {m: t for m, t in bad.items() if t}, bad


# --------------------------------------------------------------------------- env service


@pytest.fixture(scope="module")
def env_server_gen(gen_dir):
    from env_service.client import GrpcEnvClient
    from env_service.config import EnvServiceConfig
    from tau2_adapter.logs import quiet_tau2_logs
    from env_service.server import build_server

    quiet_tau2_logs("WARNING")
    server, core = build_server(EnvServiceConfig(domains=("mock",), task_files={"mock": [str(gen_dir)]}), port=0)
    client = GrpcEnvClient(f"127.0.0.1:{server.port}", timeout=60, wait_ready=True)
    yield client, core
    client.shutdown()
    server.stop()


def test_env_service_lists_the_files_splits_over_grpc(gen_dir, env_server_gen):
    client, _ = env_server_gen
    files = load_task_dir(gen_dir)
    (info,) = client.list_environments()
    assert info.name == "mock" and set(info.splits) == {"base", "train", "test"}
    assert info.num_tasks == len(shipped_tasks("mock")) + 12
    assert client.list_tasks("mock", "train") == files.splits["train"]
    assert client.list_tasks("mock", "test") == files.splits["test"]
    assert client.list_tasks("mock", "base") == shipped_tasks("mock").splits["base"]  # tau2's own, unchanged
    from sinkflex.api.env.v1 import env_pb2

    resp = client.stub.ListTasks(env_pb2.ListTasksRequest(env="mock", split="test"))
    assert resp.tasks[0].description == files.tasks[files.splits["test"][0]].description.purpose


def test_env_service_resets_and_replays_file_tasks(gen_dir, env_server_gen):
    from env_service.replay import golden_task, replay_golden
    from sinkflex.api.env.v1 import env_pb2

    client, _ = env_server_gen
    task_id = load_task_dir(gen_dir).splits["test"][0]
    r = client.reset(env_pb2.ResetRequest(env="mock", task_id=task_id, solo_mode=True))
    assert r.task_id == task_id and r.info["ticket"] in r.system_prompt
    client.close(r.session_id)
    r = client.reset(env_pb2.ResetRequest(env="mock", split="train", seed=3, solo_mode=True))
    assert r.task_id in load_task_dir(gen_dir).splits["train"]
    client.close(r.session_id)
    # replay finds a generated task through task_files; shipped tasks as before
    assert golden_task("mock", task_id, [gen_dir]).id == task_id
    with pytest.raises(KeyError, match=task_id):
        golden_task("mock", task_id)
    assert replay_golden(client, "mock", task_id, solo_mode=True, task_files=[gen_dir]).reward == 1.0
    assert replay_golden(client, "mock", "create_task_1", solo_mode=True).reward == 1.0


def test_env_config_and_command_line(gen_dir, tmp_path, capsys):
    from env_service.__main__ import config_from_args, main, parse_args
    from env_service.config import EnvServiceConfig
    from pydantic import ValidationError

    cfg = config_from_args(parse_args(["--domains", "mock", "--task-files", f"mock={gen_dir}"]))
    assert cfg.task_files == {"mock": [str(gen_dir)]}
    with pytest.raises(ValidationError, match="task_files names domain 'retail', which is not served"):
        EnvServiceConfig(domains=("mock",), task_files={"retail": ["x"]})
    bad = tmp_path / "bad"
    shutil.copytree(gen_dir, bad)
    (bad / "split_tasks.json").write_text(json.dumps({"train": ["gen_nope_0001"]}))
    with pytest.raises(SystemExit) as err:  # fails before binding a port, naming the file and id
        main(["--domains", "mock", "--task-files", f"mock={bad}", "--port", "0", "--metrics-port", "-1"])
    said = capsys.readouterr().err  # exit 2 (bad input), one line on stderr
    assert err.value.code == 2 and "cannot start" in said and str(bad / "split_tasks.json") in said and "gen_nope_0001" in said


# --------------------------------------------------------------------------- reward service


@pytest.fixture(scope="module")
def reward_server_gen(gen_dir):
    from reward_service.client import GrpcRewardClient
    from reward_service.config import RewardServiceConfig
    from reward_service.server import build_server

    config = RewardServiceConfig(port=0, metrics_port=None, preload_envs=[], task_files={"mock": [str(gen_dir)]})
    server, servicer = build_server(config)
    port = server.start()
    servicer.load(["mock"])
    server.set_serving()
    client = GrpcRewardClient(f"127.0.0.1:{port}", timeout=60)
    yield client
    client.close()
    server.stop()


def test_reward_service_scores_a_generated_golden_trajectory_1(gen_dir, env_server_gen, reward_server_gen):
    """The env service's trajectory of a generated task's golden actions, scored by the
    reward service over gRPC: 1.0; with one wrong argument: 0.0."""
    from env_service.replay import replay_golden

    env, _ = env_server_gen
    for task_id in load_task_dir(gen_dir).splits["test"]:
        gold = replay_golden(env, "mock", task_id, solo_mode=True, task_files=[gen_dir])
        req = reward_pb2.ScoreRequest(env="mock", task_id=task_id, solo_mode=True, messages=gold.messages,
                                      termination_reason=common_pb2.TERMINATION_REASON_AGENT_STOP)
        b = reward_server_gen.score(req)
        assert b.reward == 1.0, (task_id, b)
        assert {common_pb2.RewardType.Name(c.type): c.reward for c in b.components} == {"REWARD_TYPE_DB": 1.0, "REWARD_TYPE_ACTION": 1.0}
    wrong = replay_golden(env, "mock", task_id, solo_mode=True, task_files=[gen_dir],
                          edit=lambda i, name, args: {**args, next(iter(args)): "user_1" if "user_id" in args else "task_1"})
    del req.messages[:]
    req.messages.extend(wrong.messages)
    assert reward_server_gen.score(req).reward == 0.0


def test_reward_catalog_and_command_line_refuse_bad_files(gen_dir, tmp_path):
    from reward_service.__main__ import app
    from reward_service.scoring import TaskCatalog

    assert "gen_create_0000" in TaskCatalog(task_files={"mock": [str(gen_dir)]}).tasks("mock")
    assert "gen_create_0000" not in TaskCatalog().tasks("mock")
    bad = tmp_path / "bad"
    shutil.copytree(gen_dir, bad)
    raw = json.loads((bad / "tasks.json").read_text())
    raw[0]["id"] = "update_task_1"  # clashes with tau2's own mock task
    (bad / "tasks.json").write_text(json.dumps(raw))
    splits = json.loads((bad / "split_tasks.json").read_text())
    splits["train"] = [i for i in splits["train"] if i != "gen_create_0000"]
    (bad / "split_tasks.json").write_text(json.dumps(splits))
    with pytest.raises(ValueError, match="'update_task_1' is already defined by tau2's shipped mock tasks"):
        TaskCatalog(task_files={"mock": [str(bad)]})
    r = CliRunner().invoke(app, ["--task-files", f"mock={bad}", "--port", "0", "--no-metrics"])
    assert r.exit_code == 2
    assert "cannot start" in r.output and str(bad / "tasks.json") in r.output and "update_task_1" in r.output
    r = CliRunner().invoke(app, ["--task-files", "mock", "--port", "0", "--no-metrics"])
    assert r.exit_code == 2 and "expected ENV=PATH" in r.output


# --------------------------------------------------------------------------- one adapter


def test_one_adapter_reward_service_does_not_import_env_service():
    """The conversion and the termination maps live once, in tau2_adapter (issue 14)."""
    from tests.test_layering import imported_top_levels

    bad = {m: "env_service" for m, t in imported_top_levels("reward_service").items() if "env_service" in t}
    assert not bad, bad
    import env_service.convert
    import tau2_adapter.convert
    from env_service.session import TERMINATION_TO_PB
    from reward_service.scoring import TAU2_TERMINATION
    from tau2.data_model.simulation import TerminationReason
    from tau2_adapter.termination import PB_TO_TAU2, TAU2_TO_PB

    assert env_service.convert.to_tau2_messages is tau2_adapter.convert.to_tau2_messages  # a re-export, not a copy
    assert TERMINATION_TO_PB is TAU2_TO_PB and TAU2_TERMINATION is PB_TO_TAU2
    assert {TAU2_TO_PB[r] for r in TerminationReason} <= set(common_pb2.TerminationReason.values())
    for reason, pb in TAU2_TO_PB.items():
        if pb != common_pb2.TERMINATION_REASON_UNSPECIFIED:
            assert TerminationReason(PB_TO_TAU2[pb]) == reason
