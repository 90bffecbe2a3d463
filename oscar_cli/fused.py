"""The fused-kernel path of :class:`oscar_cli.cache.OscarLayer` for one-token decode steps.

On CUDA (or when :data:`FORCE` is set, for interpreter tests on CPU) a decode step of a per-token INT2 layer runs
:func:`oscar_kernels.quantize_pack` for the rows leaving the recent window and :func:`oscar_kernels.decode_int2`
for the attention, instead of the torch reference that dequantizes every cached row. The cache's own storage is
per sequence (``[B, H, N, ...]``), so each step views it as token-slot pools (slot = ``b * N + position``) with
per-sequence index lists:

* INT2 slots of row ``b``: positions ``[max(sink_end_b, qstart), qend)``;
* BF16 slots of row ``b``: its real sinks ``[first_real_b, sink_end_b)`` and the exact tail ``[qend, n)``, rotated
  into the kernel's basis (``k @ R_K``, ``v @ R_V``) and stored in bf16.

That is the same set of rows, read the same way, as the reference attention at this position, so the two agree up
to the kernel's bf16 rounding of the exact rows. Layouts that the kernels do not cover (4-bit codes, per-channel
KIVI keys, head dims or groups that are not powers of two, an empty recent window) stay on the reference path.
"""

from __future__ import annotations

import torch

from .quantizer import QuantizedRows

FORCE = False
"""Use the kernels even without CUDA (tests set this under ``TRITON_INTERPRET=1``)."""


def _pow2(v: int) -> bool:
    return v >= 16 and not v & (v - 1)


def usable(layer, query: torch.Tensor) -> bool:
    lq = layer.lq
    if lq is None or query.shape[2] != 1 or not (query.is_cuda or FORCE):
        return False
    d = query.shape[-1]
    return (lq.bits == 2 and lq.key_axis == "token" and _pow2(d) and _pow2(lq.group) and layer.windows.recent > 0
            and lq.r_k is not None and lq.r_v is not None)


def _to_slots(q: QuantizedRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, H, N, w]`` packed rows -> slot pools ``[B * N, H, w]`` (slot = b * N + position - qstart)."""
    def flat(t):
        b, h, n, w = t.shape
        return t.permute(0, 2, 1, 3).reshape(b * n, h, w)

    return flat(q.codes), flat(q.scale), flat(q.zero)


def _pack(x: torch.Tensor, r: torch.Tensor, clip: torch.Tensor, group: int) -> QuantizedRows:
    """Rotate + clip + quantize + pack rows ``[B, H, N, d]`` with :func:`oscar_kernels.quantize_pack`: one launch,
    the per-head clip ratios read from a device tensor."""
    from oscar_kernels import quantize_pack

    b, h, n, d = x.shape
    rows = x.permute(0, 2, 1, 3).reshape(b * n, h, d)
    codes = torch.empty(b * n, h, d // 4, dtype=torch.uint8, device=x.device)
    scale = torch.empty(b * n, h, d // group, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    loc = torch.arange(b * n, device=x.device, dtype=torch.int32)
    quantize_pack(rows, r.float().to(x.device), _head_clip(clip, h, x.device), codes, scale, zero, loc,
                  group_size=group)

    def back(t):
        return t.view(b, n, h, -1).permute(0, 2, 1, 3).contiguous()

    return QuantizedRows(back(codes), back(scale), back(zero), 2, group)


def _head_clip(clip: torch.Tensor, heads: int, device) -> torch.Tensor:
    """Clip ratios ``[1 or H]`` -> fp32 ``[H]`` on ``device`` (what the kernels read per KV head)."""
    return clip.float().reshape(-1).to(device).expand(heads).contiguous()


def _ranges(rows: list[list[tuple[int, int]]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence slot lists from half-open slot ranges: ``rows[b]`` = ranges of sequence ``b``, in order.

    Returns ``(indptr int32 [B + 1], indices int32 [nnz])`` as the kernels take them."""
    segs = [torch.cat([torch.arange(a, max(a, z)) for a, z in ranges] or [torch.zeros(0, dtype=torch.int64)])
            for ranges in rows]
    indptr = torch.zeros(len(segs) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor([len(x) for x in segs]), 0)
    return indptr.to(device), torch.cat(segs).to(device=device, dtype=torch.int32)


def decode(layer, query: torch.Tensor, scaling: float, qend: int) -> torch.Tensor:
    """One decode step of ``layer`` (an OscarLayer after ``update``): returns ``[B, 1, Hq, d]``."""
    from oscar_kernels import Int2Pool, LayerCache, decode_index, decode_int2

    lq, n = layer.lq, layer.n
    dev = query.device
    ts = layer.tail_start
    lo = max(ts, layer.qstart)
    new = None
    if qend > lo:
        kq = _pack(layer.keys[:, :, lo - ts : qend - ts], lq.r_k, lq.clip_k, lq.group)
        vq = _pack(layer.values[:, :, lo - ts : qend - ts], lq.r_v, lq.clip_v, lq.group)
        new = (kq, vq)
    if qend > ts:
        layer._flush(ts, qend, new)
    b, hkv = layer.keys.shape[:2]
    first_real = layer.sink_end - layer.windows.sink
    # INT2 pools: the cache's codes, positions [qstart, qend)
    nq = qend - layer.qstart
    sink_end = layer.sink_end.tolist()
    if layer.codes_k is not None and nq > 0:  # slot = b * nq + position - qstart
        kc, ks, kz = _to_slots(layer.codes_k)
        vc, vs, vz = _to_slots(layer.codes_v)
        kv_indptr, kv_indices = _ranges(
            [[(i * nq + max(e, layer.qstart) - layer.qstart, (i + 1) * nq)] for i, e in enumerate(sink_end)], dev)
    else:
        d4, g = query.shape[-1] // 4, query.shape[-1] // lq.group
        kc = vc = torch.zeros(1, hkv, d4, dtype=torch.uint8, device=dev)
        ks = kz = vs = vz = torch.ones(1, hkv, g, dtype=torch.float16, device=dev)
        kv_indptr, kv_indices = _ranges([[] for _ in range(b)], dev)
    # BF16 pools: head rows [0, lh) then tail rows [ts, n), rotated; slot = b * le + row
    head_k = layer.head_k if layer.head_k is not None else layer.keys[:, :, :0]
    head_v = layer.head_v if layer.head_v is not None else layer.values[:, :, :0]
    lh = head_k.shape[2]
    ex_k = torch.cat([head_k, layer.keys], 2).float()
    ex_v = torch.cat([head_v, layer.values], 2).float()
    rk, rv = lq.r_k.float().to(dev), lq.r_v.float().to(dev)
    le = ex_k.shape[2]
    pool_k = torch.einsum("bhnd,hde->bnhe", ex_k, rk.expand(hkv, -1, -1)).reshape(b * le, hkv, -1).to(torch.bfloat16)
    pool_v = torch.einsum("bhnd,hde->bnhe", ex_v, rv.expand(hkv, -1, -1)).reshape(b * le, hkv, -1).to(torch.bfloat16)
    ts = layer.tail_start  # after the flush: the tail is [ts, n)
    head_hi = min(lh, ts)
    rows = []
    for i, (f, e) in enumerate(zip(first_real.tolist(), sink_end, strict=True)):
        base = i * le
        # its real sinks still in the head, then its tail (left padding can reach into the tail)
        rows.append([(base + f, base + min(e, head_hi)), (base + lh + max(f - ts, 0), base + lh + n - ts)])
    bf16_indptr, bf16_indices = _ranges(rows, dev)
    cache = LayerCache(Int2Pool(kc, ks, kz, lq.group), Int2Pool(vc, vs, vz, lq.group), pool_k, pool_v, rk, rv,
                       _head_clip(lq.clip_k, hkv, dev), _head_clip(lq.clip_v, hkv, dev))
    index = decode_index(cache, kv_indptr, kv_indices, bf16_indptr, bf16_indices, max_kv_len=max(nq, 1))
    out = decode_int2(query[:, :, 0], cache, index, sm_scale=scaling)
    return out[:, None].to(query.dtype)
