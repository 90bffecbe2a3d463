"""OscarCache's kernel backend (the Triton plan/run kernels on an Int2KVPool; the interpreter on CPU) against the
torch reference backend: prefill, chunked prefill and decode steps, left padding, per-head clips, pool growth.
On a GPU machine the models run on CUDA (the kernels compiled for the device)."""

import dataclasses

import pytest
import torch
from helpers import build_llama
from oscar_kernels.scheme import DecodeOptions

from oscar_cli.cache import OscarCache, cache_kwarg
from oscar_cli.config import QuantScheme
from oscar_cli.errors import OscarError
from oscar_cli.kvquant import EXACT, LayerQuant, build_layer_quants
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
        out.append(LayerQuant(2, 2, D, rk, rv, torch.tensor([0.9, 0.8]), torch.tensor([0.85, 0.95])))
    return out


def fp8_quants(n_layers=2, h=2):
    """:func:`per_head_quants` with FP8 scales and zeros: per-head multipliers of two binades."""
    mult = torch.tensor([2.0 ** -6, 2.0 ** -4])
    return [dataclasses.replace(lq, meta="fp8", mult_k=mult, mult_v=mult.flip(0)) for lq in per_head_quants(n_layers, h)]


def centered_quants():
    """:func:`fp8_quants` with centered keys: a center per layer and KV head, far from the keys' own mean (the model
    basis; the reference subtracts it before rotating, the kernels their rotated copy after)."""
    g = torch.Generator().manual_seed(3)
    return [dataclasses.replace(lq, center_k=torch.randn(2, D, generator=g) * 2 + 1) for lq in fp8_quants()]


def mixed_quants():
    """:func:`per_head_quants` with an allocation: 4-bit keys in layer 0, 4-bit values in layer 1."""
    a, b = per_head_quants()
    return [dataclasses.replace(a, bits_k=4), dataclasses.replace(b, bits_v=4)]


def quants_for(kind, scheme):
    if kind == "per-head":
        return per_head_quants()
    if kind == "per-head-fp8":
        return fp8_quants()
    if kind == "mixed-widths":
        return mixed_quants()
    if kind == "centered-fp8":
        return centered_quants()
    m = get_method(kind)
    return build_layer_quants(m, scheme_for(m, D, reference=scheme), 2, D, 2)


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


LAYER0_TOL = 4e-3
"""Layer 0's attention output, kernels against the reference: both read the same INT2 codes of the same rows, and the
kernels hold the exact (sink, recent) rows in bf16: two bf16 steps (2^-8) bound the relative difference (measured
~1.5e-3 on every kind); an off-by-one sink or recent changes it by ~5e-2."""
LOGITS_TOL = 1.5e-2
"""The logits after both layers: layer 0's bf16 differences move layer 1's rows, and a few of its INT2 codes flip
(measured up to ~1e-2); an off-by-one sink or recent moves them by ~5e-2."""
GENERATE_TOLS = (3e-2, 1e-2)
"""(logits, layer-0 output) bounds of a 20-step generation through a pool that grows twice: on a GPU its decode steps
run the kernels' fp16/bf16 tensor-core products, whose relative output error the kernel tests bound by 1e-2; the
logits compound two layers of it (an H200 measured 2.0e-2 on the prefill's logits with layer 0 at 1.8e-3). A cache
keeping one recent row fewer moves them by ~6e-2 from the first step (measured on the CPU)."""


def steps_and_layer0(model, cache, x, mask, chunks, decode_steps):
    """:func:`steps` plus layer 0's attention output at every step (``[B, T, Hq * d]``)."""
    seen = []
    hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    try:
        logits = steps(model, cache, x, mask, chunks, decode_steps)
    finally:
        hook.remove()
    return logits, torch.cat(seen, 1)


@pytest.mark.parametrize("kind,chunks", [("per-head", (24,)), ("int2-hadamard", (9, 15)), ("int2-naive", (24,)),
                                         ("per-head-fp8", (11, 13)), ("mixed-widths", (11, 13)),
                                         ("int4-hadamard", (24,)), ("centered-fp8", (9, 15))])
def test_kernel_backend_matches_the_reference(kind, chunks):
    model = tiny()
    scheme = QuantScheme(sink=3, recent=5, scale_dtype="fp8" if kind.endswith("fp8") else "fp16",
                         bits=4 if kind.startswith("int4") else 2, center_keys=kind.startswith("centered"))
    q = quants_for(kind, scheme)
    x = torch.randint(1, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x)
    mask[1, :5] = 0  # row 1 is left-padded
    x[1, :5] = 0
    x, mask = x.to(DEV), mask.to(DEV)
    ref_cache = OscarCache(model, q, scheme, backend="reference")
    ref, ref0 = steps_and_layer0(model, ref_cache, x, mask, chunks, 4)
    ker_cache = OscarCache(model, q, scheme, backend="kernels")
    got, got0 = steps_and_layer0(model, ker_cache, x, mask, chunks, 4)
    assert ker_cache.backend == "kernels" and ref_cache.backend == "reference"
    assert torch.isfinite(got).all()
    real = torch.ones(2, got.shape[1], dtype=torch.bool, device=got.device)
    real[1, :5] = False  # pad positions' outputs are undefined in both
    assert rel(got0[real], ref0[real]) < LAYER0_TOL
    assert rel(got[real], ref[real]) < LOGITS_TOL
    assert not torch.equal(got, ref)  # really a different code path (bf16 exact rows)
    # the quantization is visible: the reference itself differs from exact attention
    exact = steps(model, OscarCache(model, [None, None], scheme), x, mask, chunks, 4)
    # (INT4 everywhere moves the logits ~2e-2 here, INT2 ~1e-1: its kernel-vs-reference check rests on layer 0's)
    assert rel(ref[real], exact[real]) > (1 if kind.startswith("int4") else 5) * LOGITS_TOL
    if kind != "per-head":
        return
    # and the bounds are tight enough to see a sink or recent one row off (the reference at that scheme)
    for off in (QuantScheme(sink=4, recent=5), QuantScheme(sink=3, recent=4)):
        wrong, wrong0 = steps_and_layer0(model, OscarCache(model, q, off, backend="reference"), x, mask, chunks, 4)
        assert rel(got0[real], wrong0[real]) > 5 * LAYER0_TOL and rel(got[real], wrong[real]) > 2 * LOGITS_TOL, off


def test_pool_grows_and_generate_runs_through_the_kernels(monkeypatch):
    import oscar_cli.cache_kernels as ck

    monkeypatch.setattr(ck, "MIN_CAPACITY", 8)  # force two doublings
    model = tiny()
    scheme = QuantScheme(sink=2, recent=4)
    q = per_head_quants()
    x = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(3)).to(DEV)
    kw = cache_kwarg(model)

    def generate(cache):
        """The generation, with layer 0's attention output of each forward pass as ``.layer0``."""
        seen = []
        hook = model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
        try:
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, **{kw: cache})
        finally:
            hook.remove()
        out.layer0 = seen
        return out

    with torch.no_grad():
        ref = generate(OscarCache(model, q, scheme, backend="reference"))
        cache = OscarCache(model, q, scheme, backend="kernels")
        got = generate(cache)
        off = generate(OscarCache(model, q, QuantScheme(sink=2, recent=3), backend="reference"))
    assert cache.kernel_state.capacity == 32 and cache.get_seq_length() == 31
    assert cache.nbytes() == cache.kernel_state.pool.nbytes

    def disagreement(run) -> list[tuple[int, float, float]]:
        """The steps that break agreement with the reference, as (step, logits rel, layer-0 rel): the generated tokens
        (the prompt is not counted) equal the reference's up to the first that differs, and every step up to it (same
        inputs in both) has its logits and its layer-0 attention output within GENERATE_TOLS of the reference's: a
        different token only where rounding can reorder a near tie; after it the contexts differ and nothing more is
        compared."""
        new_ref, new = ref.sequences[0, 12:], run.sequences[0, 12:]
        flips = (new_ref != new).nonzero().flatten().tolist()
        upto = flips[0] + 1 if flips else new.numel()
        errs = [(i, rel(run.logits[i], ref.logits[i]), rel(run.layer0[i], ref.layer0[i])) for i in range(upto)]
        return [(i, round(lg, 5), round(l0, 5)) for i, lg, l0 in errs if lg >= GENERATE_TOLS[0] or l0 >= GENERATE_TOLS[1]]

    assert torch.equal(got.sequences[0, :12], x[0]) and got.sequences.shape == ref.sequences.shape == (1, 32)
    assert disagreement(got) == []
    assert disagreement(off) != []  # a cache keeping one recent row fewer is told apart


def test_backend_choice_and_refusals(monkeypatch):
    from oscar_cli.cache_kernels import KernelState, kernel_ready

    model = tiny("cpu")
    scheme = QuantScheme(sink=2, recent=4)
    assert OscarCache(model, per_head_quants(), scheme).backend == "reference"  # auto on CPU
    # head dim 32 runs in the interpreter; on CUDA the decode kernel refuses it, so `auto` there takes the reference
    assert kernel_ready(per_head_quants()[0], scheme, 32) is None
    assert "head dim >= 64" in kernel_ready(per_head_quants()[0], scheme, 32, "cuda")
    for flag, words in (("int8_scores", "int8 scores"), ("int8_values", "int8 values")):
        lq = dataclasses.replace(per_head_quants()[0], decode=DecodeOptions(**{flag: True}))
        assert words in kernel_ready(lq, scheme, 32) and "reference attention emulates it" in kernel_ready(lq, scheme, 32)
    # one decode plan reads every layer: the layers' options are one value
    mixed = {0: per_head_quants()[0], 1: dataclasses.replace(per_head_quants()[1], decode=DecodeOptions(lean_tiles=True))}
    with pytest.raises(ValueError, match="decode options must agree"):
        KernelState(mixed, scheme, model.config)
    same = {i: dataclasses.replace(lq, decode=DecodeOptions(lean_tiles=True)) for i, lq in enumerate(per_head_quants())}
    assert KernelState(same, scheme, model.config).options == DecodeOptions(lean_tiles=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(OscarError, match="runs on CUDA tensors and the model is on cpu"):
        OscarCache(model, per_head_quants(), scheme, backend="kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kivi = quants_for("int2-kivi", scheme)
    with pytest.raises(OscarError, match="layer 0: per-channel"):
        OscarCache(model, kivi, scheme, backend="kernels")
    unfitted = [dataclasses.replace(lq, mult_k=None) for lq in fp8_quants()]
    with pytest.raises(OscarError, match="FP8 scales without fitted multipliers"):
        OscarCache(model, unfitted, QuantScheme(sink=2, recent=4, scale_dtype="fp8"), backend="kernels")
    exact_v = [dataclasses.replace(lq, bits_v=EXACT) for lq in per_head_quants()]
    with pytest.raises(OscarError, match="16-bit values"):
        OscarCache(model, exact_v, scheme, backend="kernels")
    with pytest.raises(OscarError, match="unknown cache backend"):
        OscarCache(model, kivi, scheme, backend="fast")
