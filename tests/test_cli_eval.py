"""``oscar eval`` end to end on a tiny model (load_model stubbed), with the real store."""

import json

import pytest
from typer.testing import CliRunner

from oscar_cli.cli import eval as eval_cli  # noqa: F401  (registers the command)
from oscar_cli.cli._app import app


@pytest.fixture
def stub_model(monkeypatch, kit):
    from oscar_cli import models

    def fake_load(spec, store, dtype=None, device="cpu"):
        return models.LoadedModel(model=kit.llama(), tokenizer=kit.tokenizer(), fingerprint="sha256:tiny",
                                  slug="tiny", source="memory")

    monkeypatch.setattr(models, "load_model", fake_load)


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
    from oscar_cli import evaluate as ev

    real = ev.perplexity

    def chatty(*a, **k):
        print("a library talking on stdout")
        return real(*a, **k)

    monkeypatch.setattr(ev, "perplexity", chatty)
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


def test_oscar_without_artifact_is_a_clear_error(stub_model, tmp_path, kit):
    data = tmp_path / "t.txt"
    data.write_text(kit.text(200))
    r = CliRunner().invoke(app, ["eval", "--methods", "oscar", "--data", str(data), "--seq-lengths", "64",
                                 "--store", str(tmp_path / "st")])
    assert r.exit_code == 1 and "artifact" in r.output


def test_fit_method_refs_pick_the_newest_matching_artifact(tmp_path):
    from oscar_cli.errors import OscarError

    arts = []
    for i, (method, per_head) in enumerate([("kcov", True), ("kcov", False), ("kcov", True), ("oscar", False)]):
        p = tmp_path / f"v{i + 1}"
        p.mkdir()
        (p / "manifest.json").write_text(json.dumps({"method": method, "per_head": per_head}))
        arts.append({"method": method, "path": str(p)})

    class FakeStore:
        def list_artifacts(self, slug):
            return arts

        def resolve_artifact(self, ref, slug):
            return tmp_path / ref

    st = FakeStore()
    assert eval_cli._resolve_ref(st, "fit:kcov+per-head", "m").name == "v3"
    assert eval_cli._resolve_ref(st, "fit:kcov", "m").name == "v2"
    assert eval_cli._resolve_ref(st, "v1", "m").name == "v1"
    with pytest.raises(OscarError, match="oscar fit --method kcov-uh"):
        eval_cli._resolve_ref(st, "fit:kcov-uh", "m")
