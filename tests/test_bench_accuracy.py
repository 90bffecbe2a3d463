"""benchmarks/bench_accuracy.py and bench_criteria.py on a tiny gemma-shaped model: every row they promise is
measured and reaches RESULTS; the rank correlation they report is Spearman's."""

import pytest
from helpers import load_benchmark
from typer.testing import CliRunner

from oscar_cli.cli import app

RECIPE = """model: tiny
fit:
  method: oscar
  per_head: true
  clip_criterion: logit-kl   # as the shipped recipes: the benchmarks fit their own variants from it
  sensitivity_tokens: 64
  scheme: {bits: 2, group: 0, sink: 2, recent: 4}
"""


@pytest.fixture()
def tiny_run(tmp_path, tiny_gemma_dir):
    store = tmp_path / "store"
    r = CliRunner().invoke(app, ["collect", "--model", str(tiny_gemma_dir), "--store", str(store), "--tokens", "1024",
                                 "--seq-len", "64", "--batch-size", "4", "--reservoir", "96"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    text = tmp_path / "other.txt"
    from oscar_cli.data import heldout_text

    text.write_text(heldout_text()[-30000:])
    return store, recipe, text


def test_bench_accuracy_measures_every_row(tmp_path, tiny_run, tiny_gemma_dir):
    store, recipe, text = tiny_run
    results = tmp_path / "RESULTS.md"
    bench = load_benchmark("bench_accuracy")
    assert bench.main(["--store", str(store), "--model", str(tiny_gemma_dir), "--recipe", str(recipe), "--data2",
                       str(text), "--segments", "1", "--seq-len", "64", "--budgets", "2.75,3.0",
                       "--sensitivity-tokens", "64", "--results", str(results), "--plot",
                       str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    out = results.read_text()
    for row in ("| bf16 |", "| int2-hadamard |", "| int2-hadamard-gauss |", "| int4-hadamard |",
                "| oscar, INT2, fp16 scales |", "centered keys", "fitted levels", "clips by logit-KL |",
                "| oscar, INT2, fp8 scales |", "allocated @2.75", "allocated @3", "keys only", "values only"):
        assert row in out, row
    assert "ppl held-out (other.txt)" in out and "at 32768" in out


def test_bench_criteria_ranks_with_spearman(tmp_path, tiny_run, tiny_gemma_dir):
    bench = load_benchmark("bench_criteria")
    assert bench.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bench.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert bench.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(0.866, abs=1e-3)  # ties take average ranks
    store, recipe, _ = tiny_run
    results = tmp_path / "RESULTS.md"
    assert bench.main(["--store", str(store), "--model", str(tiny_gemma_dir), "--recipe", str(recipe), "--factors",
                       "0.8,1.0", "--segments", "1", "--seq-len", "64", "--calibration-tokens", "64",
                       "--results", str(results)]) == 0
    out = results.read_text()
    assert "Spearman vs held-out ppl" in out and "| logit-KL |" in out and "| 0.8 |" in out


def test_bench_accuracy_key_layouts_at_equal_bits(tmp_path, tiny_run, tiny_gemma_dir):
    """``--key-layouts``: the three key layouts at 2 + 32/d bits (keys alone quantized), each a different
    perplexity from BF16's and from each other's, one table in RESULTS."""
    store, recipe, text = tiny_run
    results = tmp_path / "RESULTS.md"
    bench = load_benchmark("bench_accuracy")
    assert bench.main(["--store", str(store), "--model", str(tiny_gemma_dir), "--recipe", str(recipe), "--data2",
                       str(text), "--segments", "1", "--seq-len", "64", "--key-layouts",
                       "--results", str(results)]) == 0
    out = results.read_text()
    assert "## Key layout at equal bits" in out and "keys only (values exact in every row)" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r[1].strip().split(",")[0] for r in rows] == ["bf16", "OSCAR keys per token", "OSCAR keys per token",
                                                        "OSCAR keys per channel over 32-token blocks (KIVI's layout)"]
    ppl = [r[3].strip().split(" ")[0] for r in rows]
    assert len(set(ppl)) == 4 and len({r[2].strip() for r in rows[1:]}) == 1  # all measured, at one bit count


def test_key_split_rotation_puts_the_read_directions_first():
    """bench_key_split's rotation is orthogonal, its 4-bit block spans exactly the directions of the largest
    query-times-key energy, and the keys' offset sits on the 2-bit block's constant row (the zero point's)."""
    import torch

    from oscar_cli import rotation as rot

    bench = load_benchmark("bench_key_split")
    d, m = 16, 4
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    lam = torch.logspace(2, -2, d, dtype=torch.float64)
    cq = basis @ torch.diag(lam) @ basis.T
    offset = torch.randn(d, generator=g, dtype=torch.float64)
    rows = torch.randn(4096, d, generator=g, dtype=torch.float64) @ basis @ torch.diag(lam.flip(0).sqrt()) + 3 * offset
    ck = rows.T @ rows / rows.shape[0]
    r = bench.split_rotation(cq, ck, m)
    assert torch.allclose(r.T @ r, torch.eye(d, dtype=torch.float64), atol=1e-10)
    lam_u, u = rot.anchored_eigh(ck, cq)
    energy = lam_u * torch.einsum("di,de,ei->i", u, ck, u)
    energy[0] = -torch.inf
    top = u[:, energy.argsort(descending=True)[:m]]
    assert torch.allclose((r[:, :m].T @ top).norm(dim=0), torch.ones(m, dtype=torch.float64), atol=1e-8)
    on_low = u[:, 0] @ r[:, m:]
    assert torch.allclose(on_low.abs(), torch.full((d - m,), (d - m) ** -0.5, dtype=torch.float64), atol=1e-8)
    control = bench.split_rotation(cq, ck, m, least=True)  # the least-read directions in the 4-bit block
    energy[0] = torch.inf
    bottom = u[:, energy.argsort()[:m]]
    assert torch.allclose((control[:, :m].T @ bottom).norm(dim=0), torch.ones(m, dtype=torch.float64), atol=1e-8)
    assert (control[:, :m].T @ top).norm() < 1e-8


def test_bench_key_split_measures_its_rows(tmp_path, tiny_run, tiny_gemma_dir):
    store, recipe, text = tiny_run
    results = tmp_path / "RESULTS.md"
    bench = load_benchmark("bench_key_split")
    from oscar_cli import attention

    plain = attention.roundtrip
    for control in ([], ["--least"]):
        assert bench.main(["--store", str(store), "--model", str(tiny_gemma_dir), "--recipe", str(recipe),
                           "--data2", str(text), "--segments", "1", "--seq-len", "64", "--split", "8", "--clips-hi",
                           "1.0", "--clips-lo", "0.6,0.8", "--sensitivity-tokens", "64", "--results", str(results),
                           *control]) == 0
    assert attention.roundtrip is plain  # the split quantizer is gone once the script is done
    out = results.read_text()
    assert "Key rows split by query energy" in out and "| bf16 |" in out and "OSCAR uniform INT2" in out
    # head dim 32: keys (8 x 4 + 24 x 2 + two fp8 scale/zero pairs) / 32 = 3.5, values 2 + 16 / 32 = 2.5
    assert "the 8 most-read directions 4-bit + 24 2-bit" in out and "| 3.000 |" in out
    assert "the 8 least-read directions 4-bit" in out and "| 8 (least energy) |" in out
    assert "| KL 1.0/0.6 | KL 1.0/0.8 |" in out
