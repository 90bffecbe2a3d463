"""Shared fixtures: the embedded default model converted once per session, and a tiny random-weight Llama."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

EMBEDDED = "smollm2-135m"
WORDS = [f"w{i}" for i in range(90)]
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


class WordKit:
    """A word-level tokenizer over ``w0 .. w89``, a tiny random Llama sized to it, and random text in it."""

    @staticmethod
    def tokenizer():
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")

    @staticmethod
    def llama(seed=0):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          pad_token_id=1, eos_token_id=2, bos_token_id=2)
        return LlamaForCausalLM(cfg).eval()

    @staticmethod
    def text(n, seed=0):
        g = torch.Generator().manual_seed(seed)
        return " ".join(WORDS[i] for i in torch.randint(0, 90, (n,), generator=g).tolist())


@pytest.fixture()
def kit() -> WordKit:
    return WordKit()
