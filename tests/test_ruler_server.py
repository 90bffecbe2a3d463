"""benchmarks/ruler_server.py: the requests lm-eval builds here, answered elsewhere, scored here by the tasks' own
metrics (an oracle scores 1 everywhere, an engine that answers nothing 0, a missing answer is refused)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "ruler_server.py"
pytestmark = pytest.mark.slow


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, timeout=600)


def answers(folder: Path, name: str, spec: dict, fill) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"ruler-{name}.json").write_text(json.dumps({
        "config": name, "device": "test device", "commit": "test", "bits_per_element": 2.5,
        "answers": {str(r["id"]): fill(r) for r in spec["requests"]}}))


def test_prepare_then_score_with_the_tasks_own_metrics(tiny_model_dir, tmp_path):
    reqs = tmp_path / "ruler.json.gz"
    done = run("prepare", "--model", str(tiny_model_dir), "--store", str(tmp_path / "store"), "--samples", "2",
               "--lengths", "1024", "--grid-samples", "5", "--out", str(reqs))
    assert done.returncode == 0, done.stderr[-2000:]
    spec = json.loads(gzip.open(reqs, "rt").read())
    tasks = {r["task"] for r in spec["requests"]}
    assert tasks == {"oscar_ruler_niah_single_1", "oscar_ruler_niah_multikey_2", "oscar_ruler_niah_multikey_3",
                     "oscar_niah"}
    assert len(spec["requests"]) == 3 * 2 + 5
    assert all(r["ids"] and r["max_new_tokens"] > 0 for r in spec["requests"])

    ans = tmp_path / "answers"
    answers(ans, "bf16", spec, lambda r: " ".join(r["doc"].get("outputs") or [r["doc"]["answer"]]))
    answers(ans, "oscar", spec, lambda r: "")
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n")
    done = run("score", "--requests", str(reqs), "--answers", str(ans), "--store", str(tmp_path / "store"),
               "--results", str(results), "--plot", str(tmp_path / "grid.png"))
    assert done.returncode == 0, done.stderr[-2000:]
    table = results.read_text()
    bf16 = next(x for x in table.splitlines() if x.startswith("| bf16 |"))
    oscar = next(x for x in table.splitlines() if x.startswith("| oscar |"))
    cells = lambda row: [c.strip() for c in row.split("|")[3:-1]]  # noqa: E731  (three RULER cells, the grid)
    assert len(cells(bf16)) == 4 and all(c == "1.00" for c in cells(bf16)), bf16
    assert len(cells(oscar)) == 4 and all(c.startswith("0.00") for c in cells(oscar)), oscar
    assert (tmp_path / "grid.png").stat().st_size > 0

    (ans / "ruler-oscar.json").write_text(json.dumps({"config": "oscar", "device": "d", "answers": {"0": "x"}}))
    done = run("score", "--requests", str(reqs), "--answers", str(ans), "--store", str(tmp_path / "store"),
               "--results", str(results))
    assert done.returncode == 0 and "unanswered; skipped" in done.stderr
