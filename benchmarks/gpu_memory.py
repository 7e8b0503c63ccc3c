"""The memory table (docs/gpu_memory.md, docs/gpu_memory.json): gpt-oss-20b's GRPO step traced
with fake tensors on the CPU (`learner_service.memory_model`), eager attention vs the sink path,
4,096 and 8,192 tokens, for the paper's configuration (as far as it is stated; the assumptions
are written into the page) and for configs/gpt-oss-20b.yaml's learner (6 ranks). No GPU needed.

    PYTHONPATH=. python benchmarks/gpu_memory.py            # all 8 rows, about 2-5 min each on 2 cores
    PYTHONPATH=. python benchmarks/gpu_memory.py --no-trace # analytic counts only (seconds)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from learner_service.config import LearnerConfig  # noqa: E402
from learner_service.memory_model import GPT_OSS_20B, learner_config, plan_row  # noqa: E402

PAPER = {"eager_4096": 28.06, "sinkflex_4096": 22.52, "sinkflex_8192": 25.53, "eager_8192": "out of memory"}
#: What the paper leaves open, and what the "paper" rows assume.
PAPER_ASSUMPTIONS = {
    "model": "gpt-oss-20b (the paper: 'a large open-weight MoE transformer' with learned sinks and sliding-window layers; "
             "the issue names gpt-oss-20b), random weights of its exact shapes",
    "precision": "bf16 weights, gradients and AdamW moments (this learner's CUDA default); float32 log-softmax in chunks of 1,024 rows",
    "training": "full-parameter GRPO (no LoRA: the paper does not say; this learner trains every parameter)",
    "sequence": "one sequence of N tokens per micro-step (micro_batch_size 1), no packing, no shared prefix",
    "sharding": "FSDP2 over 8 GPUs (one 8-GPU node; the paper states no GPU count or sharding degree)",
    "checkpointing": "activation checkpointing of every decoder layer (the paper does not say; without it eager and ours both grow by every layer's activations)",
    "reference_model": "none (beta = 0; a KL reference would add its bf16 weights, sharded)",
    "optimizer": "AdamW, for-each implementation (PyTorch's default on CUDA)",
}
PAPER_GPUS = 8


def rows_to_run(config_path: Path):
    exp = yaml.safe_load(config_path.read_text())
    learner = dict(exp["learner"])
    learner["model"] = {**learner.get("model", {}), "arch": GPT_OSS_20B}
    base = LearnerConfig.model_validate(learner)
    gpus = int(exp["local"]["learner_procs"])
    for n in (4096, 8192):
        for att in ("eager", "sinkflex"):
            yield "paper", learner_config(GPT_OSS_20B, n, att), n, PAPER_GPUS
    for n in (4096, 8192):
        for att in ("eager", "sinkflex"):
            yield "configs/gpt-oss-20b.yaml", learner_config(GPT_OSS_20B, n, att, base=base), n, gpus


def markdown(record: dict) -> str:
    lines = [
        "# Predicted GPU memory of the GRPO step (gpt-oss-20b)",
        "",
        "Per GPU, in GB (10^9 bytes, the paper's unit). Predicted on a CPU by tracing the learner's own step "
        "(`learner_service.memory_model.trace_step`: `Learner.train_step` with FSDP2 over a fake process group, "
        "fake tensors, PyTorch's `FSDPMemTracker`), beside an analytic count of the same parts "
        "(`analytic_peak`). Made by `PYTHONPATH=. python benchmarks/gpu_memory.py` "
        f"({record['generated']}, torch {record['torch']}, transformers {record['transformers']}); "
        "plan your own configuration with `sinkflex-rl memory` (below).",
        "",
        "| config | tokens | attention | GPUs | predicted peak | phase | analytic | analytic vs traced | paper |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in record["rows"]:
        paper = record["paper"].get(f"{r['attention']}_{r['seq_len']}", "") if r["config"] == "paper" else ""
        pred = f"{r['predicted_peak_gb']:.2f}" if "predicted_peak_gb" in r else "–"
        diff = f"{100 * r['analytic_vs_traced']:+.1f} %" if "analytic_vs_traced" in r else "–"
        lines.append(f"| {r['config']} | {r['seq_len']:,} | {r['attention']} | {r['gpus']} | {pred} | {r.get('phase', '–')} | "
                     f"{r['analytic_peak_gb']:.2f} | {diff} | {paper} |")
    lines += ["", "Parts of each traced peak (GB, at the peak moment):", "",
              "| config | tokens | attention | " + " | ".join(record["parts_order"]) + " |",
              "| --- | ---: | --- | " + " | ".join("---:" for _ in record["parts_order"]) + " |"]
    for r in record["rows"]:
        parts = r.get("parts", {})
        lines.append(f"| {r['config']} | {r['seq_len']:,} | {r['attention']} | "
                     + " | ".join(f"{parts.get(p, 0):.2f}" for p in record["parts_order"]) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "gpt-oss-20b.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "gpu_memory")
    parser.add_argument("--no-trace", action="store_true", help="analytic counts only")
    parser.add_argument("--only", nargs="*", default=None, help="row keys config:tokens:attention to run (default all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch
    import transformers

    from learner_service.memory_model import PARTS

    out_json = args.out.with_suffix(".json")
    old = json.loads(out_json.read_text()) if out_json.exists() else {"rows": []}
    keep = {(r["config"], r["seq_len"], r["attention"]): r for r in old.get("rows", [])}
    record = {"generated": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
              "transformers": transformers.__version__, "paper": PAPER, "paper_assumptions": PAPER_ASSUMPTIONS,
              "parts_order": list(PARTS), "rows": []}
    for name, cfg, n, gpus in rows_to_run(args.config):
        key = (name, n, cfg.model.attn_implementation)
        if args.only is not None and f"{name}:{n}:{key[2]}" not in args.only:
            if key in keep:
                record["rows"].append(keep[key])
            continue
        t0 = time.perf_counter()
        row = plan_row(name, cfg, n, gpus, trace=not args.no_trace)
        print(f"{name} {n} {key[2]}: {json.dumps(row)} ({time.perf_counter() - t0:.0f} s)", flush=True)
        record["rows"].append(row)
        out_json.write_text(json.dumps(record, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(record))
    out_json.write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
