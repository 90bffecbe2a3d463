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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from oscar_kernels import SCALE_EPS, pack, unpack

__all__ = ["SCALE_EPS", "QuantizedRows", "bits_per_element", "clip_bounds", "dequantize", "fake_quant", "pack",
           "quantize", "unpack"]


@dataclass(frozen=True)
class QuantizedRows:
    """Packed rows. ``codes``: uint8 ``[..., d * bits / 8]``; ``scale``/``zero``: fp16 ``[..., d / group]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


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


def quantize(x: torch.Tensor, ratio: float | torch.Tensor = 1.0, bits: int = 2, group: int | None = None) -> QuantizedRows:
    """Quantize rows. x: float ``[..., d]``. Returns packed :class:`QuantizedRows`."""
    group = group or x.shape[-1]
    _check(x, bits, group)
    levels = (1 << bits) - 1
    lo, hi = clip_bounds(x, ratio, group)
    scale = ((hi - lo) / levels).clamp_min(SCALE_EPS).to(torch.float16)
    zero = lo.to(torch.float16)
    xg = x.float().unflatten(-1, (-1, group))
    codes = torch.floor((xg - zero.float().unsqueeze(-1)) / scale.float().unsqueeze(-1) + 0.5)
    codes = codes.clamp_(0, levels).to(torch.uint8).flatten(-2)
    return QuantizedRows(pack(codes, bits, group), scale, zero, bits, group)


def dequantize(q: QuantizedRows) -> torch.Tensor:
    """Packed rows -> fp32 ``[..., d]``."""
    codes = unpack(q.codes, q.bits, q.group).float().unflatten(-1, (-1, q.group))
    out = codes * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    return out.flatten(-2)


def fake_quant(x: torch.Tensor, ratio: float | torch.Tensor = 1.0, bits: int = 2, group: int | None = None) -> torch.Tensor:
    """Quantize-dequantize round trip, returned in ``x.dtype`` (same shape)."""
    return dequantize(quantize(x, ratio, bits, group)).to(x.dtype)


def bits_per_element(bits: int, group: int, meta_bits: int = 32) -> float:
    """Storage cost of one quantized element: the code plus its share of the fp16 scale and zero."""
    return bits + meta_bits / group
