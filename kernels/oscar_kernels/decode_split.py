"""The decode split kernels in Triton: one program per (sequence, KV head, part) writes one normalised partial
output and its base-2 log-sum-exp per query head of its GQA group (the grid and the partials are
:mod:`oscar_kernels.decode_grid`'s; :mod:`oscar_kernels.decode_merge` merges them).

* ``_decode_rows_kernel``: the row-scale path (one scale/zero per row, ``g = d >= 128``): the CPU/interpreter path,
  and the CUDA one where :mod:`oscar_kernels.decode_async`'s Gluon kernel does not cover the launch. All query heads
  of a KV head share each loaded tile, and tokens are the M dimension of both tensor-core products, so a 4-head
  group is not padded to 16 rows. The dequantisation is folded out of the inner loop:
  ``q'.k_hat = s (q'.c) + z sum(q')`` and ``sum_t p_t v_hat_t = sum_t (p_t s_t) c_t + sum_t p_t z_t``. Codes are read
  as int16 words (two bytes, eight codes); plane ``j`` of the low/high byte of word ``w`` is rotated element
  ``2w + {0, 1} + j d/4``. On CUDA one LOP3 per two codes turns them into fp16 ``F16_MAGIC + 4**j c``; the query
  planes are pre-divided by ``4**j`` and the offsets leave the key side through one per-head constant and the value
  side through each tile's ``sum(p*s)``. Each tile's slot indices are loaded one iteration ahead, so a tile's code
  loads wait on one memory latency instead of two.
* ``_decode_int2_kernel``: the general path (``g < d`` or ``d = 64``): quarter planes of bytes, codes dequantised
  per element when ``g < d``.

Program ``i < n_b`` of sequence ``b`` runs INT2 split ``i``, ``n_b <= i < n_b + e_b`` an exact part of the sequence's
exact (BF16) rows, the rest exit at once (counts from :func:`~oscar_kernels.decode_common.split_counts`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_common import (
    BF16_MAGIC,
    F16_MAGIC,
    code_plane,
    dot_nt,
    exact_tile,
    finish_split,
    head_mults,
    list_part,
    meta_f32,
    planes_bf16,
    planes_f16,
    softmax_step,
    split_args,
    split_counts,
    store_planes,
    word_planes_magic,
)


@triton.jit
def _word_planes_plain(x, DT: tl.constexpr):
    """int16 code words -> eight tensors of plain codes (same order as :func:`word_planes_magic`)."""
    x = x.to(tl.int32)
    return ((x & 3).to(DT), ((x >> 2) & 3).to(DT), ((x >> 4) & 3).to(DT), ((x >> 6) & 3).to(DT),
            ((x >> 8) & 3).to(DT), ((x >> 10) & 3).to(DT), ((x >> 12) & 3).to(DT), ((x >> 14) & 3).to(DT))


@triton.jit
def _word_planes(x, MAGIC: tl.constexpr, DOT_T: tl.constexpr):
    """:func:`word_planes_magic` (``MAGIC``, the PTX unpack) or :func:`_word_planes_plain` (the interpreter's)."""
    if MAGIC:
        return word_planes_magic(x)
    else:
        return _word_planes_plain(x, DOT_T)


@triton.jit
def _rows_k_loads(K_WORDS, K_SCALE, K_ZERO, slot, kvh, offs_w, stride_kws, stride_kwh, stride_kss, stride_ksh,
                  stride_kzs, stride_kzh):
    """A row-scale tile's key loads: code words ``[N, d/8]``, scales and zeros ``[N]`` in their stored dtype (masked
    tokens read slot 0, any bits: their score is -inf)."""
    kw = tl.load(K_WORDS + slot[:, None] * stride_kws + kvh * stride_kwh + offs_w[None, :])
    ks = tl.load(K_SCALE + slot * stride_kss + kvh * stride_ksh)
    kz = tl.load(K_ZERO + slot * stride_kzs + kvh * stride_kzh)
    return kw, ks, kz


@triton.jit
def _rows_v_loads(V_WORDS, V_SCALE, V_ZERO, slot, mask_n, kvh, offs_w, stride_vws, stride_vwh, stride_vss, stride_vsh,
                  stride_vzs, stride_vzh):
    """A row-scale tile's value loads, as :func:`_rows_k_loads`; masked tokens get scale and zero 0 (their ``p*s``
    and ``p*z`` must be 0)."""
    vw = tl.load(V_WORDS + slot[:, None] * stride_vws + kvh * stride_vwh + offs_w[None, :])
    vs = tl.load(V_SCALE + slot * stride_vss + kvh * stride_vsh, mask=mask_n, other=0.0)
    vz = tl.load(V_ZERO + slot * stride_vzs + kvh * stride_vzh, mask=mask_n, other=0.0)
    return vw, vs, vz

@triton.jit
def _key_dots(kw, q0, q1, q2, q3, q4, q5, q6, q7, acc, MAGIC: tl.constexpr, DOT_T: tl.constexpr):
    """``acc + q'.c`` [N, H] of one 2-bit code plane's words ``kw`` (magic offsets included: see the caller)."""
    k0, k1, k2, k3, k4, k5, k6, k7 = _word_planes(kw, MAGIC, DOT_T)
    acc = tl.dot(k0, q0, acc)
    acc = tl.dot(k1, q1, acc)
    acc = tl.dot(k2, q2, acc)
    acc = tl.dot(k3, q3, acc)
    acc = tl.dot(k4, q4, acc)
    acc = tl.dot(k5, q5, acc)
    acc = tl.dot(k6, q6, acc)
    return tl.dot(k7, q7, acc)


@triton.jit
def _rows_scores(kw, kwh, ks, kz, mask_n, q0, q1, q2, q3, q4, q5, q6, q7, s_init, qtot, m_i, l_i,
                 MAGIC: tl.constexpr, DOT_T: tl.constexpr, BITS_K: tl.constexpr):
    """A row-scale tile's base-2 scores ``s = s_k (q'.c) + z_k sum(q')`` [N, H] -> online-softmax step:
    ``(p, alpha, m_new, l_new)``; tokens outside ``mask_n`` score -inf. 4-bit keys (``BITS_K``): ``c = lo + 4 hi``,
    the high plane's words ``kwh`` dotted alike (each plane's magic offset taken out by its own ``s_init``)."""
    qc = _key_dots(kw, q0, q1, q2, q3, q4, q5, q6, q7, s_init, MAGIC, DOT_T)  # [N, H] = q'.c
    if BITS_K == 4:
        qc += 4.0 * _key_dots(kwh, q0, q1, q2, q3, q4, q5, q6, q7, s_init, MAGIC, DOT_T)
    s = qc * ks[:, None] + kz[:, None] * qtot[None, :]
    s = tl.where(mask_n[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 0)


@triton.jit
def _value_dots(vw, ps, off_t, MAGIC: tl.constexpr, DOT_T: tl.constexpr):
    """The eight plane products ``c^T (p s)`` [d/8, H] of one 2-bit code plane's words ``vw``, each less its magic
    offset ``off_t``."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_planes(vw, MAGIC, DOT_T)
    return (tl.dot(tl.trans(v0), ps) - off_t, tl.dot(tl.trans(v1), ps) - off_t, tl.dot(tl.trans(v2), ps) - off_t,
            tl.dot(tl.trans(v3), ps) - off_t, tl.dot(tl.trans(v4), ps) - off_t, tl.dot(tl.trans(v5), ps) - off_t,
            tl.dot(tl.trans(v6), ps) - off_t, tl.dot(tl.trans(v7), ps) - off_t)


@triton.jit
def _rows_values(p, alpha, vw, vwh, vs, vz, pz, a0, a1, a2, a3, a4, a5, a6, a7,
                 OFF: tl.constexpr, MAGIC: tl.constexpr, DOT_T: tl.constexpr, BITS_V: tl.constexpr):
    """A row-scale tile's value side: ``sum_t (p_t s_t) c_t`` into the plane accumulators ``a*`` [d/8, H] (rescaled
    by ``alpha``) and ``sum_t p_t z_t`` into ``pz``; 4-bit values (``BITS_V``) add their high plane ``vwh``'s
    products times 4."""
    ps = (p * vs[:, None]).to(DOT_T)
    pz = pz * alpha + tl.sum(p * vz[:, None], 0)
    # the 1024 offsets leave each tile's product before it is carried: the tensor cores' fp32 accumulation
    # truncates, and carried over a long split next to the offsets its bias grew with the split length
    # (5e-2 relative error over 4k tokens on an H200; written as dot(...) - off, Triton cannot fold the
    # carry back into the dot's accumulator)
    off_t = (OFF * tl.sum(ps.to(tl.float32), 0))[None, :]
    p0, p1, p2, p3, p4, p5, p6, p7 = _value_dots(vw, ps, off_t, MAGIC, DOT_T)
    if BITS_V == 4:
        h0, h1, h2, h3, h4, h5, h6, h7 = _value_dots(vwh, ps, off_t, MAGIC, DOT_T)
        p0, p1, p2, p3 = p0 + 4.0 * h0, p1 + 4.0 * h1, p2 + 4.0 * h2, p3 + 4.0 * h3
        p4, p5, p6, p7 = p4 + 4.0 * h4, p5 + 4.0 * h5, p6 + 4.0 * h6, p7 + 4.0 * h7
    a0 = a0 * alpha[None, :] + p0
    a1 = a1 * alpha[None, :] + p1
    a2 = a2 * alpha[None, :] + p2
    a3 = a3 * alpha[None, :] + p3
    a4 = a4 * alpha[None, :] + p4
    a5 = a5 * alpha[None, :] + p5
    a6 = a6 * alpha[None, :] + p6
    a7 = a7 * alpha[None, :] + p7
    return pz, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _rows_tile(start, hi, kv_start, slot_next, offs_t, offs_w, kvh, KV_INDICES,
               K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO, mk, mv, K_HI, V_HI,
               stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
               stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
               q0, q1, q2, q3, q4, q5, q6, q7, s_init, qtot, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7,
               BLOCK_N: tl.constexpr, OFF: tl.constexpr, MAGIC: tl.constexpr, DOT_T: tl.constexpr,
               OFF64: tl.constexpr, META_FP8: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr):
    """One row-scale tile of the split loop: tokens ``[start, start + BLOCK_N)`` of the split ending at ``hi`` (token
    masks on the slots, the scores and the value scales), whose slots ``slot_next`` the iteration before loaded.
    Returns the next tile's slots and the updated softmax state and plane accumulators."""
    offs_n = start + offs_t
    mask_n = offs_n < hi
    slot = slot_next
    slot_next = tl.load(KV_INDICES + kv_start + BLOCK_N + offs_n, mask=BLOCK_N + offs_n < hi, other=0)
    if OFF64:
        slot = slot.to(tl.int64)
    kw, ks, kz = _rows_k_loads(K_WORDS, K_SCALE, K_ZERO, slot, kvh, offs_w, stride_kws, stride_kwh,
                               stride_kss, stride_ksh, stride_kzs, stride_kzh)
    if BITS_K == 4:  # the high plane: the low plane's strides
        kwh = tl.load(K_HI + slot[:, None] * stride_kws + kvh * stride_kwh + offs_w[None, :])
    else:
        kwh = kw
    p, alpha, m_i, l_i = _rows_scores(kw, kwh, meta_f32(ks, mk, META_FP8), meta_f32(kz, mk, META_FP8), mask_n,
                                      q0, q1, q2, q3, q4, q5, q6, q7, s_init, qtot, m_i, l_i, MAGIC, DOT_T, BITS_K)
    vw, vs, vz = _rows_v_loads(V_WORDS, V_SCALE, V_ZERO, slot, mask_n, kvh, offs_w, stride_vws,
                               stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh)
    if BITS_V == 4:
        vwh = tl.load(V_HI + slot[:, None] * stride_vws + kvh * stride_vwh + offs_w[None, :])
    else:
        vwh = vw
    pz, a0, a1, a2, a3, a4, a5, a6, a7 = _rows_values(
        p, alpha, vw, vwh, meta_f32(vs, mv, META_FP8), meta_f32(vz, mv, META_FP8), pz, a0, a1, a2, a3, a4, a5, a6,
        a7, OFF, MAGIC, DOT_T, BITS_V)
    return slot_next, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _query_planes(q_rows, mq, HEAD_DIM: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
                  OFF: tl.constexpr, DOT_T: tl.constexpr):
    """The rotated query of a head tile (``q_rows`` ``[1, H]`` pointers, ``mq`` its column mask) as the eight
    bit-plane operands ``[d/8, H]`` of the row-scale loops (plane ``j`` of the low byte of code word ``w`` is element
    ``2w + j d/4``, of the high byte ``2w + 1 + j d/4``; planes 1-3 scaled by ``R1``-``R3``), ``sum(q')`` ``[H]`` and
    the offset term ``OFF * sum(planes)`` ``[H]`` that the magic-number codes add to every score."""
    W: tl.constexpr = HEAD_DIM // 8
    D4: tl.constexpr = HEAD_DIM // 4
    qw = q_rows + 2 * tl.arange(0, W)[:, None]
    q0 = tl.load(qw + 0 * D4, mask=mq, other=0.0).to(DOT_T)
    q1 = (tl.load(qw + 1 * D4, mask=mq, other=0.0) * R1).to(DOT_T)
    q2 = (tl.load(qw + 2 * D4, mask=mq, other=0.0) * R2).to(DOT_T)
    q3 = (tl.load(qw + 3 * D4, mask=mq, other=0.0) * R3).to(DOT_T)
    q4 = tl.load(qw + 1 + 0 * D4, mask=mq, other=0.0).to(DOT_T)
    q5 = (tl.load(qw + 1 + 1 * D4, mask=mq, other=0.0) * R1).to(DOT_T)
    q6 = (tl.load(qw + 1 + 2 * D4, mask=mq, other=0.0) * R2).to(DOT_T)
    q7 = (tl.load(qw + 1 + 3 * D4, mask=mq, other=0.0) * R3).to(DOT_T)
    qtot = tl.sum(tl.load(q_rows + tl.arange(0, HEAD_DIM)[:, None], mask=mq, other=0.0), 0)  # sum(q')
    qoff = (tl.sum(q0.to(tl.float32), 0) + tl.sum(q1.to(tl.float32), 0) + tl.sum(q2.to(tl.float32), 0)
            + tl.sum(q3.to(tl.float32), 0) + tl.sum(q4.to(tl.float32), 0) + tl.sum(q5.to(tl.float32), 0)
            + tl.sum(q6.to(tl.float32), 0) + tl.sum(q7.to(tl.float32), 0)) * OFF
    return q0, q1, q2, q3, q4, q5, q6, q7, qtot, qoff


@triton.jit
def _split_state(W: tl.constexpr, H: tl.constexpr):
    """A row-scale split's empty online-softmax state over ``H`` columns: running max (-inf), sum, ``sum(p*z)``, and
    the eight ``o'^T`` plane accumulators ``[W, H]`` (code-word rows x columns)."""
    return (tl.full([H], float("-inf"), tl.float32), tl.zeros([H], tl.float32), tl.zeros([H], tl.float32),
            tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32),
            tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32),
            tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32))


@triton.jit
def _decode_rows_kernel(
    QN,
    K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO, MULT_K, MULT_V, K_HI, V_HI,
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
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_NB: tl.constexpr,
    MAGIC: tl.constexpr, DOT_T: tl.constexpr, BF_PV_T: tl.constexpr, OFF64: tl.constexpr,
    PER_SEQ_EXACT: tl.constexpr, META_FP8: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    W: tl.constexpr = HEAD_DIM // 8
    D4: tl.constexpr = HEAD_DIM // 4
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    q_rows = QN + b * stride_qnb + heads[None, :] * stride_qnh  # [1, H]
    # the plan's counts: written before the previous launch
    num_splits, num_exact = split_counts(NUM_SPLITS, NUM_EXACT, b, parts, exact_splits, PER_SEQ_EXACT)
    if split < num_splits:
        # ---------------- INT2 split: tokens x heads tiles ----------------
        offs_w = tl.arange(0, W)
        mq = mask_h[None, :]
        # codes arrive as 1024 + 4**j c (MAGIC): the query planes are divided by 4**j, 1024 * sum(q) removed
        OFF: tl.constexpr = F16_MAGIC if MAGIC else 0.0
        R1: tl.constexpr = 0.25 if MAGIC else 1.0
        R2: tl.constexpr = 0.0625 if MAGIC else 1.0
        R3: tl.constexpr = 0.015625 if MAGIC else 1.0
        q0, q1, q2, q3, q4, q5, q6, q7, qtot, qoff = _query_planes(q_rows, mq, HEAD_DIM, R1, R2, R3, OFF, DOT_T)
        s_init = tl.zeros([BLOCK_N, BLOCK_H], tl.float32) - qoff[None, :]

        m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7 = _split_state(W, BLOCK_H)

        kv_start, lo, hi = list_part(KV_INDPTR, b, split, num_splits, BLOCK_N)
        offs_t = tl.arange(0, BLOCK_N)
        # the slots of the first tile; each iteration then loads the next tile's
        slot_next = tl.load(KV_INDICES + kv_start + lo + offs_t, mask=lo + offs_t < hi, other=0)
        mk, mv = head_mults(MULT_K, MULT_V, kvh, META_FP8)
        for start in range(lo, hi, BLOCK_N):
            slot_next, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7 = _rows_tile(
                start, hi, kv_start, slot_next, offs_t, offs_w, kvh, KV_INDICES,
                K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO, mk, mv, K_HI, V_HI,
                stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
                stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
                q0, q1, q2, q3, q4, q5, q6, q7, s_init, qtot, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7,
                BLOCK_N, OFF, MAGIC, DOT_T, OFF64, META_FP8, BITS_K, BITS_V)
        inv_l, lse = finish_split(m_i, l_i)
        il = inv_l[None, :]
        zt = (pz * inv_l)[None, :]
        o_rows = PART_O + b * stride_pob + heads[None, :] * stride_poh + split * stride_pos + 2 * offs_w[:, None]
        mh = mask_h[None, :]
        store_planes(o_rows, a0, a1, a2, a3, a4, a5, a6, a7, il, zt, mh, D4, R1, R2, R3)
        tl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)
    elif split < num_splits + num_exact:
        # ---------------- exact (BF16) split: tokens x heads, natural element order ----------------
        bf_start, bf_lo, bf_hi = list_part(BF16_INDPTR, b, split - num_splits, num_exact, BLOCK_NB)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        offs_d = tl.arange(0, HEAD_DIM)
        qn = tl.load(q_rows + offs_d[:, None], mask=mask_h[None, :], other=0.0).to(DOT_T)  # [d, H]
        acc = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)  # o'^T
        for start in range(bf_lo, bf_hi, BLOCK_NB):
            offs_n = start + tl.arange(0, BLOCK_NB)
            mask_n = offs_n < bf_hi
            slot = tl.load(BF16_INDICES + bf_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            kb = tl.load(K_BF16 + slot[:, None] * stride_kbs + kvh * stride_kbh + offs_d[None, :],
                         mask=mask_n[:, None], other=0.0).to(DOT_T)
            s = tl.dot(kb, qn)
            s = tl.where(mask_n[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            vb = tl.load(V_BF16 + slot[:, None] * stride_vbs + kvh * stride_vbh + offs_d[None, :],
                         mask=mask_n[:, None], other=0.0).to(BF_PV_T)
            acc = tl.dot(tl.trans(vb), p.to(BF_PV_T), acc * alpha[None, :])
            m_i = m_new
        inv_l, lse = finish_split(m_i, l_i)
        tl.store(PART_O + b * stride_pob + heads[None, :] * stride_poh + split * stride_pos + offs_d[:, None],
                 acc * inv_l[None, :], mask=mask_h[None, :])
        tl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


@triton.jit
def _decode_int2_kernel(
    QN,
    K_CODES, K_SCALE, K_ZERO, V_CODES, V_SCALE, V_ZERO, MULT_K, MULT_V, K_HI, V_HI,
    K_BF16, V_BF16,
    KV_INDPTR, KV_INDICES, BF16_INDPTR, BF16_INDICES,
    PART_O, PART_LSE, NUM_SPLITS, NUM_EXACT,
    parts, exact_splits,
    stride_qnb, stride_qnh,
    stride_kcs, stride_kch, stride_kss, stride_ksh, stride_kzs, stride_kzh,
    stride_vcs, stride_vch, stride_vss, stride_vsh, stride_vzs, stride_vzh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_NB: tl.constexpr,
    QK_T: tl.constexpr, PV_T: tl.constexpr, PTX_UNPACK: tl.constexpr, PER_SEQ_EXACT: tl.constexpr,
    META_FP8: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    D4: tl.constexpr = HEAD_DIM // 4
    BQ: tl.constexpr = GROUP_SIZE // 4
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    num_splits, num_exact = split_counts(NUM_SPLITS, NUM_EXACT, b, parts, exact_splits, PER_SEQ_EXACT)
    if split < num_splits + num_exact:
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GQA
        heads = kvh * GQA + offs_h
        offs_m = tl.arange(0, D4)
        col0 = (offs_m // BQ) * GROUP_SIZE + offs_m % BQ  # element of bit plane 0 held by byte m

        # ---- q' (rotated, pre-scaled for exp2) split into the four bit-plane quarters ----
        q_rows = QN + b * stride_qnb + heads[:, None] * stride_qnh
        q0 = tl.load(q_rows + (col0 + 0 * BQ)[None, :], mask=mask_h[:, None], other=0.0).to(QK_T)
        q1 = tl.load(q_rows + (col0 + 1 * BQ)[None, :], mask=mask_h[:, None], other=0.0).to(QK_T)
        q2 = tl.load(q_rows + (col0 + 2 * BQ)[None, :], mask=mask_h[:, None], other=0.0).to(QK_T)
        q3 = tl.load(q_rows + (col0 + 3 * BQ)[None, :], mask=mask_h[:, None], other=0.0).to(QK_T)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc0 = tl.zeros([BLOCK_H, D4], tl.float32)
        acc1 = tl.zeros([BLOCK_H, D4], tl.float32)
        acc2 = tl.zeros([BLOCK_H, D4], tl.float32)
        acc3 = tl.zeros([BLOCK_H, D4], tl.float32)

        if split < num_splits:
            # ---------------- INT2 split ----------------
            kv_start = tl.load(KV_INDPTR + b)
            kv_len = tl.load(KV_INDPTR + b + 1) - kv_start
            split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
            lo = split * split_len
            hi = tl.minimum(lo + split_len, kv_len)
            qsum = (tl.sum(q0.to(tl.float32), 1) + tl.sum(q1.to(tl.float32), 1)
                    + tl.sum(q2.to(tl.float32), 1) + tl.sum(q3.to(tl.float32), 1))
            gidx = offs_m // BQ
            mk, mv = head_mults(MULT_K, MULT_V, kvh, META_FP8)
            for start in range(lo, hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                mask_n = offs_n < hi
                slot = tl.load(KV_INDICES + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
                kc = tl.load(K_CODES + slot[:, None] * stride_kcs + kvh * stride_kch + offs_m[None, :])
                vc = tl.load(V_CODES + slot[:, None] * stride_vcs + kvh * stride_vch + offs_m[None, :])
                if BITS_K == 4:  # the high plane: the low plane's strides
                    kh = tl.load(K_HI + slot[:, None] * stride_kcs + kvh * stride_kch + offs_m[None, :])
                else:
                    kh = kc
                if BITS_V == 4:
                    vh = tl.load(V_HI + slot[:, None] * stride_vcs + kvh * stride_vch + offs_m[None, :])
                else:
                    vh = vc
                if NG == 1:
                    ks = meta_f32(tl.load(K_SCALE + slot * stride_kss + kvh * stride_ksh, mask=mask_n, other=0.0),
                                  mk, META_FP8)
                    kz = meta_f32(tl.load(K_ZERO + slot * stride_kzs + kvh * stride_kzh, mask=mask_n, other=0.0),
                                  mk, META_FP8)
                    vs = meta_f32(tl.load(V_SCALE + slot * stride_vss + kvh * stride_vsh, mask=mask_n, other=0.0),
                                  mv, META_FP8)
                    vz = meta_f32(tl.load(V_ZERO + slot * stride_vzs + kvh * stride_vzh, mask=mask_n, other=0.0),
                                  mv, META_FP8)
                    if PTX_UNPACK and BITS_K == 2:  # codes arrive as F16_MAGIC + c: q.(M + c) = q.c + M sum(q)
                        k0, k1, k2, k3 = planes_f16(kc)
                        kz = kz - F16_MAGIC * ks
                    else:
                        k0 = code_plane(kc, kh, 0, BITS_K).to(QK_T)
                        k1 = code_plane(kc, kh, 1, BITS_K).to(QK_T)
                        k2 = code_plane(kc, kh, 2, BITS_K).to(QK_T)
                        k3 = code_plane(kc, kh, 3, BITS_K).to(QK_T)
                    qc = dot_nt(q0, k0, True)
                    qc += dot_nt(q1, k1, True)
                    qc += dot_nt(q2, k2, True)
                    qc += dot_nt(q3, k3, True)
                    s = qc * ks[None, :] + qsum[:, None] * kz[None, :]
                else:
                    ks = meta_f32(tl.load(K_SCALE + slot[:, None] * stride_kss + kvh * stride_ksh + gidx[None, :],
                                 mask=mask_n[:, None], other=0.0), mk, META_FP8)
                    kz = meta_f32(tl.load(K_ZERO + slot[:, None] * stride_kzs + kvh * stride_kzh + gidx[None, :],
                                 mask=mask_n[:, None], other=0.0), mk, META_FP8)
                    s = dot_nt(q0, (code_plane(kc, kh, 0, BITS_K).to(tl.float32) * ks + kz).to(QK_T), True)
                    s += dot_nt(q1, (code_plane(kc, kh, 1, BITS_K).to(tl.float32) * ks + kz).to(QK_T), True)
                    s += dot_nt(q2, (code_plane(kc, kh, 2, BITS_K).to(tl.float32) * ks + kz).to(QK_T), True)
                    s += dot_nt(q3, (code_plane(kc, kh, 3, BITS_K).to(tl.float32) * ks + kz).to(QK_T), True)
                s = tl.where(mask_n[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc0 *= alpha[:, None]
                acc1 *= alpha[:, None]
                acc2 *= alpha[:, None]
                acc3 *= alpha[:, None]
                if NG == 1:
                    ps = (p * vs[None, :]).to(PV_T)
                    pz = tl.sum(p * vz[None, :], 1)
                    if PTX_UNPACK and BITS_V == 2:  # codes as BF16_MAGIC + c: sum ps (M + c) = sum ps c + M sum ps
                        v0, v1, v2, v3 = planes_bf16(vc)
                        pz -= BF16_MAGIC * tl.sum(ps.to(tl.float32), 1)
                    else:
                        v0 = code_plane(vc, vh, 0, BITS_V).to(PV_T)
                        v1 = code_plane(vc, vh, 1, BITS_V).to(PV_T)
                        v2 = code_plane(vc, vh, 2, BITS_V).to(PV_T)
                        v3 = code_plane(vc, vh, 3, BITS_V).to(PV_T)
                    acc0 += tl.dot(ps, v0) + pz[:, None]
                    acc1 += tl.dot(ps, v1) + pz[:, None]
                    acc2 += tl.dot(ps, v2) + pz[:, None]
                    acc3 += tl.dot(ps, v3) + pz[:, None]
                else:
                    vs = meta_f32(tl.load(V_SCALE + slot[:, None] * stride_vss + kvh * stride_vsh + gidx[None, :],
                                 mask=mask_n[:, None], other=0.0), mv, META_FP8)
                    vz = meta_f32(tl.load(V_ZERO + slot[:, None] * stride_vzs + kvh * stride_vzh + gidx[None, :],
                                 mask=mask_n[:, None], other=0.0), mv, META_FP8)
                    pp = p.to(PV_T)
                    acc0 += tl.dot(pp, (code_plane(vc, vh, 0, BITS_V).to(tl.float32) * vs + vz).to(PV_T))
                    acc1 += tl.dot(pp, (code_plane(vc, vh, 1, BITS_V).to(tl.float32) * vs + vz).to(PV_T))
                    acc2 += tl.dot(pp, (code_plane(vc, vh, 2, BITS_V).to(tl.float32) * vs + vz).to(PV_T))
                    acc3 += tl.dot(pp, (code_plane(vc, vh, 3, BITS_V).to(tl.float32) * vs + vz).to(PV_T))
                m_i = m_new
        else:
            # ---------------- exact (BF16) split ----------------
            bf_start, bf_lo, bf_hi = list_part(BF16_INDPTR, b, split - num_splits, num_exact, BLOCK_NB)
            for start in range(bf_lo, bf_hi, BLOCK_NB):
                offs_n = start + tl.arange(0, BLOCK_NB)
                mask_n = offs_n < bf_hi
                slot = tl.load(BF16_INDICES + bf_start + offs_n, mask=mask_n, other=0).to(tl.int64)
                s, v0, v1, v2, v3 = exact_tile(q0, q1, q2, q3, K_BF16, V_BF16, slot, mask_n, stride_kbs, stride_kbh,
                                               stride_vbs, stride_vbh, kvh, col0, BQ, QK_T, True)
                s = tl.where(mask_n[None, :], s, float("-inf"))
                m_i, l_i, acc0, acc1, acc2, acc3 = softmax_step(s, m_i, l_i, acc0, acc1, acc2, acc3,
                                                                v0, v1, v2, v3, PV_T)

        # ---- normalised partial output and base-2 LSE (empty split: lse = -inf, o = 0) ----
        inv_l, lse = finish_split(m_i, l_i)
        o_rows = PART_O + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos
        mh = mask_h[:, None]
        tl.store(o_rows + (col0 + 0 * BQ)[None, :], acc0 * inv_l[:, None], mask=mh)
        tl.store(o_rows + (col0 + 1 * BQ)[None, :], acc1 * inv_l[:, None], mask=mh)
        tl.store(o_rows + (col0 + 2 * BQ)[None, :], acc2 * inv_l[:, None], mask=mh)
        tl.store(o_rows + (col0 + 3 * BQ)[None, :], acc3 * inv_l[:, None], mask=mh)
        tl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


def launch_rows(q_rot, cache, index, part_o, part_lse, num_exact, *, block_h: int, block_n: int, block_nb: int,
                fp32_dot: bool, num_warps: int, num_stages: int, max_registers: int | None) -> None:
    """``_decode_rows_kernel`` over ``index``'s grid ``(B, Hkv, parts)`` (arguments:
    :func:`~oscar_kernels.decode_common.split_args`); ``fp32_dot``: the interpreter's plain unpack and fp32 dots,
    else the PTX unpack and fp16/bf16 dots; ``max_registers``: the register cap (``maxnreg``; None or 0: none)."""
    bsz, hq, d = q_rot.shape
    cap = {"maxnreg": max_registers} if max_registers else {}
    _decode_rows_kernel[(bsz, cache.kv_heads, index.parts)](
        *split_args(q_rot, cache, index, part_o, part_lse, num_exact, words=True),
        GQA=hq // cache.kv_heads, BLOCK_H=block_h, HEAD_DIM=d, BLOCK_N=block_n, BLOCK_NB=block_nb,
        MAGIC=not fp32_dot, DOT_T=tl.float32 if fp32_dot else tl.float16,
        BF_PV_T=tl.float32 if fp32_dot else tl.bfloat16, OFF64=cache.off64,
        PER_SEQ_EXACT=index.num_exact is not None, META_FP8=cache.fp8, BITS_K=cache.k.bits, BITS_V=cache.v.bits,
        num_warps=num_warps, num_stages=num_stages, **cap,
    )


def launch_general(q_rot, cache, index, part_o, part_lse, num_exact, *, block_h: int, block_n: int, block_nb: int,
                   fp32_dot: bool, ptx_unpack: bool, num_warps: int, num_stages: int) -> None:
    """``_decode_int2_kernel`` over ``index``'s grid ``(B, Hkv, parts)`` (arguments:
    :func:`~oscar_kernels.decode_common.split_args` over the code bytes); ``ptx_unpack``: the magic-number unpack
    (CUDA only)."""
    bsz, hq, d = q_rot.shape
    _decode_int2_kernel[(bsz, cache.kv_heads, index.parts)](
        *split_args(q_rot, cache, index, part_o, part_lse, num_exact, words=False),
        GQA=hq // cache.kv_heads, BLOCK_H=block_h, HEAD_DIM=d, GROUP_SIZE=cache.group_size,
        BLOCK_N=block_n, BLOCK_NB=block_nb,
        QK_T=tl.float32 if fp32_dot else tl.float16, PV_T=tl.float32 if fp32_dot else tl.bfloat16,
        PTX_UNPACK=ptx_unpack, PER_SEQ_EXACT=index.num_exact is not None, META_FP8=cache.fp8,
        BITS_K=cache.k.bits, BITS_V=cache.v.bits, num_warps=num_warps, num_stages=num_stages,
    )
