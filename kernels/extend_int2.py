"""Prefill/extend attention: new tokens attend causally to themselves (BF16) and to the cached INT2 + BF16 tokens.

Math, for sequence ``b``, new token ``i`` (0-based within the chunk ``qo_indptr[b] : qo_indptr[b+1]``) and query
head ``h`` (KV head ``kh = h // (Hq / Hkv)``): ``q' = q @ R_K[kh]``; keys ``K'`` = the sequence's INT2 slots
(``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, dequantised ``code*s + z``), its BF16 slots
(``bf16_indices[...]``, already rotated) and the chunk's own rotated keys ``k_new[j] @ R_K``, ``j <= i``
(every cached token precedes the chunk); values likewise with ``R_V``;
``o = softmax(sm_scale * q' K'^T) V' R_V^T``.

Packed layout (see :mod:`oscar_kernels.layout`): codes uint8 ``[S, Hkv, d/4]``, byte ``k*B + b`` of a row
(``B = g/4``) holds rotated elements ``k*g + b + j*B`` at bit shift ``2j``; scale/zero fp16 ``[S, Hkv, d/g]``.
The kernel works on the four bit-plane quarters of each row, so INT2 tiles are dequantised
(``code*s + z``, per element) with no reshuffle and dotted quarter by quarter.

Kernel: one program per (sequence, query head, block of ``BLOCK_M`` new tokens); grid
``(B, Hq, ceil(max_new_len / BLOCK_M))`` with ``max_new_len`` a host bound, so no host synchronisation.
The rotations of ``q``, of the new ``k``/``v`` and of the output (``R_V^T``) are separate batched matmuls in
the launcher: prefill is bound by the attention dots, and a ``[N, d] x [d, d]`` matmul per head is a small
fraction of them (``2 N d^2`` against ``~2 N L d`` flops, ``L`` >> ``d``).

Exact vs approximate: on GPU ``q'`` (scaled by ``sm_scale * log2 e``) and keys are rounded to fp16, ``p`` and
values to bf16 for the tensor-core dots (fp32 accumulation); tested at <= 1e-2 relative error against the
fp32 ``_ref``. Under ``TRITON_INTERPRET=1`` every dot runs in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .layout import cached_rows_ref, check_group_size

DEFAULT_BLOCK_M = 64
"""New tokens per program."""
DEFAULT_BLOCK_N = 64
"""Keys per inner-loop tile."""


@triton.jit
def _softmax_step(s, m_i, l_i, acc0, acc1, acc2, acc3, v0, v1, v2, v3, PV_T: tl.constexpr):
    """One online-softmax step: scores ``s`` [M, N] (base 2, -inf = masked), value quarters ``v*`` [N, d/4]."""
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
def _extend_int2_kernel(
    Q, K_NEW, V_NEW, QO_INDPTR,
    K_CODES, K_SCALE, K_ZERO, V_CODES, V_SCALE, V_ZERO,
    K_BF16, V_BF16,
    KV_INDPTR, KV_INDICES, BF16_INDPTR, BF16_INDICES,
    OUT,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcs, stride_kch, stride_kss, stride_ksh, stride_kzs, stride_kzh,
    stride_vcs, stride_vch, stride_vss, stride_vsh, stride_vzs, stride_vzh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_on, stride_oh,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_T: tl.constexpr, PV_T: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GQA
    D4: tl.constexpr = HEAD_DIM // 4
    BQ: tl.constexpr = GROUP_SIZE // 4
    offs_m = tl.arange(0, D4)
    col0 = (offs_m // BQ) * GROUP_SIZE + offs_m % BQ  # element of bit plane 0 held by byte m
    gidx = offs_m // BQ

    q_start = tl.load(QO_INDPTR + b)
    q_len = tl.load(QO_INDPTR + b + 1) - q_start
    if mb * BLOCK_M < q_len:
        offs_q = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_q = offs_q < q_len
        q_rows = Q + (q_start + offs_q).to(tl.int64)[:, None] * stride_qn + h * stride_qh
        mq = mask_q[:, None]
        q0 = tl.load(q_rows + (col0 + 0 * BQ)[None, :], mask=mq, other=0.0).to(QK_T)
        q1 = tl.load(q_rows + (col0 + 1 * BQ)[None, :], mask=mq, other=0.0).to(QK_T)
        q2 = tl.load(q_rows + (col0 + 2 * BQ)[None, :], mask=mq, other=0.0).to(QK_T)
        q3 = tl.load(q_rows + (col0 + 3 * BQ)[None, :], mask=mq, other=0.0).to(QK_T)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc0 = tl.zeros([BLOCK_M, D4], tl.float32)
        acc1 = tl.zeros([BLOCK_M, D4], tl.float32)
        acc2 = tl.zeros([BLOCK_M, D4], tl.float32)
        acc3 = tl.zeros([BLOCK_M, D4], tl.float32)

        # ---- cached INT2 prefix ----
        kv_start = tl.load(KV_INDPTR + b)
        kv_len = tl.load(KV_INDPTR + b + 1) - kv_start
        for start in range(0, kv_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_len
            slot = tl.load(KV_INDICES + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            kc = tl.load(K_CODES + slot[:, None] * stride_kcs + kvh * stride_kch + offs_m[None, :])
            ks = tl.load(K_SCALE + slot[:, None] * stride_kss + kvh * stride_ksh + gidx[None, :],
                         mask=mask_n[:, None], other=0.0).to(tl.float32)
            kz = tl.load(K_ZERO + slot[:, None] * stride_kzs + kvh * stride_kzh + gidx[None, :],
                         mask=mask_n[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q0, tl.trans(((kc & 3).to(tl.float32) * ks + kz).to(QK_T)))
            s += tl.dot(q1, tl.trans((((kc >> 2) & 3).to(tl.float32) * ks + kz).to(QK_T)))
            s += tl.dot(q2, tl.trans((((kc >> 4) & 3).to(tl.float32) * ks + kz).to(QK_T)))
            s += tl.dot(q3, tl.trans(((kc >> 6).to(tl.float32) * ks + kz).to(QK_T)))
            s = tl.where(mask_n[None, :], s, float("-inf"))
            vc = tl.load(V_CODES + slot[:, None] * stride_vcs + kvh * stride_vch + offs_m[None, :])
            vs = tl.load(V_SCALE + slot[:, None] * stride_vss + kvh * stride_vsh + gidx[None, :],
                         mask=mask_n[:, None], other=0.0).to(tl.float32)
            vz = tl.load(V_ZERO + slot[:, None] * stride_vzs + kvh * stride_vzh + gidx[None, :],
                         mask=mask_n[:, None], other=0.0).to(tl.float32)
            m_i, l_i, acc0, acc1, acc2, acc3 = _softmax_step(
                s, m_i, l_i, acc0, acc1, acc2, acc3,
                (vc & 3).to(tl.float32) * vs + vz, ((vc >> 2) & 3).to(tl.float32) * vs + vz,
                ((vc >> 4) & 3).to(tl.float32) * vs + vz, (vc >> 6).to(tl.float32) * vs + vz, PV_T)

        # ---- cached BF16 sink/recent segment ----
        bf_start = tl.load(BF16_INDPTR + b)
        bf_len = tl.load(BF16_INDPTR + b + 1) - bf_start
        for start in range(0, bf_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < bf_len
            slot = tl.load(BF16_INDICES + bf_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k_rows = K_BF16 + slot[:, None] * stride_kbs + kvh * stride_kbh
            v_rows = V_BF16 + slot[:, None] * stride_vbs + kvh * stride_vbh
            mn = mask_n[:, None]
            s = tl.dot(q0, tl.trans(tl.load(k_rows + (col0 + 0 * BQ)[None, :]).to(QK_T)))
            s += tl.dot(q1, tl.trans(tl.load(k_rows + (col0 + 1 * BQ)[None, :]).to(QK_T)))
            s += tl.dot(q2, tl.trans(tl.load(k_rows + (col0 + 2 * BQ)[None, :]).to(QK_T)))
            s += tl.dot(q3, tl.trans(tl.load(k_rows + (col0 + 3 * BQ)[None, :]).to(QK_T)))
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_i, l_i, acc0, acc1, acc2, acc3 = _softmax_step(
                s, m_i, l_i, acc0, acc1, acc2, acc3,
                tl.load(v_rows + (col0 + 0 * BQ)[None, :], mask=mn, other=0.0),
                tl.load(v_rows + (col0 + 1 * BQ)[None, :], mask=mn, other=0.0),
                tl.load(v_rows + (col0 + 2 * BQ)[None, :], mask=mn, other=0.0),
                tl.load(v_rows + (col0 + 3 * BQ)[None, :], mask=mn, other=0.0), PV_T)

        # ---- the chunk itself, causal ----
        k_end = tl.minimum((mb + 1) * BLOCK_M, q_len)
        for start in range(0, k_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < k_end
            rows = (q_start + offs_n).to(tl.int64)
            k_rows = K_NEW + rows[:, None] * stride_kn + kvh * stride_kh
            v_rows = V_NEW + rows[:, None] * stride_vn + kvh * stride_vh
            mn = mask_n[:, None]
            s = tl.dot(q0, tl.trans(tl.load(k_rows + (col0 + 0 * BQ)[None, :], mask=mn, other=0.0).to(QK_T)))
            s += tl.dot(q1, tl.trans(tl.load(k_rows + (col0 + 1 * BQ)[None, :], mask=mn, other=0.0).to(QK_T)))
            s += tl.dot(q2, tl.trans(tl.load(k_rows + (col0 + 2 * BQ)[None, :], mask=mn, other=0.0).to(QK_T)))
            s += tl.dot(q3, tl.trans(tl.load(k_rows + (col0 + 3 * BQ)[None, :], mask=mn, other=0.0).to(QK_T)))
            s = tl.where(mask_n[None, :] & (offs_n[None, :] <= offs_q[:, None]), s, float("-inf"))
            m_i, l_i, acc0, acc1, acc2, acc3 = _softmax_step(
                s, m_i, l_i, acc0, acc1, acc2, acc3,
                tl.load(v_rows + (col0 + 0 * BQ)[None, :], mask=mn, other=0.0),
                tl.load(v_rows + (col0 + 1 * BQ)[None, :], mask=mn, other=0.0),
                tl.load(v_rows + (col0 + 2 * BQ)[None, :], mask=mn, other=0.0),
                tl.load(v_rows + (col0 + 3 * BQ)[None, :], mask=mn, other=0.0), PV_T)

        inv_l = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
        o_rows = OUT + (q_start + offs_q).to(tl.int64)[:, None] * stride_on + h * stride_oh
        tl.store(o_rows + (col0 + 0 * BQ)[None, :], acc0 * inv_l[:, None], mask=mq)
        tl.store(o_rows + (col0 + 1 * BQ)[None, :], acc1 * inv_l[:, None], mask=mq)
        tl.store(o_rows + (col0 + 2 * BQ)[None, :], acc2 * inv_l[:, None], mask=mq)
        tl.store(o_rows + (col0 + 3 * BQ)[None, :], acc3 * inv_l[:, None], mask=mq)


def _rotate(x: torch.Tensor, rot: torch.Tensor, heads: int) -> torch.Tensor:
    """x ``[N, H, d]`` -> fp32 ``x[:, h] @ rot[h * n_rot // heads]`` (contiguous)."""
    r = rot.float()
    if r.shape[0] > 1:
        r = r.repeat_interleave(heads // r.shape[0], dim=0)
        return torch.einsum("nhd,hde->nhe", x.float(), r).contiguous()
    return (x.float() @ r[0]).contiguous()


def extend_int2(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    qo_indptr: torch.Tensor, max_new_len: int,
    rot_k: torch.Tensor, rot_v: torch.Tensor,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    k_bf16: torch.Tensor, v_bf16: torch.Tensor,
    bf16_indptr: torch.Tensor, bf16_indices: torch.Tensor,
    group_size: int | None = None,
    sm_scale: float | None = None,
    new_kv_rotated: bool = False,
    out: torch.Tensor | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
) -> torch.Tensor:
    """Extend (prefill) attention over the chunk itself (causal) plus the cached INT2 and BF16 tokens.

    Args:
        q: bf16/fp16/fp32 ``[N, Hq, d]`` un-rotated queries of all chunks, sequence ``b`` at rows
            ``qo_indptr[b] : qo_indptr[b+1]``.
        k_new, v_new: float ``[N, Hkv, d]`` the chunks' own keys/values (un-rotated unless ``new_kv_rotated``).
        qo_indptr: int32 ``[B + 1]``; max_new_len: host bound of the longest chunk (sets the grid).
        rot_k, rot_v: fp32 ``[Hkv or 1, d, d]``.
        k_codes, v_codes: uint8 ``[S, Hkv, d/4]``; k/v_scale, k/v_zero: fp16 ``[S, Hkv, d/g]``.
        kv_indptr: int32 ``[B + 1]``, kv_indices: int32 ``[nnz]``: INT2 prefix slots of each sequence.
        k_bf16, v_bf16: bf16 ``[S_bf16, Hkv, d]`` rotated pools; bf16_indptr int32 ``[B + 1]``,
            bf16_indices int32 ``[nnz_bf16]``.
        group_size: ``g`` (default ``d``); sm_scale: default ``1/sqrt(d)``.
        out: optional ``[N, Hq, d]`` output (default: new tensor of ``q.dtype``).
        block_m, block_n: tile sizes (``DEFAULT_BLOCK_M``, ``DEFAULT_BLOCK_N``).

    Returns:
        ``out``: ``[N, Hq, d]`` in the original basis.
    """
    n, hq, d = q.shape
    hkv = k_codes.shape[1]
    g = group_size or d
    check_group_size(d, g)
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    if k_new.shape != (n, hkv, d) or v_new.shape != (n, hkv, d):
        raise ValueError(f"k_new/v_new must be [{n}, {hkv}, {d}]")
    if qo_indptr.dtype != torch.int32 or qo_indptr.dim() != 1:
        raise ValueError("qo_indptr must be int32 [B + 1]")
    bsz = qo_indptr.shape[0] - 1
    from .decode_int2 import _check_bf16, _check_index, _check_pool, _check_rot, _interpreting
    _check_pool("k", k_codes, k_scale, k_zero, hkv, d, g)
    _check_pool("v", v_codes, v_scale, v_zero, hkv, d, g)
    _check_rot("rot_k", rot_k, hkv, d)
    _check_rot("rot_v", rot_v, hkv, d)
    _check_index("kv", kv_indptr, kv_indices, bsz)
    _check_index("bf16", bf16_indptr, bf16_indices, bsz)
    _check_bf16(k_bf16, v_bf16, hkv, d)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape:
        raise ValueError(f"out must have shape {tuple(q.shape)}")
    if n == 0 or bsz == 0:
        return out
    gqa = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qr = _rotate(q, rot_k, hq) * (sm_scale * math.log2(math.e))
    kr = k_new.float().contiguous() if new_kv_rotated else _rotate(k_new, rot_k, hkv)
    vr = v_new.float().contiguous() if new_kv_rotated else _rotate(v_new, rot_v, hkv)
    o_rot = torch.empty(n, hq, d, dtype=torch.float32, device=q.device)
    fp32_dot = _interpreting() or q.device.type != "cuda"
    grid = (bsz, hq, triton.cdiv(max_new_len, block_m))
    _extend_int2_kernel[grid](
        qr, kr, vr, qo_indptr,
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
        k_bf16, v_bf16,
        kv_indptr, kv_indices, bf16_indptr, bf16_indices,
        o_rot,
        qr.stride(0), qr.stride(1), kr.stride(0), kr.stride(1), vr.stride(0), vr.stride(1),
        k_codes.stride(0), k_codes.stride(1), k_scale.stride(0), k_scale.stride(1), k_zero.stride(0), k_zero.stride(1),
        v_codes.stride(0), v_codes.stride(1), v_scale.stride(0), v_scale.stride(1), v_zero.stride(0), v_zero.stride(1),
        k_bf16.stride(0), k_bf16.stride(1), v_bf16.stride(0), v_bf16.stride(1),
        o_rot.stride(0), o_rot.stride(1),
        GQA=gqa, HEAD_DIM=d, GROUP_SIZE=g, BLOCK_M=block_m, BLOCK_N=block_n,
        QK_T=tl.float32 if fp32_dot else tl.float16, PV_T=tl.float32 if fp32_dot else tl.bfloat16,
        num_warps=4, num_stages=2,
    )
    # back to the original basis: o = o' @ R_V^T (per KV head of each query head)
    out.copy_(_rotate(o_rot, rot_v.transpose(1, 2), hq))
    return out


def extend_int2_ref(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    qo_indptr: torch.Tensor,
    rot_k: torch.Tensor, rot_v: torch.Tensor,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
    k_bf16: torch.Tensor, v_bf16: torch.Tensor,
    bf16_indptr: torch.Tensor, bf16_indices: torch.Tensor,
    group_size: int | None = None,
    sm_scale: float | None = None,
    new_kv_rotated: bool = False,
) -> torch.Tensor:
    """Plain fp32 torch definition of :func:`extend_int2`; returns fp32 ``[N, Hq, d]``."""
    n, hq, d = q.shape
    hkv = k_codes.shape[1]
    g = group_size or d
    gqa = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    rk = rot_k.float().expand(hkv, d, d)
    rv = rot_v.float().expand(hkv, d, d)
    out = torch.empty(n, hq, d, dtype=torch.float32, device=q.device)
    for b in range(qo_indptr.shape[0] - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if q1 == q0:
            continue
        kn, vn = k_new[q0:q1].float(), v_new[q0:q1].float()
        if not new_kv_rotated:
            kn = torch.einsum("nhd,hde->nhe", kn, rk)
            vn = torch.einsum("nhd,hde->nhe", vn, rv)
        kc = cached_rows_ref(k_codes, k_scale, k_zero, k_bf16, kv_indptr, kv_indices, bf16_indptr, bf16_indices, b, g)
        vc = cached_rows_ref(v_codes, v_scale, v_zero, v_bf16, kv_indptr, kv_indices, bf16_indptr, bf16_indices, b, g)
        k, v = torch.cat([kc, kn]), torch.cat([vc, vn])
        n_cached, m = kc.shape[0], q1 - q0
        causal = torch.ones(m, n_cached + m, dtype=torch.bool, device=q.device)
        causal[:, n_cached:] = torch.tril(causal[:, n_cached:])
        for h in range(hq):
            kh = h // gqa
            qr = q[q0:q1, h].float() @ rk[kh]
            sc = (qr @ k[:, kh].T) * sm_scale
            p = torch.softmax(sc.masked_fill(~causal, float("-inf")), dim=-1)
            out[q0:q1, h] = (p @ v[:, kh]) @ rv[kh].T
    return out
