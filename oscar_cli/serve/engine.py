"""``TransformersEngine``: token-by-token generation through a fresh :class:`oscar_cli.cache.OscarCache` per request.

One worker thread owns the model (a transformers model is not thread-safe) and takes requests from a bounded queue;
:meth:`TransformersEngine.submit` refuses with :class:`QueueFull` when the queue is full. Each request streams
:class:`TokenEvent` (one per generated token, with its text delta and optional logprobs) and ends with one
:class:`Finished`. A request is cancelled between two tokens (client gone, shutdown): the worker checks its flag
before every forward pass.

Decoding: greedy when ``temperature == 0``, else softmax sampling at ``temperature`` with nucleus ``top_p`` from a
per-request generator (``seed``). Logprobs are the model's own log-softmax (before temperature and top-p), fp32.
Text: the generated ids are decoded as a whole at every step (special tokens skipped, no clean-up of spaces) and only
the part that is final is emitted: stop strings cut the text before them, and the last ``len(longest stop) - 1``
characters (or an incomplete UTF-8 character) are held back until they cannot start a stop string, so streamed
deltas always concatenate to the non-streamed text.

The KV method: ``oscar`` with an artifact, ``bf16`` without; bits, group, sink and recent come from the artifact's
scheme. :func:`kv_setup` is the one place that touches the cache and model-state
APIs.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import OscarError

log = logging.getLogger("oscar.serve")


class EngineError(OscarError):
    """A request the engine cannot run (the message says why)."""


class QueueFull(EngineError):
    """The request queue is full; retry later."""


class EngineStopped(EngineError):
    """The engine is shutting down and takes no new requests."""


# ----------------------------------------------------------------------------------------------------------------
# The KV method: the one call site of the cache / model-state APIs


@dataclass(frozen=True)
class KVSetup:
    """A model in its serving state. ``new_cache()`` returns a fresh cache for one request, ``cache_kwarg`` the
    keyword that passes it to ``forward``; ``method`` is the method label; ``scheme`` is the artifact's
    ``QuantScheme.to_dict()`` (None for ``bf16``); ``prepared`` is the :class:`oscar_cli.prepare.Prepared` state
    the caches are built from (what ``oscar eval``'s perplexity takes)."""

    method: str
    scheme: dict | None
    new_cache: Callable[[], object]
    cache_kwarg: str
    prepared: object


def kv_setup(model, artifact) -> KVSetup:
    """Put ``model`` in the state of its serving method and return how to build its per-request cache.

    ``artifact``: an :class:`oscar_cli.artifact.Artifact` (method ``oscar`` at the artifact's own
    :class:`~oscar_kernels.scheme.QuantScheme`: bits, group, sink, recent) or None (``bf16``: an exact
    :class:`OscarCache`)."""
    from ..cache import cache_kwarg, make_cache
    from ..methods import get_method, scheme_for
    from ..prepare import head_dim_of, prepare

    head_dim = head_dim_of(model.config)
    if artifact is None:
        method = get_method("bf16")
        scheme = scheme_for(method, head_dim)
    else:
        method = get_method("oscar")
        scheme = scheme_for(method, head_dim, artifact_scheme=artifact.scheme, artifact_name=artifact.name)
    prep = prepare(model, method, scheme, artifact)

    def new_cache():
        return make_cache(model, prep.method, prep.quants, prep.scheme)

    shown = None if artifact is None else scheme.to_dict()
    return KVSetup(method.label, shown, new_cache, cache_kwarg(model), prep)


# ----------------------------------------------------------------------------------------------------------------
# Requests and events


@dataclass(frozen=True)
class SamplingParams:
    """What to generate. ``max_tokens``: completion tokens (0: none; with ``echo`` only the prompt is scored);
    ``logprobs``: None, or the number of alternatives reported with each token (0: the chosen token only);
    ``echo``: score the prompt too (prompt logprobs when ``logprobs`` is set); ``stop``: strings that end the text
    (not included); ``stop_token_ids``: ids that end it besides EOS (``ignore_eos`` drops EOS)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    echo: bool = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise EngineError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise EngineError(f"temperature must be >= 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise EngineError(f"logprobs must be >= 0, got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprob:
    """One position: its token id and text, its logprob (None for the first prompt token) and the ``top``
    alternatives as ``(id, text, logprob)``, best first."""

    token_id: int
    text: str
    logprob: float | None
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: ``delta`` is the text it makes final (may be empty while text is held back)."""

    token_id: int
    delta: str
    logprob: TokenLogprob | None


@dataclass(frozen=True)
class Prefilled:
    """The prompt went through the model (first event of a request). ``prompt_logprobs``: one per prompt token
    (echo with logprobs), else None."""

    prompt_tokens: int
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Finished:
    """The end of a request. ``reason``: ``stop`` | ``length`` | ``cancelled`` | ``error``; ``delta``: text released
    at the end; ``completion_tokens`` counts every generated token, a stop token included."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    delta: str = ""
    error: str | None = None


Event = Prefilled | TokenEvent | Finished


@dataclass
class Request:
    """A submitted request. ``emit`` is called on the worker thread with each event; :meth:`cancel` is safe from any
    thread and takes effect before the next token."""

    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class Completion:
    """The result of :meth:`TransformersEngine.generate`. ``token_ids``: the tokens of ``text`` (a stop token is
    counted in ``completion_tokens`` but not listed)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob] | None


@dataclass
class EngineStats:
    """Counters since start (written under the engine's lock, read without it)."""

    requests: int = 0
    cancelled: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


_STOP = object()


# ----------------------------------------------------------------------------------------------------------------
# The engine


class TransformersEngine:
    """Serve one model (and optionally one artifact) from a single worker thread.

    ``loaded``: an :class:`oscar_cli.models.LoadedModel`; ``artifact``: an :class:`oscar_cli.artifact.Artifact` bound
    to it or None; ``max_queue``: waiting requests (see :class:`oscar_cli.serve.config.ServeConfig`)."""

    def __init__(self, loaded, artifact=None, max_queue: int | None = None):
        from .config import ServeConfig

        self.loaded, self.artifact = loaded, artifact
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.device = next(self.model.parameters()).device
        self.kv = kv_setup(self.model, artifact)
        self.max_position: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.stats = EngineStats()
        self._max_queue = ServeConfig.max_queue if max_queue is None else int(max_queue)
        self._queue: queue.Queue = queue.Queue()  # bounded by the admission count below
        self._admitted = 0  # requests submitted and not finished: waiting + the one being decoded
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._cancel_all = threading.Event()
        self._current: Request | None = None
        self._worker: threading.Thread | None = None
        self._logits_to_keep = "logits_to_keep" in _forward_params(self.model)

    @classmethod
    def load(cls, model: str, store: Path, artifact: Path | None = None, max_queue: int | None = None,
             device: str | None = None) -> TransformersEngine:
        """Load ``model`` (a spec for :func:`oscar_cli.models.load_model`) and the artifact folder ``artifact``
        (checked against the model's fingerprint). CUDA: bf16; CPU: fp32."""
        from ..artifact import load_artifact
        from ..models import load_model

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        loaded = load_model(model, Path(store), dtype=dtype, device=device)
        art = load_artifact(Path(artifact), loaded.fingerprint) if artifact is not None else None
        return cls(loaded, art, max_queue=max_queue)

    # --- description ----------------------------------------------------------------------------------------------
    @property
    def method(self) -> str:
        return self.kv.method

    @property
    def scheme(self) -> dict | None:
        return self.kv.scheme

    def describe(self) -> dict:
        """What is served: model slug/source/fingerprint, method, artifact (name, path, content hash), scheme."""
        art = None
        if self.artifact is not None:
            art = dict(name=self.artifact.name, path=str(Path(self.artifact.path).resolve()),
                       content_hash=self.artifact.manifest.content_hash)
        return dict(model=self.loaded.slug, source=self.loaded.source, fingerprint=self.loaded.fingerprint,
                    method=self.method, artifact=art, scheme=self.scheme)

    # --- tokenizer helpers -----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt string (the tokenizer's special tokens added as it does by default)."""
        return list(self.tokenizer(text)["input_ids"])

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat through the tokenizer's chat template, ready for the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise EngineError("the model's tokenizer has no chat template; use /v1/completions")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # --- lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        with self._lock:
            if self._stopping.is_set():
                raise EngineStopped("the engine has been stopped")
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="oscar-engine", daemon=True)
                self._worker.start()

    def stop(self, cancel: bool = True, timeout: float | None = 10.0) -> None:
        """Take no new requests; cancel the queued and running ones (``cancel``) or let them finish; join the worker."""
        with self._lock:
            self._stopping.set()
            worker = self._worker
        if cancel:
            self._cancel_all.set()
            while True:
                try:
                    r = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(r, Request):
                    r.cancel()
                    self._finish(r, Finished("cancelled", len(r.prompt_ids), 0))
        if worker is not None:
            self._queue.put(_STOP)
            worker.join(timeout)

    def drain(self, grace: float) -> None:
        """Take no new requests; let the queued and running ones finish for up to ``grace`` seconds, then cancel what
        is left (each gets ``Finished("cancelled")``) and join the worker: a graceful shutdown."""
        with self._lock:
            self._stopping.set()
        deadline = time.monotonic() + grace
        while (self.busy or self.queue_depth()) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.stop(cancel=True, timeout=max(grace, 1.0))

    @property
    def running(self) -> bool:
        return self._worker is not None and self._worker.is_alive() and not self._stopping.is_set()

    @property
    def busy(self) -> bool:
        """True while the worker decodes a request."""
        return self._current is not None

    def queue_depth(self) -> int:
        """Requests waiting for the worker."""
        with self._lock:
            return max(0, self._admitted - (1 if self._current is not None else 0))

    # --- submission ------------------------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, emit: Callable[[Event], None]) -> Request:
        """Queue a request; ``emit`` receives its events on the worker thread. Raises :class:`QueueFull` or
        :class:`EngineStopped`."""
        if not prompt_ids:
            raise EngineError("the prompt is empty; send at least one token")
        if self._stopping.is_set():
            raise EngineStopped("the server is shutting down")
        self.start()
        req = Request(list(prompt_ids), params, emit)
        with self._lock:
            if self._admitted > self._max_queue:
                raise QueueFull(f"the request queue is full ({self._max_queue} waiting); retry later")
            self._admitted += 1
        self._queue.put(req)
        return req

    def generate(self, prompt: str | list[int], params: SamplingParams, timeout: float | None = None) -> Completion:
        """Generate in process (through the worker, so it is safe next to a running server)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        events: queue.SimpleQueue = queue.SimpleQueue()
        req = self.submit(ids, params, events.put)
        text, tokens, lps, pl = [], [], [], None
        while True:
            try:
                ev = events.get(timeout=timeout)
            except queue.Empty:
                req.cancel()
                raise EngineError(f"generation did not finish within {timeout} s") from None
            if isinstance(ev, Prefilled):
                pl = list(ev.prompt_logprobs) if ev.prompt_logprobs is not None else None
                continue
            if isinstance(ev, TokenEvent):
                text.append(ev.delta)
                tokens.append(ev.token_id)
                if ev.logprob is not None:
                    lps.append(ev.logprob)
                continue
            if ev.reason == "error":
                raise EngineError(ev.error or "generation failed")
            text.append(ev.delta)
            return Completion("".join(text), tokens, ev.reason, ev.prompt_tokens, ev.completion_tokens, lps, pl)

    # --- worker ------------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            req = self._queue.get()
            if req is _STOP:
                return
            if self._is_cancelled(req):
                self._finish(req, Finished("cancelled", len(req.prompt_ids), 0))
                continue
            with self._lock:
                self._current = req
            try:
                with torch.inference_mode():
                    self._generate(req)
            except Exception as e:  # noqa: BLE001  (one failed request must not stop the worker)
                log.exception("generation failed")
                self._finish(req, Finished("error", len(req.prompt_ids), 0, error=f"{type(e).__name__}: {e}"))
            finally:
                with self._lock:
                    self._current = None

    def _is_cancelled(self, req: Request) -> bool:
        return req.cancelled or self._cancel_all.is_set()

    def _finish(self, req: Request, ev: Finished) -> None:
        with self._lock:
            self._admitted -= 1
            self.stats.requests += 1
            self.stats.cancelled += ev.reason == "cancelled"
            self.stats.errors += ev.reason == "error"
        self._emit(req, ev)

    def _emit(self, req: Request, ev: Event) -> bool:
        try:
            req.emit(ev)
            return True
        except Exception:  # noqa: BLE001  (the consumer is gone: its event loop closed)
            req.cancel()
            return False

    def _forward(self, ids: torch.Tensor, cache, keep_all: bool) -> torch.Tensor:
        kw = {self.kv.cache_kwarg: cache, "use_cache": True}
        if self._logits_to_keep and not keep_all:
            kw["logits_to_keep"] = 1
        return self.model(ids[None], **kw).logits[0].float()

    def _generate(self, req: Request) -> None:
        p = req.params
        ids = req.prompt_ids
        n_prompt = len(ids)
        with self._lock:
            self.stats.prompt_tokens += n_prompt
        score_prompt = p.echo and p.logprobs is not None
        cache = self.kv.new_cache()
        logits = self._forward(torch.tensor(ids, device=self.device), cache, keep_all=score_prompt)
        prompt_lps = self._prompt_logprobs(ids, logits, p.logprobs) if score_prompt else None
        last = logits[-1]
        del logits
        if not self._emit(req, Prefilled(n_prompt, prompt_lps)):
            self._finish(req, Finished("cancelled", n_prompt, 0))
            return
        gen = None
        if p.temperature > 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(p.seed if p.seed is not None else random.SystemRandom().randrange(2**63))
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        text = _TextState(self, p.stop)
        reason, n_gen = "length", 0
        for step in range(p.max_tokens):
            if self._is_cancelled(req):
                reason = "cancelled"
                break
            tok = _pick(last, p.temperature, p.top_p, gen)
            n_gen += 1
            with self._lock:
                self.stats.generated_tokens += 1
            if tok in stops:
                reason = "stop"
                break
            lp = _token_logprob(self, tok, last, p.logprobs) if p.logprobs is not None else None
            delta, hit = text.add(tok)
            if not self._emit(req, TokenEvent(tok, delta, lp)):
                reason = "cancelled"
                break
            if hit:
                reason = "stop"
                break
            if step + 1 < p.max_tokens:
                if self._is_cancelled(req):
                    reason = "cancelled"
                    break
                last = self._forward(torch.tensor([tok], device=self.device), cache, keep_all=False)[-1]
        self._finish(req, Finished(reason, n_prompt, n_gen, text.flush() if reason != "cancelled" else ""))

    def _prompt_logprobs(self, ids: list[int], logits: torch.Tensor, k: int) -> tuple[TokenLogprob, ...]:
        """Position ``i`` scored by the logits at ``i - 1`` (the first token has none), in chunks of rows."""
        out = [TokenLogprob(ids[0], self.token_text(ids[0]), None)]
        chunk = 256
        for lo in range(0, len(ids) - 1, chunk):
            lp = torch.log_softmax(logits[lo : min(lo + chunk, len(ids) - 1)], -1)
            for r in range(lp.shape[0]):
                out.append(_token_logprob(self, ids[lo + r + 1], None, k, lp[r]))
        return tuple(out)


# ----------------------------------------------------------------------------------------------------------------
# helpers


class _TextState:
    """Decoded text of the generated ids with stop strings and hold-back (see the module docstring)."""

    def __init__(self, engine: TransformersEngine, stops: tuple[str, ...]):
        self.engine, self.stops = engine, tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.end: int | None = None  # cut position once a stop string was found

    def add(self, tok: int) -> tuple[str, bool]:
        self.ids.append(tok)
        prev = len(self.text)
        self.text = self.engine.decode(self.ids)
        if self.stops:
            lo = max(0, prev - self.hold)
            hits = [i for i in (self.text.find(s, lo) for s in self.stops) if i >= 0]
            if hits:
                self.end = min(hits)
                return self._release(self.end), True
        safe = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its last byte
            safe = min(safe, len(self.text.rstrip("\ufffd")))
        return self._release(safe), False

    def _release(self, upto: int) -> str:
        upto = max(self.sent, min(upto, len(self.text)))
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta

    def flush(self) -> str:
        return self._release(self.end if self.end is not None else len(self.text))


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    """Next token from fp32 logits ``[V]``: argmax at temperature 0, else a sample (nucleus ``top_p``)."""
    if temperature == 0 or gen is None:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, -1)
    if top_p < 1:
        sp, si = probs.sort(descending=True)
        keep = (sp.cumsum(0) - sp) < top_p  # the smallest prefix whose mass reaches top_p (never empty)
        probs = torch.zeros_like(probs).scatter_(0, si, sp * keep)
    return int(torch.multinomial(probs, 1, generator=gen))


def _token_logprob(engine: TransformersEngine, tok: int, logits: torch.Tensor | None, k: int,
                   logp: torch.Tensor | None = None) -> TokenLogprob:
    if logp is None:
        logp = torch.log_softmax(logits, -1)
    top = ()
    if k:
        vals, idx = logp.topk(k)
        top = tuple((int(i), engine.token_text(int(i)), float(v)) for v, i in zip(vals.tolist(), idx.tolist(), strict=True))
    return TokenLogprob(tok, engine.token_text(tok), float(logp[tok]), top)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(i) for i in v)
    return ids


def _forward_params(model) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)
