"""A published policy version served by vLLM's own OpenAI server (`vllm serve`, CPU) gets the prompt
it was trained on, and τ²-Bench's own `tau2 run` runs against it (docs/eval.md).

- the server's /tokenize of an OpenAI conversation with tools (what any client sends) equals, token
  for token, what the rollout service renders for the same episode (`ChatTemplateFormatter`);
- a chat completion with tools goes through vLLM's Hermes tool parser;
- `tau2 run` (τ²-Bench's agent and user simulator, both the served policy; one mock task, one
  trial, a few steps) on the server writes its results file, which τ²-Bench's loader reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SERVED = "policy"


@pytest.fixture(scope="module")
def served_policy(trained_run, tmp_path_factory):
    """`vllm serve` of the run's policy version v2 with the Hermes tool parser; yields its base URL."""
    from sinkflex_rl.launcher import free_port

    policy = trained_run / "learner" / "policy" / "v2"
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(policy),
             "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "4096",
             "--kv-cache-memory-bytes", str(512 << 20), "--enforce-eager", "--disable-log-stats", "--seed", "0"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"vllm serve not ready:\n{log.read_text()[-4000:]}"
            try:
                if requests.get(f"{base}/v1/models", timeout=5).ok:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _mock_episode():
    """A mock-domain episode (solo mode): the system prompt, τ²-Bench's tools, a tool call and its reply."""
    from tau2.registry import registry

    from sinkflex.api.common.v1 import common_pb2

    env = registry.get_env_constructor("mock")(solo_mode=True)
    tools = [t.openai_schema for t in env.get_tools()]
    specs = [common_pb2.ToolSpec(name=t["function"]["name"], description=t["function"]["description"],
                                 parameters_json_schema=json.dumps(t["function"]["parameters"])) for t in tools]
    call = {"user_id": "user_1", "title": "Ünïcode"}
    return env.policy, tools, specs, call


def test_served_prompt_is_the_trained_prompt(served_policy, trained_run):
    from transformers import AutoTokenizer

    from rollout_service.formatting import ChatTemplateFormatter
    from sinkflex.api.common.v1 import common_pb2

    policy, tools, specs, args = _mock_episode()
    tok = AutoTokenizer.from_pretrained(trained_run / "learner" / "policy" / "v2")
    fmt = ChatTemplateFormatter(tok)
    user = common_pb2.Message(role=common_pb2.ROLE_USER, content="Create a task called Ünïcode for user_1.")
    ids = fmt.initial_prompt(policy, specs, [user])
    text = f'<tool_call>\n{{"name": "create_task", "arguments": {json.dumps(args)}}}\n</tool_call>'
    ids += tok.encode(text + "<|im_end|>", add_special_tokens=False)
    reply = '{"task_id": "task_1", "title": "\\u00dcn\\u00efcode"}'
    ids += fmt.suffix([common_pb2.Message(role=common_pb2.ROLE_TOOL, content=reply, tool_call_id="call_0")], ended_turn=True)
    chat = [{"role": "system", "content": policy}, {"role": "user", "content": user.content},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "create_task", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": reply}]
    r = requests.post(f"{served_policy}/tokenize", json={"model": SERVED, "messages": chat, "tools": tools,
                                                         "add_generation_prompt": True}, timeout=60)
    assert r.ok, r.text
    served = r.json()["tokens"]
    assert tok.decode(served) == tok.decode(ids)
    assert served == ids
    # a completion with tools goes through vLLM's Hermes tool parser (whatever the untrained policy writes)
    r = requests.post(f"{served_policy}/v1/chat/completions", json={
        "model": SERVED, "messages": chat[:2], "tools": tools, "max_tokens": 32, "temperature": 0.0}, timeout=300)
    assert r.ok, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_tau2_run_against_the_served_policy(served_policy, tmp_path):
    """τ²-Bench's own orchestrator, agent (`llm_agent`) and user simulator (`user_simulator`), both
    LLMs the served policy (offline: no other model), on one dual-control mock task. (τ²-Bench's
    solo agent, `llm_agent_solo`, raises on the first reply that is not a tool call, which an
    untrained policy writes.)"""
    from tau2.data_model.simulation import Results

    llm = json.dumps({"api_base": f"{served_policy}/v1", "temperature": 0.0, "max_tokens": 48})
    done = subprocess.run(
        [sys.executable, "-c", "from tau2.cli import main; main()", "run", "--domain", "mock",
         "--agent", "llm_agent", "--agent-llm", f"openai/{SERVED}", "--agent-llm-args", llm, "--agent-api-key", "EMPTY",
         "--user", "user_simulator", "--user-llm", f"openai/{SERVED}", "--user-llm-args", llm, "--user-api-key", "EMPTY",
         "--task-ids", "create_task_1", "--num-trials", "1", "--max-steps", "6", "--max-concurrency", "1",
         "--max-retries", "0", "--results-dir", str(tmp_path), "--save-to", "served"],
        capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = Results.load(tmp_path / "served.json")
    (sim,) = results.simulations
    assert sim.task_id == "create_task_1" and sim.reward_info is not None and 0.0 <= sim.reward_info.reward <= 1.0
    assert results.info.agent_info.llm == f"openai/{SERVED}"
    assert any(m.role == "assistant" for m in sim.messages) and any(m.role == "user" for m in sim.messages)
