"""Fault injection for the whole job: kill or freeze each process of `sinkflex-rl train`.

For each (process, action) this runs a tiny train on the embedded default (mock domain, solo
mode, SmolLM2, `tiny_config`) in its own run folder, waits for the first training step
(the run's metrics.jsonl), injects the fault into the process named in the run's pids.json
(written by the launcher: env, reward, rollout, its vLLM engine process, learner = torchrun,
learner_rank, redis = the embedded Redis; user_sim = the user simulator's vLLM server, for which
the tiny train runs in dual-control mode with the policy model as the user simulator),
then:

- SIGKILL, SIGTERM (a graceful stop: the rollout service ends its in-flight episodes at their
  next turn boundary and returns them as failed, with the reason): waits for the run to end;
  SIGSTOP: freezes the process past the launcher's
  freeze timeout (30 s, the controller's poll deadline) or until the run ends, then SIGCONT;
- a run that ended with an error must have printed one line naming the process and its pid
  (exit code 3); it is then re-run with the same command, which must resume and finish;
- the invariants, from the finished run folder (`check_invariants`): groups lost (published
  but neither trained nor counted as dropped: still unconsumed in the buffer, acknowledged
  untrained beyond what the learner counted as dropped, or published by the controller and
  missing from the stream) and groups trained twice (the learner's trained groups per step,
  each step counted once, beyond the distinct trained group ids) must both be 0; the policy
  version, its published folder and the last checkpoint must all be `steps`.

Bounded: every wait has a deadline; every process a run started is killed at the end (by the
pids it wrote). Usage:

    .venv/bin/python benchmarks/faults.py                       # every fault, writes docs/
    .venv/bin/python benchmarks/faults.py --faults reward:SIGKILL,env:SIGSTOP --no-docs

Writes the "Faults" section of docs/reliability.md and `faults` in docs/reliability.json
(other keys and sections are kept). `tests/test_faults.py` runs one fault with this code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: every fault, in order (user_sim: the tiny train in dual-control mode, the policy model as its user simulator)
ALL_FAULTS = [("env", "SIGKILL"), ("reward", "SIGKILL"), ("rollout", "SIGKILL"), ("engine", "SIGKILL"),
              ("learner_rank", "SIGKILL"), ("learner", "SIGKILL"), ("user_sim", "SIGKILL"), ("redis", "SIGKILL"),
              ("env", "SIGSTOP"), ("rollout", "SIGTERM")]
#: what the one-line message calls each process (sinkflex_rl.launcher.LABELS)
LABEL_WORDS = {"env": "env service", "reward": "reward service", "rollout": "rollout service",
               "engine": "vLLM engine", "learner": "learner", "learner_rank": "learner", "redis": "Redis",
               "user_sim": "user simulator"}


def tiny_config(run_dir: Path, policy: str, steps: int = 3, user_sim: bool = False) -> dict:
    """The smallest train that exercises every service (tests/test_train_e2e.py's settings, no validation).

    user_sim: τ²-Bench's dual-control mode with the policy model as the user simulator (its own
    local vLLM server, `user_sim` in pids.json) instead of solo mode.
    """
    cfg = {
        "run": {"name": "faults", "output_dir": str(run_dir), "steps": steps, "seed": 0, "step_timeout_s": 600},
        "task": {"env": "mock", "train_split": "base", "eval_split": "base", "tasks_per_step": 1,
                 "task_ids": ["create_task_1", "update_task_1"], "solo_mode": True},
        "rollout": {"group_size": 2, "temperature": 1.0, "max_new_tokens": 24, "max_turns": 2, "max_context_tokens": 4096},
        "validation": {"every_steps": 0},
        "models": {"policy": policy, "user_simulator": None},
        "local": {"ready_timeout_s": 600, "learner_stop_grace_s": 120},
        "env_service": {"domains": ["mock"]},
        "rollout_service": {"engine": {"kv_cache_gib": 0.5, "max_model_len": 4096}},
        "learner": {"optim": {"lr": 1.0e-4}, "batch": {"micro_batch_size": 1}, "model": {"gradient_checkpointing": False}},
    }
    if user_sim:
        cfg["task"]["solo_mode"] = False
        cfg["models"]["user_simulator"] = policy
        cfg["local"]["user_sim_kv_cache_gib"] = 0.5
        cfg["env_service"]["user_max_tokens"] = 32  # unbounded, SmolLM2 at temperature 0 can talk for minutes
    return cfg


def _records(path: Path, kind: str) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if r.get("kind") == kind:
            out.append(r)
    return out


def _train(config: Path, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    out = open(log_path, "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "sinkflex_rl.cli", "train", "-c", str(config)], cwd=ROOT, env=env,
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return None


def _stop(proc: subprocess.Popen, grace: float = 180.0) -> None:
    """SIGTERM the train (it stops its services), SIGKILL its group after `grace`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    if _wait(proc, grace) is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _pids(run_dir: Path) -> dict[str, int]:
    path = run_dir / "pids.json"
    return json.loads(path.read_text()) if path.exists() else {}


def kill_leftovers(run_dir: Path, seen: dict[str, int], since: float = 0.0) -> list[int]:
    """SIGKILLs (SIGCONT first) every process a run of `run_dir` recorded (pids.json, and `seen`) that still
    runs and was started after `since` (time.time()); returns their pids."""
    import psutil

    left = []
    for name, pid in {**seen, **_pids(run_dir)}.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() < since - 1:
                continue  # a reused pid: not ours
            if name in ("env", "reward", "rollout", "learner", "driver") and str(run_dir) not in " ".join(p.cmdline()):
                continue
            p.send_signal(signal.SIGCONT)
            p.kill()
            left.append(pid)
        except psutil.Error:
            continue
    return left


def last_line(log_text: str) -> str:
    lines = [x.strip() for x in log_text.splitlines() if x.strip()]
    hits = [x for x in lines if "re-run the same command to resume" in x]
    line = hits[-1] if hits else (lines[-1] if lines else "")
    return line.split("\x1b[A")[-1].strip()  # after a progress bar's cursor moves


def check_invariants(run_dir: Path, steps: int, group_size: int) -> dict:
    """Groups lost / trained twice and the version, folder and checkpoint consistency of a finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    buf = summary["buffer"]
    learner = {}
    for r in _records(run_dir / "learner" / "metrics.jsonl", "train"):
        learner[int(r["step"])] = r  # a step re-done after a crash before its checkpoint: its last record
    trained_by_steps = int(sum(r.get("groups", 0) - r.get("duplicate_groups", 0) for r in learner.values()))
    dropped_counted = int(max((r.get("dropped_stale_groups_total", 0) for r in learner.values()), default=0))
    published = len(_records(run_dir / "metrics.jsonl", "trajectory")) // group_size
    acked_untrained = buf["stream_length"] - buf["trained"] - buf["unconsumed"] - buf["dead_letters"]
    lost = buf["unconsumed"] + max(0, acked_untrained - dropped_counted) + max(0, published - buf["stream_length"])
    twice = max(0, trained_by_steps - buf["trained"])
    ckpts = sorted(int(p.name.split("_")[1]) for p in (run_dir / "learner" / "checkpoints").glob("step_*"))
    train_steps = sorted(int(r["step"]) for r in _records(run_dir / "metrics.jsonl", "train"))
    consistent = (summary["policy_version"] == steps and (run_dir / "learner" / "policy" / f"v{steps}").is_dir()
                  and bool(ckpts) and ckpts[-1] == steps and train_steps == list(range(1, steps + 1)))
    return {"groups_lost": lost, "groups_trained_twice": twice, "consistent": consistent,
            "policy_version": summary["policy_version"], "last_checkpoint": ckpts[-1] if ckpts else None,
            "train_records": train_steps, "buffer": buf, "published_by_controller": published,
            "trained_by_learner_steps": trained_by_steps, "dropped_counted": dropped_counted}


def run_fault(process: str, action: str, root: Path, policy: str, steps: int = 3, freeze_s: float = 45.0,
              step_timeout: float = 1200.0, run_timeout: float = 1500.0, keep: bool = False,
              progress=print) -> dict:
    """One fault: train, inject after step 1, re-run if it stopped, check the invariants. Returns its row."""
    import yaml

    name = f"{process}-{action.lower()}"
    run_dir = root / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg = tiny_config(run_dir, policy, steps, user_sim=process == "user_sim")
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    log_path = root / f"{name}.log"
    log_path.write_bytes(b"")
    row = {"process": process, "action": action}
    seen: dict[str, int] = {}
    t0, since = time.monotonic(), time.time()
    proc = _train(config, log_path)
    try:
        deadline = time.monotonic() + step_timeout
        while not _records(run_dir / "metrics.jsonl", "train"):
            if proc.poll() is not None:
                return {**row, "outcome": f"FAILED: train exited ({proc.returncode}) before step 1: "
                                          f"{last_line(log_path.read_text(errors='replace'))}",
                        "groups_lost": None, "groups_trained_twice": None}
            if time.monotonic() > deadline:
                return {**row, "outcome": "FAILED: no training step in time", "groups_lost": None,
                        "groups_trained_twice": None}
            time.sleep(1.0)
        seen = _pids(run_dir)
        pid = seen.get(process)
        if pid is None:
            _stop(proc)
            return {**row, "outcome": f"skipped: no {process} process in this run (pids.json: {sorted(seen)})",
                    "groups_lost": None, "groups_trained_twice": None}
        progress(f"[{name}] step 1 done after {time.monotonic() - t0:.0f}s: {action} {process} (pid {pid})")
        if action in ("SIGKILL", "SIGTERM"):
            os.kill(pid, getattr(signal, action))
            rc = _wait(proc, run_timeout)
        elif action == "SIGSTOP":
            os.kill(pid, signal.SIGSTOP)
            rc = _wait(proc, freeze_s)
            os.kill(pid, signal.SIGCONT) if _alive(pid) else None
            rc = rc if rc is not None else _wait(proc, run_timeout)
        else:
            raise ValueError(f"unknown action {action!r}")
        if rc is None:
            _stop(proc)
            return {**row, "outcome": "FAILED: the run neither finished nor stopped in time", "groups_lost": None,
                    "groups_trained_twice": None}
        first = log_path.read_text(errors="replace")
        line = last_line(first)
        if rc == 0:
            outcome = "recovered by itself"
        else:
            named = LABEL_WORDS[process] in line and f"pid {pid}" in line and "Traceback" not in first
            progress(f"[{name}] stopped (exit {rc}): {line}")
            outcome = f"stopped (exit {rc}): {line!r}" + ("" if named else " [NOT NAMED]")
            kill_leftovers(run_dir, seen, since)
            with open(log_path, "ab") as fh:
                fh.write(b"\n===== re-run =====\n")
            proc = _train(config, log_path)
            rc2 = _wait(proc, run_timeout)
            if rc2 is None:
                _stop(proc)
            second = log_path.read_text(errors="replace")[len(first):]
            if rc2 != 0:
                return {**row, "outcome": outcome + f"; re-run FAILED (exit {rc2}): {last_line(second)!r}",
                        "groups_lost": None, "groups_trained_twice": None, "named": named}
            resumed = "resuming at policy version" in second
            outcome += "; re-run " + ("resumed and finished" if resumed else "finished (did not say it resumed)")
            row["named"] = named
            # the stop's stopped.json is renamed as the re-run starts: the finished folder does not claim it stopped
            row["stop_set_aside"] = not (run_dir / "stopped.json").exists() and any(run_dir.glob("stopped-*.json"))
        inv = check_invariants(run_dir, steps, cfg["rollout"]["group_size"])
        if not inv["consistent"]:
            outcome += " [INCONSISTENT version/checkpoint]"
        progress(f"[{name}] {outcome}; lost {inv['groups_lost']}, twice {inv['groups_trained_twice']} "
                 f"({time.monotonic() - t0:.0f}s)")
        return {**row, "outcome": outcome, "groups_lost": inv["groups_lost"],
                "groups_trained_twice": inv["groups_trained_twice"], "consistent": inv["consistent"],
                "wall_s": round(time.monotonic() - t0, 1), "detail": inv}
    finally:
        _stop(proc)
        kill_leftovers(run_dir, seen, since)
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _commit() -> str | None:
    """The checkout's commit (None outside git)."""
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def write_docs(rows: list[dict], command: str, md_path: Path, json_path: Path) -> None:
    """The "Faults" section of `md_path` and `faults` in `json_path`; everything else kept.

    `rows` replace the recorded rows of the same (process, action); the others stay, each with
    the command, commit and time that measured it (a full list takes ~9 min a fault here, so
    rows accumulate over several runs).
    """
    data = json.loads(json_path.read_text()) if json_path.exists() else {}
    stamp = {"command": command, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "commit": _commit(), "load_avg_at_end": round(os.getloadavg()[0], 2)}
    new = {(r["process"], r["action"]): {**r, **stamp} for r in rows}
    old = {(r["process"], r["action"]): r for r in data.get("faults_detail", [])}
    order = [f for f in ALL_FAULTS if f in new or f in old] + [f for f in {**old, **new} if f not in ALL_FAULTS]
    rows = [new.get(f) or old[f] for f in order]
    data["faults"] = [{k: r.get(k) for k in ("process", "action", "outcome", "groups_lost", "groups_trained_twice",
                                             "measured_at", "commit")} for r in rows]
    data["faults_detail"] = rows
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    table = "\n".join(f"| {r['process']} | {r['action']} | {r['outcome'].replace('|', '/')} | {r.get('groups_lost')} | "
                      f"{r.get('groups_trained_twice')} | {r.get('measured_at', '?')}, `{r.get('command', '?')}` |"
                      for r in rows)
    section = f"""Faults

Each row is measured by [`benchmarks/faults.py`](../benchmarks/faults.py) (the command and time
are in its last column; commits and the load average in reliability.json); the same rows are in
[reliability.json](reliability.json) under `faults`, with the buffer's and the learner's figures
under `faults_detail`). Each row is its own tiny `sinkflex-rl train` (mock domain, solo mode,
SmolLM2, 3 steps, `tiny_config`; for the user simulator's row dual-control mode, SmolLM2 as the
user simulator on its own vLLM server); the fault is injected after step 1 into the process named in
the run's `pids.json`; a run that stopped is re-run with the same command. **Lost**: published
but neither trained nor counted as dropped at the end; **twice**: trained in two learner steps.
A short version (one fault) runs in the suite: `tests/test_faults.py`.

| process | action | outcome | groups lost | groups trained twice | measured |
| --- | --- | --- | --- | --- | --- |
{table}

What each outcome means: the driver checks the launched processes (and the ones it watches:
the rollout service's vLLM engine process, the learner's rank, the embedded Redis) whenever it
waits and after a failed call; a dead one, or one stopped for over 30 s (the poll deadline),
ends the run with one line naming it, its pid and exit status, exit code 3, after stopping the
others (the learner checkpoints; ranks that outlive a killed torchrun get its SIGTERM too). The
run folder then holds `stopped.json` (that line, the error, the time); the re-run renames it to
`stopped-<UTC time of the stop>.json` as it starts, so a run that resumes and finishes has no
`stopped.json` and the stop's record is kept. A
restarted learner takes back the groups delivered to its previous incarnation at once (they are
trained, or dropped as stale and counted), not after `buffer.claim_idle_ms`. A dead vLLM engine
turns the rollout service NOT_SERVING (health, Status, Rollout: UNAVAILABLE). Nothing is
restarted by default; `local.restart_services: [reward]` (or env) restarts a dead stateless
service up to `local.max_restarts` times while the rollout service retries its ScoreBatch
with backoff (not measured in this table). SIGTERM is a graceful stop: the rollout service
refuses new requests and ends each in-flight episode at its next turn boundary, returned as
failed with the reason (`the rollout service is stopping (SIGTERM)`); the run then stops as
for a dead service and the re-run resumes.
"""
    done = set(order)
    missing = [f"{a} {b}" for a, b in ALL_FAULTS if (a, b) not in done]
    if missing:
        section += (f"\nNot in this table (the whole list takes ~4 min a fault on a 2-core machine; run "
                    f"`benchmarks/faults.py` without `--faults`): {', '.join(missing)}.\n")
    old = md_path.read_text() if md_path.exists() else "# Reliability\n"
    marker = "\n## "
    parts = old.split(marker)
    kept = parts[0] + "".join(marker + p for p in parts[1:] if not p.startswith("Faults"))
    md_path.write_text(kept.rstrip() + "\n" + marker + section)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", default=",".join(f"{a}:{b}" for a, b in ALL_FAULTS),
                   help="process:ACTION,... (ACTION SIGKILL, SIGTERM or SIGSTOP)")
    p.add_argument("--root", type=Path, default=Path("/tmp/faults-runs"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--policy", default="smollm2", help="models.policy (prepared with sinkflex.models)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "reliability.json")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the run folders")
    a = p.parse_args()
    from sinkflex.models import prepare_model

    policy = str(prepare_model(a.policy))
    a.root.mkdir(parents=True, exist_ok=True)
    faults = [tuple(f.split(":")) for f in a.faults.split(",") if f]
    rows = []
    for process, action in faults:
        rows.append(run_fault(process, action, a.root, policy, steps=a.steps, keep=a.keep,
                              progress=lambda s: print(s, flush=True)))
    command = ".venv/bin/python benchmarks/faults.py" + ("" if a.faults == p.get_default("faults") else f" --faults {a.faults}")
    print(json.dumps([{k: r.get(k) for k in ("process", "action", "outcome", "groups_lost", "groups_trained_twice")}
                      for r in rows], indent=1), flush=True)
    if not a.no_docs:
        write_docs(rows, command, a.out, a.json)
    bad = [r for r in rows if r.get("groups_lost") not in (0, None) or r.get("groups_trained_twice") not in (0, None)
           or r["outcome"].startswith("FAILED") or "NOT NAMED" in r["outcome"] or "INCONSISTENT" in r["outcome"]]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
