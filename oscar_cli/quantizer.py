"""Reference INT2/INT4 row quantizer (pure torch): clip, quantize, pack.

The storage format is defined once, in ``oscar_kernels.layout`` (``pack``/``unpack``, ``SCALE_EPS``, imported here);
this module quantizes rows into it in plain torch, the definition the kernels' references are tested against.

Format, for one row ``x`` of ``d`` elements (already rotated):

* The row is cut into groups of ``group`` contiguous elements (``group`` divides ``d``).
* Clip ratio ``r`` in (0, 1]: per group ``mn, mx = min(x_g), max(x_g)``, ``mid = (mx + mn) / 2``,
  ``half = r * (mx - mn) / 2``, ``lo = mid - half``, ``hi = mid + half``.  ``r = 1`` is plain min/max.
* ``scale = max((hi - lo) / L, SCALE_EPS)`` and ``zero = lo``, both stored as fp16, ``L = 2**bits - 1``.
  Codes use the fp16-rounded values ``s, z``: ``code = clamp(floor((x - z) / s + 0.5), 0, L)``;
  the dequantised value is ``code * s + z``.
* Packing ("planar"): ``P = 8 // bits`` codes per byte. Within a group of ``g`` elements there are
  ``B = g // P`` bytes; byte ``b`` holds elements ``b, b + B, ..., b + (P-1) B`` at bit shifts ``0, bits, ...``.
  Unpacking byte vector ``y`` therefore yields whole contiguous blocks (``(y >> bits*k) & L`` is elements
  ``kB .. (k+1)B - 1``), so a kernel can dot a query block against it with no reshuffle.

Bits per element for a quantized row: ``bits + 2 * 16 / group`` (fp16 scale and zero per group).

FP8 metadata (``meta="fp8"``): scale and zero are stored as float8 e4m3 of ``scale / m`` and ``zero / m`` with a
power-of-two multiplier ``m`` (per KV head: fitted from calibration rows and held by the artifact, or taken from the
rows themselves by :func:`meta_multiplier`), saturating at ±448; the scale never rounds below e4m3's smallest step.
Codes are computed from the stored (rounded) values, as for fp16. ``bits + 16 / group`` bits per element.

Fitted levels (``table``): code ``c`` stands for ``zero + scale * table[c]`` instead of ``zero + scale * c``, with
``table`` (per KV head, ``2**bits`` sorted values in ``[0, 2**bits - 1]``) fitted by :func:`lloyd_max`; a code is the
nearest level. The uniform table is ``0, 1, ..., 2**bits - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from oscar_kernels import FP8_MAX, FP8_MIN_STEP, SCALE_EPS, pack, to_fp8, unpack

__all__ = ["FP8_MAX", "META_HEADROOM", "SCALE_EPS", "QuantizedRows", "SplitRows", "bits_per_element", "clip_bounds",
           "dequantize", "fake_quant", "gaussian_table", "lloyd_max", "meta_multiplier", "pack", "quantize",
           "quantize_split", "unpack"]

META_HEADROOM = 7
""":func:`meta_multiplier` maps the largest calibration |scale| or |zero| to at most ``2**META_HEADROOM`` (128): 3.5x
headroom below e4m3's 448 for rows larger than calibration saw, 13 binades above its smallest normal value."""


@dataclass(frozen=True)
class QuantizedRows:
    """Packed rows. ``codes``: uint8 ``[..., d * bits / 8]``; ``scale``/``zero``: fp16 ``[..., d / group]``, or
    float8 e4m3 with ``mult`` (fp32, broadcastable to them) the power-of-two multiplier they are stored in units of."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    mult: torch.Tensor | None = None
    table: torch.Tensor | None = None

    def scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 scale and zero as the stored values give them."""
        s, z = self.scale.float(), self.zero.float()
        if self.mult is not None:
            s, z = s * self.mult, z * self.mult
        return s, z

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


@dataclass(frozen=True)
class SplitRows:
    """Split key rows (the scheme's ``split_k``): the leading ``m`` rotated channels as 4-bit rows ``hi``, the other
    ``d - m`` as 2-bit rows ``lo``, each part one group with its own scale and zero."""

    hi: QuantizedRows
    lo: QuantizedRows

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes


def _check(x: torch.Tensor, bits: int, group: int) -> None:
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits}")
    d = x.shape[-1]
    per_byte = 8 // bits
    if group <= 0 or d % group or group % per_byte:
        raise ValueError(f"group {group} must divide the row length {d} and be a multiple of {per_byte}")


def clip_bounds(x: torch.Tensor, ratio: float | torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group clipping range. x: float ``[..., d]``; returns ``lo, hi`` fp32 ``[..., d / group]``.

    ``ratio`` is a float or a tensor broadcastable to ``[..., d / group]`` (e.g. one ratio per head).
    """
    xg = x.float().unflatten(-1, (-1, group))
    mn, mx = xg.amin(-1), xg.amax(-1)
    mid = (mx + mn) * 0.5
    half = (mx - mn) * 0.5 * ratio
    return mid - half, mid + half


def meta_multiplier(scale: torch.Tensor, zero: torch.Tensor, dims) -> torch.Tensor:
    """Power-of-two multiplier for FP8 metadata: the largest |scale| or |zero| over ``dims`` (kept) maps to at most
    ``2**META_HEADROOM``."""
    amax = torch.maximum(scale.abs().amax(dims, keepdim=True), zero.abs().amax(dims, keepdim=True))
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30))) - META_HEADROOM)


def quantize(x: torch.Tensor, ratio: float | torch.Tensor = 1.0, bits: int = 2, group: int | None = None,
             meta: str = "fp16", mult: torch.Tensor | None = None, table: torch.Tensor | None = None) -> QuantizedRows:
    """Quantize rows. x: float ``[..., d]``. Returns packed :class:`QuantizedRows`.

    ``meta``: ``fp16`` or ``fp8`` scale/zero; with ``fp8``, ``mult`` is the multiplier (broadcastable to
    ``[..., d / group]``, e.g. one per head), default one :func:`meta_multiplier` over all of ``x``'s rows.
    ``table``: fitted levels ``[..., 2**bits]`` (e.g. ``[H, 1, 1, 4]`` per head for rows ``[B, H, N, d]``: the shape
    of ``scale`` with a level axis appended after its group axis is dropped), None for uniform."""
    group = group or x.shape[-1]
    _check(x, bits, group)
    levels = (1 << bits) - 1
    lo, hi = clip_bounds(x, ratio, group)
    # a tensor divisor: torch on CUDA turns ``tensor / number`` into ``tensor * fp32(1 / number)``, which can land an
    # fp32 ulp off the correctly rounded quotient the kernels and the CPU compute
    scale = ((hi - lo) / torch.full_like(hi, levels)).clamp_min(SCALE_EPS)
    if meta == "fp16":
        scale, zero, mult = scale.to(torch.float16), lo.to(torch.float16), None
    elif meta == "fp8":
        if mult is None:
            mult = meta_multiplier(scale, lo, tuple(range(scale.dim())))
        mult = mult.float().to(x.device)
        scale = to_fp8(scale / mult, FP8_MIN_STEP, FP8_MAX)
        zero = to_fp8(lo / mult, -FP8_MAX, FP8_MAX)
    else:
        raise ValueError(f"meta must be fp16 or fp8, got {meta!r}")
    rows = QuantizedRows(torch.empty(0, dtype=torch.uint8), scale, zero, bits, group, mult)
    s, z = rows.scale_zero()
    xg = x.float().unflatten(-1, (-1, group))
    u = (xg - z.unsqueeze(-1)) / s.unsqueeze(-1)
    if table is None:
        codes = torch.floor(u + 0.5).clamp_(0, levels)
    else:
        t = table.float().to(x.device)  # [..., L + 1] broadcastable to scale's [..., G] plus the level axis
        mids = (t[..., 1:] + t[..., :-1]) * 0.5  # [..., L]
        codes = (u.unsqueeze(-1) > mids.unsqueeze(-2)).sum(-1).float()  # mids aligned as [..., G, 1, L]
    codes = codes.to(torch.uint8).flatten(-2)
    return QuantizedRows(pack(codes, bits, group), scale, zero, bits, group, mult, table)


def quantize_split(x: torch.Tensor, m: int, ratio_hi: float | torch.Tensor, ratio_lo: float | torch.Tensor,
                   meta: str = "fp16", mult_hi: torch.Tensor | None = None, mult_lo: torch.Tensor | None = None
                   ) -> SplitRows:
    """Split rows: ``x[..., :m]`` as one 4-bit group (clip ``ratio_hi``, FP8 multiplier ``mult_hi``), ``x[..., m:]``
    as one 2-bit group (``ratio_lo``, ``mult_lo``); see :func:`quantize`."""
    d = x.shape[-1]
    if not 0 < m < d or m % 4:
        raise ValueError(f"a split row needs 0 < m < {d} 4-bit channels, a multiple of 4; got {m}")
    return SplitRows(quantize(x[..., :m], ratio_hi, 4, m, meta, mult_hi),
                     quantize(x[..., m:], ratio_lo, 2, d - m, meta, mult_lo))


def dequantize(q: QuantizedRows | SplitRows) -> torch.Tensor:
    """Packed rows -> fp32 ``[..., d]``."""
    if isinstance(q, SplitRows):
        return torch.cat([dequantize(q.hi), dequantize(q.lo)], -1)
    codes = unpack(q.codes, q.bits, q.group).float().unflatten(-1, (-1, q.group))
    if q.table is not None:
        t = q.table.float().to(codes.device).unsqueeze(-2)  # levels aligned as [..., G, 1, L + 1]
        t = t.expand(*codes.shape, t.shape[-1])
        codes = torch.gather(t, -1, codes.long().unsqueeze(-1)).squeeze(-1)
    s, z = q.scale_zero()
    out = codes * s.unsqueeze(-1) + z.unsqueeze(-1)
    return out.flatten(-2)


def fake_quant(x: torch.Tensor, ratio: float | torch.Tensor = 1.0, bits: int = 2, group: int | None = None,
               meta: str = "fp16", mult: torch.Tensor | None = None, table: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Quantize-dequantize round trip, returned in ``x.dtype`` (same shape)."""
    return dequantize(quantize(x, ratio, bits, group, meta, mult, table)).to(x.dtype)


GAUSSIAN_LEVELS_2BIT = (-1.5104, -0.4528, 0.4528, 1.5104)
"""Lloyd-Max levels of a standard normal at 2 bits (in standard deviations)."""


def gaussian_table(group: int) -> torch.Tensor:
    """The 2-bit Gaussian Lloyd-Max levels in the min/max frame of a group of ``group`` normal samples: the frame's
    ends at the expected extremes (Blom's approximation), ``[0, 3]`` across; float32 ``[4]`` (data-free, as a
    TurboQuant-style baseline stores them)."""
    n = torch.tensor(float(group), dtype=torch.float64)
    top = torch.special.ndtri((n - 0.375) / (n + 0.25))  # E[max of n N(0,1)]
    levels = torch.tensor(GAUSSIAN_LEVELS_2BIT, dtype=torch.float64)
    return (1.5 + 1.5 * levels / top).clamp(0, 3).float()


def lloyd_max(u: torch.Tensor, w: torch.Tensor | None, bits: int, iters: int = 30) -> torch.Tensor:
    """Weighted Lloyd-Max levels for values ``u [n]`` in ``[0, L]`` (``L = 2**bits - 1``; weights ``w [n]``, None:
    equal): ``2**bits`` sorted levels in ``[0, L]`` minimizing ``Σ w (u - level(u))²``, from the uniform table."""
    L = (1 << bits) - 1
    u = u.double().flatten()
    w = torch.ones_like(u) if w is None else w.double().flatten().expand_as(u)
    t = torch.arange(L + 1, dtype=torch.float64)
    for _ in range(iters):
        mids = (t[1:] + t[:-1]) * 0.5
        c = torch.bucketize(u, mids)
        num = torch.zeros(L + 1, dtype=torch.float64).index_add_(0, c, w * u)
        den = torch.zeros(L + 1, dtype=torch.float64).index_add_(0, c, w)
        new = torch.where(den > 0, num / den.clamp_min(1e-300), t)
        new = new.clamp(0, L).sort().values
        if torch.allclose(new, t, atol=1e-9):
            break
        t = new
    return t


def bits_per_element(bits: int, group: int, meta_bits: int = 32) -> float:
    """Storage cost of one quantized element: the code plus its share of the scale and zero (``meta_bits``
    together: 32 for fp16, 16 for fp8)."""
    return bits + meta_bits / group
