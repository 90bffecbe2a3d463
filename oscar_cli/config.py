"""Configuration: frozen dataclasses, one per concept, and recipe loading (unknown keys are errors)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import OscarError

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_STORE = Path(".oscar")
DEFAULT_ARTIFACTS = Path("artifacts")


class ConfigError(OscarError):
    """A configuration or recipe problem the user can fix; the message says how."""


@dataclass(frozen=True)
class QuantConfig:
    """How rotated K/V rows are stored: ``bits`` per code, one fp16 scale/zero per ``group`` elements
    (``group = 0`` means one group per head row), the first ``sink`` and the last ``recent`` tokens kept in BF16."""

    bits: int = 2
    group: int = 0
    sink: int = 64
    recent: int = 256

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ConfigError(f"bits must be 2 or 4, got {self.bits}")
        if self.group < 0 or self.sink < 0 or self.recent < 0:
            raise ConfigError("group, sink and recent must be non-negative")

    def group_for(self, head_dim: int) -> int:
        g = self.group or head_dim
        if head_dim % g or g % (8 // self.bits):
            raise ConfigError(f"group {g} must divide the head dim {head_dim} (and be a multiple of {8 // self.bits})")
        return g


@dataclass(frozen=True)
class CollectConfig:
    """Calibration pass: which text, how many tokens, how it is cut.

    ``reservoir``: tokens whose q/k/v rows are kept for fitting clip ratios and for ``inspect``.
    ``skip``: the first positions of every window are left out of the statistics: they are attention sinks with
    outlier keys, and every cache configuration keeps at least that many sink tokens in BF16 (the smallest sink
    we ship is 16), so fitting to them would spend the rotation on rows that are never quantized.
    """

    data: str = "builtin:pydoc"
    tokens: int = 16384
    seq_len: int = 512
    batch_size: int = 4
    reservoir: int = 512
    skip: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens", "seq_len", "batch_size", "reservoir"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    @property
    def num_sequences(self) -> int:
        return -(-self.tokens // self.seq_len)


FIT_METHODS = {
    # name: (key basis, value basis, use P, use H, random signs)
    "identity": (None, None, False, False, False),
    "hadamard": (None, None, False, True, True),
    "oscar": ("q@k", "s", True, True, False),
    "oscar-uh": ("q@k", "s", False, True, False),
    "oscar-u": ("q@k", "s", False, False, False),
    "oscar-q": ("q", "s", True, True, False),
    "oscar-out": ("q@k", "o", True, True, False),
    "kcov": ("k", "v", True, True, False),
    "kcov-uh": ("k", "v", False, True, False),
    "kcov-u": ("k", "v", False, False, False),
}
"""Rotation methods for ``oscar fit``. Key basis ``q`` = eigenbasis of C_Q; ``q@k`` = eigenbasis of C_Q anchored on
the leading direction of C_K (the keys' shared offset goes to the Hadamard's constant row, where the zero point
absorbs it; see ``rotation.anchored_eigh``); ``k`` = eigenbasis of C_K. Value basis ``s`` = the score-weighted C_S,
``o`` = the attention-output covariance C_O, ``v`` = C_V."""


@dataclass(frozen=True)
class FitConfig:
    """How rotations and clip ratios are fitted from a collected run."""

    method: str = "oscar"
    layers: str = "all"
    per_head: bool = False
    fit_clip: bool = True
    clip_grid: tuple[float, ...] = field(default=tuple(round(0.50 + 0.025 * i, 3) for i in range(21)))
    seed: int = 0
    quant: QuantConfig = field(default_factory=QuantConfig)

    def __post_init__(self) -> None:
        if self.method not in FIT_METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose one of {', '.join(FIT_METHODS)}")
        if not self.clip_grid or any(not 0 < c <= 1 for c in self.clip_grid):
            raise ConfigError("clip_grid values must lie in (0, 1]")


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """``"all"`` or ``"0-5,9"`` -> sorted layer indices, checked against ``n_layers``."""
    if spec.strip() == "all":
        return list(range(n_layers))
    out: set[int] = set()
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                a, b = (int(s) for s in part.split("-", 1))
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise ConfigError(f"--layers {spec!r} is not 'all' or a list like 0-5,9") from None
    bad = sorted(i for i in out if not 0 <= i < n_layers)
    if bad or not out:
        raise ConfigError(f"--layers {spec!r} is out of range: the model has layers 0-{n_layers - 1}")
    return sorted(out)


@dataclass(frozen=True)
class Recipe:
    """A recipe file: one section per stage plus the thresholds an evaluation must meet."""

    model: str = DEFAULT_MODEL
    collect: CollectConfig = field(default_factory=CollectConfig)
    fit: FitConfig = field(default_factory=FitConfig)
    eval: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def _build(cls, section: dict[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(section) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(sorted(names))}")
    kwargs = dict(section)
    if cls is FitConfig:
        if "quant" in kwargs:
            kwargs["quant"] = _build(QuantConfig, kwargs["quant"] or {}, f"{where}.quant")
        if "clip_grid" in kwargs:
            kwargs["clip_grid"] = tuple(float(c) for c in kwargs["clip_grid"])
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"bad value in {where}: {e}") from None


EVAL_KEYS = {"tasks", "methods", "sink", "recent", "limit", "seq_lengths", "ablation"}


def load_recipe(path: Path) -> Recipe:
    """Parse a recipe YAML; unknown keys anywhere are errors."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read recipe {path}: {e.strerror}; pass an existing YAML file") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {path} must be a mapping with sections model, collect, fit, eval, thresholds")
    allowed = {"model", "collect", "fit", "eval", "thresholds"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"unknown section(s) {', '.join(unknown)} in {path}; allowed: {', '.join(sorted(allowed))}")
    ev = raw.get("eval") or {}
    bad = sorted(set(ev) - EVAL_KEYS)
    if bad:
        raise ConfigError(f"unknown key(s) {', '.join(bad)} in {path}:eval; allowed: {', '.join(sorted(EVAL_KEYS))}")
    return Recipe(
        model=str(raw.get("model", DEFAULT_MODEL)),
        collect=_build(CollectConfig, raw.get("collect") or {}, f"{path}:collect"),
        fit=_build(FitConfig, raw.get("fit") or {}, f"{path}:fit"),
        eval=dict(ev),
        thresholds=dict(raw.get("thresholds") or {}),
        source=text,
    )
