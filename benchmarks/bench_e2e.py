"""``python3 benchmarks/bench_e2e.py ARGS`` is ``oscar bench ARGS`` (see :mod:`oscar_cli.bench` for what it measures)
for a checkout without installed entry points, as on the H200: it puts the checkout's ``oscar_cli`` and ``kernels``
(as ``oscar_kernels``) with the plugin's entry point on the path (:func:`plugin_site`), for the servers too, then runs
the command. Standard library only until then."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def plugin_site(dest: Path, repo: Path = REPO) -> Path:
    """A folder holding the checkout's ``oscar_cli`` and ``kernels/oscar_kernels`` and an
    ``oscar_kv.dist-info`` with the entry points of ``pyproject.toml``: what SGLang's ``load_plugins()`` discovers,
    without the checkout's top-level ``kernels/`` on the path (it would shadow the PyPI package SGLang imports)."""
    import tomllib

    dest = Path(dest)
    meta = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    info = dest / f"oscar_kv-{meta['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    for name, target in (("oscar_cli", repo / "oscar_cli"), ("oscar_kernels", repo / "kernels" / "oscar_kernels")):
        link = dest / name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and link.resolve() == target.resolve():
                continue
            link.unlink() if link.is_symlink() else shutil.rmtree(link)
        link.symlink_to(target, target_is_directory=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: oscar-kv\nVersion: {meta['version']}\n")
    (info / "top_level.txt").write_text("oscar_cli\noscar_kernels\n")
    groups = meta.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                                                   for g, eps in groups.items()))
    return dest


def _installed() -> bool:
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    return find_spec("oscar_kernels") is not None and any(
        ep.name == "oscar" for ep in entry_points(group="sglang.srt.plugins"))


if __name__ == "__main__":
    if not _installed():
        site = plugin_site(Path(os.environ.get("TMPDIR", "/tmp")) / "oscar-bench-site")
        sys.path.append(str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(site)) if p)
    from oscar_cli.cli import main as _main

    sys.argv = ["oscar", "bench", *sys.argv[1:]]
    _main()
