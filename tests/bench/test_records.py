"""The results file (:mod:`oscar_cli.bench.records`): one JSON record per line, appended as each measurement ends,
read back whole, and the one-line errors for files oscar bench did not write."""

from __future__ import annotations

import json

import pytest
from bench_kit import SAMPLE

from oscar_cli.bench.records import Recorder, load_records
from oscar_cli.bench.spec import BenchError


def test_recorder_appends_one_line_per_measurement_with_the_runs_facts(tmp_path):
    path = tmp_path / "out" / "results.jsonl"
    rec = Recorder(path, "test device", "abc1234", "oscar bench --configs oscar")
    first = rec.add("server", "oscar", max_total_num_tokens=30000)
    assert path.read_text().count("\n") == 1  # on disk before the next measurement runs
    rec.add("latency", "oscar", context=8192, itl_ms=6.0)
    lines = path.read_text().splitlines()
    assert [json.loads(x)["measure"] for x in lines] == ["server", "latency"]
    assert load_records(path)[0] == first
    for r in load_records(path):
        assert (r["config"], r["device"], r["commit"], r["command"]) == ("oscar", "test device", "abc1234",
                                                                          "oscar bench --configs oscar")
        assert r["time"].endswith("Z")
    assert load_records(path)[1]["itl_ms"] == 6.0


def test_load_records_keeps_what_a_killed_run_wrote(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])  # killed while writing line 4
    assert [r["measure"] for r in load_records(f)] == ["server", "admission", "throughput"]
    f.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.raises(BenchError, match=":2 is not a JSON record"):
        load_records(f)


def test_load_records_reads_a_json_list_and_refuses_other_files(tmp_path):
    records = load_records(SAMPLE)
    (tmp_path / "list.json").write_text(json.dumps(records))
    assert load_records(tmp_path / "list.json") == records
    (tmp_path / "wrapped.json").write_text(json.dumps({"records": records}))
    assert load_records(tmp_path / "wrapped.json") == records
    (tmp_path / "other.jsonl").write_text('{"a": 1}\n{"b": 2}\n')
    for path, words in ((tmp_path / "other.jsonl", "holds no oscar bench records"),
                        (tmp_path / "missing.jsonl", "cannot read")):
        with pytest.raises(BenchError) as e:
            load_records(path)
        assert words in str(e.value) and "\n" not in str(e.value)
