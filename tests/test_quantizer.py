import pytest
import torch

from oscar_cli import quantizer as qz


def test_packing_is_the_kernels_layout():
    """One definition of the format: the quantizer packs with oscar_kernels.layout (tested in tests/kernels)."""
    from oscar_kernels import layout

    assert qz.pack is layout.pack and qz.unpack is layout.unpack and qz.SCALE_EPS == layout.SCALE_EPS
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
    q = qz.quantize(x, 0.9, bits=4, group=16)
    assert q.codes.shape == (5, 3, 32) and torch.equal(layout.pack(layout.unpack(q.codes, 4, 16), 4, 16), q.codes)


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
