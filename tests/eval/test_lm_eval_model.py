"""The lm-eval model ``oscar``: loglikelihoods and generation through the method under test, checked against an
untouched model decoding through the method's cache."""

import pytest
import torch
from lm_eval.api.instance import Instance

from oscar_cli.cache import cache_kwarg, make_cache
from oscar_cli.eval.lm_eval_model import ENTRY_POINT, oscar_lm_class
from oscar_cli.kvquant import build_layer_quants
from oscar_cli.methods import get_method, scheme_for


def cache_decode(kit, method, ids, n_new=0):
    """An untouched model fed ``ids`` one token at a time through a fresh cache of ``method`` (sink 2, recent 4):
    the log-softmax after every fed token, then ``n_new`` greedy tokens."""
    model = kit.llama()
    m = get_method(method)
    scheme = scheme_for(m, 32, overrides={"sink": 2, "recent": 4})
    cache = make_cache(model, m, build_layer_quants(m, scheme, 2, 32, 2), scheme)
    kw = cache_kwarg(model)
    logps, new = [], []
    with torch.no_grad():
        for t in ids:
            logps.append(torch.log_softmax(model(torch.tensor([[t]]), **{kw: cache}, use_cache=True).logits[0, -1], -1))
        for _ in range(n_new):
            new.append(int(logps[-1].argmax()))
            logps.append(torch.log_softmax(model(torch.tensor([[new[-1]]]), **{kw: cache}, use_cache=True).logits[0, -1],
                                           -1))
    return logps, new


def test_oscar_lm_loglikelihood_and_generate_use_the_method(kit):
    model, tok = kit.llama(), kit.tokenizer()
    ctx, cont = kit.text(60, 1), " " + kit.text(4, 2)
    ids, n_cont = tok(ctx + cont)["input_ids"], len(tok(cont)["input_ids"])

    def oscar_lm(method):
        return oscar_lm_class()(pretrained=model, tokenizer=tok, method=method, sink=2, recent=4, batch_size=1,
                                max_length=256, device="cpu")

    def expected(method):
        logps, _ = cache_decode(kit, method, ids[:-1])
        return sum(logps[t - 1][ids[t]].item() for t in range(len(ids) - n_cont, len(ids)))

    req = Instance("loglikelihood", {}, (ctx, cont), 0)
    base = oscar_lm("bf16").loglikelihood([req])[0][0]
    lm = oscar_lm("int2-naive")
    q = lm.loglikelihood([req])[0][0]
    assert base == pytest.approx(expected("bf16"), abs=1e-4)
    assert q == pytest.approx(expected("int2-naive"), abs=1e-4) and q != pytest.approx(base, abs=1e-2)
    # generation: what greedy decoding through a fresh int2-naive cache writes, not what the exact model writes
    out = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": ["<eos>"], "max_gen_toks": 5}), 0)])
    _, want = cache_decode(kit, "int2-naive", tok(ctx)["input_ids"], 5)
    _, exact = cache_decode(kit, "bf16", tok(ctx)["input_ids"], 5)
    assert out == [tok.decode(want)] and want != exact


def test_the_entry_point_names_the_registered_class():
    module, _, name = ENTRY_POINT.partition(":")
    cls = oscar_lm_class()
    assert (cls.__module__, cls.__name__) == (module, name)
    import importlib

    assert getattr(importlib.import_module(module), name) is cls
