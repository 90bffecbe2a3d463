"""Decode on Qwen3-8B shapes: INT2 (``DecodePlan``) vs torch SDPA BF16 (cuDNN, flash), CUDA-graph replay.

Usage: python benchmarks/bench_decode.py [--commit SHA] [--sweep | --sweep-only | --layouts | --merge | --metadata
| --variants [--set write|one-wave|balance|async|int8|int8-values|lean] [--recent N]] [--results benchmarks/RESULTS.md]
Prints a table (median µs, GB/s on the bytes the attention reads, ratio to the best BF16 backend measured in the same
run, fraction of the copy bandwidth measured in the same run) and appends it to RESULTS.md with the date, device,
commit and command. Random data, never zeros. Each sequence of ``ctx`` tokens is planned by ``DecodePlan`` over an
``Int2KVPool`` with 64 sinks and a 64-token recent window: ``ctx - 128`` INT2 tokens plus 128 exact rows, the shapes
of the earlier tables (RESULTS.md, commits 529689a, dda96f4, dbd78bb). "INT2 µs" is ``DecodePlan.attend`` (the
attention alone, comparable with those tables); "run µs" is ``DecodePlan.run`` (the new token's K/V written as INT2
code + exact row by one ``quantize_pack_kv`` launch for K and V, with the plan's default write
``oscar_kernels.write.DECODE_WRITE``, then the attention); "run µs, tf32x3 write" the same with an empty
``write_tuning``: ``quantize_pack_kv``'s own parameters (the prefill write's, the decode default before commit
c0a87a8's measurement).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F
import triton
from oscar_kernels import (
    DecodeLaunch,
    DecodeOptions,
    DecodePlan,
    Int2KVPool,
    Int2Pool,
    LayerCache,
    decode_int2,
    decode_workspace,
    default_num_splits,
)
from oscar_kernels.scheme import QuantScheme
from torch.nn.attention import SDPBackend, sdpa_kernel

from oscar_cli import code_version
from oscar_cli.results_md import append_section, markdown_table

HQ, HKV, D = 32, 8, 128  # Qwen3-8B attention
SINK, RECENT = 64, 64
BF16_TOKENS = SINK + RECENT
SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (8, 131072), (16, 8192), (16, 32768),
          (16, 131072), (32, 8192), (32, 32768)]
DEV = "cuda"


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.randn(256 * 2**20, device=DEV)  # 1 GiB
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * 4 / (t * 1e-3)


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def fill_random(cache: LayerCache, gen: torch.Generator) -> None:
    """Random codes, scales, zeros and exact rows in every slot of a layer (speed does not depend on values; the
    benchmarks never read zeros). ``gen`` lives on the cache's device."""
    for p in (cache.k, cache.v):
        dev = p.codes.device
        p.codes.copy_(torch.randint(0, 256, p.codes.shape, dtype=torch.uint8, device=dev, generator=gen))
        p.scale.copy_((torch.rand(p.scale.shape, device=dev, generator=gen) * 0.1 + 0.01).to(p.scale.dtype))
        p.zero.copy_((torch.randn(p.zero.shape, device=dev, generator=gen) * 0.1).to(p.zero.dtype))
    for t in (cache.k_bf16, cache.v_bf16):
        t.copy_(torch.randn(t.shape, device=t.device, dtype=torch.bfloat16, generator=gen))


class Int2Case:
    """One batch: ``bs`` sequences of ``ctx`` tokens (new token included) in a one-layer pool, planned once."""

    def __init__(self, bs: int, ctx: int, gen: torch.Generator, head_major: bool = True, scale_dtype: str = "fp16",
                 widths: tuple[int, int] = (2, 2), **plan_kw):
        """``head_major``: ``Int2KVPool``'s layout ([Hkv, S, ...] storage behind [S, Hkv, ...] views); ``False`` runs
        the attention over slot-major copies of the same pools (the layout of the tables before commit 0fbef24).
        ``scale_dtype``: the pools' scale/zero storage (``fp8``: e4m3 with per-head multipliers); ``widths``: the K
        and V code widths (4: two 2-bit planes)."""
        self.bs, self.ctx, self.n2 = bs, ctx, ctx - BF16_TOKENS
        rot = torch.linalg.qr(torch.randn(2, HKV, D, D, device=DEV, generator=gen))[0].contiguous()
        mult = torch.full((1, HKV), 2.0 ** -5) if scale_dtype == "fp8" else None
        self.pool = Int2KVPool(QuantScheme(group=0, sink=SINK, recent=RECENT, scale_dtype=scale_dtype), 1, HKV, D,
                               bs * ctx, bs, rot[:1], rot[1:], device=DEV, mult_k=mult, mult_v=mult,
                               widths=[widths])
        fill_random(self.pool.layer(0), gen)
        self.cache = self.pool.layer(0)
        if not head_major:
            c = self.cache
            flat = [Int2Pool(p.codes.contiguous(), p.scale.contiguous(), p.zero.contiguous(), p.group_size)
                    for p in (c.k, c.v)]
            self.cache = dataclasses.replace(c, k=flat[0], v=flat[1])
        self.req_to_token = torch.arange(bs * ctx, device=DEV, dtype=torch.int32).view(bs, ctx)  # filled in order
        self.plan = DecodePlan(self.pool, bs, ctx, q_heads=HQ, **plan_kwargs(plan_kw))
        self.plan.plan(self.req_to_token, torch.arange(bs, device=DEV), torch.full((bs,), ctx, device=DEV),
                       self.req_to_token[:, ctx - 1].contiguous())
        self.q = torch.randn(bs, HQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        self.k = torch.randn(bs, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        self.v = torch.randn(bs, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.q)

    def bytes_read(self) -> int:
        int2 = self.bs * self.n2 * self.pool.cell_bytes  # codes + scale + zero, K and V
        bf16 = self.bs * BF16_TOKENS * HKV * D * 2 * 2
        idx = (self.bs * self.ctx) * 4
        rot = 2 * HKV * D * D * 4
        return int2 + bf16 + idx + rot + 2 * self.q.numel() * 2

    def run(self):
        """``DecodePlan.run``: write the new token, then the attention."""
        return lambda: self.plan.run(0, self.q, self.k, self.v, out=self.out)

    def fn(self, num_splits: int | None = None, **kw):
        """The attention alone (``decode_int2`` over the planned lists); ``num_splits`` forces a uniform count
        (grid and workspace sized for it), ``kw`` (flat: :func:`split_knobs`) go to ``decode_int2``."""
        options, launch, rest = split_knobs(kw)
        index, ws = self.plan.index, None
        if num_splits is not None:
            index = dataclasses.replace(index, num_splits=torch.full_like(index.num_splits, num_splits),
                                        max_splits=num_splits)
            ws = decode_workspace(self.bs, HQ, D, num_splits, DEV, index.exact_splits)
        else:
            ws = self.plan._workspace
        return lambda: decode_int2(self.q, self.cache, index, workspace=ws, out=self.out,
                                   sm_scale=self.plan.sm_scale, options=options or DecodeOptions(),
                                   launch=launch or DecodeLaunch(), **rest)


def sdpa_case(bs, ctx, gen):
    q = torch.randn(bs, HQ, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(bs, HKV, ctx, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(bs, HKV, ctx, D, device=DEV, dtype=torch.bfloat16, generator=gen)

    def make(backend):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return fn
    return make, 2 * k.numel() * 2 + 2 * q.numel() * 2


SWEEP = [  # (block_n, warps, stages, register cap; 0: none) of the row-scale kernel
    (128, 1, 1, 0), (128, 1, 1, 168), (128, 1, 1, 144), (128, 1, 1, 128), (64, 1, 1, 0), (64, 1, 1, 128),
    (128, 2, 1, 0),
]


MERGE_CHUNKS = (1, 8, 32)
"""``decode_int2(merge_chunk=...)`` values of the sweep, each at the default split count and at 2x and 4x it."""


def sweep(gen, shapes):
    """Tile size, warps, pipelining, register cap and split count of the row-scale kernel, and the general kernel."""
    print("\n## sweep (µs, median of CUDA-graph replays)")
    for bs, ctx in shapes:
        case = Int2Case(bs, ctx, gen)
        base = default_num_splits(bs, HKV, case.n2, row_kernel=True)
        rows = [(graph_us(case.fn(row_kernel=False)), "general kernel")]
        for bn, nw, st, reg in SWEEP:
            for ns in sorted({max(base // 2, 1), base}):
                rows.append((graph_us(case.fn(num_splits=ns, num_warps=nw, block_n=bn, num_stages=st,
                                              max_registers=reg)),
                             f"block_n={bn} warps={nw} stages={st} maxnreg={reg} splits={ns}"))
        for mc in MERGE_CHUNKS:  # the merge reading several partials per step, with more splits than the default
            for ns in sorted({base, 2 * base, 4 * base}):
                rows.append((graph_us(case.fn(num_splits=ns, merge_chunk=mc)), f"merge_chunk={mc} splits={ns}"))
        rows.sort()
        print(f"bs{bs} ctx{ctx} (default splits {base}): " + "; ".join(f"{c}: {t:.1f}" for t, c in rows), flush=True)
        del case
        torch.cuda.empty_cache()



MERGE_SHAPES = [(1, 8192), (1, 32768), (1, 100000), (1, 131072), (8, 32768), (16, 131072), (32, 32768)]
MERGE_VARIANTS = [(f"merge chunk {c}", dict(merge_chunk=c)) for c in (8, 16, 32)]
"""Partials per merge step (until commit e6f07dc the table also held the per-KV-head merge this one replaced)."""


def merge_table(gen, results: str, commit: str) -> None:
    """The attention (``decode_int2`` over the planned lists) under each merge variant, at the default split count
    and at twice it; one table, appended to RESULTS.md."""
    head = ["bs", "context", "splits", *[f"{name} µs" for name, _ in MERGE_VARIANTS]]
    rows = []
    for bs, ctx in MERGE_SHAPES:
        case = Int2Case(bs, ctx, gen)
        base = case.plan.index.max_splits
        for ns in (None, 2 * base):
            rows.append([bs, f"{ctx // 1000}k" if ctx % 1024 else f"{ctx // 1024}k", ns or f"{base} (default)",
                         *[f"{graph_us(case.fn(num_splits=ns, **kw)):.1f}" for _, kw in MERGE_VARIANTS]])
            print(" | ".join(map(str, rows[-1])), flush=True)
        del case
        torch.cuda.empty_cache()
    table = markdown_table(head, rows)
    print(table)
    append_section(results, "Decode merge: partials per step", torch.cuda.get_device_name(), commit,
                   "The attention alone (`decode_int2` over a `DecodePlan`'s lists: query rotation, split kernel, "
                   "merge), Qwen3-8B shapes, INT2 g = d = 128, CUDA-graph replay "
                   "median; `splits`: the plan's default count, and twice it (grid and workspace sized for it).", table)


STEP_SHAPES = [(1, 8192, 16), (1, 32768, 8), (1, 100000, 4), (16, 131072, 1), (32, 32768, 1), (50, 100000, 1)]
"""(batch, context, layers) of the ``--variants`` table: enough layers that one step's INT2 data (~58 MB per layer
at bs1/100k) is at least twice the H200's 50 MB L2, so every layer reads its codes from HBM, as in a model."""
STEP_VARIANTS_LONG_RECENT = [
    ("default", {}),
    ("1408 programs", dict(min_programs=1408)),
    ("exact tile 16 x 5, 1536 programs", dict(block_nb=16, exact_splits=5, min_programs=1536)),
    ("1408 programs, write 2 warps", dict(min_programs=1408, write_tuning=dict(block_n=1, rot_precision="fma",
                                                                            num_warps=2))),
    ("1408 programs, merge cols 64", dict(min_programs=1408, merge_cols=64)),
    ("block_n 64, 1536 programs", dict(block_n=64, min_programs=1536)),
]
"""``--variants --recent 256`` (the window the SGLang runs use: ``sink + recent`` exact rows per sequence): more
INT2 splits at small batches, 16-row exact tiles over five programs, the merge over 64 columns, the K/V write with two
warps, and 64-token tiles (the Triton split kernel)."""
_WRITE_ALL_ROWS = dict(block_n=1, rot_precision="fma", num_warps=4, rot_rows=128)
STEP_VARIANTS_WRITE = [
    ("default", {}),
    ("write 4 warps, all rotation rows at once", dict(write_tuning=_WRITE_ALL_ROWS)),
    ("write 8 warps, all rotation rows at once", dict(write_tuning={**_WRITE_ALL_ROWS, "num_warps": 8})),
    ("merge chunk 256 (one step at 131-132 partials, 8 warps)", dict(merge_chunk=256)),
]
"""``--variants --set write``: the step's K/V write (and query rotation) loading its whole rotation at once with four
or eight warps per program (in SGLang the rotations arrive from HBM), and the merge reading up to 256 partials in one
step with 8 warps against the default's 128."""
STEP_VARIANTS_ONE_WAVE = [
    ("default", {}),
    ("1040 programs", dict(min_programs=1040)),
    ("1040 programs, exact splits 2", dict(min_programs=1040, exact_splits=2)),
]
"""``--variants --set one-wave``: at bs1/100k the 128 default splits of 779 INT2 tiles run 7 tiles each (112 of them
busy); 130 splits run 6, and 8 x 130 INT2 programs plus 2 exact programs per head fill the 1056 resident one-warp
programs (8 per SM at 233 registers on 132 SMs) exactly; with 3 exact programs per head the last 8 wait for the
first slots to free (the last INT2 split of each head runs 5 tiles)."""
STEP_VARIANTS_BALANCE = [
    ("exact programs fixed (4 per head)", dict(balance=False)),
    ("default (balanced: 40 exact rows per INT2 tile, >= 80)", {}),
    ("balanced, 64 rows per tile, >= 128 (3 exact at most)", dict(exact_rows_per_tile=64, exact_min_rows=128)),
    ("balanced, 32 rows per tile, >= 64 (5 exact at most)", dict(exact_rows_per_tile=32, exact_min_rows=64)),
    ("balanced, 48 rows per tile, >= 80", dict(exact_rows_per_tile=48)),
]
"""``--variants --set balance``: exact programs per sequence from the context (``DecodePlan(balance=True)``, the
default: at bs1/100k two exact programs, whose INT2 splits take 130 of the 132 programs per head, six tiles each)
against four for every sequence, and the balance rule's exact rows per program per INT2 tile and floor."""
STEP_VARIANTS_ASYNC = [
    ("Triton split kernel", dict(async_tiles=False)),
    ("default (Gluon split kernel)", {}),
    ("3 stages", dict(num_stages=3)),
    ("no register cap", dict(max_registers=0)),
]
"""``--variants --set async``: the Gluon split kernel (:mod:`oscar_kernels.decode_async`: the next tile's code words
copied into shared memory with ``cp.async`` while a tile computes, its scales loaded a tile ahead) against the
Triton one: two shared-memory stages (one tile in flight) or three, with the default register cap (168 from 2048
programs on) or none."""
STEP_VARIANTS_INT8 = [
    ("default", {}),
    ("int8 scores", dict(int8_scores=True)),
]
"""``--variants --set int8``: fewer ALU instructions per tile in the Gluon split kernel. ``int8_scores``: each head's
rotated query quantized to int8, the key codes unpacked four per AND as ``16 c`` and multiplied by int8 MMAs
(k = 32, half the MMAs), the int32 sums read as floats through a magic starting value."""
STEP_VARIANTS_INT8_VALUES = [
    ("default", {}),
    ("int8 scores", dict(int8_scores=True)),
    ("int8 values", dict(int8_values=True)),
    ("int8 scores and values", dict(int8_scores=True, int8_values=True)),
    ("int8 scores and values, maxnreg 128", dict(int8_scores=True, int8_values=True, max_registers=128)),
    ("int8 scores and values, maxnreg 192", dict(int8_scores=True, int8_values=True, max_registers=192)),
    ("int8 scores and values, 3 stages", dict(int8_scores=True, int8_values=True, num_stages=3)),
]
"""``--variants --set int8-values``: the value side of the Gluon split kernel on int8 MMAs as well
(``int8_values``): probabilities rounded to int8 steps per tile and head, value codes regrouped four tokens to a
register by two PRMTs per 32 codes and unpacked four to an AND, half the value MMAs, no code offset."""
STEP_VARIANTS_LEAN = [
    ("default", {}),
    ("lean tiles", dict(lean_tiles=True)),
    ("movmatrix", dict(movmatrix=True)),
    ("lean tiles, movmatrix", dict(lean_tiles=True, movmatrix=True)),
    ("int8 scores and values", dict(int8_scores=True, int8_values=True)),
    ("int8 scores and values, lean tiles", dict(int8_scores=True, int8_values=True, lean_tiles=True)),
    ("int8 scores and values, fused update", dict(int8_scores=True, int8_values=True, fused_update=True)),
    ("int8 scores and values, lean, fused", dict(int8_scores=True, int8_values=True, lean_tiles=True,
                                                 fused_update=True)),
    ("int8 scores and values, lean, fused, movmatrix", dict(int8_scores=True, int8_values=True, lean_tiles=True,
                                                            fused_update=True, movmatrix=True)),
    ("int8 scores and values, lean, fused, movmatrix, maxnreg 192",
     dict(int8_scores=True, int8_values=True, lean_tiles=True, fused_update=True, movmatrix=True, max_registers=192)),
    ("int8 scores and values, lean, fused, movmatrix, 4096-token splits",
     dict(int8_scores=True, int8_values=True, lean_tiles=True, fused_update=True, movmatrix=True, split_tokens=4096)),
]
"""``--variants --set lean``: fewer instructions per tile around the products. ``lean_tiles`` (same results): the
key and value scales and zeros widened to fp32 before their layout change, the token mask folded into the key scale,
zero and a per-token additive term, and the tile's token masks as 32-bit compares against the tokens left.
``fused_update`` (int8 values): each value plane's accumulator update as two fused multiply-adds. ``movmatrix``: the
probabilities into the value MMA's operand layout by 8x8 warp transposes (head tile padded to 8). The instruction
counts per tile: ``benchmarks/sass_count.py --set lean``."""
VARIANT_SETS = {"write": STEP_VARIANTS_WRITE, "one-wave": STEP_VARIANTS_ONE_WAVE, "balance": STEP_VARIANTS_BALANCE,
                "async": STEP_VARIANTS_ASYNC, "int8": STEP_VARIANTS_INT8, "int8-values": STEP_VARIANTS_INT8_VALUES,
                "lean": STEP_VARIANTS_LEAN}
"""Named ``--set``s of ``--variants`` (timed at the window of ``--recent``, bs16/128k left out). The sets measured
before ``balance`` became the default (all but ``balance``) ran with three exact programs for every sequence; run
them with ``balance=False`` added to compare."""
STEP_VARIANTS = [
    ("query rotation in its own launch", dict(fuse_q_rotation=False)),
    ("default", {}),
    ("merge cols 64", dict(merge_cols=64)),
    ("merge cols 32", dict(merge_cols=32)),
    ("2048 programs, maxnreg 128", dict(min_programs=2048, max_registers=128)),
    ("1536 programs, maxnreg 168", dict(min_programs=1536, max_registers=168)),
    ("block_n 64", dict(block_n=64)),
]
"""``DecodePlan`` variants timed by ``--variants`` against the defaults (and the step before the query rotation
moved into the write's launch). A variant is one flat dict: :class:`~oscar_kernels.scheme.DecodeOptions` and
:class:`~oscar_kernels.decode.DecodeLaunch` fields beside ``DecodePlan``'s own keywords (:func:`plan_kwargs`)."""
_LAUNCH_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeLaunch))


def split_knobs(kw: dict) -> tuple[DecodeOptions | None, DecodeLaunch | None, dict]:
    """A variant's flat keywords -> its :class:`~oscar_kernels.scheme.DecodeOptions` and
    :class:`~oscar_kernels.decode.DecodeLaunch` (None where it sets no field of one) and the other keywords."""
    opts = {k: v for k, v in kw.items() if k in DecodeOptions.names()}
    launch = {k: v for k, v in kw.items() if k in _LAUNCH_FIELDS}
    rest = {k: v for k, v in kw.items() if k not in opts and k not in launch}
    return (DecodeOptions(**opts) if opts else None), (DecodeLaunch(**launch) if launch else None), rest


def plan_kwargs(kw: dict) -> dict:
    """A variant's flat keywords -> ``DecodePlan``'s (``options``, ``launch`` and the plan's own)."""
    options, launch, rest = split_knobs(kw)
    return {**rest, **({"options": options} if options else {}), **({"launch": launch} if launch else {})}


class StepCase:
    """``bs`` sequences of ``ctx`` tokens in a pool of ``layers`` layers (random codes and exact rows), and one
    decode step over all of them: ``DecodePlan.run`` per layer, the write and attention SGLang runs per layer."""

    def __init__(self, bs: int, ctx: int, layers: int, gen: torch.Generator, recent: int = RECENT):
        self.bs, self.ctx, self.layers = bs, ctx, layers
        rot = torch.linalg.qr(torch.randn(2, layers, HKV, D, D, device=DEV, generator=gen))[0].contiguous()
        self.pool = Int2KVPool(QuantScheme(group=0, sink=SINK, recent=recent), layers, HKV, D, bs * ctx, bs,
                               rot[0], rot[1], device=DEV)
        for i in range(layers):
            fill_random(self.pool.layer(i), gen)
        self.req_to_token = torch.arange(bs * ctx, device=DEV, dtype=torch.int32).view(bs, ctx)
        self.q = torch.randn(bs, HQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        self.k = torch.randn(bs, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        self.v = torch.randn(bs, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.q)

    def step(self, **plan_kw):
        plan = DecodePlan(self.pool, self.bs, self.ctx, q_heads=HQ, **plan_kwargs(plan_kw))
        plan.plan(self.req_to_token, torch.arange(self.bs, device=DEV), torch.full((self.bs,), self.ctx, device=DEV),
                  self.req_to_token[:, self.ctx - 1].contiguous())

        def fn():
            for i in range(self.layers):
                plan.run(i, self.q, self.k, self.v, out=self.out)
        return fn, plan.index.max_splits


def variants_table(gen, results: str, commit: str, variants=None, shapes=None, recent: int = RECENT) -> None:
    """Per-layer time of a decode step (``DecodePlan.run``: K/V write + attention) under each of ``variants``
    (default :data:`STEP_VARIANTS`), over ``shapes`` (default :data:`STEP_SHAPES`), pools with a ``recent``-token
    exact window; one table, appended to RESULTS.md."""
    variants = variants or STEP_VARIANTS
    shapes = shapes or STEP_SHAPES
    head = ["variant", *[f"bs{bs}/{ctx // 1000}k µs" for bs, ctx, _ in shapes]]
    cols: list[list[str]] = []
    for bs, ctx, layers in shapes:
        case = StepCase(bs, ctx, layers, gen, recent)
        col = []
        for name, kw in variants:
            fn, splits = case.step(**kw)
            t = graph_us(fn) / layers
            col.append(f"{t:.1f} ({splits})")
            print(f"bs{bs} ctx{ctx} {name}: {t:.1f} µs per layer, grid bound {splits} splits", flush=True)
        cols.append(col)
        del case
        torch.cuda.empty_cache()
    rows = [[name, *[c[i] for c in cols]] for i, (name, _) in enumerate(variants)]
    table = markdown_table(head, rows)
    print(table)
    append_section(results, "Decode step variants, per layer", torch.cuda.get_device_name(), commit,
                   "`DecodePlan.run` (the new token's K/V write, with the query rotation in the same launch unless "
                   "said otherwise, then the attention) over every layer of a pool of several layers (each step's "
                   "INT2 data at least twice the L2), CUDA-graph replay median divided by the layers; Qwen3-8B shapes "
                   f"(32 q / 8 KV heads, d 128), INT2 g = d, sink {SINK}, recent {recent}; in brackets the plan's split "
                   "bound for the batch.", table)


METADATA_SHAPES = [(1, 32768), (1, 131072), (8, 32768), (16, 131072), (32, 32768)]
"""``--metadata``: batch 1 (launch- and latency-bound) and the large batches (bandwidth-bound)."""
STORAGE = [("INT2, fp16 scales", "fp16", (2, 2)), ("INT2, FP8 scales", "fp8", (2, 2)),
           ("K INT4 / V INT2, fp16 scales", "fp16", (4, 2)), ("K INT4 / V INT2, FP8 scales", "fp8", (4, 2)),
           ("K INT4 / V INT4, fp16 scales", "fp16", (4, 4))]
"""``--metadata``: the layer storages an allocated scheme mixes, the first the baseline of the ratios."""


def metadata_table(gen, results: str, commit: str, bw: float, shapes=None, storage=None) -> None:
    """The attention (``decode_int2`` over the planned lists, default launch) over one layer stored each way of
    ``storage`` (default :data:`STORAGE`: fp16 or FP8 scales and zeros, 2- or 4-bit keys and values), the same shapes:
    per shape and storage the µs, the MB read, the µs per MB read against the first storage's (an allocated layer's
    cost per byte; the target is within 1.10) and the fraction of the copy bandwidth."""
    shapes = shapes or METADATA_SHAPES
    storage = storage or STORAGE
    rows = []
    for bs, ctx in shapes:
        base = None
        for label, dtype, widths in storage:
            case = Int2Case(bs, ctx, gen, scale_dtype=dtype, widths=widths)
            us, nbytes = graph_us(case.fn()), case.bytes_read()
            del case
            torch.cuda.empty_cache()
            per = us / (nbytes / 1e6)
            base = base or (us, per)
            print(f"bs{bs} ctx{ctx} {label}: {us:.1f} µs, {nbytes / 1e6:.1f} MB", flush=True)
            rows.append([f"bs{bs}/{ctx // 1024}k", label, f"{us:.1f}", f"{us / base[0]:.3f}", f"{nbytes / 1e6:.1f}",
                         f"{per / base[1]:.3f}", f"{nbytes / (us * 1e-6) / bw:.2f}"])
    head = ["shape", "storage", "µs", "time vs first", "MB read", "µs per MB vs first", "of copy bw"]
    table = markdown_table(head, rows)
    print(table)
    append_section(results, "Decode attention by layer storage: code widths and scale dtype",
                   torch.cuda.get_device_name(), commit,
                   "`decode_int2` over `DecodePlan`'s lists (default launch: on CUDA the Gluon split kernel, a 4-bit "
                   "layer's second code plane in its own cp.async ring), CUDA-graph replay median; Qwen3-8B shapes "
                   f"(32 q / 8 KV heads, d 128), g = d, sink {SINK}, recent {RECENT}; random codes; per token, head and K "
                   "or V: 32 B of 2-bit codes or 64 B of 4-bit ones, plus 4 B of fp16 scale and zero or 2 B of FP8 "
                   "ones (with a per-head multiplier).", table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default=None, help="commit recorded in RESULTS.md (default: git rev-parse HEAD)")
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    ap.add_argument("--sweep", action="store_true", help="sweep tile/warps/splits on a few shapes first")
    ap.add_argument("--sweep-only", action="store_true", help="sweep, then stop (no table, nothing appended)")
    ap.add_argument("--layouts", action="store_true", help="compare slot-major and head-major pools, then stop")
    ap.add_argument("--merge", action="store_true", help="time the merge variants, append their table, then stop")
    ap.add_argument("--variants", action="store_true",
                    help="time a decode step per layer under each DecodePlan variant, append the table, then stop")
    ap.add_argument("--set", choices=sorted(VARIANT_SETS), default=None, dest="variant_set",
                    help="with --variants: time this named set instead (write: the K/V write with its whole "
                         "rotation at once, the 256-partial merge; one-wave: split and exact program counts that "
                         "fill one wave at bs1/100k; balance: exact programs per sequence from the context; async: "
                         "the Gluon split kernel against the Triton one, two or three stages; int8: its scores from "
                         "int8 MMAs; int8-values: its value products too; lean: lean tiles, movmatrix, the fused "
                         "value update)")
    ap.add_argument("--metadata", action="store_true",
                    help="time the attention over each layer storage (fp16 or FP8 scales, 2- or 4-bit keys and "
                         "values), append the table, then stop")
    ap.add_argument("--label", default="DecodePlan defaults")
    ap.add_argument("--recent", type=int, default=RECENT,
                    help=f"with --variants: the pools' exact recent window (default {RECENT}; above it "
                         "STEP_VARIANTS_LONG_RECENT is timed)")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    commit = args.commit or code_version()
    gen = torch.Generator(device=DEV).manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    if args.layouts:
        print("\n## pool layout (µs, defaults): slot-major [S, Hkv, ...] vs head-major [Hkv, S, ...]")
        for bs, ctx in [(1, 8192), (1, 131072), (8, 32768), (16, 131072), (32, 32768)]:
            ts = []
            for hm in (False, True):
                case = Int2Case(bs, ctx, gen, head_major=hm)
                ts.append(graph_us(case.fn()))
                del case
                torch.cuda.empty_cache()
            print(f"bs{bs} ctx{ctx}: slot-major {ts[0]:.1f}, head-major {ts[1]:.1f}", flush=True)
        return
    if args.merge:
        merge_table(gen, args.results, commit)
        return
    if args.metadata:
        metadata_table(gen, args.results, commit, bw)
        return
    if args.variants:
        named = args.variant_set
        if named or args.recent > RECENT:  # the exact split's variants, where its rows matter: small batches
            variants_table(gen, args.results, commit, VARIANT_SETS[named] if named else STEP_VARIANTS_LONG_RECENT,
                           STEP_SHAPES[:3] + STEP_SHAPES[4:], args.recent)
        else:
            variants_table(gen, args.results, commit, recent=args.recent)
        return
    if args.sweep or args.sweep_only:
        sweep(gen, [(1, 8192), (1, 131072), (8, 32768), (16, 131072)])
        if args.sweep_only:
            return
    head = ["bs", "context", "cuDNN BF16 µs", "flash BF16 µs", "INT2 µs", "INT2 run µs (write + attention)",
            "run µs, tf32x3 write", "INT2 MB read", "INT2 GB/s", "INT2 / best BF16", "INT2 frac of copy bw"]
    rows = []
    for bs, ctx in SHAPES:
        make, _ = sdpa_case(bs, ctx, gen)
        t_cudnn = graph_us(make(SDPBackend.CUDNN_ATTENTION))
        t_flash = graph_us(make(SDPBackend.FLASH_ATTENTION))
        del make
        torch.cuda.empty_cache()
        case = Int2Case(bs, ctx, gen)
        t = graph_us(case.fn())
        t_run = graph_us(case.run())
        case.plan.write_tuning = {}  # quantize_pack_kv's own parameters: tf32x3 tensor-core rotation, 64 tokens
        t_tc = graph_us(case.run())
        nbytes = case.bytes_read()
        gbs = nbytes / (t * 1e-6) / 1e9
        best = min(t_cudnn, t_flash)
        rows.append([bs, f"{ctx // 1024}k", f"{t_cudnn:.1f}", f"{t_flash:.1f}", f"{t:.1f}", f"{t_run:.1f}",
                     f"{t_tc:.1f}", f"{nbytes / 1e6:.1f}", f"{gbs:.0f}", f"{t / best:.2f}", f"{gbs * 1e9 / bw:.2f}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
        del case
        torch.cuda.empty_cache()
    table = markdown_table(head, rows)
    print(table)
    append_section(args.results, f"Decode, {args.label}", torch.cuda.get_device_name(), commit,
                   f"Copy bandwidth measured in the same run: {bw / 1e9:.0f} GB/s (read+write). Qwen3-8B shapes (32 q "
                   f"heads, 8 KV heads, d 128), INT2 at g = d = 128 (2.25 bits/element) + {BF16_TOKENS} exact rows per "
                   f"sequence (sink {SINK}, recent {RECENT}), `DecodePlan` over an `Int2KVPool` (head-major), "
                   "CUDA-graph replay median; cuDNN and flash BF16 measured in the same run.", table)


if __name__ == "__main__":
    main()
