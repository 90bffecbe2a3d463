"""The CLI end to end: a tiny random-weight Llama (fast) and the embedded default (slow)."""

import json
import re
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from oscar_cli.cli import app
from oscar_cli.store import Store

runner = CliRunner()
TINY = ["--tokens", "1024", "--seq-len", "64", "--batch-size", "4", "--reservoir", "96"]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def one_line_error(result, pattern):
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert pattern in lines[0], lines[0]


@pytest.fixture()
def tiny_store(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    r = invoke("collect", "--model", tiny_model_dir, "--store", store, *TINY)
    assert r.exit_code == 0, r.output
    return store


def test_collect_fit_inspect_on_a_tiny_model(tmp_path, tiny_store, tiny_model_dir):
    arts = tmp_path / "artifacts"
    r = invoke("fit", "--store", tiny_store, "--artifacts", arts, "--layers", "0-1", "--sink", "4", "--recent", "8")
    assert r.exit_code == 0, r.output
    # the summary names both baselines' layer counts: plain Hadamard and Hadamard with clips
    assert re.search(r"better than hadamard on \d/2 layers, than hadamard with clips on \d/2", r.output), r.output
    folder = arts / tiny_model_dir.name.lower() / "v1"
    assert (folder / "rotations.safetensors").is_file() and (folder / "recipe.yaml").is_file()
    r = invoke("inspect", "latest", "--store", tiny_store, "--json", "--plot", tmp_path / "p.png")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert [x["layer"] for x in report["layers"]] == [0, 1]
    assert all(x["orthogonality_error"] < 1e-5 for x in report["layers"])
    assert report["scheme"] == {"bits": 2, "group": 16, "sink": 4, "recent": 8, "scale_dtype": "fp16",
                                "levels": "uniform"}  # the group resolved to the head dim
    from oscar_cli.artifact import load_artifact

    m = load_artifact(folder).manifest
    assert m.stats_digest.startswith("sha256:") and m.stats_digest != m.data_digest
    assert m.code_version.startswith("0.1.0")
    assert (tmp_path / "p.png").stat().st_size > 10_000
    run = Store(tiny_store).get_run("latest")
    assert (run.status, run.tokens_done, run.batches_done) == ("complete", 1024, 4)
    r = invoke("runs", "--store", tiny_store, "--json")
    listed = json.loads(r.output)
    assert [x["run_id"] for x in listed["runs"]] == [run.run_id] and listed["runs"][0]["status"] == "complete"
    assert [x["version"] for x in listed["artifacts"]] == [1]


def test_a_killed_run_resumes_to_the_same_statistics(tmp_path, tiny_store, tiny_model_dir, monkeypatch):
    store = tmp_path / "resumed"
    real = Store.save_batch
    calls = {"n": 0}

    def dies_on_third_batch(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # killed while batch 3 was being written
        return real(self, *a, **k)

    monkeypatch.setattr(Store, "save_batch", dies_on_third_batch)
    r = runner.invoke(app, ["collect", "--model", str(tiny_model_dir), "--store", str(store), *TINY])
    assert r.exit_code == 130
    monkeypatch.setattr(Store, "save_batch", real)
    half = Store(store).list_runs()[-1]
    assert (half.status, half.batches_done) == ("interrupted", 2)
    r = invoke("collect", "--model", tiny_model_dir, "--store", store, "--resume", *TINY)
    assert r.exit_code == 0, r.output

    a, b = Store(tiny_store), Store(store)
    ra, rb = a.get_run("latest"), b.get_run("latest")
    assert rb.run_id == half.run_id and rb.tokens_done == ra.tokens_done
    sa, sb = a.load_stats(ra.run_id), b.load_stats(rb.run_id)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key][:2] == sb[key][:2]
        np.testing.assert_array_equal(sa[key][2], sb[key][2])
    ma, mb = a.load_samples(ra.run_id), b.load_samples(rb.run_id)
    assert ma.keys() == mb.keys()
    for key in ma:
        np.testing.assert_array_equal(ma[key][0], mb[key][0])
        np.testing.assert_array_equal(ma[key][2], mb[key][2])


def test_checkpointed_collect_resumes_bit_exact_and_writes_less(tmp_path, tiny_store, tiny_model_dir, monkeypatch):
    """With a checkpoint every 3 batches the 4-batch run writes its accumulators twice (after batches 3 and 4), not 4
    times; killed after the first checkpoint it resumes from batch 3 to the uninterrupted statistics and reservoir."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("collect:\n  checkpoint_every: 3\n")
    store = tmp_path / "ck"
    real = Store.save_batch
    calls = []

    def counted(self, run_id, batches_done, *a, **k):
        calls.append(batches_done)
        if len(calls) == 2 and kill["on"]:
            raise KeyboardInterrupt
        return real(self, run_id, batches_done, *a, **k)

    kill = {"on": True}
    monkeypatch.setattr(Store, "save_batch", counted)
    r = runner.invoke(app, ["collect", "--model", str(tiny_model_dir), "--store", str(store), "--recipe", str(recipe),
                            *TINY])
    assert r.exit_code == 130 and calls == [3, 4]
    half = Store(store).list_runs()[-1]
    assert (half.status, half.batches_done) == ("interrupted", 3)
    kill["on"], calls[:] = False, []
    r = invoke("collect", "--model", tiny_model_dir, "--store", store, "--recipe", recipe, "--resume", *TINY)
    assert r.exit_code == 0, r.output
    assert calls == [4]
    a, b = Store(tiny_store), Store(store)
    sa, sb = a.load_stats(a.get_run("latest").run_id), b.load_stats(b.get_run("latest").run_id)
    for key in sa:
        assert sa[key][:2] == sb[key][:2]
        np.testing.assert_array_equal(sa[key][2], sb[key][2])
    ma, mb = a.load_samples(a.get_run("latest").run_id), b.load_samples(b.get_run("latest").run_id)
    assert ma.keys() == mb.keys()
    for key in ma:
        np.testing.assert_array_equal(ma[key][0], mb[key][0])
        np.testing.assert_array_equal(ma[key][2], mb[key][2])


def test_bad_input_fails_with_one_line_and_leaves_the_store_alone(tmp_path, tiny_store, tiny_model_dir):
    before = [(r.run_id, r.status, r.batches_done) for r in Store(tiny_store).list_runs()]
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "fine"}\nnot json\n')
    one_line_error(invoke("collect", "--model", tmp_path / "no-model", "--store", tiny_store), "cannot load model")
    one_line_error(invoke("collect", "--model", "nobody/no-such-model", "--store", tiny_store), "cannot load model")
    one_line_error(invoke("collect", "--model", tiny_model_dir, "--store", tiny_store, "--data", tmp_path / "x.txt"),
                   "does not exist")
    one_line_error(invoke("collect", "--model", tiny_model_dir, "--store", tiny_store, "--data", empty), "is empty")
    one_line_error(invoke("collect", "--model", tiny_model_dir, "--store", tiny_store, "--data", bad_json),
                   "bad.jsonl:2 is not valid JSON")
    one_line_error(invoke("collect", "--model", tiny_model_dir, "--store", tiny_store, "--tokens", "10000000"),
                   "lower --tokens")
    one_line_error(invoke("collect", "--model", tiny_model_dir, "--store", tiny_store, "--resume", *TINY),
                   "nothing to resume")
    if not torch.cuda.is_available():  # refused before the recipe, the data or the weights are read
        one_line_error(invoke("collect", "--model", tmp_path / "no-model", "--store", tiny_store, "--device", "cuda"),
                       "no CUDA device is visible")
    one_line_error(invoke("collect", "--model", tiny_model_dir, "--store", tiny_store, "--device", "gpu0"),
                   "is not a torch device")
    import shutil

    no_tok, broken = tmp_path / "no-tokenizer", tmp_path / "broken-weights"
    for d in (no_tok, broken):
        shutil.copytree(tiny_model_dir, d)
    for f in no_tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    one_line_error(invoke("collect", "--model", no_tok, "--store", tiny_store), "needs the tokenizer files")
    one_line_error(invoke("collect", "--model", broken, "--store", tiny_store), "the checkpoint is damaged")
    one_line_error(invoke("fit", "--store", tiny_store, "--artifacts", tmp_path / "a", "--layers", "0-7"),
                   "out of range: the model has layers 0-1")
    one_line_error(invoke("fit", "--store", tiny_store, "--artifacts", tmp_path / "a", "--group", "48"),
                   "must divide the head dim 16")
    one_line_error(invoke("fit", "--store", tmp_path / "nowhere"), "no store at")
    one_line_error(invoke("inspect", "v9", "--store", tiny_store), "not found")
    assert [(r.run_id, r.status, r.batches_done) for r in Store(tiny_store).list_runs()] == before
    assert Store(tiny_store).list_artifacts() == []
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").rglob("v*"))
    assert not (tmp_path / "nowhere").exists()


def test_a_tampered_artifact_is_refused(tmp_path, tiny_store):
    arts = tmp_path / "artifacts"
    assert invoke("fit", "--store", tiny_store, "--artifacts", arts).exit_code == 0
    folder = next(arts.rglob("v1"))
    (folder / "rotations.safetensors").write_bytes((folder / "rotations.safetensors").read_bytes()[:-4] + b"\0\0\0\0")
    one_line_error(invoke("inspect", "latest", "--store", tiny_store), "content hash mismatch")


def test_fit_without_a_recipe_takes_the_models_recipe(tmp_path, tiny_store, monkeypatch):
    """``oscar fit`` with no ``--recipe`` fits with ``recipes/<model>.yaml`` when there is one (flags override its
    fields); ``--no-recipe`` takes the built-in defaults; a model without a recipe gets the defaults."""
    from oscar_cli import config
    from oscar_cli.artifact import load_artifact

    arts = tmp_path / "artifacts"
    slug = Store(tiny_store).get_run("latest").model_slug
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    monkeypatch.setattr(config, "RECIPES_DIR", recipes)
    assert invoke("fit", "--store", tiny_store, "--artifacts", arts, "--layers", "0-1").exit_code == 0  # no recipe
    (recipes / f"{slug}.yaml").write_text(f"model: {slug}\nfit:\n  scheme:\n    sink: 3\n    recent: 5\n")
    r = invoke("fit", "--store", tiny_store, "--artifacts", arts, "--layers", "0-1")
    assert r.exit_code == 0 and "the model's" in r.output, r.output
    r = invoke("fit", "--store", tiny_store, "--artifacts", arts, "--layers", "0-1", "--recent", "7")
    assert r.exit_code == 0, r.output
    assert invoke("fit", "--store", tiny_store, "--artifacts", arts, "--layers", "0-1", "--no-recipe").exit_code == 0
    schemes = [load_artifact(next(arts.glob(f"*/v{v}"))).scheme for v in (1, 2, 3, 4)]
    assert [(s.sink, s.recent) for s in schemes] == [(64, 256), (3, 5), (3, 7), (64, 256)]
    assert "recipe: " not in invoke("fit", "--store", tiny_store, "--artifacts", arts, "--no-recipe").output
    one_line_error(invoke("fit", "--store", tiny_store, "--artifacts", arts, "--recipe", recipes / f"{slug}.yaml",
                          "--no-recipe"), "exclude each other")


@pytest.mark.slow
def test_embedded_default_end_to_end(embedded_store, embedded_artifact):
    """>= 16k calibration tokens on SmolLM2-135M; the artifact must beat identity and Hadamard on most layers."""
    r = invoke("inspect", embedded_artifact, "--store", embedded_store, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert len(report["layers"]) == 30 and report["per_head"] is True
    run = Store(embedded_store).get_run(report["run_id"])
    assert run.tokens_done >= 16384 and run.status == "complete"
    for kv in ("distortion_k", "distortion_v"):
        wins = report["summary"][kv]["artifact_better_layers"]
        assert wins["identity"] >= 25 and wins["hadamard"] >= 25 and wins["hadamard_clip"] >= 20, (kv, wins)


def test_fit_allocates_widths_by_measured_sensitivity_and_inspect_shows_where_the_error_lives(
        tmp_path, tiny_store, tiny_model_dir):
    arts = tmp_path / "artifacts"
    base = ["fit", "--store", tiny_store, "--artifacts", arts, "--sink", "4", "--recent", "8"]
    one_line_error(invoke(*base, "--bits-per-element", "2.3"), "below the scheme's uniform 2-bit cost of 4")
    one_line_error(invoke(*base, "--bits-per-element", "4.5"), "needs the sensitivity pass")
    one_line_error(invoke(*base, "--sensitivity-tokens", "64"), "pass --model PATH")  # a folder model: not in store
    assert not arts.exists() or not any(arts.rglob("manifest.json"))  # refused before anything was written
    r = invoke(*base, "--scale-dtype", "fp8", "--bits-per-element", "3.5", "--sensitivity-tokens", "128",
               "--model", tiny_model_dir)
    assert r.exit_code == 0, r.output
    assert "allocation:" in r.output
    report = json.loads(invoke("inspect", "latest", "--store", tiny_store, "--json").output)
    n = len(report["layers"])
    assert report["sensitivity"]["tokens"] == 128 and report["sensitivity"]["widths"] == [2, 4]
    widths = [(x["bits_k"], x["bits_v"]) for x in report["layers"]]
    upgraded = sum(w == 4 for pair in widths for w in pair)
    # fp8 scales at head dim 16: 2 + 1 bits per element; a budget of 3.5 pays for 4-bit in a quarter of the 2n units
    assert upgraded == (2 * n) // 4 and report["bits_per_element"] <= 3.5
    for x in report["layers"]:
        s = x["sensitivity"]
        assert s["kl_k"] >= 0 and s["kl_v"] >= 0 and s["kl_k"] + s["kl_v"] > 0
        for kind in "kv":  # 4-bit beats 2-bit on every head's attention output
            assert all(a4 < a2 for a2, a4 in zip(s[f"attn_{kind}2"], s[f"attn_{kind}4"], strict=True))
    # the allocation upgrades the units with the largest predicted gain
    gain = {(x["layer"], kind): x["sensitivity"][f"kl_{kind}"] * (1 - sum(x["sensitivity"][f"attn_{kind}4"])
                                                                  / sum(x["sensitivity"][f"attn_{kind}2"]))
            for x in report["layers"] for kind in "kv"}
    chosen = {(x["layer"], kind) for x in report["layers"] for kind in "kv" if x[f"bits_{kind}"] == 4}
    assert min(gain[u] for u in chosen) >= max(g for u, g in gain.items() if u not in chosen)


def test_a_real_sigkill_mid_collect_reads_interrupted_and_resumes_bit_exact(tmp_path, tiny_model_dir):
    """``kill -9`` of a real ``oscar collect`` process once it has stored two batches: the store opens intact (the
    killed transaction never happened), the run reads ``interrupted`` in ``oscar runs`` (its row still says running:
    nothing got to record the kill), and ``--resume`` finishes it to the statistics of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys

    args = ["--model", str(tiny_model_dir), "--tokens", "8192", "--seq-len", "64", "--batch-size", "4",
            "--reservoir", "96"]
    store = tmp_path / "killed"
    cmd = [sys.executable, "-c", "from oscar_cli.cli import main; main()", "collect", *args, "--store", str(store)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "collect ended before it could be killed"
            runs = Store(store).list_runs() if (store / "oscar.duckdb").is_file() else []
            if runs and runs[-1].batches_done >= 2:
                break
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    run = Store(store).list_runs()[-1]
    assert run.status == "running" and run.live_status == "interrupted" and 2 <= run.batches_done < run.num_batches
    listed = json.loads(invoke("runs", "--store", store, "--json").stdout)
    assert listed["runs"][-1]["status"] == "interrupted"
    r = invoke("collect", *args, "--store", store, "--resume")
    assert r.exit_code == 0, r.output
    whole = tmp_path / "whole"
    assert invoke("collect", *args, "--store", whole).exit_code == 0
    a, b = Store(whole), Store(store)
    ra, rb = a.get_run("latest"), b.get_run("latest")
    assert rb.run_id == run.run_id and rb.tokens_done == ra.tokens_done and rb.live_status == "complete"
    sa, sb = a.load_stats(ra.run_id), b.load_stats(rb.run_id)
    assert sa.keys() == sb.keys()
    for key in sa:
        np.testing.assert_array_equal(sa[key][2], sb[key][2])


def test_two_collects_into_one_store_at_once_both_finish(tmp_path, tiny_model_dir):
    """Two ``oscar collect`` processes on one store at the same time (different data): each batch is one short
    transaction, so they take turns and both finish with their own complete run and the statistics each would
    have alone."""
    import subprocess
    import sys

    texts = []
    for i in range(2):
        t = tmp_path / f"text{i}.txt"
        t.write_text(" ".join(f"w{(i * 7 + j) % 50}" for j in range(20000)))
        texts.append(t)
    args = ["--model", str(tiny_model_dir), "--tokens", "2048", "--seq-len", "64", "--batch-size", "4",
            "--reservoir", "96"]
    shared = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", "from oscar_cli.cli import main; main()", "collect", *args,
                               "--data", str(t), "--store", str(shared)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for t in texts]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    runs = Store(shared).list_runs()
    assert sorted(r.live_status for r in runs) == ["complete", "complete"]
    for t in texts:  # the same statistics as a collect alone
        alone = tmp_path / f"alone-{t.stem}"
        assert invoke("collect", *args, "--data", t, "--store", alone).exit_code == 0
        ra = Store(alone).get_run("latest")
        rs = next(r for r in runs if r.data_digest == ra.data_digest)
        sa, ss = Store(alone).load_stats(ra.run_id), Store(shared).load_stats(rs.run_id)
        for key in sa:
            np.testing.assert_array_equal(sa[key][2], ss[key][2])


def test_kill_9_of_fit_and_eval_at_several_points_leaves_a_consistent_store(tmp_path, tiny_store, tiny_model_dir):
    """A real ``kill -9`` of ``oscar fit`` and of ``oscar eval`` at several moments (while the model loads, while it
    works, around the end): every artifact folder that exists loads and every registered artifact exists; an
    artifact folder is either whole or absent (its staging folder is swept by the next write); eval rows are whole
    methods. Then both commands run to the end on the same store and artifacts."""
    import os
    import signal
    import subprocess
    import sys

    from oscar_cli import artifact as art

    arts = tmp_path / "artifacts"
    main = [sys.executable, "-c", "from oscar_cli.cli import main; main()"]
    fit = [*main, "fit", "--store", str(tiny_store), "--artifacts", str(arts), "--sink", "4", "--recent", "8"]
    data = tmp_path / "text.txt"
    data.write_text(" ".join(f"w{i % 50}" for i in range(3000)))
    ev = [*main, "eval", "--store", str(tiny_store), "--model", str(tiny_model_dir), "--tasks", "oscar_ppl",
          "--methods", "bf16,int2-naive,int2-hadamard", "--seq-lengths", "64", "--limit", "2", "--data", str(data)]
    snapshots = []
    for cmd in (fit, ev):
        for delay in (0.5, 2.0, 3.5, 5.0):
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=60)
            st = Store(tiny_store)
            registered = {a["path"] for a in st.list_artifacts()}
            on_disk = {str(v.resolve()) for v in arts.glob("*/v*")} if arts.exists() else set()
            assert registered <= on_disk, (cmd[3], delay)
            for v in on_disk:
                art.load_artifact(v)  # whole, or it would not be there
            rows = st.list_evals()
            snapshots.append({m: sum(r["method"] == m for r in rows) for m in {r["method"] for r in rows}})
    assert invoke("fit", "--store", tiny_store, "--artifacts", arts, "--sink", "4", "--recent", "8").exit_code == 0
    assert not list(arts.glob("*/.tmp-*"))  # staging folders of killed fits swept
    before = len(Store(tiny_store).list_evals())
    r = invoke(*ev[3:])
    assert r.exit_code == 0, r.output
    rows = Store(tiny_store).list_evals()[before:]
    unit = {m: sum(x["method"] == m for x in rows) for m in ("bf16", "int2-naive", "int2-hadamard")}
    assert len(set(unit.values())) == 1 and unit["bf16"] >= 1
    assert all(n % unit["bf16"] == 0 for snap in snapshots for n in snap.values()), snapshots  # whole methods only
