"""`python -m learner_service --config FILE [flags]`: the GRPO learner, launched with torchrun.

    torchrun --nproc_per_node 2 -m learner_service --config configs/learner_cpu.yaml

Every rank builds the (FSDP2-sharded) model and restores the latest checkpoint of
`run_dir`; rank 0 also reads the trajectory buffer and serves LearnerService (health,
reflection, Prometheus metrics). Without torchrun it runs as a single process. SIGTERM or
SIGINT: finish the current step, write a checkpoint, acknowledge its groups, exit 0.
A Typer app (`app`); `parse_args` and `main` take an argv list.
"""

from __future__ import annotations

import logging
import os
import signal
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

PROG = "python -m learner_service"
app = service_app()


@app.command()
def cli(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(
        None, metavar="FILE", help="YAML file of LearnerConfig (default: all defaults, needs --model)"),
    model: Optional[str] = typer.Option(None, metavar="DIR", help="overrides model.path: a transformers model folder"),
    host: str = typer.Option("127.0.0.1", metavar="HOST", help="address to bind (rank 0)"),
    port: int = port_option(50054, "LearnerService port (rank 0); 0: any free port"),
    version: bool = version_option("learner_service"),
    metrics_port: Optional[int] = metrics_port_option(9094),  # metrics on rank 0
    no_metrics: bool = no_metrics_option(),
    no_server: bool = typer.Option(False, "--no-server", help="do not serve gRPC (batch jobs, tests)"),
    run_dir: Optional[str] = typer.Option(None, metavar="DIR", help="overrides run_dir"),
    max_steps: Optional[int] = typer.Option(None, metavar="N", help="stop after this many learner steps in total"),
    redis_url: Optional[str] = typer.Option(None, metavar="URL", help="overrides buffer.url"),
    rollout_address: Optional[str] = typer.Option(
        None, metavar="HOST:PORT", help="overrides rollout_address (of the RolloutService)"),
    tls_cert: Optional[str] = tls_cert_option(),
    tls_key: Optional[str] = tls_key_option(),
    tls_ca: Optional[str] = tls_ca_option(),
    tls_client_auth: bool = tls_client_auth_option(),
    log_level: str = log_level_option(),
) -> None:
    """The GRPO learner; run it under torchrun for FSDP2.

    \b
        torchrun --nproc_per_node 2 -m learner_service --config FILE [flags]

    Every rank builds the (FSDP2-sharded) model and restores the latest checkpoint of
    run_dir; rank 0 also reads the trajectory buffer and serves LearnerService (health,
    reflection, Prometheus metrics). Without torchrun it runs as a single process. SIGTERM
    or SIGINT: finish the current step, write a checkpoint, acknowledge its groups, exit 0.
    """
    code = run(Namespace(**ctx.params))
    if code:
        raise typer.Exit(code)


def parse_args(argv: list[str] | None = None) -> Namespace:
    """The flags of `argv` (default: sys.argv[1:]); exits 2 on a bad flag, 0 after --help/--version."""
    return parse_flags(app, argv, prog=PROG)


def config_from_args(args: Namespace):
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
    data["tls"] = tls_section(data.get("tls"), args)
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


def main(argv: list[str] | None = None) -> int:
    """`python -m learner_service` with `argv`: parse the flags and train; returns the exit code."""
    return run(parse_args(argv))


def run(args: Namespace) -> int:
    """Trains with the parsed flags until --max-steps or SIGTERM/SIGINT; returns the exit code (0)."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    cfg = config_from_args(args)
    use_tls("learner_service", cfg.tls)
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
        buffer = TrajectoryBuffer(url=b.url, stream=b.stream, consumer_group=b.consumer_group, claim_idle_ms=b.claim_idle_ms,
                                  max_deliveries=b.max_deliveries, keep_acked=b.keep_acked)
    runner = LearnerRunner(learner, buffer)
    if learner.rank == 0 and not args.no_server:
        from learner_service.server import SERVICE_NAME, LearnerServicer
        from sinkflex.api.learner.v1 import learner_pb2_grpc
        from sinkflex.serving import ServiceServer

        server = ServiceServer(
            port=args.port, service_names=[SERVICE_NAME], host=args.host, metrics_port=metrics_port_from(args),
            tls=cfg.tls,
        )
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(runner), server.server)

        def export(metrics: dict, server=server, buffer=buffer) -> None:  # Prometheus gauges
            server.metrics.tokens("trained").add(int(metrics.get("positions_trained", 0)))
            stats = buffer.stats()  # logs a warning past memory_warn_fraction of Redis's maxmemory
            server.metrics.set_queue_lag(buffer.stream, cfg.buffer.consumer_group, stats.unconsumed)
            server.metrics.set_buffer(buffer.stream, stats.memory_fraction, stats.dead_letters)

        runner.on_step = export
        server.start()
        server.set_serving()
    signal.signal(signal.SIGTERM, lambda *_: runner.request_stop())
    signal.signal(signal.SIGINT, lambda *_: runner.request_stop())
    try:
        step = runner.run(max_steps=args.max_steps)
        logging.getLogger("learner_service").info("stopped at step %d, policy version %d", step, learner.state.policy_version)
        _wait_for_every_rank()
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


def _wait_for_every_rank() -> None:
    """Barrier before a clean exit: rank 0 writes the last published version after the
    collective gather, and a rank that tore its gloo process group down while rank 0 was still
    writing aborted (``terminate called without an active exception``), failing the job."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    app(prog_name=PROG)
