"""OSCAR-KV: offline spectral covariance-aware rotations for INT2 KV caches."""

import os

__version__ = "0.1.0"

_CODE_VERSION: str | None = None


def code_version() -> str:
    """Package version plus the git commit of the source tree when it is a checkout (``0.1.0+g1a2b3c4``, ``.dirty``
    when it has uncommitted changes); the plain version otherwise. ``OSCAR_CODE_VERSION`` in the environment wins (a
    copy of the tree without ``.git``, e.g. shipped to a GPU machine, says which commit it is). Recorded in artifacts
    and benchmark rows."""
    global _CODE_VERSION
    if _CODE_VERSION is None and os.environ.get("OSCAR_CODE_VERSION"):
        _CODE_VERSION = os.environ["OSCAR_CODE_VERSION"]
    if _CODE_VERSION is None:
        import subprocess
        from pathlib import Path

        root = Path(__file__).resolve().parent.parent
        v = __version__
        try:
            run = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,  # noqa: E731
                                            timeout=5, check=True).stdout.strip()
            commit = run("rev-parse", "--short=12", "HEAD")
            dirty = bool(run("status", "--porcelain", "--untracked-files=no"))
            v = f"{v}+g{commit}{'.dirty' if dirty else ''}"
        except (OSError, subprocess.SubprocessError):
            pass
        _CODE_VERSION = v
    return _CODE_VERSION
