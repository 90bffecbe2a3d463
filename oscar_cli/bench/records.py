"""The records of a run: one JSON object per measurement, appended (and fsynced) to ``OUT/results.jsonl`` as each one
ends, so a killed run keeps what it measured."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .spec import BenchError


# ---------------------------------------------------------------------------------------------------- records
def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Recorder:
    """``OUT/results.jsonl``: one JSON record per line, appended and fsynced as each measurement ends, so a killed
    run keeps everything it finished. Every record carries ``measure``, ``config``, ``time``, ``device``,
    ``commit`` and ``command``."""

    def __init__(self, path: Path, device: str, commit: str, command: str):
        self.path = Path(path)
        self.meta = {"device": device, "commit": commit, "command": command}
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, measure: str, config: str, **values: Any) -> dict:
        rec = {"measure": measure, "config": config, "time": utc_now(), **self.meta, **values}
        line = json.dumps(rec, sort_keys=True, default=str)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        return rec


def load_records(path: Path) -> list[dict]:
    """Records of a results file: JSON lines (a truncated last line is dropped), a JSON list, or ``{"records":
    [...]}``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise BenchError(f"cannot read {path} ({e.strerror}); pass the results.jsonl an oscar bench run wrote") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        return _records_of(json.loads(text), path)
    if stripped.startswith("{") and "\n" not in stripped.strip():
        obj = json.loads(stripped)
        return _records_of(obj.get("records", [obj]), path)
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the line a killed run was writing
                continue
            raise BenchError(f"{path}:{i + 1} is not a JSON record; it was not written by oscar bench") from None
    return _records_of(out, path)


def _records_of(items: Any, path: Path) -> list[dict]:
    if not isinstance(items, list) or not all(isinstance(r, dict) and "measure" in r and "config" in r for r in items):
        raise BenchError(f"{path} holds no oscar bench records (each needs 'measure' and 'config')")
    return items
