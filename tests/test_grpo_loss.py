"""GRPO advantage (eq. 3) and loss (eqs. 4-7) against hand-computed values on tiny tensors."""

import math

import pytest
import torch

from learner_service.advantage import group_advantages
from learner_service.logprobs import token_entropy, token_logprobs
from learner_service.loss import grpo_loss, token_mean


# ---------------------------------------------------------------- advantages (eq. 3)
def test_advantage_hand_values():
    # rewards 0, 1, 1, 0: mean 0.5, population std 0.5.
    adv = group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0]), eps=0.0)
    assert adv.tolist() == [-1.0, 1.0, 1.0, -1.0]
    # rewards 1, 2, 3: mean 2, std sqrt(2/3); eps 0.1.
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0]), eps=0.1)
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(adv, torch.tensor([-1 / (s + 0.1), 0.0, 1 / (s + 0.1)]))


def test_advantage_all_equal_is_exactly_zero():
    # 0.1 three times: the float mean is not exactly 0.1; the advantages must still be exactly 0.
    adv = group_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64))
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert (group_advantages(torch.tensor([0.7] * 8)) == 0).all()


def test_advantage_group_of_one_is_zero():
    assert group_advantages(torch.tensor([0.9])).tolist() == [0.0]


def test_advantage_nan_reward_excluded():
    adv = group_advantages(torch.tensor([0.0, float("nan"), 1.0]), eps=0.0)
    assert adv.tolist() == [-1.0, 0.0, 1.0]  # stats from {0, 1} only; the NaN rollout gets 0
    # one valid reward left: no comparison possible.
    assert group_advantages(torch.tensor([float("nan"), 1.0])).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2))


# ---------------------------------------------------------------- token mean and loss
def test_token_mean_masks_out_tokens():
    values = torch.tensor([[1.0, 100.0], [1.0, -50.0]])
    mask = torch.tensor([[1, 0], [1, 0]])
    assert token_mean(values, mask, mask.sum()).item() == 1.0
    # Non-finite values under a 0 mask do not leak.
    assert token_mean(torch.tensor([[2.0, float("inf")]]), torch.tensor([[1, 0]]), 1).item() == 2.0


def test_loss_per_token_losses_masked_mean_is_one():
    # The per-token losses −min(ρÂ, clip(ρ)Â) are [[1, 100], [1, −50]]: ρ = 1 everywhere and
    # Â chosen per token by putting each token in its own row. Masks [[1, 0], [1, 0]] → 1.0.
    logp = torch.zeros(4, 1)
    adv = torch.tensor([-1.0, -100.0, -1.0, 50.0])
    mask = torch.tensor([[1], [0], [1], [0]])
    loss, terms = grpo_loss(logp, torch.zeros(4, 1), adv, mask, num_tokens=mask.sum())
    assert loss.item() == 1.0
    assert terms.tokens.item() == 2 and terms.pg_sum.item() == 2.0


def test_loss_and_gradient_hand_computed():
    # Two rollouts of 3 positions, ε = 0.2, one masked token each.
    # row 0: Â = +1; log-ratios ln 1.5 (clipped: 1.5 > 1.2), ln 0.5 (unclipped for Â>0), masked.
    # row 1: Â = −2; log-ratios ln 0.5 (clipped: 0.5 < 0.8), ln 1.1 (unclipped), masked.
    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 7.0], [0.5, 1.1, 9.0]])).requires_grad_()
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    n = 4.0
    loss, terms = grpo_loss(logp, old, adv, mask, num_tokens=n, clip_eps_low=0.2)
    # per-token −min(ρÂ, clip(ρ)Â): −1.2, −0.5, −(−2·0.8)=1.6, −(−2·1.1)=2.2
    expected = (-1.2 - 0.5 + 1.6 + 2.2) / n
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert terms.clipped_tokens.item() == 2
    loss.backward()
    # d/dlogp: 0 where clipped is active, −ρÂ/N where unclipped, 0 where masked.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / n, 0.0], [0.0, 2.2 / n, 0.0]]))


def test_asymmetric_upper_clip():
    logp = torch.log(torch.tensor([[1.25]])).requires_grad_()
    loss, terms = grpo_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), num_tokens=1, clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and terms.clipped_tokens.item() == 0  # 1.25 < 1.28
    loss, terms = grpo_loss(logp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), num_tokens=1, clip_eps_low=0.2, clip_eps_high=None)
    assert loss.item() == pytest.approx(-1.2) and terms.clipped_tokens.item() == 1


def test_kl_k3_value_gradient_and_safety():
    # log π_θ = ln 0.5, log π_ref = ln 0.25 → r = 0.5, k3 = 0.5 − 1 − ln 0.5.
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25]]))
    loss, terms = grpo_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 1), num_tokens=1, ref_logp_BT=ref, beta=0.1)
    k3 = 0.5 - 1 - math.log(0.5)
    assert terms.kl_sum.item() == pytest.approx(k3, rel=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.1 * (1 - 0.5), rel=1e-6)  # β(1 − r)
    # Tiny differences: no cancellation to 0 (k3 ≈ x²/2).
    x = 1e-4
    _, terms = grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), num_tokens=1,
                         ref_logp_BT=torch.full((1, 1), x), beta=1.0)
    assert terms.kl_sum.item() == pytest.approx(x * x / 2, rel=1e-3)
    # Extreme log-ratio and garbage under the mask: finite.
    loss, _ = grpo_loss(torch.tensor([[-200.0, float("nan")]]), torch.zeros(1, 2), torch.ones(1),
                        torch.tensor([[1, 0]]), num_tokens=1, ref_logp_BT=torch.tensor([[0.0, float("nan")]]), beta=1.0)
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, logp, torch.zeros(1), torch.ones(1, 1), num_tokens=1, beta=0.1)


def test_global_normaliser_identical_under_micro_batching():
    torch.manual_seed(0)
    logp = torch.randn(6, 5, dtype=torch.float64).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(6, 5, dtype=torch.float64)
    adv = torch.randn(6, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).long()
    n = mask.sum()
    full, _ = grpo_loss(logp, old, adv, mask, num_tokens=n)
    (g_full,) = torch.autograd.grad(full, logp)
    parts = [grpo_loss(logp[s], old[s], adv[s], mask[s], num_tokens=n)[0] for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
    (g_parts,) = torch.autograd.grad(sum(parts), logp)
    torch.testing.assert_close(sum(parts), full)
    torch.testing.assert_close(g_parts, g_full)


def test_token_logprobs_with_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]]])
    targets = torch.tensor([[0, 2]])
    lp = token_logprobs(logits, targets, temperature=0.5, chunk=1)
    z = torch.tensor([4.0, 0.0, -2.0])
    assert lp[0, 0].item() == pytest.approx((z[0] - torch.logsumexp(z, 0)).item(), abs=1e-6)
    assert lp[0, 1].item() == pytest.approx(math.log(1 / 3), abs=1e-6)
    ent = token_entropy(logits, temperature=0.5)
    assert ent[0, 1].item() == pytest.approx(math.log(3), abs=1e-6)


@pytest.mark.parametrize("scale", [1.0, 30.0, 3000.0])
def test_picked_logprobs_lse_and_entropy_match_float64(scale):
    """The fused one-exp-pass log-sum-exp / entropy (learner_service.logprobs._lse_and_entropy)
    against float64 torch.logsumexp / softmax, at ordinary and at huge logit magnitudes."""
    from learner_service.logprobs import picked_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 1000, generator=g) * scale
    rows = torch.tensor([0, 5, 5, 36])
    targets = torch.tensor([3, 999, 0, 500])
    logp, ent = picked_logprobs(logits.clone().requires_grad_(), rows, targets, temperature=0.7, chunk=8, entropy=True)
    z = logits.double() / 0.7
    lse = torch.logsumexp(z, -1)
    ref_ent = lse - (torch.softmax(z, -1) * z).sum(-1)
    ref_logp = z[rows, targets] - lse[rows]
    assert torch.isfinite(ent).all() and (ent >= -1e-4).all()
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5 * max(1.0, scale), rtol=1e-5)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-4 * max(1.0, scale / 30), rtol=1e-6)
