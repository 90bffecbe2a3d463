"""``oscar eval`` end to end on a tiny model (load_model stubbed), with the real store."""

import json

import pytest
from typer.testing import CliRunner

from oscar_cli.cli import eval as eval_cli  # noqa: F401  (registers the command)
from oscar_cli.cli._app import app


@pytest.fixture
def stub_model(monkeypatch, kit):
    from oscar_cli import models
    from oscar_cli.eval import run

    def fake_load(spec, store, dtype=None, device="cpu"):
        return models.LoadedModel(model=kit.llama(), tokenizer=kit.tokenizer(), fingerprint="sha256:tiny",
                                  slug="tiny", source="memory")

    monkeypatch.setattr(run, "load_model", fake_load)  # where `oscar eval` loads its model


def test_eval_ppl_stores_rows_and_prints_json(stub_model, tmp_path, kit):
    data = tmp_path / "text.txt"
    data.write_text(kit.text(400))
    csv = tmp_path / "out.csv"
    r = CliRunner().invoke(app, ["eval", "--tasks", "oscar_ppl", "--methods", "bf16,int2-naive,int2-hadamard-clip",
                                 "--sink", "2", "--recent", "8", "--seq-lengths", "64,128", "--limit", "2",
                                 "--data", str(data), "--store", str(tmp_path / "st"), "--json", "--csv", str(csv)])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert len(rows) == 6 and {x["method"] for x in rows} == {"bf16", "int2-naive", "int2-hadamard-clip"}
    assert {(x["config"]["segments"], x["config"]["mode"]) for x in rows} == {(2, "teacher-forced")}
    bf = {x["config"]["seq_len"]: x["value"] for x in rows if x["method"] == "bf16"}
    for x in rows:
        assert x["delta_bf16"] == pytest.approx(x["value"] - bf[x["config"]["seq_len"]])
        assert x["bits_per_element"] == (16 if x["method"] == "bf16" else pytest.approx(
            ((x["config"]["seq_len"] - 10) * (2 + 32 / 32) + 10 * 16) / x["config"]["seq_len"]))
    from oscar_cli.store import Store

    stored = Store(tmp_path / "st").list_evals()
    assert len(stored) == 6 and {s["task"] for s in stored} == {"oscar_ppl"}
    assert csv.read_text().count("\n") == 7


def test_json_stays_parseable_when_libraries_print(stub_model, tmp_path, kit, monkeypatch):
    from oscar_cli.eval import run

    real = run.perplexity

    def chatty(*a, **k):
        print("a library talking on stdout")
        return real(*a, **k)

    monkeypatch.setattr(run, "perplexity", chatty)
    data = tmp_path / "text.txt"
    data.write_text(kit.text(200))
    r = CliRunner().invoke(app, ["eval", "--tasks", "oscar_ppl", "--methods", "bf16", "--seq-lengths", "64",
                                 "--limit", "1", "--data", str(data), "--store", str(tmp_path / "st"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)[0]["method"] == "bf16"
    assert "a library talking" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--methods", "int9"], "unknown method"),
    (["--seq-lengths", "abc"], "--seq-lengths"),
    (["--limit", "0"], "--limit"),
    (["--data", "/nonexistent.txt"], "--data"),
])
def test_bad_input_is_one_line_exit_1(stub_model, tmp_path, args, needle):
    r = CliRunner().invoke(app, ["eval", "--store", str(tmp_path)] + args)
    assert r.exit_code == 1
    assert needle in r.output and r.output.strip().count("\n") <= 1


def test_the_table_names_each_rows_scheme():
    from oscar_cli.cli.eval import _scheme_label
    from oscar_cli.config import QuantScheme

    assert _scheme_label(QuantScheme(group=64, sink=16, recent=64).to_dict()) == "int2 g64 s16/r64"
    alloc = QuantScheme(group=64, sink=16, recent=64, scale_dtype="fp8", bits_k=(4, 2, 4), bits_v=(2, 2, 2))
    assert _scheme_label(alloc.to_dict()) == "mix2-4k2v0 g64 fp8 s16/r64"
    assert _scheme_label({"bits": 2, "group": 8, "sink": 1, "recent": 2, "levels": "odd"}) == "int2 g8 s1/r2"


def test_an_unknown_task_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from oscar_cli.eval import lm_eval_tasks, run

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the task names were checked")

    monkeypatch.setattr(run, "load_model", no_load)
    monkeypatch.setattr(lm_eval_tasks, "_index", lambda: frozenset({"hellaswag"}))  # lm-eval's index, stubbed
    r = CliRunner().invoke(app, ["eval", "--store", str(tmp_path), "--tasks", "oscar_ppl,no_such_task"])
    assert r.exit_code == 1 and "unknown lm-eval task(s) no_such_task" in r.output
    assert r.output.strip().count("\n") <= 1


def test_oscar_without_artifact_is_a_clear_error(stub_model, tmp_path, kit):
    data = tmp_path / "t.txt"
    data.write_text(kit.text(200))
    r = CliRunner().invoke(app, ["eval", "--methods", "oscar", "--data", str(data), "--seq-lengths", "64",
                                 "--store", str(tmp_path / "st")])
    assert r.exit_code == 1 and "artifact" in r.output


def make_artifact(store, tmp_path, *, bits=2, sink=2, recent=8, method="oscar", per_head=False, seed=0):
    """A fitted-looking artifact for the WordKit llama (2 layers, 2 KV heads, d 32), registered in ``store``."""
    import torch

    from oscar_cli import artifact as art
    from oscar_cli.config import AttentionShape, QuantScheme
    from oscar_cli.store import Store

    g = torch.Generator().manual_seed(seed)
    h, d = (2 if per_head else 1), 32
    r = torch.linalg.qr(torch.randn(2, h, d, d, generator=g, dtype=torch.float64))[0].float()
    tensors = {"layers": torch.arange(2), "r_k": r, "r_v": r.transpose(-1, -2).contiguous(),
               "clip_k": torch.full((2, h), 0.9), "clip_v": torch.full((2, h), 0.95),
               "eig_k": torch.rand(2, h, d), "eig_v": torch.rand(2, h, d)}
    m = art.Manifest(model_slug="tiny", model_fingerprint="sha256:tiny", run_id=None, stats_digest="", data_digest="",
                     calibration_tokens=0, method=method, per_head=per_head, layers=(0, 1),
                     shape=AttentionShape(2, 4, 2, d), scheme=QuantScheme(bits=bits, sink=sink, recent=recent).resolved(d),
                     fit_clip=True, clip_grid=(0.9,), metrics={})
    path = art.write_artifact(tmp_path / "arts", m, tensors, "")
    Store(store).register_artifact(path, art.read_manifest(path).to_dict())
    return path


def _eval(tmp_path, *args):
    return CliRunner().invoke(app, ["eval", "--store", str(tmp_path / "st"), *args])


def test_the_artifact_scheme_is_what_runs(stub_model, tmp_path, kit):
    """A 4-bit artifact evaluates at 4 bits (and is closer to bf16 than the same rotations at 2 bits); data-free
    baselines take its sink/recent; a --bits override that cannot hold names both values."""
    data = tmp_path / "t.txt"
    data.write_text(kit.text(400))
    v4 = make_artifact(tmp_path / "st", tmp_path, bits=4, sink=2, recent=8)
    v2 = make_artifact(tmp_path / "st", tmp_path, bits=2, sink=2, recent=8)
    common = ["--tasks", "oscar_ppl", "--seq-lengths", "128", "--limit", "2", "--data", str(data), "--json"]
    r = _eval(tmp_path, "--methods", f"bf16,int2-naive,oscar@{v4},oscar@{v2}", *common)
    assert r.exit_code == 0, r.output
    rows = {x["method"]: x for x in json.loads(r.stdout)}
    s4, s2 = rows[f"oscar@{v4}"]["config"]["scheme"], rows[f"oscar@{v2}"]["config"]["scheme"]
    assert (s4["bits"], s4["group"], s4["sink"], s4["recent"]) == (4, 32, 2, 8) and s2["bits"] == 2
    assert rows["int2-naive"]["config"]["scheme"]["sink"] == 2  # the baseline runs at the artifact's sink/recent
    assert rows[f"oscar@{v4}"]["bits_per_element"] == pytest.approx(((128 - 10) * (4 + 1) + 10 * 16) / 128)
    # and the codes really are 4-bit: the same rotations quantize with ~4x less logit error than at 2 bits
    import torch

    from oscar_cli.artifact import load_artifact
    from oscar_cli.methods import get_method, scheme_for
    from oscar_cli.prepare import prepare

    model, x = kit.llama(), torch.randint(3, 93, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(x, use_cache=False).logits
        errs = []
        for p in (v4, v2):
            a = load_artifact(p)
            prepare(model, get_method("oscar"), scheme_for(get_method("oscar"), 32, artifact_scheme=a.scheme), a)
            errs.append((model(x, use_cache=False).logits - exact).norm().item())
    assert errs[0] < 0.4 * errs[1], errs
    r = _eval(tmp_path, "--methods", f"oscar@{v4}", "--bits", "2", *common)
    assert r.exit_code == 1 and "4 bits" in r.output and "--bits 2" in r.output
    assert r.output.strip().count("\n") <= 1
    r = _eval(tmp_path, "--methods", f"oscar@{v4}", "--group", "12", *common)
    assert r.exit_code == 1 and "group 12 must divide the head dim 32" in r.output
    r = _eval(tmp_path, "--methods", f"oscar@{v4}", "--recent", "16", *common)
    assert r.exit_code == 0 and json.loads(r.stdout)[0]["config"]["overrides"] == {"recent": 16}


def test_missed_recipe_thresholds_fail_the_run(stub_model, tmp_path, kit):
    data = tmp_path / "t.txt"
    data.write_text(kit.text(400))
    make_artifact(tmp_path / "st", tmp_path, sink=2, recent=8)
    recipe = tmp_path / "r.yaml"

    def run(thresholds):
        recipe.write_text("model: tiny\neval:\n  tasks: [oscar_ppl]\n  methods: [bf16, int2-naive, oscar]\n"
                          f"  seq_lengths: [64, 128]\n  limit: 1\nthresholds:\n{thresholds}")
        return _eval(tmp_path, "--recipe", str(recipe), "--data", str(data))

    r = run("  - {method: oscar, task: oscar_ppl, metric: ppl, max_ratio: 1000}\n")
    assert r.exit_code == 0, r.output
    assert "all 1 recipe thresholds met" in r.output
    r = run("  - {method: oscar, task: oscar_ppl, metric: ppl, max_ratio: 0.5}\n"
            "  - {method: int2-naive, task: oscar_ppl, metric: ppl, seq_len: 64, min: 1.0e+9}\n"
            "  - {method: bf16, task: oscar_ppl, metric: ppl, max: 1.0e+9}\n")
    assert r.exit_code == 1
    missed = [line for line in r.output.splitlines() if line.startswith("threshold missed")]
    assert len(missed) == 3, r.output  # oscar at both lengths, int2-naive at 64; the bf16 bound holds
    assert any("oscar oscar_ppl ppl@128" in m and "ratio to bf16" in m and "max_ratio 0.5" in m for m in missed)
    assert any("int2-naive oscar_ppl ppl@64" in m and "min 1e+09" in m for m in missed)
    from oscar_cli.store import Store

    assert len(Store(tmp_path / "st").list_evals()) == 12  # the rows are stored even when thresholds fail


def test_fit_rotation_refs_pick_the_newest_matching_artifact(tmp_path):
    from oscar_cli.errors import OscarError
    from oscar_cli.eval.run import resolve_artifact_ref
    from oscar_cli.store import Store

    st = tmp_path / "st"
    for i, (method, per_head) in enumerate([("kcov", True), ("kcov", False), ("kcov", True), ("oscar", False)]):
        make_artifact(st, tmp_path, method=method, per_head=per_head, seed=i)
    store = Store(st)
    assert resolve_artifact_ref(store, "fit:kcov+per-head", "tiny").name == "v3"
    assert resolve_artifact_ref(store, "fit:kcov", "tiny").name == "v2"
    assert resolve_artifact_ref(store, "v1", "tiny").name == "v1"
    with pytest.raises(OscarError, match="oscar fit --method kcov-uh"):
        resolve_artifact_ref(store, "fit:kcov-uh", "tiny")


@pytest.mark.slow
def test_shipped_recipe_thresholds_hold(embedded_store, embedded_artifact):
    """`oscar eval --recipe recipes/smollm2-135m.yaml` on the embedded default meets the recipe's thresholds."""
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m.yaml"
    r = CliRunner().invoke(app, ["eval", "--recipe", str(recipe), "--store", str(embedded_store), "--artifact",
                                 str(embedded_artifact), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = {x["method"]: x["value"] for x in json.loads(r.stdout)}
    assert rows["bf16"] < rows["oscar"] < rows["int2-hadamard"] < rows["int2-naive"], rows
