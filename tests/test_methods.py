"""Method registry, scheme resolution, the rotate+quantize seam and the storage accounting."""

import pytest
import torch

from oscar_cli.config import QuantScheme
from oscar_cli.errors import OscarError
from oscar_cli.kvquant import (
    LayerQuant,
    bits_per_element,
    build_layer_quants,
    dequantize_rows,
    quantize_rows,
    quantized_count,
    roundtrip,
)
from oscar_cli.methods import METHODS, MethodError, get_method, parse_methods, scheme_for


def lq_for(name, n_layers=1, d=64, h=2, **kw):
    m = get_method(name)
    return build_layer_quants(m, scheme_for(m, d, **kw), n_layers, d, h)


def test_registry_has_required_methods():
    for name in ["bf16", "int2-naive", "int2-kivi", "int2-hadamard", "int2-hadamard-clip", "oscar", "int4-naive",
                 "int4-hadamard", "oscar-noclip", "hf-quantized"]:
        assert name in METHODS
    assert "int4-oscar" not in METHODS  # the artifact's scheme decides the width of `oscar`
    assert get_method("int2-hadamard-clip@0.9/0.8").clip == (0.9, 0.8)
    assert get_method("oscar@v3").arg == "v3"
    q8 = get_method("oscar-int8@v2")
    assert q8.int8_scores and q8.arg == "v2" and q8.clip is None and not get_method("oscar").int8_scores
    pv = get_method("oscar-int8-pv@v2")
    assert pv.int8_scores and pv.int8_values and pv.arg == "v2" and not q8.int8_values


def test_int8_values_need_row_scales():
    from oscar_cli.config import QuantScheme
    from oscar_cli.kvquant import build_layer_quants

    with pytest.raises(OscarError, match="one value scale per row"):
        build_layer_quants(get_method("oscar-int8-pv"), QuantScheme(group=32), 2, 64, 2)
    assert [m.name for m in parse_methods("bf16, int2-naive,bf16")] == ["bf16", "int2-naive"]


@pytest.mark.parametrize("bad", ["int3-naive", "int2-naive@x", "int2-hadamard-clip@1.5", ""])
def test_bad_method_names_are_one_line_errors(bad):
    with pytest.raises(OscarError) as e:
        parse_methods(bad)
    assert "\n" not in str(e.value)


def test_artifact_method_without_artifact_is_an_error():
    with pytest.raises(OscarError, match="needs an artifact"):
        scheme_for(get_method("oscar"), 64)
    with pytest.raises(OscarError, match="needs an artifact"):
        build_layer_quants(get_method("oscar"), QuantScheme(), 2, 64, 3)


def test_schemes_come_from_the_artifact_and_overrides_are_checked():
    four = QuantScheme(bits=4, group=32, sink=8, recent=16)
    oscar = get_method("oscar@v3")
    assert scheme_for(oscar, 64, artifact_scheme=four) == four  # a 4-bit artifact runs at 4 bits
    assert scheme_for(oscar, 64, artifact_scheme=four, overrides={"sink": 2, "group": 64}) == QuantScheme(
        bits=4, group=64, sink=2, recent=16)
    with pytest.raises(MethodError) as e:
        scheme_for(oscar, 64, artifact_scheme=four, overrides={"bits": 2}, artifact_name="m/v3")
    msg = str(e.value)
    assert "4 bits" in msg and "--bits 2" in msg and "m/v3" in msg and "\n" not in msg
    with pytest.raises(MethodError, match="group 48 must divide the head dim 64"):
        scheme_for(oscar, 64, artifact_scheme=four, overrides={"group": 48})
    # data-free methods: their own bits, the reference windows, overrides on top; KIVI keeps its own windows
    win = QuantScheme(sink=16, recent=64)
    assert scheme_for(get_method("int4-hadamard"), 64, windows=win) == QuantScheme(bits=4, group=64, sink=16, recent=64)
    with pytest.raises(MethodError, match="2 bits.*--bits 4"):
        scheme_for(get_method("int2-naive"), 64, overrides={"bits": 4})
    kivi = scheme_for(get_method("int2-kivi"), 64, windows=win, overrides={"sink": 3})
    assert (kivi.sink, kivi.recent, kivi.group) == (0, 128, 32)
    with pytest.raises(MethodError, match="fixes group 32"):
        scheme_for(get_method("int2-kivi"), 64, overrides={"group": 64})


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
        step = (xr.unflatten(-1, (-1, g)).amax(-1) - xr.unflatten(-1, (-1, g)).amin(-1)) / ((1 << lq.bits) - 1)
        err = (xr - yr).abs().unflatten(-1, (-1, g)).amax(-1)
        assert (err <= step * 0.5 * 1.01 + 1e-3).all()
    rel = ((x - y).norm() / x.norm()).item()
    assert rel < (0.12 if lq.bits == 4 else 0.6)


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
    lq = LayerQuant(2, 64, r, r, torch.tensor([1.0, 0.5]), torch.tensor([1.0, 0.5]))
    x = torch.randn(1, 2, 8, 64)
    q = quantize_rows(x, lq, "k")
    span = q.scale.float() * 3
    xr = x @ r
    full = xr.amax(-1) - xr.amin(-1)
    assert torch.allclose(span[0, 0, :, 0], full[0, 0], rtol=2e-3)
    assert torch.allclose(span[0, 1, :, 0], 0.5 * full[0, 1], rtol=2e-3)


def test_bits_per_element_formula():
    win = QuantScheme(sink=16, recent=64)

    def bpe(name):
        m = get_method(name)
        return bits_per_element(m, scheme_for(m, 64, windows=win), 1000, 64)

    # 1000 tokens, sink 16, recent 64 -> 920 quantized at 2 + 32/64 bits, 80 exact at 16 bits
    assert bpe("int2-naive") == pytest.approx((920 * 2.5 + 80 * 16) / 1000)
    assert bpe("int4-naive") == pytest.approx((920 * 4.5 + 80 * 16) / 1000)
    assert bpe("bf16") == 16
    # KIVI: sink 0, residual 128, blocks of 32: 1000-128 = 872 -> 864 quantized at 3 bits
    assert bpe("int2-kivi") == pytest.approx((864 * 3 + 136 * 16) / 1000)
    assert quantized_count(10, 4, 8, 1) == 0 and quantized_count(100, 4, 8, 32) == 64
