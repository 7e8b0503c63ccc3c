"""Tool-call parsing (Hermes and harmony) and token-exact prompt suffixes (no engine).

Model output is untrusted input: broken blocks give a bounded parse_error and never raise, and
arbitrary JSON arguments round-trip (hypothesis) through each format's rendering and parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rollout_service.formatting import (
    ChatTemplateFormatter,
    HarmonyFormatter,
    hermes_call_text,
)
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


# ----------------------------------------------------------------------------- untrusted model output

def test_hermes_closing_tag_inside_a_string_argument_does_not_cut_the_call():
    args = '{"note": "write </tool_call> then <tool_call> literally", "q": "a\\"</tool_call>\\\\"}'
    text = f'Done.\n<tool_call>\n{{"name": "send_note", "arguments": {args}}}\n</tool_call>\nbye'
    p = parse_hermes(text)
    assert p.ok, p.parse_error
    assert [c.name for c in p.calls] == ["send_note"]
    assert p.calls[0].arguments_json == args
    assert json.loads(p.calls[0].arguments_json)["note"] == "write </tool_call> then <tool_call> literally"
    assert p.content == "Done.\n\nbye"


def test_hermes_several_calls_with_tags_in_strings_and_unicode_kept_exactly():
    a1 = '{"city": "Zürich", "emoji": "😀\U0001F9EA", "escaped": "\\u00e9\\ud83d\\ude00"}'
    a2 = '{ "nested" : { "list" : [ 1 , -2.5e3 , true , null , { "deep" : "</tool_call>" } ] } }'
    text = (f'<tool_call>{{"name": "a", "arguments": {a1}}}</tool_call>'
            f'<tool_call>\n  {{"name": "b", "parameters": {a2}}}  \n</tool_call>'
            '<tool_call>{"name": "c"}</tool_call>')
    p = parse_hermes(text)
    assert p.ok, p.parse_error
    assert [(c.name, c.arguments_json) for c in p.calls] == [("a", a1), ("b", a2), ("c", "{}")]
    assert json.loads(a1)["escaped"] == "é😀"
    assert p.content is None


def test_hermes_arguments_key_inside_another_member_is_not_taken():
    text = '<tool_call>{"name": "f", "meta": {"arguments": {}}, "arguments": { }}</tool_call>'
    p = parse_hermes(text)
    assert p.ok and p.calls[0].arguments_json == "{ }"  # the top-level member, as written


@pytest.mark.parametrize("text, why", [
    ('<tool_call>{"name": "f", "arguments": {"q": "cut her', "truncated JSON"),
    ('<tool_call>{"name": "f", "arguments": {"q": "a</tool_call>b', "truncated JSON"),
    ('<tool_call>{"name": "f", "arguments": {"q": [1, 2', "truncated JSON"),
    ('<tool_call>{"name": "f", "arguments": {"q": 1}} and more', "text after the JSON object"),
    ('<tool_call>{"name": "f", "arguments": {"q": 1}}\n', "missing </tool_call>"),
    ('<tool_call></tool_call>', "invalid JSON"),
    ('<tool_call>["f", {}]</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', "not a JSON object"),
    ('<tool_call>{"name": "f", "arguments": {"q": ' + "[" * 100_000 + "</tool_call>", "not decodable"),
    ('<tool_call>{"name": "f", "arguments": {"q": ' + "9" * 5000 + "}}</tool_call>", "not decodable"),
])
def test_hermes_broken_blocks_give_a_clear_bounded_error_and_never_raise(text, why):
    from rollout_service.parsers import MAX_PARSE_ERROR_CHARS

    p = parse_hermes(text)
    assert not p.ok and why in p.parse_error and p.parse_error.startswith("tool call 0: ")
    assert len(p.parse_error) <= 200 <= MAX_PARSE_ERROR_CHARS
    assert p.content == text and p.calls == ()


def test_hermes_good_call_next_to_a_broken_one_is_kept_but_the_turn_is_an_error():
    text = ('<tool_call>{"name": "ok", "arguments": {"x": "</tool_call>"}}</tool_call>'
            '<tool_call>{"name": "bad", "arguments": {"x": 1}</tool_call>'
            '<tool_call>{"name": "ok2", "arguments": {}}</tool_call>')
    p = parse_hermes(text)
    assert p.parse_error.startswith("tool call 1: invalid JSON") and "tool call 0" not in p.parse_error
    assert [c.name for c in p.calls] == ["ok", "ok2"]  # kept for the record; the agent executes none on an error


def test_hermes_parse_error_is_bounded_however_many_blocks_break():
    from rollout_service.parsers import MAX_PARSE_ERROR_CHARS

    p = parse_hermes("<tool_call>{oops}</tool_call>" * 5000)
    assert len(p.parse_error) <= MAX_PARSE_ERROR_CHARS and "more error(s)" in p.parse_error


# ----------------------------------------------------------------------------- round trip (hypothesis)

_NASTY = ["</tool_call>", "<tool_call>", '"', "\\", "\\u0000", "\n", "\r\n", "\t", "\x00", "\u2028", "😀", "\U0010FFFF",
          "é", "<|end|>", "<|call|>", "<|im_end|>", '{"name": "x", "arguments": {}}', "}", "{", "'", "/", " "]
_strings = st.one_of(st.text(max_size=12), st.lists(st.sampled_from(_NASTY) | st.text(max_size=3), max_size=6).map("".join))
_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | _strings
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_strings, inner, max_size=4),
                       max_leaves=12)
_arguments = st.dictionaries(_strings, _values, max_size=5)
_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
_dumps = st.sampled_from([{}, {"ensure_ascii": False}, {"indent": 2}, {"separators": (",", ":"), "ensure_ascii": False}])
_FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FAST
@given(name=_names, args=_arguments, dump=_dumps, before=_strings)
def test_hermes_round_trip_of_arbitrary_arguments(name, args, dump, before):
    """The formatter's rendering of an assistant call (`hermes_call_text`, what the model sees
    in its history and is prompted to write) parses back to the same name and arguments."""
    arguments_json = json.dumps(args, **dump)
    text = hermes_call_text(common_pb2.ToolCall(name=name, arguments_json=arguments_json))
    p = parse_hermes(before.replace("<tool_call>", "") + "\n" + text + "\n" + text)
    assert p.ok, p.parse_error
    assert [c.name for c in p.calls] == [name, name]
    assert p.calls[0].arguments_json == arguments_json  # exactly as written
    assert json.loads(p.calls[1].arguments_json) == args


def _missing_bytes(tok) -> frozenset[int]:
    """Bytes without a token of their own in a GPT-2 style byte-level vocabulary."""
    if not hasattr(tok, "_sinkflex_missing_bytes"):
        bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        vocab = tok.get_vocab()
        tok._sinkflex_missing_bytes = frozenset(b for b, c in zip(bs, cs) if chr(c) not in vocab)
    return tok._sinkflex_missing_bytes


@_FAST
@given(name=_names, args=_arguments, dump=_dumps)
def test_hermes_round_trip_through_the_tokenizer(smollm2_tokenizer, name, args, dump):
    """Model tokens -> ChatTemplateFormatter.parse: the decoded text keeps every character of the arguments.

    Only text the model can write: SmolLM2's byte-level vocabulary has no token for the
    bytes 0x04 0x06 0x13 0x14 0x16 0x1d 0xc0 0xc1 0xf1 0xf2 0xf5-0xff, so no sampled reply
    holds U+40000..U+BFFFF (planes 4-11, unassigned) or those raw control characters, and
    the tokenizer drops them when encoding (JSON escapes the control characters anyway).
    """
    fmt = ChatTemplateFormatter(smollm2_tokenizer)
    arguments_json = json.dumps(args, **dump)
    text = hermes_call_text(common_pb2.ToolCall(name=name, arguments_json=arguments_json))
    assume(not set(text.encode()) & _missing_bytes(smollm2_tokenizer))
    p = fmt.parse(smollm2_tokenizer.encode(text, add_special_tokens=False) + [fmt.eot_id])
    assert p.ok, p.parse_error
    assert [c.name for c in p.calls] == [name] and p.calls[0].arguments_json == arguments_json
    assert json.loads(p.calls[0].arguments_json) == args


@pytest.fixture(scope="module")
def harmony_formatter():
    return HarmonyFormatter()


@_FAST
@given(name=_names, args=_arguments, dump=_dumps)
def test_harmony_round_trip_of_arbitrary_arguments(harmony_formatter, name, args, dump):
    """The HarmonyFormatter's rendering of an assistant call (as in the history it prompts
    with) parsed as a completion (the tokens after ``<|start|>assistant``)."""
    fmt = harmony_formatter
    arguments_json = json.dumps(args, **dump)
    call = common_pb2.ToolCall(id="call_0_0", name=name, arguments_json=arguments_json)
    msg = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="", tool_calls=[call])
    ids = [t for hm in fmt._to_harmony(msg) for t in fmt.enc.render(hm)]
    head = fmt.enc.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(head)] == head
    p = parse_harmony(ids[len(head):])
    assert p.ok, p.parse_error
    assert [c.name for c in p.calls] == [name] and p.calls[0].arguments_json == arguments_json
    assert json.loads(p.calls[0].arguments_json) == args
