"""The plugin's contract with SGLang 0.5.17, checked against the released wheel's SOURCE (read with ast, never
installed or imported): every symbol in :mod:`oscar_cli.serve.sglang.targets` exists with the registered parameters;
a doctored copy with one target renamed or re-signatured fails; the entry point is declared; the plugin's modules
import without SGLang and without transformers (SGLang's processes carry transformers 5.12.1).

The wheel: ``/tmp/sgl`` when a checkout machine has it unpacked, else ``pip download --no-deps sglang==0.5.17`` into
``$OSCAR_SGLANG_CACHE`` (default ``~/.cache/oscar-kv/sglang``); skipped only when the package index is unreachable."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import tomllib

from oscar_cli.serve.sglang import targets as T

SPEC = f"sglang=={T.SGLANG_VERSION}"
INDEX = "https://pypi.org/simple/sglang/"
ROOT = Path(__file__).resolve().parents[2]


def _index_reachable() -> str | None:
    try:
        urllib.request.urlopen(INDEX, timeout=15).close()
        return None
    except OSError as e:
        return str(e)


@pytest.fixture(scope="session")
def sglang_source() -> Path:
    """A folder holding ``sglang/`` or the wheel file itself (read in place)."""
    local = Path("/tmp/sgl")
    if (local / "src" / "sglang" / "srt").is_dir():
        return local / "src"
    wheels = sorted(local.glob(f"sglang-{T.SGLANG_VERSION}-*.whl"))
    cache = Path(os.environ.get("OSCAR_SGLANG_CACHE", Path.home() / ".cache" / "oscar-kv" / "sglang"))
    wheels += sorted(cache.glob(f"sglang-{T.SGLANG_VERSION}-*.whl"))
    if wheels:
        return wheels[0]
    why = _index_reachable()
    if why is not None:
        pytest.skip(f"{SPEC} is not cached and the package index is unreachable ({why})")
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
                        "manylinux_2_34_x86_64", "--python-version", "3.11", "--disable-pip-version-check", "-q",
                        "-d", str(cache), SPEC], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"pip download {SPEC} failed: {r.stderr.strip()[-500:]}"
    return sorted(cache.glob(f"sglang-{T.SGLANG_VERSION}-*.whl"))[0]


def test_every_target_holds_in_the_released_source(sglang_source):
    assert T.check_source(sglang_source) == []


def test_the_registry_covers_what_the_plugin_hooks():
    """Every hook the plugin registers and every SGLang class it subclasses is a registry target."""
    paths = {t.path for t in T.TARGETS}
    for needed in ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool",
                   "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
                   "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes",
                   "sglang.srt.server_args.ServerArgs.check_server_args",
                   "sglang.srt.layers.attention.base_attn_backend.AttentionBackend",
                   "sglang.srt.mem_cache.memory_pool.KVCache.__init__",
                   "sglang.srt.mem_cache.radix_cache.RadixCache.match_prefix",
                   "sglang.srt.mem_cache.radix_cache.RadixCache.cache_finished_req"):
        assert needed in paths
    assert len(paths) == len(T.TARGETS)


DOCTORED = {
    "hooked method renamed": (T.HOOK_BUILD_POOL, "def _build_mha_kv_pool(", "def _build_mha_token_pool("),
    "keyword-only parameter made positional": (T.HOOK_BUILD_POOL, "self, *, max_total_num_tokens: int, mha_pool_class",
                                               "self, max_total_num_tokens: int, mha_pool_class"),
    "parameter added": (T.RADIX_METHODS[0], "def match_prefix(self, params: MatchPrefixParams)",
                        "def match_prefix(self, params: MatchPrefixParams, lock: bool = False)"),
    "parameter renamed": (T.BACKEND_METHODS[1], "forward_batch: ForwardBatch,\n        in_capture: bool = False,",
                          "forward_batch: ForwardBatch,\n        capturing: bool = False,"),
    "field dropped": (T.FORWARD_BATCH, "    rids: Optional[List[str]] = None", "    request_ids: Optional[List[str]] = None"),
    "base class renamed": (T.ATTENTION_BACKEND, "class AttentionBackend(ABC):", "class AttnBackendBase(ABC):"),
}


def _module_text(tree: T.SourceTree, module: str) -> tuple[str, str]:
    for rel in (f"{module.replace('.', '/')}.py", f"{module.replace('.', '/')}/__init__.py"):
        text = tree.read(rel)
        if text is not None:
            return rel, text
    raise AssertionError(f"{module} not in the source")


@pytest.mark.parametrize("case", list(DOCTORED))
def test_a_doctored_copy_fails(sglang_source, tmp_path, case):
    """The checks can fail: the same module, copied with one change to a target, no longer passes."""
    target, old, new = DOCTORED[case]
    rel, text = _module_text(T.SourceTree(sglang_source), target.module)
    assert text.count(old) == 1, f"doctoring {case!r} does not apply to {rel}"
    same = [t for t in T.TARGETS if t.module == target.module]
    for name, body in (("intact", text), ("doctored", text.replace(old, new))):
        root = tmp_path / name
        (root / rel).parent.mkdir(parents=True)
        (root / rel).write_text(body)
        problems = T.check_source(root, same)
        if name == "intact":
            assert problems == []
        else:
            assert any(p.startswith(target.path) for p in problems), problems


def test_live_signature_check_sees_a_changed_function():
    """check_live (run inside SGLang's processes at register()) compares the same parameter lists."""
    import types

    mod = types.ModuleType("fake_sglang_mod")
    exec("class C:\n    def m(self, a, *, b=None):\n        pass\n    @classmethod\n    def r(cls, x):\n        pass\n",
         mod.__dict__)
    sys.modules["fake_sglang_mod"] = mod
    try:
        ok = [T.Target("fake_sglang_mod", "C.m", "function", ("self", "a", "*", "b")),
              T.Target("fake_sglang_mod", "C.r", "function", ("cls", "x"))]
        assert T.check_live(ok) == []
        bad = [T.Target("fake_sglang_mod", "C.m", "function", ("self", "a", "b")),
               T.Target("fake_sglang_mod", "C.gone", "function", ("self",))]
        assert len(T.check_live(bad)) == 2
    finally:
        del sys.modules["fake_sglang_mod"]


def test_entry_point_is_declared_and_callable(monkeypatch):
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps == {"oscar": "oscar_cli.serve.sglang:register",
                   "oscar_bench_fill": "oscar_cli.serve.sglang.bench_fill:register"}
    assert meta["project"]["optional-dependencies"]["serve"] == [SPEC]
    find = meta["tool"]["setuptools"]["packages"]["find"]  # the wheel holds the plugin package
    from setuptools import find_packages

    found = {p for where in find["where"] for p in find_packages(ROOT / where, include=find["include"])}
    assert {"oscar_cli.serve.sglang", "oscar_kernels"} <= found
    from oscar_cli.serve import sglang
    from oscar_cli.serve.sglang import bench_fill

    assert callable(sglang.register)
    monkeypatch.delenv(bench_fill.FLAG_ENV, raising=False)
    assert bench_fill.register() is None  # OSCAR_BENCH_NULL_FILL unset: registers nothing, imports no SGLang


def test_plugin_imports_need_neither_sglang_nor_transformers():
    """SGLang's processes run transformers 5.12.1: nothing the plugin imports may need transformers (or SGLang,
    which only its hooks and classes import, inside functions)."""
    code = ("import sys\n"
            "import oscar_cli.serve.sglang, oscar_cli.serve.sglang.plugin, oscar_cli.serve.sglang.launch\n"
            "import oscar_cli.serve.sglang.bench_fill\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'sglang'))\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert r.returncode == 0, r.stderr[-800:]
