"""`oscar eval --server`: the same tasks through a running server (the embedded one here) give the in-process scores,
and the rows record the server's artifact and scheme."""

import json

import pytest
from serve_kit import Server, load_engine
from typer.testing import CliRunner

from oscar_cli.cli import app


@pytest.fixture(scope="module")
def oscar_server(word_model, serve_store, word_artifact):
    srv = Server(load_engine(word_model, serve_store, word_artifact), model_id="tiny-oscar", max_queue=8)
    yield srv
    srv.stop()


def _eval(*args):
    r = CliRunner().invoke(app, ["eval", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_server_scores_equal_the_in_process_path(oscar_server, word_model, serve_store, word_artifact, tmp_path, kit):
    data = tmp_path / "held.txt"
    data.write_text(kit.text(600, seed=7))
    common = ["--model", word_model, "--store", serve_store, "--tasks", "oscar_ppl,oscar_niah", "--seq-lengths", "96",
              "--limit", "2", "--data", data]
    served = {r["task"]: r for r in _eval("--server", oscar_server.base, *common)}
    local = {r["task"]: r for r in _eval("--methods", f"oscar@{word_artifact}", *common)}
    assert set(served) == set(local) == {"oscar_ppl", "oscar_niah"}
    ppl_s, ppl_l = served["oscar_ppl"]["value"], local["oscar_ppl"]["value"]
    assert ppl_s == pytest.approx(ppl_l, rel=1e-4)  # prompt logprobs through the cache == teacher-forced scoring
    assert served["oscar_niah"]["value"] == local["oscar_niah"]["value"]
    s = served["oscar_ppl"]
    assert s["method"] == "oscar" and s["artifact"] == local["oscar_ppl"]["artifact"]
    assert s["config"]["scheme"] == local["oscar_ppl"]["config"]["scheme"]
    assert s["config"]["server"] == oscar_server.base and s["config"]["mode"] == "server"


def test_server_refusals_are_one_line(oscar_server, word_model, serve_store):
    for extra, needle in ((["--sink", "2"], "cannot change a running server"),
                          (["--methods", "bf16"], "do not apply to --server")):
        r = CliRunner().invoke(app, ["eval", "--server", oscar_server.base, "--model", str(word_model), "--store",
                                     str(serve_store), *extra])
        assert r.exit_code == 1 and needle in r.output and r.output.strip().count("\n") == 0, r.output
    r = CliRunner().invoke(app, ["eval", "--server", "http://127.0.0.1:9", "--model", str(word_model), "--store",
                                 str(serve_store)])
    assert r.exit_code == 1 and "cannot reach server" in r.output
