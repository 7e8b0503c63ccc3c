"""Termination reasons: τ²-Bench's `TerminationReason` <-> the wire `TerminationReason` (one copy).

`TAU2_TO_PB` maps tau2's reason values to the wire (the env service's StepResponse); it is
keyed by the values, so a `tau2.data_model.simulation.TerminationReason` (a str enum) looks
up the same entry, and importing this module does not import tau2. JUDGE_STOP (tau2's LLM
repetition judge, never used by the env service) has no wire value. `PB_TO_TAU2` maps the
wire back to tau2's values (as `SimulationRun.termination_reason` takes them) for the six
reasons tau2 knows; the rollout worker's own reasons (MAX_TURNS, MAX_CONTEXT_TOKENS,
INFRASTRUCTURE_ERROR) are not tau2's.
"""

from __future__ import annotations

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
