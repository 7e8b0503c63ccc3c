"""Attention masks as small factories (attention-gym style), composable with ``&``."""

from sinkflex.attention.masks.causal import generate_causal
from sinkflex.attention.masks.document import generate_document
from sinkflex.attention.masks.padding import generate_padding
from sinkflex.attention.masks.shared_prefix import generate_shared_prefix
from sinkflex.attention.masks.sliding_window import generate_sliding_window
from sinkflex.attention.masks.spec import HFMaskInfo, MaskMod, MaskSpec, SharedPrefixLayout, and_masks

__all__ = [
    "HFMaskInfo",
    "MaskMod",
    "MaskSpec",
    "SharedPrefixLayout",
    "and_masks",
    "generate_causal",
    "generate_document",
    "generate_padding",
    "generate_shared_prefix",
    "generate_sliding_window",
]
