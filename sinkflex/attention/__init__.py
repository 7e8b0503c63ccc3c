"""Sink-aware attention: exact, differentiable, O(n) memory on CUDA (flex) and CPU (blockwise).

Public API::

    from sinkflex.attention import sink_attention, generate_causal, generate_sliding_window
    out = sink_attention(q, k, v, sinks, mask=generate_sliding_window(128), backend="auto")

Backends side by side (`api`): ``reference`` (eager oracle), ``flex`` (compiled
FlexAttention, CUDA), ``cpu`` (blockwise autograd function). Masks are ``generate_<name>``
factories in `sinkflex.attention.masks`. `register` makes the whole thing available to
transformers models as ``attn_implementation="sinkflex"`` (`sinkflex.attention.hf`).
The paper's equation: O_sink = Σ e^{qk} v / (Σ e^{qk} + e^{s}) = O · σ(lse − s).
"""

from sinkflex.attention.api import BACKENDS, sink_attention
from sinkflex.attention.masks import (
    MaskSpec,
    and_masks,
    generate_causal,
    generate_document,
    generate_padding,
    generate_shared_prefix,
    generate_sliding_window,
)


def register(name: str = "sinkflex") -> str:
    """Register sink attention with transformers' AttentionInterface and AttentionMaskInterface.

    After this, ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) runs every attention layer through
    `sink_attention` (backend "auto"). Idempotent. Returns the name.
    """
    from sinkflex.attention import hf

    return hf.register(name)


__all__ = [
    "BACKENDS",
    "MaskSpec",
    "and_masks",
    "generate_causal",
    "generate_document",
    "generate_padding",
    "generate_shared_prefix",
    "generate_sliding_window",
    "register",
    "sink_attention",
]
