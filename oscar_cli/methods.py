"""KV-cache methods: the one registry of cache configurations that ``oscar eval`` compares, and how each one's
quant scheme is decided.

A method name (``NAME`` or ``NAME@ARG``) resolves to a :class:`Method`; :func:`scheme_for` gives the
:class:`~oscar_kernels.scheme.QuantScheme` it runs with, and :mod:`oscar_cli.kvquant` turns method + scheme into
per-layer quantizers.

* ``bf16``: no quantization (the model dtype).
* ``int2-naive`` / ``int4-naive``: per-token rows, no rotation, no clipping.
* ``int2-kivi``: KIVI — keys per channel over blocks of 32 tokens, values per token in groups of 32 channels,
  full-precision residual of 128 tokens and no sink (its own windows: ``--sink/--recent`` do not apply to it).
* ``int2-hadamard`` / ``int4-hadamard``: data-free random-sign Hadamard ``S·H``, no clipping.
* ``int2-hadamard-clip`` / ``int4-hadamard-clip``: the same with fixed clip ratios, ``@K/V`` to override
  (default ``@0.96/0.92``).
* ``oscar``: rotations, fitted clip ratios AND quant scheme of an artifact (``@REF`` picks one: ``latest``, ``v3``,
  a path, ``fit:METHOD[+per-head]``; otherwise ``--artifact``): a 4-bit artifact runs at 4 bits. The artifact's
  own fit method (``oscar``, ``oscar-uh``, ``kcov`` ...) is the ablation; ``oscar-noclip@REF`` uses its rotations
  with clip ratio 1.
* ``hf-quantized`` (``hf-hqq``, ``hf-quanto``): transformers' ``QuantizedCache`` at 2 bits, the external peer;
  only through the cache (token-by-token decoding), and only where its backend package is installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, replace

from .config import QuantScheme, SchemeError
from .errors import OscarError

DEFAULT_HADAMARD_CLIP = (0.96, 0.92)
"""Fixed (key, value) clip ratios of ``*-hadamard-clip`` (a data-free baseline: the same pair for every model)."""
KIVI_GROUP = 32
KIVI_RESIDUAL = 128


class MethodError(OscarError):
    """An unknown or unusable method name, or a scheme override a method cannot run with."""


@dataclass(frozen=True)
class Method:
    """What a method does. ``bits``: code width (None: the artifact's); ``rotation``: ``none`` | ``hadamard`` |
    ``artifact``; ``key_axis``: ``token`` | ``channel`` (KIVI keys); ``group``: quantization group (0 = one group per
    head row); ``own_windows``: (sink, recent) the method defines itself (KIVI); ``arg``: the part after ``@``."""

    name: str
    family: str  # "exact" | "quant" | "hf"
    bits: int | None = 16
    rotation: str = "none"
    clip: tuple[float, float] | None = (1.0, 1.0)  # None = the artifact's fitted ratios
    key_axis: str = "token"
    group: int = 0
    own_windows: tuple[int, int] | None = None
    backend: str | None = None
    int8_scores: bool = False
    int8_values: bool = False
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
        Method("int2-kivi", "quant", 2, key_axis="channel", group=KIVI_GROUP, own_windows=(0, KIVI_RESIDUAL),
               help="KIVI: per-channel keys, per-token values, group 32, residual 128 (its own windows)"),
        Method("int2-hadamard", "quant", 2, rotation="hadamard", help="random-sign Hadamard, no clip"),
        Method("int4-hadamard", "quant", 4, rotation="hadamard", help="random-sign Hadamard, no clip"),
        Method("int2-hadamard-clip", "quant", 2, rotation="hadamard", clip=DEFAULT_HADAMARD_CLIP,
               help="random-sign Hadamard, fixed clip @K/V (default 0.96/0.92)"),
        Method("int4-hadamard-clip", "quant", 4, rotation="hadamard", clip=DEFAULT_HADAMARD_CLIP,
               help="random-sign Hadamard INT4, fixed clip @K/V"),
        Method("oscar", "quant", None, rotation="artifact", clip=None,
               help="artifact rotations + fitted clip, at the artifact's scheme (@REF)"),
        Method("oscar-noclip", "quant", None, rotation="artifact", help="artifact rotations, no clip (@REF)"),
        Method("oscar-int8", "quant", None, rotation="artifact", clip=None, int8_scores=True,
               help="oscar with scores over INT2 keys from int8-rounded queries, as `oscar serve --int8-scores` "
                    "decodes (@REF)"),
        Method("oscar-int8-pv", "quant", None, rotation="artifact", clip=None, int8_scores=True, int8_values=True,
               help="oscar-int8 with the INT2 rows' value products from probabilities rounded to int8 steps per "
                    "128-row tile, as `oscar serve --int8-scores --int8-values` decodes (@REF; row scales)"),
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
               windows: QuantScheme | None = None, overrides: dict[str, int] | None = None,
               artifact_name: str = "") -> QuantScheme:
    """The scheme ``method`` runs with at ``head_dim`` (group resolved).

    Base: an artifact method's scheme is the artifact's (``artifact_scheme``); a data-free method uses its own bits and
    group with the sink/recent of ``windows`` (the eval's reference windows; default :class:`QuantScheme`'s); KIVI
    uses its own windows. ``overrides`` (explicit flags: ``bits``, ``group``, ``sink``, ``recent``) replace fields,
    and are refused with one line where they cannot hold: another bit width than the method's (an artifact's clip
    ratios were fitted for its bits), a group that does not divide the head dim or that the method fixes.
    """
    overrides = dict(overrides or {})
    windows = windows or QuantScheme()
    if method.family == "exact":
        return windows
    if method.needs_artifact:
        if artifact_scheme is None:
            raise MethodError(f"{method.label} needs an artifact: pass --artifact latest|vN|PATH or "
                              f"{method.name}@REF")
        base = artifact_scheme
        name = artifact_name or method.arg
        why = f"artifact {name} was fitted at {base.bits} bits" if name else f"its artifact was fitted at {base.bits} bits"
        fix = f"refit with `oscar fit --bits {overrides.get('bits')}` or drop --bits"
    else:
        base = QuantScheme(bits=method.bits, group=method.group, sink=windows.sink, recent=windows.recent)
        why, fix = f"{method.name} stores {method.bits}-bit codes by definition", "pick the method of that width"
    if "bits" in overrides and overrides["bits"] != base.bits:
        raise MethodError(f"{method.label} runs at {base.bits} bits ({why}); --bits {overrides['bits']} cannot hold: "
                          f"{fix}")
    if "group" in overrides and method.group and overrides["group"] != method.group:
        raise MethodError(f"{method.label} fixes group {method.group}; --group {overrides['group']} cannot hold")
    if method.own_windows is not None:
        overrides.pop("sink", None)
        overrides.pop("recent", None)
        base = replace(base, sink=method.own_windows[0], recent=method.own_windows[1])
    try:
        scheme = replace(base, **overrides)
        return scheme.resolved(head_dim)
    except SchemeError as e:
        raise MethodError(f"{method.label}: {e}") from None


def scheme_record(scheme: QuantScheme, overrides: dict[str, int]) -> dict:
    """What an ``evals`` row stores about the scheme: the effective scheme and the explicit overrides."""
    return {"scheme": dataclasses.asdict(scheme), "overrides": dict(overrides)}


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
