"""The main job end to end: `sinkflex-rl train` through all four services over real gRPC,
a real (embedded) Redis, vLLM CPU and the real SmolLM2, on real tau2-Bench tasks (the mock
domain in solo mode keeps CI within budget: no user-simulator engine).

One scenario, two launches of the learnable recipe on tiny budgets:
1. the run generates a mock task set, builds warm-start demonstrations from its train split's
   golden actions through the real env and reward services, the learner (torchrun, FSDP2 over
   gloo) trains on them with masked cross-entropy and publishes policy version 1, the vLLM
   engine loads it, validation runs on the held-out split before and after the warm start,
   and GRPO steps follow; Ctrl-C (SIGINT) after the first RL step lands: every launched
   service must be gone and nothing acknowledged lost;
2. the same command again: it resumes from the learner's checkpoint (the warm start and its
   validations are not run again) and finishes, validating the last step.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]


def _config(run_dir: Path, policy: Path) -> dict:
    return {
        "run": {"name": "e2e", "output_dir": str(run_dir), "steps": 3, "seed": 0, "step_timeout_s": 900},
        "task": {"env": "mock", "solo_mode": True, "generate": {"train": 8, "test": 4, "seed": 0},
                 "tasks_per_step": 1},
        "rollout": {"group_size": 2, "temperature": 1.0, "max_new_tokens": 48, "max_turns": 3, "max_context_tokens": 2048},
        "validation": {"every_steps": 3, "num_tasks": 2, "trials": 2},
        "models": {"policy": str(policy), "user_simulator": None},
        "warm_start": {"enabled": True, "tasks": 4, "epochs": 1, "lr": 1.0e-4, "batch_size": 4},
        "local": {"ready_timeout_s": 600, "learner_stop_grace_s": 300},
        "rollout_service": {"engine": {"kv_cache_gib": 0.5, "max_model_len": 4096}},
        "learner_service": {"optim": {"lr": 1.0e-5}, "batch": {"micro_batch_size": 1}, "model": {"gradient_checkpointing": False}},
    }


def _train(config: Path, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    # SIGINT as a terminal's Ctrl-C delivers it: a suite started in the background (`cmd &` in a
    # script) passes SIGINT down as ignored, and Python then never raises KeyboardInterrupt
    return subprocess.Popen([sys.executable, "-m", "sinkflex_rl.cli", "train", "-c", str(config)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


def _records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def test_warm_start_rl_interrupt_and_resume(tmp_path, smollm2_dir):
    run_dir = tmp_path / "run"
    config = tmp_path / "e2e.yaml"
    config.write_text(yaml.safe_dump(_config(run_dir, smollm2_dir)))

    # 1) first launch: generate, warm start, validate, wait for RL step 1 (version 2), then Ctrl-C
    proc = _train(config)
    deadline = time.monotonic() + 1500
    while not _records(run_dir, "train"):
        assert proc.poll() is None, f"train exited early ({proc.returncode}):\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "no training step within the time limit"
        time.sleep(1)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 4  # env, reward, rollout (+ engine), learner (torchrun + rank)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, out
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"services still running after Ctrl-C: {[p.pid for p in alive]}"
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["interrupted"] is True and first["policy_version"] >= 2
    # nothing acknowledged is lost: every acknowledged group is recorded as trained
    assert first["buffer"]["trained"] >= 1

    # the generated task set and the demonstrations, all scored 1.0 by the reward service
    assert json.loads((run_dir / "tasks" / "split_tasks.json").read_text()).keys() >= {"train", "test"}
    from learner_service.sft import read_demonstrations

    demos = read_demonstrations(run_dir / "warm_start" / "demonstrations.pb")
    assert len(demos) == 4 and all(g.trajectories[0].reward == 1.0 for g in demos)

    # 2) the same command again: resumes from the learner's checkpoint and finishes
    proc = _train(config)
    out, _ = proc.communicate(timeout=1800)
    assert proc.returncode == 0, out
    assert "resuming at policy version" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["policy_version"] == 4 and not summary["interrupted"]  # warm start v1 + 3 RL steps
    assert summary["sessions"] == 2
    buf = summary["buffer"]
    # every group written to Redis was acknowledged, once: nothing pending or undelivered,
    # and the trained set holds exactly the groups the stream received
    assert buf["unconsumed"] == 0 and buf["pending"] == 0 and buf["undelivered"] == 0
    assert buf["trained"] == buf["stream_length"] >= 3
    assert buf["dead_letters"] == 0

    # the learner trained on the demonstrations once (masked CE records), not again on resume
    learner = [json.loads(line) for line in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    ws = [r for r in learner if r["kind"] == "warm_start"]
    assert len(ws) == 1 and ws[0]["tokens"] > 0 and math.isfinite(ws[0]["loss"]) and 0 <= ws[0]["token_accuracy"] <= 1

    train = _records(run_dir, "train")
    assert sorted(r["step"] for r in train) == [1, 2, 3]  # one record per policy version, none twice
    for r in train:
        assert math.isfinite(r["loss"])
    trajectories = _records(run_dir, "trajectory")
    assert len(trajectories) >= 3 * 2 and all(0.0 <= t["reward"] <= 1.0 for t in trajectories)
    # on-policy: RL step 1's rollouts were sampled by the warm-start policy, on every turn
    step1 = [t for t in trajectories if t["step"] == 1]
    assert len(step1) == 2 and all(t["policy_version"] == 1 for t in step1)

    # validations: base and warm start in the first session, the last step after the resume;
    # each written once, with the paired differences against both references
    assert [(v["after"], v["policy_version"]) for v in summary["validation"]] == [
        ("base", 0), ("warm_start", 1), ("step 3", 4)]
    for v in summary["validation"]:
        assert v["tasks"] == 2 and v["trials"] == 2 and v["ci_low"] <= v["mean_at_1"] <= v["ci_high"]
    for key in ("last_vs_warm_start", "last_vs_base", "warm_start_vs_base"):
        diff = summary[key]
        assert diff["tasks"] == 2 and diff["ci_low"] <= diff["difference"] <= diff["ci_high"]
    val = _records(run_dir, "val")
    assert sorted(v["step"] for v in val) == [0, 1, 4]  # the policy version validated
    assert all(0.0 <= v["mean_at_1"] <= 1.0 and "pass_hat_2" in v for v in val)
    assert len(json.loads((run_dir / "validation" / "warm_start.json").read_text())["per_task"]) == 2
    for png in ("training_score.png", "trajectory_reward.png", "validation.png"):
        assert (run_dir / "plots" / png).stat().st_size > 5000

    # the last policy version loads with from_pretrained (and vLLM served it: UpdateWeights)
    import torch
    from transformers import AutoModelForCausalLM

    latest = max((run_dir / "learner" / "policy").iterdir(), key=lambda p: int(p.name.lstrip("v")))
    assert latest.name == "v4"
    model = AutoModelForCausalLM.from_pretrained(latest)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
