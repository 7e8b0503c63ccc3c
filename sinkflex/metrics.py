"""Prometheus metrics for every SinkFlex service.

What it gives a service:

- `start_metrics_server(port, host)` serves `/metrics` (Prometheus text format) over HTTP
  from a daemon thread (`prometheus_client.start_http_server`).
- `GrpcMetricsInterceptor(service)` — a `grpc.ServerInterceptor` that counts every RPC by
  method and status code and records its latency. Metric names and labels follow
  grpc-ecosystem/go-grpc-prometheus, so the usual gRPC dashboards and alerts work as is:

  ``grpc_server_started_total{grpc_type, grpc_service, grpc_method}``
  ``grpc_server_handled_total{grpc_type, grpc_service, grpc_method, grpc_code}``
  ``grpc_server_handling_seconds{grpc_type, grpc_service, grpc_method}`` (histogram, seconds)

  Every series also carries ``sinkflex_service`` (env, reward, rollout, learner), so several
  services inside one process (the embedded launcher, tests) stay apart.
- Gauges and a counter that services set themselves, labelled by ``sinkflex_service``:

  ``sinkflex_sessions`` — open sessions / episodes in flight (count);
  ``sinkflex_queue_lag`` — entries of a Redis stream not yet acknowledged by a consumer
  group (count; labels ``stream``, ``group``);
  ``sinkflex_tokens_total`` — tokens processed (counter; label ``kind``: generated,
  trained, ...), and ``sinkflex_tokens_per_second`` — its rate over a sliding window
  (gauge, tokens/s), kept by `TokenRate`.

`ServiceMetrics(service)` bundles the labelled children for one service. All metrics live in
`prometheus_client`'s default registry (process and platform collectors included).
The streaming methods' latency is the time until the last message was sent.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "GRPC_HANDLED",
    "GRPC_HANDLING_SECONDS",
    "GRPC_STARTED",
    "QUEUE_LAG",
    "SESSIONS",
    "TOKENS_PER_SECOND",
    "TOKENS_TOTAL",
    "GrpcMetricsInterceptor",
    "MetricsServer",
    "ServiceMetrics",
    "TokenRate",
    "start_metrics_server",
]

_GRPC_LABELS = ("sinkflex_service", "grpc_type", "grpc_service", "grpc_method")

#: Latency buckets in seconds: sub-millisecond env steps up to multi-minute rollouts.
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)

GRPC_STARTED = Counter(
    "grpc_server_started_total", "RPCs started on the server.", _GRPC_LABELS
)
GRPC_HANDLED = Counter(
    "grpc_server_handled_total",
    "RPCs completed on the server, by status code.",
    (*_GRPC_LABELS, "grpc_code"),
)
GRPC_HANDLING_SECONDS = Histogram(
    "grpc_server_handling_seconds",
    "Time from the start of an RPC until the server finished it (seconds).",
    _GRPC_LABELS,
    buckets=LATENCY_BUCKETS_S,
)
SESSIONS = Gauge("sinkflex_sessions", "Open sessions or episodes in flight.", ("sinkflex_service",))
QUEUE_LAG = Gauge(
    "sinkflex_queue_lag",
    "Entries of a Redis stream not yet acknowledged by a consumer group.",
    ("sinkflex_service", "stream", "group"),
)
BUFFER_MEMORY_FRACTION = Gauge(
    "sinkflex_buffer_memory_fraction",
    "Redis used memory / maxmemory of the trajectory buffer (0: no maxmemory set); with noeviction, "
    "writes fail at 1.0: alert above 0.8.",
    ("sinkflex_service", "stream"),
)
BUFFER_DEAD_LETTERS = Gauge(
    "sinkflex_buffer_dead_letters",
    "Entries in the trajectory buffer's dead-letter stream (groups the learner could not train).",
    ("sinkflex_service", "stream"),
)
TOKENS_TOTAL = Counter(
    "sinkflex_tokens", "Tokens processed (generated, trained, ...).", ("sinkflex_service", "kind")
)
TOKENS_PER_SECOND = Gauge(
    "sinkflex_tokens_per_second",
    "Tokens processed per second over a sliding window.",
    ("sinkflex_service", "kind"),
)


class MetricsServer:
    """A running `/metrics` HTTP server: its bound `port`, and `stop()`."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.port = int(server.server_port)

    def stop(self) -> None:
        """Stops serving and frees the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(port: int, host: str = "0.0.0.0") -> MetricsServer:
    """Serves `/metrics` on `host:port` from a daemon thread.

    `port=0` binds a free port (read it from `.port`). Uses
    `prometheus_client.start_http_server`.

    Raises:
        OSError: the address cannot be bound.
    """
    server, thread = prometheus_client.start_http_server(port, addr=host)
    return MetricsServer(server, thread)


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


def _split_method(full_method: str) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method or full_method


class GrpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts RPCs by method and status code and records their latency (seconds).

    Pass it to `grpc.server(..., interceptors=[GrpcMetricsInterceptor("env")])`. The status
    code is the one the servicer set or aborted with (`context.abort`, `set_code`); an
    exception escaping the servicer counts as UNKNOWN; an RPC whose client went away before
    the servicer finished counts as CANCELLED (DEADLINE_EXCEEDED once its deadline passed).
    Health and reflection RPCs are counted too.

    Ours rather than py-grpc-prometheus (0.8.0): its metrics are module-level with fixed labels and
    default buckets, so it cannot carry sinkflex_service (several services in one process) nor the
    multi-minute latency buckets rollouts need.
    """

    def __init__(self, service: str) -> None:
        self.service = service

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return None
        rpc_type = _rpc_type(handler)
        grpc_service, grpc_method = _split_method(handler_call_details.method)
        labels = (self.service, rpc_type, grpc_service, grpc_method)
        if handler.response_streaming:
            behavior = handler.stream_stream if handler.request_streaming else handler.unary_stream
            wrapped = self._wrap_stream(behavior, labels)
        else:
            behavior = handler.stream_unary if handler.request_streaming else handler.unary_unary
            wrapped = self._wrap_unary(behavior, labels)
        factory = {
            "unary": grpc.unary_unary_rpc_method_handler,
            "server_stream": grpc.unary_stream_rpc_method_handler,
            "client_stream": grpc.stream_unary_rpc_method_handler,
            "bidi_stream": grpc.stream_stream_rpc_method_handler,
        }[rpc_type]
        return factory(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    @staticmethod
    def _record(labels: tuple[str, ...], context: grpc.ServicerContext, start: float, failed: bool) -> None:
        code = context.code()
        if code is None and not context.is_active():  # the client went away before the end
            code = _gone_code(context)
        if code is None:
            code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
        GRPC_HANDLED.labels(*labels, code.name).inc()
        GRPC_HANDLING_SECONDS.labels(*labels).observe(time.perf_counter() - start)

    def _wrap_unary(self, behavior: Callable[..., Any], labels: tuple[str, ...]) -> Callable[..., Any]:
        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            GRPC_STARTED.labels(*labels).inc()
            start = time.perf_counter()
            failed = True
            try:
                response = behavior(request, context)
                failed = False
                return response
            finally:
                self._record(labels, context, start, failed)

        return unary

    def _wrap_stream(self, behavior: Callable[..., Any], labels: tuple[str, ...]) -> Callable[..., Any]:
        def stream(request: Any, context: grpc.ServicerContext) -> Any:
            GRPC_STARTED.labels(*labels).inc()
            start = time.perf_counter()
            failed = True
            try:
                yield from behavior(request, context)
                failed = False
            except GeneratorExit:  # the client cancelled or the deadline passed
                if context.code() is None:
                    context.set_code(_gone_code(context))
                raise
            finally:
                self._record(labels, context, start, failed)

        return stream


DEADLINE_SLACK_S = 0.05
"""Seconds before its deadline within which a cancelled RPC counts as DEADLINE_EXCEEDED.

The client's own timer cancels the call at its deadline, and that cancellation can reach the
server before the server's copy of the deadline (sent as `grpc-timeout`) passes: on loopback
with the cores busy, 6 of 150 such calls ended with 0.6-2.7 ms still remaining."""


def _gone_code(context: grpc.ServicerContext) -> grpc.StatusCode:
    """The code of an RPC whose client went away before the servicer finished: DEADLINE_EXCEEDED
    once its deadline has passed (within DEADLINE_SLACK_S), else CANCELLED."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


class TokenRate:
    """Tokens per second over a sliding window, exported as `sinkflex_tokens_per_second`.

    `add(n)` also increments the `sinkflex_tokens_total` counter, so Prometheus can compute
    its own `rate()` as well. Thread-safe.
    """

    def __init__(self, service: str, kind: str, window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self._counter = TOKENS_TOTAL.labels(service, kind)
        self._gauge = TOKENS_PER_SECOND.labels(service, kind)
        self._start = clock()

    def add(self, n_tokens: int) -> float:
        """Records `n_tokens` now; returns the updated rate (tokens/s)."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        self._counter.inc(n_tokens)
        with self._lock:
            now = self._clock()
            self._events.append((now, n_tokens))
            return self._update(now)

    def rate(self) -> float:
        """The current rate (tokens/s) over the window, also refreshing the gauge."""
        with self._lock:
            return self._update(self._clock())

    def _update(self, now: float) -> float:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        span = min(self.window_s, max(now - self._start, 1e-9))
        value = sum(n for _, n in self._events) / span
        self._gauge.set(value)
        return value


class ServiceMetrics:
    """The metrics one service sets itself: sessions, queue lag, token throughput.

    Example::

        m = ServiceMetrics("rollout")
        m.set_sessions(12)
        m.set_queue_lag("sinkflex:groups", "learners", 3)
        m.tokens("generated").add(512)
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self._rates: dict[str, TokenRate] = {}
        self._lock = threading.Lock()

    def set_sessions(self, n: int) -> None:
        SESSIONS.labels(self.service).set(n)

    def set_queue_lag(self, stream: str, group: str, n: int) -> None:
        QUEUE_LAG.labels(self.service, stream, group).set(n)

    def set_buffer(self, stream: str, memory_fraction: float, dead_letters: int) -> None:
        """The buffer's Redis memory use against maxmemory and its dead-letter count (`BufferStats`)."""
        BUFFER_MEMORY_FRACTION.labels(self.service, stream).set(memory_fraction)
        BUFFER_DEAD_LETTERS.labels(self.service, stream).set(dead_letters)

    def tokens(self, kind: str) -> TokenRate:
        """The `TokenRate` for `kind` ("generated", "trained", ...), made on first use."""
        with self._lock:
            if kind not in self._rates:
                self._rates[kind] = TokenRate(self.service, kind)
            return self._rates[kind]

    def interceptor(self) -> GrpcMetricsInterceptor:
        return GrpcMetricsInterceptor(self.service)
