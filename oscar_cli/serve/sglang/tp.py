"""Tensor parallelism: each rank serves its own KV heads, so it holds only their rotations and clip ratios.

SGLang shards K/V projections by contiguous KV-head blocks: rank ``r`` of ``tp`` computes heads
``[r * Hkv / tp, (r + 1) * Hkv / tp)``. The artifact is sliced the same way: per-head tensors (``h = Hkv``) keep
that block, a shared rotation (``h = 1``) is kept as is on every rank. Pure torch on CPU tensors; the pool, its cell
size and the kernel arguments of a rank are then built from the sliced tensors and ``Hkv / tp`` heads.
"""

from __future__ import annotations

import torch

from .refusals import ServeRefusal, tp_refusal

PER_HEAD_KEYS = ("r_k", "r_v", "clip_k", "clip_v")
"""Artifact tensors with a head axis (axis 1): ``r_*`` ``[n, h, d, d]``, ``clip_*`` ``[n, h]``."""
OPTIONAL_PER_HEAD_KEYS = ("mult_k", "mult_v", "center_k")
"""Per-head tensors an artifact holds for some schemes only: the FP8 multipliers ``mult_*`` ``[n, Hkv]``, the key
centers ``center_k`` ``[n, Hkv, d]``."""


def rank_heads(kv_heads: int, tp_size: int, rank: int) -> range:
    """KV heads of ``rank``; refused (one line) when ``tp_size`` does not split ``kv_heads`` by head."""
    why = tp_refusal(kv_heads, tp_size)
    if why is not None:
        raise ServeRefusal(f"oscar: {why}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside tp size {tp_size}")
    per = kv_heads // tp_size
    return range(rank * per, (rank + 1) * per)


def slice_for_rank(tensors: dict[str, torch.Tensor], kv_heads: int, tp_size: int, rank: int) -> dict[str, torch.Tensor]:
    """The artifact tensors rank ``rank`` needs: ``PER_HEAD_KEYS`` sliced to its heads (kept when shared, ``h = 1``),
    everything else unchanged. ``tp_size = 1`` returns the tensors as they are."""
    heads = rank_heads(kv_heads, tp_size, rank)
    out = dict(tensors)
    for key in PER_HEAD_KEYS + tuple(k for k in OPTIONAL_PER_HEAD_KEYS if k in tensors):
        t = tensors[key]
        h = t.shape[1]
        if h == 1:
            continue
        if h != kv_heads:
            raise ValueError(f"artifact tensor {key} has {h} heads, the model {kv_heads} KV heads")
        out[key] = t[:, heads.start:heads.stop].contiguous()
    return out


def layer_stack(tensors: dict[str, torch.Tensor], layers: list[int], num_layers: int, start: int = 0
                ) -> dict[str, torch.Tensor]:
    """Per-head tensors (those of :data:`OPTIONAL_PER_HEAD_KEYS` where present) reordered to model layers
    ``start .. start + num_layers - 1`` (the pool's layer order); ``layers`` is the artifact's list of model layers
    (axis 0 of its tensors)."""
    index = [layers.index(i) for i in range(start, start + num_layers)]
    keys = PER_HEAD_KEYS + tuple(k for k in OPTIONAL_PER_HEAD_KEYS if k in tensors)
    return {k: tensors[k][index].contiguous() for k in keys}
