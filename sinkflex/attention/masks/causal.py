"""Causal mask: query i attends to keys j <= i + offset."""

from __future__ import annotations

from torch import Tensor

from sinkflex.attention.masks.spec import MaskSpec


def generate_causal(offset: int = 0) -> MaskSpec:
    """Causal mask ``kv_idx <= q_idx + offset``.

    Args:
        offset: position of query 0 minus position of key 0. 0 for training (queries and
            keys are the same tokens); ``kv_len - q_len`` for queries appended after a cache.
    """

    def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx + offset

    return MaskSpec(
        mask_mod=causal,
        kv_range=lambda q0, q1: (0, q1 + offset),
        tile_is_full=lambda q0, q1, k0, k1: k1 - 1 <= q0 + offset,
        description="causal" if offset == 0 else f"causal(offset={offset})",
    )
