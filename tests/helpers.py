"""Builders the tests share: tiny random-weight Llamas, a word-level tokenizer kit and the benchmark scripts as
modules (imported by conftest.py and by test modules as ``helpers``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

EMBEDDED = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
WORDS = [f"w{i}" for i in range(90)]


def build_llama(*, hidden=128, layers=2, heads=4, kv_heads=2, head_dim=None, vocab=96, dtype=torch.float32, seed=0,
                **extra):
    """A tiny random-weight Llama in eval mode (the one builder the tests share)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512)
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    cfg.update(extra)
    return LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype).eval()



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
        return build_llama(seed=seed, max_position_embeddings=1024, pad_token_id=1, eos_token_id=2, bos_token_id=2)

    @staticmethod
    def text(n, seed=0):
        g = torch.Generator().manual_seed(seed)
        return " ".join(WORDS[i] for i in torch.randint(0, 90, (n,), generator=g).tolist())
