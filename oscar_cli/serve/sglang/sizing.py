"""What the OSCAR pool costs, in the terms SGLang budgets memory in.

SGLang sizes its KV pool as ``max_total_num_tokens = available_bytes // cell_size``
(``DefaultPoolConfigurator``). With OSCAR, on each TP rank:

* ``cell_size`` = quantized bytes of one token slot over this rank's layers and KV heads, K and V: codes ``d/4``
  (``d/2`` for a layer's 4-bit K or V in an allocated scheme) plus a scale and zero per group, fp16 or FP8
  (:attr:`oscar_kernels.Int2KVPool.cell_bytes`; 72 B per head and layer at d = g = 128 with fp16 scales against
  512 B for BF16 K+V: 7.1x more tokens);
* fixed bytes, subtracted from ``available_bytes`` first: the exact regions of every request slot
  (``max_running_requests + 1`` rows of SGLang's request table, row 0 pads CUDA graphs), the anchor store
  (``anchors`` entries of the same size, :data:`~.settings.DEFAULT_ANCHORS`), and the decode/extend plan workspaces.

Every number comes from the kernels' own accounting (``Int2KVPool.cell_bytes`` / ``exact_bytes``,
``DecodePlan``/``ExtendPlan.workspace_bytes()``), read off a one-slot pool of the rank's layers and plans built on
the CPU: their sizes depend on the head shape, the layers' widths and the batch bounds only (``torch.empty`` pages
are never touched).
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
           anchors: int, max_tokens: int, max_seq_len: int, start_layer: int = 0) -> Budget:
    """The :class:`Budget` of one rank (``kv_heads``/``q_heads``: this rank's; ``request_slots``: SGLang's request
    table rows, which also bound the batch; ``max_tokens``: new tokens per extend batch; ``max_seq_len``: context)."""
    import torch
    from oscar_kernels import DecodePlan, ExtendPlan, Int2KVPool

    # one slot of every layer (each layer's code widths: an allocation's 4-bit layers cost more), one request region
    eye = torch.eye(head_dim).expand(num_layers, 1, head_dim, head_dim)
    ones = torch.ones(num_layers, kv_heads) if scheme.scale_dtype == "fp8" else None  # multipliers: any value
    widths = [(scheme.width(i, "k"), scheme.width(i, "v")) for i in range(start_layer, start_layer + num_layers)]
    centers = torch.zeros(num_layers, kv_heads, head_dim) if scheme.center_keys else None  # any value
    unit = Int2KVPool(scheme, num_layers, kv_heads, head_dim, 1, 1, eye, eye, device="cpu", mult_k=ones, mult_v=ones,
                      widths=widths, center_k=centers)
    workspace = DecodePlan(unit, request_slots, max_seq_len, q_heads=q_heads).workspace_bytes() \
        + ExtendPlan(unit, request_slots, max_tokens, max_seq_len).workspace_bytes()
    return Budget(cell=unit.cell_bytes, bf16_cell=bf16_cell_bytes(num_layers, kv_heads, head_dim),
                  region=unit.exact_bytes, request_slots=request_slots, anchors=anchors, workspace=workspace)
