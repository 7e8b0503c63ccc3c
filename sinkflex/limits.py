"""Load shedding on every SinkFlex gRPC server: a cap on concurrent RPCs and per-method
request-size limits (`LimitsInterceptor`, installed by `sinkflex.serving.ServiceServer`).

- Concurrency: at most `max_concurrent_rpcs` calls run at once (a streaming call holds its
  slot until its stream ends); one more is answered RESOURCE_EXHAUSTED at once, naming the
  limit ("... max_concurrent_rpcs 64 ..."), instead of queueing without bound behind the
  worker threads. Health checks and reflection are exempt, so a busy server still reports
  SERVING.
- Request size: a method listed in `method_max_bytes` refuses a request whose serialized
  size is above its limit with RESOURCE_EXHAUSTED naming the method, the size and the limit,
  before the bytes are parsed. Unlisted methods keep the server-wide limit
  (`max_message_bytes`, 64 MiB by default: trajectories and conversations are large).
  `DEFAULT_METHOD_MAX_BYTES` lists the control methods, whose requests are a few bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import grpc

from sinkflex.errors import SERVER_BUSY, bound_message

log = logging.getLogger(__name__)

KIB = 1024

#: Requests that never carry trajectories or conversations: small limits.
DEFAULT_METHOD_MAX_BYTES: dict[str, int] = {
    "/sinkflex.api.rollout.v1.RolloutService/UpdateWeights": 64 * KIB,
    "/sinkflex.api.rollout.v1.RolloutService/Status": 64 * KIB,
    "/sinkflex.api.rollout.v1.RolloutService/Rollout": 1024 * KIB,
    "/sinkflex.api.learner.v1.LearnerService/Status": 64 * KIB,
    "/sinkflex.api.learner.v1.LearnerService/Checkpoint": 64 * KIB,
    "/sinkflex.api.learner.v1.LearnerService/PolicyVersion": 64 * KIB,
    "/sinkflex.api.env.v1.EnvService/ListEnvironments": 64 * KIB,
    "/sinkflex.api.env.v1.EnvService/ListTasks": 64 * KIB,
    "/sinkflex.api.env.v1.EnvService/Close": 64 * KIB,
}

#: Default cap on concurrent RPCs of one server.
DEFAULT_MAX_CONCURRENT_RPCS = 64

_EXEMPT_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


class _TooLarge:
    """What the size-checking deserializer hands on instead of parsing an oversized request."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


class LimitsInterceptor(grpc.ServerInterceptor):
    """Concurrent-RPC cap and per-method request-size limits (module docstring).

    Args:
        max_concurrent_rpcs: calls allowed at once (None: no cap).
        method_max_bytes: full method name -> largest request in bytes.
    """

    def __init__(self, max_concurrent_rpcs: int | None = DEFAULT_MAX_CONCURRENT_RPCS,
                 method_max_bytes: Mapping[str, int] | None = None):
        if max_concurrent_rpcs is not None and max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {max_concurrent_rpcs}")
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.method_max_bytes = dict(DEFAULT_METHOD_MAX_BYTES if method_max_bytes is None else method_max_bytes)
        self._lock = threading.Lock()
        self.in_flight = 0
        self.refused = 0

    def _acquire(self) -> bool:
        with self._lock:
            if self.max_concurrent_rpcs is not None and self.in_flight >= self.max_concurrent_rpcs:
                self.refused += 1
                return False
            self.in_flight += 1
            return True

    def _release(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_EXEMPT_PREFIXES):
            return handler
        kind = {(False, False): "unary_unary", (False, True): "unary_stream",
                (True, False): "stream_unary", (True, True): "stream_stream"}[
            (handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, kind)
        limit = self.method_max_bytes.get(method)
        fields: dict = {}
        if limit is not None and handler.request_deserializer is not None:
            inner = handler.request_deserializer

            def deserialize(data: bytes):
                if len(data) > limit:
                    return _TooLarge(f"{method}: the request is {len(data)} bytes, above this method's limit of "
                                     f"{limit} bytes (method_max_bytes)")
                return inner(data)

            fields["request_deserializer"] = deserialize
        cap = self.max_concurrent_rpcs

        def refuse(context) -> None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, bound_message(
                f"{SERVER_BUSY}: {cap} RPCs already in progress (max_concurrent_rpcs {cap}); retry with backoff"))

        def oversized(request, context) -> None:
            if isinstance(request, _TooLarge):
                log.info("%s", request.message)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, bound_message(request.message))

        if handler.response_streaming:
            def limited(request, context):
                if not handler.request_streaming:
                    oversized(request, context)
                if not self._acquire():
                    refuse(context)
                try:
                    yield from behavior(request, context)
                finally:
                    self._release()
        else:
            def limited(request, context):
                if not handler.request_streaming:
                    oversized(request, context)
                if not self._acquire():
                    refuse(context)
                try:
                    return behavior(request, context)
                finally:
                    self._release()
        fields[kind] = limited
        return handler._replace(**fields)
