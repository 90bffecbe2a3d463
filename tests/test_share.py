"""``oscar push`` / ``oscar pull`` through folders and archives (the hub path shares everything but the network calls,
which these machines cannot make: its reference parsing and the snapshot layout are tested here)."""

import io
import json
import tarfile

import pytest
import torch
from test_artifact import MANIFEST, _tensors
from typer.testing import CliRunner

from oscar_cli import artifact as art
from oscar_cli import share
from oscar_cli.cli import app
from oscar_cli.store import Store


@pytest.fixture
def fitted(tmp_path):
    return art.write_artifact(tmp_path / "src", MANIFEST, _tensors(), "fit: {}\n")


@pytest.mark.parametrize("dest", ["shared-folder", "a.tar.gz", "a.tgz", "a.tar"])
def test_push_then_pull_installs_the_same_artifact(tmp_path, fitted, dest):
    where = str(tmp_path / "out" / dest)
    share.push(fitted, where)
    st = Store(tmp_path / "store")
    got = share.pull(where, tmp_path / "artifacts", st, expected_hash=art.read_manifest(fitted).content_hash)
    assert got == tmp_path / "artifacts" / "m" / "v1"
    a, b = art.load_artifact(fitted), art.load_artifact(got)
    assert a.manifest == b.manifest and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert [x["path"] for x in st.list_artifacts()] == [str(got.resolve())]
    again = share.pull(where, tmp_path / "artifacts", st)
    assert again.name == "v2" and len(st.list_artifacts()) == 2
    with pytest.raises(art.ArtifactError, match="already exists"):
        share.push(fitted, where)


def _tamper(path, kind):
    if kind == "tensor":
        data = bytearray((path / art.TENSOR_FILE).read_bytes())
        data[-1] ^= 0xFF
        (path / art.TENSOR_FILE).write_bytes(bytes(data))
    else:
        d = json.loads((path / art.MANIFEST_FILE).read_text())
        d["scheme"]["sink"] = 0
        (path / art.MANIFEST_FILE).write_text(json.dumps(d))


@pytest.mark.parametrize("kind", ["tensor", "manifest"])
def test_a_tampered_or_other_artifact_is_refused_and_leaves_nothing(tmp_path, fitted, kind):
    folder = tmp_path / "shared"
    share.push(fitted, str(folder))
    st = Store(tmp_path / "store")
    with pytest.raises(art.ArtifactError, match="not the expected"):
        share.pull(str(folder), tmp_path / "artifacts", st, expected_hash="0" * 64)
    _tamper(folder, kind)
    with pytest.raises(art.ArtifactError, match="content hash mismatch"):
        share.pull(str(folder), tmp_path / "artifacts", st)
    assert st.list_artifacts() == [] and list((tmp_path / "artifacts").iterdir()) == []


def _archive(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("members,needle", [
    ([("../escape", b"x")], "../escape"),
    ([("manifest.json", None)], "manifest.json"),  # a link
    ([("rotations.safetensors", b"x"), ("manifest.json", b"{}")], "recipe.yaml"),  # one missing
    ([("rotations.safetensors", b"x"), ("manifest.json", b"{}"), ("recipe.yaml", b""), ("extra.py", b"")],
     "extra.py"),
])
def test_an_archive_with_anything_but_the_three_files_is_refused_before_extraction(tmp_path, members, needle):
    bad = tmp_path / "bad.tar.gz"
    _archive(bad, members)
    st = Store(tmp_path / "store")
    with pytest.raises(art.ArtifactError, match="is not an artifact archive") as e:
        share.pull(str(bad), tmp_path / "artifacts", st)
    assert needle in str(e.value)
    assert not (tmp_path / "escape").exists() and list((tmp_path / "artifacts").iterdir()) == []


def test_hub_references_parse_and_a_hub_snapshot_layout_pulls(tmp_path, fitted):
    ref = share.HubRef.parse("hf://team/oscar-artifacts/smollm2/v3@main")
    assert (ref.repo_id, ref.subfolder, ref.revision) == ("team/oscar-artifacts", "smollm2/v3", "main")
    assert share.HubRef.parse("hf://a/b") == share.HubRef("a/b")
    for bad in ("hf://a", "hf://a/../b", "hf:///"):
        with pytest.raises(art.ArtifactError, match="not a hub reference"):
            share.HubRef.parse(bad)
    # what snapshot_download returns: the repository's tree, the artifact under the subfolder
    snapshot = tmp_path / "snapshot" / "smollm2" / "v3"
    share.push(fitted, str(snapshot))
    into = tmp_path / "into"
    into.mkdir()
    share.fetch_files(snapshot, into)
    assert sorted(p.name for p in into.iterdir()) == sorted(share.FILES)
    art.load_artifact(into)


def test_the_cli_pushes_and_pulls_with_one_line_errors(tmp_path, fitted):
    runner = CliRunner()
    archive = tmp_path / "x.tgz"
    r = runner.invoke(app, ["push", str(fitted), str(archive)])
    assert r.exit_code == 0 and archive.is_file(), r.output
    r = runner.invoke(app, ["pull", str(archive), "--artifacts", str(tmp_path / "arts"), "--store",
                            str(tmp_path / "st"), "--hash", art.read_manifest(fitted).content_hash])
    assert r.exit_code == 0 and "pulled" in r.output, r.output
    r = runner.invoke(app, ["pull", str(tmp_path / "nothing.tgz"), "--artifacts", str(tmp_path / "arts"),
                            "--store", str(tmp_path / "st")])
    assert r.exit_code == 1 and "does not exist" in r.output and r.output.strip().count("\n") <= 1
