"""The quantisation scheme: the one definition of how rotated K/V rows are stored.

An artifact carries its :class:`QuantScheme` in its manifest (written by ``oscar fit``); the transformers cache, the
kernels' pool, ``oscar eval`` and ``oscar serve`` read it from there. Every default below is the only place that
default is written.

* ``bits``: code width (2 or 4; the Triton kernels implement 2) of every layer the allocation does not name.
* ``bits_k`` / ``bits_v``: the budgeted allocation (``oscar fit --bits-per-element``): the key and the value code
  width of every model layer (one entry per layer, 2 or 4), or empty for ``bits`` everywhere.
* ``group``: rotated elements per scale/zero pair; ``0`` means one group per head row (the head dim), which
  :meth:`QuantScheme.resolved` turns into the concrete number for a model.
* ``sink``: the first ``sink`` real tokens of every sequence stay exact (BF16).
* ``recent``: the query at position ``t`` reads the last ``recent`` positions ``(t - recent, t]`` exactly.
* ``scale_dtype``: storage type of the per-group scale and zero point: ``fp16``, or ``fp8`` (e4m3 of the value
  divided by a power-of-two multiplier fitted per layer, K/V and KV head, which the artifact holds: 16 bits of
  metadata per group instead of 32).
* ``levels``: how codes map to values (``uniform``: ``code * scale + zero``, codes ``0 .. 2**bits - 1``;
  ``fitted``: ``levels[code] * scale + zero`` with 4 levels per layer, K/V and KV head fitted with the clip, the
  artifact's ``levels_k``/``levels_v``; ``gaussian``: the Lloyd-Max levels of a normal distribution placed in the
  group's min/max frame, data-free; both INT2 only, and an allocation's 4-bit units stay uniform).
* ``center_keys``: keys are stored minus a fitted center per layer and KV head (the artifact's ``center_k``), every
  row the softmax sees alike: scores shift by ``q·μ`` per query, which the softmax ignores.
* ``split_k``: split key rows (``oscar fit --key-split``): per model layer, the number ``m`` of leading rotated key
  channels stored as 4-bit codes, the other ``d - m`` as 2-bit codes, each part with its own scale/zero (0: the
  layer's keys are not split; empty: none are). The layer's key rotation puts the directions the queries read most
  first (:func:`oscar_cli.rotation.split_rotation`). Needs 2-bit keys in that layer, one group per head row and
  uniform levels; the torch reference serves it, the kernels do not yet (:meth:`QuantScheme.kernel_support`).

Pure Python (no torch), so every layer of the project, and the serving engine's processes, can import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

SCALE_DTYPES = ("fp16", "fp8")
META_BITS = {"fp16": 32, "fp8": 16}
"""Storage bits of one group's scale and zero point together, per ``scale_dtype``."""
WIDTHS = (2, 4)
LEVELS = ("uniform", "fitted", "gaussian")
KERNEL_BITS = 2
"""Code width of the kernels' bit planes: 2-bit codes are one plane, 4-bit codes two (see
:mod:`oscar_kernels.layout`)."""
CUDA_MIN_HEAD_DIM = 64
"""Smallest head dim the decode kernel is run at on CUDA. At 32 (test-size models) the H200 (Triton 3.6) computed
wrong decode attention (relative error ~0.3 against the reference) while the interpreter, the extend and write
kernels at 32, and every case at 64 and 128 were right: refused there until it is found and fixed."""


def cuda_head_dim_refusal(head_dim: int) -> str | None:
    """Why the decode kernel does not run at ``head_dim`` on CUDA (:data:`CUDA_MIN_HEAD_DIM`), or None."""
    if head_dim < CUDA_MIN_HEAD_DIM:
        return (f"on CUDA the decode kernel needs head dim >= {CUDA_MIN_HEAD_DIM}, got {head_dim} (it computes wrong "
                "attention there)")
    return None


class SchemeError(ValueError):
    """A scheme that is invalid, or that cannot run where it was asked to; the message says why and how to fix it."""


@dataclass(frozen=True)
class QuantScheme:
    """How rotated K/V rows are stored (see the module docstring for each field)."""

    bits: int = 2
    group: int = 0
    sink: int = 64
    recent: int = 256
    scale_dtype: str = "fp16"
    levels: str = "uniform"
    bits_k: tuple[int, ...] = ()
    bits_v: tuple[int, ...] = ()
    center_keys: bool = False
    split_k: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.center_keys, bool):
            raise SchemeError(f"scheme center_keys must be true or false, got {self.center_keys!r}")
        for name in ("bits_k", "bits_v"):
            v = getattr(self, name)
            if not isinstance(v, (tuple, list)) or any(w not in WIDTHS or isinstance(w, bool) for w in v):
                raise SchemeError(f"scheme {name} must be a list of code widths (2 or 4), one per layer, got {v!r}")
            object.__setattr__(self, name, tuple(v))
        if len(self.bits_k) != len(self.bits_v):
            raise SchemeError(f"scheme bits_k and bits_v must name the same layers ({len(self.bits_k)} against "
                              f"{len(self.bits_v)} entries)")
        v = self.split_k
        if not isinstance(v, (tuple, list)) or any(not isinstance(m, int) or isinstance(m, bool) or m < 0 or m % 4
                                                   for m in v):
            raise SchemeError(f"scheme split_k must be a list of 4-bit key channels per layer (0 or a positive "
                              f"multiple of 4), got {v!r}")
        object.__setattr__(self, "split_k", tuple(v))
        if self.split_k and self.bits_k and len(self.split_k) != len(self.bits_k):
            raise SchemeError(f"scheme split_k and bits_k must name the same layers ({len(self.split_k)} against "
                              f"{len(self.bits_k)} entries)")
        for name in ("bits", "group", "sink", "recent"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise SchemeError(f"scheme {name} must be an integer, got {v!r}")
        if self.bits not in (2, 4):
            raise SchemeError(f"bits must be 2 or 4, got {self.bits}")
        if self.group < 0 or self.sink < 0 or self.recent < 0:
            raise SchemeError(f"group, sink and recent must be non-negative (got {self.group}, {self.sink}, {self.recent})")
        if self.scale_dtype not in SCALE_DTYPES:
            raise SchemeError(f"scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {self.scale_dtype!r}")
        if self.levels not in LEVELS:
            raise SchemeError(f"levels must be one of {', '.join(LEVELS)}, got {self.levels!r}")
        if self.levels != "uniform" and self.bits != 2:
            raise SchemeError(f"{self.levels} levels are 2-bit codebooks; the scheme has bits {self.bits}")
        if self.split:
            if self.levels != "uniform":
                raise SchemeError(f"split key rows store uniform levels; the scheme has {self.levels} levels")
            bad = [i for i, m in enumerate(self.split_k) if m and self.width(i, "k") != 2]
            if bad:
                raise SchemeError(f"split key rows need 2-bit keys; layer {bad[0]}'s keys are "
                                  f"{self.width(bad[0], 'k')}-bit")

    @property
    def mixed(self) -> bool:
        """True when the allocation gives some layer's K or V another width than ``bits``."""
        return any(w != self.bits for w in (*self.bits_k, *self.bits_v))

    @property
    def split(self) -> bool:
        """True when some layer's key rows are split (:attr:`split_k`)."""
        return any(self.split_k)

    def width(self, layer: int, kind: str) -> int:
        """Code width of model layer ``layer``'s keys (``kind="k"``) or values (``"v"``); a split key row's is 2 (its
        leading :meth:`split_of` channels are 4-bit)."""
        alloc = self.bits_k if kind == "k" else self.bits_v
        return alloc[layer] if alloc else self.bits

    def split_of(self, layer: int) -> int:
        """Leading rotated key channels of model layer ``layer`` stored as 4-bit codes (0: not split)."""
        return self.split_k[layer] if self.split_k else 0

    def check_layers(self, n_layers: int) -> None:
        """The allocation (when there is one) has one entry per model layer."""
        if self.bits_k and len(self.bits_k) != n_layers:
            raise SchemeError(f"the scheme allocates widths for {len(self.bits_k)} layers, the model has {n_layers}")
        if self.split_k and len(self.split_k) != n_layers:
            raise SchemeError(f"the scheme splits key rows of {len(self.split_k)} layers, the model has {n_layers}")

    @property
    def meta_bits(self) -> int:
        """Storage bits of one group's scale and zero point together."""
        return META_BITS[self.scale_dtype]

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    @property
    def max_code(self) -> int:
        return (1 << self.bits) - 1

    def group_for(self, head_dim: int) -> int:
        """The concrete group size for rows of ``head_dim`` elements (checked)."""
        g = self.group or head_dim
        if head_dim % g or g % self.codes_per_byte:
            raise SchemeError(f"group {g} must divide the head dim {head_dim} and be a multiple of "
                              f"{self.codes_per_byte} (codes per byte at {self.bits} bits)")
        return g

    def resolved(self, head_dim: int) -> QuantScheme:
        """The same scheme with ``group`` made concrete for ``head_dim`` (what an artifact records)."""
        return dataclasses.replace(self, group=self.check_split(head_dim))

    def check_split(self, head_dim: int) -> int:
        """The concrete group (:meth:`group_for`), checked against the split key rows: one group per head row and
        ``0 < m < head_dim`` 4-bit channels."""
        g = self.group_for(head_dim)
        if self.split:
            if g != head_dim:
                raise SchemeError(f"split key rows need one scale/zero pair per part, so group 0 (the head row); "
                                  f"the scheme's group is {g}")
            bad = [m for m in self.split_k if m >= head_dim]
            if bad:
                raise SchemeError(f"a split key row has fewer than {head_dim} 4-bit channels (the head dim); got "
                                  f"{bad[0]}")
        return g

    def unit_bits(self, layer: int, kind: str, head_dim: int) -> float:
        """Storage bits of one quantised element of model layer ``layer``'s keys or values: the code plus the share
        of the scale and zero (a split key row: ``m`` 4-bit and ``d - m`` 2-bit codes, two scale/zero pairs)."""
        g = self.check_split(head_dim)
        m = self.split_of(layer) if kind == "k" else 0
        if m:
            return (4 * m + 2 * (head_dim - m) + 2 * self.meta_bits) / head_dim
        return self.width(layer, kind) + self.meta_bits / g

    def bits_per_element(self, head_dim: int, layers=None, tokens=None) -> float:
        """Storage bits of one quantised element: its code plus its share of the scale and zero, averaged over K and
        V of ``layers`` (model layer indices; default every layer the allocation names) under the allocation, each
        layer weighted by ``tokens[layer]`` (the rows it holds: fewer in a sliding-window layer; default equal)."""
        meta = self.meta_bits / self.check_split(head_dim)
        n = max(len(self.bits_k), len(self.split_k))
        if not n:
            return self.bits + meta
        idx = range(n) if layers is None else list(layers)
        w = {i: 1 if tokens is None else tokens[i] for i in idx}
        total = sum(w.values())
        if not idx or total <= 0:
            return self.bits + meta
        return sum((self.unit_bits(i, "k", head_dim) + self.unit_bits(i, "v", head_dim)) * w[i]
                   for i in idx) / (2 * total)

    def kernel_support(self, head_dim: int, device_type: str | None = None) -> str | None:
        """Why the Triton kernels cannot run this scheme at ``head_dim`` (on ``device_type``, e.g. ``"cuda"``; None:
        anywhere they run), or None when they can."""
        if device_type == "cuda" and (why := cuda_head_dim_refusal(head_dim)) is not None:
            return why
        if self.split:
            return "the kernels store one code width per key row, the scheme splits key rows (split_k)"
        if self.levels != "uniform":
            return f"the kernels read uniform levels, the scheme has {self.levels} levels"
        g = self.group_for(head_dim)
        for name, v in (("head dim", head_dim), ("group", g)):
            if v < 16 or v & (v - 1):
                return f"the kernels need a power-of-two {name} >= 16, got {v}"
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON form; the allocation and key centering only when there are (such a scheme reads as before them)."""
        d = dataclasses.asdict(self)
        for name in ("bits_k", "bits_v", "split_k"):
            if d[name]:
                d[name] = list(d[name])
            else:
                del d[name]
        if not d["center_keys"]:
            del d["center_keys"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "scheme") -> QuantScheme:
        """Strict parse: unknown keys are errors (missing keys take the defaults)."""
        if not isinstance(d, dict):
            raise SchemeError(f"{where} must be a mapping of {', '.join(f.name for f in dataclasses.fields(cls))}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise SchemeError(f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(sorted(names))}")
        return cls(**{k: tuple(v) if k in ("bits_k", "bits_v", "split_k") and isinstance(v, list) else v
                      for k, v in d.items()})

    def describe(self) -> str:
        """Short name with the scheme in it, e.g. ``int2.g128.s64.r256``; an allocation reads ``mix2-4k3v1`` (layers
        whose keys / values are 4-bit), split key rows add ``.ks64x3`` (64 4-bit channels in 3 layers; the largest
        split when they differ), fp8 metadata adds ``.fp8``."""
        g = self.group or "row"
        width = f"int{self.bits}"
        if self.mixed:
            width = f"mix2-4k{sum(w == 4 for w in self.bits_k)}v{sum(w == 4 for w in self.bits_v)}"
        if self.split:
            width += f".ks{max(self.split_k)}x{sum(m > 0 for m in self.split_k)}"
        meta = "" if self.scale_dtype == "fp16" else f".{self.scale_dtype}"
        center = (".ck" if self.center_keys else "") + ("" if self.levels == "uniform" else f".{self.levels}")
        return f"{width}.g{g}{meta}{center}.s{self.sink}.r{self.recent}"


class DecodeOptionsError(SchemeError):
    """A decode option that is unknown or has a value of the wrong kind; the message names it and the fix."""


@dataclass(frozen=True)
class DecodeOptions:
    """How the decode kernel runs: the one value built at the edge (``oscar serve``/``oscar bench`` flags, the
    plugin's settings, an ``oscar eval`` method) and passed unchanged down to the kernel launch
    (``DecodePlan(options=...)`` -> ``decode_int2(options=...)``). Beside :class:`QuantScheme`, which says how rows
    are stored, this says how they are read.

    Numerics (each defined by ``decode_int2_ref`` and emulated by ``oscar eval``'s methods of the same name):

    * ``int8_scores``: scores over INT2 rows from int8 tensor-core products, each head's rotated query rounded to
      int8 steps of ``max |q'| / 127``.
    * ``int8_values``: the INT2 rows' value products from int8 tensor-core products, each tile's probabilities
      (times value scales) in int8 steps of 1/127 of the tile's largest, rounded after a per-row dither.
    * ``fused_update``: with ``int8_values``, each accumulator update as two fused multiply-adds (rounds the rescaled
      sum once more, within the dither's noise).

    Launch tuning (same results):

    * ``lean_tiles``: per-token bookkeeping (scale conversions, the token mask) on the slot vector's side.
    * ``movmatrix``: probabilities into the value product's operand layout by ``movmatrix`` transposes.
    * ``num_stages``: shared-memory stages of the split kernel (None: the kernel's default).
    * ``max_registers``: register cap per thread of the split kernel (None: the launcher's rule; 0: no cap).
    * ``split_tokens``: INT2 tokens per split before occupancy takes over (None: the split policy's default).

    Pure Python, like the rest of this module. The command-line form is ``KEY=VALUE[,KEY=VALUE...]``
    (:meth:`parse`, :meth:`describe`); the settings form a JSON object (:meth:`to_dict`, :meth:`from_dict`).
    """

    int8_scores: bool = False
    int8_values: bool = False
    fused_update: bool = False
    lean_tiles: bool = False
    movmatrix: bool = False
    num_stages: int | None = None
    max_registers: int | None = None
    split_tokens: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(v, bool):
                    raise DecodeOptionsError(f"decode option {f.name} must be true or false, got {v!r}")
            elif v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0
                                    or (v == 0 and f.name != "max_registers")):
                least = "a non-negative" if f.name == "max_registers" else "a positive"
                raise DecodeOptionsError(f"decode option {f.name} must be {least} integer, got {v!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @property
    def exact(self) -> bool:
        """True when the options keep the exact path's numerics (only launch tuning is set)."""
        return not (self.int8_scores or self.int8_values or self.fused_update)

    def changed(self) -> dict[str, Any]:
        """The options that differ from the defaults, in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    def to_dict(self) -> dict[str, Any]:
        """Only the options that differ from the defaults (an empty dict is the default)."""
        return self.changed()

    @classmethod
    def from_dict(cls, d: Any, where: str = "decode options") -> DecodeOptions:
        """Strict parse of :meth:`to_dict`'s form: unknown keys are errors, missing keys take the defaults."""
        if not isinstance(d, dict):
            raise DecodeOptionsError(f"{where} must be an object with keys among {', '.join(cls.names())}")
        unknown = sorted(set(d) - set(cls.names()))
        if unknown:
            raise DecodeOptionsError(f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(cls.names())}")
        return cls(**d)

    @classmethod
    def parse(cls, spec: str, base: DecodeOptions | None = None, flag: str = "--decode-tuning") -> DecodeOptions:
        """``KEY=VALUE[,KEY=VALUE...]`` on top of ``base`` (default: the defaults): ``true``/``false`` for switches,
        integers for counts. An empty string is ``base``. One-line :class:`DecodeOptionsError` naming the bad item."""
        base = base or cls()
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        given: dict[str, Any] = {}
        for item in (t.strip() for t in spec.split(",")):
            if not item:
                continue
            key, eq, value = (x.strip() for x in item.partition("="))
            if key not in kinds or not eq:
                raise DecodeOptionsError(f"{flag} {item!r}: expected KEY=VALUE with KEY one of {', '.join(kinds)} "
                                         "(e.g. lean_tiles=true,split_tokens=4096)")
            if key in given:
                raise DecodeOptionsError(f"{flag} {key} is given twice; give each key once")
            if kinds[key] == "bool":
                if value.lower() not in ("true", "false"):
                    raise DecodeOptionsError(f"{flag} {key}={value}: {key} takes true or false")
                given[key] = value.lower() == "true"
            else:
                if not value.isdigit():
                    raise DecodeOptionsError(f"{flag} {key}={value}: {key} takes a non-negative integer")
                given[key] = int(value)
        try:
            return dataclasses.replace(base, **given)
        except DecodeOptionsError as e:
            raise DecodeOptionsError(f"{flag}: {e}") from None

    def describe(self, keys: Collection[str] | None = None) -> str:
        """:meth:`parse`'s form of the options that differ from the defaults (``""`` for the defaults), e.g.
        ``int8_scores=true,split_tokens=4096``; with ``keys``, of those options whatever their values (field order)."""
        items = self.changed() if keys is None else {k: getattr(self, k) for k in self.names() if k in keys}
        return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in items.items())
