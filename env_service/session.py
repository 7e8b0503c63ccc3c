"""One episode of a tau2 task, driven one agent action at a time.

tau2's `Orchestrator` runs a whole simulation in `run()`, asking its agent for each
message. Its own Gymnasium wrapper (`tau2.gym.AgentGymEnv`) runs `run()` in a thread per
episode and hands strings across with events polled every 10 ms. Here there is no
thread: `Tau2Session` calls the Orchestrator's own `initialize()` and `step()` and
applies `run()`'s termination rules (max steps, max errors) between steps, stopping
whenever the agent is due to act. The agent is a `GymAgent` (tau2's, see below) whose
next message is the action given to `step()`. Everything else is tau2's: the
environment and its tools, the user simulator (`UserSimulator`, or `DummyUser` in solo
mode), message routing, stop detection, termination reasons, and the evaluator.

Departures from tau2's `run()`: no LLM judge for repetition (JUDGE_STOP), and a
failure of the user simulator's LLM ends the episode with USER_ERROR (tau2 would raise).

The wire trajectory of an episode is `ResetResponse.observation` + for each step
[the action, `StepResponse.observation`]: exactly tau2's trajectory (with the initial
message history and the orchestrator's greeting), system prompt excluded. An action
sent with `stop=True` appears in tau2's trajectory as the assistant message
`content + "###STOP###"`. Tool-call ids are kept exactly as the agent sent them (tau2
pairs calls and answers by position; ids may repeat or be empty), and every tool answer
carries its call's id, requestor and error flag, so `tau2_adapter.convert.to_tau2_messages` of the
trajectory is what tau2's evaluator replays. An action with both content and tool
calls is a tool call whose content is kept (tau2's default, validate_communication off).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Optional

import grpc

from env_service.catalog import Domain
from sinkflex.api.common.v1 import common_pb2
from sinkflex.errors import ServiceError, clip, failed_precondition, invalid_argument
from tau2_adapter import convert
from tau2_adapter.termination import EVALUATED_STOPS, TAU2_TO_PB, without_unexecuted_tool_calls

from tau2.agent.llm_agent import (
    AGENT_INSTRUCTION,
    AGENT_SOLO_INSTRUCTION,
    SYSTEM_PROMPT,
    SYSTEM_PROMPT_SOLO,
)
from tau2.data_model.message import AssistantMessage
from tau2.data_model.simulation import SimulationRun, TerminationReason
from tau2.gym.gym_agent import GymAgent as _Tau2GymAgent
from tau2.orchestrator.orchestrator import Orchestrator, Role
from tau2.user.user_simulator import DummyUser, UserSimulator
from tau2.utils.utils import get_now

log = logging.getLogger(__name__)

#: tau2's agent stop token (`GymAgent.STOP_TOKEN`); an action whose content holds it stops.
STOP_TOKEN = _Tau2GymAgent.STOP_TOKEN
#: tau2's stop tool (`GymAgent.STOP_FUNCTION_NAME`); a call to it stops, in solo mode too.
STOP_TOOL = _Tau2GymAgent.STOP_FUNCTION_NAME

#: tau2 TerminationReason -> wire reason (`tau2_adapter.termination.TAU2_TO_PB`).
TERMINATION_TO_PB = TAU2_TO_PB
#: Reasons that Gymnasium calls truncation (the budget ran out), not termination.
TRUNCATION_REASONS = {TerminationReason.MAX_STEPS}


class GymAgent(_Tau2GymAgent):
    """tau2's GymAgent without its thread handshake: the next message is `pending`.

    It keeps tau2's class name because `Orchestrator.initialize()` admits only an
    LLMSoloAgent or a class named "GymAgent" in solo mode. `is_stop` (STOP token in the
    content, or a call to the `done` tool) and the rewrite of a `done` call into the stop
    token are tau2's.
    """

    def __init__(self, tools, domain_policy):
        super().__init__(tools=tools, domain_policy=domain_policy)
        self.pending: Optional[AssistantMessage] = None

    def set_seed(self, seed: int) -> None:  # the actions come from outside: nothing to seed
        pass

    def generate_next_message(self, message, state):
        if self.pending is None:  # invariant: the session only steps with an action set
            raise RuntimeError("the orchestrator asked the agent for a message without an action")
        if message is not None:
            if hasattr(message, "tool_messages"):  # MultiToolMessage
                state.messages.extend(message.tool_messages)
            else:
                state.messages.append(message)
        action, self.pending = self.pending, None
        action = self._check_if_stop_toolcall(action)
        state.messages.append(action)
        return action, state


class Tau2Session:
    """One episode. Not thread-safe by itself: `core.EnvCore` holds `lock` around calls.

    Args:
        session_id: unique id of the session.
        domain: the served tau2 domain.
        task: the tau2 Task.
        solo_mode: the agent acts alone (DummyUser; agent tools plus user tools).
        max_steps: tau2 step budget (every orchestrator step counts).
        max_errors: tool errors that end the episode (TOO_MANY_ERRORS).
        user_model, user_llm_args: the user simulator's litellm model and arguments.
        seed: seed of the user simulator's LLM (litellm `seed`); None: unseeded.
        reward_on_termination: score with tau2's evaluator when the episode ends.
    """

    def __init__(
        self,
        session_id: str,
        domain: Domain,
        task,
        solo_mode: bool,
        max_steps: int,
        max_errors: int,
        user_model: str,
        user_llm_args: dict,
        seed: Optional[int],
        reward_on_termination: bool,
    ):
        self.session_id = session_id
        self.domain = domain
        self.task = task
        self.solo_mode = solo_mode
        self.reward_on_termination = reward_on_termination
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self.num_actions = 0
        self.start_time = get_now()
        self._t0 = time.perf_counter()

        environment = domain.make_environment(solo_mode=solo_mode)
        tools = domain.agent_tools(environment, solo_mode)
        if solo_mode:
            user = DummyUser()
        else:
            user = UserSimulator(tools=domain.user_tools(environment), instructions=task.user_scenario, llm=user_model,
                                 llm_args=dict(user_llm_args))
        self.agent = GymAgent(tools=tools, domain_policy=environment.get_policy())
        # The `done` tool GymAgent adds is offered only in solo mode (tau2's solo instructions name it).
        self.tools = self.agent.tools if solo_mode else self.agent.tools[:-1]
        self.orchestrator = Orchestrator(
            domain=domain.name,
            agent=self.agent,
            user=user,
            environment=environment,
            task=task,
            max_steps=max_steps,
            max_errors=max_errors,
            seed=seed,
            solo_mode=solo_mode,
        )
        self._initialized = False
        self.reward: Optional[float] = None
        self.reward_info_json = ""
        self.error = ""
        self.evaluation_error = ""  # tau2's evaluation raised at the end (info["evaluation_error"])
        #: (request bytes, response) of a Step applied after its client had gone (cancelled,
        #: deadline passed): kept for the client's resend (`core.EnvCore.step`).
        self.undelivered: Optional[tuple[bytes, common_pb2.StepResponse]] = None
        #: (request_id, request bytes, response) of the last applied Step when it had a request_id
        self.last_step: Optional[tuple[str, bytes, common_pb2.StepResponse]] = None
        #: `last_step` was already answered again to a resend
        self.last_step_replayed = False

    # -- prompts --------------------------------------------------------------------------
    @property
    def policy(self) -> str:
        return self.orchestrator.environment.get_policy()

    @property
    def system_prompt(self) -> str:
        """tau2's LLMAgent system prompt (LLMSoloAgent's, with the ticket, in solo mode)."""
        if self.solo_mode:
            instruction = AGENT_SOLO_INSTRUCTION.format(stop_function_name=STOP_TOOL, stop_token=STOP_TOKEN)
            return SYSTEM_PROMPT_SOLO.format(agent_instruction=instruction, domain_policy=self.policy, ticket=self.task.ticket)
        return SYSTEM_PROMPT.format(agent_instruction=AGENT_INSTRUCTION, domain_policy=self.policy)

    def tool_specs(self) -> list[common_pb2.ToolSpec]:
        out = []
        for tool in self.tools:
            fn = tool.openai_schema["function"]
            out.append(
                common_pb2.ToolSpec(
                    name=fn["name"],
                    description=fn.get("description", ""),
                    parameters_json_schema=json.dumps(fn.get("parameters", {"type": "object", "properties": {}})),
                )
            )
        return out

    # -- state ----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.orchestrator.done

    @property
    def termination_reason(self) -> Optional[TerminationReason]:
        return self.orchestrator.termination_reason

    # -- episode --------------------------------------------------------------------------
    def reset(self) -> list[common_pb2.Message]:
        """Starts the episode; returns the first observation (wire messages).

        In solo mode without an initial message history the agent acts first: the
        observation is empty and the task's ticket is in the system prompt.

        Raises:
            ServiceError UNAVAILABLE: the user simulator's LLM failed on the first turn.
        """
        history = self.task.initial_state.message_history if self.task.initial_state else None
        if self.solo_mode and not history:
            return []  # Orchestrator.initialize() asks the agent first: done on the first step
        self.orchestrator.initialize()
        self._initialized = True
        try:
            self._advance()
        except _UserLLMError as err:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"user simulator failed on the first turn: {err}") from None
        if self.done:
            self._finish()
        return convert.from_tau2_messages(self.orchestrator.trajectory)

    def step(self, action: common_pb2.Message, stop: bool) -> list[common_pb2.Message]:
        """Applies one agent action; returns the messages produced after it.

        Raises:
            ServiceError FAILED_PRECONDITION: the episode has ended.
            ServiceError INVALID_ARGUMENT: a bad action (wrong role, empty, stop with tool calls);
                nothing was applied.
            ServiceError INTERNAL: tau2 raised while applying a valid action; the episode
                has ended (AGENT_ERROR), so no later Step runs from a state the client never saw.
        """
        if self.done:
            reason = self.termination_reason.value if self.termination_reason else "unknown"
            raise failed_precondition(f"session {self.session_id} has ended ({reason}); Reset a new one")
        message = self._to_agent_message(action, stop)
        self.agent.pending = message
        self.num_actions += 1
        if not self._initialized:  # solo mode: the agent's first message starts the episode
            start = 0
            self.orchestrator.initialize()
            self._initialized = True
        else:
            assert self.orchestrator.to_role == Role.AGENT, self.orchestrator.to_role
            start = len(self.orchestrator.trajectory)
        try:
            if not self.done:
                self._advance(agent_turn=start > 0)
        except _UserLLMError as err:
            self.orchestrator.done = True
            self.orchestrator.termination_reason = TerminationReason.USER_ERROR
            self.error = f"user simulator failed: {err}"
            log.warning("session %s: %s", self.session_id, self.error)
        except Exception as err:  # noqa: BLE001 - never leave a half-applied step behind silently
            # The action was validated before anything ran, so this is a fault of the env
            # (tau2 raised mid-step). The episode cannot go on from a state the client
            # never saw: it ends (AGENT_ERROR) and the client is told so.
            self.agent.pending = None
            self.orchestrator.done = True
            self.orchestrator.termination_reason = TerminationReason.AGENT_ERROR
            self.error = f"the env failed while applying the action: {type(err).__name__}: {err}"
            log.exception("session %s: step failed", self.session_id)
            raise ServiceError(grpc.StatusCode.INTERNAL,
                               f"session {self.session_id}: {self.error}; the episode has ended (agent_error)") from None
        self.agent.pending = None
        if self.done:
            self._finish()
        return convert.from_tau2_messages(self.orchestrator.trajectory[start + 1 :])  # after the action

    def _to_agent_message(self, action: common_pb2.Message, stop: bool) -> AssistantMessage:
        if action.role not in (common_pb2.ROLE_UNSPECIFIED, common_pb2.ROLE_ASSISTANT):
            raise invalid_argument(f"action.role must be ROLE_ASSISTANT, got {convert.role_label(action.role)}")
        for i, call in enumerate(action.tool_calls):
            if call.requestor not in (common_pb2.ROLE_UNSPECIFIED, common_pb2.ROLE_ASSISTANT):
                raise invalid_argument(f"action.tool_calls[{i}] ({clip(call.name)}): requestor must be ROLE_ASSISTANT, "
                                       f"got {convert.role_label(call.requestor)}")
            if not call.name:
                raise invalid_argument(f"action.tool_calls[{i}] has an empty name")
        action = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=action.tool_calls, **({"content": action.content} if action.HasField("content") else {}))
        try:
            message = convert.to_tau2_message(action)
        except ValueError as err:  # e.g. pydantic refusing a field
            raise invalid_argument(f"action: {err}") from None
        if stop:
            if message.tool_calls:
                raise invalid_argument("stop=True with tool calls: send the tool calls in one step, then stop")
            text = message.content or ""
            if STOP_TOKEN not in text:
                message.content = f"{text} {STOP_TOKEN}".strip()
        elif not message.has_text_content() and not message.is_tool_call():
            raise invalid_argument("empty action: give content (a reply to the user), tool calls, or stop=True")
        return message

    def _advance(self, agent_turn: bool = False) -> None:
        """Steps the orchestrator until the agent is due to act or the episode ends.

        Applies tau2 `Orchestrator.run()`'s checks after each step (max steps, max errors,
        never while a tool call is pending). With `agent_turn`, the first step is the agent's.
        """
        orch = self.orchestrator
        first = True
        while not orch.done:
            if orch.to_role == Role.AGENT and not (first and agent_turn):
                return
            first = False
            user_turn = orch.to_role == Role.USER and not self.solo_mode
            try:
                orch.step()
            except Exception as err:
                if user_turn:  # the user simulator (its LLM call through litellm) failed
                    raise _UserLLMError(f"{type(err).__name__}: {err}") from err
                raise
            if orch.to_role == Role.ENV:
                continue
            if orch.step_count >= orch.max_steps:
                orch.done = True
                orch.termination_reason = TerminationReason.MAX_STEPS
            if orch.num_errors >= orch.max_errors:
                orch.done = True
                orch.termination_reason = TerminationReason.TOO_MANY_ERRORS

    def simulation_run(self) -> SimulationRun:
        """tau2's SimulationRun of the episode so far (for tau2's evaluator)."""
        reason = self.termination_reason or TerminationReason.AGENT_ERROR
        return SimulationRun(
            id=self.session_id,
            task_id=self.task.id,
            start_time=self.start_time,
            end_time=get_now(),
            duration=time.perf_counter() - self._t0,
            termination_reason=reason,
            messages=self.orchestrator.get_trajectory(),
        )

    def _finish(self) -> None:
        if not self.reward_on_termination or self.reward is not None:
            return
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

        run = self.simulation_run()
        if run.termination_reason.value in EVALUATED_STOPS:
            # a stop that also made tool calls ended the episode before they ran: scored on what ran
            run.messages, left_out = without_unexecuted_tool_calls(run.messages)
            if left_out:
                log.info("session %s: %d tool call(s) of the stopping message never ran, left out of the evaluation",
                         self.session_id, left_out)
        try:
            info = evaluate_simulation(
                simulation=run,
                task=self.task,
                evaluation_type=EvaluationType.ALL,
                solo_mode=self.solo_mode,
                domain=self.domain.name,
            )
        except Exception as err:  # noqa: BLE001 - a scoring failure must not lose the episode
            log.warning("session %s: tau2 evaluation failed: %s", self.session_id, err)
            self.error = self.error or f"tau2 evaluation failed: {err}"
            self.evaluation_error = f"{type(err).__name__}: {err}"[:2000]
            return
        self.reward = float(info.reward)
        self.reward_info_json = info.model_dump_json()

    def info(self) -> dict[str, str]:
        out = {"task_id": self.task.id, "env": self.domain.name, "step_count": str(self.orchestrator.step_count),
               "num_errors": str(self.orchestrator.num_errors)}
        if self.termination_reason is not None:
            out["termination_reason"] = self.termination_reason.value
        if self.reward_info_json:
            out["reward_info"] = self.reward_info_json
        if self.error:
            out["error"] = self.error
        if self.evaluation_error:  # the episode is unscored (StepResponse.reward stays 0.0 on the wire)
            out["evaluation_error"] = self.evaluation_error
        return out


class _UserLLMError(Exception):
    """The user simulator's LLM call failed."""


def new_session_id() -> str:
    return uuid.uuid4().hex
