"""The OSCAR backend's core, in SGLang's terms but without SGLang: state of one rank, batch planning, layer runs.

* :class:`OscarKV`: what one rank holds for the whole server: the :class:`oscar_kernels.Int2KVPool` (INT2 slots for
  every token slot SGLang allocates, exact regions for every request slot plus the anchor entries), the
  :class:`~.anchors.AnchorTable`, and which requests' exact regions are current. Shared by the attention backend and
  the radix cache.
* :class:`OscarAttention`: per batch, :meth:`~OscarAttention.plan_decode` / :meth:`~OscarAttention.plan_extend`
  take SGLang's batch description (``req_to_token``, ``req_pool_indices``, ``seq_lens`` or prefix/extend lengths,
  ``out_cache_loc``, request ids) and fill a :class:`oscar_kernels.DecodePlan` / :class:`oscar_kernels.ExtendPlan`;
  per layer, :meth:`~OscarAttention.forward_decode` / :meth:`~OscarAttention.forward_extend` run them.

Extend, per layer, in this order: restore anchors into the regions of requests on their first extend; anchors inside
a chunk (every ``anchor_interval`` positions): rows of positions before the chunk from the region, rows inside it from
the chunk's k/v; ``ExtendPlan.run`` (INT2 codes, attention, the chunk's exact rows); the chunk-end anchor, copied
from the region, which now holds exactly its rows. Decode: ``DecodePlan.run``; planning runs eagerly before every
CUDA-graph replay, the run is what the graph holds.

Host work per batch uses host ints only (lengths from SGLang's ``*_cpu`` lists, request ids); device lookups
(anchor entries, request rows) stay on the device: no host synchronisation in planning or runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from oscar_kernels import DecodePlan, ExtendPlan, Int2KVPool
from oscar_kernels.scheme import DecodeOptions, QuantScheme

from .anchors import AnchorTable, anchor_positions, anchored_positions

REGION_MEMORY = 4
"""Requests remembered per request slot in :attr:`OscarKV.region_pos` (bounds it when no radix cache reports the
requests' ends, e.g. ``--disable-radix-cache``; a running request is re-remembered at every extend)."""


class OscarKV:
    """One rank's pool, anchors and region bookkeeping.

    Args:
        scheme: the artifact's quant scheme.
        num_layers, kv_heads, head_dim: this rank's layers and KV heads.
        num_slots: INT2 token slots (SGLang's pool rows: ``max_total_num_tokens + 1``, slot 0 pads).
        request_slots: exact regions for requests (rows of SGLang's ``req_to_token``).
        rot_k, rot_v: fp32 ``[L, h, d, d]``; clip_k, clip_v: fp32 ``[L, h]`` (this rank's heads).
        anchors: anchor entries; anchor_interval: positions between anchors inside one extend (0: chunk ends only).
        finish_anchors: take an anchor when a request finishes (only exact when no forward can still run for it
            after its finish is processed, i.e. without SGLang's overlap scheduling).
        mult_k, mult_v: FP8 scales only: fp32 ``[L, Hkv]`` per-head multipliers (this rank's heads).
        center_k: centered keys only: fp32 ``[L, Hkv, d]`` key centers (this rank's heads).
        start_layer: the model layer of the pool's first (an allocated scheme's widths are the model's layers').
    """

    def __init__(self, scheme: QuantScheme, num_layers: int, kv_heads: int, head_dim: int, num_slots: int,
                 request_slots: int, rot_k: torch.Tensor, rot_v: torch.Tensor, clip_k: torch.Tensor,
                 clip_v: torch.Tensor, anchors: int, anchor_interval: int, device: torch.device | str | None = None,
                 finish_anchors: bool = False, mult_k: torch.Tensor | None = None,
                 mult_v: torch.Tensor | None = None, start_layer: int = 0, center_k: torch.Tensor | None = None):
        widths = [(scheme.width(i, "k"), scheme.width(i, "v")) for i in range(start_layer, start_layer + num_layers)]
        self.pool = Int2KVPool(scheme, num_layers, kv_heads, head_dim, num_slots, request_slots + anchors,
                               rot_k, rot_v, clip_k, clip_v, device, mult_k=mult_k, mult_v=mult_v, widths=widths,
                               center_k=center_k)
        self.table = AnchorTable(num_slots, anchors, device)
        self.request_slots = request_slots
        self.anchor_interval = anchor_interval
        self.finish_anchors = finish_anchors
        self.region_pos: OrderedDict[str, int] = OrderedDict()
        """Request id -> the position its exact region reflects after its last extend (first extend: absent); the
        most recent ``REGION_MEMORY * request_slots`` requests (only running ones matter)."""

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    @property
    def device(self) -> torch.device:
        return self.pool.device

    def entry_request(self, entry: int | torch.Tensor) -> int | torch.Tensor:
        """The pseudo-request index of anchor ``entry`` in the pool's exact regions."""
        return self.request_slots + entry

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, layers: Sequence[int] | None = None) -> None:
        """Copy exact rows ``src`` -> ``dst`` (int64, disjoint) of K and V, in ``layers`` (default all)."""
        if not src.numel():
            return
        for i in range(self.num_layers) if layers is None else layers:
            c = self.pool.layer(i)
            for t in (c.k_bf16, c.v_bf16):
                t.index_copy_(0, dst, t.index_select(0, src))

    def remember(self, rid: str, position: int) -> None:
        """Request ``rid``'s exact region now reflects positions ``< position``."""
        self.region_pos[rid] = position
        self.region_pos.move_to_end(rid)
        while len(self.region_pos) > REGION_MEMORY * self.request_slots:
            self.region_pos.popitem(last=False)

    def finished(self, rid: str) -> None:
        """A request left (finished, aborted or retracted): its region is no longer current, its pin goes."""
        self.region_pos.pop(rid, None)
        self.table.unpin(rid)

    def snapshot(self, req_pool_idx: int, position: int, key_slot: torch.Tensor) -> int | None:
        """Anchor request ``req_pool_idx``'s region at ``position`` (it must hold exactly positions ``< position``),
        keyed by ``key_slot`` (int64 ``[1]``, the slot of position ``position - 1``). Returns the entry or None."""
        entry = self.table.allocate()
        if entry is None or position <= 0:
            return None
        pos = torch.tensor(anchored_positions(position, self.pool.sink, self.pool.recent), device=self.device)
        self.copy_rows(self.pool.exact_rows(req_pool_idx, pos), self.pool.exact_rows(self.entry_request(entry), pos))
        self.table.bind(torch.tensor([entry], device=self.device), key_slot)
        self.table.mark()
        return entry


class OscarAttention:
    """Batch planning and layer runs over one :class:`OscarKV` (see the module docstring).

    Args:
        kv: the rank's state.
        req_to_token: SGLang's int32 ``[R, max_ctx]`` slot table (``R <= kv.request_slots``).
        max_batch: sequences per batch (``R``: every request slot, CUDA-graph padding row included).
        max_tokens: new tokens per extend batch.
        q_heads: this rank's query heads.
        sm_scale: softmax scale of every layer (SGLang's ``RadixAttention.scaling``).
        options: how the decode kernel runs (``OscarSettings.decode``), passed to ``DecodePlan`` as is.
    """

    def __init__(self, kv: OscarKV, req_to_token: torch.Tensor, max_batch: int, max_tokens: int, q_heads: int,
                 sm_scale: float | None = None, options: DecodeOptions = DecodeOptions()):
        if req_to_token.shape[0] > kv.request_slots:
            raise ValueError(f"req_to_token has {req_to_token.shape[0]} rows, the pool {kv.request_slots} regions")
        self.kv = kv
        self.req_to_token = req_to_token
        self.max_seq_len = req_to_token.shape[1]
        self.decode = DecodePlan(kv.pool, max_batch, self.max_seq_len, q_heads=q_heads, sm_scale=sm_scale,
                                 options=options)
        self.extend = ExtendPlan(kv.pool, max_batch, max_tokens, self.max_seq_len, sm_scale=sm_scale)
        self._restore: tuple[torch.Tensor, torch.Tensor] | None = None
        self._capture: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._capture_end: tuple[torch.Tensor, torch.Tensor] | None = None
        self.restore_misses = torch.zeros((), dtype=torch.int64, device=kv.device)
        """Device counter of restores that found no anchor (0 by construction; checked by tests)."""

    def workspace_bytes(self) -> int:
        return self.decode.workspace_bytes() + self.extend.workspace_bytes()

    # -------------------------------------------------------------------------------------------------- decode
    def plan_decode(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """One decode step. ``req_pool_indices``/``seq_lens`` ``[B]`` (CUDA-graph padded rows: request 0, length 1);
        ``out_cache_loc`` ``[B]`` or shorter (a graph replay passes the live batch's slots: padded with slot 0)."""
        self.kv.table.clear_slots(out_cache_loc)
        self.kv.table.mark()
        self.decode.plan(self.req_to_token, req_pool_indices, seq_lens, out_cache_loc)  # pads the rest with slot 0

    def forward_decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """q ``[B, Hq, d]``, k/v ``[B, Hkv, d]`` (this rank's heads) -> ``[B, Hq, d]``."""
        return self.decode.run(layer, q, k, v, out=out)

    # -------------------------------------------------------------------------------------------------- extend
    def plan_extend(self, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                    out_cache_loc: torch.Tensor, prefix_cpu: Sequence[int], extend_cpu: Sequence[int],
                    rids: Sequence[str] | None) -> None:
        """One extend step: sequence ``b`` computes positions ``[prefix_cpu[b], prefix_cpu[b] + extend_cpu[b])`` of
        request ``rids[b]`` (``rids`` None: a graph-capture batch, no anchors restored or taken)."""
        kv = self.kv
        kv.table.clear_slots(out_cache_loc)
        self._restore = self._capture = self._capture_end = None
        if rids is not None:
            self._plan_anchors(req_pool_indices, out_cache_loc, list(prefix_cpu), list(extend_cpu), list(rids))
        kv.table.mark()
        ends = [c0 + n for c0, n in zip(prefix_cpu, extend_cpu, strict=True)]
        self.extend.plan(self.req_to_token, req_pool_indices, prefix_lens, extend_lens, out_cache_loc,
                         max_extend_len=max(extend_cpu, default=0), max_seq_len=max(ends, default=0),
                         int2_tokens=self.extend.int2_rows(ends))  # SGLang: every sequence starts at 0

    def _plan_anchors(self, rpi: torch.Tensor, loc: torch.Tensor, prefix: list[int], ext: list[int],
                      rids: list[str]) -> None:
        kv, pool, dev = self.kv, self.kv.pool, self.kv.device
        sink, recent = pool.sink, pool.recent
        # restores: requests on their first extend with a cached prefix
        r_b, r_p = [], []
        for b, (c0, rid) in enumerate(zip(prefix, rids, strict=True)):
            if c0 > 0 and kv.region_pos.get(rid) != c0:
                ps = anchored_positions(c0, sink, recent)
                r_b += [b] * len(ps)
                r_p += ps
        if r_b:
            b_idx = torch.tensor(r_b, device=dev)
            p = torch.tensor(r_p, device=dev)
            req = rpi.to(dev).long()[b_idx]
            c0 = torch.tensor(prefix, device=dev)[b_idx]
            entry = kv.table.entries_at(self.req_to_token[req, c0 - 1])
            self.restore_misses += (entry < 0).sum()
            dst = pool.exact_rows(req, p)
            src = torch.where(entry >= 0, pool.exact_rows(kv.entry_request(entry.clamp_min(0)), p), dst)
            self._restore = (src, dst)
        # captures: anchors this chunk takes. The chunk-end anchor is copied from the region after the run (which
        # then holds exactly its rows); one inside the chunk takes rows before the chunk from the region and its own
        # rows from the chunk's k/v, before the run overwrites the ring.
        o_b, o_p, o_e, n_p, n_e, n_t, e_b, e_p, e_e, k_e, k_t = [], [], [], [], [], [], [], [], [], [], []
        qo = 0
        for b, (c0, n, rid) in enumerate(zip(prefix, ext, rids, strict=True)):
            kv.table.unpin(rid)  # its restore (if any) is planned: ordered before any later write to the entry
            for a in anchor_positions(c0, c0 + n, kv.anchor_interval):
                e = kv.table.allocate()
                if e is None:
                    break
                k_e.append(e)
                k_t.append(qo + a - 1 - c0)
                for pos in anchored_positions(a, sink, recent):
                    if a == c0 + n:
                        e_b.append(b)
                        e_p.append(pos)
                        e_e.append(e)
                    elif pos < c0:
                        o_b.append(b)
                        o_p.append(pos)
                        o_e.append(e)
                    else:
                        n_p.append(pos)
                        n_e.append(e)
                        n_t.append(qo + pos - c0)
            kv.remember(rid, c0 + n)
            qo += n
        if k_e:
            req = rpi.to(dev).long()

            def rows(b_idx, e_idx, p):  # (request rows, entry rows) of positions p
                p = _ints(p, dev)
                return pool.exact_rows(req[_ints(b_idx, dev)], p), pool.exact_rows(kv.entry_request(_ints(e_idx, dev)), p)

            old_src, old_dst = rows(o_b, o_e, o_p)
            end_src, end_dst = rows(e_b, e_e, e_p)
            new_rows = pool.exact_rows(kv.entry_request(_ints(n_e, dev)), _ints(n_p, dev))
            self._capture = (old_src, old_dst, new_rows, _ints(n_t, dev))
            self._capture_end = (end_src, end_dst)
            kv.table.bind(_ints(k_e, dev), loc.to(dev).long()[_ints(k_t, dev)])

    def forward_extend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """q ``[N, Hq, d]``, k/v ``[N, Hkv, d]`` of the planned chunks -> ``[N, Hq, d]``."""
        kv = self.kv
        if self._restore is not None:
            kv.copy_rows(*self._restore, layers=(layer,))
        if self._capture is not None:
            old_src, old_dst, new_rows, new_tok = self._capture
            kv.copy_rows(old_src, old_dst, layers=(layer,))
            if new_rows.numel():
                kv.pool.write_exact(layer, new_rows, k[new_tok], v[new_tok])
        out = self.extend.run(layer, q, k, v, out=out)
        if self._capture_end is not None:
            kv.copy_rows(*self._capture_end, layers=(layer,))
        return out


def _ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
