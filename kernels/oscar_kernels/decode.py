"""Split-KV (flash-decoding) attention of one new query per sequence over an INT2 cache plus its exact rows: the
launcher :func:`decode_int2` and its definition :func:`decode_int2_ref`.

Math, for sequence ``b`` and query head ``h`` (KV head ``kh = h // (Hq / Hkv)``): the query is rotated,
``q' = q @ R_K[kh]``; cached keys and values are held rotated (``k' = k R_K``, ``v' = v R_V``), so
``q'.k' = q.k`` and ``o = softmax(sm_scale * q' K'^T) V' R_V^T``.  Keys/values are either INT2 slots
(``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, dequantised ``x_hat = code*s + z``) or exact bf16 rows
(``bf16_indices[bf16_indptr[b]:bf16_indptr[b+1]]``: sinks and the recent window, Design P, see
:mod:`oscar_kernels.plan`). Every listed element is attended: which positions are exact is the plan's business.

One call is three launches, none waiting on the host, so it can be captured in a CUDA graph:

1. the query rotation (:mod:`oscar_kernels.decode_merge`), unless the step's K/V write has rotated ``q`` already;
2. the split kernel, grid ``(B, Hkv, max_splits + exact_splits)`` (:mod:`oscar_kernels.decode_grid`): each
   program attends one INT2 split or one share of the exact rows of a sequence for all ``Hq / Hkv`` query heads of
   its KV head and writes a normalised partial and its base-2 log-sum-exp. Row scales (``g = d >= 128``) take the
   row-scale kernel: on CUDA the Gluon one of :mod:`oscar_kernels.decode_async` (tiles through shared memory by
   ``cp.async``; the :class:`~oscar_kernels.scheme.DecodeOptions` apply to it), elsewhere the Triton one of
   :mod:`oscar_kernels.decode_split`; other groups take the general kernel there;
3. the merge of each head's partials by log-sum-exp and the rotation back by ``R_V^T``
   (:mod:`oscar_kernels.decode_merge`).

Exact vs approximate: the ``_ref`` dequantises to fp32 and works in fp32. On GPU the kernels round ``q'``
to fp16 and ``p*s`` to fp16 (fast path) or bf16 (general path) for the tensor-core dots (fp32
accumulation), rotate ``q`` with tf32x3 dots and ``o`` with tf32 dots: relative output error ~1e-3, tested
at <= 1e-2. Under ``TRITON_INTERPRET=1`` every dot runs in fp32 and the fast path skips the fp16 offset,
so it matches the reference to ~1e-6. Only a GPU run exercises the PTX unpacks (``MAGIC`` / ``PTX_UNPACK``), the
fp16/bf16 dot operands, the register cap and the 64-bit offsets' real range. ``int8_scores`` and ``int8_values``
change the numerics on purpose; ``decode_int2_ref(options=...)`` defines them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from . import decode_async
from .decode_grid import DecodeIndex, decode_workspace, row_path
from .decode_merge import merge, merge_shape
from .decode_merge import rotate_q as rotate_query
from .decode_split import launch_general, launch_rows
from .layout import LayerCache, cached_rows_ref, check_query, gpu_codegen
from .scheme import DecodeOptions, cuda_head_dim_refusal

LOG2E = math.log2(math.e)
"""The kernels' softmax runs in base 2: the rotated query carries ``sm_scale * LOG2E``."""
SMALL_BATCH_WARPS = 2
"""General path: warps per split program when ``batch * kv_heads <= 16`` (faster there, slower at larger
batches)."""
GENERAL_WARPS = 4
"""General path: warps per split program otherwise (the other side of the ``SMALL_BATCH_WARPS`` measurement)."""
GENERAL_STAGES = 2
"""General path: Triton pipelining depth (the depth every general-path measurement ran at)."""
GENERAL_MIN_BLOCK_H = 16
"""General path: the GQA group is padded to 16 rows, the M minimum of the tensor-core dots it was tuned with."""
DEFAULT_BLOCK_N = 128
"""General path: INT2 tokens per tile (128 beat 32 and 64 at every measured shape but bs1/8k)."""
BF16_BLOCK_N = 32
"""Both paths: exact rows per tile of an exact program (a 128-wide bf16 tile of 8 KB; not swept: the exact rows
are a few hundred, off the critical path at long contexts)."""
ROWS_BLOCK_N = 128
"""Row-scale path: INT2 tokens per tile (128 beat 64 at every swept shape)."""
ROWS_WARPS = 1
"""Row-scale path: warps per split program: one warp keeps every reduction inside the warp (faster than 2 or 4)."""
ROWS_STAGES = 1
"""Row-scale Triton kernel: pipelining depth (cp.async stages 2 and 3 were slower at every swept shape)."""
ROWS_MIN_BLOCK_H = 2
"""Row-scale path: smallest head-tile width (the tensor-core dot pads to 8 inside the instruction anyway)."""
ROWS_CAPPED_PROGRAMS = 2048
"""Row-scale path: from this many launched split programs (``B * Hkv * max_splits``) on, registers are capped at
``ROWS_MAX_REGISTERS`` for more resident warps (faster at large batches, slower at batch 1)."""
ROWS_MAX_REGISTERS = 168
"""Row-scale path: the register cap (Triton ``maxnreg``; 128 and 144 did not beat it)."""
ROWS_ASYNC = True
"""Row-scale path on CUDA: the Gluon split kernel of :mod:`oscar_kernels.decode_async` where it covers the launch
(each next tile's code words travel by ``cp.async`` while a tile computes: faster at every measured shape)."""


@dataclass(frozen=True)
class DecodeLaunch:
    """Launch parameters of :func:`decode_int2` that tests and benchmarks set (None: the measured default of the
    path); what serving sets is :class:`~oscar_kernels.scheme.DecodeOptions`.

    * ``block_n``: INT2 tokens per tile of the split kernel (``ROWS_BLOCK_N``; general path ``DEFAULT_BLOCK_N``);
    * ``block_nb``: exact rows per tile (``BF16_BLOCK_N``);
    * ``num_warps``: warps per split program (``ROWS_WARPS``; general path ``SMALL_BATCH_WARPS`` /
      ``GENERAL_WARPS``);
    * ``merge_chunk``, ``merge_cols``: partials the merge reads per step and output columns per merge program,
      powers of two (:func:`~oscar_kernels.decode_merge.merge_shape`);
    * ``ptx_unpack``: general path: unpack codes with the PTX magic-number trick (default: on CUDA at ``g = d``);
    * ``async_tiles``: row-scale path on CUDA: the Gluon split kernel where it covers the launch
      (:func:`~oscar_kernels.decode_async.usable`; ``ROWS_ASYNC``); False runs the Triton one.
    """

    block_n: int | None = None
    block_nb: int | None = None
    num_warps: int | None = None
    merge_chunk: int | None = None
    merge_cols: int | None = None
    ptx_unpack: bool | None = None
    async_tiles: bool = ROWS_ASYNC


def decode_int2(
    q: torch.Tensor,
    cache: LayerCache,
    index: DecodeIndex,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    sm_scale: float | None = None,
    options: DecodeOptions = DecodeOptions(),
    rotate_q: bool = True,
    row_kernel: bool | None = None,
    launch: DecodeLaunch = DecodeLaunch(),
) -> torch.Tensor:
    """Decode attention of one query per sequence over its INT2 slots and exact rows.

    Args:
        q: bf16/fp16/fp32 ``[B, Hq, d]`` un-rotated queries (``Hq`` a multiple of ``Hkv``; any strides).
        cache: the layer's :class:`~oscar_kernels.layout.LayerCache` (INT2 pools, exact rows, rotations).
        index: :class:`~oscar_kernels.decode_grid.DecodeIndex` of the batch (lists, per-sequence split counts,
            ``max_splits``).
        workspace: optional :func:`~oscar_kernels.decode_grid.decode_workspace` ``(B, Hq, d, index.max_splits,
            exact_splits=index.exact_splits)`` buffers, to avoid allocations inside a captured graph.
        out: optional ``[B, Hq, d]`` output (default: new tensor of ``q.dtype``).
        sm_scale: softmax scale (default ``1/sqrt(d)``).
        options: :class:`~oscar_kernels.scheme.DecodeOptions`: ``int8_scores``, ``int8_values``, ``fused_update``,
            ``lean_tiles`` and ``movmatrix`` apply to the Gluon split kernel (elsewhere the launch computes the
            default numerics); ``num_stages`` (shared-memory stages of the Gluon kernel, 2 or 3; Triton pipelining
            depth of the Triton row-scale kernel) and ``max_registers`` (the row-scale split kernel's register cap;
            None: ``ROWS_MAX_REGISTERS`` from ``ROWS_CAPPED_PROGRAMS`` launched split programs on; 0: none) to
            both row-scale kernels. ``split_tokens`` is the plan's (:class:`~oscar_kernels.plan.DecodePlan`).
        rotate_q: ``False``: the workspace's ``q_rot`` already holds ``q @ R_K * sm_scale * log2(e)`` (fp32, e.g.
            written by the step's K/V write launch, as :meth:`~oscar_kernels.plan.DecodePlan.run` does), so the
            query rotation launch is skipped; ``q`` then only gives the shapes and the output dtype.
        row_kernel: use the row-scale path (default: :func:`~oscar_kernels.decode_grid.row_path`); ``False``
            forces the general path.
        launch: :class:`DecodeLaunch`, the tiles, warps and merge shape (defaults: the measured ones).

    Returns:
        ``out``: ``[B, Hq, d]``, attention output in the original (un-rotated) basis.
    """
    bsz, hq, d = check_query(q, cache)
    if q.is_cuda and (why := cuda_head_dim_refusal(d)) is not None:
        raise ValueError(f"decode_int2: {why}")
    hkv = cache.kv_heads
    index.check(bsz)
    merge_chunk, merge_cols = merge_shape(index.parts, bsz * hq, d, launch.merge_chunk, launch.merge_cols)
    gqa = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    row_kernel = row_path(cache, row_kernel)
    max_splits = index.max_splits
    parts = index.parts
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape:
        raise ValueError(f"out must have shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if workspace is None:
        workspace = decode_workspace(bsz, hq, d, max_splits, q.device, index.exact_splits)
    part_o, part_lse, q_rot = workspace
    if part_o.shape != (bsz, hq, parts, d) or part_lse.shape != (bsz, hq, parts) or q_rot.shape != (bsz, hq, d) \
            or part_o.stride(-1) != 1 or part_lse.stride(-1) != 1 or q_rot.stride(-1) != 1 \
            or any(t.dtype != torch.float32 for t in workspace):
        raise ValueError(f"workspace must be decode_workspace({bsz}, {hq}, {d}, {max_splits}, exact_splits="
                         f"{index.exact_splits})")
    if bsz == 0:
        return out
    fp32_dot = not gpu_codegen(q)
    two_bit = cache.k.bits == cache.v.bits == 2
    if not two_bit and not options.exact:
        raise ValueError(f"decode options {options.describe()} read 2-bit codes only (int8 operands of one plane); "
                         f"this layer has {cache.k.bits}-bit keys and {cache.v.bits}-bit values: use the default "
                         "options")
    per_seq_exact = index.num_exact is not None
    num_exact = index.num_exact if per_seq_exact else index.num_splits  # not read without per-sequence counts
    if rotate_q:
        rotate_query(q, cache.rot_k, q_rot, sm_scale * LOG2E, hkv)
    split_args = (q_rot, cache, index, part_o, part_lse, num_exact)
    if row_kernel:
        max_registers = options.max_registers
        if max_registers is None and bsz * hkv * max_splits >= ROWS_CAPPED_PROGRAMS:
            max_registers = ROWS_MAX_REGISTERS
        block_h = max(ROWS_MIN_BLOCK_H, triton.next_power_of_2(gqa))
        if launch.async_tiles and not fp32_dot and decode_async.usable(
                d, launch.block_n, launch.block_nb, launch.num_warps, options.num_stages):
            decode_async.launch(*split_args, block_h=block_h, options=options, max_registers=max_registers)
        else:
            launch_rows(*split_args, block_h=block_h, block_n=launch.block_n or ROWS_BLOCK_N,
                        block_nb=launch.block_nb or BF16_BLOCK_N, fp32_dot=fp32_dot,
                        num_warps=launch.num_warps or ROWS_WARPS, num_stages=options.num_stages or ROWS_STAGES,
                        max_registers=max_registers)
    else:
        num_warps = launch.num_warps
        if num_warps is None:
            num_warps = SMALL_BATCH_WARPS if bsz * hkv <= 16 else GENERAL_WARPS
        ptx_unpack = launch.ptx_unpack
        if ptx_unpack is None:
            ptx_unpack = not fp32_dot and cache.group_size == d
        launch_general(*split_args, block_h=max(GENERAL_MIN_BLOCK_H, triton.next_power_of_2(gqa)),
                       block_n=launch.block_n or DEFAULT_BLOCK_N, block_nb=launch.block_nb or BF16_BLOCK_N,
                       fp32_dot=fp32_dot, ptx_unpack=bool(ptx_unpack), num_warps=num_warps,
                       num_stages=options.num_stages or GENERAL_STAGES)
    merge(part_o, part_lse, index.num_splits, num_exact, index.exact_splits, per_seq_exact, cache.rot_v, hkv, out,
          merge_chunk, merge_cols)
    return out


VALUE_TILE = 128
"""``int8_values``: INT2 rows per tile of the variant's definition (the Gluon kernel's; splits cover whole tiles)."""


def value_dither(n: int = VALUE_TILE) -> torch.Tensor:
    """``int8_values``' rounding dither of a tile's rows ``0..n-1``: ``(bitreverse7(r) + 1/2) / 128``, in [0, 1), so
    that rounding down after adding it is unbiased over a tile (plain rounding would drop every probability under
    half a step: a few percent of a sharp head's mass)."""
    r = torch.arange(n)
    rev = torch.zeros_like(r)
    for b in range(7):
        rev |= ((r >> b) & 1) << (6 - b)
    return (rev.float() + 0.5) / 128


def int8_value_weights(s: torch.Tensor, scale: torch.Tensor, m: torch.Tensor | float = 0.0) -> torch.Tensor:
    """``int8_values``' weights of the INT2 rows' codes (in place of ``exp(s - m) * scale``): for each
    ``VALUE_TILE`` rows of scores ``s`` (natural log units, fp32 ``[n]``) and value scales ``scale`` (``[n]``),
    ``floor(exp(s - max s) * scale * 127 / max scale + u) * max scale / 127 * exp(max s - m)`` with ``u`` the row's
    :func:`value_dither`, i.e. each probability times its scale in int8 steps of 1/127 of the tile's largest
    probability times its largest scale, rounded without bias."""
    w = torch.zeros_like(s)
    dither = value_dither().to(s.device)
    for t in range(0, s.numel(), VALUE_TILE):
        st, vs = s[t:t + VALUE_TILE], scale[t:t + VALUE_TILE].float()
        tm, vmax = st.max(), vs.max()
        if vmax > 0:
            n = torch.floor(torch.exp(st - tm) * (vs * (127.0 / vmax)) + dither[:st.numel()])
            w[t:t + VALUE_TILE] = n * (vmax / 127.0) * torch.exp(tm - m)
    return w


def decode_int2_ref(q: torch.Tensor, cache: LayerCache, index: DecodeIndex, sm_scale: float | None = None,
                    options: DecodeOptions = DecodeOptions()) -> torch.Tensor:
    """Plain fp32 torch definition of :func:`decode_int2` (split counts do not change the result); returns fp32
    ``[B, Hq, d]``. Of the ``options``, ``int8_scores`` and ``int8_values`` define the result (``fused_update`` rounds
    within the latter's dithered rounding, the others only change how it is computed). ``int8_scores``: that variant's
    definition: the INT2 rows' code terms ``scale * (c . q')`` use each head's rotated query rounded to int8 steps of
    ``max |q'| / 127``; their zero terms ``zero * sum(q')`` and the exact rows' scores use it as is. ``int8_values`` (row scales only): the INT2 rows' value code terms
    ``p * scale * c`` weigh each code by :func:`int8_value_weights` instead (tiles of ``VALUE_TILE`` rows from the
    start of the sequence's INT2 list); their zero terms ``p * zero``, the exact rows and the softmax's sum use the
    probabilities as they are."""
    bsz, hq, d = q.shape
    hkv = cache.kv_heads
    int8_scores, int8_values = options.int8_scores, options.int8_values
    if int8_values and cache.v.group_size != d:
        raise ValueError(f"int8_values is defined for one value scale per row (group size {d}), "
                         f"got group size {cache.v.group_size}")
    gqa = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    rk = cache.rot_k.float().expand(hkv, d, d)
    rv = cache.rot_v.float().expand(hkv, d, d)
    out = torch.empty(bsz, hq, d, dtype=torch.float32, device=q.device)
    lists = (index.kv_indptr, index.kv_indices, index.bf16_indptr, index.bf16_indices)
    for b in range(bsz):
        k = cached_rows_ref(cache.k, cache.k_bf16, *lists, b)
        v = cached_rows_ref(cache.v, cache.v_bf16, *lists, b)
        n_int2 = int(index.kv_indptr[b + 1] - index.kv_indptr[b])
        sl = index.kv_indices[index.kv_indptr[b]:index.kv_indptr[b + 1]].long()
        if int8_scores:  # the INT2 rows' zeros, per element
            zero = cache.k.scale_zero(sl)[1].repeat_interleave(cache.k.group_size, -1)  # [n_int2, Hkv, d]
        if int8_values:  # the INT2 rows' value codes, their scales and zeros
            vc = cache.v.code_values(sl)  # [n_int2, Hkv, d]
            vsc, vz = (t[..., 0] for t in cache.v.scale_zero(sl))  # [n_int2, Hkv]
        for h in range(hq):
            kh = h // gqa
            qr = q[b, h].float() @ rk[kh]
            s = k[:, kh] @ qr
            if int8_scores:
                step = qr.abs().max() / 127
                step = step if step > 0 else step.new_tensor(1.0)
                z = zero[:, kh]
                s[:n_int2] = (k[:n_int2, kh] - z) @ (torch.round(qr / step) * step) + z @ qr
            if int8_values:
                sn = s * sm_scale
                m = sn.max()
                p = torch.exp(sn - m)
                w = int8_value_weights(sn[:n_int2], vsc[:, kh], m)
                o = w @ vc[:, kh] + p[:n_int2] @ vz[:, kh, None].expand(-1, d) + p[n_int2:] @ v[n_int2:, kh]
                out[b, h] = (o / p.sum()) @ rv[kh].T
                continue
            p = torch.softmax(s * sm_scale, dim=0)
            out[b, h] = (p @ v[:, kh]) @ rv[kh].T
    return out
