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
from sinkflex.attention.masks import MaskSpec, generate_causal, generate_sliding_window

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

    spec = MaskSpec(mask_mod=hf_mask, description=f"transformers({getattr(inner, '__name__', 'mask')})")
    spec._cache["hf"] = {"offset": q_off - kv_off, "or_overlay": _has_or_overlay(inner)}
    # plain causal over the whole row (no padding, no packing, no cache): SDPA's is_causal is exact
    spec._cache["plain_causal"] = inner is causal_mask_function and padding is None and q_off == 0 and kv_off == 0
    return spec


def _with_structure(spec: MaskSpec, causal: bool, sliding_window: int | None, offset: int) -> MaskSpec:
    """``spec & causal (& window)`` as in flash attention, cached on spec (keeps block-mask caching).

    ``offset`` (query-minus-key position) is taken from the spec when transformers built it.
    """
    if "with_band" in spec._cache:  # the mask knows its own frame (shared prefix: logical positions)
        return spec._cache["with_band"](sliding_window) if causal else spec
    info = spec._cache.get("hf", {"offset": offset, "or_overlay": False})
    if info["or_overlay"] or not causal:
        return spec
    key = ("structured", sliding_window, info["offset"])
    if key not in spec._cache:
        offset = info["offset"]
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
    """Without sinks on the CPU path, the fastest exact attention the mask allows, or None.

    - plain causal rows (transformers' causal mask, no padding/packing/cache, no window):
      ``F.scaled_dot_product_attention(is_causal=True)`` — PyTorch's fused CPU flash kernel;
    - shared-prefix rows without padding or window: SDPA on the prefix (causal) and the
      suffixes batched (`_sdpa_shared_prefix`; on CPU `_SuffixAttention`: prefix part and
      own causal part as two unmasked flash calls merged by their LSE);
      the prefix keys' gradients from all suffixes add up.
    Anything else (windows, padding, documents) stays on the blockwise path. ``given`` is
    the layer's attention_mask argument, ``mask`` the spec with the layer's structure.
    """
    if not _BACKEND["sdpa"] or not isinstance(mask, MaskSpec) or q_len != kv_len:
        return None
    if sliding_window is None and isinstance(given, MaskSpec) and given._cache.get("plain_causal"):
        return _sdpa_causal  # `given`: transformers' mask before the causal band was ANDed in
    layout = mask._cache.get("shared_prefix")
    if layout is not None and mask._cache.get("shared_prefix_window") is None and not mask._cache.get("has_padding"):
        return lambda q, k, v, scale: _sdpa_shared_prefix(q, k, v, scale, layout)
    return None


def _sdpa_causal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """``[B, Hq, N, D]`` causal SDPA (GQA by KV-major grouping, as `repeat_kv`)."""
    import torch.nn.functional as F

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
    import torch.nn.functional as F

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
    import torch.nn.functional as F

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
