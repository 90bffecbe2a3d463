"""From the plugin's settings, the artifact and the served model to what one TP rank builds.

:func:`load_checked_artifact` loads the artifact (content hash verified) and runs the model refusals;
:func:`rank_setup` slices it for a rank (:mod:`.tp`), orders it by the rank's layers and computes the memory budget
(:mod:`.sizing`). Both run in the launcher (checks only) and in every scheduler process (the pool is built from the
result). No SGLang imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from oscar_kernels.scheme import QuantScheme

from ...artifact import Artifact, load_artifact
from .refusals import ModelFacts, decode_refusal, model_refusals, refuse
from .settings import OscarSettings
from .sizing import Budget, budget
from .tp import layer_stack, rank_heads, slice_for_rank


def load_checked_artifact(settings: OscarSettings, facts: ModelFacts, tp_size: int = 1,
                          load_format: str | None = None) -> tuple[Artifact, list[str]]:
    """The artifact of ``settings`` and the notes of its checks; refused (:class:`~.refusals.ServeRefusal`, one line)
    when it does not fit the model or the TP size."""
    artifact = load_artifact(settings.artifact)
    problems, notes = model_refusals(artifact.manifest, facts, tp_size, load_format)
    if (why := decode_refusal(artifact.manifest.scheme, settings.decode)) is not None:
        problems.append(why)
    refuse(problems)
    return artifact, notes


@dataclass(frozen=True)
class RankSetup:
    """What one rank builds its pool and backend from. Tensors: this rank's layers and heads, fp32 on the CPU."""

    settings: OscarSettings
    scheme: QuantScheme
    tp_rank: int
    start_layer: int
    num_layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    rot_k: torch.Tensor
    rot_v: torch.Tensor
    clip_k: torch.Tensor
    clip_v: torch.Tensor
    request_slots: int
    budget: Budget
    notes: tuple[str, ...] = ()
    mult_k: torch.Tensor | None = None
    """FP8 scales: the per-head multipliers ``[L, Hkv]`` (None with fp16 scales)."""
    mult_v: torch.Tensor | None = None
    center_k: torch.Tensor | None = None
    """Centered keys: the key centers ``[L, Hkv, d]`` (model basis; None when the scheme does not center)."""


def rank_setup(settings: OscarSettings, artifact: Artifact, facts: ModelFacts, *, tp_size: int, tp_rank: int,
               request_slots: int, max_tokens: int, max_seq_len: int, start_layer: int = 0,
               num_layers: int | None = None, notes: tuple[str, ...] = ()) -> RankSetup:
    """Rank ``tp_rank``'s share of the artifact and its budget (``request_slots``: SGLang's request table rows,
    ``max_tokens``: new tokens per extend batch, ``max_seq_len``: context length)."""
    num_layers = facts.num_layers - start_layer if num_layers is None else num_layers
    heads = rank_heads(facts.kv_heads, tp_size, tp_rank)
    q_heads = facts.num_heads // tp_size
    t = layer_stack(slice_for_rank(artifact.tensors, facts.kv_heads, tp_size, tp_rank), list(artifact.layers),
                    num_layers, start_layer)
    scheme = artifact.scheme.resolved(facts.head_dim)  # the artifact's: no second source of it
    b = budget(scheme, num_layers, len(heads), facts.head_dim, q_heads, request_slots, settings.anchors,
               max_tokens, max_seq_len, start_layer)
    return RankSetup(settings=settings, scheme=scheme, tp_rank=tp_rank, start_layer=start_layer,
                     num_layers=num_layers, kv_heads=len(heads), q_heads=q_heads, head_dim=facts.head_dim,
                     rot_k=t["r_k"], rot_v=t["r_v"], clip_k=t["clip_k"], clip_v=t["clip_v"],
                     request_slots=request_slots, budget=b, notes=tuple(notes), mult_k=t.get("mult_k"),
                     mult_v=t.get("mult_v"), center_k=t.get("center_k") if scheme.center_keys else None)
