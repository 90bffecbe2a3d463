"""benchmarks/sglang_h200.py's serve step off the GPU, with stand-ins for SGLang's servers and the project engine: a
step cut short keeps what it measured in WORK/serve.json, a re-run resumes without repeating it, and the tables
render from the saved results."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import load_benchmark


class FakeServer:
    def __init__(self, backend):
        self.backend, self.cached, self.stopped = backend, False, False

    def post(self, path, body=None, timeout=None):
        assert path == "/flush_cache"
        self.cached = False

    def stop(self):
        self.stopped = True


def test_serve_step_resumes_from_what_it_saved(tmp_path, monkeypatch):
    mod = load_benchmark("sglang_h200")
    prompts, prefix, suffixes = [[5, 6, 7], [8, 9]], [1, 2, 3, 4], [[10], [11]]
    started, engine_runs = [], []

    def make_prompts(model, work):
        path = work / "prompts.json"
        path.write_text(json.dumps(prompts))
        return path, prompts, prefix, suffixes

    def start(backend, model, port, work, artifact=None, extra=None):
        started.append(backend)
        return FakeServer(backend)

    def generate(srv, ids, n=mod.NEW_TOKENS):
        hit = len(prefix) if srv.cached and ids[:len(prefix)] == prefix else 0
        srv.cached = srv.cached or ids[:len(prefix)] == prefix
        return {"output_ids": [sum(ids) % 7, len(ids)], "meta_info": {"cached_tokens": hit}}

    def engine_outputs(model, store, artifact, path, out):
        engine_runs.append(artifact)
        if artifact is None and len(engine_runs) == 2:
            raise TimeoutError("the step's time limit")  # the first run stops in the engine half
        outs = [[sum(p) % 7, len(p) + (artifact is None)] for p in json.loads(Path(path).read_text())]
        return {"outputs": outs, "ppl_decode": 10.0 if artifact else 9.0}

    monkeypatch.setattr(mod, "make_prompts", make_prompts)
    monkeypatch.setattr(mod, "start", start)
    monkeypatch.setattr(mod, "generate", generate)
    monkeypatch.setattr(mod, "server_perplexity", lambda srv, work: 10.04 if srv.backend == "oscar" else 9.0)
    monkeypatch.setattr(mod, "engine_outputs", engine_outputs)
    args = SimpleNamespace(model=tmp_path / "m", artifact=tmp_path / "art", store=tmp_path / "store", port=1)

    with pytest.raises(TimeoutError):
        mod.step_serve(args, tmp_path)
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert set(saved) == {"oscar/outputs", "oscar/prefix", "oscar/ppl", "triton/outputs", "triton/prefix",
                          "triton/ppl", "oscar-cache/engine"}
    assert started == ["oscar", "triton"]

    text = mod.step_serve(args, tmp_path)
    assert started == ["oscar", "triton"]  # no server started again
    assert engine_runs == [args.artifact, None, None]  # only the missing engine run
    assert "| 3 | 2 / 100% | 1 / 50% |" in text  # oscar vs OscarCache equal; triton vs bf16 differ at token 1
    assert "| oscar (artifact) | 10.0400 | 10.0000 | 1.0040 |" in text
    assert text.count("| oscar | ") == len(suffixes) and "reused the prefix: yes" in text
