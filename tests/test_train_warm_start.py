"""The learnable recipe end to end on tiny budgets: `sinkflex-rl train` generates a mock task
set, builds warm-start demonstrations from its train split's golden actions through the real
env and reward services (gRPC on loopback), the learner (torchrun, FSDP2 over gloo) trains on
them with masked cross-entropy and publishes policy version 1, the vLLM CPU engine loads it,
and one GRPO step follows; validation on the held-out test split before the warm start,
after it, and after the RL step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_generate_warm_start_and_one_rl_step(tmp_path, smollm2_dir):
    run_dir = tmp_path / "run"
    config = {
        "run": {"name": "warm", "output_dir": str(run_dir), "steps": 1, "seed": 0, "step_timeout_s": 900},
        "task": {"env": "mock", "solo_mode": True, "generate": {"train": 8, "test": 4, "seed": 0},
                 "tasks_per_step": 1},
        "rollout": {"group_size": 2, "temperature": 1.0, "max_new_tokens": 48, "max_turns": 3, "max_context_tokens": 2048},
        "validation": {"every_steps": 1, "num_tasks": 4, "trials": 1},
        "models": {"policy": str(smollm2_dir), "user_simulator": None},
        "warm_start": {"enabled": True, "tasks": 4, "epochs": 1, "lr": 1.0e-4, "batch_size": 4},
        "local": {"ready_timeout_s": 600},
        "rollout_service": {"engine": {"kv_cache_gib": 0.5, "max_model_len": 4096}},
        "learner_service": {"optim": {"lr": 1.0e-5}, "batch": {"micro_batch_size": 1}, "model": {"gradient_checkpointing": False}},
    }
    path = tmp_path / "warm.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    proc = subprocess.run([sys.executable, "-m", "sinkflex_rl.cli", "train", "-c", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    # the generated task set and the demonstrations, all scored 1.0 by the reward service
    assert json.loads((run_dir / "tasks" / "split_tasks.json").read_text()).keys() >= {"train", "test"}
    from learner_service.sft import read_demonstrations

    demos = read_demonstrations(run_dir / "warm_start" / "demonstrations.pb")
    assert len(demos) == 4 and all(g.trajectories[0].reward == 1.0 for g in demos)

    # the learner trained on them (masked CE records) and published v1; RL step 1 gave v2
    learner = [json.loads(line) for line in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    ws = [r for r in learner if r["kind"] == "warm_start"]
    assert len(ws) == 1 and ws[0]["tokens"] > 0 and math.isfinite(ws[0]["loss"]) and 0 <= ws[0]["token_accuracy"] <= 1
    assert (run_dir / "learner" / "policy" / "v2" / "config.json").is_file()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(v["after"], v["policy_version"]) for v in summary["validation"]] == [("base", 0), ("warm_start", 1), ("step 1", 2)]
    for v in summary["validation"]:
        assert v["tasks"] == 4 and v["ci_low"] <= v["mean_at_1"] <= v["ci_high"]
    diff = summary["last_vs_warm_start"]
    assert diff["tasks"] == 4 and diff["ci_low"] <= diff["difference"] <= diff["ci_high"]
    assert summary["policy_version"] == 2 and summary["wall_seconds"] > 0

    # on-policy: the RL step's rollouts were sampled by the warm-start policy, on every turn
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    traj = [r for r in records if r["kind"] == "trajectory"]
    assert len(traj) == 2 and all(r["policy_version"] == 1 for r in traj)
    (train,) = [r for r in records if r["kind"] == "train"]
    assert math.isfinite(train["loss"]) and train["groups_trained"] == 1
    val = json.loads((run_dir / "validation" / "warm_start.json").read_text())
    assert len(val["per_task"]) == 4
