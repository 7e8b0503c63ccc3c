"""Flags every service entry point shares: `--version`, `--metrics-port N` and `--no-metrics`.

`python -m env_service`, `rollout_service` and `learner_service` build their flags with
argparse (`add_common_flags`, `metrics_port_from`); `python -m reward_service` is a Typer
app and uses `version_callback` and `resolve_metrics_port`. Either way the flags mean the
same: `--no-metrics` serves no Prometheus endpoint, `--metrics-port N` serves it on port N
(0: any free port), and `--metrics-port -1` is still read as `--no-metrics` (the old
spelling). `--version` prints `<service> <version>`, the version of `sinkflex-rl --version`.
"""

from __future__ import annotations

import argparse


def version_line(service: str) -> str:
    """`"env_service 0.1.0"`: the service's name and the package's version."""
    from sinkflex import __version__

    return f"{service} {__version__}"


def resolve_metrics_port(metrics_port: int | None, no_metrics: bool) -> int | None:
    """The Prometheus port to serve on, or None for none (`--no-metrics`, or a negative port)."""
    if no_metrics or metrics_port is None or metrics_port < 0:
        return None
    return metrics_port


def add_common_flags(parser: argparse.ArgumentParser, *, service: str, metrics_default: int | None) -> None:
    """Adds `--version` and the mutually exclusive `--metrics-port N` / `--no-metrics`."""
    parser.add_argument("--version", action="version", version=version_line(service), help="print the version and exit")
    group = parser.add_mutually_exclusive_group()
    default = "none" if metrics_default is None else str(metrics_default)
    group.add_argument("--metrics-port", type=int, default=metrics_default, metavar="N",
                       help=f"serve Prometheus metrics on port N, 0: any free port (default: {default})")
    group.add_argument("--no-metrics", action="store_true", help="do not serve Prometheus metrics")


def metrics_port_from(args: argparse.Namespace) -> int | None:
    """The port `add_common_flags`'s flags ask for, or None for no metrics."""
    return resolve_metrics_port(args.metrics_port, args.no_metrics)


def version_callback(service: str):
    """A Typer `--version` callback (is_eager) printing `version_line(service)`."""

    def callback(value: bool) -> None:
        if value:
            import typer

            typer.echo(version_line(service))
            raise typer.Exit()

    return callback
