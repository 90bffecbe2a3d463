"""Prefill/extend attention under position-wise windows ("Design P") over INT2 slots and exact rows.

Math. Sequence ``b`` has its first real token at position ``start_b`` (0 in SGLang; > 0 under left padding),
``sink_end_b = start_b + sink``; its chunk of new tokens are rows ``qo_indptr[b] : qo_indptr[b+1]`` of ``q``, the
chunk's token ``i`` sitting at absolute position ``t = q_pos0_b + i`` (``q_pos0_b`` = cached prefix length). With
``q' = q @ R_K[kh]`` (``kh = h // (Hq / Hkv)``), the query at ``t`` attends every key ``j`` with ``start <= j <= t``,
reading it

* EXACTLY (bf16, rotated) when ``j < sink_end`` (a sink) or ``j > t - recent`` (its recent window, its own token
  included when ``recent >= 1``);
* through its INT2 code (dequantised ``code*s + z``) otherwise,

``o = softmax(sm_scale * q' K'^T) V' R_V^T``. The keys come from three lists, each with its own mask:

* INT2 slots ``kv_indices[kv_indptr[b] : kv_indptr[b+1]]``; element ``e`` is position ``sink_end_b + e`` (the list
  runs over ``[sink_end, c1 - recent)``, the chunk's own tokens included: their codes are written before the kernel).
  Used iff ``j <= t - recent``.
* Cached exact rows ``bf16_indices[bf16_indptr[b] : ...]`` at positions ``bf16_pos[...]`` (sinks and ring of the
  prefix). Used iff ``j < sink_end or j > t - recent``.
* The chunk's own rotated keys/values (exact): position ``q_pos0 + e``. Used iff
  ``start <= j <= t and (j < sink_end or j > t - recent)``.

Queries before ``start`` (padding) see no key and output 0 (any finite value is allowed there).

Packed layout (see :mod:`oscar_kernels.layout`): codes uint8 ``[S, Hkv, d/4]``, byte ``k*B + b`` of a row
(``B = g/4``) holds rotated elements ``k*g + b + j*B`` at bit shift ``2j``; scale/zero fp16 ``[S, Hkv, d/g]``.
The kernel works on the four bit-plane quarters of each row, so INT2 tiles are dequantised
(``code*s + z``, per element) with no reshuffle and dotted quarter by quarter.

Kernel: one program per (sequence, KV head, block of new tokens); grid ``(B, Hkv, ceil(max_new_len / BLOCK_T))``
with ``max_new_len`` a host bound, so no host synchronisation. The M dimension of every tensor-core product is
``BLOCK_T`` tokens x the ``Hq / Hkv`` query heads of the KV head (padded to a power of two), so all GQA heads share
each loaded key/value tile. Tiles no row of the block can use are skipped: INT2 tiles past ``t_max - recent``,
chunk tiles in the gap between the chunk's sinks and the window of the block's first query, cached exact tiles
whose positions are neither sinks nor inside that window. The rotations of ``q``, of the new ``k``/``v`` and of the
output (``R_V^T``) are batched matmuls in the launcher: prefill is bound by the attention dots, and a
``[N, d] x [d, d]`` matmul per head is a small fraction of them (``2 N d^2`` against ``~2 N L d`` flops).

Exact vs approximate: the chunk's rotated keys/values are rounded to bf16 (as their exact rows are stored), so a
key reads the same whether it comes from the chunk or from the cache. On GPU ``q'`` (scaled by
``sm_scale * log2 e``) and keys are rounded to fp16, ``p`` and values to bf16 for the tensor-core dots (fp32
accumulation); tested at <= 1e-2 relative error against the fp32 ``_ref`` by a GPU run. Under
``TRITON_INTERPRET=1`` every dot runs in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .decode_common import code_plane, dot_nt, exact_tile, head_mults, meta_f32, softmax_step
from .layout import LayerCache, check_index, check_query, check_seq, gpu_codegen, interpreting

DEFAULT_BLOCK_M = 64
"""Rows of the M dimension per program: ``BLOCK_T = DEFAULT_BLOCK_M / GQA_P`` tokens times the padded GQA group
(64 = the 64-token tile of the previous, one-head-per-program kernel; not measured on a GPU yet)."""
DEFAULT_BLOCK_N = 64
"""Keys per inner-loop tile (kept from the previous kernel; not measured on a GPU yet)."""
DEFAULT_WARPS = 4
"""Warps per program (kept from the previous kernel; not measured)."""
DEFAULT_STAGES = 2
"""Triton pipelining depth (kept from the previous kernel; not measured)."""


@dataclass(frozen=True)
class ExtendIndex:
    """What one extend (prefill) step of a batch reads (made per batch by :class:`oscar_kernels.plan.ExtendPlan`).

    * ``qo_indptr`` int32 ``[B + 1]``: sequence ``b``'s new tokens are rows ``qo_indptr[b] : qo_indptr[b+1]``;
    * ``q_pos0`` int32 ``[B]``: absolute position of each chunk's first token (the cached prefix length);
    * ``start`` int32 ``[B]``: position of each sequence's first real token;
    * ``kv_indptr`` int32 ``[B + 1]``, ``kv_indices`` int32: INT2 slots of positions ``sink_end, sink_end + 1, ...``;
    * ``bf16_indptr`` int32 ``[B + 1]``, ``bf16_indices`` int32, ``bf16_pos`` int32 (same length as
      ``bf16_indices``): cached exact rows of the prefix and their absolute positions;
    * ``max_new_len``: host int bound of any chunk's length (sets the grid); ``sink``, ``recent``: the scheme's
      windows.
    """

    qo_indptr: torch.Tensor
    q_pos0: torch.Tensor
    start: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    bf16_indptr: torch.Tensor
    bf16_indices: torch.Tensor
    bf16_pos: torch.Tensor
    max_new_len: int
    sink: int
    recent: int

    @property
    def batch(self) -> int:
        return self.qo_indptr.shape[0] - 1

    def check(self) -> None:
        bsz = self.batch
        check_seq("qo_indptr", self.qo_indptr, bsz + 1)
        check_seq("q_pos0", self.q_pos0, bsz)
        check_seq("start", self.start, bsz)
        check_index("kv", self.kv_indptr, self.kv_indices, bsz)
        check_index("bf16", self.bf16_indptr, self.bf16_indices, bsz)
        if self.bf16_pos.dtype != torch.int32 or self.bf16_pos.shape != self.bf16_indices.shape:
            raise ValueError("bf16_pos must be int32 with the shape of bf16_indices")
        for name in ("max_new_len", "sink", "recent"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a host int >= 0, got {v!r}")


@triton.jit
def _block_rows(QO_INDPTR, Q_POS0, START, b, i0, sink, recent,
                GQA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    """The M rows of the program whose block starts at chunk token ``i0`` of sequence ``b``: row ``r`` is token
    ``i0 + r // BLOCK_H`` under query head ``kvh * GQA + r % BLOCK_H``. Returns ``q_start, q_len, i1, pos0, first,
    sink_end, tok, hh, mask_r, t, t_win`` (``t``: absolute query positions; keys ``j > t_win`` are in the row's
    window)."""
    q_start = tl.load(QO_INDPTR + b)
    q_len = tl.load(QO_INDPTR + b + 1) - q_start
    i1 = tl.minimum(i0 + BLOCK_T, q_len)
    pos0 = tl.load(Q_POS0 + b)
    first = tl.load(START + b)
    offs_r = tl.arange(0, BLOCK_T * BLOCK_H)
    tok = i0 + offs_r // BLOCK_H
    hh = offs_r % BLOCK_H
    mask_r = (tok < q_len) & (hh < GQA)
    t = pos0 + tok
    return q_start, q_len, i1, pos0, first, first + sink, tok, hh, mask_r, t, t - recent


@triton.jit
def _chunk_tiles(pos0, sink_end, i0, i1, recent, BLOCK_N: tl.constexpr):
    """The chunk's own key tiles a block reads: tiles over ``[0, sink_hi)`` (the chunk's sinks), then over
    ``[w0, i1)`` (the block's windows), nothing between. Returns ``(n_sink_tiles, w0, n_tiles)``; tile ``it`` starts at
    :func:`_chunk_tile_start`."""
    sink_hi = tl.minimum(tl.maximum(sink_end - pos0, 0), i1)
    n_sink_tiles = tl.cdiv(sink_hi, BLOCK_N)
    w0 = tl.maximum(tl.maximum(i0 + 1 - recent, 0), n_sink_tiles * BLOCK_N)
    return n_sink_tiles, w0, n_sink_tiles + tl.cdiv(tl.maximum(i1 - w0, 0), BLOCK_N)


@triton.jit
def _chunk_tile_start(it, n_sink_tiles, w0, BLOCK_N: tl.constexpr):
    return tl.where(it < n_sink_tiles, it * BLOCK_N, w0 + (it - n_sink_tiles) * BLOCK_N)


@triton.jit
def _chunk_use(offs_n, mask_n, pos0, first, sink_end, t, t_win):
    """Which rows use chunk key ``offs_n`` (position ``pos0 + offs_n``): causal, from ``first`` on, sink or window."""
    j = (pos0 + offs_n)[None, :]
    return mask_n[None, :] & (j >= first) & (j <= t[:, None]) & ((j < sink_end) | (j > t_win[:, None]))


@triton.jit
def _int2_extent(pos0, i1, sink_end, recent, kv_len):
    """INT2 list elements the rows of chunk tokens before ``i1`` may read: element ``e`` is position ``sink_end + e``,
    read through its code by a row at ``t`` iff ``sink_end + e <= t - recent``, so the row of token ``i1 - 1``
    decides."""
    return tl.minimum(tl.maximum(pos0 + i1 - recent - sink_end, 0), kv_len)


@triton.jit
def _int2_use(offs_n, mask_n, sink_end, t_win):
    """Which rows read INT2 list elements ``offs_n`` through their codes (see :func:`_int2_extent`)."""
    return mask_n[None, :] & ((sink_end + offs_n)[None, :] <= t_win[:, None])


@triton.jit
def _exact_use(pos, mask_n, sink_end, t_win):
    """Which rows use cached exact rows at positions ``pos``: sinks, or inside the row's window."""
    return mask_n[None, :] & ((pos[None, :] < sink_end) | (pos[None, :] > t_win[:, None]))


@triton.jit
def _extend_int2_kernel(
    Q, K_NEW, V_NEW, QO_INDPTR, Q_POS0, START,
    K_CODES, K_SCALE, K_ZERO, V_CODES, V_SCALE, V_ZERO, MULT_K, MULT_V, K_HI, V_HI,
    K_BF16, V_BF16,
    KV_INDPTR, KV_INDICES, BF16_INDPTR, BF16_INDICES, BF16_POS,
    OUT,
    sink, recent,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcs, stride_kch, stride_kss, stride_ksh, stride_kzs, stride_kzh,
    stride_vcs, stride_vch, stride_vss, stride_vsh, stride_vzs, stride_vzh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_on, stride_oh,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, QK_T: tl.constexpr, PV_T: tl.constexpr,
    META_FP8: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mb = tl.program_id(2)
    M: tl.constexpr = BLOCK_T * BLOCK_H
    D4: tl.constexpr = HEAD_DIM // 4
    BQ: tl.constexpr = GROUP_SIZE // 4
    offs_m = tl.arange(0, D4)
    col0 = (offs_m // BQ) * GROUP_SIZE + offs_m % BQ  # element of bit plane 0 held by byte m
    gidx = offs_m // BQ

    i0 = mb * BLOCK_T
    q_start, q_len, i1, pos0, first, sink_end, tok, hh, mask_r, t, t_win = _block_rows(
        QO_INDPTR, Q_POS0, START, b, i0, sink, recent, GQA, BLOCK_H, BLOCK_T)
    if i0 < q_len:
        q_rows = Q + (q_start + tok).to(tl.int64)[:, None] * stride_qn + (kvh * GQA + hh)[:, None] * stride_qh
        mq = mask_r[:, None]
        q0 = tl.load(q_rows + (col0 + 0 * BQ)[None, :], mask=mq, other=0.0).to(QK_T)
        q1 = tl.load(q_rows + (col0 + 1 * BQ)[None, :], mask=mq, other=0.0).to(QK_T)
        q2 = tl.load(q_rows + (col0 + 2 * BQ)[None, :], mask=mq, other=0.0).to(QK_T)
        q3 = tl.load(q_rows + (col0 + 3 * BQ)[None, :], mask=mq, other=0.0).to(QK_T)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc0 = tl.zeros([M, D4], tl.float32)
        acc1 = tl.zeros([M, D4], tl.float32)
        acc2 = tl.zeros([M, D4], tl.float32)
        acc3 = tl.zeros([M, D4], tl.float32)

        # ---- INT2 slots: element e is position sink_end + e, used iff sink_end + e <= t - recent ----
        kv_start = tl.load(KV_INDPTR + b)
        kv_len = tl.load(KV_INDPTR + b + 1) - kv_start
        n_int2 = _int2_extent(pos0, i1, sink_end, recent, kv_len)  # later tiles: no row uses them
        mk, mv = head_mults(MULT_K, MULT_V, kvh, META_FP8)
        for e0 in range(0, n_int2, BLOCK_N):
            offs_n = e0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_int2
            slot = tl.load(KV_INDICES + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            mn = mask_n[:, None]
            kc = tl.load(K_CODES + slot[:, None] * stride_kcs + kvh * stride_kch + offs_m[None, :])
            if BITS_K == 4:  # the high plane: the low plane's strides
                kh = tl.load(K_HI + slot[:, None] * stride_kcs + kvh * stride_kch + offs_m[None, :])
            else:
                kh = kc
            ks = tl.load(K_SCALE + slot[:, None] * stride_kss + kvh * stride_ksh + gidx[None, :], mask=mn, other=0.0)
            kz = tl.load(K_ZERO + slot[:, None] * stride_kzs + kvh * stride_kzh + gidx[None, :], mask=mn, other=0.0)
            ks = meta_f32(ks, mk, META_FP8)
            kz = meta_f32(kz, mk, META_FP8)
            s = dot_nt(q0, (code_plane(kc, kh, 0, BITS_K).to(tl.float32) * ks + kz).to(QK_T), False)
            s += dot_nt(q1, (code_plane(kc, kh, 1, BITS_K).to(tl.float32) * ks + kz).to(QK_T), False)
            s += dot_nt(q2, (code_plane(kc, kh, 2, BITS_K).to(tl.float32) * ks + kz).to(QK_T), False)
            s += dot_nt(q3, (code_plane(kc, kh, 3, BITS_K).to(tl.float32) * ks + kz).to(QK_T), False)
            s = tl.where(_int2_use(offs_n, mask_n, sink_end, t_win), s, float("-inf"))
            vc = tl.load(V_CODES + slot[:, None] * stride_vcs + kvh * stride_vch + offs_m[None, :])
            if BITS_V == 4:
                vh = tl.load(V_HI + slot[:, None] * stride_vcs + kvh * stride_vch + offs_m[None, :])
            else:
                vh = vc
            vs = tl.load(V_SCALE + slot[:, None] * stride_vss + kvh * stride_vsh + gidx[None, :], mask=mn, other=0.0)
            vz = tl.load(V_ZERO + slot[:, None] * stride_vzs + kvh * stride_vzh + gidx[None, :], mask=mn, other=0.0)
            vs = meta_f32(vs, mv, META_FP8)
            vz = meta_f32(vz, mv, META_FP8)
            m_i, l_i, acc0, acc1, acc2, acc3 = softmax_step(
                s, m_i, l_i, acc0, acc1, acc2, acc3,
                code_plane(vc, vh, 0, BITS_V).to(tl.float32) * vs + vz,
                code_plane(vc, vh, 1, BITS_V).to(tl.float32) * vs + vz,
                code_plane(vc, vh, 2, BITS_V).to(tl.float32) * vs + vz,
                code_plane(vc, vh, 3, BITS_V).to(tl.float32) * vs + vz, PV_T)

        # ---- cached exact rows (prefix sinks and ring): used iff j < sink_end or j > t - recent ----
        bf_start = tl.load(BF16_INDPTR + b)
        bf_len = tl.load(BF16_INDPTR + b + 1) - bf_start
        win_lo = pos0 + i0 - recent  # the block's first query's window: j > win_lo; later rows' windows are inside
        for e0 in range(0, bf_len, BLOCK_N):
            offs_n = e0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < bf_len
            pos = tl.load(BF16_POS + bf_start + offs_n, mask=mask_n, other=0)
            wanted = mask_n & ((pos < sink_end) | (pos > win_lo))
            if tl.max(wanted.to(tl.int32), 0) > 0:  # some row of the block uses this tile
                rows = tl.load(BF16_INDICES + bf_start + offs_n, mask=mask_n, other=0).to(tl.int64)
                s, v0, v1, v2, v3 = exact_tile(q0, q1, q2, q3, K_BF16, V_BF16, rows, mask_n, stride_kbs, stride_kbh,
                                                stride_vbs, stride_vbh, kvh, col0, BQ, QK_T, False)
                s = tl.where(_exact_use(pos, mask_n, sink_end, t_win), s, float("-inf"))
                m_i, l_i, acc0, acc1, acc2, acc3 = softmax_step(s, m_i, l_i, acc0, acc1, acc2, acc3,
                                                                 v0, v1, v2, v3, PV_T)

        # ---- the chunk itself (exact): element e at position pos0 + e ----
        n_sink_tiles, w0, n_tiles = _chunk_tiles(pos0, sink_end, i0, i1, recent, BLOCK_N)
        for it in range(0, n_tiles):
            offs_n = _chunk_tile_start(it, n_sink_tiles, w0, BLOCK_N) + tl.arange(0, BLOCK_N)
            mask_n = offs_n < i1
            rows = (q_start + offs_n).to(tl.int64)
            s, v0, v1, v2, v3 = exact_tile(q0, q1, q2, q3, K_NEW, V_NEW, rows, mask_n, stride_kn, stride_kh,
                                            stride_vn, stride_vh, kvh, col0, BQ, QK_T, False)
            s = tl.where(_chunk_use(offs_n, mask_n, pos0, first, sink_end, t, t_win), s, float("-inf"))
            m_i, l_i, acc0, acc1, acc2, acc3 = softmax_step(s, m_i, l_i, acc0, acc1, acc2, acc3,
                                                             v0, v1, v2, v3, PV_T)

        inv_l = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)  # no key (padding): 0
        o_rows = OUT + (q_start + tok).to(tl.int64)[:, None] * stride_on + (kvh * GQA + hh)[:, None] * stride_oh
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


def _launch_inputs(q, k_new, v_new, cache: LayerCache, index: ExtendIndex, sm_scale: float | None,
                   out: torch.Tensor | None, new_kv_rotated: bool):
    """``(out, rotated)`` of a launch: ``out`` checked or allocated; ``rotated`` None when there is nothing to compute,
    else ``(q', k', v', o')``: ``q'`` fp32 rotated and scaled by ``sm_scale * log2 e``; the chunk's rows rotated and
    rounded to bf16 as the exact rows are stored (or as given when ``new_kv_rotated``); an fp32 output in the rotated
    basis."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape:
        raise ValueError(f"out must have shape {tuple(q.shape)}, got {tuple(out.shape)}")
    n, hq, d = q.shape
    if n == 0 or index.batch == 0 or index.max_new_len == 0:
        return out, None
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qr = _rotate(q, cache.rot_k, hq) * (sm_scale * math.log2(math.e))
    if new_kv_rotated:
        kr, vr = k_new, v_new
    else:
        kr = _rotate(k_new, cache.rot_k, cache.kv_heads).to(torch.bfloat16)
        vr = _rotate(v_new, cache.rot_v, cache.kv_heads).to(torch.bfloat16)
    if kr.stride(-1) != 1 or vr.stride(-1) != 1:
        raise ValueError("k_new/v_new must have a contiguous last dim")
    return out, (qr, kr, vr, torch.empty(n, hq, d, dtype=torch.float32, device=q.device))


def _check(q, k_new, v_new, cache: LayerCache, index: ExtendIndex) -> None:
    n, hq, d = check_query(q, cache)
    hkv = cache.kv_heads
    if k_new.shape != (n, hkv, d) or v_new.shape != (n, hkv, d):
        raise ValueError(f"k_new/v_new must be [{n}, {hkv}, {d}], got {tuple(k_new.shape)} {tuple(v_new.shape)}")
    index.check()


def extend_int2(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    cache: LayerCache, index: ExtendIndex,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    new_kv_rotated: bool = False,
    block_m: int = DEFAULT_BLOCK_M,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = DEFAULT_WARPS,
    num_stages: int = DEFAULT_STAGES,
) -> torch.Tensor:
    """Extend (prefill) attention of each chunk under Design P (see the module docstring).

    Args:
        q: bf16/fp16/fp32 ``[N, Hq, d]`` un-rotated queries of all chunks (sequence ``b`` at rows
            ``index.qo_indptr[b] : index.qo_indptr[b+1]``).
        k_new, v_new: float ``[N, Hkv, d]``, the chunks' own keys/values: un-rotated (rotated here and rounded to
            bf16), or already rotated with ``new_kv_rotated`` (used as given, e.g. the bf16 rows ``quantize_pack``
            stored).
        cache: the layer's :class:`~oscar_kernels.layout.LayerCache` (the chunk's INT2 codes already written).
        index: :class:`ExtendIndex` of the batch.
        sm_scale: softmax scale (default ``1/sqrt(d)``).
        out: optional ``[N, Hq, d]`` output (default: new tensor of ``q.dtype``).
        new_kv_rotated: ``k_new``/``v_new`` are rotated already.
        block_m: rows (tokens x padded GQA group) of the M dimension per program (``DEFAULT_BLOCK_M``; at least one
            token per program).
        block_n, num_warps, num_stages: key tile, warps and pipelining depth (module defaults).

    Returns:
        ``out``: ``[N, Hq, d]`` in the original basis.
    """
    _check(q, k_new, v_new, cache, index)
    n, hq, d = q.shape
    hkv = cache.kv_heads
    g = cache.group_size
    out, rotated = _launch_inputs(q, k_new, v_new, cache, index, sm_scale, out, new_kv_rotated)
    if rotated is None:
        return out
    qr, kr, vr, o_rot = rotated
    bsz, gqa = index.batch, hq // hkv
    fp32_dot = not gpu_codegen(q)
    block_h = triton.next_power_of_2(gqa)
    block_t = max(1, block_m // block_h)
    grid = (bsz, hkv, triton.cdiv(index.max_new_len, block_t))
    k, v = cache.k, cache.v
    _extend_int2_kernel[grid](
        qr, kr, vr, index.qo_indptr, index.q_pos0, index.start,
        k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, *cache.mults, *cache.his,
        cache.k_bf16, cache.v_bf16,
        index.kv_indptr, index.kv_indices, index.bf16_indptr, index.bf16_indices, index.bf16_pos,
        o_rot,
        index.sink, index.recent,
        qr.stride(0), qr.stride(1), kr.stride(0), kr.stride(1), vr.stride(0), vr.stride(1),
        k.codes.stride(0), k.codes.stride(1), k.scale.stride(0), k.scale.stride(1), k.zero.stride(0), k.zero.stride(1),
        v.codes.stride(0), v.codes.stride(1), v.scale.stride(0), v.scale.stride(1), v.zero.stride(0), v.zero.stride(1),
        cache.k_bf16.stride(0), cache.k_bf16.stride(1), cache.v_bf16.stride(0), cache.v_bf16.stride(1),
        o_rot.stride(0), o_rot.stride(1),
        GQA=gqa, BLOCK_H=block_h, BLOCK_T=block_t, HEAD_DIM=d, GROUP_SIZE=g, BLOCK_N=block_n,
        QK_T=tl.float32 if fp32_dot else tl.float16, PV_T=tl.float32 if fp32_dot else tl.bfloat16,
        META_FP8=cache.fp8, BITS_K=k.bits, BITS_V=v.bits, num_warps=num_warps, num_stages=num_stages,
    )
    # back to the original basis: o = o' @ R_V^T (per KV head of each query head)
    out.copy_(_rotate(o_rot, cache.rot_v.transpose(1, 2), hq))
    return out


def extend_int2_ref(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    cache: LayerCache, index: ExtendIndex,
    sm_scale: float | None = None,
    new_kv_rotated: bool = False,
) -> torch.Tensor:
    """Plain fp32 torch definition of :func:`extend_int2`; returns fp32 ``[N, Hq, d]`` (rows with no key: 0)."""
    _check(q, k_new, v_new, cache, index)
    n, hq, d = q.shape
    hkv = cache.kv_heads
    gqa = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    rk = cache.rot_k.float().expand(hkv, d, d)
    rv = cache.rot_v.float().expand(hkv, d, d)
    sink, recent = index.sink, index.recent
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=q.device)
    for b in range(index.batch):
        q0, q1 = int(index.qo_indptr[b]), int(index.qo_indptr[b + 1])
        if q1 == q0:
            continue
        pos0, first = int(index.q_pos0[b]), int(index.start[b])
        sink_end = first + sink
        kn, vn = k_new[q0:q1].float(), v_new[q0:q1].float()
        if not new_kv_rotated:
            kn = torch.einsum("nhd,hde->nhe", kn, rk).to(torch.bfloat16).float()
            vn = torch.einsum("nhd,hde->nhe", vn, rv).to(torch.bfloat16).float()
        sl = index.kv_indices[index.kv_indptr[b]:index.kv_indptr[b + 1]].long()
        sb = index.bf16_indices[index.bf16_indptr[b]:index.bf16_indptr[b + 1]].long()
        k = torch.cat([cache.k.dequantize(sl), cache.k_bf16[sb].float(), kn])
        v = torch.cat([cache.v.dequantize(sl), cache.v_bf16[sb].float(), vn])
        m = q1 - q0
        t = torch.arange(pos0, pos0 + m, device=q.device)[:, None]  # query positions
        j_int2 = (sink_end + torch.arange(sl.numel(), device=q.device))[None, :]
        j_ex = index.bf16_pos[index.bf16_indptr[b]:index.bf16_indptr[b + 1]].long()[None, :]
        j_new = torch.arange(pos0, pos0 + m, device=q.device)[None, :]
        allowed = torch.cat([(j_int2 <= t - recent).expand(m, -1),
                             (j_ex < sink_end) | (j_ex > t - recent),
                             (j_new >= first) & (j_new <= t) & ((j_new < sink_end) | (j_new > t - recent))], dim=1)
        used = allowed.any(0)  # listed keys no query reads may hold anything (the kernel skips their tiles)
        k, v, allowed = k[used], v[used], allowed[:, used]
        for h in range(hq):
            kh = h // gqa
            qr = q[q0:q1, h].float() @ rk[kh]
            sc = ((qr @ k[:, kh].T) * sm_scale).masked_fill(~allowed, float("-inf"))
            p = torch.softmax(sc, dim=-1).nan_to_num(0.0)  # a row with no key (padding) gives 0
            out[q0:q1, h] = (p @ v[:, kh]) @ rv[kh].T
    return out


# ---------------------------------------------------------------------------------------------------------------
# dequantised-prefix path: the INT2 list dequantised once per layer and head group, then one flash-attention loop

DEQUANT_BLOCK_E = 64
"""INT2 positions per program of ``_dequant_list_kernel`` (a bandwidth-bound copy; not swept)."""
DEQUANT_SCRATCH_BYTES = 128 << 20
"""Default bound of the dequantised scratch an :class:`~oscar_kernels.plan.ExtendPlan` allocates: as many KV heads
per pass as fit (2 at Qwen3-8B shapes with a 131k context: fp16 K + bf16 V, 4 bytes per element)."""
DEQ_BLOCK_M = 128
"""Rows (tokens x padded GQA group) per program of the dequantised-prefix kernel (32 tokens x 4 heads at GQA 4).
The four ``DEQ_*`` launch defaults are the best of ``bench_extend.py --sweep`` on an H200 (Qwen3-8B shapes, an 8k
chunk after a 90k prefix: 27.2 ms; block_n 64: 30.2; the fused kernel: 113.1; RESULTS.md, commit f7fc522)."""
DEQ_BLOCK_N = 128
"""Keys per tile of the dequantised-prefix kernel."""
DEQ_WARPS = 8
DEQ_STAGES = 3


@triton.jit
def _dequant_list_kernel(
    KV_INDPTR, KV_INDICES,
    K_CODES, K_SCALE, K_ZERO, V_CODES, V_SCALE, V_ZERO, MULT_K, MULT_V, K_HI, V_HI,
    K_OUT, V_OUT,
    batch, head0,
    stride_kcs, stride_kch, stride_kss, stride_ksh, stride_kzs, stride_kzh,
    stride_vcs, stride_vch, stride_vss, stride_vsh, stride_vzs, stride_vzh,
    stride_oh, stride_on,
    HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_E: tl.constexpr, META_FP8: tl.constexpr,
    BITS_K: tl.constexpr, BITS_V: tl.constexpr,
):
    """Element ``e`` of the batch's INT2 list (all sequences back to back) -> row ``e`` of the scratch, head
    ``head0 + program_id(1)``, in the natural rotated element order: K ``code*s + z`` rounded to fp16 (the QK dot's
    type), V to bf16 (the PV dot's), as the fused kernel rounds them in registers."""
    pe = tl.program_id(0)
    hl = tl.program_id(1)
    kvh = head0 + hl
    n = tl.load(KV_INDPTR + batch)
    if pe * BLOCK_E < n:
        D4: tl.constexpr = HEAD_DIM // 4
        BQ: tl.constexpr = GROUP_SIZE // 4
        offs_m = tl.arange(0, D4)
        col0 = (offs_m // BQ) * GROUP_SIZE + offs_m % BQ
        gidx = offs_m // BQ
        e = pe * BLOCK_E + tl.arange(0, BLOCK_E)
        me = (e < n)[:, None]
        slot = tl.load(KV_INDICES + e, mask=e < n, other=0).to(tl.int64)
        row = hl * stride_oh + e.to(tl.int64)[:, None] * stride_on + col0[None, :]
        mk, mv = head_mults(MULT_K, MULT_V, kvh, META_FP8)
        _dequant_rows(K_CODES, K_SCALE, K_ZERO, K_OUT, slot, kvh, row, me, offs_m, gidx,
                      stride_kcs, stride_kch, stride_kss, stride_ksh, stride_kzs, stride_kzh, mk, K_HI, BQ, META_FP8,
                      BITS_K)
        _dequant_rows(V_CODES, V_SCALE, V_ZERO, V_OUT, slot, kvh, row, me, offs_m, gidx,
                      stride_vcs, stride_vch, stride_vss, stride_vsh, stride_vzs, stride_vzh, mv, V_HI, BQ, META_FP8,
                      BITS_V)


@triton.jit
def _dequant_rows(CODES, SCALE, ZERO, OUT, slot, kvh, row, me, offs_m, gidx,
                  stride_cs, stride_ch, stride_ss, stride_sh, stride_zs, stride_zh, m, HI, BQ: tl.constexpr,
                  META_FP8: tl.constexpr, BITS: tl.constexpr):
    """Slots ``slot`` of one pool (K or V), head ``kvh`` -> ``OUT`` rows ``row`` (element offsets of bit plane 0;
    plane ``j`` at ``+ j * BQ``): ``code * s + z`` in fp32, rounded to ``OUT``'s type (FP8 metadata times the head's
    multiplier ``m``; 4-bit codes with their high plane at ``HI``)."""
    c = tl.load(CODES + slot[:, None] * stride_cs + kvh * stride_ch + offs_m[None, :], mask=me, other=0)
    if BITS == 4:
        ch = tl.load(HI + slot[:, None] * stride_cs + kvh * stride_ch + offs_m[None, :], mask=me, other=0)
    else:
        ch = c
    sc = tl.load(SCALE + slot[:, None] * stride_ss + kvh * stride_sh + gidx[None, :], mask=me, other=0.0)
    z = tl.load(ZERO + slot[:, None] * stride_zs + kvh * stride_zh + gidx[None, :], mask=me, other=0.0)
    sc = meta_f32(sc, m, META_FP8)
    z = meta_f32(z, m, META_FP8)
    for j in tl.static_range(4):
        x = code_plane(c, ch, j, BITS).to(tl.float32) * sc + z
        tl.store(OUT + row + j * BQ, x.to(OUT.dtype.element_ty), mask=me)


@triton.jit
def _online_step(s, m_i, l_i, acc, v, PV_T: tl.constexpr):
    """One online-softmax step over a tile: scores ``s`` [M, N] (base 2, -inf = masked), values ``v`` [N, d]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(PV_T), v.to(PV_T), acc)
    return m_new, l_i, acc


@triton.jit
def _extend_deq_kernel(
    Q, K_NEW, V_NEW, QO_INDPTR, Q_POS0, START,
    K_DEQ, V_DEQ, K_BF16, V_BF16,
    KV_INDPTR, BF16_INDPTR, BF16_INDICES, BF16_POS,
    OUT,
    sink, recent, head0,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_dh, stride_dn,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_on, stride_oh,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, QK_T: tl.constexpr, PV_T: tl.constexpr,
):
    """Design P over the dequantised INT2 list (rows ``kv_indptr[b] + e`` of ``K_DEQ``/``V_DEQ``, head ``program_id(1)``
    of the pass), the cached exact rows and the chunk; the same key sets and masks as ``_extend_int2_kernel``, in the
    natural element order. INT2 tiles every row of the block uses run without masks."""
    b = tl.program_id(0)
    hl = tl.program_id(1)
    kvh = head0 + hl
    mb = tl.program_id(2)
    M: tl.constexpr = BLOCK_T * BLOCK_H
    offs_d = tl.arange(0, HEAD_DIM)

    i0 = mb * BLOCK_T
    q_start, q_len, i1, pos0, first, sink_end, tok, hh, mask_r, t, t_win = _block_rows(
        QO_INDPTR, Q_POS0, START, b, i0, sink, recent, GQA, BLOCK_H, BLOCK_T)
    if i0 < q_len:
        q_rows = Q + (q_start + tok).to(tl.int64)[:, None] * stride_qn + (kvh * GQA + hh)[:, None] * stride_qh
        mq = mask_r[:, None]
        q = tl.load(q_rows + offs_d[None, :], mask=mq, other=0.0).to(QK_T)
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, HEAD_DIM], tl.float32)

        # ---- INT2 (dequantised): element e is position sink_end + e, used iff sink_end + e <= t - recent ----
        kv_start = tl.load(KV_INDPTR + b)
        kv_len = tl.load(KV_INDPTR + b + 1) - kv_start
        n_int2 = _int2_extent(pos0, i1, sink_end, recent, kv_len)
        n_all = _int2_extent(pos0, i0 + 1, sink_end, recent, kv_len)  # the block's first row uses these: every row
        n_all = (n_all // BLOCK_N) * BLOCK_N
        offs_n0 = tl.arange(0, BLOCK_N)
        k_base = K_DEQ + hl * stride_dh + kv_start.to(tl.int64) * stride_dn + offs_d[None, :]
        v_base = V_DEQ + hl * stride_dh + kv_start.to(tl.int64) * stride_dn + offs_d[None, :]
        for e0 in range(0, n_all, BLOCK_N):
            rows = (e0 + offs_n0).to(tl.int64)[:, None] * stride_dn
            k = tl.load(k_base + rows)
            s = tl.dot(q, tl.trans(k.to(QK_T)))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tl.load(v_base + rows)
            acc = tl.dot(p.to(PV_T), v.to(PV_T), acc)
            m_i = m_new
        for e0 in range(n_all, n_int2, BLOCK_N):  # the diagonal band: some rows do not use every key
            offs_n = e0 + offs_n0
            mask_n = offs_n < n_int2
            rows = offs_n.to(tl.int64)[:, None] * stride_dn
            k = tl.load(k_base + rows, mask=mask_n[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k.to(QK_T)))
            s = tl.where(_int2_use(offs_n, mask_n, sink_end, t_win), s, float("-inf"))
            v = tl.load(v_base + rows, mask=mask_n[:, None], other=0.0)
            m_i, l_i, acc = _online_step(s, m_i, l_i, acc, v, PV_T)

        # ---- cached exact rows (prefix sinks and ring): used iff j < sink_end or j > t - recent ----
        bf_start = tl.load(BF16_INDPTR + b)
        bf_len = tl.load(BF16_INDPTR + b + 1) - bf_start
        win_lo = pos0 + i0 - recent
        for e0 in range(0, bf_len, BLOCK_N):
            offs_n = e0 + offs_n0
            mask_n = offs_n < bf_len
            pos = tl.load(BF16_POS + bf_start + offs_n, mask=mask_n, other=0)
            wanted = mask_n & ((pos < sink_end) | (pos > win_lo))
            if tl.max(wanted.to(tl.int32), 0) > 0:
                rows = tl.load(BF16_INDICES + bf_start + offs_n, mask=mask_n, other=0).to(tl.int64)
                mn = mask_n[:, None]
                k = tl.load(K_BF16 + rows[:, None] * stride_kbs + kvh * stride_kbh + offs_d[None, :], mask=mn,
                            other=0.0)
                s = tl.dot(q, tl.trans(k.to(QK_T)))
                s = tl.where(_exact_use(pos, mask_n, sink_end, t_win), s, float("-inf"))
                v = tl.load(V_BF16 + rows[:, None] * stride_vbs + kvh * stride_vbh + offs_d[None, :], mask=mn,
                            other=0.0)
                m_i, l_i, acc = _online_step(s, m_i, l_i, acc, v, PV_T)

        # ---- the chunk itself (exact): its sinks, then the block's windows ----
        n_sink_tiles, w0, n_tiles = _chunk_tiles(pos0, sink_end, i0, i1, recent, BLOCK_N)
        for it in range(0, n_tiles):
            offs_n = _chunk_tile_start(it, n_sink_tiles, w0, BLOCK_N) + offs_n0
            mask_n = offs_n < i1
            rows = (q_start + offs_n).to(tl.int64)
            mn = mask_n[:, None]
            k = tl.load(K_NEW + rows[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=mn, other=0.0)
            s = tl.dot(q, tl.trans(k.to(QK_T)))
            s = tl.where(_chunk_use(offs_n, mask_n, pos0, first, sink_end, t, t_win), s, float("-inf"))
            v = tl.load(V_NEW + rows[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=mn, other=0.0)
            m_i, l_i, acc = _online_step(s, m_i, l_i, acc, v, PV_T)

        inv_l = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        o_rows = OUT + (q_start + tok).to(tl.int64)[:, None] * stride_on + (kvh * GQA + hh)[:, None] * stride_oh
        tl.store(o_rows + offs_d[None, :], acc * inv_l[:, None], mask=mq)


def dequant_scratch(kv_heads: int, head_dim: int, tokens: int, device: torch.device | str,
                    max_bytes: int = DEQUANT_SCRATCH_BYTES, heads: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for :func:`extend_int2_dequant`: fp16 K and bf16 V ``[heads, tokens, d]`` (fp32 both under
    ``TRITON_INTERPRET=1``, where every dot is fp32). ``heads`` (KV heads per pass) defaults to the most, up to
    ``kv_heads``, whose two tensors fit ``max_bytes`` at 2 bytes per element (at least 1)."""
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if heads is None:
        heads = max(1, min(kv_heads, max_bytes // max(4 * tokens * head_dim, 1)))
    if not 1 <= heads <= kv_heads:
        raise ValueError(f"heads per pass must be in [1, {kv_heads}], got {heads}")
    kt, vt = (torch.float32, torch.float32) if interpreting() else (torch.float16, torch.bfloat16)
    return (torch.empty(heads, tokens, head_dim, dtype=kt, device=device),
            torch.empty(heads, tokens, head_dim, dtype=vt, device=device))


def extend_int2_dequant(
    q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
    cache: LayerCache, index: ExtendIndex,
    scratch: tuple[torch.Tensor, torch.Tensor], int2_tokens: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    new_kv_rotated: bool = False,
    block_m: int = DEQ_BLOCK_M,
    block_n: int = DEQ_BLOCK_N,
    num_warps: int = DEQ_WARPS,
    num_stages: int = DEQ_STAGES,
) -> torch.Tensor:
    """:func:`extend_int2` (same arguments, same result up to rounding order) through a dequantised copy of the INT2
    list: per pass of ``h = scratch[0].shape[0]`` KV heads, ``_dequant_list_kernel`` writes every listed INT2 row of
    those heads once (``int2_tokens`` x ``h`` rows, fp16 K / bf16 V, the types the fused kernel rounds them to), then
    ``_extend_deq_kernel`` runs one flash-attention loop over plain tiles, so the dequantisation is paid once per
    cached token and head instead of once per block of queries.

    Args:
        scratch: :func:`dequant_scratch` tensors ``[h, T, d]`` (``T >= int2_tokens``).
        int2_tokens: host bound of the batch's INT2 list length ``kv_indptr[B]`` (sets the dequantisation grid).
        block_m, block_n, num_warps, num_stages: the attention kernel's tiles (``DEQ_*`` defaults).
    """
    _check(q, k_new, v_new, cache, index)
    n, hq, d = q.shape
    hkv = cache.kv_heads
    sk, sv = scratch
    if (sk.dtype, sv.dtype) not in ((torch.float16, torch.bfloat16), (torch.float32, torch.float32)) \
            or sk.shape != sv.shape or sk.dim() != 3 \
            or sk.shape[2] != d or sk.shape[0] > hkv or sk.stride(-1) != 1 or sv.stride() != sk.stride():
        raise ValueError(f"scratch must be dequant_scratch({hkv}, {d}, T) tensors, got {tuple(sk.shape)} "
                         f"{sk.dtype} / {tuple(sv.shape)} {sv.dtype}")
    if not isinstance(int2_tokens, int) or not 0 <= int2_tokens <= sk.shape[1]:
        raise ValueError(f"int2_tokens must be a host int in [0, {sk.shape[1]}] (the scratch's rows), "
                         f"got {int2_tokens!r}")
    out, rotated = _launch_inputs(q, k_new, v_new, cache, index, sm_scale, out, new_kv_rotated)
    if rotated is None:
        return out
    qr, kr, vr, o_rot = rotated
    bsz, gqa = index.batch, hq // hkv
    fp32_dot = not gpu_codegen(q)
    block_h = triton.next_power_of_2(gqa)
    block_t = max(1, block_m // block_h)
    k, v = cache.k, cache.v
    per_pass = sk.shape[0]
    for h0 in range(0, hkv, per_pass):
        heads = min(per_pass, hkv - h0)
        if int2_tokens:
            _dequant_list_kernel[(triton.cdiv(int2_tokens, DEQUANT_BLOCK_E), heads)](
                index.kv_indptr, index.kv_indices,
                k.codes, k.scale, k.zero, v.codes, v.scale, v.zero, *cache.mults, *cache.his,
                sk, sv, bsz, h0,
                k.codes.stride(0), k.codes.stride(1), k.scale.stride(0), k.scale.stride(1),
                k.zero.stride(0), k.zero.stride(1),
                v.codes.stride(0), v.codes.stride(1), v.scale.stride(0), v.scale.stride(1),
                v.zero.stride(0), v.zero.stride(1),
                sk.stride(0), sk.stride(1),
                HEAD_DIM=d, GROUP_SIZE=cache.group_size, BLOCK_E=DEQUANT_BLOCK_E, META_FP8=cache.fp8,
                BITS_K=k.bits, BITS_V=v.bits,
            )
        _extend_deq_kernel[(bsz, heads, triton.cdiv(index.max_new_len, block_t))](
            qr, kr, vr, index.qo_indptr, index.q_pos0, index.start,
            sk, sv, cache.k_bf16, cache.v_bf16,
            index.kv_indptr, index.bf16_indptr, index.bf16_indices, index.bf16_pos,
            o_rot,
            index.sink, index.recent, h0,
            qr.stride(0), qr.stride(1), kr.stride(0), kr.stride(1), vr.stride(0), vr.stride(1),
            sk.stride(0), sk.stride(1),
            cache.k_bf16.stride(0), cache.k_bf16.stride(1), cache.v_bf16.stride(0), cache.v_bf16.stride(1),
            o_rot.stride(0), o_rot.stride(1),
            GQA=gqa, BLOCK_H=block_h, BLOCK_T=block_t, HEAD_DIM=d, BLOCK_N=block_n,
            QK_T=tl.float32 if fp32_dot else tl.float16, PV_T=tl.float32 if fp32_dot else tl.bfloat16,
            num_warps=num_warps, num_stages=num_stages,
        )
    out.copy_(_rotate(o_rot, cache.rot_v.transpose(1, 2), hq))
    return out
