"""What the OSCAR pool costs, in the terms SGLang budgets memory in.

SGLang sizes its KV pool as ``max_total_num_tokens = available_bytes // cell_size``
(``DefaultPoolConfigurator``). With OSCAR, on each TP rank:

* ``cell_size`` = INT2 bytes of one token slot over this rank's layers and KV heads, K and V: codes ``d/4`` plus an
  fp16 scale and zero per group (:attr:`oscar_kernels.Int2KVPool.cell_bytes`; 72 B per head and layer at d = g =
  128 against 512 B for BF16 K+V: 7.1x more tokens);
* fixed bytes, subtracted from ``available_bytes`` first: the exact regions of every request slot
  (``max_running_requests + 1`` rows of SGLang's request table, row 0 pads CUDA graphs), the anchor store
  (``anchors`` entries of the same size, :data:`~.settings.DEFAULT_ANCHORS`), and the decode/extend plan workspaces.

Every number comes from the kernels' own accounting (``Int2KVPool.cell_bytes`` / ``exact_bytes``,
``DecodePlan``/``ExtendPlan.workspace_bytes()``), read off a one-layer, one-slot pool and plans built on the CPU:
their sizes depend on the head shape and the batch bounds only (``torch.empty`` pages are never touched).
"""

from __future__ import annotations

from dataclasses import dataclass

from oscar_kernels.scheme import QuantScheme

BF16_BYTES = 2


def bf16_cell_bytes(num_layers: int, kv_heads: int, head_dim: int) -> int:
    """SGLang's own BF16 cell size (K and V), for the ratio in the start log."""
    return num_layers * 2 * kv_heads * head_dim * BF16_BYTES


@dataclass(frozen=True)
class Budget:
    """One rank's OSCAR memory: bytes per token and fixed bytes (see the module docstring)."""

    cell: int
    bf16_cell: int
    region: int
    request_slots: int
    anchors: int
    workspace: int

    @property
    def fixed(self) -> int:
        return (self.request_slots + self.anchors) * self.region + self.workspace

    def describe(self) -> str:
        mib = 1 << 20
        return (f"OSCAR pool: {self.cell} B/token ({self.bf16_cell / self.cell:.2f}x fewer than BF16's "
                f"{self.bf16_cell}); fixed {self.fixed / mib:.1f} MiB = {self.request_slots} request regions + "
                f"{self.anchors} anchors x {self.region / mib:.2f} MiB + plan workspaces {self.workspace / mib:.1f} MiB")


def budget(scheme: QuantScheme, num_layers: int, kv_heads: int, head_dim: int, q_heads: int, request_slots: int,
           anchors: int, max_tokens: int, max_seq_len: int) -> Budget:
    """The :class:`Budget` of one rank (``kv_heads``/``q_heads``: this rank's; ``request_slots``: SGLang's request
    table rows, which also bound the batch; ``max_tokens``: new tokens per extend batch; ``max_seq_len``: context)."""
    import torch
    from oscar_kernels import DecodePlan, ExtendPlan, Int2KVPool

    eye = torch.eye(head_dim).expand(1, 1, head_dim, head_dim)
    ones = torch.ones(1, kv_heads) if scheme.scale_dtype == "fp8" else None  # multipliers: values do not matter
    unit = Int2KVPool(scheme, 1, kv_heads, head_dim, 1, 1, eye, eye, device="cpu", mult_k=ones, mult_v=ones)
    workspace = DecodePlan(unit, request_slots, max_seq_len, q_heads=q_heads).workspace_bytes() \
        + ExtendPlan(unit, request_slots, max_tokens, max_seq_len).workspace_bytes()
    return Budget(cell=unit.cell_bytes * num_layers, bf16_cell=bf16_cell_bytes(num_layers, kv_heads, head_dim),
                  region=unit.exact_bytes * num_layers, request_slots=request_slots, anchors=anchors,
                  workspace=workspace)
