"""Decode-equivalent attention: teacher-forced scoring that sees exactly what an INT2 KV cache gives a decoder.

A decoder at query position ``t`` (``n = t + 1`` tokens present) reads, for key position ``j`` of a row whose
first real token is at ``p`` (left padding):

* the exact K/V when ``j < p + sink`` (the sink rows) or ``j >= qend(n)`` (the recent rows);
* otherwise the INT2 round trip of the rotated K/V, rotated back (:func:`oscar_cli.kvquant.roundtrip`),

with ``qstart = min_b (p_b + sink)`` and ``qend(n) = qstart + quantized_count(n, qstart, recent, block)`` — for
per-token methods simply ``n - recent``. One query therefore sees a mix of exact and round-tripped keys that differs
from its neighbour's, so :func:`mixed_attention` scores every query against both copies, ``[K_exact ; K_roundtrip]``,
with a boolean mask that lets each (query, key) pair see exactly one copy, and runs one SDPA per chunk of queries
(memory ``O(chunk · 2n)`` per head, chunk :data:`QUERY_CHUNK`).

The implementation is registered with transformers as :data:`ATTN_NAME` (``AttentionInterface`` + an eager mask so
that padding reaches it). Per-layer settings live on the attention modules (:func:`install`;
:func:`ensure_installed` for a cache that needs the attention but brings its own quantizers). A cache that attends by
itself (:class:`oscar_cli.cache.OscarCache`) returns a :class:`CachedKV` handle from ``update`` — what attention
reads — and this function hands the query to it; with any other attention implementation the cache refuses to run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import quantizer
from .config import QuantScheme
from .kvquant import LayerQuant, quantize_rows, quantized_count, roundtrip
from .models import attention_modules

ATTN_NAME = "oscar_decode_equivalent"
QUERY_CHUNK = 512
"""Queries per SDPA call: bounds the mask and score memory at ``chunk × 2n`` per head (2k tokens: ~16 MB fp32)."""
_STATE = "_oscar_state"


class CachedKV:
    """What :meth:`oscar_cli.cache.OscarLayer.update` returns as keys and values: a handle on the cache layer, which
    attends the query over its packed and exact rows (:func:`oscar_attention` calls ``layer.attend``)."""

    __slots__ = ("layer",)

    def __init__(self, layer):
        self.layer = layer

    def __repr__(self) -> str:
        return f"CachedKV({type(self.layer).__name__}, {self.layer.get_seq_length()} tokens)"


def _register() -> None:
    from transformers import AttentionInterface

    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
    except ImportError:  # pragma: no cover  (older transformers: masks are built for every implementation)
        ALL_MASK_ATTENTION_FUNCTIONS = None
    AttentionInterface.register(ATTN_NAME, oscar_attention)
    if ALL_MASK_ATTENTION_FUNCTIONS is not None:
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, eager_mask)


def install(model, quants: list[LayerQuant | None] | None, scheme: QuantScheme | None) -> None:
    """Switch ``model`` to decode-equivalent attention with one :class:`LayerQuant` per layer (None = exact), with the
    sink/recent rows of ``scheme``.

    ``quants=None`` leaves every layer exact (the attention is then plain SDPA)."""
    _register()
    mods = attention_modules(model)
    if not mods:
        from .errors import OscarError

        raise OscarError(f"{type(model).__name__} has no attention modules with k_proj/layer_idx; use a Llama-like model")
    dev = next(model.parameters()).device
    for i, m in mods.items():
        lq = None if quants is None or i >= len(quants) else quants[i]
        setattr(m, _STATE, None if lq is None else (lq.to(dev), scheme))
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(ATTN_NAME)
            return
        except Exception:  # noqa: BLE001  (older versions validate names differently)
            pass
    model.config._attn_implementation = ATTN_NAME


def ensure_installed(model) -> None:
    """Make sure ``model`` attends through :data:`ATTN_NAME` (registered in this process): what a cache that attends
    by itself needs. A model already switched keeps its per-layer settings; any other gets exact layers."""
    _register()
    if not is_installed(model):
        install(model, None, None)


def to_bool_mask(mask: torch.Tensor | None, batch: int, q_pos: torch.Tensor, n: int) -> torch.Tensor:
    """Model attention mask -> bool ``[B, 1, T, n]`` (True = may attend). Float masks are additive (0 = allowed);
    ``None`` means plain causal over positions ``q_pos [T]``."""
    if mask is None:
        j = torch.arange(n, device=q_pos.device)
        return (j[None, :] <= q_pos[:, None])[None, None].expand(batch, 1, -1, -1)
    m = mask[..., -n:] if mask.shape[-1] >= n else mask
    if m.dtype != torch.bool:
        m = m == 0
    return m[:, :1] if m.shape[1] != 1 else m


def first_real(allowed: torch.Tensor) -> torch.Tensor:
    """Per-row index of the first key any query may see (the first real token under left padding): int64 ``[B]``."""
    seen = allowed.any(dim=(1, 2))  # [B, n]
    idx = seen.float().argmax(-1)
    return torch.where(seen.any(-1), idx, torch.zeros_like(idx))


def rt_mask(q_pos: torch.Tensor, rt_start: int, length: int, sink_end: torch.Tensor, qstart: int, recent: int,
            block: int) -> torch.Tensor:
    """bool ``[B, 1, T, length]``: query ``t`` reads the round trip of key ``rt_start + l``."""
    j = torch.arange(rt_start, rt_start + length, device=q_pos.device)
    n = q_pos + 1
    qend = qstart + torch.clamp(n - recent - qstart, min=0) // block * block  # [T]
    m = (j[None, :] < qend[:, None])[None] & (j[None, None, :] >= sink_end.view(-1, 1, 1))
    return m[:, None]


def mixed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    k_rt: torch.Tensor | None = None,
    v_rt: torch.Tensor | None = None,
    use_rt: torch.Tensor | None = None,
    rt_start: int = 0,
    k_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over exact keys plus, where ``use_rt`` says so, round-tripped keys. This is the reference
    "attend over cache" step.

    q: ``[B, Hq, T, d]``; k, v: ``[B, Hkv, n_ex, d]`` exact rows at positions ``k_pos [n_ex]`` (default
    ``0 .. n_ex - 1``); allowed: bool ``[B, 1, T, n]`` over all ``n`` positions; k_rt, v_rt: ``[B, Hkv, L, d]`` round
    trips of positions ``rt_start .. rt_start + L``; use_rt: bool ``[B, 1, T, L]``. Every position a query may see must
    be among the exact rows or the round trips it uses. Returns ``[B, T, Hq, d]`` in ``q.dtype``.
    """
    n = allowed.shape[-1]
    ex_ok = allowed if k_pos is None else allowed.index_select(-1, k_pos)
    if k_rt is not None and k_rt.shape[2] > 0:
        L = k_rt.shape[2]
        sel = torch.zeros(allowed.shape[:-1] + (n,), dtype=torch.bool, device=allowed.device)
        sel[..., rt_start : rt_start + L] = use_rt
        ex_sel = sel if k_pos is None else sel.index_select(-1, k_pos)
        rt_ok = allowed[..., rt_start : rt_start + L] & use_rt
        mask = torch.cat([ex_ok & ~ex_sel, rt_ok], dim=-1)
        keys = torch.cat([k, k_rt.to(k.dtype)], dim=2)
        vals = torch.cat([v, v_rt.to(v.dtype)], dim=2)
    else:
        mask, keys, vals = ex_ok, k, v
    mask = mask | ~mask.any(-1, keepdim=True)  # fully masked (padding) queries: attend anywhere, stay finite
    gqa = q.shape[1] != keys.shape[1]
    outs = []
    for s in range(0, q.shape[2], QUERY_CHUNK):
        qc = q[:, :, s : s + QUERY_CHUNK]
        mc = mask[:, :, s : s + QUERY_CHUNK]
        outs.append(F.scaled_dot_product_attention(qc, keys, vals, attn_mask=mc, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., d]`` rounded to int8 steps of ``max |x| / 127`` each (the decode kernel's int8-scores query)."""
    step = x.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    return torch.round(x / step) * step


def int8_query(q: torch.Tensor, r_k: torch.Tensor | None) -> torch.Tensor:
    """``[q, round8(q R), q R]`` (``[B, Hq, T, 3d]``, fp32): the query against exact rows, then the rotated query
    rounded to int8 and exact, against :func:`int8_keys`' code and zero parts of the INT2 rows. ``r_k`` ``[h, d, d]``
    (h = 1 or the KV heads) or None."""
    qf = q.float()
    if r_k is None:
        qr = qf
    elif r_k.shape[0] == 1:
        qr = qf @ r_k[0].to(qf.device)
    else:
        b, hq, t, d = qf.shape
        h = r_k.shape[0]
        qr = (qf.view(b, h, hq // h, t, d) @ r_k.to(qf.device)[None, :, None]).view(b, hq, t, d)
    return torch.cat([qf, int8_rounded(qr), qr], -1)


def int8_keys(rows: quantizer.QuantizedRows) -> torch.Tensor:
    """INT2 key rows (rotated basis) as :func:`int8_query`'s INT2 part reads them: ``[0, k - z, z]``
    (``[..., 3d]``, fp32), so the score is ``round8(q').(k - z) + q'.z``: the code term from the rounded query, the
    zero term exact, as the kernel computes it."""
    z = rows.zero.float().repeat_interleave(rows.group, -1)
    k = quantizer.dequantize(rows)
    return torch.cat([torch.zeros_like(k), k - z, z], -1)


def int8_exact_keys(k: torch.Tensor) -> torch.Tensor:
    """Exact rows ``[..., d]`` padded to :func:`int8_query`'s width: ``[k, 0, 0]``."""
    return torch.cat([k, k.new_zeros(k.shape[:-1] + (2 * k.shape[-1],))], -1)


def int8_value_parts(rows: quantizer.QuantizedRows, lq: LayerQuant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """INT2 value rows (one scale per row) split as :func:`int8_values_attention` weighs them: the codes rotated back
    to the model basis ``c R_V^T`` (fp32 ``[..., d]``), the scales ``[...]`` and the zero rows ``z 1 R_V^T``
    (``[..., d]``); ``scale * codes + zeros`` is :func:`~oscar_cli.kvquant.dequantize_rows`."""
    if rows.zero.shape[-1] != 1:
        raise ValueError(f"int8 values need one value scale per row, got {rows.zero.shape[-1]} groups")
    codes = quantizer.dequantize(quantizer.QuantizedRows(rows.codes, torch.ones_like(rows.scale),
                                                         torch.zeros_like(rows.zero), rows.bits, rows.group))
    zeros = rows.zero.float().expand(codes.shape)
    if lq.r_v is not None:
        rt = lq.r_v.to(codes.device).transpose(-1, -2)
        codes, zeros = codes @ rt, zeros @ rt
    return codes, rows.scale[..., 0].float(), zeros


def _int8_value_weights(s: torch.Tensor, scale: torch.Tensor, m: torch.Tensor, first: int) -> torch.Tensor:
    """:func:`oscar_kernels.decode.int8_value_weights` over the last axis of scores ``s [..., L]`` (−inf where a
    query does not read the INT2 row), value scales ``scale`` broadcastable to it and row maxima ``m [..., 1]``: the
    INT2 list starts at column ``first`` (tiles of ``VALUE_TILE`` from there); each query's tile maximum and largest
    scale over the rows it reads."""
    from oscar_kernels.decode import VALUE_TILE, value_dither

    s, scale = s[..., first:], scale.expand(s.shape)[..., first:]
    n = s.shape[-1]
    pad = -n % VALUE_TILE
    st = F.pad(s, (0, pad), value=float("-inf")).unflatten(-1, (-1, VALUE_TILE))
    vs = F.pad(scale, (0, pad)).unflatten(-1, (-1, VALUE_TILE))
    read = st > float("-inf")
    tm = st.amax(-1, keepdim=True)
    vmax = torch.where(read, vs, torch.zeros_like(vs)).amax(-1, keepdim=True)
    ok = read & (vmax > 0)
    tm_safe = torch.where(tm > float("-inf"), tm, torch.zeros_like(tm))
    vm_safe = torch.where(vmax > 0, vmax, torch.ones_like(vmax))
    x = torch.exp(st - tm_safe) * (vs * (127.0 / vm_safe)) + value_dither(VALUE_TILE).to(s.device)
    w = torch.floor(x) * (vm_safe / 127.0) * torch.exp(tm_safe - m.unsqueeze(-1))
    w = torch.where(ok, w, torch.zeros_like(w)).flatten(-2)[..., :n]
    return F.pad(w, (first, 0))


def int8_values_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scaling: float, k_rt: torch.Tensor,
    v_parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], use_rt: torch.Tensor, rt_start: int,
    sink_end: torch.Tensor, k_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`mixed_attention` with the round-tripped value rows read as the decode kernel's ``int8_values`` reads
    them: each row's code term ``p * scale * (c R_V^T)`` weighed by :func:`oscar_kernels.decode.
    int8_value_weights` instead (per query and KV head: tiles of 128 INT2 rows from the row's first INT2 position
    ``sink_end[b]``), its zero term ``p * (z 1 R_V^T)`` and the exact rows by the probabilities, the softmax's sum of
    the probabilities. ``v_parts``: :func:`int8_value_parts` of the round trips (``[B, Hkv, L, ...]``). Explicit
    scores instead of SDPA (memory ``O(chunk · n)`` per head)."""
    vc, vs, vz = v_parts
    n = allowed.shape[-1]
    L = k_rt.shape[2]
    ex_ok = allowed if k_pos is None else allowed.index_select(-1, k_pos)
    sel = torch.zeros(allowed.shape[:-1] + (n,), dtype=torch.bool, device=allowed.device)
    sel[..., rt_start : rt_start + L] = use_rt
    ex_sel = sel if k_pos is None else sel.index_select(-1, k_pos)
    ex_mask = ex_ok & ~ex_sel
    rt_mask = allowed[..., rt_start : rt_start + L] & use_rt
    none = ~(ex_mask.any(-1, keepdim=True) | rt_mask.any(-1, keepdim=True))
    ex_mask = ex_mask | none  # fully masked (padding) queries: attend anywhere, stay finite
    g = q.shape[1] // k.shape[1]
    rep = (lambda t: t.repeat_interleave(g, 1)) if g > 1 else (lambda t: t)  # noqa: E731
    kf, vf, krf, vcf, vzf = (rep(t.float()) for t in (k, v, k_rt, vc, vz))
    vsf = rep(vs.float())[:, :, None, :]  # [B, Hq, 1, L]
    outs = []
    for s0 in range(0, q.shape[2], QUERY_CHUNK):
        qc = q[:, :, s0 : s0 + QUERY_CHUNK].float()
        s_ex = (qc @ kf.transpose(-1, -2)) * scaling
        s_ex = s_ex.masked_fill(~ex_mask[:, :, s0 : s0 + QUERY_CHUNK], float("-inf"))
        s_rt = (qc @ krf.transpose(-1, -2)) * scaling
        s_rt = s_rt.masked_fill(~rt_mask[:, :, s0 : s0 + QUERY_CHUNK], float("-inf"))
        m = torch.maximum(s_ex.amax(-1, keepdim=True), s_rt.amax(-1, keepdim=True))
        p_ex, p_rt = torch.exp(s_ex - m), torch.exp(s_rt - m)
        w = torch.cat([_int8_value_weights(s_rt[b : b + 1], vsf[b : b + 1], m[b : b + 1],
                                           int(sink_end[b]) - rt_start) for b in range(q.shape[0])])
        num = p_ex @ vf + w @ vcf + p_rt @ vzf
        outs.append(num / (p_ex.sum(-1, keepdim=True) + p_rt.sum(-1, keepdim=True)))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous().to(q.dtype)


def is_installed(model) -> bool:
    """True when ``model`` routes attention through :data:`ATTN_NAME`."""
    return getattr(model.config, "_attn_implementation", None) == ATTN_NAME


def decode_equivalent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scaling: float,
    lq: LayerQuant, scheme: QuantScheme, q_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Teacher-forced decode-equivalent attention over a full exact sequence. q ``[B, Hq, T, d]`` at positions
    ``q_pos`` (default: the last ``T`` of ``n``); k, v ``[B, Hkv, n, d]``; allowed bool ``[B, 1, T, n]``;
    ``scheme``: its sink and recent rows stay exact; ``lq.decode``: the int8 numerics emulated. Returns
    ``[B, T, Hq, d]``."""
    n, T = k.shape[2], q.shape[2]
    if q_pos is None:
        q_pos = torch.arange(n - T, n, device=q.device)
    sink_end = first_real(allowed) + scheme.sink
    qstart = int(sink_end.min())
    qend = qstart + quantized_count(int(q_pos.max()) + 1, qstart, scheme.recent, lq.token_block)
    if qend <= qstart:
        return mixed_attention(q, k, v, allowed, scaling)
    use = rt_mask(q_pos, qstart, qend - qstart, sink_end, qstart, scheme.recent, lq.token_block)
    if lq.decode.int8_values:
        v_parts = int8_value_parts(quantize_rows(v[:, :, qstart:qend], lq, "v"), lq)
        if lq.decode.int8_scores:
            q8, k8 = int8_query(q, lq.r_k), int8_exact_keys(k)
            k_rt = int8_keys(quantize_rows(k[:, :, qstart:qend], lq, "k"))
            return int8_values_attention(q8, k8, v, allowed, scaling, k_rt, v_parts, use, qstart, sink_end).to(q.dtype)
        k_rt = roundtrip(k[:, :, qstart:qend], lq, "k")
        return int8_values_attention(q, k, v, allowed, scaling, k_rt, v_parts, use, qstart, sink_end)
    v_rt = roundtrip(v[:, :, qstart:qend], lq, "v")
    if lq.decode.int8_scores:
        k_rt = int8_keys(quantize_rows(k[:, :, qstart:qend], lq, "k"))
        return mixed_attention(int8_query(q, lq.r_k).to(q.dtype), int8_exact_keys(k), v, allowed, scaling, k_rt,
                               v_rt, use, qstart)
    k_rt = roundtrip(k[:, :, qstart:qend], lq, "k")
    return mixed_attention(q, k, v, allowed, scaling, k_rt, v_rt, use, qstart)


def oscar_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered transformers attention function (signature of ``sdpa_attention_forward``)."""
    scaling = module.scaling if scaling is None else scaling
    if isinstance(key, CachedKV):
        return key.layer.attend(query, attention_mask, scaling), None
    n, T = key.shape[2], query.shape[2]
    q_pos = torch.arange(n - T, n, device=query.device)
    allowed = to_bool_mask(attention_mask, query.shape[0], q_pos, n)
    state = getattr(module, _STATE, None)
    if state is None:
        return mixed_attention(query, key, value, allowed, scaling), None
    lq, scheme = state
    return decode_equivalent(query, key, value, allowed, scaling, lq, scheme, q_pos), None
