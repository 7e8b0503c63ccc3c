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
    def rollout(self, request: rollout_pb2.RolloutRequest) -> Iterator[common_pb2.TrajectoryGroup]: ...

    def update_weights(self, policy_version: int, location: str) -> rollout_pb2.UpdateWeightsResponse: ...

    def status(self) -> rollout_pb2.StatusResponse: ...


class LocalRolloutClient:
    """In-process client over a `RolloutWorker`."""

    def __init__(self, worker):
        self.worker = worker

    def rollout(self, request):
        return self.worker.rollout(request)

    def update_weights(self, policy_version, location):
        seconds = self.worker.update_weights(policy_version, location)
        return rollout_pb2.UpdateWeightsResponse(policy_version=self.worker.engine.policy_version, load_seconds=seconds)

    def status(self):
        return self.worker.status()


class GrpcRolloutClient:
    """gRPC client of a rollout service at `address` ("host:port").

    Args:
        timeout: deadline in seconds of UpdateWeights / Status, and of a whole Rollout stream.
    """

    def __init__(self, address: str, timeout: float = 3600.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 wait_ready: bool = False):
        self.address = address
        self.timeout = timeout
        self.channel = make_channel(address, max_message_bytes)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        if wait_ready:
            wait_for_serving(self.channel, "", timeout=timeout)

    def rollout(self, request):
        """Yields each finished group. Raises ServiceError (also mid-stream)."""
        try:
            for resp in self.stub.Rollout(request, timeout=self.timeout):
                yield resp.group
        except Exception as err:  # grpc.RpcError
            if hasattr(err, "code"):
                raise ServiceError.from_rpc_error(err) from None
            raise

    @raise_as_service_error
    def update_weights(self, policy_version, location):
        return self.stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(policy_version=policy_version, location=str(location)),
                                       timeout=self.timeout)

    @raise_as_service_error
    def status(self):
        return self.stub.Status(rollout_pb2.StatusRequest(), timeout=self.timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
