"""Builders the tests share: tiny random-weight Llamas, a word-level tokenizer kit, the benchmark scripts as
modules and a content-keyed cache for the expensive session fixtures (imported by conftest.py and by test modules as
``helpers``)."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from oscar_cli.artifact import sha256_file

EMBEDDED = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("OSCAR_TEST_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oscar-kv-tests")
"""Where :func:`cached_build` keeps what it built (``OSCAR_TEST_CACHE`` moves it; deleting it between runs is safe)."""
KEEP = 3
"""Builds kept per name, the most recently used: a new build deletes older ones (each code change makes a new key)."""


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def tree_digest(*folders: Path) -> str:
    """sha256 over the relative path and bytes of every file under ``folders`` (bytecode caches left out)."""
    h = hashlib.sha256()
    for folder in folders:
        for f in sorted(folder.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
                h.update(f"{f.relative_to(folder.parent)}\0".encode())
                h.update(sha256_file(f).encode())
    return h.hexdigest()


def versions(*packages: str) -> dict[str, str]:
    return {p: importlib.metadata.version(p) for p in packages}


def cached_build(name: str, key: dict, build: Callable[[Path], None]) -> Path:
    """The folder ``CACHE/<name>-<digest of key>``, filled by ``build(folder)`` the first time and reused after.

    ``key`` must name everything the result depends on: input file digests, a digest of the code that builds it,
    package versions and arguments. One process builds while the others wait on a file lock; a build that crashed
    leaves no completion mark and is redone. The files are made read-only once built (a test that writes into the
    cache fails, except as root)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = CACHE / f"{name}-{digest}"
    done = folder / ".complete"
    if done.is_file():
        _used_now(done)
        return folder
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / "key.json").write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")
            for f in folder.rglob("*"):
                if f.is_file() and not f.is_symlink():
                    f.chmod(0o444)
            done.touch()
            _used_now(done)
    built = [d for d in CACHE.glob(f"{name}-*") if (d / ".complete").is_file()]
    for old in sorted(built, key=lambda d: (d / ".complete").stat().st_mtime, reverse=True)[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
        (CACHE / f"{old.name}.lock").unlink(missing_ok=True)
    return folder


def _used_now(mark: Path) -> None:
    t = time.time_ns()  # the fine clock: file times of two quick writes can tie
    os.utime(mark, ns=(t, t))


def copy_files(src: Path, dest: Path, names: Iterable[str] | None = None) -> None:
    """Copy the plain files of ``src`` (or those named) into ``dest`` as writable files."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith(".") and (names is None or f.name in names):
            shutil.copyfile(f, dest / f.name)


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
