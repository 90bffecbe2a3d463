"""Rotate, clip, quantize to INT2, pack and scatter new K or V rows into their token slots.

Math, per token ``n`` and KV head ``h`` (``x`` row of ``d`` elements, ``R`` = ``rot[h]`` fp32 ``[d, d]``):
``x' = x @ R``; per group ``k`` of ``g`` contiguous elements of ``x'``: ``mn, mx = min, max``,
``mid = (mx + mn) * 0.5``, ``half = (mx - mn) * 0.5 * r``, ``lo = mid - half``, ``hi = mid + half``,
``scale = fp16(max((hi - lo) / 3, 1e-5))``, ``zero = fp16(lo)``,
``code = clamp(floor((x' - zero) / scale + 0.5), 0, 3)`` (division rounded to nearest, as torch does).

Packed layout (see :mod:`oscar_kernels.layout`): slot ``t = out_cache_loc[n]``; codes row of
``codes[t, h]`` is ``d/4`` bytes; byte ``k*B + b`` (``B = g/4``) holds elements ``k*g + b + j*B`` at bit
shift ``2j``, ``j = 0..3``; ``scale[t, h, k]``, ``zero[t, h, k]`` fp16.

Kernel: one program per (block of tokens, KV head). The rotation is fused: the kernel computes the four
column quarters ``x @ R[:, cols_j]`` with near-fp32 dot products (tf32x3 by default), so each quarter is already
in the order its bit plane is packed in; min/max, the scale and the codes follow in registers and one
``d/4``-byte row per token is written.

Exact vs approximate: with ``rot=None`` (input already rotated) the kernel reproduces
:func:`quantize_pack_ref` (and ``oscar_cli.quantizer.quantize``) bit for bit. With a rotation, ``x @ R`` is
summed in a different order than torch's matmul, so ``x'`` differs by a few fp32 ulps; an element lying
within that distance of a rounding boundary can get the neighbouring code (rare; tests bound it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import CODES_PER_BYTE, check_group_size

DEFAULT_CLIP_RATIO = 1.0
"""Plain min/max range; fitted recipes pass their per-layer ratio (separate for K and V)."""
SCALE_EPS = 1e-5
"""Smallest stored scale, as in ``oscar_cli.quantizer.SCALE_EPS``."""
LEVELS = 3
"""Largest 2-bit code."""


@triton.jit
def _quantize_pack_kernel(
    X, ROT, CODES, SCALE, ZERO, LOC,
    n_tokens, clip_ratio, scale_eps,
    stride_xn, stride_xh, stride_xd,
    stride_rh, stride_rr, stride_rc,
    stride_cs, stride_ch,
    stride_ss, stride_sh,
    stride_zs, stride_zh,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    ROTATE: tl.constexpr, ROT_PER_HEAD: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    D4: tl.constexpr = HEAD_DIM // 4
    BQ: tl.constexpr = GROUP_SIZE // 4
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_tokens
    offs_d = tl.arange(0, HEAD_DIM)
    offs_m = tl.arange(0, D4)  # byte index within a row
    # element held by byte m in bit plane j: (m // BQ) * GROUP_SIZE + j * BQ + m % BQ
    col0 = (offs_m // BQ) * GROUP_SIZE + offs_m % BQ

    x_rows = X + offs_n.to(tl.int64)[:, None] * stride_xn + h * stride_xh
    if ROTATE:
        x = tl.load(x_rows + offs_d[None, :] * stride_xd, mask=mask_n[:, None], other=0.0).to(tl.float32)
        r_base = ROT + (h * stride_rh if ROT_PER_HEAD else 0) + offs_d[:, None] * stride_rr
        y0 = tl.dot(x, tl.load(r_base + (col0 + 0 * BQ)[None, :] * stride_rc), input_precision=PRECISION)
        y1 = tl.dot(x, tl.load(r_base + (col0 + 1 * BQ)[None, :] * stride_rc), input_precision=PRECISION)
        y2 = tl.dot(x, tl.load(r_base + (col0 + 2 * BQ)[None, :] * stride_rc), input_precision=PRECISION)
        y3 = tl.dot(x, tl.load(r_base + (col0 + 3 * BQ)[None, :] * stride_rc), input_precision=PRECISION)
    else:
        m2 = mask_n[:, None]
        y0 = tl.load(x_rows + (col0 + 0 * BQ)[None, :] * stride_xd, mask=m2, other=0.0).to(tl.float32)
        y1 = tl.load(x_rows + (col0 + 1 * BQ)[None, :] * stride_xd, mask=m2, other=0.0).to(tl.float32)
        y2 = tl.load(x_rows + (col0 + 2 * BQ)[None, :] * stride_xd, mask=m2, other=0.0).to(tl.float32)
        y3 = tl.load(x_rows + (col0 + 3 * BQ)[None, :] * stride_xd, mask=m2, other=0.0).to(tl.float32)

    # [BLOCK_N, NG, BQ]: one group per middle index
    y0 = tl.reshape(y0, (BLOCK_N, NG, BQ))
    y1 = tl.reshape(y1, (BLOCK_N, NG, BQ))
    y2 = tl.reshape(y2, (BLOCK_N, NG, BQ))
    y3 = tl.reshape(y3, (BLOCK_N, NG, BQ))
    mn = tl.min(tl.minimum(tl.minimum(y0, y1), tl.minimum(y2, y3)), axis=2, keep_dims=True)
    mx = tl.max(tl.maximum(tl.maximum(y0, y1), tl.maximum(y2, y3)), axis=2, keep_dims=True)
    mid = (mx + mn) * 0.5
    half = (mx - mn) * 0.5 * clip_ratio
    lo = mid - half
    hi = mid + half
    scale16 = tl.maximum(tl.math.div_rn(hi - lo, 3.0), scale_eps).to(tl.float16)
    zero16 = lo.to(tl.float16)
    s = scale16.to(tl.float32)
    z = zero16.to(tl.float32)
    c0 = tl.clamp(tl.floor(tl.math.div_rn(y0 - z, s) + 0.5), 0.0, 3.0).to(tl.uint8)
    c1 = tl.clamp(tl.floor(tl.math.div_rn(y1 - z, s) + 0.5), 0.0, 3.0).to(tl.uint8)
    c2 = tl.clamp(tl.floor(tl.math.div_rn(y2 - z, s) + 0.5), 0.0, 3.0).to(tl.uint8)
    c3 = tl.clamp(tl.floor(tl.math.div_rn(y3 - z, s) + 0.5), 0.0, 3.0).to(tl.uint8)
    packed = tl.reshape(c0 | (c1 << 2) | (c2 << 4) | (c3 << 6), (BLOCK_N, D4))

    slot = tl.load(LOC + offs_n, mask=mask_n, other=0).to(tl.int64)
    tl.store(CODES + slot[:, None] * stride_cs + h * stride_ch + offs_m[None, :], packed, mask=mask_n[:, None])
    offs_g = tl.arange(0, NG)
    m2 = mask_n[:, None]
    tl.store(SCALE + slot[:, None] * stride_ss + h * stride_sh + offs_g[None, :], tl.reshape(scale16, (BLOCK_N, NG)), mask=m2)
    tl.store(ZERO + slot[:, None] * stride_zs + h * stride_zh + offs_g[None, :], tl.reshape(zero16, (BLOCK_N, NG)), mask=m2)


def quantize_pack(
    x: torch.Tensor,
    rot: torch.Tensor | None,
    clip_ratio: float,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    out_cache_loc: torch.Tensor,
    group_size: int | None = None,
    block_n: int = 64,
    rot_precision: str = "tf32x3",
    num_warps: int = 4,
) -> None:
    """Quantize new rows into their slots, in place.

    Args:
        x: bf16/fp16/fp32 ``[N, Hkv, d]``, the un-rotated K or V of ``N`` new tokens (any strides).
        rot: fp32 ``[Hkv or 1, d, d]``, rotated row ``x' = x @ rot[h]``; ``None`` if ``x`` is already rotated.
        clip_ratio: clip ratio ``r`` in (0, 1] (``DEFAULT_CLIP_RATIO`` = 1.0 is plain min/max).
        codes: uint8 ``[S, Hkv, d/4]`` slot pool, written at rows ``out_cache_loc`` (last dim contiguous).
        scale, zero: fp16 ``[S, Hkv, d/g]`` slot pools (last dim contiguous).
        out_cache_loc: int32/int64 ``[N]`` slot of each new token (distinct slots).
        group_size: ``g`` (default ``d``: one group per head row).
        block_n: tokens per program (64: fastest of 16/32/64 at a 32k-token prefill on an H200, see
            benchmarks/NOTES.md).
        rot_precision: Triton ``input_precision`` of the fused rotation on GPU: ``"tf32x3"`` (default: three
            tf32 tensor-core passes, ~fp32 accuracy; 205 µs for 32k tokens x 8 heads against 4.3 ms for
            ``"ieee"`` fp32 FMA, measured on an H200). The interpreter always computes in fp32.
        num_warps: warps per program.
    """
    n, hkv, d = x.shape
    g = group_size or d
    check_group_size(d, g)
    if not 0.0 < clip_ratio <= 1.0:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    if codes.dtype != torch.uint8 or codes.shape[1:] != (hkv, d // CODES_PER_BYTE) or codes.stride(-1) != 1:
        raise ValueError(f"codes must be uint8 [S, {hkv}, {d // 4}] with contiguous last dim, got {codes.dtype} {tuple(codes.shape)}")
    for name, t in (("scale", scale), ("zero", zero)):
        if t.dtype != torch.float16 or t.shape[1:] != (hkv, d // g) or t.stride(-1) != 1 or t.shape[0] != codes.shape[0]:
            raise ValueError(f"{name} must be fp16 [{codes.shape[0]}, {hkv}, {d // g}] with contiguous last dim")
    if out_cache_loc.shape != (n,) or out_cache_loc.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"out_cache_loc must be int32/int64 [{n}]")
    if n == 0:
        return
    rotate = rot is not None
    if rotate:
        if rot.dtype != torch.float32 or rot.dim() != 3 or rot.shape[0] not in (1, hkv) or rot.shape[1:] != (d, d):
            raise ValueError(f"rot must be fp32 [{hkv} or 1, {d}, {d}], got {rot.dtype} {tuple(rot.shape)}")
        rot_strides = rot.stride()
    else:
        rot, rot_strides = x, (0, 0, 0)  # unused pointer
    grid = (triton.cdiv(n, block_n), hkv)
    _quantize_pack_kernel[grid](
        x, rot, codes, scale, zero, out_cache_loc,
        n, float(clip_ratio), SCALE_EPS,
        *x.stride(), *rot_strides,
        codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1), zero.stride(0), zero.stride(1),
        HEAD_DIM=d, GROUP_SIZE=g, BLOCK_N=block_n,
        ROTATE=rotate, ROT_PER_HEAD=rotate and rot.shape[0] > 1, PRECISION=rot_precision,
        num_warps=num_warps,
    )


def quantize_pack_ref(
    x: torch.Tensor,
    rot: torch.Tensor | None,
    clip_ratio: float,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    out_cache_loc: torch.Tensor,
    group_size: int | None = None,
) -> None:
    """Plain fp32 torch definition of :func:`quantize_pack` (same arguments, same in-place writes)."""
    n, hkv, d = x.shape
    g = group_size or d
    xr = x.float()
    if rot is not None:
        xr = torch.einsum("nhd,hde->nhe", xr, rot.float().expand(hkv, d, d))
    xg = xr.unflatten(-1, (-1, g))  # [N, Hkv, G, g]
    mn, mx = xg.amin(-1), xg.amax(-1)
    mid = (mx + mn) * 0.5
    half = (mx - mn) * 0.5 * clip_ratio
    lo, hi = mid - half, mid + half
    s16 = ((hi - lo) / LEVELS).clamp_min(SCALE_EPS).to(torch.float16)
    z16 = lo.to(torch.float16)
    c = torch.floor((xg - z16.float().unsqueeze(-1)) / s16.float().unsqueeze(-1) + 0.5).clamp_(0, LEVELS)
    c = c.to(torch.uint8).unflatten(-1, (CODES_PER_BYTE, g // CODES_PER_BYTE))  # [N, Hkv, G, 4, B]
    packed = c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)
    loc = out_cache_loc.long()
    codes[loc] = packed.flatten(-2).to(codes.device)
    scale[loc] = s16.to(scale.device)
    zero[loc] = z16.to(zero.device)
