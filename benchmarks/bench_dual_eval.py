"""Rollout settings compared on dual-control episodes: `sinkflex-rl eval` of one policy per arm,
each arm its own config overrides and environment, with the CPU time each vLLM server used.

    .venv/bin/python benchmarks/bench_dual_eval.py --policy runs/demo-dual/learner/policy/v1 \\
        --arm 'default:' --arm 'passive: --env OMP_WAIT_POLICY=PASSIVE' \\
        --tasks 24 --trials 4 --rounds 2 --out docs/bench_dual_eval_omp

An arm is ``NAME: [--set FIELD=VALUE]... [--env NAME=VALUE]...``: `--set` goes to `sinkflex-rl eval`
as it is (a field of the policy run's experiment), `--env` into the environment of the eval and every
process it starts. Each measurement is one eval (its run's experiment: the dual demo's tasks, the user
simulator its run trained, served by the local launcher, the rollout engine; no learner) in its own
process tree, one at a time; each round rotates the order of the arms. The figure compared is eval's
`episodes_seconds` (the services up: every episode played and scored); `wall_seconds` adds the
services' start. Beside it, the CPU seconds (user + system, `psutil.Process.cpu_times`) of the user
simulator's vLLM server and of the rollout service (its vLLM engine included), each with every process
under it, sampled every 2 s while the eval runs (the last sample before each process exits counts):
a setting that wastes cycles (threads spinning while they wait) shows there even when the wall time,
which varies by ±10 % between identical runs on a shared machine, cannot tell it apart.

Writes ``<out>.md`` and ``<out>.json`` (the same figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: the launcher's children whose process trees are timed: role -> a word of their command line
ROLES = {"user_sim": "vllm.entrypoints.openai.api_server", "rollout": "rollout_service"}


def parse_arm(text: str) -> dict:
    """``NAME: [--set F=V]... [--env K=V]...`` -> {name, sets, env}.

    Raises:
        argparse.ArgumentTypeError: no ``NAME:``, an unknown flag, or an ``--env`` without ``=``.
    """
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"an arm is 'NAME: [--set F=V]... [--env K=V]...', not {text!r}")
    words, sets, env = shlex.split(rest), [], {}
    for flag, value in zip(words[::2], words[1::2]):
        if flag == "--set":
            sets.append(value)
        elif flag == "--env" and "=" in value:
            k, v = value.split("=", 1)
            env[k] = v
        else:
            raise argparse.ArgumentTypeError(f"arm {name!r}: expected --set F=V or --env K=V, got {flag} {value}")
    if len(words) % 2:
        raise argparse.ArgumentTypeError(f"arm {name!r}: {words[-1]!r} has no value")
    return {"name": name.strip(), "sets": sets, "env": env}


class CpuSampler(threading.Thread):
    """Every `period` s, the CPU seconds of each process under `root`, kept per pid (the last sample
    of a process that has exited stays), summed at the end per role (`ROLES`)."""

    def __init__(self, root: int, period: float = 2.0):
        super().__init__(daemon=True)
        self.root, self.period, self.stop = root, period, threading.Event()
        self.cpu: dict[int, float] = {}
        self.role: dict[int, str] = {}

    def run(self) -> None:
        while not self.stop.wait(self.period):
            try:
                top = psutil.Process(self.root).children()
            except psutil.NoSuchProcess:
                return
            for child in top:
                try:
                    cmd = " ".join(child.cmdline())
                    role = next((r for r, word in ROLES.items() if word in cmd), None)
                    if role is None:
                        continue
                    for p in [child, *child.children(recursive=True)]:
                        t = p.cpu_times()
                        self.cpu[p.pid] = t.user + t.system
                        self.role[p.pid] = role
                except psutil.Error:
                    continue

    def totals(self) -> dict[str, float]:
        return {r: round(sum(c for p, c in self.cpu.items() if self.role[p] == r), 1) for r in ROLES}


def measure(policy: str, arm: dict, tasks: int, trials: int, out: Path) -> dict:
    """One `sinkflex-rl eval` of `policy` with `arm`'s overrides and environment; its figures."""
    load_before = os.getloadavg()
    cmd = [str(Path(sys.executable).parent / "sinkflex-rl"), "eval", "-p", policy, "--num-tasks", str(tasks),
           "--trials", str(trials), "-o", str(out)]
    for s in arm["sets"]:
        cmd += ["--set", s]
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **arm["env"]})
        sampler = CpuSampler(proc.pid)
        sampler.start()
        rc = proc.wait()
        sampler.stop.set()
        sampler.join()
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}: see {out.with_suffix('.log')}")
    s = json.loads((out / "summary.json").read_text())
    v = json.loads((out / "validation" / "eval.json").read_text())
    return dict(arm=arm["name"], episodes_seconds=s["episodes_seconds"], wall_seconds=s["wall_seconds"],
                mean_at_1=s["mean_at_1"], episodes=s["tasks"] * s["trials"], user_turns_mean=v["user_turns_mean"],
                cpu_seconds=sampler.totals(),
                load_before=[round(x, 2) for x in load_before], load_after=[round(x, 2) for x in os.getloadavg()])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="runs/demo-dual/learner/policy/v1",
                   help="a policy folder of a dual run (its experiment.yaml names the user simulator)")
    p.add_argument("--arm", dest="arms", type=parse_arm, action="append", required=True,
                   help="NAME: [--set FIELD=VALUE]... [--env NAME=VALUE]... (two or more)")
    p.add_argument("--tasks", type=int, default=24)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", default="runs/bench_dual_eval", help="where the evals write")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_dual_eval"))
    a = p.parse_args()
    names = [arm["name"] for arm in a.arms]
    if len(names) < 2 or len(set(names)) != len(names):
        p.error(f"give two or more arms with different names, not {names}")

    from sinkflex.hardware import _cpu_flags, cpu_model

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(a.rounds):
        for arm in a.arms[r % len(a.arms):] + a.arms[:r % len(a.arms)]:
            row = measure(a.policy, arm, a.tasks, a.trials, work / f"{arm['name']}-{r}")
            rows.append({"round": r, **row})
            print(json.dumps(rows[-1]), flush=True)

    def mean(name: str, key) -> float:
        return round(statistics.mean(key(x) for x in rows if x["arm"] == name), 1)

    summary = {n: {"episodes_seconds": mean(n, lambda x: x["episodes_seconds"]),
                   **{f"cpu_seconds_{role}": mean(n, lambda x, role=role: x["cpu_seconds"][role]) for role in ROLES}}
               for n in names}
    base = summary[names[0]]["episodes_seconds"]
    for n in names:
        summary[n]["speedup_vs_first"] = round(base / summary[n]["episodes_seconds"], 3)
    result = dict(
        command=" ".join(["python", "benchmarks/bench_dual_eval.py", *map(shlex.quote, sys.argv[1:])]),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=cpu_model(),
        cores=len(os.sched_getaffinity(0)), avx512_bf16="avx512_bf16" in _cpu_flags(), policy=a.policy,
        tasks=a.tasks, trials=a.trials, arms=a.arms, rounds=rows, mean=summary)
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    arms = "; ".join(f"`{x['name']}`: " + (" ".join([*(f"--set {s}" for s in x["sets"]), *(f"{k}={v}" for k, v in x["env"].items())]) or "as the run's experiment")
                     for x in a.arms)
    lines = [
        "# Rollout settings on dual-control episodes: " + " vs ".join(names),
        "",
        f"Command: `{result['command']}`; {result['date']}; {result['cores']} cores ({result['machine']}, "
        f"avx512_bf16: {result['avx512_bf16']}); 1-minute load average {rows[0]['load_before'][0]} before the first "
        f"measurement (the benchmark's own processes raise it; the table gives it around each). Policy `{a.policy}` "
        f"(its run's user simulator); {a.tasks} held-out tasks × {a.trials} trials a measurement. Arms: {arms}. "
        "CPU s: user + system seconds of the user simulator's vLLM server and of the rollout service (its engine "
        "included), every process under each.",
        "",
        "| round | arm | episodes s | wall s | CPU s user sim | CPU s rollout | mean@1 | user turns / episode | load before → after (1 min) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for x in rows:
        lines.append(f"| {x['round']} | {x['arm']} | {x['episodes_seconds']:.1f} | {x['wall_seconds']:.1f} | "
                     f"{x['cpu_seconds']['user_sim']:.1f} | {x['cpu_seconds']['rollout']:.1f} | {x['mean_at_1']:.3f} | "
                     f"{x['user_turns_mean']:.2f} | {x['load_before'][0]} → {x['load_after'][0]} |")
    lines += ["", "Means: " + "; ".join(
        f"{n} {s['episodes_seconds']:.1f} s ({s['speedup_vs_first']:.2f}× the first arm), CPU s user sim "
        f"{s['cpu_seconds_user_sim']:.1f}, rollout {s['cpu_seconds_rollout']:.1f}" for n, s in summary.items()) + ".", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
