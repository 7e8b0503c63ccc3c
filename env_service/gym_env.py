"""Gymnasium environments over the EnvService contract.

`Tau2Env` (registered as "SinkFlex/Tau2-v0") runs tau2 in-process through
`LocalEnvClient`; `RemoteTau2Env` (registered as "SinkFlex/RemoteTau2-v0") speaks gRPC
to any env server at `address=`. Both are the same class over an `EnvClient`.

Observations and actions are structured (unlike tau2's own `AgentGymEnv`, which flattens
messages to "role: content" strings and parses actions from strings):

- observation: a list of message dicts, the messages since the last action,
  `{"role": "user"|"assistant"|"tool"|"system", "content": str|None,
    "tool_calls": [{"id", "name", "arguments": str (JSON), "requestor"}],
    "tool_call_id": str, "error": bool, "requestor": str}` (`message_to_dict`).
- action: a dict `{"content": str|None, "tool_calls": [{"id", "name", "arguments":
  dict | str}], "stop": bool}` (any key may be omitted), or a `common_pb2.Message`.
  Tool calls run in order; content alone is a reply to the user; `stop` ends the episode.
- info (reset): session_id, task_id, tools (OpenAI-style function specs), system_prompt,
  policy, and the server's info map; (step): the server's info map (reward_info,
  termination_reason, ...).
- reward: the server's (tau2's evaluator on termination when the server computes it), else 0.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import gymnasium as gym

from env_service.client import EnvClient, GrpcEnvClient, LocalEnvClient
from env_service.config import EnvServiceConfig
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2

_ROLE = {common_pb2.ROLE_SYSTEM: "system", common_pb2.ROLE_USER: "user", common_pb2.ROLE_ASSISTANT: "assistant",
         common_pb2.ROLE_TOOL: "tool", common_pb2.ROLE_UNSPECIFIED: ""}
_LOCAL_CORES: dict[str, Any] = {}  # one in-process core per config (loading the domains takes seconds)


def message_to_dict(m: common_pb2.Message) -> dict:
    """A wire message as a plain dict (see the module docstring)."""
    return {
        "role": _ROLE[m.role],
        "content": m.content if m.HasField("content") else None,
        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments_json, "requestor": _ROLE[c.requestor]}
                       for c in m.tool_calls],
        "tool_call_id": m.tool_call_id,
        "error": m.error,
        "requestor": _ROLE[m.requestor],
    }


def action_to_message(action: dict | common_pb2.Message) -> tuple[common_pb2.Message, bool]:
    """(assistant message, stop) of a Gym action. Raises ValueError for a malformed action."""
    if isinstance(action, common_pb2.Message):
        return action, False
    if not isinstance(action, dict):
        raise ValueError(f"action must be a dict or a common_pb2.Message, got {type(action).__name__}")
    unknown = set(action) - {"content", "tool_calls", "stop"}
    if unknown:
        raise ValueError(f"unknown action keys {sorted(unknown)}; expected content, tool_calls, stop")
    msg = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT)
    if action.get("content") is not None:
        msg.content = str(action["content"])
    for i, call in enumerate(action.get("tool_calls") or []):
        args = call.get("arguments", {})
        msg.tool_calls.append(common_pb2.ToolCall(
            id=str(call.get("id", "")), name=str(call["name"]),
            arguments_json=args if isinstance(args, str) else json.dumps(args),
            requestor=common_pb2.ROLE_ASSISTANT,
        ))
    return msg, bool(action.get("stop", False))


class MessagesSpace(gym.spaces.Space):
    """A list of message dicts (observations); `contains` checks the keys and roles."""

    def __init__(self):
        super().__init__(shape=None, dtype=None)

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool") for m in x)

    def sample(self, mask=None, probability=None):
        return [{"role": "user", "content": "hello", "tool_calls": [], "tool_call_id": "", "error": False, "requestor": ""}]


class ActionSpace(gym.spaces.Space):
    """An assistant action: dict with content / tool_calls / stop, or a common_pb2.Message."""

    def __init__(self):
        super().__init__(shape=None, dtype=None)

    def contains(self, x: Any) -> bool:
        try:
            action_to_message(x)
            return True
        except (ValueError, KeyError, TypeError):
            return False

    def sample(self, mask=None, probability=None):
        return {"stop": True}


class Tau2Env(gym.Env):
    """A tau2 task as a Gymnasium env, over any `EnvClient` (in-process by default).

    Args:
        env: domain name (retail, airline, telecom, mock, or an external server's env).
        task_id: fixed task; None: reset samples from `split` with the reset seed (or
            `options={"task_id": ...}` picks one).
        split: task split to sample from ("" = all tasks).
        solo_mode: agent alone (mock, telecom).
        max_steps: tau2 step budget (0: server default).
        config: EnvServiceConfig of the in-process core (ignored with `client`).
        client: an EnvClient to use instead.
    """

    metadata = {"render_modes": []}

    def __init__(self, env: str = "retail", task_id: Optional[str] = None, split: str = "", solo_mode: bool = False,
                 max_steps: int = 0, config: EnvServiceConfig | None = None, client: EnvClient | None = None):
        self.env_name = env
        self.task_id = task_id
        self.split = split
        self.solo_mode = solo_mode
        self.max_steps = max_steps
        if client is None:
            config = config or EnvServiceConfig()
            key = config.model_dump_json()
            if key not in _LOCAL_CORES:
                _LOCAL_CORES[key] = LocalEnvClient(config).core
            client = LocalEnvClient(core=_LOCAL_CORES[key])
        self.client = client
        self.session_id: Optional[str] = None
        self.observation_space = MessagesSpace()
        self.action_space = ActionSpace()

    def reset(self, *, seed: Optional[int] = None, options: Optional[dict] = None):
        super().reset(seed=seed)
        self._close_session()
        options = options or {}
        req = env_pb2.ResetRequest(
            env=self.env_name,
            task_id=options.get("task_id", self.task_id) or "",
            split=options.get("split", self.split),
            seed=seed if seed is not None else int(self.np_random.integers(0, 2**31 - 1)),
            solo_mode=options.get("solo_mode", self.solo_mode),
            max_steps=options.get("max_steps", self.max_steps),
        )
        resp = self.client.reset(req)
        self.session_id = resp.session_id
        info = {
            "session_id": resp.session_id,
            "task_id": resp.task_id,
            "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                        "parameters": json.loads(t.parameters_json_schema or "{}")}}
                      for t in resp.tools],
            "system_prompt": resp.system_prompt,
            "policy": resp.policy,
            **dict(resp.info),
        }
        return [message_to_dict(m) for m in resp.observation], info

    def step(self, action):
        if self.session_id is None:
            raise RuntimeError("call reset() before step()")
        message, stop = action_to_message(action)
        resp = self.client.step(env_pb2.StepRequest(session_id=self.session_id, action=message, stop=stop))
        info = dict(resp.info)
        info["termination_reason"] = common_pb2.TerminationReason.Name(resp.termination_reason)
        return [message_to_dict(m) for m in resp.observation], float(resp.reward), resp.terminated, resp.truncated, info

    def _close_session(self) -> None:
        if self.session_id is not None:
            from sinkflex.errors import ServiceError

            try:
                self.client.close(self.session_id)
            except ServiceError:  # already expired or closed
                pass
            self.session_id = None

    def close(self):
        self._close_session()
        super().close()


class RemoteTau2Env(Tau2Env):
    """`Tau2Env` over gRPC to the env server at `address` ("host:port"); `close()` also
    closes the channel."""

    def __init__(self, address: str, env: str = "retail", timeout: float = 300.0, **kwargs):
        super().__init__(env=env, client=GrpcEnvClient(address, timeout=timeout), **kwargs)

    def close(self):
        super().close()
        self.client.shutdown()
