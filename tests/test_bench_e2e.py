"""``benchmarks/bench_e2e.py``: ``oscar bench`` for a checkout without installed entry points; the site it puts on
the path for itself and for the servers."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_plugin_site_exposes_the_checkout_and_its_entry_point(tmp_path):
    from importlib.metadata import distributions

    import tomllib

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_e2e_script", script)
    boot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)
    site = boot.plugin_site(tmp_path / "site")
    repo = script.parents[1]
    assert (site / "oscar_cli").resolve() == repo / "oscar_cli"
    assert (site / "oscar_kernels").resolve() == repo / "kernels" / "oscar_kernels"  # as installed
    (dist,) = list(distributions(path=[str(site)]))
    eps = {(e.group, e.name): e.value for e in dist.entry_points}
    declared = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps == {(g, k): v for g, group in declared.items() for k, v in group.items()}  # every one, as declared
    assert eps[("sglang.srt.plugins", "oscar")] == "oscar_cli.serve.sglang:register"
    assert ("lm_eval.models", "oscar") in eps
    assert boot.plugin_site(tmp_path / "site") == site  # idempotent: the links are kept
