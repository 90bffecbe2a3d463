"""OSCAR-KV INT2 cache layout: what the kernels read and write, byte by byte.

Token-slot pools, page size 1 (as SGLang's token-to-KV pool): a sequence's cached tokens are the slots
``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`` (``kv_indptr`` int32 ``[B + 1]``, ``kv_indices`` int32 ``[nnz]``).
Each slot depends only on its own token and is written once (by :func:`oscar_kernels.quantize_pack`).

Per layer, for keys and for values separately (each in its own rotated basis: ``k' = k @ R_K[h]``,
``v' = v @ R_V[h]``, ``R`` orthogonal fp32 ``[Hkv or 1, d, d]``):

* ``codes``  uint8 ``[slots, Hkv, d/4]``   -- 2-bit codes, four per byte;
* ``scale``  fp16  ``[slots, Hkv, d/g]``   -- one per group of ``g`` contiguous rotated elements;
* ``zero``   fp16  ``[slots, Hkv, d/g]``.

The kernels take any strides with a contiguous last dimension. :class:`Int2Pool` stores each pool head-major,
``[Hkv, slots, ...]`` in memory and handed out as a ``[slots, Hkv, ...]`` view, so one KV head's scales and codes of
consecutive slots are contiguous: a decode program (one sequence, one KV head) then reads whole 32-byte sectors of
scales instead of 2 bytes out of each (measured on an H200, ``benchmarks/bench_decode.py --layouts``: 10-11% faster
decode than slot-major pools, bs16/128k 592 vs 666 µs). For slot ``t``, KV head ``h``, group ``k``
(``B = g/4`` bytes per group), in an ``Int2Pool`` of ``S`` slots:

* codes row at byte ``(h * S + t) * d/4``; group ``k`` is bytes ``[k*B, (k+1)*B)`` of the row;
  byte ``b`` of group ``k`` holds rotated elements ``k*g + b``, ``k*g + b + B``, ``k*g + b + 2B``,
  ``k*g + b + 3B`` at bit shifts 0, 2, 4, 6 ("quarter-planar").  Unpacking a row with one shift gives a
  contiguous quarter of each group, so a query quarter can be dotted against it with no reshuffle.
* ``scale`` / ``zero`` of group ``k`` at byte ``2 * ((h * S + t) * d/g + k)``.

Dequantisation: ``x_hat = code * float(scale) + float(zero)`` (fp32); the quantiser is
``oscar_cli.quantizer.quantize`` (clip ratio ``r``: ``lo, hi = mid -+ r * (max - min) / 2`` per group,
``scale = max((hi - lo) / 3, 1e-5)`` and ``zero = lo`` rounded to fp16,
``code = clamp(floor((x - zero) / scale + 0.5), 0, 3)``).  At ``d = g = 128`` a token costs
``32 + 2 + 2 = 36`` bytes per head for K and as much for V: 2.25 bits per element.

Sink and recent tokens stay in a BF16 slot pool of their own, ``k_bf16``/``v_bf16`` bf16 ``[slots_bf16, Hkv, d]``,
holding keys and values ALREADY ROTATED by ``R_K`` / ``R_V`` (so one query's attention is computed entirely
in the rotated basis), addressed by ``bf16_indptr`` int32 ``[B + 1]`` / ``bf16_indices`` int32 ``[nnz_bf16]``.
Which tokens are sinks or recent is the cache's business: the kernels only see two index lists per sequence.
Every cached token of a sequence precedes the new tokens (decode query, extend chunk) of that sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CODES_PER_BYTE = 4
"""2-bit codes: four per byte."""


def check_group_size(head_dim: int, group_size: int) -> None:
    """Kernels need ``group_size`` dividing ``head_dim``, a multiple of 4, and both powers of two (tile shapes)."""
    if head_dim % group_size or group_size % CODES_PER_BYTE:
        raise ValueError(f"group_size {group_size} must divide head_dim {head_dim} and be a multiple of 4")
    for name, v in (("head_dim", head_dim), ("group_size", group_size)):
        if v & (v - 1) or v < 16:
            raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernels, got {v}")


@dataclass(frozen=True)
class Int2Pool:
    """One layer's INT2 slots for K or V. ``codes`` uint8 ``[S, Hkv, d/4]``; ``scale``/``zero`` fp16 ``[S, Hkv, d/g]``
    (views of head-major storage, see the module docstring)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int

    @classmethod
    def empty(cls, slots: int, kv_heads: int, head_dim: int, group_size: int | None = None,
              device: torch.device | str | None = None) -> Int2Pool:
        """Allocate an uninitialised pool (slots are filled by ``quantize_pack``)."""
        g = group_size or head_dim
        check_group_size(head_dim, g)
        codes = torch.empty(kv_heads, slots, head_dim // CODES_PER_BYTE, dtype=torch.uint8, device=device)
        scale = torch.empty(kv_heads, slots, head_dim // g, dtype=torch.float16, device=device)
        zero = torch.empty_like(scale)
        return cls(codes.transpose(0, 1), scale.transpose(0, 1), zero.transpose(0, 1), g)

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * CODES_PER_BYTE


def unpack_ref(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Quarter-planar unpack. codes uint8 ``[..., d/4]`` -> uint8 codes ``[..., d]`` (values 0..3)."""
    b = group_size // CODES_PER_BYTE
    p = codes.unflatten(-1, (-1, b))  # [..., G, B]
    parts = [(p >> (2 * j)) & 3 for j in range(CODES_PER_BYTE)]
    return torch.stack(parts, dim=-2).flatten(-3)


def pack_ref(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`unpack_ref`: uint8 codes ``[..., d]`` -> packed uint8 ``[..., d/4]``."""
    b = group_size // CODES_PER_BYTE
    c = codes.to(torch.uint8).unflatten(-1, (-1, CODES_PER_BYTE, b))  # [..., G, 4, B]
    out = c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)
    return out.flatten(-2)


def dequantize_ref(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes uint8 ``[..., d/4]``, scale/zero fp16 ``[..., d/g]`` -> fp32 ``[..., d]``."""
    c = unpack_ref(codes, group_size).float().unflatten(-1, (-1, group_size))
    return (c * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


def cached_rows_ref(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bf16: torch.Tensor,
                    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, bf16_indptr: torch.Tensor,
                    bf16_indices: torch.Tensor, b: int, group_size: int) -> torch.Tensor:
    """Sequence ``b``'s cached K (or V) rows, rotated basis, fp32 ``[T, Hkv, d]``: its INT2 slots dequantised, then its
    BF16 slots (the order the kernels' references attend in)."""
    sl = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
    sb = bf16_indices[bf16_indptr[b]:bf16_indptr[b + 1]].long()
    return torch.cat([dequantize_ref(codes[sl], scale[sl], zero[sl], group_size), bf16[sb].float()])
