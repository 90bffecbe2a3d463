"""Budgeted bit allocation (an exact multiple-choice knapsack), mixed-width schemes and FP8 scale/zero, and the
sensitivity pass through a tiny model."""

import itertools
import json
import random

import pytest
import torch
from oscar_kernels.scheme import QuantScheme, SchemeError

from oscar_cli import quantizer
from oscar_cli.kvquant import EXACT, LayerQuant, roundtrip
from oscar_cli.sensitivity import AllocationError, Sensitivity, allocate, allocate_scheme


def brute_force(losses, weights, costs, budget):
    units = list(losses)
    total_w = sum(weights.values())
    best = None
    for pick in itertools.product(*(sorted(losses[u]) for u in units)):
        bits = sum(costs[b] * weights[u] for u, b in zip(units, pick, strict=True)) / total_w
        if bits <= budget + 1e-12:
            loss = sum(losses[u][b] for u, b in zip(units, pick, strict=True))
            if best is None or loss < best - 1e-12:
                best = loss
    return best


@pytest.mark.parametrize("seed", range(12))
def test_allocation_solves_planted_knapsacks_exactly(seed):
    rng = random.Random(seed)
    n = rng.randint(3, 8)
    widths = [2, 4] if seed % 2 else [2, 3, 4]
    costs = {2: 2.25, 3: 3.25, 4: 4.25}
    units = [(i, k) for i in range(n) for k in "kv"][: n]
    weights = {u: rng.choice([64, 128, 192]) for u in units}
    losses = {}
    for u in units:
        loss2 = rng.uniform(0.01, 1.0)
        losses[u] = {w: loss2 / (1 + rng.uniform(0, 30) * (w - 2)) for w in widths}
    budget = rng.uniform(2.3, 3.8)
    choice = allocate(losses, weights, {w: costs[w] for w in widths}, budget)
    used = sum(costs[choice[u]] * weights[u] for u in units) / sum(weights.values())
    assert used <= budget + 1e-9
    assert sum(losses[u][choice[u]] for u in units) == pytest.approx(brute_force(losses, weights, costs, budget))


def test_allocation_spends_the_budget_where_it_buys_most_and_refuses_an_impossible_one():
    losses = {"a": {2: 1.0, 4: 0.9}, "b": {2: 5.0, 4: 0.1}, "c": {2: 2.0, 4: 0.2}}
    w = {u: 1 for u in losses}
    assert allocate(losses, w, {2: 2.5, 4: 4.5}, 2.5) == {"a": 2, "b": 2, "c": 2}
    assert allocate(losses, w, {2: 2.5, 4: 4.5}, 3.2) == {"a": 2, "b": 4, "c": 2}  # one upgrade: the largest gain
    assert allocate(losses, w, {2: 2.5, 4: 4.5}, 3.9) == {"a": 2, "b": 4, "c": 4}
    with pytest.raises(AllocationError, match="below the cheapest allocation"):
        allocate(losses, w, {2: 2.5, 4: 4.5}, 2.4)


def test_allocate_scheme_records_per_layer_widths_from_measured_sensitivity():
    kl = {(0, "k"): 0.5, (0, "v"): 0.01, (2, "k"): 0.02, (2, "v"): 0.3}
    attn = {(i, kind, w): torch.tensor([1.0 if w == 2 else 0.05]) for i in (0, 2) for kind in "kv" for w in (2, 4)}
    sens = Sensitivity(2, (2, 4), kl, attn, {}, 1024)
    assert sens.predicted_kl(0, "k", 4) == pytest.approx(0.025)
    # 4 units at 2.25 bits (fp8 scales, group 64); a budget of 2.75 pays for one 4-bit unit: layer 0's keys
    scheme, choice = allocate_scheme(sens, QuantScheme(group=64, scale_dtype="fp8"), 64, 3, 2.75)
    assert scheme.bits_k == (4, 2, 2) and scheme.bits_v == (2, 2, 2) and choice[(0, "k")] == 4
    assert scheme.bits_per_element(64, [0, 2]) == pytest.approx(2.75)
    scheme, _ = allocate_scheme(sens, QuantScheme(group=64, scale_dtype="fp8"), 64, 3, 3.25)
    assert scheme.bits_k == (4, 2, 2) and scheme.bits_v == (2, 2, 4)


def test_mixed_schemes_round_trip_and_run_in_the_kernels():
    s = QuantScheme(group=64, scale_dtype="fp8", bits_k=(2, 4, 2), bits_v=(2, 2, 4))
    assert s.mixed and s.width(1, "k") == 4 and s.width(1, "v") == 2 and s.width(2, "v") == 4
    assert s.bits_per_element(64) == pytest.approx((2 + 2 + 4 + 2 + 2 + 4) / 6 + 16 / 64)
    assert s.describe() == "mix2-4k1v1.g64.fp8.s64.r256"
    d = json.loads(json.dumps(s.to_dict()))
    assert d["bits_k"] == [2, 4, 2] and QuantScheme.from_dict(d) == s
    assert "bits_k" not in QuantScheme().to_dict()  # a uniform scheme reads as before
    assert s.kernel_support(64) is None  # an allocation of 2- and 4-bit codes, FP8 scales: the kernels run it
    assert QuantScheme(scale_dtype="fp8").kernel_support(64) is None  # FP8 scales run in the kernels
    assert QuantScheme(bits_k=(2, 2), bits_v=(2, 2)).kernel_support(64) is None  # an allocation of INT2 only
    for kw, needle in ((dict(bits_k=(2, 3), bits_v=(2, 2)), "code widths"), (dict(bits_k=(2,), bits_v=()), "same"),
                       (dict(scale_dtype="fp4"), "scale_dtype")):
        with pytest.raises(SchemeError, match=needle):
            QuantScheme(**kw)
    with pytest.raises(SchemeError, match="3 layers, the model has 4"):
        s.check_layers(4)


def test_fp8_scales_store_half_the_metadata_and_round_trip_close_to_fp16():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 64) * torch.tensor([1e-4, 1.0, 300.0]).view(1, 3, 1, 1)  # heads of very unlike scale
    q16 = quantizer.quantize(x, 0.9, 2, 64)
    lo, hi = quantizer.clip_bounds(x, 0.9, 64)
    mult = quantizer.meta_multiplier((hi - lo) / 3, lo, (0, 2, 3))
    assert mult.shape == (1, 3, 1, 1) and torch.all(torch.log2(mult) == torch.round(torch.log2(mult)))
    q8 = quantizer.quantize(x, 0.9, 2, 64, "fp8", mult)
    assert q8.scale.dtype == torch.float8_e4m3fn and q8.nbytes == q16.nbytes - 2 * q16.scale.numel()
    e16 = (quantizer.dequantize(q16) - x).pow(2).mean((0, 2, 3))
    e8 = (quantizer.dequantize(q8) - x).pow(2).mean((0, 2, 3))
    assert torch.all(e8 < 1.3 * e16), (e8, e16)  # every head, whatever its scale
    # one multiplier for all heads leaves the smallest head's scales at e4m3's floor: far worse there
    q_one = quantizer.quantize(x, 0.9, 2, 64, "fp8", quantizer.meta_multiplier((hi - lo) / 3, lo, (0, 1, 2, 3)))
    assert (quantizer.dequantize(q_one) - x).pow(2).mean((0, 2, 3))[0] > 2 * e16[0]


def test_an_exact_kind_is_left_alone_by_the_round_trip():
    lq = LayerQuant(2, EXACT, 64, None, None, torch.ones(1), torch.ones(1))
    x = torch.randn(1, 2, 5, 64)
    assert torch.equal(roundtrip(x, lq, "v"), x) and not torch.equal(roundtrip(x, lq, "k"), x.float())


def test_key_centering_is_the_same_attention_as_every_key_row_centered():
    """Quantizing k - mu and adding mu back (what the cache reads) attends exactly like centering every key row,
    INT2 and exact alike, without adding it back: the softmax ignores the per-query shift q.mu."""
    from oscar_cli.attention import mixed_attention, rt_mask

    torch.manual_seed(1)
    b, hkv, hq, n, d = 1, 2, 4, 24, 64
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hkv, n, d) + 3.0, torch.randn(b, hkv, n, d)
    mu = k.mean((0, 2))  # [H, d]
    r = torch.linalg.qr(torch.randn(hkv, d, d))[0]
    plain = LayerQuant(2, 2, 64, r, r, torch.ones(hkv), torch.ones(hkv))
    centered = LayerQuant(2, 2, 64, r, r, torch.ones(hkv), torch.ones(hkv), center_k=mu)
    q_pos = torch.arange(n)
    allowed = (torch.arange(n)[None, :] <= q_pos[:, None])[None, None]
    use = rt_mask(q_pos, 2, n - 2, torch.tensor([2]), 2, 4, 1)
    v_rt = roundtrip(v[:, :, 2:], plain, "v")
    a = mixed_attention(q, k, v, allowed, 0.125, roundtrip(k[:, :, 2:], centered, "k"), v_rt, use, 2)
    kc = k - mu[None, :, None, :]
    b_ = mixed_attention(q, kc, v, allowed, 0.125, roundtrip(kc[:, :, 2:], plain, "k"), v_rt, use, 2)
    torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-4)
    # and centering changes what is stored: the keys' offset no longer spends the INT2 range
    err_c = (roundtrip(k, centered, "k") - k).pow(2).mean()
    err_p = (roundtrip(k, plain, "k") - k).pow(2).mean()
    assert err_c < err_p


def test_a_centered_scheme_records_its_centers_and_runs_in_the_kernels():
    s = QuantScheme(group=64, center_keys=True)
    assert s.describe() == "int2.g64.ck.s64.r256" and QuantScheme.from_dict(s.to_dict()) == s
    assert "center_keys" not in QuantScheme().to_dict()
    assert s.kernel_support(64) is None
    with pytest.raises(SchemeError, match="center_keys must be true or false"):
        QuantScheme(center_keys="yes")


def test_lloyd_max_recovers_a_planted_codebook_and_fitted_levels_round_trip():
    g = torch.Generator().manual_seed(3)
    centers = torch.tensor([0.3, 1.2, 1.6, 2.8], dtype=torch.float64)
    u = torch.cat([c + 0.04 * torch.randn(4000, generator=g, dtype=torch.float64) for c in centers]).clamp(0, 3)
    torch.testing.assert_close(quantizer.lloyd_max(u, None, 2), centers, atol=5e-3, rtol=0)
    # weights move a level toward the heavier points
    w = torch.where(u > 2.4, 10.0, 1.0)
    assert quantizer.lloyd_max(u, w, 2)[3] > quantizer.lloyd_max(u, None, 2)[3] - 1e-9
    # uniform levels as a table are the uniform quantizer; fitted ones beat it on the rows they were fitted to
    x = torch.randn(1, 2, 50, 64) ** 3  # heavy-tailed rows
    uni = torch.arange(4.0).expand(2, 1, 1, 4)
    assert torch.equal(quantizer.fake_quant(x, 1.0, 2, 64, table=uni), quantizer.fake_quant(x, 1.0, 2, 64))
    lo, hi = quantizer.clip_bounds(x, 1.0, 64)
    un = ((x - lo) / ((hi - lo) / 3)).clamp(0, 3)  # one group per row: lo, hi [1, 2, 50, 1]
    fitted = torch.stack([quantizer.lloyd_max(un[0, h], None, 2) for h in range(2)]).float().view(2, 1, 1, 4)
    e_fit = (quantizer.fake_quant(x, 1.0, 2, 64, table=fitted) - x).pow(2).mean()
    e_uni = (quantizer.fake_quant(x, 1.0, 2, 64) - x).pow(2).mean()
    assert e_fit < 0.8 * e_uni
    with pytest.raises(SchemeError, match="fitted levels are 2-bit"):
        QuantScheme(bits=4, levels="fitted")
    assert "uniform levels" in QuantScheme(levels="fitted").kernel_support(64)


def test_a_budget_is_met_in_bytes_at_its_context_where_sliding_layers_hold_only_their_window():
    from types import SimpleNamespace

    from oscar_cli.models import layer_tokens

    cfg = SimpleNamespace(num_hidden_layers=4, sliding_window=512,
                          layer_types=["sliding_attention"] * 3 + ["full_attention"])
    assert layer_tokens(cfg, 32768) == [512, 512, 512, 32768] and layer_tokens(cfg, 100) == [100] * 4
    assert layer_tokens(SimpleNamespace(num_hidden_layers=2), 64) == [64, 64]  # no layer types: all global
    kl = {(i, kind): 1.0 for i in range(4) for kind in "kv"}
    kl[(3, "k")] = 0.5  # the global layer's keys gain less than any sliding unit...
    attn = {(i, kind, w): torch.tensor([1.0 if w == 2 else 0.0]) for i in range(4) for kind in "kv" for w in (2, 4)}
    sens = Sensitivity(2, (2, 4), kl, attn, {}, 64)
    base = QuantScheme(group=64, scale_dtype="fp8")
    tokens = layer_tokens(cfg, 32768)
    # ...and costs 64x more bytes per upgrade: a budget of 2.5 at 32k upgrades all six sliding units, not it
    s, _ = allocate_scheme(sens, base, 64, 4, 2.5, tokens)
    assert s.bits_k == (4, 4, 4, 2) and s.bits_v == (4, 4, 4, 2)
    assert s.bits_per_element(64, range(4), tokens) <= 2.5
    # counted by layers alone (equal weights) the same budget buys just one unit
    s_eq, _ = allocate_scheme(sens, base, 64, 4, 2.5)
    assert sum(w == 4 for w in (*s_eq.bits_k, *s_eq.bits_v)) == 1


def test_sensitivity_round_trips_its_json_form():
    attn = {(i, kind, w): torch.tensor([0.5, 0.25]) / w for i in (0, 3) for kind in "kv" for w in (2, 4)}
    logit = {(i, w): torch.tensor([0.1, 0.2]) for i in (0, 3) for w in (2, 4)}
    s = Sensitivity(2, (2, 4), {(i, kind): 0.1 * i + (kind == "v") for i in (0, 3) for kind in "kv"}, attn, logit, 256)
    back = Sensitivity.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.kl == s.kl and back.widths == s.widths and back.tokens == 256
    assert all(torch.equal(back.attn[k], v) for k, v in s.attn.items())
    assert back.predicted_kl(3, "k", 4) == pytest.approx(s.predicted_kl(3, "k", 4))


def test_the_gaussian_codebook_baseline_beats_uniform_levels_on_gaussian_rows():
    from oscar_cli.kvquant import build_layer_quants
    from oscar_cli.methods import get_method, scheme_for

    t = quantizer.gaussian_table(64)
    assert t.shape == (4,) and torch.all(t.diff() > 0) and 0 < t[0] < 1 and 2 < t[3] < 3
    m = get_method("int2-hadamard-gauss")
    s = scheme_for(m, 64)
    assert s.levels == "gaussian" and "uniform levels" in s.kernel_support(64)
    lq = build_layer_quants(m, s, 1, 64, 2)[0]
    uni = build_layer_quants(get_method("int2-hadamard"), scheme_for(get_method("int2-hadamard"), 64), 1, 64, 2)[0]
    x = torch.randn(1, 2, 400, 64, generator=torch.Generator().manual_seed(0))
    e_g = (roundtrip(x, lq, "k") - x).pow(2).mean()
    e_u = (roundtrip(x, uni, "k") - x).pow(2).mean()
    assert e_g < 0.8 * e_u, (e_g, e_u)
