"""``Int2KVPool``: every layer's INT2 slots and exact rows, the one writer of both, and their byte accounting.

Per layer (a :class:`~oscar_kernels.layout.LayerCache`):

* INT2 slots for K and for V (:class:`~oscar_kernels.layout.Int2Pool`, head-major), ``num_slots`` tokens; every
  token gets its code when it is created (:meth:`Int2KVPool.write`), whether or not it is currently read exactly.
* Exact regions ``k_bf16`` / ``v_bf16`` bf16 ``[max_requests * (sink + recent), Hkv, d]``: request ``r`` owns rows
  ``[r * (sink + recent), (r + 1) * (sink + recent))``, its sinks then a ring of its last ``recent`` positions, rows
  rotated already (:func:`~oscar_kernels.layout.exact_row_ref` is the map).
* The layer's rotations ``rot_k``/``rot_v`` fp32 ``[h, d, d]`` and clip ratios ``clip_k``/``clip_v`` fp32 ``[Hkv]``;
  with FP8 metadata (``scheme.scale_dtype == "fp8"``) the per-head multipliers ``mult_k``/``mult_v`` fp32 ``[Hkv]``.

Storage is allocated uninitialised; the plans only ever read rows that a write produced. The SGLang plugin and the
transformers cache build on this class; under tensor parallelism the caller passes only its rank's KV heads.
"""

from __future__ import annotations

import torch

from .layout import DEFAULT_CLIP_RATIO, Int2Pool, LayerCache, exact_row_ref
from .scheme import QuantScheme, SchemeError
from .write import quantize_pack_kv


def _clips(clip, num_layers: int, kv_heads: int, device) -> torch.Tensor:
    """None / float / ``[L, h]`` (h = 1 or kv_heads) -> fp32 ``[L, Hkv]`` on ``device``, values checked once here."""
    if clip is None:
        clip = DEFAULT_CLIP_RATIO
    c = torch.as_tensor(clip, dtype=torch.float32)
    if c.dim() == 0:
        c = c.expand(num_layers, 1)
    if c.dim() != 2 or c.shape[0] != num_layers or c.shape[1] not in (1, kv_heads):
        raise ValueError(f"clip ratios must be a float or [{num_layers}, 1 or {kv_heads}], got {tuple(c.shape)}")
    if not bool(((c > 0) & (c <= 1)).all()):
        raise ValueError("clip ratios must lie in (0, 1]")
    return c.to(device).expand(num_layers, kv_heads).contiguous()


def _mults(mult, name: str, num_layers: int, kv_heads: int, device) -> torch.Tensor:
    """``[L, Hkv]`` positive powers of two (FP8 metadata multipliers) -> fp32 on ``device``, checked once here."""
    if mult is None:
        raise SchemeError(f"FP8 scales need the per-head multipliers {name} [{num_layers}, {kv_heads}] (the artifact's "
                          f"{name}): refit, or use scale_dtype fp16")
    m = torch.as_tensor(mult, dtype=torch.float32)
    if m.shape != (num_layers, kv_heads):
        raise ValueError(f"{name} must be [{num_layers}, {kv_heads}], got {tuple(m.shape)}")
    if not bool((m > 0).all()) or not torch.equal(torch.exp2(torch.round(torch.log2(m))), m):
        raise ValueError(f"{name} must hold positive powers of two")
    return m.to(device).contiguous()


def _centers(center, rot: torch.Tensor, num_layers: int, kv_heads: int, d: int, device) -> list:
    """Key centers ``[L, Hkv, d]`` in the model basis -> each layer's ``[Hkv, d]`` fp32 center in its rotated basis
    (``center[h] @ rot[h]``, in float64 so the kernels' rows and the reference agree to fp32 rounding)."""
    if center is None:
        raise SchemeError(f"the scheme centers keys: give center_k [{num_layers}, {kv_heads}, {d}] (the artifact's "
                          "center_k), or fit without --center-keys")
    c = torch.as_tensor(center)
    if c.shape != (num_layers, kv_heads, d):
        raise ValueError(f"center_k must be [{num_layers}, {kv_heads}, {d}], got {tuple(c.shape)}")
    r = rot.double().cpu().expand(num_layers, kv_heads, d, d)
    rotated = torch.einsum("lhd,lhde->lhe", c.double().cpu(), r).float()
    return [rotated[i].to(device).contiguous() for i in range(num_layers)]


def _rots(rot: torch.Tensor, name: str, num_layers: int, kv_heads: int, d: int, device) -> torch.Tensor:
    if rot.dim() != 4 or rot.shape[0] != num_layers or rot.shape[1] not in (1, kv_heads) or rot.shape[2:] != (d, d):
        raise ValueError(f"{name} must be [{num_layers}, 1 or {kv_heads}, {d}, {d}], got {tuple(rot.shape)}")
    return rot.to(device=device, dtype=torch.float32).contiguous()


class Int2KVPool:
    """INT2 slots + exact regions of ``num_layers`` layers.

    Args:
        scheme: :class:`~oscar_kernels.scheme.QuantScheme` (bits, group, sink, recent); refused with
            :class:`~oscar_kernels.scheme.SchemeError` when the kernels cannot run it at ``head_dim``.
        num_layers, kv_heads, head_dim: model shape (``kv_heads``: this rank's KV heads).
        num_slots: INT2 token slots per layer.
        max_requests: requests with an exact region (``req`` indices ``0 .. max_requests - 1``).
        rot_k, rot_v: fp32 ``[L, h, d, d]`` (``h = 1`` shared or ``kv_heads``).
        clip_k, clip_v: per-layer clip ratios ``[L, h]`` (or a float; default ``DEFAULT_CLIP_RATIO``), expanded to
            ``[L, Hkv]`` on the device (each width's clips: a 4-bit layer's are its 4-bit ones).
        mult_k, mult_v: FP8 metadata only (and then required): per-layer, per-KV-head power-of-two multipliers
            ``[L, Hkv]`` (the artifact's; :mod:`oscar_kernels.layout` says how they scale the stored e4m3 values).
        center_k: centered keys only (``scheme.center_keys``, and then required): each layer's and KV head's key
            center ``[L, Hkv, d]`` in the model basis (the artifact's), subtracted from every key row stored.
        widths: code width ``(K, V)`` of each of the pool's layers (2 or 4); default the scheme's
            (``scheme.width(i, ...)`` of layer ``i``: the pool's layers are the model's, from 0).
        device: where everything lives.
    """

    def __init__(self, scheme: QuantScheme, num_layers: int, kv_heads: int, head_dim: int, num_slots: int,
                 max_requests: int, rot_k: torch.Tensor, rot_v: torch.Tensor, clip_k=None, clip_v=None,
                 device: torch.device | str | None = None, mult_k=None, mult_v=None,
                 widths: list[tuple[int, int]] | None = None, center_k=None):
        why = scheme.kernel_support(head_dim, torch.device(device).type if device is not None else None)
        if why is not None:
            raise SchemeError(f"scheme {scheme.describe()} cannot run in the kernels: {why}")
        self.scheme = scheme.resolved(head_dim)
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.num_slots, self.max_requests = num_slots, max_requests
        d, g = head_dim, self.scheme.group
        rk = _rots(rot_k, "rot_k", num_layers, kv_heads, d, device)
        rv = _rots(rot_v, "rot_v", num_layers, kv_heads, d, device)
        ck = _clips(clip_k, num_layers, kv_heads, device)
        cv = _clips(clip_v, num_layers, kv_heads, device)
        if widths is None:
            self.scheme.check_layers(num_layers)
            widths = [(self.scheme.width(i, "k"), self.scheme.width(i, "v")) for i in range(num_layers)]
        if len(widths) != num_layers or any(w not in (2, 4) for pair in widths for w in pair):
            raise ValueError(f"widths must give (K, V) code widths of 2 or 4 for each of {num_layers} layers, "
                             f"got {widths}")
        self.widths = [tuple(w) for w in widths]
        fp8 = self.scheme.scale_dtype == "fp8"
        mk = _mults(mult_k, "mult_k", num_layers, kv_heads, device) if fp8 else [None] * num_layers
        mv = _mults(mult_v, "mult_v", num_layers, kv_heads, device) if fp8 else [None] * num_layers
        ce = _centers(center_k, rk, num_layers, kv_heads, d, device) if self.scheme.center_keys else [None] * num_layers
        rows = max(self.rows_per_request * max_requests, 1)  # one row at least: kernels take a real pointer
        self._layers = []
        for i in range(num_layers):
            self._layers.append(LayerCache(
                k=Int2Pool.empty(num_slots, kv_heads, d, g, device=device, mult=mk[i], bits=self.widths[i][0]),
                v=Int2Pool.empty(num_slots, kv_heads, d, g, device=device, mult=mv[i], bits=self.widths[i][1]),
                k_bf16=torch.empty(rows, kv_heads, d, dtype=torch.bfloat16, device=device),
                v_bf16=torch.empty(rows, kv_heads, d, dtype=torch.bfloat16, device=device),
                rot_k=rk[i], rot_v=rv[i], clip_k=ck[i], clip_v=cv[i], center_k=ce[i],
            ))

    # ------------------------------------------------------------------------------------------------ layout
    @property
    def sink(self) -> int:
        return self.scheme.sink

    @property
    def recent(self) -> int:
        return self.scheme.recent

    @property
    def group_size(self) -> int:
        return self.scheme.group

    @property
    def rows_per_request(self) -> int:
        """Exact rows per request and layer, for K and for V: ``sink + recent``."""
        return self.scheme.sink + self.scheme.recent

    @property
    def device(self) -> torch.device:
        return self._layers[0].k.codes.device

    def layer(self, i: int) -> LayerCache:
        """The :class:`~oscar_kernels.layout.LayerCache` of layer ``i`` (what the kernels take)."""
        return self._layers[i]

    def exact_rows(self, req: torch.Tensor | int, pos: torch.Tensor | int,
                   start: torch.Tensor | int | None = None) -> torch.Tensor:
        """Exact-region row of position ``pos`` of request ``req`` (first real token at ``start``, default 0):
        int64, -1 for no row (see :func:`~oscar_kernels.layout.exact_row_ref`)."""
        return exact_row_ref(req, pos, 0 if start is None else start, self.sink, self.recent)

    # ------------------------------------------------------------------------------------------------ writes
    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              bf16_loc: torch.Tensor | None = None,
              bf16_out: tuple[torch.Tensor, torch.Tensor] | None = None, q: torch.Tensor | None = None,
              q_out: torch.Tensor | None = None, q_scale: float = 1.0, **tuning) -> None:
        """Rotate, clip, quantize, pack and scatter new tokens: one launch for K and V (``quantize_pack_kv``).

        Args:
            loc: int32/int64 ``[N]`` INT2 slot of each token.
            k, v: bf16/fp16/fp32 ``[N, Hkv, d]`` un-rotated keys and values.
            bf16_loc: optional int32/int64 ``[N]``: also store the rotated bf16 row at this exact row (``-1``: not;
                distinct rows otherwise: two tokens of one write aimed at one row race on a GPU).
            bf16_out: where ``bf16_loc`` points (default the layer's exact regions ``(k_bf16, v_bf16)``; a plan
                passes its own scratch to get the chunk's rotated rows).
            q, q_out, q_scale: optional queries ``[N, Hq, d]`` of the same tokens, rotated by the layer's ``rot_k``
                and scaled into fp32 ``q_out`` in the same launch (what a decode step's attention reads).
            **tuning: launch parameters of :func:`~oscar_kernels.write.quantize_pack_kv` (``block_n``,
                ``rot_precision``, ``num_warps``).
        """
        c = self._layers[layer]
        ko, vo = (c.k_bf16, c.v_bf16) if bf16_out is None else bf16_out
        if bf16_loc is None:
            ko = vo = None
        quantize_pack_kv(k, v, c.rot_k, c.rot_v, c.clip_k, c.clip_v, c.k, c.v, loc, self.group_size,
                         bf16_out=None if ko is None else (ko, vo), bf16_loc=bf16_loc, q=q, q_out=q_out,
                         q_scale=q_scale, center_k=c.center_k, **tuning)

    def write_exact(self, layer: int, bf16_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    rotated: bool = False) -> None:
        """Store exact rows only (no INT2 store): ``k``/``v`` ``[N, Hkv, d]`` (un-rotated, or rotated already with
        ``rotated``: then also centered already, as :meth:`write`'s exact rows are) at rows ``bf16_loc`` int32/int64
        ``[N]`` (``-1``: skip; distinct rows otherwise)."""
        c = self._layers[layer]
        quantize_pack_kv(k, v, None if rotated else c.rot_k, None if rotated else c.rot_v, None, None, None, None,
                         None, self.group_size, bf16_out=(c.k_bf16, c.v_bf16), bf16_loc=bf16_loc,
                         center_k=None if rotated else c.center_k)

    # ------------------------------------------------------------------------------------------------ bytes
    @property
    def cell_bytes(self) -> int:
        """Quantized bytes of one token slot over all layers, K and V: codes ``d * bits / 8`` + scale and zero per
        group (two bytes each in fp16, one in FP8)."""
        d, g = self.head_dim, self.group_size
        meta = self.scheme.meta_bits // 8  # scale and zero of one group
        return self.kv_heads * sum(d * w // 8 + meta * (d // g) for pair in self.widths for w in pair)

    @property
    def exact_bytes(self) -> int:
        """Bytes of the exact regions over all layers, K and V: ``max_requests * (sink + recent)`` bf16 rows."""
        return self.num_layers * 2 * self.max_requests * self.rows_per_request * self.kv_heads * self.head_dim * 2

    @property
    def nbytes(self) -> int:
        """Device bytes held: slots, exact regions (at least one row each), rotations and clip ratios."""
        total = 0
        for c in self._layers:
            total += c.k.nbytes + c.v.nbytes
            held = [c.k_bf16, c.v_bf16, c.rot_k, c.rot_v, c.clip_k, c.clip_v] + ([c.k.mult, c.v.mult] if c.fp8 else []) \
                + ([c.center_k] if c.center_k is not None else [])
            total += sum(t.numel() * t.element_size() for t in held)
        return total
