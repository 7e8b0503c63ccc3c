"""The gRPC servicer of EnvService over `EnvCore`, and `serve()` that runs it.

Health: NOT_SERVING until the tau2 domains are loaded, then SERVING; reflection; message
size limits on the server (`sinkflex.serving.ServiceServer`); graceful stop on SIGTERM.
"""

from __future__ import annotations

import logging
import threading

import grpc

from env_service.config import EnvServiceConfig
from env_service.core import EnvCore
from sinkflex.api.env.v1 import env_pb2, env_pb2_grpc
from sinkflex.errors import ServiceError, abort_on_error
from sinkflex.serving import DEFAULT_MAX_MESSAGE_BYTES, ServiceServer

log = logging.getLogger(__name__)

SERVICE_NAME = env_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    """EnvService over an `EnvCore` (ServiceError -> gRPC status)."""

    def __init__(self, core: EnvCore | None = None):
        self._core = core

    @property
    def core(self) -> EnvCore:
        if self._core is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the env service is still loading its domains")
        return self._core

    def set_core(self, core: EnvCore) -> None:
        self._core = core

    @abort_on_error
    def ListEnvironments(self, request, context):
        return env_pb2.ListEnvironmentsResponse(environments=self.core.list_environments())

    @abort_on_error
    def ListTasks(self, request, context):
        return env_pb2.ListTasksResponse(tasks=self.core.list_tasks(request.env, request.split))

    @abort_on_error
    def Reset(self, request, context):
        return self.core.reset(request)

    @abort_on_error
    def Step(self, request, context):
        applied: list = []
        response = self.core.step(request, client_gone=lambda: _client_gone(context), applied=applied)
        if applied:  # the client may still go before the answer reaches it
            session, data, n = applied[0]

            def on_rpc_done():
                if _ended_cancelled(context):  # off grpc's event thread: keep takes the session's lock
                    threading.Thread(target=self.core.keep_undelivered, args=(session, data, response, n),
                                     daemon=True).start()

            context.add_callback(on_rpc_done)
        return response

    @abort_on_error
    def Close(self, request, context):
        self.core.close(request.session_id)
        return env_pb2.CloseResponse()


def _client_gone(context) -> grpc.StatusCode | None:
    """None while the RPC's client waits for the answer; else DEADLINE_EXCEEDED (its deadline
    passed) or CANCELLED."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return None if context.is_active() else grpc.StatusCode.CANCELLED


def _ended_cancelled(context) -> bool:
    """Whether a finished RPC ended cancelled (the client cancelled, its deadline passed, or
    the connection dropped) rather than delivered. grpc-python has no public API for this
    on a sync server; its `_RPCState.client` is "cancelled" then (grpc/_server.py)."""
    state = getattr(context, "_state", None)
    return getattr(state, "client", None) == "cancelled"


def build_server(
    config: EnvServiceConfig,
    port: int = 50051,
    host: str = "127.0.0.1",
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    core: EnvCore | None = None,
    metrics_port: int | None = None,
) -> tuple[ServiceServer, EnvCore]:
    """Starts an env server (health NOT_SERVING), loads the domains, sets SERVING.

    Returns the started server (its bound port in `.port`; `port=0` picks a free one)
    and its core. The caller stops it with `server.stop()`. With `metrics_port`, Prometheus
    metrics (RPC counts and latencies by method and code, open sessions) are served there.
    """
    server = ServiceServer(port=port, service_names=[SERVICE_NAME], host=host,
                           max_workers=config.max_workers, max_message_bytes=max_message_bytes,
                           metrics_port=metrics_port, metrics_service="env", tls=config.tls)
    servicer = EnvServicer()  # UNAVAILABLE until the core is set (health says NOT_SERVING)
    env_pb2_grpc.add_EnvServiceServicer_to_server(servicer, server.server)
    server.start()
    core = core if core is not None else EnvCore(config)
    servicer.set_core(core)
    if metrics_port is not None:
        core.on_sessions_changed = server.metrics.set_sessions
    core.start_reaper()
    server.on_stop(core.shutdown)
    server.set_serving()
    log.info("env service SERVING on %s:%d: %s", host, server.port, ", ".join(core.catalog.domains))
    return server, core
