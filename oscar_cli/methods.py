"""The one registry of methods: rotation recipes (how ``oscar fit`` builds rotations) and KV-cache methods (how
``oscar eval`` and serving treat the cache), and how each KV method's quant scheme is decided.

Rotation recipes (:class:`Rotation`, :data:`ROTATIONS`; ``oscar fit --method NAME``): how ``R = [S]·[U]·[P]·[H]`` is
built for keys and for values. ``identity`` and ``hadamard`` are data-free (no statistics); the others fit
eigenbases from a calibration run. An artifact records the recipe it was fitted with.

KV-cache methods (:class:`Method`, :data:`METHODS`; ``oscar eval --methods NAME[@ARG],...``): what a cache stores.
A method with a data-free rotation refers to its :data:`ROTATIONS` entry; an artifact method reads the rotations
(and clip ratios) the artifact holds. :func:`scheme_for` gives the :class:`~oscar_kernels.scheme.QuantScheme` a
method runs with, and :mod:`oscar_cli.kvquant` turns method + scheme into per-layer quantizers.

* ``bf16``: no quantization (the model dtype).
* ``int2-naive`` / ``int4-naive``: per-token rows, rotation ``identity``, no clipping.
* ``int2-kivi``: KIVI — keys per channel over blocks of 32 tokens, values per token in groups of 32 channels,
  full-precision residual of 128 tokens and no sink (its own sink/recent: ``--sink/--recent`` do not apply to it).
* ``int2-hadamard`` / ``int4-hadamard``: rotation ``hadamard`` (data-free random-sign ``S·H``), no clipping.
* ``int2-hadamard-gauss``: TurboQuant-style data-free baseline: ``hadamard`` with the Gaussian Lloyd-Max levels
  (:func:`oscar_cli.quantizer.gaussian_table`) instead of uniform ones.
* ``int2-hadamard-clip`` / ``int4-hadamard-clip``: the same with fixed clip ratios, ``@K/V`` to override
  (default ``@0.96/0.92``).
* ``oscar``: rotations, fitted clip ratios AND quant scheme of an artifact (``@REF`` picks one: ``latest``, ``v3``,
  a path, ``fit:ROTATION[+per-head]``; otherwise ``--artifact``): a 4-bit artifact runs at 4 bits. The artifact's
  own rotation recipe (``oscar``, ``oscar-uh``, ``kcov`` ...) is the ablation; ``oscar-noclip@REF`` uses its
  rotations with clip ratio 1.
* ``oscar-int8`` / ``oscar-int8-pv``: ``oscar`` read with the decode kernel's int8 numerics
  (:class:`~oscar_kernels.scheme.DecodeOptions` ``int8_scores``, and ``int8_values``).
* ``hf-quantized`` (``hf-hqq``, ``hf-quanto``): transformers' ``QuantizedCache`` at 2 bits, the external peer;
  only through the cache (token-by-token decoding), and only where its backend package is installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

from oscar_kernels.scheme import DecodeOptions, QuantScheme, SchemeError

from .errors import OscarError

DEFAULT_HADAMARD_CLIP = (0.96, 0.92)
"""Fixed (key, value) clip ratios of ``*-hadamard-clip`` (a data-free baseline: the same pair for every model)."""
KIVI_GROUP = 32
KIVI_RESIDUAL = 128


class MethodError(OscarError):
    """An unknown or unusable method name, or a scheme override a method cannot run with."""


# ----------------------------------------------------------------------------------------------------------------
# Rotation recipes


@dataclass(frozen=True)
class Rotation:
    """How ``R = [S]·[U]·[P]·[H]`` is built for keys and for values.

    ``key_basis``: ``q`` = eigenbasis of C_Q; ``q@k`` = eigenbasis of C_Q anchored on the leading direction of C_K
    (the keys' shared offset goes to the Hadamard's constant row, where the zero point absorbs it; see
    ``rotation.anchored_eigh``); ``k`` = eigenbasis of C_K; None = no eigenbasis. ``value_basis``: ``s`` = the
    score-weighted C_S, ``o`` = the attention-output covariance C_O, ``v`` = C_V. ``use_p``/``use_h``: the
    bit-reversal placement and the Hadamard; ``random_signs``: the random sign flips ``S`` (seeded by
    ``rotation.HADAMARD_SEED``)."""

    name: str
    key_basis: str | None
    value_basis: str | None
    use_p: bool
    use_h: bool
    random_signs: bool
    help: str

    @property
    def data_free(self) -> bool:
        """True when no calibration statistics enter the rotation (no eigenbasis)."""
        return self.key_basis is None and self.value_basis is None

    @property
    def is_identity(self) -> bool:
        """True when R is the identity (no factor at all)."""
        return self.data_free and not (self.use_p or self.use_h or self.random_signs)


ROTATIONS: dict[str, Rotation] = {r.name: r for r in [
    Rotation("identity", None, None, False, False, False, "no rotation"),
    Rotation("hadamard", None, None, False, True, True, "random-sign Hadamard (data-free)"),
    Rotation("oscar", "q@k", "s", True, True, False, "U(C_Q anchored on C_K)·P·H keys, U(C_S)·P·H values"),
    Rotation("oscar-uh", "q@k", "s", False, True, False, "oscar without the placement P"),
    Rotation("oscar-u", "q@k", "s", False, False, False, "oscar eigenbases only (no P, no H)"),
    Rotation("oscar-q", "q", "s", True, True, False, "plain U(C_Q)·P·H keys (the reference's basis)"),
    Rotation("oscar-out", "q@k", "o", True, True, False, "oscar keys, U(C_O)·P·H values"),
    Rotation("kcov", "k", "v", True, True, False, "U(C_K)·P·H keys, U(C_V)·P·H values"),
    Rotation("kcov-uh", "k", "v", False, True, False, "kcov without P"),
    Rotation("kcov-u", "k", "v", False, False, False, "kcov eigenbases only"),
]}
"""Rotation recipes of ``oscar fit --method`` (its help is generated from this table)."""


def get_rotation(name: str) -> Rotation:
    """A rotation recipe by name (unknown names raise :class:`MethodError` listing the choices)."""
    if name not in ROTATIONS:
        raise MethodError(f"unknown rotation {name!r}; choose one of {', '.join(ROTATIONS)}")
    return ROTATIONS[name]


# ----------------------------------------------------------------------------------------------------------------
# KV-cache methods


@dataclass(frozen=True)
class Method:
    """What a KV-cache method does. ``bits``: code width (None: the artifact's); ``rotation``: a data-free
    :data:`ROTATIONS` entry, or None for the rotations an artifact holds (the method then needs one); ``clip``:
    fixed (key, value) clip ratios, None for the artifact's fitted ones; ``key_axis``: ``token`` | ``channel``
    (KIVI keys); ``group``: quantization group (0 = one group per head row); ``own_sink_recent``: (sink, recent)
    the method defines itself (KIVI); ``decode``: the decode kernel's options whose numerics the method emulates
    (int8 scores/values); ``arg``: the part after ``@``."""

    name: str
    family: str  # "exact" | "quant" | "hf"
    bits: int | None = 16
    rotation: Rotation | None = ROTATIONS["identity"]
    clip: tuple[float, float] | None = (1.0, 1.0)
    key_axis: str = "token"
    group: int = 0
    own_sink_recent: tuple[int, int] | None = None
    backend: str | None = None
    decode: DecodeOptions = DecodeOptions()
    levels: str = "uniform"
    arg: str | None = None
    help: str = ""

    def __post_init__(self) -> None:
        if self.rotation is not None and not self.rotation.data_free:
            raise ValueError(f"method {self.name}: a fitted rotation ({self.rotation.name}) comes from an artifact; "
                             "use rotation=None")

    @property
    def label(self) -> str:
        return self.name if self.arg is None else f"{self.name}@{self.arg}"

    @property
    def needs_artifact(self) -> bool:
        return self.family == "quant" and self.rotation is None

    @property
    def cache_only(self) -> bool:
        """True when the method exists only as a cache (no decode-equivalent attention)."""
        return self.family == "hf"


_HADAMARD = ROTATIONS["hadamard"]
_INT8_SCORES = DecodeOptions(int8_scores=True)
_INT8_PV = DecodeOptions(int8_scores=True, int8_values=True)

METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("bf16", "exact", help="no quantization (model dtype)"),
        Method("int2-naive", "quant", 2, help="per-token INT2, no rotation, no clip"),
        Method("int4-naive", "quant", 4, help="per-token INT4, no rotation, no clip"),
        Method("int2-kivi", "quant", 2, key_axis="channel", group=KIVI_GROUP, own_sink_recent=(0, KIVI_RESIDUAL),
               help="KIVI: per-channel keys, per-token values, group 32, residual 128 (its own sink/recent)"),
        Method("int2-hadamard", "quant", 2, rotation=_HADAMARD, help="random-sign Hadamard, no clip"),
        Method("int4-hadamard", "quant", 4, rotation=_HADAMARD, help="random-sign Hadamard, no clip"),
        Method("int2-hadamard-gauss", "quant", 2, rotation=_HADAMARD, levels="gaussian",
               help="TurboQuant-style: random-sign Hadamard, Gaussian Lloyd-Max levels (data-free), no clip"),
        Method("int2-hadamard-clip", "quant", 2, rotation=_HADAMARD, clip=DEFAULT_HADAMARD_CLIP,
               help="random-sign Hadamard, fixed clip @K/V (default 0.96/0.92)"),
        Method("int4-hadamard-clip", "quant", 4, rotation=_HADAMARD, clip=DEFAULT_HADAMARD_CLIP,
               help="random-sign Hadamard INT4, fixed clip @K/V"),
        Method("oscar", "quant", None, rotation=None, clip=None,
               help="artifact rotations + fitted clip, at the artifact's scheme (@REF)"),
        Method("oscar-noclip", "quant", None, rotation=None, help="artifact rotations, no clip (@REF)"),
        Method("oscar-int8", "quant", None, rotation=None, clip=None, decode=_INT8_SCORES,
               help="oscar with scores over INT2 keys from int8-rounded queries, as `oscar serve --int8-scores` "
                    "decodes (@REF)"),
        Method("oscar-int8-pv", "quant", None, rotation=None, clip=None, decode=_INT8_PV,
               help="oscar-int8 with the INT2 rows' value products from probabilities rounded to int8 steps per "
                    "128-row tile, as `oscar serve --int8-scores --int8-values` decodes (@REF; row scales)"),
        Method("hf-quantized", "hf", 2, backend="auto", help="transformers QuantizedCache, HQQ or quanto, 2 bits"),
        Method("hf-hqq", "hf", 2, backend="hqq", help="transformers QuantizedCache, HQQ backend, 2 bits"),
        Method("hf-quanto", "hf", 2, backend="quanto", help="transformers QuantizedCache, quanto backend, 2 bits"),
    ]
}
"""KV-cache methods of ``oscar eval --methods`` (and of serving: ``bf16``, ``oscar``)."""


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
    if m.needs_artifact:
        return replace(m, arg=arg)
    if name.endswith("-clip"):
        return replace(m, clip=_parse_clip(arg, name), arg=arg)
    raise MethodError(f"method {name} takes no @argument (got {spec!r})")


def parse_methods(specs) -> list[Method]:
    """Names (a comma-separated string or a sequence) -> methods (at least one; duplicates removed in order)."""
    parts = specs.split(",") if isinstance(specs, str) else list(specs)
    out, seen = [], set()
    for part in parts:
        if part.strip() and part.strip() not in seen:
            seen.add(part.strip())
            out.append(get_method(part))
    if not out:
        raise MethodError("--methods is empty; pass e.g. bf16,int2-naive,int2-hadamard,oscar")
    return out


def scheme_for(method: Method, head_dim: int, *, artifact_scheme: QuantScheme | None = None,
               reference: QuantScheme | None = None, overrides: dict[str, int] | None = None,
               artifact_name: str = "") -> QuantScheme:
    """The scheme ``method`` runs with at ``head_dim`` (group resolved).

    Base: an artifact method's scheme is the artifact's (``artifact_scheme``); a data-free method uses its own bits and
    group with the sink/recent of ``reference`` (the eval's reference scheme; default :class:`QuantScheme`'s); KIVI
    uses its own sink/recent. ``overrides`` (explicit flags: ``bits``, ``group``, ``sink``, ``recent``) replace fields,
    and are refused with one line where they cannot hold: another bit width than the method's (an artifact's clip
    ratios were fitted for its bits), a group that does not divide the head dim or that the method fixes.
    """
    overrides = dict(overrides or {})
    reference = reference or QuantScheme()
    if method.family == "exact":
        return reference
    if method.needs_artifact:
        if artifact_scheme is None:
            raise MethodError(f"{method.label} needs an artifact: pass --artifact latest|vN|PATH or "
                              f"{method.name}@REF")
        base = artifact_scheme
        name = artifact_name or method.arg
        why = f"artifact {name} was fitted at {base.bits} bits" if name else f"its artifact was fitted at {base.bits} bits"
        fix = f"refit with `oscar fit --bits {overrides.get('bits')}` or drop --bits"
    else:
        base = QuantScheme(bits=method.bits, group=method.group, sink=reference.sink, recent=reference.recent,
                           levels=method.levels)
        why, fix = f"{method.name} stores {method.bits}-bit codes by definition", "pick the method of that width"
    if "bits" in overrides and overrides["bits"] != base.bits:
        raise MethodError(f"{method.label} runs at {base.bits} bits ({why}); --bits {overrides['bits']} cannot hold: "
                          f"{fix}")
    if "group" in overrides and method.group and overrides["group"] != method.group:
        raise MethodError(f"{method.label} fixes group {method.group}; --group {overrides['group']} cannot hold")
    if method.own_sink_recent is not None:
        overrides.pop("sink", None)
        overrides.pop("recent", None)
        base = replace(base, sink=method.own_sink_recent[0], recent=method.own_sink_recent[1])
    try:
        scheme = replace(base, **overrides)
        return scheme.resolved(head_dim)
    except SchemeError as e:
        raise MethodError(f"{method.label}: {e}") from None


def scheme_record(scheme: QuantScheme, overrides: dict[str, int]) -> dict:
    """What an ``evals`` row stores about the scheme: the effective scheme and the explicit overrides."""
    return {"scheme": scheme.to_dict(), "overrides": dict(overrides)}


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
