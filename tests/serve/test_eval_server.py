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


class _FakeSGLangInfo:
    """An SGLang-shaped server for ``server_info``: a plain model card and ``/server_info`` with its server args."""

    def __init__(self, server_args: dict):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                body = {"/v1/models": {"object": "list", "data": [{"id": "m", "object": "model", "root": "/x"}]},
                        "/server_info": {**server_args, "version": "0.5.17"}}.get(self.path)
                raw = json.dumps(body or {"detail": "Not Found"}).encode()
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def test_server_info_reads_what_sglang_serves(word_artifact, tmp_path):
    """Against SGLang (no ``oscar`` block in its model card) the rows still say what was served: the oscar backend's
    artifact from the server arguments, name and scheme from its manifest; a baseline backend and KV dtype by name;
    a server without ``/server_info`` stays ``server``."""
    import json

    from oscar_cli.artifact import load_artifact
    from oscar_cli.eval.remote import server_info

    art = load_artifact(word_artifact)
    over = json.dumps({"oscar": {"artifact": str(word_artifact), "anchors": 64}})
    cases = [({"attention_backend": "oscar", "json_model_override_args": over},
              ("oscar", art.name, art.scheme.to_dict())),
             ({"attention_backend": "oscar", "json_model_override_args": json.dumps(
                 {"oscar": {"artifact": str(tmp_path / "elsewhere")}})}, ("oscar", str(tmp_path / "elsewhere"), None)),
             ({"attention_backend": "flashinfer", "kv_cache_dtype": "fp8_e4m3"}, ("sglang-flashinfer-fp8_e4m3", None,
                                                                                  None)),
             ({"attention_backend": "triton", "kv_cache_dtype": "auto"}, ("sglang-triton-bf16", None, None)),
             ({}, ("server", None, None))]
    for args, want in cases:
        srv = _FakeSGLangInfo(args)
        try:
            info = server_info(srv.url + "/v1")
        finally:
            srv.close()
        assert (info.method, info.artifact, info.scheme) == want and info.model_id == "m"
