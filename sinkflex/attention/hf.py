"""transformers integration: ``attn_implementation="sinkflex"`` for any causal LM, sinks or not.

Importing this module registers two functions under the name ``"sinkflex"``:

- an **attention function** (`transformers.AttentionInterface`) called by every attention
  layer as ``fn(module, query, key, value, attention_mask, scaling=, dropout=,
  sliding_window=, s_aux=, **kwargs)`` with q ``[B, Hq, N, D]``, k/v ``[B, Hkv, Nk, D]``;
  it returns ``(out [B, N, Hq, D], None)``. gpt-oss passes its sinks as ``s_aux`` and,
  on sliding layers, ``sliding_window=128``; Llama passes neither.
- a **mask function** (`transformers.masking_utils.AttentionMaskInterface`) called by
  ``create_causal_mask`` / ``create_sliding_window_causal_mask``. Without it transformers
  would hand a custom attention ``attention_mask=None`` and padding would be lost. It
  returns a `MaskSpec` (no n×n tensor) wrapping transformers' own ``mask_function`` —
  causal or sliding, plus packed sequences detected from ``position_ids`` — the 2D
  padding mask and the cache offsets, so the mask semantics are exactly transformers'.

A `MaskSpec` built by the caller may also be passed directly — for gpt-oss as the
per-layer-type dict ``attention_mask={"full_attention": spec, "sliding_attention": spec}``
(see `layer_masks`), e.g. ``generate_document(ids) & generate_padding(...)`` for packed
batches: transformers' gpt-oss does not detect packing from ``position_ids`` (Llama
does, with ``use_cache=False``).

In the attention function the layer's structure is ANDed in as well (causal when
``module.is_causal``, the window when ``sliding_window`` is given — what transformers'
flash path does), which lets the blockwise path skip tiles: O(n·W) on sliding layers.
This is skipped when the mask was built with an OR-overlay (e.g. bidirectional image
blocks), which may allow keys outside the causal band.

Refused with a clear error (never silently dropped): attention dropout > 0 in training,
``softcap``, ``position_bias``, a float 4D mask that is not a pure 0/−inf mask, a
module with ``sinks`` called without ``s_aux``, and a `BlockMask` on the CPU path.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from sinkflex.attention.api import resolve_backend
from sinkflex.attention.masks import HFMaskInfo, MaskSpec, generate_causal, generate_sliding_window
from sinkflex.attention.sdpa import sdpa_causal_attention, sdpa_shared_prefix_attention, supports_shared_prefix

NAME = "sinkflex"

_MASK_OVERRIDE: contextvars.ContextVar[MaskSpec | None] = contextvars.ContextVar("sinkflex_mask_override", default=None)


@contextlib.contextmanager
def mask_override(spec: MaskSpec | None) -> Iterator[None]:
    """Within the block, every mask transformers builds for a sinkflex model is ``spec``.

    For masks transformers cannot express from ``position_ids`` (a shared-prefix row:
    `generate_shared_prefix`); works for any model whose mask creation goes through
    ``create_causal_mask`` / ``create_sliding_window_causal_mask`` (Llama, gpt-oss, …).
    Each layer still adds its own structure (``with_band``: the logical sliding window).
    ``spec=None`` changes nothing.
    """
    token = _MASK_OVERRIDE.set(spec)
    try:
        yield
    finally:
        _MASK_OVERRIDE.reset(token)


def _has_or_overlay(fn: Callable, depth: int = 0) -> bool:
    """True if a transformers mask_function contains an ``or_masks`` overlay (closure walk)."""
    if depth > 8 or not callable(fn):
        return False
    if getattr(fn, "__name__", "") == "or_mask":
        return True
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        items = value if isinstance(value, tuple | list) else (value,)
        if any(callable(item) and _has_or_overlay(item, depth + 1) for item in items):
            return True
    return False


def sinkflex_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    **kwargs,
) -> MaskSpec:
    """AttentionMaskInterface function: a `MaskSpec` equal to transformers' mask, without n×n.

    Args (as transformers' ``sdpa_mask``): ``mask_function(b, h, q_idx, kv_idx)`` over
    absolute positions, ``attention_mask`` the 2D ``[B, kv_offset + Nk]`` padding mask
    (True = real token), offsets of the first query/key position. Other kwargs ignored.
    """
    from transformers.masking_utils import causal_mask_function, padding_mask_function, prepare_padding_mask

    override = _MASK_OVERRIDE.get()
    if override is not None:
        return override
    q_off, kv_off = int(q_offset), int(kv_offset)
    inner = mask_function if mask_function is not None else causal_mask_function
    padding = prepare_padding_mask(attention_mask, kv_length, kv_off)
    pad_fn = padding_mask_function(padding.to(torch.bool)) if padding is not None else None

    def hf_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_pos, kv_pos = q_idx + q_off, kv_idx + kv_off
        allowed = inner(b, h, q_pos, kv_pos)
        if pad_fn is not None:
            allowed = allowed & pad_fn(b, h, q_pos, kv_pos)
        return allowed

    info = HFMaskInfo(
        offset=q_off - kv_off,
        or_overlay=_has_or_overlay(inner),
        # plain causal over the whole row (no padding, no packing, no cache): SDPA's is_causal is exact
        plain_causal=inner is causal_mask_function and padding is None and q_off == 0 and kv_off == 0,
    )
    return MaskSpec(mask_mod=hf_mask, description=f"transformers({getattr(inner, '__name__', 'mask')})", hf=info)


def _with_structure(spec: MaskSpec, causal: bool, sliding_window: int | None, offset: int) -> MaskSpec:
    """``spec & causal (& window)`` as in flash attention, cached on spec (keeps block-mask caching).

    ``offset`` (query-minus-key position) is taken from the spec when transformers built it.
    """
    if spec.with_band is not None:  # the mask knows its own frame (shared prefix: logical positions)
        return spec.with_band(sliding_window) if causal else spec
    if spec.hf is not None:
        if spec.hf.or_overlay:
            return spec
        offset = spec.hf.offset
    if not causal:
        return spec
    key = ("structured", sliding_window, offset)  # memoised on the spec
    if key not in spec._cache:
        band = generate_sliding_window(sliding_window, offset) if sliding_window else generate_causal(offset)
        spec._cache[key] = spec & band
    return spec._cache[key]


def _dense_to_spec(mask: Tensor, batch: int) -> MaskSpec:
    """A user-given 4D mask ``[B or 1, 1, Nq, Nk]`` (bool, or float 0/−inf-like additive) as a `MaskSpec`."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"sinkflex needs a head-independent 4D mask [B, 1, Nq, Nk]; got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed = mask[:, 0]
    else:
        allowed = mask[:, 0] == 0
        blocked = mask[:, 0] <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            raise ValueError("sinkflex does not support additive attention biases; only 0 / -inf masks")
    allowed = allowed.expand(batch, -1, -1)

    def dense(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return allowed[b, q_idx, kv_idx]

    return MaskSpec(mask_mod=dense, description="dense 4D mask")


def sinkflex_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: MaskSpec | Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """AttentionInterface function: transformers' calling convention around `sink_attention`.

    Args:
        module: the attention layer (reads ``is_causal``, ``training``, ``sinks``).
        query: ``[B, Hq, Nq, D]``; key, value: ``[B, Hkv, Nk, D]`` (after RoPE and cache).
        attention_mask: the `MaskSpec` from `sinkflex_mask`, a 4D bool / 0-−inf mask,
            a `BlockMask` (flex only), or None (causal by ``module.is_causal``).
        scaling: q·k scale (default ``D ** -0.5``); dropout: must be 0 when training;
        sliding_window: W for sliding layers; s_aux: ``[Hq]`` sink logits (gpt-oss).

    Returns:
        ``(attn_output [B, Nq, Hq, D], None)`` — attention weights are never materialised.

    Raises:
        NotImplementedError / ValueError / TypeError: for combinations listed in the module docstring.
    """
    from torch.nn.attention.flex_attention import BlockMask

    from sinkflex.attention.blockwise import blockwise_sink_attention
    from sinkflex.attention.flex import flex_sink_attention

    if dropout and module.training:
        raise NotImplementedError(f"sinkflex attention has no dropout; got dropout={dropout} in training mode")
    for unsupported in ("softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"sinkflex attention does not support `{unsupported}`")
    if s_aux is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise ValueError(f"{type(module).__name__} has sinks but none were passed as `s_aux`; refusing to drop them")
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    if isinstance(attention_mask, MaskSpec):
        mask = _with_structure(attention_mask, causal, sliding_window, kv_len - q_len)
    elif isinstance(attention_mask, BlockMask):
        mask = attention_mask
    elif isinstance(attention_mask, Tensor):
        mask = _dense_to_spec(attention_mask[:, :, :, :kv_len], batch)
        if sliding_window:
            mask = mask & generate_sliding_window(sliding_window, kv_len - q_len)
    elif attention_mask is None:
        offset = kv_len - q_len
        band = generate_sliding_window(sliding_window, offset) if sliding_window else generate_causal(offset)
        mask = band if causal else None
    else:
        raise TypeError(f"unsupported attention_mask type {type(attention_mask).__name__}")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    backend = resolve_backend(_BACKEND["name"], query.device)
    if backend == "flex":
        out = flex_sink_attention(query, key, value, s_aux, mask, scale)[0]
    elif isinstance(mask, BlockMask):
        raise TypeError("a BlockMask attention_mask needs the flex backend (CUDA)")
    elif backend == "reference":
        from sinkflex.attention.reference import reference_sink_attention

        out = reference_sink_attention(query, key, value, s_aux, mask, scale)[0]
    elif s_aux is None and (fast := _sdpa_route(attention_mask, mask, sliding_window, q_len, kv_len)) is not None:
        out = fast(query, key, value, scale)
    else:
        out = blockwise_sink_attention(query, key, value, s_aux, mask, scale)
    return out.transpose(1, 2).contiguous(), None


_BACKEND = {"name": "auto", "sdpa": True}


def _sdpa_route(given, mask, sliding_window: int | None, q_len: int, kv_len: int):
    """Without sinks on the CPU path, the `sinkflex.attention.sdpa` function the mask allows, or None.

    - plain causal rows (transformers' causal mask, no padding/packing/cache, no window):
      `sdpa.sdpa_causal_attention` (PyTorch's fused CPU flash kernel);
    - shared-prefix rows without padding or window: `sdpa.sdpa_shared_prefix_attention`.
    Anything else (windows, padding, documents) stays on the blockwise path. ``given`` is
    the layer's attention_mask argument, ``mask`` the spec with the layer's structure.
    """
    if not _BACKEND["sdpa"] or not isinstance(mask, MaskSpec) or q_len != kv_len:
        return None
    if sliding_window is None and isinstance(given, MaskSpec) and given.hf is not None and given.hf.plain_causal:
        return sdpa_causal_attention  # `given`: transformers' mask before the causal band was ANDed in
    if supports_shared_prefix(mask):
        return lambda q, k, v, scale: sdpa_shared_prefix_attention(q, k, v, mask, scale)
    return None


def layer_masks(config, mask: MaskSpec) -> dict[str, MaskSpec]:
    """``{layer_type: mask}`` for every layer type of ``config``, to pass as ``attention_mask``.

    gpt-oss (and other models with ``config.layer_types``) accept this dict in place of the
    2D mask; each layer then ANDs its own causal band / sliding window into ``mask``. Use it
    for packed batches: ``layer_masks(cfg, generate_document(doc_ids))``.
    """
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return {layer_type: mask for layer_type in set(layer_types)}


def register(name: str = NAME, backend: str = "auto") -> str:
    """Register the attention and mask functions with transformers under ``name`` (idempotent).

    Args:
        name: the ``attn_implementation`` string.
        backend: ``"auto"`` (flex on CUDA, blockwise elsewhere), ``"cpu"`` or ``"reference"``.

    Returns:
        ``name``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    resolve_backend(backend, torch.device("cpu"))  # validates the name
    _BACKEND["name"] = backend
    AttentionInterface.register(name, sinkflex_attention_forward)
    AttentionMaskInterface.register(name, sinkflex_mask)
    return name


register()
