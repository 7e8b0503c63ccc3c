"""Per-family formatting and parsing without an engine: the start-up round-trip check (passes for
each family's rules, refuses a template that cannot be extended token-exactly, naming the model and
the difference), Qwen3 reasoning kept out of the visible reply, Llama 3.x bare-JSON calls, gpt-oss's
reasoning effort."""

from __future__ import annotations

import json

import pytest

from rollout_service.formatting import (
    ChatTemplateFormatter,
    HarmonyFormatter,
    check_round_trip,
    formatter_factory,
    tool_schema,
)
from sinkflex.api.common.v1 import common_pb2
from tests.fixtures.families import make_family_tokenizer


@pytest.fixture(scope="module")
def toks(smollm2_dir):
    from transformers import AutoTokenizer

    return {"hermes": AutoTokenizer.from_pretrained(smollm2_dir),
            "qwen3": make_family_tokenizer("qwen3", smollm2_dir), "llama3": make_family_tokenizer("llama3", smollm2_dir)}


@pytest.mark.parametrize("family, options, exact", [
    ("hermes", {}, True), ("qwen3", {"enable_thinking": True}, True), ("qwen3", {"enable_thinking": False}, False),
    ("llama3", {}, True)])
def test_round_trip_check_passes_each_family(toks, family, options, exact):
    make = formatter_factory(family, toks[family], model=f"tiny-{family}", **options)
    stream, whole, start, end = make().round_trip()
    assert (stream == whole) is exact  # Qwen3 thinking off: its template drops the prompt's empty <think> block
    if not exact:
        text = toks[family].decode(stream[start:end])
        assert "<think>\n\n</think>\n\n" in text and "<think>" not in toks[family].decode(whole[start:end])
        assert stream[:start] == whole[:start] and stream[end:] == whole[len(whole) - (len(stream) - end):]


def test_round_trip_check_refuses_and_names_the_model(smollm2_dir):
    """Llama 3's rules over SmolLM2's stock pre-tokenizer: "\\n\\n" at the end of the generation prompt
    is one token alone but not before the reply, so the stream cannot be extended token-exactly."""
    from transformers import AutoTokenizer

    from tests.fixtures.families import LLAMA3_TEMPLATE, FAMILY_MODELS

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": FAMILY_MODELS["llama3"][1]})
    tok.chat_template = LLAMA3_TEMPLATE.strip()
    with pytest.raises(ValueError, match=r"model my/llama: .*llama3.*at token \d+: '\\n\\n\{\"name\""):
        formatter_factory("llama3", tok, model="my/llama")


def test_qwen3_reasoning_is_kept_out_of_the_visible_reply(toks):
    tok = toks["qwen3"]
    fmt = ChatTemplateFormatter(tok, "qwen3", enable_thinking=True)
    eot = [fmt.eot_id]
    call = '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W1"}}\n</tool_call>'
    p = fmt.parse(tok.encode(f"<think>\nI should look up <tool_call> the order.\n</think>\n\nLet me check.\n{call}") + eot)
    assert p.ok and p.content == "Let me check." and [c.name for c in p.calls] == ["get_order"]
    assert "look up" in p.reasoning and "<think>" not in p.content
    cut = fmt.parse(tok.encode("<think>\nstill thinking about <tool_call>"))  # cut inside its reasoning
    assert cut.content is None and cut.calls == () and "inside its reasoning" in cut.parse_error
    plain = fmt.parse(tok.encode("<think>\nok\n</think>\n\nYour order shipped.") + eot)
    assert plain.ok and plain.content == "Your order shipped." and plain.reasoning.strip() == "ok"
    off = ChatTemplateFormatter(tok, "qwen3", enable_thinking=False)
    assert off.parse(tok.encode(call) + eot).calls[0].arguments_json == '{"order_id": "#W1"}'


def test_llama3_bare_json_calls(toks):
    tok = toks["llama3"]
    fmt = ChatTemplateFormatter(tok, "llama3")
    # the template ends an assistant tool-call turn with <|eot_id|> (no builtin_tools): the only stop asked for
    assert fmt.stop_token_ids == [tok.convert_tokens_to_ids("<|eot_id|>")]
    call = tok.encode('{"name": "get_order", "parameters": {"order_id": "#W1", "n": [1, 2]}}')
    whole = fmt._render([{"role": "user", "content": "U"}, fmt.to_chat(common_pb2.Message(
        role=common_pb2.ROLE_ASSISTANT, tool_calls=[common_pb2.ToolCall(name="get_order", arguments_json='{"order_id": "#W1"}')]))],
        add_generation_prompt=False)
    assert whole[-1] == fmt.eot_id
    for end in (fmt.eot_id, tok.convert_tokens_to_ids("<|eom_id|>")):  # <|eom_id|>: a model whose generation_config stops there
        p = fmt.parse(call + [end])
        assert p.ok and p.content is None and p.calls[0].name == "get_order"
        assert json.loads(p.calls[0].arguments_json) == {"order_id": "#W1", "n": [1, 2]}
    tagged = fmt.parse(tok.encode('<|python_tag|>{"name": "f", "arguments": {}}'))
    assert tagged.ok and tagged.calls[0].name == "f"
    text = fmt.parse(tok.encode("Your order {#W1} shipped.") + [fmt.eot_id])
    assert text.ok and text.calls == () and text.content == "Your order {#W1} shipped."
    broken = fmt.parse(tok.encode('{"name": "f", "parameters": {"a": '))
    assert not broken.ok and broken.content == '{"name": "f", "parameters": {"a": ' and broken.calls == ()


def test_llama3_tools_without_a_user_message(toks):
    """A solo-mode episode's first prompt has no user message: the Llama 3 rules (as the stock template)
    refuse tools there unless `tools_in_user_message` is false; the formatter sets it, and the tools
    are rendered in the system turn."""
    tok = toks["llama3"]
    fmt = ChatTemplateFormatter(tok, "llama3")
    spec = common_pb2.ToolSpec(name="get_order", description="Look up an order.",
                               parameters_json_schema='{"type": "object", "properties": {"order_id": {"type": "string"}}}')
    with pytest.raises(Exception, match="no first user message"):
        tok.apply_chat_template([{"role": "system", "content": "S"}], tools=[tool_schema(spec)], add_generation_prompt=True)
    text = tok.decode(fmt.initial_prompt("You are a shop agent.", [spec], []))
    system = text.split("<|eot_id|>")[0]
    assert '"name": "get_order"' in system and system.endswith("You are a shop agent.")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_harmony_reasoning_effort_is_configurable(effort):
    make = formatter_factory("harmony", None, model="gpt-oss", reasoning_effort=effort)
    fmt = make()
    text = fmt.enc.decode(fmt.initial_prompt("S", [], [common_pb2.Message(role=common_pb2.ROLE_USER, content="hi")]))
    assert f"Reasoning: {effort}" in text
    check_round_trip(fmt, "gpt-oss")
    with pytest.raises(ValueError, match="reasoning_effort"):
        HarmonyFormatter("max")
