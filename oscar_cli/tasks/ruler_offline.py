"""RULER needle-in-a-haystack tasks that run offline, with a sample count that ``--limit`` really limits.

lm-eval's RULER generators always build 500 samples per length and load the tokenizer by name. These wrappers call
the same generators with ``num_samples`` from the task metadata (set from ``--limit``) and take the tokenizer from
:data:`oscar_cli.tasks.TOKENIZERS` when the caller registered the loaded one under its name (no reload, no hub), else by name.
Only the noise haystacks ("repeat", "needle") are used: the essay haystack needs the hub.
"""

from __future__ import annotations

import itertools

SEQ_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def load_tokenizer(kwargs: dict):
    """The tokenizer a task's metadata names (``tokenizer`` or ``pretrained``): the loaded one registered in
    :data:`oscar_cli.tasks.TOKENIZERS` under that name, else lm-eval's RULER loader by name."""
    from lm_eval.tasks.ruler.common_utils import get_tokenizer, resolve_tokenizer_name

    from oscar_cli.tasks import TOKENIZERS

    name = resolve_tokenizer_name(kwargs)
    if name in TOKENIZERS:
        return TOKENIZERS[name]
    return get_tokenizer(name)


def _import_ruler():
    """Import lm-eval's RULER generators without the network: on import they try to download nltk's punkt_tab,
    which only the essay haystack (hub data) uses; offline that attempt waits for a network timeout."""
    import sys

    if "lm_eval.tasks.ruler.prepare_niah" not in sys.modules:
        import nltk

        download = nltk.download
        nltk.download = lambda *a, **k: False
        try:
            import lm_eval.tasks.ruler.prepare_niah  # noqa: F401
        finally:
            nltk.download = download
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE
    from lm_eval.tasks.ruler.prepare_niah import generate_samples, get_haystack

    return TEMPLATE, generate_samples, get_haystack


def _build(kwargs: dict, haystack: str, needle_v: str, **extra):
    import datasets

    TEMPLATE, generate_samples, get_haystack = _import_ruler()

    kwargs = dict(kwargs)
    seq_lengths = kwargs.pop("max_seq_lengths", [4096])
    num = int(kwargs.pop("num_samples", 500) or 500)
    tok = load_tokenizer(kwargs)
    rows = itertools.chain.from_iterable(
        generate_samples(get_haystack(type_haystack=haystack), max_seq_length=int(seq), template=TEMPLATE,
                         type_haystack=haystack, type_needle_k="words", type_needle_v=needle_v,
                         num_samples=num, TOKENIZER=tok, **extra)
        for seq in seq_lengths
    )
    return {"test": datasets.Dataset.from_list(list(rows), split=datasets.Split.TEST)}


def niah_single_1(**kwargs):
    return _build(kwargs, "repeat", "numbers")


def niah_multikey_2(**kwargs):
    return _build(kwargs, "needle", "numbers")


def niah_multikey_3(**kwargs):
    return _build(kwargs, "needle", "uuids")


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """RULER's string match, reported under the sample's length (other lengths -1, dropped by the aggregation)."""
    _import_ruler()
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    metrics = {str(n): -1.0 for n in SEQ_LENGTHS}
    metrics[str(doc["max_length"])] = string_match_all(postprocess_pred(results), [doc["outputs"]])
    return metrics


def aggregate_metrics(values: list[float]) -> float:
    kept = [v for v in values if v != -1]
    return sum(kept) / len(kept) if kept else -1.0
