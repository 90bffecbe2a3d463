"""The OpenAI-compatible HTTP API over a :class:`oscar_cli.serve.engine.TransformersEngine` (FastAPI).

Endpoints:

* ``GET /v1/models``: the served model id with what it is (``oscar``: method, artifact name/path/content hash,
  scheme bits/group/sink/recent, model fingerprint); ``GET /v1/models/{id}``.
* ``POST /v1/completions``: ``prompt`` as a string, a list of strings, token ids or a list of token-id lists;
  ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``stop_token_ids``, ``logprobs`` (alternatives per
  token), ``echo`` (the prompt back, scored when ``logprobs`` is set: what lm-eval's ``local-completions`` sends for
  loglikelihoods), ``stream`` (SSE ``data: {...}`` chunks and ``data: [DONE]``), ``stream_options.include_usage``.
* ``POST /v1/chat/completions``: ``messages`` through the tokenizer's chat template; ``max_tokens`` /
  ``max_completion_tokens``, ``logprobs`` + ``top_logprobs``, ``stream``, the sampling fields above.
* ``GET /health``; ``GET /metrics`` (Prometheus text, :mod:`oscar_cli.serve.metrics`).
* ``GET /tokenizer_info``, ``POST /tokenize``, ``POST /detokenize``: the remote-tokenizer endpoints lm-eval probes, so
  ``local-completions`` needs no local copy of the tokenizer.

Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed JSON, bad fields, prompts or
``max_tokens`` beyond the context; 404 for an unknown model or route; 429 when the engine's queue is full; 503 while
shutting down. ``n`` must be 1. A client that disconnects cancels its request before the next token.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServeConfig, ServeConfigError
from .engine import (
    EngineError,
    EngineStopped,
    Finished,
    Prefilled,
    QueueFull,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    TransformersEngine,
)
from .metrics import CONTENT_TYPE, Metrics

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
KNOWN_ENDPOINTS = (*GENERATION_ENDPOINTS, "/v1/models", "/health", "/metrics", "/tokenizer_info", "/tokenize",
                   "/detokenize")


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("rate_limit_error" if status == 429 else
                              "invalid_request_error" if 400 <= status < 500 else "server_error")

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(body, status_code=self.status, headers=headers)


# ----------------------------------------------------------------------------------------------------------------
# Request bodies (types only; ranges are checked below with OpenAI's messages)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # "8" is not an integer, 1 is not a boolean

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    max_tokens: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(_Body):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


@dataclass
class _Job:
    """One prompt in flight: its engine request and the queue its events arrive on."""

    ids: list[int]
    prompt_text: str
    request: object
    events: asyncio.Queue


class _SSEResponse(StreamingResponse):
    """A streaming response that cancels its engine requests however it ends (done, disconnect, shutdown)."""

    def __init__(self, content, jobs: list[_Job]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._jobs = jobs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for j in self._jobs:
                j.request.cancel()


def draining_server(app, engine: TransformersEngine, config: ServeConfig, **uvicorn_kw):
    """A ``uvicorn.Server`` for ``app`` whose shutdown (SIGINT/SIGTERM) first stops listening, then drains
    ``engine``: queued and running requests get ``config.shutdown_timeout_s`` to finish, what is left is cancelled,
    so every stream still open ends with an error event and ``[DONE]`` and every non-streaming request with a 503,
    instead of being cut by the server's own cancellation."""
    import uvicorn

    class _Draining(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            for server in self.servers:
                server.close()  # no new connections while the engine drains
            await asyncio.to_thread(engine.drain, config.shutdown_timeout_s)
            await super().shutdown(sockets)

    return _Draining(uvicorn.Config(app, host=config.host, port=config.port,
                                    timeout_graceful_shutdown=config.shutdown_timeout_s + 5.0, **uvicorn_kw))


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ----------------------------------------------------------------------------------------------------------------
# The app


def create_app(engine: TransformersEngine, config: ServeConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as configured by ``config``; its lifespan starts and stops the engine."""
    cfg = config or ServeConfig()
    context = cfg.max_context or engine.max_position
    if context is None:
        raise ServeConfigError("the model's config has no max_position_embeddings; pass --max-context")
    if engine.max_position is not None and context > engine.max_position:
        raise ServeConfigError(f"--max-context {context} exceeds the model's {engine.max_position} positions")
    served = cfg.model_id or engine.loaded.slug
    metrics = Metrics()
    vocab = int(getattr(engine.model.config, "vocab_size", None) or len(engine.tokenizer))  # ids the model embeds

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop, True, cfg.shutdown_timeout_s)

    app = FastAPI(title="oscar serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.config, app.state.metrics, app.state.context = engine, cfg, metrics, context
    app.add_middleware(_MetricsMiddleware, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None).response()

    # --- helpers ---------------------------------------------------------------------------------------------------
    async def parse(request: Request, model: type[_Body]) -> _Body:
        raw = await read_body(request, cfg.max_body_bytes)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or None
            raise APIError(400, f"{loc}: {err['msg']}", param=loc.split(".")[0] if loc else None,
                           code="invalid_value") from None
        if body.model is not None and body.model != served:
            raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")
        if not 0 <= body.temperature <= 2:
            raise APIError(400, f"temperature must be in [0, 2], got {body.temperature}", "temperature",
                           "invalid_value")
        if not 0 < body.top_p <= 1:
            raise APIError(400, f"top_p must be in (0, 1], got {body.top_p}", "top_p", "invalid_value")
        if body.n != 1:
            what = "n > 1 is not supported: send n requests" if body.n > 1 else f"n must be >= 1, got {body.n}"
            raise APIError(400, what, "n", "invalid_value")
        if body.presence_penalty or body.frequency_penalty or body.logit_bias:
            raise APIError(400, "presence_penalty, frequency_penalty and logit_bias are not supported",
                           code="unsupported")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream=true", "stream_options", "invalid_value")
        if body.max_tokens is not None and body.max_tokens < 0:
            raise APIError(400, f"max_tokens must be >= 0, got {body.max_tokens}", "max_tokens", "invalid_value")
        return body

    def max_tokens_for(n_prompt: int, asked: int | None, param: str, prompt_param: str, allow_zero: bool) -> int:
        if n_prompt > context:
            raise APIError(400, f"the prompt has {n_prompt} tokens, more than the model's context of {context} "
                                "tokens; shorten it", prompt_param, "context_length_exceeded")
        if asked is None:
            if n_prompt >= context and not allow_zero:
                raise APIError(400, f"the prompt has {n_prompt} tokens and fills the model's context of {context}; "
                                    "shorten it", prompt_param, "context_length_exceeded")
            return min(cfg.default_max_tokens, context - n_prompt)
        if n_prompt + asked > context:
            raise APIError(400, f"{param} {asked} plus the prompt's {n_prompt} tokens exceeds the model's context of "
                                f"{context} tokens", param, "context_length_exceeded")
        return asked

    def sampling(body: _Body, max_tokens: int, logprobs: int | None, echo: bool) -> SamplingParams:
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              stop=stop, stop_token_ids=tuple(body.stop_token_ids or ()), logprobs=logprobs,
                              echo=echo, ignore_eos=body.ignore_eos)

    def submit(prompts: list[tuple[list[int], str]], params: list[SamplingParams]) -> list[_Job]:
        """All or nothing: a batch that does not fit the queue is refused whole."""
        loop = asyncio.get_running_loop()
        jobs: list[_Job] = []
        try:
            for (ids, text), p in zip(prompts, params, strict=True):
                q: asyncio.Queue = asyncio.Queue()
                r = engine.submit(ids, p, lambda ev, q=q: loop.call_soon_threadsafe(q.put_nowait, ev))
                jobs.append(_Job(ids, text, r, q))
        except QueueFull as e:
            for j in jobs:
                j.request.cancel()
            raise APIError(429, str(e), code="queue_full") from None
        except EngineStopped as e:
            for j in jobs:
                j.request.cancel()
            raise APIError(503, str(e), code="shutting_down") from None
        except EngineError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        return jobs

    async def collect(job: _Job) -> dict:
        out = dict(deltas=[], tokens=[], prompt_logprobs=None, finished=None)
        while True:
            ev = await job.events.get()
            if isinstance(ev, Prefilled):
                out["prompt_logprobs"] = ev.prompt_logprobs
            elif isinstance(ev, TokenEvent):
                out["deltas"].append(ev.delta)
                if ev.logprob is not None:
                    out["tokens"].append(ev.logprob)
            else:
                out["deltas"].append(ev.delta)
                out["finished"] = ev
                return out

    async def collect_all(jobs: list[_Job], request: Request) -> list[dict]:
        """Wait for every job; a client that goes away cancels them (checked every ``disconnect_poll_s``)."""
        tasks = [asyncio.ensure_future(collect(j)) for j in jobs]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=cfg.disconnect_poll_s)
                if not pending:
                    break
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the connection", code="client_closed")
        finally:
            for j in jobs:
                j.request.cancel()
            for t in tasks:
                t.cancel()
        results = [t.result() for t in tasks]
        for r in results:
            f: Finished = r["finished"]
            if f.reason == "error":
                raise APIError(500, f"generation failed: {f.error}", code="generation_error")
            if f.reason == "cancelled":
                raise APIError(503, "the request was cancelled: the server is shutting down", code="shutting_down")
        return results

    def usage(results: list[dict]) -> dict:
        p = sum(r["finished"].prompt_tokens for r in results)
        c = sum(r["finished"].completion_tokens for r in results)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # --- routes ----------------------------------------------------------------------------------------------------
    def model_card() -> dict:
        d = engine.describe()
        return {"id": served, "object": "model", "created": started, "owned_by": "oscar-kv", "root": d["source"],
                "max_model_len": context,
                "oscar": {"method": d["method"], "artifact": d["artifact"], "scheme": d["scheme"],
                          "model": d["model"], "model_fingerprint": d["fingerprint"]}}

    started = int(time.time())

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != served:
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{served}'", "model",
                           "model_not_found")
        return model_card()

    @app.get("/health")
    async def health():
        if not engine.running:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok", "queue_depth": engine.queue_depth(), "busy": engine.busy}

    @app.get("/metrics")
    async def metrics_route():
        s = engine.stats
        counters = {
            "oscar_prompt_tokens_total": ("Prompt tokens prefilled.", s.prompt_tokens),
            "oscar_generated_tokens_total": ("Tokens generated (stop tokens included).", s.generated_tokens),
            "oscar_requests_cancelled_total": ("Engine requests cancelled (client gone or shutdown).", s.cancelled),
        }
        gauges = {"oscar_queue_depth": ("Requests waiting for the engine worker.", engine.queue_depth())}
        return Response(metrics.render(gauges, counters), media_type=CONTENT_TYPE)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        t = engine.tokenizer
        return {"eos_token": t.eos_token, "bos_token": t.bos_token, "pad_token": t.pad_token,
                "chat_template": getattr(t, "chat_template", None), "model_max_length": context,
                "tokenizer_class": type(t).__name__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        data = await _json_object(request, cfg.max_body_bytes)
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "prompt must be a string", "prompt", "invalid_value")
        add = data.get("add_special_tokens", True)
        enc = await asyncio.to_thread(engine.tokenizer, prompt, add_special_tokens=bool(add))
        ids = list(enc["input_ids"])
        return {"tokens": ids, "count": len(ids), "max_model_len": context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        data = await _json_object(request, cfg.max_body_bytes)
        ids = data.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", "tokens", "invalid_value")
        return {"prompt": engine.tokenizer.decode(ids)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionBody = await parse(request, CompletionBody)
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", "best_of", "invalid_value")
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix", "invalid_value")
        if body.logprobs is not None and not 0 <= body.logprobs <= cfg.max_logprobs:
            raise APIError(400, f"logprobs must be in [0, {cfg.max_logprobs}], got {body.logprobs}", "logprobs",
                           "invalid_value")
        prompts = await asyncio.to_thread(_prompts, body.prompt, engine, vocab)  # off the event loop
        if body.stream and len(prompts) != 1:
            raise APIError(400, "stream=true takes one prompt; send one request per prompt", "prompt",
                           "invalid_value")
        params = [sampling(body, max_tokens_for(len(ids), body.max_tokens, "max_tokens", "prompt",
                                                allow_zero=body.echo), body.logprobs, body.echo)
                  for ids, _ in prompts]
        jobs = submit(prompts, params)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return _SSEResponse(_stream_completion(jobs[0], body, rid, created, served, include_usage), jobs)
        results = await collect_all(jobs, request)
        choices = []
        for i, (job, r) in enumerate(zip(jobs, results, strict=True)):
            text = "".join(r["deltas"])
            entries = list(r["tokens"])
            if body.echo:
                text = job.prompt_text + text
                pl = r["prompt_logprobs"]
                entries = (list(pl) if pl is not None else []) + entries
            lp = _completion_logprobs(entries) if body.logprobs is not None else None
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": r["finished"].reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": served, "choices": choices,
                "usage": usage(results)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatBody = await parse(request, ChatBody)
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs", "invalid_value")
            if not 0 <= body.top_logprobs <= cfg.max_logprobs:
                raise APIError(400, f"top_logprobs must be in [0, {cfg.max_logprobs}], got {body.top_logprobs}",
                               "top_logprobs", "invalid_value")
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if asked is not None and asked < 0:
            raise APIError(400, f"max_completion_tokens must be >= 0, got {asked}", "max_completion_tokens",
                           "invalid_value")
        messages = _messages(body.messages)
        try:
            ids = await asyncio.to_thread(engine.chat_ids, messages)  # the template and tokenizer off the event loop
        except EngineError as e:
            raise APIError(400, str(e), "messages", "invalid_value") from None
        except Exception as e:  # noqa: BLE001  (jinja raises many types for messages a template rejects)
            raise APIError(400, f"the chat template rejected the messages ({type(e).__name__}: {e})", "messages",
                           "invalid_value") from None
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        k = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, max_tokens_for(len(ids), asked, param, "messages", allow_zero=False), k, False)
        jobs = submit([(ids, "")], [params])
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return _SSEResponse(_stream_chat(jobs[0], body, rid, created, served, include_usage), jobs)
        (r,) = await collect_all(jobs, request)
        lp = {"content": [_chat_logprob(t) for t in r["tokens"]]} if body.logprobs else None
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(r["deltas"])}, "logprobs": lp,
                  "finish_reason": r["finished"].reason}
        return {"id": rid, "object": "chat.completion", "created": created, "model": served, "choices": [choice],
                "usage": usage([r])}

    return app


# ----------------------------------------------------------------------------------------------------------------
# Streaming


async def _events(job: _Job):
    while True:
        ev = await job.events.get()
        yield ev
        if isinstance(ev, Finished):
            return


def _stream_error(ev: Finished) -> str:
    if ev.reason == "error":
        err = {"message": f"generation failed: {ev.error}", "type": "server_error", "param": None,
               "code": "generation_error"}
    else:
        err = {"message": "the request was cancelled: the server is shutting down", "type": "server_error",
               "param": None, "code": "shutting_down"}
    return _sse({"error": err})


async def _stream_completion(job: _Job, body: CompletionBody, rid: str, created: int, served: str,
                             include_usage: bool):
    def chunk(text: str, entries: list[TokenLogprob] | None, reason: str | None) -> str:
        lp = _completion_logprobs(entries) if body.logprobs is not None and entries is not None else None
        c = {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}
        return _sse({"id": rid, "object": "text_completion", "created": created, "model": served, "choices": [c]})

    async for ev in _events(job):
        if isinstance(ev, Prefilled):
            if body.echo:
                yield chunk(job.prompt_text, list(ev.prompt_logprobs or []), None)
        elif isinstance(ev, TokenEvent):
            if ev.delta or ev.logprob is not None:
                yield chunk(ev.delta, [ev.logprob] if ev.logprob is not None else None, None)
        elif ev.reason in ("error", "cancelled"):
            yield _stream_error(ev)
        else:
            yield chunk(ev.delta, None, ev.reason)
            if include_usage:
                u = {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                     "total_tokens": ev.prompt_tokens + ev.completion_tokens}
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": served,
                            "choices": [], "usage": u})
    yield "data: [DONE]\n\n"


async def _stream_chat(job: _Job, body: ChatBody, rid: str, created: int, served: str, include_usage: bool):
    def chunk(delta: dict, entries: list[TokenLogprob] | None, reason: str | None) -> str:
        lp = {"content": [_chat_logprob(t) for t in entries]} if body.logprobs and entries is not None else None
        c = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": served,
                     "choices": [c]})

    async for ev in _events(job):
        if isinstance(ev, Prefilled):
            yield chunk({"role": "assistant", "content": ""}, None, None)
        elif isinstance(ev, TokenEvent):
            if ev.delta or ev.logprob is not None:
                yield chunk({"content": ev.delta}, [ev.logprob] if ev.logprob is not None else None, None)
        elif ev.reason in ("error", "cancelled"):
            yield _stream_error(ev)
        else:
            yield chunk({"content": ev.delta} if ev.delta else {}, None, ev.reason)
            if include_usage:
                u = {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.completion_tokens,
                     "total_tokens": ev.prompt_tokens + ev.completion_tokens}
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": served,
                            "choices": [], "usage": u})
    yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------------------------------------------
# Shapes


def _completion_logprobs(entries: list[TokenLogprob]) -> dict:
    """OpenAI's legacy completion logprobs: tokens, token_logprobs, top_logprobs (the chosen token included, as
    vLLM does; None for the first prompt token), text_offset."""
    tokens, lps, tops, offsets, off = [], [], [], [], 0
    for e in entries:
        tokens.append(e.text)
        lps.append(e.logprob)
        if e.logprob is None:
            tops.append(None)
        else:
            top = {t: lp for _, t, lp in e.top}
            top.setdefault(e.text, e.logprob)
            tops.append(top)
        offsets.append(off)
        off += len(e.text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprob(e: TokenLogprob) -> dict:
    return {"token": e.text, "logprob": e.logprob, "bytes": list(e.text.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for _, t, lp in e.top]}


def _prompts(prompt, engine: TransformersEngine, vocab: int) -> list[tuple[list[int], str]]:
    """``(ids, text)`` per prompt: strings are tokenized, token ids are checked and decoded."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty", "prompt", "invalid_value")
    out = []
    for p in items:
        if isinstance(p, str):
            ids = engine.encode(p)
            text = p
        else:
            if any(not 0 <= i < vocab for i in p):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt", "invalid_value")
            ids, text = list(p), engine.decode(list(p))
        if not ids:
            raise APIError(400, "the prompt has no tokens; send at least one", "prompt", "invalid_value")
        out.append((ids, text))
    return out


def _messages(messages: list[dict]) -> list[dict]:
    """Chat messages with string content (text parts joined); anything else is a 400."""
    if not messages:
        raise APIError(400, "messages is empty", "messages", "invalid_value")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise APIError(400, f"messages.{i}.role must be system, user, assistant, developer or tool, got {role!r}",
                           "messages", "invalid_value")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages.{i}.content: only text parts are supported", "messages",
                               "invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages.{i}.content must be a string or a list of text parts", "messages",
                           "invalid_value")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes: by its Content-Length
    before anything is read, else while it streams in (nothing larger is held)."""
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"the request body exceeds {limit} bytes; send a shorter prompt or raise the server's "
                            "--max-body-bytes", code="body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_object(request: Request, limit: int) -> dict:
    try:
        data = json.loads(await read_body(request, limit))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


class _MetricsMiddleware:
    """Counts every HTTP request by endpoint and status and times it to its last byte (streams included)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in KNOWN_ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
        generation = endpoint in GENERATION_ENDPOINTS
        status = 500
        t0 = time.perf_counter()

        async def send_(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        if generation:
            self.metrics.started()
        try:
            await self.app(scope, receive, send_)
        finally:
            self.metrics.finished(endpoint, status, time.perf_counter() - t0, generation)
