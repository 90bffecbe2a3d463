"""Folders written whole: built under a temporary name, then renamed into place with the permissions any other file
the user creates would have (``tempfile.mkdtemp`` makes a folder only its owner can read)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def staging_dir(parent: Path, prefix: str = ".tmp-") -> Path:
    """A new empty folder under ``parent`` to build in (remove it on failure, rename it when done)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


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
