"""The multi-turn agent loop: env observations -> tokens -> engine -> actions -> env.

`AgentLoop` is plain Python (asyncio on the engine's loop); the gRPC servicer is a thin
edge over it. One episode (`run_episode`):

    reset the env -> render system + tools + observation ONCE into prompt ids
    repeat up to max_turns:
        sample a reply on the ids (engine) -> append ids, log-probs, mask 1
        parse tool calls -> step the env with the action (malformed: as written;
            text without tool calls is sent with StepRequest.stop when it holds ###STOP###,
            or always for an env whose route says text_ends_episode)
        episode over? stop.  else: append the env reply rendered ONCE as a suffix, mask 0

so the prompt of turn k+1 = prompt of turn k + generated ids + env suffix ids, and
`token_ids`, `logprobs`, `loss_mask` are always equally long. `run_group` runs G episodes
of one task concurrently, scores them in one batch with the reward service the env is routed
to (`reward_for`; None: the env's own reward is kept, never overwritten), and returns
one `TrajectoryGroup`; `run_tasks` keeps up to `max_groups_in_flight` groups going and
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
import hashlib
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

import grpc
from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from rollout_service.engine import Engine, Sampling
from rollout_service.formatting import ChatTemplateFormatter, Formatter, HarmonyFormatter
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
from sinkflex.api.reward.v1 import reward_pb2
from sinkflex.errors import ServiceError

log = logging.getLogger(__name__)

TR = common_pb2.TerminationReason

#: τ²-Bench's agent stop token (tau2.gym.gym_agent.GymAgent.STOP_TOKEN): text holding it ends the episode.
STOP_TOKEN = "###STOP###"


@dataclass(frozen=True)
class EpisodeSpec:
    """One rollout to run."""

    env: str
    task_id: str
    sampling: Sampling
    max_turns: int
    max_context_tokens: int
    solo_mode: bool = False
    env_seed: int = 0


@dataclass
class _Tokens:
    """The growing token record of one trajectory. All three lists are [T]."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    def add_prompt(self, ids: Sequence[int]) -> None:
        self.ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.mask.extend([0] * len(ids))

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        assert len(ids) == len(logprobs)
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.mask.extend([1] * len(ids))


def episode_seed(seed: int, task_id: str, sample: int) -> int:
    """A 31-bit sampling seed for sample `sample` of task `task_id` under request seed `seed`
    (blake2b of the three: deterministic, independent across tasks and samples)."""
    digest = hashlib.blake2b(f"{seed}/{task_id}/{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class AgentLoop:
    """Runs episodes on one engine against an env client, scores groups with a reward client.

    Args:
        engine: the vLLM engine (coroutines of this class run on `engine.loop`).
        tokenizer: the policy's transformers tokenizer (for the chat template).
        env: an `env_service.client.EnvClient` (Local or Grpc).
        reward: a `reward_service.client.RewardClient`, or None to use the env's reward.
        reward_for: env name -> the reward client that scores it, or None to keep the env's own
            terminal reward (default: `reward` for every env).
        text_ends_episode: env name -> whether a reply with text and no tool call ends the
            episode (sent with StepRequest.stop); default: never.
        buffer: a `sinkflex.buffer.TrajectoryBuffer` (only `put` is used), or None.
        tool_format: "hermes" or "harmony".
        env_max_steps: ResetRequest.max_steps (0: the env's default).
    """

    def __init__(self, engine: Engine, tokenizer, env, reward=None, buffer=None, tool_format: str = "hermes",
                 env_max_steps: int = 0, max_groups_in_flight: int = 8, buffer_timeout: float | None = None,
                 reward_for: Callable[[str], object] | None = None, text_ends_episode: Callable[[str], bool] | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env
        self.reward = reward
        self.reward_for = reward_for or (lambda env: self.reward)
        self.text_ends_episode = text_ends_episode or (lambda env: False)
        self.buffer = buffer
        self.tool_format = tool_format
        self.env_max_steps = env_max_steps
        self.max_groups_in_flight = max_groups_in_flight
        self.buffer_timeout = buffer_timeout
        self.groups_in_flight = 0
        self.groups_completed = 0
        self.totals: dict[str, float] = {}

    def formatter(self) -> Formatter:
        """A fresh per-episode formatter."""
        if self.tool_format == "harmony":
            return HarmonyFormatter()
        return ChatTemplateFormatter(self.tokenizer)

    # -- one episode --------------------------------------------------------------------------
    async def run_episode(self, spec: EpisodeSpec, prefill_lock: asyncio.Lock | None = None) -> common_pb2.Trajectory:
        """Runs one episode; never raises for env/engine failures (INFRASTRUCTURE_ERROR).

        `prefill_lock` (shared by the G episodes of a group): before its first turn, each
        episode prefills its prompt (a 1-token request) under the lock, so the engine's
        prefix cache computes a shared prompt once instead of G times in one batch.
        """
        fmt = self.formatter()
        traj = common_pb2.Trajectory(trajectory_id=uuid.uuid4().hex, task_id=spec.task_id, env=spec.env,
                                     policy_version=self.engine.policy_version)
        tokens = _Tokens()
        m = {"turns": 0, "parse_failures": 0, "tool_calls": 0, "truncated_turns": 0, "generated_tokens": 0,
             "engine_seconds": 0.0, "env_seconds": 0.0, "format_seconds": 0.0}
        t_start = time.perf_counter()
        session_id = ""
        reason = TR.TERMINATION_REASON_MAX_TURNS
        env_return = 0.0  # sum of the env's Step rewards (Gymnasium's return; the contract gives 0 before the end)
        text_stops = self.text_ends_episode(spec.env)
        try:
            t0 = time.perf_counter()
            reset = await asyncio.to_thread(self.env.reset, env_pb2.ResetRequest(
                env=spec.env, task_id=spec.task_id, seed=spec.env_seed, solo_mode=spec.solo_mode,
                max_steps=self.env_max_steps))
            m["env_seconds"] += time.perf_counter() - t0
            session_id = reset.session_id
            traj.task_id = reset.task_id or spec.task_id
            traj.messages.append(common_pb2.Message(role=common_pb2.ROLE_SYSTEM, content=reset.system_prompt))
            traj.messages.extend(reset.observation)
            t0 = time.perf_counter()
            tokens.add_prompt(fmt.initial_prompt(reset.system_prompt, reset.tools, reset.observation))
            m["format_seconds"] += time.perf_counter() - t0
            prompt_start = 0
            for turn in range(spec.max_turns):
                budget = min(spec.sampling.max_new_tokens, spec.max_context_tokens - len(tokens.ids),
                             self.engine.max_model_len - len(tokens.ids))
                if budget <= 0:
                    reason = TR.TERMINATION_REASON_MAX_CONTEXT_TOKENS
                    break
                sampling = spec.sampling
                if turn == 0 and prefill_lock is not None:
                    async with prefill_lock:
                        await self.engine.generate(tokens.ids, Sampling(temperature=0.0, max_new_tokens=1),
                                                   max_tokens=1, want_logprobs=False, count=False)
                gen = await self.engine.generate(tokens.ids, sampling, stop_token_ids=fmt.stop_token_ids, max_tokens=budget)
                info = common_pb2.TurnInfo(prompt_start=prompt_start, generation_start=len(tokens.ids),
                                           num_generated=len(gen.token_ids), policy_version=gen.policy_version,
                                           truncated=gen.truncated)
                tokens.add_generated(gen.token_ids, gen.logprobs)
                m["turns"] += 1
                m["generated_tokens"] += len(gen.token_ids)
                m["engine_seconds"] += gen.seconds
                m["truncated_turns"] += gen.truncated
                t0 = time.perf_counter()
                parsed = fmt.parse(gen.token_ids)
                m["format_seconds"] += time.perf_counter() - t0
                info.parse_error = bool(parsed.parse_error)
                m["parse_failures"] += info.parse_error
                m["tool_calls"] += len(parsed.calls)
                traj.turns.append(info)
                action = self._action(parsed, turn)
                traj.messages.append(action)
                if not action.tool_calls and not (action.content or "").strip():
                    reason = TR.TERMINATION_REASON_AGENT_ERROR  # tau2 rejects an empty agent message
                    break
                if isinstance(fmt, HarmonyFormatter):
                    fmt.note_calls(action.tool_calls)
                # the agent ends the episode (StepRequest.stop): tau2's stop token, or plain text where
                # the env has no user to reply to (text_ends_episode)
                stop = not action.tool_calls and (STOP_TOKEN in (action.content or "")
                                                  or (text_stops and not info.parse_error))
                t0 = time.perf_counter()
                step = await asyncio.to_thread(self.env.step, env_pb2.StepRequest(session_id=session_id, action=action,
                                                                                  stop=stop))
                m["env_seconds"] += time.perf_counter() - t0
                traj.messages.extend(step.observation)
                env_return += step.reward
                if step.terminated or step.truncated:
                    reason = step.termination_reason or TR.TERMINATION_REASON_AGENT_STOP
                    traj.reward_breakdown.CopyFrom(env_breakdown(step, env_return))
                    break
                if turn + 1 == spec.max_turns:
                    break
                prompt_start = len(tokens.ids)
                t0 = time.perf_counter()
                tokens.add_prompt(fmt.suffix(step.observation, ended_turn=not gen.truncated))
                m["format_seconds"] += time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001 - env/engine/transport failure: keep what was sampled
            log.warning("episode %s of %s/%s failed: %s", traj.trajectory_id, spec.env, spec.task_id, err)
            reason = TR.TERMINATION_REASON_INFRASTRUCTURE_ERROR
            traj.metrics["infrastructure_error"] = 1.0
        finally:
            if session_id:
                try:
                    await asyncio.to_thread(self.env.close, session_id)
                except ServiceError:
                    pass  # already closed / expired: nothing to free
        traj.token_ids.extend(tokens.ids)
        traj.logprobs.extend(tokens.logprobs)
        traj.loss_mask.extend(tokens.mask)
        if traj.turns:  # the oldest version of any sampled token (versions only grow)
            versions = [t.policy_version for t in traj.turns]
            traj.policy_version = min(versions)
            traj.metrics["policy_versions"] = float(len(set(versions)))  # > 1: a weight update landed between turns
        traj.termination_reason = reason
        # the env's reward (NaN when its own evaluation raised); a reward service, when the env
        # is routed to one, replaces it
        traj.reward = math.nan if math.isnan(traj.reward_breakdown.reward) else env_return
        m["env_reward"] = env_return
        m["episode_seconds"] = time.perf_counter() - t_start
        m["tokens"] = len(tokens.ids)
        for k, v in m.items():
            traj.metrics[k] = float(v)
            self.totals[k] = self.totals.get(k, 0.0) + float(v)
        return traj

    @staticmethod
    def _action(parsed, turn: int) -> common_pb2.Message:
        """The assistant message sent to the env (malformed output: content as written)."""
        msg = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT)
        if parsed.content is not None:
            msg.content = parsed.content
        if not parsed.parse_error:
            for j, call in enumerate(parsed.calls):
                msg.tool_calls.add(id=f"call_{turn}_{j}", name=call.name, arguments_json=call.arguments_json,
                                   requestor=common_pb2.ROLE_ASSISTANT)
        return msg

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
        """
        self.groups_in_flight += 1
        try:
            specs = [EpisodeSpec(env, task_id, Sampling(sampling.temperature, sampling.top_p, sampling.top_k,
                                                        sampling.max_new_tokens,
                                                        None if sampling.seed is None else episode_seed(sampling.seed, task_id, i)),
                                 max_turns, max_context_tokens, solo_mode) for i in range(group_size)]
            lock = asyncio.Lock()
            trajs = await asyncio.gather(*(self.run_episode(s, lock) for s in specs))
            await self._score(trajs, solo_mode, env)
            group = common_pb2.TrajectoryGroup(group_id=uuid.uuid4().hex, task_id=task_id, env=env, trajectories=trajs)
            ts = Timestamp()
            ts.GetCurrentTime()
            group.created_at.CopyFrom(ts)
            if publish and self.buffer is not None:
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

    #: Backoff (seconds) between tries of a ScoreBatch that failed UNAVAILABLE / DEADLINE_EXCEEDED (a reward
    #: service restarting): scoring is idempotent, so it is asked again; then the error propagates.
    SCORE_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)

    async def _score_batch_retrying(self, client, reqs):
        for delay in (*self.SCORE_RETRY_DELAYS_S, None):
            try:
                return await asyncio.to_thread(client.score_batch, reqs)
            except ServiceError as err:
                if not err.retryable or delay is None:
                    raise
                log.warning("reward ScoreBatch failed (%s); retrying in %.1fs", err.code.name, delay)
                self.totals["reward_retries"] = self.totals.get("reward_retries", 0.0) + 1.0
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

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


def env_breakdown(step: env_pb2.StepResponse, env_return: float) -> common_pb2.RewardBreakdown:
    """The breakdown of an episode the env ended: the env's own (`info["reward_breakdown"]`, a
    common.v1.RewardBreakdown in protobuf JSON) when it sends one, else just the reward with the
    terminating step's info as JSON. `reward` is the env's return, except when the env says its
    own evaluation raised (info["evaluation_error"], env_service.session): then the episode is
    unscored (reward NaN, info "unscored: ...", as the reward service does), not a 0."""
    out = common_pb2.RewardBreakdown()
    failed = step.info.get("evaluation_error")
    if failed:
        return common_pb2.RewardBreakdown(reward=math.nan, info=f"unscored: the env's evaluation raised: {failed[:1900]}")
    sent = step.info.get("reward_breakdown")
    if sent:
        try:
            json_format.Parse(sent, out, ignore_unknown_fields=True)
        except json_format.ParseError as err:
            out = common_pb2.RewardBreakdown(info=f"the env's reward_breakdown is not a RewardBreakdown: {err}")
    elif step.info:
        out.info = json.dumps(dict(step.info), sort_keys=True)
    out.reward = env_return
    return out


def collect(engine: Engine, agen_factory: Callable[[], AsyncIterator]) -> list:
    """Runs an async generator on the engine loop from another thread; returns its items."""

    async def go():
        return [x async for x in agen_factory()]

    return engine.run(go())
