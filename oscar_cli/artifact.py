"""Artifacts: the only writer of ``artifacts/``.

An artifact is a folder ``<root>/<model-slug>/v<N>/`` holding

* ``rotations.safetensors`` (fp32): ``layers`` int64 ``[n]``; ``r_k``, ``r_v`` ``[n, h, d, d]`` with ``h = 1`` for a
  rotation shared by all KV heads or ``h = kv_heads`` (``--per-head``); ``clip_k``, ``clip_v`` ``[n, h]`` clip ratios;
  ``eig_k``, ``eig_v`` ``[n, h, d]`` descending eigenvalues of the targets the rotations came from (zeros for
  data-free methods); with fp8 scales (``scheme.scale_dtype``), ``mult_k``, ``mult_v`` ``[n, kv_heads]`` the
  power-of-two multipliers the scales and zeros are stored in units of; with ``scheme.center_keys``, ``center_k``
  ``[n, kv_heads, d]`` the key centers (model basis); with ``scheme.levels == "fitted"``, ``levels_k``, ``levels_v``
  ``[n, kv_heads, 4]``; with split key rows (``scheme.split_k``), ``clip_k_hi`` ``[n, h]`` the 4-bit parts' clip
  ratios (``clip_k`` holds the 2-bit parts') and, with fp8 scales, ``mult_k_hi`` ``[n, kv_heads]``; a split layer's
  ``r_k`` is its split rotation (:func:`oscar_cli.rotation.split_rotation`), 1 in the rows of layers not split;
* ``manifest.json`` (:class:`Manifest`, schema version 3): model fingerprint, run id, stats and data digests, fit
  method, the quant scheme (:class:`oscar_kernels.scheme.QuantScheme`), code version (package version + git commit),
  created, fit-time metrics and ``content_hash`` (:func:`content_digest`: sha256 over ``rotations.safetensors`` and
  every other field of the manifest, so an edited sink, clip or scheme is refused like a damaged tensor);
* ``recipe.yaml``: a copy of the recipe that produced it.

Rows are rotated as ``x @ R``. Layers not listed are left in BF16 by the cache. Writes go to a temporary folder that
is renamed into place, so a crash never leaves half an artifact. Loading parses and validates the manifest once,
checks the content hash, the tensor shapes and, when a model fingerprint is given, that it matches; only safetensors and
JSON are read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import code_version
from .config import AttentionShape, QuantScheme, SchemeError
from .errors import OscarError
from .files import share_like_umask, staging_dir

TENSOR_FILE = "rotations.safetensors"
MANIFEST_FILE = "manifest.json"
RECIPE_FILE = "recipe.yaml"
MANIFEST_SCHEMA = 3
"""Version 3: ``content_hash`` covers the manifest's fields too (:func:`content_digest`). Version 2 (the same fields,
its hash over ``rotations.safetensors`` alone) and version 1 (no ``schema_version``, the scheme under ``quant``) are
read and checked by the rule they were written with."""
READ_SCHEMAS = (1, 2, MANIFEST_SCHEMA)


SLUG = re.compile(r"[a-z0-9_-][a-z0-9._-]*(?<!\.)")
"""What a model slug may be (:func:`oscar_cli.models.slugify`'s output): a folder name, never ``.``/``..`` or a
path."""


class ArtifactError(OscarError):
    """An artifact is missing, damaged or does not belong to the model."""


@dataclass(frozen=True)
class Manifest:
    """An artifact's ``manifest.json``, parsed and validated once at load (see :func:`Manifest.from_dict`).

    ``scheme`` is the quant scheme the clip ratios were fitted for (``group`` resolved to the head dim when it was
    0); ``stats_digest`` identifies the calibration statistics, ``data_digest`` the calibration text;
    ``metrics`` is the fit-time report (per-layer distortions, summary) that ``inspect`` shows."""

    model_slug: str
    model_fingerprint: str
    run_id: int | None
    stats_digest: str
    data_digest: str
    calibration_tokens: int
    method: str
    per_head: bool
    layers: tuple[int, ...]
    shape: AttentionShape
    scheme: QuantScheme
    fit_clip: bool
    clip_grid: tuple[float, ...]
    metrics: dict
    created: str = ""
    code_version: str = ""
    content_hash: str = ""
    schema_version: int = MANIFEST_SCHEMA

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        d["clip_grid"] = list(self.clip_grid)
        d["scheme"] = self.scheme.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "manifest") -> Manifest:
        """Strict parse (version 1 is converted); raises :class:`ArtifactError` with one line on any problem."""
        if not isinstance(d, dict):
            raise ArtifactError(f"{where} is not a JSON object; re-run `oscar fit`")
        version = d.get("schema_version", 1)
        if version not in READ_SCHEMAS:
            raise ArtifactError(f"{where} has schema version {version}; this oscar-kv reads versions "
                                f"{', '.join(map(str, READ_SCHEMAS))}: upgrade oscar-kv or re-run `oscar fit`")
        try:
            shape = AttentionShape(**{k: int(v) for k, v in d["shape"].items()})
            if version == 1:
                scheme = QuantScheme.from_dict(d["quant"], f"{where}: quant").resolved(shape.head_dim)
                fit = d.get("fit", {})
                data_digest, stats_digest = d.get("stats_digest", ""), ""
                fit_clip, clip_grid = fit.get("fit_clip", True), fit.get("clip_grid", [])
            else:
                scheme = QuantScheme.from_dict(d["scheme"], f"{where}: scheme")
                data_digest, stats_digest = d["data_digest"], d["stats_digest"]
                fit_clip, clip_grid = d["fit_clip"], d["clip_grid"]
            m = cls(
                model_slug=str(d["model_slug"]), model_fingerprint=str(d["model_fingerprint"]),
                run_id=None if d.get("run_id") is None else int(d["run_id"]),
                stats_digest=str(stats_digest), data_digest=str(data_digest),
                calibration_tokens=int(d.get("calibration_tokens", 0)), method=str(d["method"]),
                per_head=bool(d.get("per_head", False)), layers=tuple(int(i) for i in d["layers"]), shape=shape,
                scheme=scheme, fit_clip=bool(fit_clip), clip_grid=tuple(float(c) for c in clip_grid),
                metrics=dict(d.get("metrics", {})), created=str(d.get("created", "")),
                code_version=str(d.get("code_version", "")), content_hash=str(d.get("content_hash", "")),
                schema_version=int(version),
            )
            consistent = scheme.group == scheme.check_split(shape.head_dim) and bool(m.layers) \
                and all(0 <= i < shape.n_layers for i in m.layers)
        except SchemeError as e:
            raise ArtifactError(f"{e}; re-run `oscar fit`") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise ArtifactError(f"{where} is not a valid manifest ({what}); re-run `oscar fit`") from None
        if not consistent:
            raise ArtifactError(f"{where} is inconsistent (scheme group {scheme.group}, layers {list(m.layers)}, "
                                f"shape {shape}); re-run `oscar fit`")
        if not SLUG.fullmatch(m.model_slug):
            raise ArtifactError(f"{where}: model_slug {m.model_slug!r} is not a plain name (it names a folder); "
                                "re-run `oscar fit`")
        return m


@dataclass(frozen=True)
class LayerRotation:
    """One layer's rotations. ``r_k``/``r_v``: fp32 ``[h, d, d]``; ``clip_k``/``clip_v``: fp32 ``[h]`` (for the
    layer's allocated widths); ``mult_k``/``mult_v``: fp32 ``[kv_heads]`` FP8 metadata multipliers, None for fp16."""

    r_k: torch.Tensor
    r_v: torch.Tensor
    clip_k: torch.Tensor
    clip_v: torch.Tensor
    mult_k: torch.Tensor | None = None
    mult_v: torch.Tensor | None = None
    center_k: torch.Tensor | None = None
    levels_k: torch.Tensor | None = None
    levels_v: torch.Tensor | None = None
    clip_k_hi: torch.Tensor | None = None
    mult_k_hi: torch.Tensor | None = None


@dataclass(frozen=True)
class Artifact:
    path: Path
    manifest: Manifest
    tensors: dict[str, torch.Tensor]

    @property
    def name(self) -> str:
        return f"{self.path.parent.name}/{self.path.name}"

    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    @property
    def scheme(self) -> QuantScheme:
        return self.manifest.scheme

    @property
    def method(self) -> str:
        return self.manifest.method

    @property
    def heads(self) -> int:
        """Rotations per layer: 1 (shared by the KV heads) or the number of KV heads."""
        return int(self.tensors["r_k"].shape[1])

    def layer(self, idx: int) -> LayerRotation | None:
        """Rotations of model layer ``idx``, or None when the artifact leaves that layer unquantized."""
        layers = self.layers
        if idx not in layers:
            return None
        i = layers.index(idx)
        t = self.tensors
        extra = {k: t[k][i].float() if k in t else None
                 for k in ("mult_k", "mult_v", "center_k", "levels_k", "levels_v", "clip_k_hi", "mult_k_hi")}
        return LayerRotation(t["r_k"][i], t["r_v"][i], t["clip_k"][i], t["clip_v"][i], **extra)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def content_digest(tensor_file: Path, manifest: Manifest) -> str:
    """What a version-3 manifest's ``content_hash`` holds: sha256 over the tensor file's sha256 and the manifest's
    canonical JSON without ``content_hash`` itself (every field that says what the artifact computes, and the rest)."""
    fields = manifest.to_dict()
    fields.pop("content_hash", None)
    h = hashlib.sha256(sha256_file(tensor_file).encode())
    h.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def _next_version(model_dir: Path) -> int:
    versions = [int(p.name[1:]) for p in model_dir.glob("v*") if p.name[1:].isdigit()]
    return max(versions, default=0) + 1


def write_artifact(root: Path, manifest: Manifest, tensors: dict[str, torch.Tensor], recipe_text: str) -> Path:
    """Write a new version atomically; returns its folder. The manifest gets ``created``, ``code_version`` and
    ``content_hash``; the tensors are checked against it first. A write that fails (a full disk) leaves nothing
    behind and raises a one-line :class:`ArtifactError`."""
    _check_tensors(tensors, manifest, "the fitted tensors")
    if not SLUG.fullmatch(manifest.model_slug):
        raise ArtifactError(f"model slug {manifest.model_slug!r} is not a plain name; it names the artifact's folder")
    model_dir = Path(root) / manifest.model_slug
    model_dir.mkdir(parents=True, exist_ok=True)
    try:
        tmp = staging_dir(model_dir)
    except OSError as e:
        raise ArtifactError(f"cannot write an artifact under {model_dir} ({e.strerror}); free space or pass "
                            "another --artifacts folder") from None
    try:
        _write_files(tmp, manifest, tensors, recipe_text)
    except OSError as e:  # a full disk, a quota: nothing is left behind (the temporary folder goes below)
        shutil.rmtree(tmp, ignore_errors=True)
        raise ArtifactError(f"cannot write the artifact under {model_dir} ({e.strerror or e}); nothing was written: "
                            "free space or pass another --artifacts folder, then fit again") from None
    try:
        return install_version(tmp, model_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def install_version(tmp: Path, model_dir: Path) -> Path:
    """Rename the finished staging folder ``tmp`` to the next free ``<model_dir>/v<N>`` (atomic; a rename that
    another writer beat to that version tries the next one); returns it."""
    for _ in range(100):
        dest = model_dir / f"v{_next_version(model_dir)}"
        try:
            os.rename(tmp, dest)
            return dest
        except OSError:
            continue
    raise ArtifactError(f"could not claim a version folder under {model_dir}")


def _write_files(tmp: Path, manifest: Manifest, tensors: dict[str, torch.Tensor], recipe_text: str) -> None:
    """The artifact's three files into the staging folder ``tmp`` (the manifest gets ``created``, ``code_version``
    and its ``content_hash``), with the permissions of any other file the user creates."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp / TENSOR_FILE))
    full = dataclasses.replace(manifest, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               code_version=code_version(), schema_version=MANIFEST_SCHEMA)
    full = dataclasses.replace(full, content_hash=content_digest(tmp / TENSOR_FILE, full))
    (tmp / MANIFEST_FILE).write_text(json.dumps(full.to_dict(), indent=2, sort_keys=True) + "\n")
    (tmp / RECIPE_FILE).write_text(recipe_text)
    share_like_umask(tmp)


def _check_tensors(tensors: dict[str, torch.Tensor], m: Manifest, where) -> None:
    """Tensor names and shapes agree with the manifest (layers, KV heads or one shared rotation, head dim)."""
    required = {"layers", "r_k", "r_v", "clip_k", "clip_v", "eig_k", "eig_v"}
    missing = required - set(tensors)
    if missing:
        raise ArtifactError(f"{where}: tensors missing: {', '.join(sorted(missing))}; re-run `oscar fit`")
    n, d, hkv = len(m.layers), m.shape.head_dim, m.shape.n_kv_heads
    h = tensors["r_k"].shape[1] if tensors["r_k"].dim() == 4 else -1
    want = {"r_k": (n, h, d, d), "r_v": (n, h, d, d), "clip_k": (n, h), "clip_v": (n, h), "eig_k": (n, h, d),
            "eig_v": (n, h, d), "layers": (n,)}
    if m.scheme.scale_dtype == "fp8":
        missing = {"mult_k", "mult_v"} - set(tensors)
        if missing:
            raise ArtifactError(f"{where}: the scheme stores fp8 scales but the tensors lack "
                                f"{', '.join(sorted(missing))}; re-run `oscar fit`")
        want.update(mult_k=(n, hkv), mult_v=(n, hkv))
    if m.scheme.center_keys:
        if "center_k" not in tensors:
            raise ArtifactError(f"{where}: the scheme centers keys but the tensors lack center_k; re-run `oscar fit`")
        want["center_k"] = (n, hkv, d)
    if m.scheme.levels == "fitted":
        missing = {"levels_k", "levels_v"} - set(tensors)
        if missing:
            raise ArtifactError(f"{where}: the scheme has fitted levels but the tensors lack "
                                f"{', '.join(sorted(missing))}; re-run `oscar fit`")
        want.update(levels_k=(n, hkv, 4), levels_v=(n, hkv, 4))
    if m.scheme.split:
        need = {"clip_k_hi"} | ({"mult_k_hi"} if m.scheme.scale_dtype == "fp8" else set())
        missing = need - set(tensors)
        if missing:
            raise ArtifactError(f"{where}: the scheme splits key rows but the tensors lack "
                                f"{', '.join(sorted(missing))}; re-run `oscar fit`")
        want["clip_k_hi"] = (n, h)
        if "mult_k_hi" in need:
            want["mult_k_hi"] = (n, hkv)
    try:
        m.scheme.check_layers(m.shape.n_layers)  # the allocation's and the split's per-layer entries
    except SchemeError as e:
        raise ArtifactError(f"{where}: {e}; re-run `oscar fit`") from None
    bad = [k for k, s in want.items() if tuple(tensors[k].shape) != s]
    if h not in (1, hkv) or bad or tensors["layers"].tolist() != list(m.layers):
        raise ArtifactError(f"{where}: tensor shapes do not match the manifest ({n} layers, {hkv} KV heads, head dim "
                            f"{d}; bad: {', '.join(bad) or 'layers/heads'}); re-run `oscar fit`")


def remove_artifact(path: Path) -> None:
    """Delete an artifact folder (used to roll back when registering it fails)."""
    shutil.rmtree(path, ignore_errors=True)


def read_manifest(path: Path) -> Manifest:
    """Parse ``<artifact>/manifest.json`` (no tensor check; :func:`load_artifact` does the full verification)."""
    mf = Path(path) / MANIFEST_FILE
    try:
        raw = json.loads(mf.read_text())
    except OSError as e:
        raise ArtifactError(f"{path} is not an artifact ({mf.name}: {e.strerror}); run `oscar fit`") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{mf} is not valid JSON ({e.msg}); re-run `oscar fit`") from None
    return Manifest.from_dict(raw, str(mf))


def load_artifact(path: Path, expected_fingerprint: str | None = None) -> Artifact:
    """Load and verify an artifact folder: manifest parsed and validated, content hash, model fingerprint,
    tensor shapes against the manifest."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    mf, tf = path / MANIFEST_FILE, path / TENSOR_FILE
    if not mf.is_file() or not tf.is_file():
        raise ArtifactError(f"{path} is not an artifact (needs {MANIFEST_FILE} and {TENSOR_FILE}); run `oscar fit`")
    manifest = read_manifest(path)
    # version 3 covers the manifest too; older versions were written with their tensor file's hash alone
    actual = content_digest(tf, manifest) if manifest.schema_version >= 3 else sha256_file(tf)
    if manifest.content_hash != actual:
        raise ArtifactError(
            f"{path}: content hash mismatch (manifest {manifest.content_hash}, computed {actual}); "
            "the artifact was modified or damaged: re-run `oscar fit`"
        )
    if expected_fingerprint is not None and manifest.model_fingerprint != expected_fingerprint:
        raise ArtifactError(
            f"{path} was fitted for model fingerprint {manifest.model_fingerprint}, "
            f"but this model is {expected_fingerprint}; fit an artifact for this model"
        )
    try:
        tensors = load_file(str(tf))
    except SafetensorError as e:
        raise ArtifactError(f"{tf} cannot be read ({e}); re-run `oscar fit`") from None
    _check_tensors(tensors, manifest, str(path))
    return Artifact(path=path, manifest=manifest, tensors=tensors)
