"""What a long library call reports while it runs (``run_eval``, ``oscar_cli.bench.run``): the CLI draws it as a Rich
bar (:func:`oscar_cli.cli._progress.task_progress`); the default reports nothing."""

from __future__ import annotations


class Progress:
    """``start(total)`` once, then ``describe(text)`` for the current step and ``advance()`` after each unit."""

    def start(self, total: int) -> None: ...

    def describe(self, text: str) -> None: ...

    def advance(self) -> None: ...
