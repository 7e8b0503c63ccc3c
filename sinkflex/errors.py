"""One error type for every service call, in-process or over gRPC.

Core logic raises `ServiceError(code, message)`; servicers turn it into a gRPC status
(`abort_on_error`), and gRPC clients turn a failed RPC back into it (`from_rpc_error`),
so callers handle the same exception whichever client implementation they use.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import grpc

F = TypeVar("F", bound=Callable[..., Any])


class ServiceError(Exception):
    """A request failed with a gRPC status code and a message saying what was wrong."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> "ServiceError":
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
            raise ServiceError.from_rpc_error(err) from None

    return wrapper  # type: ignore[return-value]
