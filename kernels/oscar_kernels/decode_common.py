"""Device helpers shared by the decode split kernels (Triton: :mod:`oscar_kernels.decode_split`; Gluon:
:mod:`oscar_kernels.decode_async`), the merge (:mod:`oscar_kernels.decode_merge`) and the extend kernel
(:mod:`oscar_kernels.extend`): the code unpacks, the programs of a sequence and each one's share of a list, the
finish of a split, and the exact-row tile of the general path.

The unpacks turn packed 2-bit codes into tensor-core operands. On CUDA, OR-ing a code into the mantissa of an fp16
1024 (``F16_MAGIC``) or a bf16 128 (``BF16_MAGIC``) gives ``magic + code`` exactly, two codes per 32-bit register and
instruction (the "magic number" trick); the kernels take the magic back out of their sums (see each caller).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

F16_MAGIC = tl.constexpr(1024.0)
"""fp16 1024: OR-ing a code ``c < 1024`` into its mantissa gives exactly ``1024 + c`` (the PTX unpacks)."""
BF16_MAGIC = tl.constexpr(128.0)
"""bf16 128: OR-ing a code ``c < 128`` into its mantissa gives exactly ``128 + c`` (the general path's PTX unpack)."""


def _pair_bits(value: float, dtype: torch.dtype) -> int:
    """32-bit pattern of two half-words equal to ``value`` in ``dtype`` (fp16 1024 -> 0x64006400)."""
    h = torch.tensor(value, dtype=dtype).view(torch.int16).item() & 0xFFFF
    return (h << 16) | h


_F16_PAIR = _pair_bits(F16_MAGIC.value, torch.float16)
_BF16_PAIR = _pair_bits(BF16_MAGIC.value, torch.bfloat16)


def _plane_asm(shift: int, magic: int) -> str:
    """PTX: 4 packed codes (one byte each) -> bit plane at ``shift`` as 4 half-words ``magic | code``.

    OR-ing a 2-bit code into the mantissa of ``F16_MAGIC`` / ``BF16_MAGIC`` yields exactly ``1024 + code`` /
    ``128 + code``, two elements per 32-bit register in ~1.25 instructions per element.
    """
    return (
        "{ .reg .b32 t; "
        f"shr.b32 t, $2, {shift}; "
        "prmt.b32 $0, t, t, 0x3120; prmt.b32 $1, t, t, 0x1302; "
        f"and.b32 $0, $0, 0x00030003; and.b32 $1, $1, 0x00030003; "
        f"or.b32 $0, $0, {magic:#x}; or.b32 $1, $1, {magic:#x}; }}"
    )


_F16_PLANE0 = tl.constexpr(_plane_asm(0, _F16_PAIR))
_F16_PLANE1 = tl.constexpr(_plane_asm(2, _F16_PAIR))
_F16_PLANE2 = tl.constexpr(_plane_asm(4, _F16_PAIR))
_F16_PLANE3 = tl.constexpr(_plane_asm(6, _F16_PAIR))
_BF16_PLANE0 = tl.constexpr(_plane_asm(0, _BF16_PAIR))
_BF16_PLANE1 = tl.constexpr(_plane_asm(2, _BF16_PAIR))
_BF16_PLANE2 = tl.constexpr(_plane_asm(4, _BF16_PAIR))
_BF16_PLANE3 = tl.constexpr(_plane_asm(6, _BF16_PAIR))


@triton.jit
def head_mults(MULT_K, MULT_V, kvh, META_FP8: tl.constexpr):
    """KV head ``kvh``'s FP8 metadata multipliers ``(m_K, m_V)`` (1.0 each with fp16 metadata, never read)."""
    if META_FP8:
        mk = tl.load(MULT_K + kvh)
        mv = tl.load(MULT_V + kvh)
    else:
        mk = 1.0
        mv = 1.0
    return mk, mv


@triton.jit
def meta_f32(x, m, META_FP8: tl.constexpr):
    """Stored scales or zeros -> fp32 values: FP8 ones times their head's multiplier ``m``, fp16 ones as they are."""
    if META_FP8:
        return x.to(tl.float32) * m
    else:
        return x.to(tl.float32)


@triton.jit
def code_plane(c, ch, j: tl.constexpr, BITS: tl.constexpr):
    """Plane ``j`` of packed 2-bit code bytes ``c`` as integer codes (0..3); 4-bit codes (``BITS`` 4) add their high
    plane's ``ch`` times 4 (0..15)."""
    x = (c >> (2 * j)) & 3
    if BITS == 4:
        x = x | (((ch >> (2 * j)) & 3) << 2)
    return x


@triton.jit
def split_counts(NUM_SPLITS, NUM_EXACT, b, parts, exact_splits, PER_SEQ_EXACT: tl.constexpr):
    """Programs of sequence ``b`` (split kernels and merge agree on them): ``e`` exact programs, ``clamp(num_exact[b],
    1, exact_splits)`` (``PER_SEQ_EXACT``) or ``exact_splits``, and ``n = clamp(num_splits[b], 1, parts - e)`` INT2
    splits; partials ``[0, n)`` are the INT2 splits', ``[n, n + e)`` the exact programs'."""
    if PER_SEQ_EXACT:
        e = tl.minimum(tl.maximum(tl.load(NUM_EXACT + b), 1), exact_splits)
    else:
        e = exact_splits
    n = tl.minimum(tl.maximum(tl.load(NUM_SPLITS + b), 1), parts - e)
    return n, e


@triton.jit
def planes_f16(x):
    """uint8 codes -> four fp16 tensors ``1024 + plane_j``."""
    return (tl.inline_asm_elementwise(_F16_PLANE0, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4),
            tl.inline_asm_elementwise(_F16_PLANE1, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4),
            tl.inline_asm_elementwise(_F16_PLANE2, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4),
            tl.inline_asm_elementwise(_F16_PLANE3, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4))


@triton.jit
def planes_bf16(x):
    """uint8 codes -> four bf16 tensors ``128 + plane_j``."""
    return (tl.inline_asm_elementwise(_BF16_PLANE0, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=4),
            tl.inline_asm_elementwise(_BF16_PLANE1, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=4),
            tl.inline_asm_elementwise(_BF16_PLANE2, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=4),
            tl.inline_asm_elementwise(_BF16_PLANE3, "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=4))


_WORD_PLANES = tl.constexpr(
    "{ .reg .b32 h; "
    f"lop3.b32 $0, $8, 0x00030003, {_F16_PAIR:#x}, 0xea; lop3.b32 $1, $8, 0x000c000c, {_F16_PAIR:#x}, 0xea; "
    f"lop3.b32 $2, $8, 0x00300030, {_F16_PAIR:#x}, 0xea; lop3.b32 $3, $8, 0x00c000c0, {_F16_PAIR:#x}, 0xea; "
    "shr.b32 h, $8, 8; "
    f"lop3.b32 $4, h, 0x00030003, {_F16_PAIR:#x}, 0xea; lop3.b32 $5, h, 0x000c000c, {_F16_PAIR:#x}, 0xea; "
    f"lop3.b32 $6, h, 0x00300030, {_F16_PAIR:#x}, 0xea; lop3.b32 $7, h, 0x00c000c0, {_F16_PAIR:#x}, 0xea; }}"
)
"""PTX, two int16 code words per 32-bit register: eight fp16 outputs, ``(x & mask_j) | 0x6400`` = ``1024 + 4**j c``
for the low byte's plane ``j`` (outputs 0-3) and, after one shift, the high byte's (outputs 4-7). Each LOP3 handles
two codes and the result is exact (integers below 2048 are exact in fp16)."""


@triton.jit
def word_planes_magic(x):
    """int16 code words -> eight fp16 tensors ``1024 + 4**j c`` (low byte planes j = 0..3, then high byte)."""
    return tl.inline_asm_elementwise(_WORD_PLANES, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x],
                                     dtype=(tl.float16,) * 8, is_pure=True, pack=2)


@triton.jit
def list_part(INDPTR, b, part, parts, BLOCK: tl.constexpr):
    """Where sequence ``b``'s list (INT2 slots or exact rows) starts, and the entries ``[lo, hi)`` that part ``part``
    of ``parts`` covers: ``ceil(L / parts)`` rounded up to whole ``BLOCK`` tiles each, the last part shorter or
    empty (an INT2 split, or an exact program's share)."""
    start = tl.load(INDPTR + b)
    length = tl.load(INDPTR + b + 1) - start
    chunk = tl.cdiv(tl.cdiv(length, parts), BLOCK) * BLOCK
    lo = part * chunk
    return start, lo, tl.minimum(lo + chunk, length)


@triton.jit
def finish_split(m_i, l_i):
    """Online-softmax state -> (1 / l, base-2 log-sum-exp); an empty split gives ``(0, -inf)``."""
    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return inv_l, lse


@triton.jit
def store_planes(o_rows, a0, a1, a2, a3, a4, a5, a6, a7, il, zt, mh, D4: tl.constexpr, R1: tl.constexpr,
                  R2: tl.constexpr, R3: tl.constexpr):
    """A row-scale split's partial output from its eight ``o'^T`` plane accumulators ``[d/8, H]`` (``o_rows``: the
    pointers of plane 0's elements ``2w``): plane ``j`` of the low / high byte holds elements ``2w + j d/4`` /
    ``2w + 1 + j d/4``, planes 1-3 scaled back by ``R1``-``R3``; each times ``il`` (1 / l) plus ``zt``
    (``sum(p*z) / l``), under the column mask ``mh``."""
    tl.store(o_rows + 0 * D4, a0 * il + zt, mask=mh)
    tl.store(o_rows + 1 * D4, a1 * (il * R1) + zt, mask=mh)
    tl.store(o_rows + 2 * D4, a2 * (il * R2) + zt, mask=mh)
    tl.store(o_rows + 3 * D4, a3 * (il * R3) + zt, mask=mh)
    tl.store(o_rows + 1 + 0 * D4, a4 * il + zt, mask=mh)
    tl.store(o_rows + 1 + 1 * D4, a5 * (il * R1) + zt, mask=mh)
    tl.store(o_rows + 1 + 2 * D4, a6 * (il * R2) + zt, mask=mh)
    tl.store(o_rows + 1 + 3 * D4, a7 * (il * R3) + zt, mask=mh)


@triton.jit
def _pad_k(x):
    """``[M, K] -> [M, 2K]``, each element followed by a zero: a dot product over the padded K of two operands padded
    alike equals the one over K."""
    return tl.reshape(tl.join(x, tl.zeros_like(x)), (x.shape[0], 2 * x.shape[1]))


@triton.jit
def dot_nt(a, b, PAD_K: tl.constexpr):
    """``a [M, K] . b [N, K]^T`` -> [M, N] fp32. ``tl.dot`` needs K >= 16; quarters of head dims under 64 are
    narrower (K = d/4 = 8 at d = 32, 4 at d = 16; test-size models). With ``PAD_K`` a K of 8 is zero-padded to 16
    (:func:`_pad_k`) and stays on the tensor cores; otherwise, and for K < 8, the product is a multiply-sum on the CUDA
    cores. The choice is per kernel because Triton 3.6 (the H200 image's) breaks on each of them in one place: the
    multiply-sum in the general decode kernel ("operand does not dominate this use" in its layout pass) and the padded
    dot in the extend kernel ("Illegal shared layout"); so decode pads and extend does not (the check:
    ``python -m oscar_kernels.compile_check`` with that Triton). Padding twice (K = 4) fails there too. On CUDA the
    padded decode path is not launched: compiled, it computed wrong attention at d = 32 on an H200, so ``decode_int2``
    refuses head dims under ``CUDA_MIN_HEAD_DIM`` there; the interpreter and the compile check still run it."""
    if a.shape[1] >= 16:
        out = tl.dot(a, tl.trans(b))
    elif PAD_K and a.shape[1] >= 8:
        out = tl.dot(_pad_k(a), tl.trans(_pad_k(b)))
    else:
        out = tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
    return out


@triton.jit
def softmax_step(s, m_i, l_i, acc0, acc1, acc2, acc3, v0, v1, v2, v3, PV_T: tl.constexpr):
    """One online-softmax step: scores ``s`` [M, N] (base 2, -inf = masked), value quarters ``v*`` [N, d/4] in the
    bit-plane order of the general path. Shared by the general path's exact split and every list of
    :mod:`oscar_kernels.extend`; a row whose scores are all -inf so far keeps ``l = 0``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pp = p.to(PV_T)
    acc0 = acc0 * alpha[:, None] + tl.dot(pp, v0.to(PV_T))
    acc1 = acc1 * alpha[:, None] + tl.dot(pp, v1.to(PV_T))
    acc2 = acc2 * alpha[:, None] + tl.dot(pp, v2.to(PV_T))
    acc3 = acc3 * alpha[:, None] + tl.dot(pp, v3.to(PV_T))
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit
def exact_tile(q0, q1, q2, q3, K, V, rows, mask_n, stride_ks, stride_kh, stride_vs, stride_vh, kvh, col0,
                BQ: tl.constexpr, QK_T: tl.constexpr, PAD_K: tl.constexpr):
    """Scores ``q' k'^T`` [M, N] and value quarters of one tile of exact (bf16 or fp32) rows ``rows`` [N] of ``K``/``V``
    (``[R, Hkv, d]``, contiguous last dim; masked rows read 0), for query quarters ``q0..q3`` [M, d/4]."""
    mn = mask_n[:, None]
    k_rows = K + rows[:, None] * stride_ks + kvh * stride_kh
    v_rows = V + rows[:, None] * stride_vs + kvh * stride_vh
    s = dot_nt(q0, tl.load(k_rows + (col0 + 0 * BQ)[None, :], mask=mn, other=0.0).to(QK_T), PAD_K)
    s += dot_nt(q1, tl.load(k_rows + (col0 + 1 * BQ)[None, :], mask=mn, other=0.0).to(QK_T), PAD_K)
    s += dot_nt(q2, tl.load(k_rows + (col0 + 2 * BQ)[None, :], mask=mn, other=0.0).to(QK_T), PAD_K)
    s += dot_nt(q3, tl.load(k_rows + (col0 + 3 * BQ)[None, :], mask=mn, other=0.0).to(QK_T), PAD_K)
    v0 = tl.load(v_rows + (col0 + 0 * BQ)[None, :], mask=mn, other=0.0)
    v1 = tl.load(v_rows + (col0 + 1 * BQ)[None, :], mask=mn, other=0.0)
    v2 = tl.load(v_rows + (col0 + 2 * BQ)[None, :], mask=mn, other=0.0)
    v3 = tl.load(v_rows + (col0 + 3 * BQ)[None, :], mask=mn, other=0.0)
    return s, v0, v1, v2, v3


def split_args(q_rot: torch.Tensor, cache, index, part_o: torch.Tensor, part_lse: torch.Tensor,
               num_exact: torch.Tensor, words: bool) -> tuple:
    """The pointer, count and stride arguments every decode split kernel takes, in order: the rotated queries, the
    layer's INT2 pools (code ``words``: int16 views, for the row-scale kernels; else the uint8 code bytes) with their
    FP8 multipliers (:attr:`~oscar_kernels.layout.LayerCache.mults`) and high code planes (4-bit pools) and exact
    rows (a :class:`~oscar_kernels.layout.LayerCache`), ``index``'s lists and counts (a
    :class:`~oscar_kernels.decode_grid.DecodeIndex`; ``num_exact`` in place of ``index.num_exact`` when that is
    None, never read then) and the partials."""
    k, v = cache.k, cache.v
    kc, vc = (k.words, v.words) if words else (k.codes, v.codes)
    mk, mv = cache.mults
    if words:  # a 2-bit pool's own words stand in for the high plane it does not have (never read)
        kh, vh = (p.words if p.codes_hi is None else p.words_hi for p in (k, v))
    else:
        kh, vh = cache.his
    return (q_rot,
            kc, k.scale, k.zero, vc, v.scale, v.zero, mk, mv, kh, vh,
            cache.k_bf16, cache.v_bf16,
            index.kv_indptr, index.kv_indices, index.bf16_indptr, index.bf16_indices,
            part_o, part_lse, index.num_splits, num_exact,
            index.parts, index.exact_splits,
            q_rot.stride(0), q_rot.stride(1),
            kc.stride(0), kc.stride(1), k.scale.stride(0), k.scale.stride(1), k.zero.stride(0), k.zero.stride(1),
            vc.stride(0), vc.stride(1), v.scale.stride(0), v.scale.stride(1), v.zero.stride(0), v.zero.stride(1),
            cache.k_bf16.stride(0), cache.k_bf16.stride(1), cache.v_bf16.stride(0), cache.v_bf16.stride(1),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1))
