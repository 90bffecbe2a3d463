"""QuantScheme: the one definition of the storage scheme (defaults, validation, resolution, strict parsing)."""

import pytest
from oscar_kernels.scheme import QuantScheme, SchemeError


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
    assert "2-bit" in QuantScheme(bits=4).kernel_support(128)
    assert "power-of-two head dim" in QuantScheme().kernel_support(80)
    assert "group" in QuantScheme(group=8).kernel_support(64)


def test_strict_parse():
    with pytest.raises(SchemeError, match="unknown key.*bitz"):
        QuantScheme.from_dict({"bitz": 2})
    with pytest.raises(SchemeError, match="must be a mapping"):
        QuantScheme.from_dict([2])
