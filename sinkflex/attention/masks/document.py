"""Packed-documents mask: tokens attend only within their own document.

Several sequences packed into one row (ids ``[0,0,0,1,1,2,...]``) must not see each
other; combine with `generate_causal` for causal LMs. Same semantics as transformers'
``packed_sequence_mask_function``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sinkflex.attention.masks.spec import MaskSpec


def generate_document(document_ids: Tensor) -> MaskSpec:
    """Document mask ``document_ids[b, q_idx] == document_ids[b, kv_idx]``.

    Args:
        document_ids: ``[B, N]`` int, the document of every token (queries and keys are the
            same N tokens). When each document is one contiguous run (packing), the blockwise
            path also skips tiles across documents; otherwise the mask is still exact.

    Raises:
        ValueError: wrong rank.
    """
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [B, N], got shape {tuple(document_ids.shape)}")
    doc = document_ids.to(torch.long)

    def document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return doc[b, q_idx] == doc[b, kv_idx]

    n = doc.shape[1]
    if n == 0:
        return MaskSpec(mask_mod=document, description="document")
    cpu = doc.cpu()
    new_run = torch.ones_like(cpu, dtype=torch.bool)
    new_run[:, 1:] = cpu[:, 1:] != cpu[:, :-1]
    run_id = new_run.cumsum(1)  # [B, N]
    contiguous = all(int(run_id[r, -1]) == cpu[r].unique().numel() for r in range(cpu.shape[0]))
    if not contiguous:
        return MaskSpec(mask_mod=document, description="document(non-contiguous)")
    pos = torch.arange(n).expand_as(cpu)
    run_start = torch.where(new_run, pos, torch.zeros_like(pos)).cummax(1).values  # first index of own run
    ends_run = torch.ones_like(new_run)
    ends_run[:, :-1] = new_run[:, 1:]
    run_end = torch.where(ends_run, pos + 1, torch.full_like(pos, n)).flip(1).cummin(1).values.flip(1)  # one past
    lo_of = run_start.min(0).values.tolist()  # min over rows, per position
    hi_of = run_end.max(0).values.tolist()

    def kv_range(q0: int, q1: int) -> tuple[int, int]:
        return lo_of[q0], hi_of[q1 - 1]

    def tile_is_full(q0: int, q1: int, k0: int, k1: int) -> bool:
        first, last = min(q0, k0), max(q1, k1) - 1
        return bool((run_id[:, first] == run_id[:, last]).all())

    return MaskSpec(mask_mod=document, kv_range=kv_range, tile_is_full=tile_is_full, description="document")
