"""sinkflex.chat_endpoint over real HTTP on loopback: litellm's client (what τ²-Bench's user
simulator calls) gets the reply; bad requests get bounded 4xx answers and the endpoint keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from sinkflex.chat_endpoint import MAX_MESSAGE_CHARS, ChatEndpoint, ChatReply


def _reply(body: dict) -> ChatReply:
    messages = body["messages"]
    if not isinstance(messages, list):
        raise TypeError("messages is not a list")
    if messages and messages[-1].get("content") == "boom":
        raise RuntimeError("engine failed")
    return ChatReply(text=f"{len(messages)} messages, last: {messages[-1]['content']}", finish_reason="stop",
                     prompt_tokens=7, completion_tokens=3)


@pytest.fixture
def endpoint():
    ep = ChatEndpoint(_reply, "echo", max_body_bytes=4096)
    yield ep
    ep.close()


def _post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_litellm_gets_the_reply(endpoint):
    import litellm

    out = litellm.completion(model="openai/echo", api_base=endpoint.base_url, api_key="none",
                             messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "2 messages, last: hi"
    assert out.choices[0].finish_reason == "stop"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (7, 3, 10)
    with urllib.request.urlopen(f"{endpoint.base_url}/models", timeout=10) as r:
        assert json.load(r)["data"][0]["id"] == "echo"
    with urllib.request.urlopen(f"http://{endpoint.host}:{endpoint.port}/health", timeout=10) as r:
        assert json.load(r) == {"status": "ok"}


def test_bad_requests_get_bounded_errors_and_the_endpoint_keeps_serving(endpoint):
    url = f"{endpoint.base_url}/chat/completions"
    cases = {
        b"not json": 400,
        b"[1, 2]": 400,  # JSON, not an object
        json.dumps({"messages": "x" * 3000}).encode(): 400,  # refused by reply: TypeError
        json.dumps({"no_messages": 1}).encode(): 400,  # KeyError
        json.dumps({"messages": [{"role": "user", "content": "boom"}]}).encode(): 500,
        json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode(): 413,  # over max_body_bytes
    }
    for data, code in cases.items():
        status, body = _post(url, data)
        assert status == code, (data[:40], status, body)
        assert 0 < len(body["error"]["message"]) <= MAX_MESSAGE_CHARS
    status, body = _post(url, b"{}", headers={"Content-Length": "12x"})
    assert status == 400 and "Content-Length" in body["error"]["message"]
    status, body = _post(f"{endpoint.base_url}/completions", b"{}")
    assert status == 404
    status, body = _post(url, json.dumps({"messages": [{"role": "user", "content": "still here"}]}).encode())
    assert status == 200 and body["choices"][0]["message"]["content"] == "1 messages, last: still here"
