"""Artifacts: the only writer of ``artifacts/``.

An artifact is a folder ``<root>/<model-slug>/v<N>/`` holding

* ``rotations.safetensors`` (fp32): ``layers`` int64 ``[n]``; ``r_k``, ``r_v`` ``[n, h, d, d]`` with ``h = 1`` for a
  rotation shared by all KV heads or ``h = kv_heads`` (``--per-head``); ``clip_k``, ``clip_v`` ``[n, h]`` clip ratios;
  ``eig_k``, ``eig_v`` ``[n, h, d]`` descending eigenvalues of the targets the rotations came from (zeros for
  data-free methods);
* ``manifest.json``: model fingerprint, run id, stats digest, method, quant config, code version, created, metrics and
  ``content_hash`` (sha256 of ``rotations.safetensors``);
* ``recipe.yaml``: a copy of the recipe that produced it.

Rows are rotated as ``x @ R``. Layers not listed are left in BF16 by the cache. Writes go to a temporary folder that
is renamed into place, so a crash never leaves half an artifact. Loading checks the content hash and, when a model
fingerprint is given, that it matches; only safetensors and JSON are read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .config import QuantConfig
from .errors import OscarError

TENSOR_FILE = "rotations.safetensors"
MANIFEST_FILE = "manifest.json"
RECIPE_FILE = "recipe.yaml"


class ArtifactError(OscarError):
    """An artifact is missing, damaged or does not belong to the model."""


@dataclass(frozen=True)
class LayerRotation:
    """One layer's rotations. ``r_k``/``r_v``: fp32 ``[h, d, d]``; ``clip_k``/``clip_v``: fp32 ``[h]``."""

    r_k: torch.Tensor
    r_v: torch.Tensor
    clip_k: torch.Tensor
    clip_v: torch.Tensor


@dataclass(frozen=True)
class Artifact:
    path: Path
    manifest: dict
    tensors: dict[str, torch.Tensor]

    @property
    def name(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}"

    @property
    def layers(self) -> list[int]:
        return self.tensors["layers"].tolist()

    @property
    def quant(self) -> QuantConfig:
        return QuantConfig(**self.manifest["quant"])

    @property
    def method(self) -> str:
        return self.manifest["method"]

    def layer(self, idx: int) -> LayerRotation | None:
        """Rotations of model layer ``idx``, or None when the artifact leaves that layer unquantized."""
        layers = self.layers
        if idx not in layers:
            return None
        i = layers.index(idx)
        t = self.tensors
        return LayerRotation(t["r_k"][i], t["r_v"][i], t["clip_k"][i], t["clip_v"][i])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _next_version(model_dir: Path) -> int:
    versions = [int(p.name[1:]) for p in model_dir.glob("v*") if p.name[1:].isdigit()]
    return max(versions, default=0) + 1


def write_artifact(
    root: Path,
    model_slug: str,
    tensors: dict[str, torch.Tensor],
    manifest: dict,
    recipe_text: str,
) -> Path:
    """Write a new version atomically; returns its folder. ``manifest`` gets created/code_version/content_hash."""
    from safetensors.torch import save_file

    required = {"layers", "r_k", "r_v", "clip_k", "clip_v", "eig_k", "eig_v"}
    missing = required - set(tensors)
    if missing:
        raise ArtifactError(f"artifact tensors missing: {', '.join(sorted(missing))}")
    model_dir = Path(root) / model_slug
    model_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=model_dir))
    try:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp / TENSOR_FILE))
        full = dict(manifest)
        full.update(
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            code_version=__version__,
            content_hash=sha256_file(tmp / TENSOR_FILE),
        )
        (tmp / MANIFEST_FILE).write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
        (tmp / RECIPE_FILE).write_text(recipe_text)
        for _ in range(100):
            dest = model_dir / f"v{_next_version(model_dir)}"
            try:
                os.rename(tmp, dest)  # atomic; fails if another writer took this version first
                return dest
            except OSError:
                continue
        raise ArtifactError(f"could not claim a version folder under {model_dir}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_artifact(path: Path) -> None:
    """Delete an artifact folder (used to roll back when registering it fails)."""
    shutil.rmtree(path, ignore_errors=True)


def load_artifact(path: Path, expected_fingerprint: str | None = None) -> Artifact:
    """Load and verify an artifact folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    mf, tf = path / MANIFEST_FILE, path / TENSOR_FILE
    if not mf.is_file() or not tf.is_file():
        raise ArtifactError(f"{path} is not an artifact (needs {MANIFEST_FILE} and {TENSOR_FILE}); run `oscar fit`")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{mf} is not valid JSON ({e.msg}); re-run `oscar fit`") from None
    actual = sha256_file(tf)
    if manifest.get("content_hash") != actual:
        raise ArtifactError(
            f"{path}: content hash mismatch (manifest {manifest.get('content_hash')}, file {actual}); "
            "the artifact was modified or damaged: re-run `oscar fit`"
        )
    if expected_fingerprint is not None and manifest.get("model_fingerprint") != expected_fingerprint:
        raise ArtifactError(
            f"{path} was fitted for model fingerprint {manifest.get('model_fingerprint')}, "
            f"but this model is {expected_fingerprint}; fit an artifact for this model"
        )
    try:
        tensors = load_file(str(tf))
    except SafetensorError as e:
        raise ArtifactError(f"{tf} cannot be read ({e}); re-run `oscar fit`") from None
    return Artifact(path=path, manifest=manifest, tensors=tensors)
