"""Copies a finished run of `bin/demo` into docs/results/demo/ and prints its tables as Markdown.

    .venv/bin/python scripts/demo_report.py runs/demo [--out docs/results/demo]

Copied: summary.json, metrics.jsonl, validation/*.json, plots/*.png, configs/*.yaml and the
learner's metrics (learner_metrics.jsonl: warm-start and GRPO steps as the learner wrote them).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=Path("docs/results/demo"))
    a = p.parse_args()
    run, out = a.run_dir, a.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in ("summary.json", "metrics.jsonl"):
        shutil.copy2(run / name, out / name)
    shutil.copy2(run / "learner" / "metrics.jsonl", out / "learner_metrics.jsonl")
    for sub in ("validation", "plots", "configs"):
        shutil.copytree(run / sub, out / sub)

    summary = json.loads((run / "summary.json").read_text())
    print("| validation after | policy version | mean@1 | 95% CI | tasks × trials |")
    print("|---|---:|---:|---:|---:|")
    for v in summary["validation"]:
        print(f"| {v['after']} | {v['policy_version']} | {v['mean_at_1']:.3f} | [{v['ci_low']:.3f}, {v['ci_high']:.3f}] | "
              f"{v['tasks']} × {v['trials']} |")
    print()
    print("| paired difference | mean | 95% CI | tasks |")
    print("|---|---:|---:|---:|")
    for key in ("last_vs_warm_start", "warm_start_vs_base", "last_vs_base"):
        if key in summary:
            d = summary[key]
            print(f"| {d['after']} − {d['before']} | {d['difference']:+.3f} | [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] | {d['tasks']} |")
    print()
    learner = _records(run / "learner" / "metrics.jsonl")
    ws = [r for r in learner if r["kind"] == "warm_start"]
    if ws:
        print(f"warm start: {len(ws)} optimiser steps, loss {ws[0]['loss']:.3f} → {ws[-1]['loss']:.3f}, "
              f"token accuracy {ws[0]['token_accuracy']:.3f} → {ws[-1]['token_accuracy']:.3f}")
        print()
    train = [r for r in _records(run / "metrics.jsonl") if r["kind"] == "train"]
    cols = [("reward_mean", "reward mean", ".3f"), ("zero_variance_groups", "zero-var groups", ".0f"),
            ("adv_zero_fraction", "adv = 0 share", ".2f"), ("loss", "loss", ".4f"), ("grad_norm", "grad norm", ".3f"),
            ("clip_fraction", "clip frac", ".3f"), ("logprob_mismatch_mean", "engine/learner |Δlogp| mean", ".4f"),
            ("positions_trained", "positions", ".0f"), ("positions_computed", "computed", ".0f"), ("rollout_s", "rollout s", ".0f"), ("step_seconds", "learner s", ".0f")]
    print("| RL step | " + " | ".join(c[1] for c in cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for r in train:
        print(f"| {int(r['step'])} | " + " | ".join(format(r[k], f) if k in r else "–" for k, _, f in cols) + " |")


if __name__ == "__main__":
    main()
