"""Fused Triton kernels for OSCAR-KV's INT2 KV cache (imported as ``oscar_kernels``).

Storage and the one definition of its layout: :mod:`oscar_kernels.layout` (``Int2Pool``, ``LayerCache``, pack/unpack,
the exact-row map) and :class:`Int2KVPool` (all layers, writes, accounting).
Kernels: ``quantize_pack`` (rotate, clip, quantize, pack and scatter new tokens, optionally their exact rows),
``decode_int2`` (split-KV decode over INT2 slots plus exact rows), ``extend_int2`` (prefill/extend under the
position-wise sink/recent windows).
Serving: :class:`DecodePlan` / :class:`ExtendPlan` fill the index lists on the device once per batch (``plan``) and
run a layer's write + attention (``run``) with no host synchronisation.
"""

from .decode_int2 import (
    DecodeIndex,
    SplitPolicy,
    decode_index,
    decode_int2,
    decode_int2_ref,
    decode_workspace,
    default_num_splits,
    split_policy,
)
from .extend_int2 import ExtendIndex, extend_int2, extend_int2_ref
from .layout import (
    DEFAULT_CLIP_RATIO,
    SCALE_EPS,
    Int2Pool,
    LayerCache,
    cached_rows_ref,
    dequantize_ref,
    exact_row_ref,
    pack,
    unpack,
)
from .plan import DecodePlan, ExtendPlan
from .pool import Int2KVPool
from .quantize_pack import quantize_pack, quantize_pack_ref

__all__ = [
    "DEFAULT_CLIP_RATIO",
    "SCALE_EPS",
    "DecodeIndex",
    "DecodePlan",
    "ExtendIndex",
    "ExtendPlan",
    "Int2KVPool",
    "Int2Pool",
    "LayerCache",
    "SplitPolicy",
    "cached_rows_ref",
    "decode_index",
    "decode_int2",
    "decode_int2_ref",
    "decode_workspace",
    "default_num_splits",
    "dequantize_ref",
    "exact_row_ref",
    "extend_int2",
    "extend_int2_ref",
    "pack",
    "quantize_pack",
    "quantize_pack_ref",
    "split_policy",
    "unpack",
]
