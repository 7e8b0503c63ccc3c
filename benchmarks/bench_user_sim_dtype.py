"""The user simulator's vLLM server in bfloat16 against float32 on this CPU, side by side.

Each mode runs `benchmarks/user_sim_fidelity.py`'s measurement (`run`): vLLM's OpenAI server
started as the local launcher starts it (`rollout_service.user_sim.start_vllm_server`, `--dtype`
the mode), τ²-Bench's `UserSimulator` in the env service, the scripted `GoldenAgent` playing the
golden dialogue of each held-out dual-control task (`generate_dual_tasks`), `--concurrency`
dialogues at once: the work of bin/demo-dual's golden dialogues and of every user turn in its
rollouts. Modes alternate for `--rounds` rounds; the table gives each mode's best round (the
server's start and the dialogues, in seconds), the ratio bfloat16 / float32 of the dialogues'
time, and the dialogues each completed (the two dtypes must both play the user).

Why: vLLM CPU's own default dtype is bfloat16 on every CPU; where the CPU has no avx512_bf16
or AMX it is emulated, and `local.user_sim_dtype: auto` picks by the same measured rule as the
rollout engine (`rollout_service.engine.resolve_engine_dtype`, `sinkflex.hardware.bf16_verdict`).

    .venv/bin/python benchmarks/bench_user_sim_dtype.py --model runs/demo-dual/user-sim/policy/v1 \
        --tasks 16 --out docs/bench_user_sim_dtype

Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.user_sim_fidelity import run  # noqa: E402

MODES = ("bfloat16", "float32")


def cpu_facts() -> dict:
    from sinkflex.hardware import _cpu_flags, bf16_matmul_speedup, bf16_verdict, cpu_model

    flags = _cpu_flags()
    model = cpu_model()
    fast, why = bf16_verdict()
    return {"cpu": model, "cpus": os.cpu_count(), "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "bf16_matmul_speedup": round(bf16_matmul_speedup(), 2),
            "bf16_verdict": {"fast": fast, "why": why}, "platform": platform.platform(),
            "python": platform.python_version()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="user-simulator model folder (bin/demo-dual's <OUT>/user-sim/policy/v1)")
    p.add_argument("--tasks", type=int, default=16, help="held-out dual-control tasks a round (families cycled)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--port", type=int, default=8771)
    p.add_argument("--out", default="docs/bench_user_sim_dtype")
    args = p.parse_args()
    facts = cpu_facts()
    load_before = os.getloadavg()
    rounds: list[dict] = []
    for r in range(args.rounds):
        for dtype in MODES:
            ns = argparse.Namespace(tasks=args.tasks, seed=0, model=args.model, base_url=None, served_name="user-sim",
                                    port=args.port, temperature=0.0, max_tokens=64, concurrency=args.concurrency,
                                    vllm_log=None, dtype=dtype)
            res = run(ns)
            u = res["user_simulator"]
            rounds.append({"round": r, "dtype": dtype, **res["timing"], "dialogues": u["dialogues"],
                           "dialogues_completed": u["dialogues_completed"], "fidelity": u["fidelity"],
                           "loadavg_after": [round(x, 2) for x in os.getloadavg()]})
            print(json.dumps(rounds[-1]), flush=True)
    best = {m: min((x for x in rounds if x["dtype"] == m), key=lambda x: x["episodes_s"]) for m in MODES}
    ratio = best["bfloat16"]["episodes_s"] / max(best["float32"]["episodes_s"], 1e-9)
    result = {"machine": {**facts, "loadavg_before": [round(x, 2) for x in load_before]},
              "settings": {"model": args.model, "tasks": args.tasks, "rounds": args.rounds,
                           "concurrency": args.concurrency, "temperature": 0.0, "max_tokens": 64},
              "best": best, "bf16_over_fp32_dialogues_s": round(ratio, 2), "rounds": rounds,
              "command": " ".join([Path(sys.executable).name, *sys.argv])}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# The user simulator's vLLM dtype on {facts['cpu']}", "", f"Command: `{result['command']}`", "",
             f"Machine: {facts['cpus']} cores; avx512f {facts['avx512f']}, avx512_bf16 {facts['avx512_bf16']}, "
             f"amx_bf16 {facts['amx_bf16']}; bf16 / fp32 matmul measured {facts['bf16_matmul_speedup']}× "
             f"(`dtype: auto` → {'bfloat16' if facts['bf16_verdict']['fast'] else 'float32'}); 1-minute load average "
             f"{result['machine']['loadavg_before'][0]} before.", "",
             f"{args.tasks} held-out dual-control golden dialogues a round, {args.concurrency} at once, {args.rounds} "
             "round(s) a mode, modes alternating; the best round of each.", "",
             "| vLLM --dtype | server start (s) | dialogues (s) | completed | fidelity | × float32 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for m in MODES:
        b = best[m]
        lines.append(f"| {m} | {b['server_start_s']} | {b['episodes_s']} | {b['dialogues_completed']}/{b['dialogues']} | "
                     f"{b['fidelity']} | {b['episodes_s'] / max(best['float32']['episodes_s'], 1e-9):.2f}× |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
