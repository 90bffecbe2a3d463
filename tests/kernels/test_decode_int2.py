"""decode_int2 against its fp32 reference: GQA ratios, head dims, group sizes, ragged lengths, scattered slots."""

import importlib
import math

import pytest
import torch
from int2_cache import DEVICE, ON_GPU, make_cache, rel_err
from oscar_kernels import decode_int2, decode_int2_ref, decode_workspace

# interpreter: short ragged sequences (incl. an empty INT2 part and an empty BF16 part); GPU: long ones
INT2_LENS = [3000, 1, 777, 4093] if ON_GPU else [37, 0, 130, 1]
BF16_LENS = [68, 5, 0, 33] if ON_GPU else [5, 9, 0, 3]
HKV = 8 if ON_GPU else 2
# bf16 q with fp16/bf16 tensor-core dots vs fp32 dots in the interpreter
TOL = dict(atol=5e-2, rtol=5e-2) if ON_GPU else dict(atol=1e-4, rtol=1e-4)
MAX_REL = 1e-2 if ON_GPU else 1e-5
decode_module = importlib.import_module("oscar_kernels.decode_int2")  # the module, not the function


def _run(gqa, d, g, gen, num_splits=None, out=None, q_dtype=torch.bfloat16, shared_rot=False, sm_scale=None):
    cache = make_cache(INT2_LENS, BF16_LENS, HKV, d, g, gen, shared_rot=shared_rot)
    q = (torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen) * 2).to(DEVICE, q_dtype)
    got = decode_int2(q, *cache.args(), max_kv_len=max(INT2_LENS), group_size=g, sm_scale=sm_scale,
                      num_splits=num_splits, out=out)
    ref = decode_int2_ref(q, *cache.args(), group_size=g, sm_scale=sm_scale)
    return got, ref


@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", ["row", 32])
def test_decode_matches_ref(gqa, d, group):
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(1000 * gqa + d + g)
    out = torch.full((len(INT2_LENS), HKV * gqa, d), float("nan"), device=DEVICE)  # fp32 out, poisoned
    got, ref = _run(gqa, d, g, gen, num_splits=3, out=out)
    assert got is out and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)
    assert rel_err(out, ref) <= MAX_REL


def test_decode_default_out_dtype():
    gen = torch.Generator().manual_seed(5)
    got, ref = _run(4, 128, 128, gen)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # bf16 rounding of the output on top of the kernel's own error
    torch.testing.assert_close(got.float(), ref, **(dict(atol=6e-2, rtol=5e-2) if ON_GPU else dict(atol=3e-2, rtol=1e-2)))
    assert rel_err(got, ref) <= 1e-2


@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_splits_out_and_scale(num_splits):
    """Any split count gives the same answer; a caller-provided (strided, NaN-poisoned) out is fully written."""
    gen = torch.Generator().manual_seed(7 + (num_splits or 0))
    d, gqa = 64, 4
    big = torch.full((len(INT2_LENS), HKV * gqa, 2 * d), float("nan"), dtype=torch.float32, device=DEVICE)
    out = big[:, :, ::2]
    got, ref = _run(gqa, d, d, gen, num_splits=num_splits, out=out, q_dtype=torch.float16, shared_rot=True,
                    sm_scale=0.3 / math.sqrt(d))
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all() and torch.isnan(big[:, :, 1::2]).all()
    torch.testing.assert_close(out, ref, **TOL)


def test_decode_rejects_bad_shapes():
    gen = torch.Generator().manual_seed(3)
    cache = make_cache([4], [2], 2, 64, 64, gen)
    q = torch.randn(1, 3, 64, generator=gen).to(DEVICE)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple"):
        decode_int2(q, *cache.args(), max_kv_len=4)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replay():
    """Captured once for a length bound, replayed after the index lists change in place."""
    gen = torch.Generator().manual_seed(11)
    d, gqa, splits = 128, 4, 8
    cache = make_cache(INT2_LENS, BF16_LENS, HKV, d, d, gen)
    q = torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.empty_like(q)
    ws = decode_workspace(q.shape[0], q.shape[1], d, splits, DEVICE)
    decode_int2(q, *cache.args(), max_kv_len=max(INT2_LENS), num_splits=splits, out=out, workspace=ws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_int2(q, *cache.args(), max_kv_len=max(INT2_LENS), num_splits=splits, out=out, workspace=ws)
    # shorten every sequence by 10 tokens (in place), keep capacity
    lens = (cache.kv_indptr[1:] - cache.kv_indptr[:-1] - 10).clamp_min(0)
    new_indptr = torch.zeros_like(cache.kv_indptr)
    new_indptr[1:] = lens.cumsum(0)
    new_indices = torch.cat([cache.kv_indices[cache.kv_indptr[b]: cache.kv_indptr[b] + lens[b]] for b in range(len(lens))])
    cache.kv_indptr.copy_(new_indptr)
    cache.kv_indices[: new_indices.numel()].copy_(new_indices)
    out.fill_(float("nan"))
    graph.replay()
    ref = decode_int2_ref(q, *cache.args())
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
        monkeypatch.setattr(decode_module, "_max_offset", lambda *ts: 2**31)
    gen = torch.Generator().manual_seed(29)
    d, gqa = 128, 4
    cache = make_cache(INT2_LENS, BF16_LENS, HKV, d, d, gen, head_major=not path.endswith("slot-major"))
    assert (cache.k_codes.stride(0) > cache.k_codes.stride(1)) == path.endswith("slot-major")
    q = torch.randn(len(INT2_LENS), HKV * gqa, d, generator=gen).to(DEVICE, torch.bfloat16)
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    decode_int2(q, *cache.args(), max_kv_len=max(INT2_LENS), out=out, row_kernel=path.startswith("rows"),
                ptx_unpack=path == "general-ptx", num_splits=1 if path == "rows-one-split" else None)
    ref = decode_int2_ref(q, *cache.args())
    torch.testing.assert_close(out, ref, **TOL)
    assert rel_err(out, ref) <= MAX_REL


def test_decode_row_kernel_needs_row_scales():
    gen = torch.Generator().manual_seed(31)
    cache = make_cache([4], [2], 2, 128, 32, gen)
    q = torch.randn(1, 4, 128, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="row_kernel"):
        decode_int2(q, *cache.args(), max_kv_len=4, group_size=32, row_kernel=True)


def test_decode_odd_strided_pools_take_the_general_path():
    """Code pools that cannot be read as int16 words (odd row stride) fall back to the general path, still exact;
    asking for the row kernel on them is refused."""
    gen = torch.Generator().manual_seed(37)
    d, gqa = 128, 2
    cache = make_cache([9, 40], [3, 0], 2, d, d, gen)
    for name in ("k_codes", "v_codes"):
        c = getattr(cache, name)
        wide = torch.zeros(c.shape[0], c.shape[1], c.shape[2] + 1, dtype=torch.uint8, device=DEVICE)
        wide[..., :-1] = c
        setattr(cache, name, wide[..., :-1])  # row stride d/4 + 1: odd
    q = torch.randn(2, 2 * gqa, d, generator=gen).to(DEVICE)
    out = decode_int2(q, *cache.args(), max_kv_len=40)
    assert rel_err(out, decode_int2_ref(q, *cache.args())) <= MAX_REL
    with pytest.raises(ValueError, match="row_kernel"):
        decode_int2(q, *cache.args(), max_kv_len=40, row_kernel=True)
