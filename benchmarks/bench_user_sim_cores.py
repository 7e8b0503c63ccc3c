"""The local user simulator's CPU cores: beside the rollout engine on every core
(`local.user_sim_cpu_threads_bind: all`, the default) against the last core alone (``last``, where
the engine then keeps the other cores), on dual-control episodes.

    .venv/bin/python benchmarks/bench_user_sim_cores.py --policy runs/demo-dual/learner/policy/v1 \
        --tasks 24 --trials 4 --rounds 2 --out docs/bench_user_sim_cores

Each measurement is one `sinkflex-rl eval` of the policy (its run's experiment: the dual demo's
tasks, the user simulator its run trained and served by the local launcher, the rollout engine;
no learner) with ``--set local.user_sim_cpu_threads_bind=<mode>``, in its own process tree, one at
a time; the rounds alternate the order of the modes. The figure compared is eval's
`episodes_seconds` (the services up: every episode played and scored); `wall_seconds` adds the
services' start. In a dialogue the agent and the user take turns, and the episodes of a batch
move through their turns nearly together, so for much of the time only one of the two vLLM
engines computes: bound to a core each, the other core idles (and vLLM's scheduler process,
which polls while its worker computes, shares the user simulator's core).

Writes ``<out>.md`` and ``<out>.json`` (the same figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("last", "all")


def measure(policy: str, mode: str, tasks: int, trials: int, out: Path) -> dict:
    """One `sinkflex-rl eval` with the user simulator's cores `mode`; its summary's figures."""
    load_before = os.getloadavg()
    cmd = [str(Path(sys.executable).parent / "sinkflex-rl"), "eval", "-p", policy, "--num-tasks", str(tasks), "--trials", str(trials),
           "-o", str(out), "--set", f"local.user_sim_cpu_threads_bind={mode}"]
    with open(out.with_suffix(".log"), "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}: see {out.with_suffix('.log')}")
    s = json.loads((out / "summary.json").read_text())
    v = json.loads((out / "validation" / "eval.json").read_text())
    return dict(mode=mode, episodes_seconds=s["episodes_seconds"], wall_seconds=s["wall_seconds"],
                mean_at_1=s["mean_at_1"], episodes=s["tasks"] * s["trials"], user_turns_mean=v["user_turns_mean"],
                load_before=[round(x, 2) for x in load_before], load_after=[round(x, 2) for x in os.getloadavg()])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="runs/demo-dual/learner/policy/v1",
                   help="a policy folder of a dual run (its experiment.yaml names the user simulator)")
    p.add_argument("--tasks", type=int, default=24)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", default="runs/bench_user_sim_cores", help="where the evals write")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_user_sim_cores"))
    a = p.parse_args()

    from sinkflex.hardware import _cpu_flags, cpu_model

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(a.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            row = measure(a.policy, mode, a.tasks, a.trials, work / f"{mode}-{r}")
            rows.append({"round": r, **row})
            print(json.dumps(rows[-1]), flush=True)
    mean = {m: statistics.mean(x["episodes_seconds"] for x in rows if x["mode"] == m) for m in MODES}
    flags = _cpu_flags()
    result = dict(
        command=" ".join(["python", "benchmarks/bench_user_sim_cores.py", *sys.argv[1:]]),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=cpu_model(),
        cores=len(os.sched_getaffinity(0)), avx512_bf16="avx512_bf16" in flags, policy=a.policy,
        tasks=a.tasks, trials=a.trials, rounds=rows,
        mean_episodes_seconds=mean, speedup_all_vs_last=round(mean["last"] / mean["all"], 3))
    out = Path(a.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# The user simulator's cores: every core beside the engine vs the last core alone",
        "",
        f"Command: `{result['command']}`; {result['date']}; {result['cores']} cores ({result['machine']}, "
        f"avx512_bf16: {result['avx512_bf16']}); 1-minute load average {rows[0]['load_before'][0]} before the "
        f"first measurement (the benchmark's own processes raise it; the table gives it around each). Policy `{a.policy}` (its run's user "
        f"simulator); {a.tasks} held-out tasks × {a.trials} trials a measurement. `last`: the user simulator's "
        "vLLM server on the last core, the engine on the others (the layout before "
        "`local.user_sim_cpu_threads_bind`); `all`: both on every core, both at niceness 10.",
        "",
        "| round | mode | episodes s | wall s | mean@1 | user turns / episode | load before → after (1 min) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for x in rows:
        lines.append(f"| {x['round']} | {x['mode']} | {x['episodes_seconds']:.1f} | {x['wall_seconds']:.1f} | "
                     f"{x['mean_at_1']:.3f} | {x['user_turns_mean']:.2f} | {x['load_before'][0]} → {x['load_after'][0]} |")
    lines += ["", f"Mean episodes seconds: last {mean['last']:.1f}, all {mean['all']:.1f}: "
              f"**{result['speedup_all_vs_last']:.2f}×** with the user simulator on every core.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
