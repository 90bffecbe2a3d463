import json

import pytest
import torch

from oscar_cli import artifact as art


def _tensors(n=2, h=1, d=8):
    q, _ = torch.linalg.qr(torch.randn(d, d))
    return {"layers": torch.arange(n), "r_k": q.expand(n, h, d, d).clone(), "r_v": q.T.expand(n, h, d, d).clone(),
            "clip_k": torch.full((n, h), 0.9), "clip_v": torch.full((n, h), 0.8),
            "eig_k": torch.rand(n, h, d), "eig_v": torch.rand(n, h, d)}


MANIFEST = {"model_slug": "m", "model_fingerprint": "sha256:aa", "method": "oscar",
            "quant": {"bits": 2, "group": 0, "sink": 4, "recent": 8}}


def test_write_load_round_trip_and_versions(tmp_path):
    t = _tensors()
    p1 = art.write_artifact(tmp_path, "m", t, MANIFEST, "fit: {}\n")
    p2 = art.write_artifact(tmp_path, "m", t, MANIFEST, "fit: {}\n")
    assert (p1.name, p2.name) == ("v1", "v2")
    a = art.load_artifact(p2, expected_fingerprint="sha256:aa")
    assert torch.equal(a.tensors["r_k"], t["r_k"])
    assert a.layer(1).clip_v.tolist() == pytest.approx([0.8])
    assert a.layer(5) is None
    assert (p2 / "recipe.yaml").read_text() == "fit: {}\n"
    assert not list(tmp_path.glob("m/.tmp-*"))


def test_tampered_content_is_refused_with_both_hashes(tmp_path):
    p = art.write_artifact(tmp_path, "m", _tensors(), MANIFEST, "")
    expected = json.loads((p / "manifest.json").read_text())["content_hash"]
    data = bytearray((p / art.TENSOR_FILE).read_bytes())
    data[-1] ^= 0xFF
    (p / art.TENSOR_FILE).write_bytes(bytes(data))
    with pytest.raises(art.ArtifactError, match="content hash mismatch") as e:
        art.load_artifact(p)
    assert expected in str(e.value) and art.sha256_file(p / art.TENSOR_FILE) in str(e.value)


def test_fingerprint_mismatch_shows_both_values(tmp_path):
    p = art.write_artifact(tmp_path, "m", _tensors(), MANIFEST, "")
    with pytest.raises(art.ArtifactError, match="sha256:aa.*sha256:bb"):
        art.load_artifact(p, expected_fingerprint="sha256:bb")


def test_a_failed_write_leaves_no_partial_artifact(tmp_path, monkeypatch):
    import safetensors.torch

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError):
        art.write_artifact(tmp_path, "m", _tensors(), MANIFEST, "")
    assert list((tmp_path / "m").iterdir()) == []


def test_not_an_artifact(tmp_path):
    with pytest.raises(art.ArtifactError, match="is not an artifact"):
        art.load_artifact(tmp_path)
