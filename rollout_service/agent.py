"""The multi-turn agent loop: groups of episodes, scored, into the trajectory buffer.

One episode is `rollout_service.episode.run_episode(generator, env, formatter, spec)`: a
function of a `Generator` (the vLLM `Engine` here), an env client and a formatter (chosen
once from `tool_format`, `formatting.formatter_factory`), returning a frozen `Episode`;
`AgentLoop.run_episode` turns it into the wire `Trajectory` (`episode_to_proto`) and adds
its metrics to `totals`. `run_group` runs G episodes of one task concurrently, scores them
in one batch with the reward service the env is routed to (`reward_for`; None: the env's
own reward is kept, never overwritten), and returns one `TrajectoryGroup`; `run_tasks` keeps up to `max_groups_in_flight` groups going and
yields each finished group (and `put`s it into the trajectory buffer when given one).

Departures from the paper's VERL setup: env and reward calls are blocking clients run in
threads (`asyncio.to_thread`); an empty reply (only the end-of-turn token) ends the
episode with TERMINATION_REASON_AGENT_ERROR, since tau2 rejects empty agent messages.
Infrastructure failures end the episode with TERMINATION_REASON_INFRASTRUCTURE_ERROR and
keep what was sampled (never lost). A reward service that answers NOT_FOUND for an item (it
does not know the env or task) fails the group with FAILED_PRECONDITION naming both: a
misconfiguration, not a reward of 0. A trajectory whose evaluation raised (the reward
service's or the env's own) keeps reward NaN, *unscored*, and the metric `unscored` (also in
`totals`) counts it. Per-turn metrics: generated tokens, seconds,
truncation, parse failures, and the policy version that generated the turn
(`TurnInfo.policy_version`); `Trajectory.policy_version` is the oldest of them (the engine's
version at the start when no turn was generated) and the metric `policy_versions` counts the
distinct ones (2 when a weight update landed between two turns, which only the rollout
service's `weight_updates: between_turns` allows).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from rollout_service.engine import Engine, Sampling
from rollout_service.episode import (  # noqa: F401 - re-exported
    STOP_TOKEN,
    EpisodeSpec,
    env_breakdown,
    episode_to_proto,
    run_episode,
)
from rollout_service.formatting import Formatter, formatter_factory
from rollout_service.generator import Generator
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.reward.v1 import reward_pb2
from sinkflex.errors import ServiceError

log = logging.getLogger(__name__)


def episode_seed(seed: int, task_id: str, sample: int) -> int:
    """A 31-bit sampling seed for sample `sample` of task `task_id` under request seed `seed`
    (blake2b of the three: deterministic, independent across tasks and samples)."""
    digest = hashlib.blake2b(f"{seed}/{task_id}/{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


#: `reward_breakdown.info` of a finished trajectory whose group the shutdown cut short.
GROUP_STOPPED = "not scored: another episode of its group was ended by the rollout service's stop (SIGTERM)"


class AgentLoop:
    """Runs episodes on one engine against an env client, scores groups with a reward client.

    Args:
        engine: a `Generator`: the vLLM `Engine` (coroutines of this class run on `engine.loop`),
            or a `ScriptedGenerator`.
        tokenizer: the policy's transformers tokenizer (for the chat template).
        env: an `env_service.client.EnvClient` (Local or Grpc).
        reward: a `reward_service.client.RewardClient`, or None to use the env's reward.
        reward_for: env name -> the reward client that scores it, or None to keep the env's own
            terminal reward (default: `reward` for every env).
        text_ends_episode: env name -> whether a reply with text and no tool call ends the
            episode (sent with StepRequest.stop); default: never.
        buffer: a `sinkflex.buffer.TrajectoryBuffer` (only `put` is used), or None.
        tool_format: the model family, one of `formatting.FAMILIES`; its template is checked here
            on a tool round trip (`formatting.check_round_trip`: ValueError naming `model`).
        format_options: ``enable_thinking`` (qwen3), ``reasoning_effort`` (harmony).
        model: the policy's name, for the template check's message.
        env_max_steps: ResetRequest.max_steps (0: the env's default).
    """

    def __init__(self, engine: Generator, tokenizer, env, reward=None, buffer=None, tool_format: str = "hermes",
                 env_max_steps: int = 0, max_groups_in_flight: int = 8, buffer_timeout: float | None = None,
                 reward_for: Callable[[str], object] | None = None, text_ends_episode: Callable[[str], bool] | None = None,
                 format_options: dict | None = None, model: str = "the policy"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env
        self.reward = reward
        self.reward_for = reward_for or (lambda env: self.reward)
        self.text_ends_episode = text_ends_episode or (lambda env: False)
        self.buffer = buffer
        self.tool_format = tool_format
        # the format is chosen once, here, and its template checked on a tool round trip
        self._make_formatter = formatter_factory(tool_format, tokenizer, model=model, **(format_options or {}))
        self.env_max_steps = env_max_steps
        self.max_groups_in_flight = max_groups_in_flight
        self.buffer_timeout = buffer_timeout
        self.groups_in_flight = 0
        self.groups_completed = 0
        self.stopping = threading.Event()
        """Set when the service begins to stop (SIGTERM, `RolloutWorker.begin_stop`): every
        episode ends at its next turn boundary as STOPPED and its group is returned, not scored
        and not published (`run_group`)."""
        self.totals: dict[str, float] = {}

    def formatter(self) -> Formatter:
        """A fresh per-episode formatter."""
        return self._make_formatter()

    # -- one episode --------------------------------------------------------------------------
    async def run_episode(self, spec: EpisodeSpec, prefill_lock: asyncio.Lock | None = None) -> common_pb2.Trajectory:
        """Runs one episode (`episode.run_episode`) on the engine with a fresh formatter; never
        raises for env/engine failures (INFRASTRUCTURE_ERROR). The spec's `env_max_steps` and
        `text_ends_episode`, when unset, are the loop's. Its metrics are added to `totals`.

        `prefill_lock` (shared by the G episodes of a group): before its first turn, each
        episode prefills its prompt (a 1-token request) under the lock, so the engine's
        prefix cache computes a shared prompt once instead of G times in one batch.
        """
        spec = dataclasses.replace(spec, env_max_steps=spec.env_max_steps or self.env_max_steps,
                                   text_ends_episode=spec.text_ends_episode or self.text_ends_episode(spec.env))
        episode = await run_episode(self.engine, self.env, self.formatter(), spec, prefill_lock,
                                    stopping=self.stopping.is_set)
        for k, v in episode.metrics().items():
            self.totals[k] = self.totals.get(k, 0.0) + v
        return episode_to_proto(episode)

    # -- groups -------------------------------------------------------------------------------
    async def run_group(self, env: str, task_id: str, group_size: int, sampling: Sampling, max_turns: int,
                        max_context_tokens: int, solo_mode: bool = False, publish: bool = True) -> common_pb2.TrajectoryGroup:
        """G episodes of one task, concurrently; scored in one batch; one TrajectoryGroup.

        Sample i of task t uses seed `episode_seed(sampling.seed, t, i)` (when seeded): the G
        samples differ, and so do the random streams of different tasks (one seed for every task
        of a request would correlate their samples and make a mean over tasks look far less
        noisy than it is); the same (seed, task, i) replays the same stream. With
        `publish` and a buffer, the group is `put` into the trajectory buffer (waits under
        backpressure) before it is returned.

        Once `stopping` is set, the group's episodes end at their next turn boundary (STOPPED)
        and the group is returned as it is: every trajectory unscored (reward NaN, the reason in
        `reward_breakdown.info`, metric `stopped` 1.0 on those the shutdown ended), never
        published (a group cut short is not G samples of the policy; `totals["groups_stopped"]`).
        """
        self.groups_in_flight += 1
        try:
            specs = [EpisodeSpec(env, task_id, Sampling(sampling.temperature, sampling.top_p, sampling.top_k,
                                                        sampling.max_new_tokens,
                                                        None if sampling.seed is None else episode_seed(sampling.seed, task_id, i)),
                                 max_turns, max_context_tokens, solo_mode) for i in range(group_size)]
            lock = asyncio.Lock()
            trajs = await asyncio.gather(*(self.run_episode(s, lock) for s in specs))
            stopped = any(t.metrics.get("stopped") for t in trajs)
            if stopped:
                self._mark_stopped(trajs)
            else:
                await self._score(trajs, solo_mode, env)
            group = common_pb2.TrajectoryGroup(group_id=uuid.uuid4().hex, task_id=task_id, env=env, trajectories=trajs)
            ts = Timestamp()
            ts.GetCurrentTime()
            group.created_at.CopyFrom(ts)
            if stopped:
                self.totals["groups_stopped"] = self.totals.get("groups_stopped", 0.0) + 1.0
                log.warning("group of %s/%s stopped by the service's shutdown: returned as failed, not published",
                            env, task_id)
            elif publish and self.buffer is not None:
                await asyncio.to_thread(self.buffer.put, group, self.buffer_timeout)
            self.groups_completed += 1
            return group
        finally:
            self.groups_in_flight -= 1

    async def _score(self, trajs: list[common_pb2.Trajectory], solo_mode: bool = False, env: str | None = None) -> None:
        """Scores the group with the reward service `env` is routed to; None: keeps the env's reward.

        Raises:
            ServiceError FAILED_PRECONDITION: the reward service does not know the env or a task (NOT_FOUND).
        """
        client = self.reward_for(env if env is not None else (trajs[0].env if trajs else ""))
        if client is None:
            self._count_unscored(trajs)
            return  # keep the env's own terminal reward (and its breakdown)
        reqs = [reward_pb2.ScoreRequest(env=t.env, task_id=t.task_id, messages=t.messages,
                                        termination_reason=t.termination_reason, solo_mode=solo_mode) for t in trajs]
        items = await self._score_batch_retrying(client, reqs)
        unknown = [(t, item) for t, item in zip(trajs, items) if item.error_code == grpc.StatusCode.NOT_FOUND.value[0]]
        if unknown:
            t, item = unknown[0]
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"the reward service at {getattr(client, 'address', 'in-process')} does not know "
                               f"env {t.env!r} / task {t.task_id!r} ({item.error}): route the env to its own terminal "
                               f"reward (envs.{t.env}.reward: env) or to a reward service that scores it")
        for t, item in zip(trajs, items):
            t.reward_breakdown.CopyFrom(item.breakdown)
            t.reward = item.breakdown.reward  # NaN: unscored (the evaluation raised, or the item failed)
            if item.error:
                t.metrics["reward_error"] = 1.0
        self._count_unscored(trajs)

    #: Tries of a ScoreBatch that failed UNAVAILABLE / DEADLINE_EXCEEDED (a reward service restarting):
    #: scoring is idempotent, so it is asked again after 0.5, 1, 2, ... s (at most 16 s); then the error
    #: propagates.
    SCORE_ATTEMPTS = 7
    SCORE_RETRY_WAIT_S = 0.5

    async def _score_batch_retrying(self, client, reqs):
        def retrying(state) -> None:
            err = state.outcome.exception()
            log.warning("reward ScoreBatch failed (%s); retrying in %.1fs", err.code.name, state.next_action.sleep)
            self.totals["reward_retries"] = self.totals.get("reward_retries", 0.0) + 1.0

        async for attempt in AsyncRetrying(stop=stop_after_attempt(self.SCORE_ATTEMPTS),
                                           wait=wait_exponential(multiplier=self.SCORE_RETRY_WAIT_S, min=self.SCORE_RETRY_WAIT_S,
                                                                  max=32 * self.SCORE_RETRY_WAIT_S),
                                           retry=retry_if_exception(lambda e: isinstance(e, ServiceError) and e.retryable),
                                           before_sleep=retrying, reraise=True):
            with attempt:
                return await asyncio.to_thread(client.score_batch, reqs)
        raise AssertionError("unreachable")

    def _mark_stopped(self, trajs: Sequence[common_pb2.Trajectory]) -> None:
        """A group the shutdown cut short: not scored, each trajectory says why (`run_group`)."""
        for t in trajs:
            if not t.metrics.get("stopped"):  # finished, but its group is incomplete (the stopped ones say why already)
                t.reward = math.nan
                t.reward_breakdown.CopyFrom(common_pb2.RewardBreakdown(reward=math.nan, info=GROUP_STOPPED))
        self._count_unscored(trajs)

    def _count_unscored(self, trajs: Sequence[common_pb2.Trajectory]) -> None:
        """Metric `unscored` (1.0 / 0.0) on each trajectory, summed into `totals`: a NaN reward
        is a trajectory whose evaluation raised, not a reward of 0 (reward_service.scoring)."""
        for t in trajs:
            t.metrics["unscored"] = float(math.isnan(t.reward))
            self.totals["unscored"] = self.totals.get("unscored", 0.0) + t.metrics["unscored"]

    async def run_tasks(self, env: str, task_ids: Sequence[str], group_size: int, sampling: Sampling,
                        max_turns: int, max_context_tokens: int, solo_mode: bool = False, publish: bool = True
                        ) -> AsyncIterator[common_pb2.TrajectoryGroup]:
        """Yields one finished group per task (in completion order), up to
        `max_groups_in_flight` groups at once."""
        sem = asyncio.Semaphore(self.max_groups_in_flight)

        async def one(task_id: str):
            async with sem:
                return await self.run_group(env, task_id, group_size, sampling, max_turns, max_context_tokens, solo_mode,
                                            publish)

        pending = [asyncio.ensure_future(one(t)) for t in task_ids]
        try:
            for fut in asyncio.as_completed(pending):
                yield await fut
        finally:
            for p in pending:
                p.cancel()


def collect(engine: Engine, agen_factory: Callable[[], AsyncIterator]) -> list:
    """Runs an async generator on the engine loop from another thread; returns its items."""

    async def go():
        return [x async for x in agen_factory()]

    return engine.run(go())
