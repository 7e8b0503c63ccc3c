"""Sink attention on compiled FlexAttention (CUDA): the paper's sink-aware FlexAttention path.

``torch.nn.attention.flex_attention`` compiled by ``torch.compile`` into a fused Triton
kernel, with a `BlockMask` from ``create_block_mask`` (compiled too, so the n×n mask is
never materialised), returning the LSE (``return_aux=AuxRequest(lse=True)``; ``return_lse=True``
on releases before it). The sink
is applied afterwards with the zero-value identity (paper; torchtitan gpt-oss)

    O_sink = O · σ(lse − sink),    computed in float32 whatever the input dtype,

so gradients reach q, k, v (through flex's backward, which also differentiates the
LSE) and the sink logits. GQA uses flex's ``enable_gqa`` (query head h reads kv head
``h // (Hq // Hkv)``, the KV-major grouping of `reference`).

On CPU, flex only runs uncompiled and forward-only (it materialises the scores and has
no backward; see docs/architecture.md): this module serves CPU calls only without gradients, as a
cross-check of the masks; it raises otherwise. Departure from transformers' flex path:
the rescale is done in float32, not in the value dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from torch import Tensor
from torch.nn.attention import flex_attention as _flex_module
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from sinkflex.attention.masks import MaskSpec

_compiled: dict[str, object] = {}

#: ``return_aux=AuxRequest(lse=True)`` where torch has it (2.9+), else the older ``return_lse=True``.
_LSE_REQUEST = (
    {"return_aux": _flex_module.AuxRequest(lse=True)} if hasattr(_flex_module, "AuxRequest") else {"return_lse": True}
)
#: The kernel option that picks the Triton kernel, where torch knows a choice of backends
#: (``FlexKernelOptions["BACKEND"]``); older releases have only the Triton kernel.
_TRITON = (
    {"BACKEND": "TRITON"} if "BACKEND" in getattr(getattr(_flex_module, "FlexKernelOptions", None), "__annotations__", {}) else None
)

#: A stand-in for compiled ``flex_attention`` (same signature), set by `kernel_override`.
_KERNEL: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("sinkflex_flex_kernel", default=None)


@contextlib.contextmanager
def kernel_override(kernel: Callable) -> Iterator[None]:
    """Within the block, `flex_sink_attention` calls ``kernel`` in place of compiled
    ``flex_attention`` on every device (gradients allowed on CPU too) and builds block masks
    with uncompiled ``create_block_mask``.

    For tracing the CUDA path with fake tensors on a machine without CUDA (the learner's
    memory model, `learner_service.memory_model`): ``kernel`` is then ``flex_attention``
    calling its higher-order op directly, whose fake implementation allocates what the
    fused kernel returns (out, LSE) and nothing n×n.
    """
    token = _KERNEL.set(kernel)
    try:
        yield
    finally:
        _KERNEL.reset(token)


def compiled_flex_attention():
    """``torch.compile(flex_attention)``, built once per process."""
    if "flex" not in _compiled:
        _compiled["flex"] = torch.compile(flex_attention)
    return _compiled["flex"]


def compiled_create_block_mask():
    """``torch.compile(create_block_mask)``: builds block masks without an n×n tensor."""
    if "block_mask" not in _compiled:
        _compiled["block_mask"] = torch.compile(create_block_mask)
    return _compiled["block_mask"]


def block_mask_for(mask: MaskSpec | None, batch: int, q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """The `BlockMask` of a `MaskSpec` (cached on the spec per shape and device).

    Masks are head-independent (``H=None``). ``mask=None`` (no masking) uses an
    all-true mask_mod. On CUDA the block mask is built by compiled ``create_block_mask``.
    """
    spec = mask if mask is not None else _NO_MASK
    key = ("block_mask", batch, q_len, kv_len, str(device))
    if key not in spec._cache:
        build = compiled_create_block_mask() if device.type == "cuda" and _KERNEL.get() is None else create_block_mask
        spec._cache[key] = build(spec.mask_mod, batch, None, q_len, kv_len, device=device)
    return spec._cache[key]


def _all(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= 0


_NO_MASK = MaskSpec(mask_mod=_all, description="none")


def flex_sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None,
    mask: MaskSpec | BlockMask | None,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Sink attention through FlexAttention (module docstring).

    Args:
        q: ``[B, Hq, Nq, D]``; k, v: ``[B, Hkv, Nk, D]``, same dtype; CUDA for training.
        sinks: ``[Hq]`` sink logits, or None for plain attention.
        mask: a `MaskSpec` (block mask built and cached here), a ready `BlockMask`, or None.
        scale: multiplies q·k.

    Returns:
        ``(out [B, Hq, Nq, D] in q's dtype, lse [B, Hq, Nq] float32, float64 for float64 q)``; lse is over the
        allowed scores only (no sink), −inf for a fully masked row.

    Raises:
        RuntimeError: on CPU with gradients required (flex has no CPU backward).
    """
    kernel = _KERNEL.get()
    on_cuda = q.device.type == "cuda" or kernel is not None
    if not on_cuda and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        raise RuntimeError(
            "the flex backend needs CUDA for training: PyTorch's flex_attention has no CPU backward; "
            "use backend='cpu' (blockwise) on CPU"
        )
    if not on_cuda:  # forward-only cross-check: flex refuses CPU inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    batch, q_len, kv_len = q.shape[0], q.shape[2], k.shape[2]
    block_mask = mask if isinstance(mask, BlockMask) else block_mask_for(mask, batch, q_len, kv_len, q.device)
    run = kernel or (compiled_flex_attention() if on_cuda else flex_attention)
    out, aux = run(
        q,
        k,
        v,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        # the Triton kernel differentiates through the LSE; the experimental FLASH backend does not
        kernel_options=_TRITON if on_cuda else None,
        **_LSE_REQUEST,
    )
    math_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = (aux.lse if hasattr(aux, "lse") else aux).to(math_dtype)  # [B, Hq, Nq], natural log
    if sinks is None:
        return out, lse
    keep = torch.sigmoid(lse - sinks.to(math_dtype).view(1, -1, 1))  # σ(lse − sink); 0 where lse = −inf
    return (out.to(math_dtype) * keep[..., None]).to(q.dtype), lse
