"""Shared builders for the kernel tests: random caches (fresh data, scattered slots, NaN-poisoned free slots and rows)
and the end-to-end Design P reference computed from the un-rotated K/V history of each sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from oscar_kernels import DecodeIndex, ExtendIndex, Int2Pool, LayerCache, dequantize_ref, quantize_pack_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def random_rotation(n_rot: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 ``[n_rot, d, d]`` random orthogonal matrices."""
    a = torch.randn(n_rot, d, d, generator=gen, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    return (qm * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float().to(DEVICE)


def indptr(lens: list[int]) -> torch.Tensor:
    p = torch.zeros(len(lens) + 1, dtype=torch.int32)
    p[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return p.to(DEVICE)


def ragged(lens: list[int], pool_slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """indptr int32 [B+1] and shuffled distinct slot indices int32 [sum(lens)] from 1..pool_slots-1 (slot 0 stays free)."""
    perm = torch.randperm(pool_slots - 1, generator=gen)[: sum(lens)] + 1
    return indptr(lens), perm.to(torch.int32).to(DEVICE)


def outliers(d: int, gen: torch.Generator, scale: float = 4.0) -> torch.Tensor:
    """Per-channel magnitudes with a few outlier channels (what the rotations are for)."""
    return 1.0 + scale * (torch.rand(d, generator=gen) > 0.9).float()


def poison_kv_pool(pool, gen: torch.Generator) -> None:
    """Every layer of an ``Int2KVPool``: random code bytes, NaN scales/zeros and exact rows (anything a kernel
    should have written and did not stays NaN)."""
    for i in range(pool.num_layers):
        c = pool.layer(i)
        for p in (c.k, c.v):
            p.codes.copy_(torch.randint(0, 256, p.codes.shape, generator=gen, dtype=torch.uint8))
            p.scale.fill_(float("nan"))
            p.zero.fill_(float("nan"))
        c.k_bf16.fill_(float("nan"))
        c.v_bf16.fill_(float("nan"))


def poisoned_pool(slots: int, hkv: int, d: int, g: int, gen: torch.Generator, head_major: bool = True,
                  mult: torch.Tensor | None = None, bits: int = 2) -> Int2Pool:
    """Random codes, NaN scales/zeros: a slot nobody wrote poisons any attention that reads it. FP8 metadata with
    ``mult`` (fp32 ``[hkv]``), 4-bit codes (two planes) with ``bits=4``."""
    meta = torch.float16 if mult is None else torch.float8_e4m3fn
    pool = Int2Pool.empty(slots, hkv, d, g, device=DEVICE, mult=mult, bits=bits) if head_major else Int2Pool(
        torch.empty(slots, hkv, d // 4, dtype=torch.uint8, device=DEVICE),
        torch.empty(slots, hkv, d // g, dtype=meta, device=DEVICE),
        torch.empty(slots, hkv, d // g, dtype=meta, device=DEVICE), g,
        None if mult is None else mult.to(DEVICE),
        torch.empty(slots, hkv, d // 4, dtype=torch.uint8, device=DEVICE) if bits == 4 else None)
    pool.codes.copy_(torch.randint(0, 256, (slots, hkv, d // 4), generator=gen, dtype=torch.uint8))
    if pool.codes_hi is not None:
        pool.codes_hi.copy_(torch.randint(0, 256, (slots, hkv, d // 4), generator=gen, dtype=torch.uint8))
    pool.scale.fill_(float("nan"))
    pool.zero.fill_(float("nan"))
    return pool


@dataclass
class Lists:
    """A LayerCache with per-sequence INT2 and exact-row lists (what a decode step reads)."""

    cache: LayerCache
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    bf16_indptr: torch.Tensor
    bf16_indices: torch.Tensor

    def index(self, num_splits: list[int] | int, max_splits: int | None = None, exact_splits: int = 1) -> DecodeIndex:
        bsz = self.kv_indptr.shape[0] - 1
        ns = [num_splits] * bsz if isinstance(num_splits, int) else num_splits
        return DecodeIndex(self.kv_indptr, self.kv_indices, self.bf16_indptr, self.bf16_indices,
                           torch.tensor(ns, dtype=torch.int32, device=DEVICE), max_splits or max(ns), exact_splits)


def fp8_mults(hkv: int, gen: torch.Generator) -> torch.Tensor:
    """Per-head FP8 multipliers of different binades (2**-7 .. 2**-3 for unit-scale rows): heads whose e4m3 values
    sit in different parts of the format's range."""
    return torch.exp2(-torch.randint(3, 8, (hkv,), generator=gen).float())


def make_cache(int2_lens: list[int], bf16_lens: list[int], hkv: int, d: int, g: int, gen: torch.Generator,
               shared_rot: bool = False, clip_k: float = 0.9, clip_v: float = 1.0, head_major: bool = True,
               fp8: bool = False, bits: tuple[int, int] = (2, 2)) -> Lists:
    """Quantise random K/V (with a few outlier channels) into scattered slots; free slots hold NaN scales/rows.

    INT2 pools are head-major (``Int2Pool``'s layout) unless ``head_major=False`` (plain contiguous [S, Hkv, ...]);
    ``fp8``: FP8 scales and zeros with per-head multipliers (:func:`fp8_mults`); ``bits``: the K and V code widths
    (4: two planes)."""
    n_rot = 1 if shared_rot else hkv
    rot_k, rot_v = random_rotation(n_rot, d, gen), random_rotation(n_rot, d, gen)
    nnz, nnz_b = sum(int2_lens), sum(bf16_lens)
    slots, slots_b = nnz + 7, nnz_b + 5
    kv_indptr, kv_indices = ragged(int2_lens, slots, gen)
    bf16_indptr, bf16_indices = ragged(bf16_lens, slots_b, gen)
    outlier = outliers(d, gen)
    pools = []
    for rot, clip, width in ((rot_k, clip_k, bits[0]), (rot_v, clip_v, bits[1])):
        x = (torch.randn(nnz, hkv, d, generator=gen) * outlier).to(DEVICE)
        pool = poisoned_pool(slots, hkv, d, g, gen, head_major, fp8_mults(hkv, gen) if fp8 else None, width)
        quantize_pack_ref(x, rot, clip, pool.codes, pool.scale, pool.zero, kv_indices, g, mult=pool.mult,
                          codes_hi=pool.codes_hi)
        pools.append(pool)
    k_bf16 = torch.full((slots_b, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_bf16 = torch.full_like(k_bf16, float("nan"))
    k_bf16[bf16_indices.long()] = (torch.randn(nnz_b, hkv, d, generator=gen) * outlier).to(DEVICE, torch.bfloat16)
    v_bf16[bf16_indices.long()] = torch.randn(nnz_b, hkv, d, generator=gen).to(DEVICE, torch.bfloat16)
    clips = [torch.full((hkv,), c, dtype=torch.float32, device=DEVICE) for c in (clip_k, clip_v)]
    cache = LayerCache(pools[0], pools[1], k_bf16, v_bf16, rot_k, rot_v, *clips)
    return Lists(cache, kv_indptr, kv_indices, bf16_indptr, bf16_indices)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


# -------------------------------------------------------------------------------------------------------------
# end-to-end Design P reference


@dataclass
class History:
    """Un-rotated K/V of every position of one sequence, first real token at ``start``."""

    k: torch.Tensor  # [n, Hkv, d]
    v: torch.Tensor
    start: int


def design_p_ref(q: torch.Tensor, hist: History, q_pos: list[int], rot_k, rot_v, clip_k, clip_v, sink: int,
                 recent: int, group: int, sm_scale: float | None = None) -> torch.Tensor:
    """Design P attention of queries ``q`` ``[T, Hq, d]`` (un-rotated) at positions ``q_pos`` over ``hist``.

    The query at ``t`` attends keys ``start <= j <= t``: exact (``bf16(k_j @ R)``) when ``j < start + sink`` or
    ``j > t - recent``, else the dequantised INT2 code (``quantize_pack_ref`` of the un-rotated row). fp32 ``[T, Hq, d]``.
    """
    n, hkv, d = hist.k.shape
    hq = q.shape[1]
    gqa = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    rk, rv = rot_k.float().expand(hkv, d, d), rot_v.float().expand(hkv, d, d)

    def both(x, rot, clip):
        exact = torch.einsum("nhd,hde->nhe", x.float(), rot).to(torch.bfloat16).float()
        pool = Int2Pool(torch.empty(n, hkv, d // 4, dtype=torch.uint8, device=x.device),
                        torch.empty(n, hkv, d // group, dtype=torch.float16, device=x.device),
                        torch.empty(n, hkv, d // group, dtype=torch.float16, device=x.device), group)
        quantize_pack_ref(x, rot, clip, pool.codes, pool.scale, pool.zero, torch.arange(n, device=x.device), group)
        return exact, dequantize_ref(pool.codes, pool.scale, pool.zero, group)

    k_ex, k_q = both(hist.k, rot_k, clip_k)
    v_ex, v_q = both(hist.v, rot_v, clip_v)
    sink_end = hist.start + sink
    out = torch.zeros(len(q_pos), hq, d, dtype=torch.float32, device=q.device)
    j = torch.arange(n, device=q.device)
    for i, t in enumerate(q_pos):
        if t < hist.start:
            continue  # padding: anything finite
        use_exact = ((j < sink_end) | (j > t - recent))[:, None, None]
        k = torch.where(use_exact, k_ex, k_q)[hist.start:t + 1]
        v = torch.where(use_exact, v_ex, v_q)[hist.start:t + 1]
        for h in range(hq):
            kh = h // gqa
            qr = q[i, h].float() @ rk[kh]
            p = torch.softmax((k[:, kh] @ qr) * sm_scale, dim=0)
            out[i, h] = (p @ v[:, kh]) @ rv[kh].T
    return out


@dataclass
class ExtendCase:
    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    cache: LayerCache
    index: ExtendIndex
    hists: list[History]
    q_pos: list[list[int]]


def extend_case(seqs: list[tuple[int, int, int]], sink: int, recent: int, hkv: int, gqa: int, d: int, g: int,
                gen: torch.Generator, unused_tail: int = 0, fp8: bool = False,
                bits: tuple[int, int] = (2, 2)) -> ExtendCase:
    """Hand-built extend lists (no plan) for sequences ``(start, c0, m)``: a chunk of ``m`` tokens after ``c0`` cached
    ones, Design P lists (INT2 slots of ``[sink_end, c1 - recent)``, cached exact rows of the prefix's sinks and
    ring), scattered slots and rows, NaN in everything unlisted. ``unused_tail``: append that many INT2 elements
    past the used range and put that many exact rows at position ``start + sink`` before the others, all NaN, which
    no query may read (needs ``c0 >= start + sink + recent`` and ``recent >= 1``; a multiple of the key tile, so
    that the exact ones fill whole tiles). ``fp8``: FP8 scales and zeros (:func:`fp8_mults`), ``bits``: K and V code
    widths (Design P's reference describes 2-bit fp16 rows only; :func:`extend_int2_ref` describes all)."""
    rot_k, rot_v = random_rotation(hkv, d, gen), random_rotation(hkv, d, gen)
    clip_k = (0.6 + 0.4 * torch.rand(hkv, generator=gen)).to(DEVICE)
    clip_v = (0.6 + 0.4 * torch.rand(hkv, generator=gen)).to(DEVICE)
    hists, q_pos, int2_pos, ex_pos = [], [], [], []
    outlier = outliers(d, gen)
    for start, c0, m in seqs:
        c1 = c0 + m
        # bf16-representable history: the chunk's k/v reach the kernel in bf16
        k = (torch.randn(c1, hkv, d, generator=gen) * outlier).bfloat16().float().to(DEVICE)
        v = torch.randn(c1, hkv, d, generator=gen).bfloat16().float().to(DEVICE)
        hists.append(History(k, v, start))
        q_pos.append(list(range(c0, c1)))
        sink_end = start + sink
        int2_pos.append(list(range(sink_end, max(sink_end, c1 - recent))))
        ex_pos.append(list(range(start, min(sink_end, c0))) + list(range(max(sink_end, c0 + 1 - recent), c0)))
    n_int2 = sum(len(p) for p in int2_pos) + unused_tail * len(seqs)
    n_ex = sum(len(p) for p in ex_pos) + unused_tail * len(seqs)
    slots, rows = n_int2 + 5, n_ex + 4
    perm_s = (torch.randperm(slots - 1, generator=gen)[:n_int2] + 1).tolist()
    perm_r = (torch.randperm(rows - 1, generator=gen)[:n_ex] + 1).tolist()
    kp = poisoned_pool(slots, hkv, d, g, gen, mult=fp8_mults(hkv, gen) if fp8 else None, bits=bits[0])
    vp = poisoned_pool(slots, hkv, d, g, gen, mult=fp8_mults(hkv, gen) if fp8 else None, bits=bits[1])
    kx = torch.full((rows, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    vx = torch.full_like(kx, float("nan"))
    kv_lens, ex_lens, kv_idx, ex_idx, ex_p = [], [], [], [], []
    for hist, ip, ep in zip(hists, int2_pos, ex_pos, strict=True):
        sl = [perm_s.pop() for _ in ip]
        rw = [perm_r.pop() for _ in ep]
        if ip:
            loc = torch.tensor(sl, device=DEVICE)
            quantize_pack_ref(hist.k[ip], rot_k, clip_k, kp.codes, kp.scale, kp.zero, loc, g, mult=kp.mult,
                              codes_hi=kp.codes_hi)
            quantize_pack_ref(hist.v[ip], rot_v, clip_v, vp.codes, vp.scale, vp.zero, loc, g, mult=vp.mult,
                              codes_hi=vp.codes_hi)
        if ep:
            r = torch.tensor(rw, device=DEVICE)
            quantize_pack_ref(hist.k[ep], rot_k, None, None, None, None, None, g, bf16_out=kx, bf16_loc=r)
            quantize_pack_ref(hist.v[ep], rot_v, None, None, None, None, None, g, bf16_out=vx, bf16_loc=r)
        # unused tails: NaN slots past the used INT2 range, NaN rows at gap positions (never sinks, never in a window)
        sl += [perm_s.pop() for _ in range(unused_tail)]
        gap = hist.start + sink  # sink_end: with recent >= 1 the gap holds positions <= c0 - recent
        ep = [gap] * unused_tail + ep  # first, so that they fill whole tiles when unused_tail is a tile multiple
        rw = [perm_r.pop() for _ in range(unused_tail)] + rw
        kv_lens.append(len(sl))
        ex_lens.append(len(rw))
        kv_idx += sl
        ex_idx += rw
        ex_p += ep
    n = sum(m for _, _, m in seqs)
    hq = hkv * gqa
    q = (torch.randn(n, hq, d, generator=gen) * 2).to(DEVICE, torch.bfloat16)
    k_new = torch.cat([h.k[c0:] for h, (_, c0, _) in zip(hists, seqs, strict=True)]).to(torch.bfloat16)
    v_new = torch.cat([h.v[c0:] for h, (_, c0, _) in zip(hists, seqs, strict=True)]).to(torch.bfloat16)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    index = ExtendIndex(indptr([m for _, _, m in seqs]), i32([c0 for _, c0, _ in seqs]),
                        i32([s for s, _, _ in seqs]), indptr(kv_lens), i32(kv_idx), indptr(ex_lens), i32(ex_idx),
                        i32(ex_p), max(m for _, _, m in seqs), sink, recent)
    cache = LayerCache(kp, vp, kx, vx, rot_k, rot_v, clip_k.float(), clip_v.float())
    return ExtendCase(q, k_new, v_new, cache, index, hists, q_pos)


def design_p_case_ref(case: ExtendCase, sm_scale: float | None = None) -> torch.Tensor:
    """:func:`design_p_ref` of every chunk of an :class:`ExtendCase`, rows in ``q`` order (fp32)."""
    outs, row = [], 0
    c = case.cache
    for hist, pos in zip(case.hists, case.q_pos, strict=True):
        outs.append(design_p_ref(case.q[row:row + len(pos)], hist, pos, c.rot_k, c.rot_v, c.clip_k, c.clip_v,
                                 case.index.sink, case.index.recent, c.group_size, sm_scale))
        row += len(pos)
    return torch.cat(outs)


def real_rows(case: ExtendCase) -> torch.Tensor:
    """bool ``[N]``: query rows at or after their sequence's start (padding rows may output anything finite)."""
    return torch.tensor([p >= h.start for h, ps in zip(case.hists, case.q_pos, strict=True) for p in ps],
                        device=DEVICE)
