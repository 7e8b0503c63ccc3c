"""Tool-call parsing (Hermes and harmony) and token-exact prompt suffixes (no engine)."""

from __future__ import annotations

import json

import pytest

from rollout_service.formatting import ChatTemplateFormatter, HarmonyFormatter
from rollout_service.parsers import harmony_encoding, parse_harmony, parse_hermes
from sinkflex.api.common.v1 import common_pb2

NESTED = '{"order_id": "#W1", "items": [{"id": "a", "options": {"color": "red", "size": {"eu": 42}}}], "note": null}'


def test_hermes_two_calls_in_one_message():
    text = ('Let me check.\n<tool_call>\n{"name": "find_user_id_by_email", "arguments": {"email": "a@b.c"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_order_details", "arguments": {"order_id": "#W2"}}</tool_call>')
    p = parse_hermes(text)
    assert p.ok
    assert [c.name for c in p.calls] == ["find_user_id_by_email", "get_order_details"]
    assert json.loads(p.calls[0].arguments_json) == {"email": "a@b.c"}
    assert p.content == "Let me check."


def test_hermes_nested_arguments_kept_exactly():
    text = f'<tool_call>\n{{"name": "modify_pending_order_items", "arguments": {NESTED}}}\n</tool_call>'
    p = parse_hermes(text)
    assert p.ok and len(p.calls) == 1
    assert p.calls[0].arguments_json == NESTED  # the exact text: key order, spacing, null kept
    assert p.content is None


@pytest.mark.parametrize("text, why", [
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "invalid JSON"),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', "missing </tool_call>"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>', "not a JSON object"),
])
def test_hermes_malformed_goes_to_env_as_written(text, why):
    p = parse_hermes(text)
    assert not p.ok and why in p.parse_error
    assert p.content == text  # the env sees exactly what the model wrote
    assert p.calls == ()


def test_hermes_plain_reply():
    p = parse_hermes("Sure, what is your email?")
    assert p.ok and p.calls == () and p.content == "Sure, what is your email?"


def _harmony_ids(text: str) -> list[int]:
    return harmony_encoding().encode(text, allowed_special="all")


def test_harmony_two_calls_and_nested_arguments():
    ids = _harmony_ids(
        "<|channel|>analysis<|message|>Need the user and the order.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.find_user_id_by_email <|constrain|>json<|message|>{"email": "a@b.c"}<|call|>'
        f"<|start|>assistant<|channel|>commentary to=functions.modify_pending_order_items <|constrain|>json<|message|>{NESTED}<|call|>")
    p = parse_harmony(ids)
    assert p.ok, p.parse_error
    assert [c.name for c in p.calls] == ["find_user_id_by_email", "modify_pending_order_items"]
    assert p.calls[1].arguments_json == NESTED
    assert p.content is None  # analysis is reasoning, not a reply


def test_harmony_final_reply_and_bad_arguments():
    p = parse_harmony(_harmony_ids("<|channel|>final<|message|>Your order is on its way.<|return|>"))
    assert p.ok and p.content == "Your order is on its way." and p.calls == ()
    bad = parse_harmony(_harmony_ids("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{not json<|call|>"))
    assert not bad.ok and "functions.f" in bad.parse_error and bad.calls == ()


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _msg(role, content, **kw):
    return common_pb2.Message(role=role, content=content, **kw)


def test_chat_template_suffix_is_token_exact(smollm2_tokenizer):
    """initial prompt + generated ids + suffix == one render of the whole conversation."""
    tok = smollm2_tokenizer
    fmt = ChatTemplateFormatter(tok)
    tools = [common_pb2.ToolSpec(name="get_order_details", description="Get an order.",
                                 parameters_json_schema='{"type": "object", "properties": {"order_id": {"type": "string"}}}')]
    obs = [_msg(common_pb2.ROLE_ASSISTANT, "Hi! How can I help you today?"), _msg(common_pb2.ROLE_USER, "Where is order #W1?")]
    prompt = fmt.initial_prompt("You are a retail agent.", tools, obs)
    reply = '<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W1"}}\n</tool_call>'
    generated = tok.encode(reply, add_special_tokens=False) + [fmt.eot_id]  # as the engine emits it
    env = [_msg(common_pb2.ROLE_TOOL, '{"status": "delivered"}', tool_call_id="call_0_0"),
           _msg(common_pb2.ROLE_USER, "Thanks!")]
    ids = prompt + generated + fmt.suffix(env, ended_turn=True)
    sys_text = fmt.tok.decode(prompt).split("<|im_end|>")[0].removeprefix("<|im_start|>system\n")
    whole = [{"role": "system", "content": sys_text}, {"role": "assistant", "content": obs[0].content},
             {"role": "user", "content": obs[1].content}, {"role": "assistant", "content": reply}] + [fmt.to_chat(m) for m in env]
    expected = list(tok.apply_chat_template(whole, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert ids == expected
    assert tok.decode(ids[len(prompt) + len(generated):]).startswith("\n<|im_start|>tool\n<tool_response>")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert fmt.parse(generated).calls[0].arguments_json == '{"order_id": "#W1"}'


def test_chat_template_suffix_after_truncation_starts_with_template_eot(smollm2_tokenizer):
    fmt = ChatTemplateFormatter(smollm2_tokenizer)
    fmt.initial_prompt("S", [], [_msg(common_pb2.ROLE_USER, "hi")])
    env = [_msg(common_pb2.ROLE_USER, "go on")]
    ended, cut = fmt.suffix(env, ended_turn=True), fmt.suffix(env, ended_turn=False)
    assert cut == [fmt.eot_id] + ended  # the closing token is template text (mask 0), never a sampled one


def test_harmony_formatter_renders_prompt_and_tool_suffix():
    fmt = HarmonyFormatter()
    enc = fmt.enc
    tools = [common_pb2.ToolSpec(name="get_order_details", description="Get an order.",
                                 parameters_json_schema='{"type": "object", "properties": {"order_id": {"type": "string"}}}')]
    prompt = fmt.initial_prompt("You are a retail agent.", tools, [_msg(common_pb2.ROLE_USER, "Where is #W1?")])
    text = enc.decode(prompt)
    assert "get_order_details" in text and text.endswith("<|start|>assistant")
    call = common_pb2.ToolCall(id="call_0_0", name="get_order_details", arguments_json='{"order_id": "#W1"}')
    fmt.note_calls([call])
    suffix = enc.decode(fmt.suffix([_msg(common_pb2.ROLE_TOOL, "delivered", tool_call_id="call_0_0")], ended_turn=True))
    assert suffix.startswith("<|start|>functions.get_order_details<|channel|>commentary to=assistant<|message|>delivered<|end|>")
    assert suffix.endswith("<|start|>assistant")
    assert set(fmt.stop_token_ids) == set(enc.stop_tokens_for_assistant_actions())  # <|call|>, <|return|>
