"""A conformance suite for any EnvService server (`sinkflex-rl env check ADDRESS`).

Each check calls the server over gRPC and returns PASS or FAIL with what it saw. The
suite needs one task the server can run without an outside LLM: it picks the first task
of the first environment (solo mode where the environment supports it) unless told which.
Checks: health SERVING, ListEnvironments, ListTasks (all and per split), NOT_FOUND for an
unknown env / task / session, Reset's observation and tool specs (JSON Schema objects),
an unknown tool and malformed tool-call JSON answered as tool errors with the episode
going on, stop -> terminated with AGENT_STOP, a step after termination ->
FAILED_PRECONDITION, sessions isolated, Close and NOT_FOUND after it, an oversized
message -> RESOURCE_EXHAUSTED with the server still serving.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Optional

import grpc

from env_service.client import GrpcEnvClient
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
from sinkflex.errors import ServiceError
from sinkflex.serving import DEFAULT_MAX_MESSAGE_BYTES


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str = ""


class _Failed(Exception):
    pass


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise _Failed(what)


def _expect_code(fn: Callable[[], object], code: grpc.StatusCode) -> str:
    try:
        fn()
    except ServiceError as err:
        _expect(err.code == code, f"expected {code.name}, got {err.code.name}: {err.message}")
        return f"{err.code.name}: {err.message}"
    raise _Failed(f"expected {code.name}, the call succeeded")


def _tool_call(name: str, args: str, call_id: str) -> common_pb2.Message:
    return common_pb2.Message(role=common_pb2.ROLE_ASSISTANT,
                              tool_calls=[common_pb2.ToolCall(id=call_id, name=name, arguments_json=args)])


def run_checks(address: str, env: Optional[str] = None, task_id: Optional[str] = None, solo: Optional[bool] = None,
               timeout: float = 120.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[CheckResult]:
    """Runs the suite against `address`; returns one result per check, in order."""
    from sinkflex.serving import wait_for_serving

    results: list[CheckResult] = []
    state: dict = {}
    client = GrpcEnvClient(address, timeout=timeout, max_message_bytes=4 * max_message_bytes)

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
        wait_for_serving(client.channel, "", timeout=timeout)
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
        out.append(_expect_code(lambda: client.step(env_pb2.StepRequest(session_id="no-such-session-xyz", stop=True)),
                                grpc.StatusCode.NOT_FOUND))
        out.append(_expect_code(lambda: client.close("no-such-session-xyz"), grpc.StatusCode.NOT_FOUND))
        return f"{len(out)} calls refused"

    def reset() -> env_pb2.ResetResponse:
        _expect("task_id" in state, "no task to run")
        use_solo = solo if solo is not None else state["envs"][state["env"]].supports_solo
        return client.reset(env_pb2.ResetRequest(env=state["env"], task_id=state["task_id"], solo_mode=use_solo, seed=1))

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

    @check("RESOURCE_EXHAUSTED: oversized message, server keeps serving")
    def _():
        big = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="x" * (max_message_bytes + 1024))
        d = _expect_code(lambda: client.step(env_pb2.StepRequest(session_id="oversized", action=big)),
                         grpc.StatusCode.RESOURCE_EXHAUSTED)
        _expect(len(client.list_environments()) > 0, "server stopped answering")
        return d[:120]

    client.shutdown()
    return results


def format_results(results: list[CheckResult]) -> str:
    lines = [f"{'PASS' if r.passed else 'FAIL'}  {r.name}" + (f"  -- {r.detail}" if r.detail else "") for r in results]
    passed = sum(r.passed for r in results)
    lines.append(f"{passed}/{len(results)} checks passed")
    return "\n".join(lines)
