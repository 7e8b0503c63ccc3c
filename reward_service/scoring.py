"""Scores a trajectory with tau2-Bench's own checker and returns a per-check breakdown.

The reward is exactly what tau2's `evaluate_simulation` (tau2/evaluator/evaluator.py)
returns for the same simulation: the wire messages are converted to tau2 messages
(`tau2_adapter.convert`, the same conversion the env service uses), wrapped in a tau2
`SimulationRun` with the termination reason, and handed to `evaluate_simulation`. No check
is re-implemented here: the DB check (replay of the trajectory's tool calls on a fresh
environment vs. the golden actions), ENV_ASSERTION, ACTION, COMMUNICATE and the
NL-assertion judge are tau2's. What this module adds:

- the conversation: system messages are dropped (tau2's `SimulationRun.messages` never
  holds the system prompt); `solo_mode` is passed on (refused for an env without solo
  mode, or with user messages present).
- request validation: unknown env or task -> NOT_FOUND; empty names, an unspecified
  termination reason, or messages that are not a conversation (a tool message that
  answers no pending call, answers out of order, or a turn taken while tool calls are
  still unanswered) -> INVALID_ARGUMENT. Unanswered tool calls are allowed only at the
  very end (an episode cut right after a tool call).
- tool calls the environment never executed: an agent's or user's message that holds both tool calls and
  the stop token ends the episode (tau2's `Orchestrator.step` checks `is_stop` first) before
  the calls run. tau2's replay of such a trajectory raises ("Tool message expected"), and
  tau2's runner drops the sample; with `validate_communication` on, tau2 ends it as
  AGENT_ERROR, reward 0. Here the trailing unanswered calls are left out of what tau2
  evaluates (they changed nothing in the world; `tau2_adapter.termination.without_unexecuted_tool_calls`,
  the rule the env service's own evaluation follows too), so the episode is scored on what did run:
  a policy cannot turn a failure into an unscored (advantage 0) trajectory this way. The
  breakdown's info starts with how many calls were left out (`UNEXECUTED_NOTE`).
- termination reasons tau2 does not know (the rollout worker's MAX_TURNS,
  MAX_CONTEXT_TOKENS, INFRASTRUCTURE_ERROR) score 0.0 with tau2's own premature-termination
  note; tau2 scores every reason but agent/user stop that way.
- untrusted model output never raises, and a failed evaluation is never a score: a
  trajectory that tau2 cannot evaluate (its `evaluate_simulation` raised: e.g. the replay
  of its tool calls does not reproduce the recorded tool outputs, or a stop right after an
  unanswered tool call) is *unscored*: reward NaN, info ``"unscored: tau2 could not
  evaluate the trajectory: <error>"`` (`unscored`, bounded), no components. tau2's own
  runner drops such samples from its metrics (`skip_failed_samples`); so do we: the
  learner gives NaN advantage 0 and leaves it out of its group's mean/std, validation
  leaves it out of mean@1, and both count it (`unscored`). A failed ScoreBatch item
  (refused request, judge failure) is unscored the same way, with its error on the item.
- NL_ASSERTION: evaluated with `EvaluationType.ALL_WITH_NL_ASSERTIONS` through tau2's
  judge prompt, sent to the configured OpenAI-compatible endpoint (tau2 hard-codes its
  judge model; a thread-local hook on its `generate` swaps in ours, see `_install_judge_hook`).
  No task shipped with tau2 has NL_ASSERTION in its basis; tau2's default (`ALL`) would
  raise on one. Without a judge the
  request fails with FAILED_PRECONDITION; a judge that fails or answers garbage gives
  UNAVAILABLE (an infrastructure fault, not the policy's).
- the breakdown: every check tau2 ran, each with its result: one `RewardComponent` per
  check in tau2's `reward_breakdown` (the basis) and one per kind of check tau2 ran outside
  the basis (e.g. the action checks of a DB-only task), with tau2's check records
  (db_check, action_checks, communicate_checks, ...) and ``"in_basis"`` as `details_json`
  (`to_breakdown`).

Deterministic: tau2's checks are pure functions of (task, messages, termination reason);
JSON is written with sorted keys. Only a judge LLM can add non-determinism (temperature 0
and a fixed seed are the defaults).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterator, Sequence

import grpc

from reward_service.config import JudgeConfig
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.reward.v1 import reward_pb2
from sinkflex.errors import (
    ServiceError,
    clip,
    failed_precondition,
    invalid_argument,
    not_found,
)
from tau2_adapter import termination
from tau2_adapter.termination import PB_TO_TAU2, TAU2_TO_PB, without_unexecuted_tool_calls

#: Longest reason text put into a breakdown's `info` (tau2 replay errors quote whole tool outputs).
MAX_REASON_CHARS = 2000

#: Wire termination reason -> tau2 `TerminationReason` value (`tau2_adapter.termination.PB_TO_TAU2`).
TAU2_TERMINATION = PB_TO_TAU2
#: Rollout-worker reasons tau2 has no name for: premature, like every non-stop reason in tau2.
OWN_TERMINATION = {
    common_pb2.TERMINATION_REASON_MAX_TURNS: "max_turns",
    common_pb2.TERMINATION_REASON_MAX_CONTEXT_TOKENS: "max_context_tokens",
    common_pb2.TERMINATION_REASON_INFRASTRUCTURE_ERROR: "infrastructure_error",
}

#: tau2 RewardType value -> wire RewardType, in the order components are listed.
REWARD_TYPES = {
    "DB": common_pb2.REWARD_TYPE_DB,
    "ENV_ASSERTION": common_pb2.REWARD_TYPE_ENV_ASSERTION,
    "ACTION": common_pb2.REWARD_TYPE_ACTION,
    "COMMUNICATE": common_pb2.REWARD_TYPE_COMMUNICATE,
    "NL_ASSERTION": common_pb2.REWARD_TYPE_NL_ASSERTION,
}
#: tau2 RewardInfo field with the check records of each reward type, and its `info` key.
_DETAILS = {
    "DB": ("db_check", "env"),
    "ENV_ASSERTION": ("env_assertions", "env"),
    "ACTION": ("action_checks", "action"),
    "COMMUNICATE": ("communicate_checks", "communicate"),
    "NL_ASSERTION": ("nl_assertions", "nl"),
}


# --------------------------------------------------------------------------- tasks


class TaskCatalog:
    """tau2 tasks by (env, task id), loaded on first use (thread-safe).

    `env` is a tau2 domain with a task set of the same name (mock, airline, retail,
    telecom, telecom-workflow). Every task of the domain is loaded, all splits together,
    through `tau2_adapter.tasks.domain_tasks`: the tasks tau2 ships plus those of
    `task_files` (env -> task dirs in tau2's format, e.g. generated tasks; checked at
    construction, a bad file raises ValueError naming it). `extra` adds Task objects that
    are in no file (tests use it for an NL_ASSERTION basis).
    """

    def __init__(self, extra: dict[str, list] | None = None, task_files: dict[str, list[str]] | None = None) -> None:
        from tau2_adapter.tasks import domain_tasks

        self._lock = threading.Lock()
        self._tasks: dict[str, dict] = {}
        self._solo: dict[str, bool] = {}
        self._extra = {env: list(tasks) for env, tasks in (extra or {}).items()}
        self._files = {env: tuple(str(f) for f in files) for env, files in (task_files or {}).items()}
        for env, files in self._files.items():  # fail now, not on the first Score
            domain_tasks(env, files)

    def envs(self) -> list[str]:
        from tau2_adapter.tasks import task_sets
        from tau2.registry import registry

        known = set(registry.get_domains()) & set(task_sets())
        return sorted(known | set(self._extra) | set(self._files))

    def tasks(self, env: str) -> dict:
        """All tasks of `env` by id. Raises ServiceError NOT_FOUND for an unknown env."""
        with self._lock:
            if env in self._tasks:
                return self._tasks[env]
            from tau2_adapter.tasks import domain_tasks, task_sets

            envs = self.envs()
            if env not in envs:
                raise not_found(f"unknown env {clip(env)}; known envs: {', '.join(envs)}")
            by_id = dict(domain_tasks(env, self._files.get(env, ())).tasks) if env in task_sets() else {}
            by_id.update({t.id: t for t in self._extra.get(env, [])})
            self._tasks[env] = by_id
            return by_id

    def supports_solo(self, env: str) -> bool:
        """Whether tau2's `env` environment can be built in solo mode (cached)."""
        with self._lock:
            if env not in self._solo:
                from tau2.registry import registry

                try:
                    registry.get_env_constructor(env)(solo_mode=True)
                    self._solo[env] = True
                except ValueError:  # e.g. "Retail domain does not support solo mode"
                    self._solo[env] = False
            return self._solo[env]

    def get(self, env: str, task_id: str):
        """The tau2 `Task`. Raises ServiceError NOT_FOUND for an unknown env or task."""
        tasks = self.tasks(env)
        if task_id not in tasks:
            raise not_found(f"unknown task {clip(task_id)} in env {clip(env)} ({len(tasks)} tasks)")
        return tasks[task_id]


# --------------------------------------------------------------------------- messages


def check_conversation(messages: Sequence[common_pb2.Message]) -> list[str]:
    """Checks that `messages` form a conversation; returns the ids of trailing unanswered tool calls.

    Every tool message must answer the oldest pending tool call (same id), and no other
    message may come while tool calls are pending (tau2's `Environment.set_state` replays
    the trajectory in exactly this order). Calls still pending at the end are returned.

    Raises:
        ServiceError INVALID_ARGUMENT: naming the index of the first bad message.
    """
    pending: list[str] = []
    for i, m in enumerate(messages):
        if m.role not in (common_pb2.ROLE_SYSTEM, common_pb2.ROLE_USER, common_pb2.ROLE_ASSISTANT, common_pb2.ROLE_TOOL):
            raise invalid_argument(f"messages[{i}]: role {m.role} is not a valid role (ROLE_UNSPECIFIED or unknown)")
        if m.role == common_pb2.ROLE_TOOL:
            if m.tool_calls:
                raise invalid_argument(f"messages[{i}]: a tool message cannot make tool calls")
            if not pending:
                raise invalid_argument(
                    f"messages[{i}]: tool message (tool_call_id={clip(m.tool_call_id)}) answers no pending tool call"
                )
            if m.tool_call_id != pending[0]:
                raise invalid_argument(
                    f"messages[{i}]: tool message answers {clip(m.tool_call_id)}, but the next pending tool call is {clip(pending[0])}"
                )
            pending.pop(0)
            continue
        if pending:
            raise invalid_argument(
                f"messages[{i}]: a {common_pb2.Role.Name(m.role)} message comes while tool calls "
                f"{[clip(p, 40) for p in pending[:5]]}{' ...' if len(pending) > 5 else ''} are unanswered"
            )
        if m.tool_calls and m.role == common_pb2.ROLE_SYSTEM:
            raise invalid_argument(f"messages[{i}]: a system message cannot make tool calls")
        for j, call in enumerate(m.tool_calls):
            if not call.name:
                raise invalid_argument(f"messages[{i}].tool_calls[{j}]: empty tool name")
        pending = [c.id for c in m.tool_calls]
    return pending


def to_tau2(messages: Sequence[common_pb2.Message]) -> list:
    """tau2 messages of wire messages (`tau2_adapter.convert.to_tau2_messages`).

    System messages are dropped: tau2's `SimulationRun.messages` never holds the agent's
    system prompt, and its NL judge would otherwise read it as part of the conversation.

    Raises:
        ServiceError INVALID_ARGUMENT: a message the conversion refuses (e.g. a bad requestor).
    """
    from tau2_adapter.convert import to_tau2_messages

    try:
        converted = to_tau2_messages(messages, include_system=False)
    except ValueError as err:
        raise invalid_argument(f"messages: {err}") from None
    return [stop_tool_as_stop_token(m) for m in converted]


def stop_tool_as_stop_token(message):
    """tau2's rule for the agent's `done` tool (`GymAgent._check_if_stop_toolcall`): an
    assistant message that calls it is the stop message, recorded with content "###STOP###"
    and no tool calls. The env service applies the same rule to the action it receives, so
    the trajectory scored here is the one the env stepped (a solo-mode agent that stops by
    calling `done` is otherwise an unanswered tool call that tau2 cannot evaluate)."""
    from tau2.data_model.message import AssistantMessage
    from tau2.gym.gym_agent import GymAgent

    if isinstance(message, AssistantMessage) and message.tool_calls and any(
        c.name == GymAgent.STOP_FUNCTION_NAME for c in message.tool_calls
    ):
        return message.model_copy(update={"content": GymAgent.STOP_TOKEN, "tool_calls": None})
    return message


# --------------------------------------------------------------------------- judge

_judge_local = threading.local()
_judge_install_lock = threading.Lock()


def _install_judge_hook() -> None:
    """Routes tau2's NL-assertion `generate` call to this thread's judge (once per process).

    tau2's `NLAssertionsEvaluator` calls `generate(model=DEFAULT_LLM_NL_ASSERTIONS, ...)`
    from module globals; the hook replaces only the model and litellm arguments, keeping
    tau2's prompt and parsing. Threads with no judge bound get tau2's call unchanged.
    """
    from tau2.evaluator import evaluator_nl_assertions as nl

    with _judge_install_lock:
        if getattr(nl.generate, "_sinkflex_hook", False):
            return
        original = nl.generate

        def generate(model, messages, **kwargs):
            judge: JudgeConfig | None = getattr(_judge_local, "judge", None)
            if judge is None:
                return original(model=model, messages=messages, **kwargs)
            return original(model=judge.litellm_model(), messages=messages, **judge.litellm_kwargs())

        generate._sinkflex_hook = True  # type: ignore[attr-defined]
        nl.generate = generate


@contextlib.contextmanager
def _judge_bound(judge: JudgeConfig) -> Iterator[None]:
    _install_judge_hook()
    _judge_local.judge = judge
    try:
        yield
    finally:
        _judge_local.judge = None


def _raised_in_judge(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("evaluator_nl_assertions.py"):
            return True
        tb = tb.tb_next
    return False


# --------------------------------------------------------------------------- breakdown


def _reason(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 15] + " ...[truncated]"


def _jsonable(value):
    if value is None:
        return None
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def _info_text(info: dict | None) -> str:
    """tau2's `RewardInfo.info` as text: the note itself, or JSON of the non-empty parts."""
    if not info:
        return ""
    if set(info) == {"note"}:
        return str(info["note"])
    kept = {k: v for k, v in info.items() if v is not None}
    return json.dumps(kept, sort_keys=True, default=str) if kept else ""


def _outside_basis_result(name: str, records) -> float | None:
    """The result of a kind of check that tau2 ran outside the reward basis, from tau2's own
    per-check results: the product of the records' rewards (`db_reward`, `reward`,
    `action_reward`), or 1.0 iff every record is `met` (communicate, NL) -- tau2's rule for
    the same kind inside a basis. None when tau2 ran no check of the kind (no records)."""
    if records is None or (isinstance(records, list) and not records):
        return None
    if name == "DB":
        return float(records.db_reward)
    if name == "ENV_ASSERTION":
        return float(math.prod(r.reward for r in records))
    if name == "ACTION":
        return float(math.prod(r.action_reward for r in records))
    return 1.0 if all(r.met for r in records) else 0.0  # COMMUNICATE, NL_ASSERTION


def to_breakdown(reward_info) -> common_pb2.RewardBreakdown:
    """Wire `RewardBreakdown` of a tau2 `RewardInfo`: every check tau2 ran, each with its result.

    reward = tau2's reward; reward_basis = tau2's basis (empty when no check ran). One
    component per kind of check, in `REWARD_TYPES` order, with tau2's check records as
    details_json and ``"in_basis"`` saying whether it counts in the reward:

    - in the basis: one per entry of tau2's `reward_breakdown`, its reward tau2's.
    - outside the basis: tau2's `evaluate_simulation` (type ALL) runs the DB/ENV_ASSERTION,
      ACTION and COMMUNICATE evaluators for every task and keeps their records (e.g. the
      `action_checks` of a DB-only task) but drops their rewards; such a kind is listed when
      tau2 produced records for it, its reward computed from those records
      (`_outside_basis_result`). It never enters `reward` (the learner's shaping skips it).
    """
    out = common_pb2.RewardBreakdown(reward=float(reward_info.reward), info=_info_text(reward_info.info))
    for t in reward_info.reward_basis or []:
        out.reward_basis.append(REWARD_TYPES[t.value])
    breakdown = {k.value if hasattr(k, "value") else k: v for k, v in (reward_info.reward_breakdown or {}).items()}
    sub_info = reward_info.info or {}
    for name, wire in REWARD_TYPES.items():
        field, info_key = _DETAILS[name]
        records = getattr(reward_info, field)
        in_basis = name in breakdown
        result = float(breakdown[name]) if in_basis else _outside_basis_result(name, records)
        if result is None:
            continue
        details = {field: _jsonable(records), "in_basis": in_basis}
        if isinstance(sub_info.get(info_key), dict):
            details["info"] = sub_info[info_key]
        out.components.append(
            common_pb2.RewardComponent(
                type=wire, reward=result, details_json=json.dumps(details, sort_keys=True, default=str)
            )
        )
    return out


def _zero(task, reason: str) -> common_pb2.RewardBreakdown:
    out = common_pb2.RewardBreakdown(reward=0.0, info=_reason(reason))
    if task is not None and task.evaluation_criteria is not None:
        out.reward_basis.extend(REWARD_TYPES[t.value] for t in task.evaluation_criteria.reward_basis)
    return out


#: `RewardBreakdown.info` of an unscored trajectory starts with this (its `reward` is NaN).
UNSCORED_PREFIX = "unscored: "
#: The termination reasons tau2 evaluates by replaying the trajectory (every other one scores 0.0).
EVALUATED_STOPS = tuple(sorted(TAU2_TO_PB[r] for r in termination.EVALUATED_STOPS))
#: `RewardBreakdown.info` of a trajectory scored without its trailing unexecuted tool calls starts with this.
UNEXECUTED_NOTE = "{n} trailing tool call(s) never executed (the episode stopped first), left out of the evaluation"


def unscored(task, reason: str) -> common_pb2.RewardBreakdown:
    """The breakdown of a trajectory whose evaluation raised: reward NaN (not a score: the
    learner gives it advantage 0 and leaves it out of its group's mean and std, validation
    leaves it out of mean@1 and counts it), info = UNSCORED_PREFIX + the error (bounded to
    MAX_REASON_CHARS), the task's basis when known, no components (no check finished)."""
    out = common_pb2.RewardBreakdown(reward=math.nan, info=_reason(UNSCORED_PREFIX + reason))
    if task is not None and task.evaluation_criteria is not None:
        out.reward_basis.extend(REWARD_TYPES[t.value] for t in task.evaluation_criteria.reward_basis)
    return out


def is_unscored(breakdown_or_reward) -> bool:
    """True for an unscored trajectory: a NaN reward (a `RewardBreakdown`, a `Trajectory` or a float)."""
    r = breakdown_or_reward if isinstance(breakdown_or_reward, float | int) else breakdown_or_reward.reward
    return math.isnan(r)


# --------------------------------------------------------------------------- scoring


def needs_judge(task) -> bool:
    """True when the task's reward basis contains NL_ASSERTION."""
    crit = task.evaluation_criteria
    return crit is not None and any(t.value == "NL_ASSERTION" for t in crit.reward_basis)


def build_simulation(task_id: str, tau2_messages: list, termination: str):
    """A tau2 `SimulationRun` of a trajectory, with fixed id/times (evaluation reads neither)."""
    from tau2.data_model.simulation import SimulationRun, TerminationReason

    return SimulationRun(
        id=f"sinkflex-{task_id}",
        task_id=task_id,
        timestamp="",
        start_time="",
        end_time="",
        duration=0.0,
        termination_reason=TerminationReason(termination),
        messages=tau2_messages,
    )


def score(
    request: reward_pb2.ScoreRequest, catalog: TaskCatalog, judge: JudgeConfig | None = None
) -> common_pb2.RewardBreakdown:
    """Scores one trajectory with tau2's `evaluate_simulation`; see the module docstring.

    `request.solo_mode` is passed to tau2 (`evaluate_simulation(solo_mode=...)`).

    Returns:
        The breakdown; `reward` in [0, 1].
    Raises:
        ServiceError: NOT_FOUND (env/task), INVALID_ARGUMENT (request/conversation),
        FAILED_PRECONDITION (NL_ASSERTION basis without a judge), UNAVAILABLE (judge failed).
    """
    if not request.env:
        raise invalid_argument("env is empty")
    if not request.task_id:
        raise invalid_argument("task_id is empty")
    reason = request.termination_reason
    if reason not in TAU2_TERMINATION and reason not in OWN_TERMINATION:
        raise invalid_argument(
            f"termination_reason {reason} is not set or unknown; say why the episode ended"
        )
    task = catalog.get(request.env, request.task_id)
    if needs_judge(task) and judge is None:
        raise failed_precondition(
            f"task {clip(request.task_id)} of env {clip(request.env)} has NL_ASSERTION in its reward basis, "
            "but no NL-assertion judge LLM is configured (start the service with --judge-model/--judge-base-url)"
        )
    check_conversation(request.messages)
    if request.solo_mode:
        if not catalog.supports_solo(request.env):
            raise invalid_argument(f"solo_mode: env {clip(request.env)} does not support tau2's solo mode")
        users = [i for i, m in enumerate(request.messages) if m.role == common_pb2.ROLE_USER]
        if users:
            raise invalid_argument(f"solo_mode: messages{users[:5]} are user messages; a solo episode has none")
    tau2_messages = to_tau2(request.messages)  # every message checked, the unexecuted calls too
    left_out = 0
    if reason in EVALUATED_STOPS:  # other reasons: tau2 scores 0.0 without a replay
        tau2_messages, left_out = without_unexecuted_tool_calls(tau2_messages)

    if reason in OWN_TERMINATION:  # tau2's rule for every reason but agent/user stop
        return _zero(None, f"Simulation terminated prematurely. Termination reason: {OWN_TERMINATION[reason]}")

    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    from tau2_adapter import guards

    guards.install()  # the replay's calculate calls answer as the env service's did, and cannot stall the server
    simulation = build_simulation(request.task_id, tau2_messages, TAU2_TERMINATION[reason])
    evaluation = EvaluationType.ALL_WITH_NL_ASSERTIONS if needs_judge(task) else EvaluationType.ALL
    ctx = _judge_bound(judge) if judge is not None else contextlib.nullcontext()
    try:
        with ctx:
            info = evaluate_simulation(
                simulation=simulation, task=task, evaluation_type=evaluation, solo_mode=request.solo_mode, domain=request.env
            )
    except ServiceError:
        raise
    except Exception as err:  # noqa: BLE001 - untrusted trajectories must not crash the service
        if _raised_in_judge(err):
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, _reason(f"NL-assertion judge failed: {type(err).__name__}: {err}")
            ) from None
        return unscored(task, f"tau2 could not evaluate the trajectory: {type(err).__name__}: {err}")
    out = to_breakdown(info)
    if left_out:
        note = UNEXECUTED_NOTE.format(n=left_out)
        out.info = _reason(f"{note}; {out.info}" if out.info else note)
    return out


def batch_item(
    request: reward_pb2.ScoreRequest, catalog: TaskCatalog, judge: JudgeConfig | None = None
) -> reward_pb2.ScoreBatchItem:
    """One item of ScoreBatch: `score`, with any failure reported on the item, never raised.

    A failed item is unscored too: its breakdown has reward NaN and info = the error (the
    request was refused or the service failed; the trajectory was not scored, which is not
    a reward of 0.0), and `error` / `error_code` say why."""
    try:
        return reward_pb2.ScoreBatchItem(breakdown=score(request, catalog, judge))
    except ServiceError as err:
        code, message = err.code, err.message
    except Exception as err:  # noqa: BLE001 - one bad item must not fail the batch
        code, message = grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}"
    message = _reason(message)
    return reward_pb2.ScoreBatchItem(
        breakdown=common_pb2.RewardBreakdown(reward=math.nan, info=message), error=message, error_code=code.value[0]
    )
