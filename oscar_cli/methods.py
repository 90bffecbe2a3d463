"""KV-cache methods: one registry, used by the cache, the decode-equivalent attention, perplexity and lm-eval.

A method name resolves to a :class:`Method` (what to do) and, for a given model, to one :class:`LayerQuant` per
layer (the tensors to do it with: rotations, clip ratios, bits, grouping) or ``None`` for a layer kept exact.

Names (``NAME`` or ``NAME@ARG``):

* ``bf16``: no quantization (the model dtype).
* ``int2-naive`` / ``int4-naive``: per-token rows, no rotation, no clipping.
* ``int2-kivi``: KIVI — keys per channel over blocks of 32 tokens, values per token in groups of 32 channels,
  full-precision residual of 128 tokens and no sink (its own windows override ``--sink/--recent``).
* ``int2-hadamard`` / ``int4-hadamard``: data-free random-sign Hadamard ``S·H``, no clipping.
* ``int2-hadamard-clip`` / ``int4-hadamard-clip``: the same with fixed clip ratios, ``@K/V`` to override
  (default ``@0.96/0.92``).
* ``oscar`` / ``int4-oscar``: rotations and fitted clip ratios of an artifact (``@REF`` picks one: ``latest``,
  ``v3``, a path; otherwise ``--artifact``). The artifact's own fit method (``oscar``, ``oscar-uh``, ``kcov`` ...)
  is the ablation; ``oscar-noclip@REF`` uses its rotations with clip ratio 1.
* ``hf-quantized`` (``hf-hqq``, ``hf-quanto``): transformers' ``QuantizedCache`` at 2 bits, the external peer;
  only through the cache (token-by-token decoding), and only where its backend package is installed.

Storage accounting (:func:`bits_per_element`): every K or V element costs its code plus its share of the fp16
scale and zero, exact (sink, recent, unquantized layer) elements cost the exact dtype; the result equals the bytes
an :class:`oscar_cli.cache.OscarCache` actually holds × 8 / elements.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

import torch

from . import quantizer
from .errors import OscarError

DEFAULT_HADAMARD_CLIP = (0.96, 0.92)
"""Fixed (key, value) clip ratios of ``*-hadamard-clip`` (a data-free baseline: the same pair for every model)."""
HADAMARD_SEED = 0
"""Seed of the random signs of the data-free Hadamard rotation (fixed so that results are reproducible)."""
KIVI_GROUP = 32
KIVI_RESIDUAL = 128


class MethodError(OscarError):
    """An unknown or unusable method name."""


@dataclass(frozen=True)
class Method:
    """What a method does. ``rotation``: ``none`` | ``hadamard`` | ``artifact``; ``key_axis``: ``token`` | ``channel``
    (KIVI keys); ``group``: quantization group (0 = one group per head row); ``sink``/``recent``: window overrides
    (None = the caller's); ``arg``: the part after ``@`` (artifact ref or clip ratios)."""

    name: str
    family: str  # "exact" | "quant" | "hf"
    bits: int = 16
    rotation: str = "none"
    clip: tuple[float, float] | None = (1.0, 1.0)  # None = the artifact's fitted ratios
    key_axis: str = "token"
    group: int = 0
    sink: int | None = None
    recent: int | None = None
    backend: str | None = None
    arg: str | None = None
    help: str = ""

    @property
    def label(self) -> str:
        return self.name if self.arg is None else f"{self.name}@{self.arg}"

    @property
    def needs_artifact(self) -> bool:
        return self.rotation == "artifact"

    @property
    def cache_only(self) -> bool:
        """True when the method exists only as a cache (no decode-equivalent attention)."""
        return self.family == "hf"


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("bf16", "exact", help="no quantization (model dtype)"),
        Method("int2-naive", "quant", 2, help="per-token INT2, no rotation, no clip"),
        Method("int4-naive", "quant", 4, help="per-token INT4, no rotation, no clip"),
        Method(
            "int2-kivi", "quant", 2, key_axis="channel", group=KIVI_GROUP, sink=0, recent=KIVI_RESIDUAL,
            help="KIVI: per-channel keys, per-token values, group 32, residual 128",
        ),
        Method("int2-hadamard", "quant", 2, rotation="hadamard", help="random-sign Hadamard, no clip"),
        Method("int4-hadamard", "quant", 4, rotation="hadamard", help="random-sign Hadamard, no clip"),
        Method("int2-hadamard-clip", "quant", 2, rotation="hadamard", clip=DEFAULT_HADAMARD_CLIP,
               help="random-sign Hadamard, fixed clip @K/V (default 0.96/0.92)"),
        Method("int4-hadamard-clip", "quant", 4, rotation="hadamard", clip=DEFAULT_HADAMARD_CLIP,
               help="random-sign Hadamard INT4, fixed clip @K/V"),
        Method("oscar", "quant", 2, rotation="artifact", clip=None, help="artifact rotations + fitted clip (@REF)"),
        Method("oscar-noclip", "quant", 2, rotation="artifact", help="artifact rotations, no clip (@REF)"),
        Method("int4-oscar", "quant", 4, rotation="artifact", clip=None, help="artifact rotations + clip at INT4"),
        Method("hf-quantized", "hf", 2, backend="auto", help="transformers QuantizedCache, HQQ or quanto, 2 bits"),
        Method("hf-hqq", "hf", 2, backend="hqq", help="transformers QuantizedCache, HQQ backend, 2 bits"),
        Method("hf-quanto", "hf", 2, backend="quanto", help="transformers QuantizedCache, quanto backend, 2 bits"),
    ]
}


def _parse_clip(arg: str, name: str) -> tuple[float, float]:
    try:
        parts = [float(p) for p in arg.split("/")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(0 < p <= 1 for p in parts):
        raise MethodError(f"{name}@{arg}: clip ratios must be K/V in (0, 1], e.g. {name}@0.96/0.92")
    return parts[0], parts[1]


def get_method(spec: str) -> Method:
    """``"int2-hadamard-clip@0.9/0.85"`` -> :class:`Method` (unknown names raise :class:`MethodError`)."""
    name, _, arg = spec.strip().partition("@")
    if name not in METHODS:
        raise MethodError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    m = METHODS[name]
    if not arg:
        return m
    if m.rotation == "artifact":
        return replace(m, arg=arg)
    if name.endswith("-clip"):
        return replace(m, clip=_parse_clip(arg, name), arg=arg)
    raise MethodError(f"method {name} takes no @argument (got {spec!r})")


def parse_methods(spec: str) -> list[Method]:
    """Comma-separated names -> methods (at least one; duplicates removed in order)."""
    out, seen = [], set()
    for part in spec.split(","):
        if part.strip() and part.strip() not in seen:
            seen.add(part.strip())
            out.append(get_method(part))
    if not out:
        raise MethodError("--methods is empty; pass e.g. bf16,int2-naive,int2-hadamard,oscar")
    return out


def hf_backend(method: Method) -> str:
    """The QuantizedCache backend to use (``hqq`` or ``quanto``), or a one-line error naming the package."""
    have = {"hqq": importlib.util.find_spec("hqq") is not None}
    try:
        have["quanto"] = importlib.util.find_spec("optimum.quanto") is not None
    except ModuleNotFoundError:
        have["quanto"] = False
    if method.backend == "auto":
        for b in ("hqq", "quanto"):
            if have[b]:
                return b
        raise MethodError(f"{method.name} needs the hqq or optimum-quanto package: pip install hqq (optional peer)")
    if not have[method.backend]:
        pkg = "hqq" if method.backend == "hqq" else "optimum-quanto"
        raise MethodError(f"{method.name} needs the {pkg} package: pip install {pkg} (optional peer)")
    return method.backend


# ----------------------------------------------------------------------------------------------------------------
# Per-layer quantizers


@dataclass(frozen=True)
class LayerQuant:
    """How one layer's K/V rows are stored. ``r_k``/``r_v``: fp32 ``[h, d, d]`` (h = 1 or kv heads) or None for no
    rotation; ``clip_k``/``clip_v``: fp32 ``[h]``; ``token_block``: tokens quantized together (32 for per-channel
    keys, else 1) — the quantized region always grows by whole blocks."""

    bits: int
    group: int
    r_k: torch.Tensor | None
    r_v: torch.Tensor | None
    clip_k: torch.Tensor
    clip_v: torch.Tensor
    key_axis: str = "token"
    key_group: int = 0

    @property
    def token_block(self) -> int:
        return self.key_group if self.key_axis == "channel" else 1

    def to(self, device: torch.device | str) -> LayerQuant:
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, r_k=mv(self.r_k), r_v=mv(self.r_v), clip_k=mv(self.clip_k), clip_v=mv(self.clip_v))


@dataclass(frozen=True)
class Windows:
    """Exact windows: the first ``sink`` real tokens and the last ``recent`` tokens of every row."""

    sink: int
    recent: int

    def __post_init__(self) -> None:
        if self.sink < 0 or self.recent < 0:
            raise OscarError(f"--sink and --recent must be non-negative (got {self.sink}, {self.recent})")


def windows_for(method: Method, sink: int, recent: int) -> Windows:
    """The windows a method runs with: its own overrides (KIVI) or the caller's."""
    return Windows(method.sink if method.sink is not None else sink, method.recent if method.recent is not None else recent)


def _hadamard(d: int, group: int) -> torch.Tensor:
    from .rotation import compose

    return compose(torch.eye(d, dtype=torch.float64), use_u=False, use_p=False, use_h=True, group=group,
                   signs_seed=HADAMARD_SEED).float()


def build_layer_quants(
    method: Method, n_layers: int, head_dim: int, kv_heads: int, artifact=None
) -> list[LayerQuant | None]:
    """One :class:`LayerQuant` per model layer (None = exact). ``artifact``: an :class:`oscar_cli.artifact.Artifact`
    for artifact methods; its layers not listed stay exact, its head count must be 1 or ``kv_heads``."""
    if method.family == "exact":
        return [None] * n_layers
    if method.family == "hf":
        raise MethodError(f"{method.name} is a transformers QuantizedCache; it has no decode-equivalent attention")
    group = method.group or head_dim
    if head_dim % group or group % (8 // method.bits):
        raise MethodError(f"{method.label}: group {group} does not divide the head dim {head_dim}")
    one = torch.ones(1)
    if method.rotation == "none":
        base = LayerQuant(method.bits, group, None, None, one * method.clip[0], one * method.clip[1],
                          method.key_axis, KIVI_GROUP if method.key_axis == "channel" else 0)
        return [base] * n_layers
    if method.rotation == "hadamard":
        h = _hadamard(head_dim, group)[None]
        base = LayerQuant(method.bits, group, h, h, one * method.clip[0], one * method.clip[1])
        return [base] * n_layers
    if artifact is None:
        raise MethodError(f"{method.label} needs an artifact: pass --artifact latest|vN|PATH or {method.name}@REF")
    out: list[LayerQuant | None] = []
    for i in range(n_layers):
        lr = artifact.layer(i)
        if lr is None:
            out.append(None)
            continue
        h, d = lr.r_k.shape[0], lr.r_k.shape[-1]
        if d != head_dim or h not in (1, kv_heads):
            raise MethodError(
                f"artifact {artifact.name} has rotations [{h}, {d}, {d}] but the model has {kv_heads} KV heads of "
                f"dim {head_dim}; fit an artifact for this model"
            )
        if method.clip is None:
            ck, cv = lr.clip_k.float(), lr.clip_v.float()
        else:
            ck, cv = torch.full((h,), method.clip[0]), torch.full((h,), method.clip[1])
        art_group = artifact.quant.group_for(head_dim)
        out.append(LayerQuant(method.bits, art_group, lr.r_k.float(), lr.r_v.float(), ck, cv))
    return out


# ----------------------------------------------------------------------------------------------------------------
# The seam: rotate + quantize + pack rows, and the inverse.  (On CUDA the oscar_kernels versions slot in here.)


def _ratio(clip: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-head clip ``[h]`` -> broadcastable to per-group bounds of ``x [B, H, N, d]`` -> ``[h, 1, 1]``."""
    return clip.to(x.device).view(-1, 1, 1)


def quantize_rows(x: torch.Tensor, lq: LayerQuant, which: str) -> quantizer.QuantizedRows:
    """Rotate, clip, quantize and pack rows. x: float ``[B, H, N, d]`` in the model basis (``N`` a multiple of
    ``lq.token_block`` for per-channel keys). Returns packed rows in the rotated basis: codes uint8
    ``[B, H, N, d*bits/8]`` (per-channel keys: ``[B, H, N/32, d, 32*bits/8]``), fp16 scale/zero per group."""
    r, clip = (lq.r_k, lq.clip_k) if which == "k" else (lq.r_v, lq.clip_v)
    xf = x.float()
    if r is not None:
        xf = xf @ r.to(xf.device)
    if which == "k" and lq.key_axis == "channel":
        b, h, n, d = xf.shape
        xf = xf.view(b, h, n // lq.key_group, lq.key_group, d).transpose(-1, -2)  # [B, H, nb, d, 32]
        return quantizer.quantize(xf, clip.to(xf.device).view(-1, 1, 1, 1), lq.bits, lq.key_group)
    return quantizer.quantize(xf, _ratio(clip, xf), lq.bits, lq.group)


def dequantize_rows(q: quantizer.QuantizedRows, lq: LayerQuant, which: str) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: fp32 ``[B, H, N, d]`` rotated back to the model basis."""
    x = quantizer.dequantize(q)
    if which == "k" and lq.key_axis == "channel":
        x = x.transpose(-1, -2).flatten(-3, -2)
    r = lq.r_k if which == "k" else lq.r_v
    if r is not None:
        x = x @ r.to(x.device).transpose(-1, -2)
    return x


def roundtrip(x: torch.Tensor, lq: LayerQuant, which: str) -> torch.Tensor:
    """What a decoder reads back for rows ``x [B, H, N, d]``: fp32, model basis."""
    return dequantize_rows(quantize_rows(x, lq, which), lq, which)


# ----------------------------------------------------------------------------------------------------------------
# Accounting


def quantized_count(n: int, start: int, recent: int, block: int) -> int:
    """Tokens ``[start, start + count)`` held quantized when a row has ``n`` tokens: everything between the exact
    head and the last ``recent`` tokens, in whole blocks of ``block`` tokens."""
    return max(0, (n - recent - start) // block * block)


def bits_per_element(
    method: Method,
    seq_len: int,
    head_dim: int,
    sink: int,
    recent: int,
    layers_quantized: int | None = None,
    n_layers: int = 1,
    exact_bits: int = 16,
    group: int | None = None,
) -> float:
    """Average storage bits of one K/V element for a sequence of ``seq_len`` tokens (no padding).

    Quantized elements cost ``bits + 32 / group`` (fp16 scale and zero per group), exact ones ``exact_bits``; layers
    not quantized (``n_layers - layers_quantized``) are exact. Equals ``OscarCache.nbytes() * 8 / elements``.
    """
    if method.family == "exact":
        return float(exact_bits)
    w = windows_for(method, sink, recent)
    start = min(w.sink, seq_len)
    block = KIVI_GROUP if method.key_axis == "channel" else 1
    nq = quantized_count(seq_len, start, w.recent, block)
    g = group or method.group or head_dim
    q_bits = quantizer.bits_per_element(method.bits, g if method.key_axis != "channel" else KIVI_GROUP)
    per_layer = (nq * q_bits + (seq_len - nq) * exact_bits) / seq_len
    lq = n_layers if layers_quantized is None else layers_quantized
    return (lq * per_layer + (n_layers - lq) * exact_bits) / n_layers
