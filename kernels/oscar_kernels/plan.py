"""Plan once per batch, run once per layer: the index lists of Design P filled on the device, no host sync.

A batch is described as the serving engine holds it (SGLang's ``ForwardBatch``): ``req_to_token`` int32
``[R, max_ctx]`` (slot of each position of each request), ``req_pool_indices`` int ``[B]`` (the request of each
sequence, which also owns exact region ``req`` of the :class:`~oscar_kernels.pool.Int2KVPool`), lengths, the slots
of the new tokens and, under left padding, ``start`` (position of each sequence's first real token; default 0).
With ``sink_end = start + sink``, a chunk of new tokens at positions ``[c0, c1)`` (decode: ``c0 = n - 1``,
``c1 = n``) reads, per Design P (see :mod:`oscar_kernels.extend`):

* INT2 slots of positions ``[sink_end, max(sink_end, c1 - recent))``;
* exact rows of the sinks ``[start, min(sink_end, c_end))`` and of the ring ``[max(sink_end, c0 + 1 - recent),
  c_end)``, where ``c_end = c1`` for decode (the new token's row is written before the attention) and ``c_end = c0``
  for extend (the chunk's own rows come straight from the chunk);
* after an extend, the chunk's rows that stay exact (``p < sink_end`` or ``p >= c1 - recent``) are written to
  their region rows (the others get -1). Writing the ring before the attention would overwrite rows that earlier
  queries of the chunk still read.

``plan`` launches two small kernels: ``_plan_lengths_kernel`` (one program: every list's length, the split counts,
and the ``indptr`` arrays by ``tl.cumsum``) and ``_plan_fill_kernel`` (one program per sequence and 4096 INT2
positions: slots from ``req_to_token``; the first also exact rows from :func:`~oscar_kernels.layout.exact_row`,
positions, and the chunk's exact rows).
All buffers are allocated at construction; ``plan`` and ``run`` only launch kernels on them (host ints: batch size,
token count, length bounds), so ``DecodePlan.run`` can be captured in a CUDA graph and replayed after ``plan`` is
called again (eagerly) with new lengths for the same batch size. Lengths beyond the construction's
``max_seq_len`` are clamped to it (the lists would not fit): the caller's contract is ``seq_lens <= max_seq_len``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .decode import DEFAULT_BLOCK_N as DECODE_GENERAL_BLOCK_N
from .decode import LOG2E, ROWS_BLOCK_N, DecodeLaunch, decode_int2
from .decode_grid import (
    EXACT_BALANCE,
    EXACT_ROWS_PER_TILE,
    EXACT_SPLIT_ROWS,
    MIN_SPLIT_TOKENS,
    DecodeIndex,
    balance_count,
    row_path,
    split_count,
    split_policy,
)
from .extend import (
    DEFAULT_BLOCK_M,
    DEFAULT_BLOCK_N,
    DEQUANT_SCRATCH_BYTES,
    ExtendIndex,
    dequant_scratch,
    extend_int2,
    extend_int2_dequant,
)
from .layout import exact_row, exact_row_ref
from .pool import Int2KVPool
from .scheme import DecodeOptions
from .write import DECODE_WRITE

FILL_BLOCK = 512
"""Positions per step of ``_plan_fill_kernel``'s loops (the block of SGLang's ``create_flashinfer_kv_indices_triton``;
not measured here: the fill runs once per batch, not per layer)."""
FILL_PART = 4096
"""INT2 positions of a sequence per ``_plan_fill_kernel`` program (grid ``[B, ceil(max_seq_len / FILL_PART)]``).
One program per sequence looped over all of them: 84 µs per step at bs1/100k in SGLang's profile on an H200
(commit a76f86a; 1.4% of the step), eight dependent 512-position steps at most now."""


@triton.jit
def _ranges(c0, ext, first, max_len, SINK: tl.constexpr, RECENT: tl.constexpr, DECODE: tl.constexpr):
    """Design P position ranges of a chunk ``[c0, c0 + ext)``: INT2, exact sinks, exact ring (half-open)."""
    c1 = tl.minimum(c0 + ext, max_len)
    sink_end = first + SINK
    i2_hi = tl.maximum(sink_end, c1 - RECENT)
    if DECODE:
        c_end = c1
    else:
        c_end = tl.minimum(c0, c1)
    s_hi = tl.maximum(first, tl.minimum(sink_end, c_end))
    r_lo = tl.maximum(sink_end, c0 + 1 - RECENT)
    r_hi = tl.maximum(r_lo, c_end)
    return c1, sink_end, i2_hi, s_hi, r_lo, r_hi


@triton.jit
def _plan_lengths_kernel(
    C0, EXT, START, KV_INDPTR, BF16_INDPTR, QO_INDPTR, NUM_SPLITS, NUM_EXACT,
    REQ, LOC, REQ_IN, SEQ_IN, START_IN, LOC_IN, n_loc,
    batch, max_len, split_tokens, min_splits, min_split_tokens, max_splits, exact_splits,
    SINK: tl.constexpr, RECENT: tl.constexpr, DECODE: tl.constexpr, BLOCK_B: tl.constexpr,
    BALANCE: tl.constexpr, BLOCK_N: tl.constexpr, ROWS_PER_TILE: tl.constexpr, MIN_ROWS: tl.constexpr,
    HAS_START: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_B)
    m = offs < batch
    if DECODE:  # the step's inputs into the plan's buffers here: one launch instead of five copies
        tl.store(REQ + offs, tl.load(REQ_IN + offs, mask=m, other=0).to(tl.int64), mask=m)
        c0 = tl.load(SEQ_IN + offs, mask=m, other=1).to(tl.int32) - 1  # seq_lens counts the new token
        tl.store(C0 + offs, c0, mask=m)
        if HAS_START:
            first = tl.load(START_IN + offs, mask=m, other=0).to(tl.int32)
        else:
            first = tl.zeros([BLOCK_B], tl.int32)
        tl.store(START + offs, first, mask=m)
        tl.store(LOC + offs, tl.load(LOC_IN + offs, mask=offs < n_loc, other=0).to(tl.int64), mask=m)
    else:
        c0 = tl.load(C0 + offs, mask=m, other=0)
        first = tl.load(START + offs, mask=m, other=0)
    ext = tl.load(EXT + offs, mask=m, other=0)
    c1, sink_end, i2_hi, s_hi, r_lo, r_hi = _ranges(c0, ext, first, max_len, SINK, RECENT, DECODE)
    n_int2 = tl.where(m, i2_hi - sink_end, 0)
    n_ex = tl.where(m, (s_hi - first) + (r_hi - r_lo), 0)
    tl.store(KV_INDPTR, 0)
    tl.store(BF16_INDPTR, 0)
    tl.store(KV_INDPTR + 1 + offs, tl.cumsum(n_int2, 0), mask=m)
    tl.store(BF16_INDPTR + 1 + offs, tl.cumsum(n_ex, 0), mask=m)
    if DECODE:  # one token per sequence: qo_indptr is a fixed arange; every sequence gets its split count
        n = split_count(n_int2, split_tokens, min_splits, min_split_tokens, max_splits)
        if BALANCE:  # and its exact-program count, the INT2 splits taking what the exact rows leave
            n, e = balance_count(n_int2, n_ex, n, max_splits + exact_splits, exact_splits, split_tokens, min_splits,
                                 min_split_tokens, BLOCK_N, ROWS_PER_TILE, MIN_ROWS)
            tl.store(NUM_EXACT + offs, e, mask=m)
        tl.store(NUM_SPLITS + offs, n, mask=m)
    else:
        tl.store(QO_INDPTR, 0)
        tl.store(QO_INDPTR + 1 + offs, tl.cumsum(tl.where(m, ext, 0), 0), mask=m)


@triton.jit
def _plan_fill_kernel(
    REQ_TO_TOKEN, stride_rt, REQ, C0, EXT, START,
    KV_INDPTR, KV_INDICES, BF16_INDPTR, BF16_INDICES, BF16_POS, QO_INDPTR, BF16_LOC,
    max_len,
    SINK: tl.constexpr, RECENT: tl.constexpr, DECODE: tl.constexpr, BLOCK: tl.constexpr, PART: tl.constexpr,
):
    b = tl.program_id(0)
    part = tl.program_id(1)  # INT2 positions [part * PART, (part + 1) * PART) of the list; part 0 also the rest
    req = tl.load(REQ + b).to(tl.int64)
    c0 = tl.load(C0 + b)
    ext = tl.load(EXT + b)
    first = tl.load(START + b)
    c1, sink_end, i2_hi, s_hi, r_lo, r_hi = _ranges(c0, ext, first, max_len, SINK, RECENT, DECODE)
    offs = tl.arange(0, BLOCK)
    tokens = REQ_TO_TOKEN + req * stride_rt
    # INT2 slots of positions [sink_end, i2_hi)
    kv_off = tl.load(KV_INDPTR + b)
    n_int2 = i2_hi - sink_end
    tl.static_assert(PART % BLOCK == 0)
    for i in range(part * PART, tl.minimum(part * PART + PART, n_int2), BLOCK):
        mk = i + offs < n_int2
        tl.store(KV_INDICES + kv_off + i + offs, tl.load(tokens + sink_end + i + offs, mask=mk), mask=mk)
    if part == 0:
        _plan_fill_exact(req, c0, ext, first, c1, sink_end, s_hi, r_lo, r_hi, b, offs,
                         BF16_INDPTR, BF16_INDICES, BF16_POS, QO_INDPTR, BF16_LOC, SINK, RECENT, DECODE, BLOCK)


@triton.jit
def _plan_fill_exact(req, c0, ext, first, c1, sink_end, s_hi, r_lo, r_hi, b, offs,
                     BF16_INDPTR, BF16_INDICES, BF16_POS, QO_INDPTR, BF16_LOC,
                     SINK: tl.constexpr, RECENT: tl.constexpr, DECODE: tl.constexpr, BLOCK: tl.constexpr):
    """Sequence ``b``'s exact-row lists (the first fill program of the sequence writes them)."""
    # exact rows: sinks [first, s_hi), then the ring [r_lo, r_hi)
    ex_off = tl.load(BF16_INDPTR + b)
    n_s = s_hi - first
    for i in range(0, n_s + r_hi - r_lo, BLOCK):
        e = i + offs
        mk = e < n_s + r_hi - r_lo
        p = tl.where(e < n_s, first + e, r_lo + e - n_s)
        tl.store(BF16_INDICES + ex_off + e, exact_row(req, p, first, SINK, RECENT).to(tl.int32), mask=mk)
        if not DECODE:
            tl.store(BF16_POS + ex_off + e, p, mask=mk)
    # the chunk's rows that stay exact (decode: the new token, written before the attention)
    qo = tl.load(QO_INDPTR + b)
    for i in range(0, ext, BLOCK):
        mk = i + offs < ext
        p = c0 + i + offs
        keep = (p < sink_end) | (p >= c1 - RECENT)
        row = tl.where(keep, exact_row(req, p, first, SINK, RECENT), -1)
        tl.store(BF16_LOC + qo + i + offs, row.to(tl.int32), mask=mk)


def _check_batch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, max_batch: int) -> int:
    if req_to_token.dtype != torch.int32 or req_to_token.dim() != 2 or req_to_token.stride(-1) != 1:
        raise ValueError(f"req_to_token must be int32 [R, max_ctx] with a contiguous last dim, got "
                         f"{req_to_token.dtype} {tuple(req_to_token.shape)}")
    if req_pool_indices.dim() != 1 or req_pool_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError("req_pool_indices must be int32/int64 [B]")
    bsz = req_pool_indices.shape[0]
    if bsz > max_batch:
        raise ValueError(f"batch {bsz} exceeds the plan's max_batch {max_batch}")
    return bsz


def _check_len(name: str, t: torch.Tensor, n: int) -> None:
    if t.shape != (n,) or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32/int64 [{n}], got {t.dtype} {tuple(t.shape)}")


class _Plan:
    """Buffers and the two planning launches shared by :class:`DecodePlan` and :class:`ExtendPlan`."""

    def __init__(self, pool: Int2KVPool, max_batch: int, max_seq_len: int, max_tokens: int):
        if max_batch < 1 or max_seq_len < 1 or max_tokens < 1:
            raise ValueError("max_batch, max_seq_len and max_tokens must be >= 1")
        self.pool = pool
        self.max_batch, self.max_seq_len, self.max_tokens = max_batch, max_seq_len, max_tokens
        dev = pool.device
        i32 = dict(dtype=torch.int32, device=dev)
        nx = max(max_batch * pool.rows_per_request, 1)
        self._buffers: dict[str, torch.Tensor] = {}
        for name, size in (("c0", max_batch), ("ext", max_batch), ("start", max_batch), ("num_splits", max_batch),
                           ("num_exact", max_batch),
                           ("qo_indptr", max_batch + 1), ("kv_indptr", max_batch + 1), ("bf16_indptr", max_batch + 1),
                           ("kv_indices", max_batch * max_seq_len), ("bf16_indices", nx), ("bf16_pos", nx),
                           ("bf16_loc", max_tokens)):
            self._buffers[name] = torch.zeros(size, **i32)
        self._buffers["req"] = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self._buffers["loc"] = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.batch = 0
        self.tokens = 0

    def workspace_bytes(self) -> int:
        """Device bytes this plan allocated at construction (index buffers, decode workspace, scratch)."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def _fill(self, req_to_token, req_pool_indices, c0, ext, start, loc, bsz, policy=None,
              balance: dict | None = None) -> None:
        decode = policy is not None
        b = self._buffers
        if start is not None:
            _check_len("start", start, bsz)
        if not decode:  # a decode step's inputs reach the buffers inside the lengths kernel
            b["req"][:bsz].copy_(req_pool_indices)
            b["c0"][:bsz].copy_(c0)
            b["ext"][:bsz].copy_(ext)
            if start is None:
                b["start"][:bsz].zero_()
            else:
                b["start"][:bsz].copy_(start)
            b["loc"][:loc.shape[0]].copy_(loc)
        if bsz == 0:
            return
        pool = self.pool
        sp = (policy.split_tokens, policy.min_splits, policy.min_split_tokens, policy.max_splits) if decode \
            else (1, 1, 1, 1)
        balance = balance or {}
        ins = (req_pool_indices, c0, b["start"] if start is None else start, loc, loc.shape[0]) if decode \
            else (b["req"], b["c0"], b["start"], b["loc"], 0)  # extend: not read
        _plan_lengths_kernel[(1,)](
            b["c0"], b["ext"], b["start"], b["kv_indptr"], b["bf16_indptr"], b["qo_indptr"], b["num_splits"],
            b["num_exact"], b["req"], b["loc"], *ins, bsz, self.max_seq_len, *sp, balance.get("exact_splits", 1),
            SINK=pool.sink, RECENT=pool.recent, DECODE=decode, BLOCK_B=triton.next_power_of_2(bsz),
            BALANCE=bool(balance), BLOCK_N=balance.get("block_n", ROWS_BLOCK_N),
            ROWS_PER_TILE=balance.get("rows_per_tile", EXACT_ROWS_PER_TILE),
            MIN_ROWS=balance.get("min_rows", EXACT_SPLIT_ROWS), HAS_START=start is not None,
        )
        _plan_fill_kernel[(bsz, triton.cdiv(self.max_seq_len, FILL_PART))](
            req_to_token, req_to_token.stride(0), b["req"], b["c0"], b["ext"], b["start"],
            b["kv_indptr"], b["kv_indices"], b["bf16_indptr"], b["bf16_indices"], b["bf16_pos"], b["qo_indptr"],
            b["bf16_loc"],
            self.max_seq_len,
            SINK=pool.sink, RECENT=pool.recent, DECODE=decode, BLOCK=FILL_BLOCK, PART=FILL_PART,
        )


class DecodePlan(_Plan):
    """Decode steps of up to ``max_batch`` sequences of up to ``max_seq_len`` tokens (new token included).

    Allocates at construction (``workspace_bytes()`` counts them): ``kv_indices`` int32 ``[max_batch * max_seq_len]``,
    ``bf16_indices`` int32 ``[max_batch * (sink + recent)]``, the ``[max_batch + 1]`` indptr arrays, ``num_splits``,
    per-sequence request / position / start / slot / exact-row buffers, and the decode workspace (``part_o`` fp32,
    ``part_lse``, ``q_rot``), flat: sized for the batch size ``B <= max_batch`` whose ``B * (bound(B) +
    exact_splits)`` partials are the most (the full batch at the default policy), viewed per plan as
    ``[B, q_heads, bound(B) + exact_splits, d]``.

    Args:
        pool: the :class:`~oscar_kernels.pool.Int2KVPool` the steps read and write.
        max_batch, max_seq_len: capacity.
        max_splits: the INT2 split bound of every batch's grid. Default: per batch size, the bound of a batch of
            ``B`` sequences is :func:`~oscar_kernels.decode_grid.split_policy` for a uniform ``B``-sequence batch at
            ``max_seq_len`` (the measured defaults' counts at that bound), so a lone long sequence gets the splits
            that fill the GPU (128 at 128k on Qwen3-8B shapes) while a full batch keeps its own (64). Either way the
            bound is constant per batch size, so a CUDA graph captured for ``B`` replays with any lengths.
        q_heads: query heads (sets the workspace).
        sm_scale: softmax scale (default ``1/sqrt(d)``).
        options: :class:`~oscar_kernels.scheme.DecodeOptions`, passed to every
            :func:`~oscar_kernels.decode.decode_int2` launch; its ``split_tokens`` is the split policy's (None: the
            measured default of the path).
        row_kernel: the decode path (:func:`~oscar_kernels.decode_grid.row_path`; ``False`` forces the general one).
        min_programs, min_split_tokens: the split policy's other knobs
            (:func:`~oscar_kernels.decode_grid.split_policy`; defaults are the measured ones).
        write_tuning: launch parameters of the step's K/V write (``block_n``, ``rot_precision``, ``num_warps`` of
            :func:`~oscar_kernels.write.quantize_pack_kv`; default
            :data:`~oscar_kernels.write.DECODE_WRITE`, the measured fastest for a decode step's rows).
        exact_splits: programs sharing each sequence's exact rows (default ``ceil((sink + recent) /
            EXACT_SPLIT_ROWS)``, see :data:`~oscar_kernels.decode_grid.EXACT_SPLIT_ROWS`); with ``balance``, the
            most any sequence gets.
        balance: per sequence, as many exact programs as its context needs (at most ``exact_splits``) and, for
            sequences whose split count is set by occupancy, the programs left over as INT2 splits
            (:func:`~oscar_kernels.decode_grid.balance_counts`; default
            :data:`~oscar_kernels.decode_grid.EXACT_BALANCE`). The grid and workspace are the same either way.
        exact_rows_per_tile, exact_min_rows: the balance rule's exact rows per program per INT2 tile of the longest
            split, and its floor (defaults :data:`~oscar_kernels.decode_grid.EXACT_ROWS_PER_TILE`,
            :data:`~oscar_kernels.decode_grid.EXACT_SPLIT_ROWS`); the floor also sets the default ``exact_splits``.
        fuse_q_rotation: :meth:`run` rotates the queries in the launch of the step's K/V write (one launch per
            layer fewer; :func:`~oscar_kernels.write.quantize_pack_kv` with ``q``) instead of in
            :func:`~oscar_kernels.decode.decode_int2`'s own query-rotation launch. Default ``True``.
        launch: :class:`~oscar_kernels.decode.DecodeLaunch`, tiles, warps and merge shape of the decode launches
            (tests and benchmarks; defaults are the measured ones).
    """

    def __init__(self, pool: Int2KVPool, max_batch: int, max_seq_len: int, max_splits: int | None = None, *,
                 q_heads: int, sm_scale: float | None = None, options: DecodeOptions = DecodeOptions(),
                 row_kernel: bool | None = None, min_programs: int | None = None,
                 min_split_tokens: int = MIN_SPLIT_TOKENS, write_tuning: dict | None = None,
                 exact_splits: int | None = None, balance: bool = EXACT_BALANCE,
                 exact_rows_per_tile: int = EXACT_ROWS_PER_TILE, exact_min_rows: int = EXACT_SPLIT_ROWS,
                 fuse_q_rotation: bool = True, launch: DecodeLaunch = DecodeLaunch()):
        super().__init__(pool, max_batch, max_seq_len, max_batch)
        if q_heads % pool.kv_heads:
            raise ValueError(f"q_heads {q_heads} must be a multiple of the pool's KV heads {pool.kv_heads}")
        self.q_heads = q_heads
        self.row_kernel = row_path(pool.layer(0), row_kernel)
        if not isinstance(options, DecodeOptions):
            raise TypeError(f"options must be a DecodeOptions, got {type(options).__name__}")
        self.options = options
        self.launch = launch
        self._policy_args = dict(min_programs=min_programs, split_tokens=options.split_tokens,
                                 min_split_tokens=min_split_tokens)
        if max_splits is not None and max_splits < 1:
            raise ValueError(f"max_splits must be >= 1, got {max_splits}")
        self.split_cap = max_splits
        self._bounds = [self._grid_bound(bsz) for bsz in range(max_batch + 1)]
        self.max_splits = max(self._bounds)
        """The largest grid split bound of any batch size (a one-sequence batch's, at the default policy)."""
        self.sm_scale = 1.0 / math.sqrt(pool.head_dim) if sm_scale is None else sm_scale
        self.write_tuning = dict(DECODE_WRITE if write_tuning is None else write_tuning)
        self.fuse_q_rotation = fuse_q_rotation
        if exact_rows_per_tile < 1 or exact_min_rows < 1:
            raise ValueError(f"exact_rows_per_tile and exact_min_rows must be >= 1, got {exact_rows_per_tile} and "
                             f"{exact_min_rows}")
        if exact_splits is None:
            exact_splits = max(1, triton.cdiv(pool.rows_per_request, exact_min_rows))
        if exact_splits < 1:
            raise ValueError(f"exact_splits must be >= 1, got {exact_splits}")
        self.exact_splits = exact_splits
        self.balance = bool(balance)
        self.exact_rows = (exact_rows_per_tile, exact_min_rows)
        b = self._buffers
        b["qo_indptr"].copy_(torch.arange(max_batch + 1, dtype=torch.int32))  # one token per sequence
        b["ext"].fill_(1)
        parts = max(bsz * (self._bounds[bsz] + exact_splits) for bsz in range(1, max_batch + 1))
        f32 = dict(dtype=torch.float32, device=pool.device)
        b["part_o"] = torch.empty(parts * q_heads * pool.head_dim, **f32)
        b["part_lse"] = torch.empty(parts * q_heads, **f32)
        b["q_rot"] = torch.empty(max_batch * q_heads * pool.head_dim, **f32)
        self.index: DecodeIndex | None = None

    def _int2_len(self, seq_len: int) -> int:
        return max(seq_len - self.pool.sink - self.pool.recent, 1)

    def _grid_bound(self, bsz: int) -> int:
        """Host int: the split bound of a ``bsz``-sequence batch's grid (its uniform batch at ``max_seq_len``)."""
        if self.split_cap is not None:
            return self.split_cap
        return split_policy(max(bsz, 1), self.pool.kv_heads, self._int2_len(self.max_seq_len), self.row_kernel,
                            None, **self._policy_args).max_splits

    def int2_block_n(self) -> int:
        """INT2 tokens per tile of the split kernel the steps run (the balance rule counts tiles)."""
        return self.launch.block_n or (ROWS_BLOCK_N if self.row_kernel else DECODE_GENERAL_BLOCK_N)

    def grid_bound(self, bsz: int) -> int:
        """The split bound (grid and workspace) a batch of ``bsz`` sequences is planned with."""
        if not 1 <= bsz <= self.max_batch:
            raise ValueError(f"batch {bsz} is outside [1, {self.max_batch}]")
        return self._bounds[bsz]

    def plan(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
             out_cache_loc: torch.Tensor, start: torch.Tensor | None = None, max_seq_len: int | None = None) -> None:
        """Fill the lists of one decode step (device work only).

        Args:
            req_to_token: int32 ``[R, max_ctx]`` slots of each request's positions (the new token's included).
            req_pool_indices: int32/int64 ``[B]`` request of each sequence.
            seq_lens: int32/int64 ``[B]`` tokens per sequence INCLUDING the new one (at position ``seq_len - 1``).
            out_cache_loc: int32/int64 ``[B]`` INT2 slot of each new token, or its first ``n < B`` entries (a
                CUDA-graph replay's live batch): the rest are slot 0, the padding slot.
            start: optional int32/int64 ``[B]`` first real position (default 0).
            max_seq_len: optional host bound of this batch's ``seq_lens`` (sets the occupancy part of the split
                policy; default the construction's).

        Two launches: the lengths kernel copies the inputs into the plan's buffers and counts each sequence's lists
        and programs, the fill kernel writes the lists.
        """
        bsz = _check_batch(req_to_token, req_pool_indices, self.max_batch)
        _check_len("seq_lens", seq_lens, bsz)
        if out_cache_loc.dim() != 1 or out_cache_loc.shape[0] > bsz:
            raise ValueError(f"out_cache_loc must be int32/int64 [<= {bsz}], got {out_cache_loc.dtype} "
                             f"{tuple(out_cache_loc.shape)}")
        _check_len("out_cache_loc", out_cache_loc, out_cache_loc.shape[0])
        dev = self.pool.device
        req_pool_indices, seq_lens, out_cache_loc = (t.to(dev) for t in (req_pool_indices, seq_lens, out_cache_loc))
        start = None if start is None else start.to(dev)
        bound = self._int2_len(min(max_seq_len or self.max_seq_len, self.max_seq_len))
        grid = self._bounds[max(bsz, 1)]
        policy = split_policy(bsz, self.pool.kv_heads, bound, self.row_kernel, grid, **self._policy_args)
        balance = dict(exact_splits=self.exact_splits, block_n=self.int2_block_n(), rows_per_tile=self.exact_rows[0],
                       min_rows=self.exact_rows[1]) if self.balance else None
        self._fill(req_to_token, req_pool_indices, seq_lens, None, start, out_cache_loc, bsz, policy, balance)
        b = self._buffers
        self.batch = self.tokens = bsz
        self.index = DecodeIndex(b["kv_indptr"][:bsz + 1], b["kv_indices"], b["bf16_indptr"][:bsz + 1],
                                 b["bf16_indices"], b["num_splits"][:bsz], grid, self.exact_splits,
                                 b["num_exact"][:bsz] if self.balance else None)
        hq, d, parts = self.q_heads, self.pool.head_dim, self.index.parts
        self._workspace = (b["part_o"][:bsz * hq * parts * d].view(bsz, hq, parts, d),
                           b["part_lse"][:bsz * hq * parts].view(bsz, hq, parts),
                           b["q_rot"][:bsz * hq * d].view(bsz, hq, d))

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """One layer of the planned step: write the new tokens (INT2 code + exact row, one launch for K and V, which
        also rotates the queries unless ``fuse_q_rotation`` is off), then decode attention. q ``[B, Hq, d]``, k/v
        ``[B, Hkv, d]`` un-rotated; returns ``out`` ``[B, Hq, d]``."""
        if self.index is None:
            raise RuntimeError("call plan() before run()")
        b, n = self._buffers, self.batch
        if not self.fuse_q_rotation:
            self.pool.write(layer, b["loc"][:n], k, v, bf16_loc=b["bf16_loc"][:n], **self.write_tuning)
            return self.attend(layer, q, out)  # its query rotation launch sits between: no early start
        if q.shape != (n, self.q_heads, self.pool.head_dim):
            raise ValueError(f"q must be [{n}, {self.q_heads}, {self.pool.head_dim}], got {tuple(q.shape)}")
        self.pool.write(layer, b["loc"][:n], k, v, bf16_loc=b["bf16_loc"][:n], q=q, q_out=self._workspace[2],
                        q_scale=self.sm_scale * LOG2E, **self.write_tuning)
        return self._decode(layer, q, out, rotate_q=False)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode attention of the planned step over what the pool holds (no write)."""
        if self.index is None:
            raise RuntimeError("call plan() before run()")
        return self._decode(layer, q, out, rotate_q=True)

    def _decode(self, layer: int, q: torch.Tensor, out: torch.Tensor | None, rotate_q: bool) -> torch.Tensor:
        return decode_int2(q, self.pool.layer(layer), self.index, workspace=self._workspace, out=out,
                           sm_scale=self.sm_scale, options=self.options, rotate_q=rotate_q,
                           row_kernel=self.row_kernel, launch=self.launch)


class ExtendPlan(_Plan):
    """Extend (prefill) steps of up to ``max_batch`` sequences, ``max_tokens`` new tokens in all, ``max_seq_len``
    tokens per sequence.

    Allocates at construction (``workspace_bytes()``): the index buffers (``kv_indices`` int32
    ``[max_batch * max_seq_len]``, ``bf16_indices``/``bf16_pos`` int32 ``[max_batch * (sink + recent)]``, indptr
    arrays, per-sequence buffers), per-token slots and exact rows ``[max_tokens]``, and bf16 scratch
    ``[max_tokens, Hkv, d]`` for K and V holding the chunk's rotated rows (written by the same ``quantize_pack``
    launch as the INT2 codes, read by the attention, then copied to their exact rows), and the dequantised-prefix
    scratch (:func:`~oscar_kernels.extend.dequant_scratch`: ``dequant_tokens`` rows of ``dequant_heads`` KV
    heads, fp16 K / bf16 V).

    A batch whose INT2 lists fit the scratch (``int2_tokens <= dequant_tokens``, host ints) runs
    :func:`~oscar_kernels.extend.extend_int2_dequant`: its INT2 rows dequantised once per layer, then one
    flash-attention loop; a larger one runs the fused :func:`~oscar_kernels.extend.extend_int2`, which
    dequantises each tile in registers once per block of queries. Both compute Design P.

    Args:
        pool, max_batch, max_tokens, max_seq_len: as above.
        sm_scale: softmax scale (default ``1/sqrt(d)``).
        dequant_tokens: INT2 rows the scratch holds (default ``max_seq_len``: any one sequence; 0: never use it).
        dequant_heads: KV heads per dequantised pass (default: as many as fit ``DEQUANT_SCRATCH_BYTES``).
        dequant_tuning: tiles of :func:`~oscar_kernels.extend.extend_int2_dequant` (``block_m``, ``block_n``,
            ``num_warps``, ``num_stages``; defaults ``DEQ_*``).
        block_m, block_n, **tuning: passed to the fused :func:`~oscar_kernels.extend.extend_int2`.
    """

    def __init__(self, pool: Int2KVPool, max_batch: int, max_tokens: int, max_seq_len: int, *,
                 sm_scale: float | None = None, dequant_tokens: int | None = None,
                 dequant_heads: int | None = None, dequant_tuning: dict | None = None,
                 block_m: int = DEFAULT_BLOCK_M, block_n: int = DEFAULT_BLOCK_N, **tuning):
        super().__init__(pool, max_batch, max_seq_len, max_tokens)
        self.sm_scale = 1.0 / math.sqrt(pool.head_dim) if sm_scale is None else sm_scale
        self.tuning = dict(block_m=block_m, block_n=block_n, **tuning)
        self.dequant_tuning = dict(dequant_tuning or {})
        b = self._buffers
        b["arange"] = torch.arange(max_tokens, dtype=torch.int32, device=pool.device)
        for name in ("scratch_k", "scratch_v"):
            b[name] = torch.empty(max_tokens, pool.kv_heads, pool.head_dim, dtype=torch.bfloat16, device=pool.device)
        self.dequant_tokens = max_seq_len if dequant_tokens is None else dequant_tokens
        if self.dequant_tokens < 0:
            raise ValueError(f"dequant_tokens must be >= 0, got {self.dequant_tokens}")
        if self.dequant_tokens:
            b["deq_k"], b["deq_v"] = dequant_scratch(pool.kv_heads, pool.head_dim, self.dequant_tokens, pool.device,
                                                     DEQUANT_SCRATCH_BYTES, dequant_heads)
        self.int2_tokens: int | None = None
        """Host bound of the planned batch's INT2 list length; the dequantised path runs iff it fits the scratch."""
        self.index: ExtendIndex | None = None

    @property
    def dequantised(self) -> bool:
        """Whether the planned batch runs the dequantised-prefix path."""
        return self.int2_tokens is not None and 0 < self.dequant_tokens and self.int2_tokens <= self.dequant_tokens

    def int2_rows(self, ends: list[int], starts: list[int] | None = None) -> int:
        """Host int: the INT2 list length of a batch whose chunks end at ``ends`` (prefix + extend lengths) from
        first positions ``starts`` (default 0): per sequence ``max(0, min(end, max_seq_len) - recent - start - sink)``,
        the ``[sink_end, c1 - recent)`` range ``plan`` fills. What :meth:`plan`'s ``int2_tokens`` asks for."""
        starts = [0] * len(ends) if starts is None else starts
        sink, recent = self.pool.sink, self.pool.recent
        return sum(max(0, min(c1, self.max_seq_len) - recent - st - sink)
                   for c1, st in zip(ends, starts, strict=True))

    def plan(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
             extend_lens: torch.Tensor, out_cache_loc: torch.Tensor, start: torch.Tensor | None = None,
             max_extend_len: int | None = None, max_seq_len: int | None = None,
             int2_tokens: int | None = None) -> None:
        """Fill the lists of one extend step (device work only).

        Args:
            req_to_token: int32 ``[R, max_ctx]`` slots of each request's positions (the chunk's included).
            req_pool_indices: int32/int64 ``[B]``.
            prefix_lens: int32/int64 ``[B]`` cached tokens before each chunk (``c0``; the chunk starts there).
            extend_lens: int32/int64 ``[B]`` new tokens per sequence (rows of ``q`` in sequence order).
            out_cache_loc: int32/int64 ``[N]`` INT2 slot of each new token, ``N = sum(extend_lens)``.
            start: optional int32/int64 ``[B]`` first real position (default 0).
            max_extend_len: host bound of ``extend_lens`` (sets the grid; default ``N``).
            max_seq_len: host bound of ``prefix_lens + extend_lens`` (checked against the construction's).
            int2_tokens: host bound of the batch's INT2 rows (:meth:`int2_rows`); decides the dequantised path.
                Default: :meth:`int2_rows` when the lengths are CPU tensors, else ``B * max_seq_len``.
        """
        bsz = _check_batch(req_to_token, req_pool_indices, self.max_batch)
        _check_len("prefix_lens", prefix_lens, bsz)
        _check_len("extend_lens", extend_lens, bsz)
        n = out_cache_loc.shape[0]
        _check_len("out_cache_loc", out_cache_loc, n)
        if n > self.max_tokens:
            raise ValueError(f"{n} new tokens exceed the plan's max_tokens {self.max_tokens}")
        if max_seq_len is not None and max_seq_len > self.max_seq_len:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the plan's {self.max_seq_len}")
        self._fill(req_to_token, req_pool_indices, prefix_lens, extend_lens, start, out_cache_loc, bsz)
        if int2_tokens is None:
            if all(t is None or t.device.type == "cpu" for t in (prefix_lens, extend_lens, start)):
                ends = (prefix_lens.long() + extend_lens.long()).tolist()
                int2_tokens = self.int2_rows(ends, None if start is None else start.tolist())
            else:
                int2_tokens = bsz * (max_seq_len or self.max_seq_len)
        if not isinstance(int2_tokens, int) or int2_tokens < 0:
            raise ValueError(f"int2_tokens must be a host int >= 0, got {int2_tokens!r}")
        self.int2_tokens = int2_tokens
        b = self._buffers
        self.batch, self.tokens = bsz, n
        self.index = ExtendIndex(b["qo_indptr"][:bsz + 1], b["c0"][:bsz], b["start"][:bsz], b["kv_indptr"][:bsz + 1],
                                 b["kv_indices"], b["bf16_indptr"][:bsz + 1], b["bf16_indices"], b["bf16_pos"],
                                 n if max_extend_len is None else int(max_extend_len), self.pool.sink,
                                 self.pool.recent)

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """One layer of the planned step: INT2 codes of all new tokens (and their rotated rows into the scratch),
        the extend attention, then the chunk's exact rows. q ``[N, Hq, d]``, k/v ``[N, Hkv, d]`` un-rotated."""
        if self.index is None:
            raise RuntimeError("call plan() before run()")
        n, b = self.tokens, self._buffers
        sk, sv = b["scratch_k"][:n], b["scratch_v"][:n]
        self.pool.write(layer, b["loc"][:n], k, v, bf16_loc=b["arange"][:n], bf16_out=(sk, sv))
        if self.dequantised:
            out = extend_int2_dequant(q, sk, sv, self.pool.layer(layer), self.index, (b["deq_k"], b["deq_v"]),
                                      self.int2_tokens, sm_scale=self.sm_scale, out=out, new_kv_rotated=True,
                                      **self.dequant_tuning)
        else:
            out = extend_int2(q, sk, sv, self.pool.layer(layer), self.index, sm_scale=self.sm_scale, out=out,
                              new_kv_rotated=True, **self.tuning)
        self.pool.write_exact(layer, b["bf16_loc"][:n], sk, sv, rotated=True)
        return out


def plan_lists_ref(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, c0: torch.Tensor, ext: torch.Tensor,
                   start: torch.Tensor, sink: int, recent: int, decode: bool) -> dict[str, torch.Tensor]:
    """Plain torch definition of what ``plan`` fills (one layer's lists of a batch, see the module docstring):
    ``kv_indptr``/``kv_indices``, ``bf16_indptr``/``bf16_indices``/``bf16_pos``, ``qo_indptr`` and ``bf16_loc`` (the
    chunk's exact rows, -1 where a token is read through INT2 only), all int32 (``bf16_pos`` of decode is filled too
    here; ``DecodePlan`` does not need it)."""
    lists = {k: [] for k in ("kv_indices", "bf16_indices", "bf16_pos", "bf16_loc")}
    lens = {k: [] for k in ("kv", "bf16", "qo")}
    for b in range(req_pool_indices.shape[0]):
        r, a, m, st = (int(t[b]) for t in (req_pool_indices, c0, ext, start))
        c1, sink_end = a + m, st + sink
        c_end = c1 if decode else a
        int2 = torch.arange(sink_end, max(sink_end, c1 - recent))
        ex = torch.cat([torch.arange(st, max(st, min(sink_end, c_end))),
                        torch.arange(max(sink_end, a + 1 - recent), max(max(sink_end, a + 1 - recent), c_end))])
        chunk = torch.arange(a, c1)
        keep = (chunk < sink_end) | (chunk >= c1 - recent)
        lists["kv_indices"].append(req_to_token[r].cpu()[int2])
        lists["bf16_indices"].append(exact_row_ref(r, ex, st, sink, recent))
        lists["bf16_pos"].append(ex)
        lists["bf16_loc"].append(torch.where(keep, exact_row_ref(r, chunk, st, sink, recent), -1))
        lens["kv"].append(int2.numel())
        lens["bf16"].append(ex.numel())
        lens["qo"].append(m)
    out = {k: torch.cat(v).to(torch.int32) if v else torch.zeros(0, dtype=torch.int32) for k, v in lists.items()}
    for k, v in lens.items():
        out[f"{k}_indptr"] = torch.tensor([0] + v, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out
