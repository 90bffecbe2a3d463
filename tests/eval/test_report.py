"""Rows and recipe thresholds."""

from oscar_cli.config import Threshold
from oscar_cli.eval.report import EvalRow, check_thresholds


def row(method, value, seq_len=1024):
    return EvalRow(model_fingerprint="f", model_slug="s", method=method, artifact=None, task="oscar_ppl",
                   metric="ppl", value=value, config={"seq_len": seq_len}, bits_per_element=None, lm_eval_version="v")


def test_thresholds_absolute_relative_and_missing_rows():
    rows = [row("bf16", 10.0), row("oscar", 11.0), row("oscar", 13.0, 2048), row("bf16", 12.0, 2048)]
    assert rows[0].seq_len == 1024 and rows[0].to_dict()["config"] == {"seq_len": 1024}
    within = Threshold("oscar", "oscar_ppl", "ppl", "max_ratio", 1.15)
    assert check_thresholds(rows, [within]) == []  # 1.10 and 1.083 of bf16 at each length
    tight = Threshold("oscar", "oscar_ppl", "ppl", "max_ratio", 1.09)
    (miss,) = check_thresholds(rows, [tight])
    assert (miss.value, miss.baseline, miss.seq_len) == (11.0, 10.0, 1024)
    assert miss.message() == "threshold missed: oscar oscar_ppl ppl@1024 = 11, ratio to bf16 1.1 > max_ratio 1.09"
    floor = Threshold("bf16", "oscar_ppl", "ppl", "min", 11.0, seq_len=1024)
    assert [m.value for m in check_thresholds(rows, [floor])] == [10.0]
    absent = Threshold("int2-naive", "oscar_ppl", "ppl", "max", 99.0)
    (none,) = check_thresholds(rows, [absent])
    assert none.value is None and none.message().startswith("threshold not checked: no int2-naive oscar_ppl ppl row")
    no_base = Threshold("oscar", "oscar_ppl", "ppl", "max_ratio", 9.0, baseline="int2-naive")
    assert len(check_thresholds(rows, [no_base])) == 2  # a ratio without its baseline row is a miss, not a pass
