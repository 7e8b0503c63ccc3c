"""`LearnerClient`: one interface to the learner service, in-process or over gRPC.

It covers the learner calls the driver's controller makes — `status` (training state and the
last step's metrics) and `policy_version` (the latest *published*, i.e. durable, policy
version and where its weights are). Checkpoint has no caller outside the learner's own
tests and is not part of the interface (call the stub for it).

`LocalLearnerClient` calls a `LearnerServicer`'s methods in this process (the same code that
answers over gRPC: it reads the `LearnerRunner`'s state); `GrpcLearnerClient` speaks the
LearnerService contract to a running learner (rank 0). Both raise
`sinkflex.errors.ServiceError` with the same status codes, so callers handle one exception
type (`ServiceError.retryable`: the learner is busy, loading or restarting).

Importing this module imports no torch: `LocalLearnerClient` takes a servicer built elsewhere.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sinkflex.api.learner.v1 import learner_pb2, learner_pb2_grpc
from sinkflex.errors import ServiceError, raise_as_service_error
from sinkflex.serving import DEFAULT_MAX_MESSAGE_BYTES, make_channel, wait_for_serving


@runtime_checkable
class LearnerClient(Protocol):
    """The LearnerService calls the controller makes. Every method raises `ServiceError` on failure.

    `timeout` (seconds) bounds one call over gRPC (None: the client's default); in-process
    calls ignore it.
    """

    def status(self, timeout: float | None = None) -> learner_pb2.StatusResponse:
        """The learner's step, policy version, groups trained and the last step's (finite) metrics.

        Raises:
            ServiceError: UNAVAILABLE / DEADLINE_EXCEEDED while the learner loads, restarts or is busy.
        """
        ...

    def policy_version(self, timeout: float | None = None) -> learner_pb2.PolicyVersionResponse:
        """The latest published policy version (its checkpoint is durable) and its weights folder.

        Raises:
            ServiceError: UNAVAILABLE when nothing is published yet (e.g. during a warm start) or
                the learner does not answer; DEADLINE_EXCEEDED when it answers too late.
        """
        ...


class _InProcessContext:
    """The part of `grpc.ServicerContext` the learner servicer uses: `abort` raises the ServiceError
    the gRPC edge would have turned into a status; no deadline."""

    def abort(self, code, details):
        raise ServiceError(code, details)

    def time_remaining(self):
        return None


class LocalLearnerClient:
    """In-process client over a `learner_service.server.LearnerServicer` (or any object with its
    `Status` / `PolicyVersion` methods): no transport, the servicer's own code and errors.

    Args:
        servicer: the servicer of a running `LearnerRunner` (rank 0).
    """

    def __init__(self, servicer):
        self.servicer = servicer
        self._context = _InProcessContext()

    def status(self, timeout: float | None = None) -> learner_pb2.StatusResponse:
        return self.servicer.Status(learner_pb2.StatusRequest(), self._context)

    def policy_version(self, timeout: float | None = None) -> learner_pb2.PolicyVersionResponse:
        return self.servicer.PolicyVersion(learner_pb2.PolicyVersionRequest(), self._context)


class GrpcLearnerClient:
    """gRPC client of a learner service at `address` ("host:port").

    Args:
        address: the learner (rank 0).
        timeout: default deadline of each call in seconds (a busy learner answers late).
        max_message_bytes: send/receive size limit of the channel.
        wait_ready: block until the server's health check says SERVING (up to `timeout`).
    """

    def __init__(self, address: str, timeout: float = 30.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 wait_ready: bool = False):
        self.address = address
        self.timeout = timeout
        self.channel = make_channel(address, max_message_bytes)
        self.stub = learner_pb2_grpc.LearnerServiceStub(self.channel)
        if wait_ready:
            wait_for_serving(self.channel, "", timeout=timeout)

    @raise_as_service_error
    def status(self, timeout: float | None = None) -> learner_pb2.StatusResponse:
        return self.stub.Status(learner_pb2.StatusRequest(), timeout=self.timeout if timeout is None else timeout)

    @raise_as_service_error
    def policy_version(self, timeout: float | None = None) -> learner_pb2.PolicyVersionResponse:
        return self.stub.PolicyVersion(learner_pb2.PolicyVersionRequest(),
                                       timeout=self.timeout if timeout is None else timeout)

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()

    def __enter__(self) -> "GrpcLearnerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
