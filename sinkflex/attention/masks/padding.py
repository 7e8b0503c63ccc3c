"""Padding mask: padded keys are never attended (queries are not masked, as in transformers).

A query whose every allowed key is padding (e.g. a left-padding position under a causal
mask) is a fully masked row: every backend returns 0 for it, with finite gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sinkflex.attention.masks.spec import MaskSpec


def generate_padding(lengths: Tensor | None = None, *, attention_mask: Tensor | None = None) -> MaskSpec:
    """Key padding mask, from per-row lengths (right padding) or a 2D attention mask.

    Args:
        lengths: ``[B]`` int, row b has real keys ``0 .. lengths[b]-1`` (right padding).
        attention_mask: ``[B, Nk]`` bool/int, transformers convention: 1/True = real token,
            0/False = padding (left, right or anywhere).

    Raises:
        ValueError: neither or both given, or wrong rank.
    """
    if (lengths is None) == (attention_mask is None):
        raise ValueError("give exactly one of `lengths` or `attention_mask`")
    if lengths is not None:
        if lengths.dim() != 1:
            raise ValueError(f"lengths must be [B], got shape {tuple(lengths.shape)}")
        lengths = lengths.to(torch.long)
        max_len = int(lengths.max()) if lengths.numel() else 0

        def padding_by_length(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx < lengths[b]

        return MaskSpec(
            mask_mod=padding_by_length,
            kv_range=lambda q0, q1: (0, max_len),
            description=f"padding(lengths={lengths.tolist() if lengths.numel() <= 8 else '...'})",
        )
    assert attention_mask is not None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, Nk], got shape {tuple(attention_mask.shape)}")
    key_mask = attention_mask.to(torch.bool)
    any_row = key_mask.any(0).nonzero()
    lo, hi = (int(any_row.min()), int(any_row.max()) + 1) if any_row.numel() else (0, 0)

    def padding(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return key_mask[b, kv_idx]

    return MaskSpec(mask_mod=padding, kv_range=lambda q0, q1: (lo, hi), description="padding")
