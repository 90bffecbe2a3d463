"""Accuracy evaluation: the library behind ``oscar eval`` (config in, typed rows out), perplexity and lm-eval tasks.

* :func:`run_eval` is the entry point: an :class:`~oscar_cli.config.EvalConfig` in, an :class:`EvalResult` out (one
  :class:`EvalRow` per metric, stored in the ``evals`` table as each method finishes, and the recipe thresholds the
  rows miss). It resolves artifacts (``latest``, ``vN``, a path, ``fit:METHOD[+per-head]``), decides every method's
  :class:`~oscar_kernels.scheme.QuantScheme` (an artifact's own; data-free baselines take the artifact's sink/recent
  so that the table compares like with like; explicit overrides on top, refused where they cannot hold) and runs the
  method loop. The CLI only parses flags into the config and renders the result.
* :func:`prepare` puts a model into a method's state: exact methods and ``hf-*`` peers use plain SDPA, quantizing
  methods use the decode-equivalent attention (:mod:`oscar_cli.attention`) for teacher-forced scoring.
* :func:`perplexity` is the ``oscar_ppl`` task: token-level perplexity over consecutive windows of ``seq_len``
  tokens; every position sees what a decoder holding that KV cache would see. ``hf-*`` peers have no teacher-forced
  equivalent and are decoded token by token through their cache (slow: ~20 tokens/s on 2 CPU cores).
* :class:`OscarLM` is the lm-eval model ``oscar`` (an ``HFLM``): loglikelihoods through the decode-equivalent
  attention, ``generate`` with a fresh cache per call.
* :func:`run_lm_eval` runs lm-eval tasks: the offline ones shipped in :mod:`oscar_cli.tasks` (RULER NIAH with a
  sample count that ``--limit`` really limits, a needle-in-a-haystack grid) through a
  ``TaskManager(include_path=..., include_defaults=False)``; any other lm-eval task through the full index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import (
    DEFAULT_PPL_WINDOWS,
    OFFLINE_TASKS,
    PPL_TASK,
    EvalConfig,
    QuantScheme,
    Threshold,
    expand_tasks,
)
from .errors import OscarError
from .kvquant import bits_per_element, build_layer_quants
from .methods import Method, get_method, parse_methods, scheme_for, scheme_record
from .progress import Progress

__all__ = ["EvalError", "EvalResult", "EvalRow", "Prepared", "ThresholdMiss", "check_thresholds", "element_bits",
           "lm_task_names", "oscar_lm_class", "perplexity", "prepare", "resolve_artifact_ref", "run_eval",
           "run_lm_eval"]


class EvalError(OscarError):
    """An evaluation that cannot run as asked."""


@dataclass(frozen=True)
class Prepared:
    """A model in one method's state. ``scheme``: what the method runs with; ``quants``: per-layer quantizers (None
    for exact/peer methods)."""

    method: Method
    scheme: QuantScheme
    quants: list | None
    artifact: str | None

    @property
    def layers_quantized(self) -> int:
        return 0 if self.quants is None else sum(q is not None for q in self.quants)


def _set_sdpa(model) -> None:
    try:
        model.set_attn_implementation("sdpa")
    except Exception:  # noqa: BLE001
        model.config._attn_implementation = "sdpa"


def head_dim_of(config) -> int:
    from .models import attention_shape

    return attention_shape(config).head_dim


def prepare(model, method: Method, scheme: QuantScheme, artifact=None) -> Prepared:
    """Switch ``model`` to ``method`` at ``scheme`` (see :func:`oscar_cli.methods.scheme_for`), with an
    :class:`oscar_cli.artifact.Artifact` for artifact methods."""
    from . import attention

    art_name = artifact.name if artifact is not None and method.needs_artifact else None
    if method.family in ("exact", "hf"):
        if method.family == "hf":
            from .methods import hf_backend

            hf_backend(method)  # a clear error now, not mid-run
        _set_sdpa(model)
        return Prepared(method, scheme, None, art_name)
    cfg = model.config
    quants = build_layer_quants(method, scheme, cfg.num_hidden_layers, head_dim_of(cfg), cfg.num_key_value_heads,
                                artifact)
    attention.install(model, quants, scheme)
    return Prepared(method, scheme, quants, art_name)


def element_bits(prep: Prepared, model, seq_len: int, exact_bits: int = 16) -> float:
    """Storage bits per K/V element at ``seq_len`` tokens with BF16 exact windows (see
    :func:`oscar_cli.kvquant.bits_per_element`). ``hf-*`` peers: 2-bit codes, fp scale+zero per 64, BF16 residual."""
    cfg = model.config
    m = prep.method
    if m.family == "hf":
        # QuantizedCache flushes its whole residual when it reaches `recent` tokens: on average recent/2 exact
        nq = max(0, seq_len - prep.scheme.recent // 2)
        return (nq * (m.bits + 2 * exact_bits / 64) + (seq_len - nq) * exact_bits) / seq_len
    return bits_per_element(m, prep.scheme, seq_len, head_dim_of(cfg),
                            layers_quantized=prep.layers_quantized if m.family == "quant" else None,
                            n_layers=cfg.num_hidden_layers, exact_bits=exact_bits)


# ----------------------------------------------------------------------------------------------------------------
# oscar_ppl


def token_ids(tokenizer, text: str) -> torch.Tensor:
    """Tokenize a text without special tokens: int64 ``[N]``."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def windows_of(ids: torch.Tensor, seq_len: int, limit: int | None) -> torch.Tensor:
    """Consecutive non-overlapping windows ``[W, seq_len]`` (at most ``limit``)."""
    n = ids.numel() // seq_len
    if n == 0:
        raise EvalError(f"the text has {ids.numel()} tokens, fewer than one window of {seq_len}; "
                        "pass a longer --data file or a smaller --seq-lengths")
    if limit:
        n = min(n, limit)
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def _nll_decoding(model, window: torch.Tensor, prep: Prepared) -> tuple[float, int]:
    """Sum of NLL of tokens 1..L-1 decoding one token at a time through the method's cache."""
    from .cache import cache_kwarg, make_cache

    dev = next(model.parameters()).device
    cache = make_cache(model, prep.method, prep.quants, prep.scheme)
    kw = cache_kwarg(model)
    total = 0.0
    x = window.to(dev)
    for t in range(x.numel() - 1):
        logits = model(x[t : t + 1][None], **{kw: cache}, use_cache=True).logits[0, -1].float()
        total += (torch.logsumexp(logits, -1) - logits[x[t + 1]]).item()
    return total, x.numel() - 1


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, prep: Prepared, advance: Callable[[], None] | None = None,
               decode: bool = False) -> float:
    """Token perplexity of ``windows [W, L]`` (each predicts tokens 1..L-1 from its own prefix).

    Teacher-forced through the decode-equivalent attention by default; ``decode=True`` feeds the tokens one at a time
    through the method's cache instead (on CUDA, INT2 decode steps then run the fused kernels)."""
    dev = next(model.parameters()).device
    nll, count = 0.0, 0
    for w in windows:
        if prep.method.cache_only or decode:
            s, c = _nll_decoding(model, w, prep)
        else:
            x = w.to(dev)[None]
            logits = model(x, use_cache=False).logits[0, :-1].float()
            s = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            c = x.shape[1] - 1
        nll, count = nll + s, count + c
        if advance is not None:
            advance()
    return math.exp(nll / count)


# ----------------------------------------------------------------------------------------------------------------
# lm-eval


def _hflm():
    from lm_eval.models.huggingface import HFLM

    return HFLM


def _make_oscar_lm_class():
    from lm_eval.api.registry import register_model

    HFLM = _hflm()

    @register_model("oscar")
    class OscarLM(HFLM):
        """lm-eval model ``oscar``: an HF causal LM whose KV cache is a method of :mod:`oscar_cli.methods`.

        Arguments (``--model_args``): ``pretrained`` (a loaded model or a model spec for
        :func:`oscar_cli.models.load_model`), ``method``, ``artifact`` (a path or a loaded artifact), the scheme
        overrides ``sink``, ``recent``, ``group``, ``bits`` (default: the artifact's scheme, or
        :class:`QuantScheme`'s for data-free methods; ``windows`` sets the data-free methods' sink/recent), ``store``,
        plus any ``HFLM`` argument."""

        def __init__(self, pretrained="smollm2-135m", method: str | Method = "bf16", artifact=None,
                     sink: int | None = None, recent: int | None = None, group: int | None = None,
                     bits: int | None = None, windows: QuantScheme | None = None, store: str = ".oscar",
                     tokenizer=None, **kwargs):
            if isinstance(pretrained, str):
                from .models import load_model

                loaded = load_model(pretrained, Path(store))
                pretrained, tokenizer = loaded.model, loaded.tokenizer
            if isinstance(artifact, (str, Path)):
                from .artifact import load_artifact

                artifact = load_artifact(Path(artifact))
            method = get_method(method) if isinstance(method, str) else method
            overrides = {k: int(v) for k, v in dict(sink=sink, recent=recent, group=group, bits=bits).items()
                         if v is not None}
            scheme = scheme_for(method, head_dim_of(pretrained.config),
                                artifact_scheme=artifact.scheme if artifact is not None else None,
                                windows=windows, overrides=overrides,
                                artifact_name=artifact.name if artifact is not None else "")
            kwargs.setdefault("device", str(next(pretrained.parameters()).device))
            super().__init__(pretrained=pretrained, tokenizer=tokenizer, **kwargs)
            self.prep = prepare(self.model, method, scheme, artifact)

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            from .cache import cache_kwarg, make_cache

            if self.prep.method.family != "exact":
                cache = make_cache(self.model, self.prep.method, self.prep.quants, self.prep.scheme)
                generation_kwargs[cache_kwarg(self.model)] = cache
                pad = self.tokenizer.pad_token_id
                if pad is not None and "attention_mask" not in generation_kwargs:
                    mask = (context != pad).long()
                    # a row that starts with the pad id as a real token (pad == eos) keeps its first token
                    mask[:, -1] = 1
                    generation_kwargs["attention_mask"] = torch.cumsum(mask, 1).clamp(max=1)
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    return OscarLM


_OSCAR_LM = None


def __getattr__(name: str):
    """``oscar_cli.evaluate.OscarLM`` (the entry point lm-eval resolves) builds the class on first use."""
    if name == "OscarLM":
        return oscar_lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def oscar_lm_class():
    """The registered lm-eval model class (registered on first use, so importing this module stays cheap)."""
    global _OSCAR_LM
    if _OSCAR_LM is None:
        _OSCAR_LM = _make_oscar_lm_class()
    return _OSCAR_LM


def tasks_dir() -> Path:
    return Path(__file__).parent / "tasks"


def lm_task_names(names) -> list[str]:
    """Row task names (see :func:`oscar_cli.config.expand_tasks`) -> lm-eval task names (offline ones are shipped)."""
    return [OFFLINE_TASKS.get(n, n) for n in names]


def run_lm_eval(lm, tasks: list[str], limit: int | None, metadata: dict) -> dict[str, dict[str, float]]:
    """Run lm-eval tasks on an :class:`OscarLM`; returns ``{task: {metric: value}}`` (numeric metrics only).

    Offline tasks load from :func:`tasks_dir` only; others need lm-eval's index and usually the hub: when their data
    cannot be fetched this raises a one-line :class:`EvalError` naming the offline tasks."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    offline = set(OFFLINE_TASKS.values())
    md = dict(metadata)
    if limit:
        md["num_samples"] = int(limit)
    if all(t in offline for t in tasks):
        tm = TaskManager(include_path=str(tasks_dir()), include_defaults=False, metadata=md)
    else:
        tm = TaskManager(include_path=str(tasks_dir()), metadata=md)
        unknown = [t for t in tasks if t not in tm.all_tasks]
        if unknown:
            raise EvalError(f"unknown lm-eval task(s) {', '.join(unknown)}; offline tasks: {PPL_TASK}, ruler, "
                            f"{', '.join(OFFLINE_TASKS)}")
    try:
        res = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=tm, log_samples=False,
                                      bootstrap_iters=0)
    except OscarError:
        raise
    except Exception as e:  # noqa: BLE001  (datasets/hub raise many types when offline)
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise EvalError(
            f"lm-eval could not run {', '.join(tasks)} ({type(e).__name__}: {first}); without hub access use the "
            f"offline tasks: {PPL_TASK}, ruler, {', '.join(OFFLINE_TASKS)}"
        ) from None
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (res or {}).get("results", {}).items():
        vals = {}
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "stderr" not in k and k != "alias":
                vals[k.split(",")[0]] = float(v)
        out[task] = vals
    return out


def lm_eval_version() -> str:
    try:
        from importlib.metadata import version

        return version("lm_eval")
    except Exception:  # noqa: BLE001
        return "unknown"


# ----------------------------------------------------------------------------------------------------------------
# The entry point


@dataclass(frozen=True)
class EvalRow:
    """One metric of one method on one task (what the ``evals`` table stores). ``config`` holds the run settings,
    the effective ``scheme`` and the explicit ``overrides``."""

    model_fingerprint: str
    model_slug: str
    method: str
    artifact: str | None
    task: str
    metric: str
    value: float
    config: dict
    bits_per_element: float | None
    lm_eval_version: str

    @property
    def seq_len(self) -> int | None:
        return self.config.get("seq_len")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ThresholdMiss:
    """A threshold the rows do not meet (``value`` None: no row was produced for it)."""

    threshold: Threshold
    value: float | None
    baseline: float | None = None
    seq_len: int | None = None

    def message(self) -> str:
        t = self.threshold
        at = f"@{self.seq_len}" if self.seq_len else ""
        where = f"{t.method} {t.task} {t.metric}{at}"
        if self.value is None:
            return f"threshold not checked: no {where} row was produced ({t.describe()})"
        op = ">" if t.bound.startswith("max") else "<"
        if t.relative:
            got = (f"{self.value:.4g}, ratio to {t.baseline} {self.value / self.baseline:.4g}" if self.baseline
                   else f"{self.value:.4g}, no {t.baseline} row to compare with")
            return f"threshold missed: {where} = {got} {op} {t.bound} {t.value:g}"
        return f"threshold missed: {where} = {self.value:.4g} {op} {t.bound} {t.value:g}"


@dataclass
class EvalResult:
    rows: list[EvalRow] = field(default_factory=list)
    misses: list[ThresholdMiss] = field(default_factory=list)


def check_thresholds(rows: list[EvalRow], thresholds) -> list[ThresholdMiss]:
    """Every (threshold, evaluated length) that the rows miss, in threshold order."""
    misses = []
    for t in thresholds:
        hits = [r for r in rows if (r.method, r.task, r.metric) == (t.method, t.task, t.metric)
                and (t.seq_len is None or r.seq_len == t.seq_len)]
        if not hits:
            misses.append(ThresholdMiss(t, None, seq_len=t.seq_len))
        for r in hits:
            base = None
            if t.relative:
                base = next((b.value for b in rows if (b.method, b.task, b.metric, b.seq_len)
                             == (t.baseline, r.task, r.metric, r.seq_len)), None)
            if base is None and t.relative or not t.holds(r.value, base):
                misses.append(ThresholdMiss(t, r.value, base, r.seq_len))
    return misses


def resolve_artifact_ref(store, ref: str, slug: str) -> Path:
    """``fit:METHOD[+per-head]`` -> the newest artifact of that fit method; anything else -> the store's resolver
    (``latest``, ``vN``, ``model/vN``, an id, a folder)."""
    from .artifact import ArtifactError, read_manifest

    if not ref.startswith("fit:"):
        return store.resolve_artifact(ref, slug)
    want, _, flag = ref[4:].partition("+")
    if flag not in ("", "per-head"):
        raise EvalError(f"artifact ref {ref!r}: use fit:METHOD or fit:METHOD+per-head")
    per_head = flag == "per-head"
    for a in reversed(store.list_artifacts(slug)):
        if a["method"] != want:
            continue
        try:
            manifest = read_manifest(Path(a["path"]))
        except ArtifactError:
            continue
        if manifest.per_head == per_head:
            return Path(a["path"])
    raise EvalError(f"no artifact fitted with method {want}{' per head' if per_head else ''} for {slug}; "
                    f"run: oscar fit --method {want}{' --per-head' if per_head else ''}")


def reference_windows(artifacts: dict, overrides: dict[str, int]) -> QuantScheme:
    """The sink/recent that data-free methods run with: the artifacts' (when they agree), else the defaults; an
    explicit override wins (it applies to every method)."""
    wins = {(a.scheme.sink, a.scheme.recent): a.name for a in artifacts.values()}
    if len(wins) > 1 and not {"sink", "recent"} <= set(overrides):
        shown = ", ".join(f"{n} ({s}/{r})" for (s, r), n in wins.items())
        raise EvalError(f"the artifacts keep different sink/recent windows: {shown}; pass --sink and --recent to "
                        "compare them (and the data-free baselines) at one setting")
    if len(wins) == 1:
        (sink, recent), = wins
        return QuantScheme(sink=sink, recent=recent)
    return QuantScheme()


def _ppl_text(cfg: EvalConfig, tokenizer) -> torch.Tensor | None:
    """Token ids of the ``oscar_ppl`` text (``--data`` or the built-in held-out half), or None without that task."""
    if PPL_TASK not in expand_tasks(cfg.tasks):
        return None
    from .data import heldout_text, read_text_file

    return token_ids(tokenizer, read_text_file(cfg.data) if cfg.data is not None else heldout_text())


def _ppl_steps(cfg: EvalConfig, text_ids: torch.Tensor | None) -> int:
    """Perplexity windows one method evaluates (progress units)."""
    if text_ids is None:
        return 0
    return sum(min(cfg.limit or DEFAULT_PPL_WINDOWS, text_ids.numel() // n) for n in cfg.seq_lengths)


def _lm_rows(res: dict, base: dict, run_cfg: dict, seq_lengths, bits: Callable[[int], float | None]) -> list[EvalRow]:
    """:func:`run_lm_eval` results -> rows (RULER's metric names are its lengths; ``-1`` marks a length not run)."""
    rows = []
    for task, metrics in res.items():
        samples = metrics.pop("sample_len", None)
        for metric, value in metrics.items():
            if value == -1.0:
                continue  # RULER's placeholder for lengths that were not run
            n = int(metric) if metric.isdigit() else max(seq_lengths)
            rows.append(EvalRow(**base, task=task.removeprefix("oscar_ruler_"), metric=metric, value=value,
                                config=dict(run_cfg, seq_len=n, seq_lengths=list(seq_lengths), samples=samples),
                                bits_per_element=bits(n)))
    return rows


def run_eval(cfg: EvalConfig, store: Path, progress: Progress | None = None) -> EvalResult:
    """Evaluate every method of ``cfg`` on its tasks; rows go to the store's ``evals`` table as each method finishes
    (an interrupted run keeps every finished method). Returns the rows and the threshold misses. With
    ``cfg.server`` the tasks run against that server instead (:func:`run_eval_server`)."""
    if cfg.server:
        return run_eval_server(cfg, store, progress)
    from .artifact import load_artifact
    from .models import load_model
    from .store import Store

    progress = progress or Progress()
    methods = parse_methods(cfg.methods)
    row_tasks = expand_tasks(cfg.tasks)
    lm_tasks = lm_task_names([t for t in row_tasks if t != PPL_TASK])
    if cfg.data is not None and not Path(cfg.data).is_file():
        raise EvalError(f"--data {cfg.data} is not a file; pass a UTF-8 text file")
    if any(m.cache_only for m in methods) and PPL_TASK in row_tasks and max(cfg.seq_lengths) > 2048:
        raise EvalError("hf-* peers decode token by token for oscar_ppl; use --seq-lengths of at most 2048")

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    st = Store(store)
    loaded = load_model(cfg.model, store, dtype=dtype, device=device)
    head_dim = head_dim_of(loaded.config)
    artifacts = {}
    for m in methods:
        ref = m.arg or cfg.artifact
        if m.needs_artifact and ref not in artifacts:
            artifacts[ref] = load_artifact(resolve_artifact_ref(st, ref, loaded.slug), loaded.fingerprint)
    overrides = cfg.overrides
    windows = reference_windows(artifacts, overrides)
    plan = []  # every method's scheme first, so a refused override stops the run before any work
    for m in methods:
        art = artifacts.get(m.arg or cfg.artifact) if m.needs_artifact else None
        scheme = scheme_for(m, head_dim, artifact_scheme=art.scheme if art else None, windows=windows,
                            overrides=overrides, artifact_name=art.name if art else "")
        plan.append((m, art, scheme))
    text_ids = _ppl_text(cfg, loaded.tokenizer)
    version = lm_eval_version()
    per_len = cfg.limit or DEFAULT_PPL_WINDOWS
    progress.start(len(methods) * (_ppl_steps(cfg, text_ids) + (1 if lm_tasks else 0)))
    result = EvalResult()
    for m, art, scheme in plan:
        rows: list[EvalRow] = []
        prep = prepare(loaded.model, m, scheme, art)
        base = dict(model_fingerprint=loaded.fingerprint, model_slug=loaded.slug, method=m.label,
                    artifact=prep.artifact, lm_eval_version=version)
        run_cfg = dict(limit=cfg.limit, device=device, dtype=str(dtype).removeprefix("torch."), bits=scheme.bits,
                       **scheme_record(scheme, overrides))
        if text_ids is not None:
            for n in cfg.seq_lengths:
                progress.describe(f"{m.label} {PPL_TASK}@{n}")
                wins = windows_of(text_ids, n, per_len)
                ppl = perplexity(loaded.model, wins, prep, progress.advance, decode=cfg.decode)
                rows.append(EvalRow(**base, task=PPL_TASK, metric="ppl", value=ppl,
                                    config=dict(run_cfg, seq_len=n, windows=len(wins),
                                                mode="decode" if cfg.decode or m.cache_only else "teacher-forced",
                                                data=str(cfg.data) if cfg.data else "builtin:heldout"),
                                    bits_per_element=element_bits(prep, loaded.model, n)))
        if lm_tasks:
            progress.describe(f"{m.label} {','.join(lm_tasks)}")
            from .tasks import TOKENIZERS

            tok_name = getattr(loaded.tokenizer, "name_or_path", None) or loaded.slug
            TOKENIZERS[tok_name] = loaded.tokenizer
            lm = oscar_lm_class()(pretrained=loaded.model, tokenizer=loaded.tokenizer, method=m, artifact=art,
                                  windows=windows, batch_size=1, max_length=max(cfg.seq_lengths) + 256,
                                  **overrides)
            res = run_lm_eval(lm, lm_tasks, cfg.limit, {"tokenizer": tok_name, "max_seq_lengths": list(cfg.seq_lengths)})
            rows += _lm_rows(res, base, run_cfg, cfg.seq_lengths,
                             lambda n, prep=prep: element_bits(prep, loaded.model, n))
            progress.advance()
        st.record_evals([r.to_dict() for r in rows])  # per method: an interrupted run keeps every finished method
        result.rows.extend(rows)
    result.misses = check_thresholds(result.rows, cfg.thresholds)
    return result


# ----------------------------------------------------------------------------------------------------------------
# Through a server: `oscar eval --server URL` (the embedded OpenAI server or SGLang with the plugin)


@dataclass(frozen=True)
class ServerInfo:
    """What an OpenAI-compatible server says it serves (``GET /v1/models``; the ``oscar`` block when it is ours)."""

    url: str
    model_id: str
    method: str
    artifact: str | None
    scheme: dict | None


def _http(method: str, url: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    import json
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:200]
        raise EvalError(f"server {url} answered {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise EvalError(f"cannot reach server {url} ({getattr(e, 'reason', e)}); start it with `oscar serve` "
                        "or pass the right --server URL") from None


def server_info(url: str) -> ServerInfo:
    base = url.rstrip("/").removesuffix("/v1")
    cards = _http("GET", f"{base}/v1/models", timeout=30).get("data") or []
    if not cards:
        raise EvalError(f"server {base} serves no model (empty /v1/models)")
    card = cards[0]
    meta = card.get("oscar") or sglang_meta(base)
    return ServerInfo(url=base, model_id=card["id"], method=meta.get("method", "server"),
                      artifact=(meta.get("artifact") or {}).get("name") if isinstance(meta.get("artifact"), dict)
                      else meta.get("artifact"), scheme=meta.get("scheme"))


def sglang_meta(base: str) -> dict:
    """What an SGLang server serves, from its ``/server_info`` (its server arguments): with the ``oscar`` attention
    backend, method ``oscar`` and the artifact handed over in ``--json-model-override-args`` (name and scheme read
    from its manifest where that path exists here, else the path); otherwise ``sglang-<backend>-<kv dtype>``.
    ``{}`` for a server that is not SGLang."""
    import json

    from .artifact import ArtifactError, load_artifact

    try:
        info = _http("GET", f"{base}/server_info", timeout=30)
    except EvalError:
        return {}
    backend = info.get("attention_backend") if isinstance(info, dict) else None
    if not backend:
        return {}
    if backend != "oscar":
        kv = info.get("kv_cache_dtype") or "auto"
        return {"method": f"sglang-{backend}-{'bf16' if kv == 'auto' else kv}"}
    over = info.get("json_model_override_args") or "{}"
    try:
        path = (json.loads(over) if isinstance(over, str) else over).get("oscar", {}).get("artifact")
    except (ValueError, AttributeError):
        path = None
    meta: dict = {"method": "oscar", "artifact": path}
    if path and Path(path).is_dir():
        try:
            art = load_artifact(Path(path))
            meta.update(artifact=art.name, scheme=art.scheme.to_dict())
        except ArtifactError:
            pass
    return meta


def perplexity_via_server(info: ServerInfo, windows: torch.Tensor, advance: Callable[[], None] | None = None) -> float:
    """``oscar_ppl`` from the server's prompt logprobs (``echo`` + ``logprobs``; the one new token asked for is not
    counted): each window ``[L]`` of token ids contributes the logprobs of its tokens 1..L-1."""
    nll, count = 0.0, 0
    for w in windows:
        out = _http("POST", f"{info.url}/v1/completions", {
            "model": info.model_id, "prompt": w.tolist(), "max_tokens": 1, "echo": True, "logprobs": 1,
            "temperature": 0.0})  # SGLang refuses max_tokens 0
        lps = out["choices"][0]["logprobs"]["token_logprobs"][1: w.numel()]
        if len(lps) != w.numel() - 1 or any(x is None for x in lps):
            raise EvalError(f"server {info.url} returned {len(lps)} prompt logprobs for a {w.numel()}-token window; "
                            "it must support echo with logprobs")
        nll, count = nll - sum(lps), count + len(lps)
        if advance is not None:
            advance()
    return math.exp(nll / count)


def server_lm(info: ServerInfo, tokenizer_path: str | None, max_length: int):
    """lm-eval's ``local-completions`` model against the server (token-id prompts with a local tokenizer)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    kw = dict(base_url=f"{info.url}/v1/completions", model=info.model_id, max_length=max_length, num_concurrent=1,
              max_retries=1, timeout=600)
    if tokenizer_path is not None:
        kw.update(tokenizer=tokenizer_path, tokenizer_backend="huggingface", tokenized_requests=True)
    else:
        kw.update(tokenizer_backend="remote", tokenized_requests=True)
    return LocalCompletionsAPI(**kw)


def run_eval_server(cfg: EvalConfig, store: Path, progress: Progress | None = None) -> EvalResult:
    """``run_eval`` through a running server: ``oscar_ppl`` from prompt logprobs, lm-eval tasks through
    ``local-completions``; rows record the server's method, artifact and scheme."""
    from transformers import AutoTokenizer

    from .models import quiet_transformers, resolve
    from .store import Store

    progress = progress or Progress()
    info = server_info(cfg.server)
    quiet_transformers()
    slug, _, folder = resolve(cfg.model, store)
    tok_path = str(folder) if folder is not None else cfg.model
    tok = AutoTokenizer.from_pretrained(tok_path)
    row_tasks = expand_tasks(cfg.tasks)
    lm_tasks = lm_task_names([t for t in row_tasks if t != PPL_TASK])
    text_ids = _ppl_text(cfg, tok)
    per_len = cfg.limit or DEFAULT_PPL_WINDOWS
    progress.start(_ppl_steps(cfg, text_ids) + (1 if lm_tasks else 0))
    label = info.method
    base = dict(model_fingerprint="", model_slug=slug, method=label, artifact=info.artifact,
                lm_eval_version=lm_eval_version())
    run_cfg = dict(limit=cfg.limit, server=info.url, served_model=info.model_id, scheme=info.scheme, overrides={})
    rows: list[EvalRow] = []
    bits = None  # the server's storage is its own business (SGLang reports its pool)
    if text_ids is not None:
        for n in cfg.seq_lengths:
            progress.describe(f"{label} {PPL_TASK}@{n}")
            wins = windows_of(text_ids, n, per_len)
            ppl = perplexity_via_server(info, wins, progress.advance)
            rows.append(EvalRow(**base, task=PPL_TASK, metric="ppl", value=ppl,
                                config=dict(run_cfg, seq_len=n, windows=len(wins), mode="server",
                                            data=str(cfg.data) if cfg.data else "builtin:heldout"),
                                bits_per_element=bits))
    if lm_tasks:
        from .tasks import TOKENIZERS

        progress.describe(f"{label} {','.join(lm_tasks)}")
        TOKENIZERS[tok_path] = tok
        lm = server_lm(info, tok_path, max(cfg.seq_lengths) + 256)
        res = run_lm_eval(lm, lm_tasks, cfg.limit, {"tokenizer": tok_path, "max_seq_lengths": list(cfg.seq_lengths)})
        rows += _lm_rows(res, base, run_cfg, cfg.seq_lengths, lambda n: bits)
        progress.advance()
    Store(store).record_evals([r.to_dict() for r in rows])
    return EvalResult(rows, check_thresholds(rows, cfg.thresholds))


@contextlib.contextmanager
def quiet_stdout():
    """Libraries under lm-eval print to stdout; keep stdout for results (``--json`` stays parseable)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield
