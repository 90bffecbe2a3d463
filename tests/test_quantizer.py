import pytest
import torch

from oscar_cli import quantizer as qz


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d,group", [(64, 64), (64, 16), (128, 32), (80, 80)])
def test_pack_unpack_is_exact(bits, d, group):
    codes = torch.randint(0, 1 << bits, (7, 3, d), dtype=torch.uint8)
    packed = qz.pack(codes, bits, group)
    assert packed.shape == (7, 3, d * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(qz.unpack(packed, bits, group), codes)


def test_packed_layout_is_planar():
    codes = torch.arange(16, dtype=torch.uint8).remainder(4).view(1, 16)  # group 16 -> 4 bytes
    packed = qz.pack(codes, 2, 16)
    # byte b holds elements b, b+4, b+8, b+12 at shifts 0, 2, 4, 6
    for b in range(4):
        expect = sum(int(codes[0, b + 4 * k]) << (2 * k) for k in range(4))
        assert packed[0, b].item() == expect


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("ratio", [1.0, 0.8])
def test_quantization_error_obeys_its_bound(bits, ratio):
    x = torch.randn(64, 4, 64) * 3 + 0.5
    q = qz.quantize(x, ratio, bits=bits, group=32)
    xhat = qz.dequantize(q)
    lo, hi = qz.clip_bounds(x, ratio, 32)
    clamped = torch.maximum(torch.minimum(x.unflatten(-1, (-1, 32)), hi[..., None]), lo[..., None]).flatten(-2)
    s = q.scale.float().repeat_interleave(32, -1)
    # half a step, plus the fp16 rounding of zero and of the scale times the largest code
    slack = 2e-3 * (x.abs().amax() + 1)
    assert ((xhat - clamped).abs() <= s / 2 + slack).all()
    assert (xhat - x).abs().max() > 0  # really quantized


def test_constant_rows_stay_finite_and_exact():
    x = torch.full((3, 64), 1.25)
    xhat = qz.fake_quant(x)
    assert torch.isfinite(xhat).all()
    torch.testing.assert_close(xhat, x, atol=1e-3, rtol=0)


def test_bits_per_element_matches_bytes_held():
    x = torch.randn(10, 8, 128)
    q = qz.quantize(x, bits=2, group=128)
    assert q.nbytes * 8 / x.numel() == pytest.approx(qz.bits_per_element(2, 128)) == 2.25


def test_bad_group_is_rejected():
    with pytest.raises(ValueError, match="group"):
        qz.quantize(torch.randn(2, 64), group=24)
