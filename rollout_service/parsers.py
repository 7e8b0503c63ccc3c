"""Tool-call parsers: the model's text (or tokens) -> an assistant action for the env.

Formats:
- Hermes / ChatML (SmolLM2, Qwen, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the reply, any number of them; the text outside the blocks is the
  reply's content.
- Qwen3 with thinking (`split_reasoning`): the ``<think>…</think>`` reasoning is split off at
  the last ``</think>`` (`ParsedTurn.reasoning`, never content); the rest is parsed as Hermes.
  A reply that ends inside its reasoning has no content and no calls.
- Llama 3.x JSON (`parse_llama3_json`): a reply that is a bare JSON object (optionally after
  ``<|python_tag|>``) is parsed by vLLM's ``llama3_json`` tool parser (its arguments are
  ``json.dumps`` of the value, ``ensure_ascii=False``); any other reply is plain content.
- harmony (gpt-oss): parsed from the generated token ids with `openai_harmony`
  (`parse_messages_from_completion_tokens`); a message with recipient ``functions.NAME``
  is a tool call, ``final`` channel text is the reply, ``analysis`` is reasoning (dropped).

Arguments are kept exactly as the model wrote them: `ToolCall.arguments_json` is the
original JSON text of the arguments object (nested objects, key order, spacing, escapes and
non-ASCII characters preserved), never re-serialised. Malformed output is not an exception:
`ParsedTurn.parse_error` says what was wrong (bounded: `MAX_PARSE_ERROR_CHARS`) and the
whole raw text becomes the content, so that the environment sees what the model wrote and
the episode continues (the agent loop counts these).

Model output is untrusted input. Hermes blocks are delimited by the JSON they hold, not
by searching for the closing tag: a ``</tool_call>`` inside a JSON string argument (the
model quoting the format, a tool argument that contains markup) is text of the argument.
A block with complete JSON but no closing tag (the reply was cut at max_new_tokens) is a
parse error, not a call: a cut reply is not executed. Truncated JSON says "truncated".
tests/test_rollout_parsers.py round-trips arbitrary JSON arguments (hypothesis) through
each format's rendering (`formatting.hermes_call_text`, harmony's renderer) and parsing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache


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
    reasoning: str | None = None  # the reply's reasoning (qwen3 ``<think>``): kept out of content

    @property
    def ok(self) -> bool:
        return not self.parse_error


_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_WS = " \t\n\r"

#: Longest `ParsedTurn.parse_error` (the model can write any number of broken blocks).
MAX_PARSE_ERROR_CHARS = 600
#: Longest quote of the model's text inside one error.
_QUOTE_CHARS = 40


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _quote(text: str) -> str:
    """A short repr of model text for an error message."""
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


def _join_errors(errors: list[str]) -> str:
    """The errors joined with "; ", at most MAX_PARSE_ERROR_CHARS (the count of the rest said)."""
    out, used = [], 0
    for k, e in enumerate(errors):
        if used + len(e) + 2 > MAX_PARSE_ERROR_CHARS - 40:
            out.append(f"... and {len(errors) - k} more error(s)")
            break
        out.append(e)
        used += len(e) + 2
    return "; ".join(out)[:MAX_PARSE_ERROR_CHARS]


def _top_level_spans(text: str, start: int, end: int) -> dict[str, tuple[int, int]]:
    """Key -> (start, end) of each member value of the JSON object text[start:end] (already
    known to be one valid object), found by walking its top level with the decoder (a
    duplicate key: the last one, as json.loads keeps)."""
    decoder = json.JSONDecoder()
    spans: dict[str, tuple[int, int]] = {}
    i = _skip_ws(text, start + 1)  # after "{"
    while i < end and text[i] != "}":
        key, i = decoder.raw_decode(text, i)
        i = _skip_ws(text, i) + 1  # ":"
        i = _skip_ws(text, i)
        _, value_end = decoder.raw_decode(text, i)
        spans[key] = (i, value_end)
        i = _skip_ws(text, value_end)
        if i < end and text[i] == ",":
            i = _skip_ws(text, i + 1)
    return spans


def _call_of(text: str, start: int, end: int, obj) -> tuple[ParsedCall | None, str]:
    """The call of one decoded block object (text[start:end]), or None and why not."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, 'expected an object with a string "name"'
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return ParsedCall(obj["name"], "{}"), ""
    args = obj[key]
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            if isinstance(json.loads(args), dict):
                return ParsedCall(obj["name"], args), ""
        except json.JSONDecodeError:
            pass
        return None, "arguments are not a JSON object"
    if not isinstance(args, dict):
        return None, "arguments are not a JSON object"
    a, b = _top_level_spans(text, start, end)[key]
    return ParsedCall(obj["name"], text[a:b]), ""


def parse_hermes(text: str) -> ParsedTurn:
    """Parses a Hermes/ChatML reply: ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` blocks.

    A block's JSON object is decoded with `json.JSONDecoder.raw_decode` from the first
    non-space character after ``<tool_call>``, so the block ends where the object ends: a
    ``</tool_call>`` (or ``<tool_call>``) inside a JSON string argument is part of the
    argument, never the end of the call. After the object only whitespace and
    ``</tool_call>`` may follow. Where the JSON does not decode, the block is taken to end at
    the next ``</tool_call>`` (the only boundary left) and scanning goes on after it.

    Returns:
        ParsedTurn with one ParsedCall per well-formed block, in order; arguments are the
        exact text the model wrote (`arguments_json`: nesting, key order, spacing, escapes
        and non-ASCII characters as written). A block that is truncated (the JSON or the
        reply ends inside it), not closed, not a JSON object, lacks a string "name", has
        text between the object and ``</tool_call>``, or whose arguments are not an object
        makes `parse_error` non-empty (at most MAX_PARSE_ERROR_CHARS, one clause per bad
        block naming its index) and `content` the raw text (the env then sees what the
        model wrote); the calls that did parse are kept in `calls` (the agent executes none
        of them). Without any block the reply is plain content. Never raises.
    """
    if _OPEN not in text:
        return ParsedTurn(content=text, raw=text)
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    errors: list[str] = []
    outside: list[str] = []
    pos, i = 0, 0
    while True:
        open_at = text.find(_OPEN, pos)
        if open_at < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:open_at])
        start = _skip_ws(text, open_at + len(_OPEN))
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as err:
            close = text.find(_CLOSE, start)
            truncated = err.msg.startswith("Unterminated string") or _skip_ws(text, err.pos) >= len(text)
            if truncated:  # the JSON runs to the end of the reply (a string never closes, or no "}")
                errors.append(f"tool call {i}: truncated JSON (the reply ends inside the object: {err.msg})")
                close = -1
            elif close < 0:
                errors.append(f"tool call {i}: invalid JSON ({err.msg} at {err.pos - start}) and missing {_CLOSE}")
            else:
                errors.append(f"tool call {i}: invalid JSON ({err.msg} at {err.pos - start})")
            pos = len(text) if close < 0 else close + len(_CLOSE)
            i += 1
            continue
        except (ValueError, RecursionError) as err:  # an int of > 4300 digits; nesting deeper than the stack
            close = text.find(_CLOSE, start)
            errors.append(f"tool call {i}: JSON not decodable ({type(err).__name__}: {str(err)[:80]})")
            pos = len(text) if close < 0 else close + len(_CLOSE)
            i += 1
            continue
        after = _skip_ws(text, end)
        if text.startswith(_CLOSE, after):
            pos = after + len(_CLOSE)
            call, why = _call_of(text, start, end, obj)
            if call is not None:
                calls.append(call)
            else:
                errors.append(f"tool call {i}: {why}")
        elif after >= len(text):
            errors.append(f"tool call {i}: missing {_CLOSE} (the reply ends after the JSON object)")
            pos = len(text)
        else:
            close = text.find(_CLOSE, after)
            errors.append(f"tool call {i}: text after the JSON object ({_quote(text[after:close if close >= 0 else None])})"
                          + ("" if close >= 0 else f" and missing {_CLOSE}"))
            pos = len(text) if close < 0 else close + len(_CLOSE)
        i += 1
    if errors:
        return ParsedTurn(content=text, calls=tuple(calls), parse_error=_join_errors(errors), raw=text)
    rest = "".join(outside).strip()
    return ParsedTurn(content=rest or None, calls=tuple(calls), raw=text)


@lru_cache(maxsize=8)
def _vllm_tool_parser(name: str, tokenizer):
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.get_tool_parser(name)(tokenizer)


def split_reasoning(text: str) -> ParsedTurn:
    """Parses a Qwen3 thinking-mode reply: the reasoning is everything before the last ``</think>``
    (its ``<think>`` dropped), as Qwen3's template splits an assistant message; all of the reply
    when ``</think>`` never comes. The rest is parsed as Hermes (`parse_hermes`).

    Ours, not vLLM's ``qwen3`` reasoning parser: that one also ends the reasoning at a
    ``<tool_call>`` written inside it, which would send the rest of the reasoning to the env.

    Args:
        text: the decoded reply (special tokens kept, the end-of-turn token removed).

    Returns:
        ParsedTurn whose `reasoning` is the reasoning text and whose content and calls come
        from the text after it only (on a parse error `content` is that text, not the
        reasoning; a reply cut inside its reasoning has no content and says so in
        `parse_error`); `raw` is the whole reply. Never raises.
    """
    head, sep, content = text.rpartition("</think>")
    if not sep:
        return ParsedTurn(content=None, parse_error="the reply ended inside its reasoning (no </think>)", raw=text,
                          reasoning=text.split("<think>", 1)[-1])
    reasoning = head.split("<think>", 1)[-1]
    if not content.strip():
        return ParsedTurn(content=None, raw=text, reasoning=reasoning)
    parsed = parse_hermes(content.lstrip("\n"))
    return ParsedTurn(content=parsed.content, calls=parsed.calls, parse_error=parsed.parse_error, raw=text,
                      reasoning=reasoning)


def parse_llama3_json(text: str, tokenizer) -> ParsedTurn:
    """Parses a Llama 3.x reply: a bare JSON object ``{"name": ..., "parameters"|"arguments": {...}}``
    (several separated by ``;``; optionally after ``<|python_tag|>``) is a call, read by vLLM's
    ``llama3_json`` tool parser; a reply that does not start with ``{`` is plain content.

    Returns:
        ParsedTurn: the calls (arguments as vLLM's parser writes them: ``json.dumps`` of the
        value), no content; a reply that starts with ``{`` but gives no call has
        `parse_error` set and the raw text as content. Never raises.
    """
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").lstrip()
    if not body.startswith("{"):
        return ParsedTurn(content=text if text.strip() else None, raw=text)
    try:
        info = _vllm_tool_parser("llama3_json", tokenizer).extract_tool_calls(body, None)
    except Exception as err:  # noqa: BLE001 - model output is untrusted; the parser's failure is a parse error
        return ParsedTurn(content=text, parse_error=f"llama3_json: {type(err).__name__}: {str(err)[:200]}", raw=text)
    calls = tuple(ParsedCall(c.function.name, c.function.arguments) for c in info.tool_calls
                  if isinstance(c.function.name, str) and c.function.name)
    if not info.tools_called or not calls:
        return ParsedTurn(content=text, parse_error="llama3_json: a JSON reply that is not a tool call "
                          '(expected {"name": ..., "parameters": {...}})', raw=text)
    bad = [c.name for c in calls if not _is_object(c.arguments_json)]
    if bad:
        return ParsedTurn(content=text, calls=calls, parse_error=f"llama3_json: arguments of {_quote(bad[0])} are not a JSON object",
                          raw=text)
    return ParsedTurn(content=None, calls=calls, raw=text)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


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
        return ParsedTurn(content=raw, parse_error=f"harmony: {str(err)[:MAX_PARSE_ERROR_CHARS - 9]}", raw=raw)
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
            except (ValueError, RecursionError):  # JSONDecodeError, > 4300-digit ints, deep nesting
                ok = False
            if ok:
                calls.append(ParsedCall(recipient[len("functions."):], text))
            else:
                errors.append(f"call to {_quote(recipient)}: arguments are not a JSON object")
        elif msg.channel == "final":
            finals.append(text)
        elif msg.channel != "analysis":
            others.append(text)
    if errors:
        return ParsedTurn(content=raw, calls=tuple(calls), parse_error=_join_errors(errors), raw=raw)
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
