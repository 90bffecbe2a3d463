"""Fused Triton kernels for OSCAR-KV's INT2 KV cache (imported as ``oscar_kernels``).

Storage and the one definition of its layout: :mod:`oscar_kernels.layout` (``Int2Pool``, ``LayerCache``, pack/unpack,
the exact-row map) and :class:`Int2KVPool` (all layers, writes, accounting).
Kernels: ``quantize_pack`` (rotate, clip, quantize, pack and scatter new tokens, optionally their exact rows),
``decode_int2`` (split-KV decode over INT2 slots plus exact rows), ``extend_int2`` (prefill/extend under the
position-wise sink/recent windows, INT2 tiles dequantised in registers) and ``extend_int2_dequant`` (the same
attention over INT2 rows dequantised once into a ``dequant_scratch``: the serving default).
Serving: :class:`DecodePlan` / :class:`ExtendPlan` fill the index lists on the device once per batch (``plan``) and
run a layer's write + attention (``run``) with no host synchronisation.
"""

import importlib
import sys
import types

_EXPORTS = {
    "decode_int2": ("DecodeIndex", "SplitPolicy", "balance_counts", "decode_index", "decode_int2", "decode_int2_ref", "decode_workspace",
                    "default_num_splits", "split_policy"),
    "extend_int2": ("ExtendIndex", "dequant_scratch", "extend_int2", "extend_int2_dequant", "extend_int2_ref"),
    "layout": ("DEFAULT_CLIP_RATIO", "SCALE_EPS", "Int2Pool", "LayerCache", "cached_rows_ref", "dequantize_ref",
               "exact_row_ref", "pack", "unpack"),
    "plan": ("DecodePlan", "ExtendPlan"),
    "pool": ("Int2KVPool",),
    "quantize_pack": ("quantize_pack", "quantize_pack_kv", "quantize_pack_ref"),
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}


class _Package(types.ModuleType):
    """Exports load their module (and Triton) on first use, so ``import oscar_kernels.scheme`` stays light. Three
    kernels share their module's name (``quantize_pack``, ``decode_int2``, ``extend_int2``): when the import system
    binds such a submodule on the package, the package keeps the function under that name, as an eager
    ``from .quantize_pack import quantize_pack`` would."""

    def __getattr__(self, name: str):
        if name in _WHERE:
            value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
            types.ModuleType.__setattr__(self, name, value)
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return  # a submodule named like its kernel: the name stays the kernel's
        types.ModuleType.__setattr__(self, name, value)


sys.modules[__name__].__class__ = _Package

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
    "balance_counts",
    "cached_rows_ref",
    "decode_index",
    "decode_int2",
    "decode_int2_ref",
    "decode_workspace",
    "default_num_splits",
    "dequant_scratch",
    "dequantize_ref",
    "exact_row_ref",
    "extend_int2",
    "extend_int2_dequant",
    "extend_int2_ref",
    "pack",
    "quantize_pack",
    "quantize_pack_kv",
    "quantize_pack_ref",
    "split_policy",
    "unpack",
]
