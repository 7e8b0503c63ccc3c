"""Causal sliding-window mask in gpt-oss's meaning: the W most recent keys, own position included.

Query at position i attends to keys j with ``i - W < j <= i`` — exactly W keys once
``i >= W - 1`` (gpt-oss: W = 128; transformers' ``sliding_window_causal_mask_function``).
"""

from __future__ import annotations

from torch import Tensor

from sinkflex.attention.masks.spec import MaskSpec


def generate_sliding_window(window: int, offset: int = 0) -> MaskSpec:
    """Causal sliding window: ``q_idx + offset - window < kv_idx <= q_idx + offset``.

    Args:
        window: W >= 1, the number of most recent keys attended, the query's own included
            (W = 1: each query sees only itself).
        offset: position of query 0 minus position of key 0 (see `generate_causal`).

    Raises:
        ValueError: window < 1.
    """
    if window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")

    def sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_pos = q_idx + offset
        return (kv_idx <= q_pos) & (kv_idx > q_pos - window)

    return MaskSpec(
        mask_mod=sliding_window,
        kv_range=lambda q0, q1: (q0 + offset - window + 1, q1 + offset),
        tile_is_full=lambda q0, q1, k0, k1: k1 - 1 <= q0 + offset and k0 > q1 - 1 + offset - window,
        description=f"sliding_window({window})" if offset == 0 else f"sliding_window({window}, offset={offset})",
    )
