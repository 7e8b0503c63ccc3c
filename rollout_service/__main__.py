"""`python -m rollout_service --port 50053 --model DIR [...]`: the agent loop on vLLM over gRPC.

Flags override the config file (`--config`, YAML of RolloutConfig). Without
`--env-address` / `--reward-address` the env and reward services run in-process; with
`--user-sim-port` the process also serves the OpenAI-compatible user-simulator endpoint
(backed by the same engine) and an in-process env uses it. Stops gracefully on SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def parse_args(argv=None) -> argparse.Namespace:
    from sinkflex.service_cli import add_common_flags

    p = argparse.ArgumentParser(prog="python -m rollout_service", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50053)
    add_common_flags(p, service="rollout_service", metrics_default=None)
    p.add_argument("--config", help="YAML file of RolloutConfig")
    p.add_argument("--model", help="model folder (default: the prepared SmolLM2)")
    p.add_argument("--policy-version", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-gib", type=float)
    p.add_argument("--dtype")
    p.add_argument("--env-address")
    p.add_argument("--reward-address")
    p.add_argument("--redis-url")
    p.add_argument("--user-sim-port", type=int)
    p.add_argument("--tool-format", choices=["hermes", "harmony"])
    p.add_argument("--max-turns", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--max-context-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace):
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
    for key, val in {"tool_format": args.tool_format, "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
                     "max_context_tokens": args.max_context_tokens, "temperature": args.temperature}.items():
        if val is not None:
            agent[key] = val
    base.update({"engine": engine, "agent": agent})
    for key, val in {"env_address": args.env_address, "reward_address": args.reward_address,
                     "redis_url": args.redis_url, "user_sim_port": args.user_sim_port}.items():
        if val is not None:
            base[key] = val
    return validate_config(base, RolloutConfig, source="command line")


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    from rollout_service.server import build_server
    from sinkflex.service_cli import metrics_port_from

    server, worker = build_server(config, port=args.port, host=args.host, metrics_port=metrics_port_from(args))
    server.on_stop(worker.close)
    server.install_signal_handlers()
    server.wait()


if __name__ == "__main__":
    main()
