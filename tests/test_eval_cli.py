"""`sinkflex-rl eval`: a published policy version scored alone, end to end (env, reward and
rollout services as local processes over real gRPC, vLLM CPU serving the real SmolLM2, τ²-Bench's
mock domain in solo mode), and its τ²-Bench results file read by τ²-Bench's own loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _eval(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    return subprocess.run([sys.executable, "-m", "sinkflex_rl.cli", "eval", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1100, check=False)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_eval_scores_a_run_policy_and_writes_tau2_results(trained_run):
    from tau2.data_model.simulation import Results
    from tau2.metrics.agent_metrics import compute_metrics

    done = _eval("--policy", str(trained_run), "--trials", "2")  # the run folder: its newest version, v2
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = trained_run / "eval" / "v2-test"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"] == str(trained_run / "learner" / "policy" / "v2")
    assert (summary["env"], summary["split"], summary["tasks"], summary["trials"]) == ("mock", "test", 4, 2)
    assert summary["ci_low"] <= summary["mean_at_1"] <= summary["ci_high"]
    assert 0.0 <= summary["pass_hat_2"] <= summary["pass_hat_1"] <= 1.0
    assert 0 < summary["episodes_seconds"] < summary["wall_seconds"]  # the services' start is the difference
    per_task = summary["per_task"]
    assert sorted(per_task) == sorted(json.loads((trained_run / "tasks" / "split_tasks.json").read_text())["test"])
    assert summary["mean_at_1"] == pytest.approx(sum(sum(r) / len(r) for r in per_task.values()) / len(per_task))
    assert len(summary["per_family"]) == 4 and all(f["tasks"] == 1 for f in summary["per_family"].values())
    # the run's own generated tasks were used, not a copy
    used = yaml.safe_load((out / "experiment.yaml").read_text())["task"]
    assert used["generate"] is None and used["task_files"] == [str(trained_run / "tasks")]
    # τ²-Bench's loader and metrics read the results file and agree with the summary
    results = Results.load(Path(summary["tau2_results"]))
    assert len(results.simulations) == 8 and results.info.agent_info.llm == summary["policy"]
    assert all(s.messages and s.messages[0].role in ("user", "assistant") for s in results.simulations)
    theirs = compute_metrics(results)
    assert theirs.avg_reward == pytest.approx(summary["mean_at_1"])
    assert theirs.pass_hat_ks == pytest.approx({1: summary["pass_hat_1"], 2: summary["pass_hat_2"]})
    assert "mean@1" in done.stdout and "pass^2" in done.stdout


def test_eval_refuses_what_it_cannot_score(trained_run, tmp_path):
    done = _eval("--policy", str(tmp_path))  # a folder that is no model
    assert done.returncode == 2 and "no config.json" in done.stderr.replace("\n", " ")
    done = _eval("--policy", "smollm2")  # no run folder to take the experiment from
    assert done.returncode == 2 and "--config is needed" in done.stderr
    done = _eval("--policy", str(trained_run / "learner" / "policy" / "v1"), "--set", "validation.trials=0")
    assert done.returncode == 2 and "validation.trials" in done.stderr


def test_evaluate_policy_in_process(tmp_path):
    """`evaluate_policy` (what the command runs once the services are up) against the real env and
    reward cores on generated mock tasks and the scripted policy of test_controller_inprocess (at
    version 0 the first sample of each task plays the golden actions, the second stops at once)."""
    from tau2.data_model.simulation import Results
    from tau2.metrics.agent_metrics import compute_metrics

    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from env_service.core import EnvCore
    from reward_service.client import LocalRewardClient
    from reward_service.scoring import TaskCatalog
    from sinkflex.config import validate_config
    from sinkflex_rl.clients import connect
    from sinkflex_rl.commands.eval import evaluate_policy
    from sinkflex_rl.config import TrainConfig
    from tau2_adapter.generate import generate_mock_tasks, write_task_dir
    from tau2_adapter.tasks import domain_tasks
    from tests.test_controller_inprocess import ScriptedRollout

    task_dir = str(write_task_dir(generate_mock_tasks(train=4, test=4, seed=0), tmp_path / "tasks"))
    core = EnvCore(EnvServiceConfig(domains=("mock",), reward_on_termination=False, task_files={"mock": [task_dir]}))
    catalog = TaskCatalog(task_files={"mock": [task_dir]})
    rollout = ScriptedRollout(LocalEnvClient(core=core), LocalRewardClient(catalog), domain_tasks("mock", [task_dir]).tasks)
    cfg = validate_config({
        "run": {"name": "e", "output_dir": str(tmp_path / "eval"), "step_timeout_s": 60},
        "task": {"env": "mock", "eval_split": "test", "solo_mode": True, "task_files": [task_dir]},
        "validation": {"num_tasks": 0, "trials": 2}, "models": {"user_simulator": None}}, TrainConfig)
    try:
        summary = evaluate_policy(cfg, connect(env=core, reward=catalog, rollout=rollout, learner_required=False),
                                  "scripted", "x.yaml")
    finally:
        core.shutdown()
    assert json.loads((tmp_path / "eval" / "summary.json").read_text()) == summary
    assert (summary["mean_at_1"], summary["pass_hat_1"], summary["pass_hat_2"]) == (0.5, 0.5, 0.0)
    assert (summary["ci_low"], summary["ci_high"], summary["tasks"], summary["trials"]) == (0.5, 0.5, 4, 2)
    assert all(v == [1.0, 0.0] for v in summary["per_task"].values()) and len(summary["per_family"]) == 4
    assert rollout.requests == [(0, False, tuple(summary["per_task"]))]  # one request, nothing published
    results = Results.load(Path(summary["tau2_results"]))
    theirs = compute_metrics(results)
    assert (theirs.avg_reward, theirs.pass_hat_ks) == (0.5, {1: 0.5, 2: 0.0})
    assert results.info.agent_info.llm == "scripted" and len(results.simulations) == 8
