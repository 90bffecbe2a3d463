"""lm-eval finds the model ``oscar`` by itself: the startup file registers the ``lm_eval.models`` entry point as a
lazy placeholder, in fresh interpreters that never import oscar first."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from oscar_cli.eval.lm_eval_model import ENTRY_POINT
from oscar_cli.serve import lm_eval_plugin as plugin


def run_python(code: str, site: str, cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that processes ``site`` as a site directory first (as for site-packages)."""
    prelude = f"import site, sys; site.addsitedir({site!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture()
def site_dir(tmp_path):
    d = tmp_path / "site"
    d.mkdir()
    path = plugin.install(d)
    assert path.read_text() == plugin.PTH_LINE
    return d


def test_the_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group=plugin.ENTRY_POINT_GROUP)}
    assert eps.get("oscar") == ENTRY_POINT, \
        "the installed metadata lacks the entry point: reinstall with pip install --no-deps -e ."


def test_registry_lookup_as_the_cli_does_it(site_dir, tmp_path):
    code = """
assert "oscar_cli.eval" not in sys.modules and "lm_eval" not in sys.modules
import lm_eval.api.registry as r
assert "oscar_cli.eval" not in sys.modules  # registered lazily: nothing of oscar's evaluation imported yet
placeholder = dict(r.model_registry.items())["oscar"]
cls = r.get_model("oscar")  # what simple_evaluate calls for --model oscar
from lm_eval.models.huggingface import HFLM
import oscar_cli.eval.lm_eval_model as ev
print(placeholder, cls.__name__, issubclass(cls, HFLM), ev.oscar_lm_class() is cls)
"""
    r = run_python(code, str(site_dir), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [ENTRY_POINT, "OscarLM", "True", "True"]


def test_oscar_eval_registration_upgrades_the_placeholder():
    """Where the class is built by oscar itself (``oscar eval``) after the hook registered the placeholder, lm-eval's
    registry replaces the placeholder in place instead of refusing a second registration."""
    from lm_eval.api.registry import Registry

    from oscar_cli.eval.lm_eval_model import oscar_lm_class

    reg = Registry("model")
    assert plugin.register(reg) == ["oscar"] and plugin.register(reg) == []
    cls = oscar_lm_class()
    reg.register("oscar")(cls)  # what @register_model("oscar") in oscar_cli.eval.lm_eval_model does
    assert dict(reg.items())["oscar"] is cls and reg.get("oscar") is cls


def test_startup_line_is_harmless_without_oscar(tmp_path):
    """The startup file in an interpreter that cannot import oscar_cli: no error, nothing registered."""
    d = tmp_path / "site"
    d.mkdir()
    plugin.install(d)
    code = "import sys; sys.modules['oscar_cli'] = None; import site; site.addsitedir(sys.argv[1]); print('ok')"
    r = subprocess.run([sys.executable, "-c", code, str(d)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok" and r.stderr == ""


def test_install_and_uninstall(tmp_path):
    path = plugin.install(tmp_path)
    assert path.name == plugin.PTH_NAME and path.read_text().startswith("import ")
    assert plugin.uninstall(tmp_path) and not path.exists() and not plugin.uninstall(tmp_path)


@pytest.mark.slow
def test_lm_eval_cli_runs_model_oscar(site_dir, tmp_path, word_model, serve_store):
    """``lm_eval --model oscar`` through lm-eval's own CLI entry on a local loglikelihood task; the per-sample
    loglikelihoods equal the model's own log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    docs = [{"context": "w1 w2 w3", "target": " w4 w5"}, {"context": "w10 w11", "target": " w12"}]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "probe.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "oscar_probe.yaml").write_text(f"""task: oscar_probe
dataset_path: json
dataset_kwargs:
  data_files: {tasks / 'probe.jsonl'}
test_split: train
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    out = tmp_path / "out"
    argv = ["lm_eval", "--model", "oscar", "--model_args",
            f"pretrained={word_model},method=bf16,store={serve_store}", "--tasks", "oscar_probe",
            "--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "1"]
    code = f"""
assert "oscar_cli.eval" not in sys.modules
from lm_eval.__main__ import cli_evaluate
sys.argv = {argv!r}
cli_evaluate()
"""
    r = run_python(code, str(site_dir), tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (samples,) = list(out.rglob("samples_oscar_probe_*.jsonl"))
    got = [float(json.loads(ln)["resps"][0][0][0]) for ln in samples.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(str(word_model))
    model = AutoModelForCausalLM.from_pretrained(str(word_model), dtype=torch.float32).eval()
    for d, ll in zip(docs, got, strict=True):
        ctx = tok(d["context"])["input_ids"]
        whole = tok(d["context"] + d["target"])["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
        want = float(logp[torch.arange(len(ctx) - 1, len(whole) - 1), torch.tensor(whole[len(ctx):])].sum())
        assert abs(ll - want) < 1e-4
