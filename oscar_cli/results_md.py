"""Benchmark sections of ``benchmarks/RESULTS.md``: one format for every script (a title with what, date, device and
commit; the command; what was measured; the table)."""

from __future__ import annotations

import datetime
import sys
from collections.abc import Iterable
from pathlib import Path


def markdown_table(headers: Iterable[str], rows: Iterable[Iterable[object]]) -> str:
    headers = list(headers)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section(title: str, device: str, commit: str, description: str, table: str,
            command: list[str] | None = None, extra: str = "") -> str:
    """``## TITLE: DATE, measured on DEVICE, commit COMMIT``, the command (default: this process's), the description,
    the table and ``extra`` (more tables or notes)."""
    cmd = " ".join(["python", *(sys.argv if command is None else command)])
    text = (f"\n## {title}: {datetime.date.today()}, measured on {device}, commit {commit}\n\n"
            f"Command: `{cmd}`. {description}\n\n{table}\n")
    return text + (f"\n{extra.rstrip()}\n" if extra else "")


def append_section(path: str | Path, *args, **kwargs) -> str:
    """:func:`section`, appended to ``path``; returns the text."""
    text = section(*args, **kwargs)
    with open(path, "a") as f:
        f.write(text)
    return text
