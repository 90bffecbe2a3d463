"""Accuracy evaluation: decode-equivalent perplexity and lm-eval tasks for every KV method.

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

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import OscarError
from .methods import Method, Windows, bits_per_element, build_layer_quants, windows_for

OFFLINE_TASKS = {
    # user-facing name: (task in oscar_cli/tasks, metric prefix)
    "niah_single_1": "oscar_ruler_niah_single_1",
    "niah_multikey_2": "oscar_ruler_niah_multikey_2",
    "niah_multikey_3": "oscar_ruler_niah_multikey_3",
    "oscar_niah": "oscar_niah",
}
TASK_GROUPS = {"ruler": ["niah_single_1"]}
"""``ruler`` means the RULER tasks that run offline; ``niah_multikey_2/3`` can be named explicitly."""
PPL_TASK = "oscar_ppl"


class EvalError(OscarError):
    """An evaluation that cannot run as asked."""


@dataclass(frozen=True)
class Prepared:
    """A model in one method's state. ``quants``: per-layer quantizers (None for exact/peer methods)."""

    method: Method
    windows: Windows
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


def prepare(model, method: Method, sink: int, recent: int, artifact=None) -> Prepared:
    """Switch ``model`` to ``method`` (with an :class:`oscar_cli.artifact.Artifact` for artifact methods)."""
    from . import attention

    windows = windows_for(method, sink, recent)
    art_name = artifact.name if artifact is not None and method.needs_artifact else None
    if method.family in ("exact", "hf"):
        if method.family == "hf":
            from .methods import hf_backend

            hf_backend(method)  # a clear error now, not mid-run
        _set_sdpa(model)
        return Prepared(method, windows, None, art_name)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    quants = build_layer_quants(method, cfg.num_hidden_layers, head_dim, cfg.num_key_value_heads, artifact)
    attention.install(model, quants, windows)
    return Prepared(method, windows, quants, art_name)


def element_bits(prep: Prepared, model, seq_len: int, exact_bits: int = 16) -> float:
    """Storage bits per K/V element at ``seq_len`` tokens with BF16 exact windows (see
    :func:`oscar_cli.methods.bits_per_element`). ``hf-*`` peers: 2-bit codes, fp scale+zero per 64, BF16 residual."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    m = prep.method
    if m.family == "hf":
        # QuantizedCache flushes its whole residual when it reaches `recent` tokens: on average recent/2 exact
        nq = max(0, seq_len - prep.windows.recent // 2)
        return (nq * (m.bits + 2 * exact_bits / 64) + (seq_len - nq) * exact_bits) / seq_len
    group = None
    if prep.quants:
        q = next((q for q in prep.quants if q is not None), None)
        group = q.group if q is not None else None
    return bits_per_element(m, seq_len, head_dim, prep.windows.sink, prep.windows.recent,
                            layers_quantized=prep.layers_quantized if m.family == "quant" else None,
                            n_layers=cfg.num_hidden_layers, exact_bits=exact_bits, group=group)


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
    cache = make_cache(model, prep.method, prep.quants, prep.windows.sink, prep.windows.recent)
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
        :func:`oscar_cli.models.load_model`), ``method``, ``artifact`` (path), ``sink``, ``recent``, ``store``,
        plus any ``HFLM`` argument."""

        def __init__(self, pretrained="smollm2-135m", method: str | Method = "bf16", artifact=None,
                     sink: int = 64, recent: int = 256, store: str = ".oscar", tokenizer=None, **kwargs):
            from .methods import get_method

            if isinstance(pretrained, str):
                from .models import load_model

                loaded = load_model(pretrained, Path(store))
                pretrained, tokenizer = loaded.model, loaded.tokenizer
            if isinstance(artifact, (str, Path)):
                from .artifact import load_artifact

                artifact = load_artifact(Path(artifact))
            self._method = get_method(method) if isinstance(method, str) else method
            kwargs.setdefault("device", str(next(pretrained.parameters()).device))
            super().__init__(pretrained=pretrained, tokenizer=tokenizer, **kwargs)
            self.prep = prepare(self.model, self._method, int(sink), int(recent), artifact)

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            from .cache import cache_kwarg, make_cache

            if self.prep.method.family != "exact":
                cache = make_cache(self.model, self.prep.method, self.prep.quants, self.prep.windows.sink,
                                   self.prep.windows.recent)
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


def oscar_lm_class():
    """The registered lm-eval model class (registered on first use, so importing this module stays cheap)."""
    global _OSCAR_LM
    if _OSCAR_LM is None:
        _OSCAR_LM = _make_oscar_lm_class()
    return _OSCAR_LM


def tasks_dir() -> Path:
    return Path(__file__).parent / "tasks"


def expand_tasks(names: list[str]) -> list[str]:
    """User task names -> lm-eval task names (``ruler`` -> offline RULER NIAH; offline names -> shipped tasks)."""
    out: list[str] = []
    for n in names:
        for m in TASK_GROUPS.get(n, [n]):
            t = OFFLINE_TASKS.get(m, m)
            if t not in out:
                out.append(t)
    return out


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
