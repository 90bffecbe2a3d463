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
    """Rotate + clip + quantize + pack rows ``[B, H, N, d]`` with :func:`oscar_kernels.quantize_pack`."""
    from oscar_kernels import quantize_pack

    b, h, n, d = x.shape
    rows = x.permute(0, 2, 1, 3).reshape(b * n, h, d)
    codes = torch.empty(b * n, h, d // 4, dtype=torch.uint8, device=x.device)
    scale = torch.empty(b * n, h, d // group, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    loc = torch.arange(b * n, device=x.device, dtype=torch.int32)
    r = r.float().to(x.device)
    ratios = clip.float().cpu().tolist()
    if len(set(ratios)) == 1:  # one clip ratio for every head: one launch
        quantize_pack(rows, r, ratios[0], codes, scale, zero, loc, group_size=group)
    else:  # the kernel takes one ratio per launch: one launch per KV head
        for i in range(h):
            sl = slice(i, i + 1)
            quantize_pack(rows[:, sl], r[sl] if r.shape[0] > 1 else r, ratios[i], codes[:, sl], scale[:, sl],
                          zero[:, sl], loc, group_size=group)

    def back(t):
        return t.view(b, n, h, -1).permute(0, 2, 1, 3).contiguous()

    return QuantizedRows(back(codes), back(scale), back(zero), 2, group)


def _indices(starts: torch.Tensor, ends: torch.Tensor, base: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated ranges ``[starts_b, ends_b)`` offset by ``base_b``: (indptr int32 [B+1], indices int32)."""
    lens = (ends - starts).clamp_min(0)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(lens, 0)
    parts = [torch.arange(int(s), int(s) + int(n), device=device) + int(o) for s, n, o in zip(starts, lens, base, strict=True)]
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
    return indptr, idx.to(torch.int32)


def decode(layer, query: torch.Tensor, scaling: float, qend: int) -> torch.Tensor:
    """One decode step of ``layer`` (an OscarLayer after ``update``): returns ``[B, 1, Hq, d]``."""
    from oscar_kernels import decode_int2

    lq, ts, n = layer.lq, layer.tail_start, layer.n
    dev = query.device
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
    if layer.codes_k is not None and nq > 0:
        kc, ks, kz = _to_slots(layer.codes_k)
        vc, vs, vz = _to_slots(layer.codes_v)
        starts = (layer.sink_end.clamp_min(layer.qstart) - layer.qstart).cpu()
        kv_indptr, kv_indices = _indices(starts, torch.full_like(starts, nq), torch.arange(b) * nq, dev)
    else:
        d4, g = query.shape[-1] // 4, query.shape[-1] // lq.group
        kc = vc = torch.zeros(1, hkv, d4, dtype=torch.uint8, device=dev)
        ks = kz = vs = vz = torch.ones(1, hkv, g, dtype=torch.float16, device=dev)
        kv_indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        kv_indices = torch.zeros(0, dtype=torch.int32, device=dev)
    # BF16 pools: head rows [0, len_head) then tail rows [ts, n), rotated
    head_k = layer.head_k if layer.head_k is not None else layer.keys[:, :, :0]
    head_v = layer.head_v if layer.head_v is not None else layer.values[:, :, :0]
    lh = head_k.shape[2]
    ex_k = torch.cat([head_k, layer.keys], 2).float()
    ex_v = torch.cat([head_v, layer.values], 2).float()
    rk = lq.r_k.float().to(dev).expand(hkv, -1, -1)
    rv = lq.r_v.float().to(dev).expand(hkv, -1, -1)
    le = ex_k.shape[2]
    pool_k = torch.einsum("bhnd,hde->bnhe", ex_k, rk).reshape(b * le, hkv, -1).to(torch.bfloat16)
    pool_v = torch.einsum("bhnd,hde->bnhe", ex_v, rv).reshape(b * le, hkv, -1).to(torch.bfloat16)
    sink_end = layer.sink_end.cpu().clamp_max(min(lh, layer.tail_start))
    heads_lo = first_real.cpu()
    tail_lo = lh + (heads_lo - layer.tail_start).clamp_min(0)  # left padding can reach into the tail
    tail_hi = torch.full_like(heads_lo, lh + (n - layer.tail_start))
    base = torch.arange(b) * le
    ip1, ix1 = _indices(heads_lo, sink_end, base, dev)
    ip2, ix2 = _indices(tail_lo, tail_hi, base, dev)
    # interleave per sequence: [its sinks, its tail]
    parts, indptr = [], [0]
    for i in range(b):
        seg = torch.cat([ix1[ip1[i] : ip1[i + 1]], ix2[ip2[i] : ip2[i + 1]]])
        parts.append(seg)
        indptr.append(indptr[-1] + seg.numel())
    bf16_indices = torch.cat(parts).to(torch.int32)
    bf16_indptr = torch.tensor(indptr, dtype=torch.int32, device=dev)
    out = decode_int2(
        query[:, :, 0], lq.r_k.float().to(dev), lq.r_v.float().to(dev), kc, ks, kz, vc, vs, vz, kv_indptr, kv_indices,
        pool_k, pool_v, bf16_indptr, bf16_indices, max_kv_len=max(nq, 1), group_size=lq.group, sm_scale=scaling,
    )
    return out[:, None].to(query.dtype)
