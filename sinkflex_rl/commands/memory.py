"""`sinkflex-rl memory`: each learner GPU's predicted peak memory for a model, sequence
length and GPU count, without a GPU (learner_service.memory_model; docs/gpu_memory.md)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from sinkflex.service_cli import APP_SETTINGS

app = typer.Typer(help="Plan the learner's GPU memory.", **APP_SETTINGS)


def _arch(model: str) -> dict:
    """A named architecture (learner_service.memory_model.KNOWN_ARCHS) or a model folder's
    config.json (weights are never read). Raises ValueError otherwise."""
    from learner_service.memory_model import KNOWN_ARCHS

    if model in KNOWN_ARCHS:
        return dict(KNOWN_ARCHS[model])
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ValueError(f"unknown model {model!r}: give {', '.join(KNOWN_ARCHS)} or a model folder with a config.json")
    try:
        arch = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config} is not a model's config.json (JSON): {err}") from None
    if not isinstance(arch, dict) or "model_type" not in arch:
        raise ValueError(f"{config} has no model_type (a transformers config.json is needed)")
    for key in ("architectures", "quantization_config", "torch_dtype", "dtype", "transformers_version", "_name_or_path"):
        arch.pop(key, None)
    return arch


@app.command("memory", short_help="Predicted peak memory per learner GPU (no GPU needed).")
def plan_memory(
    model: str = typer.Option("gpt-oss-20b", "--model", "-m", help="gpt-oss-20b, or a model folder / config.json (architecture only)"),
    seq_len: list[int] = typer.Option([4096, 8192], "--seq-len", "-n", help="tokens per sequence (repeat the option for several)"),
    gpus: int | None = typer.Option(None, "--gpus", "-g", help="learner GPUs (FSDP2 ranks); default: the config's "
                                       "local.learner_procs, else 1"),
    attention: list[str] = typer.Option(["sinkflex"], "--attention", "-a", help="sinkflex and/or eager (repeat the option)"),
    config: Path | None = typer.Option(None, "--config", "-c", help="an experiment YAML: its learner_service section "
                                          "(batch, grpo, checkpointing) is the base, local.learner_procs the default --gpus"),
    no_checkpointing: bool = typer.Option(False, "--no-checkpointing", help="no activation checkpointing"),
    gpu_gb: float | None = typer.Option(None, "--gpu-gb", help="the GPU's memory in GB: say whether each row fits"),
    trace: bool = typer.Option(True, "--trace/--no-trace", help="trace the real step with fake tensors (minutes for a "
                               "20B model) or only count analytically (seconds)"),
    json_out: Path | None = typer.Option(None, "--json", help="also write the rows to this JSON file"),
) -> None:
    """Predicts each learner GPU's peak memory of one GRPO step (one sequence per micro-step, bf16,
    AdamW, FSDP2 over --gpus ranks) by tracing the learner's own step with fake tensors on the CPU,
    and prints it beside an analytic count, with its parts (GB = 1e9 bytes). Exits 2 on bad input."""
    import math

    from pydantic import ValidationError

    from learner_service.config import LearnerConfig
    from learner_service.memory_model import learner_config, plan_row
    from sinkflex.config import ConfigError

    try:
        arch = _arch(model)
        base = None
        if config is not None:  # the experiment as `train` reads it: a bad file fails here, naming the field
            from sinkflex_rl.config import load_train_config

            exp = load_train_config(config)
            learner = dict(exp.section("learner_service"))
            learner["model"] = {**(learner.get("model") or {}), "path": None, "arch": arch}
            try:
                base = LearnerConfig.model_validate(learner)
            except ValidationError as err:
                raise ValueError(f"{config}: learner_service: {err.errors()[0]['msg']}") from None
            if gpus is None:
                gpus = exp.local.learner_procs
        gpus = 1 if gpus is None else int(gpus)
        bad = [a for a in attention if a not in ("sinkflex", "eager")]
        if bad or gpus < 1 or any(n < 2 for n in seq_len):
            raise ValueError(f"need --attention sinkflex|eager, --gpus >= 1 and --seq-len >= 2 (got {bad or attention}, {gpus}, {seq_len})")
        if gpu_gb is not None and not (math.isfinite(gpu_gb) and gpu_gb > 0):
            raise ValueError(f"--gpu-gb is the GPU's memory in GB, a number > 0 (got {gpu_gb})")
        if json_out is not None and (json_out.is_dir() or not json_out.parent.is_dir()):
            raise ValueError(f"--json {json_out}: not a file in an existing folder")
    except (ValueError, OSError, ConfigError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    rows = []
    typer.echo(f"{'tokens':>7} {'attention':9} {'GPUs':>4} {'traced GB':>9} {'analytic GB':>11}  parts (GB)")
    for n in seq_len:
        for att in attention:
            cfg = learner_config(arch, n, att, gradient_checkpointing=not no_checkpointing, base=base)
            row = plan_row(str(config or model), cfg, n, gpus, trace=trace)
            rows.append(row)
            traced = row.get("predicted_peak_gb")
            parts = row.get("parts") or row["analytic_parts"]
            fits = ""
            if gpu_gb is not None:
                fits = "  fits" if (traced or row["analytic_peak_gb"]) <= gpu_gb else "  DOES NOT FIT"
            typer.echo(f"{n:>7} {att:9} {gpus:>4} {traced if traced is not None else '-':>9} {row['analytic_peak_gb']:>11}  "
                       + ", ".join(f"{k} {v}" for k, v in parts.items()) + fits)
    if json_out is not None:
        json_out.write_text(json.dumps({"model": model, "rows": rows}, indent=1) + "\n")
