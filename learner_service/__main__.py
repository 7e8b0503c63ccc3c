"""`python -m learner_service --config FILE [flags]`: the GRPO learner, launched with torchrun.

    torchrun --nproc_per_node 2 -m learner_service --config configs/learner_cpu.yaml

Every rank builds the (FSDP2-sharded) model and restores the latest checkpoint of
`run_dir`; rank 0 also reads the trajectory buffer and serves LearnerService (health,
reflection, Prometheus metrics). Without torchrun it runs as a single process. SIGTERM or
SIGINT: finish the current step, write a checkpoint, acknowledge its groups, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal


def parse_args(argv=None) -> argparse.Namespace:
    from sinkflex.service_cli import add_common_flags

    p = argparse.ArgumentParser(prog="python -m learner_service", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="YAML file of LearnerConfig (default: all defaults, needs --model)")
    p.add_argument("--model", help="overrides model.path: a transformers model folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50054, help="LearnerService port (rank 0); 0: any free port")
    add_common_flags(p, service="learner_service", metrics_default=9094)  # metrics on rank 0
    p.add_argument("--no-server", action="store_true", help="do not serve gRPC (batch jobs, tests)")
    p.add_argument("--run-dir", help="overrides run_dir")
    p.add_argument("--max-steps", type=int, help="stop after this many learner steps in total")
    p.add_argument("--redis-url", help="overrides buffer.url")
    p.add_argument("--rollout-address", help="overrides rollout_address (host:port of RolloutService)")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace):
    from learner_service.config import LearnerConfig, load_learner_config
    from sinkflex.config import validate_config

    if args.config:
        data = load_learner_config(args.config).model_dump()
    elif args.model:
        data = {"model": {"path": args.model}}
    else:
        raise SystemExit("python -m learner_service: give --config FILE or --model FOLDER")
    if args.model:
        data["model"] = {**data["model"], "path": args.model, "arch": None}
    if args.run_dir:
        data["run_dir"] = args.run_dir
    if args.redis_url:
        data.setdefault("buffer", {})["url"] = args.redis_url
    if args.rollout_address:
        data["rollout_address"] = args.rollout_address
    return validate_config(data, LearnerConfig, source="command line")


def init_distributed() -> None:
    """Joins the torchrun process group (gloo on CPU, NCCL on CUDA); no-op without torchrun."""
    import torch
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    cfg = config_from_args(args)
    init_distributed()

    from learner_service.checkpoint import load_checkpoint
    from learner_service.loop import LearnerRunner
    from learner_service.trainer import Learner

    learner = Learner(cfg)
    load_checkpoint(learner)
    buffer = server = None
    if learner.rank == 0:
        from sinkflex.buffer import TrajectoryBuffer

        b = cfg.buffer
        buffer = TrajectoryBuffer(url=b.url, stream=b.stream, consumer_group=b.consumer_group, claim_idle_ms=b.claim_idle_ms)
    kill_at = os.environ.get("SINKFLEX_LEARNER_KILL_BEFORE_ACK_STEP")  # fault injection (tests)
    runner = LearnerRunner(learner, buffer, kill_before_ack_step=int(kill_at) if kill_at else None)
    if learner.rank == 0 and not args.no_server:
        from learner_service.server import SERVICE_NAME, LearnerServicer
        from sinkflex.api.learner.v1 import learner_pb2_grpc
        from sinkflex.service_cli import metrics_port_from
        from sinkflex.serving import ServiceServer

        server = ServiceServer(
            port=args.port, service_names=[SERVICE_NAME], host=args.host, metrics_port=metrics_port_from(args),
        )
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(runner), server.server)

        def export(metrics: dict, server=server, buffer=buffer) -> None:  # Prometheus gauges
            server.metrics.tokens("trained").add(int(metrics.get("positions_trained", 0)))
            server.metrics.set_queue_lag(buffer.stream, cfg.buffer.consumer_group, buffer.stats().unconsumed)

        runner.on_step = export
        server.start()
        server.set_serving()
    signal.signal(signal.SIGTERM, lambda *_: runner.request_stop())
    signal.signal(signal.SIGINT, lambda *_: runner.request_stop())
    try:
        step = runner.run(max_steps=args.max_steps)
        logging.getLogger("learner_service").info("stopped at step %d, policy version %d", step, learner.state.policy_version)
    finally:
        if server is not None:
            server.stop()
        if buffer is not None:
            buffer.close()
        learner.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
