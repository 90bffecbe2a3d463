"""Per-layer quantizers for a method at a scheme, the rotate + quantize seam, and the storage accounting.

:func:`build_layer_quants` turns a :class:`~oscar_cli.methods.Method` and the
:class:`~oscar_kernels.scheme.QuantScheme` it runs with into one :class:`LayerQuant` per model layer (the tensors:
rotations, clip ratios, bits, grouping) or ``None`` for a layer kept exact. :func:`quantize_rows` /
:func:`dequantize_rows` are the torch reference of what the kernels in ``oscar_kernels`` do.

Storage accounting (:func:`bits_per_element`): every K or V element costs its code plus its share of the fp16
scale and zero, exact (sink, recent, unquantized layer) elements cost the exact dtype; the result equals the bytes
an :class:`oscar_cli.cache.OscarCache` actually holds × 8 / elements.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from oscar_kernels.scheme import DecodeOptions, QuantScheme

from . import quantizer
from .methods import KIVI_GROUP, Method, MethodError, Rotation
from .rotation import data_free

EXACT = 16
"""A :class:`LayerQuant` width that keeps that kind's rows exact (sensitivity probes: only the other kind
quantized)."""


@dataclass(frozen=True)
class LayerQuant:
    """How one layer's K/V rows are stored and read. ``bits_k``/``bits_v``: the key and value code widths (2 or 4;
    :data:`EXACT` keeps that kind exact); ``r_k``/``r_v``: fp32 ``[h, d, d]`` (h = 1 or kv heads) or None
    for no rotation; ``clip_k``/``clip_v``: fp32 ``[h]``; ``meta``: the scale/zero storage (``fp16`` | ``fp8``) with
    ``mult_k``/``mult_v`` fp32 ``[h]`` the fitted FP8 multipliers (None: taken from the rows each write);
    ``center_k``: fp32 ``[H, d]`` the key center subtracted before quantizing and added back after (the same as
    centering every key row: softmax ignores the per-query shift), or None; ``levels_k``/``levels_v``: fp32 ``[H, 4]``
    fitted levels of that kind's 2-bit codes (None: uniform); ``split_k``: the leading rotated key channels stored as
    4-bit codes, the rest 2-bit (0: not split; ``bits_k`` is then 2), with ``clip_k_hi``/``mult_k_hi`` ``[h]``/``[H]``
    the 4-bit part's clip and FP8 multiplier (``clip_k``/``mult_k``: the 2-bit part's);
    ``token_block``: tokens quantized together (32 for per-channel keys, else 1) — the quantized region always
    grows by whole blocks. ``decode``: the decode kernel's options; the reference attention emulates their numerics
    (``int8_scores``: the INT2 rows' scores from each query rounded to int8 in the rotated basis,
    :func:`oscar_cli.attention.int8_query` and :func:`~oscar_cli.attention.int8_keys`; ``int8_values``: the INT2
    rows' value code terms weighed by probabilities rounded to int8 steps per 128-row tile, row scales only,
    :func:`oscar_cli.attention.int8_values_attention`)."""

    bits_k: int
    bits_v: int
    group: int
    r_k: torch.Tensor | None
    r_v: torch.Tensor | None
    clip_k: torch.Tensor
    clip_v: torch.Tensor
    key_axis: str = "token"
    key_group: int = 0
    decode: DecodeOptions = DecodeOptions()
    meta: str = "fp16"
    mult_k: torch.Tensor | None = None
    mult_v: torch.Tensor | None = None
    center_k: torch.Tensor | None = None
    levels_k: torch.Tensor | None = None
    levels_v: torch.Tensor | None = None
    split_k: int = 0
    clip_k_hi: torch.Tensor | None = None
    mult_k_hi: torch.Tensor | None = None

    @property
    def token_block(self) -> int:
        return self.key_group if self.key_axis == "channel" else 1

    def width(self, which: str) -> int:
        return self.bits_k if which == "k" else self.bits_v

    def to(self, device: torch.device | str) -> LayerQuant:
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, r_k=mv(self.r_k), r_v=mv(self.r_v), clip_k=mv(self.clip_k), clip_v=mv(self.clip_v),
                       mult_k=mv(self.mult_k), mult_v=mv(self.mult_v), center_k=mv(self.center_k),
                       levels_k=mv(self.levels_k), levels_v=mv(self.levels_v), clip_k_hi=mv(self.clip_k_hi),
                       mult_k_hi=mv(self.mult_k_hi))


def build_layer_quants(method: Method, scheme: QuantScheme, n_layers: int, head_dim: int, kv_heads: int,
                       artifact=None) -> list[LayerQuant | None]:
    """One :class:`LayerQuant` per model layer (None = exact) for ``method`` at ``scheme`` (see
    :func:`oscar_cli.methods.scheme_for`). ``artifact``: an :class:`oscar_cli.artifact.Artifact` for artifact methods;
    its layers not listed stay exact, its head count must be 1 or ``kv_heads``."""
    if method.family == "exact":
        return [None] * n_layers
    if method.family == "hf":
        raise MethodError(f"{method.name} is a transformers QuantizedCache; it has no decode-equivalent attention")
    group = scheme.check_split(head_dim)
    scheme.check_layers(n_layers)
    if not method.decode.exact and scheme.split:
        raise MethodError(f"{method.label} emulates the decode kernel's int8 numerics, which read one key group per "
                          "row; the scheme splits key rows: use oscar")
    if not method.decode.exact and scheme.scale_dtype != "fp16":
        raise MethodError(f"{method.label} emulates the decode kernel's int8 numerics, which read fp16 scales; the "
                          f"scheme stores {scheme.scale_dtype}: use oscar")
    if method.decode.int8_values and group != head_dim:
        raise MethodError(f"{method.label} needs one value scale per row (group {head_dim}); the scheme's group is "
                          f"{group}: drop the group override or use oscar-int8")
    one = torch.ones(1)
    if method.rotation is not None:
        r = data_free_rotation(method.rotation, head_dim, group)
        r = None if r is None else r.float()[None]
        table = quantizer.gaussian_table(group).view(1, 4) if scheme.levels == "gaussian" else None
        return [LayerQuant(scheme.width(i, "k"), scheme.width(i, "v"), group, r, r, one * method.clip[0],
                           one * method.clip[1], method.key_axis, KIVI_GROUP if method.key_axis == "channel" else 0,
                           method.decode, scheme.scale_dtype, levels_k=table, levels_v=table) for i in range(n_layers)]
    if artifact is None:
        raise MethodError(f"{method.label} needs an artifact: pass --artifact latest|vN|PATH or {method.name}@REF")
    shape = artifact.manifest.shape
    if shape.head_dim != head_dim or artifact.heads not in (1, kv_heads) or shape.n_layers != n_layers:
        raise MethodError(
            f"artifact {artifact.name} was fitted for {shape.n_layers} layers of {shape.n_kv_heads} KV heads x dim "
            f"{shape.head_dim}, but the model has {n_layers} x {kv_heads} x {head_dim}; fit an artifact for this model"
        )
    out: list[LayerQuant | None] = []
    for i in range(n_layers):
        lr = artifact.layer(i)
        if lr is None:
            out.append(None)
            continue
        h = lr.r_k.shape[0]
        split = scheme.split_of(i)
        ck_hi = lr.clip_k_hi.float() if split else None
        if method.clip is None:
            ck, cv = lr.clip_k.float(), lr.clip_v.float()
        else:
            ck, cv = torch.full((h,), method.clip[0]), torch.full((h,), method.clip[1])
            ck_hi = ck if split else None
        out.append(LayerQuant(scheme.width(i, "k"), scheme.width(i, "v"), group, lr.r_k.float(), lr.r_v.float(), ck,
                              cv, decode=method.decode, meta=scheme.scale_dtype, mult_k=lr.mult_k, mult_v=lr.mult_v,
                              center_k=lr.center_k if scheme.center_keys else None,
                              levels_k=lr.levels_k if scheme.levels == "fitted" else None,
                              levels_v=lr.levels_v if scheme.levels == "fitted" else None,
                              split_k=split, clip_k_hi=ck_hi, mult_k_hi=lr.mult_k_hi if split else None))
    return out


def data_free_rotation(rotation: Rotation, head_dim: int, group: int) -> torch.Tensor | None:
    """The matrix of a data-free rotation recipe (:attr:`~oscar_cli.methods.Rotation.data_free`) at ``head_dim``
    with Hadamard blocks of ``group``: float64 ``[d, d]``, or None for the identity (rows are stored unrotated)."""
    if not rotation.data_free:
        raise MethodError(f"rotation {rotation.name} is fitted from calibration statistics; load it from an artifact")
    if rotation.is_identity:
        return None
    return data_free(head_dim, group, use_p=rotation.use_p, use_h=rotation.use_h, random_signs=rotation.random_signs)


# ----------------------------------------------------------------------------------------------------------------
# The seam: rotate + quantize + pack rows, and the inverse (the torch reference of oscar_kernels.quantize_pack).


def quantize_rows(x: torch.Tensor, lq: LayerQuant, which: str) -> quantizer.QuantizedRows | quantizer.SplitRows:
    """Rotate, clip, quantize and pack rows. x: float ``[B, H, N, d]`` in the model basis (``N`` a multiple of
    ``lq.token_block`` for per-channel keys). Returns packed rows in the rotated basis: codes uint8
    ``[B, H, N, d*bits/8]`` (per-channel keys: ``[B, H, N/32, d, 32*bits/8]``), scale/zero per group; split keys
    (``lq.split_k``): :class:`~oscar_cli.quantizer.SplitRows`."""
    r, clip = (lq.r_k, lq.clip_k) if which == "k" else (lq.r_v, lq.clip_v)
    bits = lq.width(which)
    if bits == EXACT:
        raise ValueError(f"the layer's {which} rows are exact; nothing to quantize")
    mult = lq.mult_k if which == "k" else lq.mult_v
    xf = x.float()
    if which == "k" and lq.center_k is not None:
        xf = xf - lq.center_k.to(xf.device)[:, None, :]
    if r is not None:
        xf = xf @ r.to(xf.device)
    if which == "k" and lq.split_k:
        hi_mult = None if lq.mult_k_hi is None else lq.mult_k_hi.view(-1, 1, 1)
        return quantizer.quantize_split(xf, lq.split_k, lq.clip_k_hi.to(xf.device).view(-1, 1, 1),
                                        clip.to(xf.device).view(-1, 1, 1), lq.meta, hi_mult,
                                        None if mult is None else mult.view(-1, 1, 1))
    if which == "k" and lq.key_axis == "channel":
        b, h, n, d = xf.shape
        xf = xf.view(b, h, n // lq.key_group, lq.key_group, d).transpose(-1, -2)  # [B, H, nb, d, 32]
        view = (-1, 1, 1, 1)
        return quantizer.quantize(xf, clip.to(xf.device).view(*view), bits, lq.key_group, lq.meta,
                                  None if mult is None else mult.view(*view))
    levels = lq.levels_k if which == "k" else lq.levels_v
    table = None if levels is None or bits != 2 else levels.view(levels.shape[0], 1, 1, -1)
    return quantizer.quantize(xf, clip.to(xf.device).view(-1, 1, 1), bits, lq.group, lq.meta,
                              None if mult is None else mult.view(-1, 1, 1), table)


def dequantize_rows(q: quantizer.QuantizedRows | quantizer.SplitRows, lq: LayerQuant, which: str) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: fp32 ``[B, H, N, d]`` rotated back to the model basis."""
    x = quantizer.dequantize(q)
    if which == "k" and lq.key_axis == "channel":
        x = x.transpose(-1, -2).flatten(-3, -2)
    r = lq.r_k if which == "k" else lq.r_v
    if r is not None:
        x = x @ r.to(x.device).transpose(-1, -2)
    if which == "k" and lq.center_k is not None:
        x = x + lq.center_k.to(x.device)[:, None, :]
    return x


def roundtrip(x: torch.Tensor, lq: LayerQuant, which: str) -> torch.Tensor:
    """What a decoder reads back for rows ``x [B, H, N, d]``: fp32, model basis (the rows themselves where that kind
    is :data:`EXACT`)."""
    if lq.width(which) == EXACT:
        return x.float()
    return dequantize_rows(quantize_rows(x, lq, which), lq, which)


# ----------------------------------------------------------------------------------------------------------------
# Accounting


def quantized_count(n: int, start: int, recent: int, block: int) -> int:
    """Tokens ``[start, start + count)`` held quantized when a row has ``n`` tokens: everything between the exact
    head and the last ``recent`` tokens, in whole blocks of ``block`` tokens."""
    return max(0, (n - recent - start) // block * block)


def bits_per_element(method: Method, scheme: QuantScheme, seq_len: int, head_dim: int,
                     layers_quantized: int | None = None, n_layers: int = 1, exact_bits: int = 16,
                     quantized_layers=None, tokens=None) -> float:
    """Average storage bits of one K/V element for a sequence of ``seq_len`` tokens (no padding); with an
    allocation, ``quantized_layers`` (model layer indices) selects the widths averaged, weighted by ``tokens[layer]``
    (the rows each layer holds; default equal).

    Quantized elements cost their code width (the scheme's allocation averaged over K, V and the layers) plus the
    scale and zero per group (:meth:`~oscar_kernels.scheme.QuantScheme.bits_per_element`), exact ones ``exact_bits``;
    layers not quantized (``n_layers - layers_quantized``) are exact. Equals ``OscarCache.nbytes() * 8 / elements``.
    """
    if method.family == "exact":
        return float(exact_bits)
    start = min(scheme.sink, seq_len)
    block = KIVI_GROUP if method.key_axis == "channel" else 1
    nq = quantized_count(seq_len, start, scheme.recent, block)
    q_bits = scheme.bits_per_element(head_dim, quantized_layers, tokens)
    per_layer = (nq * q_bits + (seq_len - nq) * exact_bits) / seq_len
    lq = n_layers if layers_quantized is None else layers_quantized
    return (lq * per_layer + (n_layers - lq) * exact_bits) / n_layers
