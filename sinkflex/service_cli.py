"""Typer helpers every entry point shares: app settings, `--version`, `--metrics-port N` / `--no-metrics`.

Every command line of the project is a Typer app: `sinkflex-rl` (sinkflex_rl/cli.py) and the four
services, `python -m env_service|reward_service|rollout_service|learner_service`. They are
built with `APP_SETTINGS` (via `service_app` for the services), so their help renders the
same way: `rich_markup_mode=None`, i.e. plain text, reflowed to the terminal's width, with
no markup that would eat a literal `[0, 1]`, `[flags]` or `<run dir>` in a help string.

The services declare `--version` with `version_option`, and `--metrics-port N` and
`--no-metrics` with `metrics_port_option` / `no_metrics_option`: `--no-metrics` serves no
Prometheus endpoint, `--metrics-port N` serves it on port N (0: any free port), and
`--metrics-port -1` is still read as `--no-metrics` (the old spelling); giving both is a
usage error (exit 2). `--version` prints `<service> <version>`, the version of
`sinkflex-rl --version`. `parse_flags` parses a service's flags without running it, as
argparse's `parse_args` did (the services' `parse_args`, used by tests and `sinkflex-rl env
serve`).
"""

from __future__ import annotations

import sys
from argparse import Namespace
from typing import Any

import typer

#: Keyword arguments of every `typer.Typer(...)` of the project (sinkflex-rl and its groups
#: included): plain help text, reflowed. Typer's "rich" markup drops `[flags]` or
#: `[default: x]` from a help string and keeps a docstring's hard line breaks; "markdown"
#: drops `<run dir>` and turns `__x__` bold.
APP_SETTINGS: dict[str, Any] = {"rich_markup_mode": None, "pretty_exceptions_show_locals": False}


def service_app(**kwargs: Any) -> typer.Typer:
    """A service's one-command Typer app: `APP_SETTINGS`, `-h` as well as `--help` (as argparse
    had), no shell-completion flags."""
    settings = {"add_completion": False, "context_settings": {"help_option_names": ["-h", "--help"]}, **APP_SETTINGS}
    return typer.Typer(**{**settings, **kwargs})


def version_line(service: str) -> str:
    """`"env_service 0.1.0"`: the service's name and the package's version."""
    from sinkflex import __version__

    return f"{service} {__version__}"


def resolve_metrics_port(metrics_port: int | None, no_metrics: bool) -> int | None:
    """The Prometheus port to serve on, or None for none (`--no-metrics`, or a negative port)."""
    if no_metrics or metrics_port is None or metrics_port < 0:
        return None
    return metrics_port


def metrics_port_from(args: Any) -> int | None:
    """The port that parsed flags (`.metrics_port`, `.no_metrics`) ask for, or None for no metrics."""
    return resolve_metrics_port(args.metrics_port, args.no_metrics)


def version_callback(service: str):
    """A Typer `--version` callback (is_eager) printing `version_line(service)`."""

    def callback(value: bool) -> None:
        if value:
            typer.echo(version_line(service))
            raise typer.Exit()

    return callback


def version_option(service: str) -> Any:
    """`version: bool = version_option("env_service")`: the eager `--version` flag."""
    return typer.Option(False, "--version", callback=version_callback(service), is_eager=True,
                        help="print the version and exit")


#: Click's UsageError (exit 2, with the usage line), which Typer does not export (Typer >= 0.2x
#: vendors Click); BadParameter is its subclass in every version.
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def _given(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _exclusive_metrics_flags(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """Refuses `--metrics-port N` together with `--no-metrics` (a usage error, exit 2).

    Click processes the flags given on the command line first, in their order, so the second
    of the two that is processed sees the first one's source."""
    other = "no_metrics" if param.name == "metrics_port" else "metrics_port"
    if _given(ctx, param.name) and _given(ctx, other):
        flags = {"metrics_port": "--metrics-port N", "no_metrics": "--no-metrics"}
        raise _UsageError(f"{flags[param.name]} is not allowed with {flags[other]}: give one of them", ctx=ctx)
    return value


def metrics_port_option(default: int | None, *, unset: str = "none") -> Any:
    """`metrics_port: Optional[int] = metrics_port_option(9091)`: `--metrics-port N`.

    With `default` None the help says `(default: <unset>)`, what not giving the flag means
    (e.g. the config's port); otherwise Typer shows `[default: N]`."""
    said = "" if default is not None else f" (default: {unset})"
    return typer.Option(default, "--metrics-port", metavar="N", show_default=default is not None, min=-1, max=65535,
                        help=f"serve Prometheus metrics on port N{said}; 0: any free port, -1: none",
                        callback=_exclusive_metrics_flags)


def port_option(default: int, help: str) -> Any:
    """`port: int = port_option(50051, "gRPC port, 0: any free port")`: `--port PORT`, in 0–65535
    (another value is a usage error, exit 2: gRPC would bind some other port)."""
    return typer.Option(default, metavar="PORT", min=0, max=65535, help=help)


#: The levels `--log-level` takes (any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _log_level(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(LOG_LEVELS)}")
    return value.upper()


def log_level_option() -> Any:
    """`log_level: str = log_level_option()`: `--log-level LEVEL`, one of `LOG_LEVELS` (any case;
    another is a usage error, exit 2), upper-cased."""
    return typer.Option("INFO", metavar="LEVEL", callback=_log_level,
                        help="logging level: DEBUG, INFO, WARNING or ERROR")


def no_metrics_option() -> Any:
    """`no_metrics: bool = no_metrics_option()`: `--no-metrics`, exclusive with `--metrics-port`."""
    return typer.Option(False, "--no-metrics", help="do not serve Prometheus metrics", show_default=False,
                        callback=_exclusive_metrics_flags)


def parse_flags(app: typer.Typer, argv: list[str] | None = None, *, prog: str | None = None) -> Namespace:
    """Parses `argv` (default: sys.argv[1:]) with the flags of `app`'s one command, without running it.

    Returns the parameters as a Namespace (`args.metrics_port`, ...), as argparse did. Like
    `app()` itself it exits: 2 with the usage and the error on a bad flag, 0 after `--help`
    or `--version` (SystemExit).
    """
    command = typer.main.get_command(app)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with command.make_context(prog or command.name, args) as ctx:
            return Namespace(**ctx.params)
    except Exception as err:  # Click's UsageError (.show) and Exit; Typer >= 0.2x vendors Click
        code = getattr(err, "exit_code", None)
        if not isinstance(code, int):
            raise
        if hasattr(err, "show"):
            err.show()
        raise SystemExit(code) from None


# ------------------------------------------------------------------ TLS (sinkflex.tls)
#: The services' `--tls-*` flags, each also read from its SINKFLEX_TLS_* environment variable.
def tls_cert_option() -> Any:
    """`tls_cert: Optional[str] = tls_cert_option()`: `--tls-cert FILE` (SINKFLEX_TLS_CERT_FILE)."""
    return typer.Option(None, "--tls-cert", metavar="FILE", envvar="SINKFLEX_TLS_CERT_FILE", show_envvar=True,
                        help="serve TLS with this PEM certificate (with --tls-key); also this service's client "
                             "certificate to other services (mutual TLS) (default: plaintext)")


def tls_key_option() -> Any:
    """`tls_key: Optional[str] = tls_key_option()`: `--tls-key FILE` (SINKFLEX_TLS_KEY_FILE)."""
    return typer.Option(None, "--tls-key", metavar="FILE", envvar="SINKFLEX_TLS_KEY_FILE", show_envvar=True,
                        help="PEM private key of --tls-cert")


def tls_ca_option() -> Any:
    """`tls_ca: Optional[str] = tls_ca_option()`: `--tls-ca FILE` (SINKFLEX_TLS_CA_FILE)."""
    return typer.Option(None, "--tls-ca", metavar="FILE", envvar="SINKFLEX_TLS_CA_FILE", show_envvar=True,
                        help="PEM CA bundle: verifies client certificates (--tls-client-auth) and the other "
                             "services this one calls")


def tls_client_auth_option() -> Any:
    """`tls_client_auth: bool = tls_client_auth_option()`: `--tls-client-auth` (SINKFLEX_TLS_CLIENT_AUTH)."""
    return typer.Option(False, "--tls-client-auth", envvar="SINKFLEX_TLS_CLIENT_AUTH", show_envvar=True,
                        help="mutual TLS: refuse clients without a certificate signed by --tls-ca")


def tls_section(base: Any, args: Any) -> dict:
    """A config's `tls` section (`base`: a TLSConfig, a dict or None) with the parsed `--tls-*`
    flags (`args.tls_cert`, `.tls_key`, `.tls_ca`, `.tls_client_auth`) laid over it."""
    from sinkflex.tls import merge_flags

    return merge_flags(base, cert=getattr(args, "tls_cert", None), key=getattr(args, "tls_key", None),
                       ca=getattr(args, "tls_ca", None), client_auth=getattr(args, "tls_client_auth", False))


def use_tls(service: str, tls: Any) -> None:
    """At a service's start: reads its TLS files (a bad one: exit 2 naming it) and makes its
    `tls` the TLS of the channels it opens to other services (when on)."""
    from sinkflex.tls import TLSError, set_client_tls

    try:
        tls.check("server")
    except TLSError as err:
        typer.echo(f"{service}: cannot start: {err}", err=True)
        raise SystemExit(2) from None
    if tls.active:
        set_client_tls(tls)
