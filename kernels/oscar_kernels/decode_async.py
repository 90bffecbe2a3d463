"""The row-scale decode split kernel with its INT2 tiles staged through shared memory by ``cp.async`` (Gluon).

Same grid, lists, partials and math as the Triton row-scale kernel of :mod:`oscar_kernels.decode_split`: program
``(b, kvh, split)`` runs INT2 split ``split < n`` or exact program ``split - n < e`` of sequence ``b`` (counts from
the plan, :func:`~oscar_kernels.decode_common.split_counts`), and writes one normalised partial and its base-2
log-sum-exp per query head of the GQA group.

What differs is where each tile's bytes wait. The Triton kernel loads a tile's key words into registers, stores
them to shared memory for the tensor-core operand layout, then does the same for the value words after the scores:
every tile waits twice on HBM (an ``ncu`` source profile on an H200 put ~30% of the warps' stall samples on those
two waits, at batch 1 and at batch 50). Here the key and value words of tile ``i + 1`` are copied global -> shared
with ``cp.async`` while tile ``i`` is computed (``STAGES`` stages of ``2 x BLOCK_N x d/8`` int16, ``STAGES - 1``
tiles in flight, no registers held), its scales and zeros are loaded into registers one tile ahead, and its slots
``STAGES`` tiles ahead. The tile's words reach the ``mma`` operand layout straight from shared memory (``ldmatrix``;
the value words through a transposed view). The scalar helpers (split counts, list parts, the split's finish) and
the unpack are the Triton kernel's own ``@triton.jit`` functions (:mod:`oscar_kernels.decode_common`).

Written in Gluon (``triton.experimental.gluon``, explicit layouts and shared memory), so it runs on CUDA only and
only for the shapes it was written for (``d = 128``, 128-token tiles, one warp) and with Triton 3.6's Gluon (the
H200 image's; later releases renamed its ``cp.async`` API); :func:`usable` says when, and
:func:`~oscar_kernels.decode.decode_int2` falls back to the Triton kernel otherwise (and under the interpreter,
which does not run Gluon).

The :class:`~oscar_kernels.scheme.DecodeOptions` are this kernel's (:func:`launch`). ``Q8`` (``int8_scores``, off
by default) takes the scores from int8 MMAs instead: each head's rotated query rounded to int8 (its own scale), the
key words' bytes read from the same ring as int8 operands and unpacked four codes per AND (``16 c``), k = 32 MMAs
(half as many), the int32 sums read as floats through a magic starting value. ``V8`` (``int8_values``) puts the
value products on int8 MMAs too (probabilities in int8 steps per tile).

Three more knobs, off by default (``benchmarks/sass_count.py`` counts what each saves): ``LEAN`` (``lean_tiles``)
does the tile's per-token bookkeeping on the slot vector's side (scales widened before their layout change, the
token mask folded into the key terms, 32-bit tile masks; same arithmetic); ``MOVM`` (``movmatrix``) moves the
probabilities into the value MMA's operand layout by ``movmatrix`` transposes (same results; the head tile padded to
8); ``FUSED`` (``fused_update``, with ``V8``) updates each value plane's accumulator with two fused multiply-adds.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .decode_common import (
    F16_MAGIC,
    finish_split,
    head_mults,
    list_part,
    split_args,
    split_counts,
    store_planes,
    word_planes_magic,
)
from .scheme import DecodeOptions

HEAD_DIM = gl.constexpr(128)
"""The head dim the kernel's layouts are written for."""
BLOCK_N = gl.constexpr(128)
"""INT2 tokens per tile (the MMA M of the key product and K of the value product)."""
BLOCK_NB = gl.constexpr(32)
"""Exact rows per tile of an exact program."""
P_MAGIC = gl.constexpr(1536.0)
"""``int8_values``: the fp16 the rounded probabilities are added onto. fp16 steps by 1 from 1024 to 2048 and 1536's
mantissa has a zero low byte, so ``P_MAGIC - 1/2 + y`` (``0 <= y < 128``: a probability in steps plus its row's
dither) rounds to ``1536 + floor(y)``, whose low byte is ``floor(y)``. With 1024 instead, ``y < 1/4`` would land
below 1024, where fp16 steps by 1/2, and its low byte would read -1."""
STAGES = 2
"""Shared-memory stages of the INT2 code words: the tile computed and ``STAGES - 1`` in flight (2 or 3; three
measured slower on an H200, ``bench_decode.py --variants --set async``)."""


def supported() -> bool:
    """Whether this Triton's Gluon has the API the kernel is written in (Triton 3.6's: later releases renamed the
    ``cp.async`` copy and the barrier)."""
    return hasattr(async_copy, "async_copy_global_to_shared") and hasattr(gl, "thread_barrier")


def usable(head_dim: int, block_n: int | None, block_nb: int | None, num_warps: int | None,
           num_stages: int | None = None) -> bool:
    """Whether the kernel covers a launch of these parameters (the caller checks CUDA and the other variants)."""
    return supported() and head_dim == HEAD_DIM.value and block_n in (None, BLOCK_N.value) \
        and block_nb in (None, BLOCK_NB.value) \
        and num_warps in (None, 1) and num_stages in (None, 2, 3)


_BYTE_PLANES_S8 = gl.constexpr(
    "{ .reg .b32 t; "
    "shl.b32 t, $4, 4; and.b32 $0, t, 0x30303030; shl.b32 t, $4, 2; and.b32 $1, t, 0x30303030; "
    "and.b32 $2, $4, 0x30303030; shr.b32 t, $4, 2; and.b32 $3, t, 0x30303030; }"
)
"""PTX, four code bytes per 32-bit register: four int8 outputs, plane ``j`` of each byte (its bits ``2j, 2j + 1``)
moved to bits 4-5, i.e. ``16 c``: three shifts and four ANDs per sixteen codes."""


_VALUE_PLANES_S8 = gl.constexpr(
    "{ .reg .b32 l, h; "
    "prmt.b32 l, $8, $9, 0x6420; prmt.b32 h, $8, $9, 0x7531; "
    "and.b32 $0, l, 0x03030303; and.b32 $1, l, 0x0c0c0c0c; shr.b32 l, l, 4; "
    "and.b32 $2, l, 0x03030303; and.b32 $3, l, 0x0c0c0c0c; "
    "and.b32 $4, h, 0x03030303; and.b32 $5, h, 0x0c0c0c0c; shr.b32 h, h, 4; "
    "and.b32 $6, h, 0x03030303; and.b32 $7, h, 0x0c0c0c0c; }"
)
"""PTX, four value code words (int16: tokens 2t, 2t + 1 in one register, 2t + 8, 2t + 9 in the next, one word
column) -> their low bytes and their high bytes gathered into one register each (two PRMTs), then eight int8
outputs, four per byte, each plane ``j`` where ``x & 0x03`` / ``x & 0x0c`` of the byte or of it shifted by 4
finds it (``c``, ``4 c``, ``c``, ``4 c`` for planes 0-3): two PRMTs, two shifts and eight ANDs per 32 codes."""
_LOW_BYTES = gl.constexpr("prmt.b32 $0, $1, $2, 0x6420;")
"""PTX: the low bytes of four half-words (two registers) into one register."""


@gluon.jit
def _value_planes_s8(x):
    """int16 value words in the ``VX`` layout -> eight int8 tensors (same layout, element for element): the low
    byte's planes 0-3 as ``c, 4c, c, 4c``, then the high byte's."""
    return gl.inline_asm_elementwise(_VALUE_PLANES_S8, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [x], dtype=(gl.int8,) * 8,
                                     is_pure=True, pack=4)


@gluon.jit
def _low_bytes(x):
    """fp16 ``1536 + n`` (``0 <= n < 128``; any fp16 whose mantissa's low byte is ``n``) -> int8 ``n`` (bits), four
    elements per PRMT."""
    return gl.inline_asm_elementwise(_LOW_BYTES, "=r,r,r", [x], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _by_quads(x, dim: gl.constexpr):
    """Relabel the token axis ``dim`` (of 16-token blocks) of an MMA operand: token ``16 h + 8 c + 2 t + b`` ->
    ``16 h + 4 t + 2 c + b``. A thread of the fp16 operand layouts holds tokens ``2t, 2t + 1, 2t + 8, 2t + 9`` of
    each block; relabelled, those are ``4t .. 4t + 3``, which is what a thread of the 8-bit operand layouts holds. So
    a 16-bit-layout tensor's int8 values, relabelled, are the 8-bit operand as is (no data moves); the product over
    tokens is the same when both operands are relabelled alike."""
    if dim == 1:
        R: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[1]
        return gl.reshape(gl.permute(gl.reshape(x, [R, N // 16, 2, 4, 2]), (0, 1, 3, 2, 4)), [R, N])
    else:
        N: gl.constexpr = x.shape[0]
        C: gl.constexpr = x.shape[1]
        return gl.reshape(gl.permute(gl.reshape(x, [N // 16, 2, 4, 2, C]), (0, 2, 1, 3, 4)), [N, C])


@gluon.jit
def _plane_int8(acc, al, codes, pb8, start, scale, magic_scale, A_OP8: gl.constexpr, FUSED: gl.constexpr):
    """One value plane's accumulator after a tile of int8 values: ``acc * al`` plus the plane's int8 product (its
    codes relabelled into the 8-bit operand, the int32 sums from the magic ``start``) times each head's ``scale``.
    The magic is taken off exactly before the scaling (a subtract, a multiply and a fused multiply-add per element),
    or with ``FUSED`` inside two fused multiply-adds, ``bits * scale + (acc * al - magic * scale)``
    (``magic_scale``): the rescaled sum is rounded once at the magic's magnitude, ~1 int8 probability step times one
    code unit per tile, a fraction of the dithered rounding's own noise."""
    a8 = gl.convert_layout(_by_quads(codes, 1), A_OP8, assert_trivial=True)
    bits = mma_v2(a8, pb8, start).to(gl.float32, bitcast=True)
    if FUSED:
        return bits * scale + (acc * al - magic_scale)
    return acc * al + (bits - 12582912.0) * scale


_TRANSPOSE8 = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")


@gluon.jit
def _to_b_operand(x, B_OP: gl.constexpr):
    """fp16 ``[BN, H]`` (``H`` a multiple of 8) in the MMA accumulator layout -> the same values in the B-operand
    layout ``B_OP``, by one
    ``movmatrix`` (8x8 transpose across the warp) per register: a lane's register holds row ``t/4``, columns
    ``2(t%4), +1`` of an 8-row block before, and rows ``2(t%4), +1``, column ``t/4`` after, which is the B operand's
    arrangement. The tensor keeps its layout, so its elements are relabelled by a reshape and permute (no data
    moves; ``assert_trivial`` proves it)."""
    t = gl.inline_asm_elementwise(_TRANSPOSE8, "=r,r", [x], dtype=gl.float16, is_pure=True, pack=2)
    N: gl.constexpr = x.shape[0]
    H: gl.constexpr = x.shape[1]
    # element (8g + r, 8h + c) now holds x[8g + c, 8h + r]: swap r and c within each 8x8 block
    t = gl.reshape(gl.permute(gl.reshape(t, [N // 8, 8, H // 8, 8]), (0, 3, 2, 1)), [N, H])
    return gl.convert_layout(t, B_OP, assert_trivial=True)


@gluon.jit
def _byte_planes_s8(x):
    """int8 code bytes -> four int8 tensors ``16 c`` (planes j = 0..3 of each byte)."""
    return gl.inline_asm_elementwise(_BYTE_PLANES_S8, "=r,=r,=r,=r,r", [x], dtype=(gl.int8,) * 4, is_pure=True,
                                     pack=4)


@gluon.jit
def _round_s8(x):
    """fp32 within [-127.5, 127.5] -> int8, rounded half away from zero."""
    return (x + gl.where(x >= 0.0, 0.5, -0.5)).to(gl.int32).to(gl.int8)


@gluon.jit
def _row_f32(x, ROW: gl.constexpr, WIDE_FIRST: gl.constexpr):
    """A tile's per-token fp16 vector -> fp32 ``[BN, 1]`` in the MMA rows' layout; ``WIDE_FIRST`` converts before
    the layout change (each lane converts its own 4 tokens, not the 16 rows it receives)."""
    if WIDE_FIRST:
        return gl.expand_dims(gl.convert_layout(x.to(gl.float32), ROW), 1)
    return gl.expand_dims(gl.convert_layout(x, ROW).to(gl.float32), 1)


@gluon.jit
def _key_terms(ks, kz, live, Q8: gl.constexpr, ROW: gl.constexpr):
    """A tile's key scale and zero and each token's additive score term, fp32 ``[BN, 1]`` in the MMA rows' layout,
    computed on the slot vector's side (4 tokens a lane, not the 16 rows each lane receives) with the token mask
    folded in: tokens outside ``live`` get scale and zero 0 (their slot-0 bits may be anything) and the term
    ``-inf``, so no compare per row or select per score element; live tokens get ``-magic * scale`` with int8 scores
    (the int32 sums' magic start taken off) and 0 otherwise."""
    ksv = gl.where(live, ks.to(gl.float32), 0.0)
    kzv = gl.where(live, kz.to(gl.float32), 0.0)
    if Q8:
        tail = gl.where(live, ksv * -12582912.0, float("-inf"))
    else:
        tail = gl.where(live, 0.0, float("-inf"))
    return (gl.expand_dims(gl.convert_layout(ksv, ROW), 1), gl.expand_dims(gl.convert_layout(kzv, ROW), 1),
            gl.expand_dims(gl.convert_layout(tail, ROW), 1))


@gluon.jit
def _issue_tile(K_WORDS, V_WORDS, K_HI, V_HI, k_dst, v_dst, kh_dst, vh_dst, slot, valid, kvh, offs_w, stride_kws,
                stride_kwh, stride_vws, stride_vwh, ROWS: gl.constexpr, OFF64: gl.constexpr, BITS_K: gl.constexpr,
                BITS_V: gl.constexpr):
    """``cp.async`` of one tile's key and value code words (rows ``slot``) into one stage, as one commit group, with
    the high planes' words of 4-bit keys or values (``BITS_K``, ``BITS_V``: the low plane's strides, their own
    rings ``kh_dst``, ``vh_dst``); tokens outside ``valid`` are zero-filled without a read (a split's last "next"
    tile costs no memory trip)."""
    s = gl.convert_layout(slot, gl.SliceLayout(1, ROWS))
    if OFF64:
        s = s.to(gl.int64)
    s2 = gl.expand_dims(s, 1)
    w2 = gl.expand_dims(offs_w, 0)
    m = gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, ROWS)), 1)
    async_copy.async_copy_global_to_shared(k_dst, K_WORDS + s2 * stride_kws + kvh * stride_kwh + w2, mask=m)
    async_copy.async_copy_global_to_shared(v_dst, V_WORDS + s2 * stride_vws + kvh * stride_vwh + w2, mask=m)
    if BITS_K == 4:
        async_copy.async_copy_global_to_shared(kh_dst, K_HI + s2 * stride_kws + kvh * stride_kwh + w2, mask=m)
    if BITS_V == 4:
        async_copy.async_copy_global_to_shared(vh_dst, V_HI + s2 * stride_vws + kvh * stride_vwh + w2, mask=m)
    async_copy.commit_group()


@gluon.jit
def _tile_scales(K_SCALE, K_ZERO, V_SCALE, V_ZERO, slot, valid, kvh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
                 stride_vss, stride_vsh, stride_vzs, stride_vzh, mk, mv, OFF64: gl.constexpr,
                 META_FP8: gl.constexpr):
    """One tile's key/value scales and zeros (fp16, the slot vector's layout). Tokens outside ``valid`` read slot 0
    (any bits: their score is -inf) and get value scale and zero 0 (their ``p*s`` and ``p*z`` must be 0). FP8
    metadata is read as e4m3 times the head's multiplier ``mk`` / ``mv`` and handed on as fp16, exactly (see
    :mod:`oscar_kernels.layout`), so the rest of the kernel is the same for both."""
    if OFF64:
        slot = slot.to(gl.int64)
    ks = gl.load(K_SCALE + slot * stride_kss + kvh * stride_ksh)
    kz = gl.load(K_ZERO + slot * stride_kzs + kvh * stride_kzh)
    vs = gl.load(V_SCALE + slot * stride_vss + kvh * stride_vsh, mask=valid, other=0.0)
    vz = gl.load(V_ZERO + slot * stride_vzs + kvh * stride_vzh, mask=valid, other=0.0)
    if META_FP8:
        ks = (ks.to(gl.float32) * mk).to(gl.float16)
        kz = (kz.to(gl.float32) * mk).to(gl.float16)
        vs = (vs.to(gl.float32) * mv).to(gl.float16)
        vz = (vz.to(gl.float32) * mv).to(gl.float16)
    return ks, kz, vs, vz


@gluon.jit
def _decode_rows_async_kernel(
    QN,
    K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO, MULT_K, MULT_V, K_HI, V_HI,  # high planes: read if 4-bit
    K_BF16, V_BF16,
    KV_INDPTR, KV_INDICES, BF16_INDPTR, BF16_INDICES,
    PART_O, PART_LSE, NUM_SPLITS, NUM_EXACT,
    parts, exact_splits,
    stride_qnb, stride_qnh,
    stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
    stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    GQA: gl.constexpr, BLOCK_H: gl.constexpr, OFF64: gl.constexpr, PER_SEQ_EXACT: gl.constexpr,
    STAGES: gl.constexpr, Q8: gl.constexpr, V8: gl.constexpr, LEAN: gl.constexpr, FUSED: gl.constexpr,
    MOVM: gl.constexpr, META_FP8: gl.constexpr, BITS_K: gl.constexpr, BITS_V: gl.constexpr,
):
    D: gl.constexpr = HEAD_DIM
    W: gl.constexpr = D // 8
    D4: gl.constexpr = D // 4
    BN: gl.constexpr = BLOCK_N
    NB: gl.constexpr = BLOCK_NB
    OFF: gl.constexpr = F16_MAGIC  # codes arrive as 1024 + 4**j c: query planes 1-3 divided by 4**j, as R1-R3
    R1: gl.constexpr = 0.25
    R2: gl.constexpr = 0.0625
    R3: gl.constexpr = 0.015625
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    ROWS: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0])  # 16 bytes of a row per lane
    VEC: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    EXACT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    RING: gl.constexpr = gl.SwizzledSharedLayout(8, 4, 2, [1, 0])
    TILE: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    RING8: gl.constexpr = gl.SwizzledSharedLayout(16, 4, 2, [1, 0])  # RING's bytes seen as int8 rows of 2 W
    A_OP8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B_OP8: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    MAGIC_I: gl.constexpr = 0x4B400000  # int32 bits of 12582912.0: + n (|n| < 2**22) reads as 12582912 + n
    MAGIC_F: gl.constexpr = 12582912.0
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    # A_OP's elements of a [d/8, BN] value tile with the registers ordered so that each pair holds tokens 2t, 2t+1
    # (one register) and 2t+8, 2t+9 (the next) of one word column, as _value_planes_s8 takes them
    VX: gl.constexpr = gl.DistributedLinearLayout([[0, 1], [0, 8], [8, 0], [0, 16], [0, 32], [0, 64]],
                                                  [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [], [], [W, BN])
    VR1: gl.constexpr = 0.25 if V8 else R1  # the value planes' scales at the store (int8 planes: c, 4c, c, 4c)
    VR2: gl.constexpr = 1.0 if V8 else R2
    VR3: gl.constexpr = 0.25 if V8 else R3

    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    num_splits, num_exact = split_counts(NUM_SPLITS, NUM_EXACT, b, parts, exact_splits, PER_SEQ_EXACT)
    offs_h = gl.arange(0, BLOCK_H, layout=COL)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    if split < num_splits:
        # ---------------- INT2 split ----------------
        kv_start, lo, hi = list_part(KV_INDPTR, b, split, num_splits, BN)
        offs_t = gl.arange(0, BN, layout=VEC)
        offs_w = gl.arange(0, W, layout=gl.SliceLayout(0, ROWS))
        k_ring = gl.allocate_shared_memory(gl.int16, [STAGES, BN, W], RING)
        v_ring = gl.allocate_shared_memory(gl.int16, [STAGES, BN, W], RING)
        # 4-bit keys or values: the high plane's words in a ring of their own, copied in the same commit group
        if BITS_K == 4:
            kh_ring = gl.allocate_shared_memory(gl.int16, [STAGES, BN, W], RING)
        else:
            kh_ring = k_ring  # never read
        if BITS_V == 4:
            vh_ring = gl.allocate_shared_memory(gl.int16, [STAGES, BN, W], RING)
        else:
            vh_ring = v_ring
        # the first STAGES - 1 tiles in flight before the query planes are read; slots run STAGES tiles ahead of
        # the tile computed, scales one
        valid = lo + offs_t < hi
        slot = gl.load(KV_INDICES + kv_start + lo + offs_t, mask=valid, other=0)
        mk, mv = head_mults(MULT_K, MULT_V, kvh, META_FP8)
        _issue_tile(K_WORDS, V_WORDS, K_HI, V_HI, k_ring.index(0), v_ring.index(0), kh_ring.index(0),
                    vh_ring.index(0), slot, valid, kvh, offs_w, stride_kws, stride_kwh, stride_vws, stride_vwh, ROWS,
                    OFF64, BITS_K, BITS_V)
        ks_n, kz_n, vs_n, vz_n = _tile_scales(K_SCALE, K_ZERO, V_SCALE, V_ZERO, slot, valid, kvh, stride_kss,
                                              stride_ksh, stride_kzs, stride_kzh, stride_vss, stride_vsh, stride_vzs,
                                              stride_vzh, mk, mv, OFF64, META_FP8)
        pos1 = lo + BN + offs_t
        slot1 = gl.load(KV_INDICES + kv_start + pos1, mask=pos1 < hi, other=0)  # tile 1
        slot2 = slot1
        if STAGES == 3:
            _issue_tile(K_WORDS, V_WORDS, K_HI, V_HI, k_ring.index(1), v_ring.index(1), kh_ring.index(1),
                        vh_ring.index(1), slot1, pos1 < hi, kvh, offs_w, stride_kws, stride_kwh, stride_vws,
                        stride_vwh, ROWS, OFF64, BITS_K, BITS_V)
            pos2 = lo + 2 * BN + offs_t
            slot2 = gl.load(KV_INDICES + kv_start + pos2, mask=pos2 < hi, other=0)  # tile 2

        # query planes [d/8, H] (plane j of word w's low byte: element 2w + j d/4, high byte: 2w + 1 + j d/4),
        # planes 1-3 of each byte pre-divided by 4**j; sum(q') and the offset the magic codes add to each score
        offs_qw = gl.arange(0, W, layout=gl.SliceLayout(1, B_OP))
        offs_qh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, B_OP))
        qw = QN + b * stride_qnb + gl.expand_dims((kvh * GQA + offs_qh) * stride_qnh, 0) \
            + 2 * gl.expand_dims(offs_qw, 1)
        mq = gl.expand_dims(offs_qh < GQA, 0)
        q0 = gl.load(qw + 0 * D4, mask=mq, other=0.0).to(gl.float16)
        q1 = (gl.load(qw + 1 * D4, mask=mq, other=0.0) * R1).to(gl.float16)
        q2 = (gl.load(qw + 2 * D4, mask=mq, other=0.0) * R2).to(gl.float16)
        q3 = (gl.load(qw + 3 * D4, mask=mq, other=0.0) * R3).to(gl.float16)
        q4 = gl.load(qw + 1 + 0 * D4, mask=mq, other=0.0).to(gl.float16)
        q5 = (gl.load(qw + 1 + 1 * D4, mask=mq, other=0.0) * R1).to(gl.float16)
        q6 = (gl.load(qw + 1 + 2 * D4, mask=mq, other=0.0) * R2).to(gl.float16)
        q7 = (gl.load(qw + 1 + 3 * D4, mask=mq, other=0.0) * R3).to(gl.float16)
        qsum = (q0.to(gl.float32) + q1.to(gl.float32) + q2.to(gl.float32) + q3.to(gl.float32)
                + q4.to(gl.float32) + q5.to(gl.float32) + q6.to(gl.float32) + q7.to(gl.float32))
        qoff = gl.convert_layout(gl.sum(qsum, 0), COL) * OFF
        offs_d = gl.arange(0, D, layout=ROW)
        q_rows = QN + b * stride_qnb + gl.expand_dims(heads * stride_qnh, 0)
        qa = gl.load(q_rows + gl.expand_dims(offs_d, 1), mask=gl.expand_dims(mask_h, 0), other=0.0)  # [D, H]
        qtot = gl.sum(qa, 0)
        s_init = gl.zeros([BN, BLOCK_H], gl.float32, MMA) - gl.expand_dims(qoff, 0)
        kz_q = gl.expand_dims(qtot, 0)
        if Q8:
            # int8 scores: each head's q' quantized with its own scale (max |q'| / 127) into four int8 planes
            # [d/4, H] (plane j: elements j d/4 + byte, the bytes of a row of codes in order); a plane's codes arrive
            # as 16 c, so q'.c = g n with g = scale / 16 and n = q8 . 16c, summed exactly in int32 and read through
            # the magic float's bits. Scores are kept in units of g per head (inner = s / g: two fused multiply-adds
            # per element) and scaled back where the softmax subtracts the running max
            amax = gl.max(gl.abs(qa), 0)
            amax = gl.where(amax > 0.0, amax, 1.0)
            gq = amax / (127.0 * 16.0)
            inv = gl.expand_dims(gl.convert_layout(127.0 / amax, gl.SliceLayout(0, B_OP8)), 0)
            offs_bk = gl.arange(0, 2 * W, layout=gl.SliceLayout(1, B_OP8))
            offs_bh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, B_OP8))
            qb = QN + b * stride_qnb + gl.expand_dims((kvh * GQA + offs_bh) * stride_qnh, 0) \
                + gl.expand_dims(offs_bk, 1)
            mb = gl.expand_dims(offs_bh < GQA, 0)
            p8_0 = _round_s8(gl.load(qb + 0 * D4, mask=mb, other=0.0) * inv)
            p8_1 = _round_s8(gl.load(qb + 1 * D4, mask=mb, other=0.0) * inv)
            p8_2 = _round_s8(gl.load(qb + 2 * D4, mask=mb, other=0.0) * inv)
            p8_3 = _round_s8(gl.load(qb + 3 * D4, mask=mb, other=0.0) * inv)
            kz_g = gl.expand_dims(qtot / gq, 0)  # a token's zero term in units of g
            g2 = gl.expand_dims(gq, 0)
            i_init = gl.full([BN, BLOCK_H], MAGIC_I, gl.int32, MMA)

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, COL)
        l_i = gl.zeros([BLOCK_H], gl.float32, COL)
        pz = gl.zeros([BLOCK_H], gl.float32, COL)
        a0 = gl.zeros([W, BLOCK_H], gl.float32, MMA)
        a1 = gl.zeros([W, BLOCK_H], gl.float32, MMA)
        a2 = gl.zeros([W, BLOCK_H], gl.float32, MMA)
        a3 = gl.zeros([W, BLOCK_H], gl.float32, MMA)
        a4 = gl.zeros([W, BLOCK_H], gl.float32, MMA)
        a5 = gl.zeros([W, BLOCK_H], gl.float32, MMA)
        a6 = gl.zeros([W, BLOCK_H], gl.float32, MMA)
        a7 = gl.zeros([W, BLOCK_H], gl.float32, MMA)
        offs_r = gl.arange(0, BN, layout=ROW)
        if V8:  # each row's rounding offset: fp16 P_MAGIC - 1/2 plus the row's dither (bit-reversed row + 1/2) / 128
            r = offs_r
            rv = ((r & 1) << 6) | ((r & 2) << 4) | ((r & 4) << 2) | (r & 8) | ((r >> 2) & 4) | ((r >> 4) & 2) \
                | ((r >> 6) & 1)
            p_add = gl.expand_dims((P_MAGIC - 0.5) + (rv.to(gl.float32) + 0.5) * (1.0 / 128.0), 1)
        stage = 0
        for start in range(lo, hi, BN):
            ks, kz, vs, vz = ks_n, kz_n, vs_n, vz_n
            # the stage the tile STAGES - 1 ahead lands in was read by the iteration before: every lane is past it
            gl.thread_barrier()
            into = (stage + STAGES - 1) % STAGES
            if LEAN:  # token masks as the tile offsets against the tokens left: 32-bit compares (LLVM widens the
                left = hi - start  # loop counter to 64 bits for the addresses, and `start + offs < hi` with it)
                live = offs_t < left
                _issue_tile(K_WORDS, V_WORDS, K_HI, V_HI, k_ring.index(into), v_ring.index(into),
                            kh_ring.index(into), vh_ring.index(into), slot2, offs_t < left - (STAGES - 1) * BN, kvh,
                            offs_w, stride_kws, stride_kwh, stride_vws, stride_vwh, ROWS, OFF64, BITS_K, BITS_V)
                ks_n, kz_n, vs_n, vz_n = _tile_scales(K_SCALE, K_ZERO, V_SCALE, V_ZERO, slot1, offs_t < left - BN,
                                                      kvh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
                                                      stride_vss, stride_vsh, stride_vzs, stride_vzh, mk, mv, OFF64, META_FP8)
                far = start + STAGES * BN + offs_t
                slot_far = gl.load(KV_INDICES + kv_start + far, mask=offs_t < left - STAGES * BN, other=0)
            else:  # statement for statement as before LEAN: sharing the calls above moves LLVM's schedule of the
                # default kernel (its sm_90 SASS changes); merge the branches once LEAN is measured and settled
                ahead = start + (STAGES - 1) * BN + offs_t
                _issue_tile(K_WORDS, V_WORDS, K_HI, V_HI, k_ring.index(into), v_ring.index(into),
                            kh_ring.index(into), vh_ring.index(into), slot2, ahead < hi, kvh, offs_w, stride_kws,
                            stride_kwh, stride_vws, stride_vwh, ROWS, OFF64, BITS_K, BITS_V)
                nxt = start + BN + offs_t
                ks_n, kz_n, vs_n, vz_n = _tile_scales(K_SCALE, K_ZERO, V_SCALE, V_ZERO, slot1, nxt < hi, kvh,
                                                      stride_kss, stride_ksh, stride_kzs, stride_kzh, stride_vss,
                                                      stride_vsh, stride_vzs, stride_vzh, mk, mv, OFF64, META_FP8)
                far = start + STAGES * BN + offs_t
                slot_far = gl.load(KV_INDICES + kv_start + far, mask=far < hi, other=0)
            if STAGES == 3:
                slot1 = slot2
                slot2 = slot_far
            else:
                slot1 = slot_far
                slot2 = slot_far
            async_copy.wait_group(STAGES - 1)  # this tile's group has landed (the later ones may be in flight)
            gl.thread_barrier()
            # ---- scores: s = s_k (q'.c) + z_k sum(q'), online softmax over the tile
            if LEAN:
                ksf, kzf, tail = _key_terms(ks, kz, live, Q8, ROW)
            elif Q8:
                ksf = gl.expand_dims(gl.convert_layout(ks, ROW).to(gl.float32), 1)
                kzf = gl.expand_dims(gl.convert_layout(kz, ROW).to(gl.float32), 1)
            if Q8:
                c0, c1, c2, c3 = _byte_planes_s8(k_ring.index(stage)._reinterpret(gl.int8, [BN, 2 * W], RING8)
                                                 .load(A_OP8))
                qi = mma_v2(c0, p8_0, i_init)
                qi = mma_v2(c1, p8_1, qi)
                qi = mma_v2(c2, p8_2, qi)
                qi = mma_v2(c3, p8_3, qi)
                if LEAN:
                    s = qi.to(gl.float32, bitcast=True) * ksf + (kzf * kz_g + tail)  # s / g
                else:
                    s = qi.to(gl.float32, bitcast=True) * ksf + (kzf * kz_g - MAGIC_F * ksf)  # s / g
            else:
                k0, k1, k2, k3, k4, k5, k6, k7 = word_planes_magic(k_ring.index(stage).load(A_OP))
                qc = mma_v2(k0, q0, s_init)
                qc = mma_v2(k1, q1, qc)
                qc = mma_v2(k2, q2, qc)
                qc = mma_v2(k3, q3, qc)
                qc = mma_v2(k4, q4, qc)
                qc = mma_v2(k5, q5, qc)
                qc = mma_v2(k6, q6, qc)
                qc = mma_v2(k7, q7, qc)
                if BITS_K == 4:  # c = lo + 4 hi: the high plane's dots from their own magic start, times 4
                    h0, h1, h2, h3, h4, h5, h6, h7 = word_planes_magic(kh_ring.index(stage).load(A_OP))
                    qh = mma_v2(h0, q0, s_init)
                    qh = mma_v2(h1, q1, qh)
                    qh = mma_v2(h2, q2, qh)
                    qh = mma_v2(h3, q3, qh)
                    qh = mma_v2(h4, q4, qh)
                    qh = mma_v2(h5, q5, qh)
                    qh = mma_v2(h6, q6, qh)
                    qh = mma_v2(h7, q7, qh)
                    qc = qc + 4.0 * qh
                if LEAN:
                    s = qc * ksf + (kzf * kz_q + tail)
                else:
                    ksf = gl.expand_dims(gl.convert_layout(ks, ROW).to(gl.float32), 1)
                    kzf = gl.expand_dims(gl.convert_layout(kz, ROW).to(gl.float32), 1)
                    s = qc * ksf + kzf * kz_q
            if not LEAN:
                s = gl.where(gl.expand_dims(start + offs_r < hi, 1), s, float("-inf"))
            if V8:
                # int8 values: probabilities relative to each head's tile maximum (p / max_t p = 2**(s - max s)),
                # times the token's value scale over the tile's largest, in int8 steps of 1/127 rounded down after
                # adding the row's dither (one fused multiply-add onto fp16's 1536 - 1/2 + dither, whose low byte
                # is then the integer: no bias from the many small probabilities); the value planes' int8 codes
                # (c or 4c) against them in k = 32 MMAs summed exactly in int32 from the magic start, scaled back
                # per head by 2**(max s - m) * max_t vs / 127 into the fp32 plane accumulators
                if Q8:
                    tm = gl.max(s, 0) * gq
                    p = gl.exp2(s * g2 - gl.expand_dims(tm, 0))
                else:
                    tm = gl.max(s, 0)
                    p = gl.exp2(s - gl.expand_dims(tm, 0))
                m_new = gl.maximum(m_i, tm)
                e = gl.exp2(tm - m_new)
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + e * gl.sum(p, 0)
                m_i = m_new
                vsv = vs.to(gl.float32)
                vmax = gl.max(vsv, 0)
                vinv = gl.where(vmax > 0.0, 127.0 / vmax, 0.0)
                vsc = gl.expand_dims(gl.convert_layout(vsv * vinv, ROW), 1)
                vzf = _row_f32(vz, ROW, LEAN)
                pz = pz * alpha + e * gl.sum(p * vzf, 0)
                if MOVM:
                    p16 = _to_b_operand((p * vsc + p_add).to(gl.float16), B_OP)
                else:
                    p16 = gl.convert_layout((p * vsc + p_add).to(gl.float16), B_OP)
                pb8 = gl.convert_layout(_by_quads(_low_bytes(p16), 0), B_OP8, assert_trivial=True)
                scb = gl.expand_dims(e * (vmax / 127.0), 0)
                scm = scb * MAGIC_F
                al = gl.expand_dims(alpha, 0)
                u0, u1, u2, u3, u4, u5, u6, u7 = _value_planes_s8(
                    gl.convert_layout(v_ring.index(stage).permute((1, 0)).load(A_OP), VX, assert_trivial=True))
                vi = gl.full([W, BLOCK_H], MAGIC_I, gl.int32, MMA)
                a0 = _plane_int8(a0, al, u0, pb8, vi, scb, scm, A_OP8, FUSED)
                a1 = _plane_int8(a1, al, u1, pb8, vi, scb, scm, A_OP8, FUSED)
                a2 = _plane_int8(a2, al, u2, pb8, vi, scb, scm, A_OP8, FUSED)
                a3 = _plane_int8(a3, al, u3, pb8, vi, scb, scm, A_OP8, FUSED)
                a4 = _plane_int8(a4, al, u4, pb8, vi, scb, scm, A_OP8, FUSED)
                a5 = _plane_int8(a5, al, u5, pb8, vi, scb, scm, A_OP8, FUSED)
                a6 = _plane_int8(a6, al, u6, pb8, vi, scb, scm, A_OP8, FUSED)
                a7 = _plane_int8(a7, al, u7, pb8, vi, scb, scm, A_OP8, FUSED)
            else:
                if Q8:
                    m_new = gl.maximum(m_i, gl.max(s, 0) * gq)
                    p = gl.exp2(s * g2 - gl.expand_dims(m_new, 0))
                else:
                    m_new = gl.maximum(m_i, gl.max(s, 0))
                    p = gl.exp2(s - gl.expand_dims(m_new, 0))
                alpha = gl.exp2(m_i - m_new)
                l_i = l_i * alpha + gl.sum(p, 0)
                m_i = m_new
                # ---- values: sum_t (p_t s_t) c_t into the plane accumulators, sum_t p_t z_t into pz
                vsf = _row_f32(vs, ROW, LEAN)
                vzf = _row_f32(vz, ROW, LEAN)
                ps = (p * vsf).to(gl.float16)
                pz = pz * alpha + gl.sum(p * vzf, 0)
                off_t = gl.expand_dims(OFF * gl.sum(ps.to(gl.float32), 0), 0)
                if MOVM:
                    pb = _to_b_operand(ps, B_OP)
                else:
                    pb = gl.convert_layout(ps, B_OP)
                al = gl.expand_dims(alpha, 0)
                v0, v1, v2, v3, v4, v5, v6, v7 = word_planes_magic(v_ring.index(stage).permute((1, 0)).load(A_OP))
                zero = gl.zeros([W, BLOCK_H], gl.float32, MMA)
                if BITS_V == 4:  # c = lo + 4 hi: the high plane's products (less their own magic offset) times 4
                    w0, w1, w2, w3, w4, w5, w6, w7 = word_planes_magic(
                        vh_ring.index(stage).permute((1, 0)).load(A_OP))
                    a0 = a0 * al + ((mma_v2(v0, pb, zero) - off_t) + 4.0 * (mma_v2(w0, pb, zero) - off_t))
                    a1 = a1 * al + ((mma_v2(v1, pb, zero) - off_t) + 4.0 * (mma_v2(w1, pb, zero) - off_t))
                    a2 = a2 * al + ((mma_v2(v2, pb, zero) - off_t) + 4.0 * (mma_v2(w2, pb, zero) - off_t))
                    a3 = a3 * al + ((mma_v2(v3, pb, zero) - off_t) + 4.0 * (mma_v2(w3, pb, zero) - off_t))
                    a4 = a4 * al + ((mma_v2(v4, pb, zero) - off_t) + 4.0 * (mma_v2(w4, pb, zero) - off_t))
                    a5 = a5 * al + ((mma_v2(v5, pb, zero) - off_t) + 4.0 * (mma_v2(w5, pb, zero) - off_t))
                    a6 = a6 * al + ((mma_v2(v6, pb, zero) - off_t) + 4.0 * (mma_v2(w6, pb, zero) - off_t))
                    a7 = a7 * al + ((mma_v2(v7, pb, zero) - off_t) + 4.0 * (mma_v2(w7, pb, zero) - off_t))
                else:
                    a0 = a0 * al + (mma_v2(v0, pb, zero) - off_t)
                    a1 = a1 * al + (mma_v2(v1, pb, zero) - off_t)
                    a2 = a2 * al + (mma_v2(v2, pb, zero) - off_t)
                    a3 = a3 * al + (mma_v2(v3, pb, zero) - off_t)
                    a4 = a4 * al + (mma_v2(v4, pb, zero) - off_t)
                    a5 = a5 * al + (mma_v2(v5, pb, zero) - off_t)
                    a6 = a6 * al + (mma_v2(v6, pb, zero) - off_t)
                    a7 = a7 * al + (mma_v2(v7, pb, zero) - off_t)
            stage = (stage + 1) % STAGES
        async_copy.wait_group(0)  # nothing left in flight when the program ends
        inv_l, lse = finish_split(m_i, l_i)
        il = gl.expand_dims(inv_l, 0)
        zt = gl.expand_dims(pz * inv_l, 0)
        offs_ow = gl.arange(0, W, layout=ROW)
        o_rows = PART_O + b * stride_pob + gl.expand_dims(heads * stride_poh, 0) + split * stride_pos \
            + 2 * gl.expand_dims(offs_ow, 1)
        mh = gl.expand_dims(mask_h, 0)
        store_planes(o_rows, a0, a1, a2, a3, a4, a5, a6, a7, il, zt, mh, D4, VR1, VR2, VR3)
        gl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)
    elif split < num_splits + num_exact:
        # ---------------- exact (BF16) program: rows x heads, natural element order ----------------
        bf_start, bf_lo, bf_hi = list_part(BF16_INDPTR, b, split - num_splits, num_exact, NB)
        k_tile = gl.allocate_shared_memory(gl.float16, [NB, D], TILE)
        v_tile = gl.allocate_shared_memory(gl.bfloat16, [NB, D], TILE)
        offs_qd = gl.arange(0, D, layout=gl.SliceLayout(1, B_OP))
        offs_qh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, B_OP))
        qn = gl.load(QN + b * stride_qnb + gl.expand_dims((kvh * GQA + offs_qh) * stride_qnh, 0)
                     + gl.expand_dims(offs_qd, 1), mask=gl.expand_dims(offs_qh < GQA, 0), other=0.0).to(gl.float16)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, COL)
        l_i = gl.zeros([BLOCK_H], gl.float32, COL)
        acc = gl.zeros([D, BLOCK_H], gl.float32, MMA)  # o'^T
        offs_e = gl.arange(0, NB, layout=gl.SliceLayout(1, EXACT))
        offs_ed = gl.arange(0, D, layout=gl.SliceLayout(0, EXACT))
        offs_er = gl.arange(0, NB, layout=ROW)
        for start in range(bf_lo, bf_hi, NB):
            mask_e = start + offs_e < bf_hi
            slot = gl.load(BF16_INDICES + bf_start + start + offs_e, mask=mask_e, other=0).to(gl.int64)
            me = gl.expand_dims(mask_e, 1)
            kb = gl.load(K_BF16 + gl.expand_dims(slot * stride_kbs + kvh * stride_kbh, 1) + gl.expand_dims(offs_ed, 0),
                         mask=me, other=0.0)
            vb = gl.load(V_BF16 + gl.expand_dims(slot * stride_vbs + kvh * stride_vbh, 1) + gl.expand_dims(offs_ed, 0),
                         mask=me, other=0.0)
            gl.thread_barrier()  # the tiles' previous contents are read
            k_tile.store(kb.to(gl.float16))
            v_tile.store(vb)
            gl.thread_barrier()
            s = mma_v2(k_tile.load(A_OP), qn, gl.zeros([NB, BLOCK_H], gl.float32, MMA))
            s = gl.where(gl.expand_dims(start + offs_er < bf_hi, 1), s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - gl.expand_dims(m_new, 0))
            l_i = l_i * alpha + gl.sum(p, 0)
            pv = gl.convert_layout(p.to(gl.bfloat16), B_OP)
            acc = mma_v2(v_tile.permute((1, 0)).load(A_OP), pv, acc * gl.expand_dims(alpha, 0))
            m_i = m_new
        inv_l, lse = finish_split(m_i, l_i)
        offs_od = gl.arange(0, D, layout=ROW)
        gl.store(PART_O + b * stride_pob + gl.expand_dims(heads * stride_poh, 0) + split * stride_pos
                 + gl.expand_dims(offs_od, 1), acc * gl.expand_dims(inv_l, 0), mask=gl.expand_dims(mask_h, 0))
        gl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


def launch(q_rot, cache, index, part_o, part_lse, num_exact, *, block_h: int, options: DecodeOptions,
           max_registers: int | None) -> None:
    """One launch of the kernel over ``index``'s grid ``(B, Hkv, parts)``, with the arguments of
    :func:`~oscar_kernels.decode_common.split_args`, ``block_h`` query-head columns per program (at least 8
    with ``movmatrix``), the ``options``' numerics and tuning and a register cap (``maxnreg``; None or 0: none)."""
    bsz, hq, _ = q_rot.shape
    cap = {"maxnreg": max_registers} if max_registers else {}
    _decode_rows_async_kernel[(bsz, cache.kv_heads, index.parts)](
        *split_args(q_rot, cache, index, part_o, part_lse, num_exact, words=True), GQA=hq // cache.kv_heads,
        BLOCK_H=max(block_h, 8) if options.movmatrix else block_h, OFF64=cache.off64,
        PER_SEQ_EXACT=index.num_exact is not None, STAGES=options.num_stages or STAGES, Q8=options.int8_scores,
        V8=options.int8_values, LEAN=options.lean_tiles, FUSED=options.fused_update, MOVM=options.movmatrix,
        META_FP8=cache.fp8, BITS_K=cache.k.bits, BITS_V=cache.v.bits, num_warps=1, **cap,
    )
