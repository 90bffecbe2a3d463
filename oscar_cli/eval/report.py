"""What an evaluation reports: one :class:`EvalRow` per metric (what the store's ``evals`` table holds), the recipe
thresholds the rows miss (:func:`check_thresholds`), and the :class:`EvalResult` of a run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import Threshold


@dataclass(frozen=True)
class EvalRow:
    """One metric of one method on one task (what the ``evals`` table stores). ``config`` holds the run settings,
    the effective ``scheme`` and the explicit ``overrides``."""

    model_fingerprint: str
    model_slug: str
    method: str
    artifact: str | None
    task: str
    metric: str
    value: float
    config: dict
    bits_per_element: float | None
    lm_eval_version: str

    @property
    def seq_len(self) -> int | None:
        return self.config.get("seq_len")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ThresholdMiss:
    """A threshold the rows do not meet (``value`` None: no row was produced for it)."""

    threshold: Threshold
    value: float | None
    baseline: float | None = None
    seq_len: int | None = None

    def message(self) -> str:
        t = self.threshold
        at = f"@{self.seq_len}" if self.seq_len else ""
        where = f"{t.method} {t.task} {t.metric}{at}"
        if self.value is None:
            return f"threshold not checked: no {where} row was produced ({t.describe()})"
        op = ">" if t.bound.startswith("max") else "<"
        if t.relative:
            got = (f"{self.value:.4g}, ratio to {t.baseline} {self.value / self.baseline:.4g}" if self.baseline
                   else f"{self.value:.4g}, no {t.baseline} row to compare with")
            return f"threshold missed: {where} = {got} {op} {t.bound} {t.value:g}"
        return f"threshold missed: {where} = {self.value:.4g} {op} {t.bound} {t.value:g}"


@dataclass
class EvalResult:
    """The rows of a run and the thresholds they miss."""

    rows: list[EvalRow] = field(default_factory=list)
    misses: list[ThresholdMiss] = field(default_factory=list)


def check_thresholds(rows: list[EvalRow], thresholds) -> list[ThresholdMiss]:
    """Every (threshold, evaluated length) that the rows miss, in threshold order."""
    misses = []
    for t in thresholds:
        hits = [r for r in rows if (r.method, r.task, r.metric) == (t.method, t.task, t.metric)
                and (t.seq_len is None or r.seq_len == t.seq_len)]
        if not hits:
            misses.append(ThresholdMiss(t, None, seq_len=t.seq_len))
        for r in hits:
            base = None
            if t.relative:
                base = next((b.value for b in rows if (b.method, b.task, b.metric, b.seq_len)
                             == (t.baseline, r.task, r.metric, r.seq_len)), None)
            if base is None and t.relative or not t.holds(r.value, base):
                misses.append(ThresholdMiss(t, r.value, base, r.seq_len))
    return misses
