"""``oscar bench`` as a command: flags parsed into the library's configuration, usage errors (exit 2) and one-line
refusals (exit 1) before anything runs, and rendering through the command. The library itself is tested beside its
modules (tests/bench/)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from oscar_cli import bench
from oscar_cli.bench.records import load_records
from oscar_cli.bench.render import results_section
from oscar_cli.cli import app

SAMPLE = Path(__file__).parent / "data" / "bench_e2e_sample.jsonl"
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["bench", *map(str, args)])


def one_line_error(result, *words, code=1):
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for w in words:
        assert w in lines[0], lines[0]


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("args, words", [
    (["--configs", "oscar,vllm"], ["vllm", "flashinfer-fp8"]),
    (["--configs", " , "], ["configuration"]),
    (["--measure", "capacity,speed"], ["speed", "throughput"]),
    (["--latency-contexts", "8k,32k"], ["8k,32k"]),
])
def test_bad_values_are_usage_errors(args, words, tmp_path):
    r = invoke(*args, "--out", tmp_path / "o")
    assert r.exit_code == 2, r.output
    for w in words:
        assert w in r.output
    assert not (tmp_path / "o").exists()


def test_refuses_with_one_line_without_sglang(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    r = invoke("--out", tmp_path / "o", "--tokenizer", tmp_path)
    one_line_error(r, "SGLang is not importable", "--render")
    assert not (tmp_path / "o").exists()


def test_refuses_with_one_line_without_cuda(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    fake = importlib.machinery.ModuleSpec("sglang", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "sglang" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = invoke("--out", tmp_path / "o", "--tokenizer", tmp_path)
    one_line_error(r, "CUDA is not available", "--render")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("tuning, words", [
    ("lean=1", ["--decode-tuning 'lean=1'", "lean_tiles", "split_tokens"]),
    ("split_tokens=0", ["--decode-tuning: decode option split_tokens must be a positive integer"]),
])
def test_bad_decode_tuning_is_a_one_line_usage_error_before_anything_runs(tuning, words, tmp_path):
    r = invoke("--configs", "oscar", "--decode-tuning", tuning, "--out", tmp_path / "o")
    one_line_error(r, *words, code=2)
    assert not (tmp_path / "o").exists()


def test_decode_tuning_without_an_oscar_configuration_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "missing_runtime", lambda: None)
    r = invoke("--configs", "flashinfer", "--decode-tuning", "split_tokens=4096", "--out", tmp_path / "o",
               "--tokenizer", tmp_path)
    one_line_error(r, "--decode-tuning applies to the oscar configurations", "--configs")
    assert not (tmp_path / "o").exists()


def test_flags_become_the_runs_configuration_and_its_records_are_rendered(monkeypatch, tmp_path):
    """What the command hands the library (flags parsed, names ordered and checked, --decode-tuning in one form,
    the arguments after --, the command line) and what it renders from the records the run wrote."""
    seen = {}

    def run(cfg, progress):
        seen["cfg"] = cfg
        shutil.copy(SAMPLE, Path(cfg.out) / "results.jsonl")  # as a run that measured the sample would leave it
        return load_records(SAMPLE)

    monkeypatch.setattr(bench, "missing_runtime", lambda: None)
    monkeypatch.setattr(bench, "run", run)
    (tmp_path / "o").mkdir()
    md = tmp_path / "R.md"
    r = invoke("--configs", "oscar-int8-pv,flashinfer", "--measure", "latency", "--profile", "--out", tmp_path / "o",
               "--tokenizer", tmp_path, "--latency-contexts", "8192,32768", "--decode-tuning",
               "split_tokens=4096, lean_tiles=True", "--commit", "abc1234", "--results-md", md, "--",
               "--chunked-prefill-size", "4096")
    assert r.exit_code == 0, r.output
    cfg = seen["cfg"]
    assert cfg.configs == ("flashinfer", "oscar-int8-pv") and cfg.measures == ("profile", "latency")
    assert cfg.latency_contexts == (8192, 32768) and cfg.tokenizer == tmp_path and cfg.commit == "abc1234"
    assert cfg.decode_tuning == "lean_tiles=true,split_tokens=4096"
    assert cfg.extra == ("--chunked-prefill-size", "4096")
    assert "4,500,000" in r.output and "SYNTHETIC SAMPLE" in r.output
    assert md.read_text() == "\n" + results_section(load_records(SAMPLE))


# ------------------------------------------------------------------------------------------------ rendering
def test_render_writes_section_plot_and_json(tmp_path):
    md, png = tmp_path / "R.md", tmp_path / "p.png"
    r = invoke("--render", SAMPLE, "--results-md", md, "--plot", png)
    assert r.exit_code == 0, r.output
    assert "4,500,000" in r.output and "SYNTHETIC SAMPLE" in r.output
    assert md.read_text() == "\n" + results_section(load_records(SAMPLE))
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = invoke("--render", SAMPLE, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == load_records(SAMPLE)


def test_render_without_results_md_writes_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    default = tmp_path / "benchmarks" / "RESULTS.md"
    default.write_text("before\n")
    r = invoke("--render", SAMPLE)
    assert r.exit_code == 0, r.output
    assert default.read_text() == "before\n"


def test_render_refuses_bad_files_with_one_line(tmp_path):
    one_line_error(invoke("--render", tmp_path / "missing.jsonl"), "cannot read")
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n{"b": 2}\n')
    one_line_error(invoke("--render", tmp_path / "x.jsonl"), "no oscar bench records")
