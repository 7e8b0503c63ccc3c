"""Clients of the reward service: one interface, an in-process and a gRPC implementation.

`RewardClient` is what callers (the rollout worker, evaluation) use. `LocalRewardClient`
runs the same core as the servicer (`reward_service.scoring`) in this process — for unit
tests and debugging; `GrpcRewardClient` calls a running service over a channel with the
same message-size limits as the server. Both raise `sinkflex.errors.ServiceError` from
`score` (NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION, UNAVAILABLE, RESOURCE_EXHAUSTED),
and `score_batch` never raises for one bad item (the item carries error and error_code).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import grpc

from reward_service.config import JudgeConfig
from reward_service.scoring import TaskCatalog, batch_item, score
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.reward.v1 import reward_pb2, reward_pb2_grpc
from sinkflex.errors import raise_as_service_error
from sinkflex.serving import DEFAULT_MAX_MESSAGE_BYTES, make_channel


class RewardClient(Protocol):
    def score(self, request: reward_pb2.ScoreRequest) -> common_pb2.RewardBreakdown:
        """The trajectory's reward breakdown. Raises ServiceError."""
        ...

    def score_batch(self, requests: list[reward_pb2.ScoreRequest]) -> list[reward_pb2.ScoreBatchItem]:
        """One item per request, in order; a bad item has reward 0.0 and `error`/`error_code` set."""
        ...


class LocalRewardClient:
    """In-process client: the servicer's core, no transport."""

    def __init__(self, catalog: TaskCatalog | None = None, judge: JudgeConfig | None = None) -> None:
        self.catalog = catalog or TaskCatalog()
        self.judge = judge

    def score(self, request: reward_pb2.ScoreRequest) -> common_pb2.RewardBreakdown:
        return score(request, self.catalog, self.judge)

    def score_batch(self, requests: list[reward_pb2.ScoreRequest]) -> list[reward_pb2.ScoreBatchItem]:
        return [batch_item(r, self.catalog, self.judge) for r in requests]


class GrpcRewardClient:
    """gRPC client of a running reward service at `address` ("host:port").

    `timeout` (seconds) bounds each call; `max_message_bytes` is the channel's send and
    receive limit (an oversized request fails with RESOURCE_EXHAUSTED before it is sent).
    """

    def __init__(
        self, address: str, timeout: float = 300.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.channel = make_channel(address, max_message_bytes)
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)

    @raise_as_service_error
    def score(self, request: reward_pb2.ScoreRequest) -> common_pb2.RewardBreakdown:
        return self.stub.Score(request, timeout=self.timeout).breakdown

    @raise_as_service_error
    def score_batch(self, requests: list[reward_pb2.ScoreRequest]) -> list[reward_pb2.ScoreBatchItem]:
        return list(self.stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=requests), timeout=self.timeout).items)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GrpcRewardClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: Most items of one ScoreBatch of `unknown_tasks` (at or below every server's default cap).
CHECK_BATCH_ITEMS = 128


def unknown_tasks(client: RewardClient, env: str, task_ids: Sequence[str], solo_mode: bool = False) -> list[tuple[str, str]]:
    """The (task id, reason) pairs of `task_ids` that the reward service behind `client` does not
    know (NOT_FOUND: unknown env or task), found by one ScoreBatch of empty episodes cut at
    MAX_TURNS (cheap for τ²-Bench's checker: no evaluation runs), in batches of at most
    CHECK_BATCH_ITEMS (a server refuses a ScoreBatch above its reward_service.max_batch_items,
    256 by default: the demo checks its 256 train + 64 test tasks). Any reward.v1 service answers
    NOT_FOUND for an env or task it does not know; other per-item errors are not reported here.

    Raises:
        ServiceError: a batch call itself failed (e.g. UNAVAILABLE: nothing answers).
    """
    reqs = [reward_pb2.ScoreRequest(env=env, task_id=t, termination_reason=common_pb2.TERMINATION_REASON_MAX_TURNS,
                                    solo_mode=solo_mode) for t in task_ids]
    items = [item for i in range(0, len(reqs), CHECK_BATCH_ITEMS) for item in client.score_batch(reqs[i:i + CHECK_BATCH_ITEMS])]
    return [(t, item.error) for t, item in zip(task_ids, items) if item.error_code == grpc.StatusCode.NOT_FOUND.value[0]]


def unknown_message(env: str, address: str, unknown: Sequence[tuple[str, str]]) -> str:
    """Why `env` cannot be trained as configured: its reward service at `address` does not know it
    (`unknown`: what `unknown_tasks` returned)."""
    tasks = ", ".join(t for t, _ in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
    return (f"the reward service at {address} does not know env {env!r} (task(s) {tasks}): {unknown[0][1]}. "
            f"Score {env!r} with its own terminal reward (task.reward: env in the experiment; envs.{env}.reward: env "
            "in the rollout service's config) or with a reward service (reward.v1) that knows it (task.reward_address)")
