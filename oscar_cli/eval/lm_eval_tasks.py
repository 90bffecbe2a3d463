"""lm-eval tasks: the offline ones shipped in :mod:`oscar_cli.tasks` and any other task of lm-eval's index.

The offline tasks (RULER NIAH with a sample count that ``--limit`` really limits, a needle-in-a-haystack grid) load
through a ``TaskManager(include_path=..., include_defaults=False)`` (no index build, no hub); any other task needs
lm-eval's full index and usually the hub. :func:`lm_rows` turns the results into :class:`~.report.EvalRow` s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..config import OFFLINE_TASKS, PPL_TASK
from ..errors import OscarError
from . import EvalError
from .report import EvalRow

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
"""The folder of the shipped task YAML and their Python (:mod:`oscar_cli.tasks`)."""


def lm_task_names(names) -> list[str]:
    """Row task names (see :func:`oscar_cli.config.expand_tasks`) -> lm-eval task names (offline ones are shipped)."""
    return [OFFLINE_TASKS.get(n, n) for n in names]


def check_lm_tasks(tasks: list[str]) -> None:
    """Refuse unknown lm-eval task names in one line before anything slow loads (the offline tasks need no index;
    any other name is looked up in lm-eval's index, built once per process)."""
    offline = set(OFFLINE_TASKS.values())
    others = [t for t in tasks if t not in offline]
    if not others:
        return
    unknown = [t for t in others if t not in _index()]
    if unknown:
        raise EvalError(f"unknown lm-eval task(s) {', '.join(unknown)}; offline tasks: {PPL_TASK}, ruler, "
                        f"{', '.join(OFFLINE_TASKS)}")


@functools.cache
def _index() -> frozenset[str]:
    """Every task name lm-eval's index (plus the shipped tasks) knows."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise EvalError("lm-eval is not installed; `make setup` installs it (pip install 'lm-eval[hf,ruler]')") from None
    return frozenset(TaskManager(include_path=str(TASKS_DIR)).all_tasks)


def run_lm_eval(lm, tasks: list[str], limit: int | None, metadata: dict) -> dict[str, dict[str, float]]:
    """Run lm-eval tasks on an lm-eval model (:class:`~.lm_eval_model.OscarLM`, or a server's
    ``local-completions``); returns ``{task: {metric: value}}`` (numeric metrics only).

    Offline tasks load from :data:`TASKS_DIR` only; others need lm-eval's index and usually the hub: when their data
    cannot be fetched this raises a one-line :class:`EvalError` naming the offline tasks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    offline = set(OFFLINE_TASKS.values())
    md = dict(metadata)
    if limit:
        md["num_samples"] = int(limit)
    if all(t in offline for t in tasks):
        tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=md)
    else:
        check_lm_tasks(tasks)
        tm = TaskManager(include_path=str(TASKS_DIR), metadata=md)
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=tm, log_samples=False,
                                      bootstrap_iters=0)
    except OscarError:
        raise
    except Exception as e:  # noqa: BLE001  (datasets/hub raise many types when offline)
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise EvalError(
            f"lm-eval could not run {', '.join(tasks)} ({type(e).__name__}: {first}); without hub access use the "
            f"offline tasks: {PPL_TASK}, ruler, {', '.join(OFFLINE_TASKS)}"
        ) from None
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (res or {}).get("results", {}).items():
        vals = {}
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "stderr" not in k and k != "alias":
                vals[k.split(",")[0]] = float(v)
        out[task] = vals
    return out


def lm_eval_version() -> str:
    """The installed lm-eval version (``unknown`` when it cannot be read)."""
    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return "unknown"


def lm_rows(res: dict, base: dict, run_cfg: dict, seq_lengths, bits: Callable[[int], float | None]) -> list[EvalRow]:
    """:func:`run_lm_eval` results -> rows (RULER's metric names are its lengths; ``-1`` marks a length not run).
    ``base``: the row fields shared by the method's rows; ``run_cfg``: its run settings; ``bits(n)``: bits per
    element at ``n`` tokens."""
    rows = []
    for task, metrics in res.items():
        samples = metrics.pop("sample_len", None)
        for metric, value in metrics.items():
            if value == -1.0:
                continue  # RULER's placeholder for lengths that were not run
            n = int(metric) if metric.isdigit() else max(seq_lengths)
            rows.append(EvalRow(**base, task=task.removeprefix("oscar_ruler_"), metric=metric, value=value,
                                config=dict(run_cfg, seq_len=n, seq_lengths=list(seq_lengths), samples=samples),
                                bits_per_element=bits(n)))
    return rows
