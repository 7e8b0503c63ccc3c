"""`sink_attention`: the one public entry point, dispatching to the backends.

Backends (side by side, none imports another):
- ``"reference"`` — `sinkflex.attention.reference`: eager, n×n, float64-capable oracle;
- ``"flex"`` — `sinkflex.attention.flex`: compiled FlexAttention with block masks (CUDA);
- ``"cpu"`` — `sinkflex.attention.blockwise`: exact blockwise autograd function, O(n)
  memory (the CPU training path; also runs on CUDA, unfused);
- ``"auto"`` — ``"flex"`` on CUDA, ``"cpu"`` elsewhere.

Beside them, `sinkflex.attention.sdpa`: PyTorch's SDPA for the masks it expresses exactly
(plain causal, shared prefix without window or padding) and **no sinks**; not a choice of
`sink_attention` (which always takes sinks) but the path the transformers integration
(`sinkflex.attention.hf`) takes on CPU for sink-free layers when the mask allows. Each is
tested against the reference (tests/test_attention.py, tests/test_shared_prefix.py).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from sinkflex.attention.masks import MaskSpec

Backend = Literal["auto", "reference", "flex", "cpu"]
BACKENDS = ("auto", "reference", "flex", "cpu")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, N, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or head dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[1]):
        raise ValueError(f"sinks must be [Hq] = [{q.shape[1]}]; got {tuple(sinks.shape)}")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"flex"`` on CUDA else ``"cpu"``; validates the name (ValueError)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "cpu"
    return backend


def sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None = None,
    *,
    mask: MaskSpec | None,
    scale: float | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Attention with a learned per-head sink logit (paper: O_sink = O · σ(lse − s)).

    ``O_i = Σ_j e^{s_ij} v_j / (Σ_j e^{s_ij} + e^{sink_h})`` with ``s_ij = scale · q_i·k_j``
    over the keys the mask allows; LSE math in float32 (float64 for float64 inputs).

    Args:
        q: ``[B, Hq, Nq, D]`` queries.
        k, v: ``[B, Hkv, Nk, D]``, Hq a multiple of Hkv; query head h uses kv head
            ``h // (Hq // Hkv)`` (KV-major grouping, as ``repeat_kv`` in transformers).
        sinks: ``[Hq]`` sink logits (any float dtype), or None for plain attention.
        mask: a `MaskSpec` from the ``generate_*`` factories (combine with ``&``), or None
            for no masking at all (bidirectional). Required keyword: causality is explicit.
        scale: multiplies q·k; default ``D ** -0.5``.
        backend: ``"auto"`` | ``"reference"`` | ``"flex"`` | ``"cpu"`` (see module docstring).

    Returns:
        ``[B, Hq, Nq, D]`` in q's dtype; a fully masked row is 0 (no NaN in values or grads).

    Raises:
        ValueError: bad shapes/dtypes or unknown backend.
        RuntimeError: ``"flex"`` on CPU with gradients required.
    """
    _check_inputs(q, k, v, sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    chosen = resolve_backend(backend, q.device)
    if chosen == "reference":
        from sinkflex.attention.reference import reference_sink_attention

        return reference_sink_attention(q, k, v, sinks, mask, scale)[0]
    if chosen == "flex":
        from sinkflex.attention.flex import flex_sink_attention

        return flex_sink_attention(q, k, v, sinks, mask, scale)[0]
    from sinkflex.attention.blockwise import blockwise_sink_attention

    return blockwise_sink_attention(q, k, v, sinks, mask, scale)
