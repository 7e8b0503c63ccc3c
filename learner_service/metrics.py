"""What one learner step adds up, and the metrics it reports.

`StepTotals` and `LogprobMismatch` collect sums over a step's micro-batches (and, after
their `all_reduce`, over ranks); `step_metrics` turns them into the step's metrics record,
one name per quantity:

- loss, pg_loss, kl, clip_fraction: per token of N = Σ_i T_i (every optimised token of the
  step's rollouts, the zero-advantage ones left out of the forward included); ratio_mean,
  entropy: per token run through the model;
- grad_norm (mean over the step's optimiser steps), lr, optimizer_steps, nonfinite_grad_steps;
- reward_mean / reward_std over scored rollouts, unscored (rollouts whose evaluation raised:
  reward NaN, advantage 0, left out of mean and std); adv_*; staleness_mean / _max (policy
  versions between sampling and training);
- rollouts, optimised_tokens, skipped_* (grpo.skip_zero_advantage; per PPO epoch),
  positions_trained, positions_computed and the shared-prefix counts;
- logprob_mismatch_mean / _max: |engine log-prob − learner log-prob| on loss-mask tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from learner_service.batch import GroupInfo, LayoutCounts, Rollout
from learner_service.config import GRPOConfig
from learner_service.loss import LossTerms


@dataclasses.dataclass
class StepTotals:
    """What one learner step adds up over its micro-batches (and, after `all_reduce`, over
    ranks): sums, never means. Divide a loss term by `terms.tokens` (N = Σ_i T_i) for its
    per-token mean (paper eq. (6)'s normaliser)."""

    terms: LossTerms = dataclasses.field(default_factory=LossTerms.zero)  # Σ of grpo_loss's terms (float64)
    entropy: float = 0.0  # Σ entropy at optimised tokens
    positions: float = 0.0  # the rollouts' predicted positions (what an unshared learner computes)
    positions_computed: float = 0.0  # model positions actually run (shared prefixes once)
    shared_prefix_rows: float = 0.0
    shared_prefix_fallback_groups: float = 0.0
    shared_prefix_positions: float = 0.0
    skipped_rollouts: float = 0.0  # zero-advantage rollouts not run (grpo.skip_zero_advantage)
    skipped_tokens: float = 0.0  # their optimised tokens: part of N, never run
    skipped_positions: float = 0.0  # their positions (not in `positions`)

    def add_terms(self, terms: LossTerms, entropy: float, positions: float, positions_computed: float) -> None:
        """Adds one micro-batch's `grpo_loss` terms (detached sums) and its sizes."""
        self.terms = self.terms + terms
        self.entropy += entropy
        self.positions += positions
        self.positions_computed += positions_computed

    def add_layout(self, counts: LayoutCounts) -> None:
        """Adds `batch.plan_micro_batches`' shared-prefix counts."""
        self.shared_prefix_rows += counts.shared_prefix_rows
        self.shared_prefix_fallback_groups += counts.shared_prefix_fallback_groups
        self.shared_prefix_positions += counts.shared_prefix_positions

    def add_skipped(self, rollouts: Sequence[Rollout]) -> None:
        """Adds the zero-advantage rollouts left out of the forward/backward."""
        self.skipped_rollouts += len(rollouts)
        self.skipped_tokens += float(sum(int(r.mask_T.sum()) for r in rollouts))
        self.skipped_positions += float(sum(r.num_positions for r in rollouts))

    def all_reduce(self, reduce_: Callable[[torch.Tensor], None]) -> None:
        """Sums every field over ranks with `reduce_` (an in-place all-reduce of a float64
        tensor): the one place the totals are packed into a tensor and unpacked, by name
        (the loss terms by `LossTerms.to_tensor` / `from_tensor`). One collective."""
        names = [f.name for f in dataclasses.fields(self) if f.name != "terms"]
        k = len(dataclasses.fields(LossTerms))
        t = torch.cat([self.terms.to_tensor(), torch.tensor([getattr(self, n) for n in names], dtype=torch.float64)])
        reduce_(t)
        self.terms = LossTerms.from_tensor(t[:k])
        for n, v in zip(names, t[k:].tolist()):
            setattr(self, n, v)


@dataclasses.dataclass
class LogprobMismatch:
    """|engine log-prob − learner log-prob| on loss-mask tokens: Σ, max and token count."""

    total: float = 0.0  # Σ |Δ|
    max: float = 0.0  # max |Δ|
    tokens: float = 0.0

    def add(self, d: torch.Tensor) -> None:
        """Adds the |Δ| of some tokens (a float64 tensor; nothing when empty)."""
        if d.numel():
            self.total += d.sum().item()
            self.max = max(self.max, d.max().item())
            self.tokens += float(d.numel())

    def all_reduce(self, reduce_: Callable[[torch.Tensor], None], reduce_max: Callable[[torch.Tensor], None]) -> None:
        """Σ and token count summed over ranks with `reduce_`, the max with `reduce_max`."""
        s = torch.tensor([self.total, self.tokens], dtype=torch.float64)
        m = torch.tensor([self.max], dtype=torch.float64)
        reduce_max(m)
        reduce_(s)
        self.total, self.tokens = s.tolist()
        self.max = m.item()

    @property
    def mean(self) -> float:
        return self.total / max(self.tokens, 1.0)


def step_metrics(
    *,
    grpo: GRPOConfig,
    totals: StepTotals,
    mismatch: LogprobMismatch,
    grad_norms: Sequence[float],
    lr: float,
    infos: Sequence[GroupInfo],
    rollouts: Sequence[Rollout],
    policy_version: int,
    nonfinite_grad_steps: int,
) -> dict[str, float]:
    """The metrics of one trained step (the module docstring names them).

    Args:
        grpo: the algorithm's config (β for the loss, ppo_epochs for per-epoch counts).
        totals, mismatch: the step's sums, already reduced over ranks.
        grad_norms: the gradient norm of each optimiser step taken (non-finite ones skipped).
        lr: the learning rate after the step.
        infos: the groups trained; rollouts: their rollouts (with the old log-probs used).
        policy_version: the learner's policy version while it trained (for staleness).
        nonfinite_grad_steps: optimiser steps skipped so far for a non-finite gradient norm.
    """
    terms = totals.terms.item()
    tok = max(terms["tokens"], 1.0)  # optimised tokens run through the model
    n_all = max(terms["tokens"] + totals.skipped_tokens, 1.0)  # N: run + skipped (Â = 0)
    rewards = torch.cat([i.rewards_G for i in infos])
    valid = rewards[~torch.isnan(rewards)]
    adv = torch.tensor([r.advantage for r in rollouts])
    stale = torch.tensor([float(policy_version - r.policy_version) for r in rollouts])
    epochs = grpo.ppo_epochs
    return {
        "loss": (terms["pg_sum"] + grpo.beta * terms["kl_sum"]) / n_all,
        "pg_loss": terms["pg_sum"] / n_all,
        "kl": terms["kl_sum"] / n_all,
        "clip_fraction": terms["clipped_tokens"] / n_all,
        "ratio_mean": terms["ratio_sum"] / tok,
        "entropy": totals.entropy / tok,
        "grad_norm": float(sum(grad_norms) / len(grad_norms)) if grad_norms else 0.0,
        "lr": lr,
        "reward_mean": float(valid.mean()) if valid.numel() else float("nan"),
        "reward_std": float(valid.std(unbiased=False)) if valid.numel() else float("nan"),
        "unscored": float(torch.isnan(rewards).sum()),
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std(unbiased=False)),
        "adv_min": float(adv.min()),
        "adv_max": float(adv.max()),
        "adv_zero_fraction": float((adv == 0).float().mean()),
        "staleness_mean": float(stale.mean()),
        "staleness_max": float(stale.max()),
        "rollouts": float(len(rollouts)),
        "optimised_tokens": (terms["tokens"] + totals.skipped_tokens) / epochs,
        "skipped_rollouts": totals.skipped_rollouts / epochs,
        "skipped_tokens": totals.skipped_tokens / epochs,
        "skipped_positions": totals.skipped_positions / epochs,
        "optimizer_steps": float(len(grad_norms)),
        "positions_trained": totals.positions,
        "positions_computed": totals.positions_computed,
        "shared_prefix_rows": totals.shared_prefix_rows,
        "shared_prefix_fallback_groups": totals.shared_prefix_fallback_groups,
        "shared_prefix_positions": totals.shared_prefix_positions,
        "logprob_mismatch_mean": mismatch.mean,
        "logprob_mismatch_max": mismatch.max,
        "nonfinite_grad_steps": float(nonfinite_grad_steps),
    }
