"""``attn_implementation="sinkflex"`` inside real transformers models (tiny random configs, CPU):
gpt-oss against its own eager attention — logits and every parameter's gradient, float32
and float64 — plus padding, packing, generation with a cache, Llama, and refusals."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.attention import build_tiny_gpt_oss

SEQ = 24  # > sliding_window (5): the sliding layer really slides


def _logits_and_grads(model, impl, input_ids, **kwargs):
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids, **kwargs).logits
    keep = kwargs.get("attention_mask")
    keep = keep.bool() if isinstance(keep, torch.Tensor) else torch.ones_like(input_ids, dtype=torch.bool)
    weights = torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)  # a non-trivial loss
    (logits[keep] * weights).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), keep, grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("padded", [False, True])
def test_gpt_oss_matches_eager_logits_and_all_grads(registered_sinkflex, dtype, tol, padded):
    model = build_tiny_gpt_oss(dtype)
    ids = torch.randint(0, 97, (2, SEQ), generator=torch.Generator().manual_seed(1))
    kwargs = {}
    if padded:  # row 1: 7 left-padding tokens (fully masked rows under the causal mask)
        kwargs["attention_mask"] = torch.ones(2, SEQ, dtype=torch.long)
        kwargs["attention_mask"][1, :7] = 0
    want, keep, want_grads = _logits_and_grads(model, "eager", ids, **kwargs)
    got, _, got_grads = _logits_and_grads(model, registered_sinkflex, ids, **kwargs)
    assert torch.isfinite(got).all() and all(torch.isfinite(g).all() for g in got_grads.values())
    torch.testing.assert_close(got[keep], want[keep], atol=tol, rtol=tol)
    assert set(got_grads) == set(want_grads) and any(name.endswith("sinks") for name in got_grads)
    for name, grad in want_grads.items():
        scale = grad.abs().max().clamp_min(1.0)
        torch.testing.assert_close(got_grads[name] / scale, grad / scale, atol=tol, rtol=tol, msg=name)
    # the comparison is sensitive: the sinks move the logits far beyond the tolerance
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.add_(3.0)
        moved = model(input_ids=ids, **kwargs).logits
    assert (moved - got)[keep].abs().max() > 1e3 * tol


def test_gpt_oss_packed_documents_equal_separate_runs_and_eager(registered_sinkflex):
    """Packed sequences via a document `MaskSpec` per layer type: no cross-document attention,
    equal to separate runs, and to transformers' eager attention given the same mask densely."""
    from sinkflex.attention import generate_causal, generate_document, generate_sliding_window
    from sinkflex.attention.hf import layer_masks

    model = build_tiny_gpt_oss(torch.float64)
    lengths = [9, 15]
    n = sum(lengths)
    ids = torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(2))
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    doc_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))[None]
    documents = generate_document(doc_ids)
    dense = {  # the same masks as 0 / -inf 4D tensors, for transformers' eager attention
        "full_attention": (generate_causal() & documents).dense(1, n, n, torch.device("cpu"))[:, None],
        "sliding_attention": (generate_sliding_window(5) & documents).dense(1, n, n, torch.device("cpu"))[:, None],
    }
    dense = {k: torch.zeros(v.shape, dtype=torch.float64).masked_fill(~v, float("-inf")) for k, v in dense.items()}
    model.set_attn_implementation(registered_sinkflex)
    packed, _, packed_grads = _logits_and_grads(
        model, registered_sinkflex, ids, position_ids=position_ids, attention_mask=layer_masks(model.config, documents)
    )
    with torch.no_grad():
        separate = torch.cat([model(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, separate, atol=1e-10, rtol=1e-10)
    with torch.no_grad():  # the same masks given densely to sinkflex (user 4D masks are accepted)
        dense_ours = model(input_ids=ids, position_ids=position_ids, attention_mask=dense).logits
    torch.testing.assert_close(dense_ours, packed, atol=1e-10, rtol=1e-10)
    eager, _, eager_grads = _logits_and_grads(model, "eager", ids, position_ids=position_ids, attention_mask=dense)
    torch.testing.assert_close(packed, eager, atol=1e-10, rtol=1e-10)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-10, rtol=1e-10, msg=name)


def test_llama_packed_position_ids_equal_separate_runs(registered_sinkflex):
    """Llama detects packing from position_ids (no cache): the sinkflex mask honours it."""
    model = _tiny_llama()
    model.set_attn_implementation(registered_sinkflex)
    lengths = [7, 13]
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(6))
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        separate = torch.cat([model(input_ids=part).logits for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, separate, atol=1e-10, rtol=1e-10)


def test_gpt_oss_right_padding_trains_without_nan(registered_sinkflex):
    model = build_tiny_gpt_oss(torch.float32)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 10:] = 0
    mask[2, 1:] = 0
    ids = torch.randint(0, 97, (3, SEQ), generator=torch.Generator().manual_seed(3))
    logits, keep, grads = _logits_and_grads(model, registered_sinkflex, ids, attention_mask=mask)
    assert torch.isfinite(logits).all() and all(torch.isfinite(g).all() for g in grads.values())
    want, _, _ = _logits_and_grads(model, "eager", ids, attention_mask=mask)
    torch.testing.assert_close(logits[keep], want[keep], atol=2e-5, rtol=2e-5)


def test_gpt_oss_generate_with_cache_matches_eager(registered_sinkflex):
    """Greedy decoding past the window: cache offsets and the sliding layer's cache are honoured."""
    model = build_tiny_gpt_oss(torch.float64).eval()
    prompt = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left-padded prompt, as in batched generation
    runs = {}
    for impl in ("eager", registered_sinkflex):
        model.set_attn_implementation(impl)
        runs[impl] = model.generate(
            prompt, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    assert torch.equal(runs["eager"].sequences, runs[registered_sinkflex].sequences)
    for a, b in zip(runs["eager"].logits, runs[registered_sinkflex].logits, strict=True):
        torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-9)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128, initializer_range=0.3,
    )  # fmt: skip
    return LlamaForCausalLM(config).double()


def test_llama_without_sinks_matches_sdpa(registered_sinkflex):
    model = _tiny_llama()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, 15:] = 0
    want, keep, want_grads = _logits_and_grads(model, "sdpa", ids, attention_mask=mask)
    got, _, got_grads = _logits_and_grads(model, registered_sinkflex, ids, attention_mask=mask)
    torch.testing.assert_close(got[keep], want[keep], atol=1e-10, rtol=1e-10)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-10, rtol=1e-10, msg=name)


def test_refusals_are_loud(registered_sinkflex):
    from sinkflex.attention.hf import sinkflex_attention_forward

    model = build_tiny_gpt_oss(torch.float32)
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="refusing to drop them"):
        sinkflex_attention_forward(attn, q, kv, kv, None, scaling=0.3)
    attn.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        sinkflex_attention_forward(attn, q, kv, kv, None, dropout=0.1, s_aux=attn.sinks)
    with pytest.raises(NotImplementedError, match="softcap"):
        sinkflex_attention_forward(attn, q, kv, kv, None, s_aux=attn.sinks, softcap=30.0)
    bias = torch.randn(1, 1, 6, 6)
    with pytest.raises(ValueError, match="additive attention biases"):
        sinkflex_attention_forward(attn, q, kv, kv, bias, s_aux=attn.sinks)
