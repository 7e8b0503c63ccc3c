"""Sampling settings the engine accepts give an unbiased GRPO ratio: the learner's log-probs under
top-k / top-p are vLLM's processed log-probs (renormalised over the kept tokens).

Unit level: `picked_logprobs(top_k=, top_p=)` against vLLM's own masking function
(`apply_top_k_top_p_pytorch` + log-softmax) and a float64 gradient check. End to end (vLLM CPU
and the learner): tests/test_families_chat.py::test_engine_and_learner_agree_at_step_0_under_top_p_top_k."""

from __future__ import annotations

import math

import pytest
import torch

from learner_service.logprobs import kept_mask, picked_logprobs

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (20, 1.0), (20, 0.9), (5, 0.5), (1, 1.0), (0, 0.01)])
def test_truncated_logprobs_are_vllms_processed_logprobs(top_k, top_p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 300, generator=g) * 3
    t = 0.8
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])
    ref_lp = apply_top_k_top_p_pytorch((z / t).clone(), torch.full((7,), top_k) if top_k else None,
                                       torch.full((7,), top_p) if top_p < 1 else None).log_softmax(-1)
    # targets: sampled from the kept set (as the engine does)
    targets = torch.multinomial(ref_lp.exp(), 1, generator=g).flatten()[rows]
    lp, ent = picked_logprobs(z, rows, targets, t, entropy=True, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(lp, ref_lp[rows, targets], rtol=0, atol=1e-5)
    p = ref_lp.exp()
    torch.testing.assert_close(ent, -(p * ref_lp.masked_fill(p == 0, 0)).sum(-1), rtol=0, atol=1e-4)
    keep = kept_mask(z / t, top_k, top_p)
    assert torch.equal(keep, torch.isfinite(ref_lp))
    full = torch.log_softmax(z / t, -1)[rows, targets]
    assert (lp - full).abs().max() > 1e-3  # truncation changes the log-probs: the learner must apply it


def test_truncated_logprobs_gradient():
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(5, 40, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    rows = torch.tensor([0, 1, 1, 3, 4])
    with torch.no_grad():
        keep = kept_mask(z / 0.7, 10, 0.8)
        targets = torch.stack([torch.nonzero(keep[r])[0, 0] for r in rows])

    def f(x):
        return picked_logprobs(x, rows, targets, 0.7, chunk=2, top_k=10, top_p=0.8)[0]

    assert torch.autograd.gradcheck(f, (z,), eps=1e-6, atol=1e-6)
    with torch.no_grad():  # a picked target outside its row's kept set is kept: finite log-prob
        out = torch.nonzero(~keep[2])[0, 0]
        assert math.isfinite(float(picked_logprobs(z, torch.tensor([2]), out[None], 0.7, top_k=10, top_p=0.8)[0][0]))

