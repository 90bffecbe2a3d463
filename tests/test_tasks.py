"""The lm-eval tasks shipped in oscar_cli/tasks: offline generators whose sample count ``--limit`` limits."""

from oscar_cli.tasks import TOKENIZERS, niah, ruler_offline


def test_offline_ruler_and_niah_respect_num_samples(kit):
    """--limit reaches the generators: RULER builds num_samples rows per length, not 500."""
    TOKENIZERS["tiny-test"] = kit.tokenizer()
    assert ruler_offline.load_tokenizer({"tokenizer": "tiny-test"}) is TOKENIZERS["tiny-test"]
    ds = ruler_offline.niah_single_1(tokenizer="tiny-test", max_seq_lengths=[512], num_samples=3)["test"]
    assert len(ds) == 3 and set(ds["max_length"]) == {512}
    assert all(o[0] in i for i, o in zip(ds["input"], ds["outputs"], strict=True))
    grid = niah.grid(tokenizer="tiny-test", max_seq_lengths=[256, 384], num_samples=5)["test"]
    assert len(grid) == 10 and sorted(set(grid["depth"])) == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert all(a in i for a, i in zip(grid["answer"], grid["input"], strict=True))
    assert niah.process_results(grid[0], [f" {grid[0]['answer']}."])["acc"] == 1.0
    assert niah.process_results(grid[0], [" 0000000."])["acc"] == 0.0
