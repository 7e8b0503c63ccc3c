"""Prompt formatting on token ids: the first prompt, then per-turn environment suffixes.

The agent loop never decodes and re-encodes history. The first prompt is rendered once
(system + tools + first observation); after each agent turn the environment's reply is
rendered ONCE as a suffix and appended to the ids the engine already consumed and
produced. So the prompt of turn k+1 = prompt of turn k + generated ids + suffix ids.

`ChatTemplateFormatter` (Hermes / ChatML models: SmolLM2, Qwen, ...): the suffix is the
difference of two renders of the tokenizer's chat template, around a fixed reference
conversation: render(ref + env messages, add_generation_prompt) minus render(ref), where
ref ends with an assistant turn. The template's text after the assistant's end-of-turn
token (e.g. the newline after ``<|im_end|>``) belongs to the suffix (loss mask 0). If the
previous reply was truncated (no end-of-turn sampled), the suffix starts with the
template's end-of-turn token: it is template text, never a generated token (mask 0).
Templates without tool support (SmolLM2's) get the tools in the system message in the
Hermes format and tool results as ``tool`` messages wrapped in ``<tool_response>``. The
tool block comes first, before the environment's system prompt (`hermes_system`): it is
the same for every task of a domain, so every episode's prompt starts with one long shared
prefix (served once by vLLM's prefix cache, trained once by the learner's shared-prefix
packing), and the task-specific text (tau2's ticket, in solo mode) sits right before the
agent's turn.

`HarmonyFormatter` (gpt-oss): renders with `openai_harmony`; each env message is rendered
on its own (harmony messages are self-delimited) followed by ``<|start|>assistant``.
"""

from __future__ import annotations

import json
from typing import Callable, Protocol, Sequence

from rollout_service.parsers import ParsedTurn, harmony_encoding, parse_harmony, parse_hermes
from sinkflex.api.common.v1 import common_pb2

_ROLE = {common_pb2.ROLE_SYSTEM: "system", common_pb2.ROLE_USER: "user", common_pb2.ROLE_ASSISTANT: "assistant",
         common_pb2.ROLE_TOOL: "tool"}

HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def hermes_system(system_prompt: str, tools: Sequence[dict]) -> str:
    """The system message for a template without native tools: the Hermes tool block (one
    OpenAI function schema per line), then the environment's system prompt."""
    if not tools:
        return system_prompt
    block = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    return f"{block}\n\n{system_prompt}"


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


class ChatTemplateFormatter:
    """Hermes/ChatML tool calling over a Hugging Face tokenizer's chat template.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        template = tokenizer.chat_template or ""
        self.native_tools = "tools" in template
        eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.eot_id = eot if isinstance(eot, int) and eot != tokenizer.unk_token_id else tokenizer.eos_token_id
        self.stop_token_ids = sorted({self.eot_id, tokenizer.eos_token_id})
        self._tools: list[dict] = []
        self._ref = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                     {"role": "assistant", "content": "A"}]

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        kwargs = {"tools": self._tools} if (self.native_tools and self._tools) else {}
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

    def initial_prompt(self, system_prompt, tools, observation) -> list[int]:
        """Ids of system (+ tools) + the first observation + the assistant header."""
        self._tools = [tool_schema(t) for t in tools]
        system = system_prompt if self.native_tools else hermes_system(system_prompt, self._tools)
        messages = [{"role": "system", "content": system}] + [self.to_chat(m) for m in observation if m.role != common_pb2.ROLE_SYSTEM]
        return self._render(messages, add_generation_prompt=True)

    def suffix(self, env_messages, ended_turn: bool) -> list[int]:
        """Ids to append after a generated reply: the env's messages + the next assistant header.

        Args:
            env_messages: what the environment returned after the agent's action.
            ended_turn: the reply ended with the end-of-turn token (False: truncated).
        """
        base = self._render(self._ref, add_generation_prompt=False)
        full = self._render(self._ref + [self.to_chat(m) for m in env_messages], add_generation_prompt=True)
        if full[: len(base)] != base:
            raise ValueError("chat template is not prefix-stable: cannot render the env reply as a suffix")
        cut = len(base) - 1 - base[::-1].index(self.eot_id)  # the reference assistant's end-of-turn token
        tail = base[cut + 1:] + full[len(base):]
        return tail if ended_turn else [self.eot_id] + tail

    def parse(self, token_ids) -> ParsedTurn:
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return parse_hermes(self.tok.decode(ids, skip_special_tokens=False))

    def note_calls(self, calls) -> None:
        """Nothing to remember: a Hermes tool response does not name its call's tool."""


class HarmonyFormatter:
    """gpt-oss harmony format via `openai_harmony` (rendering and parsing offline)."""

    def __init__(self, reasoning_effort: str = "low"):
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

    def initial_prompt(self, system_prompt, tools, observation) -> list[int]:
        from openai_harmony import (Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                                    ToolDescription)

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
        return list(self.enc.render_conversation_for_completion(Conversation.from_messages(msgs), Role.ASSISTANT))

    def suffix(self, env_messages, ended_turn: bool) -> list[int]:
        from openai_harmony import Role

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


#: tool format (`AgentConfig.tool_format`) -> a per-episode formatter from the policy's tokenizer.
FORMATTERS: dict[str, Callable[[object], Formatter]] = {
    "hermes": ChatTemplateFormatter,
    "harmony": lambda tokenizer: HarmonyFormatter(),
}


def formatter_factory(tool_format: str, tokenizer) -> Callable[[], Formatter]:
    """A function that makes a fresh formatter (formatters hold per-episode state) of
    `tool_format` over `tokenizer`; the format is chosen here, once.

    Raises:
        ValueError: a tool format not in `FORMATTERS`.
    """
    try:
        make = FORMATTERS[tool_format]
    except KeyError:
        raise ValueError(f"unknown tool format {tool_format!r} (known: {', '.join(sorted(FORMATTERS))})") from None
    return lambda: make(tokenizer)
