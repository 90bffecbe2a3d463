"""The decode step's first and last launches around the split kernels: the query rotation and the merge.

* ``_rotate_q_kernel``, grid ``(B, Hkv)``: ``q' = q @ R_K[kh] * sm_scale * log2(e)`` once per query head (fp32,
  tf32x3 dots, base-2 softmax units) into the workspace's ``q_rot``. Skipped (``decode_int2(rotate_q=False)``) when
  the step's K/V write launch has written ``q'`` already (:func:`oscar_kernels.write.quantize_pack_kv` with ``q``).
* ``_decode_int2_merge_kernel``, grid ``(B, Hq, d / cols)``: merges sequence ``b``'s ``n_b`` INT2 partials and its
  ``e_b`` exact ones of one query head by log-sum-exp (the partials of programs that exited are never read) and
  rotates the result back by ``R_V^T`` in the same program, ``cols`` output columns of it per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_common import split_counts

Q_ROT_BLOCK_C = 64
"""Query rotation: output columns per ``tl.dot`` (``R_K`` read in ``d / 64`` pieces to bound registers; not swept:
one small program per sequence and KV head)."""
Q_ROT_WARPS = 4
"""Query rotation: warps per program (not swept, as ``Q_ROT_BLOCK_C``)."""
MERGE_SPLIT_CHUNK = 32
"""Merge: fewest partials read per loop step (8 or 16 per step measured slower; :func:`merge_chunk_for`)."""
MERGE_MAX_CHUNK = 128
"""Merge: most partials read per loop step by default: a one-sequence batch's ~130 partials in one step (256, with
8 warps, measured level)."""
MERGE_WARPS = 4
"""Merge: warps per program up to 128 partials per step (not swept); see :func:`merge_warps`."""
MERGE_ROT_ROWS = 64
"""Merge: output columns per piece of the ``R_V^T`` product (bounds the registers of the loaded rows)."""
MERGE_MIN_PROGRAMS = 128
"""Merge: programs aimed for (about one per SM of an H200), by giving each head's output columns to several
programs (:func:`merge_columns`; faster at batch 1, level from batch 16 on)."""
MERGE_MIN_COLS = 32
"""Merge: fewest output columns per program (the smallest measured)."""


def merge_chunk_for(parts: int) -> int:
    """Default merge step: the partials' count rounded up to a power of two, within ``[MERGE_SPLIT_CHUNK,
    MERGE_MAX_CHUNK]`` (one step up to 128 partials)."""
    return min(MERGE_MAX_CHUNK, max(MERGE_SPLIT_CHUNK, triton.next_power_of_2(max(parts, 1))))


def merge_warps(chunk: int) -> int:
    """Warps of a merge program reading ``chunk`` partials per step: ``MERGE_WARPS``, and one per 32 partials beyond
    (8 at 256: 128 fp32 of the ``[chunk, d]`` tile per thread at d = 128, as 4 warps hold at 128)."""
    return max(MERGE_WARPS, chunk // 32)


@triton.jit
def _rotate_q_kernel(
    Q, ROT_K, QN, qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_rh, stride_rr, stride_rc,
    stride_qnb, stride_qnh,
    GQA: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_C: tl.constexpr,
    ROT_PER_HEAD: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, BLOCK_C)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_h[:, None], other=0.0).to(tl.float32)
    r_rows = ROT_K + (kvh * stride_rh if ROT_PER_HEAD else 0) + offs_d[:, None] * stride_rr
    for c in tl.static_range(0, HEAD_DIM, BLOCK_C):
        r = tl.load(r_rows + (c + offs_c)[None, :] * stride_rc)
        qn = tl.dot(q, r, input_precision="tf32x3") * qk_scale
        tl.store(QN + b * stride_qnb + heads[:, None] * stride_qnh + (c + offs_c)[None, :], qn, mask=mask_h[:, None])


@triton.jit
def _decode_int2_merge_kernel(
    PART_O, PART_LSE, NUM_SPLITS, NUM_EXACT, ROT_V, OUT,
    parts, exact_splits,
    stride_pob, stride_poh, stride_pos,
    stride_plb, stride_plh,
    stride_rh, stride_rr, stride_rc,
    stride_ob, stride_oh, stride_od,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, ROT_PER_HEAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, ROT_ROWS: tl.constexpr, COLS: tl.constexpr, PER_SEQ_EXACT: tl.constexpr,
):
    """The merge of one (sequence, query head), output columns ``[c * COLS, (c + 1) * COLS)``: partial weights from
    every LSE at once, the weighted sum of the partials ``SPLIT_CHUNK`` at a time (independent loads), then those
    columns of ``o = o' @ R_V^T`` as fp32 multiply-sums (their ``R_V`` rows loaded first when ``COLS <= ROT_ROWS``).
    With ``COLS < d`` each of the ``d / COLS`` programs of a head merges the whole ``o'`` (the partials are read from
    L2 that many times) and rotates its share."""

    b = tl.program_id(0)
    h = tl.program_id(1)
    col = tl.program_id(2) * COLS
    kvh = h // GQA
    offs_d = tl.arange(0, HEAD_DIM)
    r_base = ROT_V + (kvh * stride_rh if ROT_PER_HEAD else 0)
    offs_r = tl.arange(0, ROT_ROWS)
    # the rotation's rows, when they are one piece, load first: their HBM trip overlaps the partials' L2 reads
    # (once the layer's weights have passed through the L2, R_V comes from HBM every step)
    if ROT_ROWS == COLS:
        r_pre = tl.load(r_base + (col + offs_r)[:, None] * stride_rr + offs_d[None, :] * stride_rc)
    num_splits, num_exact = split_counts(NUM_SPLITS, NUM_EXACT, b, parts, exact_splits, PER_SEQ_EXACT)
    total = num_splits + num_exact  # partials [0, n) INT2, [n, n + e) exact
    offs_p = tl.arange(0, BLOCK_P)
    lse_row = PART_LSE + b * stride_plb + h * stride_plh
    lse = tl.load(lse_row + offs_p, mask=offs_p < total, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_sum = tl.sum(tl.exp2(lse - m), 0)
    o_row = PART_O + b * stride_pob + h * stride_poh
    o = tl.zeros([HEAD_DIM], tl.float32)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    for c0 in range(0, total, SPLIT_CHUNK):
        idx = c0 + offs_c
        ok = idx < total
        w_c = tl.exp2(tl.load(lse_row + idx, mask=ok, other=float("-inf")) - m)
        tile = tl.load(o_row + idx[:, None] * stride_pos + offs_d[None, :], mask=ok[:, None], other=0.0)
        o += tl.sum(w_c[:, None] * tile, 0)
    o = o * tl.where(w_sum > 0.0, 1.0 / tl.where(w_sum > 0.0, w_sum, 1.0), 0.0)
    for c in tl.static_range(0, COLS, ROT_ROWS):  # out[c] = sum_k o'[k] R_V[c, k]
        if ROT_ROWS == COLS:
            r = r_pre
        else:
            r = tl.load(r_base + (col + c + offs_r)[:, None] * stride_rr + offs_d[None, :] * stride_rc)
        out = tl.sum(r * o[None, :], 1)
        tl.store(OUT + b * stride_ob + h * stride_oh + (col + c + offs_r) * stride_od, out.to(OUT.dtype.element_ty))


def merge_shape(parts: int, heads: int, head_dim: int, chunk: int | None = None,
                cols: int | None = None) -> tuple[int, int]:
    """The merge's partials per step and output columns per program (defaults :func:`merge_chunk_for` and
    :func:`merge_columns`), checked: powers of two, ``cols`` at most ``head_dim``."""
    if chunk is None:
        chunk = merge_chunk_for(parts)
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"merge_chunk must be a power of two >= 1, got {chunk}")
    if cols is None:
        cols = merge_columns(heads, head_dim)
    if cols < 1 or cols & (cols - 1):
        raise ValueError(f"merge_cols must be a power of two >= 1, got {cols}")
    return chunk, min(head_dim, cols)


def rotate_q(q: torch.Tensor, rot_k: torch.Tensor, q_rot: torch.Tensor, qk_scale: float, kv_heads: int) -> None:
    """``q_rot[b, h] = q[b, h] @ rot_k[h // gqa] * qk_scale`` in one launch: q ``[B, Hq, d]`` (any float dtype and
    strides), rot_k fp32 ``[kv_heads or 1, d, d]``, q_rot fp32 ``[B, Hq, d]`` with a contiguous last dim."""
    bsz, hq, d = q.shape
    gqa = hq // kv_heads
    _rotate_q_kernel[(bsz, kv_heads)](
        q, rot_k, q_rot, qk_scale,
        *q.stride(), *rot_k.stride(), q_rot.stride(0), q_rot.stride(1),
        GQA=gqa, BLOCK_H=triton.next_power_of_2(gqa), HEAD_DIM=d, BLOCK_C=min(d, Q_ROT_BLOCK_C),
        ROT_PER_HEAD=rot_k.shape[0] > 1, num_warps=Q_ROT_WARPS,
    )


def merge(part_o: torch.Tensor, part_lse: torch.Tensor, num_splits: torch.Tensor, num_exact: torch.Tensor,
          exact_splits: int, per_seq_exact: bool, rot_v: torch.Tensor, kv_heads: int, out: torch.Tensor,
          chunk: int, cols: int) -> None:
    """``out`` ``[B, Hq, d]`` from the partials ``part_o`` fp32 ``[B, Hq, P, d]`` / ``part_lse`` fp32 ``[B, Hq, P]``
    of the counts ``num_splits`` / ``num_exact`` int32 ``[B]`` (``num_exact`` read only with ``per_seq_exact``),
    rotated back by ``rot_v`` fp32 ``[kv_heads or 1, d, d]``; ``chunk``, ``cols`` from :func:`merge_shape`."""
    bsz, hq, parts, d = part_o.shape
    _decode_int2_merge_kernel[(bsz, hq, d // cols)](
        part_o, part_lse, num_splits, num_exact, rot_v, out,
        parts, exact_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        *rot_v.stride(),
        *out.stride(),
        GQA=hq // kv_heads, HEAD_DIM=d, BLOCK_P=triton.next_power_of_2(parts), ROT_PER_HEAD=rot_v.shape[0] > 1,
        SPLIT_CHUNK=chunk, ROT_ROWS=min(cols, MERGE_ROT_ROWS), COLS=cols, PER_SEQ_EXACT=per_seq_exact,
        num_warps=merge_warps(chunk),
    )


def merge_columns(heads: int, head_dim: int) -> int:
    """Output columns per merge program for ``heads = B * Hq`` merged heads (see ``MERGE_MIN_PROGRAMS``)."""
    cols = triton.next_power_of_2(head_dim)
    while cols > MERGE_MIN_COLS and heads * triton.cdiv(head_dim, cols) < MERGE_MIN_PROGRAMS:
        cols //= 2
    return min(cols, head_dim)
