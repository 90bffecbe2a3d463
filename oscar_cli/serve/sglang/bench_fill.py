"""Benchmark-only SGLang plugin ``oscar_bench_fill``: extend forwards that skip the model (``oscar bench --fill null``).

A decode step's speed depends on how many cached positions each request attends over and where they lie, not on
their values. ``--fill null`` gives every request of a throughput batch its own pages at the full context without
paying B x L tokens of real prefill: while the flag file named by ``OSCAR_BENCH_NULL_FILL`` exists, every extend
forward of the server returns zero next-token logits at once, without running the model, so the new tokens' cache
slots are allocated (distinct per request, as SGLang's allocator hands them out) but hold whatever the pool held.
The bench removes the flag once every request has its first token; the decode steps it then times are real forwards
over ``batch x context`` distinct positions, for every attention backend alike (this plugin loads next to ``oscar``
or alone, for the baselines). Nothing is registered unless ``OSCAR_BENCH_NULL_FILL`` is set.

Entry point ``[sglang.srt.plugins] oscar_bench_fill``; the hook target is :data:`targets.HOOK_FORWARD`, checked
against the running SGLang when registering (a mismatch is logged and nothing is hooked).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import targets as T

FLAG_ENV = "OSCAR_BENCH_NULL_FILL"
"""Environment variable naming the flag file; the hook is registered only where it is set."""
PLUGIN = "oscar_bench_fill"
"""The entry point's name (what ``SGLANG_PLUGINS`` lists)."""

log = logging.getLogger(__name__)


def null_fill_active(forward_batch: Any, flag: str | None = None) -> bool:
    """Whether this forward is an extend to skip: the flag file exists and the batch extends."""
    flag = os.environ.get(FLAG_ENV) if flag is None else flag
    return bool(flag) and forward_batch.forward_mode.is_extend() and os.path.exists(flag)


def null_output(runner: Any, forward_batch: Any, output_types: tuple[type, type] | None = None) -> Any:
    """What ``ModelRunner.forward`` returns for a skipped extend: zero next-token logits ``[batch, vocab]`` (fp32, on
    the batch's device; greedy sampling takes token 0), no hidden states, no graph."""
    import torch

    if output_types is None:
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.model_executor.model_runner import ModelRunnerOutput
    else:
        LogitsProcessorOutput, ModelRunnerOutput = output_types  # noqa: N806
    logits = torch.zeros(forward_batch.batch_size, runner.model_config.vocab_size, dtype=torch.float32,
                         device=forward_batch.seq_lens.device)
    return ModelRunnerOutput(logits_output=LogitsProcessorOutput(next_token_logits=logits), can_run_graph=False)


def around_forward(original, runner, forward_batch, *args, **kwargs):
    """AROUND ``ModelRunner.forward``: a skipped extend while the flag file exists, the real forward otherwise."""
    if null_fill_active(forward_batch):
        return null_output(runner, forward_batch)
    return original(runner, forward_batch, *args, **kwargs)


def register() -> None:
    """Entry point ``[sglang.srt.plugins] oscar_bench_fill``: hook ``ModelRunner.forward`` where ``OSCAR_BENCH_NULL_FILL``
    is set and the target matches the running SGLang."""
    if not os.environ.get(FLAG_ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    problems = T.check_live([T.HOOK_FORWARD])
    if problems:
        for p in problems:
            log.error("oscar_bench_fill: SGLang target changed, the null fill is off: %s", p)
        return
    HookRegistry.register(T.HOOK_FORWARD.path, around_forward, HookType.AROUND)
    log.info("oscar_bench_fill: extend forwards skip the model while %s exists", os.environ[FLAG_ENV])
