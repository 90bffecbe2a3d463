"""Rich progress bars shared by the commands."""

from __future__ import annotations

import contextlib
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ._app import console


@contextlib.contextmanager
def token_progress(description: str):
    """A bar in tokens with a tokens/s readout; yields ``update(done, total)``."""
    start = time.monotonic()
    first: list[int | None] = [None]
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
        console=console, transient=False,
    ) as bar:
        task = bar.add_task(description, total=None, rate="")

        def update(done: int, total: int) -> None:
            if first[0] is None:
                first[0] = done
            elapsed = time.monotonic() - start
            rate = (done - first[0]) / elapsed if elapsed > 0 and done > first[0] else 0.0
            bar.update(task, completed=done, total=total, rate=f"{rate:,.0f} tok/s" if rate else "")

        yield update


@contextlib.contextmanager
def step_progress(description: str):
    """A bar in steps (layers, tasks); yields ``update(done, total)``."""
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@contextlib.contextmanager
def task_progress(description: str, quiet: bool = False):
    """A bar driven by a library :class:`oscar_cli.progress.Progress` (``start``/``describe``/``advance``); yields it.
    ``quiet`` hides the bar (``--json`` keeps stderr for errors only)."""
    from ..progress import Progress as Reporter

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=quiet) as bar:
        task = bar.add_task(description, total=None)

        class Bar(Reporter):
            def start(self, total: int) -> None:
                bar.update(task, total=total)

            def describe(self, text: str) -> None:
                bar.update(task, description=text)

            def advance(self) -> None:
                bar.advance(task)

        yield Bar()
