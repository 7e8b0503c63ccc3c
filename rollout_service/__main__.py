"""`python -m rollout_service --port 50053 --model DIR [...]`: the agent loop on vLLM over gRPC.

Flags override the config file (`--config`, YAML of RolloutConfig). Without
`--env-address` / `--reward-address` the env and reward services run in-process; with
`--user-sim-port` the process also serves the OpenAI-compatible user-simulator endpoint
(backed by the same engine) and an in-process env uses it. Stops gracefully on SIGTERM.
A Typer app (`app`); `parse_args` and `main` take an argv list.
"""

from __future__ import annotations

import enum
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

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

PROG = "python -m rollout_service"
app = service_app()


class ToolFormat(str, enum.Enum):
    """`--tool-format`: AgentConfig.tool_format."""

    hermes = "hermes"
    qwen3 = "qwen3"
    llama3 = "llama3"
    harmony = "harmony"


@app.command()
def cli(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", metavar="HOST", help="address to bind"),
    port: int = port_option(50053, "gRPC port, 0: any free port"),
    version: bool = version_option("rollout_service"),
    metrics_port: Optional[int] = metrics_port_option(None),
    no_metrics: bool = no_metrics_option(),
    config: Optional[str] = typer.Option(None, metavar="FILE", help="YAML file of RolloutConfig; flags override it"),
    model: Optional[str] = typer.Option(
        None, metavar="DIR", help="model folder, transformers format (default: the prepared SmolLM2)"),
    policy_version: Optional[int] = typer.Option(None, metavar="N", help="policy version of the weights in --model"),
    max_model_len: Optional[int] = typer.Option(None, metavar="TOKENS", help="context length of the engine"),
    kv_cache_gib: Optional[float] = typer.Option(None, metavar="GIB", help="KV-cache memory of the engine, GiB"),
    dtype: Optional[str] = typer.Option(
        None, metavar="DTYPE", help="engine dtype, e.g. auto, bfloat16, float32 (default: auto)"),
    env_address: Optional[str] = typer.Option(
        None, metavar="HOST:PORT", help="env service to use (default: an in-process env)"),
    reward_address: Optional[str] = typer.Option(
        None, metavar="HOST:PORT", help="reward service to use (default: an in-process one)"),
    redis_url: Optional[str] = typer.Option(
        None, metavar="URL", help="trajectory buffer (default: REDIS_URL, else the embedded Redis)"),
    user_sim_port: Optional[int] = typer.Option(
        None, metavar="PORT",
        help="also serve the OpenAI-compatible user-simulator endpoint on this port, in [0, 65535]; 0: any free port"),
    tool_format: Optional[ToolFormat] = typer.Option(
        None, case_sensitive=True, help="tool-call format of the model (default: hermes)"),
    max_turns: Optional[int] = typer.Option(None, metavar="N", help="agent turns per episode"),
    max_new_tokens: Optional[int] = typer.Option(None, metavar="N", help="generated tokens per turn"),
    max_context_tokens: Optional[int] = typer.Option(None, metavar="N", help="tokens per trajectory"),
    temperature: Optional[float] = typer.Option(None, metavar="T", help="sampling temperature of the policy, >= 0"),
    tls_cert: Optional[str] = tls_cert_option(),
    tls_key: Optional[str] = tls_key_option(),
    tls_ca: Optional[str] = tls_ca_option(),
    tls_client_auth: bool = tls_client_auth_option(),
    log_level: str = log_level_option(),
) -> None:
    """Run the agent loop on a vLLM engine, served over gRPC until SIGTERM.

    Flags override the config file (--config, YAML of RolloutConfig). Without --env-address
    and --reward-address the env and reward services run in-process; with --user-sim-port
    the process also serves the OpenAI-compatible user-simulator endpoint (backed by the
    same engine), and an in-process env uses it.
    """
    run(Namespace(**ctx.params))


def parse_args(argv: list[str] | None = None) -> Namespace:
    """The flags of `argv` (default: sys.argv[1:]); exits 2 on a bad flag, 0 after --help/--version."""
    return parse_flags(app, argv, prog=PROG)


def config_from_args(args: Namespace):
    from rollout_service.config import RolloutConfig
    from sinkflex.config import load_config, validate_config

    base = load_config(args.config, RolloutConfig).model_dump() if args.config else {}
    engine = dict(base.get("engine") or {})
    agent = dict(base.get("agent") or {})
    if args.model or "model" not in engine:
        if args.model:
            engine["model"] = args.model
        else:
            from sinkflex.models import prepare_model

            engine["model"] = str(prepare_model("smollm2"))
    for key, val in {"policy_version": args.policy_version, "max_model_len": args.max_model_len,
                     "kv_cache_gib": args.kv_cache_gib, "dtype": args.dtype}.items():
        if val is not None:
            engine[key] = val
    tool_format = getattr(args.tool_format, "value", args.tool_format)  # a ToolFormat, or its value
    for key, val in {"tool_format": tool_format, "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
                     "max_context_tokens": args.max_context_tokens, "temperature": args.temperature}.items():
        if val is not None:
            agent[key] = val
    base.update({"engine": engine, "agent": agent})
    for key, val in {"env_address": args.env_address, "reward_address": args.reward_address,
                     "redis_url": args.redis_url, "user_sim_port": args.user_sim_port}.items():
        if val is not None:
            base[key] = val
    base["tls"] = tls_section(base.get("tls"), args)
    return validate_config(base, RolloutConfig, source="command line")


def main(argv: list[str] | None = None) -> None:
    """`python -m rollout_service` with `argv`: parse the flags and serve."""
    run(parse_args(argv))


def run(args: Namespace) -> None:
    """Serves with the parsed flags until SIGTERM."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    use_tls("rollout_service", config.tls)
    from rollout_service.server import build_server

    server, worker = build_server(config, port=args.port, host=args.host, metrics_port=metrics_port_from(args))
    server.on_stop(worker.close)
    server.install_signal_handlers()
    server.wait()


if __name__ == "__main__":
    app(prog_name=PROG)
