"""`MaskSpec`: one attention mask, usable by every backend without an n×n tensor.

A mask is a flex-style ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = the query may
attend to the key; PyTorch `torch.nn.attention.flex_attention` signature) plus two
optional *structure hints* that let the blockwise CPU path skip work:

- ``kv_range(q0, q1) -> (lo, hi)``: a conservative key interval ``[lo, hi)`` outside which
  no query in ``[q0, q1)`` may attend (causal: ``hi = q1 + offset``; sliding window:
  ``lo = q0 + offset - W + 1``). Tiles outside it are never computed.
- ``tile_is_full(q0, q1, k0, k1) -> bool``: True only when every entry of the tile is
  allowed for every batch row, so the tile needs no mask at all.
- ``kv_intervals(q0, q1) -> [(lo, hi), …]``: sorted disjoint key intervals, a finer form
  of ``kv_range`` for masks whose allowed keys are not one interval (shared prefix:
  the prefix and the query's own suffix, never another suffix).

``mask_mod`` must be index-based and broadcastable: it is called with scalar indices
(by ``create_block_mask`` under vmap) and with broadcast index tensors
``b: [B, 1, 1]``, ``q_idx: [1, tq, 1]``, ``kv_idx: [1, 1, tk]`` (by the CPU tiles and the
reference), returning a bool tensor of the broadcast shape. Masks compose with
`and_masks` (or the ``&`` operator). Masks are shared by all heads (``h`` is unused).

What a mask *means* beyond its mask_mod is in typed fields, set by the factory that knows it:
``shared_prefix`` (the row layout of `generate_shared_prefix`, read by the SDPA path),
``with_band`` (the mask with a layer's sliding window in the mask's own position frame), and
``hf`` (what transformers' mask function was: `sinkflex.attention.hf.sinkflex_mask`). A
combination (`and_masks`) carries none of them. ``_cache`` only memoises masks and block masks
derived from this one (`flex.block_mask_for`, `hf._with_structure`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
KvRange = Callable[[int, int], tuple[int, int]]
KvIntervals = Callable[[int, int], list[tuple[int, int]]]
TileIsFull = Callable[[int, int, int, int], bool]


@dataclass(frozen=True)
class SharedPrefixLayout:
    """The rows of a shared-prefix mask (`generate_shared_prefix`)."""

    rows: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # per row: (prefix length P, ((start, end) of each suffix, …))
    window: int | None  # the logical sliding window, None: causal
    has_padding: bool  # some row ends in padding (segment −1)


@dataclass(frozen=True)
class HFMaskInfo:
    """What transformers' mask function was, for a mask built by `sinkflex.attention.hf.sinkflex_mask`."""

    offset: int  # query-minus-key position offset (cache)
    or_overlay: bool  # the mask_function has an ``or_masks`` overlay (may allow keys outside the causal band)
    plain_causal: bool  # transformers' causal mask over the whole row: no padding, no packing, no cache


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """An attention mask: a flex ``mask_mod`` plus optional structure hints (module docstring).

    Attributes:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool``; True = attend.
        kv_range: conservative key interval ``[lo, hi)`` for a query interval ``[q0, q1)``;
            None = all keys. Values may fall outside ``[0, Nk]``; callers clamp.
        tile_is_full: True if a (q0, q1, k0, k1) tile is entirely allowed in every batch
            row; None = never known to be full (the mask is evaluated on every tile).
        description: human-readable form, e.g. ``"causal & sliding_window(128)"``.
        kv_intervals: conservative sorted key intervals for ``[q0, q1)`` (within kv_range
            when both are given); None = the single interval of kv_range.
        shared_prefix: the row layout when this is a shared-prefix mask, else None.
        with_band: ``win -> MaskSpec``: this mask with also the sliding window ``win`` (None:
            as is) on the mask's own logical positions; None: the layer's band is ANDed on.
        hf: what transformers' mask function was (`HFMaskInfo`), None for other masks.
    """

    mask_mod: MaskMod
    kv_range: KvRange | None = None
    tile_is_full: TileIsFull | None = None
    description: str = "mask"
    kv_intervals: KvIntervals | None = None
    shared_prefix: SharedPrefixLayout | None = None
    with_band: Callable[[int | None], MaskSpec] | None = field(default=None, repr=False)
    hf: HFMaskInfo | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __and__(self, other: MaskSpec) -> MaskSpec:
        return and_masks(self, other)

    def __repr__(self) -> str:
        return f"MaskSpec({self.description})"

    def key_bounds(self, q0: int, q1: int, kv_len: int) -> tuple[int, int]:
        """Clamped key interval ``[lo, hi)`` that queries ``[q0, q1)`` may see (``lo >= hi``: none)."""
        if self.kv_range is None:
            return 0, kv_len
        lo, hi = self.kv_range(q0, q1)
        return max(lo, 0), min(hi, kv_len)

    def key_intervals(self, q0: int, q1: int, kv_len: int) -> list[tuple[int, int]]:
        """Clamped, sorted, non-empty key intervals that queries ``[q0, q1)`` may see."""
        lo, hi = self.key_bounds(q0, q1, kv_len)
        if self.kv_intervals is None:
            return [(lo, hi)] if lo < hi else []
        out = [(max(a, lo), min(b, hi)) for a, b in self.kv_intervals(q0, q1)]
        return [(a, b) for a, b in out if a < b]

    def tile(self, batch: int, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> Tensor | None:
        """The allowed entries of one tile as a bool tensor ``[B or 1, q1 - q0, k1 - k0]``.

        Returns None when the tile is known to be fully allowed (no masking needed).
        """
        if self.tile_is_full is not None and self.tile_is_full(q0, q1, k0, k1):
            return None
        b = torch.arange(batch, device=device).view(-1, 1, 1)
        h = torch.zeros((), dtype=torch.long, device=device)
        q_idx = torch.arange(q0, q1, device=device).view(1, -1, 1)
        kv_idx = torch.arange(k0, k1, device=device).view(1, 1, -1)
        allowed = torch.as_tensor(self.mask_mod(b, h, q_idx, kv_idx), device=device)
        while allowed.dim() < 3:
            allowed = allowed.unsqueeze(0)
        return allowed.expand(-1, q1 - q0, k1 - k0)

    def dense(self, batch: int, q_len: int, kv_len: int, device: torch.device) -> Tensor:
        """The whole mask as a bool tensor ``[B or 1, q_len, kv_len]`` (n×n: reference only)."""
        full = self.tile(batch, 0, q_len, 0, kv_len, device)
        if full is None:
            return torch.ones(1, q_len, kv_len, dtype=torch.bool, device=device)
        return full


def and_masks(*specs: MaskSpec) -> MaskSpec:
    """The intersection of masks: allowed where every mask allows (hints intersected).

    Raises:
        ValueError: no mask given.
    """
    if not specs:
        raise ValueError("and_masks needs at least one MaskSpec")
    if len(specs) == 1:
        return specs[0]
    mods = [s.mask_mod for s in specs]
    ranges = [s.kv_range for s in specs if s.kv_range is not None]
    fulls = [s.tile_is_full for s in specs]
    with_intervals = [s for s in specs if s.kv_intervals is not None]

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = mods[0](b, h, q_idx, kv_idx)
        for mod in mods[1:]:
            allowed = allowed & mod(b, h, q_idx, kv_idx)
        return allowed

    def kv_range(q0: int, q1: int) -> tuple[int, int]:
        bounds = [r(q0, q1) for r in ranges]
        return max(lo for lo, _ in bounds), min(hi for _, hi in bounds)

    def tile_is_full(q0: int, q1: int, k0: int, k1: int) -> bool:
        return all(f(q0, q1, k0, k1) for f in fulls)  # type: ignore[misc]

    def kv_intervals(q0: int, q1: int) -> list[tuple[int, int]]:
        out = with_intervals[0].kv_intervals(q0, q1)  # type: ignore[misc]
        for other in with_intervals[1:]:
            theirs = other.kv_intervals(q0, q1)  # type: ignore[misc]
            out = [(max(a, c), min(b, d)) for a, b in out for c, d in theirs if max(a, c) < min(b, d)]
        return out

    return MaskSpec(
        mask_mod=mask_mod,
        kv_range=kv_range if ranges else None,
        tile_is_full=tile_is_full if all(f is not None for f in fulls) else None,
        description=" & ".join(s.description for s in specs),
        kv_intervals=kv_intervals if with_intervals else None,
    )
