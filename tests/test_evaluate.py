"""Perplexity, bits accounting and the lm-eval model on a tiny random Llama with an in-memory word tokenizer."""

import math

import pytest
import torch

from oscar_cli import evaluate as ev
from oscar_cli.config import QuantScheme, expand_tasks
from oscar_cli.kvquant import bits_per_element
from oscar_cli.methods import get_method, scheme_for


def prep(model, name, sink, recent, artifact=None):
    m = get_method(name)
    scheme = scheme_for(m, ev.head_dim_of(model.config), windows=QuantScheme(sink=sink, recent=recent),
                        artifact_scheme=None if artifact is None else artifact.scheme)
    return ev.prepare(model, m, scheme, artifact)


def test_perplexity_bf16_matches_cross_entropy_and_quantization_hurts(kit):
    model, tok = kit.llama(), kit.tokenizer()
    ids = ev.token_ids(tok, kit.text(300))
    wins = ev.windows_of(ids, 96, 3)
    assert wins.shape == (3, 96)
    p_bf16 = ev.perplexity(model, wins, prep(model, "bf16", 4, 8))
    with torch.no_grad():
        logits = model(wins).logits[:, :-1]
    ref = math.exp(torch.nn.functional.cross_entropy(logits.reshape(-1, 96), wins[:, 1:].reshape(-1)).item())
    assert p_bf16 == pytest.approx(ref, rel=1e-5)
    p_full_recent = ev.perplexity(model, wins, prep(model, "int2-naive", 4, 96))
    assert p_full_recent == pytest.approx(p_bf16, rel=1e-5)
    p_naive = ev.perplexity(model, wins, prep(model, "int2-naive", 4, 8))
    assert p_naive != pytest.approx(p_bf16, rel=1e-4)


def test_windows_error_and_element_bits(kit):
    model = kit.llama()
    with pytest.raises(ev.EvalError, match="fewer than one window"):
        ev.windows_of(torch.arange(10), 64, None)
    p = prep(model, "int2-hadamard", 16, 64)
    assert ev.element_bits(p, model, 1024) == pytest.approx(bits_per_element(get_method("int2-hadamard"), p.scheme,
                                                                             1024, 32))
    assert p.scheme == QuantScheme(sink=16, recent=64, group=32)
    assert ev.element_bits(prep(model, "bf16", 16, 64), model, 1024) == 16


def test_expand_tasks_maps_offline_names():
    assert expand_tasks(["ruler", "oscar_ppl", "ruler"]) == ["niah_single_1", "oscar_ppl"]
    assert ev.lm_task_names(expand_tasks(["ruler"])) == ["oscar_ruler_niah_single_1"]
    assert ev.lm_task_names(["niah_multikey_2", "oscar_niah", "hellaswag"]) == [
        "oscar_ruler_niah_multikey_2", "oscar_niah", "hellaswag"]


def test_hub_failure_is_a_one_line_error_naming_offline_tasks(monkeypatch):
    import lm_eval

    def boom(**kw):
        raise ConnectionError("Couldn't reach 'Idavidrein/gpqa' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(lm_eval, "simple_evaluate", boom)
    with pytest.raises(ev.EvalError) as e:
        ev.run_lm_eval(object(), ["oscar_niah"], 1, {})
    msg = str(e.value)
    assert "\n" not in msg and "ruler" in msg and "oscar_ppl" in msg


def test_oscar_lm_loglikelihood_and_generate_use_the_method(kit):
    from lm_eval.api.instance import Instance

    model, tok = kit.llama(), kit.tokenizer()
    ctx, cont = kit.text(60, 1), " " + kit.text(4, 2)

    def ll(method):
        lm = ev.oscar_lm_class()(pretrained=model, tokenizer=tok, method=method, sink=2, recent=4, batch_size=1,
                                 max_length=256, device="cpu")
        req = Instance("loglikelihood", {}, (ctx, cont), 0)
        return lm, lm.loglikelihood([req])[0][0]

    _, base = ll("bf16")
    lm, q = ll("int2-naive")
    assert q != pytest.approx(base, abs=1e-4)
    # the same number by hand: decode-equivalent attention on the full sequence
    ids = torch.tensor([tok(ctx + cont)["input_ids"]])
    n_cont = len(tok(cont)["input_ids"])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, use_cache=False).logits[0, :-1], -1)
    by_hand = logp[torch.arange(ids.shape[1] - 1), ids[0, 1:]][-n_cont:].sum().item()
    assert q == pytest.approx(by_hand, abs=1e-3)
    # generation goes through a fresh OscarCache
    from oscar_cli import cache as cache_mod

    made = []
    orig = cache_mod.make_cache
    cache_mod.make_cache = lambda *a, **k: made.append(orig(*a, **k)) or made[-1]
    try:
        out = lm.generate_until([Instance("generate_until", {}, (ctx, {"until": ["<eos>"], "max_gen_toks": 5}), 0)])
    finally:
        cache_mod.make_cache = orig
    assert len(made) == 1 and isinstance(made[0], cache_mod.OscarCache)
    assert made[0].get_seq_length() >= 60 and isinstance(out[0], str)


@pytest.mark.slow
def test_embedded_default_ordering_on_heldout_text(embedded_store, embedded_artifact):
    """One 1k window of the held-out text, sink 16 / recent 64:
    bf16 < oscar < int2-hadamard-clip < int2-hadamard < int2-naive."""
    from oscar_cli.artifact import load_artifact
    from oscar_cli.data import heldout_text
    from oscar_cli.models import load_model

    lm = load_model("smollm2-135m", embedded_store)
    art = load_artifact(embedded_artifact, lm.fingerprint)
    wins = ev.windows_of(ev.token_ids(lm.tokenizer, heldout_text()), 1024, 1)
    ppl = {m: ev.perplexity(lm.model, wins, prep(lm.model, m, 16, 64, art if m == "oscar" else None))
           for m in ["bf16", "oscar", "int2-hadamard-clip", "int2-hadamard", "int2-naive"]}
    assert ppl["bf16"] < ppl["oscar"] < ppl["int2-hadamard-clip"] < ppl["int2-hadamard"] < ppl["int2-naive"], ppl


def test_offline_ruler_and_niah_respect_num_samples(kit):
    """--limit reaches the generators: RULER builds num_samples rows per length, not 500."""
    from oscar_cli.tasks import TOKENIZERS, niah, ruler_offline

    TOKENIZERS["tiny-test"] = kit.tokenizer()
    ds = ruler_offline.niah_single_1(tokenizer="tiny-test", max_seq_lengths=[512], num_samples=3)["test"]
    assert len(ds) == 3 and set(ds["max_length"]) == {512}
    assert all(o[0] in i for i, o in zip(ds["input"], ds["outputs"], strict=True))
    grid = niah.grid(tokenizer="tiny-test", max_seq_lengths=[256, 384], num_samples=5)["test"]
    assert len(grid) == 10 and sorted(set(grid["depth"])) == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert all(a in i for a, i in zip(grid["answer"], grid["input"], strict=True))
    assert niah.process_results(grid[0], [f" {grid[0]['answer']}."])["acc"] == 1.0


@pytest.mark.slow
def test_embedded_default_ruler_through_lm_eval(embedded_store, embedded_artifact):
    """RULER niah_single_1 offline through lm-eval, generating through the cache: --limit 1 gives 1 sample at 1k
    tokens; BF16 and the per-head artifact find the needle, the unrotated naive INT2 cache does not."""
    from oscar_cli.artifact import load_artifact
    from oscar_cli.models import load_model
    from oscar_cli.tasks import TOKENIZERS

    lm = load_model("smollm2-135m", embedded_store)
    TOKENIZERS["embedded"] = lm.tokenizer
    art = load_artifact(embedded_artifact, lm.fingerprint)
    scores = {}
    for method in ("bf16", "oscar", "int2-naive"):
        olm = ev.oscar_lm_class()(pretrained=lm.model, tokenizer=lm.tokenizer, method=method,
                                  artifact=art if method == "oscar" else None, windows=art.scheme, batch_size=1,
                                  max_length=1280, device="cpu")
        res = ev.run_lm_eval(olm, ev.lm_task_names(expand_tasks(["ruler"])), 1,
                             {"tokenizer": "embedded", "max_seq_lengths": [1024]})
        r = res["oscar_ruler_niah_single_1"]
        assert r["sample_len"] == 1
        scores[method] = r["1024"]
    assert scores == {"bf16": 1.0, "oscar": 1.0, "int2-naive": 0.0}, scores


@pytest.mark.slow
def test_shipped_recipe_thresholds_hold(embedded_store, embedded_artifact):
    """`oscar eval --recipe recipes/smollm2-135m.yaml` on the embedded default meets the recipe's thresholds."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from oscar_cli.cli import app

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m.yaml"
    r = CliRunner().invoke(app, ["eval", "--recipe", str(recipe), "--store", str(embedded_store), "--artifact",
                                 str(embedded_artifact), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = {x["method"]: x["value"] for x in json.loads(r.stdout)}
    assert rows["bf16"] < rows["oscar"] < rows["int2-hadamard"] < rows["int2-naive"], rows
