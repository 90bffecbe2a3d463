"""``oscar eval --server URL``: the same tasks through a running OpenAI-compatible server (the embedded one or
SGLang with the plugin): ``oscar_ppl`` from prompt logprobs, lm-eval tasks through lm-eval's ``local-completions``;
rows record the server's method, artifact and scheme."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..artifact import ArtifactError, load_artifact
from ..config import PPL_TASK, EvalConfig, expand_tasks
from ..models import quiet_transformers, resolve
from ..progress import Progress
from ..store import Store
from ..tasks import TOKENIZERS
from . import EvalError
from .lm_eval_tasks import check_lm_tasks, lm_eval_version, lm_rows, lm_task_names, run_lm_eval
from .report import EvalResult, EvalRow, check_thresholds
from .segments import ppl_steps, ppl_text, segments_of, segments_per_length


@dataclass(frozen=True)
class ServerInfo:
    """What an OpenAI-compatible server says it serves (``GET /v1/models``; the ``oscar`` block when it is ours)."""

    url: str
    model_id: str
    method: str
    artifact: str | None
    scheme: dict | None


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    """One JSON request; an HTTP error or an unreachable server is a one-line :class:`EvalError`."""
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
    """What the server at ``url`` (with or without ``/v1``) serves."""
    base = url.rstrip("/").removesuffix("/v1")
    cards = http_json("GET", f"{base}/v1/models", timeout=30).get("data") or []
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
    try:
        info = http_json("GET", f"{base}/server_info", timeout=30)
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


def perplexity_via_server(info: ServerInfo, segments: torch.Tensor, advance: Callable[[], None] | None = None
                          ) -> float:
    """``oscar_ppl`` from the server's prompt logprobs (``echo`` + ``logprobs``; the one new token asked for is not
    counted): each segment ``[L]`` of token ids contributes the logprobs of its tokens 1..L-1."""
    nll, count = 0.0, 0
    for seg in segments:
        out = http_json("POST", f"{info.url}/v1/completions", {
            "model": info.model_id, "prompt": seg.tolist(), "max_tokens": 1, "echo": True, "logprobs": 1,
            "temperature": 0.0})  # SGLang refuses max_tokens 0
        lps = out["choices"][0]["logprobs"]["token_logprobs"][1: seg.numel()]
        if len(lps) != seg.numel() - 1 or any(x is None for x in lps):
            raise EvalError(f"server {info.url} returned {len(lps)} prompt logprobs for a {seg.numel()}-token "
                            "segment; it must support echo with logprobs")
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
    """:func:`~.run.run_eval` through the running server ``cfg.server``: ``oscar_ppl`` from prompt logprobs, lm-eval
    tasks through ``local-completions``; rows record the server's method, artifact and scheme."""
    from transformers import AutoTokenizer

    progress = progress or Progress()
    row_tasks = expand_tasks(cfg.tasks)
    lm_tasks = lm_task_names([t for t in row_tasks if t != PPL_TASK])
    check_lm_tasks(lm_tasks)  # before the server is asked or the tokenizer loads
    info = server_info(cfg.server)
    quiet_transformers()
    slug, _, folder = resolve(cfg.model, store)
    tok_path = str(folder) if folder is not None else cfg.model
    tok = AutoTokenizer.from_pretrained(tok_path)
    text_ids = ppl_text(cfg, tok)
    progress.start(ppl_steps(cfg, text_ids) + (1 if lm_tasks else 0))
    label = info.method
    base = dict(model_fingerprint="", model_slug=slug, method=label, artifact=info.artifact,
                lm_eval_version=lm_eval_version())
    run_cfg = dict(limit=cfg.limit, server=info.url, served_model=info.model_id, scheme=info.scheme, overrides={})
    rows: list[EvalRow] = []
    bits = None  # the server's storage is its own business (SGLang reports its pool)
    if text_ids is not None:
        for n in cfg.seq_lengths:
            progress.describe(f"{label} {PPL_TASK}@{n}")
            segs = segments_of(text_ids, n, segments_per_length(cfg))
            ppl = perplexity_via_server(info, segs, progress.advance)
            rows.append(EvalRow(**base, task=PPL_TASK, metric="ppl", value=ppl,
                                config=dict(run_cfg, seq_len=n, segments=len(segs), mode="server",
                                            data=str(cfg.data) if cfg.data else "builtin:heldout"),
                                bits_per_element=bits))
    if lm_tasks:
        progress.describe(f"{label} {','.join(lm_tasks)}")
        TOKENIZERS[tok_path] = tok
        lm = server_lm(info, tok_path, max(cfg.seq_lengths) + 256)
        res = run_lm_eval(lm, lm_tasks, cfg.limit, {"tokenizer": tok_path, "max_seq_lengths": list(cfg.seq_lengths)})
        rows += lm_rows(res, base, run_cfg, cfg.seq_lengths, lambda n: bits)
        progress.advance()
    Store(store).record_evals([r.to_dict() for r in rows])
    return EvalResult(rows, check_thresholds(rows, cfg.thresholds))
