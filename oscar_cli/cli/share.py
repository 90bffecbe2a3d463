"""``oscar push`` / ``oscar pull``: share an artifact through a folder, an archive or a hub repository, verified by
content hash before anything uses it (:mod:`oscar_cli.share`)."""

from __future__ import annotations

from typing import Annotated

import typer

from ._app import DEFAULTS, ArtifactsOpt, StoreOpt, app, guarded, out

TokenOpt = Annotated[str | None, typer.Option("--token", help="Hub token (default: huggingface_hub's login).")]


@app.command("push")
@guarded
def push_cmd(
    artifact: Annotated[str, typer.Argument(help="Artifact: latest, vN, MODEL/vN, an id or a folder.")],
    dest: Annotated[str, typer.Argument(help="A new folder, an archive (.tar.gz, .tgz, .tar) or "
                                        "hf://OWNER/NAME[/SUBFOLDER][@REVISION].")],
    store: StoreOpt = DEFAULTS["store"],
    token: TokenOpt = None,
) -> None:
    """Verify an artifact and copy it (its tensors, manifest and recipe) to a folder, an archive or a hub repository.

    Example: oscar push latest /shared/smollm2-oscar.tar.gz
    """
    from pathlib import Path

    from ..share import push
    from ..store import Store

    path = Path(artifact) if Path(artifact).is_dir() else Store(store, create=False).resolve_artifact(artifact)
    where = push(path, dest, token=token)
    out.print(f"pushed {path} to {where}", highlight=False)


@app.command("pull")
@guarded
def pull_cmd(
    src: Annotated[str, typer.Argument(help="A folder or archive made by `oscar push`, or "
                                       "hf://OWNER/NAME[/SUBFOLDER][@REVISION].")],
    artifacts: ArtifactsOpt = DEFAULTS["artifacts"],
    store: StoreOpt = DEFAULTS["store"],
    expect_hash: Annotated[str | None, typer.Option("--hash", help="Refuse it unless its content hash is this "
                                                    "(the hash `oscar inspect` or the sender printed).")] = None,
    token: TokenOpt = None,
) -> None:
    """Fetch an artifact, verify its content hash (and --hash when given) before any tensor is used, then install
    it as a new version under --artifacts and register it in the store.

    Example: oscar pull /shared/smollm2-oscar.tar.gz --hash 3f2a...
    """
    from ..share import pull
    from ..store import Store

    dest = pull(src, artifacts, Store(store), expected_hash=expect_hash, token=token)
    out.print(f"pulled {src} into {dest}", highlight=False)
