"""The demo's learner step, side by side: the full step against leaving zero-advantage rollouts out
(`grpo.skip_zero_advantage`), with and without gradient checkpointing.

    .venv/bin/python benchmarks/bench_learner_step.py            # -> docs/bench_learner_step.md + .json
    .venv/bin/python benchmarks/bench_learner_step.py --quick    # 3 groups instead of 10 (smoke run)

Workload: what one RL step of configs/demo.yaml trains — 10 groups × G = 8 rollouts of SmolLM2-135M
(the prepared `smollm2` folder), a common prompt of 830 tokens (the mock domain's system prompt and
tools, loss mask 0), 25 group-specific prompt tokens, then 100–180 generated tokens per rollout
(loss mask 1, with a 20-token tool reply at mask 0 in the middle); rewards 0/1 with 4 of the 10
groups at zero variance (in the demo's reference run 2–5 of 10 per step). All rollouts of the step
train as one shared-prefix row (`batch.shared_prefix_across_groups`), `dtype: auto`, 2 threads.

Modes (each in its own process, so that each peak RSS is its own; one warm-up step on one group,
then one timed step on the same tokens in every mode):
- ``full``: every rollout through forward/backward, gradient checkpointing on (the reference
  run's step before this change);
- ``skip``: zero-advantage rollouts left out (exact: same loss and gradient, checked below);
- ``skip_tuned_malloc``: ``skip`` under the local launcher's malloc settings for the CPU learner
  (`local.learner_glibc_tunables`: every allocation in glibc's heap, none given back to the
  kernel), where the other modes run under glibc's defaults (each tensor of 32 MiB or more mapped
  fresh and unmapped when freed);
- ``skip_no_ckpt`` (with ``--all``): the same without gradient checkpointing, one row;
- ``skip_no_ckpt_mb27`` (with ``--all``): without checkpointing, rows of at most 27 rollouts.

The table reports step seconds, positions computed, peak RSS, the process's system time and
minor page faults (warm-up included), the loss and gradient norm (equal between modes when the
skip is exact), and the ratio against ``full``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: 0/1 rewards of the 10 groups (4 at zero variance: 32 of 80 rollouts have advantage 0)
REWARDS = [[1, 1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 1, 0, 1, 0, 0],
           [1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 1, 0, 1], [1, 1, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0],
           [1, 0, 1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 0, 1, 1, 1]]
MODES = {  # mode -> (gradient checkpointing, micro_batch_size, skip_zero_advantage)
    "full": (True, 80, False),
    "skip": (True, 80, True),
    "skip_tuned_malloc": (True, 80, True),
    "skip_no_ckpt": (False, 80, True),
    "skip_no_ckpt_mb27": (False, 27, True),
}


def demo_groups(tag: str, n_groups: int, vocab: int = 49152):
    """`n_groups` demo-shaped TrajectoryGroups (module docstring), the same tokens for any `tag`."""
    import torch

    from sinkflex.api.common.v1 import common_pb2

    g = torch.Generator().manual_seed(0)
    head = torch.randint(0, vocab, (830,), generator=g).tolist()
    out = []
    for k in range(n_groups):
        mid = torch.randint(0, vocab, (25,), generator=g).tolist()
        grp = common_pb2.TrajectoryGroup(group_id=f"{tag}-{k}")
        for i in range(8):
            n = int(torch.randint(100, 180, (1,), generator=g))
            tail = torch.randint(0, vocab, (n,), generator=g).tolist()
            mask = [0] * 855 + [1] * (n // 2) + [0] * 20 + [1] * (n - n // 2 - 20)
            grp.trajectories.add(trajectory_id=f"{k}-{i}", token_ids=head + mid + tail, loss_mask=mask,
                                 logprobs=[-0.05 if m else 0.0 for m in mask], reward=float(REWARDS[k % 10][i]))
        out.append(grp)
    return out


def worker(mode: str, n_groups: int) -> dict:
    import torch

    from learner_service.config import LearnerConfig
    from learner_service.trainer import Learner
    from sinkflex.models import default_model_dir

    ckpt, mbs, skip = MODES[mode]
    cfg = LearnerConfig.model_validate(dict(
        run_dir=f"/tmp/bench_learner_step/{mode}", tensorboard=False,
        model=dict(path=str(default_model_dir("smollm2")), dtype="auto", gradient_checkpointing=ckpt),
        optim=dict(lr=2e-5, eps=1e-5), grpo=dict(skip_zero_advantage=skip),
        batch=dict(groups_per_step=n_groups, micro_batch_size=mbs, shared_prefix_across_groups=True)))
    learner = Learner(cfg, metrics=False)
    learner.train_step(demo_groups("warm-up", 1))
    t0 = time.perf_counter()
    m = learner.train_step(demo_groups("timed", n_groups))
    dt = time.perf_counter() - t0
    return dict(mode=mode, gradient_checkpointing=ckpt, micro_batch_size=mbs, skip_zero_advantage=skip,
                step_s=dt, positions_computed=m["positions_computed"], positions_trained=m["positions_trained"],
                skipped_rollouts=m["skipped_rollouts"], loss=m["loss"], grad_norm=m["grad_norm"],
                precision=learner.precision.describe(), threads=torch.get_num_threads(),
                glibc_tunables=os.environ.get("GLIBC_TUNABLES"), sys_s=resource.getrusage(resource.RUSAGE_SELF).ru_stime,
                minor_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, load_avg=os.getloadavg()[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 groups instead of 10")
    p.add_argument("--all", action="store_true", help="also the two modes without gradient checkpointing (~23 GiB peak)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "docs" / "bench_learner_step.md"))
    p.add_argument("--json", default=str(REPO / "docs" / "bench_learner_step.json"))
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--groups", type=int, default=10, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        print("ROW " + json.dumps(worker(args.worker, args.groups)), flush=True)
        return
    n_groups = 3 if args.quick else 10
    modes = list(MODES) if args.all else ["full", "skip", "skip_tuned_malloc"]
    from sinkflex_rl.config import LEARNER_GLIBC_TUNABLES
    load0 = os.getloadavg()
    rows = []
    for mode in modes:
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
        if mode == "skip_tuned_malloc":
            env["GLIBC_TUNABLES"] = LEARNER_GLIBC_TUNABLES
        proc = subprocess.run([sys.executable, __file__, "--worker", mode, "--groups", str(n_groups)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env=dict(env, OMP_NUM_THREADS=str(args.threads)))
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
        rows += got or [dict(mode=mode, error=f"worker exit {proc.returncode}")]
        print(rows[-1], file=sys.stderr, flush=True)
    load1 = os.getloadavg()
    full = next((r for r in rows if r.get("mode") == "full" and "error" not in r), None)
    lines = ["| mode | checkpointing | malloc | rollouts per row | skipped rollouts | positions computed | step s | vs full | "
             "peak RSS GiB | system s | minor faults | loss | grad norm |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']} | | | | | | | | | | | |")
            continue
        rel = f"{full['step_s'] / r['step_s']:.2f}×" if full else "–"
        lines.append(f"| {r['mode']} | {'on' if r['gradient_checkpointing'] else 'off'} | "
                     f"{'tuned' if r['glibc_tunables'] else 'glibc default'} | {r['micro_batch_size']} | "
                     f"{r['skipped_rollouts']:.0f} | {r['positions_computed']:.0f} | {r['step_s']:.1f} | {rel} | "
                     f"{r['peak_rss_gib']:.2f} | {r['sys_s']:.1f} | {r['minor_faults'] / 1e6:.2f} M | {r['loss']:.6g} | "
                     f"{r['grad_norm']:.6g} |")
    import torch

    from sinkflex.hardware import cpu_has_fast_bf16, cpu_model

    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    device = f"CPU, {os.cpu_count()} cores ({cpu_model()}), fast bf16: {cpu_has_fast_bf16()}"
    speedup = {r["mode"]: full["step_s"] / r["step_s"] for r in rows if full and "error" not in r}
    Path(args.json).write_text(json.dumps(dict(date=stamp, device=device, torch=torch.__version__, threads=args.threads,
                                               groups=n_groups, load_avg_start=load0, load_avg_end=load1, rows=rows,
                                               speedup_vs_full=speedup), indent=1) + "\n")
    body = "\n".join(lines)
    print(body)
    Path(args.out).write_text(
        "# The demo's learner step: zero-advantage rollouts left out, and the learner's malloc settings\n\n"
        + __doc__.split("\n\n", 1)[1].split("\n\n", 1)[1].rstrip() + "\n\n"
        + f"## {device}, torch {torch.__version__}\n\n"
        + f"{stamp}; `benchmarks/bench_learner_step.py{' --all' if args.all else ''}{' --quick' if args.quick else ''}`, "
          f"{n_groups} groups, {args.threads} threads; load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end.\n\n"
        + body + "\n")


if __name__ == "__main__":
    main()
