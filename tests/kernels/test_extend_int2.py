"""extend_int2 against its fp32 reference and against Design P computed from each sequence's un-rotated history:
ragged chunks after ragged prefixes, left padding, GQA folded into M, window variants, tile skipping."""

import pytest
import torch
from int2_cache import DEVICE, ON_GPU, design_p_case_ref, extend_case, real_rows, rel_err
from oscar_kernels import extend_int2, extend_int2_ref
from oscar_kernels.extend import dequant_scratch, extend_int2_dequant

# (start, cached prefix c0, new tokens m): a prefill from scratch, a one-token step under left padding, a chunk
# after a prefix long enough to have INT2 tokens, sinks and a ring
SEQS = [(0, 0, 300), (5, 1000, 1), (0, 700, 129)] if ON_GPU else [(0, 0, 21), (2, 13, 1), (0, 30, 17)]
SINK, RECENT = (64, 256) if ON_GPU else (3, 8)
HKV = 4 if ON_GPU else 2
TOL = dict(atol=5e-2, rtol=5e-2) if ON_GPU else dict(atol=1e-4, rtol=1e-4)
MAX_REL = 1e-2 if ON_GPU else 1e-5
BLOCKS = dict(block_m=64, block_n=64) if ON_GPU else dict(block_m=64, block_n=16)  # several key tiles per list


PATHS = ["fused", "dequant", "dequant-1head"]
"""The fused kernel (INT2 tiles dequantised in registers), the dequantised-prefix path with every KV head in one pass,
and with one KV head per pass (several passes over the scratch)."""


def _extend(path, case, k_new=None, v_new=None, **kw):
    k_new = case.k_new if k_new is None else k_new
    v_new = case.v_new if v_new is None else v_new
    if path == "fused":
        return extend_int2(case.q, k_new, v_new, case.cache, case.index, **kw)
    blocks = {key: kw.pop(key) for key in ("block_m", "block_n") if key in kw}
    n_int2 = int(case.index.kv_indptr[-1])
    heads = 1 if path == "dequant-1head" else case.cache.kv_heads
    scratch = dequant_scratch(case.cache.kv_heads, case.cache.head_dim, max(n_int2, 1), DEVICE, heads=heads)
    for t in scratch:
        t.fill_(float("nan"))  # rows the path does not write must not be read
    return extend_int2_dequant(case.q, k_new, v_new, case.cache, case.index, scratch, n_int2, **blocks, **kw)


def _check(case, got, **kw):
    real = real_rows(case)
    ref = extend_int2_ref(case.q, case.k_new, case.v_new, case.cache, case.index, **kw)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[real].float(), ref[real], **TOL)
    assert rel_err(got[real], ref[real]) <= MAX_REL
    # the reference itself is Design P over the un-rotated history (only fp32 summation order differs: on a GPU the
    # 4k-key rows of the real sizes, on CPU the small ones)
    torch.testing.assert_close(ref[real], design_p_case_ref(case, kw.get("sm_scale"))[real],
                               **(dict(atol=1e-4, rtol=1e-4) if ON_GPU else dict(atol=1e-5, rtol=1e-5)))


# every GQA ratio, head dim and group at least twice, each (d, group) pair once or more (interpreter time)
SHAPES = [(1, 64, "row"), (1, 128, 32), (4, 64, 32), (4, 128, "row"), (8, 64, "row"), (8, 128, 32), (4, 32, "row"),
          (2, 32, 16)]


# both paths at every shape; the one-head passes (a loop over the scratch, whatever the shape) at three of them
EXTEND_CASES = [(*shape, path) for path in PATHS[:2] for shape in SHAPES] + \
    [(*shape, PATHS[2]) for shape in (SHAPES[0], SHAPES[5], SHAPES[7])]


@pytest.mark.parametrize("gqa,d,group,path", EXTEND_CASES)
def test_extend_matches_ref(gqa, d, group, path):
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(100 * gqa + d + g)
    case = extend_case(SEQS, SINK, RECENT, HKV, gqa, d, g, gen)
    out = torch.full(case.q.shape, float("nan"), device=DEVICE)  # fp32, poisoned
    got = _extend(path, case, out=out, **BLOCKS)
    assert got is out
    _check(case, out)


def _check_against_the_reference(path, case):
    """The path's output (fp32, poisoned first) against :func:`extend_int2_ref` on the real rows: the reference's
    dequantisation of the same bytes, whatever the storage (Design P describes 2-bit fp16 rows only)."""
    got = _extend(path, case, out=torch.full(case.q.shape, float("nan"), device=DEVICE), **BLOCKS)
    real = real_rows(case)
    ref = extend_int2_ref(case.q, case.k_new, case.v_new, case.cache, case.index)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[real].float(), ref[real], **TOL)
    assert rel_err(got[real], ref[real]) <= MAX_REL


@pytest.mark.parametrize("path", PATHS[:2])
@pytest.mark.parametrize("d,group", [(64, 32), (128, "row")])
def test_extend_fp8_metadata(path, d, group):
    """FP8 scales and zeros (e4m3 times a per-head multiplier of its own binade) through both paths: the INT2 rows
    the kernels read are the reference's dequantisation of the same bytes."""
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(7 + d + g)
    case = extend_case(SEQS, SINK, RECENT, HKV, 4, d, g, gen, fp8=True)
    assert case.cache.fp8 and case.cache.k.scale.dtype == torch.float8_e4m3fn
    _check_against_the_reference(path, case)


@pytest.mark.parametrize("path", PATHS[:2])
@pytest.mark.parametrize("d,group,bits", [(64, 32, (4, 2)), (128, "row", (2, 4)), (64, "row", (4, 4))])
def test_extend_four_bit_layers(path, d, group, bits):
    """4-bit keys and/or values (two code planes) through both paths, against the reference's dequantisation."""
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(11 + d + g + sum(bits))
    case = extend_case(SEQS, SINK, RECENT, HKV, 4, d, g, gen, bits=bits)
    assert (case.cache.k.bits, case.cache.v.bits) == bits
    _check_against_the_reference(path, case)


@pytest.mark.parametrize("path", PATHS[:2])
@pytest.mark.parametrize("sink,recent", [(0, 5), (4, 0), (0, 0), (2, 1), (6, 100)])
def test_extend_window_variants(sink, recent, path):
    """No sinks, no recent window (the query's own key through INT2), neither, a one-token window, a window longer
    than every sequence (everything exact)."""
    gen = torch.Generator().manual_seed(7 * sink + recent)
    case = extend_case(SEQS, sink, recent, HKV, 3, 64, 32, gen)
    out = torch.full(case.q.shape, float("nan"), device=DEVICE)
    got = _extend(path, case, out=out, **BLOCKS)
    _check(case, got)


@pytest.mark.parametrize("path", PATHS[:2])
def test_extend_skips_tiles_no_row_can_use(path):
    """Whole tiles of listed keys that no query of the block may read are skipped, not read: INT2 slots past
    ``t - recent`` and exact rows at gap positions are NaN here, so reading one poisons the output."""
    gen = torch.Generator().manual_seed(17)
    seqs = [(0, 40, 23), (3, 60, 5)] if not ON_GPU else [(0, 1200, 300), (3, 900, 64)]
    case = extend_case(seqs, SINK, RECENT, HKV, 4, 64, 64, gen, unused_tail=16 if not ON_GPU else 64)
    out = torch.full(case.q.shape, float("nan"), device=DEVICE)
    got = _extend(path, case, out=out, block_m=32, block_n=16)
    _check(case, got)


@pytest.mark.parametrize("path", PATHS[:2])
def test_extend_prerotated_kv_and_sm_scale(path):
    """``new_kv_rotated``: the chunk's rows are used as given (the bf16 rows quantize_pack stores)."""
    gen = torch.Generator().manual_seed(19)
    case = extend_case(SEQS, SINK, RECENT, HKV, 2, 64, 64, gen)
    c = case.cache
    kr = torch.einsum("nhd,hde->nhe", case.k_new.float(), c.rot_k).bfloat16()
    vr = torch.einsum("nhd,hde->nhe", case.v_new.float(), c.rot_v).bfloat16()
    got = _extend(path, case, kr, vr, sm_scale=0.05, new_kv_rotated=True, **BLOCKS)
    ref = extend_int2_ref(case.q, kr, vr, c, case.index, sm_scale=0.05, new_kv_rotated=True)
    real = real_rows(case)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()  # default out: q's dtype
    torch.testing.assert_close(got[real].float(), ref[real], atol=3e-2 if ON_GPU else 2e-2, rtol=1e-2)  # bf16 out
    torch.testing.assert_close(ref[real], design_p_case_ref(case, 0.05)[real], atol=1e-5, rtol=1e-5)


def test_extend_chunk_only_is_causal_attention():
    """With no cached tokens, everything exact and identity rotations the result is plain causal attention."""
    gen = torch.Generator().manual_seed(23)
    n, gqa = 21, 2
    case = extend_case([(0, 0, n)], 0, n, 2, gqa, 64, 64, gen)
    eye = torch.eye(64, device=DEVICE).expand(2, 64, 64).contiguous()
    c = case.cache
    cache = type(c)(c.k, c.v, c.k_bf16, c.v_bf16, eye, eye, c.clip_k, c.clip_v)
    q, k, v = case.q.float(), case.k_new.float(), case.v_new.float()
    got = extend_int2(q, k, v, cache, case.index, **BLOCKS)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(gqa, 1).transpose(0, 1), v.repeat_interleave(gqa, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=3e-2 if ON_GPU else 1e-5, rtol=1e-2 if ON_GPU else 1e-5)


def test_extend_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(29)
    case = extend_case([(0, 0, 4)], 1, 2, 2, 2, 64, 64, gen)
    with pytest.raises(ValueError, match="k_new"):
        extend_int2(case.q, case.k_new[:, :1], case.v_new, case.cache, case.index)
    with pytest.raises(ValueError, match="multiple"):
        extend_int2(case.q[:, :3], case.k_new, case.v_new, case.cache, case.index)


def test_extend_dequant_rejects_bad_scratch():
    gen = torch.Generator().manual_seed(31)
    case = extend_case([(0, 30, 4)], 1, 2, 2, 2, 64, 64, gen)
    n_int2 = int(case.index.kv_indptr[-1])
    args = (case.q, case.k_new, case.v_new, case.cache, case.index)
    good = dequant_scratch(2, 64, n_int2, DEVICE)
    with pytest.raises(ValueError, match="int2_tokens"):
        extend_int2_dequant(*args, good, n_int2 + 1)
    with pytest.raises(ValueError, match="scratch"):
        extend_int2_dequant(*args, dequant_scratch(2, 32, n_int2, DEVICE), n_int2)
    with pytest.raises(ValueError, match="scratch"):
        extend_int2_dequant(*args, (good[0], good[1][:, :-1]), n_int2)
    with pytest.raises(ValueError, match="heads per pass"):
        dequant_scratch(2, 64, 8, DEVICE, heads=3)
    assert dequant_scratch(8, 128, 131072, "cpu")[0].shape[0] == 2  # 128 MiB: two of Qwen3-8B's heads at 131k
