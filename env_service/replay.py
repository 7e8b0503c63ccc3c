"""Replay of a tau2 task's golden actions through any EnvClient, scored by tau2's evaluator.

The golden actions are the task's `evaluation_criteria.actions`. Each is sent as one
agent tool call; then the agent stops, its final message carrying the task's
`communicate_info` (what tau2's COMMUNICATE check looks for). Actions requested by the
user (telecom) can only be sent by the agent in solo mode, where the agent holds the
user's tools; otherwise they are skipped (and the DB will not match).

Tasks come from `tau2_adapter.tasks.domain_tasks`: tau2's shipped tasks, plus the task
files (tau2's format) given as `task_files`, or a Task given directly.

The trajectory the service produced (observations plus actions) is turned back into
tau2 messages with `tau2_adapter.convert` and scored with tau2's
`evaluate_simulation(..., EvaluationType.ALL)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
from tau2_adapter import convert
from tau2_adapter.termination import PB_TO_TAU2


@dataclass
class ReplayResult:
    session_id: str
    messages: list  # wire messages: Reset observation, then per step the action and its observation
    termination_reason: str  # tau2 TerminationReason value
    server_reward: float
    reward: float  # tau2's evaluator on `messages`
    breakdown: dict = field(default_factory=dict)
    num_steps: int = 0


def golden_task(env: str, task_id: str, task_files: Sequence[str | Path] = ()):
    """tau2's Task `task_id` of domain `env`: the tasks tau2 ships (all splits) plus those of
    `task_files` (task dirs in tau2's format), through `tau2_adapter.tasks.domain_tasks`
    (loaded once per domain and files). Raises KeyError for an unknown task."""
    from tau2_adapter.tasks import domain_tasks

    tasks = domain_tasks(env, task_files).tasks
    try:
        return tasks[task_id]
    except KeyError:
        where = f" or in {', '.join(map(str, task_files))}" if task_files else ""
        raise KeyError(f"no task {task_id!r} in tau2 domain {env!r}{where}") from None


def score(env: str, task, messages: list, termination_reason: str, solo_mode: bool = False):
    """tau2's RewardInfo for a wire trajectory (`evaluate_simulation`, EvaluationType.ALL)."""
    from tau2.data_model.simulation import SimulationRun
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
    from tau2.utils.utils import get_now

    run = SimulationRun(id="replay", task_id=task.id, start_time=get_now(), end_time=get_now(), duration=0.0,
                        termination_reason=termination_reason, messages=convert.to_tau2_messages(messages, include_system=False))
    return evaluate_simulation(simulation=run, task=task, evaluation_type=EvaluationType.ALL, solo_mode=solo_mode, domain=env)


def replay_golden(client, env: str, task_id: str, solo_mode: bool = False,
                  edit: Optional[Callable[[int, str, dict], dict]] = None, close: bool = True,
                  evaluate: bool = True, task=None, task_files: Sequence[str | Path] = ()) -> ReplayResult:
    """Runs the golden actions of `task_id` through `client` (an EnvClient) and scores them.

    The server must serve the task (for a task of a task file: started with the file in
    its `task_files`). The golden actions and the task scored come from `task` if given
    (e.g. `TaskSet.tasks[task_id]`), else from `golden_task(env, task_id, task_files)`.

    Args:
        edit: optional `(index, tool_name, arguments) -> arguments` to change an action
            (e.g. one wrong argument).
        close: Close the session at the end.
        evaluate: score with tau2's evaluator (else `reward` is NaN).
    """
    if task is None:
        task = golden_task(env, task_id, task_files)
    reset = client.reset(env_pb2.ResetRequest(env=env, task_id=task_id, solo_mode=solo_mode, seed=1))
    messages = list(reset.observation)
    step = None
    n = 0
    for i, action in enumerate(task.evaluation_criteria.actions or []):
        if action.requestor != "assistant" and not solo_mode:
            continue
        args = dict(action.arguments)
        if edit is not None:
            args = edit(i, action.name, args)
        msg = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[
            common_pb2.ToolCall(id=f"golden-{i}", name=action.name, arguments_json=json.dumps(args),
                                requestor=common_pb2.ROLE_ASSISTANT)])
        step = client.step(env_pb2.StepRequest(session_id=reset.session_id, action=msg))
        n += 1
        messages += [msg, *step.observation]
        if step.terminated or step.truncated:
            break
    if step is None or not (step.terminated or step.truncated):
        info = task.evaluation_criteria.communicate_info or []
        final = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT)
        if info:
            final.content = "; ".join(str(x) for x in info)
        step = client.step(env_pb2.StepRequest(session_id=reset.session_id, action=final, stop=True))
        n += 1
        # As tau2 records it: the stop is the agent's message with the stop token.
        from env_service.session import STOP_TOKEN

        final.content = f"{final.content} {STOP_TOKEN}".strip() if final.HasField("content") else STOP_TOKEN
        messages += [final, *step.observation]
    if close:
        client.close(reset.session_id)
    reason = PB_TO_TAU2.get(step.termination_reason, "agent_error")
    reward, breakdown = float("nan"), {}
    if evaluate:
        info = score(env, task, messages, reason, solo_mode=solo_mode)
        reward = float(info.reward)
        breakdown = {str(k.value if hasattr(k, "value") else k): v for k, v in (info.reward_breakdown or {}).items()}
    return ReplayResult(session_id=reset.session_id, messages=messages, termination_reason=reason,
                        server_reward=step.reward, reward=reward, breakdown=breakdown, num_steps=n)


def replay_dialogue(client, env: str, task, agent, max_turns: int = 12, edit: Optional[Callable] = None,
                    close: bool = True, seed: int = 1, evaluate: bool = True) -> ReplayResult:
    """Runs a scripted agent against the env's user simulator (solo mode off) and scores the episode.

    Args:
        client: an EnvClient serving `task` (its user simulator answers the user's turns).
        task: the τ²-Bench Task (its id is Reset).
        agent: `next_turn(user_text, tool_answer) -> turn` with `turn.content`, `turn.tool`,
            `turn.arguments` and `turn.stop` (e.g. `tau2_adapter.generate_dual.GoldenAgent`); it is
            given the user's last message, or the tool's answer after a tool call.
        max_turns: agent turns at most (the episode is then left as it is, unscored by the env).
        edit: optional `turn -> turn` applied to every agent turn (e.g. one wrong argument).
    """
    reset = client.reset(env_pb2.ResetRequest(env=env, task_id=task.id, solo_mode=False, seed=seed))
    messages = list(reset.observation)
    users = [m.content for m in reset.observation if m.role == common_pb2.ROLE_USER]
    user_text, tool_answer = (users[-1] if users else None), None
    step, n = None, 0
    for n in range(1, max_turns + 1):
        turn = agent.next_turn(user_text, tool_answer)
        if edit is not None:
            turn = edit(turn)
        if turn.tool is not None:
            msg = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[common_pb2.ToolCall(
                id=f"dialogue-{n}", name=turn.tool, arguments_json=json.dumps(turn.arguments),
                requestor=common_pb2.ROLE_ASSISTANT)])
        else:
            msg = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content=turn.content or "")
        step = client.step(env_pb2.StepRequest(session_id=reset.session_id, action=msg, stop=bool(turn.stop)))
        messages += [msg, *step.observation]
        if step.terminated or step.truncated:
            break
        tools = [m.content for m in step.observation if m.role == common_pb2.ROLE_TOOL]
        users = [m.content for m in step.observation if m.role == common_pb2.ROLE_USER]
        tool_answer = tools[-1] if tools else None
        user_text = users[-1] if users and not tools else None
    if close:
        client.close(reset.session_id)
    ended = step is not None and (step.terminated or step.truncated)
    reason = PB_TO_TAU2.get(step.termination_reason, "agent_error") if ended else "max_steps"
    reward, breakdown = float("nan"), {}
    if evaluate:
        info = score(env, task, messages, reason, solo_mode=False)
        reward = float(info.reward)
        breakdown = {str(k.value if hasattr(k, "value") else k): v for k, v in (info.reward_breakdown or {}).items()}
    return ReplayResult(session_id=reset.session_id, messages=messages, termination_reason=reason,
                        server_reward=step.reward if step is not None else 0.0, reward=reward, breakdown=breakdown,
                        num_steps=n)
