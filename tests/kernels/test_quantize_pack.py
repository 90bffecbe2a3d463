"""quantize_pack (kernel) and quantize_pack_ref (definition) against the format and against each other."""

import pytest
import torch
from int2_cache import DEVICE, ON_GPU, random_rotation
from oscar_kernels import Int2Pool, dequantize_ref, pack_ref, quantize_pack, quantize_pack_ref, unpack_ref

N_TOK = 1031 if ON_GPU else 37  # odd, spans several token blocks


def _pools(slots, hkv, d, g, gen, head_major=False):
    """Random codes and NaN scales/zeros: contiguous [S, Hkv, ...], or Int2Pool's head-major views."""
    if head_major:
        pool = Int2Pool.empty(slots, hkv, d, g, device=DEVICE)
        pool.codes.copy_(torch.randint(0, 256, (slots, hkv, d // 4), generator=gen, dtype=torch.uint8))
        pool.scale.fill_(float("nan"))
        pool.zero.fill_(float("nan"))
        return pool.codes, pool.scale, pool.zero
    codes = torch.randint(0, 256, (slots, hkv, d // 4), generator=gen, dtype=torch.uint8).to(DEVICE)
    scale = torch.full((slots, hkv, d // g), float("nan"), dtype=torch.float16, device=DEVICE)
    return codes, scale, torch.full_like(scale, float("nan"))


def _x(n, hkv, d, gen, dtype):
    outlier = 1.0 + 6.0 * (torch.rand(d, generator=gen) > 0.9).float()
    return (torch.randn(n, hkv, d, generator=gen) * outlier + 0.3).to(DEVICE, dtype)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", ["row", 32])
@pytest.mark.parametrize("ratio", [1.0, 0.85])
def test_ref_matches_oscar_cli_quantizer(d, group, ratio):
    """The kernel-side reference packs exactly what the pure-torch quantizer defines."""
    quantizer = pytest.importorskip("oscar_cli.quantizer")
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(d + g)
    hkv, n = 3, 29
    x = _x(n, hkv, d, gen, torch.float32)
    rot = random_rotation(hkv, d, gen)
    codes, scale, zero = _pools(n, hkv, d, g, gen)
    quantize_pack_ref(x, rot, ratio, codes, scale, zero, torch.arange(n, device=DEVICE), g)
    want = quantizer.quantize(torch.einsum("nhd,hde->nhe", x, rot), ratio, bits=2, group=g)
    assert torch.equal(codes, want.codes) and torch.equal(scale, want.scale) and torch.equal(zero, want.zero)


@pytest.mark.parametrize("g", [16, 64])
def test_ref_pack_unpack_and_error_bound(g):
    gen = torch.Generator().manual_seed(g)
    d, hkv, n, ratio = 64, 2, 53, 0.8
    c = torch.randint(0, 4, (n, hkv, d), generator=gen, dtype=torch.uint8)
    packed = pack_ref(c, g)
    assert packed.shape == (n, hkv, d // 4) and torch.equal(unpack_ref(packed, g), c)
    # bit positions: element k*g + j*B + b sits in byte k*B + b at shift 2j
    bq = g // 4
    for k, j, b in [(0, 0, 0), (0, 3, bq - 1), (d // g - 1, 2, 1)]:
        byte = packed[..., k * bq + b]
        assert torch.equal((byte >> (2 * j)) & 3, c[..., k * g + j * bq + b])

    x = _x(n, hkv, d, gen, torch.float32)
    codes, scale, zero = _pools(n, hkv, d, g, gen)
    quantize_pack_ref(x, None, ratio, codes, scale, zero, torch.arange(n, device=DEVICE), g)
    xh = dequantize_ref(codes, scale, zero, g).unflatten(-1, (-1, g))
    xg = x.float().unflatten(-1, (-1, g))
    mn, mx = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    lo = (mx + mn) / 2 - ratio * (mx - mn) / 2
    hi = (mx + mn) / 2 + ratio * (mx - mn) / 2
    s = scale.float().unsqueeze(-1)
    s_exact = (hi - lo) / 3
    bound = s / 2 + 3 * (s - s_exact).abs() + (zero.float().unsqueeze(-1) - lo).abs() + 1e-6
    err = (xh - torch.minimum(torch.maximum(xg, lo), hi)).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert (s / 2 < (hi - lo) / 5).all()  # the bound is not vacuous


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", ["row", 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_prerotated_is_bit_exact(d, group, dtype):
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(d * 7 + g)
    hkv, slots = 3, N_TOK + 11
    x = _x(N_TOK, hkv, d, gen, dtype)
    loc = torch.randperm(slots, generator=gen)[:N_TOK].to(DEVICE)  # int64, scattered
    got = _pools(slots, hkv, d, g, gen)
    want = tuple(t.clone() for t in got)
    quantize_pack(x, None, 0.9, *got, loc, g)
    quantize_pack_ref(x, None, 0.9, *want, loc, g)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0)))
    free = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    free[loc] = False
    assert torch.isfinite(got[1][loc]).all() and torch.isnan(got[1][free]).all()  # written / untouched


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", ["row", 32])
@pytest.mark.parametrize("shared_rot", [False, True])
def test_kernel_fused_rotation(d, group, shared_rot):
    """Fused rotation: fp32 sums in another order, so a rare code may move by one at a rounding boundary."""
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(d * 3 + g + shared_rot)
    hkv, slots = 4, N_TOK + 5
    x_full = _x(N_TOK, 2 * hkv, d, gen, torch.float16)
    x = x_full[:, ::2]  # non-contiguous heads
    rot = random_rotation(1 if shared_rot else hkv, d, gen)
    loc = torch.randperm(slots, generator=gen)[:N_TOK].to(DEVICE, torch.int32)
    got = _pools(slots, hkv, d, g, gen, head_major=True)
    assert got[0].stride(0) < got[0].stride(1)  # head-major storage
    want = tuple(t.clone() for t in got)
    quantize_pack(x, rot, 0.75, *got, loc, g)
    quantize_pack_ref(x, rot, 0.75, *want, loc, g)
    lo = loc.long()
    cg, cw = unpack_ref(got[0][lo], g).int(), unpack_ref(want[0][lo], g).int()
    assert (cg - cw).abs().max() <= 1 and (cg != cw).float().mean() < 2e-3
    torch.testing.assert_close(got[1][lo], want[1][lo], atol=1e-4, rtol=2e-3)  # ~1 fp16 ulp
    torch.testing.assert_close(got[2][lo], want[2][lo], atol=1e-4, rtol=2e-3)


def test_kernel_rejects_bad_args():
    gen = torch.Generator().manual_seed(0)
    x = _x(4, 2, 64, gen, torch.float32)
    codes, scale, zero = _pools(8, 2, 64, 64, gen)
    loc = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="clip_ratio"):
        quantize_pack(x, None, 1.5, codes, scale, zero, loc)
    with pytest.raises(ValueError, match="group_size"):
        quantize_pack(x, None, 1.0, codes, scale, zero, loc, group_size=24)
