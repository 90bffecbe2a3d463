"""Folders written whole: built under a temporary name, then renamed into place with the permissions any other file
the user creates would have (``tempfile.mkdtemp`` makes a folder only its owner can read)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def staging_dir(parent: Path, prefix: str = ".tmp-") -> Path:
    """A new empty folder under ``parent`` to build in (remove it on failure, rename it when done), named after this
    process (``<prefix><pid>-...``); the staging folders of processes that are gone (``kill -9``) are removed first."""
    sweep_stale(parent, prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def pid_alive(pid: int | None) -> bool:
    """Whether process ``pid`` runs on this host (signal 0; a process of another user counts as running)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(parent: Path, prefix: str = ".tmp-") -> list[Path]:
    """Remove the staging folders under ``parent`` left by processes of this host that no longer run; returns them."""
    gone = []
    for p in Path(parent).glob(f"{prefix}*"):
        pid = p.name[len(prefix):].split("-", 1)[0]
        if p.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_like_umask(root: Path) -> None:
    """Give ``root`` and everything under it the permissions a plain ``mkdir`` / ``open`` would under the current
    umask (folders 0777, files 0666, less the umask: 0755 / 0644 under the usual 022)."""
    mask = umask()
    dirs, files = 0o777 & ~mask, 0o666 & ~mask
    for here, _subdirs, names in os.walk(root):
        os.chmod(here, dirs)
        for n in names:
            os.chmod(os.path.join(here, n), files)
