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

from learner_service.config import LearnerConfig
from learner_service.memory_model import GPT_OSS_20B, learner_config, plan_row

PAPER = {"eager_4096": 28.06, "sinkflex_4096": 22.52, "sinkflex_8192": 25.53}
PAPER_NOTES = "eager at 8,192 tokens: out of memory (GPU not stated)"
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
#: The GPU check's learner part (benchmarks/gpu_check.py --learner-layers): its rows, predicted here.
GPU_CHECK_LAYERS = 12


def rows_to_run(config_path: Path):
    exp = yaml.safe_load(config_path.read_text())
    learner = dict(exp["learner_service"])
    learner["model"] = {**learner.get("model", {}), "arch": GPT_OSS_20B}
    base = LearnerConfig.model_validate(learner)
    gpus = int(exp["local"]["learner_procs"])
    for n in (4096, 8192):
        for att in ("eager", "sinkflex"):
            yield "paper", learner_config(GPT_OSS_20B, n, att), n, PAPER_GPUS
    for n in (4096, 8192):
        for att in ("eager", "sinkflex"):
            yield "configs/gpt-oss-20b.yaml", learner_config(GPT_OSS_20B, n, att, base=base), n, gpus
    small = dict(GPT_OSS_20B, num_hidden_layers=GPU_CHECK_LAYERS, layer_types=GPT_OSS_20B["layer_types"][:GPU_CHECK_LAYERS])
    for n in (4096, 8192):
        for att in ("eager", "sinkflex"):
            yield f"gpu_check ({GPU_CHECK_LAYERS} layers)", learner_config(small, n, att), n, 1


def _row(record: dict, config: str, n: int, attention: str) -> dict | None:
    return next((r for r in record["rows"] if r["config"] == config and r["seq_len"] == n and r["attention"] == attention), None)


def _gb(r: dict | None, key: str = "predicted_peak_gb") -> float | None:
    return None if r is None or key not in r else r[key]


def markdown(record: dict) -> str:
    parts_order = record["parts_order"]
    lines = [
        "# Predicted GPU memory of the GRPO step (gpt-oss-20b)",
        "",
        "Each learner GPU's peak memory during GRPO steps, predicted on a CPU, in GB (10^9 bytes, the paper's unit). "
        "`learner_service.memory_model.trace_step` runs the learner's own step (`Learner.train_step`: the model on "
        "the chosen attention path, the chunked float32 log-probs, the GRPO loss, backward, gradient clipping, AdamW, "
        "FSDP2) with fake tensors over a fake process group of the given GPU count, under PyTorch's `FSDPMemTracker` "
        "(as torchtitan's memory estimation does), and splits the peak into parts. `analytic_peak` counts the same "
        "parts from the architecture (module docstrings give both methods and what they leave out). "
        f"Made by `PYTHONPATH=. python benchmarks/gpu_memory.py` on {record['generated']} "
        f"(torch {record['torch']}, transformers {record['transformers']}).",
        "",
        "| config | tokens | attention | GPUs | predicted peak (traced) | peak falls in | analytic count | analytic vs traced | paper |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in record["rows"]:
        paper = record["paper"].get(f"{r['attention']}_{r['seq_len']}", "") if r["config"] == "paper" else ""
        if r["config"] == "paper" and r["attention"] == "eager" and r["seq_len"] == 8192:
            paper = "out of memory"
        pred = f"{r['predicted_peak_gb']:.2f}" if "predicted_peak_gb" in r else "–"
        diff = f"{100 * r['analytic_vs_traced']:+.1f} %" if "analytic_vs_traced" in r else "–"
        lines.append(f"| {r['config']} | {r['seq_len']:,} | {r['attention']} | {r['gpus']} | {pred} | {r.get('phase', '–')} | "
                     f"{r['analytic_peak_gb']:.2f} | {diff} | {paper} |")
    lines += ["", "Parts of each traced peak (GB, live at the peak moment; they add up to the peak):", "",
              "| config | tokens | attention | " + " | ".join(p.replace("_", " ") for p in parts_order) + " |",
              "| --- | ---: | --- | " + " | ".join("---:" for _ in parts_order) + " |"]
    for r in record["rows"]:
        parts = r.get("parts", {})
        lines.append(f"| {r['config']} | {r['seq_len']:,} | {r['attention']} | "
                     + " | ".join(f"{parts.get(p, 0):.2f}" for p in parts_order) + " |")
    phased = [r for r in record["rows"] if r.get("phase_peaks_gb")]
    if phased:
        lines += ["", "Peaks by phase (GB): the model's forward, log-probs and backward beside AdamW's step (benchmarks/"
                  "gpu_check.py reads `max_memory_allocated` as each optimizer step begins, for the first):", "",
                  "| config | tokens | attention | forward / backward | optimizer step |", "| --- | ---: | --- | ---: | ---: |"]
        for r in phased:
            pp = r["phase_peaks_gb"]
            fb = max(pp.get(k, 0) for k in ("forward", "log-probs", "backward"))
            lines.append(f"| {r['config']} | {r['seq_len']:,} | {r['attention']} | {fb:.2f} | {pp.get('optimizer', 0):.2f} |")
    far = [r for r in record["rows"] if abs(r.get("analytic_vs_traced", 0)) > 0.10]
    lines += ["", "Analytic vs traced: " + ("every row within 10 %." if not far else "rows more than 10 % apart, and "
              "the parts that differ most (analytic − traced, GB):"), ""]
    for r in far:
        diffs = {k: r["analytic_parts"].get(k, 0) - r["parts"].get(k, 0) for k in set(r["analytic_parts"]) | set(r["parts"])}
        top = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:3]
        lines.append(f"- {r['config']}, {r['seq_len']:,}, {r['attention']}: {100 * r['analytic_vs_traced']:+.1f} %; "
                     + ", ".join(f"{k.replace('_', ' ')} {v:+.2f}" for k, v in top)
                     + f" (analytic peak at its {r['analytic_phase']} moment, traced in the {r.get('phase')})")
    rows = {(n, a): _row(record, "paper", n, a) for n in (4096, 8192) for a in ("eager", "sinkflex")}
    paper = record["paper"]
    lines += ["", "## Beside the paper", ""]
    if all(r is not None and "parts" in r for r in rows.values()):
        static_parts = ("parameters", "gradients", "optimizer_state", "fsdp_buffers")

        def dynamic(r: dict) -> float:  # what grows with the sequence: activations, attention, logits, chunks
            return sum(v for k, v in r["parts"].items() if k not in static_parts)

        e4, s4, s8, e8 = (rows[k]["predicted_peak_gb"] for k in ((4096, "eager"), (4096, "sinkflex"), (8192, "sinkflex"), (8192, "eager")))
        implied = paper["sinkflex_4096"] - dynamic(rows[(4096, "sinkflex")])
        v = int(GPT_OSS_20B["vocab_size"])
        lines += [
            "The paper gives 28.06 GB (eager) and 22.52 GB (ours) at 4,096 tokens, 25.53 GB (ours) at 8,192 and eager "
            "out of memory there, on a GPU it does not name, with a configuration it does not state (below). What "
            "does not depend on the unstated static part (weights, gradients, optimizer state, FSDP buffers) can be "
            "compared directly:",
            "",
            f"- eager − ours at 4,096 tokens: predicted {e4 - s4:.2f} GB ({100 * (e4 - s4) / e4:.1f} % of eager), paper "
            f"{paper['eager_4096'] - paper['sinkflex_4096']:.2f} GB (19.7 %);",
            f"- ours, 8,192 − 4,096 tokens: predicted {s8 - s4:+.2f} GB, paper {paper['sinkflex_8192'] - paper['sinkflex_4096']:+.2f} GB. "
            f"The paper's growth is about the float32 logits of 4,096 more tokens ({4096 * v * 4 / 1e9:.2f} GB); this "
            "learner keeps the logits in bf16 and converts 1,024 rows at a time (`picked_logprobs`), so its growth is "
            "the checkpoints, the bf16 logits and the attention's O(N) tensors;",
            f"- eager at 8,192 tokens: predicted {e8:.2f} GB, {e8 - s8:.2f} GB above ours (three [64, N, N + 1] bf16 "
            "tensors of one layer's attention at once, 8.6 GB each).",
            "",
            f"Taking the static part the paper's own 22.52 GB implies ({implied:.2f} GB: 22.52 minus our sequence-dependent "
            f"parts of that row, {dynamic(rows[(4096, 'sinkflex')]):.2f} GB) and adding each row's sequence-dependent parts:",
            "",
            "| row | ours, with the paper's static part | paper |",
            "| --- | ---: | ---: |",
        ]
        for (n, a), label in (((4096, "eager"), "eager_4096"), ((4096, "sinkflex"), "sinkflex_4096"),
                              ((8192, "sinkflex"), "sinkflex_8192"), ((8192, "eager"), None)):
            ours = implied + dynamic(rows[(n, a)])
            lines.append(f"| {a} at {n:,} | {ours:.2f} | {paper[label] if label else 'out of memory'} |")
        lines += [
            "",
            f"so the paper's figures are consistent with this learner's sequence-dependent memory (within "
            f"{100 * max(abs(implied + dynamic(rows[(4096, 'eager')]) - paper['eager_4096']) / paper['eager_4096'], abs(implied + dynamic(rows[(8192, 'sinkflex')]) - paper['sinkflex_8192']) / paper['sinkflex_8192']):.0f} %) "
            f"on a GPU of less than {implied + dynamic(rows[(8192, 'eager')]):.0f} GB, where eager at 8,192 tokens runs out "
            "of memory. This is one fitted constant, not a measurement of the paper's setup. Our own static part for the "
            f"assumed configuration is {sum(rows[(4096, 'sinkflex')]['parts'].get(k, 0) for k in static_parts):.2f} GB; "
            "LoRA, a quantized frozen base, more GPUs or CPU offload would each give a smaller one.",
        ]
    lines += ["", "What the paper leaves open, and what its rows here assume:", ""]
    lines += [f"- {k.replace('_', ' ')}: {v}" for k, v in record["paper_assumptions"].items()]
    lines += [
        "",
        "configs/gpt-oss-20b.yaml's rows take that file's learner section as it trains (6 FSDP2 ranks on GPUs 2-7, "
        "micro-batch 1, max_seq_len 8,192, bf16, activation checkpointing, beta 0, `sinkflex` attention; the eager "
        "rows swap only the attention). The estimate that file carried before (~56 GB of training state per GPU "
        "plus ~25 GB of activations) assumed float32 master weights; this learner keeps bf16 weights and bf16 AdamW "
        "moments on CUDA, 8 bytes a parameter, which is what the trace counts.",
        "",
        "The `gpu_check` rows are benchmarks/gpu_check.py's learner part (gpt-oss-20b's first 12 layers, one GPU, "
        "FSDP2 over NCCL with world size 1): when a GPU run happens, its measured peaks go beside these predictions "
        "(docs/gpu_check.json). None has happened yet: the session that built this had no GPU lent.",
        "",
        "## Reading the parts",
        "",
        "- parameters: the bf16 shards, plus the unsharded copies FSDP2 all-gathers: the root unit's (embeddings and "
        "lm_head, kept from forward to backward) and one or two decoder layers' (the running one and the prefetched one);",
        "- gradients: sharded gradients of the earlier micro-steps, plus unsharded ones waiting for their reduce-scatter;",
        "- optimizer state: AdamW's two moments (bf16, like the weights), and at the optimizer step its for-each "
        "temporary (√v of every shard);",
        "- activations / attention / logits: tensors allocated in the model's decoder layers / inside its attention "
        "modules / inside lm_head, saved ones and the temporaries of their backward (the gradients of a module's "
        "inputs count where they are allocated, those of its weights as gradients); with checkpointing a layer's "
        "are its input, kept, and its recomputed insides during its backward;",
        "- logprob chunks: outside the model: the float32 chunks of the log-softmax, its LSE, the logits' gradient "
        "(`learner_service.logprobs.picked_logprobs`), the loss;",
        "- fsdp buffers: all-gather and reduce-scatter buffers.",
        "",
        "Analytic vs traced: the analytic count is a hand count of the largest tensors at three candidate moments "
        "(a decoder layer's backward, lm_head's backward, the optimizer step); it leaves out small tensors, the flex "
        "kernel's and FSDP2's bookkeeping, and it assumes the largest moment of a layer's backward; the trace sees "
        "every allocation at every moment.",
        "",
        "## Plan your own configuration",
        "",
        "```bash",
        "sinkflex-rl memory -m gpt-oss-20b -n 4096 -n 8192 -g 6 -a sinkflex -a eager --gpu-gb 80",
        "sinkflex-rl memory -c configs/gpt-oss-20b.yaml            # its learner section and learner_procs",
        "sinkflex-rl memory -m /models/my-model --no-trace          # analytic count only (seconds)",
        "```",
        "",
        "`-m` takes a named architecture or a model folder's config.json (weights are never read); a trace of "
        "gpt-oss-20b took 1-2 minutes per row on two busy cores, `--no-trace` takes seconds.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "gpt-oss-20b.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "gpu_memory")
    parser.add_argument("--no-trace", action="store_true", help="analytic counts only")
    parser.add_argument("--only", nargs="*", default=None, help="row keys config:tokens:attention to run (default all)")
    parser.add_argument("--reanalyze", action="store_true", help="recount the analytic columns of the rows on file (no trace)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch
    import transformers

    from learner_service.memory_model import PARTS

    out_json = args.out.with_suffix(".json")
    old = json.loads(out_json.read_text()) if out_json.exists() else {"rows": []}
    keep = {(r["config"], r["seq_len"], r["attention"]): r for r in old.get("rows", [])}
    record = {"generated": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
              "transformers": transformers.__version__, "paper": PAPER, "paper_notes": PAPER_NOTES,
              "paper_assumptions": PAPER_ASSUMPTIONS,
              "parts_order": list(PARTS), "rows": []}
    if args.reanalyze:
        from learner_service.memory_model import GB, analytic_peak

        record["rows"] = old["rows"]
        for r, (name, cfg, n, gpus) in zip(record["rows"], [x for x in rows_to_run(args.config)
                                                              if (x[0], x[2], x[1].model.attn_implementation) in keep]):
            peak, parts, phase = analytic_peak(cfg.model.arch, n, gpus, r["attention"], cfg.model.gradient_checkpointing)
            r.update(analytic_peak_gb=round(peak / GB, 3), analytic_phase=phase,
                     analytic_parts={k: round(v / GB, 3) for k, v in parts.items() if v})
            if "predicted_peak_gb" in r:
                r["analytic_vs_traced"] = round(peak / GB / r["predicted_peak_gb"] - 1, 4)
        out_json.write_text(json.dumps(record, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(record))
        return 0
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
