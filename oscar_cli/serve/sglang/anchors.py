"""Anchors: where a cached prefix may be reused exactly, and the snapshots that make it exact.

Under the project's attention semantics a query at position ``t >= a`` reads the prefix ``[0, a)`` through INT2
codes (shared by the radix cache, written once per slot) except for its sinks and the last ``recent`` positions,
which it reads exactly; those exact rows live only in the exact region of the request that computed them. An
*anchor* at position ``a`` is a snapshot of them: the sinks ``[0, min(sink, a))`` and the ring
``[max(sink, a - recent), a)``, stored as one more exact region of the pool (entry ``e`` is pseudo-request
``request_slots + e``, same row map), so a new request restores it with one row copy per layer.

This module keeps the bookkeeping; the row copies are planned in :mod:`.core`.

* ``anchor_of_slot`` int32 ``[num_slots]`` (device): the entry anchored at the position after the token in that
  slot, -1 for none. Keyed by the slot of position ``a - 1``: a radix-tree slot has one token path to the root, so
  the key names the prefix exactly. Every pool write clears the entries of the slots it writes
  (:meth:`AnchorTable.clear_slots`), so a freed and reused slot can never serve a stale anchor.
* ``slot_of_anchor`` int64 ``[capacity]`` (device): the reverse map, to unbind an entry's old key on reuse.
* Entries are chosen on the host, first in first out, skipping pinned ones; a match pins the anchor it stopped at
  until the request's first extend has restored it (:meth:`AnchorTable.pin`). Pins end at deterministic points only
  (the request's first extend, its end, or :data:`PIN_STEPS` planned batches without a new match), never on garbage
  collection: every TP rank must make the same choices.
* :meth:`AnchorTable.deepest`: the deepest anchored position of a matched slot list (one small host read), which
  the radix cache caps the match to. It first waits for the event recorded after the last batch's table updates
  (:meth:`AnchorTable.mark`): under SGLang's overlap scheduling that batch may still be on the GPU, and every rank
  must read the same table (the wait is for the batch's planning kernels, which run right after the previous
  batch, already complete when the scheduler matches).

Plain torch: no SGLang.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable

import torch

PIN_STEPS = 256
"""Planned batches after which a pin that was not renewed ends (a request matched but never scheduled: aborted while
waiting). SGLang's binding match runs in the same scheduling round as the request's first extend."""


def anchor_positions(c0: int, c1: int, interval: int) -> list[int]:
    """Anchor positions taken by an extend of positions ``[c0, c1)``: every multiple of ``interval`` inside
    ``(c0, c1)`` and the chunk end ``c1`` (``interval = 0``: the chunk end only)."""
    if c1 <= c0:
        return []
    inner = [] if interval <= 0 else list(range((c0 // interval + 1) * interval, c1, interval))
    return [*inner, c1]


def anchored_positions(a: int, sink: int, recent: int) -> list[int]:
    """Positions whose exact rows an anchor at ``a`` holds: the sinks ``[0, min(sink, a))`` and the ring
    ``[max(sink, a - recent), a)``."""
    return [*range(min(sink, a)), *range(max(sink, a - recent), a)]


class AnchorTable:
    """Host FIFO of anchor entries with pins, and the device maps between entries and their key slots."""

    def __init__(self, num_slots: int, capacity: int, device: torch.device | str | None = None):
        self.capacity = capacity
        self.anchor_of_slot = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
        self.slot_of_anchor = torch.full((max(capacity, 1),), -1, dtype=torch.int64, device=device)
        self._order: deque[int] = deque(range(capacity))
        self._pin_of: dict[Hashable, tuple[int, int]] = {}
        self._pins: Counter[int] = Counter()
        self.step = 0
        """Batches planned so far (the same on every TP rank)."""
        self._event = None

    # ----------------------------------------------------------------------------------------------- entries (host)
    def allocate(self) -> int | None:
        """The least recently allocated entry that is not pinned (moved to the back), or None when all are pinned."""
        for _ in range(len(self._order)):
            e = self._order.popleft()
            self._order.append(e)
            if not self._pins[e]:
                return e
        return None

    def pin(self, key: Hashable, entry: int | None) -> None:
        """``key`` (a request) holds ``entry`` until :meth:`unpin` (or :data:`PIN_STEPS` batches); a new pin of the
        same key replaces the old one."""
        self.unpin(key)
        if entry is not None and entry >= 0:
            self._pin_of[key] = (entry, self.step)
            self._pins[entry] += 1

    def unpin(self, key: Hashable) -> None:
        got = self._pin_of.pop(key, None)
        if got is not None:
            e = got[0]
            self._pins[e] -= 1
            if not self._pins[e]:
                del self._pins[e]

    def mark(self) -> None:
        """A batch's table updates are enqueued: count the step, expire stale pins, record the event matches wait
        for (CUDA only)."""
        self.step += 1
        for key in [k for k, (_, s) in self._pin_of.items() if self.step - s > PIN_STEPS]:
            self.unpin(key)
        if self.anchor_of_slot.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def pinned(self, entry: int) -> bool:
        return bool(self._pins[entry])

    # ----------------------------------------------------------------------------------------------- keys (device)
    def clear_slots(self, slots: torch.Tensor) -> None:
        """Slots about to be written (``out_cache_loc``): they stop keying any anchor. No host sync."""
        if slots.numel():
            self.anchor_of_slot.index_fill_(0, slots.long(), -1)

    def bind(self, entries: torch.Tensor, slots: torch.Tensor) -> None:
        """Key ``entries`` (int64 ``[M]``) by ``slots`` (int64 ``[M]``, device), unbinding the keys those entries
        had. Slot 0 (SGLang's padding slot, never in the radix tree) is never a key. No host sync."""
        if not entries.numel():
            return
        dev = self.anchor_of_slot.device
        entries, slots = entries.to(dev).long(), slots.to(dev).long()
        old = self.slot_of_anchor[entries]
        idx = old.clamp_min(0)
        cur = self.anchor_of_slot[idx]
        self.anchor_of_slot.scatter_(0, idx, torch.where((old > 0) & (cur == entries), -1, cur).to(torch.int32))
        keep = self.anchor_of_slot[slots]
        self.anchor_of_slot.scatter_(0, slots, torch.where(slots > 0, entries, keep).to(torch.int32))
        self.slot_of_anchor.scatter_(0, entries, torch.where(slots > 0, slots, -1))

    def entries_at(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 entry keyed by each slot (-1 for none), on the device."""
        return self.anchor_of_slot[slots.long()].long()

    def deepest(self, slots: torch.Tensor) -> tuple[int, int]:
        """``(a, entry)``: the deepest ``a <= len(slots)`` whose position ``a - 1`` (slot ``slots[a - 1]``) keys an
        anchor, and that anchor's entry; ``(0, -1)`` for none. One host read of two ints."""
        m = slots.numel()
        if m == 0:
            return 0, -1
        if self._event is not None:
            self._event.synchronize()
        e = self.entries_at(slots)
        pos = torch.arange(1, m + 1, device=e.device)
        a = torch.where(e >= 0, pos, 0).max()
        entry = torch.where(a > 0, e[(a - 1).clamp_min(0)], -1)
        a_host, entry_host = torch.stack([a, entry]).tolist()
        return int(a_host), int(entry_host)
