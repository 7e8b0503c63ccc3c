"""gRPC plumbing shared by every SinkFlex service and client.

Every server built here serves `grpc.health.v1` (NOT_SERVING until the service calls
`set_serving()`), server reflection, message-size limits, and stops gracefully on
SIGTERM/SIGINT: it refuses new RPCs and lets in-flight ones finish within a grace period.
Every client channel gets the same size limits, so an oversized message fails with
RESOURCE_EXHAUSTED on whichever side sees it, and the server keeps serving.

Request bytes that are not the method's message (garbage, truncated, invalid UTF-8 in a
string field) are answered INVALID_ARGUMENT naming the message type, without reaching the
servicer (`BadRequestInterceptor`; grpc's own answer would be INTERNAL "Exception
deserializing request!" with a traceback in the log for each). A `ServiceError` raised by a
servicer that does not map it itself becomes its status, and any status message leaving a
server is at most 1 KiB (`sinkflex.errors.MAX_MESSAGE_BYTES`).
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sinkflex.authz import AuthzInterceptor, Policy, policy_for
from sinkflex.errors import ServiceError, bound_message
from sinkflex.limits import LimitsInterceptor
from sinkflex.metrics import MetricsServer, ServiceMetrics, start_metrics_server
from sinkflex.retry import poll_until
from sinkflex.tls import TLSConfig, client_tls, unavailable_hint

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


def make_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tls: TLSConfig | None = None) -> grpc.Channel:
    """A channel to `address` ("host:port") with the message-size limits set.

    `tls` None: the process's client TLS (`sinkflex.tls.client_tls()`: what the service set,
    else the SINKFLEX_TLS_* environment), plaintext when that is off. The channel remembers
    whether it is TLS (`channel_is_tls`), so errors can say when a mismatch is the likely cause.
    """
    tls = tls if tls is not None else client_tls()
    if tls.active:
        channel = grpc.secure_channel(address, tls.channel_credentials(),
                                      options=[*channel_options(max_message_bytes), *tls.channel_options()])
    else:
        channel = grpc.insecure_channel(address, options=channel_options(max_message_bytes))
    try:
        channel._sinkflex_tls = tls.active  # type: ignore[attr-defined]
    except AttributeError:  # a channel type without a __dict__: no hint
        pass
    return channel


def channel_is_tls(channel: grpc.Channel) -> bool | None:
    """Whether `make_channel` made `channel` with TLS (None: not one of its channels)."""
    return getattr(channel, "_sinkflex_tls", None)


def wait_for_serving(channel: grpc.Channel, service: str = "", timeout: float = 60.0) -> None:
    """Blocks until the server's health check reports SERVING for `service`.

    Raises:
        TimeoutError: not SERVING within `timeout` seconds.
    """
    stub = health_pb2_grpc.HealthStub(channel)
    last = ["no answer"]

    def serving() -> bool:
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
        except grpc.RpcError as err:  # not up yet
            last[0] = f"{err.code().name}: {err.details()}"
            tls = channel_is_tls(channel)
            hint = unavailable_hint(err.details() or "", tls) if tls is not None else ""
            if hint and err.code() == grpc.StatusCode.UNAVAILABLE:
                last[0] = f"{last[0]} ({hint})"
            return False
        if resp.status == health_pb2.HealthCheckResponse.SERVING:
            return True
        last[0] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return False

    if poll_until(serving, timeout, every_s=0.1):
        return
    raise TimeoutError(f"service {service!r} not SERVING after {timeout:.0f}s: {last[0]}")


class _Undecodable:
    """What the wrapped deserializer hands on for bytes that do not parse (never None:
    grpc treats a None request as a deserialization failure)."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _type_name(deserializer: Callable | None) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) or "request message"


def _lenient(deserializer: Callable[[bytes], object]) -> Callable[[bytes], object]:
    type_name = _type_name(deserializer)

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as err:  # noqa: BLE001 - any parse failure is the client's bad bytes
            # upb names the fault: "Wire format was corrupt", "String field had bad UTF-8"
            text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            return _Undecodable(f"the request is not a valid {type_name} ({len(data)} bytes): {text}")

    return deserialize


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    context.abort(code, bound_message(message))


class BadRequestInterceptor(grpc.ServerInterceptor):
    """Clear answers to bad input on every RPC of a server.

    - request bytes that do not parse as the method's message: INVALID_ARGUMENT, with the
      type name, the size and the parser's error (the servicer is not called);
    - a `sinkflex.errors.ServiceError` that escapes a servicer: its own status;
    - every status message leaving the server: bounded (`sinkflex.errors.bound_message`).
    Anything else a servicer raises is left to grpc (UNKNOWN), so bugs stay visible.
    """

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        if handler.request_streaming:
            behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
        else:
            behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        wrapped = self._wrap(behavior, handler.request_streaming, handler.response_streaming, method)
        fields = {"request_deserializer": _lenient(handler.request_deserializer)}
        name = {(False, False): "unary_unary", (False, True): "unary_stream",
                (True, False): "stream_unary", (True, True): "stream_stream"}[
            (handler.request_streaming, handler.response_streaming)]
        fields[name] = wrapped
        return handler._replace(**fields)

    @staticmethod
    def _wrap(behavior, request_streaming: bool, response_streaming: bool, method: str):
        def checked(request, context):
            if isinstance(request, _Undecodable):
                log.info("%s: %s", method, request.message)
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return request

        def requests(iterator, context):
            for request in iterator:
                yield checked(request, context)

        if response_streaming:
            def handle(request, context):
                request = requests(request, context) if request_streaming else checked(request, context)
                try:
                    yield from behavior(request, context)
                except ServiceError as err:
                    _abort(context, err.code, err.message)
        else:
            def handle(request, context):
                request = requests(request, context) if request_streaming else checked(request, context)
                try:
                    return behavior(request, context)
                except ServiceError as err:
                    _abort(context, err.code, err.message)
        return handle


class BindError(OSError):
    """A server's gRPC address cannot be bound (`ServiceServer.start`): the port is in use or the
    host is not an address of this machine. The services' command lines report it in one line."""


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
    `interceptors` are extra `grpc.ServerInterceptor`s, run after the metrics one and
    before `BadRequestInterceptor` (always installed, innermost: undecodable request bytes
    are INVALID_ARGUMENT, and counted so by the metrics). `tls` (`sinkflex.tls.TLSConfig`,
    None or inactive: plaintext) serves TLS, or mutual TLS with
    `require_client_auth`; its files are read by `start()` (`TLSError` naming a bad one).
    Load shedding (`sinkflex.limits.LimitsInterceptor`, always installed, outermost after
    metrics): at most `max_concurrent_rpcs` calls at once (default: `max_workers` − min(4, half), so
    health checks and refusals always find a thread; a call over it is RESOURCE_EXHAUSTED
    naming the limit) and `method_max_bytes` per-method request limits (default
    `sinkflex.limits.DEFAULT_METHOD_MAX_BYTES`). With `authz` (a `sinkflex.authz.Policy`;
    default: `policy_for(tls)`, enforced when TLS is on) the protected methods are refused
    to callers whose certificate does not name an allowed identity.
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
    tls: TLSConfig | None = None
    max_concurrent_rpcs: int | None = 0
    method_max_bytes: Mapping[str, int] | None = None
    authz: Policy | None = None

    def __post_init__(self) -> None:
        self.service_names = list(self.service_names)
        if self.metrics_service is None:
            first = self.service_names[0].rpartition(".")[2] if self.service_names else "sinkflex"
            self.metrics_service = first.removesuffix("Service").lower() or first.lower()
        self.metrics = ServiceMetrics(self.metrics_service)
        if self.max_concurrent_rpcs == 0:
            self.max_concurrent_rpcs = max(1, self.max_workers - min(4, self.max_workers // 2))
        if self.authz is None:
            self.authz = policy_for(self.tls)
        self.limits = LimitsInterceptor(self.max_concurrent_rpcs, self.method_max_bytes)
        interceptors = [self.limits, AuthzInterceptor(self.authz), *self.interceptors, BadRequestInterceptor()]
        if self.metrics_port is not None:
            interceptors.insert(0, self.metrics.interceptor())
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.max_workers),
            # no SO_REUSEPORT (gRPC's default on Linux): a second server on a port already served
            # must fail to bind, not share the port and get half of the first one's calls
            options=[*channel_options(self.max_message_bytes), ("grpc.so_reuseport", 0)],
            interceptors=interceptors,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopped = threading.Event()
        self._metrics_server: MetricsServer | None = None
        self._on_stop: list[Callable[[], None]] = []
        self._on_stopping: list[Callable[[], None]] = []

    def _set_all(self, status: int) -> None:
        for name in ["", *self.service_names]:
            self.health.set(name, status)

    def start(self) -> int:
        """Binds and starts serving (health NOT_SERVING). Returns the bound port.

        Raises:
            ValueError: the port is not in 0–65535 (gRPC would bind another one).
            BindError: the address cannot be bound (the port is in use, also by another of our
                servers, or the host is not an address of this machine).
        """
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port!r} is not in 0–65535 (0: any free port)")
        address = f"{self.host}:{self.port}"
        try:
            if self.tls is not None and self.tls.active:
                bound = self.server.add_secure_port(address, self.tls.server_credentials())
            else:
                bound = self.server.add_insecure_port(address)
        except RuntimeError:  # gRPC >= 1.5x raises instead of returning 0
            bound = 0
        if bound == 0:
            raise BindError(f"could not bind {address}: the port is in use or {self.host} is not an address of this machine")
        self.port = bound
        if self.metrics_port is not None:
            self._metrics_server = start_metrics_server(self.metrics_port, self.host)
            self.metrics_port = self._metrics_server.port
            log.info("Prometheus metrics on http://%s:%d/metrics", self.host, self.metrics_port)
        self.server.start()
        log.info("listening on %s:%d (%s; %s)", self.host, bound, ", ".join(self.service_names),
                 self.tls.describe() if self.tls is not None else "plaintext")
        return bound

    def set_serving(self) -> None:
        self._set_all(health_pb2.HealthCheckResponse.SERVING)

    def set_not_serving(self) -> None:
        """Health NOT_SERVING while the server keeps answering (e.g. its engine died)."""
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    def on_stopping(self, fn: Callable[[], None]) -> None:
        """Registers a callback run when the stop begins, before the grace period (e.g. tell
        in-flight work to wind down so that it ends within the grace period)."""
        self._on_stopping.append(fn)

    def on_stop(self, fn: Callable[[], None]) -> None:
        """Registers a callback run after the server has stopped (free sessions, engines...)."""
        self._on_stop.append(fn)

    def stop(self) -> None:
        """Health NOT_SERVING, refuse new RPCs, let in-flight RPCs finish within the grace period."""
        if self._stopped.is_set():
            return
        self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        for fn in self._on_stopping:
            try:
                fn()
            except Exception:  # noqa: BLE001 - shutdown must go on
                log.exception("stopping callback failed")
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
