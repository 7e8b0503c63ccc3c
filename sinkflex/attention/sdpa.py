"""The SDPA path: exact attention by PyTorch's `scaled_dot_product_attention` for the masks it can express.

A fourth backend beside ``reference``, ``flex`` and the blockwise ``cpu`` path (listed in
`sinkflex.attention.api`), for attention **without sinks** on CPU, where PyTorch's fused flash
kernel beats the blockwise tiles. The transformers integration (`sinkflex.attention.hf`) takes
it when the mask allows and the layer has no sinks (Llama-family models):

- `sdpa_causal_attention`: plain causal rows (``is_causal=True``);
- `sdpa_shared_prefix_attention`: shared-prefix rows [prefix | suffix_1 | … | suffix_G]
  (`generate_shared_prefix`, no window, no padding): the prefix is one causal call, the
  suffixes are batched; on CPU `_SuffixAttention` computes a batch as two unmasked flash calls
  (the prefix part and the own causal part) merged by their log-sum-exp.

Every form attends to exactly the pairs the mask allows with the same softmax, so it matches
`sinkflex.attention.reference` to rounding (tests/test_shared_prefix.py, float64 ≤ 1e-12).
Shapes: q ``[B, Hq, N, D]``, k, v ``[B, Hkv, N, D]`` (Hq a multiple of Hkv, KV-major grouping
as ``repeat_kv``); the output is ``[B, Hq, N, D]`` in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sinkflex.attention.masks import MaskSpec


def supports_shared_prefix(mask: MaskSpec) -> bool:
    """Whether `sdpa_shared_prefix_attention` computes `mask` exactly: a shared-prefix mask
    (`generate_shared_prefix`) without a sliding window and without padding."""
    layout = mask.shared_prefix
    return layout is not None and layout.window is None and not layout.has_padding


def sdpa_shared_prefix_attention(q: Tensor, k: Tensor, v: Tensor, mask: MaskSpec, scale: float) -> Tensor:
    """Shared-prefix attention (no sinks) by SDPA pieces: ``[B, Hq, N, D]``.

    Raises:
        ValueError: `mask` is not a shared-prefix mask this path computes (`supports_shared_prefix`).
    """
    if not supports_shared_prefix(mask):
        raise ValueError(f"the SDPA path computes shared-prefix masks without window or padding, not {mask!r}")
    return _sdpa_shared_prefix(q, k, v, scale, mask.shared_prefix.rows)


def sdpa_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``[B, Hq, N, D]`` causal SDPA (GQA by KV-major grouping, as `repeat_kv`); no sinks, no padding."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _sdpa_shared_prefix(q: Tensor, k: Tensor, v: Tensor, scale: float, layout) -> Tensor:
    """Shared-prefix attention by SDPA pieces; ``layout`` = per row ``(P, [(start, end), …])``.

    Per row: the prefix is one causal SDPA call; the G suffixes are batched as
    ``[G, H, S_max, D]`` queries (`_sdpa_suffixes_batched`). On CPU each batch is
    `_SuffixAttention`: the prefix part (all suffixes' queries against the prefix keys, read
    once) and the own part (causal) as two unmasked flash-attention calls merged by their LSE.
    Elsewhere (or with no prefix) one SDPA call against ``[prefix keys | own suffix keys]``
    (the prefix keys broadcast over G, their gradients summed in the expand's backward) with
    the causal-offset mask; there a bucket of one is its own masked call.
    Suffixes shorter than ``S_max`` are padded with query rows whose outputs are dropped
    (zero gradient). Suffixes are batched in buckets of similar length (`_length_buckets`:
    padding costs at most `_PAD_BUDGET` times the unpadded attention). All forms are exact
    (same pairs, same softmax); batching turns G small kernel calls into a few (CPU flash
    attention's backward in particular).
    """
    gqa = q.shape[1] != k.shape[1]
    rows = []
    for b, (prefix, sufs) in enumerate(layout):
        qb, kb, vb = q[b : b + 1], k[b : b + 1], v[b : b + 1]
        parts = []
        if prefix:
            parts.append(F.scaled_dot_product_attention(
                qb[:, :, :prefix], kb[:, :, :prefix], vb[:, :, :prefix], is_causal=True, scale=scale, enable_gqa=gqa))
        outs: dict[int, Tensor] = {}  # suffix index -> its [1, H, n, D] output
        split = prefix > 0 and q.device.type == "cpu"  # `_SuffixAttention` serves a bucket of one too
        for bucket in _length_buckets(prefix, [e - a for a, e in sufs]):
            chosen = [sufs[j] for j in bucket]
            if len(bucket) > 1 or split:
                lengths = [e - a for a, e in chosen]
                out = _sdpa_suffixes_batched(qb, kb, vb, scale, prefix, chosen, max(lengths), gqa)
                for j, piece in zip(bucket, out.split(lengths, dim=2)):
                    outs[j] = piece
                continue
            (a, e), j = chosen[0], bucket[0]
            n = e - a
            ks = torch.cat([kb[:, :, :prefix], kb[:, :, a:e]], dim=2)
            vs = torch.cat([vb[:, :, :prefix], vb[:, :, a:e]], dim=2)
            cols = torch.arange(prefix + n, device=q.device)
            allowed = (cols[None, :] < prefix) | (cols[None, :] - prefix <= torch.arange(n, device=q.device)[:, None])
            outs[j] = F.scaled_dot_product_attention(qb[:, :, a:e], ks, vs, attn_mask=allowed, scale=scale, enable_gqa=gqa)
        parts.extend(outs[j] for j in range(len(sufs)))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


def _length_buckets(prefix: int, lengths: list[int]) -> list[list[int]]:
    """Suffix indices grouped for batched SDPA calls: sorted by length, each bucket as large as
    padding to its longest member allows (padded attention ≤ `_PAD_BUDGET` × unpadded).

    One bucket when all suffixes are about as long (a GRPO group); a row of many groups'
    rollouts of varied lengths gets a few buckets instead of one call per suffix.
    """
    order = sorted(range(len(lengths)), key=lambda j: lengths[j])
    buckets: list[list[int]] = []
    cur: list[int] = []
    cost = 0
    for j in order:
        n = lengths[j]
        # n is the bucket's longest so far (sorted): padded cost = |bucket| · n · (P + n)
        if cur and (len(cur) + 1) * n * (prefix + n) > _PAD_BUDGET * (cost + n * (prefix + n)):
            buckets.append(cur)
            cur, cost = [], 0
        cur.append(j)
        cost += n * (prefix + n)
    if cur:
        buckets.append(cur)
    return buckets


#: batch a row's suffixes into one SDPA call while padding costs at most this much extra attention
_PAD_BUDGET = 1.5


def _sdpa_suffixes_batched(qb: Tensor, kb: Tensor, vb: Tensor, scale: float, prefix: int, sufs, s_max: int, gqa: bool) -> Tensor:
    """``[1, Hq, Σ n_g, D]`` attention of one row's G suffixes (see `_sdpa_shared_prefix`).

    On CPU with a prefix: `_SuffixAttention` (the prefix part and the own causal part as two
    unmasked flash-attention calls, merged by their log-sum-exp). Otherwise one SDPA call over
    ``[prefix keys | own keys]`` with the causal-offset mask.
    """
    dev = qb.device
    starts = torch.tensor([a for a, _ in sufs], device=dev)
    lengths = torch.tensor([e - a for a, e in sufs], device=dev)
    s = torch.arange(s_max, device=dev)
    idx = starts[:, None] + torch.minimum(s[None, :], lengths[:, None] - 1)  # [G, S] packed index (pads repeat the last)
    real = (s[None, :] < lengths[:, None]).flatten()  # [G·S] rows that are real queries, in suffix order

    def own(x: Tensor) -> Tensor:  # [1, H, N, D] -> [G, H, S, D]
        return x[0][:, idx].transpose(0, 1)

    if prefix > 0 and dev.type == "cpu":
        # a pad query (a copy of its suffix's last) sees pad keys only causally after every real
        # query: real rows never see a pad key, and dropped pad rows send back zero gradient
        parts = (own(qb), kb[:, :, :prefix], vb[:, :, :prefix], own(kb), own(vb))
        if torch.is_autocast_enabled("cpu"):  # as autocast casts F.scaled_dot_product_attention's inputs (RoPE
            dt = torch.get_autocast_dtype("cpu")  # leaves q, k in float32 beside a bf16 v); the raw op is not cast
            parts = tuple(x.to(dt) for x in parts)
        out = _SuffixAttention.apply(*parts, scale)
        return out.transpose(0, 1).flatten(1, 2)[:, real].unsqueeze(0)

    def keys(x: Tensor) -> Tensor:  # [G, H, P + S, D]: the prefix (broadcast) then the suffix's own
        return torch.cat([x[:, :, :prefix].expand(len(sufs), -1, -1, -1), own(x)], dim=2)

    cols = torch.arange(prefix + s_max, device=dev)
    own_col = cols - prefix  # [P + S]: the key's index inside the suffix (negative: prefix)
    allowed = (own_col[None, None, :] < 0) | (
        (own_col[None, None, :] <= s[None, :, None]) & (own_col[None, None, :] < lengths[:, None, None])
    )  # [G, S, P + S]: a pad query row still sees the prefix / its suffix, so no row is empty
    out = F.scaled_dot_product_attention(own(qb), keys(kb), keys(vb), attn_mask=allowed[:, None], scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1).flatten(1, 2)[:, real].unsqueeze(0)  # [1, H, Σ n_g, D]


def _fold_groups(x: Tensor, kv_heads: int) -> Tensor:
    """``[G, Hq, S, …]`` → ``[1, Hkv, G·r·S, …]`` with r = Hq / Hkv: every query that reads KV head
    h (query heads h·r … h·r + r − 1, `repeat_kv`'s grouping) in one row of KV head h."""
    g, hq, s = x.shape[:3]
    return x.reshape(g, kv_heads, hq // kv_heads, s, *x.shape[3:]).transpose(0, 1).reshape(1, kv_heads, -1, *x.shape[3:])


def _unfold_groups(y: Tensor, g: int, hq: int, s: int) -> Tensor:
    """The inverse of `_fold_groups`: ``[1, Hkv, G·r·S, …]`` → ``[G, Hq, S, …]``."""
    kv_heads = y.shape[1]
    return y.reshape(kv_heads, g, hq // kv_heads, s, *y.shape[3:]).transpose(0, 1).reshape(g, hq, s, *y.shape[3:])


class _SuffixAttention(torch.autograd.Function):
    """Exact attention of G suffixes to a shared prefix and to their own causal past, on CPU.

    ``forward(q [G, Hq, S, D], k_prefix [1, Hkv, P, D], v_prefix, k_own [G, Hkv, S, D], v_own,
    scale) -> [G, Hq, S, D]`` (same dtype as q; P ≥ 1; Hq a multiple of Hkv). Query ``(g, s)``
    attends to every prefix key and to own keys ``0..s``.

    Two unmasked calls of PyTorch's CPU flash attention
    (`aten._scaled_dot_product_flash_attention_for_cpu`, which returns the row log-sum-exp):
    the prefix part with every suffix's queries folded into one row per KV head (the prefix's
    keys are read once for all G suffixes and never copied G times), and the own part causal.
    The two are merged by their LSEs, ``o = e^{l₁−l}·o₁ + e^{l₂−l}·o₂, l = logaddexp(l₁, l₂)``
    (FlashAttention's split-KV combine). The backward runs the kernel's backward once per part
    with the *merged* output and LSE, which gives each part's exact share of dq, dk, dv (the
    softmax of a part's keys is ``exp(s − l)`` with the full row's l; the same identity ring
    attention uses). Same pairs and softmax as the masked single call: exact to rounding
    (tests/test_shared_prefix.py, float64 ≤ 1e-12).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k_prefix: Tensor, v_prefix: Tensor, k_own: Tensor, v_own: Tensor, scale: float) -> Tensor:
        g, hq, s, _ = q.shape
        kv_heads = k_prefix.shape[1]
        o1, l1 = _FLASH_CPU(_fold_groups(q, kv_heads), k_prefix, v_prefix, 0.0, False, scale=scale)
        o1, l1 = _unfold_groups(o1, g, hq, s), _unfold_groups(l1, g, hq, s)
        o2, l2 = _FLASH_CPU(q, k_own, v_own, 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)  # float32 (or float64) whatever q's dtype
        out = (torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2).to(q.dtype)
        ctx.save_for_backward(q, k_prefix, v_prefix, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k_prefix, v_prefix, k_own, v_own, out, lse = ctx.saved_tensors
        g, hq, s, _ = q.shape
        kv_heads = k_prefix.shape[1]
        grad_out = grad_out.contiguous()
        fold = lambda x: _fold_groups(x, kv_heads)
        dq1, dk_prefix, dv_prefix = _FLASH_CPU_BACKWARD(fold(grad_out), fold(q), k_prefix, v_prefix, fold(out), fold(lse),
                                                        0.0, False, scale=ctx.scale)
        dq2, dk_own, dv_own = _FLASH_CPU_BACKWARD(grad_out, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        return _unfold_groups(dq1, g, hq, s) + dq2, dk_prefix, dv_prefix, dk_own, dv_own, None


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
