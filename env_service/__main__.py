"""`python -m env_service --host H --port P [...]`: serve tau2 domains over gRPC.

Flags override the config file (`--config`, YAML of EnvServiceConfig). Stops gracefully
on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not try the network


def parse_args(argv=None) -> argparse.Namespace:
    from sinkflex.service_cli import add_common_flags

    p = argparse.ArgumentParser(prog="python -m env_service", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--config", help="YAML file of EnvServiceConfig")
    p.add_argument("--domains", help="comma-separated tau2 domains (default: retail,airline,telecom,mock)")
    p.add_argument("--task-files", action="append", default=[], metavar="DOMAIN=PATH[,PATH]",
                   help="extra tau2 task dirs/files for a domain (tau2's tasks.json + split_tasks.json; repeatable)")
    p.add_argument("--user-model", help='litellm model of the user simulator, e.g. "openai/smollm2"')
    p.add_argument("--user-base-url", help="OpenAI-compatible base URL of the user LLM")
    p.add_argument("--user-api-key", help="API key of the user LLM endpoint")
    p.add_argument("--user-temperature", type=float)
    p.add_argument("--user-max-tokens", type=int)
    p.add_argument("--max-sessions", type=int)
    p.add_argument("--session-ttl", type=float, dest="session_ttl_seconds", help="idle seconds before a session is freed")
    p.add_argument("--max-steps", type=int, dest="default_max_steps", help="default step budget of an episode")
    p.add_argument("--no-reward", action="store_true", help="do not score episodes with tau2's evaluator on termination")
    p.add_argument("--max-workers", type=int)
    add_common_flags(p, service="env_service", metrics_default=9091)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def parse_task_files(values: list[str]) -> dict[str, list[str]]:
    """`["mock=DIR1,DIR2", "retail=DIR3"]` -> `{"mock": [DIR1, DIR2], "retail": [DIR3]}`."""
    out: dict[str, list[str]] = {}
    for value in values:
        domain, sep, paths = value.partition("=")
        if not sep or not domain.strip() or not paths.strip():
            raise SystemExit(f"--task-files {value!r}: expected DOMAIN=PATH[,PATH...]")
        out.setdefault(domain.strip(), []).extend(p.strip() for p in paths.split(",") if p.strip())
    return out


def config_from_args(args: argparse.Namespace):
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
    return validate_config(base, EnvServiceConfig, source="command line")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from env_service.logs import quiet_tau2_logs

    quiet_tau2_logs("DEBUG" if args.log_level.upper() == "DEBUG" else "WARNING")
    config = config_from_args(args)
    from tau2_adapter.tasks import domain_tasks

    try:  # a bad task file fails here, with its name, before any port is bound (loads are cached)
        for domain, files in config.task_files.items():
            domain_tasks(domain, files)
    except ValueError as err:
        raise SystemExit(f"env_service: cannot start: {err}") from None
    from env_service.server import build_server
    from sinkflex.service_cli import metrics_port_from

    metrics_port = metrics_port_from(args)
    server, _core = build_server(config, port=args.port, host=args.host, metrics_port=metrics_port)
    server.install_signal_handlers()
    server.wait()


if __name__ == "__main__":
    main()
