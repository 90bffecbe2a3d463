"""``oscar serve``: engine choice, the SGLang hand-off, refused arguments, artifact resolution and a real server
process that finishes its in-flight request on SIGTERM and exits 0."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import types

import pytest
import requests
import torch
from oscar_kernels.scheme import DecodeOptions
from serve_kit import save_wordkit, wait_until
from typer.testing import CliRunner

from oscar_cli.cli import app
from oscar_cli.cli import serve as serve_cli
from oscar_cli.serve.sglang.settings import read_settings

LAUNCH = "oscar_cli.serve.sglang.launch"


def invoke(*args: str):
    return CliRunner().invoke(app, ["serve", *args])


def one_line_error(result, code: int = 1) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == code and len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    return lines[0]


def fake_sglang(monkeypatch):
    mod = types.ModuleType("sglang")
    mod.__spec__ = importlib.machinery.ModuleSpec("sglang", None)
    monkeypatch.setitem(sys.modules, "sglang", mod)


def test_auto_picks_sglang_only_with_cuda_and_sglang(monkeypatch):
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    if importlib.util.find_spec("sglang") is None:
        assert serve_cli.pick_engine("auto") == "transformers"
    fake_sglang(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serve_cli.pick_engine("auto") == "transformers"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert serve_cli.pick_engine("auto") == "sglang"
    assert serve_cli.pick_engine("transformers") == "transformers"


def test_unknown_engine_and_option():
    assert "--engine 'vllm': choose auto, sglang or transformers" in one_line_error(invoke("--engine", "vllm"))
    assert invoke("--bogus").exit_code == 2  # a usage error


def test_extra_args_are_refused_for_transformers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # auto -> transformers
    for engine in ("transformers", "auto"):
        msg = one_line_error(invoke("--engine", engine, "--", "--tp-size", "2"))
        assert "extra engine arguments (--tp-size 2) are for --engine sglang" in msg
        assert "drop the part after --" in msg


def test_sglang_without_its_launch_module_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, LAUNCH, None)  # as if oscar_cli/serve/sglang/launch.py were not there
    msg = one_line_error(invoke("--engine", "sglang", "--artifact", "latest"))
    assert "the SGLang engine is not part of this installation" in msg
    assert "oscar_cli.serve.sglang.launch is missing" in msg and "use --engine transformers" in msg


def test_sglang_execs_what_build_launch_returns(monkeypatch, word_model, serve_store, word_artifact):
    calls: dict = {}

    def build_launch(model_path, artifact, host, port, extra, decode=None):
        calls["build"] = (model_path, artifact, host, port, extra)
        calls["decode"] = decode
        return ["/bin/sglang-server", "--model-path", model_path], {"SGLANG_PLUGINS": "oscar"}

    def execvpe(file, argv, env):
        calls["exec"] = (file, argv, env)
        raise SystemExit(0)  # instead of replacing the test process

    launch = types.ModuleType(LAUNCH)
    launch.build_launch = build_launch
    monkeypatch.setitem(sys.modules, LAUNCH, launch)
    monkeypatch.setattr(os, "execvpe", execvpe)
    r = invoke("--engine", "sglang", "--model", str(word_model), "--artifact", "latest", "--store", str(serve_store),
               "--host", "0.0.0.0", "--port", "8123", "--", "--tp-size", "2", "--mem-fraction-static", "0.8")
    assert r.exit_code == 0, r.output
    assert calls["build"] == (str(word_model), word_artifact, "0.0.0.0", 8123,
                              ["--tp-size", "2", "--mem-fraction-static", "0.8"])
    assert calls["decode"] == DecodeOptions()
    file, argv, env = calls["exec"]
    assert file == "/bin/sglang-server" and argv == ["/bin/sglang-server", "--model-path", str(word_model)]
    assert env["SGLANG_PLUGINS"] == "oscar" and env["PATH"] == os.environ["PATH"]
    assert re.search(r"artifact \S+/v1, INT2 group 32, sink 4, recent 8\) at http://0\.0\.0\.0:8123/v1 "
                     r"\(engine sglang\)", r.output), r.output


DECODE_FLAGS = [
    (["--int8-scores"], DecodeOptions(int8_scores=True)),
    (["--int8-values"], DecodeOptions(int8_values=True)),
    (["--decode-tuning=lean_tiles=true,split_tokens=4096"], DecodeOptions(lean_tiles=True, split_tokens=4096)),
    (["--int8-scores", "--int8-values", "--decode-tuning", " fused_update=True, max_registers=0 ,"],
     DecodeOptions(int8_scores=True, int8_values=True, fused_update=True, max_registers=0)),
]


@pytest.mark.parametrize("flags, options", DECODE_FLAGS)
def test_decode_flags_become_one_options_value_in_the_settings(monkeypatch, word_model, serve_store, word_artifact,
                                                               flags, options):
    """The int8 switches and --decode-tuning's items become one DecodeOptions, written by the real build_launch
    into the server's settings (the plugin reads them back there and hands them to its decode plan)."""
    calls: dict = {}

    def execvpe(file, argv, env):
        calls["argv"] = argv
        raise SystemExit(0)

    monkeypatch.setattr(os, "execvpe", execvpe)
    r = invoke("--engine", "sglang", "--model", str(word_model), "--artifact", "latest", "--store", str(serve_store),
               *flags)
    assert r.exit_code == 0, r.output
    argv = calls["argv"]
    text = argv[argv.index("--json-model-override-args") + 1]
    assert json.loads(text)["oscar"]["decode"] == options.to_dict()
    settings = read_settings(text)
    assert settings.decode == options and settings.artifact == word_artifact.resolve()


@pytest.mark.parametrize("flag", ["--int8-scores", "--int8-values", "--decode-tuning=lean_tiles=false"])
def test_decode_flags_are_sglang_only(word_model, serve_store, flag):
    msg = one_line_error(invoke("--engine", "transformers", "--model", str(word_model), "--artifact", "latest",
                                "--store", str(serve_store), flag))
    assert f"{flag.partition('=')[0]} is an SGLang engine option" in msg and "--engine sglang" in msg


def test_decode_tuning_help_names_every_decode_option():
    r = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert r.exit_code == 0 and "--decode-tuning" in r.output
    assert all(name in r.output for name in DecodeOptions.names()), r.output


BAD_TUNING = [
    ("lean=true", "--decode-tuning 'lean=true': expected KEY=VALUE with KEY one of int8_scores"),
    ("lean_tiles", "--decode-tuning 'lean_tiles': expected KEY=VALUE"),
    ("lean_tiles=1", "--decode-tuning lean_tiles=1: lean_tiles takes true or false"),
    ("split_tokens=many", "--decode-tuning split_tokens=many: split_tokens takes a non-negative integer"),
    ("split_tokens=0", "split_tokens must be a positive integer"),
    ("max_registers=1.5", "max_registers takes a non-negative integer"),
    ("movmatrix=true,movmatrix=false", "--decode-tuning movmatrix is given twice"),
]


@pytest.mark.parametrize("tuning, words", BAD_TUNING)
def test_bad_decode_tuning_is_a_one_line_usage_error(monkeypatch, tuning, words):
    monkeypatch.setattr(serve_cli, "pick_engine", lambda e: pytest.fail("must fail before choosing the engine"))
    msg = one_line_error(invoke("--engine", "sglang", "--decode-tuning", tuning), code=2)
    assert words in msg


def test_sglang_needs_an_artifact(monkeypatch, word_model, serve_store):
    launch = types.ModuleType(LAUNCH)
    launch.build_launch = lambda *a: pytest.fail("must not be called")
    monkeypatch.setitem(sys.modules, LAUNCH, launch)
    msg = one_line_error(invoke("--engine", "sglang", "--model", str(word_model), "--store", str(serve_store)))
    assert "--engine sglang serves an artifact's INT2 cache: pass --artifact" in msg


def test_artifact_refs_are_checked(word_model, serve_store, word_artifact, tmp_path):
    msg = one_line_error(invoke("--engine", "transformers", "--model", str(word_model), "--artifact", "v9",
                                "--store", str(serve_store)))
    assert "artifact 'v9' not found" in msg
    other = save_wordkit(tmp_path / "other-model", seed=1)  # same shapes, other weights
    msg = one_line_error(invoke("--engine", "transformers", "--model", str(other), "--artifact", str(word_artifact),
                                "--store", str(serve_store)))
    assert "fingerprint" in msg and "fit an artifact for this model" in msg


def test_busy_port_is_one_line(word_model, serve_store):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        msg = one_line_error(invoke("--engine", "transformers", "--model", str(word_model), "--store",
                                    str(serve_store), "--port", str(s.getsockname()[1])))
    assert "cannot listen on 127.0.0.1:" in msg and "pass another --port" in msg


def test_serve_process_finishes_in_flight_and_exits_0_on_sigterm(word_model, serve_store, word_artifact, tmp_path):
    """The real command in its own process: prints its URL and scheme, resolves ``latest`` through the store, answers,
    and on SIGTERM stops accepting, lets the running request finish and exits 0."""
    cmd = [sys.executable, "-c", "from oscar_cli.cli import main; main()", "serve", "--engine", "transformers",
           "--model", str(word_model), "--artifact", "latest", "--store", str(serve_store), "--port", "0",
           "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "400"})
    lines: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stderr], daemon=True).start()
    try:
        first = lines.get(timeout=120)
        m = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", first)
        assert m, first
        assert re.search(r"\(oscar, artifact \S+/v1, INT2 group 32, sink 4, recent 8\)", first)
        url = m.group(1)
        card = requests.get(url + "/models", timeout=10).json()["data"][0]
        assert card["id"] == "tiny" and card["oscar"]["artifact"]["path"] == str(word_artifact.resolve())
        result: dict = {}

        def ask():
            r = requests.post(url + "/completions", timeout=60, json={"model": "tiny", "prompt": "w1 w2",
                                                                       "max_tokens": 400, "ignore_eos": True})
            result["r"] = r

        asker = threading.Thread(target=ask)
        asker.start()
        flight = re.compile(r"^oscar_requests_in_flight 1$", re.M)
        wait_until(lambda: flight.search(requests.get(url[:-3] + "/metrics", timeout=10).text), step=0.02)
        proc.send_signal(signal.SIGTERM)
        asker.join(60)
        r = result["r"]
        assert r.status_code == 200
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 400
        assert proc.wait(60) == 0
        rest = []
        while not lines.empty():
            rest.append(lines.get())
        assert any("server stopped (SIGTERM)" in ln for ln in rest), rest
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(url + "/models", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
