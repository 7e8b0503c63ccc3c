"""The `sinkflex-rl` command line.

Each command group lives in its own module under `sinkflex_rl/commands/` and imports its
heavy dependencies (torch, vLLM, tau2) inside the command, so `sinkflex-rl --help` is fast.
"""

from __future__ import annotations

import importlib
import logging
import os

import typer

from sinkflex.service_cli import APP_SETTINGS

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not try the network

app = typer.Typer(
    name="sinkflex-rl",
    help="SinkFlex-RL: RL training for long-horizon tool-use agents on tau2-Bench.",
    no_args_is_help=True,
    **APP_SETTINGS,
)

#: (module under sinkflex_rl.commands, group name or "" for top-level commands)
_COMMAND_MODULES = [("config", "config"), ("env", "env"), ("memory", ""), ("models", "models"), ("tasks", "tasks"),
                    ("train", ""), ("eval", "")]


def _print_version(value: bool) -> None:
    if value:
        from sinkflex import __version__

        typer.echo(f"sinkflex-rl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="debug logging"),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="print the version and exit"),
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


for _module, _group in _COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"sinkflex_rl.commands.{_module}")
    except ModuleNotFoundError as _err:  # a command group not built yet
        if _err.name != f"sinkflex_rl.commands.{_module}":
            raise
        continue
    if _group:
        app.add_typer(_mod.app, name=_group)
    else:
        for _cmd in _mod.app.registered_commands:
            app.registered_commands.append(_cmd)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
