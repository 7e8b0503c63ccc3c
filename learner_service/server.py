"""The LearnerService gRPC servicer (rank 0): Status, Checkpoint, PolicyVersion.

Reads the runner's state; Checkpoint asks the training loop for a checkpoint at its next
tick (within one `buffer.block_ms` when idle, after the current step when training) and
waits for it.
"""

from __future__ import annotations

import concurrent.futures
import math

import grpc

from learner_service.loop import LearnerRunner
from sinkflex.api.learner.v1 import learner_pb2, learner_pb2_grpc
from sinkflex.errors import ServiceError, abort_on_error

SERVICE_NAME = learner_pb2.DESCRIPTOR.services_by_name["LearnerService"].full_name


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    """Serves a `LearnerRunner`'s state over gRPC.

    Args:
        runner: the running learner loop.
        checkpoint_timeout_s: how long Checkpoint waits for the loop (DEADLINE_EXCEEDED after).
    """

    def __init__(self, runner: LearnerRunner, checkpoint_timeout_s: float = 600.0):
        self.runner = runner
        self.checkpoint_timeout_s = checkpoint_timeout_s

    @abort_on_error
    def Status(self, request, context):
        s = self.runner.learner.state
        metrics = {k: float(v) for k, v in self.runner.learner.last_metrics.items() if math.isfinite(v)}
        return learner_pb2.StatusResponse(
            step=s.step, policy_version=s.policy_version, groups_trained=s.groups_trained, metrics=metrics
        )

    @abort_on_error
    def Checkpoint(self, request, context):
        fut = self.runner.request_checkpoint()
        timeout = self.checkpoint_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        try:
            path, version, step = fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no checkpoint within {timeout:.0f}s") from None
        except RuntimeError as err:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(err)) from None
        return learner_pb2.CheckpointResponse(path=path, policy_version=version, step=step)

    @abort_on_error
    def PolicyVersion(self, request, context):
        s = self.runner.learner.state
        if s.published_version < 0:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no policy version published yet")
        return learner_pb2.PolicyVersionResponse(policy_version=s.published_version, location=s.published_location)
