"""gRPC plumbing shared by every SinkFlex service and client.

Every server built here serves `grpc.health.v1` (NOT_SERVING until the service calls
`set_serving()`), server reflection, message-size limits, and stops gracefully on
SIGTERM/SIGINT: it refuses new RPCs and lets in-flight ones finish within a grace period.
Every client channel gets the same size limits, so an oversized message fails with
RESOURCE_EXHAUSTED on whichever side sees it, and the server keeps serving.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sinkflex.metrics import MetricsServer, ServiceMetrics, start_metrics_server

log = logging.getLogger(__name__)

#: Default limit on one gRPC message, both directions, in bytes (64 MiB): a long
#: trajectory (~10 MB of messages and token ids) fits; a runaway one is refused.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options that set the send and receive message-size limits (bytes) on a server or channel."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def make_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """An insecure channel to `address` ("host:port") with the message-size limits set."""
    return grpc.insecure_channel(address, options=channel_options(max_message_bytes))


def wait_for_serving(channel: grpc.Channel, service: str = "", timeout: float = 60.0) -> None:
    """Blocks until the server's health check reports SERVING for `service`.

    Raises:
        TimeoutError: not SERVING within `timeout` seconds.
    """
    import time

    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as err:  # not up yet
            last = f"{err.code().name}: {err.details()}"
        time.sleep(0.1)
    raise TimeoutError(f"service {service!r} not SERVING after {timeout:.0f}s: {last}")


@dataclass
class ServiceServer:
    """A gRPC server with health, reflection, size limits and graceful shutdown.

    Usage::

        server = ServiceServer(port=50051, service_names=[env_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name])
        env_pb2_grpc.add_EnvServiceServicer_to_server(servicer, server.server)
        server.start()              # health: NOT_SERVING
        servicer.load()             # load domains / model ...
        server.set_serving()        # health: SERVING
        server.wait()               # until SIGTERM / SIGINT / stop()

    With `metrics_port` set, `start()` also serves Prometheus metrics on
    `host:metrics_port` (`sinkflex.metrics`): every RPC is counted by method and status
    code with its latency, and the service sets its own gauges through `server.metrics`
    (`set_sessions`, `set_queue_lag`, `tokens(kind).add(n)`). `metrics_service` is the
    `sinkflex_service` label (default: from the first service name, "EnvService" -> "env").
    `interceptors` are extra `grpc.ServerInterceptor`s, run after the metrics one.
    """

    port: int
    service_names: Iterable[str]
    host: str = "127.0.0.1"
    max_workers: int = 32
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_seconds: float = 10.0
    metrics_port: int | None = None
    metrics_service: str | None = None
    interceptors: Sequence[grpc.ServerInterceptor] = ()

    def __post_init__(self) -> None:
        self.service_names = list(self.service_names)
        if self.metrics_service is None:
            first = self.service_names[0].rpartition(".")[2] if self.service_names else "sinkflex"
            self.metrics_service = first.removesuffix("Service").lower() or first.lower()
        self.metrics = ServiceMetrics(self.metrics_service)
        interceptors = list(self.interceptors)
        if self.metrics_port is not None:
            interceptors.insert(0, self.metrics.interceptor())
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.max_workers),
            options=channel_options(self.max_message_bytes),
            interceptors=interceptors or None,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopped = threading.Event()
        self._metrics_server: MetricsServer | None = None
        self._on_stop: list[Callable[[], None]] = []

    def _set_all(self, status: int) -> None:
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def start(self) -> int:
        """Binds and starts serving (health NOT_SERVING). Returns the bound port."""
        bound = self.server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise OSError(f"could not bind {self.host}:{self.port}")
        self.port = bound
        if self.metrics_port is not None:
            self._metrics_server = start_metrics_server(self.metrics_port, self.host)
            self.metrics_port = self._metrics_server.port
            log.info("Prometheus metrics on http://%s:%d/metrics", self.host, self.metrics_port)
        self.server.start()
        log.info("listening on %s:%d (%s)", self.host, bound, ", ".join(self.service_names))
        return bound

    def set_serving(self) -> None:
        self._set_all(health_pb2.HealthCheckResponse.SERVING)

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Registers a callback run after the server has stopped (free sessions, engines...)."""
        self._on_stop.append(fn)

    def stop(self) -> None:
        """Health NOT_SERVING, refuse new RPCs, let in-flight RPCs finish within the grace period."""
        if self._stopped.is_set():
            return
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(self.grace_seconds).wait()
        if self._metrics_server is not None:
            self._metrics_server.stop()
        for fn in self._on_stop:
            try:
                fn()
            except Exception:  # noqa: BLE001 - shutdown must go on
                log.exception("stop callback failed")
        self._stopped.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the server gracefully (main thread only)."""

        def handler(signum, _frame):
            log.info("signal %s: stopping gracefully", signal.Signals(signum).name)
            threading.Thread(target=self.stop, daemon=True).start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def wait(self) -> None:
        """Blocks until stop() has finished."""
        while not self._stopped.wait(0.5):
            pass
