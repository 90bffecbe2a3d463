"""Streaming calibration statistics: float64 second moments per (layer, KV head, kind). Pure torch; no model, no I/O.

Kinds (see :mod:`oscar_cli.collect` for how they are gathered): ``q`` (C_Q of the GQA group), ``k``, ``v``, ``s``
(score-weighted value target C_S) and ``o`` (attention-output covariance).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .config import AttentionShape

KINDS = ("q", "k", "v", "s", "o")


class StatsAccumulator:
    """Float64 streaming second moments per (layer, kv head, kind). Pure torch; no model or I/O.

    The accumulators live where the rows come from: the first :meth:`update` moves them to its tensors' device (a
    CUDA model's statistics accumulate on the GPU), and what leaves the accumulator (:meth:`as_rows`,
    :meth:`digest`) is read back to the CPU."""

    def __init__(self, shape: AttentionShape, skip: int = 0):
        self.shape = shape
        self.skip = skip
        L, H, d = shape.n_layers, shape.n_kv_heads, shape.head_dim
        self.sums = {k: torch.zeros(L, H, d, d, dtype=torch.float64) for k in KINDS}
        self.count = {k: torch.zeros(L, H, dtype=torch.float64) for k in KINDS}
        self.weight = {k: torch.zeros(L, H, dtype=torch.float64) for k in KINDS}

    @property
    def device(self) -> torch.device:
        return self.sums[KINDS[0]].device

    def to(self, device: torch.device | str) -> StatsAccumulator:
        """Move every accumulator to ``device`` (in place; returns self)."""
        for d in (self.sums, self.count, self.weight):
            for kind in d:
                d[kind] = d[kind].to(device)
        return self

    def _host(self) -> tuple[dict, dict, dict]:
        return tuple({k: t.cpu() for k, t in d.items()} for d in (self.sums, self.count, self.weight))

    def update(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> None:
        """q, o: ``[B, n_heads, T, d]``; k, v: ``[B, n_kv_heads, T, d]`` (post-RoPE, any float dtype)."""
        if q.device != self.device:
            self.to(q.device)
        s = self.skip
        H, G, d = self.shape.n_kv_heads, self.shape.group, self.shape.head_dim
        # -> per kv head rows [H, N, d] in float64
        qr = q[:, :, s:].double().unflatten(1, (H, G)).permute(1, 0, 2, 3, 4).reshape(H, -1, d)
        orows = o[:, :, s:].double().unflatten(1, (H, G)).permute(1, 0, 2, 3, 4).reshape(H, -1, d)
        kr = k[:, :, s:].double().transpose(0, 1).reshape(H, -1, d)
        vr = v[:, :, s:].double().transpose(0, 1).reshape(H, -1, d)
        for kind, rows in (("q", qr), ("k", kr), ("v", vr), ("o", orows)):
            self.sums[kind][layer] += rows.transpose(1, 2) @ rows
            self.count[kind][layer] += rows.shape[1]
            self.weight[kind][layer] += rows.shape[1]
        cq = self.sums["q"][layer] / self.count["q"][layer].clamp_min(1)[:, None, None]
        w = torch.einsum("hnd,hde,hne->hn", kr, cq, kr)  # k C_Q kᵀ per row
        self.sums["s"][layer] += (vr * w[..., None]).transpose(1, 2) @ vr
        self.count["s"][layer] += vr.shape[1]
        self.weight["s"][layer] += w.sum(1)

    def covariance(self, kind: str) -> torch.Tensor:
        """Normalised targets ``[L, H, d, d]``: Σ/N for q, k, v, o and Σ w v vᵀ / Σ w for s."""
        den = self.weight[kind] if kind == "s" else self.count[kind]
        return self.sums[kind] / den.clamp_min(1e-300)[..., None, None]

    def as_rows(self) -> dict:
        sums, count, weight = self._host()
        out = {}
        for kind in KINDS:
            for layer in range(self.shape.n_layers):
                for h in range(self.shape.n_kv_heads):
                    out[(layer, h, kind)] = (
                        count[kind][layer, h].item(),
                        weight[kind][layer, h].item(),
                        sums[kind][layer, h].numpy(),
                    )
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the accumulators (what one store checkpoint writes)."""
        return sum(t.numel() * t.element_size() for d in (self.sums, self.count, self.weight) for t in d.values())

    def digest(self) -> str:
        """sha256 over every accumulator (counts, weights, sums), in a fixed order: identifies the statistics an
        artifact was fitted from (equal for a resumed and an uninterrupted run)."""
        sums, count, weight = self._host()
        h = hashlib.sha256()
        for kind in KINDS:
            for t in (count[kind], weight[kind], sums[kind]):
                h.update(np.ascontiguousarray(t.numpy(), dtype=np.float64).tobytes())
        return "sha256:" + h.hexdigest()

    def load_rows(self, rows: dict) -> None:
        for (layer, h, kind), (count, weight, mat) in rows.items():
            self.count[kind][layer, h] = count
            self.weight[kind][layer, h] = weight
            self.sums[kind][layer, h] = torch.from_numpy(np.array(mat, dtype=np.float64))
