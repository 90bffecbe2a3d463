"""decode_int2 against its fp32 reference: GQA ratios, head dims, group sizes, ragged lengths, scattered slots,
per-sequence split counts inside a fixed grid, both paths; the split policy against the measured defaults."""

import importlib
import math

import pytest
import torch
import triton
import triton.language as tl
from int2_cache import DEVICE, ON_GPU, make_cache, rel_err
from oscar_kernels import (
    DecodeIndex,
    DecodeLaunch,
    DecodeOptions,
    Int2Pool,
    LayerCache,
    decode_index,
    decode_int2,
    decode_int2_ref,
    decode_workspace,
    default_num_splits,
    split_policy,
)
from oscar_kernels.decode import VALUE_TILE, int8_value_weights, value_dither
from oscar_kernels.decode_grid import EXACT_ROWS_PER_TILE, EXACT_SPLIT_ROWS, balance_count, balance_counts, split_count
from oscar_kernels.decode_merge import merge_chunk_for, merge_warps
from oscar_kernels.scheme import CUDA_MIN_HEAD_DIM

# interpreter: short ragged sequences (incl. an empty INT2 part and an empty exact part); GPU: long ones
INT2_LENS = [3000, 1, 777, 4093] if ON_GPU else [37, 0, 130, 1]
BF16_LENS = [68, 5, 0, 33] if ON_GPU else [5, 9, 0, 3]
SPLITS = [3, 1, 6, 2]  # per sequence; the grid holds MAX_SPLITS, so some programs of every sequence exit at once
MAX_SPLITS = 7
HKV = 8 if ON_GPU else 2
# bf16 q with fp16/bf16 tensor-core dots vs fp32 dots in the interpreter
TOL = dict(atol=5e-2, rtol=5e-2) if ON_GPU else dict(atol=1e-4, rtol=1e-4)
TOL8V = dict(atol=0.1, rtol=0.05)
MAX_REL = 1e-2 if ON_GPU else 1e-5
layout_module = importlib.import_module("oscar_kernels.layout")  # the module, not the package's names
INT8_SCORES, INT8_VALUES = DecodeOptions(int8_scores=True), DecodeOptions(int8_values=True)


def _poisoned_workspace(bsz, hq, d, max_splits):
    ws = decode_workspace(bsz, hq, d, max_splits, DEVICE)
    for t in ws:
        t.fill_(float("nan"))  # a partial nobody wrote would poison the merge
    return ws


# every GQA ratio with both head dims and every (d, group) pair (GQA 4 at d = 64 / 128 with row and 32-element groups
# is every other test's shape); d = 32 is refused on CUDA and checked in the interpreter
SHAPES = [(1, 64, "row"), (1, 128, 32), (3, 64, 32), (3, 128, "row"), (8, 64, 32), (8, 128, "row"), (4, 32, "row"),
          (2, 32, 16)]


@pytest.mark.parametrize("gqa,d,group", SHAPES)
def test_decode_matches_ref(gqa, d, group):
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(1000 * gqa + d + g)
    lists = make_cache(INT2_LENS, BF16_LENS, HKV, d, g, gen)
    q = (torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    index = lists.index(SPLITS, MAX_SPLITS)
    out = torch.full(q.shape, float("nan"), device=DEVICE)  # fp32 out, poisoned
    ws = _poisoned_workspace(q.shape[0], q.shape[1], d, MAX_SPLITS)
    if ON_GPU and d < CUDA_MIN_HEAD_DIM:  # computed wrong on an H200: refused on CUDA, checked in the interpreter
        with pytest.raises(ValueError, match="needs head dim >= 64"):
            decode_int2(q, lists.cache, index, workspace=ws, out=out)
        return
    got = decode_int2(q, lists.cache, index, workspace=ws, out=out)
    ref = decode_int2_ref(q, lists.cache, index)
    assert got is out and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)
    assert rel_err(out, ref) <= MAX_REL


def test_decode_default_out_dtype():
    gen = torch.Generator().manual_seed(5)
    lists = make_cache(INT2_LENS, BF16_LENS, HKV, 128, 128, gen)
    q = (torch.randn(len(INT2_LENS), HKV * 4, 128, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    index = decode_index(lists.cache, lists.kv_indptr, lists.kv_indices, lists.bf16_indptr, lists.bf16_indices,
                         max(INT2_LENS))
    got = decode_int2(q, lists.cache, index)
    ref = decode_int2_ref(q, lists.cache, index)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # bf16 rounding of the output on top of the kernel's own error
    torch.testing.assert_close(got.float(), ref, **(dict(atol=6e-2, rtol=5e-2) if ON_GPU else dict(atol=3e-2, rtol=1e-2)))
    assert rel_err(got, ref) <= 1e-2


@pytest.mark.parametrize("splits", [[1, 1, 1, 1], [5, 5, 5, 5], [0, 9, 2, 40]])
def test_decode_split_counts_do_not_change_the_answer(splits):
    """Any per-sequence split count gives the same answer; counts outside [1, max_splits] are clamped (0 -> 1,
    9 and 40 -> max_splits); a caller-provided strided, NaN-poisoned out is fully written and nothing else."""
    gen = torch.Generator().manual_seed(7 + sum(splits))
    d, gqa, max_splits = 64, 4, 5
    lists = make_cache(INT2_LENS, BF16_LENS, HKV, d, d, gen, shared_rot=True)
    q = torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen).to(DEVICE, torch.float16)
    big = torch.full((len(INT2_LENS), HKV * gqa, 2 * d), float("nan"), dtype=torch.float32, device=DEVICE)
    out = big[:, :, ::2]
    index = lists.index(splits, max_splits)
    got = decode_int2(q, lists.cache, index, workspace=_poisoned_workspace(q.shape[0], q.shape[1], d, max_splits),
                      out=out, sm_scale=0.3 / math.sqrt(d))
    ref = decode_int2_ref(q, lists.cache, index, sm_scale=0.3 / math.sqrt(d))
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all() and torch.isnan(big[:, :, 1::2]).all()
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("merge_chunk", [1, 4, 256])
def test_decode_merge_chunks_do_not_change_the_answer(merge_chunk):
    """The merge reading one partial per step, several (counts 3, 1, 6 and 2 of a grid of 7: chunks that end past a
    sequence's count, partials of inactive splits poisoned) and 256 with 8 warps (the default, 32, is every other
    test's) gives the reference answer on both paths."""
    gen = torch.Generator().manual_seed(11 + merge_chunk)
    for g in (64, 32):  # the row-scale path (g = d) and the general one
        lists = make_cache(INT2_LENS, BF16_LENS, HKV, 64, g, gen)
        q = (torch.randn(len(INT2_LENS), HKV * 4, 64, generator=gen) * 2).to(DEVICE, torch.bfloat16)
        index = lists.index(SPLITS, MAX_SPLITS)
        out = torch.full(q.shape, float("nan"), device=DEVICE)
        decode_int2(q, lists.cache, index, workspace=_poisoned_workspace(q.shape[0], q.shape[1], 64, MAX_SPLITS),
                    out=out, launch=DecodeLaunch(merge_chunk=merge_chunk))
        torch.testing.assert_close(out, decode_int2_ref(q, lists.cache, index), **TOL)
    with pytest.raises(ValueError, match="merge_chunk must be a power of two"):
        decode_int2(q, lists.cache, index, launch=DecodeLaunch(merge_chunk=3))


@pytest.mark.parametrize("launch", [DecodeLaunch(merge_cols=32), DecodeLaunch(merge_cols=16, block_nb=16),
                                    DecodeLaunch(block_n=64), DecodeLaunch(block_n=16, merge_cols=32)],
                         ids=["merge-cols-32", "merge-cols-16-exact-16", "tiles-64", "tiles-16"])
def test_decode_launch_knobs_do_not_change_the_answer(launch):
    """The merge split over output columns, the exact split's tile and the INT2 tile (64 and 16 tokens: several
    tiles per split, ragged tails) give the reference answer on both paths (ragged lengths, per-sequence split
    counts, NaN-poisoned workspace and out); on CUDA tiles other than 128 tokens take the Triton row-scale kernel.
    The general path (g = 32) takes the merge and exact-tile knobs."""
    gen = torch.Generator().manual_seed(211 + (launch.merge_cols or 0) + (launch.block_n or 0))
    for g in (128, 32):
        if g == 32 and launch.block_n is not None:
            continue
        lists = make_cache(INT2_LENS, BF16_LENS, HKV, 128, g, gen)
        q = (torch.randn(len(INT2_LENS), HKV * 4, 128, generator=gen) * 2).to(DEVICE, torch.bfloat16)
        index = lists.index(SPLITS, MAX_SPLITS)
        out = torch.full(q.shape, float("nan"), device=DEVICE)
        decode_int2(q, lists.cache, index, workspace=_poisoned_workspace(q.shape[0], q.shape[1], 128, MAX_SPLITS),
                    out=out, launch=launch)
        ref = decode_int2_ref(q, lists.cache, index)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, **TOL)
        assert rel_err(out, ref) <= MAX_REL
    with pytest.raises(ValueError, match="merge_cols must be a power of two"):
        decode_int2(q, lists.cache, index, launch=DecodeLaunch(merge_cols=48))


@pytest.mark.parametrize("exact_splits", [2, 3, 8])
def test_decode_exact_rows_shared_by_several_programs(exact_splits):
    """The exact rows of each sequence spread over ``exact_splits`` programs (whole tiles each: with 8 and a short
    list most parts are empty, and one sequence has no exact rows at all) give the reference answer on both paths
    and with the merge split over columns; the workspace is poisoned, so a part nobody wrote would show."""
    gen = torch.Generator().manual_seed(307 + exact_splits)
    bf16_lens = [70, 5, 0, 33] if ON_GPU else [40, 9, 0, 3]
    for g, kw in ((128, {}), (128, dict(merge_cols=32)), (32, {})):
        lists = make_cache(INT2_LENS, bf16_lens, HKV, 128, g, gen)
        q = (torch.randn(len(INT2_LENS), HKV * 4, 128, generator=gen) * 2).to(DEVICE, torch.bfloat16)
        index = lists.index(SPLITS, MAX_SPLITS, exact_splits)
        out = torch.full(q.shape, float("nan"), device=DEVICE)
        ws = decode_workspace(q.shape[0], q.shape[1], 128, MAX_SPLITS, DEVICE, exact_splits)
        for t in ws:
            t.fill_(float("nan"))
        decode_int2(q, lists.cache, index, workspace=ws, out=out, launch=DecodeLaunch(block_nb=16, **kw))
        ref = decode_int2_ref(q, lists.cache, index)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, **TOL)
        assert rel_err(out, ref) <= MAX_REL
    with pytest.raises(ValueError, match="workspace must be"):
        decode_int2(q, lists.cache, index, workspace=decode_workspace(q.shape[0], q.shape[1], 128, MAX_SPLITS, DEVICE))
    with pytest.raises(ValueError, match="exact_splits must be"):
        decode_int2(q, lists.cache, lists.index(SPLITS, MAX_SPLITS, 0))


@pytest.mark.parametrize("path", ["row", "general"])
def test_decode_per_sequence_exact_counts(path):
    """Per-sequence exact programs (``num_exact``, clamped to ``[1, exact_splits]``) and INT2 splits past
    ``max_splits`` into the programs the exact rows leave (clamped to ``parts - e``): partials ``[0, n)`` INT2, ``[n,
    n + e)`` exact, the rest never written (the workspace is poisoned) nor read; the answer is the reference's."""
    gen = torch.Generator().manual_seed(331)
    bf16_lens = [70, 5, 0, 33] if ON_GPU else [40, 9, 0, 3]
    g = 128 if path == "row" else 32
    lists = make_cache(INT2_LENS, bf16_lens, HKV, 128, g, gen)
    q = (torch.randn(len(INT2_LENS), HKV * 4, 128, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    max_splits, exact_splits = 3, 3
    # (splits, exact): past max_splits; one exact program of 40 rows; 0 -> 1 exact; over both bounds (clamped)
    for ns, ne in (([5, 1, 4, 2], [1, 3, 2, 1]), ([1, 2, 1, 9], [0, 1, 3, 7])):
        index = DecodeIndex(lists.kv_indptr, lists.kv_indices, lists.bf16_indptr, lists.bf16_indices,
                            torch.tensor(ns, dtype=torch.int32, device=DEVICE), max_splits, exact_splits,
                            torch.tensor(ne, dtype=torch.int32, device=DEVICE))
        for kw in ({}, dict(merge_cols=32, merge_chunk=2)):
            ws = decode_workspace(q.shape[0], q.shape[1], 128, max_splits, DEVICE, exact_splits)
            for t in ws:
                t.fill_(float("nan"))
            out = torch.full(q.shape, float("nan"), device=DEVICE)
            decode_int2(q, lists.cache, index, workspace=ws, out=out, row_kernel=path == "row",
                        launch=DecodeLaunch(block_nb=16, **kw))
            ref = decode_int2_ref(q, lists.cache, index)
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out, ref, **TOL)
            assert rel_err(out, ref) <= MAX_REL
    with pytest.raises(ValueError, match="num_exact must be int32"):
        decode_int2(q, lists.cache, DecodeIndex(lists.kv_indptr, lists.kv_indices, lists.bf16_indptr,
                                                lists.bf16_indices, index.num_splits, 3, 3, index.num_exact[:2]))


def test_balance_counts_at_the_benchmark_shapes():
    """The rule at Qwen3-8B shapes (8 KV heads, sink 64 / recent 256: 320 exact rows, 4 exact programs at most,
    128-token tiles): one long sequence takes 130 six-tile splits and two exact programs (132 programs per head, as
    the grid it had); 8k and 32k keep four exact programs and their splits; bs50/100k (length-bound) keeps its 49
    splits with one exact program; bs32/32k likewise."""
    def counts(bs, ctx):
        lens = torch.full((bs,), ctx - 320)
        pol = split_policy(bs, 8, ctx - 320, True)
        n, e = balance_counts(lens, torch.full((bs,), 320), pol, 4, 128)
        return pol.max_splits, int(n[0]), int(e[0])

    assert counts(1, 100_000) == (128, 130, 2)
    assert counts(1, 32_768) == (127, 127, 4)
    assert counts(1, 8192) == (31, 31, 4)
    assert counts(50, 100_000) == (49, 49, 1)
    assert counts(32, 32_768) == (16, 16, 1)
    # 4 + 3 programs: 1000 tokens keep 4 two-tile splits (the fewest for two tiles, also with 6 programs free) and
    # 3 exact programs (clamped from 4); a short exact list -> one program; 9000 tokens (18-tile splits, 720 exact
    # rows a program) -> one exact program, the six left take 12-tile splits; never above parts - e, never below 1
    pol = split_policy(1, 8, 1000, True, max_splits=4, min_programs=1024, min_split_tokens=16)
    n, e = balance_counts(torch.tensor([1000, 1000, 0, 9000]), torch.tensor([300, 10, 0, 700]), pol, 3, 128)
    assert n.tolist() == [4, 4, 1, 6] and e.tolist() == [3, 1, 1, 1]
    assert n.dtype == e.dtype == torch.int32


@triton.jit
def _balance_count_kernel(L, E, N, OUT_N, OUT_E, parts, exact_splits, split_tokens, min_splits, min_split_tokens,
                          BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, MIN_ROWS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    n, e = balance_count(tl.load(L + offs), tl.load(E + offs), tl.load(N + offs), parts, exact_splits, split_tokens,
                         min_splits, min_split_tokens, BLOCK_N, ROWS, MIN_ROWS)
    tl.store(OUT_N + offs, n)
    tl.store(OUT_E + offs, e)


def test_balance_count_twin_matches_torch():
    gen = torch.Generator().manual_seed(47)
    lens = torch.randint(0, 140000, (64,), generator=gen, dtype=torch.int32)
    lens[:4] = torch.tensor([0, 1, 256, 99680], dtype=torch.int32)
    ex = torch.randint(0, 700, (64,), generator=gen, dtype=torch.int32)
    for bs, cap, exact in ((1, None, 3), (50, None, 3), (4, 5, 2), (1, None, 1)):
        pol = split_policy(bs, 8, 140000, True, max_splits=cap)
        want_n, want_e = balance_counts(lens, ex, pol, exact, 128)
        out_n = torch.full((64,), -1, dtype=torch.int32, device=DEVICE)
        out_e = torch.full((64,), -1, dtype=torch.int32, device=DEVICE)
        _balance_count_kernel[(1,)](lens.to(DEVICE), ex.to(DEVICE), pol.num_splits(lens).to(DEVICE), out_n, out_e,
                                    pol.max_splits + exact, exact, pol.split_tokens, pol.min_splits,
                                    pol.min_split_tokens, BLOCK=64, BLOCK_N=128, ROWS=EXACT_ROWS_PER_TILE,
                                    MIN_ROWS=EXACT_SPLIT_ROWS)
        assert torch.equal(out_n.cpu(), want_n) and torch.equal(out_e.cpu(), want_e)
        assert bool((want_n + want_e <= pol.max_splits + exact).all()) and int(want_n.min()) >= 1


def test_decode_reads_a_prerotated_query_from_the_workspace():
    """``rotate_q=False``: the attention reads ``q_rot`` as the caller left it (here the reference rotation,
    scaled), so the answer equals the default's; a poisoned ``q_rot`` poisons the output (it really is read)."""
    from oscar_kernels.decode import LOG2E
    from oscar_kernels.write import rotate_q_ref

    gen = torch.Generator().manual_seed(223)
    d, gqa = 128, 4
    lists = make_cache(INT2_LENS, BF16_LENS, HKV, d, d, gen)
    q = (torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    index = lists.index(SPLITS, MAX_SPLITS)
    ws = _poisoned_workspace(q.shape[0], q.shape[1], d, MAX_SPLITS)
    ws[2].copy_(rotate_q_ref(q, lists.cache.rot_k, LOG2E / math.sqrt(d)))
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    decode_int2(q, lists.cache, index, workspace=ws, out=out, rotate_q=False)
    torch.testing.assert_close(out, decode_int2_ref(q, lists.cache, index), **TOL)
    ws[2].fill_(float("nan"))
    decode_int2(q, lists.cache, index, workspace=ws, out=out, rotate_q=False)
    assert torch.isnan(out).all()


def test_decode_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(3)
    lists = make_cache([4], [2], 2, 64, 64, gen)
    q = torch.randn(1, 3, 64, generator=gen).to(DEVICE)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple"):
        decode_int2(q, lists.cache, lists.index(1))
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE)  # a batch of 2 against a 1-sequence index
    with pytest.raises(ValueError, match="kv_indptr"):
        decode_int2(q, lists.cache, lists.index(1))
    with pytest.raises(ValueError, match="workspace"):
        decode_int2(q[:1], lists.cache, lists.index(1), workspace=decode_workspace(1, 4, 64, 3, DEVICE))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replay():
    """Captured once for a split bound, replayed after the lists and the device split counts change in place."""
    gen = torch.Generator().manual_seed(11)
    d, gqa, max_splits = 128, 4, 8
    lists = make_cache(INT2_LENS, BF16_LENS, HKV, d, d, gen)
    q = torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.empty_like(q)
    ws = decode_workspace(q.shape[0], q.shape[1], d, max_splits, DEVICE)
    index = lists.index([8, 1, 4, 8], max_splits)
    decode_int2(q, lists.cache, index, workspace=ws, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_int2(q, lists.cache, index, workspace=ws, out=out)
    # shorten every sequence by 10 tokens (in place), keep capacity; new split counts
    lens = (lists.kv_indptr[1:] - lists.kv_indptr[:-1] - 10).clamp_min(0)
    new_indptr = torch.zeros_like(lists.kv_indptr)
    new_indptr[1:] = lens.cumsum(0)
    new_indices = torch.cat([lists.kv_indices[lists.kv_indptr[b]: lists.kv_indptr[b] + lens[b]]
                             for b in range(len(lens))])
    lists.kv_indptr.copy_(new_indptr)
    lists.kv_indices[: new_indices.numel()].copy_(new_indices)
    index.num_splits.copy_(torch.tensor([2, 8, 1, 5], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    ref = decode_int2_ref(q, lists.cache, index)
    assert rel_err(out, ref) <= MAX_REL


@pytest.mark.parametrize("path", ["rows", "rows-one-split", "rows-int64", "rows-slot-major", "general",
                                  "general-ptx", "general-slot-major"])
def test_decode_paths_agree(path, monkeypatch):
    """g = d = 128: the row-scale fast path (also as one split over each whole sequence, where rounding could
    build up over thousands of tokens, and with 64-bit slot offsets) and the general path (plain or PTX unpack),
    on head-major pools (Int2Pool's layout) and on plain slot-major ones."""
    if path == "general-ptx" and not ON_GPU:
        pytest.skip("the PTX unpack runs on CUDA only")
    if path == "rows-int64":  # pools past 2**31 elements switch to 64-bit offsets; pretend this one is that big
        monkeypatch.setattr(layout_module, "OFFSET64", 1)
    gen = torch.Generator().manual_seed(29)
    d, gqa = 128, 4
    lists = make_cache(INT2_LENS, BF16_LENS, HKV, d, d, gen, head_major=not path.endswith("slot-major"))
    assert (lists.cache.k.codes.stride(0) > lists.cache.k.codes.stride(1)) == path.endswith("slot-major")
    assert lists.cache.off64 == (path == "rows-int64")
    q = torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    index = lists.index(1 if path == "rows-one-split" else SPLITS, MAX_SPLITS)
    decode_int2(q, lists.cache, index, out=out, row_kernel=path.startswith("rows"),
                launch=DecodeLaunch(ptx_unpack=path == "general-ptx"))
    ref = decode_int2_ref(q, lists.cache, index)
    torch.testing.assert_close(out, ref, **TOL)
    assert rel_err(out, ref) <= MAX_REL


FP8_PATHS = ["rows", "rows-gluon", "general-row", "general-ptx", "general-groups", "int8-options"]


@pytest.mark.parametrize("path", FP8_PATHS)
def test_decode_fp8_metadata(path):
    """FP8 scales and zeros (e4m3 times each KV head's multiplier, heads in different binades) through every split
    kernel: the row-scale Triton and Gluon kernels, the general one at row scales (plain and PTX unpack) and at
    32-element groups, and the Gluon kernel's int8 options against their definition."""
    if path in ("rows-gluon", "general-ptx", "int8-options") and not ON_GPU:
        pytest.skip("the Gluon kernel and the PTX unpack run on CUDA only")
    d, gqa = 128, 4
    g = 32 if path == "general-groups" else d
    gen = torch.Generator().manual_seed(83)
    lists = make_cache(INT2_LENS, BF16_LENS, HKV, d, g, gen, fp8=True)
    assert lists.cache.fp8 and lists.cache.k.scale.dtype == torch.float8_e4m3fn
    q = (torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    index = lists.index(SPLITS, MAX_SPLITS)
    options = OPTION_CASES["all-capped"] if path == "int8-options" else DecodeOptions()
    kw = {"options": options} if path == "int8-options" else {
        "row_kernel": path.startswith("rows"),
        "launch": DecodeLaunch(ptx_unpack=path == "general-ptx", async_tiles=path == "rows-gluon")}
    out = _decode_poisoned(q, lists, index, **kw)
    ref = decode_int2_ref(q, lists.cache, index, options=options)
    torch.testing.assert_close(out, ref, **_tol(options))
    assert rel_err(out, ref) <= MAX_REL


WIDTH_CASES = [("rows", (4, 2)), ("rows", (2, 4)), ("rows", (4, 4)), ("rows-gluon", (4, 2)), ("rows-gluon", (2, 4)),
               ("rows-gluon", (4, 4)), ("rows-gluon-3", (4, 4)), ("general-row", (4, 2)), ("general-groups", (4, 4)),
               ("general-ptx", (4, 2)), ("default", (4, 2))]
"""4-bit keys, values or both through the row-scale Triton kernel, the Gluon one (each high plane in its own
``cp.async`` ring; two stages, and three under the large-batch register cap), the general one at row scales and at 32-element groups, with the PTX unpack
on the other kind's 2-bit codes, and the default path (on CUDA the Gluon kernel)."""


@pytest.mark.parametrize("path,bits", WIDTH_CASES)
def test_decode_four_bit_layers(path, bits):
    """A layer allocated 4-bit keys and/or values (two 2-bit code planes, code = lo + 4 hi, 15 steps per scale)
    against the reference: every split kernel reads both planes. int8 options on such a layer are refused."""
    if path.startswith(("general-ptx", "rows-gluon")) and not ON_GPU:
        pytest.skip("the PTX unpack and the Gluon kernel run on CUDA only")
    d, gqa = 128, 4
    g = 32 if path == "general-groups" else d
    gen = torch.Generator().manual_seed(sum(bits) + len(path))
    lists = make_cache(INT2_LENS, BF16_LENS, HKV, d, g, gen, bits=bits)
    assert (lists.cache.k.bits, lists.cache.v.bits) == bits
    q = (torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    index = lists.index(SPLITS, MAX_SPLITS)
    if path == "default":
        kw = {}
    elif path.startswith("rows-gluon"):
        kw = {"row_kernel": True, "launch": DecodeLaunch(async_tiles=True),
              "options": DecodeOptions(num_stages=3, max_registers=168) if path.endswith("-3") else DecodeOptions()}
    else:
        kw = {"row_kernel": path == "rows",
              "launch": DecodeLaunch(ptx_unpack=path == "general-ptx", async_tiles=False)}
    out = _decode_poisoned(q, lists, index, **kw)
    ref = decode_int2_ref(q, lists.cache, index)
    torch.testing.assert_close(out, ref, **TOL)
    assert rel_err(out, ref) <= MAX_REL
    two = make_cache(INT2_LENS, BF16_LENS, HKV, d, g, torch.Generator().manual_seed(sum(bits) + len(path)))
    assert rel_err(decode_int2_ref(q, two.cache, index), ref) > 10 * MAX_REL  # the 4-bit codes change the answer
    with pytest.raises(ValueError, match="read 2-bit codes only"):
        decode_int2(q, lists.cache, index, options=INT8_SCORES)


GLUON_ONLY = "the interpreter does not run the Gluon split kernel, the one that implements the decode options"
"""Skip reason of the option tests on a machine without CUDA: there ``decode_int2`` runs the Triton kernel, which
computes the default numerics whatever the options say, so comparing it with an option's definition would fail and
comparing it with the default's would test nothing."""

OPTION_CASES = {
    "int8-scores": DecodeOptions(int8_scores=True),
    "int8-scores-capped": DecodeOptions(int8_scores=True, max_registers=168),
    "int8-values": DecodeOptions(int8_values=True),
    "int8-both-capped": DecodeOptions(int8_scores=True, int8_values=True, max_registers=168),
    "int8-values-fused": DecodeOptions(int8_values=True, fused_update=True),
    "lean": DecodeOptions(lean_tiles=True),
    "movmatrix": DecodeOptions(movmatrix=True),
    "three-stages": DecodeOptions(num_stages=3),
    "all-capped": DecodeOptions(int8_scores=True, int8_values=True, lean_tiles=True, fused_update=True,
                                movmatrix=True, max_registers=168),
}
"""Every decode option alone and in the combinations served (int8 scores and values together, under the large-batch
register cap), against :func:`decode_int2_ref` with the same options."""


def _async_case(layout: str, gen: torch.Generator):
    """The Gluon kernel's ragged cases: an empty INT2 part, single-tile and many-tile splits, exact rows over three
    programs, and a split count over ``max_splits`` with per-sequence exact programs."""
    d, gqa = 128, 4
    bf16_lens = [70, 5, 0, 33] if ON_GPU else [40, 9, 0, 3]
    lists = make_cache(INT2_LENS, bf16_lens, HKV, d, d, gen, head_major=layout != "slot-major")
    q = (torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    indexes = [lists.index(SPLITS, MAX_SPLITS, 3),
               DecodeIndex(lists.kv_indptr, lists.kv_indices, lists.bf16_indptr, lists.bf16_indices,
                           torch.tensor([9, 1, 4, 2], dtype=torch.int32, device=DEVICE), 3, 3,
                           torch.tensor([1, 3, 2, 1], dtype=torch.int32, device=DEVICE))]
    return lists, q, indexes


def _decode_poisoned(q, lists, index, **kw) -> torch.Tensor:
    ws = decode_workspace(q.shape[0], q.shape[1], q.shape[2], index.max_splits, DEVICE, index.exact_splits)
    for t in ws:
        t.fill_(float("nan"))
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    decode_int2(q, lists.cache, index, workspace=ws, out=out, **kw)
    assert torch.isfinite(out).all()
    return out


def _tol(options: DecodeOptions) -> dict:
    # int8 values: the kernel's and the definition's exp differ in the last bits, so a probability on a rounding
    # boundary may land one int8 step (1/127 of its tile's largest) apart
    return TOL8V if options.int8_values else TOL


@pytest.mark.parametrize("layout", ["head-major", "slot-major", "int64"])
def test_decode_async_tiles(layout, monkeypatch):
    """The row-scale path's two split kernels, the Gluon one (``async_tiles``, the default on CUDA: INT2 tiles staged
    through shared memory one tile ahead) and the Triton one, give the reference answer and agree with each other on
    ragged lengths (:func:`_async_case`), pools in both layouts and with 64-bit offsets, poisoned workspace and out;
    on CUDA every option at once (under the register cap) matches its definition in each layout too. Where the Gluon
    kernel does not cover the launch (the interpreter, d = 64) the Triton kernel runs and the answer is the same."""
    if layout == "int64":
        monkeypatch.setattr(layout_module, "OFFSET64", 1)
    gen = torch.Generator().manual_seed(509)
    lists, q, indexes = _async_case(layout, gen)
    for index in indexes:
        ref = decode_int2_ref(q, lists.cache, index)
        gluon = _decode_poisoned(q, lists, index, launch=DecodeLaunch(async_tiles=True))
        plain = _decode_poisoned(q, lists, index, launch=DecodeLaunch(async_tiles=False))
        for out in (gluon, plain):
            torch.testing.assert_close(out, ref, **TOL)
            assert rel_err(out, ref) <= MAX_REL
        torch.testing.assert_close(gluon, plain, atol=1e-2, rtol=1e-2)
        if ON_GPU:
            options = OPTION_CASES["all-capped"]
            out = _decode_poisoned(q, lists, index, options=options)
            want = decode_int2_ref(q, lists.cache, index, options=options)
            torch.testing.assert_close(out, want, **_tol(options))
            assert rel_err(out, want) <= MAX_REL
    small = make_cache(INT2_LENS, BF16_LENS, HKV, 64, 64, gen)
    q64 = torch.randn(len(INT2_LENS), HKV * 4, 64, generator=gen).to(DEVICE, torch.bfloat16)
    index = small.index(SPLITS, MAX_SPLITS)
    out = _decode_poisoned(q64, small, index, launch=DecodeLaunch(async_tiles=True))
    torch.testing.assert_close(out, decode_int2_ref(q64, small.cache, index), **TOL)


@pytest.mark.skipif(not ON_GPU, reason=GLUON_ONLY)
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_decode_options_match_their_definition(case):
    """Each :class:`DecodeOptions` case (:data:`OPTION_CASES`) through the Gluon kernel against
    ``decode_int2_ref(options=...)`` on the ragged cases of :func:`_async_case`; the options that only change how the
    answer is computed (lean tiles, movmatrix, three stages) give the default kernel's answer to float rounding."""
    options = OPTION_CASES[case]
    gen = torch.Generator().manual_seed(509)
    lists, q, indexes = _async_case("head-major", gen)
    for index in indexes:
        out = _decode_poisoned(q, lists, index, options=options)
        want = decode_int2_ref(q, lists.cache, index, options=options)
        torch.testing.assert_close(out, want, **_tol(options))
        assert rel_err(out, want) <= MAX_REL
        if options.exact:
            torch.testing.assert_close(out, _decode_poisoned(q, lists, index), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not ON_GPU, reason=GLUON_ONLY)
@pytest.mark.parametrize("gqa", [1, 8, 16])
def test_decode_async_movmatrix_at_other_head_tiles(gqa):
    """``movmatrix`` transposes each 8x8 block of the probabilities: with one query head per KV head (the head tile
    padded from 1), 8 (no padding) and 16 (two blocks of heads) the Gluon kernel still gives the reference answer,
    also with int8 scores and values and lean tiles against their definition."""
    gen = torch.Generator().manual_seed(gqa)
    d = 128
    lists = make_cache(INT2_LENS, BF16_LENS, HKV, d, d, gen)
    q = torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen).to(DEVICE, torch.bfloat16)
    index = lists.index(SPLITS, MAX_SPLITS)
    for options in (DecodeOptions(movmatrix=True),
                    DecodeOptions(movmatrix=True, lean_tiles=True, int8_scores=True, int8_values=True)):
        out = torch.full(q.shape, float("nan"), device=DEVICE)
        decode_int2(q, lists.cache, index, out=out, options=options)
        want = decode_int2_ref(q, lists.cache, index, options=options)
        torch.testing.assert_close(out, want, **_tol(options))
        assert rel_err(out, want) <= MAX_REL


def test_decode_ref_int8_scores_rounds_only_the_int2_rows_query():
    """The int8-scores reference rounds each head's rotated query to steps of max |q'| / 127 for the INT2 rows only:
    a query already on that grid (identity rotation, integers up to 127) gives the plain reference exactly, a
    random one a nearby but different answer."""
    gen = torch.Generator().manual_seed(41)
    lists = make_cache([50, 9], [6, 3], 2, 32, 32, gen)
    c = lists.cache
    eye = torch.eye(32, device=DEVICE).expand(c.rot_k.shape).contiguous()
    cache = LayerCache(c.k, c.v, c.k_bf16, c.v_bf16, eye, c.rot_v, c.clip_k, c.clip_v)
    index = lists.index(1)
    grid = torch.randint(-126, 127, (2, 4, 32), generator=gen).float()
    grid[..., 0] = 127
    grid = grid.to(DEVICE)
    torch.testing.assert_close(decode_int2_ref(grid / 40, cache, index, options=INT8_SCORES),
                               decode_int2_ref(grid / 40, cache, index), atol=1e-5, rtol=1e-5)
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    ref, ref8 = decode_int2_ref(q, cache, index), decode_int2_ref(q, cache, index, options=INT8_SCORES)
    assert not torch.equal(ref, ref8)
    torch.testing.assert_close(ref8, ref, atol=0.1, rtol=0.1)


def test_int8_value_weights_round_each_tile_to_its_own_steps():
    """The int8-values weights: a tile whose probabilities times scales sit on its grid (steps of 1/127 of its
    largest) keeps them exactly; otherwise each weight is off by less than one step of its own tile's grid (tiles of
    ``VALUE_TILE`` rows from the list's start), the dither keeps a sharp head's total within 0.5% where plain
    rounding loses over 1% (every probability under half a step), and a tile of zero scales weighs nothing."""
    gen = torch.Generator().manual_seed(43)
    n = VALUE_TILE * 2 + 40
    s = torch.randn(n, generator=gen) * 3
    scale = torch.rand(n, generator=gen) + 0.1
    exact = torch.exp(s) * scale
    w = int8_value_weights(s, scale)
    for t in range(0, n, VALUE_TILE):
        step = torch.exp(s[t:t + VALUE_TILE].max()) * scale[t:t + VALUE_TILE].max() / 127
        assert (w[t:t + VALUE_TILE] - exact[t:t + VALUE_TILE]).abs().max() <= step * (1 + 1e-5)
    assert not torch.equal(w, exact)
    u = value_dither()
    assert u.min() > 0 and u.max() < 1 and len(set(u.tolist())) == VALUE_TILE
    sharp = torch.randn(VALUE_TILE * 40, generator=gen) * 2
    ones = torch.ones_like(sharp)
    m = sharp.max()
    total = torch.exp(sharp - m).sum()
    assert abs(int8_value_weights(sharp, ones, m).sum() / total - 1) < 0.005
    rounded = sum(torch.round(torch.exp(t - t.max()) * 127).sum() / 127 * torch.exp(t.max() - m)
                  for t in sharp.split(VALUE_TILE))
    assert rounded / total < 0.99
    grid = torch.randint(1, 128, (n,), generator=gen).float()
    grid[::VALUE_TILE] = 127
    on = int8_value_weights(torch.zeros(n), grid / 127 * 3.0)
    torch.testing.assert_close(on, grid / 127 * 3.0, rtol=1e-6, atol=0)
    torch.testing.assert_close(int8_value_weights(s, scale, m=2.0), w * math.exp(-2.0), rtol=1e-5, atol=0)
    assert not int8_value_weights(s[:10], torch.zeros(10)).any()


def test_int8_values_magic_rounding_gives_the_dithered_floor():
    """The Gluon kernel's int8-value rounding on the CPU: each probability in steps ``x`` (0..127) plus its row's
    dither, added in fp32 onto ``P_MAGIC - 1/2`` and converted to fp16 (round to nearest), has as its low byte the
    definition's ``floor(x + u)`` (``int8_value_weights``) for every row of a tile, small ``x`` included (with 1024
    as the magic, ``x + u < 1/4`` fell below 1024 and read -1)."""
    from oscar_kernels.decode_async import P_MAGIC

    u = value_dither()
    x = torch.cat([torch.linspace(0, 127, 12_701), torch.rand(4096, generator=torch.Generator().manual_seed(7)) * 0.3,
                   torch.zeros(1)])
    y = x[:, None] + u[None, :]
    half = (y.to(torch.float32) + (P_MAGIC.value - 0.5)).to(torch.float16)
    low = (half.view(torch.int16) & 0xFF).to(torch.int8)
    want = torch.floor(y)
    ties = (y - y.round()).abs() < 1e-4  # fp32 sums within an ulp of an integer may round either way
    assert (low.float() == want)[~ties].all()
    assert ((low.float() - want).abs() <= 1)[ties].all()
    assert low.min() >= 0 and low.max() <= 127


def test_decode_ref_int8_values_changes_only_the_int2_rows_code_terms():
    """The int8-values reference: with equal scores and scales in every tile (all weights on the grid) it is the
    plain reference; with random ones nearby but different; row scales only."""
    gen = torch.Generator().manual_seed(47)
    lists = make_cache([300, 9], [6, 3], 2, 32, 32, gen)
    c = lists.cache
    index = lists.index(1)
    q0 = torch.zeros(2, 4, 32, device=DEVICE)  # every score 0: one probability for all rows
    flat = Int2Pool(c.v.codes, torch.full_like(c.v.scale, 0.5), c.v.zero, c.v.group_size)
    cache = LayerCache(c.k, flat, c.k_bf16, c.v_bf16, c.rot_k, c.rot_v, c.clip_k, c.clip_v)
    torch.testing.assert_close(decode_int2_ref(q0, cache, index, options=INT8_VALUES), decode_int2_ref(q0, cache, index),
                               atol=1e-5, rtol=1e-5)
    q = torch.randn(2, 4, 32, generator=gen).to(DEVICE)
    ref, ref8 = decode_int2_ref(q, c, index), decode_int2_ref(q, c, index, options=INT8_VALUES)
    assert not torch.equal(ref, ref8)
    assert rel_err(ref8, ref) < 0.05
    grouped = make_cache([20], [2], 2, 32, 16, gen)
    with pytest.raises(ValueError, match="int8_values"):
        decode_int2_ref(q[:1], grouped.cache, grouped.index(1), options=INT8_VALUES)


def test_decode_row_kernel_needs_row_scales():
    gen = torch.Generator().manual_seed(31)
    lists = make_cache([4], [2], 2, 128, 32, gen)
    q = torch.randn(1, 4, 128, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="row_kernel"):
        decode_int2(q, lists.cache, lists.index(1), row_kernel=True)


def test_decode_odd_strided_pools_take_the_general_path():
    """Code pools that cannot be read as int16 words (odd row stride) fall back to the general path, still exact;
    asking for the row kernel on them is refused."""
    gen = torch.Generator().manual_seed(37)
    d, gqa = 128, 2
    lists = make_cache([9, 40], [3, 0], 2, d, d, gen)
    pools = []
    for p in (lists.cache.k, lists.cache.v):
        wide = torch.zeros(p.codes.shape[0], p.codes.shape[1], p.codes.shape[2] + 1, dtype=torch.uint8, device=DEVICE)
        wide[..., :-1] = p.codes
        pools.append(Int2Pool(wide[..., :-1], p.scale, p.zero, p.group_size))  # row stride d/4 + 1: odd
    c = lists.cache
    cache = LayerCache(pools[0], pools[1], c.k_bf16, c.v_bf16, c.rot_k, c.rot_v, c.clip_k, c.clip_v)
    assert cache.k.words is None
    q = torch.randn(2, 2 * gqa, d, generator=gen).to(DEVICE)
    index = lists.index([2, 3])
    out = decode_int2(q, cache, index)
    assert rel_err(out, decode_int2_ref(q, cache, index)) <= MAX_REL
    with pytest.raises(ValueError, match="row_kernel"):
        decode_int2(q, cache, index, row_kernel=True)


# ---------------------------------------------------------------------------------------------------------------
# split policy


def _old_default_num_splits(batch, kv_heads, max_kv_len, row_kernel):
    """The host policy the tuned constants were measured with (decode_int2.py before device split counts; the
    row-scale path's program floor raised to 1024 with the 8-partial merge)."""
    min_programs = 1024 if row_kernel else 128
    split_tokens = 2048 if row_kernel else 3072
    by_len = triton.cdiv(max(max_kv_len, 1), split_tokens)
    by_programs = triton.cdiv(min_programs, batch * kv_heads)
    return max(1, min(max(by_len, by_programs), triton.cdiv(max(max_kv_len, 1), 256)))


def test_split_policy_reproduces_the_measured_counts():
    # counts named in RESULTS.md / decode_int2.py for the Qwen3-8B benchmark shapes (8 KV heads, ctx - 128 INT2)
    named = {(1, 8192, True): 32, (1, 131072, True): 128, (8, 32768, True): 16, (16, 131072, True): 64,
             (1, 8192, False): 16, (1, 131072, False): 43, (8, 32768, False): 11, (16, 131072, False): 43}
    for (bs, ctx, rows), want in named.items():
        assert default_num_splits(bs, 8, ctx - 128, rows) == want, (bs, ctx, rows)
    for bs in (1, 2, 3, 8, 16, 32, 64):
        for hkv in (1, 2, 8):
            for n in (0, 1, 255, 256, 257, 1000, 2048, 4097, 8064, 32640, 130944):
                for rows in (False, True):
                    pol = split_policy(bs, hkv, n, rows)
                    want = _old_default_num_splits(bs, hkv, n, rows)
                    assert pol.max_splits == want and pol.splits_for(n) == want
                    # per sequence: never above the bound, shorter sequences get no more splits than longer ones
                    lens = torch.tensor([0, n // 3, n // 2, n])
                    got = pol.num_splits(lens)
                    assert int(got[-1]) == want and bool((got[:-1] <= got[1:]).all()) and int(got.min()) >= 1


@triton.jit
def _split_count_kernel(L, OUT, split_tokens, min_splits, min_split_tokens, max_splits, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(OUT + offs, split_count(tl.load(L + offs), split_tokens, min_splits, min_split_tokens, max_splits))


def test_split_count_twin_matches_torch():
    gen = torch.Generator().manual_seed(41)
    lens = torch.randint(0, 40000, (64,), generator=gen, dtype=torch.int32)
    lens[:3] = torch.tensor([0, 1, 256], dtype=torch.int32)
    for bs, rows, cap in ((1, True, None), (16, False, None), (4, True, 5)):
        pol = split_policy(bs, 2, 40000, rows, max_splits=cap)
        out = torch.full((64,), -1, dtype=torch.int32, device=DEVICE)
        _split_count_kernel[(1,)](lens.to(DEVICE), out, pol.split_tokens, pol.min_splits, pol.min_split_tokens,
                                  pol.max_splits, BLOCK=64)
        assert torch.equal(out.cpu(), pol.num_splits(lens))


def test_decode_index_gives_uniform_batches_the_old_counts():
    gen = torch.Generator().manual_seed(43)
    for d, rows in ((128, True), (64, False)):
        lists = make_cache([300, 300, 300], [2, 2, 2], 2, d, d, gen)
        index = decode_index(lists.cache, lists.kv_indptr, lists.kv_indices, lists.bf16_indptr, lists.bf16_indices,
                             300)
        want = _old_default_num_splits(3, 2, 300, rows)
        assert isinstance(index, DecodeIndex) and index.max_splits == want
        assert index.num_splits.tolist() == [want] * 3


def test_merge_chunk_reads_every_partial_in_one_step_up_to_128():
    assert [merge_chunk_for(p) for p in (0, 1, 19, 32, 33, 34, 64, 65, 128, 131, 132, 500)] == \
        [32, 32, 32, 32, 64, 64, 64, 128, 128, 128, 128, 128]
    assert [merge_warps(c) for c in (32, 64, 128, 256)] == [4, 4, 4, 8]
