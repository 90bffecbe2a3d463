"""benchmarks/bench_calibration.py on a tiny architecture: the library collect + fit it times really ran (a complete
run, an artifact), its table reached RESULTS, and a used store is refused."""

import json
from pathlib import Path

import pytest
from helpers import load_benchmark


def load_bench():
    return load_benchmark("bench_calibration")


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 2048, "tie_word_embeddings": True}


def test_collect_and_fit_of_a_random_architecture(tmp_path, tiny_model_dir):
    from oscar_cli.artifact import load_artifact
    from oscar_cli.store import Store

    bench = load_bench()
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    results = tmp_path / "RESULTS.md"
    store = tmp_path / "store"
    m = bench.main(["--tokenizer", str(tiny_model_dir), "--config", str(cfg), "--tokens", "3072", "--seq-len", "256",
                    "--batch-size", "2", "--device", "cpu", "--store", str(store), "--per-head",
                    "--results", str(results), "--commit", "abc123"])
    run = Store(store).get_run("latest")
    assert run.status == "complete" and run.tokens_done == 3072 and m["batches"] == 6 == run.num_batches
    art = load_artifact(Path(m["artifact"]))
    assert art.manifest.per_head and art.manifest.model_fingerprint == run.model_fingerprint
    assert m["first_s"] > 0 and m["last_s"] > 0 and m["collect_s"] > 0 and m["fit_s"] > 0
    text = results.read_text()
    assert "## Calibration at scale (collect + fit)" in text and "commit abc123" in text
    assert "2 layers, 4 query / 2 KV heads, d 16" in text and "| 3,072 | 6 |" in text

    with pytest.raises(SystemExit, match="is not empty"):
        bench.main(["--tokenizer", str(tiny_model_dir), "--config", str(cfg), "--store", str(store),
                    "--results", str(results)])
