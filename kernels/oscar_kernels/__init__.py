"""Fused Triton kernels for OSCAR-KV's INT2 KV cache.

Storage and the one definition of its layout: :mod:`oscar_kernels.layout` (``Int2Pool``, ``LayerCache``, pack/unpack,
the exact-row map) and :class:`Int2KVPool` (all layers, writes, accounting); the scheme and the decode options:
:mod:`oscar_kernels.scheme` (``QuantScheme``, ``DecodeOptions``; pure Python).
Kernels: ``quantize_pack`` (:mod:`~oscar_kernels.write`: rotate, clip, quantize, pack and scatter new tokens,
optionally their exact rows), ``decode_int2`` (:mod:`~oscar_kernels.decode`: split-KV decode over INT2 slots plus
exact rows), ``extend_int2`` (:mod:`~oscar_kernels.extend`: prefill/extend under the position-wise sink/recent
windows, INT2 tiles dequantised in registers) and ``extend_int2_dequant`` (the same attention over INT2 rows
dequantised once into a ``dequant_scratch``: the serving default).
Serving: :class:`DecodePlan` / :class:`ExtendPlan` fill the index lists on the device once per batch (``plan``) and
run a layer's write + attention (``run``) with no host synchronisation.

The names below load their module (and torch and Triton) on first use, so ``import oscar_kernels.scheme`` stays
light for the processes that only read a scheme. No module is named like a function it exports.
"""

import importlib

_EXPORTS = {
    "decode": ("DecodeLaunch", "decode_int2", "decode_int2_ref"),
    "decode_grid": ("DecodeIndex", "SplitPolicy", "balance_counts", "decode_index", "decode_workspace",
                    "default_num_splits", "split_policy"),
    "extend": ("ExtendIndex", "dequant_scratch", "extend_int2", "extend_int2_dequant", "extend_int2_ref"),
    "layout": ("DEFAULT_CLIP_RATIO", "FP8_MAX", "FP8_MIN_STEP", "SCALE_EPS", "Int2Pool", "LayerCache", "cached_rows_ref", "dequantize_ref",
               "exact_row_ref", "pack", "to_fp8", "unpack"),
    "plan": ("DecodePlan", "ExtendPlan"),
    "pool": ("Int2KVPool",),
    "scheme": ("DecodeOptions", "QuantScheme"),
    "write": ("quantize_pack", "quantize_pack_kv", "quantize_pack_ref"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    """PEP 562: an exported name imports its module once, then lives in the package's namespace."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
