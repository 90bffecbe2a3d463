"""What the toolkit reads from disk cannot run code or escape its folders: only safetensors, JSON and YAML through a
safe loader are read; names that become folders are plain names."""

import json
import re
from pathlib import Path

import pytest

from oscar_cli import artifact as art
from oscar_cli.models import slugify

ROOT = Path(__file__).resolve().parents[1]
UNSAFE = re.compile(r"\btorch\.load\(|\bimport pickle\b|\bpickle\.|\bmarshal\.|\byaml\.load\(|\byaml\.unsafe_load|"
                    r"\bdill\b|\bjoblib\.load|trust_remote_code\s*=\s*True")


def test_no_code_executing_loader_in_the_package():
    """A scan of every module of oscar_cli and the kernels: no torch.load, pickle, marshal, unsafe YAML or remote
    code (the scan itself is checked against a line that has each)."""
    bad = "torch.load(f); import pickle; yaml.load(t); trust_remote_code=True"
    assert len(UNSAFE.findall(bad)) == 4
    found = []
    for folder in (ROOT / "oscar_cli", ROOT / "kernels" / "oscar_kernels"):
        for py in folder.rglob("*.py"):
            for i, line in enumerate(py.read_text().splitlines(), 1):
                if UNSAFE.search(line):
                    found.append(f"{py.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []


@pytest.mark.parametrize("spec", ["..", ".", "../../etc", "a/../../b", "./x/..", "..gguf", "/", "~/..", "C:\\..\\x"])
def test_a_slug_is_a_plain_folder_name(spec):
    slug = slugify(spec)
    assert slug not in (".", "..") and "/" not in slug and "\\" not in slug and art.SLUG.fullmatch(slug)


def test_a_manifest_naming_a_folder_outside_is_refused(tmp_path):
    from test_artifact import MANIFEST, _tensors

    p = art.write_artifact(tmp_path, MANIFEST, _tensors(), "")
    d = json.loads((p / art.MANIFEST_FILE).read_text())
    for slug in ("../evil", "..", "a/b"):
        d["model_slug"] = slug
        (p / art.MANIFEST_FILE).write_text(json.dumps(d))
        with pytest.raises(art.ArtifactError, match="is not a plain name"):
            art.load_artifact(p)
    import dataclasses

    with pytest.raises(art.ArtifactError, match="is not a plain name"):
        art.write_artifact(tmp_path, dataclasses.replace(MANIFEST, model_slug="../up"), _tensors(), "")
    assert not (tmp_path.parent / "up").exists()
