"""benchmarks/ruler_hf.py: RULER requests answered through transformers with OscarCache, in length-sorted batches
(left-padded rows answer as they would alone), written in the form ``ruler_server.py score`` reads."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import ruler_hf  # noqa: E402


def request(i, task, length, n, budget=6):
    ids = [2 + (7 * i + 3 * j) % 900 for j in range(n)]
    return {"id": i, "key": f"k{i}", "task": task, "ids": ids, "max_new_tokens": budget,
            "doc": {"max_length": length, "answer": "x"}}


def test_batches_keep_one_task_length_and_budget_and_bound_the_padded_tokens():
    reqs = [request(i, "a" if i % 2 else "b", 64 if i < 6 else 128, 40 + i) for i in range(10)]
    out = ruler_hf.batches(reqs, 3, 100)
    assert sorted(r["id"] for b in out for r in b) == list(range(10))
    for b in out:
        assert len({(r["task"], r["doc"]["max_length"], r["max_new_tokens"]) for r in b}) == 1
        assert len(b) <= 3 and (len(b) == 1 or len(b) * max(len(r["ids"]) for r in b) <= 100)
        assert [len(r["ids"]) for r in b] == sorted((len(r["ids"]) for r in b), reverse=True)


def test_answers_in_padded_batches_equal_answers_alone(tiny_gemma_dir, tmp_path):
    reqs = [request(i, "oscar_ruler_niah_single_1", 64, n) for i, n in enumerate((48, 40, 33))]
    path = tmp_path / "r.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"model": "tiny", "samples": 1, "lengths": [64], "grid_samples": 0, "requests": reqs}, f)
    got = {}
    for batch in (1, 3):
        out = tmp_path / f"b{batch}"
        assert ruler_hf.main(["--requests", str(path), "--model", str(tiny_gemma_dir), "--store", str(tmp_path / "s"),
                              "--config", "hadamard", "--method", "int2-hadamard", "--sink", "2", "--recent", "4",
                              "--batch", str(batch), "--device", "cpu", "--out", str(out)]) == 0
        got[batch] = json.loads((out / "ruler-hadamard.json").read_text())
    assert set(got[3]["answers"]) == {"0", "1", "2"} and not got[3]["errors"]
    assert got[1]["answers"] == got[3]["answers"]
    # fp32 exact rows on the CPU; quantized rows past the sink and the recent window cost far less
    assert 2 < got[3]["bits_per_element"] < 16 and got[3]["backend"] == "transformers"
    assert got[3]["scheme"].startswith("int2")
