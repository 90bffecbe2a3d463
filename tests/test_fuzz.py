"""Property tests (hypothesis), bounded for CI: the quantizer's round trips and error bounds, the rotation builders for
every head dim 2..256, the kernels' reference write against the quantizer, and the parsers of recipes and
manifests (a valid value or a one-line error of the documented type, nothing else)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oscar_kernels import Int2Pool, quantize_pack_ref

from oscar_cli import artifact as art
from oscar_cli import quantizer, rotation
from oscar_cli.config import ConfigError, load_recipe

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(bits=st.sampled_from([2, 4]), groups=st.integers(1, 4), group=st.sampled_from([4, 8, 16, 32, 64]),
       rows=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(bits, groups, group, rows, seed):
    if group % (8 // bits):
        return
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, groups * group), generator=g, dtype=torch.uint8)
    packed = quantizer.pack(codes, bits, group)
    assert packed.shape[-1] == groups * group * bits // 8
    assert torch.equal(quantizer.unpack(packed, bits, group), codes)


@FAST
@given(bits=st.sampled_from([2, 4]), group=st.sampled_from([8, 16, 64]), ratio=st.floats(0.5, 1.0),
       scale=st.floats(1e-3, 1e3), offset=st.floats(-100, 100), meta=st.sampled_from(["fp16", "fp8"]),
       seed=st.integers(0, 2**31 - 1))
def test_quantize_stays_in_range_and_within_half_a_step(bits, group, ratio, scale, offset, meta, seed):
    """Codes lie in [0, 2**bits - 1]; inside the clip range the error is at most half a step plus the metadata's
    rounding; outside it the value lands on the nearest end."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2 * group, generator=g).double() * scale + offset
    q = quantizer.quantize(x.float(), ratio, bits=bits, group=group, meta=meta)
    codes = quantizer.unpack(q.codes, bits, group)
    assert int(codes.max()) <= (1 << bits) - 1
    xh = quantizer.dequantize(q).double()
    s, z = (t.double().unsqueeze(-1) for t in q.scale_zero())
    lo, hi = (t.double().unsqueeze(-1) for t in quantizer.clip_bounds(x.float(), ratio, group))
    xg = x.unflatten(-1, (-1, group))
    top = z + s * ((1 << bits) - 1)
    want = torch.minimum(torch.maximum(xg, z), top)  # the representable range of the stored scale and zero
    err = (xh.unflatten(-1, (-1, group)) - want).abs()
    step = s.expand_as(err)
    assert (err <= step / 2 + 1e-6 * (xg.abs() + 1)).all()
    # the stored range covers the clip range up to the metadata's rounding: half a step of the zero (relative to its
    # magnitude: 2**-4 in e4m3, 2**-11 in fp16) and of each of the 2**bits - 1 scale steps
    rel = 2.0 ** -4 if meta == "fp8" else 2.0 ** -11
    tiny = 1e-6 * (scale + abs(offset))
    assert (z <= lo + rel * lo.abs() + tiny).all()
    assert (top >= hi - rel * lo.abs() - ((1 << bits) - 1) * rel * s - tiny).all()


@settings(max_examples=40, deadline=None)
@given(d=st.integers(2, 256), seed=st.integers(0, 1000))
def test_rotations_are_orthogonal_at_every_head_dim(d, seed):
    """``compose`` with every factor (eigenbasis, bit-reversal placement, block mixing of a dividing group, random
    signs) is orthogonal for any head dim 2..256, and the placement is a permutation."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    cov = a @ a.T
    group = max(k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, d) if d % k == 0 and k <= d)
    r = rotation.compose(cov, use_u=True, use_p=True, use_h=True, group=group, signs_seed=seed)
    assert rotation.orthogonality_error(r) < 1e-9
    br = rotation.bit_reversal(d)
    assert sorted(br.tolist()) == list(range(d))


@settings(max_examples=30, deadline=None)
@given(d=st.sampled_from([16, 32, 64]), group=st.sampled_from(["row", 16]), bits=st.sampled_from([2, 4]),
       fp8=st.booleans(), clip=st.floats(0.6, 1.0), seed=st.integers(0, 2**31 - 1))
def test_the_kernels_reference_write_is_the_quantizer(d, group, bits, fp8, clip, seed):
    """``quantize_pack_ref`` (what the kernels are tested against) stores the codes, scales and zeros that
    ``oscar_cli.quantizer.quantize`` defines, for both widths (4-bit as two planes) and both metadata types."""
    g_ = d if group == "row" else group
    gen = torch.Generator().manual_seed(seed)
    hkv, n = 2, 5
    x = torch.randn(n, hkv, d, generator=gen) * (1 + 4 * torch.rand(d, generator=gen))
    mult = torch.exp2(-torch.randint(2, 7, (hkv,), generator=gen).float()) if fp8 else None
    pool = Int2Pool.empty(n, hkv, d, g_, mult=mult, bits=bits)
    quantize_pack_ref(x, None, clip, pool.codes, pool.scale, pool.zero, torch.arange(n), g_, mult=mult,
                      codes_hi=pool.codes_hi)
    want = quantizer.quantize(x, clip, bits=bits, group=g_, meta="fp8" if fp8 else "fp16",
                              mult=None if mult is None else mult.view(hkv, 1))
    assert torch.equal(pool.code_values(torch.arange(n)), quantizer.unpack(want.codes, bits, g_).float())
    s, z = pool.scale_zero(torch.arange(n))
    ws, wz = want.scale_zero()
    assert torch.equal(s, ws.float()) and torch.equal(z, wz.float())


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c,
                                                                                      max_size=4), max_leaves=12)
RECIPE_KEYS = st.sampled_from(["model", "collect", "fit", "eval", "thresholds", "scheme", "bits", "group", "sink",
                               "tokens", "layers", "method", "methods", "tasks", "seq_lengths"])


@FAST
@given(doc=st.dictionaries(RECIPE_KEYS, VALUES, max_size=5))
def test_any_recipe_is_parsed_or_refused_in_one_line(tmp_path_factory, doc):
    p = tmp_path_factory.mktemp("r") / "r.yaml"
    p.write_text(yaml.safe_dump(doc))
    try:
        load_recipe(p)
    except ConfigError as e:
        assert "\n" not in str(e)


def _valid_manifest() -> dict:
    from test_artifact import MANIFEST

    return json.loads(json.dumps(MANIFEST.to_dict()))


@FAST
@given(path=st.lists(st.sampled_from(["scheme", "shape", "layers", "bits", "group", "sink", "recent", "n_layers",
                                      "head_dim", "model_slug", "metrics", "clip_grid", "schema_version",
                                      "fit_clip", "run_id"]), min_size=1, max_size=2), value=VALUES)
def test_any_manifest_edit_is_parsed_or_refused_in_one_line(path, value):
    d = _valid_manifest()
    target = d
    for key in path[:-1]:
        target = target.get(key) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return
    target[path[-1]] = value
    try:
        art.Manifest.from_dict(d)
    except art.ArtifactError as e:
        assert "\n" not in str(e)


@pytest.mark.parametrize("d", [2, 3, 6, 12, 48, 80, 96, 160, 192, 256])
def test_mixing_matrix_at_awkward_head_dims(d):
    """Hadamard where an order exists, DCT otherwise; orthogonal either way (the fit's H for any head dim)."""
    m, kind = rotation.mixing_matrix(d, d)
    assert kind in ("hadamard", "dct") and rotation.orthogonality_error(m) < 1e-9
