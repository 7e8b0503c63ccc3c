"""A published policy version carries its model folder's tokenizer as the tokenizer's own
`save_pretrained` writes it (not a fixed list of file names), generation_config.json as is, and,
for a chat template without tools, a `tool_use` template that renders an OpenAI conversation with
tools as the rollouts were rendered in training."""

import json
from pathlib import Path

import pytest

from learner_service.publish import _copy_tokenizer
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2

CHAT = [{"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": "Create a task called Ünïcode."},
        {"role": "assistant", "content": '<tool_call>\n{"name": "create_task", "arguments": {"title": "x"}}\n</tool_call>'}]


def test_smollm2_tokenizer_is_published_identical(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    out = tmp_path / "v1"
    out.mkdir()
    _copy_tokenizer(Path(smollm2_dir), out)
    src, pub = AutoTokenizer.from_pretrained(smollm2_dir), AutoTokenizer.from_pretrained(out)
    assert pub.get_vocab() == src.get_vocab() and len(pub) == len(src) == 49152
    assert pub.chat_template["default"] == src.chat_template and "<|im_start|>" in src.chat_template
    assert set(pub.chat_template) == {"default", "tool_use"}
    assert (pub.eos_token, pub.pad_token, pub.all_special_tokens) == (src.eos_token, src.pad_token, src.all_special_tokens)
    ids = src.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert pub.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False) == ids
    assert (out / "generation_config.json").read_bytes() == (Path(smollm2_dir) / "generation_config.json").read_bytes()


def test_files_outside_the_old_fixed_list_are_published(tmp_path, smollm2_dir):
    """A tokenizer with a named second chat template keeps it in additional_chat_templates/,
    which the old fixed list of file names did not copy."""
    from transformers import AutoTokenizer

    tool_use = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = {"default": tok.chat_template, "tool_use": tool_use}
    src, out = tmp_path / "src", tmp_path / "v1"
    tok.save_pretrained(src)
    assert (src / "additional_chat_templates" / "tool_use.jinja").is_file()
    out.mkdir()
    _copy_tokenizer(src, out)
    pub = AutoTokenizer.from_pretrained(out)
    assert pub.chat_template == {"default": tok.chat_template["default"], "tool_use": tool_use}
    assert pub.apply_chat_template(CHAT[:2], chat_template="tool_use", tokenize=False) == (
        "<system>You are a helpful agent.<user>Create a task called Ünïcode.")


def test_a_folder_without_a_tokenizer_publishes_none(tmp_path):
    out = tmp_path / "v1"
    out.mkdir()
    (tmp_path / "config.json").write_text("{}")
    _copy_tokenizer(tmp_path, out)
    assert list(out.iterdir()) == []


def _call(name: str, args: dict, call_id: str) -> tuple[str, common_pb2.ToolCall, dict]:
    """A Hermes tool call as the policy writes it, as the env gets it, and as an OpenAI client sends it back."""
    text = f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(args)}}}\n</tool_call>'
    return (text, common_pb2.ToolCall(id=call_id, name=name, arguments_json=json.dumps(args)),
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}})


@pytest.mark.parametrize("arguments", ["string", "object"])
def test_published_template_renders_tools_as_training_did(tmp_path, smollm2_dir, env_core, arguments):
    """A retail episode as the rollout service renders it (ChatTemplateFormatter: the first prompt,
    generated tool calls, the env's suffixes) and the same conversation as an OpenAI client (τ²-Bench's
    agent through `vllm serve`) sends it, rendered by the published version's template with tools:
    the same token ids. Tool-call arguments arrive as a JSON string (the OpenAI wire) or, after
    vLLM's own parsing, as an object; a non-ASCII argument is escaped as `json.dumps` does."""
    from transformers import AutoTokenizer

    from env_service.client import LocalEnvClient
    from rollout_service.formatting import ChatTemplateFormatter, tool_schema

    out = tmp_path / "v1"
    out.mkdir()
    _copy_tokenizer(Path(smollm2_dir), out)
    src, pub = AutoTokenizer.from_pretrained(smollm2_dir), AutoTokenizer.from_pretrained(out)
    env = LocalEnvClient(core=env_core)
    first = env.reset(env_pb2.ResetRequest(env="retail", task_id="0"))
    assert len(first.tools) > 10 and first.system_prompt
    fmt = ChatTemplateFormatter(src)
    ids = fmt.initial_prompt(first.system_prompt, first.tools, first.observation)
    roles = {common_pb2.ROLE_USER: "user", common_pb2.ROLE_ASSISTANT: "assistant"}
    chat = [{"role": "system", "content": first.system_prompt}] + [
        {"role": roles[m.role], "content": m.content} for m in first.observation if m.role != common_pb2.ROLE_SYSTEM]
    assert [m["role"] for m in chat] == ["system", "assistant", "user"]
    turns = [("", _call("find_user_id_by_email", {"email": "Ünïcode@example.com"}, "call_0"), "user_1"),
             ("Found you.", _call("get_user_details", {"user_id": "user_1"}, "call_1"), '{"name": "X"}')]
    for content, (text, call, wire), result in turns:
        ids += src.encode((f"{content}\n{text}" if content else text) + "<|im_end|>", add_special_tokens=False)
        ids += fmt.suffix([common_pb2.Message(role=common_pb2.ROLE_TOOL, content=result, tool_call_id=call.id)], ended_turn=True)
        if arguments == "object":
            wire = {**wire, "function": {**wire["function"], "arguments": json.loads(wire["function"]["arguments"])}}
        chat += [{"role": "assistant", "content": content or None, "tool_calls": [wire]},
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    # tools as vLLM's OpenAI server hands them to the template (FunctionDefinition.model_dump: extra keys)
    tools = [{**t, "function": {**t["function"], "strict": True}} for t in map(tool_schema, first.tools)]
    served = pub.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert src.decode(served) == src.decode(ids)
    assert list(served) == ids
    assert "\\u00dcn\\u00efcode@example.com" in src.decode(served)
    # without tools the model's own template renders, as before
    assert pub.apply_chat_template(CHAT, tokenize=False) == src.apply_chat_template(CHAT, tokenize=False)


def test_a_template_that_renders_tools_is_published_unchanged(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    native = "{% if tools %}[{{ tools | length }} tools]{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = native
    src, out = tmp_path / "src", tmp_path / "v1"
    tok.save_pretrained(src)
    out.mkdir()
    _copy_tokenizer(src, out)
    assert AutoTokenizer.from_pretrained(out).chat_template == native


def test_rollouts_of_a_published_version_render_as_before(tmp_path, smollm2_dir):
    """The rollout service on a published version (eval, a resumed engine) picks the same format and
    renders the same ids as on the source folder: the tool_use template is for serving only."""
    from transformers import AutoTokenizer

    from rollout_service.formatting import check_round_trip, formatter_factory

    out = tmp_path / "v1"
    out.mkdir()
    _copy_tokenizer(Path(smollm2_dir), out)
    src, pub = (formatter_factory("hermes", AutoTokenizer.from_pretrained(p))() for p in (smollm2_dir, out))
    assert pub.native_tools is False and src.native_tools is False
    check_round_trip(pub, "v1")
    assert pub.round_trip() == src.round_trip()
