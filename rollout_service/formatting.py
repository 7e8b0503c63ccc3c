"""Prompt formatting on token ids, per model family: the first prompt, then per-turn environment suffixes.

The agent loop never decodes and re-encodes history. The first prompt is rendered once
(system + tools + first observation); after each agent turn the environment's reply is
rendered ONCE as a suffix and appended to the ids the engine already consumed and
produced. So the prompt of turn k+1 = prompt of turn k + generated ids + suffix ids, and
every generated id (reasoning included) stays in the token stream exactly as sampled.

Families (`AgentConfig.tool_format`, `FAMILIES`):
- ``hermes`` (SmolLM2, Hermes, ChatML models): ``<tool_call>`` JSON blocks; a template without
  tool support (SmolLM2's) gets the tools in the system message (`hermes_system`) and tool
  results as ``tool`` messages wrapped in ``<tool_response>``. The tool block comes first,
  before the environment's system prompt: it is the same for every task of a domain, so every
  episode's prompt starts with one long shared prefix.
- ``qwen3`` (Qwen3's stock hybrid-thinking template): native ``tools``; ``<tool_call>`` JSON
  blocks; ``enable_thinking`` passed to the template (off: its generation prompt already holds
  an empty ``<think></think>`` block). The reasoning the policy writes (``<think>…</think>``)
  stays in the token stream with loss mask 1 (it is the policy's own output) and is never sent
  to the environment: it is split off at ``</think>`` (`parsers.split_reasoning`) and only the
  text after it is parsed for calls and sent as the visible reply.
- ``llama3`` (Llama 3.x JSON tool calling): native ``tools`` (in the first user message as the stock
  templates place them, or, in a conversation with no user message such as a solo-mode episode,
  in the system turn: ``tools_in_user_message=False``, the templates' own switch); a reply that is a bare JSON
  object ``{"name": ..., "parameters": ...}`` (optionally after ``<|python_tag|>``) is a call,
  parsed by vLLM's ``llama3_json`` tool parser; tool results are the template's ``tool``
  (``ipython``) messages; end of turn ``<|eot_id|>``, the only stop the formatter asks for: the
  stock Llama 3.x templates end every assistant turn, tool calls included, with ``<|eot_id|>``
  unless ``builtin_tools`` is passed (ipython mode: ``<|eom_id|>``), and the formatter never
  passes it. A reply that still ends with ``<|eom_id|>`` (vLLM also stops at the ids the model's
  generation_config.json lists as EOS: Llama 3.1's lists it) is parsed the same way and kept as
  generated; that one id then differs from a render of the conversation.
- ``harmony`` (gpt-oss): rendered with `openai_harmony`, reasoning effort configurable; each
  env message is rendered on its own (harmony messages are self-delimited) followed by
  ``<|start|>assistant``; calls parsed from the ids (`parsers.parse_harmony`).

Suffixes of a chat template (`ChatTemplateFormatter.suffix`) are the template's own text
after a reference assistant turn's end-of-turn token: render(ref + env messages,
add_generation_prompt) from the position after that token, where ref = system, user,
assistant. Everything before the reference assistant turn must render the same with and
without the env messages; the assistant turn itself may render differently (Qwen3 drops
reasoning from turns before the last user message): that part of the render is never used,
the stream keeps the ids as generated. If the previous reply was truncated (no end-of-turn
sampled), the suffix starts with the template's end-of-turn token: template text, loss mask 0.

At start-up `check_round_trip` renders one full tool round trip (system, user, assistant tool
call, tool reply, next assistant header) both ways — as the agent loop builds it (prompt +
the assistant turn as generated + suffix) and as one render of the whole conversation — and
refuses (ValueError naming the model and the first difference) a template whose stream cannot
be extended token-exactly: any difference outside the assistant turn, or inside it for a
family that does not declare a rewrite of past assistant turns (only ``qwen3`` does, for its
reasoning blocks).

Where vLLM's parsers are used and where not (vllm 0.32 registries):
- Qwen3 reasoning: ours (`parsers.split_reasoning`), because vLLM's ``qwen3`` reasoning parser also
  ends the reasoning at a ``<tool_call>`` written inside it, which would send the rest of the
  reasoning to the environment (Qwen3's template splits at ``</think>`` only).
- Llama 3.x calls: vLLM's ``llama3_json`` tool parser (`ToolParserManager`); its arguments are
  ``json.dumps`` of the parsed value (same JSON value, spacing may differ from the ids).
- Hermes / Qwen3 calls: our `parsers.parse_hermes`, because vLLM's ``hermes`` parser ends a
  block at the first ``</tool_call>`` (even inside a JSON string) and re-serialises the arguments.
- harmony: our `parsers.parse_harmony` calls the same `openai_harmony` parser vLLM's
  ``openai`` parsers wrap, directly on the generated ids (theirs needs a request object).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from rollout_service.parsers import (
    ParsedTurn,
    harmony_encoding,
    parse_harmony,
    parse_hermes,
    parse_llama3_json,
    split_reasoning,
)
from sinkflex.api.common.v1 import common_pb2
from sinkflex.chat_templates import HERMES_TOOLS_PROMPT, hermes_system  # noqa: F401 (HERMES_TOOLS_PROMPT re-exported)

#: The model families (`AgentConfig.tool_format`).
FAMILIES = ("hermes", "qwen3", "llama3", "harmony")

#: Reasoning efforts of gpt-oss's harmony system message.
REASONING_EFFORTS = ("low", "medium", "high")

_ROLE = {common_pb2.ROLE_SYSTEM: "system", common_pb2.ROLE_USER: "user", common_pb2.ROLE_ASSISTANT: "assistant",
         common_pb2.ROLE_TOOL: "tool"}


def tool_schema(spec: common_pb2.ToolSpec) -> dict:
    """OpenAI function schema of a ToolSpec."""
    params = json.loads(spec.parameters_json_schema) if spec.parameters_json_schema else {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": spec.name, "description": spec.description, "parameters": params}}


def hermes_call_text(call: common_pb2.ToolCall) -> str:
    return f'<tool_call>\n{{"name": {json.dumps(call.name)}, "arguments": {call.arguments_json or "{}"}}}\n</tool_call>'


class Formatter(Protocol):
    """What the agent loop needs from a model's prompt format."""

    stop_token_ids: list[int]

    def initial_prompt(self, system_prompt: str, tools: Sequence[common_pb2.ToolSpec],
                       observation: Sequence[common_pb2.Message]) -> list[int]: ...

    def suffix(self, env_messages: Sequence[common_pb2.Message], ended_turn: bool) -> list[int]: ...

    def parse(self, token_ids: Sequence[int]) -> ParsedTurn: ...

    def note_calls(self, calls: Sequence[common_pb2.ToolCall]) -> None:
        """Sees the tool calls of the action sent to the env (before the env's reply is rendered)."""
        ...



@dataclass(frozen=True)
class _Family:
    """What differs between chat-template families."""

    eot: str  # the assistant's end-of-turn token, as the template renders it after every assistant turn
    foreign_ends: tuple[str, ...] = ()  # not rendered by the template after an assistant turn and not asked
    # for as stops, but a reply that ends with one (the model's generation_config lists it as EOS) is parsed without it
    rewrites_history: bool = False  # the template renders past assistant turns differently (reasoning dropped)


_FAMILIES = {
    "hermes": _Family("<|im_end|>"),
    "qwen3": _Family("<|im_end|>", rewrites_history=True),
    "llama3": _Family("<|eot_id|>", foreign_ends=("<|eom_id|>",)),
}


class ChatTemplateFormatter:
    """Tool calling over a Hugging Face tokenizer's chat template: the hermes, qwen3 and llama3 families.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        family: "hermes", "qwen3" or "llama3".
        enable_thinking: qwen3 only: passed to the template (False: no reasoning is generated).

    Raises:
        ValueError: an unknown family.
    """

    def __init__(self, tokenizer, family: str = "hermes", enable_thinking: bool = True):
        if family not in _FAMILIES:
            raise ValueError(f"not a chat-template family: {family!r} (known: {', '.join(sorted(_FAMILIES))})")
        self.tok = tokenizer
        self.family = family
        self._fam = _FAMILIES[family]
        self.enable_thinking = enable_thinking
        template = tokenizer.chat_template or ""
        # a published policy version keeps the model's template as "default" and adds a named
        # "tool_use" one for serving (sinkflex.chat_templates): rollouts render with the default
        default = template.get("default", "") if isinstance(template, dict) else template
        self.native_tools = "tools" in default
        eot = tokenizer.convert_tokens_to_ids(self._fam.eot)
        self.eot_id = eot if isinstance(eot, int) and eot != tokenizer.unk_token_id else tokenizer.eos_token_id
        # the stops the engine is asked for: the template's own end of an assistant turn (and EOS), so that a reply
        # that ends cleanly ends as a render of it does (vLLM's structured outputs also end a guided reply only there)
        self.stop_token_ids = sorted(s for s in {self.eot_id, tokenizer.eos_token_id} if s is not None)
        ends = set(self.stop_token_ids)
        for name in self._fam.foreign_ends:
            t = tokenizer.convert_tokens_to_ids(name)
            if isinstance(t, int) and t != tokenizer.unk_token_id:
                ends.add(t)
        self._end_ids = frozenset(ends)
        self._tools: list[dict] = []
        self._ref = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                     {"role": "assistant", "content": "A"}]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        kwargs = {"tools": self._tools} if (self.native_tools and self._tools) else {}
        if self.family == "qwen3":
            kwargs["enable_thinking"] = self.enable_thinking
        if self.family == "llama3" and "tools" in kwargs and not any(m["role"] == "user" for m in messages):
            # the stock Llama 3.x templates put the tools in the first user message and raise when there is none
            # (an episode in solo mode: system prompt, then the agent); their own switch puts them in the system turn
            kwargs["tools_in_user_message"] = False
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                           return_dict=False, **kwargs)
        return list(ids)

    def to_chat(self, m: common_pb2.Message) -> dict:
        """A wire message as a chat-template message dict."""
        role = _ROLE.get(m.role, "user")
        content = m.content if m.HasField("content") else ""
        if role == "assistant" and m.tool_calls:
            if self.native_tools:
                return {"role": "assistant", "content": content, "tool_calls": [
                    {"type": "function", "id": c.id,
                     "function": {"name": c.name, "arguments": json.loads(c.arguments_json or "{}")}} for c in m.tool_calls]}
            content = "\n".join([content] * bool(content) + [hermes_call_text(c) for c in m.tool_calls])
        if role == "tool" and not self.native_tools:
            content = f"<tool_response>\n{content}\n</tool_response>"
        out = {"role": role, "content": content}
        if role == "tool" and m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
        return out

    def system_message(self, system_prompt: str) -> dict:
        """The system message of the first prompt (the Hermes tool block first when the template has no tools)."""
        return {"role": "system", "content": system_prompt if self.native_tools else hermes_system(system_prompt, self._tools)}

    def initial_prompt(self, system_prompt, tools, observation) -> list[int]:
        """Ids of system (+ tools) + the first observation + the assistant header."""
        self._tools = [tool_schema(t) for t in tools]
        messages = [self.system_message(system_prompt)] + [self.to_chat(m) for m in observation if m.role != common_pb2.ROLE_SYSTEM]
        return self._render(messages, add_generation_prompt=True)

    def suffix(self, env_messages, ended_turn: bool) -> list[int]:
        """Ids to append after a generated reply: the env's messages + the next assistant header.

        Args:
            env_messages: what the environment returned after the agent's action.
            ended_turn: the reply ended with the end-of-turn token (False: truncated).

        Raises:
            ValueError: the template renders the turns before the reference assistant turn
                differently once env messages follow, or drops the assistant's end-of-turn token.
        """
        base = self._render(self._ref, add_generation_prompt=False)
        full = self._render(self._ref + [self.to_chat(m) for m in env_messages], add_generation_prompt=True)
        eots_base = [i for i, t in enumerate(base) if t == self.eot_id]
        eots_full = [i for i, t in enumerate(full) if t == self.eot_id]
        k = len(eots_base)  # the reference assistant's end-of-turn is the k-th
        turn_start = eots_base[-2] + 1 if k >= 2 else 0
        if k == 0 or len(eots_full) < k or full[:turn_start] != base[:turn_start]:
            raise ValueError(f"the chat template is not extendable: the turns before an assistant turn render differently "
                             f"once an env reply follows, or the end-of-turn {self._fam.eot!r} is missing")
        tail = full[eots_full[k - 1] + 1:]
        return tail if ended_turn else [self.eot_id] + tail

    def parse(self, token_ids) -> ParsedTurn:
        """The reply's visible content and calls (qwen3: reasoning split off first, never content)."""
        ids = list(token_ids)
        if ids and ids[-1] in self._end_ids:
            ids = ids[:-1]
        text = self.tok.decode(ids, skip_special_tokens=False)
        if self.family == "llama3":
            return parse_llama3_json(text, self.tok)
        if self.family == "qwen3" and self.enable_thinking:
            return split_reasoning(text)
        return parse_hermes(text)

    def note_calls(self, calls) -> None:
        """Nothing to remember: these templates' tool replies do not depend on the call."""

    # -- the start-up check ---------------------------------------------------------------------
    def round_trip(self) -> tuple[list[int], list[int], int, int]:
        """One tool round trip built as the agent loop builds it and as one render.

        Returns:
            (stream, whole, start, end): stream = prompt + the assistant turn as generated +
            suffix; whole = one render of system, user, assistant call, tool reply and the next
            assistant header; [start, end) the assistant turn's span in the stream (the
            generation prompt's own text included).
        """
        tools = [common_pb2.ToolSpec(name="get_order", description="Look up an order.",
                                     parameters_json_schema='{"type": "object", "properties": {"order_id": {"type": "string"}}}')]
        user = common_pb2.Message(role=common_pb2.ROLE_USER, content="Where is order #W1?")
        call = common_pb2.ToolCall(id="call_0_0", name="get_order", arguments_json='{"order_id": "#W1"}')
        reply = common_pb2.Message(role=common_pb2.ROLE_TOOL, content='{"status": "delivered"}', tool_call_id="call_0_0")
        prompt = self.initial_prompt("You are a shop agent.", tools, [user])
        head = self._render([self.system_message("You are a shop agent."), self.to_chat(user)], add_generation_prompt=False)
        assistant = self.to_chat(common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[call]))
        if self.family == "qwen3" and self.enable_thinking:
            assistant["reasoning_content"] = "The user asks about an order."
        with_reply = self._render([self.system_message("You are a shop agent."), self.to_chat(user), assistant],
                                  add_generation_prompt=False)
        if with_reply[:len(prompt)] != prompt:
            raise ValueError("the assistant's reply, rendered, does not start with the generation prompt: "
                             + _first_difference(self._decode, with_reply, prompt))
        eots = [i for i, t in enumerate(with_reply) if t == self.eot_id and i >= len(prompt)]
        if not eots:
            raise ValueError(f"the assistant's reply, rendered, has no end-of-turn {self._fam.eot!r}")
        generated = with_reply[len(prompt): eots[0] + 1]
        stream = prompt + generated + self.suffix([reply], ended_turn=True)
        whole = self._render([self.system_message("You are a shop agent."), self.to_chat(user), assistant, self.to_chat(reply)],
                             add_generation_prompt=True)
        return stream, whole, len(head), len(prompt) + len(generated)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    @property
    def rewrites_history(self) -> bool:
        return self._fam.rewrites_history


class HarmonyFormatter:
    """gpt-oss harmony format via `openai_harmony` (rendering and parsing offline).

    Args:
        reasoning_effort: "low", "medium" or "high" (the system message's ``Reasoning:``).

    Raises:
        ValueError: an unknown reasoning effort.
    """

    family = "harmony"
    rewrites_history = False

    def __init__(self, reasoning_effort: str = "low"):
        if reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, not {reasoning_effort!r}")
        self.enc = harmony_encoding()
        self.stop_token_ids = list(self.enc.stop_tokens_for_assistant_actions())
        self.reasoning_effort = reasoning_effort
        self._call_names: dict[str, str] = {}

    def _to_harmony(self, m: common_pb2.Message) -> list:
        from openai_harmony import Author, Message, Role

        content = m.content if m.HasField("content") else ""
        if m.role == common_pb2.ROLE_USER:
            return [Message.from_role_and_content(Role.USER, content)]
        if m.role == common_pb2.ROLE_ASSISTANT:
            out = []
            if content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
            for c in m.tool_calls:
                self._call_names[c.id] = c.name
                out.append(Message.from_role_and_content(Role.ASSISTANT, c.arguments_json or "{}")
                           .with_channel("commentary").with_recipient(f"functions.{c.name}").with_content_type("<|constrain|>json"))
            return out
        if m.role == common_pb2.ROLE_TOOL:
            name = self._call_names.get(m.tool_call_id, "tool")
            return [Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"), content)
                    .with_channel("commentary").with_recipient("assistant")]
        return [Message.from_role_and_content(Role.DEVELOPER, content)]

    def _prompt_messages(self, system_prompt, tools, observation) -> list:
        """Harmony messages of the first prompt: system (reasoning effort), developer (instructions, tools), observation."""
        from openai_harmony import DeveloperContent, Message, ReasoningEffort, Role, SystemContent, ToolDescription

        effort = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}[self.reasoning_effort]
        dev = DeveloperContent.new().with_instructions(system_prompt)
        if tools:
            dev = dev.with_function_tools([ToolDescription.new(t.name, t.description, parameters=json.loads(t.parameters_json_schema or "{}"))
                                           for t in tools])
        msgs = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort)),
                Message.from_role_and_content(Role.DEVELOPER, dev)]
        for m in observation:
            if m.role != common_pb2.ROLE_SYSTEM:
                msgs.extend(self._to_harmony(m))
        return msgs

    def initial_prompt(self, system_prompt, tools, observation) -> list[int]:
        from openai_harmony import Conversation, Role

        msgs = self._prompt_messages(system_prompt, tools, observation)
        return list(self.enc.render_conversation_for_completion(Conversation.from_messages(msgs), Role.ASSISTANT))

    def suffix(self, env_messages, ended_turn: bool) -> list[int]:
        ids: list[int] = [] if ended_turn else self.enc.encode("<|end|>", allowed_special="all")
        for m in env_messages:
            for hm in self._to_harmony(m):
                ids.extend(self.enc.render(hm))
        ids.extend(self.enc.encode("<|start|>assistant", allowed_special="all"))
        return ids

    def note_calls(self, calls: Sequence[common_pb2.ToolCall]) -> None:
        """Remembers call id -> tool name (harmony names the tool in its reply's author)."""
        for c in calls:
            self._call_names[c.id] = c.name

    def parse(self, token_ids) -> ParsedTurn:
        return parse_harmony(list(token_ids))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(list(ids))

    def round_trip(self) -> tuple[list[int], list[int], int, int]:
        """As `ChatTemplateFormatter.round_trip`, with harmony's renderer."""
        from openai_harmony import Conversation, Role

        tools = [common_pb2.ToolSpec(name="get_order", description="Look up an order.",
                                     parameters_json_schema='{"type": "object", "properties": {"order_id": {"type": "string"}}}')]
        user = common_pb2.Message(role=common_pb2.ROLE_USER, content="Where is order #W1?")
        call = common_pb2.ToolCall(id="call_0_0", name="get_order", arguments_json='{"order_id": "#W1"}')
        reply = common_pb2.Message(role=common_pb2.ROLE_TOOL, content='{"status": "delivered"}', tool_call_id="call_0_0")
        prompt = self.initial_prompt("You are a shop agent.", tools, [user])
        head = self.enc.encode("<|start|>assistant", allowed_special="all")
        assistant = self._to_harmony(common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[call]))
        generated = [t for hm in assistant for t in self.enc.render(hm)][len(head):]  # after the header in the prompt
        self.note_calls([call])
        stream = prompt + generated + self.suffix([reply], ended_turn=True)
        first = self._prompt_messages("You are a shop agent.", tools, [user])
        whole = list(self.enc.render_conversation_for_completion(
            Conversation.from_messages(first + assistant + self._to_harmony(reply)), Role.ASSISTANT))
        return stream, whole, len(prompt) - len(head), len(prompt) + len(generated)


def check_round_trip(formatter, model: str) -> None:
    """Refuses a template that cannot be extended token-exactly (see the module docstring).

    Args:
        formatter: a fresh formatter (`ChatTemplateFormatter` or `HarmonyFormatter`).
        model: the policy's name, for the message.

    Raises:
        ValueError: naming the model, the family and the first difference (position and text of both sides).
    """
    try:
        stream, whole, start, end = formatter.round_trip()
    except (ValueError, KeyError, TypeError) as err:  # a template that raises on a tool round trip
        raise ValueError(f"model {model}: the {formatter.family} chat template cannot render a tool round trip: "
                         f"{str(err)[:300]}") from None
    if stream == whole:
        return
    lcp = next((i for i, (a, b) in enumerate(zip(stream, whole)) if a != b), min(len(stream), len(whole)))
    lcs = next((i for i, (a, b) in enumerate(zip(reversed(stream), reversed(whole))) if a != b), min(len(stream), len(whole)))
    inside_turn = lcp >= start and lcs >= len(stream) - end
    if formatter.rewrites_history and inside_turn:
        return  # the template rewrites the past assistant turn (reasoning); the stream keeps the ids as generated
    where = "inside the assistant turn" if inside_turn else "outside the assistant turn"
    raise ValueError(f"model {model}: the {formatter.family} chat template cannot be extended token-exactly: a tool "
                     f"round trip rendered as one conversation differs from prompt + reply + suffix {where}: "
                     + _first_difference(formatter._decode, stream, whole, lcp))


def _first_difference(decode, a: Sequence[int], b: Sequence[int], at: int | None = None) -> str:
    """Where two id lists first differ, with a little decoded text of each side (bounded)."""
    if at is None:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"at token {at}: {decode(a[at:at + 12])[:80]!r} (prompt + reply + suffix) vs "
            f"{decode(b[at:at + 12])[:80]!r} (one render)")


#: tool format (`AgentConfig.tool_format`) -> a per-episode formatter from the policy's tokenizer and the options.
FORMATTERS: dict[str, Callable[..., Formatter]] = {
    "hermes": lambda tokenizer, **o: ChatTemplateFormatter(tokenizer, "hermes"),
    "qwen3": lambda tokenizer, **o: ChatTemplateFormatter(tokenizer, "qwen3", enable_thinking=o.get("enable_thinking", True)),
    "llama3": lambda tokenizer, **o: ChatTemplateFormatter(tokenizer, "llama3"),
    "harmony": lambda tokenizer, **o: HarmonyFormatter(o.get("reasoning_effort", "low")),
}


def formatter_factory(tool_format: str, tokenizer, model: str = "the policy", check: bool = True,
                      **options) -> Callable[[], Formatter]:
    """A function that makes a fresh formatter (formatters hold per-episode state) of
    `tool_format` over `tokenizer`; the format is chosen here, once, and checked here
    (`check_round_trip`) unless `check` is False.

    Args:
        options: ``enable_thinking`` (qwen3), ``reasoning_effort`` (harmony).

    Raises:
        ValueError: a tool format not in `FORMATTERS`; a template that cannot be extended
            token-exactly (naming `model`).
    """
    try:
        make = FORMATTERS[tool_format]
    except KeyError:
        raise ValueError(f"unknown tool format {tool_format!r} (known: {', '.join(sorted(FORMATTERS))})") from None
    if check:
        check_round_trip(make(tokenizer, **options), model)
    return lambda: make(tokenizer, **options)
