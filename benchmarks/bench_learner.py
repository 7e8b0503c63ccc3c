"""Learner throughput and memory: shared-prefix groups, bf16 autocast and a bare transformers loop, side by side.

    .venv/bin/python benchmarks/bench_learner.py --threads 2 --subset 2   # CPU cases -> docs/bench_learner.md + .json
    .venv/bin/python benchmarks/bench_learner.py --quick --threads 2      # small workloads (smoke run)
    .venv/bin/python benchmarks/bench_learner.py --render-only            # the page again from the JSON

Every mode runs `--warmup-rounds` (default 1) full-size rounds before its `--steps` timed ones:
the first step at a workload's size pays one-off costs (on 2026-12-03 retail unshared_fp32 took
141 s in round 1 and 91 s in round 2), which would otherwise count against whichever mode runs
first. Warm-up rounds are recorded (`step_s_rounds`) but not counted. The page's generated block
lies between two HTML comments; the hand-written text around it is kept, and so are the
--mismatch run's figures in the JSON.

One process per model (SmolLM2-135M, gpt-oss-mini) builds one `Learner` and runs every
mode on the same model and the same tokens, alternating mode by mode within each round
(load drift on a shared machine hits all of them alike):

- ``unshared_fp32``: today's step — one padded row per rollout, fp32 (``batch.shared_prefix``
  off, ``model.dtype float32``); ``unshared_auto``: the same rows under ``dtype auto``;
- ``shared_fp32``: the group as one row [prefix | suffix_1 | … | suffix_G] (the prompt computed
  once), fp32; ``shared_auto``: shared rows with ``dtype auto`` (bf16 autocast on AMX CPUs);
- ``bare_fp32`` / ``bare_bf16``: a bare transformers loop on the unshared rows —
  ``model(ids).logits`` with the model's default attention (sdpa for Llama, eager for
  gpt-oss, its only exact path with sinks), cross-entropy over every position, backward,
  no optimiser, no gradient checkpointing; bf16 = ``torch.autocast(bfloat16)``;
- ``unshared_fp32_no_ckpt`` (mock-shaped workload only): ``unshared_fp32`` with gradient
  checkpointing off, to see how much of the gap it is.

Every learner mode is a full `Learner.train_step` (GRPO loss, metrics, grad clipping,
AdamW). Workloads: retail-shaped groups (prefix 5,000 tokens, G = 8 suffixes of 600) and
mock-shaped (prefix 800, G = 8 × 200); the prefix has loss mask 0, suffixes 1.
Effective tokens/s = the rollouts' full lengths summed, per second of wall time. Peak
memory per mode: the process's peak RSS (VmHWM, reset before each step through
/proc/self/clear_refs) on CPU; torch.cuda.max_memory_allocated on CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
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


WORKLOADS = {"retail": dict(prefix=5000, G=8, suffix=600), "mock": dict(prefix=800, G=8, suffix=200)}
QUICK_WORKLOADS = {"retail": dict(prefix=1000, G=4, suffix=120), "mock": dict(prefix=200, G=4, suffix=50)}


def cases(quick: bool) -> dict[str, dict]:
    """name -> model source (the workloads run inside each model's worker)."""
    from sinkflex.models import default_model_dir, is_prepared

    out = {}
    smol = default_model_dir("smollm2")
    if is_prepared(smol):
        out["SmolLM2-135M"] = dict(path=str(smol))
    out["gpt-oss-mini"] = dict(arch=GPT_OSS_MINI)
    return out


def make_group(prefix: int, G: int, suffix: int, vocab: int, seed: int = 0, tag: str = ""):
    """One group: a shared random prefix (mask 0), G random suffixes (mask 1, engine log-prob −9)."""
    import torch

    from sinkflex.api.common.v1 import common_pb2

    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, vocab, (prefix,), generator=g).tolist()
    group = common_pb2.TrajectoryGroup(group_id=f"bench-{seed}-{prefix}-{G}-{suffix}-{tag}")  # tag: a new id per step
    for i in range(G):
        tail = torch.randint(0, vocab, (suffix,), generator=g).tolist()
        mask = [0] * prefix + [1] * suffix
        group.trajectories.add(trajectory_id=f"{seed}-{i}", token_ids=head + tail, loss_mask=mask,
                               logprobs=[-9.0 if m else 0.0 for m in mask], reward=float(i % 2))
    return group


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


MODES = ("unshared_fp32", "unshared_auto", "shared_fp32", "shared_auto", "bare_fp32", "bare_bf16")


def worker(case: dict, steps: int, quick: bool, only: list[str] | None, subset: int | None = None,
           workloads_wanted: list[str] | None = None) -> list[dict]:
    """One process, one model, every workload and mode (module docstring); returns the raw rows."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from learner_service.batch import pack, rollouts_from_group
    from learner_service.config import LearnerConfig
    from learner_service.model import Precision, resolve_precision
    from learner_service.trainer import Learner

    model = dict(path=case["path"]) if "path" in case else dict(arch=case["arch"])
    gpt_oss = case.get("arch", {}).get("model_type") == "gpt_oss"
    default_attn = "eager" if gpt_oss else "sdpa"
    cfg = LearnerConfig.model_validate(dict(
        run_dir="/tmp/bench_learner", model=dict(model, dtype="float32"), tensorboard=False,
        optim=dict(lr=1e-6), batch=dict(groups_per_step=99, micro_batch_size=8),
    ))
    learner = Learner(cfg, metrics=False)
    auto = resolve_precision(cfg.model.model_copy(update={"dtype": "auto"}), learner.device)
    fp32 = Precision(torch.float32, None, "benchmark fp32")
    vocab = learner.model.config.vocab_size

    def bare_step(groups, bf16: bool):
        rollouts = [r for g in groups for r in rollouts_from_group(g)[0]]
        learner.model.gradient_checkpointing_disable()
        learner.model.set_attn_implementation(default_attn)
        try:
            for i in range(len(rollouts)):  # one rollout per forward (memory without checkpointing)
                b = pack(rollouts, [i]).to(learner.device)
                ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
                with ctx:
                    logits = learner.model(input_ids=b.input_ids_BT, use_cache=False).logits
                F.cross_entropy(logits.flatten(0, 1).float(), b.target_ids_BT.flatten()).backward()
                del logits
            learner.model.zero_grad(set_to_none=True)
        finally:
            learner.model.set_attn_implementation(cfg.model.attn_implementation)
            learner.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def learner_step(groups, shared: bool, precision, ckpt: bool = True):
        learner.shared_prefix = shared
        learner.precision = precision
        # shared rows hold a whole group (micro_batch_size G); unshared rows 2 rollouts per forward
        learner.cfg = cfg.model_copy(update={"batch": cfg.batch.model_copy(update={"micro_batch_size": 8 if shared else 2})})
        if not ckpt:
            learner.model.gradient_checkpointing_disable()
        try:
            return learner.train_step(groups)
        finally:
            if not ckpt:
                learner.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def run(mode: str, groups):
        reset_peak()
        t0 = time.perf_counter()
        metrics = {}
        if mode.startswith("bare"):
            bare_step(groups, bf16=mode == "bare_bf16")
        else:
            metrics = learner_step(groups, mode.startswith("shared"), auto if mode.endswith("auto") else fp32,
                                   ckpt=not mode.endswith("no_ckpt"))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0, peak_gib(), metrics

    rows = []
    workloads = QUICK_WORKLOADS if quick else WORKLOADS
    for m in ("unshared_fp32", "shared_auto", "bare_fp32", "bare_bf16"):
        run(m, [make_group(64, 2, 16, vocab, seed=99, tag=m)])  # warm-up: allocator, thread pools, kernels (not timed)
    for wname, w in workloads.items():
        if workloads_wanted and wname not in workloads_wanted:
            continue
        modes = list(MODES) + (["unshared_fp32_no_ckpt"] if wname == "mock" else [])
        modes = [m for m in modes if not only or m in only]
        times: dict[str, list[float]] = {m: [] for m in modes}
        peaks = {m: 0.0 for m in modes}
        last: dict[str, dict] = {}
        for s in range(steps):
            for m in modes:
                # unshared and bare modes cost the same per rollout (one row each): optionally timed on a subset
                G = w["G"] if m.startswith("shared") or not subset else min(subset, w["G"])
                eff = G * (w["prefix"] + w["suffix"])
                dt, pk, met = run(m, [make_group(w["prefix"], G, w["suffix"], vocab, seed=s, tag=m)])
                times[m].append(dt)
                peaks[m] = max(peaks[m], pk)
                last[m] = met
                print(f"[{case.get('path', 'gpt-oss-mini')}] {wname} {m}: {dt:.1f} s, {eff / dt:.0f} tok/s, "
                      f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        for m in modes:
            met = last[m]
            G = w["G"] if m.startswith("shared") or not subset else min(subset, w["G"])
            eff = G * (w["prefix"] + w["suffix"])
            rows.append(dict(
                workload=wname, mode=m, prefix=w["prefix"], G=w["G"], timed_rollouts=G, suffix=w["suffix"], steps=steps,
                effective_tokens=eff, step_s=sum(times[m]) / steps, step_s_rounds=[round(t, 2) for t in times[m]], tokens_per_s=eff * steps / sum(times[m]),
                peak_gib=peaks[m], precision=(auto.describe() if m.endswith("auto") else "fp32" if not m.startswith("bare")
                                              else ("bf16 autocast" if m == "bare_bf16" else "fp32")),
                logprob_mismatch_mean=met.get("logprob_mismatch_mean"), logprob_mismatch_max=met.get("logprob_mismatch_max"),
                positions_computed=met.get("positions_computed"), shared_prefix_rows=met.get("shared_prefix_rows"),
                load_avg=os.getloadavg()[0],
            ))
            print("ROW " + json.dumps(rows[-1]), flush=True)  # a later crash (e.g. OOM) keeps the finished rows
    return rows


def mismatch_worker(engine_dtype: str, path: str, G: int = 4, new_tokens: int = 96) -> list[dict]:
    """Engine/learner log-prob mismatch on real rollouts: the project's vLLM `Engine` (dtype
    `engine_dtype`) samples G completions of a chat prompt; a fp32 and a dtype-auto `Learner`
    each take their first step on them; rows hold logprob_mismatch_mean / _max (loss-mask tokens)."""
    import torch
    from transformers import AutoTokenizer

    from learner_service.config import LearnerConfig
    from learner_service.trainer import Learner
    from rollout_service.engine import Engine, Sampling
    from sinkflex.api.common.v1 import common_pb2

    tok = AutoTokenizer.from_pretrained(path)
    msgs = [{"role": "system", "content": "You are a helpful retail customer-service agent."},
            {"role": "user", "content": "Hi, I want to return the hiking boots from my last order. How do I do that?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)  # BatchEncoding (a Mapping) or ids
    engine = Engine(path, dtype=engine_dtype, max_model_len=1024, kv_cache_gib=0.5)
    gens = [engine.run(engine.generate(prompt, Sampling(temperature=1.0, seed=100 + i, max_new_tokens=new_tokens),
                                       min_tokens=new_tokens)) for i in range(G)]
    resolved = engine.dtype
    engine.shutdown()
    rows = []
    for ldtype in ("float32", "auto"):
        group = common_pb2.TrajectoryGroup(group_id=f"mismatch-{engine_dtype}-{ldtype}")
        for i, g in enumerate(gens):
            group.trajectories.add(trajectory_id=str(i), token_ids=prompt + list(g.token_ids),
                                   logprobs=[0.0] * len(prompt) + list(g.logprobs),
                                   loss_mask=[0] * len(prompt) + [1] * len(g.token_ids), reward=float(i % 2))
        cfg = LearnerConfig.model_validate(dict(run_dir="/tmp/bench_learner_mm", model=dict(path=path, dtype=ldtype),
                                                tensorboard=False, optim=dict(lr=1e-6), batch=dict(micro_batch_size=G)))
        learner = Learner(cfg, metrics=False)
        m = learner.train_step([group])
        rows.append(dict(engine_dtype=resolved, learner=learner.precision.describe(), tokens=G * new_tokens,
                         logprob_mismatch_mean=m["logprob_mismatch_mean"], logprob_mismatch_max=m["logprob_mismatch_max"]))
        del learner
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return rows


def run_case(name: str, case: dict, steps: int, threads: int, quick: bool, only: list[str] | None,
             subset: int | None = None, workloads: list[str] | None = None) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", "--case", json.dumps(case), "--steps", str(steps)]
    cmd += ["--subset", str(subset)] if subset else []
    cmd += ["--workloads", ",".join(workloads)] if workloads else []
    cmd += ["--quick"] if quick else []
    cmd += ["--only", ",".join(only)] if only else []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    rows = [dict(r, model=name) for r in rows]
    if proc.returncode != 0:
        rows.append(dict(model=name, error=f"worker exit {proc.returncode} (rows before it kept)"))
    return rows


def step_s(row: dict) -> str:
    """'97.5', or with several timed rounds their mean and each round: '97.5 (95.1, 99.9)'."""
    rounds = row.get("step_s_rounds") or []
    each = f" ({', '.join(f'{t:.1f}' for t in rounds)})" if len(rounds) > 1 else ""
    return f"{row['step_s']:.1f}{each}"


def table(rows: list[dict]) -> str:
    lines = [
        "| model | workload | mode | precision | rollouts timed | effective tok/s | step s (each round) | vs unshared_fp32 | peak RSS GiB |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = {(r["model"], r["workload"]): r["tokens_per_s"] for r in rows if r.get("mode") == "unshared_fp32"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | – | – | – | – | {r['error']} | | | |")
            continue
        ref = base.get((r["model"], r["workload"]))
        rel = f"{r['tokens_per_s'] / ref:.2f}×" if ref else "–"
        pk = "–" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        lines.append(f"| {r['model']} | {r['workload']} ({r['prefix']} + {r['G']} × {r['suffix']}) | {r['mode']} | "
                     f"{r['precision']} | {r.get('timed_rollouts', r['G'])} | {r['tokens_per_s']:.0f} | {step_s(r)} | {rel} | {pk} |")
    return "\n".join(lines)


def ratios(rows: list[dict], model: str = "SmolLM2-135M") -> dict[str, float | None]:
    """The issue's ratios for `model` (None where a mode is missing)."""
    t = {(r["workload"], r["mode"]): r["tokens_per_s"] for r in rows if r.get("model") == model and "error" not in r}

    def q(a, b):
        return t[a] / t[b] if a in t and b in t else None

    return {
        "retail_shared_auto_vs_unshared_fp32": q(("retail", "shared_auto"), ("retail", "unshared_fp32")),
        "retail_shared_fp32_vs_unshared_fp32": q(("retail", "shared_fp32"), ("retail", "unshared_fp32")),
        "unshared_vs_bare_fp32": q(("retail", "unshared_fp32"), ("retail", "bare_fp32")),
        "unshared_vs_bare_bf16": q(("retail", "unshared_auto"), ("retail", "bare_bf16")),
        "mock_shared_auto_vs_unshared_fp32": q(("mock", "shared_auto"), ("mock", "unshared_fp32")),
        "mock_unshared_vs_bare_fp32": q(("mock", "unshared_fp32"), ("mock", "bare_fp32")),
        "mock_no_ckpt_vs_ckpt_fp32": q(("mock", "unshared_fp32_no_ckpt"), ("mock", "unshared_fp32")),
    }


def summarise(row: dict, warmup: int) -> dict:
    """`row` with its step time and tokens/s over the rounds after the first `warmup`
    (full-size warm-up rounds: the first step at a workload's size pays one-off costs, e.g.
    retail unshared_fp32 141 s in round 1 and 91 s in round 2 on 2026-12-03). Rows without
    per-round times (older records) are returned unchanged.

    Raises:
        SystemExit: `warmup` leaves no timed round.
    """
    rounds = row.get("step_s_rounds")
    if "error" in row or not rounds:
        return row
    counted = rounds[warmup:]
    if not counted:
        raise SystemExit(f"--warmup-rounds {warmup} leaves no timed round of {len(rounds)} "
                         f"({row.get('model')} {row.get('workload')} {row.get('mode')})")
    mean = sum(counted) / len(counted)
    return dict(row, step_s=mean, tokens_per_s=row["effective_tokens"] / mean, warmup_rounds=warmup,
                timed_rounds=len(counted))


def render(data: dict, out: Path) -> None:
    """Writes the record `data` (the JSON's fields) as the generated block of the page `out`."""
    warmup = data.get("warmup_rounds", 0)
    rounds = (f"{data['steps']} timed round(s) per workload after {warmup} full-size warm-up round(s) "
              f"(each round's time in brackets, the warm-up's first; not counted)" if warmup else
              f"{data['steps']} timed round(s) per workload after a small warm-up")
    load0, load1 = data["load_avg_start"], data["load_avg_end"]
    header = (
        f"## {data['device']}, torch {data['torch']}\n\n"
        f"{data['date']}; {rounds}, modes alternating in one process, "
        f"unshared/bare modes timed on {data.get('subset') or 'all'} rollout(s) per group, "
        f"{data['threads']} CPU thread(s); load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end.\n\n"
    )
    rat_md = "\n".join(f"- `{k}`: {'–' if v is None else f'{v:.2f}'}" for k, v in data["ratios"].items())
    write_results(out, header + table(data["rows"]) + "\n\nRatios (SmolLM2-135M):\n\n" + rat_md + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=1, help="timed rounds per workload")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="full-size rounds of every mode before the timed ones, recorded but not counted")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite --out from the record in --json (with --warmup-rounds: count the rounds after them)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads per worker")
    p.add_argument("--models", default="", help="comma-separated subset of the model names")
    p.add_argument("--only", default="", help="comma-separated subset of the modes")
    p.add_argument("--workloads", default="", help="comma-separated subset of the workloads (retail, mock)")
    p.add_argument("--subset", type=int, default=0,
                   help="time the unshared and bare modes on this many rollouts of each group (0: all G); "
                        "their cost is linear in the rollouts, the shared modes always run the whole group")
    p.add_argument("--out", default=str(REPO / "docs" / "bench_learner.md"))
    p.add_argument("--json", default=str(REPO / "docs" / "bench_learner.json"))
    p.add_argument("--mismatch", action="store_true",
                   help="only the engine/learner log-prob mismatch (vLLM fp32 and auto engines, SmolLM2) -> --json")
    p.add_argument("--mismatch-worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    only = [m for m in args.only.split(",") if m] or None
    if args.worker:
        wl = [x for x in args.workloads.split(",") if x] or None
        print(json.dumps(worker(json.loads(args.case), args.steps, args.quick, only, args.subset or None, wl)))
        return
    if args.mismatch_worker:
        from sinkflex.models import default_model_dir

        print(json.dumps(mismatch_worker(args.mismatch_worker, str(default_model_dir("smollm2")))))
        return
    if args.mismatch:
        rows = []
        for dt in ("float32", "auto"):
            proc = subprocess.run([sys.executable, __file__, "--mismatch-worker", dt], stdout=subprocess.PIPE, text=True,
                                  cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
            rows += json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else [dict(error=dt)]
        print(json.dumps(rows, indent=1))
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else {}
        data["logprob_mismatch"] = rows
        path.write_text(json.dumps(data, indent=1) + "\n")
        return
    if args.render_only:
        data = json.loads(Path(args.json).read_text())
        data["rows"] = [summarise(r, args.warmup_rounds) for r in data["rows"]]
        data.update(ratios=ratios(data["rows"]), warmup_rounds=args.warmup_rounds,
                    steps=min((r.get("timed_rounds", data["steps"]) for r in data["rows"] if "error" not in r),
                              default=data["steps"]))
        write_record(Path(args.json), data)
        render(data, Path(args.out))
        return
    import torch

    from learner_service.model import cpu_has_fast_bf16
    from sinkflex.hardware import cpu_model

    load0 = os.getloadavg()
    wanted = [m for m in args.models.split(",") if m]
    rows: list[dict] = []
    for name, c in cases(args.quick).items():
        if not wanted or name in wanted:
            rows += run_case(name, c, args.warmup_rounds + args.steps, args.threads, args.quick, only, args.subset or None,
                             [x for x in args.workloads.split(",") if x] or None)
    load1 = os.getloadavg()
    device = f"CPU, {os.cpu_count()} cores ({cpu_model()}), fast bf16: {cpu_has_fast_bf16()}"
    rows = [summarise(r, args.warmup_rounds) for r in rows]
    print(table(rows))
    data = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=device, torch=torch.__version__,
                threads=args.threads, steps=args.steps, warmup_rounds=args.warmup_rounds, quick=args.quick,
                subset=args.subset or None, load_avg_start=load0, load_avg_end=load1, rows=rows, ratios=ratios(rows))
    write_record(Path(args.json), data)
    render(data, Path(args.out))


def write_record(path: Path, record: dict) -> None:
    """Writes the throughput run's `record` to `path`, keeping the --mismatch run's keys
    (``logprob_mismatch*``) of the file already there: a throughput run does not measure them."""
    old = json.loads(path.read_text()) if path.exists() else {}
    data = {k: v for k, v in old.items() if k.startswith("logprob_mismatch")}
    data.update(record)
    path.write_text(json.dumps(data, indent=1) + "\n")


#: The generated part of the page lies between these markers; the text around it (the
#: reading of the numbers, exactness, mismatch, GPU sections) is written by hand and kept.
BEGIN, END = "<!-- bench_learner: generated results begin -->", "<!-- bench_learner: generated results end -->"


def write_results(out: Path, results: str) -> None:
    """Replaces the generated block of `out` (between BEGIN and END) with `results`, keeping
    the rest; a page without the markers gets them appended (a new page: a title first)."""
    text = out.read_text() if out.exists() else "# Learner benchmark\n"
    block = f"{BEGIN}\n{results.rstrip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    out.write_text(text)


if __name__ == "__main__":
    main()
