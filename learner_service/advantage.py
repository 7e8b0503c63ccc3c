"""Group-relative advantages: GRPO's replacement for a value model.

Paper (SinkFlex-RL, arXiv 2608.10357), eq. (3):

    Â_i = (R_i − mean(R_1..G)) / (std(R_1..G) + ε_A)

and eq. (4): the same Â_i on every optimised token of rollout i (broadcast by the loss).

Departures from the paper, each deliberate:
- ``std`` is the population standard deviation (ddof = 0), as numpy's default; the paper
  does not say which. With G = 2 and rewards {0, 1}: Â = ±0.5/(0.5 + ε_A) ≈ ±1.
- A group whose valid rewards are all equal gets advantages of *exactly* 0 (the
  subtraction of a float mean can leave ±1e-17 noise that the division would blow up).
- A group with fewer than two valid rewards gets 0 (no comparison is possible).
- A NaN reward (a rollout that could not be scored) is excluded from the mean and std of
  its group and its own advantage is 0.

Legend: G = rollouts in one group.
"""

from __future__ import annotations

import torch


def group_advantages(rewards_G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of one GRPO group (paper eq. (3)).

    Args:
        rewards_G: [G] float tensor of trajectory rewards R_i; NaN marks an unscored rollout.
        eps: ε_A, added to the standard deviation (≥ 0).

    Returns:
        adv_G: [G] float32 tensor. Exactly 0 for NaN rewards, for a group with fewer than two
        valid rewards, and for a group whose valid rewards are all equal.

    Raises:
        ValueError: `rewards_G` is not one-dimensional, or `eps` < 0.
    """
    if rewards_G.dim() != 1:
        raise ValueError(f"rewards_G must be 1-D [G], got shape {tuple(rewards_G.shape)}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r_G = rewards_G.detach().to(torch.float64)
    valid_G = ~torch.isnan(r_G)
    adv_G = torch.zeros_like(r_G)
    r_V = r_G[valid_G]
    if r_V.numel() < 2 or bool((r_V == r_V[0]).all()):
        return adv_G.to(torch.float32)
    mean = r_V.mean()
    std = r_V.std(unbiased=False)
    adv_G[valid_G] = (r_V - mean) / (std + eps)
    return adv_G.to(torch.float32)


def batch_advantages(rewards_per_group: list[torch.Tensor], eps: float = 1e-6) -> list[torch.Tensor]:
    """`group_advantages` applied to each group independently.

    Args:
        rewards_per_group: one [G_g] tensor per group (groups may differ in size).

    Returns:
        one [G_g] float32 advantage tensor per group.
    """
    return [group_advantages(r_G, eps) for r_G in rewards_per_group]
