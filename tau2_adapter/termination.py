"""Termination reasons: τ²-Bench's `TerminationReason` <-> the wire `TerminationReason` (one copy).

`TAU2_TO_PB` maps tau2's reason values to the wire (the env service's StepResponse); it is
keyed by the values, so a `tau2.data_model.simulation.TerminationReason` (a str enum) looks
up the same entry, and importing this module does not import tau2. JUDGE_STOP (tau2's LLM
repetition judge, never used by the env service) has no wire value. `PB_TO_TAU2` maps the
wire back to tau2's values (as `SimulationRun.termination_reason` takes them) for the six
reasons tau2 knows; the rollout worker's own reasons (MAX_TURNS, MAX_CONTEXT_TOKENS,
INFRASTRUCTURE_ERROR) are not tau2's.

`without_unexecuted_tool_calls` is the one rule for a stop that also made tool calls: the env
service's own evaluation and the reward service both score what ran.
"""

from __future__ import annotations

from collections.abc import Sequence

from sinkflex.api.common.v1 import common_pb2

TAU2_TO_PB: dict[str, int] = {
    "agent_stop": common_pb2.TERMINATION_REASON_AGENT_STOP,
    "user_stop": common_pb2.TERMINATION_REASON_USER_STOP,
    "max_steps": common_pb2.TERMINATION_REASON_MAX_STEPS,
    "too_many_errors": common_pb2.TERMINATION_REASON_TOO_MANY_ERRORS,
    "agent_error": common_pb2.TERMINATION_REASON_AGENT_ERROR,
    "user_error": common_pb2.TERMINATION_REASON_USER_ERROR,
    "judge_stop": common_pb2.TERMINATION_REASON_UNSPECIFIED,
}

PB_TO_TAU2: dict[int, str] = {pb: value for value, pb in TAU2_TO_PB.items() if pb != common_pb2.TERMINATION_REASON_UNSPECIFIED}

#: tau2's reasons whose trajectory `evaluate_simulation` replays and checks (every other one scores 0.0).
EVALUATED_STOPS: frozenset[str] = frozenset({"agent_stop", "user_stop"})


def without_unexecuted_tool_calls(messages: Sequence) -> tuple[list, int]:
    """tau2 `messages` without the tool calls that never ran, and how many were left out.

    A message holding the stop token and tool calls ends the episode before its calls run
    (tau2's `Orchestrator.step` checks `is_stop` first, for the agent and the user alike), and
    tau2's replay of such a trajectory raises ("Tool message expected"). The calls changed
    nothing, so for an episode that ended in `EVALUATED_STOPS` the episode is scored on what
    ran: the last message that made tool calls (an `AssistantMessage` or a `UserMessage`) keeps
    its content and the calls a `ToolMessage` after it answers (by `id`); left with neither it
    is dropped (tau2 refuses an empty message). Duck-typed on `role` / `tool_calls` / `id`, so
    this module imports no tau2.

    Args:
        messages: tau2 messages of one episode, in order (`SimulationRun.messages`).
    Returns:
        (a new list, the input list and messages unchanged; the number of calls left out). With
        nothing unanswered, (a copy of `messages`, 0).
    """
    out = list(messages)
    last = next((i for i in range(len(out) - 1, -1, -1)
                 if out[i].role != "tool" and getattr(out[i], "tool_calls", None)), None)
    if last is None:
        return out, 0
    answered = {m.id for m in out[last + 1:] if m.role == "tool"}
    calls = out[last].tool_calls
    ran = [c for c in calls if c.id in answered]
    if len(ran) == len(calls):
        return out, 0
    kept = out[last].model_copy(update={"tool_calls": ran or None})
    out[last:last + 1] = [kept] if kept.content or kept.tool_calls else []
    return out, len(calls) - len(ran)
