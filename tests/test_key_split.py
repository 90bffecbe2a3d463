"""Split key rows: the most-read rotated directions of a key row at 4 bits, the rest at 2 (``oscar fit --key-split``):
the scheme, the reference quantizer, the cache, the allocation's third choice, and collect -> fit -> inspect -> eval
on a tiny gemma-shaped model."""

import dataclasses
import json

import pytest
import torch
from helpers import build_llama
from oscar_kernels.scheme import QuantScheme, SchemeError
from typer.testing import CliRunner

from oscar_cli import attention as attn
from oscar_cli import quantizer
from oscar_cli.cache import OscarCache, cache_kwarg
from oscar_cli.cli import app
from oscar_cli.kvquant import LayerQuant, bits_per_element, dequantize_rows, quantize_rows, roundtrip
from oscar_cli.methods import get_method
from oscar_cli.rotation import orthogonality_error, split_rotation
from oscar_cli.sensitivity import SPLIT, Sensitivity, allocate_scheme

D = 32


def random_cov(d, seed, decay=0.8):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return q @ torch.diag(decay ** torch.arange(d, dtype=torch.float64)) @ q.T


def test_split_schemes_validate_count_their_bits_and_round_trip_their_json():
    s = QuantScheme(scale_dtype="fp8", bits_k=(2, 2, 4), bits_v=(2, 4, 2), split_k=(64, 0, 0))
    assert s.split and s.split_of(0) == 64 and s.split_of(1) == 0 and s.width(0, "k") == 2
    # a split row: 64 4-bit + 192 2-bit codes and two fp8 scale/zero pairs, over 256 elements
    assert s.unit_bits(0, "k", 256) == pytest.approx((64 * 4 + 192 * 2 + 2 * 16) / 256)
    assert s.unit_bits(0, "v", 256) == pytest.approx(2 + 16 / 256)
    want = (2.625 + 2.0625 + 2.0625 + 4.0625 + 4.0625 + 2.0625) / 6
    assert s.bits_per_element(256) == pytest.approx(want)
    assert s.describe() == "mix2-4k1v1.ks64x1.grow.fp8.s64.r256"
    d = json.loads(json.dumps(s.resolved(256).to_dict()))
    assert d["split_k"] == [64, 0, 0] and QuantScheme.from_dict(d) == s.resolved(256)
    assert "split_k" not in QuantScheme().to_dict()
    assert "splits key rows" in s.kernel_support(256)  # the torch reference serves it; the kernels refuse it
    for kw, needle in ((dict(split_k=(6,)), "multiple of 4"), (dict(split_k=(8,), bits_k=(4,), bits_v=(2,)), "2-bit keys"),
                       (dict(split_k=(8,), levels="fitted"), "uniform levels"),
                       (dict(split_k=(8, 0), bits_k=(2,), bits_v=(2,)), "same layers")):
        with pytest.raises(SchemeError, match=needle):
            QuantScheme(**kw)
    with pytest.raises(SchemeError, match="group 0"):
        QuantScheme(group=64, split_k=(8,)).resolved(256)
    with pytest.raises(SchemeError, match="fewer than 32"):
        QuantScheme(split_k=(32,)).resolved(32)
    with pytest.raises(SchemeError, match="2 layers, the model has 3"):
        QuantScheme(split_k=(8, 0)).check_layers(3)


def test_split_rows_quantize_each_part_on_its_own_and_hold_the_bytes_the_scheme_counts():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 10, D) * torch.linspace(4, 0.5, D)
    clip_hi, clip_lo = torch.tensor([1.0, 0.9, 0.95]), torch.tensor([0.7, 0.6, 0.65])
    lq = LayerQuant(2, 2, D, None, None, clip_lo, torch.ones(3), split_k=8, clip_k_hi=clip_hi)
    rows = quantize_rows(x, lq, "k")
    assert isinstance(rows, quantizer.SplitRows) and rows.hi.bits == 4 and rows.lo.bits == 2
    hi = quantizer.quantize(x[..., :8], clip_hi.view(-1, 1, 1), 4, 8)
    lo = quantizer.quantize(x[..., 8:], clip_lo.view(-1, 1, 1), 2, D - 8)
    assert torch.equal(rows.hi.codes, hi.codes) and torch.equal(rows.lo.scale, lo.scale)
    back = dequantize_rows(rows, lq, "k")
    assert torch.equal(back, torch.cat([quantizer.dequantize(hi), quantizer.dequantize(lo)], -1))
    scheme = QuantScheme(split_k=(8,))
    assert rows.nbytes * 8 / x.numel() == pytest.approx(scheme.unit_bits(0, "k", D))
    # the leading channels carry the energy here: the split's error there is a fraction of uniform INT2's
    plain = roundtrip(x, dataclasses.replace(lq, split_k=0, clip_k_hi=None), "k")
    err = lambda y: (y - x)[..., :8].pow(2).mean()  # noqa: E731
    assert err(back) < 0.2 * err(plain)
    # a rotated, FP8 split layer round-trips through its rotation and multipliers
    r = split_rotation(random_cov(D, 1), random_cov(D, 2), 8).float()[None]
    assert orthogonality_error(r[0]) < 1e-5
    mult = torch.full((3,), 2.0 ** -6)
    lq8 = LayerQuant(2, 2, D, r, r, clip_lo, torch.ones(3), meta="fp8", mult_k=mult, mult_v=mult, split_k=8,
                     clip_k_hi=clip_hi, mult_k_hi=mult)
    y = roundtrip(x, lq8, "k")
    assert y.shape == x.shape and (y - x).pow(2).mean() < 0.2 * x.pow(2).mean()


def test_the_allocation_offers_split_keys_as_a_third_choice():
    kl = {(0, "k"): 0.5, (0, "v"): 0.01, (1, "k"): 0.4, (1, "v"): 0.3}
    attn_err = {(i, kind, w): torch.tensor([1.0 if w == 2 else 0.05]) for i in (0, 1) for kind in "kv" for w in (2, 4)}
    logit = {(i, w): torch.tensor([0.1]) for i in (0, 1) for w in (2, 4)}
    sens = Sensitivity(2, (2, 4), kl, attn_err, logit, 1024, split=64, split_clips=(1.0, 0.6),
                       kl_split={0: 0.03, 1: 0.35})
    scheme = QuantScheme(scale_dtype="fp8")
    # per element at d 256: INT2 2.0625, split 2.625, INT4 4.0625. A budget of 2.3 pays for one split (2.203 over 4
    # units) but not two (2.344) nor a 4-bit unit (2.5625): layer 0's keys, whose split buys the most
    s, choice = allocate_scheme(sens, scheme, 256, 2, 2.3)
    assert choice[(0, "k")] == SPLIT and s.split_k == (64, 0) and s.bits_k == (2, 2) and s.bits_v == (2, 2)
    assert s.bits_per_element(256) == pytest.approx((2.625 + 3 * 2.0625) / 4)
    assert sens.unit_kl(0, "k", SPLIT) == 0.03 and sens.unit_kl(0, "k", 4) == pytest.approx(0.025)
    # 2.75 pays for a split and a 4-bit unit (2.703): layer 1's keys at 4 bits (0.4 -> 0.02) beat their split (0.35)
    # and layer 1's values at 4 bits (0.3 -> 0.015); 4-bit keys in layer 0 with layer 1's split buy less (0.525
    # against 0.85)
    s, choice = allocate_scheme(sens, scheme, 256, 2, 2.75)
    assert s.split_k == (64, 0) and s.bits_k == (2, 4) and s.bits_v == (2, 2)
    # without split measurements the choice is not offered
    s, _ = allocate_scheme(dataclasses.replace(sens, split=0, kl_split={}), scheme, 256, 2, 2.3)
    assert s.split_k == ()
    back = Sensitivity.from_dict(json.loads(json.dumps(sens.to_dict())))
    assert back.split == 64 and back.split_clips == (1.0, 0.6) and back.kl_split == sens.kl_split


def test_the_cache_decodes_split_keys_as_the_decode_equivalent_attention_and_holds_the_counted_bytes():
    model = build_llama(dtype=torch.float32, seed=0, pad_token_id=0)
    r = torch.stack([split_rotation(random_cov(D, 3 + h), random_cov(D, 7 + h), 8) for h in range(2)]).float()
    one = torch.ones(2)
    lq = LayerQuant(2, 2, D, r, r, one * 0.7, one, split_k=8, clip_k_hi=one)
    quants = [lq, dataclasses.replace(lq, split_k=0, clip_k_hi=None)]
    scheme = QuantScheme(sink=3, recent=6, bits_k=(2, 2), bits_v=(2, 2), split_k=(8, 0)).resolved(D)
    kw = cache_kwarg(model)
    prompt = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = OscarCache(model, quants, scheme)
        out = model(prompt, **{kw: cache}, use_cache=True)
        logits, seq = [out.logits], prompt
        for _ in range(8):
            nxt = logits[-1][:, -1:].argmax(-1)
            seq = torch.cat([seq, nxt], 1)
            logits.append(model(nxt, **{kw: cache}, use_cache=True).logits)
        attn.install(model, quants, scheme)
        tf = model(seq, use_cache=False).logits
    assert isinstance(cache.layers[0].codes_k, quantizer.SplitRows)
    cached = torch.cat(logits, 1)
    torch.testing.assert_close(cached, tf[:, : cached.shape[1]], atol=2e-4, rtol=1e-4)
    n = cache.get_seq_length()
    assert n == seq.shape[1]
    expect = bits_per_element(get_method("oscar"), scheme, n, D, n_layers=2, exact_bits=32)
    assert cache.bits_per_element() == pytest.approx(expect, rel=1e-12)


TINY = ["--tokens", "1024", "--seq-len", "64", "--batch-size", "4", "--reservoir", "96"]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_split_keys_through_collect_fit_inspect_and_eval(tmp_path, tiny_gemma_dir):
    from oscar_kernels import Int2KVPool

    from oscar_cli.artifact import load_artifact
    from oscar_cli.kvquant import build_layer_quants

    store, arts = tmp_path / "store", tmp_path / "artifacts"
    assert invoke("collect", "--model", tiny_gemma_dir, "--store", store, *TINY).exit_code == 0
    base = ["fit", "--store", store, "--artifacts", arts, "--sink", "2", "--recent", "4", "--scale-dtype", "fp8"]
    r = invoke(*base, "--key-split", "8")
    assert r.exit_code == 1 and "give bits_per_element" in r.output and not arts.exists()
    r = invoke(*base, "--key-split", "32", "--bits-per-element", "3", "--sensitivity-tokens", "128")
    assert r.exit_code == 1 and "fewer than 32" in r.output and not arts.exists()
    # head dim 32, fp8: INT2 2.5 bits, split 8 of 32 3.5, INT4 4.5. At 64 tokens the three sliding layers hold 16 rows
    # and the global one 64: a budget of 2.58 pays for one sliding layer's split keys and nothing else
    r = invoke(*base, "--key-split", "8", "--bits-per-element", "2.58", "--sensitivity-tokens", "128", "--context", "64",
               "--model", tiny_gemma_dir)
    assert r.exit_code == 0, r.output
    art = load_artifact(next(arts.glob("*/v1")))
    sch = art.scheme
    assert sum(m > 0 for m in sch.split_k) == 1 and set(sch.split_k) == {0, 8} and not sch.mixed, sch
    layer = sch.split_k.index(8)
    assert layer in (0, 1, 2) and "split keys" in r.output
    sens = art.manifest.metrics["sensitivity"]
    assert sens["split"] == 8 and all("kl_k_split" in row for row in sens["layers"].values())
    hi, lo = sens["split_clips"]
    assert (hi, lo) in {(h, c) for h in (0.9, 1.0) for c in (0.55, 0.6, 0.65, 0.7)}
    t = art.tensors
    assert torch.all(t["clip_k_hi"][layer] == hi) and torch.all(t["clip_k"][layer] == lo)
    assert t["mult_k_hi"].shape == t["mult_k"].shape and orthogonality_error(t["r_k"][layer][0]) < 1e-5
    assert art.manifest.metrics["allocation"]["bits_per_element"] <= 2.58
    report = json.loads(invoke("inspect", "latest", "--store", store, "--json").output)
    assert [x["split_k"] for x in report["layers"]] == list(sch.split_k)
    r = invoke("inspect", "latest", "--store", store)
    assert r.exit_code == 0, r.output
    # eval reads the split from the artifact (the quantized rows are read past the 16-token window)
    data = tmp_path / "text.txt"
    from oscar_cli.data import heldout_text

    data.write_text(heldout_text()[:20000])
    r = invoke("eval", "--model", tiny_gemma_dir, "--store", store, "--tasks", "oscar_ppl", "--methods", "bf16,oscar",
               "--artifact", art.path, "--seq-lengths", "64", "--limit", "2", "--data", data, "--json")
    assert r.exit_code == 0, r.output
    rows = {x["method"]: x for x in json.loads(r.stdout)}
    assert rows["oscar"]["config"]["scheme"]["split_k"] == list(sch.split_k)
    assert rows["oscar"]["value"] != rows["bf16"]["value"]
    quants = build_layer_quants(get_method("oscar"), sch, 4, 32, 1, art)
    assert quants[layer].split_k == 8 and torch.all(quants[layer].clip_k_hi == hi)
    # the kernels' pool refuses a split scheme with one line (the cache then serves it through the torch reference)
    with pytest.raises(SchemeError, match="splits key rows"):
        Int2KVPool(sch, 4, 1, 32, 8, 1, t["r_k"], t["r_v"])
    # an artifact whose tensors lack the split's clips is refused on load
    from safetensors.torch import load_file, save_file

    f = art.path / "rotations.safetensors"
    tensors = load_file(str(f))
    del tensors["clip_k_hi"]
    save_file(tensors, str(f))
    from oscar_cli.artifact import ArtifactError

    with pytest.raises(ArtifactError, match="lack clip_k_hi|content"):
        load_artifact(art.path)
