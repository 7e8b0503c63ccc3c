"""The GRPO loss: clipped importance-ratio objective plus a k3 KL penalty.

Paper (SinkFlex-RL, arXiv 2608.10357), equations (4)–(7):

    (4)  Â_{i,t} = Â_i                                   (one advantage per rollout)
    (5)  ρ_{i,t} = π_θ(y_{i,t} | ·) / π_θold(y_{i,t} | ·)
    (6)  L_clip  = −(1/Σ_i T_i) Σ_i Σ_t min(ρ_{i,t} Â_i, clip(ρ_{i,t}, 1−ε_c, 1+ε_c) Â_i)
    (7)  L       = L_clip + β · KL(π_θ ‖ π_ref)

with T_i the number of optimised (loss-mask = 1) tokens of rollout i.

Departures and choices:
- The normaliser Σ_i T_i is passed in (`num_tokens`): it is the token count of the whole
  global batch of one optimiser step (all micro-batches, all data-parallel ranks). Each
  micro-batch's loss is its *sum* divided by that global count, so summing the gradients
  of the micro-batches (and summing, not averaging, across ranks) gives exactly the
  gradient of eq. (6) over the global batch.
- The upper clip may differ from the lower one (ε_high ≥ ε_low, "clip-higher").
- log ρ is clamped to ±LOG_RATIO_CLAMP (20) before exp: it changes nothing unless
  ρ > 4.9e8 or ρ < 2e-9 (where that token's gradient becomes 0), and an absurd
  engine/learner mismatch cannot make the loss infinite.
- KL is the k3 estimator k3 = r − 1 − log r, r = π_ref/π_θ, per token, normalised by the
  same Σ_i T_i. It is evaluated as expm1(log r) − log r with log r clamped to
  [−KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP], which is exact for small |log r| (no
  1 − 1 cancellation) and never overflows.

Legend: B = rollouts in the (micro-)batch, T = padded sequence length (token positions
whose log-prob is predicted), N = global number of optimised tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

#: |log(π_ref/π_θ)| is clamped here before exp in the k3 estimator (e^20 ≈ 4.9e8).
KL_LOG_RATIO_CLAMP = 20.0
#: |log ρ| is clamped here before exp, so that one absurd engine log-prob cannot make the
#: loss infinite (its gradient is 0 beyond the clamp; such a token is clipped anyway).
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossTerms:
    """What one call of `grpo_loss` contributes, as detached sums over its optimised tokens.

    Dividing a field by the global token count N gives its per-token mean; sums of
    several micro-batches and ranks add up, as a type: ``LossTerms.zero() + a + b`` sums
    field by field (in float64 when started from `zero`, so that the sum is that of the
    fields' values as Python floats, in the same order); `to_tensor` / `from_tensor` are
    the one packing of the fields, which the learner's all-reduce over ranks uses
    (`metrics.StepTotals.all_reduce`).
    """

    pg_sum: torch.Tensor  # [] Σ −min(ρÂ, clip(ρ)Â)
    kl_sum: torch.Tensor  # [] Σ k3
    clipped_tokens: torch.Tensor  # [] tokens where the clipped term is the active one
    ratio_sum: torch.Tensor  # [] Σ ρ
    tokens: torch.Tensor  # [] Σ mask

    @classmethod
    def zero(cls, dtype: torch.dtype = torch.float64) -> LossTerms:
        """The neutral element of `+`: every field a CPU [] zero (float64 by default)."""
        return cls(**{f.name: torch.zeros((), dtype=dtype) for f in fields(cls)})

    def __add__(self, other: LossTerms) -> LossTerms:
        if not isinstance(other, LossTerms):
            return NotImplemented
        return LossTerms(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __radd__(self, other) -> LossTerms:
        if isinstance(other, int) and other == 0:  # sum(terms) starts from 0
            return self
        return NotImplemented

    def to_tensor(self) -> torch.Tensor:
        """[5] float64 CPU tensor of the fields, in field order (`metrics.StepTotals.all_reduce` reduces it)."""
        return torch.stack([getattr(self, f.name).detach().to(torch.float64) for f in fields(self)]).cpu()

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> LossTerms:
        """The inverse of `to_tensor`."""
        names = [f.name for f in fields(cls)]
        if t.shape != (len(names),):
            raise ValueError(f"LossTerms.from_tensor needs a [{len(names)}] tensor, got {tuple(t.shape)}")
        return cls(**{n: t[i].clone() for i, n in enumerate(names)})

    def item(self) -> dict[str, float]:
        """{field: value} as Python floats."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


def token_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor, num_tokens: float | torch.Tensor) -> torch.Tensor:
    """Σ_{b,t} mask·values / num_tokens: the token mean of eq. (6) over unmasked tokens only.

    Masked positions contribute exactly 0 even when their values are huge or non-finite.

    Args:
        values_BT: [B, T] float per-token values.
        mask_BT: [B, T] 0/1 (bool, int or float) loss mask.
        num_tokens: N, the global optimised-token count (> 0), a number or [] tensor.

    Returns:
        [] float tensor.
    """
    kept_BT = torch.where(mask_BT.bool(), values_BT, torch.zeros_like(values_BT))
    return kept_BT.sum() / num_tokens


def grpo_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    num_tokens: float | torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    ref_logp_BT: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, LossTerms]:
    """GRPO loss of one (micro-)batch, paper eqs. (4)–(7).

    Args:
        logp_BT: [B, T] float, log π_θ of each token (differentiable).
        old_logp_BT: [B, T] float, log π_θold (the sampling policy), no gradient.
        adv_B: [B] float, Â_i of each rollout (eq. (3), `advantage.group_advantages`); or
            [B, T] when a row holds several rollouts (packed), Â of each position's rollout.
        mask_BT: [B, T] 0/1 loss mask; only these tokens are optimised or counted.
        num_tokens: N = Σ_i T_i over the global batch of this optimiser step (> 0).
        clip_eps_low: ε_c: the ratio is clipped below at 1 − ε_c.
        clip_eps_high: upper clip 1 + ε_high; None → ε_c (symmetric, as in the paper).
        ref_logp_BT: [B, T] float, log π_ref; required when beta > 0.
        beta: β, weight of the k3 KL penalty (≥ 0).

    Returns:
        (loss, terms): loss is a [] tensor = (Σ masked per-token loss) / num_tokens, whose
        gradient w.r.t. logp_BT is, per unmasked token, −ρÂ/N where the unclipped term is
        active (0 where the clipped one is) plus β(1 − π_ref/π_θ)/N; terms holds detached
        sums for metrics.

    Raises:
        ValueError: mismatched shapes, beta < 0, beta > 0 without ref_logp_BT, or a bad clip.
    """
    if logp_BT.shape != old_logp_BT.shape or logp_BT.shape != mask_BT.shape:
        raise ValueError(
            f"logp_BT {tuple(logp_BT.shape)}, old_logp_BT {tuple(old_logp_BT.shape)} and "
            f"mask_BT {tuple(mask_BT.shape)} must have the same shape [B, T]"
        )
    if adv_B.shape != logp_BT.shape[:1] and adv_B.shape != logp_BT.shape:
        raise ValueError(f"adv_B must be [B] = [{logp_BT.shape[0]}] or [B, T], got {tuple(adv_B.shape)}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logp_BT is None:
        raise ValueError("beta > 0 needs ref_logp_BT")
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if not (0 <= clip_eps_low < 1) or eps_high < 0:
        raise ValueError(f"bad clip: eps_low={clip_eps_low} (need 0 <= eps_low < 1), eps_high={eps_high}")

    m_BT = mask_BT.bool()
    math = torch.float64 if logp_BT.dtype == torch.float64 else torch.float32  # fp32 at least, fp64 kept (exactness tests)
    logp_BT = logp_BT.to(math)
    # Masked positions use log-ratio 0 so that exp() never sees garbage from padding.
    log_ratio_BT = torch.where(m_BT, logp_BT - old_logp_BT.detach().to(math), torch.zeros_like(logp_BT))
    log_ratio_BT = log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # ρ stays finite
    ratio_BT = torch.exp(log_ratio_BT)  # ρ, eq. (5)
    adv = adv_B.detach().to(math)
    adv_BT = adv[:, None].expand_as(ratio_BT) if adv.dim() == 1 else adv  # eq. (4)
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = torch.clamp(ratio_BT, 1.0 - clip_eps_low, 1.0 + eps_high) * adv_BT
    pg_BT = -torch.minimum(unclipped_BT, clipped_BT)  # eq. (6), per token
    loss_BT = pg_BT

    kl_BT = torch.zeros_like(pg_BT)
    if beta > 0:
        # k3 = r − 1 − log r with r = π_ref/π_θ; expm1 keeps small |log r| exact.
        log_r_BT = torch.where(m_BT, ref_logp_BT.detach().to(math) - logp_BT, torch.zeros_like(logp_BT))
        log_r_BT = log_r_BT.clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        kl_BT = torch.expm1(log_r_BT) - log_r_BT
        loss_BT = pg_BT + beta * kl_BT  # eq. (7)

    loss = token_mean(loss_BT, m_BT, num_tokens)
    with torch.no_grad():
        zero = torch.zeros_like(pg_BT)
        clipped_active_BT = m_BT & (clipped_BT < unclipped_BT)
        terms = LossTerms(
            pg_sum=torch.where(m_BT, pg_BT, zero).sum().detach(),
            kl_sum=torch.where(m_BT, kl_BT, zero).sum().detach(),
            clipped_tokens=clipped_active_BT.sum().float(),
            ratio_sum=torch.where(m_BT, ratio_BT, zero).sum().detach(),
            tokens=m_BT.sum().float(),
        )
    return loss, terms
