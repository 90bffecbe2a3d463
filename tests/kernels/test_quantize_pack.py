"""quantize_pack (kernel) and quantize_pack_ref (definition) against the format and against each other: bit-exact
packing, fused rotation, per-KV-head clip tensors in one launch, the exact-row output, the INT2-store skip."""

import pytest
import torch
from int2_cache import DEVICE, ON_GPU, random_rotation
from oscar_kernels import Int2Pool, dequantize_ref, quantize_pack, quantize_pack_ref, unpack

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


@pytest.mark.parametrize("d", [32, 64, 128])
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
def test_ref_error_bound(g):
    gen = torch.Generator().manual_seed(g)
    d, hkv, n, ratio = 64, 2, 53, 0.8
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


# every head dim with both groups, each head dim and each group with both input dtypes (not the full product: on a GPU
# every case compiles its own kernel)
PREROTATED = [(32, "row", torch.bfloat16), (32, 32, torch.float32), (64, "row", torch.float32),
              (64, 32, torch.bfloat16), (128, "row", torch.bfloat16), (128, 32, torch.float32)]


@pytest.mark.parametrize("d,group,dtype", PREROTATED)
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


def test_scale_is_one_rounded_division():
    """``scale = fp16((hi - lo) / 3)`` with the quotient rounded once, in the kernel and in the reference, on any device
    (torch on CUDA computes ``tensor / 3`` as ``tensor * fp32(1/3)``): a group whose ``(hi - lo) / 3`` lies just
    below an fp16 rounding boundary, where the reciprocal's product rounds to the fp16 step above."""
    w = 13.001952171325684  # an fp32 value: w / 3 = 4.3339840..., fp16's boundary 4.333984375 two thirds of an fp32 ulp up
    exact = (torch.tensor(w) / torch.tensor(3.0)).half()
    assert exact != (torch.tensor(w) * torch.tensor(1 / 3)).half()  # the case tells the two apart
    d = 32
    x = torch.zeros(1, 1, d)
    x[0, 0, 5] = w  # one group: min 0, max w, so lo = 0 and hi = w exactly at clip 1
    x = x.to(DEVICE)
    loc = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    got = _pools(1, 1, d, d, torch.Generator().manual_seed(0))
    want = tuple(t.clone() for t in got)
    quantize_pack(x, None, 1.0, *got, loc, d)
    quantize_pack_ref(x, None, 1.0, *want, loc, d)
    assert got[1].item() == want[1].item() == exact.item()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("group", ["row", 32])
@pytest.mark.parametrize("path", ["dot", "fma", "fma-all-rows"])
def test_kernel_fused_rotation(d, group, path):
    """Fused rotation, through tensor-core dots or (``rot_precision="fma"``, few tokens per program) CUDA-core
    multiply-adds, 32 rows of the rotation per step or (``rot_rows=0``, four warps) all of them at once at these
    head dims: fp32 sums in another order, so a rare code may move by one at a rounding boundary. One rotation shared
    by the heads or one per head, alternating so that every head dim, group and path meets both."""
    g = d if group == "row" else group
    shared_rot = (d // 32 + (group == "row") + ["dot", "fma", "fma-all-rows"].index(path)) % 2 == 1
    gen = torch.Generator().manual_seed(d * 3 + g + shared_rot)
    hkv, slots = 4, N_TOK + 5
    x_full = _x(N_TOK, 2 * hkv, d, gen, torch.float16)
    x = x_full[:, ::2]  # non-contiguous heads
    rot = random_rotation(1 if shared_rot else hkv, d, gen)
    loc = torch.randperm(slots, generator=gen)[:N_TOK].to(DEVICE, torch.int32)
    got = _pools(slots, hkv, d, g, gen, head_major=True)
    assert got[0].stride(0) < got[0].stride(1)  # head-major storage
    want = tuple(t.clone() for t in got)
    kw = {"dot": {}, "fma": dict(rot_precision="fma", block_n=4),
          "fma-all-rows": dict(rot_precision="fma", block_n=4, num_warps=4, rot_rows=0)}[path]
    quantize_pack(x, rot, 0.75, *got, loc, g, **kw)
    quantize_pack_ref(x, rot, 0.75, *want, loc, g)
    lo = loc.long()
    cg, cw = unpack(got[0][lo], 2, g).int(), unpack(want[0][lo], 2, g).int()
    assert (cg - cw).abs().max() <= 1 and (cg != cw).float().mean() < 2e-3
    torch.testing.assert_close(got[1][lo], want[1][lo], atol=1e-4, rtol=2e-3)  # ~1 fp16 ulp
    torch.testing.assert_close(got[2][lo], want[2][lo], atol=1e-4, rtol=2e-3)


def _fp8_pools(slots, hkv, d, g, mult):
    pool = Int2Pool.empty(slots, hkv, d, g, device=DEVICE, mult=mult)
    pool.codes.zero_()
    pool.scale.fill_(float("nan"))
    pool.zero.fill_(float("nan"))
    return pool


@pytest.mark.parametrize("d,group", [(64, 32), (128, "row")])
def test_kernel_fp8_metadata_is_bit_exact(d, group):
    """FP8 scales and zeros: the kernel stores the reference's bytes (its own round-to-nearest-even onto e4m3's grid,
    so also where the backend's fp32 -> e4m3 conversion rounds otherwise), for heads whose multipliers put their
    values near e4m3's top (saturating at 448), in its normal range and among its subnormals, rotated in the kernel
    (codes within the rotation's rounding) and pre-rotated (bit for bit); the pure-torch quantizer agrees."""
    quantizer = pytest.importorskip("oscar_cli.quantizer")
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(d + g + 8)
    hkv, slots = 3, N_TOK + 9
    x = _x(N_TOK, hkv, d, gen, torch.float32) * torch.tensor([1.0, 40.0, 0.0005], device=DEVICE).view(1, hkv, 1)
    mult = torch.tensor([2.0 ** -8, 2.0 ** -3, 1.0], device=DEVICE)
    loc = torch.randperm(slots, generator=gen)[:N_TOK].to(DEVICE)
    clip = torch.tensor([0.9, 0.8, 1.0], device=DEVICE)
    got, want = _fp8_pools(slots, hkv, d, g, mult), _fp8_pools(slots, hkv, d, g, mult)
    quantize_pack(x, None, clip, got.codes, got.scale, got.zero, loc, g, mult=mult)
    quantize_pack_ref(x, None, clip, want.codes, want.scale, want.zero, loc, g, mult=mult)
    lo = loc.long()
    assert torch.equal(got.codes, want.codes)
    for a, b in ((got.scale, want.scale), (got.zero, want.zero)):
        assert torch.equal(a[lo].view(torch.uint8), b[lo].view(torch.uint8))
    assert got.scale[lo].float().max() == 448.0 and (got.scale[lo].float() < 2.0 ** -6).any()  # both ends
    ref = quantizer.quantize(x[lo.argsort()], clip.view(hkv, 1), bits=2, group=g, meta="fp8",
                             mult=mult.view(hkv, 1))  # rows in slot order
    assert torch.equal(ref.codes, got.codes[lo.sort().values])
    rot = random_rotation(hkv, d, gen)
    fused = _fp8_pools(slots, hkv, d, g, mult)
    quantize_pack(x, rot, clip, fused.codes, fused.scale, fused.zero, loc, g, mult=mult)
    quantize_pack_ref(x, rot, clip, want.codes, want.scale, want.zero, loc, g, mult=mult)
    cg, cw = unpack(fused.codes[lo], 2, g).int(), unpack(want.codes[lo], 2, g).int()
    assert (cg - cw).abs().max() <= 1 and (cg != cw).float().mean() < 2e-3
    torch.testing.assert_close(fused.dequantize(lo), want.dequantize(lo), atol=0.1, rtol=0.1)


@pytest.mark.parametrize("d,group,fp8", [(64, 32, False), (128, "row", True)])
def test_kernel_four_bit_codes_are_bit_exact(d, group, fp8):
    """4-bit codes as two 2-bit planes (low plane in ``codes``, high in ``codes_hi``): the kernel writes the
    reference's bytes pre-rotated (codes within the rotation's rounding when it rotates), with fp16 or FP8
    scales; the pure-torch quantizer's 4-bit codes are the same codes; the ``Int2Pool`` path of
    ``quantize_pack_kv`` (K 4-bit, V 2-bit: two launches) writes what two single writes do."""
    quantizer = pytest.importorskip("oscar_cli.quantizer")
    from oscar_kernels import quantize_pack_kv

    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(d + g + 4)
    hkv, slots = 2, N_TOK + 5
    x = _x(N_TOK, hkv, d, gen, torch.float32)
    mult = torch.tensor([2.0 ** -5, 2.0 ** -4], device=DEVICE) if fp8 else None
    loc = torch.randperm(slots, generator=gen)[:N_TOK].to(DEVICE)
    clip = torch.tensor([1.0, 0.95], device=DEVICE)
    pools = [Int2Pool.empty(slots, hkv, d, g, device=DEVICE, mult=mult, bits=4) for _ in range(3)]
    for p in pools:
        p.codes.zero_()
        p.codes_hi.zero_()
    got, want, fused = pools
    quantize_pack(x, None, clip, got.codes, got.scale, got.zero, loc, g, mult=mult, codes_hi=got.codes_hi)
    quantize_pack_ref(x, None, clip, want.codes, want.scale, want.zero, loc, g, mult=mult, codes_hi=want.codes_hi)
    lo = loc.long()
    assert torch.equal(got.codes, want.codes) and torch.equal(got.codes_hi, want.codes_hi)
    view = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    assert torch.equal(view(got.scale[lo]), view(want.scale[lo])) and torch.equal(view(got.zero[lo]), view(want.zero[lo]))
    codes = got.code_values(lo)
    assert codes.max() == 15 and codes.min() == 0 and (codes > 3).float().mean() > 0.5  # both planes used
    order = lo.argsort()
    ref = quantizer.quantize(x[order], clip.view(hkv, 1), bits=4, group=g, meta="fp8" if fp8 else "fp16",
                             mult=None if mult is None else mult.view(hkv, 1))
    assert torch.equal(unpack(ref.codes, 4, g).float(), codes[order])
    rot = random_rotation(hkv, d, gen)
    v_pool = Int2Pool.empty(slots, hkv, d, g, device=DEVICE, mult=mult)
    quantize_pack_kv(x, x, rot, rot, clip, clip, fused, v_pool, loc, g)
    quantize_pack_ref(x, rot, clip, want.codes, want.scale, want.zero, loc, g, mult=mult, codes_hi=want.codes_hi)
    cg, cw = fused.code_values(lo), want.code_values(lo)
    assert (cg - cw).abs().max() <= 1 and (cg != cw).float().mean() < 2e-3
    assert v_pool.bits == 2 and v_pool.code_values(lo).max() == 3


def test_kernel_rejects_bad_args():
    gen = torch.Generator().manual_seed(0)
    x = _x(4, 2, 64, gen, torch.float32)
    codes, scale, zero = _pools(8, 2, 64, 64, gen)
    loc = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="clip_ratio"):
        quantize_pack(x, None, 1.5, codes, scale, zero, loc)
    with pytest.raises(ValueError, match="group_size"):
        quantize_pack(x, None, 1.0, codes, scale, zero, loc, group_size=24)
    clip = torch.tensor([0.9, 1.2], device=DEVICE)  # per-head ratios are the caller's business, shape is checked
    with pytest.raises(ValueError, match="clip"):
        quantize_pack(x, None, clip.double(), codes, scale, zero, loc)
    with pytest.raises(ValueError, match="bf16_loc"):
        quantize_pack(x, None, 1.0, codes, scale, zero, loc, bf16_out=torch.empty(8, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="nothing to store"):
        quantize_pack(x, None, 1.0, None, None, None, None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):  # a multiplier with fp16 pools
        quantize_pack(x, None, 1.0, codes, scale, zero, loc, mult=torch.ones(2, device=DEVICE))
    fp8 = _fp8_pools(8, 2, 64, 64, torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="mult must be an fp32"):
        quantize_pack(x, None, 1.0, fp8.codes, fp8.scale, fp8.zero, loc, mult=torch.ones(3, device=DEVICE))


def _equal(a, b):
    """Bitwise equality with NaN == NaN (poisoned slots the kernel must leave alone)."""
    return torch.equal(a.float().nan_to_num(-7.0), b.float().nan_to_num(-7.0))


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("group", ["row", 32])
def test_per_head_clip_tensor_is_one_launch_per_head_loop(rotate, group):
    """A per-KV-head fp32 clip tensor in one launch == one launch per head with its float ratio (and == the ref)."""
    d, hkv = 64, 4
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(61 + rotate + g)
    slots = N_TOK + 9
    x = _x(N_TOK, hkv, d, gen, torch.bfloat16)
    rot = random_rotation(hkv, d, gen) if rotate else None
    clip = torch.tensor([0.7, 1.0, 0.85, 0.55], device=DEVICE)
    loc = torch.randperm(slots, generator=gen)[:N_TOK].to(DEVICE, torch.int32)
    one = _pools(slots, hkv, d, g, gen, head_major=True)
    per_head = tuple(t.clone() for t in one)
    ref = tuple(t.clone() for t in one)
    quantize_pack(x, rot, clip, *one, loc, g)
    for h in range(hkv):
        sl = slice(h, h + 1)
        quantize_pack(x[:, sl], None if rot is None else rot[sl], float(clip[h]), *(t[:, sl] for t in per_head), loc, g)
    quantize_pack_ref(x, rot, clip, *ref, loc, g)
    for a, b in zip(one, per_head, strict=True):
        assert _equal(a, b)
    if not rotate:  # bit exact against the definition
        for a, b in zip(one, ref, strict=True):
            assert _equal(a, b)
    # the clip really differs per head: head 3 (0.55) has a smaller scale than it would at 1.0
    full = _pools(slots, hkv, d, g, gen, head_major=True)
    quantize_pack_ref(x, rot, 1.0, *full, loc, g)
    lo = loc.long()
    assert (one[1][lo, 3].float() < full[1][lo, 3].float()).all()
    assert torch.equal(one[1][lo, 1], full[1][lo, 1])


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("store_codes", [True, False])
def test_bf16_rows_at_a_second_index_list(rotate, store_codes):
    """``bf16_out[bf16_loc[n]] = bf16(x[n] @ R)`` where ``bf16_loc[n] >= 0``, nothing else touched; without codes the
    INT2 pools stay untouched."""
    d, hkv, g = 128, 2, 32
    gen = torch.Generator().manual_seed(71 + 2 * rotate + store_codes)
    slots, rows = N_TOK + 3, N_TOK + 20
    x = _x(N_TOK, hkv, d, gen, torch.float32)
    rot = random_rotation(1, d, gen) if rotate else None
    loc = torch.randperm(slots, generator=gen)[:N_TOK].to(DEVICE)
    bloc = torch.randperm(rows, generator=gen)[:N_TOK].to(DEVICE, torch.int32)
    bloc[::4] = -1  # skipped
    pools = _pools(slots, hkv, d, g, gen, head_major=True)
    before = tuple(t.clone() for t in pools)
    want_pools = tuple(t.clone() for t in pools)
    out = torch.full((rows, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    want = out.clone()
    args = (*pools, loc) if store_codes else (None, None, None, None)
    quantize_pack(x, rot, 0.8, *args, g, bf16_out=out, bf16_loc=bloc)
    quantize_pack_ref(x, rot, 0.8, *((*want_pools, loc) if store_codes else (None, None, None, None)), g,
                      bf16_out=want, bf16_loc=bloc)
    written = torch.zeros(rows, dtype=torch.bool, device=DEVICE)
    written[bloc[bloc >= 0].long()] = True
    assert torch.isfinite(out[written]).all() and torch.isnan(out[~written]).all()
    if rotate:  # fp32 sums in another order: a rare element may round to the neighbouring bf16 value
        torch.testing.assert_close(out[written].float(), want[written].float(), atol=1e-5, rtol=8e-3)
        assert (out[written] != want[written]).float().mean() < 1e-3
        exact = torch.einsum("nhd,hde->nhe", x, rot.expand(hkv, d, d))
        keep = bloc >= 0
        torch.testing.assert_close(out[bloc[keep].long()].float(), exact[keep], atol=1e-6, rtol=8e-3)
    else:
        keep = bloc >= 0
        assert torch.equal(out[written], want[written]) and torch.equal(out[bloc[keep].long()], x[keep].bfloat16())
    if store_codes:
        if not rotate:
            for a, b in zip(pools, want_pools, strict=True):
                assert _equal(a, b)
        assert torch.isfinite(pools[1][loc]).all()
    else:
        for a, b in zip(pools, before, strict=True):
            assert _equal(a, b)


@pytest.mark.parametrize("d,group,rotate", [(64, 32, False), (128, "row", True)])
def test_kernel_centered_rows(d, group, rotate):
    """Key centering: every stored row is ``x @ R - c[h]`` (codes, scales and the exact row); pre-rotated rows are
    bit-exact against the definition, and a centered write of ``x`` equals an uncentered write of ``x - c R^T``."""
    g = d if group == "row" else group
    gen = torch.Generator().manual_seed(d + 17 * rotate)
    hkv, slots, rows = 3, N_TOK + 4, N_TOK + 2
    x = _x(N_TOK, hkv, d, gen, torch.float32)
    rot = random_rotation(hkv, d, gen) if rotate else None
    center = (torch.randn(hkv, d, generator=gen) * 2 + 1).to(DEVICE)
    loc = torch.randperm(slots, generator=gen)[:N_TOK].to(DEVICE)
    bloc = torch.randperm(rows, generator=gen)[:N_TOK].to(DEVICE)
    bloc[::4] = -1
    got = _pools(slots, hkv, d, g, gen)
    want = tuple(t.clone() for t in got)
    out = torch.full((rows, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    want_out = out.clone()
    quantize_pack(x, rot, 0.9, *got, loc, g, bf16_out=out, bf16_loc=bloc, center=center)
    quantize_pack_ref(x, rot, 0.9, *want, loc, g, bf16_out=want_out, bf16_loc=bloc, center=center)
    lo, kept = loc.long(), bloc[bloc >= 0].long()
    if rotate:  # fused rotation: fp32 sums in another order
        cg, cw = unpack(got[0][lo], 2, g).int(), unpack(want[0][lo], 2, g).int()
        assert (cg - cw).abs().max() <= 1 and (cg != cw).float().mean() < 2e-3
        torch.testing.assert_close(got[1][lo], want[1][lo], atol=1e-4, rtol=2e-3)
        torch.testing.assert_close(out[kept].float(), want_out[kept].float(), atol=2e-2, rtol=1e-2)
    else:
        for a, b in zip((*got, out), (*want, want_out), strict=True):
            assert torch.equal(a.nan_to_num(-7.0) if a.is_floating_point() else a,
                               b.nan_to_num(-7.0) if b.is_floating_point() else b)
    # the center is really applied: the same write uncentered of the shifted rows stores the same rows
    shifted = tuple(t.clone() for t in want)
    r = torch.eye(d, device=DEVICE).expand(hkv, d, d) if rot is None else rot.to(DEVICE)
    quantize_pack_ref(x - torch.einsum("he,hde->hd", center, r)[None], rot, 0.9, *shifted, loc, g)
    a, b = dequantize_ref(*(t[lo] for t in shifted), g), dequantize_ref(*(t[lo] for t in want), g)
    assert (a - b).abs().mean() < 1e-3 * b.abs().mean()  # fp32 rounding may move a rare code at a boundary
    with pytest.raises(ValueError, match="center must be an fp32"):
        quantize_pack(x, rot, 0.9, *got, loc, g, center=center[:, :-1])


@pytest.mark.parametrize("case", ["same", "mixed", "centered"])
def test_kv_pair_is_two_single_launches(case, monkeypatch):
    """``quantize_pack_kv`` writes exactly what ``quantize_pack`` of K and then of V writes: in one launch when both
    compile alike ("same": rotated, per-head clips, codes and exact rows; "centered": keys centered as well), in two
    when they differ ("mixed": V pre-rotated with a scalar clip)."""
    from oscar_kernels import quantize_pack_kv, write

    d, hkv, g = 64, 2, 32
    gen = torch.Generator().manual_seed(91 + (case == "mixed"))
    slots, rows = N_TOK + 5, N_TOK + 9
    k, v = _x(N_TOK, hkv, d, gen, torch.bfloat16), _x(N_TOK, hkv, d, gen, torch.bfloat16)
    rk, rv = random_rotation(hkv, d, gen), random_rotation(hkv, d, gen)
    ck, cv = torch.tensor([0.9, 0.7], device=DEVICE), torch.tensor([0.8, 1.0], device=DEVICE)
    if case == "mixed":
        rv, cv = None, 0.85
    center = torch.randn(hkv, d, generator=gen).to(DEVICE) if case == "centered" else None
    loc = torch.randperm(slots, generator=gen)[:N_TOK].to(DEVICE)
    bloc = torch.randperm(rows, generator=gen)[:N_TOK].to(DEVICE, torch.int32)
    bloc[1::3] = -1
    pools = [_pools(slots, hkv, d, g, gen) for _ in range(2)]
    want = [tuple(t.clone() for t in p) for p in pools]
    out = [torch.full((rows, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    want_out = [t.clone() for t in out]
    launches = []
    real = write._launch
    monkeypatch.setattr(write, "_launch", lambda *a, **kw: (launches.append(1), real(*a, **kw)))
    quantize_pack_kv(k, v, rk, rv, ck, cv, pools[0], pools[1], loc, g, bf16_out=tuple(out), bf16_loc=bloc,
                     center_k=center)
    assert len(launches) == (2 if case == "mixed" else 1)
    quantize_pack(k, rk, ck, *want[0], loc, g, bf16_out=want_out[0], bf16_loc=bloc, center=center)
    quantize_pack(v, rv, cv, *want[1], loc, g, bf16_out=want_out[1], bf16_loc=bloc)
    for got, exp in zip([*pools[0], *pools[1], *out], [*want[0], *want[1], *want_out], strict=True):
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.uint8 else got,
                           exp.view(torch.uint8) if exp.dtype != torch.uint8 else exp)  # NaNs compared as bytes
    with pytest.raises(ValueError, match="same shape"):
        quantize_pack_kv(k, v[:-1], rk, rv, ck, cv, pools[0], pools[1], loc, g)


def test_unknown_rotation_precision_is_refused():
    d, hkv = 64, 2
    gen = torch.Generator().manual_seed(5)
    x = _x(3, hkv, d, gen, torch.float32)
    codes, scale, zero = _pools(4, hkv, d, d, gen)
    with pytest.raises(ValueError, match="rot_precision must be tf32x3, tf32, ieee or fma"):
        quantize_pack(x, random_rotation(hkv, d, gen), 1.0, codes, scale, zero,
                      torch.arange(3, device=DEVICE), rot_precision="bf16")
    for bad in (-1, 48, True):
        with pytest.raises(ValueError, match="rot_rows must be 0 \\(fma_rot_rows\\) or a power of two"):
            quantize_pack(x, random_rotation(hkv, d, gen), 1.0, codes, scale, zero,
                          torch.arange(3, device=DEVICE), rot_precision="fma", rot_rows=bad)



@pytest.mark.parametrize("case", ["same", "mixed", "shared-rot", "all-rows"])
def test_kv_write_rotates_the_queries_in_the_same_launch(case):
    """With ``q``, ``quantize_pack_kv`` also writes ``q @ rot_k[h // gqa] * q_scale`` in fp32 (``rotate_q_ref``) into
    a NaN-poisoned strided ``q_out``, every element and nothing else, and the K/V writes are unchanged ("mixed": K and
    V compile apart, the queries ride on the K launch; "shared-rot": one rotation for every head; "all-rows": the
    whole rotation loaded at once by four warps per program)."""
    from oscar_kernels import quantize_pack_kv
    from oscar_kernels.write import rotate_q_ref

    d, hkv, gqa, g = 64, 2, 3, 64
    gen = torch.Generator().manual_seed(131 + len(case))
    n, slots = 5, 11
    k, v = _x(n, hkv, d, gen, torch.bfloat16), _x(n, hkv, d, gen, torch.bfloat16)
    q = _x(n, hkv * gqa, d, gen, torch.bfloat16)
    rk, rv = random_rotation(1 if case == "shared-rot" else hkv, d, gen), random_rotation(hkv, d, gen)
    ck, cv = torch.tensor([0.9, 0.7], device=DEVICE), (0.85 if case == "mixed" else torch.tensor([0.8, 1.0],
                                                                                                    device=DEVICE))
    loc = torch.randperm(slots, generator=gen)[:n].to(DEVICE)
    pools = [_pools(slots, hkv, d, g, gen) for _ in range(2)]
    want = [tuple(t.clone() for t in p) for p in pools]
    big = torch.full((n, hkv * gqa, 2 * d), float("nan"), device=DEVICE)
    q_out = big[:, :, :d]
    rows = dict(num_warps=4, rot_rows=d) if case == "all-rows" else dict(num_warps=1)
    quantize_pack_kv(k, v, rk, rv, ck, cv, pools[0], pools[1], loc, g, q=q, q_out=q_out, q_scale=0.37,
                     block_n=1, rot_precision="fma", **rows)
    quantize_pack(k, rk, ck, *want[0], loc, g)
    quantize_pack(v, rv, cv, *want[1], loc, g)
    for got, exp in zip([*pools[0], *pools[1]], [*want[0], *want[1]], strict=True):
        assert torch.equal(got.view(torch.uint8) if got.dtype != torch.uint8 else got,
                           exp.view(torch.uint8) if exp.dtype != torch.uint8 else exp)
    assert torch.isfinite(q_out).all() and torch.isnan(big[:, :, d:]).all()
    ref = rotate_q_ref(q, rk, 0.37)
    torch.testing.assert_close(q_out, ref, **(dict(atol=1e-4, rtol=1e-4) if ON_GPU else dict(atol=1e-5, rtol=1e-5)))
    with pytest.raises(ValueError, match="q_out must be fp32"):
        quantize_pack_kv(k, v, rk, rv, ck, cv, pools[0], pools[1], loc, g, q=q, q_out=q_out.bfloat16())
    with pytest.raises(ValueError, match="q must be"):
        quantize_pack_kv(k, v, rk, rv, ck, cv, pools[0], pools[1], loc, g, q=q[:, :5], q_out=q_out[:, :5])
    with pytest.raises(ValueError, match="needs rot_k"):
        quantize_pack_kv(k, v, None, rv, ck, cv, pools[0], pools[1], loc, g, q=q, q_out=q_out)


def test_fma_rotation_rows_per_step_keep_128_elements_per_thread():
    """``rot_rows=0``: all of R in one step at d <= 128 with four warps, 32 rows with one (the old default), fewer
    rows a step at d = 256 rather than 512 rotation registers per thread."""
    from oscar_kernels.write import fma_rot_rows

    assert [fma_rot_rows(d, 4) for d in (32, 64, 128, 256)] == [32, 64, 128, 64]
    assert fma_rot_rows(128, 1) == 32 and fma_rot_rows(128, 8) == 128 and fma_rot_rows(256, 8) == 128
