"""The lm-eval model ``oscar`` for lm-eval's own CLI: ``lm_eval --model oscar --model_args ...`` with no oscar import.

How lm-eval 0.4.13 finds models: only through ``lm_eval.api.registry.model_registry``. Its own models are lazy
``"module:Class"`` placeholders listed in ``lm_eval/models/__init__.py``; nothing reads entry points or plugins (the
registry accepts ``importlib.metadata.EntryPoint`` placeholders, but no code fills it from installed packages), and
``--include_path`` indexes task YAML only (their ``!function`` references resolve after the model is built). So:

* ``pyproject.toml`` declares the model in the entry-point group :data:`ENTRY_POINT_GROUP`:
  ``oscar = "oscar_cli.eval.lm_eval_model:OscarLM"``;
* a one-line startup file :data:`PTH_NAME` in site-packages (``python -m oscar_cli.serve.lm_eval_plugin install``)
  calls :func:`install_hook`, which waits for ``lm_eval.api.registry`` to be imported and then registers every entry
  point of that group as a lazy placeholder (the registry's documented lazy mechanism). Until lm-eval asks for the
  model nothing else is imported: the startup cost is one dictionary lookup per import.

The placeholder is exactly ``<module>:<class>`` of the class :func:`oscar_cli.eval.lm_eval_model.oscar_lm_class`
registers, so when ``oscar eval`` registers it in the same process the registry upgrades the placeholder in place
instead of refusing a second registration. ``oscar_cli.eval.lm_eval_model`` builds that class on first use (importing
lm-eval's ``HFLM`` is slow) through its module ``__getattr__``. This module imports nothing of it: it only names the
entry point.

Import-light on purpose (standard library only): every interpreter of the environment imports it at startup.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

ENTRY_POINT_GROUP = "lm_eval.models"
PTH_NAME = "oscar_kv_lm_eval.pth"
PTH_LINE = ('import sys; exec("try:\\n import oscar_cli.serve.lm_eval_plugin as m\\nexcept ImportError:\\n m = None\\n'
            'if m is not None:\\n m.install_hook()")\n')
"""The startup line: a removed or broken oscar-kv install leaves other interpreters alone."""
REGISTRY_MODULE = "lm_eval.api.registry"


def register(registry=None) -> list[str]:
    """Register each :data:`ENTRY_POINT_GROUP` entry point not yet known as a lazy ``module:attr`` placeholder;
    returns the names added. ``registry``: lm-eval's model registry (default ``model_registry``)."""
    from importlib.metadata import entry_points

    if registry is None:
        from lm_eval.api.registry import model_registry as registry
    added = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in registry:
            registry.register(ep.name, target=ep.value.replace(" ", ""))
            added.append(ep.name)
    return added


def install_hook() -> None:
    """Run :func:`register` once ``lm_eval.api.registry`` has been imported (now, if it already is). Idempotent."""
    after_import(REGISTRY_MODULE, lambda _module: register())


def after_import(name: str, hook: Callable) -> None:
    """Call ``hook(module)`` right after module ``name`` executes (now, when it is already imported)."""
    if name in sys.modules:
        hook(sys.modules[name])
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)
    if finder is None:
        finder = _AfterImport()
        sys.meta_path.insert(0, finder)
    finder.hooks.setdefault(name, hook)


class _AfterImport:  # a meta-path finder (duck-typed: importlib.abc costs 15 ms to import)
    """Calls ``hooks[name](module)`` right after module ``name`` has executed; finds nothing itself."""

    def __init__(self):
        self.hooks: dict[str, Callable] = {}

    def find_spec(self, fullname, path, target=None):
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        self.hooks.pop(fullname)
        spec.loader = _Loader(spec.loader, hook)
        return spec


class _Loader:
    def __init__(self, inner, after: Callable):
        self._inner, self._after = inner, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._after(module)

    def __getattr__(self, name):
        return getattr(self._inner, name)


# ----------------------------------------------------------------------------------------------------------------
# install / uninstall the startup file


def site_dir() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def install(directory: Path | None = None) -> Path:
    """Write :data:`PTH_NAME` into ``directory`` (default: this interpreter's site-packages); returns its path."""
    path = Path(directory or site_dir()) / PTH_NAME
    path.write_text(PTH_LINE)
    return path


def uninstall(directory: Path | None = None) -> bool:
    path = Path(directory or site_dir()) / PTH_NAME
    if path.is_file():
        path.unlink()
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["install"]:
        print(f"wrote {install()}; lm_eval --model oscar now resolves through the entry point {ENTRY_POINT_GROUP}")
        return 0
    if args[:1] == ["uninstall"]:
        print("removed" if uninstall() else f"{PTH_NAME} was not installed")
        return 0
    print("usage: python -m oscar_cli.serve.lm_eval_plugin install|uninstall", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
