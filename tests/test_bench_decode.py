"""benchmarks/bench_decode.py --variants off the GPU: each variant's decode step runs through the kernels (interpreter)
on tiny pools, and the table appended to RESULTS.md has one row per variant, one column per shape and the plan's
split bound of each cell; a wrong step would fail against the reference."""

from __future__ import annotations

import pytest
import torch
from helpers import load_benchmark
from oscar_kernels import decode_int2_ref


@pytest.fixture
def bench(monkeypatch):
    mod = load_benchmark("bench_decode")
    monkeypatch.setattr(mod, "DEV", "cpu")
    monkeypatch.setattr(mod, "STEP_SHAPES", [(1, 400, 2), (2, 200, 1)])
    monkeypatch.setattr(mod.torch.cuda, "get_device_name", lambda *a: "cpu (interpreter)")
    monkeypatch.setattr(mod.torch.cuda, "empty_cache", lambda: None)
    return mod


def test_each_variant_steps_through_every_layer_and_matches_the_reference(bench):
    case = bench.StepCase(1, 400, 2, torch.Generator().manual_seed(0))
    picked = bench.STEP_VARIANTS[1:3] + bench.STEP_VARIANTS_LONG_RECENT[2:3] + bench.STEP_VARIANTS_WRITE[-1:]
    for name, kw in picked:
        fn, bound = case.step(**kw)
        case.out.fill_(float("nan"))
        fn()  # every layer; the output is the last layer's
        plan = bench.DecodePlan(case.pool, 1, 400, q_heads=bench.HQ, **bench.plan_kwargs(kw))
        plan.plan(case.req_to_token, torch.arange(1), torch.full((1,), 400), case.req_to_token[:, 399].contiguous())
        ref = decode_int2_ref(case.q, case.pool.layer(case.layers - 1), plan.index, plan.sm_scale)
        assert torch.isfinite(case.out).all(), name
        err = (case.out.float() - ref).norm() / ref.norm()
        assert err < 1e-2, (name, err)
        assert bound == plan.index.max_splits >= 1


def test_variants_table_has_a_row_per_variant_and_is_appended(bench, tmp_path, monkeypatch):
    timed = []
    monkeypatch.setattr(bench, "graph_us", lambda fn: (fn(), timed.append(1), 10.0 * len(timed))[2])
    variants = bench.STEP_VARIANTS[:2]
    results = tmp_path / "RESULTS.md"
    bench.variants_table(torch.Generator().manual_seed(1), str(results), "abc1234", variants)
    text = results.read_text()
    assert "## Decode step variants, per layer" in text and "commit abc1234" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].split("|")[1:4] == [" variant ", " bs1/0k µs ", " bs2/0k µs "]
    assert [r.split("|")[1].strip() for r in rows[1:]] == [name for name, _ in variants]
    # each cell: time per layer (the fake timer's value over the step's layers) and the split bound in brackets
    assert rows[1].split("|")[2].strip().endswith(")") and "5.0 (" in rows[1]
    assert len(timed) == len(variants) * 2


def test_named_variant_sets_are_chosen_by_set(bench):
    assert bench.parse_args(["--variants", "--set", "write"]).variant_set == "write"
    assert bench.parse_args([]).variant_set is None
    assert set(bench.VARIANT_SETS) == {"write", "one-wave", "balance", "async", "int8", "int8-values", "lean"}
    assert bench.parse_args(["--variants", "--set", "async"]).variant_set == "async"
    assert bench.parse_args(["--variants", "--set", "lean"]).variant_set == "lean"
    assert all(set(kw) <= {"lean_tiles", "fused_update", "movmatrix", "int8_scores", "int8_values", "max_registers", "split_tokens"}
               for _, kw in bench.VARIANT_SETS["lean"])
    assert bench.parse_args(["--variants", "--set", "int8"]).variant_set == "int8"
    with pytest.raises(SystemExit):
        bench.parse_args(["--variants", "--set", "nope"])


def test_flat_variant_keywords_split_into_options_launch_and_plan_keywords(bench):
    """A variant's flat dict: DecodeOptions fields into ``options``, DecodeLaunch fields into ``launch``, the rest
    (DecodePlan's own) as they are; every variant of every set names only keywords DecodePlan takes."""
    kw = bench.plan_kwargs(dict(int8_scores=True, split_tokens=4096, block_n=64, merge_cols=32, min_programs=8))
    assert kw == dict(options=bench.DecodeOptions(int8_scores=True, split_tokens=4096),
                      launch=bench.DecodeLaunch(block_n=64, merge_cols=32), min_programs=8)
    assert bench.plan_kwargs({}) == {}
    for variants in [bench.STEP_VARIANTS, bench.STEP_VARIANTS_LONG_RECENT, *bench.VARIANT_SETS.values()]:
        for _, v in variants:
            assert set(bench.plan_kwargs(v)) <= {"options", "launch", "min_programs", "exact_splits", "balance",
                                                 "write_tuning", "fuse_q_rotation", "exact_rows_per_tile",
                                                 "exact_min_rows"}


def test_metadata_table_times_each_storage_on_the_same_shapes(bench, tmp_path, monkeypatch):
    """``--metadata``: each shape with every layer storage (the FP8 and the 4-bit ones' attention checked against
    its reference), the bytes read per token and head following the storage (4-bit codes double the code bytes,
    FP8 saves one byte of scale and one of zero); one row per shape and storage, ratios to the first, appended."""
    n2 = 2 * (300 - bench.BF16_TOKENS) * bench.HKV  # INT2 rows x heads of a 2 x 300 batch
    fp16 = bench.Int2Case(2, 300, torch.Generator().manual_seed(2))
    for dtype, widths, extra in (("fp8", (2, 2), -4), ("fp16", (4, 2), 32), ("fp8", (4, 4), 2 * 32 - 4)):
        case = bench.Int2Case(2, 300, torch.Generator().manual_seed(2), scale_dtype=dtype, widths=widths)
        assert (case.cache.k.bits, case.cache.v.bits) == widths and case.cache.fp8 == (dtype == "fp8")
        case.fn()()
        ref = decode_int2_ref(case.q, case.cache, case.plan.index, case.plan.sm_scale)
        assert ((case.out.float() - ref).norm() / ref.norm()) < 1e-2
        assert case.bytes_read() - fp16.bytes_read() == n2 * extra
    timed = []
    monkeypatch.setattr(bench, "graph_us", lambda fn: (timed.append(1), 10.0 * len(timed))[1])
    results = tmp_path / "RESULTS.md"
    storage = bench.STORAGE[:3]
    bench.metadata_table(torch.Generator().manual_seed(1), str(results), "abc1234", 1e12, shapes=[(1, 300), (2, 300)],
                         storage=storage)
    text = results.read_text()
    assert "## Decode attention by layer storage" in text and "commit abc1234" in text
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| bs")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [(s, label) for s in ("bs1/0k", "bs2/0k")
                                                           for label, _, _ in storage]
    assert len(timed) == 6 and rows[1][4].strip() == "2.000"  # the fake timer: 20 after the first's 10
    assert bench.parse_args(["--metadata"]).metadata
