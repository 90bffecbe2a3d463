"""The ``oscar_ppl`` text: token ids, cut into consecutive non-overlapping segments of ``seq_len`` tokens."""

from __future__ import annotations

import torch

from ..config import DEFAULT_PPL_SEGMENTS, PPL_TASK, EvalConfig, expand_tasks
from ..data import heldout_text, read_text_file
from . import EvalError


def token_ids(tokenizer, text: str) -> torch.Tensor:
    """Tokenize a text without special tokens: int64 ``[N]``."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def segments_of(ids: torch.Tensor, seq_len: int, limit: int | None) -> torch.Tensor:
    """Consecutive non-overlapping segments ``[S, seq_len]`` of ``ids [N]`` (at most ``limit``)."""
    n = ids.numel() // seq_len
    if n == 0:
        raise EvalError(f"the text has {ids.numel()} tokens, fewer than one segment of {seq_len}; "
                        "pass a longer --data file or a smaller --seq-lengths")
    if limit:
        n = min(n, limit)
    return ids[: n * seq_len].view(n, seq_len)


def ppl_text(cfg: EvalConfig, tokenizer) -> torch.Tensor | None:
    """Token ids of the ``oscar_ppl`` text (``--data`` or the built-in held-out half), or None without that task."""
    if PPL_TASK not in expand_tasks(cfg.tasks):
        return None
    return token_ids(tokenizer, read_text_file(cfg.data) if cfg.data is not None else heldout_text())


def segments_per_length(cfg: EvalConfig) -> int:
    """Segments ``oscar_ppl`` evaluates per sequence length: ``--limit``, else :data:`DEFAULT_PPL_SEGMENTS`."""
    return cfg.limit or DEFAULT_PPL_SEGMENTS


def ppl_steps(cfg: EvalConfig, text_ids: torch.Tensor | None) -> int:
    """Segments one method evaluates over all lengths (progress units)."""
    if text_ids is None:
        return 0
    return sum(min(segments_per_length(cfg), text_ids.numel() // n) for n in cfg.seq_lengths)
