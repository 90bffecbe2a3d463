"""``oscar serve``: an OpenAI-compatible server for a model and (optionally) an artifact."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
from pathlib import Path
from typing import Annotated

import typer
from oscar_kernels.scheme import DecodeOptions

from ..config import DEFAULT_MODEL, DEFAULT_STORE
from ..errors import OscarError
from ..serve.config import ServeConfig
from ._app import DecodeTuningOpt, StoreOpt, app, console, decode_options, guarded

ENGINES = ("auto", "sglang", "transformers")
BACKLOG = 2048
"""Pending connections the listening socket holds (uvicorn's default)."""


@app.command("serve", context_settings={"allow_extra_args": True})
@guarded
def serve_cmd(
    ctx: typer.Context,
    artifact: Annotated[str | None, typer.Option("--artifact", help="Artifact to serve: latest, vN, model/vN or a "
                                                 "folder (method oscar); without it the model runs in bf16.")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help="Model spec (see oscar collect).")] = DEFAULT_MODEL,
    engine: Annotated[str, typer.Option("--engine", help="auto (sglang when CUDA and the sglang package are "
                                        "available, else transformers), sglang or transformers.")] = "auto",
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = ServeConfig.host,
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).")] = ServeConfig.port,
    served_name: Annotated[str | None, typer.Option("--served-model-name", help="Model id clients send "
                                                    "(default: the model's slug).")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait for the engine; one more "
                                           "gets 429 (transformers engine).")] = ServeConfig.max_queue,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", help="Largest request body accepted; larger "
                                                "ones get 413 (transformers engine).")] = ServeConfig.max_body_bytes,
    max_context: Annotated[int | None, typer.Option("--max-context", help="Prompt + completion tokens per request "
                                                    "(default: the model's positions).")] = None,
    int8_scores: Annotated[bool, typer.Option("--int8-scores", help="SGLang engine: decode scores over the INT2 "
                                              "cache from int8 tensor-core products (each head's rotated query "
                                              "rounded to int8): faster at large batches, slightly less exact.")] = False,
    int8_values: Annotated[bool, typer.Option("--int8-values", help="SGLang engine: decode value products over the "
                                              "INT2 cache from int8 tensor-core products (probabilities rounded "
                                              "to int8 steps per tile): faster at large batches, slightly less "
                                              "exact.")] = False,
    decode_tuning: DecodeTuningOpt = "",
    store: StoreOpt = DEFAULT_STORE,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /metrics) on a model with an
    artifact's INT2 KV cache.

    Example: oscar serve --artifact latest --port 8000   (then: curl localhost:8000/v1/models)

    Arguments after -- go to the engine: oscar serve --engine sglang --artifact v3 -- --tp-size 2
    """
    extra = list(ctx.args)
    if engine not in ENGINES:
        raise OscarError(f"--engine {engine!r}: choose auto, sglang or transformers")
    decode = decode_options(decode_tuning, int8_scores=int8_scores, int8_values=int8_values)
    cfg = ServeConfig(host=host, port=port, model_id=served_name, max_queue=max_queue, max_context=max_context,
                      max_body_bytes=max_body_bytes)
    chosen = pick_engine(engine)
    for flag, on in (("--int8-scores", int8_scores), ("--int8-values", int8_values),
                     ("--decode-tuning", bool(decode_tuning.strip(" ,")))):
        if chosen == "transformers" and on:
            raise OscarError(f"{flag} is an SGLang engine option (its CUDA decode kernel); drop it or pass "
                             "--engine sglang")
    if chosen == "transformers" and extra:
        raise OscarError(f"extra engine arguments ({' '.join(extra)}) are for --engine sglang; the transformers "
                         "engine takes none (drop the part after --)")
    if chosen == "sglang":
        _run_sglang(model, artifact, store, cfg, extra, decode)
    else:
        _run_transformers(model, artifact, store, cfg)


def pick_engine(engine: str) -> str:
    """``auto`` -> ``sglang`` when CUDA is available and ``import sglang`` works, else ``transformers``."""
    if engine != "auto":
        return engine
    if importlib.util.find_spec("sglang") is None:
        return "transformers"
    import torch

    if not torch.cuda.is_available():
        return "transformers"
    try:
        import sglang  # noqa: F401
    except Exception:  # noqa: BLE001  (a broken sglang install: fall back, as documented)
        return "transformers"
    return "sglang"


def _artifact_path(ref: str | None, store: Path, slug: str) -> Path | None:
    if ref is None:
        return None
    from ..store import Store

    return Store(store).resolve_artifact(ref, slug)


def _describe(info: dict) -> str:
    s = info.get("scheme")
    art = info.get("artifact")
    if art is None:
        return f"{info['model']} ({info['method']}, no artifact)"
    return (f"{info['model']} ({info['method']}, artifact {art['name']}, INT{s['bits']} group {s['group']}, "
            f"sink {s['sink']}, recent {s['recent']})")


def _run_transformers(model: str, artifact: str | None, store: Path, cfg) -> None:
    import dataclasses

    from ..models import resolve
    from ..serve.engine import TransformersEngine
    from ..serve.openai_server import create_app, draining_server

    slug = resolve(model, store)[0]
    path = _artifact_path(artifact, store, slug)
    eng = TransformersEngine.load(model, store, path, max_queue=cfg.max_queue)
    sock = _bind(cfg.host, cfg.port)
    cfg = dataclasses.replace(cfg, port=sock.getsockname()[1])
    app_ = create_app(eng, cfg)
    server = draining_server(app_, eng, cfg, log_level="warning")
    console.print(f"serving {_describe(eng.describe())} at {cfg.url} (engine transformers, model id "
                  f"'{cfg.model_id or eng.loaded.slug}'); Ctrl-C or SIGTERM stops it", highlight=False, soft_wrap=True)
    stopped_by: list[int] = []
    with _signals_noted(stopped_by):
        server.run(sockets=[sock])
    why = f" ({signal.Signals(stopped_by[0]).name})" if stopped_by else ""
    console.print(f"server stopped{why}", highlight=False)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a busy port is a one-line error, port 0 picks a free port and the
    printed URL accepts connections at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)  # connections wait in the backlog until the server loop runs
    except OSError as e:
        sock.close()
        raise OscarError(f"cannot listen on {host}:{port} ({e.strerror}); pass another --port or --host") from None
    return sock


@contextlib.contextmanager
def _signals_noted(seen: list[int]):
    """Handlers that only note SIGINT/SIGTERM: uvicorn shuts down gracefully on them and then re-raises the signal
    to the previous handler; with these the process exits 0 instead of dying of the signal."""
    sigs = [signal.SIGINT, signal.SIGTERM]
    old = {s: signal.signal(s, lambda sig, frame: seen.append(sig)) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _run_sglang(model: str, artifact: str | None, store: Path, cfg, extra: list[str], decode: DecodeOptions) -> None:
    try:
        from ..serve.sglang.launch import build_launch
    except ImportError as e:
        if e.name and e.name.startswith("oscar_cli.serve.sglang"):
            raise OscarError("the SGLang engine is not part of this installation (oscar_cli.serve.sglang.launch "
                             "is missing); use --engine transformers") from None
        raise OscarError(f"the SGLang engine cannot be loaded ({e}); install it with pip install 'oscar-kv[serve]' "
                         "or use --engine transformers") from None
    from ..artifact import load_artifact
    from ..models import resolve

    slug, _, folder = resolve(model, store)
    path = _artifact_path(artifact, store, slug)
    if path is None:
        raise OscarError("--engine sglang serves an artifact's INT2 cache: pass --artifact latest|vN|PATH")
    art = load_artifact(path, _fingerprint(model, store, folder))
    argv, env = build_launch(str(folder) if folder is not None else model, path, cfg.host, cfg.port, extra,
                             decode=decode)
    s = art.scheme
    console.print(f"serving {slug} (oscar, artifact {art.name}, INT{s.bits} group {s.group or 'head dim'}, sink "
                  f"{s.sink}, recent {s.recent}) at {cfg.url} (engine sglang)", highlight=False, soft_wrap=True)
    os.execvpe(argv[0], argv, {**os.environ, **env})


def _fingerprint(model: str, store: Path, folder: Path | None) -> str:
    """The model's fingerprint: recorded next to converted models, else computed from the weights on the CPU."""
    import json

    from ..models import FINGERPRINT_FILE, load_model

    meta = folder / FINGERPRINT_FILE if folder is not None else None
    if meta is not None and meta.is_file():
        return json.loads(meta.read_text())["fingerprint"]
    import torch

    return load_model(model, store, dtype=torch.bfloat16, device="cpu").fingerprint
