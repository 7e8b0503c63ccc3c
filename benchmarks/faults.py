"""Fault injection for the whole job: kill or freeze each process of `sinkflex-rl train` at the
moments that matter, and check that the run heals itself.

A *campaign* is one tiny train on the embedded default (mock domain, SmolLM2, `tiny_config`;
dual-control mode, the policy model as its user simulator, for the user simulator's faults) that
takes a list of faults in turn. For each fault the generator waits for its *moment* in the next
RL step, watched from outside (no hook in the services):

- `mid-rollout`: the rollout service's Status reports groups in flight (a Rollout request that
  publishes training data is running), then `MID_ROLLOUT_DELAY_S` later;
- `step-before-ack`: the learner wrote a new train record (its optimizer step is done) while its
  newest checkpoint is still the previous step's (the step's groups are not acknowledged: a
  group is acknowledged only after the checkpoint that records it, learner_service/loop.py);
- `checkpoint`: a temporary entry (`.tmp*`, `*.tmp`) exists in learner/checkpoints (a checkpoint
  is being written);
- `publishing`: a temporary folder of the next policy version exists in learner/policy (the
  learner), or the version's folder exists and the engine does not serve it yet (UpdateWeights
  in flight: the rollout service and its engine);

then sends the signal to the process named in the run's pids.json (env, reward, rollout, its vLLM
`engine`, `learner_rank`, `learner` = torchrun, `user_sim`, `redis` = the embedded Redis). SIGSTOP
is left in place: the launcher must find the process frozen past its freeze timeout (30 s), kill
it and restart it. The generator then waits until the run's recoveries.jsonl records a restart
naming that pid (recovered in run), and goes on with the next fault. The campaign must finish by
itself (exit 0, no re-run). Invariants, from the finished run folder (`check_invariants`):
groups lost (published but neither trained nor counted as dropped: still unconsumed in the
buffer, acknowledged untrained beyond what the learner counted as dropped, or published by the
controller and missing from the stream) and groups trained twice (the learner's trained groups
per step, each step counted once, beyond the distinct trained group ids), over the whole
campaign: every row of a campaign carries its campaign's counts (0 for the campaign means 0
for each of its faults); the policy version, its published folder and the last checkpoint must
all be `steps`.

Bounded: every wait has a deadline; a frozen process is resumed (SIGCONT) if the run did not
recover; every process a run started is killed at the end (by the pids it wrote). Usage:

    .venv/bin/python benchmarks/faults.py                         # every campaign, writes docs/
    .venv/bin/python benchmarks/faults.py --campaigns quick --no-docs

Writes the "Faults" section of docs/reliability.md and `faults` / `faults_detail` in
docs/reliability.json (other keys and sections are kept). `tests/test_train_e2e.py` runs one
in-run recovery with this code (the reward service killed mid-rollout).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the campaigns: name -> (faults (process, action, moment), dual-control mode with a user simulator)
CAMPAIGNS: dict[str, tuple[list[tuple[str, str, str]], bool]] = {
    # processes whose restart is quick (no vLLM model load)
    "quick": ([("env", "SIGKILL", "mid-rollout"), ("reward", "SIGKILL", "mid-rollout"),
               ("learner_rank", "SIGKILL", "step-before-ack"), ("learner", "SIGKILL", "step-before-ack"),
               ("redis", "SIGKILL", "mid-rollout"), ("learner_rank", "SIGKILL", "checkpoint"),
               ("learner", "SIGKILL", "checkpoint"), ("learner_rank", "SIGKILL", "publishing"),
               ("redis", "SIGKILL", "step-before-ack"), ("env", "SIGSTOP", "mid-rollout"),
               ("reward", "SIGSTOP", "mid-rollout"), ("learner_rank", "SIGSTOP", "step-before-ack")], False),
    # the rollout service and its vLLM engine (each restart loads the model)
    "engine": ([("rollout", "SIGKILL", "mid-rollout"), ("engine", "SIGKILL", "mid-rollout"),
                ("engine", "SIGKILL", "publishing"), ("rollout", "SIGKILL", "publishing"),
                ("rollout", "SIGSTOP", "mid-rollout")], False),
    "user_sim": ([("user_sim", "SIGKILL", "mid-rollout"), ("user_sim", "SIGSTOP", "mid-rollout")], True),
}
#: how long after the rollout service reports groups in flight a mid-rollout fault is sent (s)
MID_ROLLOUT_DELAY_S = 1.0


def tiny_config(run_dir: Path, policy: str, steps: int = 3, user_sim: bool = False) -> dict:
    """The smallest train that exercises every service: two mock-domain tasks in solo mode, 2 samples
    of at most 2 turns a step, no warm start, no validation.

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
        "local": {"ready_timeout_s": 900, "learner_stop_grace_s": 120, "max_restarts": 12},
        "env_service": {"domains": ["mock"]},
        "rollout_service": {"engine": {"kv_cache_gib": 0.5, "max_model_len": 4096}},
        "learner_service": {"optim": {"lr": 1.0e-4}, "batch": {"micro_batch_size": 1}, "model": {"gradient_checkpointing": False}},
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
    # a drop is acknowledged at once and counted in the next checkpoint: a learner killed before that
    # checkpoint forgets the count, not the drop, which its log names (every incarnation's, appended)
    log_path = run_dir / "logs" / "learner.log"
    logged = set(re.findall(r"dropping group (\S+) \(entry", log_path.read_text(errors="replace"))) if log_path.exists() else set()
    dropped_counted = max(dropped_counted, len(logged))
    published = len(_records(run_dir / "metrics.jsonl", "trajectory")) // group_size
    added = buf.get("added") or buf["stream_length"]  # every group ever added (acknowledged history may be trimmed)
    acked_untrained = added - buf["trained"] - buf["unconsumed"] - buf["dead_letters"]
    lost = buf["unconsumed"] + max(0, acked_untrained - dropped_counted) + max(0, published - added)
    twice = max(0, trained_by_steps - buf["trained"])
    ckpts = sorted(int(p.name.split("_")[1]) for p in (run_dir / "learner" / "checkpoints").glob("step_*"))
    train_steps = sorted(int(r["step"]) for r in _records(run_dir / "metrics.jsonl", "train"))
    consistent = (summary["policy_version"] == steps and (run_dir / "learner" / "policy" / f"v{steps}").is_dir()
                  and bool(ckpts) and ckpts[-1] == steps and train_steps == list(range(1, steps + 1)))
    return {"groups_lost": lost, "groups_trained_twice": twice, "consistent": consistent,
            "policy_version": summary["policy_version"], "last_checkpoint": ckpts[-1] if ckpts else None,
            "train_records": train_steps, "buffer": buf, "published_by_controller": published,
            "trained_by_learner_steps": trained_by_steps, "dropped_counted": dropped_counted}


def _rollout_address(run_dir: Path) -> str | None:
    import yaml

    path = run_dir / "configs" / "learner_service.yaml"
    if not path.exists():
        return None
    return (yaml.safe_load(path.read_text()) or {}).get("rollout_address") or None


def _rollout_status(address: str | None):
    """The rollout service's Status, or None when it does not answer."""
    if not address:
        return None
    from rollout_service.client import GrpcRolloutClient
    from sinkflex.errors import ServiceError

    try:
        with GrpcRolloutClient(address, timeout=2.0) as client:
            return client.status(timeout=2.0)
    except (ServiceError, ValueError, OSError):
        return None


def _latest_checkpoint(run_dir: Path) -> str:
    path = run_dir / "learner" / "checkpoints" / "latest"
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _temporary(folder: Path) -> list[str]:
    """Names of the entries of `folder` that are being written (`.tmp*`, `*.tmp`, but not the `latest` pointer's)."""
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError:
        return []
    return [n for n in names if (n.startswith(".tmp") or n.endswith(".tmp") or ".tmp-" in n) and "latest" not in n]


def wait_for_moment(moment: str, run_dir: Path, proc: subprocess.Popen, timeout: float) -> str | None:
    """Blocks until `moment` comes in the run of `run_dir` (module docstring); returns what shows it (the
    evidence, one line), or None when the run ended or `timeout` passed first. Polls every 20 ms."""
    deadline = time.monotonic() + timeout
    learner_dir = run_dir / "learner"
    n_train = len(_records(learner_dir / "metrics.jsonl", "train"))
    versions = {p.name for p in (learner_dir / "policy").glob("v*")}
    address = _rollout_address(run_dir)
    last_status = 0.0
    # temporaries left by an earlier fault (a writer killed mid-write) are not this moment
    stale = set(_temporary(learner_dir / "checkpoints")) | set(_temporary(learner_dir / "policy"))
    while time.monotonic() < deadline and proc.poll() is None:
        if moment == "mid-rollout":
            if time.monotonic() - last_status >= 0.25:
                last_status = time.monotonic()
                st = _rollout_status(address or _rollout_address(run_dir))
                if st is not None and st.groups_in_flight > 0:
                    time.sleep(MID_ROLLOUT_DELAY_S)
                    return f"rollout service: {st.groups_in_flight} group(s) in flight at policy version {st.policy_version}"
        elif moment == "step-before-ack":
            records = _records(learner_dir / "metrics.jsonl", "train")
            if len(records) > n_train:
                latest = _latest_checkpoint(run_dir)
                step = int(records[-1].get("step", 0))
                done = re.match(r"step_0*(\d+)", latest)
                if done is None or int(done.group(1)) < step:
                    return f"learner step {step} done (train record written), newest checkpoint {latest or 'none'}: not acknowledged"
                n_train = len(records)
        elif moment == "checkpoint":
            tmp = [n for n in _temporary(learner_dir / "checkpoints") if n not in stale]
            if tmp:
                return f"checkpoint being written: learner/checkpoints/{tmp[0]} (newest complete: {_latest_checkpoint(run_dir)})"
        elif moment == "publishing":
            tmp = [n for n in _temporary(learner_dir / "policy") if n not in stale]
            if tmp:
                return f"policy version being written: learner/policy/{tmp[0]}"
            new = {p.name for p in (learner_dir / "policy").glob("v*")} - versions
            if new:
                st = _rollout_status(address or _rollout_address(run_dir))
                v = max(int(n[1:]) for n in new if n[1:].isdigit())
                if st is not None and st.policy_version < v:
                    return f"policy v{v} published, the engine serves v{st.policy_version}: UpdateWeights in flight"
                versions |= new
        else:
            raise ValueError(f"unknown moment {moment!r}")
        time.sleep(0.02)
    return None


#: the process whose restart heals a fault of each process (a dead engine or rank restarts its service)
RESTARTED = {"engine": "rollout", "learner_rank": "learner"}


def _recovery_of(run_dir: Path, pid: int, since: int, process: str = "") -> dict | None:
    """The first recovery record after the first `since` of recoveries.jsonl whose restart names `pid`,
    or restarts the process that heals a fault of `process` (`RESTARTED`: a rollout service that
    exited with its engine is named itself)."""
    from sinkflex_rl.launcher import LABELS

    label = LABELS.get(RESTARTED.get(process, process), process)
    path = run_dir / "recoveries.jsonl"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()[since:]
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if any(f"pid {pid})" in note or f"pid {pid}," in note or (process and f"({label} restart " in note)
               for note in r.get("restarted", [])):
            return r
    return None


def _n_recoveries(run_dir: Path) -> int:
    path = run_dir / "recoveries.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def run_campaign(name: str, faults: list[tuple[str, str, str]], root: Path, policy: str, user_sim: bool = False,
                 moment_timeout: float = 900.0, recover_timeout: float = 900.0, run_timeout: float = 1200.0,
                 keep: bool = False, progress=print, inject_until: float | None = None) -> list[dict]:
    """One tiny train that takes `faults` in turn (module docstring). Returns one row per fault.
    `inject_until` (a time.time()): no fault is sent after it (the run goes on to its end; those rows
    say so and are left out of the docs)."""
    import yaml

    run_dir = root / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    steps = len(faults) + 2
    cfg = tiny_config(run_dir, policy, steps, user_sim=user_sim)
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    log_path = root / f"{name}.log"
    log_path.write_bytes(b"")
    rows: list[dict] = []
    seen: dict[str, int] = {}
    t0, since = time.monotonic(), time.time()
    proc = _train(config, log_path)
    try:
        for process, action, moment in faults:
            row = {"process": process, "action": action, "moment": moment, "campaign": name,
                   "recovered_in_run": False, "groups_lost": None, "groups_trained_twice": None}
            rows.append(row)
            if inject_until is not None and time.time() > inject_until:
                row["outcome"] = "not measured: out of time (--until)"
                continue
            evidence = wait_for_moment(moment, run_dir, proc, moment_timeout)
            seen.update(_pids(run_dir))
            pid = _pids(run_dir).get(process)
            if evidence is None or pid is None:
                row["outcome"] = ("FAILED: " + ("the run ended" if proc.poll() is not None else "no such moment in time")
                                  if evidence is None else f"skipped: no {process} in pids.json")
                progress(f"[{name}] {process} {action} {moment}: {row['outcome']}")
                continue
            n_before = _n_recoveries(run_dir)
            os.kill(pid, getattr(signal, action))
            t_fault = time.monotonic()
            row.update(pid=pid, evidence=evidence, at_s=round(t_fault - t0, 1))
            progress(f"[{name}] {action} {process} (pid {pid}) at {moment}: {evidence}")
            deadline = t_fault + recover_timeout
            rec = None
            while time.monotonic() < deadline and proc.poll() is None:
                rec = _recovery_of(run_dir, pid, n_before, process)
                if rec is not None:
                    break
                time.sleep(0.5)
            if rec is None:
                if action == "SIGSTOP" and _alive(pid):
                    os.kill(pid, signal.SIGCONT)
                row["outcome"] = "FAILED: no in-run recovery" + (f" (the run ended, exit {proc.returncode}: "
                                                                f"{last_line(log_path.read_text(errors='replace'))})"
                                                                if proc.poll() is not None else " in time")
                progress(f"[{name}] {row['outcome']}")
                break
            row.update(recovered_in_run=True, recovered_in_s=round(time.monotonic() - t_fault, 1),
                       restarted=rec["restarted"], groups_retried=rec.get("groups_retried", 0))
            row["outcome"] = "recovered in-run: " + " / ".join(rec["restarted"])
            progress(f"[{name}] recovered in {row['recovered_in_s']:.0f}s: {row['outcome']}")
        rc = _wait(proc, run_timeout)
        if rc is None:
            _stop(proc)
        text = log_path.read_text(errors="replace")
        finished = rc == 0 and (run_dir / "summary.json").exists()
        inv = check_invariants(run_dir, steps, cfg["rollout"]["group_size"]) if finished else None
        for row in rows:
            if row.get("outcome", "").startswith("not measured"):
                continue
            if not finished:
                row["recovered_in_run"] = False
                row["outcome"] = (row.get("outcome", "") + f"; the run did not finish (exit {rc}): {last_line(text)!r}")
                continue
            row.update(groups_lost=inv["groups_lost"], groups_trained_twice=inv["groups_trained_twice"],
                       consistent=inv["consistent"])
            if "Traceback" in text:
                row["outcome"] += " [TRACEBACK in the train's output]"
        progress(f"[{name}] finished={finished} in {time.monotonic() - t0:.0f}s; "
                 + (f"lost {inv['groups_lost']}, twice {inv['groups_trained_twice']}, consistent {inv['consistent']}"
                    if inv else ""))
        for row in rows:
            row["campaign_detail"] = inv
            row["campaign_wall_s"] = round(time.monotonic() - t0, 1)
        return rows
    finally:
        _stop(proc)
        seen.update(_pids(run_dir))
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
    """The checkout's commit (None outside git), with `+dirty` when tracked code differs from it."""
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    head = out.stdout.strip() or None
    dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", "*.py"], check=False).returncode
    return f"{head}+dirty" if head and dirty else head


#: the commit of the code that ran (taken when this module is imported, before any campaign)
COMMIT_AT_START = _commit()


ROW_KEYS = ("process", "action", "moment", "recovered_in_run", "groups_lost", "groups_trained_twice", "commit")


def write_docs(rows: list[dict], command: str | None, md_path: Path, json_path: Path, restamp: bool = True) -> None:
    """The "Faults" section of `md_path` and `faults` / `faults_detail` in `json_path`: `rows` (one
    run of this generator, stamped with `command`, this commit and the time; `restamp=False`: rows
    already stamped, written as they are) replace the rows of the same (process, action, moment);
    rows measured earlier keep their own stamps; every other key and section is kept."""
    from sinkflex.buffer.embedded import PERSISTENCE

    data = json.loads(json_path.read_text()) if json_path.exists() else {}
    stamp = {"command": command, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "commit": COMMIT_AT_START, "load_avg_at_end": round(os.getloadavg()[0], 2)} if restamp else {}
    key = lambda r: (r["process"], r["action"], r["moment"])
    new = {key(r): {**r, **stamp} for r in rows}
    old = [r for r in data.get("faults_detail", []) if "moment" in r and key(r) not in new]  # measured earlier
    order = [key(f) for c in CAMPAIGNS.values() for f in ({"process": p, "action": a, "moment": m} for p, a, m in c[0])]
    rows = sorted([*old, *new.values()], key=lambda r: order.index(key(r)) if key(r) in order else len(order))
    data["faults"] = [{k: r.get(k) for k in ROW_KEYS} for r in rows]
    data["faults_detail"] = rows
    data["redis_persistence"] = PERSISTENCE
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    runs = {}
    for r in rows:
        runs.setdefault((r["command"], r["commit"], r["measured_at"], r.get("load_avg_at_end")), []).append(r["campaign"])
    commits = "; ".join(f"`{c}` at commit `{h}`, {t} (campaigns {', '.join(dict.fromkeys(n))}; 1-min load average "
                        f"{load} at its end)" for (c, h, t, load), n in runs.items())
    ok = sum(1 for r in rows if r["recovered_in_run"] and r["groups_lost"] == 0 and r["groups_trained_twice"] == 0)
    table = "\n".join(
        f"| {r['process']} | {r['action']} | {r['moment']} | {'yes' if r['recovered_in_run'] else 'NO'} | "
        f"{r.get('recovered_in_s', '')} | {r.get('groups_retried', '')} | {r.get('groups_lost')} | {r.get('groups_trained_twice')} | "
        f"{r['campaign']} | {str(r.get('evidence', '')).replace('|', '/')} |" for r in rows)
    section = f"""Faults

Measured by [`benchmarks/faults.py`](../benchmarks/faults.py) on a 2-core machine shared with other sessions: {commits}; the same rows are in [reliability.json](reliability.json) under `faults`
(`{{{", ".join(ROW_KEYS)}}}`), with each restart's line, the evidence of the moment and the
buffer's and learner's figures under `faults_detail`. **{ok} of {len(rows)}** faults recovered
in-run with 0 groups lost and 0 trained twice.

Each campaign is one tiny `sinkflex-rl train` (mock domain, SmolLM2, `tiny_config`: 1 task x 2
samples a step, `local.max_restarts` 12; the user simulator's campaign in dual-control mode with
SmolLM2 as the user simulator on its own vLLM server) that takes its faults in turn, one per RL
step, and must finish by itself (exit 0, never re-run). A fault is sent at its moment, watched
from outside the services: **mid-rollout** (the rollout service reports groups in flight, then 1 s),
**step-before-ack** (the learner's optimizer step is done, its checkpoint not yet written: its
groups unacknowledged), **checkpoint** (a checkpoint's temporary folder exists), **publishing**
(the next policy version's folder is being written, or is written and the engine does not serve
it yet: UpdateWeights in flight). SIGSTOP is left in place: the launcher finds the process
frozen past its 30 s freeze timeout, kills and restarts it. **Recovered in-run**: the run's
recoveries.jsonl names the signalled pid in a restart and the run finishes by itself.
**Retried**: the groups of the step's Rollout request that the recovery cut off (rolled out
again). **Lost**: published but neither trained nor counted as dropped at the end (published:
the buffer's `BufferStats.added`, every group ever added to the stream, which must also cover the
groups the controller recorded; trained: the buffer's trained-id set); **twice**: trained in two
learner steps (the learner's per-step group counts beyond the distinct trained ids); both are the campaign's (0 for a campaign is 0 for each of its
faults). The policy version, its published folder and the last checkpoint agree at the end of
every campaign that finished. A short version (one in-run recovery) runs in the suite:
`tests/test_train_e2e.py` kills the reward service mid-rollout in its resumed launch.

| process | action | moment | recovered in-run | in s | retried | groups lost | groups trained twice | campaign | evidence of the moment |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
{table}

**How it heals** (the embedded default; `sinkflex_rl/launcher.py`, `LocalLauncher.recover` and
`run_recovering`): the driver checks every launched process (env, reward, rollout, torchrun, the
user simulator) and the ones it watches (the rollout service's vLLM engine process, the
learner's ranks, the embedded Redis) whenever it waits, and after a failed call. One that died,
or has been stopped for over 30 s, abandons the current step: the controller's clients are
closed (the Rollout stream is cancelled; groups the service had published already stay in the
stream and are trained, or dropped as stale and counted), and the launcher restarts the process
as Kubernetes restarts a pod: same command and port, a frozen one SIGKILLed first, what a dead one
left in its process group killed (a SIGKILLed vLLM server's engine process: before 5f6ba92 each
killed user simulator left 2.6 GiB running past the end of the run), a dead engine or rank
restarting its service, the embedded Redis on the same database file and socket; each
after a backoff of 1, 2, 4, ... s (at most 30 s), at most `local.max_restarts` times per process
and run (default 3; `local.restart_services` lists what is restarted, default every process).
The driver then goes on from the learner's policy version: the engine is brought to that
version, the cut-off step is rolled out again (`groups_retried`); the restarted learner resumes
from its newest complete checkpoint and takes back the groups delivered to its previous
incarnation first (trained, or dropped because the checkpoint records them as trained). A call
that failed while nothing is dead (a client that gave up on a restarting peer) is taken up again
once every service answers SERVING (3 times in a row at most); with services that run elsewhere
(compose, a cluster) that is the only recovery the driver does, their supervisor restarts them.
Clients retry idempotent calls with backoff meanwhile (tenacity): the rollout service's
ScoreBatch (0.5 .. 16 s, 7 tries), every Redis call of the trajectory buffer (10 tries, about
13 s), the controller's Status polls. Each recovery is a line of the run's `recoveries.jsonl`;
summary.json counts `recoveries` and `groups_retried`. A process out of restarts, or whose
restart fails, ends the run with one line naming it, its pid and exit status, exit code 3
(`stopped.json`; re-run the same command to resume). SIGTERM stays a graceful stop.

**Redis persistence.** The embedded Redis (`sinkflex/buffer/embedded.py`, `PERSISTENCE`) runs
with `appendonly yes` and `appendfsync always`: Redis writes and fsyncs each write command to its
append-only file before it sends the reply. A kill (SIGKILL of redis-server) loses no answered
write; a restart on the same file replays the AOF. A power loss keeps every answered write as far
as the disk honours fsync; a write not yet answered may be lost (its client saw an error and
retries). `tests/test_launcher_faults.py` checks the kill: 20 groups put, 3 read, 1
acknowledged, SIGKILL, restart: the stream, the pending entries and the trained set are exactly
as before, and the running server's `appendfsync` is `always` (a power loss cannot be made on this
machine; that claim rests on the setting). Compose and the chart run their Redis the same way
(`--appendonly yes --appendfsync always`, with `maxmemory` and `noeviction`), so the same holds
there: a kill of the Redis container or pod loses no answered write, a power loss none that the
disk (the `redis-data` volume, the chart's PersistentVolume) acknowledged as fsynced. Without a
persistent volume (`redis.persistence.enabled: false`, an emptyDir) a deleted pod loses the
buffer whatever the fsync setting. `tests/test_deploy_security.py` runs compose's Redis command
line on a real redis-server and reads `appendfsync always` back; the chart's arguments are
checked as rendered.
"""
    done = {key(r) for r in rows}
    missing = [f"{p} {a} {m}" for c in CAMPAIGNS.values() for p, a, m in c[0] if (p, a, m) not in done]
    if missing:
        section += f"\nNot in this table (not measured on this code; `--campaigns` runs them): {', '.join(missing)}.\n"
    old = md_path.read_text() if md_path.exists() else "# Reliability\n"
    marker = "\n## "
    parts = old.split(marker)
    kept = parts[0] + "".join(marker + p for p in parts[1:] if not p.startswith("Faults"))
    md_path.write_text(kept.rstrip() + "\n" + marker + section)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--campaigns", default=",".join(CAMPAIGNS), help=f"comma-separated, of: {', '.join(CAMPAIGNS)}")
    p.add_argument("--root", type=Path, default=Path("/tmp/faults-runs"))
    p.add_argument("--policy", default="smollm2", help="models.policy (prepared with sinkflex.models)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "reliability.json")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the run folders")
    p.add_argument("--until", type=float, default=None, help="send no fault after this time.time()")
    p.add_argument("--docs-only", action="store_true",
                   help="run nothing: rewrite the Faults section from --json's faults_detail (each row keeps its commit)")
    a = p.parse_args()
    if a.docs_only:
        rows = json.loads(a.json.read_text())["faults_detail"]
        write_docs(rows, None, a.out, a.json, restamp=False)
        return
    from sinkflex.models import prepare_model

    policy = str(prepare_model(a.policy))
    a.root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in [c for c in a.campaigns.split(",") if c]:
        faults, user_sim = CAMPAIGNS[name]
        rows += run_campaign(name, faults, a.root, policy, user_sim=user_sim, keep=a.keep,
                             progress=lambda s: print(s, flush=True), inject_until=a.until)
    measured = [r for r in rows if not r.get("outcome", "").startswith("not measured")]
    command = ".venv/bin/python benchmarks/faults.py" + ("" if a.campaigns == p.get_default("campaigns")
                                                         else f" --campaigns {a.campaigns}")
    print(json.dumps([{k: r.get(k) for k in (*ROW_KEYS[:-1], "outcome")} for r in rows], indent=1), flush=True)
    if not a.no_docs:
        write_docs(measured, command, a.out, a.json)
    bad = [r for r in measured if not r["recovered_in_run"] or r.get("groups_lost") != 0 or r.get("groups_trained_twice") != 0
           or r.get("consistent") is False]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
