"""Shared-prefix mask: one row [prefix | suffix_1 | … | suffix_G], each suffix alone with the prefix.

All G rollouts of a GRPO group share their prompt. Packed as one row, the prefix is
computed once; suffix s attends to the prefix and to its own causal past only, never to
another suffix. Position ids continue from the prefix in every suffix, so causality and
the sliding window are evaluated on *logical* positions (``position_ids``): each rollout
sees exactly the keys it would see alone (sliding window W: the W most recent logical
positions, which may reach back into the prefix). Sinks need nothing here: every
backend adds the sink to each query's own softmax.

Segment ids: 0 = prefix, s ≥ 1 = suffix s, −1 = padding (padding attends only to padding,
causally; its outputs are don't-care but finite).

    allowed(q, k) = (seg[k] == seg[q]  or  (seg[k] == 0 and seg[q] ≥ 1))
                    and pos[k] ≤ pos[q]  [and pos[k] > pos[q] − W]

Structure hints for the blockwise CPU path: ``kv_intervals`` lists, per query tile, the
prefix interval and the tile's own suffix intervals (never another suffix), clipped to
the window; ``tile_is_full`` marks tiles that need no mask. ``with_band(W)`` gives the
same mask with the logical sliding window (what a sliding layer must use instead of a
window on packed indices).
"""

from __future__ import annotations

import torch
from torch import Tensor

from sinkflex.attention.masks.spec import MaskSpec, SharedPrefixLayout


def _runs(seg: list[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs ``(start, end, segment)`` of one row's segment ids."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(seg) + 1):
        if i == len(seg) or seg[i] != seg[start]:
            out.append((start, i, seg[start]))
            start = i
    return out


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def generate_shared_prefix(segment_ids: Tensor, position_ids: Tensor | None = None, window: int | None = None) -> MaskSpec:
    """Shared-prefix mask (module docstring) over rows ``[prefix | suffix_1 | … | suffix_G | padding]``.

    Args:
        segment_ids: ``[B, N]`` int: 0 prefix, s ≥ 1 suffix s, −1 padding. Each row must be
            the prefix run (possibly empty) followed by one contiguous run per suffix, then
            padding.
        position_ids: ``[B, N]`` int logical positions (prefix 0..P−1, each suffix P, P+1, …);
            default: derived from ``segment_ids`` (padding continues its packed index).
        window: W ≥ 1 for the causal sliding window on logical positions; None: causal.

    Returns:
        a `MaskSpec` whose ``shared_prefix`` holds the row layout (`SharedPrefixLayout`:
        ``((prefix_len, ((start, end), …)), …)``, the window, whether a row is padded) for the
        SDPA path, and whose ``with_band`` adds a layer's sliding window on logical positions.

    Raises:
        ValueError: wrong ranks/shapes, a segment that is not one contiguous run, or window < 1.
    """
    if segment_ids.dim() != 2:
        raise ValueError(f"segment_ids must be [B, N], got shape {tuple(segment_ids.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    seg = segment_ids.to(torch.long)
    seg_cpu = seg.cpu()
    batch, n = seg.shape
    layouts = []  # per row: (prefix_len, [(start, end), ...] of suffixes, pad_start)
    for b in range(batch):
        runs = _runs(seg_cpu[b].tolist())
        ids = [s for _, _, s in runs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"row {b}: every segment must be one contiguous run, got runs {ids}")
        prefix = runs[0][1] if runs and runs[0][2] == 0 else 0
        sufs = [(a, e) for a, e, s in runs if s >= 1]
        pad = [a for a, _, s in runs if s < 0]
        if pad and any(a > pad[0] for a, _ in sufs):
            raise ValueError(f"row {b}: padding must come last")
        if any(s < -1 for s in ids):
            raise ValueError(f"row {b}: segment ids must be >= -1")
        layouts.append((prefix, sufs, pad[0] if pad else n))
    if position_ids is None:
        pos_cpu = torch.arange(n).repeat(batch, 1)
        for b, (prefix, sufs, _) in enumerate(layouts):
            for a, e in sufs:
                pos_cpu[b, a:e] = torch.arange(prefix, prefix + e - a)
        pos = pos_cpu.to(seg.device)
    else:
        if position_ids.shape != seg.shape:
            raise ValueError(f"position_ids {tuple(position_ids.shape)} must match segment_ids {tuple(seg.shape)}")
        pos = position_ids.to(device=seg.device, dtype=torch.long)
        pos_cpu = pos.cpu()
    pos_list = pos_cpu.tolist()

    def shared_prefix(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        sq, sk = seg[b, q_idx], seg[b, kv_idx]
        pq, pk = pos[b, q_idx], pos[b, kv_idx]
        allowed = ((sk == sq) | ((sk == 0) & (sq >= 1))) & (pk <= pq)
        if window is not None:
            allowed = allowed & (pk > pq - window)
        return allowed

    big = n + 2 + (max(max(r) for r in pos_list) if n and batch else 0)
    w = window if window is not None else big  # no window: reaches back past position 0

    def kv_intervals(q0: int, q1: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for b, (prefix, sufs, pad_start) in enumerate(layouts):
            p = pos_list[b]
            # prefix queries [q0, min(q1, prefix)): prefix keys, causal + window (packed = logical)
            u, v = q0, min(q1, prefix)
            if u < v:
                out.append((max(0, u - w + 1), v))
            for a, e in sufs:
                u, v = max(q0, a), min(q1, e)
                if u >= v:
                    continue
                lo_pos = p[u] - w + 1  # logical window start of the first query
                out.append((max(0, lo_pos), min(prefix, p[v - 1] + 1)))  # prefix keys
                out.append((a + max(0, lo_pos - prefix), v))  # own suffix keys
            u, v = max(q0, pad_start), q1
            if u < v:
                out.append((max(pad_start, u - w + 1), v))
        return _merge(out)

    def tile_is_full(q0: int, q1: int, k0: int, k1: int) -> bool:
        for b, (prefix, sufs, _) in enumerate(layouts):
            p = pos_list[b]
            if q1 <= prefix:
                q_start = 0  # the tile's queries are all prefix
            else:
                q_start = next((a for a, e in sufs if a <= q0 and q1 <= e), None)
                if q_start is None:
                    return False  # the query tile spans segments (or padding)
            if k1 <= prefix and q_start >= prefix and prefix > 0:
                pass  # suffix queries, prefix keys: always before them
            elif q_start <= k0 and k1 - 1 <= q0 and (q_start > 0 or q1 <= prefix or prefix == 0):
                pass  # own segment, causal on packed index
            else:
                return False
            if window is not None and not p[k0] > p[q1 - 1] - window:
                return False
        return True

    bands: dict[int | None, MaskSpec] = {}

    def with_band(win: int | None) -> MaskSpec:
        """This mask with (also) the logical sliding window ``win`` (None: as is)."""
        if win not in bands:
            bands[win] = generate_shared_prefix(seg, pos, win if window is None else min(win, window))
        return bands[win]

    desc = "shared_prefix" if window is None else f"shared_prefix(window={window})"
    layout = SharedPrefixLayout(rows=tuple((prefix, tuple(sufs)) for prefix, sufs, _ in layouts), window=window,
                                has_padding=any(pad < n for _, _, pad in layouts))
    spec = MaskSpec(mask_mod=shared_prefix, kv_range=None, tile_is_full=tile_is_full, description=desc,
                    kv_intervals=kv_intervals, shared_prefix=layout, with_band=with_band)
    bands[None] = bands[window] = spec
    return spec
