"""DecodePlan / ExtendPlan end to end: a tiny engine (requests, req_to_token, scattered slots) prefills and decodes
through plan/run, and every output is checked against Design P computed from the un-rotated K/V history of its
sequence (quantised with quantize_pack_ref semantics, exact rows bf16 after rotation)."""

from __future__ import annotations

import importlib

import pytest
import torch
from int2_cache import DEVICE, ON_GPU, History, design_p_ref, outliers, poison_kv_pool, random_rotation, rel_err
from oscar_kernels import DecodeLaunch, DecodeOptions, DecodePlan, ExtendPlan, Int2KVPool, exact_row_ref
from oscar_kernels.plan import plan_lists_ref
from oscar_kernels.scheme import QuantScheme

TOL = dict(atol=5e-2, rtol=5e-2) if ON_GPU else dict(atol=2e-4, rtol=2e-4)
MAX_REL = 1e-2 if ON_GPU else 2e-5
# small split knobs so that short interpreted sequences get several INT2 splits (defaults are the measured ones)
SPLITS = dict(options=DecodeOptions(split_tokens=8), min_split_tokens=4, min_programs=1, max_splits=3)
EXTEND_BLOCKS = dict(block_m=64, block_n=16)


class Engine:
    """Requests with pre-drawn un-rotated histories (bf16 values), one layer, a req_to_token map of scattered slots,
    everything unwritten poisoned with NaN."""

    def __init__(self, scheme: QuantScheme, hkv: int, gqa: int, d: int, reqs: int, max_ctx: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.scheme, self.hkv, self.hq, self.d, self.max_ctx = scheme, hkv, hkv * gqa, d, max_ctx
        rot_k = random_rotation(hkv, d, gen)[None]
        rot_v = random_rotation(hkv, d, gen)[None]
        clip_k = 0.6 + 0.4 * torch.rand(1, hkv, generator=gen)
        clip_v = 0.6 + 0.4 * torch.rand(1, hkv, generator=gen)
        slots = reqs * max_ctx + 9
        # centered keys: a center far from the keys' own mean, so an uncentered store would read differently
        self.center = (torch.randn(1, hkv, d, generator=gen) * 3 + 2) if scheme.center_keys else None
        self.pool = Int2KVPool(scheme, 1, hkv, d, slots, reqs, rot_k, rot_v, clip_k, clip_v, device=DEVICE,
                               center_k=self.center)
        poison_kv_pool(self.pool, gen)
        perm = torch.randperm(slots, generator=gen)[: reqs * max_ctx]
        self.req_to_token = perm.view(reqs, max_ctx).to(DEVICE, torch.int32)
        outlier = outliers(d, gen)
        self.k = (torch.randn(reqs, max_ctx, hkv, d, generator=gen) * outlier).to(DEVICE, torch.bfloat16)
        self.v = torch.randn(reqs, max_ctx, hkv, d, generator=gen).to(DEVICE, torch.bfloat16)
        self.q = (torch.randn(reqs, max_ctx, self.hq, d, generator=gen) * 2).to(DEVICE, torch.bfloat16)

    def _ref(self, req: int, start: int, positions: list[int]) -> torch.Tensor:
        c = self.pool.layer(0)
        k = self.k[req, : positions[-1] + 1].float()
        if self.center is not None:  # Design P of the centered keys: the softmax ignores the shift q·center
            k = k - self.center[0].to(k.device)
        hist = History(k, self.v[req, : positions[-1] + 1].float(), start)
        return design_p_ref(self.q[req, positions], hist, positions, c.rot_k, c.rot_v, c.clip_k, c.clip_v,
                            self.scheme.sink, self.scheme.recent, self.pool.group_size)

    def extend(self, plan: ExtendPlan, reqs: list[int], c0: list[int], m: list[int], start: list[int]):
        """One extend step through the plan: returns (output, reference) over the real query rows."""
        pos = [list(range(a, a + b)) for a, b in zip(c0, m, strict=True)]
        loc = torch.cat([self.req_to_token[r, p] for r, p in zip(reqs, pos, strict=True)])
        i = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731
        plan.plan(self.req_to_token, i(reqs), i(c0), i(m), loc, start=i(start), max_extend_len=max(m))
        q = torch.cat([self.q[r, p] for r, p in zip(reqs, pos, strict=True)])
        k = torch.cat([self.k[r, p] for r, p in zip(reqs, pos, strict=True)])
        v = torch.cat([self.v[r, p] for r, p in zip(reqs, pos, strict=True)])
        out = torch.full(q.shape, float("nan"), device=DEVICE)
        plan.run(0, q, k, v, out=out)
        ref = torch.cat([self._ref(r, s, p) for r, s, p in zip(reqs, start, pos, strict=True)])
        real = torch.tensor([x >= s for s, p in zip(start, pos, strict=True) for x in p], device=DEVICE)
        return out[real], ref[real]

    def decode(self, plan: DecodePlan, reqs: list[int], n: list[int], start: list[int]):
        """One decode step (new token at position n - 1) through the plan: (output, reference)."""
        i = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731
        loc = torch.stack([self.req_to_token[r, x - 1] for r, x in zip(reqs, n, strict=True)])
        plan.plan(self.req_to_token, i(reqs), i(n), loc, start=i(start))
        pos = [x - 1 for x in n]
        out = torch.full((len(reqs), self.hq, self.d), float("nan"), device=DEVICE)
        plan.run(0, self.q[reqs, pos], self.k[reqs, pos], self.v[reqs, pos], out=out)
        ref = torch.cat([self._ref(r, s, [p]) for r, s, p in zip(reqs, start, pos, strict=True)])
        return out, ref

    def state(self) -> list[torch.Tensor]:
        c = self.pool.layer(0)
        return [c.k.codes, c.k.scale, c.k.zero, c.v.codes, c.v.scale, c.v.zero, c.k_bf16, c.v_bf16]


def _close(out, ref):
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)
    assert rel_err(out, ref) <= MAX_REL


CASES = [  # scheme, hkv, gqa, d, prefill lengths, starts
    (QuantScheme(group=32, sink=3, recent=6), 2, 4, 64, [20, 9, 33], [0, 2, 0]),
    (QuantScheme(group=0, sink=0, recent=4), 2, 2, 128, [17, 1, 30], [0, 0, 4]),  # row-scale decode path
    (QuantScheme(group=0, sink=2, recent=0), 1, 8, 64, [12, 25, 5], [1, 0, 0]),  # own key through INT2
    (QuantScheme(group=32, sink=3, recent=6, center_keys=True), 2, 4, 64, [20, 9, 33], [0, 2, 0]),  # centered keys
]


DECODE_VARIANTS = {
    "default": {},
    "fma": dict(write_tuning=dict(rot_precision="fma", block_n=1, num_warps=1)),
    "tf32x3-write": dict(write_tuning={}),
    "unfused": dict(fuse_q_rotation=False),
    "merge-cols": dict(launch=DecodeLaunch(merge_cols=32)),
    "exact-splits": dict(exact_splits=3, launch=DecodeLaunch(block_nb=16)),
    "tiles": dict(exact_splits=2, launch=DecodeLaunch(block_n=64, block_nb=16)),
}


@pytest.mark.parametrize("case,write", [(c, "default") for c in range(len(CASES))]
                         + [(0, "fma"), (1, "tf32x3-write"), (1, "unfused"), (1, "merge-cols"), (0, "exact-splits"),
                            (1, "exact-splits"), (1, "tiles"), (2, "tiles")])
def test_prefill_then_decode_matches_design_p(case, write):
    """One extend over three requests (scattered slots, request order != pool order, left padding), then decode steps
    on the SAME plan buffers with new lengths each step (ring wrap-around included): every output is Design P. The
    queries are rotated in the write's launch by default; "unfused" rotates them in the attention's own launch;
    "fma" / "tf32x3-write" write the decode tokens (and rotate the queries) through the CUDA-core / tensor-core
    rotation (``write_tuning``); "merge-cols" splits the merge over output columns; "exact-splits" shares each
    sequence's exact rows among three programs (16-row tiles); "tiles" runs 64-token INT2 tiles and 16-row exact tiles
    (on CUDA the row-scale path's Triton kernel)."""
    scheme, hkv, gqa, d, lens, start = CASES[case]
    steps = 3
    eng = Engine(scheme, hkv, gqa, d, reqs=4, max_ctx=max(lens) + steps, seed=10 + case)
    reqs = [2, 0, 3]
    ext = ExtendPlan(eng.pool, 4, sum(lens), eng.max_ctx, **EXTEND_BLOCKS)
    _close(*eng.extend(ext, reqs, [0, 0, 0], lens, start))
    dec = DecodePlan(eng.pool, 4, eng.max_ctx, q_heads=eng.hq, **DECODE_VARIANTS[write], **SPLITS)
    ptrs = None
    for s in range(steps):
        n = [x + 1 + s for x in lens]
        _close(*eng.decode(dec, reqs, n, start))
        idx = dec.index
        now = [t.data_ptr() for t in (idx.kv_indptr, idx.kv_indices, idx.bf16_indices, idx.num_splits)]
        assert ptrs is None or now == ptrs  # same buffers, new contents
        ptrs = now
    # the split counts really vary per sequence inside the fixed grid
    assert dec.index.max_splits == SPLITS["max_splits"] and len(set(dec.index.num_splits.tolist())) > 1


def test_decode_grid_bound_follows_the_batch_size():
    """Default policy: the grid bound is that of a uniform batch of the planned size at max_seq_len, so one long
    sequence gets more splits than a full batch; the flat workspace holds the largest batch's partials; the bs1
    step with its larger bound is still Design P, and so is the full batch after it on the same buffers."""
    from oscar_kernels.decode_grid import split_policy
    eng = Engine(QuantScheme(group=0, sink=2, recent=4), 2, 2, 128, reqs=3, max_ctx=200, seed=17)
    knobs = dict(split_tokens=64, min_split_tokens=16, min_programs=16)
    dec = DecodePlan(eng.pool, 3, 200, q_heads=eng.hq, balance=False, options=DecodeOptions(split_tokens=64),
                     min_split_tokens=16, min_programs=16)
    want = [split_policy(b, 2, 200 - 6, dec.row_kernel, **knobs).max_splits for b in (1, 2, 3)]
    assert [dec.grid_bound(b) for b in (1, 2, 3)] == want and want[0] > want[2]
    assert dec.max_splits == want[0]
    parts = max(b * (w + 1) for b, w in zip((1, 2, 3), want, strict=True))
    assert dec.workspace_bytes() >= parts * eng.hq * (128 + 1) * 4
    lens = [180, 60, 150]
    ext = ExtendPlan(eng.pool, 3, sum(lens), 200, **EXTEND_BLOCKS)
    out, ref = eng.extend(ext, [0, 1, 2], [0, 0, 0], lens, [0, 0, 0])
    # 390 rows: a few rotated exact rows round to the other bf16 neighbour than the reference's rotation does (one
    # ulp, fp32 summation order), which moves single outputs by ~4e-4; the relative error stays that of the others
    assert torch.isfinite(out).all() and rel_err(out, ref) <= MAX_REL
    torch.testing.assert_close(out, ref, **(TOL if ON_GPU else dict(atol=2e-3, rtol=2e-3)))
    _close(*eng.decode(dec, [0], [181], [0]))
    assert dec.index.max_splits == want[0] and dec._workspace[0].shape == (1, eng.hq, want[0] + 1, 128)
    assert int(dec.index.num_splits[0]) > want[2]  # more splits than the full batch's bound allows
    _close(*eng.decode(dec, [0, 1, 2], [182, 61, 151], [0, 0, 0]))
    assert dec.index.max_splits == want[2]
    with pytest.raises(ValueError, match="outside"):
        dec.grid_bound(4)


@pytest.mark.parametrize("block_n", [None, 16])
def test_decode_plan_balances_exact_programs(block_n):
    """``balance`` (the default): the plan's per-sequence INT2 splits and exact programs are
    :func:`~oscar_kernels.decode_grid.balance_counts` of its lists' lengths, within the same grid and workspace as
    without it; the steps stay Design P. With 16-token INT2 tiles the long sequences' splits grow past the policy's
    bound into the programs their single exact program leaves."""
    from oscar_kernels.decode_grid import balance_counts, split_policy
    eng = Engine(QuantScheme(group=0, sink=2, recent=4), 2, 2, 128, reqs=3, max_ctx=200, seed=23)
    knobs = dict(split_tokens=64, min_split_tokens=16, min_programs=8)
    dec = DecodePlan(eng.pool, 3, 200, q_heads=eng.hq, exact_splits=3, options=DecodeOptions(split_tokens=64),
                     min_split_tokens=16, min_programs=8, launch=DecodeLaunch(block_n=block_n))
    assert dec.balance and dec.int2_block_n() == (block_n or 128)
    lens = [180, 60, 150]
    ext = ExtendPlan(eng.pool, 3, sum(lens), 200, **EXTEND_BLOCKS)
    eng.extend(ext, [0, 1, 2], [0, 0, 0], lens, [0, 0, 0])
    for rows, seq in (([0], [181]), ([0, 1, 2], [182, 61, 151]), ([1, 2], [62, 152])):
        _close(*eng.decode(dec, rows, seq, [0] * len(rows)))
        idx = dec.index
        kv_lens = (idx.kv_indptr[1:] - idx.kv_indptr[:-1]).cpu()
        ex_lens = (idx.bf16_indptr[1:] - idx.bf16_indptr[:-1]).cpu()
        pol = split_policy(len(rows), 2, 200 - 6, dec.row_kernel, idx.max_splits, **knobs)
        want_n, want_e = balance_counts(kv_lens, ex_lens, pol, 3, dec.int2_block_n())
        assert idx.num_exact is not None and idx.exact_splits == 3
        assert torch.equal(idx.num_splits.cpu(), want_n) and torch.equal(idx.num_exact.cpu(), want_e)
        assert bool((want_n + want_e <= idx.parts).all())
        if block_n == 16 and len(rows) == 1:
            assert int(want_n[0]) > idx.max_splits and int(want_e[0]) == 1


def test_plan_lists_follow_design_p():
    """The device-filled lists against the spec's ranges, written out in Python."""
    sink, recent = 3, 5
    eng = Engine(QuantScheme(group=32, sink=sink, recent=recent), 1, 1, 64, reqs=3, max_ctx=40, seed=3)
    r2t = eng.req_to_token.cpu()
    reqs, start = [1, 2, 0], [0, 4, 2]
    i = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731

    def rows(req, ps, st):
        return exact_row_ref(req, torch.tensor(ps, dtype=torch.long), st, sink, recent).tolist()

    # decode: seq_lens count the new token
    n = [30, 6, 10]
    dec = DecodePlan(eng.pool, 3, 40, q_heads=1)
    dec.plan(eng.req_to_token, i(reqs), i(n), i([0, 1, 2]), start=i(start))
    idx = dec.index
    for b, (r, x, st) in enumerate(zip(reqs, n, start, strict=True)):
        se = st + sink
        int2 = list(range(se, max(se, x - recent)))
        ex = list(range(st, min(se, x))) + list(range(max(se, x - recent), x))
        assert idx.kv_indices[idx.kv_indptr[b]:idx.kv_indptr[b + 1]].tolist() == r2t[r, int2].tolist()
        assert idx.bf16_indices[idx.bf16_indptr[b]:idx.bf16_indptr[b + 1]].tolist() == rows(r, ex, st)
        new_row = rows(r, [x - 1], st)[0]
        assert dec._buffers["bf16_loc"][b].item() == new_row
    # extend: chunk [c0, c1), the cached lists end before the chunk, chunk rows that stay exact get their rows
    c0, m = [20, 0, 3], [7, 9, 1]
    ext = ExtendPlan(eng.pool, 3, sum(m), 40)
    loc = i(list(range(sum(m))))
    ext.plan(eng.req_to_token, i(reqs), i(c0), i(m), loc, start=i(start))
    xi = ext.index
    assert xi.qo_indptr.tolist() == [0, 7, 16, 17] and xi.q_pos0.tolist() == c0 and xi.max_new_len == sum(m)
    bloc = ext._buffers["bf16_loc"][: sum(m)].tolist()
    row0 = 0
    for b, (r, a, k, st) in enumerate(zip(reqs, c0, m, start, strict=True)):
        se, c1 = st + sink, a + k
        int2 = list(range(se, max(se, c1 - recent)))
        ex = list(range(st, min(se, a))) + list(range(max(se, a + 1 - recent), a))
        assert xi.kv_indices[xi.kv_indptr[b]:xi.kv_indptr[b + 1]].tolist() == r2t[r, int2].tolist()
        sl = slice(xi.bf16_indptr[b], xi.bf16_indptr[b + 1])
        assert xi.bf16_indices[sl].tolist() == rows(r, ex, st) and xi.bf16_pos[sl].tolist() == ex
        want = [rows(r, [p], st)[0] if p >= st and (p < se or p >= c1 - recent) else -1 for p in range(a, c1)]
        assert bloc[row0:row0 + k] == want
        row0 += k
    ref = plan_lists_ref(eng.req_to_token, torch.tensor(reqs), torch.tensor(c0), torch.tensor(m), torch.tensor(start),
                         sink, recent, decode=False)
    assert ref["bf16_loc"].tolist() == bloc and ref["qo_indptr"].tolist() == [0, 7, 16, 17]


def _assert_distinct_rows(loc: torch.Tensor) -> None:
    """The exact rows one write stores are distinct: the write kernel's programs store them concurrently, so two
    tokens aimed at one row would race (either could land)."""
    rows = loc[loc >= 0]
    assert rows.unique().numel() == rows.numel(), f"a plan aims two tokens at one exact row: {loc.tolist()}"


@pytest.mark.parametrize("sink,recent", [(3, 5), (0, 4), (2, 0), (0, 0), (6, 1)])
def test_plan_lists_match_the_reference(sink, recent):
    """Random batches (request order, left padding, lengths around the windows): the device lists == plan_lists_ref."""
    gen = torch.Generator().manual_seed(50 + 10 * sink + recent)
    reqs, bsz, ctx = 5, 4, 48
    eng = Engine(QuantScheme(group=32, sink=sink, recent=recent), 1, 1, 64, reqs=reqs, max_ctx=ctx, seed=sink)
    req = torch.randperm(reqs, generator=gen)[:bsz]
    start = torch.randint(0, 4, (bsz,), generator=gen)
    dec = DecodePlan(eng.pool, bsz, ctx, q_heads=1)
    ext = ExtendPlan(eng.pool, bsz, bsz * 12, ctx)
    for _ in range(3):
        n = torch.randint(1, ctx + 1, (bsz,), generator=gen)
        dec.plan(eng.req_to_token, req.to(DEVICE), n.to(DEVICE), torch.arange(bsz, device=DEVICE),
                 start=start.to(DEVICE))
        want = plan_lists_ref(eng.req_to_token, req, n - 1, torch.ones(bsz, dtype=torch.long), start, sink, recent,
                              decode=True)
        got, idx = dec._buffers, dec.index
        assert torch.equal(idx.kv_indptr.cpu(), want["kv_indptr"]) and torch.equal(idx.bf16_indptr.cpu(), want["bf16_indptr"])
        nk, nb = int(want["kv_indptr"][-1]), int(want["bf16_indptr"][-1])
        assert torch.equal(idx.kv_indices[:nk].cpu(), want["kv_indices"])
        assert torch.equal(idx.bf16_indices[:nb].cpu(), want["bf16_indices"])
        assert torch.equal(got["bf16_loc"][:bsz].cpu(), want["bf16_loc"])
        _assert_distinct_rows(got["bf16_loc"][:bsz])
        c0 = torch.randint(0, ctx - 12, (bsz,), generator=gen)
        m = torch.randint(0, 13, (bsz,), generator=gen)
        ext.plan(eng.req_to_token, req.to(DEVICE), c0.to(DEVICE), m.to(DEVICE),
                 torch.arange(int(m.sum()), device=DEVICE), start=start.to(DEVICE))
        want = plan_lists_ref(eng.req_to_token, req, c0, m, start, sink, recent, decode=False)
        got, xi = ext._buffers, ext.index
        for name in ("qo_indptr", "kv_indptr", "bf16_indptr"):
            assert torch.equal(getattr(xi, name).cpu(), want[name]), name
        nk, nb = int(want["kv_indptr"][-1]), int(want["bf16_indptr"][-1])
        assert torch.equal(xi.kv_indices[:nk].cpu(), want["kv_indices"])
        assert torch.equal(xi.bf16_indices[:nb].cpu(), want["bf16_indices"])
        assert torch.equal(xi.bf16_pos[:nb].cpu(), want["bf16_pos"])
        assert torch.equal(got["bf16_loc"][:int(m.sum())].cpu(), want["bf16_loc"])
        _assert_distinct_rows(got["bf16_loc"][:int(m.sum())])


def test_decode_equals_extend_of_one_token():
    scheme = QuantScheme(group=32, sink=2, recent=5)
    eng = Engine(scheme, 2, 4, 64, reqs=3, max_ctx=30, seed=21)
    reqs, lens, start = [1, 2, 0], [14, 3, 22], [0, 1, 0]
    ext = ExtendPlan(eng.pool, 3, sum(lens), 30, **EXTEND_BLOCKS)
    eng.extend(ext, reqs, [0, 0, 0], lens, start)
    before = [t.clone() for t in eng.state()]
    out_d, ref = eng.decode(DecodePlan(eng.pool, 3, 30, q_heads=eng.hq, **SPLITS), reqs, [x + 1 for x in lens], start)
    after_d = [t.clone() for t in eng.state()]
    for t, b in zip(eng.state(), before, strict=True):
        t.copy_(b)
    out_e, _ = eng.extend(ext, reqs, lens, [1, 1, 1], start)
    torch.testing.assert_close(out_e, out_d, atol=1e-5 if not ON_GPU else 2e-2, rtol=1e-5 if not ON_GPU else 2e-2)
    _close(out_e, ref)
    for a, b in zip(eng.state(), after_d, strict=True):  # the same slots and rows written, with the same values
        assert torch.equal(a.float().nan_to_num(-7.0), b.float().nan_to_num(-7.0))


def test_chunked_extend_equals_one_extend():
    scheme = QuantScheme(group=0, sink=3, recent=6)
    reqs, start = [0, 1], [0, 2]
    first, second = [11, 4], [9, 13]
    total = [a + b for a, b in zip(first, second, strict=True)]
    one = Engine(scheme, 2, 2, 64, reqs=2, max_ctx=max(total), seed=31)
    two = Engine(scheme, 2, 2, 64, reqs=2, max_ctx=max(total), seed=31)
    out_one, ref_one = one.extend(ExtendPlan(one.pool, 2, sum(total), one.max_ctx, **EXTEND_BLOCKS), reqs, [0, 0],
                                  total, start)
    plan = ExtendPlan(two.pool, 2, sum(total), two.max_ctx, **EXTEND_BLOCKS)
    out_a, _ = two.extend(plan, reqs, [0, 0], first, start)
    out_b, _ = two.extend(plan, reqs, first, second, start)
    _close(out_one, ref_one)
    # reassemble the two chunks in the one-extend row order (real rows only: sequence 1 starts at 2)
    pieces_a = [out_a[: first[0]], out_a[first[0]:]]
    pieces_b = [out_b[: second[0]], out_b[second[0]:]]
    chunked = torch.cat([pieces_a[0], pieces_b[0], pieces_a[1], pieces_b[1]])
    torch.testing.assert_close(chunked, out_one, atol=1e-5 if not ON_GPU else 2e-2, rtol=1e-5 if not ON_GPU else 2e-2)
    for a, b in zip(one.state(), two.state(), strict=True):
        assert torch.equal(a.float().nan_to_num(-7.0), b.float().nan_to_num(-7.0))


def test_workspace_bytes_and_limits():
    eng = Engine(QuantScheme(group=32, sink=2, recent=6), 2, 4, 64, reqs=3, max_ctx=20, seed=5)
    dec = DecodePlan(eng.pool, 3, 20, q_heads=8, max_splits=5)
    b, rows, hq, parts, d = 3, 3 * 8, 8, 6, 64
    int32 = 5 * b + 3 * (b + 1) + b * 20 + 2 * rows + b  # per-sequence, indptrs, INT2 list, exact list + positions, rows
    int64 = 2 * b  # request and slot of each new token
    workspace = b * hq * parts * d * 4 + b * hq * parts * 4 + b * hq * d * 4  # part_o, part_lse, q_rot
    assert dec.workspace_bytes() == 4 * int32 + 8 * int64 + workspace
    ext = ExtendPlan(eng.pool, 3, 16, 20)
    assert ext.workspace_bytes() > 2 * 16 * 2 * 64 * 2  # includes the bf16 K/V scratch
    i = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731
    with pytest.raises(ValueError, match="max_batch"):
        dec.plan(eng.req_to_token, i([0, 1, 2, 0]), i([3, 3, 3, 3]), i([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="req_to_token"):
        dec.plan(eng.req_to_token.long(), i([0]), i([3]), i([0]))
    with pytest.raises(ValueError, match="max_tokens"):
        ext.plan(eng.req_to_token, i([0]), i([0]), i([17]), i(list(range(17))))
    with pytest.raises(RuntimeError, match="plan"):
        DecodePlan(eng.pool, 1, 8, q_heads=8).run(0, *(torch.zeros(1, h, 64, device=DEVICE) for h in (8, 2, 2)))


def test_decode_plan_copies_its_inputs_in_the_lengths_kernel():
    """A decode plan's inputs reach its buffers inside the lengths kernel (no eager copies): over stale buffers, the
    request rows (int32 or int64), ``seq_lens - 1``, the start (0 without one) and the new tokens' slots, a shorter
    ``out_cache_loc`` (a graph replay's live rows) padded with slot 0; the lists then match the reference. A longer
    ``out_cache_loc`` is refused."""
    eng = Engine(QuantScheme(group=32, sink=2, recent=4), 2, 4, 64, reqs=3, max_ctx=24, seed=17)
    dec = DecodePlan(eng.pool, 3, 24, q_heads=8, **SPLITS)
    b = dec._buffers
    for name in ("req", "c0", "start", "loc"):
        b[name].fill_(77)
    i = lambda x, dt=torch.int64: torch.tensor(x, device=DEVICE, dtype=dt)  # noqa: E731
    reqs, n = [2, 0, 1], [9, 24, 5]
    live = torch.stack([eng.req_to_token[r, x - 1] for r, x in zip(reqs[:2], n[:2], strict=True)])
    dec.plan(eng.req_to_token, i(reqs, torch.int32), i(n, torch.int32), live.to(torch.int32))
    assert b["req"][:3].tolist() == reqs and b["c0"][:3].tolist() == [x - 1 for x in n]
    assert b["start"][:3].tolist() == [0, 0, 0] and b["loc"][:3].tolist() == [*live.tolist(), 0]
    ref = plan_lists_ref(eng.req_to_token, i(reqs), i([x - 1 for x in n]), i([1, 1, 1]), i([0, 0, 0]),
                         eng.scheme.sink, eng.scheme.recent, decode=True)
    assert torch.equal(dec.index.kv_indptr.cpu().long(), ref["kv_indptr"].long())  # the reference is a CPU one
    got = dec.index.kv_indices[: int(ref["kv_indptr"][-1])]
    assert torch.equal(got.cpu().long(), ref["kv_indices"].long())
    loc = torch.stack([eng.req_to_token[r, x - 1] for r, x in zip([1, 2], [7, 11], strict=True)])
    dec.plan(eng.req_to_token, i([1, 2]), i([7, 11]), loc, start=i([0, 3]))  # int64, with a start
    assert b["req"][:2].tolist() == [1, 2] and b["c0"][:2].tolist() == [6, 10] and b["start"][:2].tolist() == [0, 3]
    assert b["loc"][:2].tolist() == loc.tolist()
    ref = plan_lists_ref(eng.req_to_token, i([1, 2]), i([6, 10]), i([1, 1]), i([0, 3]), eng.scheme.sink,
                         eng.scheme.recent, decode=True)
    for name in ("kv_indptr", "bf16_indptr"):
        assert torch.equal(getattr(dec.index, name).cpu().long(), ref[name].long())
    with pytest.raises(ValueError, match="out_cache_loc"):
        dec.plan(eng.req_to_token, i([0]), i([3]), i([4, 5]))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_run_cuda_graph_replay_over_changing_lengths():
    """DecodePlan.run captured once; plan() re-run eagerly with new lengths before each replay; no host sync in
    plan or run; every replay is Design P."""
    scheme = QuantScheme(group=0, sink=4, recent=16)
    eng = Engine(scheme, 2, 4, 128, reqs=3, max_ctx=600, seed=41)
    reqs, lens, start = [2, 0, 1], [300, 17, 520], [0, 3, 0]
    ext = ExtendPlan(eng.pool, 3, sum(lens), 600)
    eng.extend(ext, reqs, [0, 0, 0], lens, start)
    dec = DecodePlan(eng.pool, 3, 600, q_heads=eng.hq, max_splits=4, options=DecodeOptions(split_tokens=64),
                     min_split_tokens=32)
    i = lambda x: torch.tensor(x, device=DEVICE)  # noqa: E731
    q = torch.zeros(3, eng.hq, 128, device=DEVICE, dtype=torch.bfloat16)
    k = torch.zeros(3, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    out = torch.empty(3, eng.hq, 128, device=DEVICE, dtype=torch.float32)
    r2t, reqs_t, start_t = eng.req_to_token, i(reqs), i(start)

    def stage(n):
        pos = [x - 1 for x in n]
        n_t, loc = i(n), r2t[reqs_t, i(pos)]  # the engine's inputs, on the device before planning
        torch.cuda.set_sync_debug_mode("error")  # plan: device work only
        dec.plan(r2t, reqs_t, n_t, loc, start=start_t)
        torch.cuda.set_sync_debug_mode("default")
        q.copy_(eng.q[reqs, pos])
        k.copy_(eng.k[reqs, pos])
        v.copy_(eng.v[reqs, pos])
        return pos

    stage([x + 1 for x in lens])
    dec.run(0, q, k, v, out=out)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # run: device work only
    dec.run(0, q, k, v, out=out)
    torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.run(0, q, k, v, out=out)
    for s in range(1, 4):
        n = [x + 1 + s for x in lens]
        pos = stage(n)
        out.fill_(float("nan"))
        graph.replay()
        ref = torch.cat([eng._ref(r, st, [p]) for r, st, p in zip(reqs, start, pos, strict=True)])
        _close(out, ref)


def test_plan_lists_match_the_reference_over_several_fill_programs(monkeypatch):
    """The fill split over programs of FILL_PART INT2 positions each (48-token contexts over 16-position parts: the
    lists of one sequence written by up to three programs, its exact rows by the first alone)."""
    plan_module = importlib.import_module("oscar_kernels.plan")
    monkeypatch.setattr(plan_module, "FILL_PART", 16)
    monkeypatch.setattr(plan_module, "FILL_BLOCK", 8)
    test_plan_lists_match_the_reference(3, 5)
    test_plan_lists_match_the_reference(0, 0)
