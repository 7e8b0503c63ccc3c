"""`RolloutClient`: one interface to the rollout service, in-process or over gRPC.

`LocalRolloutClient` calls a `RolloutWorker` directly; `GrpcRolloutClient` speaks the
RolloutService contract. Both raise `sinkflex.errors.ServiceError`.
"""

from __future__ import annotations

from typing import Iterator, Protocol, runtime_checkable

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from sinkflex.errors import ServiceError, raise_as_service_error
from sinkflex.serving import DEFAULT_MAX_MESSAGE_BYTES, make_channel, wait_for_serving


@runtime_checkable
class RolloutClient(Protocol):
    """The RolloutService calls. Every method raises `ServiceError` on failure.

    `timeout` (seconds) bounds one call over gRPC — for `rollout`, the whole stream — (None:
    the client's default); in-process calls ignore it.
    """

    def rollout(self, request: rollout_pb2.RolloutRequest,
                timeout: float | None = None) -> Iterator[common_pb2.TrajectoryGroup]:
        """Yields each finished, scored group of `request` (published to the buffer when
        request.publish), in completion order.

        Raises (also mid-stream):
            ServiceError: INVALID_ARGUMENT, NOT_FOUND (env or task), FAILED_PRECONDITION (the env's
                reward service does not know it), UNAVAILABLE / DEADLINE_EXCEEDED.
        """
        ...

    def update_weights(self, policy_version: int, location: str,
                       timeout: float | None = None) -> rollout_pb2.UpdateWeightsResponse:
        """Loads policy `policy_version` from the weights folder `location` into the engine;
        returns the version served then and the load time.

        Raises:
            ServiceError: the load failed, or the service did not answer.
        """
        ...

    def status(self, timeout: float | None = None) -> rollout_pb2.StatusResponse:
        """The served model and policy version, groups in flight / completed and the engine's
        metrics (engine_busy_seconds, engine_uptime_seconds, ...).

        Raises:
            ServiceError: UNAVAILABLE while the engine loads; DEADLINE_EXCEEDED.
        """
        ...


class LocalRolloutClient:
    """In-process client over a `RolloutWorker`."""

    def __init__(self, worker):
        self.worker = worker

    def rollout(self, request, timeout=None):
        return self.worker.rollout(request)

    def update_weights(self, policy_version, location, timeout=None):
        seconds = self.worker.update_weights(policy_version, location)
        return rollout_pb2.UpdateWeightsResponse(policy_version=self.worker.engine.policy_version, load_seconds=seconds)

    def status(self, timeout=None):
        return self.worker.status()


class GrpcRolloutClient:
    """gRPC client of a rollout service at `address` ("host:port").

    Args:
        timeout: default deadline in seconds of UpdateWeights / Status, and of a whole Rollout stream.
    """

    def __init__(self, address: str, timeout: float = 3600.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 wait_ready: bool = False):
        self.address = address
        self.timeout = timeout
        self.channel = make_channel(address, max_message_bytes)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        if wait_ready:
            wait_for_serving(self.channel, "", timeout=timeout)

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def rollout(self, request, timeout=None):
        """Yields each finished group. Raises ServiceError (also mid-stream)."""
        try:
            for resp in self.stub.Rollout(request, timeout=self._timeout(timeout)):
                yield resp.group
        except Exception as err:  # grpc.RpcError
            if hasattr(err, "code"):
                raise ServiceError.from_rpc_error(err) from None
            raise

    @raise_as_service_error
    def update_weights(self, policy_version, location, timeout=None):
        return self.stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(policy_version=policy_version, location=str(location)),
                                       timeout=self._timeout(timeout))

    @raise_as_service_error
    def status(self, timeout=None):
        return self.stub.Status(rollout_pb2.StatusRequest(), timeout=self._timeout(timeout))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
