"""The Hermes tool prompt for chat templates without native tools, as text and as a chat template.

A model whose chat template does not render tools (SmolLM2's) is trained with the tools in the
system message in the Hermes format (`HERMES_TOOLS_PROMPT`, one OpenAI function schema per
line, the block before the environment's system prompt), tool calls written as
``<tool_call>`` blocks and tool results as ``tool`` messages wrapped in ``<tool_response>``
(rollout_service.formatting renders the rollouts so). `tool_use_template` gives a chat template
that renders an OpenAI-style conversation with ``tools=`` the same way, so a published policy
version served by any OpenAI-compatible server (``vllm serve`` with ``--tool-call-parser
hermes``) gets the prompt it was trained on. It is saved as the tokenizer's named ``tool_use``
template, which transformers' and vLLM's ``apply_chat_template`` pick when tools are given;
without tools the model's own template renders, unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def hermes_system(system_prompt: str, tools: Sequence[dict]) -> str:
    """The system message for a template without native tools: the Hermes tool block (one
    OpenAI function schema per line, `json.dumps`), then the environment's system prompt."""
    if not tools:
        return system_prompt
    block = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    return f"{block}\n\n{system_prompt}"


def renders_tools(template: str | dict | None) -> bool:
    """Whether a tokenizer's chat template renders tools itself: its default template (a str, or
    the "default" entry of a dict of named templates) mentions ``tools``, or it has a named
    ``tool_use`` template. The test rollout_service.formatting makes to pick the Hermes prompt."""
    if isinstance(template, dict):
        return "tool_use" in template or "tools" in (template.get("default") or "")
    return "tools" in (template or "")


def _jinja_str(text: str) -> str:
    """`text` as a Jinja string literal (JSON's escapes are Jinja's)."""
    return json.dumps(text)


def tool_use_template(default_template: str) -> str:
    """A chat template that renders a conversation with ``tools`` as rollout_service.formatting
    does for a template without native tools, then hands the rewritten messages to
    `default_template` (the model's own, unchanged).

    The rewrite: the Hermes tool block (`HERMES_TOOLS_PROMPT`, each tool as
    ``{"type": "function", "function": {"name", "description", "parameters"}}`` in JSON with
    ASCII escapes, as `json.dumps` writes it) then a blank line before the first system message's
    content (a system message of just the block and the blank line when there is none); an
    assistant message's tool calls (OpenAI ``{"function": {"name", "arguments"}}`` or
    ``{"name", "arguments"}``; arguments a JSON string, written as is, or an object) appended to
    its content, one ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` block per line;
    a tool message's content wrapped in ``<tool_response>\\n...\\n</tool_response>``. Without tools
    the messages pass unchanged.
    """
    head, tail = HERMES_TOOLS_PROMPT.split("{tools}")
    head, tail = head.replace("{{", "{").replace("}}", "}"), tail.replace("{{", "{").replace("}}", "}")
    prelude = (
        "{%- if tools -%}\n"
        "{%- set ns = namespace(tools=[], msgs=[]) -%}\n"
        "{%- for t in tools -%}\n"
        "{%- set f = t.function if t.function is defined else t -%}\n"
        "{%- set params = f.parameters if f.parameters is defined and f.parameters is not none"
        " else {'type': 'object', 'properties': {}} -%}\n"
        "{%- set ns.tools = ns.tools + [{'type': 'function', 'function': {'name': f.name, 'description':"
        " f.description if f.description is defined and f.description is not none else '', 'parameters': params}}"
        " | tojson(ensure_ascii=true)] -%}\n"
        "{%- endfor -%}\n"
        f"{{%- set block = {_jinja_str(head)} + ns.tools | join('\\n') + {_jinja_str(tail)} -%}}\n"
        "{%- if not messages or messages[0].role != 'system' -%}\n"
        "{%- set ns.msgs = [{'role': 'system', 'content': block + '\\n\\n'}] -%}\n"
        "{%- endif -%}\n"
        "{%- for m in messages -%}\n"
        "{%- set content = m.content if m.content is string else '' -%}\n"
        "{%- if loop.first and m.role == 'system' -%}\n"
        "{%- set ns.msgs = ns.msgs + [{'role': 'system', 'content': block + '\\n\\n' + content}] -%}\n"
        "{%- elif m.role == 'assistant' and m.tool_calls -%}\n"
        "{%- set parts = namespace(text=[content] if content else []) -%}\n"
        "{%- for c in m.tool_calls -%}\n"
        "{%- set fc = c.function if c.function is defined else c -%}\n"
        "{%- set args = fc.arguments if fc.arguments is string else (fc.arguments | tojson(ensure_ascii=true)"
        " if fc.arguments is defined and fc.arguments is not none else '') -%}\n"
        "{%- set parts.text = parts.text + ['<tool_call>\\n{\"name\": ' + fc.name | tojson(ensure_ascii=true)"
        " + ', \"arguments\": ' + (args or '{}') + '}\\n</tool_call>'] -%}\n"
        "{%- endfor -%}\n"
        "{%- set ns.msgs = ns.msgs + [{'role': 'assistant', 'content': parts.text | join('\\n')}] -%}\n"
        "{%- elif m.role == 'tool' -%}\n"
        "{%- set ns.msgs = ns.msgs + [{'role': 'tool', 'content': '<tool_response>\\n' + content + '\\n</tool_response>'}] -%}\n"
        "{%- else -%}\n"
        "{%- set ns.msgs = ns.msgs + [{'role': m.role, 'content': content}] -%}\n"
        "{%- endif -%}\n"
        "{%- endfor -%}\n"
        "{%- set messages = ns.msgs -%}\n"
        "{%- set tools = none -%}\n"
        "{%- endif -%}\n"
    )
    return prelude + default_template


def with_tool_use(template: str | dict | None) -> str | dict | None:
    """The tokenizer chat template to publish: `template` plus a ``tool_use`` template
    (`tool_use_template`) when it does not render tools itself (`renders_tools`); unchanged
    otherwise (also when there is none)."""
    if template is None or renders_tools(template):
        return template
    if isinstance(template, dict):
        return {**template, "tool_use": tool_use_template(template["default"])} if template.get("default") else template
    return {"default": template, "tool_use": tool_use_template(template)}
