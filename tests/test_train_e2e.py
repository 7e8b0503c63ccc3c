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
   validations are not run again), and while RL step 2's rollouts are in flight the reward
   service is killed (SIGKILL): the launcher restarts it, the run goes on by itself (the short
   version of benchmarks/faults.py's campaigns: one in-run recovery, no re-run) and finishes,
   validating the last step.

Across both launches and the fault: no group lost or trained twice (a group the fault delayed
past its step's retry arrives stale and is dropped and counted, not trained), and training exactly
on-policy (synchronous, `rollout.max_staleness` 0): every turn of RL step s's trajectories
sampled by policy version s (the warm start is version 1), staleness 0 at every learner step,
and each validation sampled by exactly the version it names.
"""

from __future__ import annotations

import json
import math
import os
import re
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


def _train(config: Path, log: Path) -> subprocess.Popen:
    """`sinkflex-rl train -c config`, its output appended to `log` (a file, not a pipe: the test polls
    the run while it goes, and a pipe nobody reads would stall it once full)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    with open(log, "ab") as out:
        # SIGINT as a terminal's Ctrl-C delivers it: a suite started in the background (`cmd &` in a
        # script) passes SIGINT down as ignored, and Python then never raises KeyboardInterrupt
        return subprocess.Popen([sys.executable, "-m", "sinkflex_rl.cli", "train", "-c", str(config)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """Waits for `proc` to exit; returns its output so far (the log's text)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return log.read_text(errors="replace")


def _records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def test_warm_start_rl_interrupt_resume_and_a_killed_reward_service(tmp_path, smollm2_dir):
    from benchmarks.faults import _n_recoveries, _pids, _recovery_of, wait_for_moment

    run_dir = tmp_path / "run"
    config = tmp_path / "e2e.yaml"
    config.write_text(yaml.safe_dump(_config(run_dir, smollm2_dir)))
    log = tmp_path / "train.log"

    # 1) first launch: generate, warm start, validate, wait for RL step 1 (version 2), then Ctrl-C
    proc = _train(config, log)
    deadline = time.monotonic() + 1500
    while not _records(run_dir, "train"):
        if proc.poll() is not None:
            pytest.fail(f"train exited early ({proc.returncode}):\n{log.read_text(errors='replace')[-5000:]}")
        assert time.monotonic() < deadline, "no training step within the time limit"
        time.sleep(1)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 4  # env, reward, rollout (+ engine), learner (torchrun + rank)
    proc.send_signal(signal.SIGINT)
    out = _wait(proc, log, 600)
    assert proc.returncode == 130, out[-5000:]
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

    # 2) the same command again: resumes from the learner's checkpoint; the reward service is
    # killed while RL step 2's rollouts are in flight, restarted by the launcher; the run finishes
    started = time.time()
    log.write_bytes(b"")
    proc = _train(config, log)
    learner_cfg = run_dir / "configs" / "learner_service.yaml"  # this launch's addresses, written before any starts
    while not (learner_cfg.exists() and learner_cfg.stat().st_mtime >= started and _pids(run_dir).get("reward")):
        assert proc.poll() is None, log.read_text(errors="replace")[-5000:]
        assert time.time() < started + 900, "the second launch wrote no addresses"
        time.sleep(0.5)
    n_before = _n_recoveries(run_dir)
    evidence = wait_for_moment("mid-rollout", run_dir, proc, timeout=900)
    assert evidence is not None, log.read_text(errors="replace")[-5000:]
    assert evidence.startswith("rollout service:") and "in flight" in evidence, evidence
    pid = _pids(run_dir)["reward"]
    os.kill(pid, signal.SIGKILL)
    deadline, recovery = time.monotonic() + 600, None
    while recovery is None and proc.poll() is None and time.monotonic() < deadline:
        recovery = _recovery_of(run_dir, pid, n_before, "reward")
        time.sleep(0.5)
    assert recovery is not None, f"no in-run recovery of the reward service:\n{log.read_text(errors='replace')[-5000:]}"
    assert any(f"reward service (pid {pid})" in note and "restarted" in note for note in recovery["restarted"]), recovery
    out = _wait(proc, log, 1800)
    assert proc.returncode == 0, out[-5000:]
    assert "resuming at policy version" in out
    assert "Traceback" not in out, out[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["policy_version"] == 4 and not summary["interrupted"]  # warm start v1 + 3 RL steps
    assert summary["sessions"] == 2
    buf = summary["buffer"]
    # every group written to Redis was acknowledged, once: nothing pending or undelivered
    assert buf["unconsumed"] == 0 and buf["pending"] == 0 and buf["undelivered"] == 0
    assert buf["dead_letters"] == 0 and buf["trained"] >= 3
    # none lost: each group the stream received was trained, or dropped as stale and counted (the
    # reward service's death can hold a Rollout request past its step's retry: its group then
    # arrives sampled by a version the learner has left, and max_staleness 0 drops it), never both
    state = json.loads(max((run_dir / "learner" / "checkpoints").glob("step_*/state.json")).read_text())
    dropped = set(re.findall(r"dropping group (\S+) \(entry", (run_dir / "logs" / "learner.log").read_text(errors="replace")))
    assert buf["added"] == buf["trained"] + len(dropped) and state["groups_dropped_stale"] == len(dropped), (buf, dropped)
    trained_ids = state["trained_group_ids"]
    assert len(trained_ids) == len(set(trained_ids)) == buf["trained"] and not dropped & set(trained_ids)

    # the learner trained on the demonstrations once (masked CE records), not again on resume
    learner = [json.loads(line) for line in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    ws = [r for r in learner if r["kind"] == "warm_start"]
    assert len(ws) == 1 and ws[0]["tokens"] > 0 and math.isfinite(ws[0]["loss"]) and 0 <= ws[0]["token_accuracy"] <= 1

    train = _records(run_dir, "train")
    assert sorted(r["step"] for r in train) == [1, 2, 3]  # one record per policy version, none twice
    for r in train:
        assert math.isfinite(r["loss"]) and r["staleness_max"] == 0.0
    # nothing trained twice: the learner's groups over its steps (a step re-done after a crash
    # counted once) are the groups the buffer holds as trained
    steps = {int(r["step"]): r for r in learner if r["kind"] == "train"}
    assert sorted(steps) == [1, 2, 3]
    assert sum(r["groups"] - r.get("duplicate_groups", 0) for r in steps.values()) == buf["trained"]
    # exactly on-policy: every turn of RL step s's trajectories sampled by version s (the warm
    # start is version 1), the learner's staleness exactly 0
    for r in steps.values():
        assert r["policy_version"] == r["step"] + 1 and r["staleness_mean"] == r["staleness_max"] == 0.0, r
        assert r["max_staleness"] == 0, r
    trajectories = _records(run_dir, "trajectory")
    assert sorted({t["step"] for t in trajectories}) == [1, 2, 3]
    for t in trajectories:  # (a group the interrupted launch published for step 2 is recorded too)
        assert t["policy_version"] == t["policy_version_last"] == t["step"] and 0.0 <= t["reward"] <= 1.0, t
    assert all(sum(t["step"] == s for t in trajectories) >= 2 for s in (1, 2, 3))

    # validations: base and warm start in the first session, the last step after the resume;
    # each written once, with the paired differences against both references
    assert [(v["after"], v["policy_version"]) for v in summary["validation"]] == [
        ("base", 0), ("warm_start", 1), ("step 3", 4)]
    for v in summary["validation"]:
        assert v["tasks"] == 2 and v["trials"] == 2 and v["ci_low"] <= v["mean_at_1"] <= v["ci_high"]
    for key in ("last_vs_warm_start", "last_vs_base", "warm_start_vs_base"):
        diff = summary[key]
        assert diff["tasks"] == 2 and diff["ci_low"] <= diff["difference"] <= diff["ci_high"]
    from sinkflex_rl.controller import read_validations

    assert [v["sampled_policy_versions"] for v in read_validations(run_dir)] == [[0], [1], [4]]  # exactly the version named
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
