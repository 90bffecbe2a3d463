"""OscarCache's kernel backend (the Triton plan/run kernels on an Int2KVPool; the interpreter on CPU) against the
torch reference backend: prefill, chunked prefill and decode steps, left padding, per-head clips, pool growth.
On a GPU machine the models run on CUDA (the kernels compiled for the device)."""

import pytest
import torch
from helpers import build_llama

from oscar_cli.cache import OscarCache, cache_kwarg
from oscar_cli.config import QuantScheme
from oscar_cli.errors import OscarError
from oscar_cli.kvquant import LayerQuant, build_layer_quants
from oscar_cli.methods import get_method, scheme_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"
D = 64 if DEV == "cuda" else 32  # on CUDA the decode kernel refuses head dims under 64 (CUDA_MIN_HEAD_DIM)


def tiny(device=DEV):
    return build_llama(head_dim=D, pad_token_id=0).to(device)


def per_head_quants(n_layers=2, h=2):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n_layers):
        rk = torch.linalg.qr(torch.randn(h, D, D, generator=g, dtype=torch.float64))[0].float()
        rv = torch.linalg.qr(torch.randn(h, D, D, generator=g, dtype=torch.float64))[0].float()
        out.append(LayerQuant(2, D, rk, rv, torch.tensor([0.9, 0.8]), torch.tensor([0.85, 0.95])))
    return out


def quants_for(kind, scheme):
    if kind == "per-head":
        return per_head_quants()
    m = get_method(kind)
    return build_layer_quants(m, scheme_for(m, D, windows=scheme), 2, D, 2)


def steps(model, cache, x, mask, chunks, decode_steps):
    """Prefill ``x`` in ``chunks`` pieces, then greedy-free decode of fixed tokens; returns the logits of every step."""
    kw = cache_kwarg(model)
    out, seen = [], 0
    with torch.no_grad():
        for c in chunks:
            part = x[:, seen:seen + c]
            seen += c
            out.append(model(part, attention_mask=mask[:, :seen], **{kw: cache}, use_cache=True).logits)
        m = mask
        for t in range(decode_steps):
            nxt = torch.full((x.shape[0], 1), 7 + t, device=x.device)
            m = torch.cat([m, torch.ones_like(nxt)], 1)
            out.append(model(nxt, attention_mask=m, **{kw: cache}, use_cache=True).logits)
    return torch.cat(out, 1)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind,chunks", [("per-head", (24,)), ("int2-hadamard", (9, 15)), ("int2-naive", (24,))])
def test_kernel_backend_matches_the_reference(kind, chunks):
    model = tiny()
    scheme = QuantScheme(sink=3, recent=5)
    q = quants_for(kind, scheme)
    x = torch.randint(1, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x)
    mask[1, :5] = 0  # row 1 is left-padded
    x[1, :5] = 0
    x, mask = x.to(DEV), mask.to(DEV)
    ref_cache = OscarCache(model, q, scheme, backend="reference")
    ref = steps(model, ref_cache, x, mask, chunks, 4)
    ker_cache = OscarCache(model, q, scheme, backend="kernels")
    got = steps(model, ker_cache, x, mask, chunks, 4)
    assert ker_cache.backend == "kernels" and ref_cache.backend == "reference"
    assert torch.isfinite(got).all()
    real = torch.ones(2, got.shape[1], dtype=torch.bool, device=got.device)
    real[1, :5] = False  # pad positions' outputs are undefined in both
    assert rel(got[real], ref[real]) < 2e-2
    assert not torch.equal(got, ref)  # really a different code path (bf16 exact rows)
    # the quantization is visible: the reference itself differs from exact attention
    exact = steps(model, OscarCache(model, [None, None], scheme), x, mask, chunks, 4)
    assert rel(ref[real], exact[real]) > 2 * rel(got[real], ref[real])


def test_pool_grows_and_generate_runs_through_the_kernels(monkeypatch):
    import oscar_cli.cache_kernels as ck

    monkeypatch.setattr(ck, "MIN_CAPACITY", 8)  # force two doublings
    model = tiny()
    scheme = QuantScheme(sink=2, recent=4)
    q = per_head_quants()
    x = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(3)).to(DEV)
    kw = cache_kwarg(model)
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                             **{kw: OscarCache(model, q, scheme, backend="reference")})
        cache = OscarCache(model, q, scheme, backend="kernels")
        got = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False, **{kw: cache})
    assert cache.kernel_state.capacity == 32 and cache.get_seq_length() == 31
    assert (got[0] == ref[0]).float().mean() > 0.9  # greedy tokens agree up to bf16 rounding of exact rows
    assert cache.nbytes() == cache.kernel_state.pool.nbytes


def test_backend_choice_and_refusals(monkeypatch):
    from oscar_cli.cache_kernels import kernel_ready

    model = tiny("cpu")
    scheme = QuantScheme(sink=2, recent=4)
    assert OscarCache(model, per_head_quants(), scheme).backend == "reference"  # auto on CPU
    # head dim 32 runs in the interpreter; on CUDA the decode kernel refuses it, so `auto` there takes the reference
    assert kernel_ready(per_head_quants()[0], scheme, 32) is None
    assert "head dim >= 64" in kernel_ready(per_head_quants()[0], scheme, 32, "cuda")
    import dataclasses

    for flag, words in (("int8_scores", "int8 scores"), ("int8_values", "int8 values")):
        lq = dataclasses.replace(per_head_quants()[0], **{flag: True})
        assert words in kernel_ready(lq, scheme, 32) and "reference attention emulates it" in kernel_ready(lq, scheme, 32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(OscarError, match="runs on CUDA tensors and the model is on cpu"):
        OscarCache(model, per_head_quants(), scheme, backend="kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kivi = quants_for("int2-kivi", scheme)
    with pytest.raises(OscarError, match="layer 0: per-channel"):
        OscarCache(model, kivi, scheme, backend="kernels")
    four = build_layer_quants(get_method("int4-hadamard"), scheme_for(get_method("int4-hadamard"), D), 2, D, 2)
    with pytest.raises(OscarError, match="4-bit codes"):
        OscarCache(model, four, scheme, backend="kernels")
    with pytest.raises(OscarError, match="unknown cache backend"):
        OscarCache(model, kivi, scheme, backend="fast")
