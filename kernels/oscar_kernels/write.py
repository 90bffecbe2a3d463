"""Rotate, clip, quantize to INT2, pack and scatter new K or V rows into their token slots (and exact rows).

Math, per token ``n`` and KV head ``h`` (``x`` row of ``d`` elements, ``R`` = ``rot[h]`` fp32 ``[d, d]``, clip ratio
``r = clip[h]``): ``x' = x @ R`` (minus the head's key center ``c[h]``, rotated basis, when keys are centered);
per group ``k`` of ``g`` contiguous elements of ``x'``: ``mn, mx = min, max``,
``mid = (mx + mn) * 0.5``, ``half = (mx - mn) * 0.5 * r``, ``lo = mid - half``, ``hi = mid + half``,
``scale = fp16(max((hi - lo) / 3, SCALE_EPS))``, ``zero = fp16(lo)``,
``code = clamp(floor((x' - zero) / scale + 0.5), 0, 3)`` (each division rounded to nearest, as torch does on
the CPU; torch on CUDA multiplies by the reciprocal of a Python number, so the reference divides by tensors).
With FP8 metadata (a per-head multiplier ``m = mult[h]``) the stored scale is ``e4m3(clamp(scale / m,
FP8_MIN_STEP, 448))`` and the zero ``e4m3(clamp(lo / m, -448, 448))``, and the codes use ``float(stored) * m``.
Optionally the rotated row itself, ``bf16(x')``, is stored as an exact row.

Packed layout (see :mod:`oscar_kernels.layout`): slot ``t = out_cache_loc[n]``; codes row of
``codes[t, h]`` is ``d/4`` bytes; byte ``k*B + b`` (``B = g/4``) holds elements ``k*g + b + j*B`` at bit
shift ``2j``, ``j = 0..3``; ``scale[t, h, k]``, ``zero[t, h, k]`` fp16. Exact row ``bf16_out[bf16_loc[n], h, :]``
bf16 ``[d]`` in natural element order, skipped where ``bf16_loc[n] < 0``.

Kernel: one program per (block of tokens, KV head, K or V): :func:`quantize_pack_kv` writes the K and the V rows of
the same tokens in one launch, :func:`quantize_pack` one of them. The rotation is fused: the kernel computes the four
column quarters ``x @ R[:, cols_j]`` with near-fp32 dot products (tf32x3 by default), so each quarter is already
in the order its bit plane is packed in; min/max, the scale and the codes follow in registers and one
``d/4``-byte row per token is written. Per-head clip ratios are read from a device tensor inside the kernel, so
all heads go in one launch with no host synchronisation.

Exact vs approximate: with ``rot=None`` (input already rotated) the kernel reproduces
:func:`quantize_pack_ref` (and ``oscar_cli.quantizer.quantize``) bit for bit, codes and exact rows. With a
rotation, ``x @ R`` is summed in a different order than torch's matmul, so ``x'`` differs by a few fp32 ulps; an
element lying within that distance of a rounding boundary can get the neighbouring code or bf16 value (rare;
tests bound it). On GPU the tf32x3 dots are only exercised by a GPU run; the interpreter computes every dot in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import (
    CODES_PER_BYTE,
    DEFAULT_CLIP_RATIO,
    FP8,
    FP8_MAX,
    FP8_MIN_STEP,
    KERNEL_BITS,
    SCALE_EPS,
    Int2Pool,
    check_bf16,
    check_clip,
    check_group_size,
    pack,
    to_fp8,
)

_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_MIN_STEP = tl.constexpr(FP8_MIN_STEP)
LEVELS = (1 << KERNEL_BITS) - 1
"""Largest code (3 at 2 bits); the kernel gets it as ``MAX_CODE``."""
DEFAULT_BLOCK_N = 64
"""Tokens per program: fastest of 32/64/128 at 4 warps for a 32k-token prefill on an H200 (204 µs vs 955 at 32 and
390 at 128; 128 tokens with 8 warps 202 µs), ``benchmarks/RESULTS.md``, commit 78c2798."""
DEFAULT_ROT_PRECISION = "tf32x3"
"""Triton ``input_precision`` of the fused rotation: three tf32 tensor-core passes, ~fp32 accuracy; 204 µs for 32k
tokens x 8 heads against 4266 µs for ``"ieee"`` fp32 FMA and 130 µs for plain ``"tf32"`` (~1e-3 relative error,
not used), measured on an H200 (commit 78c2798)."""
DEFAULT_WARPS = 4
"""Warps per program at ``DEFAULT_BLOCK_N`` (8 warps: 427 µs vs 204 on the same run)."""
DEFAULT_ROT_ROWS = 32
"""Rows of the rotation per multiply-add step of the ``"fma"`` rotation (``rot_rows``; 0: :func:`fma_rot_rows`)."""
ROT_ELEMS_PER_THREAD = 128
"""``rot_rows=0``: rotation elements a step may hold per thread (128 fp32 registers; the four quarters' loads of a
step are issued before their sums only when the step covers all of ``R``)."""


def fma_rot_rows(head_dim: int, num_warps: int) -> int:
    """Rows of ``R`` per step for ``rot_rows=0``: as many as keep ``ROT_ELEMS_PER_THREAD`` of its elements per thread
    (all of them at d = 128 with four warps, so one HBM trip; 32 with one warp, the earlier default)."""
    return max(1, min(head_dim, ROT_ELEMS_PER_THREAD * 32 * num_warps // head_dim))


DECODE_WRITE = dict(block_n=1, rot_precision="fma", num_warps=4, rot_rows=0)
"""Launch parameters of a decode step's K/V write (one new token per sequence; ``DecodePlan``'s default
``write_tuning``): one token per program, rotated by fp32 multiply-adds on the CUDA cores. Measured on an
H200 (``benchmarks/bench_decode.py``, commit c0a87a8, Qwen3-8B shapes): ``DecodePlan.run`` (write + attention) at
bs1/8k 31.1 µs against 44.5 with the prefill defaults above (tensor-core tf32x3 rotation of 64-token blocks), i.e.
the write ~6 µs instead of ~19; faster at every measured batch up to bs32 (bs32/32k 320.3 vs 329.2 µs). The prefill
defaults compile to 255 registers and spill at d = 128; this one (one warp then) used 156 and did not.

Since commit 1c022d0 four warps per program load the whole rotation at once (``rot_rows=0``: all of ``R`` up to
d = 128, :func:`fma_rot_rows`) instead of one warp 32 rows at a time: in a whole decode step over pools larger than
the L2 the rotations come from HBM and one warp waited on four trips for them. Measured on an H200 (``bench_decode.py --variants --set write-peel``, per layer of a
step, sink 64 / recent 256): bs1/8k 27.7 -> 20.6 µs, bs1/32k 33.2 -> 25.9, bs1/100k 56.2 -> 46.8; bs32/32k 307.0
-> 307.5 and bs50/100k 1262.9 -> 1266.6 (level); eight warps measured the same as four. 163 registers at d = 128,
no spills."""


@triton.jit
def _to_bf16(x):
    """fp32 -> bf16 rounded to nearest even with integer ops (what torch does for finite values; the Triton
    interpreter's float cast truncates, so a plain ``.to`` would differ between CPU tests and GPU)."""
    u = x.to(tl.uint32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _rotated_quarters(
    x_rows, mask_n, ROT_H, stride_xd, stride_rr, stride_rc, col0,
    HEAD_DIM: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr, D4: tl.constexpr,
    ROTATE: tl.constexpr, PRECISION: tl.constexpr, ROT_FMA: tl.constexpr,
):
    """The four column quarters ``y_j = (x @ R)[:, col0 + j * BQ]`` (fp32 ``[BLOCK_N, d/4]``) of the rows at
    ``x_rows`` (``[BLOCK_N, 1]`` pointers), ``R`` at ``ROT_H``; without ``ROTATE`` the rows themselves. ``ROT_FMA``:
    0 for tensor-core dots at ``PRECISION``, else fp32 multiply-adds over that many rows of ``R`` per step."""
    offs_d = tl.arange(0, HEAD_DIM)
    if ROTATE and ROT_FMA:  # few rows (a decode step): fp32 multiply-adds on the CUDA cores, ROT_FMA rows of R a step
        KB: tl.constexpr = ROT_FMA if ROT_FMA < HEAD_DIM else HEAD_DIM
        offs_k = tl.arange(0, KB)
        y0 = tl.zeros([BLOCK_N, D4], tl.float32)
        y1 = tl.zeros([BLOCK_N, D4], tl.float32)
        y2 = tl.zeros([BLOCK_N, D4], tl.float32)
        y3 = tl.zeros([BLOCK_N, D4], tl.float32)
        for k0 in tl.static_range(0, HEAD_DIM, KB):
            xk = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xd, mask=mask_n[:, None], other=0.0)
            xk = xk.to(tl.float32)[:, :, None]
            r_k = ROT_H + (k0 + offs_k)[:, None] * stride_rr
            if KB == HEAD_DIM:  # one step: all of R's loads issued before the sums (with several warps the sums
                # meet at barriers, which loads written between them would wait behind: one HBM trip, not four;
                # fma_rot_rows keeps this to 128 elements per thread)
                r0 = tl.load(r_k + (col0 + 0 * BQ)[None, :] * stride_rc)
                r1 = tl.load(r_k + (col0 + 1 * BQ)[None, :] * stride_rc)
                r2 = tl.load(r_k + (col0 + 2 * BQ)[None, :] * stride_rc)
                r3 = tl.load(r_k + (col0 + 3 * BQ)[None, :] * stride_rc)
                y0 += tl.sum(xk * r0[None, :, :], axis=1)
                y1 += tl.sum(xk * r1[None, :, :], axis=1)
                y2 += tl.sum(xk * r2[None, :, :], axis=1)
                y3 += tl.sum(xk * r3[None, :, :], axis=1)
            else:  # each load beside its sum (the four loads first: 255 registers and spills in one warp)
                y0 += tl.sum(xk * tl.load(r_k + (col0 + 0 * BQ)[None, :] * stride_rc)[None, :, :], axis=1)
                y1 += tl.sum(xk * tl.load(r_k + (col0 + 1 * BQ)[None, :] * stride_rc)[None, :, :], axis=1)
                y2 += tl.sum(xk * tl.load(r_k + (col0 + 2 * BQ)[None, :] * stride_rc)[None, :, :], axis=1)
                y3 += tl.sum(xk * tl.load(r_k + (col0 + 3 * BQ)[None, :] * stride_rc)[None, :, :], axis=1)
    elif ROTATE:
        x = tl.load(x_rows + offs_d[None, :] * stride_xd, mask=mask_n[:, None], other=0.0).to(tl.float32)
        r_base = ROT_H + offs_d[:, None] * stride_rr
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
    return y0, y1, y2, y3


@triton.jit
def _rotate_q_rows(
    pid_n, kvh, j,
    Q, ROT, QOUT, n_tokens, q_scale,
    stride_qn, stride_qh, stride_qd,
    stride_rh, stride_rr, stride_rc,
    stride_on, stride_oh,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    ROT_PER_HEAD: tl.constexpr, PRECISION: tl.constexpr, ROT_FMA: tl.constexpr,
):
    """Block ``pid_n`` of tokens, query head ``kvh * GQA + j``: ``qout = q @ R_K[kvh] * q_scale`` (fp32, natural
    element order), the rotation of the K rows of the same launch."""
    D4: tl.constexpr = HEAD_DIM // 4
    h = kvh * GQA + j
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_tokens
    col0 = tl.arange(0, D4)  # one group of d: quarter j holds elements j * d/4 + m
    q_rows = Q + offs_n.to(tl.int64)[:, None] * stride_qn + h * stride_qh
    y0, y1, y2, y3 = _rotated_quarters(q_rows, mask_n, ROT + (kvh * stride_rh if ROT_PER_HEAD else 0), stride_qd,
                                       stride_rr, stride_rc, col0, HEAD_DIM, D4, BLOCK_N, D4, True, PRECISION,
                                       ROT_FMA)
    o_rows = QOUT + offs_n.to(tl.int64)[:, None] * stride_on + h * stride_oh
    m2 = mask_n[:, None]
    tl.store(o_rows + (col0 + 0 * D4)[None, :], y0 * q_scale, mask=m2)
    tl.store(o_rows + (col0 + 1 * D4)[None, :], y1 * q_scale, mask=m2)
    tl.store(o_rows + (col0 + 2 * D4)[None, :], y2 * q_scale, mask=m2)
    tl.store(o_rows + (col0 + 3 * D4)[None, :], y3 * q_scale, mask=m2)


@triton.jit
def _fp8_grid(v):
    """fp32 ``v`` (``|v| <= 448``) rounded to nearest even on float8 e4m3's grid, still fp32 (so its conversion to
    e4m3 is exact on every backend): the step of ``v``'s binade (``2**(e - 3)``, subnormals ``2**-9``) from the
    exponent bits, then a round-to-nearest-even of ``|v| / step`` (at most 16) by the 1.5 * 2**23 addition; the
    sign back on last, zeros +0 (as :func:`~oscar_kernels.layout.to_fp8` stores them: an H100 stored +0 where
    the interpreter kept the sign)."""
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / step + 12582912.0) - 12582912.0) * step
    return tl.where(r > 0.0, tl.where(v < 0, -r, r), 0.0)


@triton.jit
def _quantize_pack_rows(
    pid_n, h,
    X, ROT, CLIP, CODES, SCALE, ZERO, LOC, BF16, BLOC, MULT, CODES_HI, CENTER,
    n_tokens, clip_ratio, scale_eps,
    stride_xn, stride_xh, stride_xd,
    stride_rh, stride_rr, stride_rc,
    stride_cs, stride_ch,
    stride_ss, stride_sh,
    stride_zs, stride_zh,
    stride_bs, stride_bh,
    stride_eh,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    ROTATE: tl.constexpr, ROT_PER_HEAD: tl.constexpr, CLIP_PER_HEAD: tl.constexpr, PRECISION: tl.constexpr,
    ROT_FMA: tl.constexpr,
    STORE_CODES: tl.constexpr, STORE_BF16: tl.constexpr, MAX_CODE: tl.constexpr, META_FP8: tl.constexpr,
    CENTER_ROWS: tl.constexpr,
):
    """Block ``pid_n`` of tokens, KV head ``h``, of one of K or V (the body of both kernels below); FP8 metadata
    (``META_FP8``) stores scale and zero over KV head ``h``'s multiplier ``MULT[h]``; 4-bit codes (``MAX_CODE``
    15) store their high plane at ``CODES_HI`` (the low plane's strides); ``CENTER_ROWS`` subtracts KV head ``h``'s
    center ``CENTER[h]`` (rotated basis, natural element order) from the rotated rows before anything is stored."""
    D4: tl.constexpr = HEAD_DIM // 4
    BQ: tl.constexpr = GROUP_SIZE // 4
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_tokens
    offs_m = tl.arange(0, D4)  # byte index within a row
    # element held by byte m in bit plane j: (m // BQ) * GROUP_SIZE + j * BQ + m % BQ
    col0 = (offs_m // BQ) * GROUP_SIZE + offs_m % BQ

    x_rows = X + offs_n.to(tl.int64)[:, None] * stride_xn + h * stride_xh
    y0, y1, y2, y3 = _rotated_quarters(x_rows, mask_n, ROT + (h * stride_rh if ROT_PER_HEAD else 0), stride_xd,
                                       stride_rr, stride_rc, col0, HEAD_DIM, BQ, BLOCK_N, D4, ROTATE, PRECISION,
                                       ROT_FMA)
    if CENTER_ROWS:  # key centering: every stored row (codes and exact) alike, so the softmax sees one shift
        c_h = CENTER + h * stride_eh
        y0 -= tl.load(c_h + (col0 + 0 * BQ))[None, :]
        y1 -= tl.load(c_h + (col0 + 1 * BQ))[None, :]
        y2 -= tl.load(c_h + (col0 + 2 * BQ))[None, :]
        y3 -= tl.load(c_h + (col0 + 3 * BQ))[None, :]

    if STORE_BF16:  # the rotated row, natural element order, where bf16_loc >= 0
        brow = tl.load(BLOC + offs_n, mask=mask_n, other=-1).to(tl.int64)
        mb = (mask_n & (brow >= 0))[:, None]
        b_rows = BF16 + brow[:, None] * stride_bs + h * stride_bh
        tl.store(b_rows + (col0 + 0 * BQ)[None, :], _to_bf16(y0), mask=mb)
        tl.store(b_rows + (col0 + 1 * BQ)[None, :], _to_bf16(y1), mask=mb)
        tl.store(b_rows + (col0 + 2 * BQ)[None, :], _to_bf16(y2), mask=mb)
        tl.store(b_rows + (col0 + 3 * BQ)[None, :], _to_bf16(y3), mask=mb)

    if STORE_CODES:
        if CLIP_PER_HEAD:
            r = tl.load(CLIP + h)
        else:
            r = clip_ratio
        # [BLOCK_N, NG, BQ]: one group per middle index
        y0 = tl.reshape(y0, (BLOCK_N, NG, BQ))
        y1 = tl.reshape(y1, (BLOCK_N, NG, BQ))
        y2 = tl.reshape(y2, (BLOCK_N, NG, BQ))
        y3 = tl.reshape(y3, (BLOCK_N, NG, BQ))
        mn = tl.min(tl.minimum(tl.minimum(y0, y1), tl.minimum(y2, y3)), axis=2, keep_dims=True)
        mx = tl.max(tl.maximum(tl.maximum(y0, y1), tl.maximum(y2, y3)), axis=2, keep_dims=True)
        mid = (mx + mn) * 0.5
        half = (mx - mn) * 0.5 * r
        lo = mid - half
        hi = mid + half
        TOP: tl.constexpr = MAX_CODE * 1.0
        if META_FP8:
            m = tl.load(MULT + h)
            sq = _fp8_grid(tl.clamp(tl.math.div_rn(tl.maximum(tl.math.div_rn(hi - lo, TOP), scale_eps), m),
                                    _FP8_MIN_STEP, _FP8_MAX))
            zq = _fp8_grid(tl.clamp(tl.math.div_rn(lo, m), -_FP8_MAX, _FP8_MAX))
            scale16 = sq.to(tl.float8e4nv)
            zero16 = zq.to(tl.float8e4nv)
            s = sq * m
            z = zq * m
        else:  # div_rn: the quotient rounded once, as the definition says (no reciprocal, no approximate div.full)
            scale16 = tl.maximum(tl.math.div_rn(hi - lo, TOP), scale_eps).to(tl.float16)
            zero16 = lo.to(tl.float16)
            s = scale16.to(tl.float32)
            z = zero16.to(tl.float32)
        c0 = tl.clamp(tl.floor(tl.math.div_rn(y0 - z, s) + 0.5), 0.0, TOP).to(tl.uint8)
        c1 = tl.clamp(tl.floor(tl.math.div_rn(y1 - z, s) + 0.5), 0.0, TOP).to(tl.uint8)
        c2 = tl.clamp(tl.floor(tl.math.div_rn(y2 - z, s) + 0.5), 0.0, TOP).to(tl.uint8)
        c3 = tl.clamp(tl.floor(tl.math.div_rn(y3 - z, s) + 0.5), 0.0, TOP).to(tl.uint8)
        packed = tl.reshape((c0 & 3) | ((c1 & 3) << 2) | ((c2 & 3) << 4) | ((c3 & 3) << 6), (BLOCK_N, D4))

        slot = tl.load(LOC + offs_n, mask=mask_n, other=0).to(tl.int64)
        m2 = mask_n[:, None]
        tl.store(CODES + slot[:, None] * stride_cs + h * stride_ch + offs_m[None, :], packed, mask=m2)
        if MAX_CODE > 3:  # 4-bit codes: the high two bits in their own plane, same layout
            packed_hi = tl.reshape((c0 >> 2) | ((c1 >> 2) << 2) | ((c2 >> 2) << 4) | ((c3 >> 2) << 6), (BLOCK_N, D4))
            tl.store(CODES_HI + slot[:, None] * stride_cs + h * stride_ch + offs_m[None, :], packed_hi, mask=m2)
        offs_g = tl.arange(0, NG)
        tl.store(SCALE + slot[:, None] * stride_ss + h * stride_sh + offs_g[None, :],
                 tl.reshape(scale16, (BLOCK_N, NG)), mask=m2)
        tl.store(ZERO + slot[:, None] * stride_zs + h * stride_zh + offs_g[None, :],
                 tl.reshape(zero16, (BLOCK_N, NG)), mask=m2)


@triton.jit
def _quantize_pack_kv_kernel(
    K_X, K_ROT, K_CLIP, K_CODES, K_SCALE, K_ZERO, K_LOC, K_BF16, K_BLOC, K_MULT, K_CODES_HI, K_CENTER,
    K_n_tokens, K_clip_ratio, K_scale_eps,
    K_stride_xn, K_stride_xh, K_stride_xd,
    K_stride_rh, K_stride_rr, K_stride_rc,
    K_stride_cs, K_stride_ch,
    K_stride_ss, K_stride_sh,
    K_stride_zs, K_stride_zh,
    K_stride_bs, K_stride_bh,
    K_stride_eh,
    V_X, V_ROT, V_CLIP, V_CODES, V_SCALE, V_ZERO, V_LOC, V_BF16, V_BLOC, V_MULT, V_CODES_HI, V_CENTER,
    V_n_tokens, V_clip_ratio, V_scale_eps,
    V_stride_xn, V_stride_xh, V_stride_xd,
    V_stride_rh, V_stride_rr, V_stride_rc,
    V_stride_cs, V_stride_ch,
    V_stride_ss, V_stride_sh,
    V_stride_zs, V_stride_zh,
    V_stride_bs, V_stride_bh,
    V_stride_eh,
    Q_X, Q_OUT, q_scale,
    Q_stride_xn, Q_stride_xh, Q_stride_xd,
    Q_stride_on, Q_stride_oh,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    ROTATE: tl.constexpr, ROT_PER_HEAD: tl.constexpr, CLIP_PER_HEAD: tl.constexpr, PRECISION: tl.constexpr,
    ROT_FMA: tl.constexpr,
    STORE_CODES: tl.constexpr, STORE_BF16: tl.constexpr, MAX_CODE: tl.constexpr, META_FP8: tl.constexpr,
    KV_PROGRAMS: tl.constexpr,
    ROTATE_Q: tl.constexpr, GQA: tl.constexpr, CENTER_K: tl.constexpr,
):
    """K and V of the same tokens in one launch: ``program_id(2)`` 0 writes K, 1 writes V (the two are independent,
    so their programs run side by side instead of one launch after the other). A single write launches it with a
    grid of depth 1 (``KV_PROGRAMS = 1``: the V arguments then repeat the K ones and are never read). With queries to
    rotate (grid depth ``KV_PROGRAMS + GQA``), program ``KV_PROGRAMS + j`` rotates query head ``h * GQA + j`` by
    ``K_ROT[h]`` into ``Q_OUT``. ``CENTER_K``: the first write's rows are centered (keys; values never are)."""
    if tl.program_id(2) == 0:
        _quantize_pack_rows(tl.program_id(0), tl.program_id(1), K_X, K_ROT, K_CLIP, K_CODES, K_SCALE, K_ZERO, K_LOC,
                            K_BF16, K_BLOC, K_MULT, K_CODES_HI, K_CENTER, K_n_tokens, K_clip_ratio,
                            K_scale_eps, K_stride_xn, K_stride_xh, K_stride_xd, K_stride_rh, K_stride_rr, K_stride_rc, K_stride_cs, K_stride_ch, K_stride_ss,
                            K_stride_sh, K_stride_zs, K_stride_zh, K_stride_bs, K_stride_bh,
                            K_stride_eh, HEAD_DIM=HEAD_DIM, GROUP_SIZE=GROUP_SIZE, BLOCK_N=BLOCK_N, ROTATE=ROTATE,
                            ROT_PER_HEAD=ROT_PER_HEAD, CLIP_PER_HEAD=CLIP_PER_HEAD, PRECISION=PRECISION,
                            ROT_FMA=ROT_FMA, STORE_CODES=STORE_CODES, STORE_BF16=STORE_BF16, MAX_CODE=MAX_CODE,
                            META_FP8=META_FP8, CENTER_ROWS=CENTER_K)
    elif tl.program_id(2) < KV_PROGRAMS:
        _quantize_pack_rows(tl.program_id(0), tl.program_id(1), V_X, V_ROT, V_CLIP, V_CODES, V_SCALE, V_ZERO, V_LOC,
                            V_BF16, V_BLOC, V_MULT, V_CODES_HI, V_CENTER, V_n_tokens, V_clip_ratio,
                            V_scale_eps, V_stride_xn, V_stride_xh, V_stride_xd, V_stride_rh, V_stride_rr, V_stride_rc, V_stride_cs, V_stride_ch, V_stride_ss,
                            V_stride_sh, V_stride_zs, V_stride_zh, V_stride_bs, V_stride_bh,
                            V_stride_eh, HEAD_DIM=HEAD_DIM, GROUP_SIZE=GROUP_SIZE, BLOCK_N=BLOCK_N, ROTATE=ROTATE,
                            ROT_PER_HEAD=ROT_PER_HEAD, CLIP_PER_HEAD=CLIP_PER_HEAD, PRECISION=PRECISION,
                            ROT_FMA=ROT_FMA, STORE_CODES=STORE_CODES, STORE_BF16=STORE_BF16, MAX_CODE=MAX_CODE,
                            META_FP8=META_FP8, CENTER_ROWS=False)
    elif ROTATE_Q:  # a static branch: the query programs are compiled only when there are queries
        _rotate_q_rows(tl.program_id(0), tl.program_id(1), tl.program_id(2) - KV_PROGRAMS, Q_X, K_ROT, Q_OUT,
                       K_n_tokens, q_scale, Q_stride_xn, Q_stride_xh, Q_stride_xd, K_stride_rh, K_stride_rr,
                       K_stride_rc, Q_stride_on, Q_stride_oh, GQA=GQA, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
                       ROT_PER_HEAD=ROT_PER_HEAD, PRECISION=PRECISION, ROT_FMA=ROT_FMA)


def _check_clip(clip: float | torch.Tensor | None, hkv: int) -> float | torch.Tensor:
    if clip is None:
        return DEFAULT_CLIP_RATIO
    if isinstance(clip, torch.Tensor):
        check_clip("clip", clip, hkv)
        return clip
    if not 0.0 < float(clip) <= 1.0:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip}")
    return float(clip)


def _check_args(x, rot, clip, codes, scale, zero, out_cache_loc, group_size, bf16_out, bf16_loc, mult=None,
                codes_hi=None, center=None):
    """Shared by the kernel launcher and the reference: returns ``(g, clip)``."""
    n, hkv, d = x.shape
    if center is not None and (center.dtype != torch.float32 or center.shape != (hkv, d) or center.stride(-1) != 1
                               or center.device != x.device):
        raise ValueError(f"center must be an fp32 [{hkv}, {d}] tensor on {x.device} with a contiguous last dim, got "
                         f"{center.dtype} {tuple(center.shape)} on {center.device}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    if codes is None:
        if scale is not None or zero is not None:
            raise ValueError("codes, scale and zero are given together or not at all")
        if bf16_out is None:
            raise ValueError("nothing to store: give codes/scale/zero, bf16_out, or both")
        g = group_size or d
    else:
        if scale is None or zero is None:
            raise ValueError("codes, scale and zero are given together or not at all")
        g = group_size or d // max(scale.shape[-1], 1)
        check_group_size(d, g)
        if codes.dtype != torch.uint8 or codes.shape[1:] != (hkv, d // CODES_PER_BYTE) or codes.stride(-1) != 1:
            raise ValueError(f"codes must be uint8 [S, {hkv}, {d // 4}] with contiguous last dim, "
                             f"got {codes.dtype} {tuple(codes.shape)}")
        meta = torch.float16 if mult is None else FP8
        for name, t in (("scale", scale), ("zero", zero)):
            if t.dtype != meta or t.shape != (codes.shape[0], hkv, d // g) or t.stride(-1) != 1:
                raise ValueError(f"{name} must be {str(meta).removeprefix('torch.')} [{codes.shape[0]}, {hkv}, "
                                 f"{d // g}] with contiguous last dim (FP8 with a multiplier), got {t.dtype}")
        if codes_hi is not None and (codes_hi.dtype != torch.uint8 or codes_hi.shape != codes.shape
                                     or codes_hi.stride() != codes.stride()):
            raise ValueError(f"codes_hi (4-bit codes' high plane) must be uint8 {tuple(codes.shape)} with the codes' "
                             f"strides, got {codes_hi.dtype} {tuple(codes_hi.shape)}")
        if mult is not None and (mult.dtype != torch.float32 or mult.shape != (hkv,) or mult.device != codes.device):
            raise ValueError(f"mult must be an fp32 [{hkv}] tensor on {codes.device}, got {mult.dtype} "
                             f"{tuple(mult.shape)} on {mult.device}")
        if out_cache_loc is None or out_cache_loc.shape != (n,) or out_cache_loc.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"out_cache_loc must be int32/int64 [{n}]")
    if (bf16_out is None) != (bf16_loc is None):
        raise ValueError("bf16_out and bf16_loc are given together or not at all")
    if bf16_out is not None:
        check_bf16("bf16_out", bf16_out, hkv, d)
        if bf16_loc.shape != (n,) or bf16_loc.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"bf16_loc must be int32/int64 [{n}]")
    if rot is not None and (rot.dtype != torch.float32 or rot.dim() != 3 or rot.shape[0] not in (1, hkv)
                            or rot.shape[1:] != (d, d)):
        raise ValueError(f"rot must be fp32 [{hkv} or 1, {d}, {d}], got {rot.dtype} {tuple(rot.shape)}")
    return g, _check_clip(clip, hkv)


def quantize_pack(
    x: torch.Tensor,
    rot: torch.Tensor | None,
    clip: float | torch.Tensor | None,
    codes: torch.Tensor | None,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    out_cache_loc: torch.Tensor | None,
    group_size: int | None = None,
    bf16_out: torch.Tensor | None = None,
    bf16_loc: torch.Tensor | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    rot_precision: str = DEFAULT_ROT_PRECISION,
    num_warps: int = DEFAULT_WARPS,
    rot_rows: int = DEFAULT_ROT_ROWS,
    mult: torch.Tensor | None = None,
    codes_hi: torch.Tensor | None = None,
    center: torch.Tensor | None = None,
) -> None:
    """Quantize new rows into their slots (and optionally store their rotated exact rows), in place, one launch.

    Args:
        x: bf16/fp16/fp32 ``[N, Hkv, d]``, the un-rotated K or V of ``N`` new tokens (any strides).
        rot: fp32 ``[Hkv or 1, d, d]``, rotated row ``x' = x @ rot[h]``; ``None`` if ``x`` is already rotated.
        clip: clip ratio ``r`` in (0, 1]: a float, or an fp32 ``[Hkv]`` device tensor of per-KV-head ratios (read in
            the kernel; its values are not checked, which would need a host sync); ``None``: ``DEFAULT_CLIP_RATIO``.
        codes: uint8 ``[S, Hkv, d/4]`` slot pool, written at rows ``out_cache_loc`` (last dim contiguous);
            ``None`` (with scale/zero) skips the INT2 store.
        scale, zero: fp16 ``[S, Hkv, d/g]`` slot pools (last dim contiguous); float8 e4m3 with ``mult``.
        out_cache_loc: int32/int64 ``[N]`` slot of each new token (distinct slots); unused without ``codes``.
        group_size: ``g`` (default: ``d / scale.shape[-1]``, or ``d`` without codes).
        bf16_out: optional bf16 ``[R, Hkv, d]`` exact rows: row ``bf16_loc[n]`` gets ``bf16(x'[n])``.
        bf16_loc: int32/int64 ``[N]`` (with ``bf16_out``): target row of each token, ``-1`` = do not store; rows
            distinct (two tokens of one launch aimed at one row race: which one lands is undefined on a GPU).
        block_n: tokens per program (``DEFAULT_BLOCK_N``).
        rot_precision: how the fused rotation multiplies on GPU: a Triton ``input_precision`` of its tensor-core
            dots (``"tf32x3"``, the default ``DEFAULT_ROT_PRECISION``; ``"tf32"``, ``"ieee"``), or ``"fma"``: fp32
            multiply-adds on the CUDA cores, for a few rows per program (a decode step's; use a small ``block_n``).
            The interpreter always computes in fp32.
        num_warps: warps per program (``DEFAULT_WARPS``).
        rot_rows: ``"fma"`` only: rows of ``rot`` multiplied per step (a power of two, ``DEFAULT_ROT_ROWS``; ``d``
            and more: all of them, every load of the rotation in flight at once; 0: :func:`fma_rot_rows`, all of
            them where that holds at most ``ROT_ELEMS_PER_THREAD`` per thread).
        mult: FP8 metadata: fp32 ``[Hkv]`` per-head multiplier (scale and zero stored as e4m3 of ``value / mult``,
            see :mod:`oscar_kernels.layout`); None: fp16 metadata.
        codes_hi: 4-bit codes: their high 2-bit plane (uint8, ``codes``' shape and strides; ``codes`` gets the low
            plane, the scale spans 15 steps); None: 2-bit codes.
        center: key centering: fp32 ``[Hkv, d]`` (contiguous last dim, on the rows' device) in the ROTATED basis,
            natural element order, subtracted from every rotated row before its codes and its exact row are made
            (``x' = x @ rot[h] - center[h]``); None: rows as they are.
    """
    args, meta = _launch_args(x, rot, clip, codes, scale, zero, out_cache_loc, group_size, bf16_out, bf16_loc,
                              rot_precision, rot_rows, num_warps, mult, codes_hi, center)
    _launch(x.shape, args, args, meta, block_n, num_warps)


def _launch(shape, ka: list, va: list, meta: dict, block_n: int, num_warps: int, qa: list | None = None,
            gqa: int = 1) -> None:
    """One launch over ``[N, Hkv, d]`` rows: K programs, and V programs unless ``va`` is ``ka`` (a single write
    repeats its arguments and gets a grid of depth 1); with ``qa`` (:func:`_q_args`) also the ``gqa`` query heads of
    each KV head, rotated by the K rotation (``gqa`` more programs per block and head)."""
    n, hkv, _ = shape
    if n:
        kv_programs = 1 if va is ka else 2
        rotate_q = qa is not None
        if not rotate_q:
            qa, gqa = [ka[0], ka[0], 1.0, 0, 0, 0, 0, 0], 0  # never read
        grid = (triton.cdiv(n, block_n), hkv, kv_programs + gqa)
        _quantize_pack_kv_kernel[grid](*ka, *va, *qa, BLOCK_N=block_n, **meta, KV_PROGRAMS=kv_programs,
                                       ROTATE_Q=rotate_q, GQA=max(gqa, 1), num_warps=num_warps)


def _q_args(q: torch.Tensor, q_out: torch.Tensor, q_scale: float, k: torch.Tensor, rot_k: torch.Tensor | None) -> \
        tuple[list, int]:
    """Checked arguments of the query rotation that shares a K/V write's launch: (list, GQA)."""
    n, hkv, d = k.shape
    if rot_k is None:
        raise ValueError("rotating queries in the write needs rot_k")
    if q.dim() != 3 or q.shape[0] != n or q.shape[2] != d or q.shape[1] % hkv or q.dtype not in (
            torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bf16/fp16/fp32 [{n}, a multiple of {hkv}, {d}], got {q.dtype} {tuple(q.shape)}")
    if q_out is None or q_out.shape != q.shape or q_out.dtype != torch.float32 or q_out.stride(-1) != 1 \
            or q_out.device != q.device:
        raise ValueError(f"q_out must be fp32 {tuple(q.shape)} on {q.device} with a contiguous last dim")
    return [q, q_out, float(q_scale), *q.stride(), q_out.stride(0), q_out.stride(1)], q.shape[1] // hkv


def _launch_args(x, rot, clip, codes, scale, zero, out_cache_loc, group_size, bf16_out, bf16_loc,
                 rot_precision, rot_rows: int = DEFAULT_ROT_ROWS, num_warps: int = DEFAULT_WARPS,
                 mult: torch.Tensor | None = None, codes_hi: torch.Tensor | None = None,
                 center: torch.Tensor | None = None) -> tuple[list, dict]:
    """Checked arguments of one K or V write: (pointer/scalar/stride list, compile-time parameters)."""
    g, clip = _check_args(x, rot, clip, codes, scale, zero, out_cache_loc, group_size, bf16_out, bf16_loc, mult,
                          codes_hi, center)
    n, hkv, d = x.shape
    if codes is None:
        check_group_size(d, g)
    rotate = rot is not None
    rot_t, rot_strides = (rot, rot.stride()) if rotate else (x, (0, 0, 0))  # unused pointer without rotation
    per_head = isinstance(clip, torch.Tensor)
    store_codes, store_bf16 = codes is not None, bf16_out is not None
    c_t, s_t, z_t, l_t = (codes, scale, zero, out_cache_loc) if store_codes else (x, x, x, x)
    b_t, bl_t = (bf16_out, bf16_loc) if store_bf16 else (x, x)
    fp8 = store_codes and mult is not None
    four = store_codes and codes_hi is not None
    args = [
        x, rot_t, clip if per_head else x, c_t, s_t, z_t, l_t, b_t, bl_t, mult if fp8 else x, codes_hi if four else x,
        x if center is None else center,
        n, DEFAULT_CLIP_RATIO if per_head else clip, SCALE_EPS,
        *x.stride(), *rot_strides,
        *(c_t.stride()[:2] if store_codes else (0, 0)), *(s_t.stride()[:2] if store_codes else (0, 0)),
        *(z_t.stride()[:2] if store_codes else (0, 0)), *(b_t.stride()[:2] if store_bf16 else (0, 0)),
        0 if center is None else center.stride(0),
    ]
    fma = rot_precision == "fma"
    if not isinstance(rot_rows, int) or isinstance(rot_rows, bool) or rot_rows < 0 or rot_rows & (rot_rows - 1):
        raise ValueError(f"rot_rows must be 0 (fma_rot_rows) or a power of two, got {rot_rows!r}")
    if not fma and rot_precision not in ("tf32x3", "tf32", "ieee"):
        raise ValueError(f"rot_precision must be tf32x3, tf32, ieee or fma, got {rot_precision!r}")
    meta = dict(HEAD_DIM=d, GROUP_SIZE=g, ROTATE=rotate, ROT_PER_HEAD=rotate and rot.shape[0] > 1,
                CLIP_PER_HEAD=per_head, PRECISION="ieee" if fma else rot_precision,
                ROT_FMA=(rot_rows or fma_rot_rows(d, num_warps)) if fma else 0,
                STORE_CODES=store_codes, STORE_BF16=store_bf16, MAX_CODE=15 if four else LEVELS,
                META_FP8=fp8, CENTER_K=center is not None)
    return args, meta


def quantize_pack_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    rot_k: torch.Tensor | None,
    rot_v: torch.Tensor | None,
    clip_k: float | torch.Tensor | None,
    clip_v: float | torch.Tensor | None,
    k_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    v_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    out_cache_loc: torch.Tensor | None,
    group_size: int | None = None,
    bf16_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    bf16_loc: torch.Tensor | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    rot_precision: str = DEFAULT_ROT_PRECISION,
    num_warps: int = DEFAULT_WARPS,
    q: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
    q_scale: float = 1.0,
    rot_rows: int = DEFAULT_ROT_ROWS,
    center_k: torch.Tensor | None = None,
) -> None:
    """:func:`quantize_pack` of the K and the V rows of the same tokens in one launch (grid ``[blocks, Hkv, 2]``).

    ``k_slots``/``v_slots``: each one's :class:`~oscar_kernels.layout.Int2Pool` (any width and metadata), or
    ``(codes, scale, zero)`` / ``(codes, scale, zero, mult)`` (2-bit codes; FP8 metadata with ``mult``), or ``None``
    for exact rows only; ``bf16_out``:
    ``(k_rows, v_rows)``; the rest as :func:`quantize_pack`, per K and V where named so. Results equal two
    :func:`quantize_pack` calls. When K and V differ in what the kernel is compiled for (one rotated and the other
    not, per-head clips for one only, ...), it makes those two launches instead.

    With ``q`` (bf16/fp16/fp32 ``[N, Hq, d]``, the queries of the same tokens, ``Hq`` a multiple of ``Hkv``) the same
    launch also writes ``q_out[n, h] = q[n, h] @ rot_k[h // (Hq / Hkv)] * q_scale`` (fp32 ``[N, Hq, d]``, contiguous
    last dim; grid ``[blocks, Hkv, 2 + Hq / Hkv]``), rotated as the K rows are (``rot_precision``): what a decode
    step's attention reads (:func:`rotate_q_ref` is the definition). A decode step thereby pays one launch for its
    writes and its query rotation. ``center_k``: the keys' center (:func:`quantize_pack`'s ``center``; the queries are
    not shifted: the scores move by ``q·center`` for every row a query reads, which the softmax ignores)."""
    if v.shape != k.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    ko, vo = bf16_out if bf16_out is not None else (None, None)
    (kc, ks, kz, kmult, khi), (vc, vs, vz, vmult, vhi) = (_slots(k_slots), _slots(v_slots))
    ka, km = _launch_args(k, rot_k, clip_k, kc, ks, kz, out_cache_loc, group_size, ko, bf16_loc,
                          rot_precision, rot_rows, num_warps, kmult, khi, center_k)
    va, vm = _launch_args(v, rot_v, clip_v, vc, vs, vz, out_cache_loc, group_size, vo, bf16_loc,
                          rot_precision, rot_rows, num_warps, vmult, vhi)
    qa, gqa = _q_args(q, q_out, q_scale, k, rot_k) if q is not None else (None, 1)
    if {**km, "CENTER_K": False} == vm:  # the centering is the K programs' only: one launch still
        _launch(k.shape, ka, va, km, block_n, num_warps, qa, gqa)
    else:
        _launch(k.shape, ka, ka, km, block_n, num_warps, qa, gqa)
        _launch(k.shape, va, va, vm, block_n, num_warps)


def _slots(slots) -> tuple:
    """``None`` / an :class:`Int2Pool` / ``(codes, scale, zero)`` / ``(codes, scale, zero, mult)`` -> ``(codes,
    scale, zero, mult, codes_hi)``."""
    if slots is None:
        return None, None, None, None, None
    if isinstance(slots, Int2Pool):
        return slots.codes, slots.scale, slots.zero, slots.mult, slots.codes_hi
    if len(slots) not in (3, 4):
        raise ValueError(f"slots must be (codes, scale, zero) or (codes, scale, zero, mult), got {len(slots)} items")
    return (*slots, None, None) if len(slots) == 3 else (*slots, None)


def rotate_q_ref(q: torch.Tensor, rot_k: torch.Tensor, q_scale: float = 1.0) -> torch.Tensor:
    """Plain fp32 torch definition of the query rotation of :func:`quantize_pack_kv`: q ``[N, Hq, d]``, rot_k fp32
    ``[Hkv or 1, d, d]`` -> fp32 ``[N, Hq, d]``."""
    n, hq, d = q.shape
    gqa = hq // rot_k.shape[0] if rot_k.shape[0] > 1 else hq
    rk = rot_k.float().repeat_interleave(gqa, 0) if rot_k.shape[0] > 1 else rot_k.float().expand(hq, d, d)
    return torch.einsum("nhd,hde->nhe", q.float(), rk.to(q.device)) * q_scale


def quantize_pack_ref(
    x: torch.Tensor,
    rot: torch.Tensor | None,
    clip: float | torch.Tensor | None,
    codes: torch.Tensor | None,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    out_cache_loc: torch.Tensor | None,
    group_size: int | None = None,
    bf16_out: torch.Tensor | None = None,
    bf16_loc: torch.Tensor | None = None,
    mult: torch.Tensor | None = None,
    codes_hi: torch.Tensor | None = None,
    center: torch.Tensor | None = None,
) -> None:
    """Plain fp32 torch definition of :func:`quantize_pack` (same arguments, same in-place writes)."""
    g, clip = _check_args(x, rot, clip, codes, scale, zero, out_cache_loc, group_size, bf16_out, bf16_loc, mult,
                          codes_hi, center)
    n, hkv, d = x.shape
    xr = x.float()
    if rot is not None:
        xr = torch.einsum("nhd,hde->nhe", xr, rot.float().expand(hkv, d, d))
    if center is not None:
        xr = xr - center.float()
    if bf16_out is not None:
        keep = bf16_loc >= 0
        bf16_out[bf16_loc[keep].long()] = xr[keep].to(torch.bfloat16).to(bf16_out.device)
    if codes is None:
        return
    r = clip.view(1, hkv, 1) if isinstance(clip, torch.Tensor) else clip
    xg = xr.unflatten(-1, (-1, g))  # [N, Hkv, G, g]
    mn, mx = xg.amin(-1), xg.amax(-1)
    mid = (mx + mn) * 0.5
    half = (mx - mn) * 0.5 * r
    lo, hi = mid - half, mid + half
    top = 15 if codes_hi is not None else LEVELS
    # divided by a tensor, not by the number: torch on CUDA computes ``tensor / number`` as ``tensor * fp32(1 /
    # number)``, one fp32 ulp off the correctly rounded quotient for some inputs (enough to move an fp16 scale one
    # step), while the definition, the kernel's div_rn and torch on the CPU round the quotient itself
    s16 = ((hi - lo) / torch.full_like(hi, top)).clamp_min(SCALE_EPS)
    if mult is None:
        s16, z16 = s16.to(torch.float16), lo.to(torch.float16)
        sf, zf = s16.float(), z16.float()
    else:
        m = mult.float().to(x.device).view(1, hkv, 1)
        s16 = to_fp8(s16 / m, FP8_MIN_STEP, FP8_MAX)
        z16 = to_fp8(lo / m, -FP8_MAX, FP8_MAX)
        sf, zf = s16.float() * m, z16.float() * m
    c = torch.floor((xg - zf.unsqueeze(-1)) / sf.unsqueeze(-1) + 0.5).clamp_(0, top).flatten(-2).to(torch.uint8)
    loc = out_cache_loc.long()
    codes[loc] = pack(c & 3, KERNEL_BITS, g).to(codes.device)
    if codes_hi is not None:
        codes_hi[loc] = pack(c >> 2, KERNEL_BITS, g).to(codes.device)
    scale[loc] = s16.to(scale.device)
    zero[loc] = z16.to(zero.device)
