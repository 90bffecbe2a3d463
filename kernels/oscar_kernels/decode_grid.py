"""The grid of a decode launch: how many INT2 splits and exact programs each sequence gets, what a launch reads
(:class:`DecodeIndex`) and the workspace its partials go to.

A launch runs ``parts = max_splits + exact_splits`` programs per (sequence, KV head). Sequence ``b`` uses ``n_b``
INT2 splits, each covering ``ceil(L_b / n_b)`` INT2 tokens rounded up to whole tiles, and ``e_b`` exact programs
sharing its exact rows; the other programs exit at once. :class:`SplitPolicy` sets ``n_b`` from the length (host:
:meth:`SplitPolicy.num_splits`; device: :func:`split_count`, what the plan kernel evaluates), and
:func:`balance_counts` (device: :func:`balance_count`) both counts from the context, so that the exact programs end
about when the INT2 splits do. The counts are device tensors inside a grid fixed by host ints, so a CUDA graph
captured for one batch size replays with any lengths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .layout import LayerCache, check_index, check_seq

DEFAULT_MIN_PROGRAMS = 128
"""General path: split programs aimed for at least (about one per SM of an H200), through the policy's
``min_splits``."""
DEFAULT_SPLIT_TOKENS = 3072
"""General path: INT2 tokens per split (the fastest split count at the measured batch sizes and contexts)."""
ROWS_MIN_PROGRAMS = 1024
"""Row-scale path: split programs aimed for at least (about eight one-warp programs per SM of an H200: more splits
pay at batch 1 since the merge reads many partials per step)."""
ROWS_SPLIT_TOKENS = 2048
"""Row-scale path: INT2 tokens per split (the fastest split count at the measured batch sizes and contexts)."""
MIN_SPLIT_TOKENS = 256
"""Both paths: no split under two 128-token tiles (a shorter one pays the query setup, an LSE write and a merge
term for less than two tiles; not swept on its own)."""
EXACT_SPLIT_ROWS = 80
"""Fewest exact rows per exact program: ``DecodePlan``'s default ``exact_splits = ceil((sink + recent) / 80)`` (4 at
SGLang's window of 320 rows: one wave at bs1/100k) and the floor of :func:`balance_counts`' rows per program."""
EXACT_BALANCE = True
""":class:`~oscar_kernels.plan.DecodePlan` default: exact programs per sequence from :func:`balance_counts` (the
context sets how many the exact rows need; an occupancy-bound sequence takes the programs they leave as INT2
splits) instead of ``exact_splits`` for every sequence."""
EXACT_ROWS_PER_TILE = 40
"""Balance rule: exact rows one exact program takes per 128-token INT2 tile of the sequence's longest split, so an
exact program ends about when the INT2 splits do (a 32-row exact tile takes ~0.7 of a 128-token INT2 tile's
time)."""


@dataclass(frozen=True)
class SplitPolicy:
    """INT2 splits of a sequence of ``L`` INT2 tokens:
    ``clamp(max(ceil(L / split_tokens), min_splits), 1, min(ceil(L / min_split_tokens), max_splits))``
    (``L`` taken as at least 1). ``max_splits`` fixes the grid; ``min_splits`` spreads a small batch over the SMs.
    :func:`split_policy` builds it from host integers; :meth:`num_splits` (torch) and :func:`split_count`
    (``@triton.jit``) evaluate it on the device."""

    split_tokens: int
    min_splits: int
    min_split_tokens: int
    max_splits: int

    def num_splits(self, kv_lens: torch.Tensor) -> torch.Tensor:
        """int32 split counts for INT2 lengths ``kv_lens`` (any integer tensor; stays on its device, no sync)."""
        n = kv_lens.long().clamp_min(1)
        by_len = torch.clamp_min((n + self.split_tokens - 1) // self.split_tokens, self.min_splits)
        cap = torch.clamp_max((n + self.min_split_tokens - 1) // self.min_split_tokens, self.max_splits)
        return torch.minimum(by_len, cap).clamp_min(1).to(torch.int32)

    def splits_for(self, kv_len: int) -> int:
        """Host integer: the split count of one sequence of ``kv_len`` INT2 tokens."""
        return int(self.num_splits(torch.tensor([kv_len]))[0])


@triton.jit
def split_count(kv_len, split_tokens, min_splits, min_split_tokens, max_splits):
    """Triton twin of :meth:`SplitPolicy.num_splits` (element-wise)."""
    n = tl.maximum(kv_len, 1)
    by_len = tl.maximum(tl.cdiv(n, split_tokens), min_splits)
    cap = tl.minimum(tl.cdiv(n, min_split_tokens), max_splits)
    return tl.maximum(tl.minimum(by_len, cap), 1)


@triton.jit
def balance_count(n_int2, n_exact, n, parts, exact_splits, split_tokens, min_splits, min_split_tokens,
                  BLOCK_N: tl.constexpr, ROWS_PER_TILE: tl.constexpr, MIN_ROWS: tl.constexpr):
    """Triton twin of :func:`balance_counts` (element-wise): ``(INT2 splits, exact programs)``."""
    length = tl.maximum(n_int2, 1)
    tiles = tl.cdiv(tl.cdiv(length, n), BLOCK_N)
    rows = tl.maximum(tiles * ROWS_PER_TILE, MIN_ROWS)
    e = tl.minimum(tl.maximum(tl.cdiv(n_exact, rows), 1), exact_splits)
    n2 = tl.minimum(parts - e, tl.cdiv(length, min_split_tokens))
    t2 = tl.cdiv(tl.cdiv(length, n2), BLOCK_N)
    grown = tl.cdiv(length, t2 * BLOCK_N)
    return tl.where(tl.cdiv(length, split_tokens) <= min_splits, grown, n), e


def balance_counts(kv_lens: torch.Tensor, exact_lens: torch.Tensor, policy: SplitPolicy, exact_splits: int,
                   block_n: int, rows_per_tile: int = EXACT_ROWS_PER_TILE,
                   min_rows: int = EXACT_SPLIT_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, ``(n, e)``: INT2 splits and exact programs within a grid of ``parts = policy.max_splits +
    exact_splits`` programs per (sequence, KV head), for ``kv_lens`` INT2 tokens and ``exact_lens`` exact rows.

    * ``e = clamp(ceil(exact_len / rows), 1, exact_splits)``, ``rows = max(min_rows, t * rows_per_tile)`` with ``t``
      the ``block_n`` tiles of the longest of the policy's ``n`` splits: a long context needs fewer exact programs
      (two of 160 rows against seven-tile splits), a short one keeps ``ceil(exact_len / min_rows)``.
    * A sequence whose split count is set by occupancy (``ceil(L / split_tokens) <= min_splits``: small batches)
      then takes the programs the exact rows leave: the fewest splits that reach the tile count of ``min(parts - e,
      ceil(L / min_split_tokens))`` splits. At bs1/100k (Qwen3-8B shapes, sink 64 / recent 256): 130 INT2 splits of
      six tiles and two exact programs of 160 rows in 132 programs per head, against 128 splits of seven tiles (112
      of them busy) and four exact programs. Length-bound sequences keep the policy's count.

    int32 tensors on the lengths' device (no sync); :func:`balance_count` is the plan kernel's twin."""
    length = kv_lens.long().clamp_min(1)
    n = policy.num_splits(kv_lens).long()
    parts = policy.max_splits + exact_splits
    tiles = _cdiv(_cdiv(length, n), block_n)
    rows = torch.clamp_min(tiles * rows_per_tile, min_rows)
    e = torch.clamp(_cdiv(exact_lens.long(), rows), 1, exact_splits)
    n2 = torch.minimum(parts - e, _cdiv(length, policy.min_split_tokens))
    grown = _cdiv(length, _cdiv(_cdiv(length, n2), block_n) * block_n)
    n = torch.where(_cdiv(length, policy.split_tokens) <= policy.min_splits, grown, n)
    return n.to(torch.int32), e.to(torch.int32)


def _cdiv(a: torch.Tensor, b) -> torch.Tensor:
    return (a + b - 1) // b


_UNBOUNDED = 2**30


def split_policy(batch: int, kv_heads: int, max_kv_len: int, row_kernel: bool = False, max_splits: int | None = None,
                 min_programs: int | None = None, split_tokens: int | None = None,
                 min_split_tokens: int = MIN_SPLIT_TOKENS) -> SplitPolicy:
    """The split policy for a batch of ``batch`` sequences of at most ``max_kv_len`` INT2 tokens (host ints only).

    ``min_splits = ceil(min_programs / (batch * kv_heads))``; ``max_splits`` defaults to the count of a sequence of
    ``max_kv_len`` tokens, so a uniform batch at the bound gets exactly the counts the measured defaults were taken
    with (``default_num_splits`` before the device split counts: RESULTS.md, commits 529689a and dda96f4). Defaults
    per path: ``ROWS_*`` for the row-scale kernel, ``DEFAULT_*`` for the general one; ``MIN_SPLIT_TOKENS``."""
    if min_programs is None:
        min_programs = ROWS_MIN_PROGRAMS if row_kernel else DEFAULT_MIN_PROGRAMS
    if split_tokens is None:
        split_tokens = ROWS_SPLIT_TOKENS if row_kernel else DEFAULT_SPLIT_TOKENS
    policy = SplitPolicy(split_tokens, triton.cdiv(min_programs, max(batch * kv_heads, 1)), min_split_tokens,
                         _UNBOUNDED)
    if max_splits is None:
        max_splits = policy.splits_for(max_kv_len)
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    return dataclasses.replace(policy, max_splits=max_splits)


def default_num_splits(batch: int, kv_heads: int, max_kv_len: int, row_kernel: bool = False,
                       min_programs: int | None = None, split_tokens: int | None = None) -> int:
    """INT2 splits of a uniform batch at ``max_kv_len`` (the grid bound ``max_splits`` of :func:`split_policy`)."""
    return split_policy(batch, kv_heads, max_kv_len, row_kernel, None, min_programs, split_tokens).max_splits


@dataclass(frozen=True)
class DecodeIndex:
    """What one decode step of a batch reads (made per batch by :class:`oscar_kernels.plan.DecodePlan`).

    * ``kv_indptr`` int32 ``[B + 1]``, ``kv_indices`` int32 ``[>= nnz]``: INT2 slots of each sequence;
    * ``bf16_indptr`` int32 ``[B + 1]``, ``bf16_indices`` int32 ``[>= nnz_bf16]``: exact rows of each sequence;
    * ``max_splits``, ``exact_splits``: host ints; the grid and the workspace hold ``parts = max_splits +
      exact_splits`` programs and partials per (sequence, KV head);
    * ``num_exact`` int32 ``[B]`` device tensor or None: programs sharing each sequence's exact rows (whole
      ``BF16_BLOCK_N`` tiles each), clamped to ``[1, exact_splits]``; None: ``exact_splits`` for every sequence;
    * ``num_splits`` int32 ``[B]`` device tensor: INT2 splits per sequence, clamped to ``[1, parts - e_b]`` (``e_b``
      its exact programs: ``max_splits`` without ``num_exact``; a sequence with fewer exact programs may use the
      programs they leave, see :func:`balance_counts`).

    Program ``i`` of sequence ``b`` runs INT2 split ``i`` for ``i < n_b``, exact part ``i - n_b`` for ``n_b <= i <
    n_b + e_b``, and exits otherwise; its partial is ``i``.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    bf16_indptr: torch.Tensor
    bf16_indices: torch.Tensor
    num_splits: torch.Tensor
    max_splits: int
    exact_splits: int = 1
    num_exact: torch.Tensor | None = None

    @property
    def parts(self) -> int:
        """Partials per (sequence, query head) in the workspace: ``max_splits + exact_splits``."""
        return self.max_splits + self.exact_splits

    @property
    def batch(self) -> int:
        return self.kv_indptr.shape[0] - 1

    def check(self, batch: int) -> None:
        check_index("kv", self.kv_indptr, self.kv_indices, batch)
        check_index("bf16", self.bf16_indptr, self.bf16_indices, batch)
        check_seq("num_splits", self.num_splits, batch)
        if self.num_exact is not None:
            check_seq("num_exact", self.num_exact, batch)
        if not isinstance(self.max_splits, int) or self.max_splits < 1:
            raise ValueError(f"max_splits must be a host int >= 1, got {self.max_splits!r}")
        if not isinstance(self.exact_splits, int) or self.exact_splits < 1:
            raise ValueError(f"exact_splits must be a host int >= 1, got {self.exact_splits!r}")


def row_path(cache: LayerCache, row_kernel: bool | None = None) -> bool:
    """Whether :func:`decode_int2` takes the row-scale fast path for ``cache`` (``row_kernel=None``: when it can:
    ``g = d >= 128`` and code pools readable as int16 words); ``row_kernel=True`` where it cannot is an error."""
    can = cache.group_size == cache.head_dim >= 128 and cache.k.words is not None and cache.v.words is not None
    if row_kernel and not can:
        raise ValueError("row_kernel needs group_size == head_dim >= 128 and code pools with even strides")
    return can if row_kernel is None else bool(row_kernel)


def decode_index(cache: LayerCache, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, bf16_indptr: torch.Tensor,
                 bf16_indices: torch.Tensor, max_kv_len: int, max_splits: int | None = None,
                 row_kernel: bool | None = None) -> DecodeIndex:
    """A :class:`DecodeIndex` over caller-built lists, split counts from :func:`split_policy` evaluated on the
    device (``max_kv_len``: host bound of the INT2 lengths)."""
    policy = split_policy(kv_indptr.shape[0] - 1, cache.kv_heads, max_kv_len, row_path(cache, row_kernel), max_splits)
    return DecodeIndex(kv_indptr, kv_indices, bf16_indptr, bf16_indices,
                       policy.num_splits(kv_indptr[1:] - kv_indptr[:-1]), policy.max_splits)


def decode_workspace(batch: int, q_heads: int, head_dim: int, max_splits: int, device: torch.device | str,
                     exact_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch for :func:`decode_int2` (pass it to reuse buffers, e.g. inside a CUDA graph), ``P = max_splits +
    exact_splits``: ``part_o`` fp32 ``[B, Hq, P, d]``, ``part_lse`` fp32 ``[B, Hq, P]``, ``q_rot`` fp32
    ``[B, Hq, d]``."""
    parts = max_splits + exact_splits
    return (torch.empty(batch, q_heads, parts, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, q_heads, parts, dtype=torch.float32, device=device),
            torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=device))
