"""CPU benchmark: transformers' gpt-oss eager attention vs our blockwise sink path vs SDPA (no sink).

One layer's forward + backward, float32, batch 1, gpt-oss-20b's 8:1 head grouping scaled
down (8 query heads, 1 KV head, head dim 64), for a sliding-window (W = 128) and a full
causal layer, at 1k..16k tokens; our path alone also at 32k and 64k. Every configuration
runs in its own child process (`--child`), which measures:

- time: wall seconds of forward + backward (minimum over repeats for small sizes);
- peak memory: the rise of the child's peak RSS (``VmHWM`` after ``clear_refs``) over its
  RSS just before the step, with inputs already allocated — CPU torch has no
  ``max_memory_allocated``. A child is capped by RLIMIT_AS (baseline + 6.5 GiB), and
  eager is not started where its analytic estimate exceeds 6 GiB (shared 24 GiB machine).

Results go to a Markdown table (``--out``, default docs/bench_attention.md) with the
analytic memory model for full gpt-oss-20b shapes and the issue's targets.

    nice -n 10 .venv/bin/python benchmarks/bench_attention.py            # full run
    .venv/bin/python benchmarks/bench_attention.py --sizes 1024 --big-sizes   # quick
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3
MIB = 1024**2
HQ, HKV, DIM, WINDOW = 8, 1, 64, 128
EAGER_LIMIT_GIB = 6.0
CHILD_HEADROOM_GIB = 6.5
IMPLS = ("eager", "ours", "ours_nosink", "sdpa")
PAIRED_MAX = 2048  # sink overhead measured in interleaved pairs up to this size
LAYERS = ("sliding", "full")


# ---- analytic memory model --------------------------------------------------------------


def eager_estimate_bytes(n: int, n_q_heads: int = HQ, batch: int = 1, elem: int = 4) -> int:
    """Peak extra memory of transformers' gpt-oss eager attention, forward + backward.

    The backward holds ~4 score-sized tensors at once (saved softmax output, its gradient,
    the sink-column pad of the gradient, the softmax-backward result): 4 · B·Hq·N²·elem.
    """
    return 4 * batch * n_q_heads * n * n * elem


def ours_estimate_bytes(
    n: int, n_q_heads: int = HQ, n_kv_heads: int = HKV, dim: int = DIM, batch: int = 1, elem: int = 4, tiles=(512, 512)
) -> int:
    """Peak extra memory of the blockwise path: O, dO-sized buffers and grads (O(n)) + a few tiles."""
    per_q = batch * n_q_heads * n * dim * 4  # float32 math
    per_kv = batch * n_kv_heads * n * dim * 4
    tile = batch * n_q_heads * tiles[0] * tiles[1] * 4
    return 4 * per_q + 2 * per_kv + 4 * tile + 3 * batch * n_q_heads * n * 4


# ---- child: one configuration ------------------------------------------------------------


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _make_step(impl: str, layer: str, n: int):
    import torch

    from sinkflex.attention import generate_causal, generate_sliding_window
    from sinkflex.attention.blockwise import blockwise_sink_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, n, DIM, generator=gen).requires_grad_()
    k = torch.randn(1, HKV, n, DIM, generator=gen).requires_grad_()
    v = torch.randn(1, HKV, n, DIM, generator=gen).requires_grad_()
    sinks = torch.randn(HQ, generator=gen).requires_grad_()
    grad = torch.randn(1, HQ, n, DIM, generator=gen)
    scale = DIM**-0.5

    if impl in ("ours", "ours_nosink"):
        mask = generate_sliding_window(WINDOW) if layer == "sliding" else generate_causal()
        use_sinks = sinks if impl == "ours" else None

        def fn():
            return blockwise_sink_attention(q, k, v, use_sinks, mask, scale)

    elif impl == "eager":
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

        idx = torch.arange(n)
        allowed = idx[None, :] <= idx[:, None]
        if layer == "sliding":
            allowed &= idx[None, :] > idx[:, None] - WINDOW
        additive = torch.zeros(1, 1, n, n).masked_fill_(~allowed, torch.finfo(torch.float32).min)  # as eager_mask
        del allowed

        class Module(torch.nn.Module):
            num_key_value_groups = HQ // HKV

        module = Module()
        module.sinks = sinks

        def fn():
            return eager_attention_forward(module, q, k, v, additive, scaling=scale)[0].transpose(1, 2)

    elif impl == "sdpa":
        sliding_mask = None
        if layer == "sliding":
            idx = torch.arange(n)
            sliding_mask = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - WINDOW)

        def fn():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=sliding_mask, is_causal=sliding_mask is None, scale=scale, enable_gqa=True
            )

    else:
        raise ValueError(impl)

    def step():
        out = fn()
        out.backward(grad)
        for t in (q, k, v, sinks):
            t.grad = None
        del out

    return step


def _paired_sink_overhead(layer: str, n: int, repeats: int) -> dict:
    """Times ours with and without sinks alternately (ABAB…) in one process: min over repeats each."""
    with_sink, without = _make_step("ours", layer, n), _make_step("ours_nosink", layer, n)
    with_sink(), without()  # warm-up
    repeats = repeats if n <= 2048 else 2
    t_with, t_without = [], []
    for _ in range(repeats):
        for step, times in ((with_sink, t_with), (without, t_without)):
            c0 = _cpu_seconds()
            step()
            times.append(_cpu_seconds() - c0)
    return {"paired_sink_cpu_s": min(t_with), "paired_nosink_cpu_s": min(t_without)}


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads (robust to other jobs on the machine)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_child(impl: str, layer: str, n: int, repeats: int) -> dict:
    import torch

    torch.manual_seed(0)
    paired = _paired_sink_overhead(layer, n, repeats) if impl == "ours_nosink" and n <= PAIRED_MAX else {}
    _trim()
    step = _make_step(impl, layer, n)
    warm = n <= 2048
    if warm:
        step()
    _trim()
    limit = _status("VmSize") + int(CHILD_HEADROOM_GIB * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status("VmRSS")
    times, cpu = [], []
    try:
        for _ in range(repeats if n <= 2048 else 1):
            t0, c0 = time.perf_counter(), _cpu_seconds()
            step()
            times.append(time.perf_counter() - t0)
            cpu.append(_cpu_seconds() - c0)
    except (RuntimeError, MemoryError) as exc:
        return {"status": "oom", "error": str(exc).splitlines()[0][:200]}
    peak = _status("VmHWM") - base
    return {
        "status": "ok",
        "time_s": min(times),
        "cpu_s": min(cpu),
        "peak_bytes": peak,
        "repeats": len(times),
        **paired,
    }


# ---- parent: orchestration and the report ------------------------------------------------


def measure(impl: str, layer: str, n: int, repeats: int) -> dict:
    if impl == "eager" and eager_estimate_bytes(n) > EAGER_LIMIT_GIB * GIB:
        return {"status": "not_run", "est_bytes": eager_estimate_bytes(n)}
    cmd = [sys.executable, __file__, "--child", impl, layer, str(n), "--repeats", str(repeats)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # no spin-waiting: CPU seconds = work done
    proc = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env=env, cwd=Path(__file__).resolve().parents[1]
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"status": "failed", "error": f"rc={proc.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


def _fmt_mem(r: dict) -> str:
    if r["status"] == "ok":
        return f"{r['peak_bytes'] / MIB:,.0f} MiB"
    if r["status"] == "not_run":
        return f"OOM-risk, est. {r['est_bytes'] / GIB:.1f} GiB (not run)"
    return r["status"].upper()


def _fmt_time(r: dict) -> str:
    return f"{r['cpu_s']:.2f} ({r['time_s']:.1f})" if r["status"] == "ok" else "—"


def model_table() -> list[str]:
    """Analytic per-layer attention memory for gpt-oss-20b (64 q heads, 8 kv heads, d = 64), bf16, B = 1."""
    rows = [
        (
            "| tokens | eager: saved probs / layer | eager: transient peak / layer | ours: saved O + LSE / layer |"
            " ours: transient tiles | eager saved, 24 layers |"
        ),
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in (4096, 8192, 16384, 65536):
        probs = 64 * n * n * 2  # bf16 softmax output kept for backward
        transient = eager_estimate_bytes(n, n_q_heads=64, elem=2)
        saved_ours = 64 * n * 64 * 2 + 64 * n * 4
        tiles = 4 * 64 * 512 * 512 * 4
        rows.append(
            f"| {n:,} | {probs / GIB:,.1f} GiB | {transient / GIB:,.1f} GiB | {saved_ours / MIB:,.0f} MiB |"
            f" {tiles / MIB:,.0f} MiB | {24 * probs / GIB:,.0f} GiB |"
        )
    return rows


def report(results: dict, sizes: list[int], big: list[int], started: str, wall: float) -> str:
    import torch

    from sinkflex.hardware import cpu_model

    lines = [
        "# Sink attention benchmark (CPU)",
        "",
        (
            f"Generated by `benchmarks/bench_attention.py` on {started}"
            + (f" ({wall / 60:.0f} min); " if wall > 0 else " from the saved results of that run; ")
            + f"torch {torch.__version__}, {os.cpu_count()} CPU cores ({cpu_model()}), "
            "a machine shared with other jobs (timings are noisy; the ratios come from one run)."
        ),
        "",
        (
            f"One attention layer, forward + backward, float32, batch 1, {HQ} query heads, {HKV} KV head, head dim {DIM}; "
            f"sliding = causal window W = {WINDOW} (gpt-oss), full = causal. Peak memory = rise of the child process's "
            "peak RSS over its RSS with the inputs allocated (eager's n×n additive mask, shared by all layers, is built "
            "before and not counted). `ours` = blockwise CPU path with sinks, `ours_nosink` = same without sinks, "
            "`sdpa` = `torch.nn.functional.scaled_dot_product_attention` without sinks. "
            "Time = CPU seconds (user + system, all threads) of forward + backward — robust to the other jobs "
            "sharing the machine — with wall seconds in parentheses; speed ratios use CPU seconds."
        ),
        "",
    ]
    for layer in LAYERS:
        lines += [
            f"## {layer} layer",
            "",
            "| tokens | " + " | ".join(f"{i} CPU-s (wall s) | {i} peak" for i in IMPLS) + " |",
        ]
        lines.append("|---:|" + "---:|" * (2 * len(IMPLS)))
        for n in sizes + big:
            cells = []
            for impl in IMPLS:
                r = results.get((impl, layer, n))
                cells += ["—", "—"] if r is None else [_fmt_time(r), _fmt_mem(r)]
            lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Targets", ""]
    lines += _targets(results, sizes, big)
    lines += [
        "",
        "## Analytic memory model, full gpt-oss-20b shapes",
        "",
        (
            "Per attention layer and sequence (64 query heads, 8 KV heads, head dim 64, bf16). Eager keeps the "
            "softmax output for backward (n² per head per layer) and peaks at ~4 score-sized tensors in backward; "
            "ours (CPU blockwise and CUDA flex alike) keeps only O and the LSE, O(n), plus a few tiles at a time. "
            "Sliding-window layers cost eager the same n² (dense mask); ours does O(n·W) work on them. With "
            "activation checkpointing only one layer's eager n² tensors are live at a time (the 'transient peak' "
            "column); without it the saved probabilities of every layer add up (last column)."
        ),
        "",
    ]
    lines += model_table()
    lines += [
        "",
        "Eager memory model check on this machine (measured / estimated 4·Hq·N²·4 bytes):",
        "",
    ]
    for layer in LAYERS:
        checks = []
        for n in sizes:
            r = results.get(("eager", layer, n))
            if r and r["status"] == "ok":
                checks.append(f"{n:,}: {r['peak_bytes'] / eager_estimate_bytes(n):.2f}")
        lines.append(f"- {layer}: " + (", ".join(checks) or "no eager run"))
    lines += [
        "",
        "## GPU",
        "",
        (
            "`benchmarks/gpu_check.py` runs the CUDA side (compiled flex with sinks vs float64 reference and vs "
            "eager, proof that the fused kernel ran, and the paper's peak-VRAM table for a gpt-oss-20b-shaped "
            "model with fewer layers at 4096 and 8192 tokens). Not run yet: no GPU was lent to this session."
        ),
        "",
        (
            "Reproduce: `nice -n 10 .venv/bin/python benchmarks/bench_attention.py --json results.json` "
            "(add `--resume results.json` to continue, `--report-only` to rewrite this file)."
        ),
    ]
    return "\n".join(lines) + "\n"


def _targets(results: dict, sizes: list[int], big: list[int]) -> list[str]:
    out = []
    n8 = 8192
    for layer in LAYERS:
        ours8 = results.get(("ours", layer, n8), {})
        eager8 = results.get(("eager", layer, n8), {})
        if ours8.get("status") == "ok":
            if eager8.get("status") == "ok":
                ratio, how = eager8["peak_bytes"] / ours8["peak_bytes"], "measured"
            else:
                ratio, how = eager_estimate_bytes(n8) / ours8["peak_bytes"], "eager estimated (not run)"
            out.append(
                f"- peak memory eager / ours at 8192, {layer}: **{ratio:,.0f}×** ({how}); target ≥ 20: "
                f"{'met' if ratio >= 20 else 'NOT met'}"
            )
        eager_t = results.get(("eager", layer, n8), {})
        if ours8.get("status") == "ok":
            if eager_t.get("status") == "ok":
                speed, how = eager_t["cpu_s"] / ours8["cpu_s"], "measured"
            else:
                e4 = results.get(("eager", layer, 4096), {})
                if e4.get("status") != "ok":
                    continue
                speed, how = 4 * e4["cpu_s"] / ours8["cpu_s"], "eager extrapolated as 4 × its 4096 time (not run)"
            out.append(
                f"- speed eager / ours at 8192, {layer}: **{speed:.1f}×** ({how}); target ≥ 5: "
                f"{'met' if speed >= 5 else 'NOT met'}"
            )
        all_n = sizes + big
        growth = []
        for a, b in itertools.pairwise(all_n):
            ra, rb = results.get(("ours", layer, a), {}), results.get(("ours", layer, b), {})
            if b == 2 * a and ra.get("status") == "ok" and rb.get("status") == "ok":
                growth.append((a, rb["peak_bytes"] / ra["peak_bytes"]))
        if growth:
            worst = max(g for _, g in growth)
            out.append(
                f"- memory(2n)/memory(n), ours, {layer}: "
                + ", ".join(f"{a:,}→{2 * a:,}: {g:.2f}" for a, g in growth)
                + f"; target ≤ 2.2: {'met' if worst <= 2.2 else 'NOT met'}"
            )
        overheads = []
        for n in all_n:
            r = results.get(("ours_nosink", layer, n), {})
            if "paired_sink_cpu_s" in r:
                overheads.append((n, r["paired_sink_cpu_s"] / r["paired_nosink_cpu_s"] - 1))
        if overheads:
            worst = max(o for _, o in overheads)
            out.append(
                f"- sink overhead (time with / without sinks − 1, interleaved in one process), {layer}: "
                + ", ".join(f"{n:,}: {o * 100:+.0f} %" for n, o in overheads)
                + f"; target ≤ 10 %: {'met' if worst <= 0.10 else 'NOT met at every size'}"
            )
        separate = []
        for n in all_n:
            a, b = results.get(("ours", layer, n), {}), results.get(("ours_nosink", layer, n), {})
            if a.get("status") == "ok" and b.get("status") == "ok" and "paired_sink_cpu_s" not in b:
                separate.append((n, a["cpu_s"] / b["cpu_s"] - 1))
        if separate:
            out.append(
                f"- sink overhead from separate processes (noisier on a shared machine), {layer}: "
                + ", ".join(f"{n:,}: {o * 100:+.0f} %" for n, o in separate)
            )
    r64 = results.get(("ours", "full", 65536), {})
    if not r64:
        slide = results.get(("ours", "sliding", 65536), {})
        if slide.get("status") == "ok":
            out.append(
                "- full-attention layer at 65,536 tokens: **not completed in this session** (O(n²) compute, 16 × the "
                "16,384-token cost; the wall time on this shared machine ran past the deadline). Our path's memory does not depend on the mask (the same O(n) "
                f"buffers; only the visited tiles differ): the sliding layer at 65,536 peaked at "
                f"{slide['peak_bytes'] / GIB:.2f} GiB; analytic estimate for the full layer "
                f"{ours_estimate_bytes(65536) / GIB:.2f} GiB — target within 24 GiB: met by estimate, not measured"
            )
    if r64:
        ok = r64.get("status") == "ok" and r64["peak_bytes"] < 24 * GIB
        desc = (
            f"{r64['peak_bytes'] / GIB:.2f} GiB peak, {r64['cpu_s']:.0f} CPU-s"
            if r64.get("status") == "ok"
            else r64["status"]
        )
        out.append(
            f"- full-attention layer at 65,536 tokens, forward + backward: {desc}; target within 24 GiB: "
            f"{'met' if ok else 'NOT met'}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "LAYER", "N"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--big-sizes", type=int, nargs="*", default=[32768, 65536])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "bench_attention.md")
    parser.add_argument("--json", type=Path, default=None, help="also write raw results here")
    parser.add_argument("--resume", type=Path, default=None, help="reuse the results in this --json file")
    parser.add_argument("--report-only", action="store_true", help="write the table from --resume, measure nothing")
    args = parser.parse_args()
    if args.child:
        impl, layer, n = args.child
        print(json.dumps(run_child(impl, layer, int(n), args.repeats)), flush=True)
        return
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.time()
    results: dict = {}
    if args.resume and args.resume.exists():
        results = {tuple(row[:3]): row[3] for row in json.loads(args.resume.read_text())}
    # cheapest and most important first: every path up to 8192, then our path's long sequences
    # (sliding before full), then the others at the largest --sizes
    small = [n for n in args.sizes if n <= 8192]
    rest = [n for n in args.sizes if n > 8192]
    big = sorted(args.big_sizes)
    plan = [(impl, layer, n) for n in small for layer in LAYERS for impl in IMPLS]
    plan += [("ours", "sliding", n) for n in rest + big]
    plan += [(impl, layer, n) for n in rest for layer in ("full", "sliding") for impl in IMPLS]
    plan += [("ours", "full", n) for n in big]
    plan = [key for i, key in enumerate(plan) if key not in plan[:i] and key not in results]
    if args.report_only:
        plan = []
        if args.resume:
            started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(args.resume.stat().st_mtime))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for impl, layer, n in plan:
        results[(impl, layer, n)] = r = measure(impl, layer, n, args.repeats)
        print(f"{impl:12s} {layer:8s} {n:6d}  {_fmt_time(r):>9s}  {_fmt_mem(r)}", flush=True)
        if args.json:
            args.json.write_text(json.dumps([[*key, val] for key, val in results.items()], indent=1))
        args.out.write_text(report(results, args.sizes, args.big_sizes, started, time.time() - t0))  # progressive
    wall = 0.0 if args.report_only else time.time() - t0
    args.out.write_text(report(results, args.sizes, args.big_sizes, started, wall))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
