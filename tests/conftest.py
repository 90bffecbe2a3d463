"""Shared fixtures: the embedded default model converted once per session, and a tiny random-weight Llama."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers.py (pytest runs with --import-mode=importlib)
from helpers import EMBEDDED, WordKit, build_llama  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: fail fast instead of retrying the network
if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in the interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def embedded_store(tmp_path_factory) -> Path:
    """A store folder holding the safetensors copy of the embedded default (converted once, ~20 s)."""
    from oscar_cli.models import resolve

    store = tmp_path_factory.mktemp("store")
    resolve(EMBEDDED, store)
    return store


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_store) -> Path:
    """A 2-layer random-weight Llama (GQA 4:2, head dim 16) saved with the embedded model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    src = embedded_store / "models" / EMBEDDED
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def embedded_artifact(embedded_store, tmp_path_factory) -> Path:
    """``oscar collect`` (16,384 tokens) and ``oscar fit --per-head`` on the embedded default; returns the artifact."""
    from typer.testing import CliRunner

    from oscar_cli.cli import app

    arts = tmp_path_factory.mktemp("artifacts")
    runner = CliRunner()
    r = runner.invoke(app, ["collect", "--store", str(embedded_store), "--tokens", "16384", "--seq-len", "512",
                            "--batch-size", "8"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["fit", "--store", str(embedded_store), "--artifacts", str(arts), "--per-head",
                            "--sink", "16", "--recent", "64"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return next(arts.glob("*/v1"))


@pytest.fixture()
def tiny_llama():
    """The builder of tiny random Llamas (:func:`build_llama`)."""
    return build_llama


@pytest.fixture()
def kit() -> WordKit:
    return WordKit()
