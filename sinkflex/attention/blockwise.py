"""Blockwise sink attention for CPU training: exact, differentiable, O(n) memory.

A flash-attention-style `torch.autograd.Function` (Dao et al., FlashAttention-2,
Alg. 1 and 2) with the sink folded in as one extra logit whose value vector is zero:

    forward (per query tile, online softmax over key tiles):
        m, l, acc  ->  O_attn = acc / l,  lse = m + log l          (scores only)
        L   = logaddexp(lse, sink_h)                               (sink-inclusive LSE)
        O   = O_attn · σ(lse − sink_h) = O_attn · e^{lse − L}       (paper: O·σ(lse − s))
    backward (recompute P = e^{S − L} tile by tile; nothing n×n is stored):
        D_i  = dO_i · O_i
        dV  += Pᵀ dO;   dP = dO Vᵀ;   dS = P ∘ (dP − D)
        dQ  += scale · dS K;   dK += scale · dSᵀ Q
        d sink_h = −Σ_{b,i} σ(sink_h − lse_i) · D_i                  (the sink's P is e^{s − L})

Only q, k, v, O and L are saved (O(n)); each step holds one ``[B, Hq, tq, tk]`` tile.
Tiles outside the mask's key intervals are never visited (sliding window: O(n·W) work;
shared prefix: a suffix's queries never visit another suffix's keys),
and tiles whose evaluated mask is empty are skipped. Math runs in float32 (float64 for
float64 inputs) whatever the input dtype; outputs and gradients are cast back.
A fully masked row yields O = 0 and zero gradients (no NaN), with or without a sink.
Departure from the paper: none in the math; this is the CPU counterpart of its compiled
FlexAttention path. Double backward is not supported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sinkflex.attention.masks import MaskSpec

DEFAULT_Q_TILE = 512  # 256 when the mask's key range per query tile is narrow (sliding window)
DEFAULT_KV_TILE = 512


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _kv_tiles(mask: MaskSpec | None, q0: int, q1: int, kv_len: int, kv_tile: int):
    """Key tiles for queries [q0, q1): tiles of each of the mask's key intervals (never outside them)."""
    intervals = [(0, kv_len)] if mask is None else mask.key_intervals(q0, q1, kv_len)
    for lo, hi in intervals:
        for k0 in range(lo, hi, kv_tile):
            yield k0, min(k0 + kv_tile, hi)


def _masked_scores(q_t: Tensor, k_t: Tensor, mask: MaskSpec | None, group: int, q0: int, q1: int, k0: int, k1: int):
    """Scaled scores of one tile ``[B, Hkv, G·tq, tk]``, masked entries at −inf; None if all masked.

    q_t: ``[B, Hkv, G·tq, D]`` (scale folded in), k_t: ``[B, Hkv, tk, D]``.
    """
    batch, n_kv = q_t.shape[:2]
    allowed = None if mask is None else mask.tile(batch, q0, q1, k0, k1, q_t.device)  # [B or 1, tq, tk]
    if allowed is not None:
        if not bool(allowed.any()):
            return None
        if bool(allowed.all()):
            allowed = None  # e.g. transformers' masks, which carry no structure hints
    scores = q_t @ k_t.transpose(-1, -2)  # [B, Hkv, G·tq, tk]
    if allowed is not None:
        scores.view(batch, n_kv, group, q1 - q0, k1 - k0).masked_fill_(~allowed[:, None, None], float("-inf"))
    return scores


def _q_tile(x: Tensor, q0: int, q1: int) -> Tensor:
    """``[B, Hkv, G, Nq, ...]`` -> the rows q0:q1 of every group head, ``[B, Hkv, G·tq, ...]``."""
    return x[:, :, :, q0:q1].flatten(2, 3)


def _forward(q, k, v, sinks, mask, scale, q_tile, kv_tile):
    """q ``[B, Hkv, G, Nq, D]``, k/v ``[B, Hkv, Nk, D]`` (compute dtype).

    Returns (out ``[B, Hkv, G, Nq, D]``, sink-inclusive lse ``[B, Hkv, G, Nq]``).
    """
    batch, n_kv, group, q_len, dim = q.shape
    kv_len = k.shape[2]
    out = torch.zeros(batch, n_kv, group, q_len, dim, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, n_kv, group, q_len), float("-inf"), dtype=q.dtype, device=q.device)
    for q0 in range(0, q_len, q_tile):
        q1 = min(q0 + q_tile, q_len)
        q_t = _q_tile(q, q0, q1) * scale  # [B, Hkv, G·tq, D]
        row_max = torch.full(q_t.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # [B, Hkv, G·tq]
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros_like(q_t)
        for k0, k1 in _kv_tiles(mask, q0, q1, kv_len, kv_tile):
            scores = _masked_scores(q_t, k[:, :, k0:k1], mask, group, q0, q1, k0, k1)
            if scores is None:
                continue
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            safe_max = _finite_or_zero(new_max)
            probs = scores.sub_(safe_max[..., None]).exp_()  # masked -> e^{-inf} = 0
            rescale = torch.exp(row_max - safe_max)  # row_max = -inf (nothing seen yet) -> 0
            row_sum = row_sum * rescale + probs.sum(dim=-1)
            acc = acc * rescale[..., None] + probs @ v[:, :, k0:k1]
            row_max = new_max
        seen = row_sum > 0
        denom = torch.where(seen, row_sum, torch.ones_like(row_sum))
        tile_shape = (batch, n_kv, group, q1 - q0)
        out[:, :, :, q0:q1] = (acc / denom[..., None]).view(*tile_shape, dim)
        lse[:, :, :, q0:q1] = torch.where(seen, row_max + torch.log(denom), float("-inf")).view(tile_shape)
    if sinks is None:
        return out, lse
    sink = sinks.view(1, n_kv, group, 1).expand_as(lse)
    total = torch.logaddexp(lse, sink)  # L = log(Σ e^s + e^sink)
    keep = torch.where(torch.isneginf(lse), torch.zeros_like(lse), torch.exp(lse - _finite_or_zero(total)))
    return out * keep[..., None], total  # keep = σ(lse − sink); 0 for a fully masked row


def _backward(q, k, v, sinks, mask, scale, out, lse_total, grad_out, q_tile, kv_tile):
    """Gradients (dq, dk, dv, dsinks) in the compute dtype; shapes as in `_forward`."""
    batch, n_kv, group, q_len, dim = q.shape
    kv_len = k.shape[2]
    safe_lse = _finite_or_zero(lse_total)  # fully masked row without sink: every P is e^{-inf} = 0
    delta = (grad_out * out).sum(dim=-1)  # D = rowsum(dO ∘ O)  [B, Hkv, G, Nq]
    grad_q = torch.zeros_like(q)
    grad_k = torch.zeros_like(k)
    grad_v = torch.zeros_like(v)
    for q0 in range(0, q_len, q_tile):
        q1 = min(q0 + q_tile, q_len)
        q_t = _q_tile(q, q0, q1) * scale  # [B, Hkv, G·tq, D]
        do_t = _q_tile(grad_out, q0, q1)  # [B, Hkv, G·tq, D]
        lse_t = _q_tile(safe_lse, q0, q1)[..., None]  # [B, Hkv, G·tq, 1]
        delta_t = _q_tile(delta, q0, q1)[..., None]
        dq_t = torch.zeros_like(q_t)
        for k0, k1 in _kv_tiles(mask, q0, q1, kv_len, kv_tile):
            k_t, v_t = k[:, :, k0:k1], v[:, :, k0:k1]  # [B, Hkv, tk, D]
            scores = _masked_scores(q_t, k_t, mask, group, q0, q1, k0, k1)
            if scores is None:
                continue
            probs = scores.sub_(lse_t).exp_()  # P = e^{S − L}  [B, Hkv, G·tq, tk]
            grad_v[:, :, k0:k1] += probs.transpose(-1, -2) @ do_t  # dV += Pᵀ dO (sums the G heads)
            dscores = do_t @ v_t.transpose(-1, -2)  # dP = dO Vᵀ
            dscores.sub_(delta_t).mul_(probs)  # dS = P ∘ (dP − D)
            dq_t += dscores @ k_t
            grad_k[:, :, k0:k1] += dscores.transpose(-1, -2) @ q_t  # q_t carries the scale
        grad_q[:, :, :, q0:q1] = (dq_t * scale).view(batch, n_kv, group, q1 - q0, dim)
    grad_sinks = None
    if sinks is not None:
        sink = sinks.view(1, n_kv, group, 1)
        sink_prob = torch.exp(sink - safe_lse)  # the sink's P: e^{sink − L} = σ(sink − lse)
        grad_sinks = -(sink_prob * delta).sum(dim=(0, 3)).reshape(-1)  # [Hq], KV-major
    return grad_q, grad_k, grad_v, grad_sinks


class BlockwiseSinkAttention(torch.autograd.Function):
    """Autograd function behind `blockwise_sink_attention` (module docstring for the math)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, scale, q_tile, kv_tile):
        compute = _compute_dtype(q.dtype)
        batch, n_q, q_len, dim = q.shape
        n_kv = k.shape[1]
        qc = q.to(compute).view(batch, n_kv, n_q // n_kv, q_len, dim)  # KV-major grouping
        kc, vc = k.to(compute), v.to(compute)
        sc = None if sinks is None else sinks.to(compute)
        with torch.autocast(q.device.type, enabled=False):  # the math stays fp32 under a caller's bf16 autocast
            out, lse_total = _forward(qc, kc, vc, sc, mask, scale, q_tile, kv_tile)
        ctx.save_for_backward(qc, kc, vc, sc, out, lse_total)
        ctx.meta = (mask, scale, q_tile, kv_tile, q.dtype, k.dtype, v.dtype, None if sinks is None else sinks.dtype)
        return out.view(batch, n_q, q_len, dim).to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        qc, kc, vc, sc, out, lse_total = ctx.saved_tensors
        mask, scale, q_tile, kv_tile, q_dtype, k_dtype, v_dtype, s_dtype = ctx.meta
        batch, n_q, q_len, dim = grad_out.shape
        do = grad_out.to(qc.dtype).reshape(qc.shape)
        with torch.autocast(qc.device.type, enabled=False):
            gq, gk, gv, gs = _backward(qc, kc, vc, sc, mask, scale, out, lse_total, do, q_tile, kv_tile)
        gq = gq.view(batch, n_q, q_len, dim).to(q_dtype)
        gs = None if gs is None else gs.to(s_dtype)
        return gq, gk.to(k_dtype), gv.to(v_dtype), gs, None, None, None, None


def blockwise_sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None,
    mask: MaskSpec | None,
    scale: float,
    *,
    q_tile: int | None = None,
    kv_tile: int = DEFAULT_KV_TILE,
) -> Tensor:
    """Exact sink attention in O(n) memory, differentiable in q, k, v and sinks (any device).

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nk, D]`` (query head h uses kv head
            ``h // (Hq // Hkv)``); float16/bfloat16/float32/float64.
        sinks: ``[Hq]`` sink logits, or None for plain attention.
        mask: allowed (query, key) pairs (`MaskSpec`), or None for all.
        scale: multiplies q·k.
        q_tile, kv_tile: tile sizes (memory per step ~ ``B·Hq·q_tile·kv_tile`` floats); q_tile
            None = 512, or 256 when the mask lets a query tile see fewer than 1024 keys.

    Returns:
        ``[B, Hq, Nq, D]`` in q's dtype.
    """
    if q_tile is None:
        q_tile = DEFAULT_Q_TILE
        q_len, kv_len = q.shape[2], k.shape[2]
        if mask is not None and q_len > q_tile:
            width = sum(hi - lo for lo, hi in mask.key_intervals(q_len // 2, q_len // 2 + q_tile, kv_len))
            q_tile = q_tile if width >= 2 * q_tile else q_tile // 2
    if q_tile < 1 or kv_tile < 1:
        raise ValueError(f"tile sizes must be >= 1; got q_tile={q_tile}, kv_tile={kv_tile}")
    return BlockwiseSinkAttention.apply(q, k, v, sinks, mask, scale, q_tile, kv_tile)
