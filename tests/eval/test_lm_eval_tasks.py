"""lm-eval tasks: offline names, the one-line hub error, results into rows, and RULER through the model (slow)."""

import pytest

from oscar_cli.config import expand_tasks
from oscar_cli.eval import EvalError
from oscar_cli.eval.lm_eval_tasks import TASKS_DIR, lm_rows, lm_task_names, run_lm_eval


def test_offline_task_names_map_to_the_shipped_tasks():
    assert expand_tasks(["ruler", "oscar_ppl", "ruler"]) == ["niah_single_1", "oscar_ppl"]
    assert lm_task_names(expand_tasks(["ruler"])) == ["oscar_ruler_niah_single_1"]
    assert lm_task_names(["niah_multikey_2", "oscar_niah", "hellaswag"]) == [
        "oscar_ruler_niah_multikey_2", "oscar_niah", "hellaswag"]
    assert {p.stem for p in TASKS_DIR.glob("*.yaml")} >= set(lm_task_names(["niah_single_1", "oscar_niah"]))


def test_hub_failure_is_a_one_line_error_naming_offline_tasks(monkeypatch):
    import lm_eval

    def boom(**kw):
        raise ConnectionError("Couldn't reach 'Idavidrein/gpqa' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(lm_eval, "simple_evaluate", boom)
    with pytest.raises(EvalError) as e:
        run_lm_eval(object(), ["oscar_niah"], 1, {})
    msg = str(e.value)
    assert "\n" not in msg and "ruler" in msg and "oscar_ppl" in msg and "ConnectionError" in msg


def test_results_become_rows_per_length():
    """RULER reports per length (``-1`` for lengths not run); other tasks at the longest length."""
    res = {"oscar_ruler_niah_single_1": {"1024": 1.0, "2048": -1.0, "sample_len": 2},
           "hellaswag": {"acc": 0.25}}
    base = dict(model_fingerprint="f", model_slug="s", method="bf16", artifact=None, lm_eval_version="v")
    rows = lm_rows(res, base, {"limit": 2}, (512, 1024), lambda n: n / 64)
    got = [(r.task, r.metric, r.value, r.seq_len, r.bits_per_element, r.config["samples"]) for r in rows]
    assert got == [("niah_single_1", "1024", 1.0, 1024, 16.0, 2), ("hellaswag", "acc", 0.25, 1024, 16.0, None)]
    assert rows[0].config["seq_lengths"] == [512, 1024] and rows[0].config["limit"] == 2


@pytest.mark.slow
def test_embedded_default_ruler_through_lm_eval(embedded_store, embedded_artifact):
    """RULER niah_single_1 offline through lm-eval, generating through the cache: --limit 1 gives 1 sample at 1k
    tokens; BF16 and the per-head artifact find the needle, the unrotated naive INT2 cache does not."""
    from oscar_cli.artifact import load_artifact
    from oscar_cli.eval.lm_eval_model import oscar_lm_class
    from oscar_cli.models import load_model
    from oscar_cli.tasks import TOKENIZERS

    lm = load_model("smollm2-135m", embedded_store)
    TOKENIZERS["embedded"] = lm.tokenizer
    art = load_artifact(embedded_artifact, lm.fingerprint)
    scores = {}
    for method in ("bf16", "oscar", "int2-naive"):
        olm = oscar_lm_class()(pretrained=lm.model, tokenizer=lm.tokenizer, method=method,
                               artifact=art if method == "oscar" else None, reference=art.scheme, batch_size=1,
                               max_length=1280, device="cpu")
        res = run_lm_eval(olm, lm_task_names(expand_tasks(["ruler"])), 1,
                          {"tokenizer": "embedded", "max_seq_lengths": [1024]})
        r = res["oscar_ruler_niah_single_1"]
        assert r["sample_len"] == 1
        scores[method] = r["1024"]
    assert scores == {"bf16": 1.0, "oscar": 1.0, "int2-naive": 0.0}, scores
