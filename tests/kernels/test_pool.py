"""Int2KVPool: writes against quantize_pack_ref (per-head rotations and clips, exact rows at a second list),
exact-only writes, the row map, per-layer LayerCaches, byte accounting, refused schemes."""

import pytest
import torch
from int2_cache import DEVICE, poison_kv_pool, random_rotation
from oscar_kernels import Int2KVPool, Int2Pool, exact_row_ref, quantize_pack_ref
from oscar_kernels.scheme import QuantScheme, SchemeError

L, HKV, D = 2, 2, 64


def _pool(scheme=None, slots=40, reqs=3, shared_rot=False, gen=None, clip_k=None, clip_v=None):
    gen = gen or torch.Generator().manual_seed(0)
    scheme = scheme or QuantScheme(group=32, sink=2, recent=4)
    h = 1 if shared_rot else HKV
    rot_k = torch.stack([random_rotation(h, D, gen) for _ in range(L)])
    rot_v = torch.stack([random_rotation(h, D, gen) for _ in range(L)])
    pool = Int2KVPool(scheme, L, HKV, D, slots, reqs, rot_k, rot_v, clip_k, clip_v, device=DEVICE)
    poison_kv_pool(pool, gen)  # anything not written stays NaN
    return pool


def _nan_equal(a, b):
    return torch.equal(a.float().nan_to_num(-7.0), b.float().nan_to_num(-7.0))


def test_write_matches_the_reference_with_per_head_clips():
    """One write of 11 tokens (per-head clip ratios for K, one per layer for V) against ``quantize_pack_ref``: INT2
    codes at scattered slots, exact rows at their rows. The exact rows are distinct, as a plan's are (a write's rows
    race where two tokens share one: on a GPU either token's row may land, in the kernel and in torch's reference
    alike; this test once wrote positions 5 and 9, 6 and 10 of one request to the same ring rows and failed or passed
    by the order in which the GPU retired the stores)."""
    gen = torch.Generator().manual_seed(1)
    clip_k = torch.tensor([[0.9, 0.7], [1.0, 0.6]])
    clip_v = torch.tensor([[0.8], [0.95]])  # one ratio per layer, expanded to the KV heads
    pool = _pool(gen=gen, clip_k=clip_k, clip_v=clip_v)
    c = pool.layer(1)
    assert torch.equal(c.clip_k.cpu(), clip_k[1]) and torch.equal(c.clip_v.cpu(), torch.tensor([0.95, 0.95]))
    n = 11
    k = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    loc = torch.randperm(40, generator=gen)[:n].to(DEVICE)
    # request 1's sinks and ring (positions 0-5), request 2's sinks and three ring positions: 11 distinct rows
    rows = pool.exact_rows(torch.tensor([1] * 6 + [2] * 5), torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 7, 8, 9])).to(DEVICE)
    rows[2:5] = -1
    assert rows[rows >= 0].unique().numel() == n - 3
    want = {name: t.clone() for name, t in (("kc", c.k.codes), ("ks", c.k.scale), ("kz", c.k.zero),
                                            ("vc", c.v.codes), ("vs", c.v.scale), ("vz", c.v.zero),
                                            ("kb", c.k_bf16), ("vb", c.v_bf16))}
    l0 = {name: t.clone() for name, t in (("kc", pool.layer(0).k.codes), ("kb", pool.layer(0).k_bf16))}
    pool.write(1, loc, k, v, bf16_loc=rows)
    quantize_pack_ref(k, c.rot_k, c.clip_k, want["kc"], want["ks"], want["kz"], loc, 32, bf16_out=want["kb"],
                      bf16_loc=rows)
    quantize_pack_ref(v, c.rot_v, c.clip_v, want["vc"], want["vs"], want["vz"], loc, 32, bf16_out=want["vb"],
                      bf16_loc=rows)
    lo = loc.long()
    # fused rotation: fp32 sums in another order, so a rare code or bf16 value may move by one step
    for got, ref in ((c.k.codes, want["kc"]), (c.v.codes, want["vc"])):
        assert (got[lo] != ref[lo]).float().mean() < 1e-2
    for got, ref in ((c.k.scale, want["ks"]), (c.v.zero, want["vz"])):
        torch.testing.assert_close(got[lo], ref[lo], atol=1e-4, rtol=2e-3)
    for got, ref in ((c.k_bf16, want["kb"]), (c.v_bf16, want["vb"])):
        assert torch.isnan(got).eq(torch.isnan(ref)).all()  # the same rows written, the rest untouched
        torch.testing.assert_close(got.nan_to_num(0.0).float(), ref.nan_to_num(0.0).float(), atol=1e-5, rtol=8e-3)
    free = torch.ones(40, dtype=torch.bool, device=DEVICE)
    free[lo] = False
    assert torch.isnan(c.k.scale[free]).all() and torch.isfinite(c.k.scale[lo]).all()
    # the other layer is untouched
    assert torch.equal(pool.layer(0).k.codes, l0["kc"]) and _nan_equal(pool.layer(0).k_bf16, l0["kb"])


@pytest.mark.parametrize("rotated", [False, True])
def test_write_exact_stores_rows_only(rotated):
    gen = torch.Generator().manual_seed(2 + rotated)
    pool = _pool(gen=gen, shared_rot=True)
    c = pool.layer(0)
    n = 6
    k = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    rows = torch.tensor([0, 5, -1, 7, 12, 17], device=DEVICE)
    codes = c.k.codes.clone()
    pool.write_exact(0, rows, k, v, rotated=rotated)
    keep = rows >= 0
    rk = torch.eye(D, device=DEVICE) if rotated else c.rot_k[0]
    rv = torch.eye(D, device=DEVICE) if rotated else c.rot_v[0]
    torch.testing.assert_close(c.k_bf16[rows[keep]].float(), (k[keep].float() @ rk).bfloat16().float(),
                               atol=1e-5, rtol=8e-3)
    torch.testing.assert_close(c.v_bf16[rows[keep]].float(), (v[keep].float() @ rv).bfloat16().float(),
                               atol=1e-5, rtol=8e-3)
    others = torch.ones(c.k_bf16.shape[0], dtype=torch.bool, device=DEVICE)
    others[rows[keep]] = False
    assert torch.isnan(c.k_bf16[others]).all() and torch.isnan(c.v_bf16[others]).all()
    assert torch.equal(c.k.codes, codes) and torch.isnan(c.k.scale).all()  # no INT2 store


def test_exact_rows_is_the_layout_map():
    pool = _pool()
    req = torch.tensor([0, 2, 2, 1])
    pos = torch.tensor([1, 9, 3, 0])
    assert torch.equal(pool.exact_rows(req, pos), exact_row_ref(req, pos, 0, 2, 4))
    assert torch.equal(pool.exact_rows(req, pos, start=torch.tensor([0, 1, 1, 1])),
                       exact_row_ref(req, pos, torch.tensor([0, 1, 1, 1]), 2, 4))
    assert pool.exact_rows(2, 9).item() == 2 * 6 + 2 + (9 - 2) % 4
    assert pool.exact_rows(1, 0, start=1).item() == -1


def test_layers_and_accounting():
    scheme = QuantScheme(group=0, sink=3, recent=5)  # group = d: one scale/zero per head row
    pool = _pool(scheme, slots=50, reqs=4)
    assert pool.group_size == D and pool.rows_per_request == 8
    c = pool.layer(1)
    assert isinstance(c.k, Int2Pool) and c.k.slots == 50 and c.k_bf16.shape == (4 * 8, HKV, D)
    assert c.rot_k.shape == (HKV, D, D) and c.clip_k.shape == (HKV,) and torch.all(c.clip_k == 1.0)
    assert pool.layer(0).k.codes.data_ptr() != c.k.codes.data_ptr()
    # per token, all layers, K and V: d/4 code bytes + fp16 scale and zero per head
    assert pool.cell_bytes == L * 2 * HKV * (D // 4 + 4) == 160
    assert pool.exact_bytes == L * 2 * 4 * 8 * HKV * D * 2
    rot_clip = L * 2 * (HKV * D * D * 4 + HKV * 4)
    assert pool.nbytes == pool.cell_bytes * 50 + pool.exact_bytes + rot_clip
    # the Qwen3-8B shape at 2.25 bits/element: 36 layers x 8 KV heads x (32 + 4) bytes x K and V per token
    eye = torch.eye(128).expand(36, 1, 128, 128)
    qwen = Int2KVPool(QuantScheme(), 36, 8, 128, 2, 1, eye, eye, device=DEVICE)
    assert qwen.cell_bytes == 36 * 8 * 36 * 2 and qwen.cell_bytes * 8 / (36 * 2 * 8 * 128) == 2.25
    assert qwen.exact_bytes == 36 * 2 * (64 + 256) * 8 * 128 * 2


def test_refuses_what_the_kernels_cannot_run():
    gen = torch.Generator().manual_seed(4)
    rot = torch.eye(D).expand(L, 1, D, D)
    for scheme, d in ((QuantScheme(levels="fitted"), D), (QuantScheme(group=8), D), (QuantScheme(), 80)):
        with pytest.raises(SchemeError, match="kernels"):
            Int2KVPool(scheme, L, HKV, d, 8, 1, torch.eye(d).expand(L, 1, d, d), torch.eye(d).expand(L, 1, d, d))
    with pytest.raises(ValueError, match="clip"):
        Int2KVPool(QuantScheme(), L, HKV, D, 8, 1, rot, rot, clip_k=torch.full((L, HKV), 1.5))
    with pytest.raises(ValueError, match="rot_k"):
        Int2KVPool(QuantScheme(), L, HKV, D, 8, 1, random_rotation(HKV, D, gen), rot)


def test_fp8_metadata_pool():
    """``scale_dtype: fp8``: e4m3 scales and zeros with each layer's per-head multipliers (required, powers of two),
    written as ``quantize_pack_ref`` writes them; the cell costs one byte less per scale and per zero (2.125 bits per
    element at the Qwen3-8B shape); the decode kernels read the pool through the reference's dequantisation."""
    gen = torch.Generator().manual_seed(6)
    scheme = QuantScheme(group=32, sink=2, recent=4, scale_dtype="fp8")
    rot = torch.stack([random_rotation(HKV, D, gen) for _ in range(L)])
    mult = torch.tensor([[2.0 ** -6, 2.0 ** -4], [2.0 ** -5, 2.0 ** -7]])
    with pytest.raises(SchemeError, match="mult_k"):
        Int2KVPool(scheme, L, HKV, D, 8, 1, rot, rot)
    with pytest.raises(ValueError, match="powers of two"):
        Int2KVPool(scheme, L, HKV, D, 8, 1, rot, rot, mult_k=mult * 1.5, mult_v=mult)
    pool = Int2KVPool(scheme, L, HKV, D, 40, 3, rot, rot.flip(0), device=DEVICE, mult_k=mult, mult_v=mult.flip(1))
    c = pool.layer(1)
    assert c.fp8 and c.k.scale.dtype == torch.float8_e4m3fn and torch.equal(c.v.mult.cpu(), mult[1].flip(0))
    assert pool.cell_bytes == L * 2 * HKV * (D // 4 + 2 * 2)
    n = 13
    k = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    loc = torch.randperm(40, generator=gen)[:n].to(DEVICE)
    pool.write(1, loc, k, v)
    for x, p in ((k, c.k), (v, c.v)):
        want = Int2Pool.empty(40, HKV, D, 32, device=DEVICE, mult=p.mult)
        quantize_pack_ref(x, c.rot_k if p is c.k else c.rot_v, 1.0, want.codes, want.scale, want.zero, loc, 32,
                          mult=p.mult)
        lo = loc.long()
        assert (p.codes[lo] != want.codes[lo]).float().mean() < 1e-2  # fused rotation: a rare code may move
        torch.testing.assert_close(p.dequantize(lo), want.dequantize(lo), atol=0.05, rtol=0.05)
    eye = torch.eye(128).expand(36, 1, 128, 128)
    ones = torch.ones(36, 8)
    qwen = Int2KVPool(QuantScheme(scale_dtype="fp8"), 36, 8, 128, 2, 1, eye, eye, device=DEVICE, mult_k=ones,
                      mult_v=ones)
    assert qwen.cell_bytes * 8 / (36 * 2 * 8 * 128) == 2.125


def test_mixed_widths_pool():
    """A scheme's allocation (4-bit keys in layer 0, 4-bit values in layer 1): each layer's pools have their
    widths, the write stores them as the reference does, the cell counts each layer's bytes; explicit ``widths``
    override the scheme (a pool of a model's quantized layers only)."""
    gen = torch.Generator().manual_seed(9)
    scheme = QuantScheme(group=32, sink=2, recent=4, bits_k=(4, 2), bits_v=(2, 4))
    rot = torch.stack([random_rotation(HKV, D, gen) for _ in range(L)])
    pool = Int2KVPool(scheme, L, HKV, D, 40, 3, rot, rot, device=DEVICE)
    assert [(c.k.bits, c.v.bits) for c in (pool.layer(0), pool.layer(1))] == [(4, 2), (2, 4)]
    # per layer: one 4-bit and one 2-bit kind, fp16 scale and zero per 32-element group
    assert pool.cell_bytes == L * HKV * (D // 2 + D // 4 + 2 * 4 * (D // 32))
    n = 9
    k = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    loc = torch.randperm(40, generator=gen)[:n].to(DEVICE)
    for i in range(L):
        c = pool.layer(i)
        pool.write(i, loc, k, v)
        for x, p, r in ((k, c.k, c.rot_k), (v, c.v, c.rot_v)):
            want = Int2Pool.empty(40, HKV, D, 32, device=DEVICE, bits=p.bits)
            quantize_pack_ref(x, r, 1.0, want.codes, want.scale, want.zero, loc, 32, codes_hi=want.codes_hi)
            lo = loc.long()
            assert (p.code_values(lo) != want.code_values(lo)).float().mean() < 1e-2
            torch.testing.assert_close(p.dequantize(lo), want.dequantize(lo), atol=2e-2, rtol=2e-2)
    narrow = Int2KVPool(QuantScheme(group=32), 1, HKV, D, 8, 1, rot[:1], rot[:1], widths=[(4, 4)])
    assert narrow.layer(0).k.bits == narrow.layer(0).v.bits == 4
    with pytest.raises(SchemeError, match="3 layers"):
        Int2KVPool(QuantScheme(group=32, bits_k=(2, 4, 2), bits_v=(2, 2, 2)), L, HKV, D, 8, 1, rot, rot)


def test_centered_keys_pool():
    """``center_keys``: the centers are required, held per layer in each head's rotated basis, and every key row the
    pool stores (codes and exact rows, through ``write`` and ``write_exact``) is the rotated row minus that center;
    values are never centered."""
    gen = torch.Generator().manual_seed(8)
    scheme = QuantScheme(group=32, sink=2, recent=4, center_keys=True)
    rot = torch.stack([random_rotation(HKV, D, gen) for _ in range(L)])
    center = torch.randn(L, HKV, D, generator=gen) + 2
    with pytest.raises(SchemeError, match="center_k"):
        Int2KVPool(scheme, L, HKV, D, 8, 1, rot, rot)
    with pytest.raises(ValueError, match="center_k must be"):
        Int2KVPool(scheme, L, HKV, D, 8, 1, rot, rot, center_k=center[:, :1])
    pool = Int2KVPool(scheme, L, HKV, D, 40, 3, rot, rot.flip(0), device=DEVICE, center_k=center)
    plain = Int2KVPool(QuantScheme(group=32, sink=2, recent=4), L, HKV, D, 40, 3, rot, rot.flip(0), device=DEVICE)
    c = pool.layer(1)
    # rot is on DEVICE (random_rotation puts it there), center on the CPU: the expected center is made on the CPU
    torch.testing.assert_close(c.center_k.cpu(), torch.einsum("hd,hde->he", center[1], rot[1].cpu()))
    assert plain.layer(1).center_k is None and pool.nbytes == plain.nbytes + L * HKV * D * 4
    n = 9
    k = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    v = torch.randn(n, HKV, D, generator=gen).to(DEVICE, torch.bfloat16)
    loc = torch.randperm(40, generator=gen)[:n].to(DEVICE)
    rows = torch.randperm(pool.rows_per_request * 3, generator=gen)[:n].to(DEVICE)
    pool.write(1, loc, k, v, bf16_loc=rows)
    want_k = Int2Pool.empty(40, HKV, D, 32, device=DEVICE)
    out = torch.empty(pool.rows_per_request * 3, HKV, D, dtype=torch.bfloat16, device=DEVICE)
    quantize_pack_ref(k, c.rot_k, 1.0, want_k.codes, want_k.scale, want_k.zero, loc, 32, bf16_out=out, bf16_loc=rows,
                      center=c.center_k)
    lo, ro = loc.long(), rows.long()
    torch.testing.assert_close(c.k.dequantize(lo), want_k.dequantize(lo), atol=0.05, rtol=0.05)
    torch.testing.assert_close(c.k_bf16[ro].float(), out[ro].float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(c.v_bf16[ro].float(), torch.einsum("nhd,hde->nhe", v.float(), c.rot_v.cpu().to(DEVICE)),
                               atol=3e-2, rtol=2e-2)  # values: rotated only
    c.k_bf16.fill_(float("nan"))
    pool.write_exact(1, rows, k, v)  # un-rotated input: rotated and centered here
    torch.testing.assert_close(c.k_bf16[ro].float(), out[ro].float(), atol=2e-2, rtol=1e-2)
