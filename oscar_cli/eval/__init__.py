"""Accuracy evaluation, the library behind ``oscar eval``: an :class:`~oscar_cli.config.EvalConfig` in, typed rows out.

Modules, one concern each:

* :mod:`.run` — :func:`~.run.run_eval`, the entry point: resolves artifacts, decides every method's scheme, runs the
  method loop and stores the rows;
* :mod:`.segments` — the ``oscar_ppl`` text cut into consecutive segments of ``seq_len`` tokens;
* :mod:`.perplexity` — token perplexity of those segments through a prepared model (:mod:`oscar_cli.prepare`);
* :mod:`.lm_eval_model` — the lm-eval model ``oscar`` (:class:`OscarLM`, an ``HFLM``);
* :mod:`.lm_eval_tasks` — lm-eval tasks: the offline ones shipped in :mod:`oscar_cli.tasks` and lm-eval's index;
* :mod:`.report` — rows, recipe thresholds and the result;
* :mod:`.remote` — the same tasks through a running server (``oscar eval --server``).

Importing this package is cheap: lm-eval and the model code load inside the functions that need them.
"""

from ..errors import OscarError


class EvalError(OscarError):
    """An evaluation that cannot run as asked."""
