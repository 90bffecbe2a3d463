"""OSCAR-KV INT2 cache layout: what the kernels read and write, byte by byte, and the one definition of each part.

Token-slot pools, page size 1 (as SGLang's token-to-KV pool): a sequence's INT2 tokens are the slots
``kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`` (``kv_indptr`` int32 ``[B + 1]``, ``kv_indices`` int32 ``[nnz]``).
Each slot depends only on its own token and is written once, when the token is created (by
:func:`oscar_kernels.quantize_pack`), whether or not the token is currently read exactly; slots can be shared.

Per layer, for keys and for values separately (each in its own rotated basis: ``k' = k @ R_K[h]``,
``v' = v @ R_V[h]``, ``R`` orthogonal fp32 ``[Hkv or 1, d, d]``):

* ``codes``  uint8 ``[slots, Hkv, d/4]``   -- 2-bit codes, four per byte;
* ``scale``  fp16  ``[slots, Hkv, d/g]``   -- one per group of ``g`` contiguous rotated elements;
* ``zero``   fp16  ``[slots, Hkv, d/g]``;

or, with FP8 metadata (``QuantScheme.scale_dtype = "fp8"``), ``scale`` and ``zero`` float8 e4m3 of the same shape
holding ``scale / m`` and ``zero / m``, with ``mult`` fp32 ``[Hkv]`` the power-of-two multiplier ``m`` of each KV
head (fitted from calibration rows, held by the artifact): one byte per group instead of two for each of scale and
zero. Stored values are rounded to nearest even on e4m3's grid, clamped to ``[FP8_MIN_STEP, 448]`` (scale) and
``[-448, 448]`` (zero); dequantisation reads ``float(scale) * m`` and ``float(zero) * m``, which the kernels take
through fp16 exactly (an e4m3 value times a power of two is an fp16 number in any range a model produces).

The kernels take any strides with a contiguous last dimension. :class:`Int2Pool` stores each pool head-major,
``[Hkv, slots, ...]`` in memory and handed out as a ``[slots, Hkv, ...]`` view, so one KV head's scales and codes of
consecutive slots are contiguous: a decode program (one sequence, one KV head) then reads whole 32-byte sectors of
scales instead of 2 bytes out of each (measured on an H200, ``benchmarks/bench_decode.py --layouts``, commit dbd78bb:
10-11% faster decode than slot-major pools, bs16/128k 592 vs 666 µs). For slot ``t``, KV head ``h``, group ``k``
(``B = g/4`` bytes per group), in an ``Int2Pool`` of ``S`` slots:

* codes row at byte ``(h * S + t) * d/4``; group ``k`` is bytes ``[k*B, (k+1)*B)`` of the row;
  byte ``b`` of group ``k`` holds rotated elements ``k*g + b``, ``k*g + b + B``, ``k*g + b + 2B``,
  ``k*g + b + 3B`` at bit shifts 0, 2, 4, 6 ("planar"; :func:`pack` with ``bits=2``).  Unpacking a row with one
  shift gives a contiguous quarter of each group, so a query quarter can be dotted against it with no reshuffle.
* ``scale`` / ``zero`` of group ``k`` at byte ``2 * ((h * S + t) * d/g + k)``.

4-bit codes (a layer's K or V given INT4 by a scheme's allocation, ``bits_k`` / ``bits_v``) are stored as two such
2-bit planes with the same layout and strides: ``codes`` the low two bits of each code, ``codes_hi`` the high two
(code ``c = lo + 4 hi``, 0..15), scale and zero as above with ``scale = (hi - lo) / 15``. Every kernel then reads a
4-bit row as two 2-bit rows: its unpacks and products stay the 2-bit ones, the high plane's weighted by 4.

Quantisation (the definition; ``oscar_cli.quantizer.quantize`` and :func:`oscar_kernels.quantize_pack_ref` follow
it): clip ratio ``r``: ``lo, hi = mid -+ r * (max - min) / 2`` per group, ``scale = max((hi - lo) / 3, SCALE_EPS)``
and ``zero = lo`` rounded to fp16, ``code = clamp(floor((x - zero) / scale + 0.5), 0, 3)``; dequantisation
``x_hat = code * float(scale) + float(zero)`` (fp32).  At ``d = g = 128`` a token costs ``32 + 2 + 2 = 36`` bytes
per head for K and as much for V: 2.25 bits per element.

Exact rows (:class:`LayerCache` ``k_bf16`` / ``v_bf16``, bf16 ``[R, Hkv, d]``): rows ALREADY ROTATED by ``R_K`` /
``R_V`` (so attention runs entirely in the rotated basis). Each request owns a region of ``sink + recent`` rows
per layer, holding its sinks and a ring of its last ``recent`` positions (:func:`exact_row_ref` /
:func:`exact_row`); the kernels address them through ``bf16_indptr`` int32 ``[B + 1]`` / ``bf16_indices`` int32
``[nnz_bf16]`` lists, which :mod:`oscar_kernels.plan` fills.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .scheme import KERNEL_BITS

CODES_PER_BYTE = 8 // KERNEL_BITS
"""2-bit codes: four per byte."""
SCALE_EPS = 1e-5
"""Smallest stored scale: keeps constant groups finite (fp16 holds it as a normal number)."""
FP8_MAX = 448.0
"""Largest finite float8 e4m3 magnitude: FP8 scales and zeros saturate there."""
FP8_MIN_STEP = 2.0 ** -9
"""Smallest positive float8 e4m3 number: an FP8 scale never rounds below it (a zero scale would lose the group)."""
FP8 = torch.float8_e4m3fn
DEFAULT_CLIP_RATIO = 1.0
"""Plain min/max range; fitted recipes pass their per-layer, per-KV-head ratios (separate for K and V)."""


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on the CPU; every ``tl.dot`` is fp32, no PTX)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


COMPILE_ONLY = False
"""Set by :mod:`oscar_kernels.compile_check`: kernels are compiled for a GPU target from CPU tensors and never
launched, so the launchers pick the code a CUDA tensor would get."""


def launchable(device: torch.device | str) -> bool:
    """Whether kernels can run over tensors on ``device``: a CUDA device, or any under the interpreter."""
    return torch.device(device).type == "cuda" or interpreting()


def gpu_codegen(t: torch.Tensor) -> bool:
    """Whether a launch over ``t`` compiles the GPU variants (bf16/fp16 tensor-core dots, PTX unpacks): on a CUDA
    tensor, or in a compile-only check; never under the interpreter."""
    return not interpreting() and (t.device.type == "cuda" or COMPILE_ONLY)


# ---------------------------------------------------------------------------------------------------------------
# packing (bits 2 and 4) and dequantisation


def _per_byte(bits: int) -> int:
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """uint8 codes ``[..., d]`` (values < 2**bits) -> packed uint8 ``[..., d * bits / 8]`` (planar layout).

    With ``P = 8 // bits`` codes per byte and ``B = group / P`` bytes per group, byte ``b`` of a group holds the
    group's elements ``b, b + B, ..., b + (P-1) B`` at bit shifts ``0, bits, ..., (P-1) bits``."""
    per_byte = _per_byte(bits)
    c = codes.to(torch.uint8).unflatten(-1, (-1, per_byte, group // per_byte))  # [..., G, P, B]
    out = torch.zeros(c.shape[:-2] + c.shape[-1:], dtype=torch.uint8, device=codes.device)
    for k in range(per_byte):
        out |= c[..., k, :] << (bits * k)
    return out.flatten(-2)


def unpack(packed: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[..., d * bits / 8]`` -> uint8 codes ``[..., d]``."""
    per_byte = _per_byte(bits)
    mask = (1 << bits) - 1
    p = packed.unflatten(-1, (-1, group // per_byte))  # [..., G, B]
    parts = [(p >> (bits * k)) & mask for k in range(per_byte)]
    return torch.stack(parts, dim=-2).flatten(-3)


def dequantize_ref(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                   mult: torch.Tensor | None = None, codes_hi: torch.Tensor | None = None) -> torch.Tensor:
    """2-bit rows: codes uint8 ``[..., Hkv, d/4]``, scale/zero fp16 ``[..., Hkv, d/g]`` -> fp32 ``[..., Hkv, d]``;
    FP8 scale/zero with ``mult`` fp32 ``[Hkv]``, the per-head multiplier; 4-bit rows with ``codes_hi``, the high
    plane (code ``lo + 4 hi``)."""
    c = unpack(codes, KERNEL_BITS, group_size).float()
    if codes_hi is not None:
        c = c + 4.0 * unpack(codes_hi, KERNEL_BITS, group_size).float()
    c = c.unflatten(-1, (-1, group_size))
    s, z = scale.float(), zero.float()
    if mult is not None:
        s, z = s * mult.float()[:, None], z * mult.float()[:, None]
    return (c * s.unsqueeze(-1) + z.unsqueeze(-1)).flatten(-2)


def to_fp8(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """fp32 ``x`` clamped to ``[lo, hi]`` and rounded to nearest even on float8 e4m3's grid, as float8 e4m3, zeros
    positive (what the write kernel stores as FP8 metadata: a small negative zero point that rounds to zero is
    stored as +0, which GPUs' conversions give whatever the sign)."""
    y = x.float().clamp(lo, hi).to(FP8)
    return torch.where(y.float() == 0, torch.zeros_like(y), y)


# ---------------------------------------------------------------------------------------------------------------
# argument checks shared by the launchers


def check_group_size(head_dim: int, group_size: int) -> None:
    """Kernels need ``group_size`` dividing ``head_dim``, a multiple of 4, and both powers of two (tile shapes)."""
    if head_dim % group_size or group_size % CODES_PER_BYTE:
        raise ValueError(f"group_size {group_size} must divide head_dim {head_dim} and be a multiple of 4")
    for name, v in (("head_dim", head_dim), ("group_size", group_size)):
        if v & (v - 1) or v < 16:
            raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernels, got {v}")


def check_pool(name: str, pool: Int2Pool, kv_heads: int, head_dim: int) -> None:
    """``pool`` holds uint8 codes ``[S, kv_heads, d/4]`` and fp16 scale/zero ``[S, kv_heads, d/g]`` (or float8 e4m3
    with an fp32 ``[kv_heads]`` multiplier), last dims contiguous."""
    d, g = head_dim, pool.group_size
    check_group_size(d, g)
    codes = pool.codes
    if codes.dtype != torch.uint8 or codes.dim() != 3 or codes.shape[1:] != (kv_heads, d // CODES_PER_BYTE) \
            or codes.stride(-1) != 1:
        raise ValueError(f"{name} codes must be uint8 [S, {kv_heads}, {d // 4}] with contiguous last dim, "
                         f"got {codes.dtype} {tuple(codes.shape)}")
    meta = FP8 if pool.fp8 else torch.float16
    for what, t in (("scale", pool.scale), ("zero", pool.zero)):
        if t.dtype != meta or t.shape != (codes.shape[0], kv_heads, d // g) or t.stride(-1) != 1:
            raise ValueError(f"{name} {what} must be {str(meta).removeprefix('torch.')} [{codes.shape[0]}, {kv_heads}, "
                             f"{d // g}] with contiguous last dim, got {t.dtype} {tuple(t.shape)}")
    hi = pool.codes_hi
    if hi is not None and (hi.dtype != torch.uint8 or hi.shape != codes.shape or hi.stride() != codes.stride()):
        raise ValueError(f"{name} high code plane must be uint8 {tuple(codes.shape)} with the low plane's strides, "
                         f"got {hi.dtype} {tuple(hi.shape)} strides {hi.stride()}")
    if pool.fp8 and (pool.mult.dtype != torch.float32 or pool.mult.shape != (kv_heads,)
                     or pool.mult.device != codes.device):
        raise ValueError(f"{name} multiplier must be fp32 [{kv_heads}] on {codes.device}, got {pool.mult.dtype} "
                         f"{tuple(pool.mult.shape)} on {pool.mult.device}")


def check_rot(name: str, rot: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    """``rot`` is fp32 ``[kv_heads or 1, d, d]``."""
    d = head_dim
    if rot.dtype != torch.float32 or rot.dim() != 3 or rot.shape[0] not in (1, kv_heads) or rot.shape[1:] != (d, d):
        raise ValueError(f"{name} must be fp32 [{kv_heads} or 1, {d}, {d}], got {rot.dtype} {tuple(rot.shape)}")


def check_bf16(name: str, t: torch.Tensor, kv_heads: int, head_dim: int) -> None:
    """``t`` is bf16 ``[R, kv_heads, d]`` with a contiguous last dim (exact rows)."""
    if t.dtype != torch.bfloat16 or t.dim() != 3 or t.shape[1:] != (kv_heads, head_dim) or t.stride(-1) != 1:
        raise ValueError(f"{name} must be bf16 [R, {kv_heads}, {head_dim}] with contiguous last dim, "
                         f"got {t.dtype} {tuple(t.shape)}")


def check_clip(name: str, clip: torch.Tensor, kv_heads: int) -> None:
    """``clip`` is an fp32 ``[kv_heads]`` tensor of per-KV-head clip ratios (values are not read on the host)."""
    if not isinstance(clip, torch.Tensor) or clip.dtype != torch.float32 or clip.shape != (kv_heads,):
        got = f"{clip.dtype} {tuple(clip.shape)}" if isinstance(clip, torch.Tensor) else type(clip).__name__
        raise ValueError(f"{name} must be an fp32 [{kv_heads}] tensor of clip ratios, got {got}")


def check_index(name: str, indptr: torch.Tensor, indices: torch.Tensor, batch: int) -> None:
    """``indptr`` int32 ``[batch + 1]``, ``indices`` int32 ``[nnz]``."""
    if indptr.dtype != torch.int32 or indptr.shape != (batch + 1,):
        raise ValueError(f"{name}_indptr must be int32 [{batch + 1}], got {indptr.dtype} {tuple(indptr.shape)}")
    if indices.dtype != torch.int32 or indices.dim() != 1:
        raise ValueError(f"{name}_indices must be int32 [nnz], got {indices.dtype} {tuple(indices.shape)}")


def check_query(q: torch.Tensor, cache) -> tuple[int, int, int]:
    """``q`` float ``[N, Hq, d]`` for ``cache`` (a :class:`LayerCache`): its head dim, ``Hq`` a multiple of the KV
    heads. Returns ``(N, Hq, d)``."""
    n, hq, d = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q must be bf16/fp16/fp32, got {q.dtype}")
    if d != cache.head_dim:
        raise ValueError(f"q head dim {d} does not match the cache's {cache.head_dim}")
    if hq % cache.kv_heads:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {cache.kv_heads}")
    return n, hq, d


def check_seq(name: str, t: torch.Tensor, batch: int, dtypes=(torch.int32,)) -> None:
    """``t`` is a 1-d integer tensor of ``batch`` elements (one per sequence)."""
    if t.dtype not in dtypes or t.shape != (batch,):
        want = "/".join(str(x).removeprefix("torch.") for x in dtypes)
        raise ValueError(f"{name} must be {want} [{batch}], got {t.dtype} {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------------------------
# storage


@dataclass(frozen=True)
class Int2Pool:
    """One layer's INT2 slots for K or V. ``codes`` uint8 ``[S, Hkv, d/4]``; ``scale``/``zero`` fp16 ``[S, Hkv, d/g]``
    (views of head-major storage when made by :meth:`empty`, see the module docstring); with ``mult`` (fp32
    ``[Hkv]``, the per-head multiplier) they are float8 e4m3 instead (FP8 metadata); with ``codes_hi`` (the high
    2-bit plane, same shape and strides as ``codes``) the codes are 4-bit."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    mult: torch.Tensor | None = None
    codes_hi: torch.Tensor | None = None

    @classmethod
    def empty(cls, slots: int, kv_heads: int, head_dim: int, group_size: int | None = None,
              device: torch.device | str | None = None, mult: torch.Tensor | None = None, bits: int = 2) -> Int2Pool:
        """Allocate an uninitialised pool (slots are filled by ``quantize_pack``); FP8 metadata with ``mult``,
        4-bit codes (two planes) with ``bits=4``."""
        if bits not in (2, 4):
            raise ValueError(f"pool code width must be 2 or 4, got {bits}")
        g = group_size or head_dim
        check_group_size(head_dim, g)
        codes = torch.empty(kv_heads, slots, head_dim // CODES_PER_BYTE, dtype=torch.uint8, device=device)
        codes_hi = torch.empty_like(codes).transpose(0, 1) if bits == 4 else None
        scale = torch.empty(kv_heads, slots, head_dim // g, dtype=torch.float16 if mult is None else FP8,
                            device=device)
        zero = torch.empty_like(scale)
        if mult is not None:
            mult = mult.to(device=codes.device, dtype=torch.float32).contiguous()
        return cls(codes.transpose(0, 1), scale.transpose(0, 1), zero.transpose(0, 1), g, mult, codes_hi)

    @property
    def bits(self) -> int:
        """Code width: 4 with a high plane, else 2."""
        return 2 if self.codes_hi is None else 4

    @property
    def fp8(self) -> bool:
        """Whether scale and zero are FP8 (float8 e4m3 times the per-head ``mult``)."""
        return self.mult is not None

    @property
    def slots(self) -> int:
        return self.codes.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.codes.shape[1]

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * CODES_PER_BYTE

    @functools.cached_property
    def words(self) -> torch.Tensor | None:
        """The codes viewed as int16 words (two bytes, eight codes), or None when the strides do not allow it."""
        try:
            return self.codes.view(torch.int16)
        except RuntimeError:
            return None

    @functools.cached_property
    def words_hi(self) -> torch.Tensor | None:
        """The high plane as int16 words (4-bit pools), or None."""
        try:
            return None if self.codes_hi is None else self.codes_hi.view(torch.int16)
        except RuntimeError:
            return None

    @property
    def nbytes(self) -> int:
        planes = (self.codes, self.scale, self.zero) + (() if self.codes_hi is None else (self.codes_hi,))
        return sum(t.numel() * t.element_size() for t in planes)

    def dequantize(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 ``[n, Hkv, d]`` rows of ``slots`` (the definition the kernels follow)."""
        hi = None if self.codes_hi is None else self.codes_hi[slots]
        return dequantize_ref(self.codes[slots], self.scale[slots], self.zero[slots], self.group_size, self.mult,
                              hi)

    def code_values(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 ``[n, Hkv, d]`` codes of ``slots`` (0..3, or 0..15 for 4-bit pools), in rotated element order."""
        c = unpack(self.codes[slots], KERNEL_BITS, self.group_size).float()
        if self.codes_hi is not None:
            c = c + 4.0 * unpack(self.codes_hi[slots], KERNEL_BITS, self.group_size).float()
        return c

    def scale_zero(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 scales and zeros ``[n, Hkv, d/g]`` of ``slots``, as dequantisation reads them."""
        s, z = self.scale[slots].float(), self.zero[slots].float()
        if self.fp8:
            s, z = s * self.mult[:, None], z * self.mult[:, None]
        return s, z


def max_offset(*ts: torch.Tensor) -> int:
    """Largest element offset any of ``ts`` can be indexed at (0 for empty tensors)."""
    return max([sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) for t in ts if t.numel()] or [0])


OFFSET64 = 2**31
"""Element offsets from this on need 64-bit pointer arithmetic in the kernels."""


@dataclass(frozen=True)
class LayerCache:
    """Everything a kernel reads of one layer: INT2 slots, exact rows, rotations, clip ratios. Checked once, here.

    * ``k``, ``v``: :class:`Int2Pool` (same slots, KV heads, head dim and group);
    * ``k_bf16``, ``v_bf16``: bf16 ``[R, Hkv, d]`` exact rows, already rotated;
    * ``rot_k``, ``rot_v``: fp32 ``[Hkv or 1, d, d]``;
    * ``clip_k``, ``clip_v``: fp32 ``[Hkv]`` device tensors of clip ratios (read by ``quantize_pack`` in the kernel);
    * ``center_k``: key centering (``QuantScheme.center_keys``): fp32 ``[Hkv, d]``, each head's key center in the
      rotated basis, subtracted from every key row the layer stores (INT2 and exact alike; the attention kernels need
      nothing: a query's scores all move by ``q·center``); None: keys stored as they are.
    """

    k: Int2Pool
    v: Int2Pool
    k_bf16: torch.Tensor
    v_bf16: torch.Tensor
    rot_k: torch.Tensor
    rot_v: torch.Tensor
    clip_k: torch.Tensor
    clip_v: torch.Tensor
    center_k: torch.Tensor | None = None

    def __post_init__(self) -> None:
        hkv, d = self.k.kv_heads, self.k.head_dim
        check_pool("k", self.k, hkv, d)
        check_pool("v", self.v, hkv, d)
        if self.v.slots != self.k.slots or self.v.group_size != self.k.group_size or self.v.fp8 != self.k.fp8:
            raise ValueError("k and v INT2 pools must have the same slots, group size and metadata dtype")
        check_bf16("k_bf16", self.k_bf16, hkv, d)
        check_bf16("v_bf16", self.v_bf16, hkv, d)
        if self.v_bf16.shape != self.k_bf16.shape:
            raise ValueError("k_bf16 and v_bf16 must have the same shape")
        check_rot("rot_k", self.rot_k, hkv, d)
        check_rot("rot_v", self.rot_v, hkv, d)
        check_clip("clip_k", self.clip_k, hkv)
        check_clip("clip_v", self.clip_v, hkv)
        c = self.center_k
        if c is not None and (c.dtype != torch.float32 or c.shape != (hkv, d) or not c.is_contiguous()
                              or c.device != self.k.codes.device):
            raise ValueError(f"center_k must be a contiguous fp32 [{hkv}, {d}] tensor on the pool's device, got "
                             f"{c.dtype} {tuple(c.shape)} on {c.device}")

    @property
    def kv_heads(self) -> int:
        return self.k.kv_heads

    @property
    def head_dim(self) -> int:
        return self.k.head_dim

    @property
    def group_size(self) -> int:
        return self.k.group_size

    @property
    def fp8(self) -> bool:
        """Whether the INT2 pools keep FP8 scales and zeros (each with its per-head multiplier)."""
        return self.k.fp8

    @property
    def his(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V high code planes, the kernels' ``K_HI`` / ``V_HI`` (a 2-bit pool's own low plane stands in
        as a valid pointer that is never read)."""
        return tuple(p.codes if p.codes_hi is None else p.codes_hi for p in (self.k, self.v))

    @property
    def mults(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V per-head multipliers, the kernels' ``MULT_K`` / ``MULT_V`` (with fp16 metadata the clip
        tensors stand in as valid pointers that are never read)."""
        return (self.k.mult, self.v.mult) if self.fp8 else (self.clip_k, self.clip_v)

    @functools.cached_property
    def off64(self) -> bool:
        """Whether the INT2 pools need 64-bit offsets (their largest element offset reaches :data:`OFFSET64`)."""
        ts = [t for p in (self.k, self.v) for t in (p.codes, p.scale, p.zero)]  # a high plane has the codes' strides
        return max_offset(*ts) >= OFFSET64


# ---------------------------------------------------------------------------------------------------------------
# the exact-row map


def exact_row_ref(req: torch.Tensor, pos: torch.Tensor, start: torch.Tensor | int, sink: int,
                  recent: int) -> torch.Tensor:
    """Row of the exact region holding position ``pos`` of request ``req`` (int64, broadcast), or -1 for none.

    ``rel = pos - start``; ``rel < sink``: ``req * (sink + recent) + rel`` (a sink); else, with ``recent > 0``,
    ``req * (sink + recent) + sink + (rel - sink) % recent`` (the ring of the last ``recent`` positions).
    -1 for ``rel < 0`` (padding before the first real token) and, when ``recent == 0``, for non-sinks."""
    req, pos = torch.as_tensor(req).long(), torch.as_tensor(pos).long()
    rel = pos - torch.as_tensor(start, device=pos.device).long()
    base = req * (sink + recent)
    ring = base + sink + (rel - sink).remainder(recent) if recent > 0 else torch.full_like(rel, -1)
    row = torch.where(rel < sink, base + rel, ring)
    return torch.where(rel < 0, torch.full_like(row, -1), row)


@triton.jit
def exact_row(req, pos, start, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Triton twin of :func:`exact_row_ref` (element-wise; ``req`` should be int64 for large regions)."""
    rel = pos - start
    base = req * (SINK + RECENT)
    if RECENT > 0:
        ring = base + SINK + (rel - SINK) % RECENT  # rel - SINK >= 0 wherever it is selected
    else:
        ring = base * 0 - 1
    row = tl.where(rel < SINK, base + rel, ring)
    return tl.where(rel < 0, -1, row)


def cached_rows_ref(pool: Int2Pool, bf16: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    bf16_indptr: torch.Tensor, bf16_indices: torch.Tensor, b: int) -> torch.Tensor:
    """Sequence ``b``'s cached K (or V) rows in the rotated basis, fp32 ``[T, Hkv, d]``: its INT2 slots dequantised,
    then its exact rows (the order the kernels' references attend in)."""
    sl = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
    sb = bf16_indices[bf16_indptr[b]:bf16_indptr[b + 1]].long()
    return torch.cat([pool.dequantize(sl), bf16[sb].float()])
