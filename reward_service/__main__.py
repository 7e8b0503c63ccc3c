"""`python -m reward_service --host H --port P [--judge-model M --judge-base-url URL] [--task-files mock=DIR]`.

Flags override the fields of an optional YAML config (`--config`, a `RewardServiceConfig`).
The judge's API key may also come from the environment variable SINKFLEX_JUDGE_API_KEY.
"""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from pathlib import Path

import typer

from sinkflex.service_cli import (
    metrics_port_option,
    no_metrics_option,
    resolve_metrics_port,
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

app = service_app()


@app.command()
def main(
    host: str | None = typer.Option(None, metavar="HOST", help="address to bind (default: 127.0.0.1)"),
    port: int | None = typer.Option(None, metavar="PORT", help="gRPC port (default: 50052); 0: any free port"),
    metrics_port: int | None = metrics_port_option(None, unset="9092"),
    no_metrics: bool = no_metrics_option(),
    max_message_bytes: int | None = typer.Option(
        None, metavar="BYTES", help="gRPC message-size limit (default: 64 MiB)"),
    preload_env: list[str] | None = typer.Option(
        None, metavar="ENV", help="env whose tasks load before SERVING (repeatable)"),
    task_files: list[str] | None = typer.Option(
        None, "--task-files", metavar="ENV=PATH[,PATH]",
        help="extra tau2 task dirs/files for an env (tau2's tasks.json + split_tasks.json; repeatable)"),
    judge_model: str | None = typer.Option(
        None, metavar="MODEL", help="NL-assertion judge model name (enables NL_ASSERTION)"),
    judge_base_url: str | None = typer.Option(
        None, metavar="URL", help="judge's OpenAI-compatible base URL, e.g. http://h:8000/v1"),
    judge_api_key: str | None = typer.Option(
        None, metavar="KEY", envvar="SINKFLEX_JUDGE_API_KEY", help="judge's API key"),
    tls_cert: str | None = tls_cert_option(),
    tls_key: str | None = tls_key_option(),
    tls_ca: str | None = tls_ca_option(),
    tls_client_auth: bool = tls_client_auth_option(),
    config: Path | None = typer.Option(None, metavar="FILE", help="YAML RewardServiceConfig; flags override it"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="debug logging"),
    version: bool = version_option("reward_service"),
) -> None:
    """Serves tau2-Bench's reward checker (Score, ScoreBatch) over gRPC until SIGTERM.

    Each reward is tau2's evaluator's, in [0, 1]; NL_ASSERTION checks need a judge
    (--judge-model). Flags override the fields of --config (a RewardServiceConfig); the
    judge's API key may also come from SINKFLEX_JUDGE_API_KEY.
    """
    from reward_service.config import RewardServiceConfig
    from sinkflex.config import ConfigError, load_config, validate_config

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from tau2_adapter.logs import quiet_tau2_logs

    quiet_tau2_logs("DEBUG" if verbose else "WARNING")
    try:
        base = load_config(config, RewardServiceConfig).model_dump() if config else {}
        flags = {"host": host, "port": port, "max_message_bytes": max_message_bytes}
        base.update({k: v for k, v in flags.items() if v is not None})
        if no_metrics or metrics_port is not None:  # --metrics-port -1: none, as --no-metrics
            base["metrics_port"] = resolve_metrics_port(metrics_port, no_metrics)
        if preload_env:
            base["preload_envs"] = list(preload_env)
        if task_files:
            files = {k: list(v) for k, v in (base.get("task_files") or {}).items()}
            for value in task_files:
                env, sep, paths = value.partition("=")
                if not sep or not env.strip() or not paths.strip():
                    typer.echo(f"--task-files {value!r}: expected ENV=PATH[,PATH...]", err=True)
                    raise typer.Exit(2)
                files.setdefault(env.strip(), []).extend(p.strip() for p in paths.split(",") if p.strip())
            base["task_files"] = files
        judge = dict(base.get("judge") or {})
        for key, value in (("model", judge_model), ("base_url", judge_base_url), ("api_key", judge_api_key)):
            if value is not None:
                judge[key] = value
        if judge.get("model"):  # an API key alone (e.g. from the environment) enables no judge
            base["judge"] = judge
        base["tls"] = tls_section(base.get("tls"), Namespace(tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca,
                                                              tls_client_auth=tls_client_auth))
        cfg = validate_config(base, RewardServiceConfig, source="flags")
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None

    use_tls("reward_service", cfg.tls)
    from tau2_adapter.tasks import domain_tasks

    from tau2_adapter.tasks import task_sets

    try:  # a bad task file or an unknown preloaded env fails here, named, before any port is bound (loads are cached)
        for env, files in cfg.task_files.items():
            domain_tasks(env, files)
        from tau2.registry import registry

        known = sorted(set(registry.get_domains()) & set(task_sets()) | set(cfg.task_files))  # what Score knows
        for env in cfg.preload_envs:
            if env not in known:
                raise ValueError(f"preload env {env[:200]!r} (--preload-env / preload_envs) is unknown; known envs: "
                                 f"{', '.join(known)}")
    except ValueError as err:
        typer.echo(f"reward_service: cannot start: {err}", err=True)
        raise typer.Exit(2) from None

    from reward_service.server import serve
    from sinkflex.serving import BindError

    try:
        serve(cfg)
    except BindError as err:  # the port is in use (also by another reward server), or the host is not this machine's
        typer.echo(f"reward_service: cannot start: {err}", err=True)
        raise typer.Exit(1) from None


if __name__ == "__main__":
    app()
