"""Sharing artifacts: ``oscar push`` to a folder, an archive or a hub repository, ``oscar pull`` back into the local
artifacts folder and store, verified by content hash before any tensor is used.

An artifact is three files (:mod:`oscar_cli.artifact`): ``rotations.safetensors``, ``manifest.json`` (whose
``content_hash`` covers the tensors and every other manifest field) and ``recipe.yaml``. A shared copy is those three
files and nothing else, in

* a folder (``DEST/manifest.json`` ...);
* a ``.tar.gz`` / ``.tgz`` / ``.tar`` archive holding them at its top level (no folders, links or other members: an
  archive with anything else is refused before it is extracted);
* a hub repository ``hf://OWNER/NAME[/SUBFOLDER][@REVISION]`` (model repositories, through ``huggingface_hub``:
  ``upload_folder`` to push, ``snapshot_download`` of the three files to pull; the network calls need hub access).

Pulling copies the files into a staging folder, loads the artifact there (manifest parsed, content hash, shapes;
``expected_hash`` when given must equal the manifest's, and the model fingerprint must match when one is given),
then renames it into ``<artifacts>/<model>/v<N>`` and registers it in the store: a tampered or mismatched copy is
refused in one line and leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .artifact import MANIFEST_FILE, RECIPE_FILE, TENSOR_FILE, ArtifactError, install_version, load_artifact
from .files import share_like_umask, staging_dir

FILES = (TENSOR_FILE, MANIFEST_FILE, RECIPE_FILE)
"""What a shared artifact holds."""
HUB = "hf://"
ARCHIVES = (".tar.gz", ".tgz", ".tar")


@dataclass(frozen=True)
class HubRef:
    """``hf://OWNER/NAME[/SUBFOLDER][@REVISION]``."""

    repo_id: str
    subfolder: str = ""
    revision: str | None = None

    @classmethod
    def parse(cls, ref: str) -> HubRef:
        body, _, revision = ref[len(HUB):].partition("@")
        parts = [p for p in body.split("/") if p]
        if len(parts) < 2 or any(p in (".", "..") for p in parts):
            raise ArtifactError(f"{ref!r} is not a hub reference; write hf://OWNER/NAME[/SUBFOLDER][@REVISION]")
        return cls("/".join(parts[:2]), "/".join(parts[2:]), revision or None)


def kind_of(where: str) -> str:
    """``hub``, ``archive`` or ``folder``."""
    if where.startswith(HUB):
        return "hub"
    if where.endswith(ARCHIVES):
        return "archive"
    return "folder"


# ---------------------------------------------------------------------------------------------------------- push
def push(artifact_dir: Path, dest: str, *, token: str | None = None) -> str:
    """Verify ``artifact_dir`` and copy its three files to ``dest`` (folder, archive or hub). Returns ``dest``."""
    load_artifact(artifact_dir)  # a damaged artifact is never shared
    kind = kind_of(dest)
    if kind == "hub":
        return _push_hub(artifact_dir, HubRef.parse(dest), token)
    target = Path(dest)
    if target.exists() and (target.is_file() or any(target.iterdir())):
        raise ArtifactError(f"{dest} already exists; push to a new folder or archive name")
    if kind == "archive":
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.partial")
        mode = "w:gz" if dest.endswith((".tar.gz", ".tgz")) else "w"
        try:
            with tarfile.open(tmp, mode) as tar:
                for name in FILES:
                    tar.add(artifact_dir / name, arcname=name, recursive=False)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return dest
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(target.parent)
    try:
        for name in FILES:
            shutil.copy2(artifact_dir / name, tmp / name)
        share_like_umask(tmp)
        if target.exists():
            target.rmdir()  # empty: checked above
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _push_hub(artifact_dir: Path, ref: HubRef, token: str | None) -> str:
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ArtifactError("pushing to a hub needs huggingface_hub (pip install huggingface_hub)") from None
    api = HfApi(token=token)
    api.create_repo(ref.repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(folder_path=str(artifact_dir), repo_id=ref.repo_id, repo_type="model",
                      path_in_repo=ref.subfolder or None, revision=ref.revision, allow_patterns=list(FILES),
                      commit_message=f"OSCAR-KV artifact {artifact_dir.parent.name}/{artifact_dir.name}")
    return f"{HUB}{ref.repo_id}" + (f"/{ref.subfolder}" if ref.subfolder else "") + \
        (f"@{ref.revision}" if ref.revision else "")


# ---------------------------------------------------------------------------------------------------------- pull
def _safe_extract(archive: Path, into: Path) -> None:
    """Extract exactly the artifact's files from the top level of ``archive``; anything else (folders, links,
    devices, other names, duplicates) refuses the whole archive before a byte is written."""
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            names = [m.name for m in members]
            bad = [m.name for m in members if not m.isfile() or m.name not in FILES]
            if bad or len(set(names)) != len(names) or set(names) != set(FILES):
                shown = ", ".join(bad[:3]) or ", ".join(sorted(set(FILES) - set(names))) or "duplicate names"
                raise ArtifactError(f"{archive} is not an artifact archive (it must hold exactly "
                                    f"{', '.join(FILES)} at its top level; found {shown})")
            for m in members:
                with tar.extractfile(m) as src, open(into / m.name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArtifactError(f"cannot read archive {archive} ({e}); pass an archive made by `oscar push`") from None


def _fetch_hub(ref: HubRef, into: Path, token: str | None) -> None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ArtifactError("pulling from a hub needs huggingface_hub (pip install huggingface_hub)") from None
    prefix = f"{ref.subfolder}/" if ref.subfolder else ""
    local = Path(snapshot_download(ref.repo_id, repo_type="model", revision=ref.revision, token=token,
                                   allow_patterns=[prefix + f for f in FILES]))
    fetch_files(local / ref.subfolder if ref.subfolder else local, into)


def fetch_files(src: Path, into: Path) -> None:
    """Copy the artifact's three files from folder ``src`` (the layout of a pushed folder or a hub snapshot) into
    ``into``; a missing one is refused."""
    missing = [f for f in FILES if not (src / f).is_file()]
    if missing:
        raise ArtifactError(f"{src} holds no artifact ({', '.join(missing)} missing); pass a folder, archive or hub "
                            "reference made by `oscar push`")
    for f in FILES:
        shutil.copyfile(src / f, into / f)


def pull(src: str, artifacts_root: Path, store, *, expected_hash: str | None = None,
         expected_fingerprint: str | None = None, token: str | None = None) -> Path:
    """Fetch ``src``, verify it, install it as a new version under ``artifacts_root`` and register it in ``store``
    (an :class:`oscar_cli.store.Store`). Returns the installed folder."""
    artifacts_root = Path(artifacts_root)
    artifacts_root.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(artifacts_root)
    try:
        kind = kind_of(src)
        if kind == "hub":
            _fetch_hub(HubRef.parse(src), tmp, token)
        elif kind == "archive":
            if not Path(src).is_file():
                raise ArtifactError(f"archive {src} does not exist")
            _safe_extract(Path(src), tmp)
        else:
            if not Path(src).is_dir():
                raise ArtifactError(f"{src} is neither a folder, an archive (.tar.gz, .tgz, .tar) nor hf://...")
            fetch_files(Path(src), tmp)
        art = load_artifact(tmp, expected_fingerprint)  # the content hash before anything else uses it
        if expected_hash is not None and art.manifest.content_hash != expected_hash:
            raise ArtifactError(f"{src} has content hash {art.manifest.content_hash}, not the expected "
                                f"{expected_hash}; it is another artifact or was altered")
        model_dir = artifacts_root / art.manifest.model_slug  # a plain name: the manifest was checked
        model_dir.mkdir(parents=True, exist_ok=True)
        share_like_umask(tmp)
        dest = install_version(tmp, model_dir)
        try:
            store.register_artifact(dest, art.manifest.to_dict())  # the files verified above, renamed whole
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)  # not registered: not installed
            raise
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
