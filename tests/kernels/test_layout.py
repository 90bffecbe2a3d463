"""layout.py: planar packing (2 and 4 bits), the exact-row map (torch and its Triton twin), cached rows, Int2Pool's
head-major storage, LayerCache's checks."""

import pytest
import torch
import triton
import triton.language as tl
from int2_cache import DEVICE, make_cache, random_rotation
from oscar_kernels import Int2Pool, LayerCache, cached_rows_ref, dequantize_ref, exact_row_ref, pack, unpack
from oscar_kernels.layout import check_group_size, exact_row


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d,group", [(64, 64), (64, 16), (128, 32), (80, 80)])
def test_pack_unpack_round_trip(bits, d, group):
    gen = torch.Generator().manual_seed(bits * d + group)
    codes = torch.randint(0, 1 << bits, (7, 3, d), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits, group)
    assert packed.shape == (7, 3, d * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits, group), codes)


@pytest.mark.parametrize("bits", [2, 4])
def test_packed_layout_is_planar(bits):
    """Byte ``b`` of group ``k`` holds elements ``k*g + b + j*B`` at bit shift ``bits * j``, ``B = g * bits / 8``."""
    gen = torch.Generator().manual_seed(bits)
    g, d = 16, 64
    per_byte, nb = 8 // bits, 16 * bits // 8
    codes = torch.randint(0, 1 << bits, (5, d), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits, g)
    for k in range(d // g):
        for b in range(nb):
            for j in range(per_byte):
                got = (packed[:, k * nb + b] >> (bits * j)) & ((1 << bits) - 1)
                assert torch.equal(got, codes[:, k * g + b + j * nb]), (k, b, j)


def test_pack_rejects_other_widths():
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(4, 16, dtype=torch.uint8), 3, 16)


def test_check_group_size():
    check_group_size(128, 32)
    for d, g in ((64, 24), (48, 16), (64, 8)):
        with pytest.raises(ValueError):
            check_group_size(d, g)


@pytest.mark.parametrize("sink,recent", [(4, 8), (0, 8), (4, 0), (1, 1)])
def test_exact_row_map(sink, recent):
    """Spec examples; each request's region holds its sinks and a ring of its last ``recent`` positions: for any
    length ``n`` the rows of ``[start, start + sink)`` and of the last ``recent`` positions are distinct and stay inside
    the request's region; padding (before ``start``) and, without a ring, non-sinks have no row (-1)."""
    per = sink + recent
    req, start = 3, 5
    assert int(exact_row_ref(req, start, start, sink, recent)) == (req * per if sink else (req * per if recent else -1))
    if recent:
        p = start + sink + 2 * recent + 1  # wrapped twice
        assert int(exact_row_ref(req, p, start, sink, recent)) == req * per + sink + (2 * recent + 1) % recent
    assert int(exact_row_ref(req, start - 1, start, sink, recent)) == -1
    for n in range(start + 1, start + sink + 3 * recent + 3):
        sinks = torch.arange(start, min(start + sink, n))
        ring = torch.arange(min(max(start + sink, n - recent), n), n)
        rows = exact_row_ref(req, torch.cat([sinks, ring]), start, sink, recent)
        assert rows.unique().numel() == rows.numel()
        assert bool(((rows >= req * per) & (rows < (req + 1) * per)).all())
        assert torch.equal(rows[:sinks.numel()], req * per + sinks - start)
    if recent == 0:
        assert int(exact_row_ref(req, start + sink, start, sink, recent)) == -1


@triton.jit
def _exact_row_kernel(REQ, POS, START, OUT, SINK: tl.constexpr, RECENT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    row = exact_row(tl.load(REQ + offs).to(tl.int64), tl.load(POS + offs), tl.load(START + offs), SINK, RECENT)
    tl.store(OUT + offs, row)


@pytest.mark.parametrize("sink,recent", [(4, 8), (0, 5), (3, 0)])
def test_exact_row_triton_twin_matches_torch(sink, recent):
    gen = torch.Generator().manual_seed(10 * sink + recent)
    n = 256
    req = torch.randint(0, 1000, (n,), generator=gen, dtype=torch.int32)
    start = torch.randint(0, 20, (n,), generator=gen, dtype=torch.int32)
    pos = start + torch.randint(-3, 200, (n,), generator=gen, dtype=torch.int32)
    out = torch.full((n,), -7, dtype=torch.int64, device=DEVICE)
    _exact_row_kernel[(1,)](req.to(DEVICE), pos.to(DEVICE), start.to(DEVICE), out, SINK=sink, RECENT=recent, BLOCK=n)
    assert torch.equal(out.cpu(), exact_row_ref(req, pos, start, sink, recent))


def test_cached_rows_are_the_quantizer_round_trip_then_the_exact_rows():
    """INT2 slots dequantise to what ``oscar_cli.quantizer`` gives for the same rotated rows; exact rows follow."""
    quantizer = pytest.importorskip("oscar_cli.quantizer")
    gen = torch.Generator().manual_seed(3)
    lists = make_cache([5, 0, 7], [2, 3, 0], 2, 64, 32, gen)
    c = lists.cache
    for b in range(3):
        got = cached_rows_ref(c.k, c.k_bf16, lists.kv_indptr, lists.kv_indices, lists.bf16_indptr,
                              lists.bf16_indices, b)
        sl = lists.kv_indices[lists.kv_indptr[b]:lists.kv_indptr[b + 1]].long()
        sb = lists.bf16_indices[lists.bf16_indptr[b]:lists.bf16_indptr[b + 1]].long()
        q = quantizer.QuantizedRows(c.k.codes[sl], c.k.scale[sl], c.k.zero[sl], 2, 32)
        assert torch.equal(got, torch.cat([quantizer.dequantize(q), c.k_bf16[sb].float()]))
        assert torch.isfinite(got).all() and got.shape[0] == sl.numel() + sb.numel()


def test_int2_pool_is_head_major():
    pool = Int2Pool.empty(10, 3, 128, 32, device=DEVICE)
    assert pool.codes.shape == (10, 3, 32) and pool.scale.shape == (10, 3, 4)
    assert pool.codes.stride() == (32, 320, 1) and pool.scale.stride() == (4, 40, 1)
    assert pool.words is not None and pool.words.shape == (10, 3, 16) and pool.words.dtype == torch.int16
    assert (pool.slots, pool.kv_heads, pool.head_dim, pool.group_size) == (10, 3, 128, 32)
    assert pool.nbytes == 10 * 3 * (32 + 2 * 2 * 4)
    codes = torch.arange(10 * 3 * 32, dtype=torch.int64).to(torch.uint8).view(10, 3, 32).to(DEVICE)
    pool.codes.copy_(codes)
    assert torch.equal(dequantize_ref(pool.codes, torch.ones(10, 3, 4, dtype=torch.float16, device=DEVICE),
                                      torch.zeros(10, 3, 4, dtype=torch.float16, device=DEVICE), 32),
                       unpack(codes, 2, 32).float())


def test_layer_cache_checks_its_parts():
    gen = torch.Generator().manual_seed(5)
    c = make_cache([3], [2], 2, 64, 64, gen).cache
    good = dict(k=c.k, v=c.v, k_bf16=c.k_bf16, v_bf16=c.v_bf16, rot_k=c.rot_k, rot_v=c.rot_v, clip_k=c.clip_k,
                clip_v=c.clip_v)
    assert LayerCache(**good).kv_heads == 2
    bad = {
        "rot_k": random_rotation(2, 32, gen),  # wrong head dim
        "clip_v": torch.ones(3, device=DEVICE),  # wrong head count
        "clip_k": torch.ones(2, dtype=torch.float64, device=DEVICE),
        "k_bf16": c.k_bf16.float(),
        "v": Int2Pool.empty(c.k.slots + 1, 2, 64, 64, device=DEVICE),  # slots differ
    }
    for name, value in bad.items():
        with pytest.raises(ValueError):
            LayerCache(**{**good, name: value})
