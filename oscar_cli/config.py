"""Configuration: frozen dataclasses, one per concept, and recipe loading (unknown and unused keys are errors).

The quantisation scheme itself (:class:`QuantScheme`: bits, group, sink, recent, scale dtype, code levels) is defined
once, in :mod:`oscar_kernels.scheme`, and re-exported here; an artifact's manifest carries the scheme it was fitted
for, and everything downstream (cache, kernels, eval, serve) reads it from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oscar_kernels.scheme import QuantScheme, SchemeError

from .errors import OscarError
from .methods import ROTATIONS, Rotation

__all__ = [
    "AttentionShape", "CollectConfig", "ConfigError", "EvalConfig", "FitConfig", "QuantScheme", "Recipe",
    "SchemeError", "Threshold", "load_recipe", "parse_layers",
]

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_STORE = Path(".oscar")
DEFAULT_ARTIFACTS = Path("artifacts")


class ConfigError(OscarError):
    """A configuration or recipe problem the user can fix; the message says how."""


@dataclass(frozen=True)
class AttentionShape:
    """Attention geometry of a decoder: layers, query heads, KV heads, head dim."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


CHECKPOINT_BYTES = 32 << 20
"""Accumulator bytes written per batch, amortised, when ``checkpoint_every`` is 0."""


@dataclass(frozen=True)
class CollectConfig:
    """Calibration pass: which text, how many tokens, how it is cut.

    ``reservoir``: tokens whose q/k/v rows are kept for fitting clip ratios and for ``inspect``.
    ``skip``: the first positions of every sequence are left out of the statistics: they are attention sinks with
    outlier keys, and every cache configuration keeps at least that many sink tokens in BF16 (the smallest sink
    we ship is 16), so fitting to them would spend the rotation on rows that are never quantized.
    ``checkpoint_every``: batches between store checkpoints (accumulators, reservoir and progress in one
    transaction); 0 = about every :data:`CHECKPOINT_BYTES` of accumulators, so that the store write per batch does not
    grow with the model (every batch for small models; for Qwen3-8B shapes, ~190 MB of float64, every 6th). A killed
    run resumes from its last checkpoint and ends with bit-identical statistics.
    """

    data: str = "builtin:pydoc"
    tokens: int = 16384
    seq_len: int = 512
    batch_size: int = 4
    reservoir: int = 512
    skip: int = 16
    seed: int = 0
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be >= 0 (0 = by size), got {self.checkpoint_every}")
        for name in ("tokens", "seq_len", "batch_size", "reservoir"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    @property
    def num_sequences(self) -> int:
        return -(-self.tokens // self.seq_len)


def _default_clip_grid() -> tuple[float, ...]:
    return tuple(round(0.50 + 0.025 * i, 3) for i in range(21))


@dataclass(frozen=True)
class FitConfig:
    """How rotations and clip ratios are fitted from a collected run, and the scheme they are fitted for.
    ``method``: the rotation recipe, a :data:`oscar_cli.methods.ROTATIONS` name (``oscar fit --method``).
    ``bits_per_element``: the budget (storage bits per quantized element, scale/zero included, averaged over K and V
    of the fitted layers) that :func:`oscar_cli.sensitivity.allocate` spends on 4-bit layers; None: the scheme's
    width everywhere. ``sensitivity_tokens``: calibration tokens the sensitivity pass scores through the model
    (:mod:`oscar_cli.sensitivity`; 0: none, allowed only without a budget above the base width); ``model``: the model
    to load for it (default: the run's, from the store's converted models or the embedded ones); ``context``: the
    sequence length at which the budget is met in bytes (a sliding-window layer holds at most its window of it).
    ``clip_criterion``: ``layer-local`` (the clips each layer's metric picks) or ``logit-kl`` (those clips scaled by
    the factor of ``clip_scale_grid`` with the least final-logit KL on calibration text; needs the sensitivity
    pass). ``key_split``: with a budget, a third choice for each layer's keys beside 2 and 4 bits: the row split into
    its ``key_split`` most-read rotated directions at 4 bits and the rest at 2 (:func:`oscar_cli.rotation.
    split_rotation`; 0: not offered), its (4-bit, 2-bit) clip pair the one of ``split_clips_hi`` x ``split_clips_lo``
    with the least final-logit KL on calibration text, every layer's keys split."""

    method: str = "oscar"
    layers: str = "all"
    per_head: bool = False
    fit_clip: bool = True
    clip_grid: tuple[float, ...] = field(default_factory=_default_clip_grid)
    seed: int = 0
    scheme: QuantScheme = field(default_factory=QuantScheme)
    bits_per_element: float | None = None
    sensitivity_tokens: int = 0
    model: str | None = None
    context: int = 32768
    clip_criterion: str = "layer-local"
    clip_scale_grid: tuple[float, ...] = (0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 2.0)
    key_split: int = 0
    split_clips_hi: tuple[float, ...] = (0.9, 1.0)
    split_clips_lo: tuple[float, ...] = (0.55, 0.6, 0.65, 0.7)

    def __post_init__(self) -> None:
        if not isinstance(self.key_split, int) or isinstance(self.key_split, bool) or self.key_split < 0 \
                or self.key_split % 4:
            raise ConfigError(f"key_split must be 0 (off) or a positive multiple of 4 key channels, got "
                              f"{self.key_split!r}")
        if self.key_split and (self.bits_per_element is None or self.sensitivity_tokens <= 0):
            raise ConfigError("key_split is a choice of the budgeted allocation: give bits_per_element (e.g. 2.5) and "
                              "sensitivity_tokens (e.g. 1024) with it")
        if self.bits_per_element is not None and not 1 < self.bits_per_element <= 16:
            raise ConfigError(f"bits_per_element must lie in (1, 16] bits per quantized element, got "
                              f"{self.bits_per_element}")
        if self.clip_criterion not in ("layer-local", "logit-kl"):
            raise ConfigError(f"clip_criterion must be layer-local or logit-kl, got {self.clip_criterion!r}")
        if self.clip_criterion == "logit-kl" and self.sensitivity_tokens <= 0:
            raise ConfigError("clip_criterion logit-kl scores clips on calibration text through the model: give "
                              "sensitivity_tokens (e.g. 1024)")
        if not self.clip_scale_grid or any(c <= 0 for c in self.clip_scale_grid):
            raise ConfigError("clip_scale_grid values must be positive")
        if self.context <= 0:
            raise ConfigError(f"context must be a positive number of tokens, got {self.context}")
        if self.sensitivity_tokens < 0:
            raise ConfigError(f"sensitivity_tokens must be >= 0 (0: no sensitivity pass), got "
                              f"{self.sensitivity_tokens}")
        if self.method not in ROTATIONS:
            raise ConfigError(f"unknown rotation {self.method!r} for fit --method; choose one of {', '.join(ROTATIONS)}")
        for name in ("clip_grid", "split_clips_hi", "split_clips_lo"):  # clip ratios
            v = getattr(self, name)
            if not v or any(not 0 < c <= 1 for c in v):
                raise ConfigError(f"{name} values must lie in (0, 1]")

    @property
    def rotation(self) -> Rotation:
        return ROTATIONS[self.method]

    def without_model_pass(self) -> FitConfig:
        """These settings without anything that runs the model at fit time: no sensitivity pass, no budget,
        the layer-local clips."""
        return dataclasses.replace(self, sensitivity_tokens=0, bits_per_element=None, clip_criterion="layer-local",
                                   key_split=0)


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
                if b < a:
                    raise ConfigError(f"--layers {spec!r}: range {part} runs backwards; write it low-high ({b}-{a})")
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise ConfigError(f"--layers {spec!r} is not 'all' or a list like 0-5,9") from None
    bad = sorted(i for i in out if not 0 <= i < n_layers)
    if bad or not out:
        raise ConfigError(f"--layers {spec!r} is out of range: the model has layers 0-{n_layers - 1}")
    return sorted(out)


# ----------------------------------------------------------------------------------------------------------------
# Evaluation


PPL_TASK = "oscar_ppl"
OFFLINE_TASKS = {
    # user-facing name (also the task name of stored rows): lm-eval task shipped in oscar_cli/tasks
    "niah_single_1": "oscar_ruler_niah_single_1",
    "niah_multikey_2": "oscar_ruler_niah_multikey_2",
    "niah_multikey_3": "oscar_ruler_niah_multikey_3",
    "oscar_niah": "oscar_niah",
}
TASK_GROUPS = {"ruler": ("niah_single_1",)}
"""``ruler`` means the RULER tasks that run offline; ``niah_multikey_2/3`` can be named explicitly."""


def expand_tasks(names) -> list[str]:
    """User task names -> the task names rows are stored under (groups expanded, duplicates dropped, in order)."""
    out: list[str] = []
    for n in names:
        for m in TASK_GROUPS.get(n, (n,)):
            if m not in out:
                out.append(m)
    return out


DEFAULT_EVAL_TASKS = (PPL_TASK,)
DEFAULT_EVAL_METHODS = ("bf16", "int2-naive", "int2-hadamard", "oscar")
DEFAULT_SEQ_LENGTHS = (1024,)
DEFAULT_PPL_SEGMENTS = 4
"""Segments of the text per sequence length for ``oscar_ppl`` when no limit is given."""
BOUNDS = ("max", "min", "max_ratio", "min_ratio")


@dataclass(frozen=True)
class Threshold:
    """One bound an evaluation must meet: the ``metric`` of ``method`` on ``task`` (at ``seq_len``, or at every
    evaluated length when None) is at most ``max`` / at least ``min``, or its ratio to the same metric of
    ``baseline`` is at most ``max_ratio`` / at least ``min_ratio``. Exactly one bound is given."""

    method: str
    task: str
    metric: str
    bound: str
    value: float
    seq_len: int | None = None
    baseline: str = "bf16"

    @property
    def relative(self) -> bool:
        return self.bound.endswith("_ratio")

    def holds(self, value: float, base: float | None) -> bool:
        x = value / base if self.relative else value
        return x <= self.value if self.bound.startswith("max") else x >= self.value

    def describe(self) -> str:
        at = f"@{self.seq_len}" if self.seq_len else ""
        of = f" of {self.baseline}" if self.relative else ""
        op = "<=" if self.bound.startswith("max") else ">="
        what = "ratio" if self.relative else "value"
        return f"{self.method} {self.task} {self.metric}{at}: {what}{of} {op} {self.value:g}"


@dataclass(frozen=True)
class EvalConfig:
    """What ``oscar eval`` runs. ``scheme_overrides``: explicit ``sink``/``recent``/``group``/``bits`` that replace the
    scheme of every method (an artifact's scheme, or the data-free methods' defaults); refused where they cannot hold.
    ``thresholds``: bounds checked after the run (from a recipe)."""

    model: str = DEFAULT_MODEL
    tasks: tuple[str, ...] = DEFAULT_EVAL_TASKS
    methods: tuple[str, ...] = DEFAULT_EVAL_METHODS
    seq_lengths: tuple[int, ...] = DEFAULT_SEQ_LENGTHS
    limit: int | None = None
    artifact: str = "latest"
    data: Path | None = None
    decode: bool = False
    scheme_overrides: tuple[tuple[str, int], ...] = ()
    thresholds: tuple[Threshold, ...] = ()
    server: str | None = None

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ConfigError("--tasks is empty; pass e.g. --tasks oscar_ppl,ruler")
        if not self.methods:
            raise ConfigError("--methods is empty; pass e.g. --methods bf16,int2-naive,int2-hadamard,oscar")
        if not self.seq_lengths or any(n <= 1 for n in self.seq_lengths):
            raise ConfigError(f"--seq-lengths {list(self.seq_lengths)} must be token counts above 1, e.g. 1024,4096")
        if self.limit is not None and self.limit <= 0:
            raise ConfigError(f"--limit must be positive, got {self.limit}")
        allowed = {"sink", "recent", "group", "bits"}
        for k, v in self.scheme_overrides:
            if k not in allowed:
                raise ConfigError(f"cannot override {k!r} of the scheme; overridable: {', '.join(sorted(allowed))}")
            if v < 0:
                raise ConfigError(f"--{k} must be non-negative, got {v}")

    @property
    def overrides(self) -> dict[str, int]:
        return dict(self.scheme_overrides)


EVAL_KEYS = {"tasks", "methods", "seq_lengths", "limit", "sink", "recent", "group", "bits", "artifact", "decode"}
THRESHOLD_KEYS = {"method", "task", "metric", "seq_len", "baseline", *BOUNDS}


def _tuple(v, where: str, conv) -> tuple:
    items = v if isinstance(v, (list, tuple)) else str(v).split(",")
    try:
        return tuple(conv(x) for x in items if str(x).strip())
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be a list, got {v!r}") from None


def _eval_config(ev: dict[str, Any], model: str, where: str) -> EvalConfig:
    if not isinstance(ev, dict):
        raise ConfigError(f"{where} must be a mapping")
    bad = sorted(set(ev) - EVAL_KEYS)
    if bad:
        raise ConfigError(f"unknown key(s) {', '.join(bad)} in {where}; allowed: {', '.join(sorted(EVAL_KEYS))}")
    kw: dict[str, Any] = {"model": model}
    if "tasks" in ev:
        kw["tasks"] = _tuple(ev["tasks"], f"{where}.tasks", lambda x: str(x).strip())
    if "methods" in ev:
        kw["methods"] = _tuple(ev["methods"], f"{where}.methods", lambda x: str(x).strip())
    if "seq_lengths" in ev:
        kw["seq_lengths"] = _tuple(ev["seq_lengths"], f"{where}.seq_lengths", int)
    if "limit" in ev:
        kw["limit"] = None if ev["limit"] is None else int(ev["limit"])
    if "artifact" in ev:
        kw["artifact"] = str(ev["artifact"])
    if "decode" in ev:
        kw["decode"] = bool(ev["decode"])
    kw["scheme_overrides"] = tuple((k, int(ev[k])) for k in ("bits", "group", "sink", "recent") if k in ev)
    return EvalConfig(**kw)


def _thresholds(raw, ev: EvalConfig, where: str) -> tuple[Threshold, ...]:
    """Parse ``thresholds:`` (a list of mappings); every threshold must refer to a method and task the eval runs."""
    if raw in (None, [], {}):
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{where} must be a list of {{method, task, metric, max|min|max_ratio|min_ratio}} mappings")
    run_tasks = set(expand_tasks(ev.tasks))
    out = []
    for i, t in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(t, dict):
            raise ConfigError(f"{at} must be a mapping with method, task, metric and one bound")
        unknown = sorted(set(t) - THRESHOLD_KEYS)
        if unknown:
            raise ConfigError(f"unknown key(s) {', '.join(unknown)} in {at}; allowed: {', '.join(sorted(THRESHOLD_KEYS))}")
        missing = [k for k in ("method", "task", "metric") if k not in t]
        bounds = [b for b in BOUNDS if b in t]
        if missing or len(bounds) != 1:
            raise ConfigError(f"{at} needs method, task, metric and exactly one of {', '.join(BOUNDS)}")
        th = Threshold(method=str(t["method"]), task=str(t["task"]), metric=str(t["metric"]), bound=bounds[0],
                       value=float(t[bounds[0]]), seq_len=None if t.get("seq_len") is None else int(t["seq_len"]),
                       baseline=str(t.get("baseline", "bf16")))
        if th.method not in ev.methods:
            raise ConfigError(f"{at} checks method {th.method!r}, which the eval section does not run "
                              f"(methods: {', '.join(ev.methods)})")
        if th.relative and th.baseline not in ev.methods:
            raise ConfigError(f"{at} compares with {th.baseline!r}, which the eval section does not run; add it to methods")
        if "baseline" in t and not th.relative:
            raise ConfigError(f"{at} has a baseline but an absolute bound; use max_ratio/min_ratio or drop baseline")
        if th.task not in run_tasks:
            raise ConfigError(f"{at} checks task {th.task!r}, which the eval section does not run "
                              f"(tasks: {', '.join(sorted(run_tasks))})")
        if th.seq_len is not None and th.seq_len not in ev.seq_lengths:
            raise ConfigError(f"{at} checks seq_len {th.seq_len}, not among seq_lengths {list(ev.seq_lengths)}")
        out.append(th)
    return tuple(out)


@dataclass(frozen=True)
class Recipe:
    """A recipe file: one section per stage plus the thresholds an evaluation must meet."""

    model: str = DEFAULT_MODEL
    collect: CollectConfig = field(default_factory=CollectConfig)
    fit: FitConfig = field(default_factory=FitConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    has_eval: bool = False
    source: str = ""

    @property
    def thresholds(self) -> tuple[Threshold, ...]:
        return self.eval.thresholds


def _build(cls, section: dict[str, Any], where: str):
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(section) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(unknown)} in {where}; allowed: {', '.join(sorted(names))}")
    kwargs = dict(section)
    try:
        if cls is FitConfig:
            if "scheme" in kwargs:
                kwargs["scheme"] = QuantScheme.from_dict(kwargs["scheme"] or {}, f"{where}.scheme")
            for name in ("clip_grid", "clip_scale_grid", "split_clips_hi", "split_clips_lo"):
                if name in kwargs:
                    kwargs[name] = tuple(float(c) for c in kwargs[name])
        return cls(**kwargs)
    except SchemeError as e:
        raise ConfigError(f"{where}: {e}") from None
    except TypeError as e:
        raise ConfigError(f"bad value in {where}: {e}") from None


RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
"""Where each model's recipe lives (``recipes/<model-slug>.yaml`` in a checkout): ``oscar fit`` without ``--recipe``
fits a run with its model's recipe when there is one (:func:`default_recipe`)."""


def default_recipe(model_slug: str) -> Path | None:
    """The recipe of a model, ``recipes/<model_slug>.yaml``, when the checkout holds one (None otherwise)."""
    path = RECIPES_DIR / f"{model_slug}.yaml"
    return path if path.is_file() else None


def load_recipe(path: Path) -> Recipe:
    """Parse a recipe YAML; unknown keys anywhere, and thresholds about methods or tasks the recipe does not
    evaluate, are errors."""
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read recipe {path}: {e.strerror}; pass an existing YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe {path} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
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
    model = str(raw.get("model", DEFAULT_MODEL))
    ev = _eval_config(raw.get("eval") or {}, model, f"{path}:eval")
    if raw.get("thresholds") and "eval" not in raw:
        raise ConfigError(f"{path} has thresholds but no eval section to check them against")
    ev = dataclasses.replace(ev, thresholds=_thresholds(raw.get("thresholds"), ev, f"{path}:thresholds"))
    return Recipe(
        model=model,
        collect=_build(CollectConfig, raw.get("collect") or {}, f"{path}:collect"),
        fit=_build(FitConfig, raw.get("fit") or {}, f"{path}:fit"),
        eval=ev,
        has_eval="eval" in raw,
        source=text,
    )
