"""OscarCache on a tiny random-weight Llama (token ids, no tokenizer): exactness, decode equivalence, padding, bytes."""

import dataclasses

import pytest
import torch
from helpers import build_llama
from oscar_kernels.scheme import DecodeOptions
from transformers import DynamicCache

from oscar_cli import attention as attn
from oscar_cli.cache import OscarCache, cache_kwarg, make_cache
from oscar_cli.config import QuantScheme
from oscar_cli.errors import OscarError
from oscar_cli.kvquant import bits_per_element, build_layer_quants, quantized_count
from oscar_cli.methods import get_method, scheme_for

D = 32  # head dim of the tiny model


def tiny_llama(dtype=torch.float32, seed=0):
    return build_llama(dtype=dtype, seed=seed, pad_token_id=0)


def SinkRecent(sink, recent):  # noqa: N802
    return QuantScheme(sink=sink, recent=recent)


def ids(b, n, seed=0):
    return torch.randint(1, 96, (b, n), generator=torch.Generator().manual_seed(seed))


def quants(name, layers=2):
    """``NAME+int8``: the method's layers with int8 scores (what ``oscar-int8`` does to an artifact's layers);
    ``NAME+int8pv``: with int8 scores and values (``oscar-int8-pv``)."""
    base, _, int8 = name.partition("+")
    m = get_method(base)
    out = build_layer_quants(m, scheme_for(m, D), layers, D, 2)
    opts = DecodeOptions(int8_scores=True, int8_values=int8 == "int8pv")
    return [dataclasses.replace(lq, decode=opts) for lq in out] if int8 else out


def test_recent_covering_sequence_gives_dynamic_cache_tokens():
    model = tiny_llama()
    x = ids(2, 30)
    kw = cache_kwarg(model)
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                             **{kw: DynamicCache(config=model.config)})
        cache = OscarCache(model, quants("int2-naive"), SinkRecent(4, 64))
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False, **{kw: cache})
    assert torch.equal(out, ref)
    assert all(layer.codes_k is None for layer in cache.layers)


@pytest.mark.parametrize("name", ["int2-hadamard-clip", "int2-kivi", "int2-hadamard-clip+int8",
                                  "int2-hadamard-clip+int8pv"])
def test_prefill_and_decode_steps_equal_decode_equivalent_attention(name):
    """Prefill through the cache quantizes as a decoder would, and every decode step's attention equals the
    teacher-forced decode-equivalent attention at that position."""
    model = tiny_llama()
    w = scheme_for(get_method(name.partition("+")[0]), D, reference=SinkRecent(3, 6))  # KIVI: its own sink/recent (0 / 128)
    q = quants(name)
    prompt, steps = ids(1, 150 if name == "int2-kivi" else 40), 12
    kw = cache_kwarg(model)
    captured = []
    hook = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, a: captured.append(a[0]))
    with torch.no_grad():
        cache = make_cache(model, get_method(name.partition("+")[0]), q, w)
        out = model(prompt, **{kw: cache}, use_cache=True)
        logits, seq = [out.logits], prompt
        for _ in range(steps):
            nxt = logits[-1][:, -1:].argmax(-1)
            seq = torch.cat([seq, nxt], 1)
            logits.append(model(nxt, **{kw: cache}, use_cache=True).logits)
        cached = torch.cat(logits, 1)
        cached_attn = torch.cat(captured, 1)
        captured.clear()
        attn.install(model, q, w)
        tf = model(seq, use_cache=False).logits
        tf_attn = captured[0]
    hook.remove()
    ref_attn, ref = tf_attn[:, : cached_attn.shape[1]], tf[:, : cached.shape[1]]
    if name.endswith("+int8pv"):
        # int8 value weights are floors of p * 127 / max + dither. A cached step scores one query and the teacher-
        # forced pass all of them (another summation order: the last bits differ), so a weight close to an integer
        # can land one int8 step apart on some CPUs: a flip moves that position's outputs by a fraction of 1/127
        # of the values (and the logits after it). Allow that at two positions at most; a cache that quantizes
        # or tiles the wrong rows is off at every later step.
        for got, want, tight in ((cached_attn, ref_attn, 2e-5), (cached, ref, 2e-4)):
            off = ((got - want).abs() > tight + 1e-4 * want.abs()).any(-1)[0]
            assert int(off.sum()) <= 2, off.nonzero().flatten().tolist()
            torch.testing.assert_close(got, want, atol=want.abs().max().item() / 127, rtol=0)
    else:
        torch.testing.assert_close(cached_attn, ref_attn, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(cached, ref, atol=2e-4, rtol=1e-4)
    layer = cache.layers[0]
    block = 32 if name == "int2-kivi" else 1
    assert (w.sink, w.recent) == ((0, 128) if name == "int2-kivi" else (3, 6))
    nq = quantized_count(seq.shape[1], w.sink, w.recent, block)
    assert nq > 0 and layer.tail_start - layer.qstart == nq


def test_left_padded_batch_matches_rows_alone():
    """Sinks are the first real tokens of each row: a padded row decodes as it would alone."""
    model = tiny_llama()
    kw = cache_kwarg(model)
    q, w = quants("int2-naive"), SinkRecent(4, 6)
    a, b = ids(1, 36, seed=1), ids(1, 28, seed=2)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 8, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :8] = 0
    with torch.no_grad():
        both = model.generate(batch, attention_mask=mask, max_new_tokens=16, do_sample=False,
                              **{kw: OscarCache(model, q, w)})
        alone = [model.generate(r, attention_mask=torch.ones_like(r), max_new_tokens=16, do_sample=False,
                                **{kw: OscarCache(model, q, w)}) for r in (a, b)]
    assert torch.equal(both[0, 36:], alone[0][0, 36:])
    assert torch.equal(both[1, 36:], alone[1][0, 28:])


@pytest.mark.parametrize("name", ["int2-naive", "int2-hadamard", "int4-naive", "int2-kivi"])
def test_bytes_held_equal_accounting(name):
    model = tiny_llama(torch.bfloat16)
    kw = cache_kwarg(model)
    m = get_method(name)
    n_prompt, new = 150, 20
    with torch.no_grad():
        scheme = scheme_for(m, D, reference=SinkRecent(8, 16))
        cache = make_cache(model, m, build_layer_quants(m, scheme, 2, D, 2), scheme)
        model.generate(ids(1, n_prompt), attention_mask=torch.ones(1, n_prompt, dtype=torch.long),
                       max_new_tokens=new, do_sample=False, **{kw: cache})
    n = n_prompt + new - 1  # the last token is never fed back
    assert cache.get_seq_length() == n
    expect = bits_per_element(m, scheme, n, D, exact_bits=16)
    assert cache.bits_per_element() == pytest.approx(expect, rel=1e-12)
    dyn_bytes = 2 * 2 * 2 * n * D * 2  # layers * (K, V) * heads * tokens * d * bf16
    assert cache.nbytes() < (0.9 if name == "int2-kivi" else 0.5) * dyn_bytes


def test_unusable_operations_and_peers_are_clear_errors():
    model = tiny_llama()
    cache = OscarCache(model, quants("int2-naive"), SinkRecent(2, 2))
    with pytest.raises(OscarError, match="beam search"):
        cache.layers[0].reorder_cache(torch.tensor([0]))
    import importlib.util

    if importlib.util.find_spec("hqq") is None:
        with pytest.raises(OscarError, match="hqq"):
            make_cache(model, get_method("hf-hqq"), None, SinkRecent(0, 64))


def test_the_hqq_peer_decodes_through_transformers_quantized_cache():
    """``hf-hqq`` (the accuracy tables' HQQ row) is transformers' own ``QuantizedCache`` with the hqq package's
    quantizer: decoded token by token, its states past the residual are stored as 2-bit codes (not kept exact), and
    its perplexity is the BF16 one's to within quantization noise, never equal to it."""
    pytest.importorskip("hqq")
    from oscar_cli.eval.perplexity import perplexity
    from oscar_cli.prepare import prepare

    model = tiny_llama()
    seg = ids(1, 150, seed=3)
    hqq, bf16 = get_method("hf-hqq"), get_method("bf16")
    scheme = scheme_for(hqq, D, overrides={"recent": 32})
    cache = make_cache(model, hqq, None, scheme)
    kw = cache_kwarg(model)
    with torch.no_grad():
        for t in range(seg.shape[1]):
            model(seg[:, t : t + 1], **{kw: cache}, use_cache=True)
    layer = cache.layers[0]
    codes, meta = layer._quantized_keys
    assert meta["nbits"] == 2 and codes.dtype == torch.uint8
    assert layer.keys.shape[-2] < 32  # the residual was flushed into the codes
    p_hqq = perplexity(model, seg, prepare(model, hqq, scheme))
    p_bf16 = perplexity(model, seg, prepare(model, bf16, scheme_for(bf16, D)))
    assert p_hqq != p_bf16 and abs(p_hqq / p_bf16 - 1) < 0.05


def test_cache_refuses_another_attention_implementation():
    """The cache attends by itself; if the model is switched back to SDPA it must refuse, not attend the tail only."""
    model = tiny_llama()
    kw = cache_kwarg(model)
    cache = make_cache(model, get_method("int2-naive"), quants("int2-naive"), SinkRecent(2, 4))
    with torch.no_grad():
        model(ids(1, 12), **{kw: cache}, use_cache=True)
        model.set_attn_implementation("sdpa")
        with pytest.raises(OscarError, match="attends with 'sdpa'.*make_cache"):
            model(ids(1, 1), **{kw: cache}, use_cache=True)
