"""Learner throughput and memory against a plain transformers forward+backward, side by side.

    .venv/bin/python benchmarks/bench_learner.py            # CPU cases, table to docs/bench_learner.md
    .venv/bin/python benchmarks/bench_learner.py --quick    # smaller batches (smoke run)

For each case (a model and a batch of rollouts), one process builds the model once and
runs the three modes alternately, step by step (A B C A B C ...: load drift on a shared
machine hits all of them alike), one warm-up step each, then `--steps` timed steps each:

- ``learner``: `Learner.train_step(groups)` — batching, tempered log-probs, GRPO loss
  (eqs. 4–7), entropy and clip metrics, gradient clipping, AdamW, scheduler;
- ``plain``: the same model object built the same way (same attention, gradient
  checkpointing, micro-batches), ``loss = cross_entropy(logits, targets)`` + backward +
  AdamW — the cost floor of a training step on these tokens;
- ``plain-default``: as ``plain`` but with transformers' default attention for the model
  (eager for gpt-oss: its only exact route with sinks; sdpa for Llama).

tokens/s counts the trained positions (padding excluded) per second of wall time. Peak
memory per mode: on CUDA, torch.cuda.max_memory_allocated; on CPU, the process's peak
RSS (VmHWM), reset before each step through /proc/self/clear_refs. All three modes share
the model, its gradients and the AdamW state, so peak differences are the step's own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GPT_OSS_MINI = dict(
    model_type="gpt_oss", vocab_size=8192, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=1, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=8192,
    rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048, rope_theta=150000.0,
                         beta_fast=32.0, beta_slow=1.0),
)
#: gpt-oss-20b's layer geometry (64 q heads, 8 KV heads, head dim 64, hidden 2880, window
#: 128) with fewer layers and experts, for a GPU run.
GPT_OSS_20B_SHAPED = dict(
    GPT_OSS_MINI, vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=4,
    num_attention_heads=64, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=4,
    max_position_embeddings=131072,
    rope_parameters=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096, rope_theta=150000.0,
                         beta_fast=32.0, beta_slow=1.0),
)


def cases(quick: bool, cuda: bool) -> dict[str, dict]:
    """name -> model source, rollouts, tokens per rollout, prompt tokens, micro-batch size."""
    if cuda:
        return {
            "gpt-oss-20b-shaped, 4 layers, 2 x 4096 tok": dict(arch=GPT_OSS_20B_SHAPED, n=2, T=4096, prompt=512, micro=1),
            "gpt-oss-20b-shaped, 4 layers, 2 x 8192 tok": dict(arch=GPT_OSS_20B_SHAPED, n=2, T=8192, prompt=512, micro=1),
        }
    from sinkflex.models import default_model_dir, is_prepared

    out = {
        "gpt-oss-mini (4 layers, sinks, 8q/1kv heads), 4 x 1024 tok": dict(arch=GPT_OSS_MINI, n=4, T=512 if quick else 1024, prompt=128, micro=2),
    }
    smol = default_model_dir("smollm2")
    if is_prepared(smol):
        out["SmolLM2-135M, 4 x 256 tok"] = dict(path=str(smol), n=4, T=128 if quick else 256, prompt=64, micro=2)
    return out


def make_groups(n: int, T: int, prompt: int, vocab: int, seed: int = 0):
    import torch

    from sinkflex.api.common.v1 import common_pb2

    g = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(0, n, 4):
        group = common_pb2.TrajectoryGroup(group_id=f"bench-{seed}-{k}")
        for i in range(min(4, n - k)):
            ids = torch.randint(0, vocab, (T,), generator=g).tolist()
            mask = [0] * prompt + [1] * (T - prompt)
            group.trajectories.add(trajectory_id=f"{k}-{i}", token_ids=ids, loss_mask=mask,
                                   logprobs=[-9.0 if m else 0.0 for m in mask], reward=float(i % 2))
        groups.append(group)
    return groups


def _status_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20  # kB -> GiB
    raise KeyError(field)


def reset_peak() -> None:
    """Resets the peak (CUDA allocator, or the process's VmHWM via /proc/self/clear_refs)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_gib() -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    return _status_gib("VmHWM")


def worker(case: dict, steps: int) -> dict:
    """One process, one model: the modes alternate step by step (A B C A B C ...), so that
    load drift on a shared machine hits all of them alike; the peak memory is reset before
    each step and read after it."""
    import torch
    import torch.nn.functional as F

    from learner_service.batch import micro_batches, num_micro_steps, pack, rollouts_from_group
    from learner_service.config import LearnerConfig
    from learner_service.trainer import Learner

    model = dict(path=case["path"]) if "path" in case else dict(arch=case["arch"])
    default_attn = "eager" if case.get("arch", {}).get("model_type") == "gpt_oss" else "sdpa"
    cfg = LearnerConfig.model_validate(dict(
        run_dir="/tmp/bench_learner", model=model, tensorboard=False,
        optim=dict(lr=1e-6), batch=dict(groups_per_step=99, micro_batch_size=case["micro"]),
    ))
    learner = Learner(cfg, metrics=False)
    vocab = learner.model.config.vocab_size
    positions = case["n"] * (case["T"] - 1)

    def plain_step(groups):
        rollouts = [r for g in groups for r in rollouts_from_group(g)[0]]
        idx = list(range(len(rollouts)))
        n_tok = float(sum(int(r.mask_T.sum()) for r in rollouts))
        for mb in micro_batches(idx, case["micro"], num_micro_steps(len(idx), case["micro"])):
            b = pack(rollouts, mb).to(learner.device)
            logits = learner.model(input_ids=b.input_ids_BT, use_cache=False).logits
            nll = F.cross_entropy(logits.flatten(0, 1).float(), b.target_ids_BT.flatten(), reduction="none")
            (nll * b.mask_BT.flatten()).sum().div(n_tok).backward()
            del logits, nll
        torch.nn.utils.clip_grad_norm_(learner.model.parameters(), 1.0)
        learner.optimizer.step()
        learner.optimizer.zero_grad(set_to_none=True)

    def run(mode: str, groups) -> tuple[float, float]:
        learner.model.set_attn_implementation(default_attn if mode == "plain-default" else cfg.model.attn_implementation)
        reset_peak()
        t0 = time.perf_counter()
        (learner.train_step if mode == "learner" else plain_step)(groups)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0, peak_gib()

    modes = ("learner", "plain", "plain-default")
    times: dict[str, list[float]] = {m: [] for m in modes}
    peaks: dict[str, float] = {m: 0.0 for m in modes}
    for s in range(steps + 1):  # step 0: warm-up, not timed
        for m in modes:
            dt, pk = run(m, make_groups(case["n"], case["T"], case["prompt"], vocab, seed=s))
            peaks[m] = max(peaks[m], pk)
            if s > 0:
                times[m].append(dt)
    return {m: {"tokens_per_s": positions * steps / sum(times[m]), "step_s": sum(times[m]) / steps, "peak_gib": peaks[m]}
            for m in modes}


def run_case(name: str, case: dict, steps: int, threads: int) -> dict[str, dict]:
    cmd = [sys.executable, __file__, "--worker", "--case", json.dumps(case), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        err = {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:120]}
        return {m: err for m in ("learner", "plain", "plain-default")}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"[{name}] {res}", file=sys.stderr, flush=True)
    return res


def table(results: dict[str, dict[str, dict]], cuda: bool) -> str:
    mem = "peak GPU GiB" if cuda else "peak RSS GiB"
    lines = [
        f"| case | learner tok/s | plain fwd+bwd tok/s (same attention) | **ratio** | plain, transformers default attention tok/s | learner {mem} | plain {mem} | default-attn {mem} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def fmt_mem(r):
        if "error" in r:
            return r["error"]
        return f"{r['peak_gib']:.2f}"

    for name, res in results.items():
        lrn, pl, dflt = res["learner"], res["plain"], res["plain-default"]
        ratio = lrn["tokens_per_s"] / pl["tokens_per_s"] if "error" not in lrn and "error" not in pl else float("nan")
        tok = lambda r: f"{r['tokens_per_s']:.0f}" if "error" not in r else r["error"]  # noqa: E731
        lines.append(f"| {name} | {tok(lrn)} | {tok(pl)} | **{ratio:.2f}** | {tok(dflt)} | {fmt_mem(lrn)} | {fmt_mem(pl)} | {fmt_mem(dflt)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker (1: stable on a shared machine)")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_learner.md"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        print(json.dumps(worker(json.loads(args.case), args.steps)))
        return
    import torch

    cuda = torch.cuda.is_available()
    results = {name: run_case(name, c, args.steps, args.threads) for name, c in cases(args.quick, cuda).items()}
    device = torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores ({platform.processor() or platform.machine()})"
    load = os.getloadavg()
    body = table(results, cuda)
    print(body)
    header = (
        f"## {'GPU' if cuda else 'CPU'}: {device}, torch {torch.__version__}, fp{'16 (bf16)' if cuda else '32'}\n\n"
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.steps} timed steps per mode after one warm-up, "
        f"modes alternating step by step in one process, {args.threads} CPU thread(s); load average at the end {load[0]:.1f} (shared machine).\n\n"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    intro = "" if out.exists() else (Path(__file__).read_text().split('"""')[1].strip().replace("\n\n", "\n\n", 1) + "\n\n")
    with open(out, "a") as f:
        f.write(("# Learner benchmark\n\n" + intro if intro else "") + header + body + "\n\n")


if __name__ == "__main__":
    main()
