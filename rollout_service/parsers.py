"""Tool-call parsers: the model's text (or tokens) -> an assistant action for the env.

Two formats:
- Hermes / ChatML (SmolLM2, Qwen, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the reply, any number of them; the text outside the blocks is the
  reply's content.
- harmony (gpt-oss): parsed from the generated token ids with `openai_harmony`
  (`parse_messages_from_completion_tokens`); a message with recipient ``functions.NAME``
  is a tool call, ``final`` channel text is the reply, ``analysis`` is reasoning (dropped).

Arguments are kept exactly as the model wrote them: `ToolCall.arguments_json` is the
original JSON text of the arguments object (nested objects, key order, spacing preserved),
never re-serialised. Malformed output is not an exception: `ParsedTurn.parse_error` says
what was wrong and the whole raw text becomes the content, so that the environment sees
what the model wrote and the episode continues (the agent loop counts these).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    """One tool call as written by the model."""

    name: str
    arguments_json: str  # the arguments object exactly as written (JSON text)


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn, parsed.

    `content` is the natural-language text (None if there is none); on a parse error it is
    the whole raw reply and `calls` holds the calls that did parse (possibly none).
    """

    content: str | None
    calls: tuple[ParsedCall, ...] = ()
    parse_error: str = ""  # empty: parsed cleanly
    raw: str = ""

    @property
    def ok(self) -> bool:
        return not self.parse_error


def _raw_arguments(body: str, obj: dict) -> str:
    """Returns the exact JSON text of the ``arguments`` value inside `body` (a JSON object
    text already decoded into `obj`), found by raw-decoding at the value's offset."""
    decoder = json.JSONDecoder()
    for m in re.finditer(r'"(?:arguments|parameters)"\s*:\s*', body):
        start = m.end()
        try:
            value, end = decoder.raw_decode(body, start)
        except json.JSONDecodeError:
            continue
        if value == obj.get("arguments", obj.get("parameters")):
            return body[start:end]
    return json.dumps(obj.get("arguments", obj.get("parameters", {})), ensure_ascii=False)


def parse_hermes(text: str) -> ParsedTurn:
    """Parses a Hermes/ChatML reply: ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` blocks.

    Returns:
        ParsedTurn with one ParsedCall per well-formed block, in order. A block that is not
        closed, not a JSON object, lacks a string "name", or whose arguments are not an
        object makes `parse_error` non-empty and `content` the raw text (the env then sees
        what the model wrote). Without any block the reply is plain content.
    """
    blocks = list(_TOOL_CALL_RE.finditer(text))
    if not blocks:
        return ParsedTurn(content=text, raw=text)
    calls: list[ParsedCall] = []
    errors: list[str] = []
    decoder = json.JSONDecoder()
    for i, m in enumerate(blocks):
        body = m.group(1).strip()
        if not m.group(2):
            errors.append(f"tool call {i}: missing </tool_call>")
            continue
        try:
            obj, end = decoder.raw_decode(body)
        except json.JSONDecodeError as err:
            errors.append(f"tool call {i}: invalid JSON ({err.msg} at {err.pos})")
            continue
        if body[end:].strip():
            errors.append(f"tool call {i}: text after the JSON object")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            errors.append(f"tool call {i}: expected an object with a string \"name\"")
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                if isinstance(json.loads(args), dict):
                    calls.append(ParsedCall(obj["name"], args))
                    continue
            except json.JSONDecodeError:
                pass
            errors.append(f"tool call {i}: arguments are not a JSON object")
            continue
        if not isinstance(args, dict):
            errors.append(f"tool call {i}: arguments are not a JSON object")
            continue
        calls.append(ParsedCall(obj["name"], _raw_arguments(body, obj)))
    if errors:
        return ParsedTurn(content=text, calls=tuple(calls), parse_error="; ".join(errors), raw=text)
    outside = _TOOL_CALL_RE.sub("", text).strip()
    return ParsedTurn(content=outside or None, calls=tuple(calls), raw=text)


@lru_cache(maxsize=1)
def harmony_encoding():
    """The gpt-oss harmony encoding (`openai_harmony`, o200k_harmony vocabulary, offline)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def parse_harmony(token_ids: list[int]) -> ParsedTurn:
    """Parses generated gpt-oss tokens (harmony format) into content and tool calls.

    Args:
        token_ids: the completion tokens after ``<|start|>assistant`` (as generated; may end
            with ``<|call|>``, ``<|return|>`` or ``<|end|>``, or be cut off).

    Returns:
        ParsedTurn: calls from messages addressed ``functions.NAME`` (arguments text kept
        exactly), content from the ``final`` channel (or any non-analysis text); a
        token stream harmony cannot parse gives `parse_error` and the decoded raw text.
    """
    from openai_harmony import Role

    enc = harmony_encoding()
    raw = enc.decode(token_ids)
    try:
        messages = enc.parse_messages_from_completion_tokens(token_ids, Role.ASSISTANT)
    except Exception as err:  # noqa: BLE001 - openai_harmony raises a bare HarmonyError
        return ParsedTurn(content=raw, parse_error=f"harmony: {err}", raw=raw)
    calls: list[ParsedCall] = []
    finals: list[str] = []
    others: list[str] = []
    errors: list[str] = []
    for msg in messages:
        text = "".join(getattr(c, "text", "") for c in msg.content)
        recipient = msg.recipient or ""
        if recipient.startswith("functions."):
            try:
                ok = isinstance(json.loads(text), dict)
            except json.JSONDecodeError:
                ok = False
            if ok:
                calls.append(ParsedCall(recipient[len("functions."):], text))
            else:
                errors.append(f"call to {recipient}: arguments are not a JSON object")
        elif msg.channel == "final":
            finals.append(text)
        elif msg.channel != "analysis":
            others.append(text)
    if errors:
        return ParsedTurn(content=raw, calls=tuple(calls), parse_error="; ".join(errors), raw=raw)
    content = "".join(finals) or "".join(others) or None
    return ParsedTurn(content=content, calls=tuple(calls), raw=raw)


@dataclass
class ParseStats:
    """Counts of parsed turns (per episode; summed into metrics)."""

    turns: int = 0
    tool_calls: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, parsed: ParsedTurn) -> None:
        self.turns += 1
        self.tool_calls += len(parsed.calls)
        if parsed.parse_error:
            self.failures += 1
            self.errors.append(parsed.parse_error)
