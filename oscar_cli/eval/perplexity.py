"""The ``oscar_ppl`` task: token perplexity of text segments through a model in one KV method's state.

Teacher-forced by default: one forward pass per segment through the decode-equivalent attention, where every
position sees what a decoder holding that KV cache would see. ``hf-*`` peers have no teacher-forced equivalent and
are decoded token by token through their cache (slow: ~20 tokens/s on 2 CPU cores), as is every method with
``decode=True``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..cache import cache_kwarg, make_cache
from ..prepare import Prepared


@torch.no_grad()
def _nll_decoding(model, segment: torch.Tensor, prep: Prepared) -> tuple[float, int]:
    """Sum of NLL of tokens 1..L-1 of ``segment [L]``, decoding one token at a time through the method's cache."""
    dev = next(model.parameters()).device
    cache = make_cache(model, prep.method, prep.quants, prep.scheme)
    kw = cache_kwarg(model)
    total = 0.0
    x = segment.to(dev)
    for t in range(x.numel() - 1):
        logits = model(x[t : t + 1][None], **{kw: cache}, use_cache=True).logits[0, -1].float()
        total += (torch.logsumexp(logits, -1) - logits[x[t + 1]]).item()
    return total, x.numel() - 1


@torch.no_grad()
def perplexity(model, segments: torch.Tensor, prep: Prepared, advance: Callable[[], None] | None = None,
               decode: bool = False) -> float:
    """Token perplexity of ``segments [S, L]`` (int64 token ids; each predicts its tokens 1..L-1 from its own
    prefix).

    Teacher-forced through the decode-equivalent attention by default; ``decode=True`` feeds the tokens one at a time
    through the method's cache instead (on CUDA, INT2 decode steps then run the fused kernels). ``advance`` is called
    once per segment."""
    dev = next(model.parameters()).device
    nll, count = 0.0, 0
    for seg in segments:
        if prep.method.cache_only or decode:
            s, c = _nll_decoding(model, seg, prep)
        else:
            x = seg.to(dev)[None]
            logits = model(x, use_cache=False).logits[0, :-1].float()
            s = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            c = x.shape[1] - 1
        nll, count = nll + s, count + c
        if advance is not None:
            advance()
    return math.exp(nll / count)
