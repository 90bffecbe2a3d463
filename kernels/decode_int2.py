"""Split-KV (flash-decoding) attention of one new query per sequence over an INT2 cache plus its exact rows.

Math, for sequence ``b`` and query head ``h`` (KV head ``kh = h // (Hq / Hkv)``): the query is rotated,
``q' = q @ R_K[kh]``; cached keys and values are held rotated (``k' = k R_K``, ``v' = v R_V``), so
``q'.k' = q.k`` and ``o = softmax(sm_scale * q' K'^T) V' R_V^T``.  Keys/values are either INT2 slots
(``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, dequantised ``x_hat = code*s + z``) or exact bf16 rows
(``bf16_indices[bf16_indptr[b]:bf16_indptr[b+1]]``: sinks and the recent window, Design P, see
:mod:`oscar_kernels.plan`). Every listed element is attended: which positions are exact is the plan's business.

Kernels, all launched without host synchronisation, so one call can be captured in a CUDA graph:

* ``_rotate_q_kernel``, grid ``(B, Hkv)``: ``q' = q @ R_K[kh] * sm_scale * log2(e)`` once per query head
  (fp32, base-2 softmax units), into the workspace; skipped with ``rotate_q=False``, when the step's K/V write
  launch has written ``q'`` already (:func:`oscar_kernels.quantize_pack.quantize_pack_kv` with ``q``).
* ``_decode_rows_kernel``, grid ``(B, Hkv, max_splits + exact_splits)``, the fast path for one scale/zero per row
  (``g = d >= 128``). Sequence ``b`` uses ``n_b = clamp(num_splits[b], 1, max_splits)`` INT2 splits (a device
  tensor: ragged batches get per-sequence counts inside a grid fixed by the host int ``max_splits``); split
  ``i < n_b`` covers ``ceil(L_b / n_b)`` INT2 tokens (rounded up to a tile); programs ``n_b <= i < max_splits`` exit
  at once; splits ``max_splits + e``, ``e < exact_splits``, share the exact rows (whole tiles each, see
  ``EXACT_SPLIT_ROWS``). All ``Hq / Hkv`` query heads of a KV
  head share each loaded tile (GQA), and tokens are the M dimension of both tensor-core products, so a
  4-head group is not padded to 16 rows. The dequantisation is folded out of the inner loop:
  ``q'.k_hat = s (q'.c) + z sum(q')`` and ``sum_t p_t v_hat_t = sum_t (p_t s_t) c_t + sum_t p_t z_t``.
  Codes are read as int16 words (two bytes, eight codes); plane ``j`` of the low/high byte of word ``w`` is
  rotated element ``2w + {0, 1} + j d/4``. On CUDA one LOP3 per two codes turns them into fp16
  ``F16_MAGIC + 4**j c`` (the "magic number" trick: the code lands in the mantissa of 1024); the query planes are
  pre-divided by ``4**j``; the offsets leave the key side through one per-head constant and the
  value side through each tile's ``sum(p*s)``, so per element the loop runs 0.56 integer instructions plus its
  share of the dot.
  On CUDA with Triton 3.6 the same programs run as :mod:`oscar_kernels.decode_async`'s Gluon kernel (``async_tiles``,
  default ``ROWS_ASYNC``): each next tile's code words travel global -> shared with ``cp.async`` while a tile
  computes, so a tile no longer waits on HBM twice.
* ``_decode_int2_kernel``, same grid and split rule, the general path (``g < d`` or ``d = 64``): quarter planes of
  bytes, codes dequantised per element when ``g < d``.
* ``_decode_int2_merge_kernel``, grid ``(B, Hq, d / merge_cols)``: merges sequence ``b``'s ``n_b`` INT2 partials and
  the exact one of one query head by log-sum-exp (the partials of exited programs are never read) and rotates back
  by ``R_V^T`` in the same program (``merge_cols`` output columns of it per program).

Each active split writes its normalised partial output and base-2 log-sum-exp (an empty split: ``lse = -inf``).

Exact vs approximate: the ``_ref`` dequantises to fp32 and works in fp32. On GPU the kernels round ``q'``
to fp16 and ``p*s`` to fp16 (fast path) or bf16 (general path) for the tensor-core dots (fp32
accumulation), rotate ``q`` with tf32x3 dots and ``o`` with tf32 dots: relative output error ~1e-3, tested
at <= 1e-2. Under ``TRITON_INTERPRET=1`` every dot runs in fp32 and the fast path skips the fp16 offset,
so it matches the reference to ~1e-6. Only a GPU run exercises the PTX unpacks (``MAGIC`` / ``PTX_UNPACK``), the
fp16/bf16 dot operands, the register cap and the 64-bit offsets' real range.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .layout import LayerCache, cached_rows_ref, check_index, check_query, check_seq, dequantize_ref, gpu_codegen
from .scheme import cuda_head_dim_refusal

LOG2E = math.log2(math.e)
"""The kernels' softmax runs in base 2: the rotated query carries ``sm_scale * LOG2E``."""
DEFAULT_MIN_PROGRAMS = 128
"""General path: split programs aimed for at least (about one per SM of an H200), through the split policy's
``min_splits``."""
DEFAULT_SPLIT_TOKENS = 3072
"""General path: INT2 tokens per split. Measured on an H200 (Qwen3-8B shapes, block_n 128): bs1/128k 172 µs at 33
splits vs 185 at 66 and 295 at 16; bs8/32k 245 µs at 18 splits vs 276 at 9; bs16/128k 1674 µs at 20 splits vs 1801
at 5 and 1796 at 10; bs1/8k 26.5 µs at 16 splits vs 31 at 32."""
SMALL_BATCH_WARPS = 2
"""General path: warps per split program when ``batch * kv_heads <= 16``: bs1/128k ran 144 µs with 2 warps vs 185 with 4;
at bs8 and bs16 2 warps were slower (304 vs 276, 2183 vs 1801 µs)."""
GENERAL_WARPS = 4
"""General path: warps per split program otherwise (the other side of the ``SMALL_BATCH_WARPS`` measurement)."""
GENERAL_STAGES = 2
"""General path: Triton pipelining depth; every v3 measurement (RESULTS.md, commit 529689a) ran at 2, and the sweep
there moved bs16/128k by < 15% over split counts and depths."""
GENERAL_MIN_BLOCK_H = 16
"""General path: the GQA group is padded to 16 rows, the M minimum of the tensor-core dots it was tuned with."""
DEFAULT_BLOCK_N = 128
"""General path: INT2 tokens per inner-loop tile (128 beat 32 and 64 at every measured shape except bs1/8k, where 64 won by 3%)."""
BF16_BLOCK_N = 32
"""Both paths: exact (BF16) rows per tile of the exact split. Not swept: the exact split covers at most
``sink + recent`` rows (a few hundred) while the INT2 splits cover the rest of the context, so it is off the
critical path at long contexts; 32 keeps the bf16 tile of a 128-wide head at 8 KB."""
ROWS_BLOCK_N = 128
"""Row-scale path: INT2 tokens per tile. Measured on an H200 (Qwen3-8B shapes, one warp; this and the constants below
on slot-major pools, before ``Int2Pool`` went head-major): 128 beat 64 at every
swept shape (bs16/128k 682 vs 780 µs, bs1/128k 108 vs 133, bs8/32k 109 vs 138)."""
ROWS_WARPS = 1
"""Row-scale path: warps per split program; one warp keeps every reduction inside the warp (bs16/128k: 682 µs
with one warp, 808 with two, 2091 with four)."""
ROWS_STAGES = 1
"""Row-scale path: Triton pipelining depth (cp.async stages 2 and 3 were 9-44% slower at every swept shape)."""
ROWS_MIN_BLOCK_H = 2
"""Row-scale path: smallest head-tile width (the tensor-core dot pads to 8 inside the instruction anyway)."""
ROWS_MIN_PROGRAMS = 1024
"""Row-scale path: split programs aimed for at least, through the split policy's ``min_splits`` (and no split under
``MIN_SPLIT_TOKENS``). Raised from 128 with a merge reading 8 partials per step, from a sweep on an H200
(RESULTS.md, commit b7f000b, CUDA-graph replay, µs): bs1/8k 18.3 at 32 splits vs 22.0 at 16; bs1/128k 61.5 at 128
vs 82.5 at 64; bs8/32k 96.4 at 16 (1024 programs) vs 108.4 at 32; bs16/128k 577.3 at 64 (unchanged)."""
ROWS_SPLIT_TOKENS = 2048
"""Row-scale path: INT2 tokens per split. Measured: bs1/8k 25.2 µs at 16 splits vs 30.2 at 32; bs1/128k 108 at
64 vs 133 at 128; bs8/32k 109 at 16 vs 159 at 8; bs16/128k 682 at 32 vs 710 at 64 (with the register cap 646 vs 666)."""
ROWS_CAPPED_PROGRAMS = 2048
"""Row-scale path: from this many launched split programs (``B * Hkv * max_splits``) on, cap registers at
``ROWS_MAX_REGISTERS`` (more resident warps). bs16/128k (8192 programs): 666 µs capped vs 710; bs1/128k (512): 117
capped vs 108; bs8/32k (1024): 111 vs 109."""
ROWS_MAX_REGISTERS = 168
"""Row-scale path: the register cap (Triton ``maxnreg``); 128 and 144 did not beat it (commit 59b8e6e sweep)."""
MIN_SPLIT_TOKENS = 256
"""Both paths: a sequence of ``L`` INT2 tokens gets at most ``ceil(L / 256)`` splits, so no split is shorter than
two 128-token tiles (the cap of every measured default; a shorter split pays the query-plane setup, an LSE write and
a merge term for less than two tiles). Not swept on its own."""
Q_ROT_BLOCK_C = 64
"""Query rotation: output columns per ``tl.dot`` (64 KB of fp32 ``R_K`` per program is read in ``d / 64`` pieces to
bound registers). Not swept: one small program per (sequence, KV head)."""
Q_ROT_WARPS = 4
"""Query rotation: warps per program (not swept, see ``Q_ROT_BLOCK_C``)."""
MERGE_SPLIT_CHUNK = 32
"""Merge: fewest INT2 partials read per loop step (``decode_int2(merge_chunk=...)``; ``[32, d]`` fp32, 16 KB at
d = 128); the default is :func:`merge_chunk_for` the launch's partials, from this up to ``MERGE_MAX_CHUNK``.
History: reading 8 per step instead of 1 is what made more splits pay at bs1 (``ROWS_MIN_PROGRAMS``; sweep on an
H200, RESULTS.md, commit b7f000b: bs1/128k 96.1 -> 82.5 µs at 64 splits, 61.5 at 128). That merge ran one program
per (sequence, KV head) over the GQA group padded to 16 rows with a tf32 ``R_V^T`` dot; the one program per
(sequence, query head) here, 32 partials per step and an fp32 multiply-sum product, measured within 2% of it at every
shape (``bench_decode.py --merge``, commit e6f07dc: bs1/100k 55.3 vs 55.8 µs, bs32/32k 306.2 vs 301.2; 8 or 16
partials per step slower) and replaced it for its exact product."""
MERGE_MAX_CHUNK = 128
"""Merge: most partials read per loop step by default. 256 (with ``merge_warps`` = 8 warps per program, the tile's
128 KB of fp32 over 256 threads), so that a one-sequence batch's 131-132 partials at 32k and 100k are one step
instead of two, measured level on an H200 (``bench_decode.py --variants --set pair``, commit 4505b5b: bs1/8k / 32k /
100k 18.6 / 22.4 / 41.3 µs against 18.2 / 22.2 / 41.1 at 128): kept at 128. History: all of a one-sequence batch's
partials in one step (128 splits at 32k and 100k) instead of four: measured on an H200 (``bench_decode.py --variants --set write-peel``,
commit 1c022d0, a decode step per layer, sink 64 / recent 256) bs1/32k 33.2 -> 30.7 µs, bs1/100k 56.2 -> 53.3;
bs1/8k (34 partials) 27.7 -> 27.5; at bs32/32k (19 partials, where 32 already reads them all) 128 was 2% slower
(312.2 vs 307.0: a 128-row tile for 19 rows), hence no more than the partials need."""


def merge_chunk_for(parts: int) -> int:
    """Default merge step: the partials' count rounded up to a power of two, within ``[MERGE_SPLIT_CHUNK,
    MERGE_MAX_CHUNK]`` (one step up to 128 partials)."""
    return min(MERGE_MAX_CHUNK, max(MERGE_SPLIT_CHUNK, triton.next_power_of_2(max(parts, 1))))


MERGE_WARPS = 4
"""Merge: warps per program up to 128 partials per step (not swept); see :func:`merge_warps`."""


def merge_warps(chunk: int) -> int:
    """Warps of a merge program reading ``chunk`` partials per step: ``MERGE_WARPS``, and one per 32 partials beyond
    (8 at 256: 128 fp32 of the ``[chunk, d]`` tile per thread at d = 128, as 4 warps hold at 128)."""
    return max(MERGE_WARPS, chunk // 32)
MERGE_ROT_ROWS = 64
"""Merge: output columns per piece of the ``R_V^T`` product (bounds the registers of the loaded rows)."""
EXACT_SPLIT_ROWS = 80
"""Fewest exact rows per exact-split program: ``DecodePlan``'s default ``exact_splits = ceil((sink + recent) /
EXACT_SPLIT_ROWS)`` (4 at the SGLang window of 320 rows: 8 x (128 + 4) = 1056 programs at bs1/100k, one wave of
8 per SM on 132 SMs), and with ``balance`` the floor of :func:`balance_counts`' rows per program (a short context's
exact programs then run three 32-row tiles against its splits' two 128-token ones). 128 before the exact programs
followed the context. History: the exact rows were one program's, and with the SGLang window (sink 64 + recent 256 = 320 rows,
ten 32-row tiles) that program was the step's longest at short contexts. Measured on an H200 (``bench_decode.py
--variants --recent 256``, commit 418023b, a decode step per layer): one / 3 / 5 / 10 exact programs at bs1/8k 40.4 /
28.0 / 27.1 / 27.3 µs, bs1/32k 46.8 / 33.4 / 32.5 / 34.8, bs1/100k 58.6 / 59.0 / 61.1 / 59.6, bs32/32k 322.0 / 323.4 /
324.1 / 325.6. Three (this value at that window) keeps the bs1/100k grid in one wave (8 x (128 + 3) = 1048 programs
of 234 registers, 1056 resident); five made it 1064 (the 61.1), and taking the extra programs out of the INT2 splits
instead cost bs1/32k a third tile per split (36.4 µs, commit dc4302a)."""
MERGE_MIN_PROGRAMS = 128
"""Merge: programs aimed for (about one per SM). Each (sequence, query head) gets ``d / cols`` programs, ``cols`` the
largest power of two in ``[MERGE_MIN_COLS, d]`` with ``B * Hq * d / cols >= MERGE_MIN_PROGRAMS``; each merges the
whole ``o'`` (the partials are read from L2 that many times) and rotates its columns. Measured on an H200
(``bench_decode.py --variants``, commit 154a6a4, a decode step per layer, Qwen3-8B shapes): bs1 (32 heads) at 32
columns / 64 / 128: 26.8 / 27.1 / 28.5 µs at 8k, 32.7 / 33.6 / 35.4 at 32k, 58.5 / 59.8 / 62.6 at 100k; from bs16 on
one program per head (128 columns) was level or best (bs32/32k 316.8 vs 320.3 at 64 and 326.6 at 32; bs50/100k
1305.9 vs 1311.5 and 1330.8)."""
MERGE_MIN_COLS = 32
"""Merge: fewest output columns per program (the smallest measured)."""
ROWS_PREFETCH = True
"""Row-scale path: load the next tile's slot indices one iteration ahead (``decode_int2(prefetch=...)``), so a
tile's code loads wait on one memory latency instead of two. Measured on an H200 (``bench_decode.py --variants``,
commit 154a6a4, per layer of a decode step): bs1/100k 61.3 µs vs 62.6 without; bs1/8k 29.0 vs 28.5, bs16/128k
579.5 vs 580.0, bs50/100k 1302.1 vs 1305.9 (level). Costs no registers (248 either way at d = 128)."""
ROWS_PIPELINE = False
"""Row-scale path: software-pipeline the split loop (``decode_int2(pipeline=...)``): tile ``i + 1``'s code words,
scales and zeros are loaded while tile ``i`` is computed, tile ``i + 2``'s slots one step earlier."""
ROWS_L2_AHEAD = 0
"""Row-scale path: tiles ahead whose code words, scales and zeros each iteration asks the L2 to fetch from HBM
(``decode_int2(l2_ahead=...)``: 0 off, 1 the next tile, 2 the one after; ``prefetch.global.L2``, no registers held),
so the tile's own loads later hit the L2 and more bytes are in flight per SM than the loads' registers allow. Off:
measured on an H200 (``bench_decode.py --variants --l2``, commit 53abccc, per layer of a decode step, sink 64 /
recent 256) one tile ahead is level at bs1 (55.7 µs vs 56.8 at 100k) and 1.6% slower at bs50/100k (1272 vs 1252),
two tiles ahead 16% slower at bs32 and bs50: the split kernel is not waiting on HBM."""
ROWS_PEEL = False
"""Row-scale path: run a split's whole tiles without token masks and its partial last tile, if any, after them with
masks (``decode_int2(peel=...)``): no per-token bound checks, score selects or masked value-scale loads in the loop
(1,568 instructions per tile and warp at d = 128 against 1,683, from the sm_90 SASS). Off: the two copies of the tile
body compile to 254 registers against 233 (80 bytes of spills under the large-batch cap), and on an H200
(``bench_decode.py --variants --set write-peel``, commit 1c022d0) it was level at bs1 and 2-4% slower at bs32/32k
and bs50/100k."""
ROWS_PAIR = False
"""Row-scale path: take each 128-token tile as two 64-token halves in the two halves of the ``2 * BLOCK_H``-wide
head tile (``decode_int2(pair=...)``, :func:`_pair_split`): a 4-head GQA group fills half of the tensor cores' N = 8,
so the plain loop's score, softmax and scale work runs on duplicated columns; paired, every element is useful at the
same tensor-core work. Off: in the sm_90 SASS it cuts the loop from 1,683 to 1,565 instructions per tile and warp
(the float work halves, but selects between the halves' scales and the zeroed probability halves, and layout
shuffles, take back most of it; 235 registers), and on an H200 (``bench_decode.py --variants --set pair``, commit
4505b5b, per layer) it was slower everywhere: bs1/8k / 32k / 100k 19.9 / 23.8 / 46.0 µs against 18.6 / 22.4 /
41.3, bs50/100k 1294 against 1246."""
ROWS_ASYNC = True
"""Row-scale path on CUDA: the split kernel of :mod:`oscar_kernels.decode_async` (INT2 tiles staged through shared
memory with ``cp.async`` one tile ahead) where it covers the launch."""
ROWS_INT8_SCORES = False
"""Row-scale path, Gluon split kernel: scores over the INT2 rows from int8 MMAs, each head's rotated query rounded to
int8 steps of ``max |q'| / 127`` (``decode_int2(int8_scores=...)``, defined by ``decode_int2_ref(int8_scores=
True)``). Measured on an H200 (``bench_decode.py --variants --set int8``, commit a067547, per layer): bs50/100k 1045
µs against 1123, bs32/32k 258 against 274, bs1/100k 35.1 against 37.3, bs1/8k and 32k level; end to end (``oscar
bench`` configuration ``oscar-int8``, commit a707298) 1,140 tokens/s at bs50/100k against 1,085 and batch-1 ITL at
100k 5.92-5.95 ms against 6.02-6.04. Off by default: it changes the scores (up to 1.5% relative on the output
against the exact reference on the kernel test's sharp attention; on the embedded model ``oscar eval`` method
``oscar-int8`` measured level perplexity, RULER niah 0.70 vs 0.75 over 20 samples); ``oscar serve --int8-scores``
turns it on for a server."""
ROWS_FOLD_OFFSET = False
"""Row-scale path, Gluon split kernel: each value plane's MMA starts from its rescaled sum less the tile's code
offset (``decode_int2(fold_offset=...)``). Off: level alone on an H200 (commit a067547: bs50/100k 1134 µs against
1123); with int8 scores 1004 against 1045 at bs50/100k but 36.6 against 35.1 at bs1/100k."""
ROWS_INT8_VALUES = False
"""Row-scale path, Gluon split kernel: the INT2 rows' value products from int8 MMAs (``decode_int2(int8_values=
...)``, defined by ``decode_int2_ref(int8_values=True)``): each tile's probabilities relative to each head's tile
maximum, times the token's value scale over the tile's largest, in int8 steps of 1/127; the value codes regrouped
four tokens to a register (two PRMTs per 32 codes; the fp16 operand layout's token axis relabelled into the 8-bit
one, no data moved) and unpacked four to an AND, half the value MMAs (k = 32), no code offset; the probabilities rounded down after a per-row dither (unbiased). Measured on an
H200 (``bench_decode.py --variants --set int8-values``, commit 9a8a519, per layer): bs50/100k 1106 µs against 1196
(1008 with int8 scores as well, 1119 with int8 scores alone), bs32/32k 262 / 244 against 280, bs1/100k 36.4 / 34.7
against 36.9; end to end with int8 scores (``oscar bench`` configuration ``oscar-int8-pv``, commit a782139) 1,267
tokens/s at bs50/100k. Off by default: 7-bit probabilities per tile change the output more than int8 scores (~3%
relative against the exact reference on the kernel tests' sharp synthetic attention); ``oscar serve --int8-values``
turns it on for a server, ``oscar eval`` method ``oscar-int8-pv`` measures it."""
ROWS_LEAN_TILES = False
"""Row-scale path, Gluon split kernel: the tile's per-token bookkeeping on the slot vector's side
(``decode_int2(lean_tiles=...)``): the key and value scales and zeros widened to fp32 before their layout change
(each lane converts its 4 tokens, not the 16 rows it receives), and the token mask folded into the key scale, zero and
an additive per-token term (``-inf`` past the list's end), instead of a 64-bit compare per row and a select per
score element; the tile's token masks as 32-bit compares against the tokens left. Same arithmetic, same results.
sm_90 SASS per tile and warp at the large-batch register cap (``benchmarks/sass_count.py --set lean``): 1,740 ->
1,606 by default, 1,513 -> 1,370 with int8 scores and values. Off until measured on a GPU."""
ROWS_FUSED_UPDATE = False
"""Row-scale path, Gluon split kernel with ``int8_values``: each value plane's accumulator update as two fused
multiply-adds, ``bits * scale + (acc * al - magic * scale)``, instead of taking the int32 sums' magic off exactly
first (``decode_int2(fused_update=...)``): 32 instructions fewer per tile and warp; the rescaled sum is rounded once
at the magic's magnitude (~1 int8 probability step times one code unit per tile, within the definition's own
dithered rounding noise). Off until measured on a GPU."""
ROWS_MOVMATRIX = False
"""Row-scale path, Gluon split kernel: each tile's probabilities move from the score accumulator layout to the value
MMA's B operand by one ``movmatrix`` (an 8x8 transpose across the warp) per register instead of a layout conversion
of shuffles and byte permutes (``decode_int2(movmatrix=...)``); the head tile is padded to 8 (at GQA 4 the
accumulator layout would broadcast lanes that movmatrix tells apart). Data movement only: same results. sm_90 SASS
per tile and warp at the large-batch register cap: 1,740 -> 1,673 by default, 1,350 -> 1,296 with int8 scores and
values, lean tiles and the fused update. Off until measured on a GPU."""
ROWS_EARLY_V = False
"""Row-scale path: issue the value tile's loads beside the key tile's at the top of each iteration
(``decode_int2(early_v=...)``) instead of after the scores. Off: slower everywhere it was measured (commit 154a6a4:
bs1/100k 67.7 µs vs 61.3 with prefetch alone, bs50/100k 1493 vs 1302; it spills under the 168-register cap)."""

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
def _split_counts(NUM_SPLITS, NUM_EXACT, b, parts, exact_splits, PER_SEQ_EXACT: tl.constexpr):
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
def _planes_f16(x):
    """uint8 codes -> four fp16 tensors ``1024 + plane_j``."""
    return (tl.inline_asm_elementwise(_F16_PLANE0, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4),
            tl.inline_asm_elementwise(_F16_PLANE1, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4),
            tl.inline_asm_elementwise(_F16_PLANE2, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4),
            tl.inline_asm_elementwise(_F16_PLANE3, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4))


@triton.jit
def _planes_bf16(x):
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
def _word_planes_magic(x):
    """int16 code words -> eight fp16 tensors ``1024 + 4**j c`` (low byte planes j = 0..3, then high byte)."""
    return tl.inline_asm_elementwise(_WORD_PLANES, "=r,=r,=r,=r,=r,=r,=r,=r,r", [x],
                                     dtype=(tl.float16,) * 8, is_pure=True, pack=2)


@triton.jit
def _word_planes_plain(x, DT: tl.constexpr):
    """int16 code words -> eight tensors of plain codes (same order as :func:`_word_planes_magic`)."""
    x = x.to(tl.int32)
    return ((x & 3).to(DT), ((x >> 2) & 3).to(DT), ((x >> 4) & 3).to(DT), ((x >> 6) & 3).to(DT),
            ((x >> 8) & 3).to(DT), ((x >> 10) & 3).to(DT), ((x >> 12) & 3).to(DT), ((x >> 14) & 3).to(DT))


@triton.jit
def _word_planes(x, MAGIC: tl.constexpr, DOT_T: tl.constexpr):
    """:func:`_word_planes_magic` (``MAGIC``, the PTX unpack) or :func:`_word_planes_plain` (the interpreter's)."""
    if MAGIC:
        return _word_planes_magic(x)
    else:
        return _word_planes_plain(x, DOT_T)


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
def _list_part(INDPTR, b, part, parts, BLOCK: tl.constexpr):
    """Where sequence ``b``'s list (INT2 slots or exact rows) starts, and the entries ``[lo, hi)`` that part ``part``
    of ``parts`` covers: ``ceil(L / parts)`` rounded up to whole ``BLOCK`` tiles each, the last part shorter or
    empty (an INT2 split, or an exact program's share)."""
    start = tl.load(INDPTR + b)
    length = tl.load(INDPTR + b + 1) - start
    chunk = tl.cdiv(tl.cdiv(length, parts), BLOCK) * BLOCK
    lo = part * chunk
    return start, lo, tl.minimum(lo + chunk, length)


@triton.jit
def _finish_split(m_i, l_i):
    """Online-softmax state -> (1 / l, base-2 log-sum-exp); an empty split gives ``(0, -inf)``."""
    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return inv_l, lse


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
                  stride_vzs, stride_vzh, MASKED: tl.constexpr = True):
    """A row-scale tile's value loads, as :func:`_rows_k_loads`; masked tokens get scale and zero 0 (their ``p*s``
    and ``p*z`` must be 0); without ``MASKED`` every token is in range and nothing is masked."""
    vw = tl.load(V_WORDS + slot[:, None] * stride_vws + kvh * stride_vwh + offs_w[None, :])
    if MASKED:
        vs = tl.load(V_SCALE + slot * stride_vss + kvh * stride_vsh, mask=mask_n, other=0.0)
        vz = tl.load(V_ZERO + slot * stride_vzs + kvh * stride_vzh, mask=mask_n, other=0.0)
    else:
        vs = tl.load(V_SCALE + slot * stride_vss + kvh * stride_vsh)
        vz = tl.load(V_ZERO + slot * stride_vzs + kvh * stride_vzh)
    return vw, vs, vz


_L2_PREFETCH = tl.constexpr("prefetch.global.L2 [$1]; mov.u32 $0, 0;")
"""PTX: ask the L2 for the line holding an address (a hint: nothing is loaded into registers, nothing can fault)."""


@triton.jit
def _l2_prefetch(ptrs):
    """``prefetch.global.L2`` of every pointer of ``ptrs`` (the dummy result is discarded; not pure, so kept)."""
    tl.inline_asm_elementwise(_L2_PREFETCH, "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rows_l2_prefetch(K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO, slot, kvh, stride_kws, stride_kwh,
                      stride_kss, stride_ksh, stride_kzs, stride_kzh, stride_vws, stride_vwh, stride_vss, stride_vsh,
                      stride_vzs, stride_vzh):
    """L2 prefetch of a row-scale tile's key and value rows (code words, scales, zeros) at ``slot`` [N]: one
    address per row and tensor (a row's d/4 bytes of words lie in one line)."""
    _l2_prefetch(K_WORDS + slot * stride_kws + kvh * stride_kwh)
    _l2_prefetch(V_WORDS + slot * stride_vws + kvh * stride_vwh)
    _l2_prefetch(K_SCALE + slot * stride_kss + kvh * stride_ksh)
    _l2_prefetch(K_ZERO + slot * stride_kzs + kvh * stride_kzh)
    _l2_prefetch(V_SCALE + slot * stride_vss + kvh * stride_vsh)
    _l2_prefetch(V_ZERO + slot * stride_vzs + kvh * stride_vzh)


@triton.jit
def _rows_scores(kw, ks, kz, mask_n, q0, q1, q2, q3, q4, q5, q6, q7, s_init, qtot, m_i, l_i,
                 MAGIC: tl.constexpr, DOT_T: tl.constexpr, MASKED: tl.constexpr = True):
    """A row-scale tile's base-2 scores ``s = s_k (q'.c) + z_k sum(q')`` [N, H] -> online-softmax step:
    ``(p, alpha, m_new, l_new)``; ``MASKED``: tokens outside ``mask_n`` score -inf (without it all count)."""
    k0, k1, k2, k3, k4, k5, k6, k7 = _word_planes(kw, MAGIC, DOT_T)
    qc = tl.dot(k0, q0, s_init)
    qc = tl.dot(k1, q1, qc)
    qc = tl.dot(k2, q2, qc)
    qc = tl.dot(k3, q3, qc)
    qc = tl.dot(k4, q4, qc)
    qc = tl.dot(k5, q5, qc)
    qc = tl.dot(k6, q6, qc)
    qc = tl.dot(k7, q7, qc)  # [N, H] = q'.c
    s = qc * ks[:, None] + kz[:, None] * qtot[None, :]
    if MASKED:
        s = tl.where(mask_n[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 0)


@triton.jit
def _rows_values(p, alpha, vw, vs, vz, pz, a0, a1, a2, a3, a4, a5, a6, a7,
                 OFF: tl.constexpr, MAGIC: tl.constexpr, DOT_T: tl.constexpr):
    """A row-scale tile's value side: ``sum_t (p_t s_t) c_t`` into the plane accumulators ``a*`` [d/8, H] (rescaled
    by ``alpha``) and ``sum_t p_t z_t`` into ``pz``."""
    ps = (p * vs[:, None]).to(DOT_T)
    pz = pz * alpha + tl.sum(p * vz[:, None], 0)
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_planes(vw, MAGIC, DOT_T)
    # the 1024 offsets leave each tile's product before it is carried: the tensor cores' fp32 accumulation
    # truncates, and carried over a long split next to the offsets its bias grew with the split length
    # (5e-2 relative error over 4k tokens on an H200; written as dot(...) - off, Triton cannot fold the
    # carry back into the dot's accumulator)
    off_t = (OFF * tl.sum(ps.to(tl.float32), 0))[None, :]
    a0 = a0 * alpha[None, :] + (tl.dot(tl.trans(v0), ps) - off_t)
    a1 = a1 * alpha[None, :] + (tl.dot(tl.trans(v1), ps) - off_t)
    a2 = a2 * alpha[None, :] + (tl.dot(tl.trans(v2), ps) - off_t)
    a3 = a3 * alpha[None, :] + (tl.dot(tl.trans(v3), ps) - off_t)
    a4 = a4 * alpha[None, :] + (tl.dot(tl.trans(v4), ps) - off_t)
    a5 = a5 * alpha[None, :] + (tl.dot(tl.trans(v5), ps) - off_t)
    a6 = a6 * alpha[None, :] + (tl.dot(tl.trans(v6), ps) - off_t)
    a7 = a7 * alpha[None, :] + (tl.dot(tl.trans(v7), ps) - off_t)
    return pz, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _rows_tile(start, hi, kv_start, slot_next, offs_t, offs_w, kvh, KV_INDICES,
               K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO,
               stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
               stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
               q0, q1, q2, q3, q4, q5, q6, q7, s_init, qtot, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7,
               BLOCK_N: tl.constexpr, OFF: tl.constexpr, MAGIC: tl.constexpr, DOT_T: tl.constexpr,
               OFF64: tl.constexpr, PREFETCH: tl.constexpr, EARLY_V: tl.constexpr, L2_AHEAD: tl.constexpr,
               MASKED: tl.constexpr):
    """One row-scale tile of the plain split loop: tokens ``[start, start + BLOCK_N)`` of the split ending at
    ``hi``. ``MASKED``: the tile may run past ``hi`` (token masks on the slots, the scores and the value scales);
    without it every token is in range and no mask is computed. Returns the next tile's slots (``PREFETCH``) and the
    updated softmax state and plane accumulators."""
    offs_n = start + offs_t
    if MASKED:
        mask_n = offs_n < hi
    else:
        mask_n = offs_t >= 0  # all true; not applied
    if PREFETCH:
        slot = slot_next
        slot_next = tl.load(KV_INDICES + kv_start + BLOCK_N + offs_n, mask=BLOCK_N + offs_n < hi, other=0)
    elif MASKED:
        slot = tl.load(KV_INDICES + kv_start + offs_n, mask=mask_n, other=0)
    else:
        slot = tl.load(KV_INDICES + kv_start + offs_n)
    if OFF64:
        slot = slot.to(tl.int64)
    if L2_AHEAD == 2:  # the slots of the tile after next, for its L2 prefetch below
        far = 2 * BLOCK_N + offs_n
        slot_far = tl.load(KV_INDICES + kv_start + far, mask=far < hi, other=0)
    kw, ks, kz = _rows_k_loads(K_WORDS, K_SCALE, K_ZERO, slot, kvh, offs_w, stride_kws, stride_kwh,
                               stride_kss, stride_ksh, stride_kzs, stride_kzh)
    if EARLY_V:  # the value tile's loads issued beside the key tile's, before the score math
        vw, vs, vz = _rows_v_loads(V_WORDS, V_SCALE, V_ZERO, slot, mask_n, kvh, offs_w, stride_vws,
                                   stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh, MASKED)
    p, alpha, m_i, l_i = _rows_scores(kw, ks.to(tl.float32), kz.to(tl.float32), mask_n, q0, q1, q2, q3,
                                      q4, q5, q6, q7, s_init, qtot, m_i, l_i, MAGIC, DOT_T, MASKED)
    # after the scores: the slot load these addresses need has arrived by now
    if L2_AHEAD == 1:
        slot_l2 = slot_next
    elif L2_AHEAD == 2:
        slot_l2 = slot_far
    if L2_AHEAD > 0:
        if OFF64:
            slot_l2 = slot_l2.to(tl.int64)
        _rows_l2_prefetch(K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO, slot_l2, kvh, stride_kws,
                          stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh, stride_vws,
                          stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh)
    if not EARLY_V:
        vw, vs, vz = _rows_v_loads(V_WORDS, V_SCALE, V_ZERO, slot, mask_n, kvh, offs_w, stride_vws,
                                   stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh, MASKED)
    pz, a0, a1, a2, a3, a4, a5, a6, a7 = _rows_values(
        p, alpha, vw, vs.to(tl.float32), vz.to(tl.float32), pz, a0, a1, a2, a3, a4, a5, a6, a7,
        OFF, MAGIC, DOT_T)
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
def _store_planes(o_rows, a0, a1, a2, a3, a4, a5, a6, a7, il, zt, mh, D4: tl.constexpr, R1: tl.constexpr,
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
def _split_state(W: tl.constexpr, H: tl.constexpr):
    """A row-scale split's empty online-softmax state over ``H`` columns: running max (-inf), sum, ``sum(p*z)``, and
    the eight ``o'^T`` plane accumulators ``[W, H]`` (code-word rows x columns)."""
    return (tl.full([H], float("-inf"), tl.float32), tl.zeros([H], tl.float32), tl.zeros([H], tl.float32),
            tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32),
            tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32),
            tl.zeros([W, H], tl.float32), tl.zeros([W, H], tl.float32))


@triton.jit
def _pair_tile(start, hi, kv_start, sa_next, sb_next, offs_t, offs_w, kvh, isb, KV_INDICES,
               K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO,
               stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
               stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
               qa0, qa1, qa2, qa3, qa4, qa5, qa6, qa7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
               s_init, qtot, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7,
               BLOCK_N: tl.constexpr, OFF: tl.constexpr, MAGIC: tl.constexpr, DOT_T: tl.constexpr,
               OFF64: tl.constexpr):
    """One tile of the paired split loop: its first ``BLOCK_N / 2`` tokens (half A) feed the columns ``< BLOCK_H`` of
    a ``[BLOCK_N / 2, 2 BLOCK_H]`` score tile, the second half (B) the others, each column its own online softmax
    (see :func:`_pair_split`). Returns the next tile's slots of both halves and the updated state."""
    HB: tl.constexpr = BLOCK_N // 2
    offs_a = start + offs_t
    offs_b = offs_a + HB
    sa, sb = sa_next, sb_next
    sa_next = tl.load(KV_INDICES + kv_start + BLOCK_N + offs_a, mask=BLOCK_N + offs_a < hi, other=0)
    sb_next = tl.load(KV_INDICES + kv_start + BLOCK_N + offs_b, mask=BLOCK_N + offs_b < hi, other=0)
    if OFF64:
        sa = sa.to(tl.int64)
        sb = sb.to(tl.int64)
    mask_a = offs_a < hi
    mask_b = offs_b < hi
    kwa, ksa, kza = _rows_k_loads(K_WORDS, K_SCALE, K_ZERO, sa, kvh, offs_w, stride_kws, stride_kwh,
                                  stride_kss, stride_ksh, stride_kzs, stride_kzh)
    kwb, ksb, kzb = _rows_k_loads(K_WORDS, K_SCALE, K_ZERO, sb, kvh, offs_w, stride_kws, stride_kwh,
                                  stride_kss, stride_ksh, stride_kzs, stride_kzh)
    k0, k1, k2, k3, k4, k5, k6, k7 = _word_planes(kwa, MAGIC, DOT_T)
    j0, j1, j2, j3, j4, j5, j6, j7 = _word_planes(kwb, MAGIC, DOT_T)
    qc = tl.dot(k0, qa0, s_init)
    qc = tl.dot(j0, qb0, qc)
    qc = tl.dot(k1, qa1, qc)
    qc = tl.dot(j1, qb1, qc)
    qc = tl.dot(k2, qa2, qc)
    qc = tl.dot(j2, qb2, qc)
    qc = tl.dot(k3, qa3, qc)
    qc = tl.dot(j3, qb3, qc)
    qc = tl.dot(k4, qa4, qc)
    qc = tl.dot(j4, qb4, qc)
    qc = tl.dot(k5, qa5, qc)
    qc = tl.dot(j5, qb5, qc)
    qc = tl.dot(k6, qa6, qc)
    qc = tl.dot(j6, qb6, qc)
    qc = tl.dot(k7, qa7, qc)
    qc = tl.dot(j7, qb7, qc)  # [N/2, 2H]: column c < H token a, head c; column H + h token b, head h
    ks = tl.where(isb, ksb.to(tl.float32)[:, None], ksa.to(tl.float32)[:, None])
    kz = tl.where(isb, kzb.to(tl.float32)[:, None], kza.to(tl.float32)[:, None])
    s = qc * ks + kz * qtot[None, :]
    s = tl.where(tl.where(isb, mask_b[:, None], mask_a[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a half with no token yet: alpha = p = 0, not NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    vwa, vsa, vza = _rows_v_loads(V_WORDS, V_SCALE, V_ZERO, sa, mask_a, kvh, offs_w, stride_vws, stride_vwh,
                                  stride_vss, stride_vsh, stride_vzs, stride_vzh)
    vwb, vsb, vzb = _rows_v_loads(V_WORDS, V_SCALE, V_ZERO, sb, mask_b, kvh, offs_w, stride_vws, stride_vwh,
                                  stride_vss, stride_vsh, stride_vzs, stride_vzh)
    vs = tl.where(isb, vsb.to(tl.float32)[:, None], vsa.to(tl.float32)[:, None])
    vz = tl.where(isb, vzb.to(tl.float32)[:, None], vza.to(tl.float32)[:, None])
    ps = (p * vs).to(DOT_T)
    zero = tl.zeros_like(ps)
    psa = tl.where(isb, zero, ps)
    psb = tl.where(isb, ps, zero)
    pz = pz * alpha + tl.sum(p * vz, 0)
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_planes(vwa, MAGIC, DOT_T)
    u0, u1, u2, u3, u4, u5, u6, u7 = _word_planes(vwb, MAGIC, DOT_T)
    off_t = (OFF * tl.sum(ps.to(tl.float32), 0))[None, :]  # the 1024 offsets, per tile (see _rows_values)
    al = alpha[None, :]
    a0 = a0 * al + (tl.dot(tl.trans(u0), psb, tl.dot(tl.trans(v0), psa)) - off_t)
    a1 = a1 * al + (tl.dot(tl.trans(u1), psb, tl.dot(tl.trans(v1), psa)) - off_t)
    a2 = a2 * al + (tl.dot(tl.trans(u2), psb, tl.dot(tl.trans(v2), psa)) - off_t)
    a3 = a3 * al + (tl.dot(tl.trans(u3), psb, tl.dot(tl.trans(v3), psa)) - off_t)
    a4 = a4 * al + (tl.dot(tl.trans(u4), psb, tl.dot(tl.trans(v4), psa)) - off_t)
    a5 = a5 * al + (tl.dot(tl.trans(u5), psb, tl.dot(tl.trans(v5), psa)) - off_t)
    a6 = a6 * al + (tl.dot(tl.trans(u6), psb, tl.dot(tl.trans(v6), psa)) - off_t)
    a7 = a7 * al + (tl.dot(tl.trans(u7), psb, tl.dot(tl.trans(v7), psa)) - off_t)
    return sa_next, sb_next, m_new, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _pair_halves(a, w2, W: tl.constexpr, BLOCK_H: tl.constexpr):
    """``[W, 2H]`` -> ``[W, H]``: columns ``h`` and ``H + h`` weighted by ``w2[0, h]`` and ``w2[1, h]`` and summed."""
    return tl.sum(tl.reshape(a, (W, 2, BLOCK_H)) * w2[None, :, :], 1)


@triton.jit
def _pair_split(QN, K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO, KV_INDPTR, KV_INDICES, PART_O, PART_LSE,
                b, kvh, split, num_splits,
                stride_qnb, stride_qnh,
                stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
                stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
                stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                GQA: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                MAGIC: tl.constexpr, DOT_T: tl.constexpr, OFF64: tl.constexpr):
    """One INT2 split of the row-scale kernel with the padded half of the head tile put to use (``pair``): a GQA
    group of ``H`` heads fills only ``H`` of the ``2H``-wide tensor-core tile, so each 128-token tile is taken as two
    64-token halves side by side: ``s[t, c]`` is token ``t`` (half A) for ``c < H`` and token ``64 + t`` (half B)
    for ``c >= H``, from two dots per bit plane with the query plane zero in the other half's columns. Every score,
    exponential and scale is then a useful one (the unpaired tile computes ``[128, 2H]`` for ``H`` heads), at the
    same tensor-core work. Each column runs its own online softmax; the two halves of a head meet once, at the end.
    Same partial output and LSE as the plain split."""
    W: tl.constexpr = HEAD_DIM // 8
    D4: tl.constexpr = HEAD_DIM // 4
    C: tl.constexpr = 2 * BLOCK_H
    HB: tl.constexpr = BLOCK_N // 2
    offs_c = tl.arange(0, C)
    hc = offs_c % BLOCK_H
    isb = (offs_c >= BLOCK_H)[None, :]
    mq = (hc < GQA)[None, :]
    q_rows = QN + b * stride_qnb + (kvh * GQA + hc)[None, :] * stride_qnh  # [1, 2H]
    offs_w = tl.arange(0, W)
    OFF: tl.constexpr = F16_MAGIC if MAGIC else 0.0  # as the plain split: codes arrive as 1024 + 4**j c
    R1: tl.constexpr = 0.25 if MAGIC else 1.0
    R2: tl.constexpr = 0.0625 if MAGIC else 1.0
    R3: tl.constexpr = 0.015625 if MAGIC else 1.0
    q0, q1, q2, q3, q4, q5, q6, q7, qtot, qoff = _query_planes(q_rows, mq, HEAD_DIM, R1, R2, R3, OFF, DOT_T)
    s_init = tl.zeros([HB, C], tl.float32) - qoff[None, :]
    zq = tl.zeros_like(q0)
    qa0, qb0 = tl.where(isb, zq, q0), tl.where(isb, q0, zq)
    qa1, qb1 = tl.where(isb, zq, q1), tl.where(isb, q1, zq)
    qa2, qb2 = tl.where(isb, zq, q2), tl.where(isb, q2, zq)
    qa3, qb3 = tl.where(isb, zq, q3), tl.where(isb, q3, zq)
    qa4, qb4 = tl.where(isb, zq, q4), tl.where(isb, q4, zq)
    qa5, qb5 = tl.where(isb, zq, q5), tl.where(isb, q5, zq)
    qa6, qb6 = tl.where(isb, zq, q6), tl.where(isb, q6, zq)
    qa7, qb7 = tl.where(isb, zq, q7), tl.where(isb, q7, zq)

    m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7 = _split_state(W, C)

    kv_start, lo, hi = _list_part(KV_INDPTR, b, split, num_splits, BLOCK_N)
    offs_t = tl.arange(0, HB)
    sa_next = tl.load(KV_INDICES + kv_start + lo + offs_t, mask=lo + offs_t < hi, other=0)
    sb_next = tl.load(KV_INDICES + kv_start + lo + HB + offs_t, mask=lo + HB + offs_t < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        sa_next, sb_next, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7 = _pair_tile(
            start, hi, kv_start, sa_next, sb_next, offs_t, offs_w, kvh, isb, KV_INDICES,
            K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO,
            stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
            stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
            qa0, qa1, qa2, qa3, qa4, qa5, qa6, qa7, qb0, qb1, qb2, qb3, qb4, qb5, qb6, qb7,
            s_init, qtot, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7,
            BLOCK_N, OFF, MAGIC, DOT_T, OFF64)
    # the two halves of each head: one softmax state
    m2 = tl.reshape(m_i, (2, BLOCK_H))
    m_h = tl.max(m2, 0)
    w2 = tl.exp2(m2 - tl.where(m_h == float("-inf"), 0.0, m_h)[None, :])
    inv_l, lse = _finish_split(m_h, tl.sum(tl.reshape(l_i, (2, BLOCK_H)) * w2, 0))
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQA
    heads = kvh * GQA + offs_h
    il = inv_l[None, :]
    zt = (tl.sum(tl.reshape(pz, (2, BLOCK_H)) * w2, 0) * inv_l)[None, :]
    o_rows = PART_O + b * stride_pob + heads[None, :] * stride_poh + split * stride_pos + 2 * offs_w[:, None]
    mh = mask_h[None, :]
    _store_planes(o_rows, _pair_halves(a0, w2, W, BLOCK_H), _pair_halves(a1, w2, W, BLOCK_H),
                  _pair_halves(a2, w2, W, BLOCK_H), _pair_halves(a3, w2, W, BLOCK_H),
                  _pair_halves(a4, w2, W, BLOCK_H), _pair_halves(a5, w2, W, BLOCK_H),
                  _pair_halves(a6, w2, W, BLOCK_H), _pair_halves(a7, w2, W, BLOCK_H), il, zt, mh, D4, R1, R2, R3)
    tl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


@triton.jit
def _decode_rows_kernel(
    QN,
    K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO,
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
    PREFETCH: tl.constexpr, EARLY_V: tl.constexpr, PIPELINE: tl.constexpr, PDL: tl.constexpr,
    EXACT_QUARTERS: tl.constexpr, L2_AHEAD: tl.constexpr, PEEL: tl.constexpr, PER_SEQ_EXACT: tl.constexpr,
    PAIR: tl.constexpr = False,
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
    num_splits, num_exact = _split_counts(NUM_SPLITS, NUM_EXACT, b, parts, exact_splits, PER_SEQ_EXACT)
    if PDL:  # launched early: wait for the step's write (q', the new rows), then let the merge launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PAIR and split < num_splits:
        _pair_split(QN, K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO, KV_INDPTR, KV_INDICES, PART_O, PART_LSE,
                    b, kvh, split, num_splits, stride_qnb, stride_qnh,
                    stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
                    stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
                    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
                    GQA, BLOCK_H, HEAD_DIM, BLOCK_N, MAGIC, DOT_T, OFF64)
    elif split < num_splits:
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

        kv_start, lo, hi = _list_part(KV_INDPTR, b, split, num_splits, BLOCK_N)
        offs_t = tl.arange(0, BLOCK_N)
        if PIPELINE:
            # software pipeline: tile i + 1's words, scales and zeros are loaded while tile i is computed (their
            # registers carried across the iteration), and tile i + 2's slots one step earlier still
            slot = tl.load(KV_INDICES + kv_start + lo + offs_t, mask=lo + offs_t < hi, other=0)
            if OFF64:
                slot = slot.to(tl.int64)
            kw_n, ks_n, kz_n = _rows_k_loads(K_WORDS, K_SCALE, K_ZERO, slot, kvh, offs_w, stride_kws, stride_kwh,
                                             stride_kss, stride_ksh, stride_kzs, stride_kzh)
            vw_n, vs_n, vz_n = _rows_v_loads(V_WORDS, V_SCALE, V_ZERO, slot, lo + offs_t < hi, kvh, offs_w,
                                             stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh)
            slot_next = tl.load(KV_INDICES + kv_start + lo + BLOCK_N + offs_t, mask=lo + BLOCK_N + offs_t < hi, other=0)
            for start in range(lo, hi, BLOCK_N):
                mask_n = start + offs_t < hi
                kw, ks, kz, vw, vs, vz = kw_n, ks_n, kz_n, vw_n, vs_n, vz_n
                slot = slot_next
                if OFF64:
                    slot = slot.to(tl.int64)
                kw_n, ks_n, kz_n = _rows_k_loads(K_WORDS, K_SCALE, K_ZERO, slot, kvh, offs_w, stride_kws,
                                                 stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh)
                vw_n, vs_n, vz_n = _rows_v_loads(V_WORDS, V_SCALE, V_ZERO, slot, start + BLOCK_N + offs_t < hi, kvh,
                                                 offs_w, stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs,
                                                 stride_vzh)
                nxt = start + 2 * BLOCK_N + offs_t
                slot_next = tl.load(KV_INDICES + kv_start + nxt, mask=nxt < hi, other=0)
                p, alpha, m_i, l_i = _rows_scores(kw, ks.to(tl.float32), kz.to(tl.float32), mask_n, q0, q1, q2, q3,
                                                  q4, q5, q6, q7, s_init, qtot, m_i, l_i, MAGIC, DOT_T)
                pz, a0, a1, a2, a3, a4, a5, a6, a7 = _rows_values(
                    p, alpha, vw, vs.to(tl.float32), vz.to(tl.float32), pz, a0, a1, a2, a3, a4, a5, a6, a7,
                    OFF, MAGIC, DOT_T)
        else:
            if PREFETCH:  # the slots of the first tile; each iteration then loads the next tile's
                slot_next = tl.load(KV_INDICES + kv_start + lo + offs_t, mask=lo + offs_t < hi, other=0)
            else:
                slot_next = offs_t  # not read
            if PEEL:  # whole tiles without token masks, then the split's partial last tile (if any) with them
                full_hi = lo + (hi - lo) // BLOCK_N * BLOCK_N
            else:
                full_hi = hi
            for start in range(lo, full_hi, BLOCK_N):
                slot_next, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7 = _rows_tile(
                    start, hi, kv_start, slot_next, offs_t, offs_w, kvh, KV_INDICES,
                    K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO,
                    stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
                    stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
                    q0, q1, q2, q3, q4, q5, q6, q7, s_init, qtot, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7,
                    BLOCK_N, OFF, MAGIC, DOT_T, OFF64, PREFETCH, EARLY_V, L2_AHEAD, not PEEL)
            if PEEL:
                if full_hi < hi:
                    slot_next, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7 = _rows_tile(
                        full_hi, hi, kv_start, slot_next, offs_t, offs_w, kvh, KV_INDICES,
                        K_WORDS, K_SCALE, K_ZERO, V_WORDS, V_SCALE, V_ZERO,
                        stride_kws, stride_kwh, stride_kss, stride_ksh, stride_kzs, stride_kzh,
                        stride_vws, stride_vwh, stride_vss, stride_vsh, stride_vzs, stride_vzh,
                        q0, q1, q2, q3, q4, q5, q6, q7, s_init, qtot, m_i, l_i, pz, a0, a1, a2, a3, a4, a5, a6, a7,
                        BLOCK_N, OFF, MAGIC, DOT_T, OFF64, PREFETCH, EARLY_V, 0, True)
        inv_l, lse = _finish_split(m_i, l_i)
        il = inv_l[None, :]
        zt = (pz * inv_l)[None, :]
        o_rows = PART_O + b * stride_pob + heads[None, :] * stride_poh + split * stride_pos + 2 * offs_w[:, None]
        mh = mask_h[None, :]
        _store_planes(o_rows, a0, a1, a2, a3, a4, a5, a6, a7, il, zt, mh, D4, R1, R2, R3)
        tl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)
    elif split < num_splits + num_exact:
        # ---------------- exact (BF16) split: tokens x heads, natural element order ----------------
        bf_start, bf_lo, bf_hi = _list_part(BF16_INDPTR, b, split - num_splits, num_exact, BLOCK_NB)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        if EXACT_QUARTERS:  # rows read and multiplied a quarter of the head dim at a time: fewer live registers
            offs_e = tl.arange(0, D4)
            qe = q_rows + offs_e[:, None]
            mq = mask_h[None, :]
            qe0 = tl.load(qe + 0 * D4, mask=mq, other=0.0).to(DOT_T)  # [d/4, H]
            qe1 = tl.load(qe + 1 * D4, mask=mq, other=0.0).to(DOT_T)
            qe2 = tl.load(qe + 2 * D4, mask=mq, other=0.0).to(DOT_T)
            qe3 = tl.load(qe + 3 * D4, mask=mq, other=0.0).to(DOT_T)
            e0 = tl.zeros([D4, BLOCK_H], tl.float32)  # quarters of o'^T
            e1 = tl.zeros([D4, BLOCK_H], tl.float32)
            e2 = tl.zeros([D4, BLOCK_H], tl.float32)
            e3 = tl.zeros([D4, BLOCK_H], tl.float32)
            for start in range(bf_lo, bf_hi, BLOCK_NB):
                offs_n = start + tl.arange(0, BLOCK_NB)
                mask_n = offs_n < bf_hi
                slot = tl.load(BF16_INDICES + bf_start + offs_n, mask=mask_n, other=0).to(tl.int64)
                mn = mask_n[:, None]
                k_rows = K_BF16 + slot[:, None] * stride_kbs + kvh * stride_kbh + offs_e[None, :]
                s = tl.dot(tl.load(k_rows + 0 * D4, mask=mn, other=0.0).to(DOT_T), qe0)
                s = tl.dot(tl.load(k_rows + 1 * D4, mask=mn, other=0.0).to(DOT_T), qe1, s)
                s = tl.dot(tl.load(k_rows + 2 * D4, mask=mn, other=0.0).to(DOT_T), qe2, s)
                s = tl.dot(tl.load(k_rows + 3 * D4, mask=mn, other=0.0).to(DOT_T), qe3, s)
                s = tl.where(mn, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 0))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[None, :])
                l_i = l_i * alpha + tl.sum(p, 0)
                pv = p.to(BF_PV_T)
                v_rows = V_BF16 + slot[:, None] * stride_vbs + kvh * stride_vbh + offs_e[None, :]
                e0 = tl.dot(tl.trans(tl.load(v_rows + 0 * D4, mask=mn, other=0.0).to(BF_PV_T)), pv,
                            e0 * alpha[None, :])
                e1 = tl.dot(tl.trans(tl.load(v_rows + 1 * D4, mask=mn, other=0.0).to(BF_PV_T)), pv,
                            e1 * alpha[None, :])
                e2 = tl.dot(tl.trans(tl.load(v_rows + 2 * D4, mask=mn, other=0.0).to(BF_PV_T)), pv,
                            e2 * alpha[None, :])
                e3 = tl.dot(tl.trans(tl.load(v_rows + 3 * D4, mask=mn, other=0.0).to(BF_PV_T)), pv,
                            e3 * alpha[None, :])
                m_i = m_new
            inv_l, lse = _finish_split(m_i, l_i)
            il = inv_l[None, :]
            o_rows = PART_O + b * stride_pob + heads[None, :] * stride_poh + split * stride_pos + offs_e[:, None]
            tl.store(o_rows + 0 * D4, e0 * il, mask=mq)
            tl.store(o_rows + 1 * D4, e1 * il, mask=mq)
            tl.store(o_rows + 2 * D4, e2 * il, mask=mq)
            tl.store(o_rows + 3 * D4, e3 * il, mask=mq)
        else:
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
            inv_l, lse = _finish_split(m_i, l_i)
            tl.store(PART_O + b * stride_pob + heads[None, :] * stride_poh + split * stride_pos + offs_d[:, None],
                     acc * inv_l[None, :], mask=mask_h[None, :])
        tl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


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
    :mod:`oscar_kernels.extend_int2`; a row whose scores are all -inf so far keeps ``l = 0``."""
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


@triton.jit
def _decode_int2_kernel(
    QN,
    K_CODES, K_SCALE, K_ZERO, V_CODES, V_SCALE, V_ZERO,
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
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    D4: tl.constexpr = HEAD_DIM // 4
    BQ: tl.constexpr = GROUP_SIZE // 4
    NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
    num_splits, num_exact = _split_counts(NUM_SPLITS, NUM_EXACT, b, parts, exact_splits, PER_SEQ_EXACT)
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
            for start in range(lo, hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                mask_n = offs_n < hi
                slot = tl.load(KV_INDICES + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
                kc = tl.load(K_CODES + slot[:, None] * stride_kcs + kvh * stride_kch + offs_m[None, :])
                vc = tl.load(V_CODES + slot[:, None] * stride_vcs + kvh * stride_vch + offs_m[None, :])
                if NG == 1:
                    ks = tl.load(K_SCALE + slot * stride_kss + kvh * stride_ksh, mask=mask_n, other=0.0).to(tl.float32)
                    kz = tl.load(K_ZERO + slot * stride_kzs + kvh * stride_kzh, mask=mask_n, other=0.0).to(tl.float32)
                    vs = tl.load(V_SCALE + slot * stride_vss + kvh * stride_vsh, mask=mask_n, other=0.0).to(tl.float32)
                    vz = tl.load(V_ZERO + slot * stride_vzs + kvh * stride_vzh, mask=mask_n, other=0.0).to(tl.float32)
                    if PTX_UNPACK:  # codes arrive as F16_MAGIC + c: q.(M + c) = q.c + M sum(q)
                        k0, k1, k2, k3 = _planes_f16(kc)
                        kz = kz - F16_MAGIC * ks
                    else:
                        k0 = (kc & 3).to(QK_T)
                        k1 = ((kc >> 2) & 3).to(QK_T)
                        k2 = ((kc >> 4) & 3).to(QK_T)
                        k3 = (kc >> 6).to(QK_T)
                    qc = dot_nt(q0, k0, True)
                    qc += dot_nt(q1, k1, True)
                    qc += dot_nt(q2, k2, True)
                    qc += dot_nt(q3, k3, True)
                    s = qc * ks[None, :] + qsum[:, None] * kz[None, :]
                else:
                    ks = tl.load(K_SCALE + slot[:, None] * stride_kss + kvh * stride_ksh + gidx[None, :],
                                 mask=mask_n[:, None], other=0.0).to(tl.float32)
                    kz = tl.load(K_ZERO + slot[:, None] * stride_kzs + kvh * stride_kzh + gidx[None, :],
                                 mask=mask_n[:, None], other=0.0).to(tl.float32)
                    s = dot_nt(q0, ((kc & 3).to(tl.float32) * ks + kz).to(QK_T), True)
                    s += dot_nt(q1, (((kc >> 2) & 3).to(tl.float32) * ks + kz).to(QK_T), True)
                    s += dot_nt(q2, (((kc >> 4) & 3).to(tl.float32) * ks + kz).to(QK_T), True)
                    s += dot_nt(q3, ((kc >> 6).to(tl.float32) * ks + kz).to(QK_T), True)
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
                    if PTX_UNPACK:  # codes arrive as BF16_MAGIC + c: sum ps (M + c) = sum ps c + M sum ps
                        v0, v1, v2, v3 = _planes_bf16(vc)
                        pz -= BF16_MAGIC * tl.sum(ps.to(tl.float32), 1)
                    else:
                        v0 = (vc & 3).to(PV_T)
                        v1 = ((vc >> 2) & 3).to(PV_T)
                        v2 = ((vc >> 4) & 3).to(PV_T)
                        v3 = (vc >> 6).to(PV_T)
                    acc0 += tl.dot(ps, v0) + pz[:, None]
                    acc1 += tl.dot(ps, v1) + pz[:, None]
                    acc2 += tl.dot(ps, v2) + pz[:, None]
                    acc3 += tl.dot(ps, v3) + pz[:, None]
                else:
                    vs = tl.load(V_SCALE + slot[:, None] * stride_vss + kvh * stride_vsh + gidx[None, :],
                                 mask=mask_n[:, None], other=0.0).to(tl.float32)
                    vz = tl.load(V_ZERO + slot[:, None] * stride_vzs + kvh * stride_vzh + gidx[None, :],
                                 mask=mask_n[:, None], other=0.0).to(tl.float32)
                    pp = p.to(PV_T)
                    acc0 += tl.dot(pp, ((vc & 3).to(tl.float32) * vs + vz).to(PV_T))
                    acc1 += tl.dot(pp, (((vc >> 2) & 3).to(tl.float32) * vs + vz).to(PV_T))
                    acc2 += tl.dot(pp, (((vc >> 4) & 3).to(tl.float32) * vs + vz).to(PV_T))
                    acc3 += tl.dot(pp, ((vc >> 6).to(tl.float32) * vs + vz).to(PV_T))
                m_i = m_new
        else:
            # ---------------- exact (BF16) split ----------------
            bf_start, bf_lo, bf_hi = _list_part(BF16_INDPTR, b, split - num_splits, num_exact, BLOCK_NB)
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
        inv_l, lse = _finish_split(m_i, l_i)
        o_rows = PART_O + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos
        mh = mask_h[:, None]
        tl.store(o_rows + (col0 + 0 * BQ)[None, :], acc0 * inv_l[:, None], mask=mh)
        tl.store(o_rows + (col0 + 1 * BQ)[None, :], acc1 * inv_l[:, None], mask=mh)
        tl.store(o_rows + (col0 + 2 * BQ)[None, :], acc2 * inv_l[:, None], mask=mh)
        tl.store(o_rows + (col0 + 3 * BQ)[None, :], acc3 * inv_l[:, None], mask=mh)
        tl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse, mask=mask_h)


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
    PDL: tl.constexpr,
):
    """The merge of one (sequence, query head), output columns ``[c * COLS, (c + 1) * COLS)``: partial weights from
    every LSE at once, the weighted sum of the partials ``SPLIT_CHUNK`` at a time (independent loads), then those
    columns of ``o = o' @ R_V^T`` as fp32 multiply-sums (their ``R_V`` rows loaded first when ``COLS <= ROT_ROWS``). With ``COLS < d`` each of the ``d / COLS`` programs of a head
    merges the whole ``o'`` (the partials are read from L2 that many times) and rotates its share."""
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
    if PDL:  # launched early: wait for the split kernel's partials
        tl.extra.cuda.gdc_wait()
    num_splits, num_exact = _split_counts(NUM_SPLITS, NUM_EXACT, b, parts, exact_splits, PER_SEQ_EXACT)
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


# ---------------------------------------------------------------------------------------------------------------
# split policy


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


EXACT_BALANCE = True
""":class:`~oscar_kernels.plan.DecodePlan` default: exact programs per sequence from :func:`balance_counts` (the
context sets how many the exact rows need; an occupancy-bound sequence takes the programs they leave as INT2
splits) instead of ``exact_splits`` for every sequence."""
EXACT_ROWS_PER_TILE = 40
"""Balance rule: exact rows one exact program takes per 128-token INT2 tile of the sequence's longest split, so an
exact program (32-row bf16 tiles) ends about when the INT2 splits do: a 32-row exact tile (16 KB of bf16 K and V)
takes ~0.7 of a 128-token INT2 tile's time. Measured on an H200 (``bench_decode.py --variants --set balance``,
commit 0c8db62, per layer at bs1/100k): with 64 rows per tile one exact program of ten tiles beside 130 six-tile
splits gave 43.9 µs, level with three programs beside 128 seven-tile splits (44.4), where two exact programs of five
tiles beside 130 six-tile splits had given 41.2 (commit b61799f): the single program was the longest."""


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


# ---------------------------------------------------------------------------------------------------------------
# launcher


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


def merge_columns(heads: int, head_dim: int) -> int:
    """Output columns per merge program for ``heads = B * Hq`` merged heads (see ``MERGE_MIN_PROGRAMS``)."""
    cols = triton.next_power_of_2(head_dim)
    while cols > MERGE_MIN_COLS and heads * triton.cdiv(head_dim, cols) < MERGE_MIN_PROGRAMS:
        cols //= 2
    return min(cols, head_dim)


def decode_workspace(batch: int, q_heads: int, head_dim: int, max_splits: int,
                     device: torch.device | str, exact_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch for :func:`decode_int2` (pass it to reuse buffers, e.g. inside a CUDA graph), ``P = max_splits +
    exact_splits``: ``part_o`` fp32 ``[B, Hq, P, d]``, ``part_lse`` fp32 ``[B, Hq, P]``, ``q_rot`` fp32
    ``[B, Hq, d]``."""
    parts = max_splits + exact_splits
    return (torch.empty(batch, q_heads, parts, head_dim, dtype=torch.float32, device=device),
            torch.empty(batch, q_heads, parts, dtype=torch.float32, device=device),
            torch.empty(batch, q_heads, head_dim, dtype=torch.float32, device=device))


def decode_int2(
    q: torch.Tensor,
    cache: LayerCache,
    index: DecodeIndex,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    sm_scale: float | None = None,
    block_n: int | None = None,
    num_stages: int | None = None,
    num_warps: int | None = None,
    ptx_unpack: bool | None = None,
    row_kernel: bool | None = None,
    max_registers: int | None = None,
    merge_chunk: int | None = None,
    merge_cols: int | None = None,
    prefetch: bool = ROWS_PREFETCH,
    early_v: bool = ROWS_EARLY_V,
    pipeline: bool = ROWS_PIPELINE,
    pdl: bool = False,
    exact_quarters: bool = False,
    l2_ahead: int = ROWS_L2_AHEAD,
    rotate_q: bool = True,
    block_nb: int | None = None,
    peel: bool = ROWS_PEEL,
    pair: bool = ROWS_PAIR,
    async_tiles: bool = ROWS_ASYNC,
    int8_scores: bool = ROWS_INT8_SCORES,
    fold_offset: bool = ROWS_FOLD_OFFSET,
    int8_values: bool = ROWS_INT8_VALUES,
    lean_tiles: bool = ROWS_LEAN_TILES,
    fused_update: bool = ROWS_FUSED_UPDATE,
    movmatrix: bool = ROWS_MOVMATRIX,
) -> torch.Tensor:
    """Decode attention of one query per sequence over its INT2 slots and exact rows.

    Args:
        q: bf16/fp16/fp32 ``[B, Hq, d]`` un-rotated queries (``Hq`` a multiple of ``Hkv``; any strides).
        cache: the layer's :class:`~oscar_kernels.layout.LayerCache` (INT2 pools, exact rows, rotations).
        index: :class:`DecodeIndex` of the batch (lists, per-sequence split counts, ``max_splits``).
        workspace: optional :func:`decode_workspace` ``(B, Hq, d, index.max_splits)`` buffers, to avoid allocations
            inside a captured graph.
        out: optional ``[B, Hq, d]`` output (default: new tensor of ``q.dtype``).
        sm_scale: softmax scale (default ``1/sqrt(d)``).
        block_n, num_stages, num_warps: INT2 tokens per tile, Triton pipelining depth and warps of the split
            kernel (defaults per path: ``ROWS_*`` for the row-scale path; ``DEFAULT_BLOCK_N``, ``GENERAL_STAGES``,
            ``SMALL_BATCH_WARPS`` / ``GENERAL_WARPS`` otherwise).
        ptx_unpack: general path only: unpack codes with the PTX magic-number trick (default: on CUDA, ``g = d``).
        row_kernel: use the row-scale fast path (default: :func:`row_path`); ``False`` forces the general path.
        max_registers: register cap per thread of the row-scale split kernel (Triton's ``maxnreg``; default
            ``ROWS_MAX_REGISTERS`` from ``ROWS_CAPPED_PROGRAMS`` launched split programs on, else none; 0 for none).
        merge_chunk: INT2 partials the merge reads per step, a power of two (default :func:`merge_chunk_for` the
            launch's partials).
        merge_cols: output columns per merge program, a power of two (at most ``d``; default
            :func:`merge_columns`).
        prefetch, early_v: row-scale path: load the next tile's slots one iteration ahead (``ROWS_PREFETCH``); issue
            the value tile's loads with the key tile's (``ROWS_EARLY_V``).
        block_nb: exact rows per tile of the exact split (``BF16_BLOCK_N``).
        peel: row-scale path, plain split loop: whole tiles without token masks, the partial last tile apart
            (``ROWS_PEEL``).
        pair: row-scale path: each 128-token tile as two 64-token halves side by side in the head tile's padded
            columns (``ROWS_PAIR``; with ``prefetch``, without ``pipeline``, ``peel``, ``early_v`` or ``l2_ahead``).
        pipeline: row-scale path: software-pipeline the split loop (``ROWS_PIPELINE``).
        async_tiles: row-scale path on CUDA: run :mod:`oscar_kernels.decode_async`'s split kernel (the next tile's
            words copied into shared memory with ``cp.async`` while a tile computes; ``num_stages`` 2 or 3 sets its
            shared-memory stages) where it covers the launch (:func:`~oscar_kernels.decode_async.usable`, no other
            row-scale variant asked for); ``ROWS_ASYNC``.
        int8_scores: with ``async_tiles``: the scores from int8 tensor-core products (``ROWS_INT8_SCORES``): each
            head's rotated query quantized to int8 with its own scale, the key codes unpacked four to an ALU
            instruction (three shifts and four ANDs per sixteen codes against eight LOP3s and a shift), half the
            MMAs (k = 32).
        fold_offset: with ``async_tiles``: each value plane's MMA starts from its rescaled sum less the tile's code
            offset (``ROWS_FOLD_OFFSET``; one fused multiply per element instead of a subtract and a multiply-add).
        lean_tiles: with ``async_tiles``: the tile's per-token bookkeeping (scale conversions, the token mask) on
            the slot vector's side (``ROWS_LEAN_TILES``; same results).
        fused_update: with ``int8_values``: each value plane's accumulator update as two fused multiply-adds
            (``ROWS_FUSED_UPDATE``; rounds the rescaled sum once more).
        movmatrix: with ``async_tiles``: the probabilities into the value MMA's operand layout by ``movmatrix``
            transposes (``ROWS_MOVMATRIX``; same results; the head tile padded to 8).
        int8_values: with ``async_tiles``: the INT2 rows' value products from int8 tensor-core products
            (``ROWS_INT8_VALUES``): each tile's probabilities rounded to int8 steps of 1/127 of each head's tile
            maximum times the token's value scale over the tile's largest; ``fold_offset`` does not apply.
        exact_quarters: row-scale path: the exact split reads and multiplies its rows a quarter of the head dim at a
            time (202 registers instead of 233 for the kernel at d = 128 with 32-row exact tiles, sink 64 / recent
            256: more resident programs; measured slower on an H200, commit f70fdbc: RESULTS.md).
        l2_ahead: row-scale path, plain split loop: ask the L2 to fetch the code words, scales and zeros of the
            tile ``l2_ahead`` iterations ahead (0 off, 1 or 2; 1 needs ``prefetch``) once a tile's scores are done
            (``ROWS_L2_AHEAD``); ignored under the interpreter (no PTX).
        pdl: launch the split kernel and the merge with programmatic dependent launch (Hopper on): each may start
            while the launch before it still runs and waits (``griddepcontrol.wait``) before reading what that one
            writes; the merge loads its ``R_V`` rows before waiting. Pair it with a previous launch that lets
            dependents start early (:func:`~oscar_kernels.quantize_pack.quantize_pack_kv` with
            ``launch_dependents``); ignored under the interpreter.
        rotate_q: ``False``: the workspace's ``q_rot`` already holds ``q @ R_K * sm_scale * log2(e)`` (fp32, e.g.
            written by the step's K/V write launch, as :meth:`~oscar_kernels.plan.DecodePlan.run` does), so the
            query rotation launch is skipped; ``q`` then only gives the shapes and the output dtype.

    Returns:
        ``out``: ``[B, Hq, d]``, attention output in the original (un-rotated) basis.
    """
    bsz, hq, d = check_query(q, cache)
    if q.is_cuda and (why := cuda_head_dim_refusal(d)) is not None:
        raise ValueError(f"decode_int2: {why}")
    hkv = cache.kv_heads
    index.check(bsz)
    if merge_chunk is None:
        merge_chunk = merge_chunk_for(index.parts)
    if merge_chunk < 1 or merge_chunk & (merge_chunk - 1):
        raise ValueError(f"merge_chunk must be a power of two >= 1, got {merge_chunk}")
    if merge_cols is None:
        merge_cols = merge_columns(bsz * hq, d)
    if merge_cols < 1 or merge_cols & (merge_cols - 1):
        raise ValueError(f"merge_cols must be a power of two >= 1, got {merge_cols}")
    gqa = hq // hkv
    g = cache.group_size
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
    pdl = bool(pdl) and not fp32_dot  # the interpreter has no grid dependency control
    if l2_ahead not in (0, 1, 2) or isinstance(l2_ahead, bool):
        raise ValueError(f"l2_ahead must be 0, 1 or 2 (tiles ahead), got {l2_ahead!r}")
    if l2_ahead == 1 and not prefetch:
        raise ValueError("l2_ahead=1 prefetches the next tile's slots, which prefetch=False does not load: "
                         "pass prefetch=True or l2_ahead=2")
    if pair and row_kernel and (pipeline or peel or early_v or l2_ahead or not prefetch):
        raise ValueError("pair runs its own split loop (next slots prefetched): pass it without pipeline, peel, "
                         "early_v and l2_ahead, and with prefetch")
    l2_ahead = 0 if fp32_dot or pipeline else l2_ahead  # PTX only; the pipelined loop holds its next tile already
    k, v = cache.k, cache.v
    per_seq_exact = index.num_exact is not None
    num_exact = index.num_exact if per_seq_exact else index.num_splits  # not read without per-sequence counts
    if rotate_q:
        _rotate_q_kernel[(bsz, hkv)](
            q, cache.rot_k, q_rot, sm_scale * LOG2E,
            *q.stride(), *cache.rot_k.stride(), q_rot.stride(0), q_rot.stride(1),
            GQA=gqa, BLOCK_H=triton.next_power_of_2(gqa), HEAD_DIM=d, BLOCK_C=min(d, Q_ROT_BLOCK_C),
            ROT_PER_HEAD=cache.rot_k.shape[0] > 1, num_warps=Q_ROT_WARPS,
        )
    if row_kernel:
        if max_registers is None and bsz * hkv * max_splits >= ROWS_CAPPED_PROGRAMS:
            max_registers = ROWS_MAX_REGISTERS
        kw, vw = k.words, v.words
        gluon = async_tiles and not fp32_dot and prefetch and not (pair or peel or pipeline or early_v or l2_ahead
                                                                    or pdl or exact_quarters)
        if gluon:
            from . import decode_async

            gluon = decode_async.usable(d, block_n, block_nb, num_warps, num_stages)
        args = (q_rot,
                kw, k.scale, k.zero, vw, v.scale, v.zero,
                cache.k_bf16, cache.v_bf16,
                index.kv_indptr, index.kv_indices, index.bf16_indptr, index.bf16_indices,
                part_o, part_lse, index.num_splits, num_exact,
                parts, index.exact_splits,
                q_rot.stride(0), q_rot.stride(1),
                kw.stride(0), kw.stride(1), k.scale.stride(0), k.scale.stride(1), k.zero.stride(0), k.zero.stride(1),
                vw.stride(0), vw.stride(1), v.scale.stride(0), v.scale.stride(1), v.zero.stride(0), v.zero.stride(1),
                cache.k_bf16.stride(0), cache.k_bf16.stride(1), cache.v_bf16.stride(0), cache.v_bf16.stride(1),
                part_o.stride(0), part_o.stride(1), part_o.stride(2),
                part_lse.stride(0), part_lse.stride(1))
        block_h = max(ROWS_MIN_BLOCK_H, triton.next_power_of_2(gqa))
        if gluon and movmatrix:
            block_h = max(block_h, 8)
        cap = {"maxnreg": max_registers} if max_registers else {}
        if gluon:
            decode_async._decode_rows_async_kernel[(bsz, hkv, parts)](
                *args, GQA=gqa, BLOCK_H=block_h, OFF64=cache.off64, PER_SEQ_EXACT=per_seq_exact,
                STAGES=num_stages or decode_async.STAGES, Q8=bool(int8_scores), FOLD=bool(fold_offset),
                V8=bool(int8_values), LEAN=bool(lean_tiles),
                FUSED=bool(fused_update), MOVM=bool(movmatrix), num_warps=1,
                **cap,
            )
        else:
            _decode_rows_kernel[(bsz, hkv, parts)](
                *args, GQA=gqa, BLOCK_H=block_h, HEAD_DIM=d,
                BLOCK_N=block_n or ROWS_BLOCK_N, BLOCK_NB=block_nb or BF16_BLOCK_N,
                MAGIC=not fp32_dot, DOT_T=tl.float32 if fp32_dot else tl.float16,
                BF_PV_T=tl.float32 if fp32_dot else tl.bfloat16, OFF64=cache.off64,
                PREFETCH=bool(prefetch), EARLY_V=bool(early_v), PIPELINE=bool(pipeline), PDL=pdl,
                EXACT_QUARTERS=bool(exact_quarters), L2_AHEAD=l2_ahead, PEEL=bool(peel) and not pipeline,
                PER_SEQ_EXACT=per_seq_exact, PAIR=bool(pair),
                num_warps=num_warps or ROWS_WARPS, num_stages=num_stages or ROWS_STAGES, launch_pdl=pdl, **cap,
            )
    else:
        if num_warps is None:
            num_warps = SMALL_BATCH_WARPS if bsz * hkv <= 16 else GENERAL_WARPS
        if ptx_unpack is None:
            ptx_unpack = not fp32_dot and g == d
        _decode_int2_kernel[(bsz, hkv, parts)](
            q_rot,
            k.codes, k.scale, k.zero, v.codes, v.scale, v.zero,
            cache.k_bf16, cache.v_bf16,
            index.kv_indptr, index.kv_indices, index.bf16_indptr, index.bf16_indices,
            part_o, part_lse, index.num_splits, num_exact,
            parts, index.exact_splits,
            q_rot.stride(0), q_rot.stride(1),
            k.codes.stride(0), k.codes.stride(1), k.scale.stride(0), k.scale.stride(1), k.zero.stride(0), k.zero.stride(1),
            v.codes.stride(0), v.codes.stride(1), v.scale.stride(0), v.scale.stride(1), v.zero.stride(0), v.zero.stride(1),
            cache.k_bf16.stride(0), cache.k_bf16.stride(1), cache.v_bf16.stride(0), cache.v_bf16.stride(1),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            GQA=gqa, BLOCK_H=max(GENERAL_MIN_BLOCK_H, triton.next_power_of_2(gqa)), HEAD_DIM=d, GROUP_SIZE=g,
            BLOCK_N=block_n or DEFAULT_BLOCK_N, BLOCK_NB=block_nb or BF16_BLOCK_N,
            QK_T=tl.float32 if fp32_dot else tl.float16, PV_T=tl.float32 if fp32_dot else tl.bfloat16,
            PTX_UNPACK=bool(ptx_unpack), PER_SEQ_EXACT=per_seq_exact,
            num_warps=num_warps, num_stages=num_stages or GENERAL_STAGES,
        )
    cols = min(d, merge_cols)
    _decode_int2_merge_kernel[(bsz, hq, d // cols)](
        part_o, part_lse, index.num_splits, num_exact, cache.rot_v, out,
        parts, index.exact_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        *cache.rot_v.stride(),
        *out.stride(),
        GQA=gqa, HEAD_DIM=d, BLOCK_P=triton.next_power_of_2(parts), ROT_PER_HEAD=cache.rot_v.shape[0] > 1,
        SPLIT_CHUNK=merge_chunk, ROT_ROWS=min(cols, MERGE_ROT_ROWS), COLS=cols, PER_SEQ_EXACT=per_seq_exact,
        PDL=pdl, num_warps=merge_warps(merge_chunk), launch_pdl=pdl,
    )
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
                    int8_scores: bool = False, int8_values: bool = False) -> torch.Tensor:
    """Plain fp32 torch definition of :func:`decode_int2` (split counts do not change the result); returns fp32
    ``[B, Hq, d]``. ``int8_scores``: that variant's definition: the INT2 rows' code terms ``scale * (c . q')`` use
    each head's rotated query rounded to int8 steps of ``max |q'| / 127``; their zero terms ``zero * sum(q')`` and
    the exact rows' scores use it as is. ``int8_values`` (row scales only): the INT2 rows' value code terms
    ``p * scale * c`` weigh each code by :func:`int8_value_weights` instead (tiles of ``VALUE_TILE`` rows from the
    start of the sequence's INT2 list); their zero terms ``p * zero``, the exact rows and the softmax's sum use the
    probabilities as they are."""
    bsz, hq, d = q.shape
    hkv = cache.kv_heads
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
            zero = cache.k.zero[sl].float().repeat_interleave(cache.k.group_size, -1)  # [n_int2, Hkv, d]
        if int8_values:  # the INT2 rows' value codes, their scales and zeros
            vc = dequantize_ref(cache.v.codes[sl], torch.ones_like(cache.v.scale[sl]),
                                torch.zeros_like(cache.v.zero[sl]), d)  # [n_int2, Hkv, d]
            vsc, vz = cache.v.scale[sl][..., 0].float(), cache.v.zero[sl][..., 0].float()  # [n_int2, Hkv]
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
