"""One error type for every service call, in-process or over gRPC.

Core logic raises `ServiceError(code, message)`; servicers turn it into a gRPC status
(`abort_on_error`), and gRPC clients turn a failed RPC back into it (`from_rpc_error`),
so callers handle the same exception whichever client implementation they use.

Every message is bounded: `ServiceError` keeps at most `MAX_MESSAGE_BYTES` (1 KiB) of
UTF-8, with lone surrogates escaped, so a status never exceeds a client's metadata limit
(16 KiB by default) nor fails to encode. Code that quotes a request's value in a message
quotes it with `clip()` (at most `MAX_QUOTE_CHARS` characters, repr-style, with its length),
so an id of 10 MB is named, not echoed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

F = TypeVar("F", bound=Callable[..., Any])

#: Longest error message (UTF-8 bytes) a ServiceError carries; longer ones are cut.
MAX_MESSAGE_BYTES = 1024
#: Longest quote of a request value in a message (characters, before repr escaping).
MAX_QUOTE_CHARS = 120
#: Status codes of a service that is slow, starting or restarting: worth asking again (`ServiceError.retryable`).
RETRYABLE_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})
#: How a load-shedding refusal's message starts (`sinkflex.limits.LimitsInterceptor`): RESOURCE_EXHAUSTED
#: with it means the server refused the call before running it (`ServiceError.shed`).
SERVER_BUSY = "server busy"


def safe_text(text: str) -> str:
    """`text` with lone surrogates (not encodable as UTF-8) written as backslash escapes."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bound_message(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message` as valid UTF-8 of at most `limit` bytes (cut, with a note, when longer)."""
    message = safe_text(str(message))
    data = message.encode("utf-8")
    if len(data) <= limit:
        return message
    note = f" ...[cut: {len(data)} bytes]"
    return data[: limit - len(note)].decode("utf-8", "ignore") + note


def clip(value: Any, limit: int = MAX_QUOTE_CHARS) -> str:
    """A bounded quote of a request value for an error message: `repr(value)`, and for a
    string longer than `limit` characters its first `limit` and its length, e.g.
    `'xxxxxxxx'... (20000 chars)`."""
    if isinstance(value, str) and len(value) > limit:
        return f"{safe_text(repr(value[:limit]))}... ({len(value)} chars)"
    text = safe_text(repr(value))
    return text if len(text) <= 2 * limit else text[: 2 * limit] + f"... ({len(text)} chars)"


class ServiceError(Exception):
    """A request failed with a gRPC status code and a message saying what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str):
        message = bound_message(message)
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @property
    def retryable(self) -> bool:
        """Worth sending again, if the call is idempotent: the service did not answer in time or
        is not serving (yet) (DEADLINE_EXCEEDED or UNAVAILABLE, `RETRYABLE_CODES`), or its load
        shedding refused the call (`shed`). The one predicate of every retry of an idempotent
        call (polls, Status, ScoreBatch); a call that changes state (an env Step) may be sent
        again only when `shed`, since a DEADLINE_EXCEEDED one may have run."""
        return self.code in RETRYABLE_CODES or self.shed

    @property
    def shed(self) -> bool:
        """The server's load shedding refused the call before running it (RESOURCE_EXHAUSTED,
        message starting with `SERVER_BUSY`): it changed nothing, and the same call may be sent
        again after a backoff, whatever the method. Other RESOURCE_EXHAUSTED answers (a request
        above a size limit, too many open sessions) are not."""
        return self.code == grpc.StatusCode.RESOURCE_EXHAUSTED and self.message.startswith(SERVER_BUSY)

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> ServiceError:
        return cls(err.code(), err.details() or "")


def not_found(what: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, what)


def invalid_argument(what: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, what)


def failed_precondition(what: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, what)


def resource_exhausted(what: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, what)


def abort_on_error(method: F) -> F:
    """Decorates a servicer method: a `ServiceError` becomes `context.abort(code, message)`."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except ServiceError as err:
            context.abort(err.code, err.message)

    return wrapper  # type: ignore[return-value]


def raise_as_service_error(method: F) -> F:
    """Decorates a gRPC client method: a `grpc.RpcError` becomes a `ServiceError`."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except grpc.RpcError as err:
            error = ServiceError.from_rpc_error(err)
            tls = getattr(getattr(args[0], "channel", None), "_sinkflex_tls", None) if args else None
            if tls is not None and error.code == grpc.StatusCode.UNAVAILABLE:
                from sinkflex.tls import unavailable_hint

                hint = unavailable_hint(error.message, tls)
                if hint:
                    error = ServiceError(error.code, f"{error.message} ({hint})")
            raise error from None

    return wrapper  # type: ignore[return-value]
