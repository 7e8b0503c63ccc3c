"""Conversion between the wire messages (`common_pb2.Message`) and tau2's messages.

This is the one place where SinkFlex's structured messages meet tau2's pydantic messages
(`tau2.data_model.message`). The env service uses it to put tau2's trajectory on the
wire, and the reward service uses it to rebuild the tau2 trajectory that tau2's
evaluator scores (`tau2.evaluator.evaluator.evaluate_simulation`), so the two must agree
exactly: a round trip `to_tau2_message(from_tau2_message(m)) == m` holds for every
system, user, assistant and tool message (tau2's `__eq__`: role, content, tool calls
with id/name/arguments/requestor, tool id/requestor/error).

Mapping:

| tau2                                   | wire (`common_pb2`)                                  |
| -------------------------------------- | ---------------------------------------------------- |
| `SystemMessage(content)`               | `Message(role=ROLE_SYSTEM, content)`                 |
| `UserMessage(content, tool_calls)`     | `Message(role=ROLE_USER, content, tool_calls)`       |
| `AssistantMessage(content, tool_calls)`| `Message(role=ROLE_ASSISTANT, content, tool_calls)`  |
| `ToolMessage(id, content, requestor, error)` | `Message(role=ROLE_TOOL, tool_call_id, content, requestor, error)` |
| `MultiToolMessage(tool_messages)`      | one `ROLE_TOOL` message per tool message, in order   |
| `ToolCall(id, name, arguments, requestor)` | `ToolCall(id, name, arguments_json, requestor)`  |

`content=None` <-> `content` unset (proto3 `optional`). `tool_calls=None` <-> no
tool calls. Timestamps, costs, usage and turn indices are not carried (tau2's
evaluator does not read them).

Arguments that are not a JSON object (malformed JSON, a list, a number) are
kept, not rejected: they become tau2 arguments `{RAW_ARGUMENTS_KEY: "<the text>"}`. So do
JSON objects that Python cannot carry through tau2 and back onto the wire: nested deeper
than `MAX_ARGUMENT_DEPTH` (json and tau2 recurse), an integer literal of more digits than
Python's int-string limit (4300), a lone surrogate (`"\\ud800"`) in a key or a string.
Calling a tau2 tool with that keyword fails with tau2's own error message ("...got an
unexpected keyword argument 'arguments_not_a_json_object'"), so the
env service answers such a call with a tool error observation (the episode goes on,
as in tau2) and tau2's evaluator, replaying the trajectory, gets the same error and the
same DB. `from_tau2_message` turns that form back into the original text.
"""

from __future__ import annotations

import json
from typing import Iterable, Sequence

from sinkflex.api.common.v1 import common_pb2

from tau2.data_model.message import (
    AssistantMessage,
    MultiToolMessage,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)

#: tau2 argument key that carries tool-call arguments that are not a JSON object.
RAW_ARGUMENTS_KEY = "arguments_not_a_json_object"

#: Deepest nesting of objects/arrays kept as parsed tool-call arguments; deeper: raw text.
MAX_ARGUMENT_DEPTH = 64

#: A tau2 message (tau2.data_model.message.Message without MultiToolMessage).
Tau2Message = SystemMessage | UserMessage | AssistantMessage | ToolMessage

_ROLE_TO_PB = {
    "system": common_pb2.ROLE_SYSTEM,
    "user": common_pb2.ROLE_USER,
    "assistant": common_pb2.ROLE_ASSISTANT,
    "tool": common_pb2.ROLE_TOOL,
}
_PB_TO_ROLE = {v: k for k, v in _ROLE_TO_PB.items()}


def role_label(role: int) -> str:
    """The enum name of a `common_pb2.Role` value, or "unknown role value N" (never raises)."""
    try:
        return common_pb2.Role.Name(role)
    except ValueError:
        return f"unknown role value {role}"


def role_name(role: int) -> str:
    """tau2 role string ("system", "user", "assistant", "tool") of a `common_pb2.Role`.

    Raises:
        ValueError: ROLE_UNSPECIFIED or an unknown value.
    """
    try:
        return _PB_TO_ROLE[role]
    except KeyError:
        raise ValueError(f"message role {role_label(role)} is not a valid role") from None


def parse_arguments(arguments_json: str) -> dict:
    """tau2 `ToolCall.arguments` for a wire `arguments_json` string.

    A JSON object is returned as a dict; anything else (malformed JSON, "", a list, a
    number, an object too deep or holding what Python cannot carry: see the module
    docstring) as `{RAW_ARGUMENTS_KEY: arguments_json}`.
    """
    if _too_deep(arguments_json):
        return {RAW_ARGUMENTS_KEY: arguments_json}
    try:
        value = json.loads(arguments_json)
    except (ValueError, TypeError, RecursionError):  # JSONDecodeError, int-digit limit, ...
        return {RAW_ARGUMENTS_KEY: arguments_json}
    if not isinstance(value, dict) or not _encodable(value):
        return {RAW_ARGUMENTS_KEY: arguments_json}
    return value


def _too_deep(text: str, limit: int = MAX_ARGUMENT_DEPTH) -> bool:
    """Whether the brackets of JSON `text` (outside strings) nest deeper than `limit`."""
    if text.count("{") + text.count("[") <= limit:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
            if depth > limit:
                return True
        elif ch in "}]":
            depth -= 1
    return False


def _encodable(value) -> bool:
    """Whether every key and string in a parsed JSON value is valid UTF-8 text (no lone
    surrogate): what a protobuf string field and tau2's messages can hold."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return False
    return True


def format_arguments(arguments: dict) -> str:
    """Wire `arguments_json` for tau2 `ToolCall.arguments` (inverse of `parse_arguments`)."""
    if set(arguments) == {RAW_ARGUMENTS_KEY} and isinstance(arguments[RAW_ARGUMENTS_KEY], str):
        return arguments[RAW_ARGUMENTS_KEY]
    return json.dumps(arguments, ensure_ascii=False)


def _requestor(role: int, default: str) -> str:
    if role == common_pb2.ROLE_UNSPECIFIED:
        return default
    name = role_name(role)
    if name not in ("user", "assistant"):
        raise ValueError(f"requestor must be ROLE_USER or ROLE_ASSISTANT, got {role_label(role)}")
    return name


def to_tau2_tool_call(call: common_pb2.ToolCall, default_requestor: str = "assistant") -> ToolCall:
    """tau2 `ToolCall` of a wire tool call. An unset requestor means `default_requestor`."""
    return ToolCall(
        id=call.id,
        name=call.name,
        arguments=parse_arguments(call.arguments_json),
        requestor=_requestor(call.requestor, default_requestor),
    )


def from_tau2_tool_call(call: ToolCall) -> common_pb2.ToolCall:
    """Wire tool call of a tau2 `ToolCall` (requestor always set)."""
    return common_pb2.ToolCall(
        id=call.id,
        name=call.name,
        arguments_json=format_arguments(call.arguments),
        requestor=_ROLE_TO_PB[call.requestor],
    )


def to_tau2_message(message: common_pb2.Message) -> Tau2Message:
    """tau2 message of a wire message.

    Tool calls of a user/assistant message default to that role as requestor; a tool
    message's unset requestor means "assistant".

    Raises:
        ValueError: unspecified role, or a requestor that is not user/assistant.
    """
    role = role_name(message.role)
    content = message.content if message.HasField("content") else None
    if role == "system":
        return SystemMessage(role="system", content=content)
    if role == "tool":
        return ToolMessage(
            id=message.tool_call_id,
            role="tool",
            content=content,
            requestor=_requestor(message.requestor, "assistant"),
            error=message.error,
        )
    tool_calls = [to_tau2_tool_call(c, default_requestor=role) for c in message.tool_calls] or None
    cls = UserMessage if role == "user" else AssistantMessage
    return cls(role=role, content=content, tool_calls=tool_calls)


def from_tau2_message(message: Tau2Message) -> common_pb2.Message:
    """Wire message of a tau2 message.

    Raises:
        ValueError: a `MultiToolMessage` (use `from_tau2_messages`, which expands it).
    """
    if isinstance(message, MultiToolMessage):
        raise ValueError("a MultiToolMessage holds several messages: use from_tau2_messages")
    out = common_pb2.Message(role=_ROLE_TO_PB[message.role])
    if message.content is not None:
        out.content = message.content
    if isinstance(message, ToolMessage):
        out.tool_call_id = message.id
        out.error = message.error
        out.requestor = _ROLE_TO_PB[message.requestor]
    elif isinstance(message, (UserMessage, AssistantMessage)) and message.tool_calls:
        out.tool_calls.extend(from_tau2_tool_call(c) for c in message.tool_calls)
    return out


def to_tau2_messages(messages: Iterable[common_pb2.Message], include_system: bool = True) -> list[Tau2Message]:
    """tau2 messages of wire messages, in order (system messages dropped unless `include_system`)."""
    out = []
    for m in messages:
        if m.role == common_pb2.ROLE_SYSTEM and not include_system:
            continue
        out.append(to_tau2_message(m))
    return out


def from_tau2_messages(messages: Sequence[Tau2Message | MultiToolMessage]) -> list[common_pb2.Message]:
    """Wire messages of tau2 messages, in order; a `MultiToolMessage` expands to its tool messages."""
    out = []
    for m in messages:
        if isinstance(m, MultiToolMessage):
            out.extend(from_tau2_message(t) for t in m.tool_messages)
        else:
            out.append(from_tau2_message(m))
    return out
