"""Sink attention kernels (reference, blockwise CPU path, eager flex forward) against each other,
against closed-form values and against transformers' gpt-oss eager attention."""

from __future__ import annotations

import math

import pytest
import torch

from sinkflex.attention import (
    generate_causal,
    generate_document,
    generate_padding,
    generate_sliding_window,
    sink_attention,
)
from sinkflex.attention.blockwise import blockwise_sink_attention
from sinkflex.attention.flex import flex_sink_attention
from sinkflex.attention.reference import reference_sink_attention

F64 = torch.float64


def _inputs(batch=2, n_q=8, n_kv=2, n=64, dim=16, dtype=F64, seed=0, sink_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_q, n, dim, generator=gen, dtype=F64).to(dtype).requires_grad_()
    k = torch.randn(batch, n_kv, n, dim, generator=gen, dtype=F64).to(dtype).requires_grad_()
    v = torch.randn(batch, n_kv, n, dim, generator=gen, dtype=F64).to(dtype).requires_grad_()
    s = (sink_scale * torch.randn(n_q, generator=gen, dtype=F64)).to(dtype).requires_grad_()
    grad = torch.randn(batch, n_q, n, dim, generator=gen, dtype=F64).to(dtype)
    return q, k, v, s, grad


def _run(fn, q, k, v, s, grad):
    """Output and gradients (q, k, v, sinks) of ``fn(q, k, v, s)`` for the cotangent ``grad``."""
    out = fn(q, k, v, s)
    params = [t for t in (q, k, v, s) if t is not None]
    grads = torch.autograd.grad(out, params, grad)
    return [out.detach(), *grads]


def _blockwise(mask, **tiles):
    return lambda q, k, v, s: blockwise_sink_attention(q, k, v, s, mask, q.shape[-1] ** -0.5, **tiles)


def _reference(mask):
    return lambda q, k, v, s: reference_sink_attention(q, k, v, s, mask, q.shape[-1] ** -0.5)[0]


def _assert_close(got, want, atol=1e-11, rtol=1e-9):
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


# ---- closed-form values -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_one_key_known_values(backend):
    """q = k = 1, v = 2, s = 0, d = 1, scale 1: O = 2σ(1), dq = dk = −ds = 0.393224, dv = σ(1)."""
    q = torch.ones(1, 1, 1, 1, dtype=F64, requires_grad=True)
    k = torch.ones(1, 1, 1, 1, dtype=F64, requires_grad=True)
    v = torch.full((1, 1, 1, 1), 2.0, dtype=F64, requires_grad=True)
    s = torch.zeros(1, dtype=F64, requires_grad=True)
    out = sink_attention(q, k, v, s, mask=None, scale=1.0, backend=backend)
    out.sum().backward()
    assert out.item() == pytest.approx(1.46212, abs=5e-6)
    assert q.grad.item() == pytest.approx(0.393224, abs=5e-7)
    assert k.grad.item() == pytest.approx(0.393224, abs=5e-7)
    assert v.grad.item() == pytest.approx(0.731059, abs=5e-7)
    assert s.grad.item() == pytest.approx(-0.393224, abs=5e-7)
    sig = 1 / (1 + math.exp(-1))  # exact forms of the rounded values above
    assert out.item() == pytest.approx(2 * sig, rel=1e-14)
    assert s.grad.item() == pytest.approx(-2 * sig * (1 - sig), rel=1e-13)


@pytest.mark.parametrize("backend", ["reference", "cpu", "flex"])
@pytest.mark.parametrize("n_keys,sink", [(1, 0.0), (7, 1.5), (300, -2.0), (300, 4.0)])
def test_uniform_logits_output_is_n_over_n_plus_e_s(backend, n_keys, sink):
    """One head, N keys, all logits 0 (q = 0), V = 1: O = N / (N + e^s)."""
    q = torch.zeros(1, 1, 1, 4, dtype=F64)
    k = torch.randn(1, 1, n_keys, 4, dtype=F64)
    v = torch.ones(1, 1, n_keys, 4, dtype=F64)
    out = sink_attention(q, k, v, torch.tensor([sink], dtype=F64), mask=None, backend=backend)
    torch.testing.assert_close(out, torch.full_like(out, n_keys / (n_keys + math.exp(sink))), atol=1e-7, rtol=1e-7)


# ---- blockwise CPU path against the float64 reference -------------------------------------

MASKS = {
    "none": lambda b, n: None,
    "causal": lambda b, n: generate_causal(),
    "sliding7": lambda b, n: generate_sliding_window(7),
    "sliding1": lambda b, n: generate_sliding_window(1),
    "causal_padding": lambda b, n: generate_causal() & generate_padding(torch.tensor([n, n // 3][:b])),
    "left_padding": lambda b, n: (
        generate_causal()
        & generate_padding(attention_mask=(torch.arange(n) >= torch.tensor([[0], [n // 4]])[:b]).long())
    ),
    "documents": lambda b, n: (
        generate_causal()
        & generate_document(torch.tensor([[0] * (n // 2) + [1] * (n // 4) + [2] * (n - n // 2 - n // 4), [0] * n])[:b])
    ),
    "sliding_documents": lambda b, n: (
        generate_sliding_window(5) & generate_document((torch.arange(n) // 11).expand(b, n).contiguous())
    ),
}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (8, 1)])
def test_blockwise_matches_reference_float64(mask_name, heads):
    q, k, v, s, grad = _inputs(n_q=heads[0], n_kv=heads[1], n=70)
    mask = MASKS[mask_name](2, 70)
    want = _run(_reference(mask), q, k, v, s, grad)
    got = _run(_blockwise(mask, q_tile=16, kv_tile=24), q, k, v, s, grad)  # many ragged tiles
    _assert_close(got, want)


def test_blockwise_default_tiles_and_no_sink():
    q, k, v, _, grad = _inputs(n=600, n_q=4, n_kv=1)
    mask = generate_causal()
    want = _run(_reference(mask), q, k, v, None, grad)
    got = _run(_blockwise(mask), q, k, v, None, grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_gqa_grouping_is_kv_major():
    """Query head h uses kv head h // (Hq // Hkv) and sink h: equal to running each group alone."""
    q, k, v, s, _ = _inputs(n_q=6, n_kv=3, n=20)
    out = sink_attention(q, k, v, s, mask=generate_causal(), backend="cpu")
    for h in range(6):
        alone = sink_attention(
            q[:, h : h + 1], k[:, h // 2 : h // 2 + 1], v[:, h // 2 : h // 2 + 1], s[h : h + 1],
            mask=generate_causal(), backend="reference",
        )  # fmt: skip
        torch.testing.assert_close(out[:, h : h + 1], alone, atol=1e-12, rtol=1e-10)


# ---- masks: window boundary, W = 1, padding, fully masked rows, packing --------------------


@pytest.mark.parametrize("backend", ["reference", "cpu", "flex"])
def test_window_boundary_n300_w128(backend):
    """W = 128 at n = 300: the key at q−127 is attended, the key at q−128 is not."""
    n, window, query = 300, 128, 299
    q = torch.zeros(1, 1, n, 1, dtype=F64)
    k = torch.zeros(1, 1, n, 1, dtype=F64)
    for probe, expect_seen in ((query - 127, True), (query - 128, False)):
        v = torch.zeros(1, 1, n, 1, dtype=F64)
        v[0, 0, probe] = 1.0  # output = attention weight on the probe key
        out = sink_attention(q, k, v, None, mask=generate_sliding_window(window), backend=backend)
        weight = out[0, 0, query, 0].item()
        assert weight == pytest.approx(1 / window if expect_seen else 0.0, abs=1e-7)
    mask = generate_sliding_window(window).dense(1, n, n, torch.device("cpu"))[0]
    assert mask.sum(1).tolist() == [min(i + 1, window) for i in range(n)]


@pytest.mark.parametrize("backend", ["reference", "cpu", "flex"])
def test_window_one_attends_only_to_itself(backend):
    q, k, v, s, _ = _inputs(n=50)
    with torch.no_grad():
        out = sink_attention(q, k, v, s, mask=generate_sliding_window(1), backend=backend)
        scores = (q * k.repeat_interleave(4, 1)).sum(-1) / 4.0  # own score, D = 16
        want = v.repeat_interleave(4, 1) * torch.sigmoid(scores - s.view(1, -1, 1))[..., None]
    torch.testing.assert_close(out, want, atol=1e-7, rtol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_sink_to_minus_infinity_is_plain_attention(backend):
    q, k, v, _, grad = _inputs(n=40)
    mask = generate_causal()
    plain = torch.nn.functional.scaled_dot_product_attention(
        q.repeat_interleave(1, 1), k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True
    )
    for sink in (-1e4, float("-inf")):
        s = torch.full((8,), sink, dtype=F64, requires_grad=True)
        got = _run(lambda q, k, v, s, m=mask: sink_attention(q, k, v, s, mask=m, backend=backend), q, k, v, s, grad)
        torch.testing.assert_close(got[0], plain.detach(), atol=1e-12, rtol=1e-10)
        assert torch.isfinite(got[4]).all() and got[4].abs().max() < 1e-12


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("with_sink", [True, False])
def test_fully_masked_rows_are_zero_without_nan(backend, with_sink):
    """Left padding under a causal mask: the padded queries see no key at all."""
    q, k, v, s, grad = _inputs(n=33)
    s = s if with_sink else None
    mask = generate_causal() & generate_padding(attention_mask=torch.tensor([[1] * 33, [0] * 9 + [1] * 24]))
    got = _run(lambda q, k, v, s, m=mask: sink_attention(q, k, v, s, mask=m, backend=backend), q, k, v, s, grad)
    for t in got:
        assert torch.isfinite(t).all()
    assert got[0][1, :, :9].abs().max() == 0  # fully masked rows give 0
    assert got[1][1, :, :9].abs().max() == 0  # and no gradient to their queries
    assert got[2][1, :, :9].abs().max() == 0 and got[3][1, :, :9].abs().max() == 0  # padded keys unused


def test_all_rows_masked_everywhere():
    q, k, v, s, grad = _inputs(n=20)
    mask = generate_padding(torch.tensor([0, 0]))
    got = _run(_blockwise(mask), q, k, v, s, grad)
    assert all(torch.isfinite(t).all() and t.abs().max() == 0 for t in got)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_packed_documents_equal_separate_runs(backend):
    lengths = [13, 30, 21]
    q, k, v, s, grad = _inputs(batch=1, n=sum(lengths))
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    for base in (generate_causal(), generate_sliding_window(6)):
        mask = base & generate_document(doc_ids)
        packed = _run(lambda q, k, v, s, m=mask: sink_attention(q, k, v, s, mask=m, backend=backend), q, k, v, s, grad)
        start, separate = 0, []
        for n in lengths:
            sl = slice(start, start + n)
            parts = [t[:, :, sl].detach().requires_grad_() for t in (q, k, v)]
            separate.append(
                _run(
                    lambda q, k, v, s, m=base: sink_attention(q, k, v, s, mask=m, backend=backend),
                    *parts,
                    s,
                    grad[:, :, sl],
                )
            )
            start += n
        for i in range(4):  # out, dq, dk, dv: concatenated along the sequence
            torch.testing.assert_close(packed[i], torch.cat([p[i] for p in separate], dim=2), atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(packed[4], sum(p[4] for p in separate), atol=1e-12, rtol=1e-10)


def test_blockwise_skips_tiles_outside_the_window():
    """Sliding window W: the blockwise path evaluates only O(n·W) mask entries."""
    calls = []
    base = generate_sliding_window(8)

    class Counting(type(base)):
        def tile(self, batch, q0, q1, k0, k1, device):
            calls.append((q1 - q0) * (k1 - k0))
            return super().tile(batch, q0, q1, k0, k1, device)

    mask = Counting(base.mask_mod, base.kv_range, base.tile_is_full, base.description)
    q, k, v, s, _ = _inputs(n=512, n_q=2, n_kv=1, dim=4)
    with torch.no_grad():
        blockwise_sink_attention(q, k, v, s, mask, 0.5, q_tile=32, kv_tile=64)
    assert sum(calls) <= 512 * (32 + 8)  # never the 512 × 512 grid


# ---- flex (eager, CPU forward) agrees: checks the masks as flex mask_mods and the LSE rescale


@pytest.mark.parametrize("mask_name", ["none", "causal", "sliding7", "causal_padding", "left_padding", "documents"])
def test_flex_forward_matches_reference(mask_name):
    q, k, v, s, _ = _inputs(n=70, dtype=torch.float32)
    mask = MASKS[mask_name](2, 70)
    with torch.no_grad():
        want, want_lse = reference_sink_attention(q.double(), k.double(), v.double(), s.double(), mask, 0.25)
        got, lse = flex_sink_attention(q, k, v, s, mask, 0.25)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], atol=2e-5, rtol=1e-5)


def test_flex_refuses_cpu_training():
    q, k, v, s, _ = _inputs(n=8, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="CUDA"):
        sink_attention(q, k, v, s, mask=generate_causal(), backend="flex")


# ---- precision: every path within 2x the eager error, against float64 -----------------------


def _gpt_oss_eager(q, k, v, s, causal_mask):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from tests.fixtures.attention import EagerGptOssAttentionStub

    additive = torch.zeros(causal_mask.shape, dtype=q.dtype).masked_fill(~causal_mask, torch.finfo(q.dtype).min)
    module = EagerGptOssAttentionStub(s, q.shape[1], k.shape[1])
    out, _ = eager_attention_forward(module, q, k, v, additive[:, None], scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_precision_within_twice_eager_error(dtype):
    n = 128
    q64, k64, v64, s64, grad64 = _inputs(n=n, n_q=8, n_kv=2, dim=64, seed=3, sink_scale=2.0)
    dense = generate_causal().dense(1, n, n, torch.device("cpu"))
    exact = _run(lambda q, k, v, s: _gpt_oss_eager(q, k, v, s, dense), q64, k64, v64, s64, grad64)
    low = [t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64, s64)]
    grad = grad64.to(dtype)

    def errors(fn):
        got = _run(fn, *low, grad)
        return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, exact, strict=True)]

    eager = errors(lambda q, k, v, s: _gpt_oss_eager(q, k, v, s, dense))
    mask = generate_causal()
    for backend in ("cpu", "reference"):
        ours = errors(lambda q, k, v, s, b=backend: sink_attention(q, k, v, s, mask=mask, backend=b))
        for name, e_ours, e_eager in zip(("out", "dq", "dk", "dv", "dsinks"), ours, eager, strict=True):
            assert e_ours <= 2 * e_eager + 1e-7, f"{backend} {name}: {e_ours:.3g} vs eager {e_eager:.3g}"
    with torch.no_grad():
        flex_out = flex_sink_attention(*[t.detach() for t in low], mask, q64.shape[-1] ** -0.5)[0]
    flex_err = ((flex_out.double() - exact[0]).norm() / exact[0].norm()).item()
    assert flex_err <= 2 * eager[0] + 1e-7


# ---- input validation ----------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    q, k, v, s, _ = _inputs(n=8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        sink_attention(q[:, :3], k, v, s[:3], mask=None)
    with pytest.raises(ValueError, match="sinks must be"):
        sink_attention(q, k, v, s[:3], mask=None)
    with pytest.raises(ValueError, match="unknown attention backend"):
        sink_attention(q, k, v, s, mask=None, backend="triton")
    with pytest.raises(ValueError, match="sliding window must be >= 1"):
        generate_sliding_window(0)
