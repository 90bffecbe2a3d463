"""The one method registry: rotation recipes and KV-cache methods, and how a KV method's scheme is decided."""

import pytest
from oscar_kernels.scheme import DecodeOptions

from oscar_cli.config import QuantScheme
from oscar_cli.errors import OscarError
from oscar_cli.kvquant import build_layer_quants
from oscar_cli.methods import (
    METHODS,
    ROTATIONS,
    Method,
    MethodError,
    get_method,
    get_rotation,
    parse_methods,
    scheme_for,
)


def test_registry_has_required_methods():
    for name in ["bf16", "int2-naive", "int2-kivi", "int2-hadamard", "int2-hadamard-clip", "oscar", "int4-naive",
                 "int4-hadamard", "oscar-noclip", "hf-quantized"]:
        assert name in METHODS
    assert "int4-oscar" not in METHODS  # the artifact's scheme decides the width of `oscar`
    assert get_method("int2-hadamard-clip@0.9/0.8").clip == (0.9, 0.8)
    assert get_method("oscar@v3").arg == "v3"
    q8 = get_method("oscar-int8@v2")
    assert q8.decode == DecodeOptions(int8_scores=True) and q8.arg == "v2" and q8.clip is None
    assert get_method("oscar").decode == DecodeOptions()
    pv = get_method("oscar-int8-pv@v2")
    assert pv.decode == DecodeOptions(int8_scores=True, int8_values=True) and pv.arg == "v2"
    # a method's decode options reach every layer's quantizer
    art_free = [lq.decode for lq in build_layer_quants(get_method("int2-hadamard"), QuantScheme(), 2, 64, 2)]
    assert art_free == [DecodeOptions()] * 2


def test_data_free_methods_refer_to_their_rotation_recipe():
    """One registry: a KV method with a data-free rotation holds the ``ROTATIONS`` entry itself; artifact methods hold
    none (the artifact's fitted rotations) and are the ones that need an artifact."""
    for name in ("int2-hadamard", "int4-hadamard", "int2-hadamard-clip", "int4-hadamard-clip"):
        assert METHODS[name].rotation is ROTATIONS["hadamard"]
    for name in ("int2-naive", "int4-naive", "int2-kivi", "bf16"):
        assert METHODS[name].rotation is ROTATIONS["identity"]
    needs = {n for n, m in METHODS.items() if m.needs_artifact}
    assert needs == {"oscar", "oscar-noclip", "oscar-int8", "oscar-int8-pv"}
    assert all(METHODS[n].rotation is None for n in needs)
    assert {r.name for r in ROTATIONS.values() if r.data_free} == {"identity", "hadamard"}
    assert get_rotation("kcov").value_basis == "v"
    with pytest.raises(MethodError, match="unknown rotation 'nope'; choose one of identity, hadamard"):
        get_rotation("nope")
    with pytest.raises(ValueError, match="comes from an artifact"):
        Method("int2-oscar", "quant", 2, rotation=ROTATIONS["oscar"])


def test_int8_values_need_row_scales():
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
    # data-free methods: their own bits, the reference sink/recent, overrides on top; KIVI keeps its own sink/recent
    ref = QuantScheme(sink=16, recent=64)
    assert scheme_for(get_method("int4-hadamard"), 64, reference=ref) == QuantScheme(bits=4, group=64, sink=16,
                                                                                       recent=64)
    with pytest.raises(MethodError, match="2 bits.*--bits 4"):
        scheme_for(get_method("int2-naive"), 64, overrides={"bits": 4})
    kivi = scheme_for(get_method("int2-kivi"), 64, reference=ref, overrides={"sink": 3})
    assert (kivi.sink, kivi.recent, kivi.group) == (0, 128, 32)
    with pytest.raises(MethodError, match="fixes group 32"):
        scheme_for(get_method("int2-kivi"), 64, overrides={"group": 64})


