"""One episode: a function of a `Generator`, an env client and a `Formatter`, to an `Episode`.

`run_episode(generator, env, formatter, spec)`:

    reset the env -> render system + tools + observation ONCE into prompt ids
    repeat up to max_turns:
        no room left for a reply (turn budget <= 0)? CONTEXT_FULL
        sample a reply on the ids (generator) -> append ids, log-probs, mask 1
        parse tool calls -> the action (malformed: the text as written); an empty action:
            AGENT_ERROR (tau2 rejects empty agent messages)
        step the env with the action (text without tool calls is sent with
            StepRequest.stop when it holds ###STOP###, or always when the spec says
            text_ends_episode)
        episode over? DONE (the env's termination reason).  else: append the env reply
            rendered ONCE as a suffix, mask 0
    MAX_TURNS

so the prompt of turn k+1 = prompt of turn k + generated ids + env suffix ids, and
`token_ids`, `logprobs`, `loss_mask` are always equally long. A failing env call ends the
episode with ENV_ERROR, a failing generator or formatter with GENERATION_ERROR; both keep
what was sampled (never lost) and both are TERMINATION_REASON_INFRASTRUCTURE_ERROR on the
wire. The env session is always closed.

The result is a frozen `Episode` (token record, messages, turns, status, the env's reward,
timing); `episode_to_proto` builds the wire `common.v1.Trajectory` from it, at the edge
(`rollout_service.agent.AgentLoop`, which also scores groups with the reward service).
Nothing here knows vLLM: tests/test_episode.py runs episodes with a `ScriptedGenerator`.

Concerns kept apart: the turn budget (`turn_budget`), the group's shared-prefix prefill
under a lock (`prefill`), the timing (`_Clock`), the token record (`_Tokens`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from google.protobuf import json_format
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential_jitter,
)

from rollout_service.engine import Sampling
from rollout_service.formatting import Formatter
from rollout_service.generator import Generator
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
from sinkflex.errors import ServiceError

log = logging.getLogger(__name__)

TR = common_pb2.TerminationReason

#: τ²-Bench's agent stop token (tau2.gym.gym_agent.GymAgent.STOP_TOKEN): text holding it ends the episode.
STOP_TOKEN = "###STOP###"


@dataclass(frozen=True)
class EpisodeSpec:
    """One rollout to run.

    env_max_steps: ResetRequest.max_steps (0: the env's default).
    text_ends_episode: a reply with text and no tool call ends the episode (StepRequest.stop).
    """

    env: str
    task_id: str
    sampling: Sampling
    max_turns: int
    max_context_tokens: int
    solo_mode: bool = False
    env_seed: int = 0
    env_max_steps: int = 0
    text_ends_episode: bool = False


class EpisodeStatus(enum.Enum):
    """How an episode ended."""

    DONE = "done"  # the env ended it (terminated or truncated); the reason is the env's
    MAX_TURNS = "max_turns"  # spec.max_turns agent turns, the env still going
    CONTEXT_FULL = "context_full"  # no room for another reply (max_context_tokens / the engine's max_model_len)
    AGENT_ERROR = "agent_error"  # an empty reply (tau2 rejects empty agent messages)
    ENV_ERROR = "env_error"  # an env call (reset / step) raised
    GENERATION_ERROR = "generation_error"  # the generator or the formatter raised
    STOPPED = "stopped"  # the service began to stop (SIGTERM): ended at a turn boundary, what was sampled kept


#: status -> the wire termination reason (DONE: the env's own).
TERMINATION = {
    EpisodeStatus.MAX_TURNS: TR.TERMINATION_REASON_MAX_TURNS,
    EpisodeStatus.CONTEXT_FULL: TR.TERMINATION_REASON_MAX_CONTEXT_TOKENS,
    EpisodeStatus.AGENT_ERROR: TR.TERMINATION_REASON_AGENT_ERROR,
    EpisodeStatus.ENV_ERROR: TR.TERMINATION_REASON_INFRASTRUCTURE_ERROR,
    EpisodeStatus.GENERATION_ERROR: TR.TERMINATION_REASON_INFRASTRUCTURE_ERROR,
    EpisodeStatus.STOPPED: TR.TERMINATION_REASON_INFRASTRUCTURE_ERROR,
}

#: `Episode.error` of an episode ended because the service is stopping.
STOPPED_ERROR = "the rollout service is stopping (SIGTERM): episode ended before agent turn {turn}"


@dataclass(frozen=True)
class Turn:
    """One agent turn: where its tokens are in the token record, and what came of them."""

    prompt_start: int  # offset of the env suffix before this turn (0 for the first turn: the whole prompt)
    generation_start: int  # offset of its first generated token
    num_generated: int
    policy_version: int  # the version that generated every token of the turn
    truncated: bool  # cut at the token budget (no end-of-turn sampled)
    parse_error: str = ""  # empty: the reply parsed cleanly
    tool_calls: int = 0  # calls parsed (also on a parse error: those that did parse)
    engine_seconds: float = 0.0  # the generator's own time for the reply


@dataclass(frozen=True)
class Timing:
    """Seconds spent: the whole episode, and in each part of it."""

    episode_seconds: float = 0.0
    engine_seconds: float = 0.0  # sum of the generator's reported seconds
    env_seconds: float = 0.0  # wall time in env reset/step calls
    format_seconds: float = 0.0  # rendering prompts / suffixes and parsing replies


@dataclass(frozen=True)
class Episode:
    """The record of one episode (the messages are the env's protos, not copied again).

    token_ids, logprobs, loss_mask: [T] each; loss_mask 1 exactly on generated tokens,
    logprobs 0.0 elsewhere.
    """

    trajectory_id: str
    env: str
    task_id: str
    status: EpisodeStatus
    termination_reason: int  # common.v1.TerminationReason
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    loss_mask: tuple[int, ...]
    messages: tuple[common_pb2.Message, ...]
    turns: tuple[Turn, ...]
    start_policy_version: int  # the generator's version when the episode started
    env_return: float  # sum of the env's Step rewards
    env_breakdown: common_pb2.RewardBreakdown | None  # the env's breakdown when it ended the episode
    timing: Timing
    error: str = ""  # ENV_ERROR / GENERATION_ERROR: what raised

    @property
    def policy_version(self) -> int:
        """The oldest version of any sampled token (versions only grow); the start's when no turn ran."""
        return min(t.policy_version for t in self.turns) if self.turns else self.start_policy_version

    @property
    def reward(self) -> float:
        """The env's reward: its return, NaN (unscored) when its own evaluation raised."""
        if self.env_breakdown is not None and math.isnan(self.env_breakdown.reward):
            return math.nan
        return self.env_return

    @property
    def infrastructure_error(self) -> bool:
        return self.status in (EpisodeStatus.ENV_ERROR, EpisodeStatus.GENERATION_ERROR, EpisodeStatus.STOPPED)

    def metrics(self) -> dict[str, float]:
        """The per-episode metrics that add up over episodes (`AgentLoop.totals`)."""
        t = self.timing
        return {"turns": float(len(self.turns)),
                "parse_failures": float(sum(bool(x.parse_error) for x in self.turns)),
                "tool_calls": float(sum(x.tool_calls for x in self.turns)),
                "truncated_turns": float(sum(x.truncated for x in self.turns)),
                "generated_tokens": float(sum(x.num_generated for x in self.turns)),
                "engine_seconds": float(t.engine_seconds), "env_seconds": float(t.env_seconds),
                "format_seconds": float(t.format_seconds), "env_reward": float(self.env_return),
                "episode_seconds": float(t.episode_seconds), "tokens": float(len(self.token_ids)),
                "user_turns": float(sum(m.role == common_pb2.ROLE_USER for m in self.messages))}


def episode_to_proto(ep: Episode) -> common_pb2.Trajectory:
    """The wire Trajectory of an episode: the token record, messages, turns, termination
    reason, the env's reward (and breakdown, when the env ended the episode) and metrics
    (`Episode.metrics`, plus `infrastructure_error` 1.0 on ENV_ERROR / GENERATION_ERROR / STOPPED,
    `stopped` 1.0 and reward NaN with the reason in `reward_breakdown.info` on STOPPED, and
    `policy_versions`, the number of distinct versions over the turns, when a turn ran)."""
    traj = common_pb2.Trajectory(
        trajectory_id=ep.trajectory_id, task_id=ep.task_id, env=ep.env, policy_version=ep.policy_version,
        token_ids=ep.token_ids, logprobs=ep.logprobs, loss_mask=ep.loss_mask, messages=ep.messages,
        termination_reason=ep.termination_reason, reward=ep.reward,
        turns=[common_pb2.TurnInfo(prompt_start=t.prompt_start, generation_start=t.generation_start,
                                   num_generated=t.num_generated, policy_version=t.policy_version,
                                   truncated=t.truncated, parse_error=bool(t.parse_error)) for t in ep.turns])
    if ep.env_breakdown is not None:
        traj.reward_breakdown.CopyFrom(ep.env_breakdown)
    if ep.infrastructure_error:
        traj.metrics["infrastructure_error"] = 1.0
    if ep.status is EpisodeStatus.STOPPED:  # the reason, on the wire: unscored, with why
        traj.metrics["stopped"] = 1.0
        traj.reward = math.nan
        traj.reward_breakdown.CopyFrom(common_pb2.RewardBreakdown(reward=math.nan, info=ep.error))
    if ep.turns:  # > 1: a weight update landed between turns
        traj.metrics["policy_versions"] = float(len({t.policy_version for t in ep.turns}))
    for k, v in ep.metrics().items():
        traj.metrics[k] = v
    return traj


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


# -- the parts ------------------------------------------------------------------------------------
def turn_budget(spec: EpisodeSpec, generator: Generator, context_len: int) -> int:
    """Tokens the next reply may have: the spec's max_new_tokens, within max_context_tokens
    and the generator's max_model_len (<= 0: the context is full)."""
    return min(spec.sampling.max_new_tokens, spec.max_context_tokens - context_len, generator.max_model_len - context_len)


async def prefill(generator: Generator, prompt_ids: list[int], lock: asyncio.Lock) -> None:
    """Prefills `prompt_ids` (a 1-token warm-up request) under `lock`, shared by the G episodes
    of a group: the engine's prefix cache computes their shared prompt once, not G times in one batch."""
    async with lock:
        await generator.generate(prompt_ids, Sampling(temperature=0.0, max_new_tokens=1), max_tokens=1,
                                 want_logprobs=False, count=False)


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


class _Clock:
    """Seconds per part of an episode (`with clock("env"): ...`)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds = {"engine": 0.0, "env": 0.0, "format": 0.0}

    @contextlib.contextmanager
    def __call__(self, part: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - t0

    def timing(self) -> Timing:
        s = self.seconds
        return Timing(time.perf_counter() - self.start, s["engine"], s["env"], s["format"])


class _EnvFailure(Exception):
    """An env call raised (`__cause__`)."""


#: Seconds an episode keeps sending an env call again while the env server sheds it (busy).
ENV_BUSY_RETRY_S = 600.0


async def _env_call(clock: _Clock, fn, request):
    """`fn(request)` in a thread, timed as "env". A call the env server refused as busy
    (`ServiceError.shed`: not run) is sent again with jittered exponential backoff (0.1 s
    doubling to 5 s) for up to `ENV_BUSY_RETRY_S`; any other error, or still busy after that,
    raises `_EnvFailure`. G episodes of many groups start together, so an env server's
    concurrent-RPC cap (`sinkflex.limits`) is met in normal operation, above all in dual control,
    where a Step holds its slot while the user simulator writes."""
    with clock("env"):
        try:
            async for attempt in AsyncRetrying(
                    retry=retry_if_exception(lambda e: isinstance(e, ServiceError) and e.shed),
                    wait=wait_exponential_jitter(initial=0.1, max=5.0), stop=stop_after_delay(ENV_BUSY_RETRY_S),
                    before_sleep=_log_busy, reraise=True):
                with attempt:
                    return await asyncio.to_thread(fn, request)
        except Exception as err:
            raise _EnvFailure(str(err)) from err


async def _reset_env(clock: _Clock, env, request: env_pb2.ResetRequest) -> env_pb2.ResetResponse:
    """`_env_call(clock, env.reset, request)`, except when the episode is cancelled while it runs
    (its client went away): the reset's thread cannot be stopped, so the session it opens is
    closed once it returns instead of being left open on the env server."""
    call = asyncio.ensure_future(_env_call(clock, env.reset, request))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        call.add_done_callback(lambda done: _close_opened(env, done))
        raise


def _close_opened(env, reset: asyncio.Future) -> None:
    """Closes (in a thread: a blocking call) the session that a cancelled episode's `reset` opened."""
    if reset.cancelled() or reset.exception() is not None or not reset.result().session_id:
        return

    def close(session_id: str) -> None:
        try:
            env.close(session_id)
        except Exception as err:  # noqa: BLE001 - closed already, or the env server is gone: nothing to free
            log.debug("closing session %s of a cancelled episode: %s", session_id, err)

    threading.Thread(target=close, args=(reset.result().session_id,), name="close-cancelled-session", daemon=True).start()


def _log_busy(state) -> None:
    log.debug("env server busy (%s); calling again in %.2f s (attempt %d)",
              state.outcome.exception(), state.next_action.sleep, state.attempt_number)


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


# -- the episode ----------------------------------------------------------------------------------
async def run_episode(generator: Generator, env, formatter: Formatter, spec: EpisodeSpec,
                      prefill_lock: asyncio.Lock | None = None, stopping: Callable[[], bool] | None = None) -> Episode:
    """Runs one episode; never raises for env / generator / formatter failures (ENV_ERROR,
    GENERATION_ERROR: what was sampled is kept).

    Args:
        generator: the engine (`Generator`).
        env: an `env_service.client.EnvClient` (blocking; its calls run in threads).
        formatter: a fresh formatter (it holds the episode's state: tools, call names).
        spec: what to run.
        prefill_lock: shared by the G episodes of a group: the first prompt is prefilled under
            it (`prefill`) before the first turn.
        stopping: asked before the env is reset and before every agent turn; True ends the
            episode there with STOPPED (INFRASTRUCTURE_ERROR on the wire, `STOPPED_ERROR` as its
            error, every turn sampled so far kept): the service's graceful stop, which hands every
            in-flight episode back as failed with its reason instead of losing it.
    """
    trajectory_id = uuid.uuid4().hex
    start_version = generator.policy_version
    clock = _Clock()
    tokens = _Tokens()
    messages: list[common_pb2.Message] = []
    turns: list[Turn] = []
    task_id = spec.task_id
    session_id = ""
    status, reason, error = EpisodeStatus.MAX_TURNS, None, ""
    env_return = 0.0  # sum of the env's Step rewards (Gymnasium's return; the contract gives 0 before the end)
    breakdown = None
    stopping = stopping or (lambda: False)
    try:
        if stopping():
            return _stopped_episode(trajectory_id, spec, start_version, clock, STOPPED_ERROR.format(turn=1))
        reset = await _reset_env(clock, env, env_pb2.ResetRequest(
            env=spec.env, task_id=spec.task_id, seed=spec.env_seed, solo_mode=spec.solo_mode,
            max_steps=spec.env_max_steps))
        session_id = reset.session_id
        task_id = reset.task_id or spec.task_id
        messages.append(common_pb2.Message(role=common_pb2.ROLE_SYSTEM, content=reset.system_prompt))
        messages.extend(reset.observation)
        with clock("format"):
            tokens.add_prompt(formatter.initial_prompt(reset.system_prompt, reset.tools, reset.observation))
        prompt_start = 0
        for turn in range(spec.max_turns):
            if stopping():
                status, error = EpisodeStatus.STOPPED, STOPPED_ERROR.format(turn=turn + 1)
                break
            budget = turn_budget(spec, generator, len(tokens.ids))
            if budget <= 0:
                status = EpisodeStatus.CONTEXT_FULL
                break
            if turn == 0 and prefill_lock is not None:
                await prefill(generator, tokens.ids, prefill_lock)
            gen = await generator.generate(tokens.ids, spec.sampling, stop_token_ids=formatter.stop_token_ids,
                                           max_tokens=budget)
            clock.seconds["engine"] += gen.seconds
            generation_start = len(tokens.ids)
            tokens.add_generated(gen.token_ids, gen.logprobs)
            parse_error, calls = "the formatter's parse raised", 0
            try:
                with clock("format"):
                    parsed = formatter.parse(gen.token_ids)
                parse_error, calls = parsed.parse_error, len(parsed.calls)
            finally:  # every generated token belongs to a recorded turn, even when parsing raised
                turns.append(Turn(prompt_start, generation_start, len(gen.token_ids), gen.policy_version,
                                  gen.truncated, parse_error, calls, gen.seconds))
            action = _action(parsed, turn)
            messages.append(action)
            if not action.tool_calls and not (action.content or "").strip():
                status = EpisodeStatus.AGENT_ERROR  # tau2 rejects an empty agent message
                break
            formatter.note_calls(action.tool_calls)
            # the agent ends the episode (StepRequest.stop): tau2's stop token, or plain text where
            # the env has no user to reply to (text_ends_episode)
            stop = not action.tool_calls and (STOP_TOKEN in (action.content or "")
                                              or (spec.text_ends_episode and not turns[-1].parse_error))
            # request_id: a resend of this Step (whatever the server believes was delivered) is never applied twice
            request = env_pb2.StepRequest(session_id=session_id, action=action, stop=stop, request_id=str(turn))
            step = await _env_call(clock, env.step, request)
            messages.extend(step.observation)
            env_return += step.reward
            if step.terminated or step.truncated:
                status, reason = EpisodeStatus.DONE, step.termination_reason or TR.TERMINATION_REASON_AGENT_STOP
                breakdown = env_breakdown(step, env_return)
                break
            if turn + 1 == spec.max_turns:
                break
            prompt_start = len(tokens.ids)
            with clock("format"):
                tokens.add_prompt(formatter.suffix(step.observation, ended_turn=not gen.truncated))
    except _EnvFailure as err:
        status, error = EpisodeStatus.ENV_ERROR, str(err)
        log.warning("episode %s of %s/%s failed: %s", trajectory_id, spec.env, spec.task_id, err)
    except Exception as err:  # noqa: BLE001 - generator/formatter failure: keep what was sampled
        status, error = EpisodeStatus.GENERATION_ERROR, f"{type(err).__name__}: {err}"
        log.warning("episode %s of %s/%s failed: %s", trajectory_id, spec.env, spec.task_id, err)
    finally:
        if session_id:
            try:
                await asyncio.to_thread(env.close, session_id)
            except ServiceError:
                pass  # already closed / expired: nothing to free
    return Episode(
        trajectory_id=trajectory_id, env=spec.env, task_id=task_id, status=status,
        termination_reason=reason if reason is not None else TERMINATION[status],
        token_ids=tuple(tokens.ids), logprobs=tuple(tokens.logprobs), loss_mask=tuple(tokens.mask),
        messages=tuple(messages), turns=tuple(turns), start_policy_version=start_version, env_return=env_return,
        env_breakdown=breakdown, timing=clock.timing(), error=error)


def _stopped_episode(trajectory_id: str, spec: EpisodeSpec, version: int, clock: _Clock, error: str) -> Episode:
    """An episode stopped before its env was reset: no tokens, no session."""
    return Episode(trajectory_id=trajectory_id, env=spec.env, task_id=spec.task_id, status=EpisodeStatus.STOPPED,
                   termination_reason=TERMINATION[EpisodeStatus.STOPPED], token_ids=(), logprobs=(), loss_mask=(),
                   messages=(), turns=(), start_policy_version=version, env_return=0.0, env_breakdown=None,
                   timing=clock.timing(), error=error)
