"""τ²-Bench's `calculate` tool (retail, airline) cannot stall the env or the reward service.

Found by a bad-input pass over the env service: `calculate` checks only the expression's
characters and `eval`s it, so ``9**9**9`` (a 370-million-digit power) kept the env server
computing, GIL held, for many minutes; meanwhile every other session stalled (``9**10**7`` held a
`get_users` step of another session for 5.7 s), and the reward service, which replays the
trajectory's tool calls, would stall the same way scoring it. `tau2_adapter.guards` refuses such
an expression at once with a tool error, in both services alike; every other expression, and the
tool's schema, stay τ²-Bench's own.

Real env and reward services as processes over loopback gRPC (retail with a scripted user:
litellm's `mock_response`, no model server).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_guard_keeps_tau2s_answers_and_schema_and_refuses_huge_powers():
    from tau2.domains.airline.environment import get_environment as airline
    from tau2.domains.retail.environment import get_environment as retail

    from tau2_adapter import guards

    before = {name: [t.openai_schema for t in make().get_tools()] for name, make in (("retail", retail), ("airline", airline))}
    answers = {}
    small = ["2+2", "2**3", "(2)**(3)**(2)", "2.5*4", "2**-3", "(9**100)**100", "1/3", "2.0**100", "((1+2)*3)/4"]
    for e in small:
        try:
            answers[e] = retail().tools.use_tool("calculate", expression=e)
        except Exception as err:  # noqa: BLE001 - τ²-Bench's own error, compared below
            answers[e] = f"{type(err).__name__}: {err}"
    guards.install()
    guards.install()  # idempotent
    assert {name: [t.openai_schema for t in make().get_tools()] for name, make in (("retail", retail), ("airline", airline))} == before
    for make in (retail, airline):
        tools = make().tools
        for e in small:
            try:
                got = tools.use_tool("calculate", expression=e)
            except Exception as err:  # noqa: BLE001
                got = f"{type(err).__name__}: {err}"
            assert got == answers[e], e
        for bomb in ("9**9**9", "9**10**7", "((9**100)**100)**100", "2**(2**40)", "(10**5)**(10**5)", "7*2**200000"):
            t0 = time.monotonic()
            with pytest.raises(ValueError, match="would grow past 100000 bits"):
                tools.use_tool("calculate", expression=bomb)
            assert time.monotonic() - t0 < 0.5, bomb


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)
def test_a_calculate_bomb_neither_stalls_other_sessions_nor_the_reward_service(tmp_path):
    from env_service.client import GrpcEnvClient
    from reward_service.client import GrpcRewardClient
    from sinkflex.api.common.v1 import common_pb2
    from sinkflex.api.env.v1 import env_pb2
    from sinkflex.api.reward.v1 import reward_pb2
    from sinkflex.serving import wait_for_serving

    cfg = tmp_path / "env.yaml"
    cfg.write_text("domains: [retail, mock]\nuser_model: openai/scripted-user\nuser_base_url: null\n"
                   "user_llm_extra_args: {mock_response: 'Hi, I need help with an order of mine.'}\n")
    env_port, reward_port = _free_port(), _free_port()
    environ = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    procs = [subprocess.Popen([sys.executable, "-m", "env_service", "--config", str(cfg), "--port", str(env_port),
                               "--no-metrics", "--log-level", "WARNING"], cwd=ROOT, env=environ),
             subprocess.Popen([sys.executable, "-m", "reward_service", "--port", str(reward_port), "--no-metrics",
                               "--preload-env", "retail"], cwd=ROOT, env=environ,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        env = GrpcEnvClient(f"127.0.0.1:{env_port}", timeout=120)
        reward = GrpcRewardClient(f"127.0.0.1:{reward_port}")
        wait_for_serving(env.channel, "", timeout=180)
        wait_for_serving(reward.channel, "", timeout=180)
        task_id = env.list_tasks("retail")[0]
        retail = env.reset(env_pb2.ResetRequest(env="retail", task_id=task_id))
        mock = env.reset(env_pb2.ResetRequest(env="mock", task_id="create_task_1", solo_mode=True))

        def action(name: str, args: dict, call_id: str = "c1") -> common_pb2.Message:
            return common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[
                common_pb2.ToolCall(id=call_id, name=name, arguments_json=json.dumps(args))])

        bomb = action("calculate", {"expression": "9**9**9"})
        result: dict = {}

        def send_bomb():
            t0 = time.monotonic()
            result["resp"] = env.step(env_pb2.StepRequest(session_id=retail.session_id, action=bomb))
            result["seconds"] = time.monotonic() - t0

        thread = threading.Thread(target=send_bomb)
        thread.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        other = env.step(env_pb2.StepRequest(session_id=mock.session_id, action=action("get_users", {})))
        other_s = time.monotonic() - t0
        thread.join(timeout=120)
        assert not thread.is_alive() and result["seconds"] < 10, result
        assert other_s < 5 and other.observation[0].tool_call_id == "c1" and not other.observation[0].error
        answer = result["resp"].observation[0]
        assert answer.tool_call_id == "c1" and answer.error and "would grow past 100000 bits" in answer.content
        assert not result["resp"].terminated  # a tool error: the episode goes on
        ok = action("calculate", {"expression": "(2+3)*4"}, "c2")
        resp = env.step(env_pb2.StepRequest(session_id=retail.session_id, action=ok))
        assert resp.observation[0].content == "20.0", resp.observation[0]
        stop = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="###STOP###")
        messages = [*retail.observation, bomb, *result["resp"].observation, ok, *resp.observation, stop]
        t0 = time.monotonic()
        breakdown = reward.score(reward_pb2.ScoreRequest(env="retail", task_id=task_id, messages=messages,
                                                         termination_reason=common_pb2.TERMINATION_REASON_AGENT_STOP))
        assert time.monotonic() - t0 < 60
        # the replay got the same answers as the env gave: scored (0: nothing the task asks was done), not unscored
        assert breakdown.reward == 0.0 and not breakdown.info.startswith("unscored"), breakdown
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
