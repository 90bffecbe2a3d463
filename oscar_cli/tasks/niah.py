"""Needle-in-a-haystack grid over context lengths × needle depths, on the built-in held-out text (offline).

Each sample hides "The special magic number for <key> is <7 digits>." at a relative depth of a haystack cut from
:func:`oscar_cli.data.heldout_text` to the target token length, then asks for the number. Score: 1 when the number
appears in the answer. Metadata: ``max_seq_lengths`` (token lengths), ``depths`` (default 0.1 .. 0.9),
``num_samples`` (samples per length, spread over the depths; ``--limit``), ``tokenizer`` (a name registered in
:data:`oscar_cli.tasks.TOKENIZERS` or loadable by name).
"""

from __future__ import annotations

import random

from oscar_cli.tasks.ruler_offline import SEQ_LENGTHS, load_tokenizer
from oscar_cli.tasks.ruler_offline import aggregate_metrics as aggregate_metrics  # noqa: F401  (used by the yaml)

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
WORDS = ["amber", "cobalt", "falcon", "harbor", "juniper", "lantern", "meadow", "nickel", "orchid", "quartz"]
QUESTION = "\nWhat is the special magic number for {key} mentioned in the text above? The special magic number for {key} is"


def grid(**kwargs):
    import datasets

    from oscar_cli.data import heldout_text

    lengths = [int(n) for n in kwargs.pop("max_seq_lengths", [4096])]
    depths = [float(d) for d in kwargs.pop("depths", DEPTHS)]
    num = int(kwargs.pop("num_samples", len(depths)) or len(depths))
    tok = load_tokenizer(kwargs)
    hay = tok(heldout_text(), add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    rows = []
    for n in lengths:
        for i in range(num):
            depth = depths[i % len(depths)]
            key, value = rng.choice(WORDS) + "-" + rng.choice(WORDS), str(rng.randint(1_000_000, 9_999_999))
            needle_text = f" The special magic number for {key} is {value}. "
            needle = tok(needle_text, add_special_tokens=False)["input_ids"]
            q = QUESTION.format(key=key)
            budget = n - len(needle) - len(tok(q, add_special_tokens=False)["input_ids"]) - 16
            start = rng.randrange(0, max(1, len(hay) - budget))
            ctx = hay[start : start + budget]
            at = int(len(ctx) * depth)
            text = tok.decode(ctx[:at]) + needle_text + tok.decode(ctx[at:]) + q
            rows.append({"input": text, "answer": value, "max_length": n, "depth": depth})
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    hit = float(doc["answer"] in results[0])
    metrics = {str(n): -1.0 for n in SEQ_LENGTHS}
    metrics[str(doc["max_length"])] = hit
    metrics["acc"] = hit
    return metrics
