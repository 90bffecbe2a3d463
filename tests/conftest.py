"""Shared fixtures (the embedded default converted and calibrated once, cached by content; a tiny random-weight
Llama), the ``--shuffle SEED`` option and the ``gpu`` marker of the GPU suite."""

from __future__ import annotations

import inspect
import os
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # helpers.py (pytest runs with --import-mode=importlib)
from helpers import (  # noqa: E402
    EMBEDDED,
    ROOT,
    WordKit,
    build_llama,
    cached_build,
    copy_files,
    sha256_file,
    tree_digest,
    versions,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: fail fast instead of retrying the network
if not torch.cuda.is_available():  # Triton kernels run on CPU tensors in the interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # xdist workers share the cores: torch threads of each its share
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

TESTS = Path(__file__).resolve().parent
GPU_SUITE = ("kernels", "test_cache_kernels.py")
"""Tests whose kernels run compiled on CUDA when a GPU is present (under the interpreter otherwise): their non-slow
tests are marked ``gpu`` at collection, and ``make gpu-test`` runs ``-m gpu``. A test elsewhere joins the GPU suite
with an explicit ``@pytest.mark.gpu`` (which also keeps a slow kernel test in it)."""
TOKENIZER_FILES = ("special_tokens_map.json", "chat_template.jinja")
COLLECT = ["--tokens", "16384", "--seq-len", "512", "--batch-size", "8"]
FIT = ["--no-recipe", "--per-head", "--sink", "16", "--recent", "64"]


# ---------------------------------------------------------------- options: the random order, the GPU suite's marker
def pytest_addoption(parser):
    parser.addoption("--shuffle", metavar="SEED", default=None,
                     help="run the tests in an order drawn from SEED (an integer, or 'random' for a fresh one; the "
                          "seed is printed at the end): exposes state that leaks from one test into another")


def pytest_configure(config):
    seed = config.getoption("shuffle")
    if seed is None:
        return
    if "shuffle_seed" in getattr(config, "workerinput", {}):  # an xdist worker takes the controller's seed
        seed = config.workerinput["shuffle_seed"]
    elif seed == "random":
        seed = str(random.SystemRandom().randrange(10**6))
    if not seed.isdigit():
        raise pytest.UsageError(f"--shuffle takes an integer seed or 'random', not {seed!r}")
    config.option.shuffle = seed


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # pytest-xdist: every worker must collect the same order
    node.workerinput["shuffle_seed"] = node.config.getoption("shuffle")


def pytest_report_header(config):
    seed = config.getoption("shuffle")
    return f"shuffled: --shuffle {seed}" if seed is not None else None


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `-m gpu` must see the marks (deselecting keeps the order)
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in GPU_SUITE \
                and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.gpu)
    seed = config.getoption("shuffle")
    if seed is not None:  # the same seed gives the same order in every xdist worker (they must agree)
        random.Random(int(seed)).shuffle(items)


def pytest_terminal_summary(terminalreporter, config):
    seed = config.getoption("shuffle")
    if seed is not None:
        terminalreporter.write_line(f"test order shuffled: --shuffle {seed} repeats it")


# ---------------------------------------------------------------- the embedded default, built once per content
def _gguf() -> Path:
    from oscar_cli.models import embedded_gguf

    return embedded_gguf(EMBEDDED)


def _model_key() -> dict:
    from oscar_cli import models

    return {"gguf": sha256_file(_gguf()), "converter": sha256_file(Path(inspect.getsourcefile(models.resolve))),
            "versions": versions("torch", "transformers", "gguf", "safetensors")}


def embedded_model() -> Path:
    """The safetensors copy of the embedded default (``oscar_cli.models.resolve``), converted once per content."""
    from oscar_cli.models import resolve

    return cached_build("model-" + EMBEDDED, _model_key(), lambda f: resolve(EMBEDDED, f)) / "models" / EMBEDDED


def _link_model(store: Path) -> Path:
    (store / "models").mkdir(parents=True, exist_ok=True)
    (store / "models" / EMBEDDED).symlink_to(embedded_model(), target_is_directory=True)
    return store


@pytest.fixture(scope="session")
def embedded_store(tmp_path_factory) -> Path:
    """A store folder holding the safetensors copy of the embedded default (converted once, ~20 s, then cached)."""
    return _link_model(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="session")
def embedded_tokenizer() -> Path:
    """The embedded default's tokenizer files, read from its GGUF alone (no model conversion; cached)."""

    def build(folder: Path) -> None:
        from transformers import AutoTokenizer

        gguf = _gguf()
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(folder))

    key = {"gguf": sha256_file(_gguf()), "build": inspect.getsource(build),
           "versions": versions("transformers", "tokenizers", "gguf")}
    return cached_build("tokenizer-" + EMBEDDED, key, build)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer) -> Path:
    """A 2-layer random-weight Llama (GQA 4:2, head dim 16) saved with the embedded model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    copy_files(embedded_tokenizer, out,
               [f.name for f in embedded_tokenizer.iterdir() if f.name.startswith("tokenizer") or f.name in TOKENIZER_FILES])
    return out


@pytest.fixture(scope="session")
def tiny_gemma_dir(tmp_path_factory, embedded_tokenizer) -> Path:
    """A 4-layer random-weight Gemma 3 (gemma-3-270m's architecture in small: one KV head for four query heads,
    QK-norm, sliding-window layers of 16 tokens with a global layer every fourth) with the embedded tokenizer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=2048, sliding_window=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=32,
    )
    model = Gemma3ForCausalLM(cfg)
    out = tmp_path_factory.mktemp("tiny-gemma")
    model.save_pretrained(out)
    copy_files(embedded_tokenizer, out,
               [f.name for f in embedded_tokenizer.iterdir() if f.name.startswith("tokenizer") or f.name in TOKENIZER_FILES])
    return out


@pytest.fixture(scope="session")
def embedded_artifact(embedded_store, tmp_path_factory) -> Path:
    """``oscar collect`` (16,384 tokens) and ``oscar fit --per-head`` on the embedded default; returns the artifact.

    Built once per content (the GGUF, the oscar_cli and kernels sources, the package versions, the arguments) and
    cached: a session copies the built store's database into ``embedded_store`` and the artifact into its tmp."""
    from oscar_cli.store import DB_FILE

    def build(folder: Path) -> None:
        from typer.testing import CliRunner

        from oscar_cli.cli import app

        store = _link_model(folder / "store")
        runner = CliRunner()
        r = runner.invoke(app, ["collect", "--store", str(store), *COLLECT], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["fit", "--store", str(store), "--artifacts", str(folder / "artifacts"), *FIT],
                          catch_exceptions=False)
        assert r.exit_code == 0, r.output

    key = {**_model_key(), "code": tree_digest(ROOT / "oscar_cli", ROOT / "kernels"), "collect": COLLECT, "fit": FIT,
           "build": inspect.getsource(build), "versions": versions("torch", "transformers", "duckdb", "numpy")}
    built = cached_build("artifact-" + EMBEDDED, key, build)
    assert not (embedded_store / DB_FILE).exists(), "embedded_artifact must fill embedded_store before any test writes"
    copy_files(built / "store", embedded_store)
    src = next((built / "artifacts").glob("*/v1"))
    dest = tmp_path_factory.mktemp("artifacts") / src.parent.name / "v1"
    shutil.copytree(src, dest, copy_function=shutil.copyfile)
    return dest


@pytest.fixture()
def tiny_llama():
    """The builder of tiny random Llamas (:func:`build_llama`)."""
    return build_llama


@pytest.fixture()
def kit() -> WordKit:
    return WordKit()
