"""``oscar bench``'s library on CPU: a tokenizer folder and the bench's own Qwen3-8B-shaped model and artifact."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_kit.py (--import-mode=importlib)


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> Path:
    """A tokenizer folder: a tokenizer.json with 480 tokens and 20 added ones (ids 0..499)."""
    folder = tmp_path_factory.mktemp("tok")
    tok = {"model": {"type": "WordLevel", "vocab": {f"w{i}": i for i in range(20, 500)}},
           "added_tokens": [{"id": i, "content": f"<s{i}>"} for i in range(20)]}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.fixture(scope="session")
def qwen(tmp_path_factory, tokenizer) -> tuple[Path, Path, Path]:
    """``(out, model folder, artifact)``: the bench's Qwen3-8B-shaped model and data-free artifact, written once."""
    from oscar_cli.bench.spec import prepare_model

    out = tmp_path_factory.mktemp("bench")
    model, art = prepare_model(out, tokenizer)
    return out, model, art
