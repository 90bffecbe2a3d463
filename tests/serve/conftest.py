"""Serving fixtures: a word-level tiny Llama saved as a model folder, an artifact fitted on it, a bf16 server."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # serve_kit.py (--import-mode=importlib)
from helpers import WordKit  # noqa: E402
from serve_kit import Server, load_engine, save_wordkit  # noqa: E402


@pytest.fixture(scope="session")
def word_model(tmp_path_factory) -> Path:
    """A 2-layer random Llama (4 heads, 2 KV heads, head dim 32, 1024 positions) with a word tokenizer, as a folder."""
    return save_wordkit(tmp_path_factory.mktemp("word-model"))


@pytest.fixture(scope="session")
def serve_store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve-store")


@pytest.fixture(scope="session")
def word_artifact(word_model, serve_store, tmp_path_factory) -> Path:
    """``oscar collect`` (1,024 tokens) and ``oscar fit`` (sink 4, recent 8) on ``word_model``; the artifact folder."""
    from typer.testing import CliRunner

    from oscar_cli.cli import app

    data = tmp_path_factory.mktemp("calib") / "calib.txt"
    data.write_text(WordKit.text(3000, seed=1))
    arts = tmp_path_factory.mktemp("serve-artifacts")
    runner = CliRunner()
    r = runner.invoke(app, ["collect", "--model", str(word_model), "--data", str(data), "--tokens", "1024",
                            "--seq-len", "128", "--batch-size", "8", "--reservoir", "256", "--store", str(serve_store)],
                      catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["fit", "--store", str(serve_store), "--artifacts", str(arts), "--sink", "4", "--recent",
                            "8"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return next(arts.glob("*/v1"))


@pytest.fixture(scope="session")
def mixed_artifact(word_model, serve_store, word_artifact, tmp_path_factory) -> Path:
    """``oscar fit`` of ``word_artifact``'s run with FP8 scales and a budget of 3.25 bits per element: 4-bit keys
    or values in the layers the sensitivity pass picks."""
    from typer.testing import CliRunner

    from oscar_cli.cli import app

    arts = tmp_path_factory.mktemp("mixed-artifacts")
    r = CliRunner().invoke(app, ["fit", "--store", str(serve_store), "--artifacts", str(arts), "--sink", "4",
                                 "--recent", "8", "--scale-dtype", "fp8", "--bits-per-element", "3.25",
                                 "--sensitivity-tokens", "256", "--model", str(word_model)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return next(arts.glob("*/v1"))


@pytest.fixture(scope="module")
def bf16_server(word_model, serve_store):
    """A server on the word model without artifact (bf16), model id ``tiny``, a queue of 8."""
    srv = Server(load_engine(word_model, serve_store), model_id="tiny", max_queue=8)
    yield srv
    srv.stop()
