"""The kernel backend of :class:`oscar_cli.cache.OscarCache`: the transformers cache on :class:`oscar_kernels.Int2KVPool`.

Every row of the batch is one request of the pool: its position ``p`` lives at slot ``b * capacity + p`` (a
``req_to_token`` table like an engine's), its sinks and last ``recent`` rows in its exact region. Per forward pass:

* ``update`` hands the new K/V (``[B, Hkv, m, d]``, un-rotated) to the layer, which keeps them until ``attend``;
* the first kernel layer to attend plans the step once for all layers (:class:`~oscar_kernels.DecodePlan` for one new
  token, :class:`~oscar_kernels.ExtendPlan` for a prefill or a chunk): index lists filled on the device from host
  integers only, no ``.tolist()``, no per-step copy of the cache, no re-rotation of exact rows;
* each layer's ``attend`` runs ``plan.run``: the new tokens' INT2 codes and exact rows are written (one launch for K
  and V, per-KV-head clip ratios as a device tensor) and the attention reads the pool directly.

The attention is Design P (see :mod:`oscar_kernels.extend`): the same position-wise sink/recent rows as the
reference path and as ``oscar eval``'s teacher-forced attention, so both backends give the same outputs up to the
kernels' bf16 rounding of exact rows. One :class:`~oscar_kernels.scheme.DecodeOptions` value (the layers'
``LayerQuant.decode``) goes to the decode plan. The first real token of each row (left padding) is read from the
attention mask once, at the first call; later steps assume the mask only grows by real tokens (what ``generate``
passes).

The pool grows by doubling its per-row capacity (slots are copied once per doubling, amortised O(1) per token).
"""

from __future__ import annotations

import torch

from .config import QuantScheme
from .kvquant import LayerQuant
from .models import attention_shape

MIN_CAPACITY = 256
"""Smallest per-row slot capacity allocated (then doubled as the sequence grows)."""


def kernel_ready(lq: LayerQuant | None, scheme: QuantScheme, head_dim: int, device_type: str | None = None) -> str | None:
    """Why a layer's quantizer cannot run in the kernels (on ``device_type``), or None when it can (None layers stay
    exact anyway)."""
    if lq is None:
        return None
    if lq.key_axis != "token":
        return "per-channel (KIVI) keys"
    if lq.bits_k not in (2, 4) or lq.bits_v not in (2, 4):
        return f"{lq.bits_k}-bit keys and {lq.bits_v}-bit values (the kernels store 2- and 4-bit codes)"
    if lq.meta == "fp8" and (lq.mult_k is None or lq.mult_v is None):
        return "FP8 scales without fitted multipliers (the kernels need the artifact's mult_k/mult_v)"
    if lq.decode.int8_scores:
        return "int8 scores (the kernels' prefill path has no int8 variant; the reference attention emulates it)"
    if lq.decode.int8_values:
        return "int8 values (the kernels' prefill path has no int8 variant; the reference attention emulates it)"
    return scheme.kernel_support(head_dim, device_type)


def kernels_launchable(device) -> bool:
    """Whether the kernel backend can run on ``device`` (CUDA, or anything under ``TRITON_INTERPRET=1``)."""
    from oscar_kernels.layout import launchable

    return launchable(device)


def _stack_rot(quants: list[LayerQuant], which: str, d: int) -> torch.Tensor:
    rots = []
    for lq in quants:
        r = lq.r_k if which == "k" else lq.r_v
        rots.append(torch.eye(d)[None] if r is None else r.float().cpu())
    h = max(r.shape[0] for r in rots)
    return torch.stack([r.expand(h, d, d) for r in rots])


def _stack_mult(quants: list[LayerQuant], which: str, kv_heads: int) -> torch.Tensor | None:
    """The layers' FP8 multipliers ``[L, Hkv]`` (None with fp16 scales)."""
    if quants[0].meta != "fp8":
        return None
    return torch.stack([(lq.mult_k if which == "k" else lq.mult_v).float().cpu().expand(kv_heads) for lq in quants])


def _stack_center(quants: list[LayerQuant], scheme: QuantScheme) -> torch.Tensor | None:
    """The layers' key centers ``[L, Hkv, d]`` (None when the scheme does not center keys)."""
    if not scheme.center_keys:
        return None
    return torch.stack([lq.center_k.float().cpu() for lq in quants])


def _stack_clip(quants: list[LayerQuant], which: str) -> torch.Tensor:
    clips = [(lq.clip_k if which == "k" else lq.clip_v).float().cpu() for lq in quants]
    h = max(c.numel() for c in clips)
    return torch.stack([c.expand(h) for c in clips])


class KernelState:
    """What the kernel layers of one cache share: the pool, the slot table, the first real positions and the plan
    of the current forward pass. ``layer_of``: model layer -> pool layer (quantized layers only)."""

    def __init__(self, quants: dict[int, LayerQuant], scheme: QuantScheme, config):
        self.layer_of = {i: j for j, i in enumerate(sorted(quants))}
        self.quants = [quants[i] for i in sorted(quants)]
        options = {lq.decode for lq in self.quants}
        if len(options) != 1:
            raise ValueError(f"one decode plan reads every layer: the layers' decode options must agree, got {options}")
        self.options = options.pop()
        self.scheme = scheme
        shape = attention_shape(config)
        self.kv_heads, self.q_heads, self.head_dim = shape.n_kv_heads, shape.n_heads, shape.head_dim
        self.pool = None
        self.capacity = 0
        self.batch = 0
        self.start: torch.Tensor | None = None
        self.req_to_token: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.planned: tuple[int, int] | None = None  # (cached before the step, new tokens)
        self.decode_plan = self.extend_plan = None
        self.scaling: float | None = None

    def reset(self) -> None:
        """Forget the sequence (the pool stays allocated; positions are written again from 0)."""
        self.start = None
        self.planned = None

    # ---------------------------------------------------------------------------------------------------- storage
    def _allocate(self, batch: int, capacity: int, device) -> None:
        from oscar_kernels import Int2KVPool

        old, old_cap = self.pool, self.capacity
        pool = Int2KVPool(self.scheme, len(self.quants), self.kv_heads, self.head_dim, batch * capacity, batch,
                          _stack_rot(self.quants, "k", self.head_dim), _stack_rot(self.quants, "v", self.head_dim),
                          _stack_clip(self.quants, "k"), _stack_clip(self.quants, "v"), device=device,
                          mult_k=_stack_mult(self.quants, "k", self.kv_heads),
                          mult_v=_stack_mult(self.quants, "v", self.kv_heads),
                          widths=[(lq.bits_k, lq.bits_v) for lq in self.quants],
                          center_k=_stack_center(self.quants, self.scheme))
        if old is not None:  # same rows and positions in the larger table; exact regions are per row: unchanged
            for j in range(len(self.quants)):
                a, b = old.layer(j), pool.layer(j)
                for src, dst in ((a.k, b.k), (a.v, b.v)):
                    for name in ("codes", "scale", "zero") + (("codes_hi",) if src.codes_hi is not None else ()):
                        s, t = getattr(src, name), getattr(dst, name)
                        t.view(batch, capacity, *t.shape[1:])[:, :old_cap].copy_(s.view(batch, old_cap, *s.shape[1:]))
                b.k_bf16.copy_(a.k_bf16)
                b.v_bf16.copy_(a.v_bf16)
        self.pool, self.capacity, self.batch = pool, capacity, batch
        self.req_to_token = torch.arange(batch * capacity, dtype=torch.int32, device=device).view(batch, capacity)
        self.rows = torch.arange(batch, dtype=torch.int32, device=device)  # request of each batch row: itself
        self.decode_plan = self.extend_plan = None

    def _ensure(self, batch: int, n: int, device) -> None:
        if self.pool is None or n > self.capacity:
            cap = max(MIN_CAPACITY, self.capacity)
            while cap < n:
                cap *= 2
            self._allocate(batch, cap, device)

    # ---------------------------------------------------------------------------------------------------- steps
    def plan(self, n0: int, m: int, device) -> None:
        """Plan the forward pass that adds ``m`` tokens after ``n0`` cached ones (once for all layers)."""
        from oscar_kernels import DecodePlan, ExtendPlan

        b = self.batch
        self._ensure(b, n0 + m, device)
        if m == 1:
            if self.decode_plan is None:
                self.decode_plan = DecodePlan(self.pool, b, self.capacity, q_heads=self.q_heads,
                                              sm_scale=self.scaling, options=self.options)
            seq = torch.full((b,), n0 + 1, dtype=torch.int32, device=device)
            loc = self.req_to_token[:, n0]
            self.decode_plan.plan(self.req_to_token, self.rows, seq, loc, start=self.start, max_seq_len=n0 + 1)
        else:
            if self.extend_plan is None or self.extend_plan.max_tokens < b * m:
                self.extend_plan = ExtendPlan(self.pool, b, max(b * m, b * MIN_CAPACITY), self.capacity,
                                              sm_scale=self.scaling)
            prefix = torch.full((b,), n0, dtype=torch.int32, device=device)
            ext = torch.full((b,), m, dtype=torch.int32, device=device)
            loc = self.req_to_token[:, n0:n0 + m].reshape(-1)
            self.extend_plan.plan(self.req_to_token, self.rows, prefix, ext, loc, start=self.start, max_extend_len=m,
                                  max_seq_len=n0 + m)
        self.planned = (n0, m)

    def attend(self, layer: int, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """query ``[B, Hq, m, d]``, k/v ``[B, Hkv, m, d]`` (un-rotated, the step's new tokens) -> ``[B, m, Hq, d]``."""
        b, hq, m, d = query.shape
        j = self.layer_of[layer]
        if m == 1:
            out = self.decode_plan.run(j, query[:, :, 0], k[:, :, 0], v[:, :, 0])
            return out.view(b, 1, hq, d).to(query.dtype)
        rows = lambda t: t.transpose(1, 2).reshape(b * m, t.shape[1], d)  # noqa: E731  (sequence-major rows)
        out = self.extend_plan.run(j, rows(query), rows(k), rows(v))
        return out.view(b, m, hq, d).to(query.dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self.pool is None else self.pool.nbytes


class KernelLayer:
    """The per-layer half of the kernel backend (the policy lives in :class:`oscar_cli.cache.OscarLayer`)."""

    def __init__(self, index: int, state: KernelState):
        self.index, self.state = index, state
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def stash(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pending = (k, v)

    def attend(self, query: torch.Tensor, first_real, n: int, scaling: float) -> torch.Tensor:
        st = self.state
        m = query.shape[2]
        if st.start is None:  # the first call: rows, their first real tokens, the softmax scale
            st.batch, st.scaling = query.shape[0], scaling
            st.start = first_real().to(torch.int32)
        if st.planned != (n - m, m):
            st.plan(n - m, m, query.device)
        k, v = self.pending
        self.pending = None
        return st.attend(self.index, query, k, v)
