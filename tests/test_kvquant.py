"""Per-layer quantizers: the rotate+quantize seam, the data-free rotations and the storage accounting."""

import pytest
import torch

from oscar_cli import rotation as rot
from oscar_cli.config import QuantScheme
from oscar_cli.kvquant import (
    LayerQuant,
    bits_per_element,
    build_layer_quants,
    data_free_rotation,
    dequantize_rows,
    quantize_rows,
    quantized_count,
    roundtrip,
)
from oscar_cli.methods import ROTATIONS, MethodError, get_method, scheme_for


def lq_for(name, n_layers=1, d=64, h=2, **kw):
    m = get_method(name)
    return build_layer_quants(m, scheme_for(m, d, **kw), n_layers, d, h)


def test_data_free_rotations_are_the_recipes_matrices():
    """``int2-hadamard`` stores rows rotated by the ``hadamard`` recipe's matrix (the seeded ``S·H`` an
    ``oscar fit --method hadamard`` artifact holds); ``identity`` stores them unrotated."""
    for group in (64, 32):
        r = data_free_rotation(ROTATIONS["hadamard"], 64, group)
        assert torch.equal(r, rot.data_free(64, group))
        lq = build_layer_quants(get_method("int2-hadamard"), QuantScheme(group=group), 2, 64, 2)[0]
        assert torch.equal(lq.r_k[0], r.float()) and torch.equal(lq.r_v[0], r.float())
    assert data_free_rotation(ROTATIONS["identity"], 64, 64) is None and lq_for("int2-naive")[0].r_k is None
    with pytest.raises(MethodError, match="load it from an artifact"):
        data_free_rotation(ROTATIONS["oscar"], 64, 64)


@pytest.mark.parametrize("name", ["int2-naive", "int2-hadamard", "int2-hadamard-clip", "int4-hadamard", "int2-kivi"])
def test_roundtrip_error_bound(name):
    """Unclipped: every element within half a step of its group; rotations are undone exactly."""
    m = get_method(name)
    lq = lq_for(name)[0]
    x = torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(0))
    y = roundtrip(x, lq, "v")
    assert y.shape == x.shape
    if m.clip == (1.0, 1.0):
        xr = x @ lq.r_v if lq.r_v is not None else x
        yr = y @ lq.r_v if lq.r_v is not None else y
        g = lq.group
        step = (xr.unflatten(-1, (-1, g)).amax(-1) - xr.unflatten(-1, (-1, g)).amin(-1)) / ((1 << lq.bits_v) - 1)
        err = (xr - yr).abs().unflatten(-1, (-1, g)).amax(-1)
        assert (err <= step * 0.5 * 1.01 + 1e-3).all()
    rel = ((x - y).norm() / x.norm()).item()
    assert rel < (0.12 if lq.bits_v == 4 else 0.6)


def test_kivi_keys_are_per_channel_blocks():
    lq = lq_for("int2-kivi")[0]
    assert lq.token_block == 32
    x = torch.randn(1, 2, 64, 64)
    q = quantize_rows(x, lq, "k")
    assert q.codes.shape == (1, 2, 2, 64, 8) and q.scale.shape == (1, 2, 2, 64, 1)
    # a constant channel inside a block is reproduced exactly (scale floor aside)
    x[..., :32, 5] = 0.25
    y = dequantize_rows(quantize_rows(x, lq, "k"), lq, "k")
    assert torch.allclose(y[..., :32, 5], torch.full_like(y[..., :32, 5], 0.25), atol=1e-3)


def test_per_head_clip_broadcasts():
    r = torch.linalg.qr(torch.randn(2, 64, 64))[0]
    lq = LayerQuant(2, 2, 64, r, r, torch.tensor([1.0, 0.5]), torch.tensor([1.0, 0.5]))
    x = torch.randn(1, 2, 8, 64)
    q = quantize_rows(x, lq, "k")
    span = q.scale.float() * 3
    xr = x @ r
    full = xr.amax(-1) - xr.amin(-1)
    assert torch.allclose(span[0, 0, :, 0], full[0, 0], rtol=2e-3)
    assert torch.allclose(span[0, 1, :, 0], 0.5 * full[0, 1], rtol=2e-3)


def test_bits_per_element_formula():
    ref = QuantScheme(sink=16, recent=64)

    def bpe(name):
        m = get_method(name)
        return bits_per_element(m, scheme_for(m, 64, reference=ref), 1000, 64)

    # 1000 tokens, sink 16, recent 64 -> 920 quantized at 2 + 32/64 bits, 80 exact at 16 bits
    assert bpe("int2-naive") == pytest.approx((920 * 2.5 + 80 * 16) / 1000)
    assert bpe("int4-naive") == pytest.approx((920 * 4.5 + 80 * 16) / 1000)
    assert bpe("bf16") == 16
    # KIVI: sink 0, residual 128, blocks of 32: 1000-128 = 872 -> 864 quantized at 3 bits
    assert bpe("int2-kivi") == pytest.approx((864 * 3 + 136 * 16) / 1000)
    assert quantized_count(10, 4, 8, 1) == 0 and quantized_count(100, 4, 8, 32) == 64
