"""extend_int2 against its fp32 reference: causal chunk + INT2 prefix + BF16 segment, ragged and scattered."""

import pytest
import torch
from int2_cache import DEVICE, ON_GPU, make_cache, rel_err
from oscar_kernels import extend_int2, extend_int2_ref

NEW_LENS = [130, 1, 67] if ON_GPU else [9, 1, 20]
INT2_LENS = [1500, 0, 333] if ON_GPU else [13, 0, 21]
BF16_LENS = [36, 7, 0] if ON_GPU else [4, 3, 0]
HKV = 4 if ON_GPU else 2
TOL = dict(atol=5e-2, rtol=5e-2) if ON_GPU else dict(atol=1e-4, rtol=1e-4)
MAX_REL = 1e-2 if ON_GPU else 1e-5
BLOCKS = dict(block_m=64, block_n=64) if ON_GPU else dict(block_m=32, block_n=32)  # few interpreted programs


def _indptr(lens):
    p = torch.zeros(len(lens) + 1, dtype=torch.int32)
    p[1:] = torch.tensor(lens).cumsum(0)
    return p.to(DEVICE)


@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", ["row", 32])
def test_extend_matches_ref(gqa, d, group):
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(100 * gqa + d + g)
    cache = make_cache(INT2_LENS, BF16_LENS, HKV, d, g, gen)
    n = sum(NEW_LENS)
    q = (torch.randn(n, HKV * gqa, d, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    k = torch.randn(n, HKV, d, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(n, HKV, d, generator=gen).to(DEVICE, torch.bfloat16)
    qo = _indptr(NEW_LENS)
    out = torch.full(q.shape, float("nan"), device=DEVICE)  # fp32, poisoned
    got = extend_int2(q, k, v, qo, max(NEW_LENS), *cache.args(), group_size=g, out=out, **BLOCKS)
    ref = extend_int2_ref(q, k, v, qo, *cache.args(), group_size=g)
    assert got is out and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL)
    assert rel_err(out, ref) <= MAX_REL


def test_extend_prerotated_kv_and_default_out():
    gen = torch.Generator().manual_seed(17)
    d, gqa = 64, 4
    cache = make_cache(INT2_LENS, BF16_LENS, HKV, d, d, gen, shared_rot=True)
    n = sum(NEW_LENS)
    q = torch.randn(n, HKV * gqa, d, generator=gen).to(DEVICE, torch.float16)
    k = torch.randn(n, HKV, d, generator=gen).to(DEVICE)
    v = torch.randn(n, HKV, d, generator=gen).to(DEVICE)
    qo = _indptr(NEW_LENS)
    got = extend_int2(q, k, v, qo, max(NEW_LENS), *cache.args(), sm_scale=0.05, new_kv_rotated=True, **BLOCKS)
    ref = extend_int2_ref(q, k, v, qo, *cache.args(), sm_scale=0.05, new_kv_rotated=True)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref, atol=3e-2 if ON_GPU else 2e-3, rtol=1e-2)


def test_extend_chunk_only_is_causal_attention():
    """With no cached tokens and identity rotations the result is plain causal softmax attention."""
    gen = torch.Generator().manual_seed(23)
    d, hkv, gqa, n = 64, 2, 2, 21
    cache = make_cache([0], [0], hkv, d, d, gen)
    eye = torch.eye(d, device=DEVICE).expand(hkv, d, d).contiguous()
    cache.rot_k, cache.rot_v = eye, eye
    q = torch.randn(n, hkv * gqa, d, generator=gen).to(DEVICE)
    k = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    got = extend_int2(q, k, v, _indptr([n]), n, *cache.args(), **BLOCKS)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(gqa, 1).transpose(0, 1), v.repeat_interleave(gqa, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=3e-2 if ON_GPU else 1e-5, rtol=1e-2 if ON_GPU else 1e-5)
