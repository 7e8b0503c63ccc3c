"""The gRPC servicer of RolloutService over `RolloutWorker`, and `build_server()`.

Health: NOT_SERVING until the vLLM engine is loaded, then SERVING; reflection; size limits;
graceful stop on SIGTERM (`sinkflex.serving.ServiceServer`): new RPCs are refused; every
in-flight episode ends at its next turn boundary (`RolloutWorker.begin_stop`) and its group is
streamed back as failed (INFRASTRUCTURE_ERROR, metric `stopped`, the reason in
`reward_breakdown.info`), unscored and never published, within the grace period; groups
already published to the buffer are never lost (the buffer holds them until the learner acks).

Guards (docs/reliability.md "Security"): with TLS on, UpdateWeights is allowed to the learner
and driver identities only, and a Rollout with publish=true to the driver only
(`sinkflex.authz`); UpdateWeights loads only `<policy_root>/v<N>` for version N, strictly
increasing (`engine.check_policy_location`); a Rollout request above `config.limits` (group
size, tasks, turns, context) is INVALID_ARGUMENT naming the cap, before anything runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import grpc

from rollout_service.config import RolloutConfig, RolloutLimits
from rollout_service.engine import check_policy_location
from rollout_service.worker import RolloutWorker
from sinkflex.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from sinkflex.authz import PUBLISH, Policy
from sinkflex.errors import ServiceError, abort_on_error
from sinkflex.serving import ServiceServer

log = logging.getLogger(__name__)

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """RolloutService over a `RolloutWorker` (ServiceError -> gRPC status).

    Args:
        worker: the worker (None: set later with `set_worker`, UNAVAILABLE until then).
        limits: caps on one Rollout request.
        policy_root: the only folder UpdateWeights loads from (None: any).
        authz: who may publish (`sinkflex.authz.Policy`; default: nothing checked).
    """

    def __init__(self, worker: RolloutWorker | None = None, limits: RolloutLimits | None = None,
                 policy_root: str | None = None, authz: Policy | None = None):
        self._worker = worker
        self.limits = limits or RolloutLimits()
        self.policy_root = policy_root
        self.authz = authz or Policy()

    @property
    def worker(self) -> RolloutWorker:
        if self._worker is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the rollout service is still loading its engine")
        return self._worker

    def set_worker(self, worker: RolloutWorker) -> None:
        self._worker = worker

    def _check_engine(self) -> None:
        engine = getattr(self.worker, "engine", None)
        if engine is not None and callable(getattr(engine, "dead", None)) and engine.dead():
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the rollout service's vLLM engine process died: NOT_SERVING")

    def _check_limits(self, request) -> None:
        lim = self.limits
        checks = (
            (request.group_size, lim.max_group_size, "group_size", "max_group_size"),
            (len(request.task_ids), lim.max_tasks_per_call, "the number of task_ids", "max_tasks_per_call"),
            (request.max_turns, lim.max_turns, "max_turns", "max_turns"),
            (request.max_context_tokens, lim.max_context_tokens, "max_context_tokens", "max_context_tokens"),
        )
        for value, cap, what, name in checks:
            if value > cap:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{what} {value} is above this server's cap {cap} (rollout_service.limits.{name})")
        sp = request.sampling
        if not (math.isfinite(sp.temperature) and 0 <= sp.temperature <= lim.max_temperature):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.temperature {sp.temperature} is not in "
                               f"[0, {lim.max_temperature}] (rollout_service.limits.max_temperature; 0: the default)")
        if not (math.isfinite(sp.top_p) and 0 <= sp.top_p <= 1):
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"sampling.top_p {sp.top_p} is not in [0, 1] (0: the default)")
        if sp.max_new_tokens > lim.max_context_tokens or sp.max_new_tokens < 0 or sp.top_k < -1:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, (
                f"sampling.max_new_tokens {sp.max_new_tokens} must be in [0, {lim.max_context_tokens}] "
                f"(rollout_service.limits.max_context_tokens) and top_k {sp.top_k} >= -1"))
        if request.max_turns < 0 or request.max_context_tokens < 0:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"max_turns ({request.max_turns}) and max_context_tokens ({request.max_context_tokens}) "
                               "must be >= 0 (0: the server's default)")

    def Rollout(self, request, context):
        try:
            self._check_limits(request)
            if request.publish:
                self.authz.check(context, PUBLISH)
            self._check_engine()
            for group in self.worker.rollout(request, on_end=context.add_callback):
                if not context.is_active():
                    break
                yield rollout_pb2.RolloutResponse(group=group)
        except ServiceError as err:
            context.abort(err.code, err.message)
        except asyncio.CancelledError:
            if context.is_active():  # not the client's cancellation
                raise
        if not context.is_active():
            log.warning("Rollout client went away: its groups in flight were cancelled, none published; "
                        "groups published before stay in the buffer")

    @abort_on_error
    def UpdateWeights(self, request, context):
        worker = self.worker  # UNAVAILABLE while the engine loads
        folder = check_policy_location(request.policy_version, request.location, self.policy_root)
        seconds = worker.update_weights(request.policy_version, str(folder))
        return rollout_pb2.UpdateWeightsResponse(policy_version=self.worker.engine.policy_version, load_seconds=seconds)

    @abort_on_error
    def Status(self, request, context):
        self._check_engine()
        return self.worker.status()


def build_server(config: RolloutConfig, port: int = 50053, host: str = "127.0.0.1", worker: RolloutWorker | None = None,
                 metrics_port: int | None = None, grace_seconds: float = 60.0) -> tuple[ServiceServer, RolloutWorker]:
    """Starts the server (NOT_SERVING), builds the worker (loads the engine), then SERVING.

    Returns:
        (server, worker); `server.port` is the bound port (port 0: any free one).
    """
    server = ServiceServer(port=port, service_names=[SERVICE_NAME], host=host, metrics_port=metrics_port,
                           grace_seconds=grace_seconds, tls=config.tls)
    if config.policy_root is None:
        log.warning("rollout_service.policy_root is not set: UpdateWeights loads any folder of safetensors on this "
                    "host; set it to the learner's <run_dir>/policy")
    servicer = RolloutServicer(limits=config.limits, policy_root=config.policy_root, authz=server.authz)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    server.start()
    worker = worker if worker is not None else RolloutWorker(config)
    servicer.set_worker(worker)
    server.on_stopping(worker.begin_stop)
    server.set_serving()
    log.info("rollout service SERVING on %s:%d (model %s)", host, server.port, config.engine.model)
    _watch_engine(server, worker)
    return server, worker


def _watch_engine(server: ServiceServer, worker: RolloutWorker, every_s: float = 1.0) -> None:
    """A daemon thread: once the engine process dies, health goes NOT_SERVING for good (a client that
    health-checks, or the launcher, sees it; Rollout and Status fail UNAVAILABLE)."""

    engine = getattr(worker, "engine", None)
    if engine is None or not callable(getattr(engine, "dead", None)):
        return

    def watch() -> None:
        while not server._stopped.is_set():  # noqa: SLF001 - the server's own stop flag
            if engine.dead():
                log.error("the vLLM engine process died: rollout service NOT_SERVING")
                server.set_not_serving()
                return
            time.sleep(every_s)

    threading.Thread(target=watch, name="engine-watchdog", daemon=True).start()
