"""Reference sink attention: eager PyTorch, readable, float64-capable — the correctness oracle.

Implements the paper's sink attention literally, with the sink as one extra logit whose
value vector is zero (SinkFlex-RL, §sink-aware FlexAttention; gpt-oss):

    O_i = Σ_j e^{s_ij} v_j / (Σ_j e^{s_ij} + e^{sink_h}),   s_ij = scale · q_i·k_j  (allowed j)

It materialises the full ``[B, Hq, Nq, Nk]`` scores, so it is for tests and small inputs
only. Computation runs in the input dtype (use float64 for the oracle). Departure from
transformers' eager gpt-oss attention: masked logits are −inf (not ``finfo.min``) and a
fully masked row without a sink returns 0 instead of a uniform average.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sinkflex.attention.masks import MaskSpec


def reference_sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None,
    mask: MaskSpec | None,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Eager sink attention (module docstring); differentiable by autograd in q, k, v, sinks.

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nk, D]``; Hq a multiple of Hkv, query head h
            uses kv head ``h // (Hq // Hkv)`` (KV-major grouping).
        sinks: ``[Hq]`` sink logits, or None for plain attention.
        mask: allowed (query, key) pairs, or None for all.
        scale: multiplies q·k.

    Returns:
        ``(out [B, Hq, Nq, D] in q's dtype, lse [B, Hq, Nq])`` where lse is the log-sum-exp
        of the allowed scores only (without the sink; −inf for a fully masked row).
    """
    batch, n_q_heads, q_len, _ = q.shape
    n_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = n_q_heads // n_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [B, Hq, Nk, D]
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Hq, Nq, Nk]
    if mask is not None:
        allowed = mask.dense(batch, q_len, kv_len, q.device)  # [B or 1, Nq, Nk]
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(scores.detach(), dim=-1)
    logits = scores
    if sinks is not None:
        sink_col = sinks.to(scores.dtype).view(1, n_q_heads, 1, 1).expand(batch, n_q_heads, q_len, 1)
        logits = torch.cat([scores, sink_col], dim=-1)  # [B, Hq, Nq, Nk + 1]
    row_max = logits.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)  # fully masked rows
    weights = torch.exp(logits - row_max)
    denom = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    probs = weights / denom  # a fully masked row (no sink) is all 0
    out = probs[..., :kv_len] @ v.to(probs.dtype)  # the sink column has a zero value vector
    return out.to(q.dtype), lse
