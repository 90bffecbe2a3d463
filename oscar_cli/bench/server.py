"""One SGLang server under test: its start log and HTTP API (``/generate`` streams, ``/v1/loads``, profiling),
the parsers of its log lines and traces, and the GPU memory monitor."""

from __future__ import annotations

import dataclasses
import gzip
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import BenchConfig, BenchError, EngineConfig, server_argv

POLL_S = 1.0
"""How often /v1/loads and nvidia-smi are polled during a measurement."""
HEALTH_POLL_S = 2.0
"""How often a starting server's /health is asked."""
GPU_FREE_MIB = 4096
"""After a server stops, the next one starts once the device uses less than this (or after 60 s)."""

# ---------------------------------------------------------------------------------------------------- log parsing
DECODE_LINE = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (?P<running>\d+), #token: (?P<tokens>\d+), "
                         r"token usage: (?P<usage>[0-9.]+), .*?cuda graph: (?P<graph>True|False), "
                         r"gen throughput \(token/s\): (?P<tput>[0-9.]+), #queue-req: (?P<queue>\d+)")
"""SGLang 0.5.17's ``Decode batch`` line (``scheduler_components/metrics_reporter.py``)."""
KV_ALLOC_LINE = re.compile(r"KV Cache is allocated\. dtype: (?P<dtype>\S+), #tokens: (?P<tokens>\d+), "
                           r"K size: (?P<k>[0-9.]+) GB, V size: (?P<v>[0-9.]+) GB")
"""``KVCache._finalize_allocation_log`` (``mem_cache/memory_pool.py``; GB = 2**30 bytes)."""
OSCAR_POOL_LINE = re.compile(r"OSCAR pool: (?P<cell>\d+) B/token \((?P<ratio>[0-9.]+)x fewer than BF16's "
                             r"(?P<bf16>\d+)\); fixed (?P<fixed>[0-9.]+) MiB")
"""The plugin's budget line (``oscar_cli.serve.sglang.sizing.Budget.describe``)."""
MAX_TOKENS_LINE = re.compile(r"max_total_num_tokens=(\d+)")


def decode_lines(text: str) -> list[dict]:
    """Every ``Decode batch`` line of a server log, as numbers."""
    return [{"running": int(m["running"]), "tokens": int(m["tokens"]), "usage": float(m["usage"]),
             "graph": m["graph"] == "True", "tok_s": float(m["tput"]), "queue": int(m["queue"])}
            for m in DECODE_LINE.finditer(text)]


def server_decode_rate(text: str, batch: int) -> dict | None:
    """Median server-side gen throughput over the ``Decode batch`` lines at ``batch`` running requests and an empty
    queue (the first such line dropped: its interval can include the last prefill)."""
    lines = [x for x in decode_lines(text) if x["running"] == batch and x["queue"] == 0]
    if len(lines) > 1:
        lines = lines[1:]
    if not lines:
        return None
    return {"tok_s": statistics.median(x["tok_s"] for x in lines), "lines": len(lines),
            "cuda_graph": all(x["graph"] for x in lines)}


def kv_allocation(text: str) -> dict | None:
    """SGLang's KV allocation line (the last one: the one of the running pool)."""
    found = list(KV_ALLOC_LINE.finditer(text))
    if not found:
        return None
    m = found[-1]
    return {"dtype": m["dtype"], "tokens": int(m["tokens"]), "k_gib": float(m["k"]), "v_gib": float(m["v"])}


def oscar_budget(text: str) -> dict | None:
    m = OSCAR_POOL_LINE.search(text)
    if m is None:
        return None
    return {"cell_bytes": int(m["cell"]), "bf16_cell_bytes": int(m["bf16"]), "fixed_mib": float(m["fixed"])}


def max_tokens_from_log(text: str) -> int | None:
    found = MAX_TOKENS_LINE.findall(text)
    return int(found[-1]) if found else None


# ---------------------------------------------------------------------------------------------------- HTTP
def http_json(base: str, method: str, path: str, payload: Any = None, timeout: float = 30.0) -> Any:
    """One request to the server; the body parsed as JSON when it is JSON (text otherwise). Raises
    ``RuntimeError`` for a status other than 200."""
    host, port = base.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        body = None if payload is None else json.dumps(payload)
        conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        r = conn.getresponse()
        data = r.read().decode(errors="replace")
    finally:
        conn.close()
    if r.status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {r.status}: {data[:200]}")
    return json.loads(data) if data.strip()[:1] in ("{", "[") else data


@dataclass
class Stream:
    """One streamed ``/generate`` request: ``events`` are (perf_counter time, completion tokens so far)."""

    prompt_tokens: int
    sent: float = 0.0
    events: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    meta: dict = dataclasses.field(default_factory=dict)
    done: float | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.events[-1][1] if self.events else 0

    def tokens_at(self, t: float) -> int:
        n = 0
        for when, count in self.events:
            if when > t:
                break
            n = count
        return n


def stream_generate(base: str, ids: list[int], new_tokens: int, timeout: float, s: Stream) -> None:
    """POST /generate with ``stream`` on; fills ``s`` as chunks arrive (``meta_info.completion_tokens``)."""
    host, port = base.split("//", 1)[1].split(":")
    payload = {"input_ids": ids, "stream": True,
               "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        s.sent = time.perf_counter()
        conn.request("POST", "/generate", json.dumps(payload), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            s.error = f"HTTP {r.status}: {r.read()[:200].decode(errors='replace')}"
            return
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            meta = obj.get("meta_info", {}) if isinstance(obj, dict) else {}
            s.events.append((time.perf_counter(), int(meta.get("completion_tokens", len(s.events) + 1))))
            s.meta = meta
        s.done = time.perf_counter()
    except (OSError, http.client.HTTPException, ValueError) as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def decode_window(streams: list[Stream]) -> dict | None:
    """Decode tokens/s while all ``streams`` were decoding: tokens received between the last first token and the
    first finish, over that window; None when the window is empty (or a stream failed)."""
    if not streams or any(s.error or not s.events for s in streams):
        return None
    t0 = max(s.events[0][0] for s in streams)
    t1 = min(s.events[-1][0] for s in streams)
    if t1 <= t0:
        return None
    tokens = sum(s.tokens_at(t1) - s.tokens_at(t0) for s in streams)
    return {"tokens": tokens, "seconds": t1 - t0, "tok_s": tokens / (t1 - t0)}


def token_gaps_ms(s: Stream) -> list[float]:
    """Milliseconds per token between consecutive chunks after the first (each chunk's gap over its new tokens)."""
    out = []
    for (ta, na), (tb, nb) in zip(s.events, s.events[1:], strict=False):
        if nb > na:
            out.extend([1e3 * (tb - ta) / (nb - na)] * (nb - na))
    return out


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


# ---------------------------------------------------------------------------------------------------- trace summary
ATTENTION_KERNELS = re.compile(
    r"decode_int2|extend_int2|rotate_q_kernel|decode_rows|quantize_pack|_plan_(?:lengths|fill)|"  # oscar (kernels/)
    r"BatchDecode|BatchPrefill|SingleDecode|SinglePrefill|MergeState|VariableLengthMerge|"  # flashinfer attention
    r"(?:^|[^a-z])_fwd_kernel(?:_stage\d|_unified)?(?:$|[^a-z_])|_fwd_grouped_kernel_stage|"  # SGLang triton
    r"_copy_unified_indices|kv_indices|store_cache|store_kv|set_kv_buffer|reshape_and_cache|"  # KV writes, indices
    r"fmha|flash_fwd|flash_attn|attention", re.IGNORECASE)
"""Attention, KV-write and attention-index kernels of the three backends (flashinfer's norm, activation and
sampling kernels share its namespace and are not attention)."""
GEMM_KERNELS = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|splitk", re.IGNORECASE)
"""The weight matmuls (cuBLAS/cuBLASLt/CUTLASS names on Hopper); checked after :data:`ATTENTION_KERNELS`."""


def kernel_class(name: str) -> str:
    if ATTENTION_KERNELS.search(name):
        return "attention"
    if GEMM_KERNELS.search(name):
        return "gemm"
    return "other"


def trace_summary(trace: dict, steps: int) -> dict:
    """Device time per decode step of a torch-profiler chrome trace, by :func:`kernel_class`, in ms; memcpy and
    memset count as other. ``top``: the five longest kernels."""
    by = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    names: dict[str, float] = {}
    n = 0
    for e in trace.get("traceEvents", []):
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        us = float(e.get("dur", 0.0))
        name = str(e.get("name", ""))
        by["other" if cat != "kernel" else kernel_class(name)] += us
        names[name] = names.get(name, 0.0) + us
        n += 1
    steps = max(1, int(steps))
    out = {f"{k}_ms": v / 1e3 / steps for k, v in by.items()}
    out["total_ms"] = sum(by.values()) / 1e3 / steps
    out["kernels"] = n
    out["top"] = [[k[:120], v / 1e3 / steps] for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:5]]
    return out


def read_trace(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------- machine
def missing_runtime() -> str | None:
    """Why this machine cannot run the benchmark (one line), or None."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return ("SGLang is not importable here; oscar bench runs SGLang 0.5.17 servers on a CUDA machine (its site "
                "first on PYTHONPATH, see benchmarks/bench_e2e.py), or pass --render RESULTS_JSON to render recorded "
                "results")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        return ("CUDA is not available here; oscar bench needs a GPU for its SGLang servers, or pass --render "
                "RESULTS_JSON to render recorded results")
    return None


def nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=10).stdout
        return out.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def device_name() -> str:
    return nvidia_smi("name") or "unknown device"


def gpu_used_mib() -> float | None:
    v = nvidia_smi("memory.used")
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


class Monitor:
    """While a measurement runs: ``/v1/loads`` (running requests, KV tokens in use, token usage) and the device's
    memory, polled every :data:`POLL_S` seconds on a thread; keeps the largest values."""

    def __init__(self, base: str | None, gpu: Callable[[], float | None] = gpu_used_mib,
                 interval: float | None = None):
        self.base, self.gpu = base, gpu
        self.interval = POLL_S if interval is None else interval
        self.peak = {"running": 0, "used_tokens": 0, "token_usage": 0.0, "gpu_mib": None}
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        if self.base is not None:
            try:
                loads = http_json(self.base, "GET", "/v1/loads?include=core", timeout=5).get("loads") or [{}]
                load = loads[0]
                self.last = load
                self.peak["running"] = max(self.peak["running"], int(load.get("num_running_reqs", 0)))
                self.peak["used_tokens"] = max(self.peak["used_tokens"], int(load.get("num_used_tokens", 0)))
                self.peak["token_usage"] = max(self.peak["token_usage"], float(load.get("token_usage", 0.0)))
            except (OSError, RuntimeError, ValueError, AttributeError, http.client.HTTPException):
                pass
        mib = self.gpu()
        if mib is not None:
            self.peak["gpu_mib"] = max(self.peak["gpu_mib"] or 0.0, mib)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()


# ---------------------------------------------------------------------------------------------------- the server
class ServerError(BenchError):
    """A server that did not start or died."""


class Server:
    """One SGLang HTTP server process (own process group, cwd outside the checkout so its top-level ``kernels/``
    never shadows the PyPI package SGLang imports); its log goes to ``log``."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, port: int, cwd: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.argv, self.log = argv, Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.log, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, cwd=str(cwd), stdout=self._f,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.start_s: float | None = None

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``/health`` answered 200 (SGLang answers 503 while starting)."""
        deadline = self.started + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"the server exited with {self.proc.returncode} while starting: "
                                  f"{self.last_error()} (log: {self.log})")
            try:
                http_json(self.url, "GET", "/health", timeout=5)
                self.start_s = time.perf_counter() - self.started
                return self.start_s
            except (OSError, RuntimeError, http.client.HTTPException):
                time.sleep(HEALTH_POLL_S)
        raise ServerError(f"the server did not answer /health within {timeout:.0f} s: {self.last_error()} "
                          f"(log: {self.log})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str, timeout: float = 30) -> Any:
        return http_json(self.url, "GET", path, timeout=timeout)

    def post(self, path: str, payload: Any = None, timeout: float = 60) -> Any:
        return http_json(self.url, "POST", path, {} if payload is None else payload, timeout=timeout)

    def log_size(self) -> int:
        self._f.flush()
        return self.log.stat().st_size

    def log_text(self, start: int = 0) -> str:
        with open(self.log, errors="replace") as f:
            f.seek(start)
            return f.read()

    def last_error(self) -> str:
        lines = [x for x in self.log_text().splitlines() if x.strip()]
        hits = [x for x in lines if re.search(r"Error|error:|refus|Traceback", x)]
        return (hits or lines or ["(empty log)"])[-1].strip()[:300]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self._f.close()


def start_server(config: EngineConfig, cfg: BenchConfig, model: Path, artifact: Path | None, timeout: float) -> Server:
    out = Path(cfg.out).resolve()
    argv, env = server_argv(config, cfg, model, artifact, out / "profiles")
    n = len(list((out / "logs").glob(f"server-{config.name}-*.log"))) if (out / "logs").is_dir() else 0
    srv = Server(argv, env, out / "logs" / f"server-{config.name}-{n + 1}.log", cfg.port, out)
    try:
        srv.wait_ready(timeout)
    except BaseException:
        srv.stop()
        raise
    return srv


def wait_gpu_free(gpu: Callable[[], float | None], limit_s: float = 60.0) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        used = gpu()
        if used is None or used < GPU_FREE_MIB:
            return
        time.sleep(2)


