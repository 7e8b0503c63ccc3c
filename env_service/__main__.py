"""`python -m env_service --host H --port P [...]`: serve tau2 domains over gRPC.

Flags override the config file (`--config`, YAML of EnvServiceConfig). Stops gracefully
on SIGTERM/SIGINT. A Typer app (`app`); `parse_args` and `main` take an argv list.
"""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from typing import Optional

import typer

from sinkflex.service_cli import (
    log_level_option,
    metrics_port_from,
    metrics_port_option,
    no_metrics_option,
    parse_flags,
    port_option,
    service_app,
    tls_ca_option,
    tls_cert_option,
    tls_client_auth_option,
    tls_key_option,
    tls_section,
    use_tls,
    version_option,
)

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not try the network

PROG = "python -m env_service"
app = service_app()


@app.command()
def cli(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", metavar="HOST", help="address to bind"),
    port: int = port_option(50051, "gRPC port, 0: any free port"),
    config: Optional[str] = typer.Option(None, metavar="FILE", help="YAML file of EnvServiceConfig; flags override it"),
    domains: Optional[str] = typer.Option(
        None, metavar="LIST", help="comma-separated tau2 domains (default: retail,airline,telecom,mock)"),
    task_files: Optional[list[str]] = typer.Option(
        None, "--task-files", metavar="DOMAIN=PATH[,PATH]",
        help="extra tau2 task dirs/files for a domain (tau2's tasks.json + split_tasks.json; repeatable)"),
    user_model: Optional[str] = typer.Option(
        None, metavar="MODEL", help='litellm model of the user simulator, e.g. "openai/smollm2"'),
    user_base_url: Optional[str] = typer.Option(None, metavar="URL", help="OpenAI-compatible base URL of the user LLM"),
    user_api_key: Optional[str] = typer.Option(None, metavar="KEY", help="API key of the user LLM endpoint"),
    user_temperature: Optional[float] = typer.Option(
        None, metavar="T", help="sampling temperature of the user simulator, in [0, 2] (default: 0.0)"),
    user_max_tokens: Optional[int] = typer.Option(
        None, metavar="N", help="cap on the tokens of one user-simulator reply (default: the endpoint's)"),
    max_sessions: Optional[int] = typer.Option(
        None, metavar="N", help="open sessions at most; a Reset beyond fails (default: 1024)"),
    session_ttl_seconds: Optional[float] = typer.Option(
        None, "--session-ttl", metavar="SECONDS", help="idle seconds before a session is freed"),
    default_max_steps: Optional[int] = typer.Option(
        None, "--max-steps", metavar="N", help="default step budget of an episode"),
    no_reward: bool = typer.Option(
        False, "--no-reward", help="do not score episodes with tau2's evaluator on termination"),
    max_workers: Optional[int] = typer.Option(None, metavar="N", help="gRPC server threads (default: 64)"),
    version: bool = version_option("env_service"),
    metrics_port: Optional[int] = metrics_port_option(9091),
    no_metrics: bool = no_metrics_option(),
    tls_cert: Optional[str] = tls_cert_option(),
    tls_key: Optional[str] = tls_key_option(),
    tls_ca: Optional[str] = tls_ca_option(),
    tls_client_auth: bool = tls_client_auth_option(),
    log_level: str = log_level_option(),
) -> None:
    """Serve tau2 domains over gRPC until SIGTERM/SIGINT.

    Flags override the config file (--config, YAML of EnvServiceConfig); a bad config value,
    an unknown domain or a bad task file fails the start, naming it, before any port is bound
    (exit 2); a port in use or a host that is not this machine's, exit 1.
    """
    run(Namespace(**ctx.params))


def parse_args(argv: list[str] | None = None) -> Namespace:
    """The flags of `argv` (default: sys.argv[1:]); exits 2 on a bad flag, 0 after --help/--version."""
    return parse_flags(app, argv, prog=PROG)


def parse_task_files(values: list[str]) -> dict[str, list[str]]:
    """`["mock=DIR1,DIR2", "retail=DIR3"]` -> `{"mock": [DIR1, DIR2], "retail": [DIR3]}`."""
    out: dict[str, list[str]] = {}
    for value in values:
        domain, sep, paths = value.partition("=")
        if not sep or not domain.strip() or not paths.strip():
            raise SystemExit(f"--task-files {value!r}: expected DOMAIN=PATH[,PATH...]")
        out.setdefault(domain.strip(), []).extend(p.strip() for p in paths.split(",") if p.strip())
    return out


def config_from_args(args: Namespace):
    from env_service.config import EnvServiceConfig
    from sinkflex.config import load_config, validate_config

    base = load_config(args.config, EnvServiceConfig).model_dump() if args.config else {}
    overrides = {
        "user_model": args.user_model,
        "user_base_url": args.user_base_url,
        "user_api_key": args.user_api_key,
        "user_temperature": args.user_temperature,
        "user_max_tokens": args.user_max_tokens,
        "max_sessions": args.max_sessions,
        "session_ttl_seconds": args.session_ttl_seconds,
        "default_max_steps": args.default_max_steps,
        "max_workers": args.max_workers,
        "domains": tuple(d.strip() for d in args.domains.split(",") if d.strip()) if args.domains else None,
        "reward_on_termination": False if args.no_reward else None,
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    if args.task_files:
        files = {k: list(v) for k, v in (base.get("task_files") or {}).items()}
        for k, v in parse_task_files(args.task_files).items():
            files.setdefault(k, []).extend(v)
        base["task_files"] = files
    base["tls"] = tls_section(base.get("tls"), args)
    return validate_config(base, EnvServiceConfig, source="command line")


def main(argv: list[str] | None = None) -> None:
    """`python -m env_service` with `argv`: parse the flags and serve."""
    run(parse_args(argv))


def run(args: Namespace) -> None:
    """Serves with the parsed flags until SIGTERM/SIGINT."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tau2_adapter.logs import quiet_tau2_logs

    quiet_tau2_logs("DEBUG" if args.log_level.upper() == "DEBUG" else "WARNING")
    from sinkflex.config import ConfigError

    try:
        config = config_from_args(args)
    except ConfigError as err:  # a bad --config file or flag value: named, exit 2
        typer.echo(f"env_service: {err}", err=True)
        raise SystemExit(2) from None
    use_tls("env_service", config.tls)
    from env_service.catalog import check_domains
    from tau2_adapter.tasks import domain_tasks

    try:  # an unknown domain or a bad task file fails here, named, before any port is bound (loads are cached)
        check_domains(config.domains)
        for domain, files in config.task_files.items():
            domain_tasks(domain, files)
    except ValueError as err:
        typer.echo(f"env_service: cannot start: {err}", err=True)
        raise SystemExit(2) from None
    from env_service.server import build_server
    from sinkflex.serving import BindError

    metrics_port = metrics_port_from(args)
    try:
        server, _core = build_server(config, port=args.port, host=args.host, metrics_port=metrics_port)
    except BindError as err:  # the port is in use (also by another env server), or the host is not this machine's
        raise SystemExit(f"env_service: cannot start: {err}") from None
    server.install_signal_handlers()
    server.wait()


if __name__ == "__main__":
    app(prog_name=PROG)
