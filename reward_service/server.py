"""The reward service's gRPC servicer and server (`python -m reward_service`).

`RewardServicer` is a thin edge over `reward_service.scoring`: Score maps a
`ServiceError` to its gRPC status; ScoreBatch never fails for one item (each item carries
its own error and error_code), and refuses a batch of more than `max_batch_items` items
(INVALID_ARGUMENT naming the cap). `build_server` adds health (NOT_SERVING until the task
sets are loaded), reflection, message-size limits on both directions, graceful shutdown
and Prometheus metrics (`sinkflex.serving.ServiceServer`).
"""

from __future__ import annotations

import logging

import grpc

from reward_service.config import JudgeConfig, RewardServiceConfig
from reward_service.scoring import TaskCatalog, batch_item, score
from sinkflex.api.reward.v1 import reward_pb2, reward_pb2_grpc
from sinkflex.errors import ServiceError, abort_on_error
from sinkflex.serving import ServiceServer

log = logging.getLogger(__name__)

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["RewardService"].full_name


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    """Score / ScoreBatch over tau2's `evaluate_simulation` (see `reward_service.scoring`)."""

    def __init__(self, catalog: TaskCatalog | None = None, judge: JudgeConfig | None = None,
                 max_batch_items: int = 256) -> None:
        self.catalog = catalog or TaskCatalog()
        self.judge = judge
        self.max_batch_items = max_batch_items

    def load(self, envs: list[str]) -> None:
        """Loads tau2 (a few seconds) and the task sets of `envs` before the service says SERVING."""
        for env in envs:
            n = len(self.catalog.tasks(env))
            log.info("loaded %d tasks of env %r", n, env)

    @abort_on_error
    def Score(self, request: reward_pb2.ScoreRequest, context) -> reward_pb2.ScoreResponse:
        return reward_pb2.ScoreResponse(breakdown=score(request, self.catalog, self.judge))

    @abort_on_error
    def ScoreBatch(self, request: reward_pb2.ScoreBatchRequest, context) -> reward_pb2.ScoreBatchResponse:
        if len(request.items) > self.max_batch_items:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"ScoreBatch of {len(request.items)} items is above this "
                               f"server's cap of {self.max_batch_items} (reward_service.max_batch_items): split it")
        return reward_pb2.ScoreBatchResponse(items=[batch_item(r, self.catalog, self.judge) for r in request.items])


def build_server(config: RewardServiceConfig, catalog: TaskCatalog | None = None) -> tuple[ServiceServer, RewardServicer]:
    """A started-not-yet server (health NOT_SERVING) and its servicer; call `start()`, `load()`, `set_serving()`."""
    catalog = catalog if catalog is not None else TaskCatalog(task_files=config.task_files)
    servicer = RewardServicer(catalog=catalog, judge=config.judge, max_batch_items=config.max_batch_items)
    server = ServiceServer(
        port=config.port,
        service_names=[SERVICE_NAME],
        host=config.host,
        max_workers=config.max_workers,
        max_message_bytes=config.max_message_bytes,
        grace_seconds=config.grace_seconds,
        metrics_port=config.metrics_port,
        metrics_service="reward",
        tls=config.tls,
    )
    reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server.server)
    return server, servicer


def serve(config: RewardServiceConfig) -> None:
    """Runs the service until SIGTERM/SIGINT: start, load task sets, SERVING, wait, graceful stop."""
    server, servicer = build_server(config)
    server.install_signal_handlers()
    server.start()
    servicer.load(list(dict.fromkeys([*config.preload_envs, *config.task_files])))
    server.set_serving()
    log.info(
        "reward service SERVING on %s:%d (NL judge: %s)",
        config.host,
        server.port,
        config.judge.model if config.judge else "none",
    )
    server.wait()
