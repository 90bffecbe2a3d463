"""Fused Triton kernels for OSCAR-KV's INT2 KV cache (imported as ``oscar_kernels``).

``quantize_pack``: rotate, clip, quantize, pack and scatter new tokens into INT2 slots.
``decode_int2``: split-KV decode attention over INT2 slots plus a BF16 sink/recent segment.
``extend_int2``: prefill/extend attention of new tokens over themselves, the INT2 prefix and the BF16 segment.
The cache layout (byte offsets, index lists) is documented in :mod:`oscar_kernels.layout`.
"""

from .decode_int2 import decode_int2, decode_int2_ref, decode_workspace
from .extend_int2 import extend_int2, extend_int2_ref
from .layout import Int2Pool, dequantize_ref, pack_ref, unpack_ref
from .quantize_pack import quantize_pack, quantize_pack_ref

__all__ = [
    "Int2Pool",
    "decode_int2",
    "decode_int2_ref",
    "decode_workspace",
    "dequantize_ref",
    "extend_int2",
    "extend_int2_ref",
    "pack_ref",
    "quantize_pack",
    "quantize_pack_ref",
    "unpack_ref",
]
