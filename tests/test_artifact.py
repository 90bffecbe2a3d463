import hashlib
import json

import pytest
import torch

from oscar_cli import artifact as art
from oscar_cli.config import AttentionShape, QuantScheme


def _tensors(n=2, h=1, d=8):
    q, _ = torch.linalg.qr(torch.randn(d, d))
    return {"layers": torch.arange(n), "r_k": q.expand(n, h, d, d).clone(), "r_v": q.T.expand(n, h, d, d).clone(),
            "clip_k": torch.full((n, h), 0.9), "clip_v": torch.full((n, h), 0.8),
            "eig_k": torch.rand(n, h, d), "eig_v": torch.rand(n, h, d)}


def manifest(n=2, h=1, d=8, **kw):
    base = dict(model_slug="m", model_fingerprint="sha256:aa", run_id=1, stats_digest="sha256:ss",
                data_digest="sha256:dd", calibration_tokens=1024, method="oscar", per_head=h > 1,
                layers=tuple(range(n)), shape=AttentionShape(n, 2 * max(h, 1), max(h, 1), d),
                scheme=QuantScheme(sink=4, recent=8).resolved(d), fit_clip=True, clip_grid=(0.9, 1.0), metrics={})
    base.update(kw)
    return art.Manifest(**base)


MANIFEST = manifest()


def test_write_load_round_trip_and_versions(tmp_path):
    t = _tensors()
    p1 = art.write_artifact(tmp_path, MANIFEST, t, "fit: {}\n")
    p2 = art.write_artifact(tmp_path, MANIFEST, t, "fit: {}\n")
    assert (p1.name, p2.name) == ("v1", "v2")
    a = art.load_artifact(p2, expected_fingerprint="sha256:aa")
    assert torch.equal(a.tensors["r_k"], t["r_k"])
    assert a.layer(1).clip_v.tolist() == pytest.approx([0.8])
    assert a.layer(5) is None
    assert (p2 / "recipe.yaml").read_text() == "fit: {}\n"
    assert not list(tmp_path.glob("m/.tmp-*"))
    m = a.manifest
    assert isinstance(m, art.Manifest) and m.schema_version == art.MANIFEST_SCHEMA
    assert a.scheme == QuantScheme(group=8, sink=4, recent=8)
    # the hash covers the tensor file and every other manifest field (what load_artifact checks), not a placeholder
    fields = json.loads((p2 / art.MANIFEST_FILE).read_text())
    fields.pop("content_hash")
    digest = hashlib.sha256(hashlib.sha256((p2 / art.TENSOR_FILE).read_bytes()).hexdigest().encode())
    digest.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    assert m.content_hash == digest.hexdigest() and len(m.content_hash) == 64
    assert m.code_version.startswith("0.1.0") and m.created.endswith("Z")
    assert art.Manifest.from_dict(m.to_dict()) == m


@pytest.mark.parametrize("edit", [
    lambda d: d["scheme"].update(sink=8),
    lambda d: d["scheme"].update(recent=16),
    lambda d: d.update(model_fingerprint="sha256:zz"),
    lambda d: d.update(layers=[0]) or d["shape"].update(n_layers=1),
    lambda d: d["metrics"].update(note="edited"),
])
def test_an_edited_manifest_is_refused_like_damaged_tensors(tmp_path, edit):
    """Version 3: the content hash covers the manifest, so a sink, window, fingerprint or layer list edited by hand
    (a valid manifest, still) is refused before any tensor is used."""
    p = art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    d = json.loads((p / art.MANIFEST_FILE).read_text())
    edit(d)
    (p / art.MANIFEST_FILE).write_text(json.dumps(d))
    with pytest.raises(art.ArtifactError, match="content hash mismatch.*modified or damaged") as e:
        art.load_artifact(p)
    assert "\n" not in str(e.value)


def test_version_2_manifests_load_with_their_own_hash_rule(tmp_path):
    """Migration: an artifact written before version 3 (hash of the tensor file alone) still loads and verifies its
    tensors; a tampered version-2 tensor file is still refused."""
    p = art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    d = json.loads((p / art.MANIFEST_FILE).read_text())
    d.update(schema_version=2, content_hash=art.sha256_file(p / art.TENSOR_FILE))
    (p / art.MANIFEST_FILE).write_text(json.dumps(d))
    a = art.load_artifact(p)
    assert a.manifest.schema_version == 2 and a.scheme == MANIFEST.scheme
    data = bytearray((p / art.TENSOR_FILE).read_bytes())
    data[-1] ^= 0xFF
    (p / art.TENSOR_FILE).write_bytes(bytes(data))
    with pytest.raises(art.ArtifactError, match="content hash mismatch"):
        art.load_artifact(p)


def test_version_1_manifests_are_converted(tmp_path):
    p = art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    d = json.loads((p / art.MANIFEST_FILE).read_text())
    old = {k: v for k, v in d.items() if k not in ("schema_version", "scheme", "data_digest", "stats_digest",
                                                    "fit_clip", "clip_grid")}
    old.update(quant={"bits": 2, "group": 0, "sink": 4, "recent": 8}, stats_digest="sha256:dd",
               fit={"fit_clip": True, "clip_grid": [0.9, 1.0], "layers": "all"},
               content_hash=art.sha256_file(p / art.TENSOR_FILE))  # version 1 hashed the tensor file alone
    (p / art.MANIFEST_FILE).write_text(json.dumps(old))
    m = art.load_artifact(p).manifest
    assert m.scheme == QuantScheme(group=8, sink=4, recent=8) and m.data_digest == "sha256:dd" and m.stats_digest == ""


@pytest.mark.parametrize("edit,needle", [
    (lambda d: d.pop("scheme"), "missing key 'scheme'"),
    (lambda d: d.update(schema_version=7), "schema version 7"),
    (lambda d: d["scheme"].update(bits=3), "bits must be 2 or 4"),
    (lambda d: d["scheme"].update(group=3), "group 3 must divide"),
    (lambda d: d.update(layers=[0, 5]), "inconsistent"),
])
def test_bad_manifests_are_one_line_errors(tmp_path, edit, needle):
    p = art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    d = json.loads((p / art.MANIFEST_FILE).read_text())
    edit(d)
    (p / art.MANIFEST_FILE).write_text(json.dumps(d))
    with pytest.raises(art.ArtifactError, match=needle) as e:
        art.load_artifact(p)
    assert "\n" not in str(e.value)


def test_tensors_must_match_the_manifest(tmp_path):
    with pytest.raises(art.ArtifactError, match="do not match the manifest"):
        art.write_artifact(tmp_path, manifest(n=3), _tensors(n=2), "")
    with pytest.raises(art.ArtifactError, match="do not match the manifest"):
        art.write_artifact(tmp_path, manifest(), _tensors(h=3), "")  # 3 rotations for 1 KV head
    assert not (tmp_path / "m").exists() or not list((tmp_path / "m").iterdir())


def test_tampered_content_is_refused_with_both_hashes(tmp_path):
    p = art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    expected = json.loads((p / "manifest.json").read_text())["content_hash"]
    data = bytearray((p / art.TENSOR_FILE).read_bytes())
    data[-1] ^= 0xFF
    (p / art.TENSOR_FILE).write_bytes(bytes(data))
    with pytest.raises(art.ArtifactError, match="content hash mismatch") as e:
        art.load_artifact(p)
    m = art.read_manifest(p)
    assert expected in str(e.value) and art.content_digest(p / art.TENSOR_FILE, m) in str(e.value)


def test_fingerprint_mismatch_shows_both_values(tmp_path):
    p = art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    with pytest.raises(art.ArtifactError, match="sha256:aa.*sha256:bb"):
        art.load_artifact(p, expected_fingerprint="sha256:bb")


@pytest.mark.parametrize("where", ["tensors", "manifest"])
def test_a_full_disk_during_the_write_leaves_nothing_and_says_so(tmp_path, monkeypatch, where):
    """ENOSPC while the tensors or the manifest are written: one line naming the folder and the fix, no version
    folder, no temporary folder, earlier versions untouched."""
    import errno

    import safetensors.torch

    first = art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    before = sorted(p.name for p in (tmp_path / "m").iterdir())

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "tensors":
        monkeypatch.setattr(safetensors.torch, "save_file", full)
    else:
        monkeypatch.setattr(art.Path, "write_text", full)
    with pytest.raises(art.ArtifactError, match="No space left on device.*nothing was written.*free space") as e:
        art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before == ["v1"]
    assert art.load_artifact(first).manifest.content_hash


def test_not_an_artifact(tmp_path):
    with pytest.raises(art.ArtifactError, match="is not an artifact"):
        art.load_artifact(tmp_path)


def test_an_artifact_has_the_permissions_of_any_other_file(tmp_path):
    """Not the 0700 folder of a temporary directory: under umask 022 the folder is 0755 and its files 0644."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        p = art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in p.iterdir()} == {0o644}


def test_staging_folders_of_dead_processes_are_swept(tmp_path):
    import os
    import subprocess
    import sys

    from oscar_cli.files import staging_dir, sweep_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / f".tmp-{pid}-abc").mkdir()
    (tmp_path / f".tmp-{os.getppid()}-live").mkdir()  # a process that runs: kept
    (tmp_path / ".tmp-xyz").mkdir()  # not ours to judge: kept
    mine = staging_dir(tmp_path)
    assert mine.name.startswith(f".tmp-{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, f".tmp-{os.getppid()}-live", ".tmp-xyz"])
    assert sweep_stale(tmp_path) == []
