"""OscarCache decode steps through the Triton kernels (interpreter on CPU) equal the torch reference path."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oscar_cli import fused
from oscar_cli.cache import cache_kwarg, make_cache
from oscar_cli.config import QuantScheme
from oscar_cli.kvquant import LayerQuant, build_layer_quants
from oscar_cli.methods import get_method, scheme_for


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def per_head_quants(n_layers=2, d=32, h=2):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n_layers):
        rk = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()
        rv = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()
        out.append(LayerQuant(2, 32, rk, rv, torch.tensor([0.9, 0.8]), torch.tensor([0.85, 0.95])))
    return out


def run(model, quants, x, mask, steps, use_kernels, monkeypatch):
    monkeypatch.setattr(fused, "FORCE", use_kernels)
    calls = {"n": 0}
    real = fused.decode

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(fused, "decode", counted)
    kw = cache_kwarg(model)
    cache = make_cache(model, get_method("oscar"), quants, QuantScheme(sink=3, recent=5))
    with torch.no_grad():
        logits = [model(x, attention_mask=mask, **{kw: cache}, use_cache=True).logits[:, -1]]
        seq, m = x, mask
        for t in range(steps):
            nxt = torch.full((x.shape[0], 1), 7 + t)
            seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
            logits.append(model(nxt, attention_mask=m, **{kw: cache}, use_cache=True).logits[:, -1])
    return torch.stack(logits), calls["n"]


@pytest.mark.parametrize("kind", ["per-head", "hadamard"])
def test_kernel_decode_steps_match_the_reference_path(kind, monkeypatch):
    model = tiny_llama()
    had = get_method("int2-hadamard")
    quants = per_head_quants() if kind == "per-head" else build_layer_quants(had, scheme_for(had, 32), 2, 32, 2)
    x = torch.randint(1, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x)
    mask[1, :5] = 0  # left padding in row 1
    x[1, :5] = 0
    ref, n_ref = run(model, quants, x, mask, 6, False, monkeypatch)
    got, n_kernel = run(model, quants, x, mask, 6, True, monkeypatch)
    assert n_ref == 0 and n_kernel == 6 * 2  # every decode step of both layers went through the kernels
    assert torch.isfinite(got).all()
    rel = (got - ref).norm() / ref.norm()
    assert rel < 2e-2, rel
    assert not torch.equal(got, ref)  # really a different code path (bf16 exact rows)


def test_layouts_the_kernels_do_not_cover_stay_on_the_reference(monkeypatch):
    monkeypatch.setattr(fused, "FORCE", True)
    model = tiny_llama()
    w = QuantScheme(sink=3, recent=5)
    kv = get_method("int2-kivi")
    kivi = build_layer_quants(kv, scheme_for(kv, 32, windows=w), 2, 32, 2)
    layer = make_cache(model, kv, kivi, scheme_for(kv, 32, windows=w)).layers[0]
    assert not fused.usable(layer, torch.zeros(1, 4, 1, 32))
    h4 = get_method("int4-hadamard")
    four = build_layer_quants(h4, scheme_for(h4, 32, windows=w), 2, 32, 2)
    layer = make_cache(model, h4, four, scheme_for(h4, 32, windows=w)).layers[0]
    assert not fused.usable(layer, torch.zeros(1, 4, 1, 32))
