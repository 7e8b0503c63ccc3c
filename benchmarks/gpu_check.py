"""GPU check (one H200): compiled-flex sink attention — correct, really compiled, and the paper's VRAM table.

Runs on CUDA only and fails loudly (non-zero exit, message) on anything unexpected; it
never falls back silently. Parts, in order (results written to ``$OUT`` or ``--out-dir``
after each part, so a timeout still leaves the finished parts):

1. ``correctness`` — gpt-oss head geometry (64 query heads, 8 KV heads, d = 64), bf16,
   batch 2 with a left-padded row (fully masked rows), sliding-window (128) and full
   causal masks: the flex sink path against a float64 reference, outputs and gradients
   of q, k, v and the sinks; each error must be within 2× transformers' gpt-oss eager
   error in bf16; no NaN.
2. ``compiled`` — proof that the fused compiled kernel ran, not a dense fallback: the
   "flex_attention called without torch.compile" warning is turned into an error, dynamo
   must have compiled graphs, the profiler must show Triton kernels, and a 16,384-token
   forward+backward (64 heads) must stay far below the 64 GiB a dense fp32 score matrix
   would need.
3. ``shared_prefix`` — a GRPO group as one row [prefix | suffix_1 | … | suffix_G]
   (`generate_shared_prefix`, block mask from its mask_mod, built by compiled
   ``create_block_mask``), gpt-oss geometry, bf16, sinks, sliding window 128 (shorter than
   the prefix) and full causal: flex against the float64 reference on the same mask
   (outputs and gradients within 2× transformers' eager bf16 error), the reference against
   each rollout computed alone (exactly the same attention), and the block mask's sparsity
   (the suffixes never visit each other's blocks).
4. ``learner`` — the paper's table through the project's own learner: `learner_service.trainer.
   Learner` (FSDP2 over NCCL, world size 1; bf16 weights, gradients and AdamW moments; activation
   checkpointing; the chunked float32 log-probs and the GRPO loss) on gpt-oss-20b's exact layer
   shapes (`learner_service.memory_model.GPT_OSS_20B`) with ``--learner-layers`` layers, random
   weights, two learner steps of 2 rollouts × N tokens (one per micro-step, the memory model's
   step) at 4,096 and 8,192 tokens, ``attn_implementation`` "sinkflex" (compiled flex) vs "eager":
   measured peak (``torch.cuda.max_memory_allocated``: the second step's, and the forward/backward's
   read as each optimizer step begins), the second step's tokens/s, and beside them the memory
   model's prediction of the same configuration (traced: docs/gpu_memory.json, config
   "gpu_check (12 layers)"; analytic: computed here). Out-of-memory is recorded as such.
   Paper: 28.06 GB (eager) → 22.52 GB at 4,096; eager OOM at 8,192.
5. ``model`` (optional) — the same table on a bare transformers loop (no learner), ``--layers``.
6. ``kernel`` (optional, ``--kernel-bench``) — one layer, eager vs flex with / without
   sinks vs SDPA: time and peak memory at 4096..32768 tokens.

Needs: torch ≥ 2.11 with CUDA and Triton (the GPU machine: torch 2.11, CUDA 13, Python 3.12,
transformers 5.17), pydantic (carried as wheels: benchmarks/gpu_wheels.sh), run from the
repository root::

    PYTHONPATH=. python benchmarks/gpu_check.py                   # parts 1-4, ~5-8 min
    PYTHONPATH=. python benchmarks/gpu_check.py --parts learner --learner-layers 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sinkflex.attention import generate_causal, generate_padding, generate_shared_prefix, generate_sliding_window
from sinkflex.attention.flex import flex_sink_attention
from sinkflex.attention.reference import reference_sink_attention

GIB = 1024**3
HQ, HKV, DIM, WINDOW = 64, 8, 64, 128
FAILURES: list[str] = []
DEVICE = "cuda"  # "cpu" only with --dry-run-cpu (harness check: blockwise path instead of flex, tiny sizes)
DRY = {"on": False}


def sink_path(q, k, v, sinks, mask, scale):
    """The path under test: compiled flex on CUDA; the blockwise path in a CPU dry run."""
    if DRY["on"]:
        from sinkflex.attention.blockwise import blockwise_sink_attention

        return blockwise_sink_attention(q, k, v, sinks, mask, scale)
    return flex_sink_attention(q, k, v, sinks, mask, scale)[0]


def check(ok: bool, what: str) -> None:
    """Record a failed check (the script exits non-zero at the end) and print it at once."""
    print(("  ok   " if ok else "  FAIL ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def _inputs(batch: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, HQ, n, DIM, device=DEVICE, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, HKV, n, DIM, device=DEVICE, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, HKV, n, DIM, device=DEVICE, generator=gen, dtype=torch.float64)
    sinks = 2 * torch.randn(HQ, device=DEVICE, generator=gen, dtype=torch.float64)
    grad = torch.randn(batch, HQ, n, DIM, device=DEVICE, generator=gen, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, sinks, grad)]


def _out_and_grads(fn, q, k, v, sinks, grad):
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad)
    return [out.detach(), *grads]


def _eager(q, k, v, sinks, allowed):
    """transformers' gpt-oss eager attention with its additive mask (finfo.min where masked)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    class Module(torch.nn.Module):
        num_key_value_groups = HQ // HKV

    module = Module()
    module.sinks = sinks
    additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    additive.masked_fill_(~allowed, torch.finfo(q.dtype).min)
    return eager_attention_forward(module, q, k, v, additive[:, None], scaling=DIM**-0.5)[0].transpose(1, 2)


# ---- part 1 ------------------------------------------------------------------------------


def _flex_vs_eager(tag: str, mask, allowed, inputs):
    """The sink path (bf16) and eager attention (bf16) against the float64 reference on one mask:
    per output/gradient relative errors, checked flex ≤ 2 × eager. Returns (row, flex, exact)."""
    q, k, v, s, g = inputs
    exact = _out_and_grads(lambda *a, m=mask: reference_sink_attention(*a, m, DIM**-0.5)[0], q, k, v, s, g)
    low = [t.to(torch.bfloat16) for t in (q, k, v, s, g)]
    flex = _out_and_grads(lambda *a, m=mask: sink_path(*a, m, DIM**-0.5), *low)
    eager = _out_and_grads(lambda *a, al=allowed: _eager(*a, al), *low)
    row = {}
    for label, f, e, x in zip(("out", "dq", "dk", "dv", "dsinks"), flex, eager, exact, strict=True):
        err_flex = ((f.double() - x).norm() / x.norm()).item()
        err_eager = ((e.double() - x).norm() / x.norm()).item()
        row[label] = {"flex": err_flex, "eager_bf16": err_eager}
        check(bool(torch.isfinite(f).all()), f"{tag}: {label} finite")
        check(err_flex <= 2 * err_eager + 1e-6, f"{tag}: {label} rel err {err_flex:.2e} ≤ 2 × eager {err_eager:.2e}")
    return row, flex, exact


def part_correctness(results: dict) -> None:
    n, pad = (256, 40) if DRY["on"] else (1024, 100)
    key_mask = torch.ones(2, n, dtype=torch.long, device=DEVICE)
    key_mask[1, :pad] = 0  # row 1: the first `pad` queries see no key at all
    for name, base in (("sliding", generate_sliding_window(WINDOW)), ("full", generate_causal())):
        mask = base & generate_padding(attention_mask=key_mask)
        allowed = mask.dense(2, n, n, torch.device(DEVICE))
        row, flex, _ = _flex_vs_eager(f"correctness {name}", mask, allowed, _inputs(2, n, torch.float64))
        check(flex[0][1, :, :pad].abs().max().item() == 0, f"correctness {name}: fully masked rows are 0")
        results["correctness"][name] = row


# ---- part 3: shared prefix ----------------------------------------------------------------


def part_shared_prefix(results: dict) -> None:
    prefix, G, suffix = (160, 3, 48) if DRY["on"] else (2048, 4, 512)
    n = prefix + G * suffix
    seg = torch.tensor([[0] * prefix + [s + 1 for s in range(G) for _ in range(suffix)]], device=DEVICE)
    out_rows = {}
    for name, window in (("sliding", WINDOW), ("full", None)):
        mask = generate_shared_prefix(seg, window=window)
        allowed = mask.dense(1, n, n, torch.device(DEVICE))
        q, k, v, s, g = _inputs(1, n, torch.float64, seed=3)
        row, _, exact = _flex_vs_eager(f"shared_prefix {name}", mask, allowed, (q, k, v, s, g))
        # the reference on the shared row = each rollout alone (causal / window on its own positions)
        band = generate_sliding_window(window) if window else generate_causal()
        worst = 0.0
        for i in range(G):
            cols = torch.cat([torch.arange(prefix), torch.arange(prefix + i * suffix, prefix + (i + 1) * suffix)]).to(DEVICE)
            alone = reference_sink_attention(q[:, :, cols], k[:, :, cols], v[:, :, cols], s, band, DIM**-0.5)[0]
            worst = max(worst, (alone - exact[0][:, :, cols]).abs().max().item())
        row["alone_vs_shared_max_abs_fp64"] = worst
        check(worst <= 1e-10, f"shared_prefix {name}: shared row = each rollout alone (fp64 max |Δ| {worst:.1e})")
        if not DRY["on"]:
            from sinkflex.attention.flex import block_mask_for

            bm = block_mask_for(mask, 1, n, n, torch.device(DEVICE))
            row["block_mask_sparsity"] = float(bm.sparsity())
            dense_causal = block_mask_for(generate_causal(), 1, n, n, torch.device(DEVICE))
            check(bm.sparsity() > dense_causal.sparsity(),
                  f"shared_prefix {name}: block mask sparsity {bm.sparsity():.1f}% > causal {dense_causal.sparsity():.1f}%")
        out_rows[name] = row
    results["shared_prefix"] = {"prefix": prefix, "G": G, "suffix": suffix, **out_rows}


# ---- part 2 ------------------------------------------------------------------------------


def part_compiled(results: dict) -> None:
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    n = 16384
    q, k, v, s, g = _inputs(1, n, torch.bfloat16, seed=1)
    leaves = [t.requires_grad_() for t in (q, k, v, s)]
    mask = generate_causal()
    flex_sink_attention(*leaves, mask, DIM**-0.5)[0].backward(g)  # compile outside the measurement
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = flex_sink_attention(*leaves, mask, DIM**-0.5)[0]
        out.backward(g)
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    kernels = sorted({e.key for e in prof.key_averages() if e.device_type.name == "CUDA"})
    triton = [name for name in kernels if "triton" in name.lower()]
    flex_named = [name for name in triton if "flex" in name.lower() or "triton_tem" in name.lower()]
    graphs = int(counters["stats"]["unique_graphs"])
    results["compiled"] = {
        "tokens": n,
        "peak_extra_gib": peak / GIB,
        "dense_scores_would_be_gib": HQ * n * n * 4 / GIB,
        "dynamo_unique_graphs": graphs,
        "triton_kernels": triton[:20],
        "all_cuda_kernels": kernels[:40],
    }
    check(graphs > 0, f"compiled: dynamo compiled {graphs} graph(s)")
    check(len(triton) > 0, f"compiled: {len(triton)} Triton kernels ran (e.g. {triton[:2]})")
    check(len(flex_named) > 0, f"compiled: a flex template kernel ran ({flex_named[:2]})")
    check(
        peak < 4 * GIB, f"compiled: 16k-token fwd+bwd peak {peak / GIB:.2f} GiB ≪ dense {HQ * n * n * 4 / GIB:.0f} GiB"
    )


# ---- part 5: a bare transformers loop -------------------------------------------------------


def _gpt_oss_20b_config(layers: int):
    from transformers import GptOssConfig

    tiny = DRY["on"]
    return GptOssConfig(
        num_hidden_layers=layers,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        hidden_size=64 if tiny else 2880,
        intermediate_size=64 if tiny else 2880,
        num_attention_heads=HQ,
        num_key_value_heads=HKV,
        head_dim=DIM,
        num_local_experts=4 if tiny else 32,
        num_experts_per_tok=2 if tiny else 4,
        vocab_size=1000 if tiny else 201088,
        sliding_window=WINDOW,
        max_position_embeddings=131072,
        use_cache=False,
    )


def _train_step_peak(model, impl: str, n: int) -> dict:
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.config.vocab_size, (1, n), device=DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    try:
        t0 = time.perf_counter()
        for _ in range(2):  # the first step allocates the optimizer state, the second is steady
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        row = {
            "status": "ok",
            "loss": loss.item(),
            "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
            "two_steps_s": time.perf_counter() - t0,
        }
    except torch.OutOfMemoryError as exc:
        row = {
            "status": "OOM",
            "error": str(exc).splitlines()[0][:200],
            "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
        }
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
    return row


def part_model(results: dict, layers: int, sizes: list[int], experts: str) -> None:
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = GptOssForCausalLM._from_config(
            _gpt_oss_20b_config(layers), dtype=torch.bfloat16, experts_implementation=experts
        )
    model.train()
    params = sum(p.numel() for p in model.parameters())
    results["model"] = {"layers": layers, "params_b": params / 1e9, "experts_implementation": experts, "runs": {}}
    print(f"  model: {layers} layers, {params / 1e9:.2f} B parameters", flush=True)
    with torch.no_grad():  # same logits on a short input: both paths compute the same model
        ids = torch.randint(0, model.config.vocab_size, (1, 512), device=DEVICE)
        model.set_attn_implementation("eager")
        eager_logits = model(input_ids=ids).logits.float()
        model.set_attn_implementation("sinkflex")
        ours_logits = model(input_ids=ids).logits.float()
        rel = ((ours_logits - eager_logits).norm() / eager_logits.norm()).item()
    results["model"]["logits_rel_diff_512"] = rel
    check(rel < 5e-2, f"model: sinkflex vs eager logits rel diff {rel:.2e} (bf16)")
    for n in sizes:
        for impl in ("sinkflex", "eager"):
            row = _train_step_peak(model, impl, n)
            results["model"]["runs"][f"{impl}@{n}"] = row
            print(f"  model {impl:8s} {n:6d}: {row}", flush=True)
            if impl == "sinkflex":
                check(row["status"] == "ok", f"model: sinkflex training step at {n} tokens runs")


# ---- part 4: the learner ------------------------------------------------------------------


def _learner_arch(layers: int) -> dict:
    from learner_service.memory_model import GPT_OSS_20B

    arch = dict(GPT_OSS_20B, num_hidden_layers=layers, layer_types=GPT_OSS_20B["layer_types"][:layers])
    if DRY["on"]:  # toy widths, same structure
        arch.update(hidden_size=64, intermediate_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                    num_local_experts=8, vocab_size=1000, sliding_window=16)
    return arch


def _learner_steps(arch: dict, n: int, attention: str, out_dir: Path) -> dict:
    """Two learner steps (2 rollouts of n tokens each, one per micro-step) of a fresh Learner:
    the peak over both, the second step's tokens/s."""
    from learner_service.memory_model import learner_config, synthetic_group
    from learner_service.trainer import Learner

    cfg = learner_config(arch, n, attention).model_copy(update={"run_dir": str(out_dir / "learner")})
    learner = None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        learner = Learner(cfg, device=torch.device(DEVICE), metrics=False)
        before_step: list[float] = []  # the forward/backward peak, read as each optimizer step begins
        learner.optimizer.register_step_pre_hook(lambda *_: before_step.append(torch.cuda.max_memory_allocated() / 1e9))
        base = torch.cuda.max_memory_allocated()
        t0 = time.perf_counter()
        metrics = [learner.train_step([synthetic_group(f"gc-{attention}-{n}-{s}", 2, n, min(64, n // 4), arch["vocab_size"], s)])
                   for s in range(2)]
        torch.cuda.synchronize()
        row = {
            "status": "ok",
            "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
            "peak_before_optimizer_gb": max(before_step, default=0.0),  # forward/backward (the learner resets per step)
            "peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
            "after_build_gb": base / 1e9,
            "tokens_per_s": metrics[-1]["tokens_per_s"],
            "step_seconds": [m["step_seconds"] for m in metrics],
            "optimizer_steps": sum(m["optimizer_steps"] for m in metrics),
            "loss": metrics[-1]["loss"],
            "two_steps_s": time.perf_counter() - t0,
        }
    except torch.OutOfMemoryError as exc:
        row = {"status": "OOM", "error": str(exc).splitlines()[0][:200], "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9}
    finally:
        if learner is not None:
            learner.optimizer.zero_grad(set_to_none=True)
        del learner
        gc.collect()
        torch.cuda.empty_cache()
    return row


def part_learner(results: dict, layers: int, sizes: list[int], out_dir: Path) -> None:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from learner_service.memory_model import analytic_peak, param_counts

    if not dist.is_initialized():  # FSDP2 over NCCL (gloo in the CPU dry run), world size 1
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    arch = _learner_arch(layers)
    root, per_layer, _, _ = param_counts(arch)
    results["learner"] = {"layers": layers, "params_b": (root + sum(per_layer)) / 1e9, "gpus": 1, "runs": {}}
    print(f"  learner: {layers} layers of gpt-oss-20b, {(root + sum(per_layer)) / 1e9:.2f} B parameters", flush=True)
    graphs_before = int(counters["stats"]["unique_graphs"])
    table = Path(__file__).resolve().parents[1] / "docs" / "gpu_memory.json"  # the memory model's traced rows
    predicted = {(r["seq_len"], r["attention"]): r for r in (json.loads(table.read_text())["rows"] if table.exists() else [])
                 if r["config"] == f"gpu_check ({layers} layers)" and r["gpus"] == 1}
    for n in sizes:
        for attention in ("sinkflex", "eager"):
            row = _learner_steps(arch, n, attention, out_dir)
            a_peak, a_parts, a_phase = analytic_peak(arch, n, 1, attention)
            row.update(analytic_peak_gb=a_peak / 1e9, analytic_phase=a_phase)
            if (n, attention) in predicted and row["status"] == "ok" and row["peak_allocated_gb"] > 0:
                p = predicted[(n, attention)]
                row.update(predicted_peak_gb=p["predicted_peak_gb"], predicted_phase_peaks_gb=p.get("phase_peaks_gb"),
                           predicted_vs_measured=p["predicted_peak_gb"] / row["peak_allocated_gb"] - 1)
            if row["status"] == "ok" and row["peak_allocated_gb"] > 0:  # (0 in the CPU dry run: no CUDA counters)
                row["analytic_vs_measured"] = a_peak / (row["peak_allocated_gb"] * 1e9) - 1
            results["learner"]["runs"][f"{attention}@{n}"] = row
            print(f"  learner {attention:8s} {n:6d}: {row}", flush=True)
            if attention == "sinkflex":
                check(row["status"] == "ok", f"learner: sinkflex GRPO step at {n} tokens runs")
                check(row["status"] != "ok" or row["optimizer_steps"] == 2, f"learner: sinkflex at {n} took 2 optimizer steps")
    if not DRY["on"]:
        graphs = int(counters["stats"]["unique_graphs"]) - graphs_before
        results["learner"]["dynamo_graphs"] = graphs
        check(graphs > 0, f"learner: the sink path compiled {graphs} graph(s) (compiled flex ran inside the learner)")


# ---- part 6 ------------------------------------------------------------------------------


def part_kernel(results: dict, sizes: list[int]) -> None:
    def timed(fn, leaves, g, repeats=5):
        for _ in range(2):
            fn(*leaves).backward(g)
        torch.cuda.synchronize()
        for t in leaves:
            t.grad = None
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*leaves).backward(g)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            for t in leaves:
                t.grad = None
        return {"time_s": sorted(times)[len(times) // 2], "peak_gib": (torch.cuda.max_memory_allocated() - base) / GIB}

    rows = {}
    for layer, mask in (("sliding", generate_sliding_window(WINDOW)), ("full", generate_causal())):
        for n in sizes:
            q, k, v, s, g = _inputs(1, n, torch.bfloat16, seed=2)
            leaves = [t.requires_grad_() for t in (q, k, v, s)]
            impls = {
                "flex_sink": lambda q, k, v, s, m=mask: flex_sink_attention(q, k, v, s, m, DIM**-0.5)[0],
                "flex_nosink": lambda q, k, v, s, m=mask: (
                    flex_sink_attention(q, k, v, None, m, DIM**-0.5)[0] + 0 * s.sum()
                ),
            }
            if layer == "full":
                impls["sdpa_nosink"] = lambda q, k, v, s: (
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    + 0 * s.sum()
                )
            if 4 * HQ * n * n * 2 < 60 * GIB:
                allowed = mask.dense(1, n, n, torch.device("cuda"))
                impls["eager"] = lambda q, k, v, s, al=allowed: _eager(q, k, v, s, al)
            for name, fn in impls.items():
                try:
                    rows[f"{layer}/{name}@{n}"] = timed(fn, leaves, g)
                except torch.OutOfMemoryError:
                    rows[f"{layer}/{name}@{n}"] = {"status": "OOM"}
                gc.collect()
                torch.cuda.empty_cache()
                print(f"  kernel {layer:7s} {name:11s} {n:6d}: {rows[f'{layer}/{name}@{n}']}", flush=True)
    results["kernel"] = rows


# ---- main --------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        nargs="*",
        default=["correctness", "compiled", "shared_prefix", "learner"],
        choices=["correctness", "compiled", "shared_prefix", "learner", "model", "kernel"],
    )
    parser.add_argument("--learner-layers", type=int, default=12,
                        help="gpt-oss-20b layers in the learner part (12: 11 B parameters, about 110 GB of bf16 state on one GPU)")
    parser.add_argument("--kernel-bench", action="store_true", help="also run part 4 (kernel)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="*", default=[4096, 8192])
    parser.add_argument("--kernel-sizes", type=int, nargs="*", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--experts", default="eager", help="transformers experts_implementation for the model part")
    parser.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", "gpu_results")))
    parser.add_argument("--dry-run-cpu", action="store_true", help="check the harness on CPU (no flex, tiny sizes)")
    args = parser.parse_args()
    if args.dry_run_cpu:
        global DEVICE
        DEVICE, DRY["on"] = "cpu", True
        args.parts = [p for p in args.parts if p in ("correctness", "shared_prefix", "learner", "model")]
        args.layers, args.learner_layers, args.sizes = 2, 2, [256]
        for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
            setattr(torch.cuda, name, lambda *a, **k: None)
        torch.cuda.max_memory_allocated = torch.cuda.max_memory_reserved = lambda *a, **k: 0
    elif not torch.cuda.is_available():
        print("FAIL: CUDA is not available; this script only runs on a GPU", file=sys.stderr)
        return 2
    # the uncompiled flex path (a dense fallback) must never run silently
    warnings.filterwarnings("error", message=".*flex_attention called without torch.compile.*")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True

    import sinkflex.attention

    sinkflex.attention.register()
    parts = list(args.parts) + (["kernel"] if args.kernel_bench and "kernel" not in args.parts else [])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "device": "cpu (dry run)" if DRY["on"] else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "correctness": {},
    }
    for part in parts:
        print(f"== {part}", flush=True)
        t0 = time.perf_counter()
        try:
            if part == "correctness":
                part_correctness(results)
            elif part == "compiled":
                part_compiled(results)
            elif part == "shared_prefix":
                part_shared_prefix(results)
            elif part == "learner":
                part_learner(results, args.learner_layers, args.sizes, args.out_dir)
            elif part == "model":
                part_model(results, args.layers, args.sizes, args.experts)
            elif part == "kernel":
                part_kernel(results, args.kernel_sizes)
        except Exception as exc:  # noqa: BLE001 — a crash is a failed check, reported with its traceback
            traceback.print_exc()
            check(False, f"{part}: raised {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        results.setdefault("seconds", {})[part] = time.perf_counter() - t0
        results["failures"] = FAILURES
        (args.out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results, indent=1, default=str))
    if FAILURES:
        print(f"\n{len(FAILURES)} check(s) FAILED:\n  " + "\n  ".join(FAILURES), file=sys.stderr)
        return 1
    print("\nall GPU checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
