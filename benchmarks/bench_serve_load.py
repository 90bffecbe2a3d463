"""The embedded server under load: concurrent clients mixing streaming and non-streaming completions, streams dropped
mid-way, malformed and oversized bodies, health checks.

Usage: python benchmarks/bench_serve_load.py [--model smollm2-135m | --tiny] [--artifact latest] [--store .oscar]
       [--clients 32] [--requests 500] [--max-tokens 4] [--commit SHA] [--results benchmarks/RESULTS.md]

``--tiny`` serves a 2-layer random-weight Llama with the embedded model's tokenizer instead: the server's own work
(parsing, validation, tokenization, queueing, streaming, disconnects, the engine loop) at the full request count,
with the model's cost taken out (on two CPU cores SmolLM2 answers ~3 requests/s, so 32 x 500 would take ~1.5 h).

Starts ``oscar serve``'s app (transformers engine, the draining server) on a free loopback port in this process,
runs ``--clients`` threads of ``--requests`` requests each, and prints one table: per request kind the count, the
status codes seen, p50 / p99 latency, then throughput, the server's memory before and after, and the leak checks
(queue empty, nothing in flight, the engine idle). Appends it to RESULTS.md with date, device, commit and command.
Every request is checked as it returns: a generation is a 200 with text (a full stream ends with ``[DONE]``), a
malformed body a 4xx with a typed OpenAI error, an oversized one a 413; any 5xx or other answer is a failure
(:func:`run_load` returns them, ``main`` exits 1).
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import requests

KINDS = ("completion", "stream", "chat-stream", "dropped-stream", "malformed", "bad-field", "oversized", "health")
WEIGHTS = (30, 15, 15, 10, 10, 8, 4, 8)
"""The mix of request kinds (weights, in the order of :data:`KINDS`)."""


@dataclass
class LoadResult:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return sum(len(v) for v in self.latencies.values())


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _one(url: str, kind: str, rng: random.Random, max_tokens: int, max_body: int) -> tuple[int, str | None]:
    """Send one request of ``kind``; returns (status, failure or None)."""
    words = " ".join(f"w{rng.randrange(1, 40)}" for _ in range(rng.randrange(3, 40)))
    if kind == "health":
        r = requests.get(url.removesuffix("/v1") + "/health", timeout=120)
        return r.status_code, None if r.status_code == 200 else f"health {r.status_code}"
    if kind == "completion":
        r = requests.post(url + "/completions", json={"prompt": words, "max_tokens": max_tokens, "temperature": 0},
                          timeout=120)
        ok = r.status_code == 200 and isinstance(r.json()["choices"][0]["text"], str)
        return r.status_code, None if ok or r.status_code == 429 else f"completion {r.status_code} {r.text[:120]}"
    if kind in ("stream", "chat-stream", "dropped-stream"):
        body = ({"messages": [{"role": "user", "content": words}]} if kind == "chat-stream" else {"prompt": words})
        route = "/chat/completions" if kind == "chat-stream" else "/completions"
        n = max_tokens * 8 if kind == "dropped-stream" else max_tokens
        with requests.post(url + route, json={**body, "max_tokens": n, "stream": True}, stream=True,
                           timeout=120) as r:
            if r.status_code != 200:
                return r.status_code, None if r.status_code == 429 else f"{kind} {r.status_code} {r.text[:120]}"
            lines = r.iter_lines()
            if kind == "dropped-stream":  # the client goes away after the first event
                next(lines, None)
                return 200, None
            last = [ln for ln in lines if ln][-1]
            return 200, None if last == b"data: [DONE]" else f"{kind} did not end with [DONE]: {last[:80]!r}"
    if kind == "malformed":
        r = requests.post(url + "/completions", data=b'{"prompt": "w1", "max_tokens": ', timeout=120,
                          headers={"content-type": "application/json"})
        typed = r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        return r.status_code, None if typed else f"malformed {r.status_code} {r.text[:120]}"
    if kind == "bad-field":
        bad = rng.choice([{"max_tokens": "8"}, {"temperature": 7}, {"n": 3}, {"prompt": []}, {"top_p": 0},
                          {"logprobs": 99}, {"stream": 1}, {"model": "other"}])
        r = requests.post(url + "/completions", json={"prompt": words, "max_tokens": 1, **bad}, timeout=120)
        typed = 400 <= r.status_code < 500 and r.json()["error"]["type"] == "invalid_request_error"
        return r.status_code, None if typed else f"bad field {bad} -> {r.status_code} {r.text[:120]}"
    if kind == "oversized":
        r = requests.post(url + "/completions", data=b'{"prompt": "' + b"w1 " * (max_body // 3 + 10) + b'"}',
                          timeout=120, headers={"content-type": "application/json"})
        return r.status_code, None if r.status_code == 413 else f"oversized {r.status_code} {r.text[:120]}"
    raise ValueError(kind)


def run_load(url: str, clients: int, per_client: int, max_tokens: int, max_body: int, seed: int = 0) -> LoadResult:
    """``clients`` threads of ``per_client`` requests each, kinds drawn by :data:`WEIGHTS`."""
    res = LoadResult()
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        for _ in range(per_client):
            kind = rng.choices(KINDS, WEIGHTS)[0]
            t0 = time.perf_counter()
            try:
                status, failure = _one(url, kind, rng, max_tokens, max_body)
            except Exception as e:  # noqa: BLE001  (a dropped connection or a timeout is a failure to report)
                status, failure = -1, f"{kind}: {type(e).__name__}: {e}"
            dt = time.perf_counter() - t0
            with lock:
                res.latencies[kind].append(dt)
                res.statuses[kind][status] += 1
                if failure or status >= 500:
                    res.failures.append(failure or f"{kind} {status}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res.seconds = time.perf_counter() - t0
    return res


def rss_mb() -> float:
    """This process's resident memory (Linux ``/proc``), MB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def table(res: LoadResult) -> str:
    from oscar_cli.results_md import markdown_table

    rows = []
    for kind in KINDS:
        lat = res.latencies.get(kind, [])
        if not lat:
            continue
        codes = ", ".join(f"{c}: {n}" for c, n in sorted(res.statuses[kind].items()))
        rows.append([kind, str(len(lat)), codes, f"{1000 * _percentile(lat, 0.5):.0f}",
                     f"{1000 * _percentile(lat, 0.99):.0f}"])
    return markdown_table(["kind", "requests", "status: count", "p50 ms", "p99 ms"], rows)


def tiny_model(store: Path) -> Path:
    """A 2-layer random-weight Llama (GQA 4:2, head dim 16, seed 0) with the embedded model's tokenizer, saved under
    ``store/models/tiny-load-llama`` (built once)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from oscar_cli.models import DEFAULT_MODEL, quiet_transformers, resolve

    out = store / "models" / "tiny-load-llama"
    if (out / "config.json").is_file():
        return out
    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(str(resolve(DEFAULT_MODEL, store)[2]))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="serve a 2-layer random-weight Llama (the embedded tokenizer)")
    ap.add_argument("--artifact", default=None, help="artifact to serve (default: BF16)")
    ap.add_argument("--store", default=".oscar")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=500, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20)
    ap.add_argument("--commit", default="")
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    args = ap.parse_args(argv)

    import torch

    from oscar_cli.results_md import append_section
    from oscar_cli.serve.config import ServeConfig
    from oscar_cli.serve.engine import TransformersEngine
    from oscar_cli.serve.openai_server import create_app, draining_server
    from oscar_cli.store import Store

    store = Path(args.store)
    if args.tiny:
        args.model = str(tiny_model(store))
    artifact = None
    if args.artifact:
        from oscar_cli.models import resolve

        artifact = Store(store).resolve_artifact(args.artifact, resolve(args.model, store)[0])
    eng = TransformersEngine.load(args.model, store, artifact, max_queue=args.max_queue)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServeConfig(port=port, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes)
    app = create_app(eng, cfg)
    server = draining_server(app, eng, cfg, log_level="error")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}/v1"
    run_load(url, 2, 3, args.max_tokens, args.max_body_bytes, seed=99)  # warm-up
    before = rss_mb()
    res = run_load(url, args.clients, args.requests, args.max_tokens, args.max_body_bytes)
    time.sleep(0.5)
    after = rss_mb()
    metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    in_flight = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("oscar_requests_in_flight"))
    leaks = {"queue": eng.queue_depth(), "busy": eng.busy, "in flight": in_flight}
    server.should_exit = True
    thread.join(60)
    tab = table(res)
    summary = (f"{res.requests} requests from {args.clients} clients in {res.seconds:.1f} s "
               f"({res.requests / res.seconds:.1f} requests/s); failures: {len(res.failures)}; server memory "
               f"{before:.0f} -> {after:.0f} MB; after the load: queue {leaks['queue']}, engine busy {leaks['busy']}, "
               f"in flight {leaks['in flight']:.0f}")
    print(tab)
    print(summary)
    for f in res.failures[:10]:
        print("failure:", f, file=sys.stderr)
    device = f"CPU ({torch.get_num_threads()} threads)" if not torch.cuda.is_available() else torch.cuda.get_device_name()
    append_section(args.results, "Embedded server under load", device, args.commit or "unknown",
                   (f"Model {args.model}" if not args.tiny else "A 2-layer random-weight Llama (`--tiny`: the "
                    "server's work at full count, the model's cost taken out)") +
                   (f", artifact {artifact}" if artifact else " in BF16") +
                   f"; {args.max_tokens} tokens per generation, queue {args.max_queue}, body limit "
                   f"{args.max_body_bytes} bytes; kinds {dict(zip(KINDS, WEIGHTS, strict=True))} (weights); 429 is the "
                   "queue's documented answer when full. " + summary + ".", tab,
                   command=sys.argv if argv is None else ["benchmarks/bench_serve_load.py", *argv])
    return 1 if res.failures or leaks["queue"] or leaks["busy"] or in_flight else 0


if __name__ == "__main__":
    raise SystemExit(main())
