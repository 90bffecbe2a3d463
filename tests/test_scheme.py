"""QuantScheme (how rows are stored) and DecodeOptions (how the decode kernel reads them): defaults, validation,
resolution, strict parsing."""

import pytest
from oscar_kernels.scheme import DecodeOptions, DecodeOptionsError, QuantScheme, SchemeError


def test_defaults_and_resolution():
    s = QuantScheme()
    assert (s.bits, s.group, s.sink, s.recent, s.scale_dtype, s.levels) == (2, 0, 64, 256, "fp16", "uniform")
    r = s.resolved(128)
    assert r.group == 128 and r.bits_per_element(128) == 2.25 and QuantScheme(group=32).bits_per_element(64) == 3.0
    assert r.describe() == "int2.g128.s64.r256" and s.describe() == "int2.grow.s64.r256"
    assert QuantScheme.from_dict(r.to_dict()) == r


@pytest.mark.parametrize("kw,needle", [
    (dict(bits=3), "bits must be 2 or 4"), (dict(sink=-1), "non-negative"), (dict(levels="nf"), "levels"),
    (dict(scale_dtype="fp32"), "scale_dtype"), (dict(recent=1.5), "integer"),
])
def test_invalid_schemes_are_one_line_errors(kw, needle):
    with pytest.raises(SchemeError, match=needle) as e:
        QuantScheme(**kw)
    assert "\n" not in str(e.value)


def test_group_checks_and_kernel_support():
    with pytest.raises(SchemeError, match="must divide the head dim 64"):
        QuantScheme(group=48).group_for(64)
    with pytest.raises(SchemeError, match="multiple of 2"):
        QuantScheme(bits=4, group=3).group_for(3)
    assert QuantScheme().kernel_support(128) is None
    assert QuantScheme().kernel_support(32) is None and QuantScheme().kernel_support(64, "cuda") is None
    assert "decode kernel needs head dim >= 64" in QuantScheme().kernel_support(32, "cuda")  # wrong there on an H200
    assert QuantScheme(bits=4).kernel_support(128) is None  # 4-bit codes: two 2-bit planes
    assert "power-of-two head dim" in QuantScheme().kernel_support(80)
    assert "group" in QuantScheme(group=8).kernel_support(64)


def test_strict_parse():
    with pytest.raises(SchemeError, match="unknown key.*bitz"):
        QuantScheme.from_dict({"bitz": 2})
    with pytest.raises(SchemeError, match="must be a mapping"):
        QuantScheme.from_dict([2])


def test_decode_options_round_trip_their_command_line_and_json_forms():
    assert DecodeOptions().describe() == "" and DecodeOptions().to_dict() == {} and DecodeOptions().exact
    o = DecodeOptions.parse("split_tokens=4096, int8_scores=true,lean_tiles=false")
    assert o == DecodeOptions(int8_scores=True, split_tokens=4096) and not o.exact
    assert o.describe() == "int8_scores=true,split_tokens=4096"  # field order, defaults left out
    assert DecodeOptions.parse(o.describe()) == o and DecodeOptions.from_dict(o.to_dict()) == o
    assert DecodeOptions.parse("movmatrix=true", base=o) == DecodeOptions(int8_scores=True, movmatrix=True,
                                                                          split_tokens=4096)
    assert DecodeOptions(lean_tiles=True, movmatrix=True, num_stages=3).exact  # launch tuning keeps the numerics
    assert DecodeOptions(max_registers=0).max_registers == 0  # 0: no register cap


@pytest.mark.parametrize("spec,match", [
    ("int8_scores", "expected KEY=VALUE"), ("warp_size=4", "expected KEY=VALUE"),
    ("lean_tiles=yes", "takes true or false"), ("split_tokens=-1", "non-negative integer"),
    ("split_tokens=0", "positive integer"), ("num_stages=2,num_stages=3", "given twice"),
])
def test_decode_options_refuse_bad_command_lines_in_one_line(spec, match):
    with pytest.raises(DecodeOptionsError, match=match) as e:
        DecodeOptions.parse(spec)
    assert "\n" not in str(e.value)


def test_decode_options_from_dict_is_strict():
    with pytest.raises(DecodeOptionsError, match="unknown key"):
        DecodeOptions.from_dict({"int8_score": True})
    with pytest.raises(DecodeOptionsError, match="true or false"):
        DecodeOptions.from_dict({"int8_values": 1})
    with pytest.raises(DecodeOptionsError, match="must be an object"):
        DecodeOptions.from_dict(["int8_values"])
