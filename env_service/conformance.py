"""A conformance suite for any EnvService server (`sinkflex-rl env check ADDRESS`).

Each check calls the server over gRPC and returns PASS or FAIL with what it saw. The
suite needs one task the server can run without an outside LLM: it picks the first task
of the first environment (solo mode where the environment supports it) unless told which.
Checks: health SERVING, ListEnvironments, ListTasks (all and per split), NOT_FOUND for an
unknown env / split / task / session (every refusal with the contract's code and a message),
Reset's observation and tool specs (JSON Schema objects), an unknown tool and malformed
tool-call JSON answered as tool errors with the episode going on, stop -> terminated with
AGENT_STOP, a step after termination -> FAILED_PRECONDITION, sessions isolated, Close and
NOT_FOUND after it; terminal-reward semantics (reward 0 on every step before the end, a
finite reward on the terminating step, the same for the same episode replayed);
ResetRequest.max_steps honoured (truncated, not terminated, with MAX_STEPS, within the
budget; then FAILED_PRECONDITION); sessions isolated under concurrency (several sessions
stepped at once from threads: each answers its own tool calls, stops or truncates exactly
as a session run alone does, with the same reward); an oversized message ->
RESOURCE_EXHAUSTED with the server still serving; with `max_sessions`, Reset beyond it ->
RESOURCE_EXHAUSTED and a free slot again after Close.

Before any check the address must accept a connection within `ready_timeout` seconds;
otherwise `run_checks` raises `EnvUnreachable` with what gRPC said (no check runs).
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import grpc

from env_service.client import GrpcEnvClient
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
from sinkflex.errors import ServiceError
from sinkflex.serving import DEFAULT_MAX_MESSAGE_BYTES, wait_for_serving


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str = ""


class _Failed(Exception):
    pass


class EnvUnreachable(Exception):
    """Nothing answered at the address within the ready timeout."""


def probe(channel: grpc.Channel, address: str, ready_timeout: float) -> None:
    """Raises EnvUnreachable unless `channel` connects within `ready_timeout` seconds."""
    try:
        grpc.channel_ready_future(channel).result(timeout=ready_timeout)
        return
    except grpc.FutureTimeoutError:
        pass
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    why = "no connection"
    try:  # one call without waiting for readiness: gRPC says why it cannot connect
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    except grpc.RpcError as err:
        why = f"{err.code().name}: {err.details()}"
    raise EnvUnreachable(f"no env server reachable at {address} within {ready_timeout:g} s ({why}); "
                         "is it running, and on that host and port?")


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise _Failed(what)


def _expect_code(fn: Callable[[], object], code: grpc.StatusCode) -> str:
    try:
        fn()
    except ServiceError as err:
        _expect(err.code == code, f"expected {code.name}, got {err.code.name}: {err.message}")
        _expect(bool(err.message.strip()), f"{code.name} without a message saying what was wrong")
        return f"{err.code.name}: {err.message}"
    raise _Failed(f"expected {code.name}, the call succeeded")


def _tool_call(name: str, args: str, call_id: str) -> common_pb2.Message:
    return common_pb2.Message(role=common_pb2.ROLE_ASSISTANT,
                              tool_calls=[common_pb2.ToolCall(id=call_id, name=name, arguments_json=args)])


#: The step budget the max_steps and concurrency checks give their sessions.
BUDGET = 3


def run_checks(address: str, env: Optional[str] = None, task_id: Optional[str] = None, solo: Optional[bool] = None,
               timeout: float = 120.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, ready_timeout: float = 5.0,
               concurrency: int = 6, max_sessions: Optional[int] = None) -> list[CheckResult]:
    """Runs the suite against `address`; returns one result per check, in order.

    Args:
        timeout: deadline of each call, seconds.
        ready_timeout: seconds for the address to accept a connection and report SERVING.
        concurrency: sessions the concurrency check runs at once.
        max_sessions: the server's session limit; when given, Reset beyond it is checked.

    Raises:
        EnvUnreachable: nothing accepted a connection at `address` within `ready_timeout`.
    """

    results: list[CheckResult] = []
    state: dict = {}
    client = GrpcEnvClient(address, timeout=timeout, max_message_bytes=4 * max_message_bytes)
    try:
        probe(client.channel, address, ready_timeout)
    except EnvUnreachable:
        client.shutdown()
        raise

    def check(name: str):
        def deco(fn):
            try:
                detail = fn() or ""
                results.append(CheckResult(name, True, str(detail)))
            except _Failed as err:
                results.append(CheckResult(name, False, str(err)))
            except ServiceError as err:
                results.append(CheckResult(name, False, f"unexpected {err.code.name}: {err.message}"))
            except Exception as err:  # noqa: BLE001 - report, go on
                results.append(CheckResult(name, False, f"{type(err).__name__}: {err}"))
            return fn
        return deco

    @check("health: SERVING")
    def _():
        wait_for_serving(client.channel, "", timeout=ready_timeout)
        return "grpc.health.v1 SERVING"

    @check("ListEnvironments")
    def _():
        envs = client.list_environments()
        _expect(len(envs) > 0, "no environments")
        for e in envs:
            _expect(bool(e.name), "an environment without a name")
        state["envs"] = {e.name: e for e in envs}
        return ", ".join(f"{e.name} ({e.num_tasks} tasks, splits {list(e.splits)})" for e in envs)

    @check("ListTasks: all tasks and every split")
    def _():
        _expect("envs" in state, "no environments listed")
        lines = []
        for e in state["envs"].values():
            ids = client.list_tasks(e.name)
            _expect(len(ids) == e.num_tasks, f"{e.name}: ListTasks gave {len(ids)} tasks, ListEnvironments says {e.num_tasks}")
            _expect(len(set(ids)) == len(ids), f"{e.name}: duplicate task ids")
            for split in e.splits:
                part = client.list_tasks(e.name, split)
                _expect(set(part) <= set(ids), f"{e.name}/{split}: ids outside the env's tasks")
            lines.append(f"{e.name}: {len(ids)}")
        state["env"] = env or next(iter(state["envs"]))
        _expect(state["env"] in state["envs"], f"env {state['env']!r} not served")
        state["task_id"] = task_id or client.list_tasks(state["env"])[0]
        return "; ".join(lines)

    @check("NOT_FOUND: unknown env, split, task, session")
    def _():
        out = [_expect_code(lambda: client.list_tasks("no-such-env-xyz"), grpc.StatusCode.NOT_FOUND)]
        out.append(_expect_code(lambda: client.reset(env_pb2.ResetRequest(env="no-such-env-xyz")), grpc.StatusCode.NOT_FOUND))
        if "env" in state:
            out.append(_expect_code(lambda: client.list_tasks(state["env"], "no-such-split-xyz"), grpc.StatusCode.NOT_FOUND))
            out.append(_expect_code(lambda: client.reset(env_pb2.ResetRequest(env=state["env"], task_id="no-such-task-xyz")),
                                    grpc.StatusCode.NOT_FOUND))
            out.append(_expect_code(lambda: client.reset(env_pb2.ResetRequest(env=state["env"], split="no-such-split-xyz")),
                                    grpc.StatusCode.NOT_FOUND))
        out.append(_expect_code(lambda: client.step(env_pb2.StepRequest(session_id="no-such-session-xyz", stop=True)),
                                grpc.StatusCode.NOT_FOUND))
        out.append(_expect_code(lambda: client.close("no-such-session-xyz"), grpc.StatusCode.NOT_FOUND))
        return f"{len(out)} calls refused"

    def reset(max_steps: int = 0) -> env_pb2.ResetResponse:
        _expect("task_id" in state, "no task to run")
        use_solo = solo if solo is not None else state["envs"][state["env"]].supports_solo
        return client.reset(env_pb2.ResetRequest(env=state["env"], task_id=state["task_id"], solo_mode=use_solo, seed=1,
                                                 max_steps=max_steps))

    def error_step(session_id: str, call_id: str) -> env_pb2.StepResponse:
        """A step calling an unknown tool: one tool error answering `call_id`."""
        s = client.step(env_pb2.StepRequest(session_id=session_id, action=_tool_call("no_such_tool_xyz", "{}", call_id)))
        answers = [m.tool_call_id for m in s.observation if m.role == common_pb2.ROLE_TOOL]
        _expect(answers == [call_id], f"session {session_id}: the tool results answer {answers}, not [{call_id!r}]")
        return s

    def episode(max_steps: int, stop_after: Optional[int], tag: str) -> tuple[int, env_pb2.StepResponse]:
        """Tool-error steps until the episode ends (or `stop_after` of them, then stop).

        Returns the number of Step calls and the last StepResponse; closes the session.
        """
        r = reset(max_steps)
        try:
            calls, s = 0, None
            limit = stop_after if stop_after is not None else max_steps
            while calls < limit:
                s = error_step(r.session_id, f"{tag}-{calls}")
                calls += 1
                _expect(math.isfinite(s.reward), f"reward {s.reward} is not finite")
                if s.terminated or s.truncated:
                    break
                _expect(s.reward == 0.0, f"reward {s.reward:g} on step {calls}, before the episode ended")
            if stop_after is not None and not (s and (s.terminated or s.truncated)):
                s = client.step(env_pb2.StepRequest(session_id=r.session_id, stop=True))
                calls += 1
            return calls, s
        finally:
            client.close(r.session_id)

    @check("Reset: session, observation, tool specs")
    def _():
        r = reset()
        _expect(bool(r.session_id), "empty session_id")
        _expect(r.task_id == state["task_id"], f"task_id {r.task_id!r} != {state['task_id']!r}")
        _expect(len(r.tools) > 0, "no tools")
        for t in r.tools:
            schema = json.loads(t.parameters_json_schema)
            _expect(isinstance(schema, dict) and schema.get("type") == "object", f"tool {t.name}: parameters schema is not an object schema")
        for m in r.observation:
            _expect(m.role != common_pb2.ROLE_UNSPECIFIED, "an observation message without a role")
        state["session"] = r.session_id
        state["tools"] = [t.name for t in r.tools]
        return f"{state['env']}/{state['task_id']}: {len(r.observation)} messages, tools {state['tools']}"

    @check("Step: unknown tool -> tool error, episode goes on")
    def _():
        _expect("session" in state, "no session")
        s = client.step(env_pb2.StepRequest(session_id=state["session"], action=_tool_call("no_such_tool_xyz", "{}", "chk-1")))
        tools = [m for m in s.observation if m.role == common_pb2.ROLE_TOOL]
        _expect(len(tools) == 1 and tools[0].error and tools[0].tool_call_id == "chk-1",
                f"expected one tool error answering chk-1, got {list(s.observation)}")
        _expect(not s.terminated and not s.truncated, "the episode ended")
        return tools[0].content

    @check("Step: malformed tool-call JSON -> tool error, episode goes on")
    def _():
        _expect("session" in state, "no session")
        name = state["tools"][0]
        s = client.step(env_pb2.StepRequest(session_id=state["session"], action=_tool_call(name, "{not json", "chk-2")))
        tools = [m for m in s.observation if m.role == common_pb2.ROLE_TOOL]
        _expect(len(tools) == 1 and tools[0].error and tools[0].tool_call_id == "chk-2",
                f"expected one tool error answering chk-2, got {list(s.observation)}")
        _expect(not s.terminated and not s.truncated, "the episode ended")
        return tools[0].content

    @check("Sessions are isolated")
    def _():
        _expect("session" in state, "no session")
        other = reset()
        _expect(other.session_id != state["session"], "Reset reused a session id")
        s = client.step(env_pb2.StepRequest(session_id=other.session_id, stop=True))
        _expect(s.terminated, "stop did not terminate the other session")
        s2 = client.step(env_pb2.StepRequest(session_id=state["session"], action=_tool_call("no_such_tool_xyz", "{}", "chk-3")))
        _expect(not s2.terminated, "stopping one session ended another")
        client.close(other.session_id)
        return "stopping one session leaves the other running"

    @check("Step: stop -> terminated, AGENT_STOP")
    def _():
        _expect("session" in state, "no session")
        s = client.step(env_pb2.StepRequest(session_id=state["session"], stop=True))
        _expect(s.terminated, "not terminated")
        _expect(s.termination_reason == common_pb2.TERMINATION_REASON_AGENT_STOP,
                f"termination_reason {common_pb2.TerminationReason.Name(s.termination_reason)}")
        return f"reward {s.reward:g}"

    @check("FAILED_PRECONDITION: step after termination")
    def _():
        _expect("session" in state, "no session")
        return _expect_code(lambda: client.step(env_pb2.StepRequest(session_id=state["session"], stop=True)),
                            grpc.StatusCode.FAILED_PRECONDITION)

    @check("Close, then NOT_FOUND")
    def _():
        _expect("session" in state, "no session")
        client.close(state["session"])
        a = _expect_code(lambda: client.step(env_pb2.StepRequest(session_id=state["session"], stop=True)), grpc.StatusCode.NOT_FOUND)
        _expect_code(lambda: client.close(state["session"]), grpc.StatusCode.NOT_FOUND)
        return a

    @check("Terminal reward: 0 before the end, finite at termination, the same on a replay")
    def _():
        _expect("task_id" in state, "no task to run")
        calls, end = episode(0, stop_after=1, tag="rwd")
        _expect(end.terminated and not end.truncated, "stop after one step did not terminate the episode")
        _expect(math.isfinite(end.reward), f"terminal reward {end.reward} is not finite")
        _, again = episode(0, stop_after=1, tag="rwd")
        _expect(again.reward == end.reward, f"the same episode got reward {end.reward:g}, then {again.reward:g}")
        state["stop_reward"] = end.reward
        return f"0 on the running step, {end.reward:g} at termination, {again.reward:g} on the replay"

    @check(f"max_steps: truncated with MAX_STEPS within the budget ({BUDGET}), then FAILED_PRECONDITION")
    def _():
        _expect("task_id" in state, "no task to run")
        r = reset(BUDGET)
        try:
            for calls in range(1, BUDGET + 1):
                s = error_step(r.session_id, f"budget-{calls}")
                if s.terminated or s.truncated:
                    break
                _expect(s.reward == 0.0, f"reward {s.reward:g} before the episode ended")
            _expect(s.truncated and not s.terminated, f"after {calls} steps of a {BUDGET}-step budget: truncated={s.truncated} "
                    f"terminated={s.terminated} (Gymnasium: a spent budget truncates)")
            _expect(s.termination_reason == common_pb2.TERMINATION_REASON_MAX_STEPS,
                    f"termination_reason {common_pb2.TerminationReason.Name(s.termination_reason)}")
            _expect(math.isfinite(s.reward), f"reward {s.reward} is not finite")
            _expect_code(lambda: client.step(env_pb2.StepRequest(session_id=r.session_id, stop=True)),
                         grpc.StatusCode.FAILED_PRECONDITION)
        finally:
            client.close(r.session_id)
        state["budget_calls"], state["budget_reward"] = calls, s.reward
        return f"truncated after {calls} steps, reward {s.reward:g}"

    @check("Concurrent sessions are isolated")
    def _():
        _expect("stop_reward" in state and "budget_calls" in state, "needs the terminal-reward and max_steps checks")
        k = max(2, concurrency if max_sessions is None else min(concurrency, max_sessions))
        # Even sessions: one tool-error step, then stop (as in the terminal-reward check). Odd
        # sessions: a BUDGET-step budget spent on tool errors (as in the max_steps check). All
        # are open at once and stepped in rounds, every session's step of a round at the same time.
        with ThreadPoolExecutor(k) as pool:
            ids = [r.session_id for r in pool.map(lambda i: reset(BUDGET if i % 2 else 0), range(k))]
            try:
                _expect(len(set(ids)) == k, f"{k} concurrent Resets gave {len(set(ids))} distinct session ids")
                calls, last, running = [0] * k, [None] * k, list(range(k))

                def one(i: int) -> env_pb2.StepResponse:
                    if i % 2 == 0 and calls[i] == 1:
                        return client.step(env_pb2.StepRequest(session_id=ids[i], stop=True))
                    return error_step(ids[i], f"iso{i}-{calls[i]}")

                for _round in range(BUDGET + 1):
                    for i, s in zip(running, list(pool.map(one, running))):
                        calls[i], last[i] = calls[i] + 1, s
                        _expect(math.isfinite(s.reward), f"session {i}: reward {s.reward} is not finite")
                        if not (s.terminated or s.truncated):
                            _expect(s.reward == 0.0, f"session {i}: reward {s.reward:g} before the episode ended")
                    running = [i for i in running if not (last[i].terminated or last[i].truncated)]
                    if not running:
                        break
                _expect(not running, f"sessions {running} still running after {BUDGET + 1} rounds")
            finally:
                def close(sid: str) -> None:
                    try:
                        client.close(sid)
                    except ServiceError:
                        pass
                list(pool.map(close, ids))
        for i in range(k):
            s = last[i]
            if i % 2 == 0:
                _expect(s.terminated and s.termination_reason == common_pb2.TERMINATION_REASON_AGENT_STOP and calls[i] == 2,
                        f"session {i}: after {calls[i]} steps terminated={s.terminated} truncated={s.truncated} "
                        f"({common_pb2.TerminationReason.Name(s.termination_reason)}); alone: stopped on step 2")
                _expect(s.reward == state["stop_reward"], f"session {i}: reward {s.reward:g}, alone {state['stop_reward']:g}")
            else:
                _expect(s.truncated and calls[i] == state["budget_calls"],
                        f"session {i}: truncated={s.truncated} after {calls[i]} steps; alone: after {state['budget_calls']}")
                _expect(s.reward == state["budget_reward"], f"session {i}: reward {s.reward:g}, alone {state['budget_reward']:g}")
        return (f"{k} sessions at once: {(k + 1) // 2} stopped with reward {state['stop_reward']:g}, {k // 2} truncated "
                f"after {state['budget_calls']} steps, as alone; every tool result answered its own call")

    @check("RESOURCE_EXHAUSTED: oversized message, server keeps serving")
    def _():
        big = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="x" * (max_message_bytes + 1024))
        d = _expect_code(lambda: client.step(env_pb2.StepRequest(session_id="oversized", action=big)),
                         grpc.StatusCode.RESOURCE_EXHAUSTED)
        _expect(len(client.list_environments()) > 0, "server stopped answering")
        return d[:120]

    if max_sessions is not None:
        @check(f"RESOURCE_EXHAUSTED: Reset beyond max_sessions ({max_sessions}), a slot again after Close")
        def _():
            _expect("task_id" in state, "no task to run")
            opened: list[str] = []
            try:
                for n in range(max_sessions):
                    try:
                        opened.append(reset().session_id)
                    except ServiceError as err:
                        raise _Failed(f"Reset {n + 1} of {max_sessions} refused ({err.code.name}: {err.message}); "
                                      "other sessions open on the server?") from None
                d = _expect_code(reset, grpc.StatusCode.RESOURCE_EXHAUSTED)
                client.close(opened.pop())
                opened.append(reset().session_id)
            finally:
                for sid in opened:
                    client.close(sid)
            return d[:120]

    client.shutdown()
    return results


def format_results(results: list[CheckResult]) -> str:
    lines = [f"{'PASS' if r.passed else 'FAIL'}  {r.name}" + (f"  -- {r.detail}" if r.detail else "") for r in results]
    passed = sum(r.passed for r in results)
    lines.append(f"{passed}/{len(results)} checks passed")
    return "\n".join(lines)
