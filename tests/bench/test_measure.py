"""The measurements (:mod:`oscar_cli.bench.measure`): records on disk as each measurement ends, every measurement
against a fake SGLang HTTP server (streamed ``/generate``, ``/v1/loads``, profiling, ``Decode batch`` log lines),
the null fill's flag, ``--decode-tuning`` runs under their own names, and start timeouts per backend."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from bench_kit import StubServer
from oscar_kernels.scheme import DecodeOptions

from oscar_cli.bench import measure
from oscar_cli.bench import server as bench_server
from oscar_cli.bench.measure import run
from oscar_cli.bench.records import load_records
from oscar_cli.bench.render import profile_rows, results_section, summary_rows
from oscar_cli.bench.server import decode_window, http_json, token_gaps_ms
from oscar_cli.bench.spec import (
    CONFIGS,
    MEASURES,
    NULL_FILL_FLAG,
    PROFILE_STEPS,
    RESTART_TIMEOUT_S,
    RESULTS_FILE,
    SUFFIX_TOKENS,
    BenchConfig,
    server_argv,
)
from oscar_cli.serve.sglang.settings import read_settings


def test_every_measurement_is_on_disk_when_the_next_one_runs(tmp_path, qwen):
    _, model, art = qwen
    cfg = BenchConfig(out=tmp_path, configs=("flashinfer",), measures=("capacity", "throughput", "latency"),
                        command="oscar bench --configs flashinfer")
    path = tmp_path / RESULTS_FILE
    servers, seen = [], {}

    def start(config, cfg_, model_, artifact, timeout):
        assert artifact is None and timeout <= cfg.start_timeout_s
        servers.append(StubServer())
        return servers[-1]

    def capacity(run):
        seen["capacity"] = [r["measure"] for r in load_records(path)]
        run.add("admission", requests=7)

    def throughput(run):
        seen["throughput"] = [r["measure"] for r in load_records(path)]
        raise RuntimeError("HTTP 500")

    def latency(run):
        seen["latency"] = [r["measure"] for r in load_records(path)]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(cfg, start=start, measures={"capacity": capacity, "throughput": throughput, "latency": latency},
              gpu=lambda: 1000.0, device="test device", prepare=lambda c: (model, art))
    assert seen == {"capacity": ["server"], "throughput": ["server", "admission"],
                    "latency": ["server", "admission", "throughput"]}
    recs = load_records(path)
    assert [r["measure"] for r in recs] == ["server", "admission", "throughput"]
    assert recs[2]["error"] == "RuntimeError: HTTP 500"
    assert recs[0]["max_total_num_tokens"] == 700_000 and recs[0]["requests_long"] == 7
    assert recs[0]["kv_alloc"]["tokens"] == 4500000 and recs[0]["device"] == "test device"
    assert all(r["command"] == "oscar bench --configs flashinfer" and r["commit"] for r in recs)
    assert servers[0].stopped  # the server is stopped on the way out
    # --commit names the code where the checkout's git metadata does not (a copied working tree)
    run(dataclasses.replace(cfg, measures=("capacity",), commit="abc1234"), start=start,
          measures={"capacity": lambda run: []}, gpu=lambda: 1000.0, device="test device",
          prepare=lambda c: (model, art))
    assert load_records(path)[-1]["commit"] == "abc1234"
    assert load_records(path)[0]["commit"] != "abc1234"


# ------------------------------------------------------------------------------------------------ fake SGLang
TOKEN_S = 0.01
"""Seconds between streamed tokens of the fake server (100 tokens/s per stream)."""
FAKE_RATE = 123.0
"""Per-request gen throughput the fake writes into its Decode batch lines."""
BATCHING_S = 0.03
"""The fake starts decoding a request once no other has arrived for this long (all of a burst decode together)."""


class FakeSGLang:
    """What the bench reads of an SGLang 0.5.17 server: /health, /server_info, /v1/loads, streamed /generate (with
    cached_tokens from the longest prefix seen), /flush_cache, /abort_request, /start_profile (a gzipped chrome
    trace), and a log with Decode batch lines every 5 ms."""

    def __init__(self, log: Path, max_total: int, mrr: int, oscar: bool):
        self.log, self.max_total, self.lock = log, max_total, threading.Lock()
        self.active, self.used, self.seen, self.profiles, self.arrived = 0, 0, [], [], 0.0
        self.requests: list[tuple[int, int]] = []  # (prompt tokens, max_new_tokens) of every /generate
        self.null_flag: str | None = None  # OSCAR_BENCH_NULL_FILL of its environment (--fill null)
        self.flag_at: list[tuple[bool, bool]] = []  # (at arrival, at the last token) the flag file existed
        kind = "OSCAR INT2 " if oscar else ""
        lines = [f"[t] {kind}KV Cache is allocated. dtype: torch.bfloat16, #tokens: {max_total}, K size: 0.25 GB, "
                 "V size: 0.25 GB", f"[t] max_total_num_tokens={max_total}, max_running_requests={mrr}"]
        if oscar:
            lines.append("[t] oscar: ...: OSCAR pool: 20736 B/token (7.11x fewer than BF16's 147456); fixed 512.0 MiB = "
                         "13 request regions + 64 anchors x 6.00 MiB + plan workspaces 50.0 MiB")
        log.write_text("\n".join(lines) + "\n")
        self.info = {"max_total_num_tokens": max_total, "version": "0.5.17", "internal_states": [
            {"effective_max_running_requests_per_dp": mrr, "memory_usage": {"kvcache": 0.5, "weight": 1.0}}]}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def reply(self, obj, status=200):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    return self.reply({})
                if self.path == "/server_info":
                    return self.reply(fake.info)
                if self.path.startswith("/v1/loads"):
                    return self.reply({"loads": [{"num_running_reqs": fake.active, "num_used_tokens": fake.used,
                                                  "token_usage": fake.used / fake.max_total}]})
                self.reply({"detail": "not found"}, 404)

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/flush_cache":
                    fake.seen.clear()
                    return self.reply({})
                if self.path == "/abort_request":
                    return self.reply({})
                if self.path == "/start_profile":
                    fake.profiles.append(payload)
                    fake.write_trace(payload)
                    return self.reply({})
                if self.path == "/generate":
                    return self.generate(payload)
                self.reply({"detail": "not found"}, 404)

            def generate(self, p):
                ids, n = p["input_ids"], p["sampling_params"]["max_new_tokens"]
                with fake.lock:
                    cached = max((fake.common(ids, s) for s in fake.seen), default=0)
                    fake.seen.append(ids)
                    fake.requests.append((len(ids), n))
                    fake.arrived = time.perf_counter()
                while time.perf_counter() - fake.arrived < BATCHING_S:  # a scheduler admits a burst as one batch
                    time.sleep(0.002)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                with fake.lock:
                    fake.active += 1
                    fake.used += len(ids)
                flag = fake.null_flag is not None and os.path.exists(fake.null_flag)
                try:
                    for i in range(1, n + 1):
                        time.sleep(TOKEN_S)
                        meta = {"completion_tokens": i, "cached_tokens": cached, "prompt_tokens": len(ids)}
                        self.chunk(b"data: " + json.dumps({"meta_info": meta}).encode() + b"\n\n")
                    if fake.null_flag is not None:
                        fake.flag_at.append((flag, os.path.exists(fake.null_flag)))
                    self.chunk(b"data: [DONE]\n\n")
                    self.wfile.write(b"0\r\n\r\n")
                finally:
                    with fake.lock:
                        fake.active -= 1
                        fake.used -= len(ids)

            def chunk(self, data):
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        class Quiet(ThreadingHTTPServer):
            request_queue_size = 128  # the default backlog of 5 delays a burst of connections by SYN retries

            def handle_error(self, request, client_address):  # a client that hung up is not an error here
                pass

        self.httpd = Quiet(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self.httpd.serve_forever, daemon=True),
                        threading.Thread(target=self.scheduler_log, daemon=True)]
        for t in self.threads:
            t.start()

    @staticmethod
    def common(a, b):
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return min(n, len(a) - 1)

    def scheduler_log(self):
        while not self._stop.wait(0.005):
            if self.active:
                with open(self.log, "a") as f:
                    f.write(f"[t] Decode batch, #running-req: {self.active}, #token: {self.used}, token usage: 0.10, "
                            f"cuda graph: True, gen throughput (token/s): {FAKE_RATE * self.active:.2f}, "
                            "#queue-req: 0\n")

    def write_trace(self, p):
        per_step = [("_decode_int2_kernel", "kernel", 3000.0), ("nvjet_tst_128x256_64x4", "kernel", 5000.0),
                    ("rms_norm_kernel", "kernel", 1000.0), ("Memcpy DtoD", "gpu_memcpy", 500.0),
                    ("aten::add", "cpu_op", 7.0)]
        ev = [{"ph": "X", "cat": c, "name": n, "dur": us, "ts": 0} for _ in range(p["num_steps"]) for n, c, us in per_step]
        folder = Path(p["output_dir"])
        with gzip.open(folder / f"{p['profile_id']}-TP-0.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": ev}, f)

    def stop(self):
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeProcess:
    """The driver's view of a server (as :class:`bench_e2e.Server`), over :class:`FakeSGLang`."""

    def __init__(self, fake: FakeSGLang, argv):
        self.fake, self.url, self.argv, self.start_s, self.stopped = fake, fake.url, argv, 0.5, False

    def get(self, path, timeout=30):
        return http_json(self.url, "GET", path, timeout=timeout)

    def post(self, path, payload=None, timeout=60):
        return http_json(self.url, "POST", path, {} if payload is None else payload, timeout=timeout)

    def log_size(self):
        return self.fake.log.stat().st_size

    def log_text(self, start=0):
        with open(self.fake.log) as f:
            f.seek(start)
            return f.read()

    def alive(self):
        return not self.stopped

    def stop(self):
        self.stopped = True
        self.fake.stop()


def test_measurements_through_a_fake_sglang_server(tmp_path, qwen, monkeypatch):
    _, model, art = qwen
    monkeypatch.setattr(bench_server, "POLL_S", 0.01)
    cfg = BenchConfig(out=tmp_path, configs=("oscar", "flashinfer"), measures=MEASURES, context_length=2048,
                        long_context=1024, admission_context=512, admission_new_tokens=12,
                        latency_contexts=(256, 512, 1024), decode_tokens=12, prefill_budget=5000,
                        max_running_requests=12, budget_s=120, command="oscar bench (fake server)")
    sizes = {"flashinfer": (4096, 100), "oscar": (30000, 12)}  # largest batches at 1024 tokens: 4 and 12 (capped)
    started, fakes = [], {}

    def start(config, cfg_, model_, artifact, timeout):
        argv, env = server_argv(config, cfg_, model_, artifact, tmp_path / "profiles")
        started.append((config.name, argv, env))
        fake = FakeSGLang(tmp_path / f"{config.name}.log", *sizes[config.name], oscar=config.name == "oscar")
        fakes[config.name] = fake
        return FakeProcess(fake, argv)

    streams = {}  # (config, what) -> the streams a measurement read, to check its record against them
    generate = measure.Run.generate

    def capture(self, prompts, new_tokens, timeout, what, all_started=None):
        out = generate(self, prompts, new_tokens, timeout, what, all_started)
        streams[(self.config.name, what)] = out
        return out

    monkeypatch.setattr(measure.Run, "generate", capture)
    recs = run(cfg, start=start, gpu=lambda: 2048.0, device="fake", prepare=lambda c: (model, art))
    assert [s[0] for s in started] == ["flashinfer", "oscar"]
    assert started[1][2]["SGLANG_PLUGINS"] == "oscar" and "--radix-cache-backend" in started[1][1]
    assert load_records(tmp_path / RESULTS_FILE) == recs
    bad = [r for r in recs if r.get("error") or r.get("skipped") or r.get("errors")]
    assert not bad, bad
    by = {(r["config"], r["measure"], r.get("batch"), r.get("context")): r for r in recs}
    assert [r["measure"] for r in recs if r["config"] == "flashinfer"] == \
        ["server", "admission", "throughput", "profile", "profile", "latency", "latency", "latency"]

    srv = by[("oscar", "server", None, None)]
    assert srv["max_total_num_tokens"] == 30000 and srv["max_running_requests"] == 12
    assert srv["oscar_pool"] == {"cell_bytes": 20736, "bf16_cell_bytes": 147456, "fixed_mib": 512.0}
    assert by[("oscar", "plugin_check", None, None)]["cell_bytes"] == 20736

    for config, n in (("flashinfer", 4), ("oscar", 12)):
        adm = by[(config, "admission", None, 512)]
        assert adm["requests"] == n and adm["finished"] == n and adm["context"] == 512
        assert adm["max_running_loads"] == n and adm["max_running_log"] == n

    fi = by[("flashinfer", "throughput", 4, 1024)]
    assert fi["roles"] == ["largest", "equal"] and fi["fill"] == "prefill"  # 4 x 1024 <= the prefill budget
    eq = by[("oscar", "throughput", 4, 1024)]
    large = by[("oscar", "throughput", 12, 1024)]
    assert eq["roles"] == ["equal"] and eq["fill"] == "prefill"
    assert large["roles"] == ["largest"] and large["fill"] == "prefix"  # 12 x 1024 > 5000: one shared prefix
    plen = 1024 - 12 - SUFFIX_TOKENS
    assert large["probe_cached_tokens"] == plen and large["cached_tokens_min"] == plen
    for r, b in ((fi, 4), (eq, 4), (large, 12)):
        assert r["server_tok_s"] == pytest.approx(FAKE_RATE * b)  # the fake's Decode batch lines at that batch
        read = streams[(r["config"], f"decode bs{b} at 1024 ({r['fill']})")]
        assert len(read) == b and all(x.tokens == 12 and not x.error for x in read)
        win = decode_window(read)  # all streams' tokens over the window in which every stream decodes
        assert (r["window_tokens"], r["window_s"], r["tok_s"]) == (win["tokens"], win["seconds"], win["tok_s"])
        assert 0 < r["window_tokens"] <= b * 12 and r["tok_s"] == pytest.approx(r["window_tokens"] / r["window_s"])

    for config in ("flashinfer", "oscar"):
        for ctx in (256, 512, 1024):
            lat = by[(config, "latency", None, ctx)]
            assert lat["prompt_tokens"] == ctx - 12 and lat["ttft_s"] > 0
            (one,) = streams[(config, f"bs1 at {ctx}")]
            gaps = token_gaps_ms(one)  # the median gap of the stream's 12 tokens, the first token's time
            assert one.tokens == 12 and len(gaps) == 11 and lat["itl_ms"] == statistics.median(gaps) > 0
            assert lat["ttft_s"] == one.events[0][0] - one.sent and lat["itl_p90_ms"] >= lat["itl_ms"]
        for b in (1, 4 if config == "flashinfer" else 12):
            p = by[(config, "profile", b, 1024)]
            assert (p["attention_ms"], p["gemm_ms"], p["other_ms"]) == (3.0, 5.0, 1.5)
            assert p["steps"] == PROFILE_STEPS and Path(p["trace"]).is_file() and p["fill"] == "prefix"
    for fake in fakes.values():  # one unrecorded warm-up (kernel JIT) right before the first latency request
        first = fake.requests.index((256 - 12, 12))
        assert fake.requests[first - 1] == (256 - 12, 4) and fake.requests.count((256 - 12, 4)) == 1
    section = results_section(recs)
    assert "| oscar | INT2 g128 s64/r256 | 30,000 | 7.32x | 29 | 12/12 @512 |" in section  # 29 fit, 12 slots


def test_null_fill_holds_the_flag_until_every_stream_decodes(tmp_path, qwen, monkeypatch):
    """--fill null: the servers get the flag path and the benchmark plugin; the flag exists while the distinct
    prompts arrive (their extends would skip the model) and is gone before they finish and after the run; the
    profile fills its streams the same way (distinct pages, marked N in its table)."""
    _, model, art = qwen
    monkeypatch.setattr(bench_server, "POLL_S", 0.01)
    cfg = BenchConfig(out=tmp_path, configs=("flashinfer",), measures=("throughput", "profile"), context_length=2048,
                        long_context=1024, admission_context=512, latency_contexts=(512,), decode_tokens=80, fill="null",
                        budget_s=60, command="oscar bench (null)")
    fakes = []

    def start(config, cfg_, model_, artifact, timeout):
        argv, env = server_argv(config, cfg_, model_, artifact, tmp_path / "profiles")
        assert env["SGLANG_PLUGINS"] == "oscar_bench_fill"
        fakes.append(FakeSGLang(tmp_path / f"{config.name}.log", 4096, 100, oscar=False))
        fakes[-1].null_flag = env["OSCAR_BENCH_NULL_FILL"]
        return FakeProcess(fakes[-1], argv)

    recs = run(cfg, start=start, gpu=lambda: 2048.0, device="fake", prepare=lambda c: (model, art))
    tp = [r for r in recs if r["measure"] == "throughput"]
    assert tp and all(r["fill"] == "null" and not r.get("errors") for r in tp), tp
    flag = Path(fakes[0].null_flag)
    assert flag == (tmp_path / NULL_FILL_FLAG).resolve() and not flag.exists()
    assert fakes[0].requests and {n for _, n in fakes[0].requests} == {80}
    assert len({tuple(ids) for ids in fakes[0].seen}) == len(fakes[0].seen)  # distinct prompts
    assert fakes[0].flag_at and all(at_start and not at_end for at_start, at_end in fakes[0].flag_at), \
        fakes[0].flag_at
    assert " N" in summary_rows(recs)[0][8] and "N = distinct prompts whose prefill skipped" in \
        results_section(recs)
    prof = [r for r in recs if r["measure"] == "profile"]
    assert [r["batch"] for r in prof] == [1, 4] and all(r["fill"] == "null" and r["total_ms"] for r in prof), prof
    assert [r[1] for r in profile_rows(recs)] == ["bs1/1k N", "bs4/1k N"]
    assert len(fakes[0].flag_at) == 4 + 1 + 4  # the throughput streams', then the profiles' (1 + 4): flag at arrival


def test_decode_tuning_runs_every_oscar_configuration_under_its_own_name(tmp_path, qwen):
    """``--decode-tuning`` goes over each oscar configuration's own options (the baselines run as they are); its
    records are named CONFIG+KEY=VALUE,... and its KV label says the options, so the table keeps them apart; the
    server gets the merged options through the plugin's settings."""
    _, model, art = qwen
    cfg = BenchConfig(out=tmp_path, configs=("flashinfer", "oscar-int8-pv-lean"), measures=("capacity",),
                      command="oscar bench", budget_s=3600.0, decode_tuning="split_tokens=4096,movmatrix=false")
    started = []

    def start(config, cfg_, model_, artifact, timeout):
        started.append(config)
        return StubServer()

    recs = run(cfg, start=start, measures={"capacity": lambda run: run.add("admission", requests=1,
                                                                       context=32768)},
               gpu=lambda: 1000.0, device="test device", prepare=lambda c: (model, art))
    name = "oscar-int8-pv-lean+movmatrix=false,split_tokens=4096"
    assert [c.name for c in started] == ["flashinfer", name]
    assert started[0] == CONFIGS["flashinfer"]
    assert started[1].decode == DecodeOptions(int8_scores=True, int8_values=True, lean_tiles=True,
                                              fused_update=True, split_tokens=4096)
    assert started[1].kv.endswith(", movmatrix=false, split_tokens=4096")
    assert {r["config"] for r in recs if r["measure"] != "plugin_check"} == {"flashinfer", name}
    assert [row[0] for row in summary_rows(recs)] == ["flashinfer", name]
    argv, _ = server_argv(started[1], cfg, model, art, tmp_path / "p")
    assert read_settings(argv[argv.index("--json-model-override-args") + 1]).decode == started[1].decode


def test_each_backends_first_start_gets_the_start_timeout(tmp_path, qwen):
    """A backend's first start may build its JIT kernels cold: it gets ``--start-timeout``; a restart of a backend
    already started in the same command (flashinfer-fp8 after flashinfer) is capped at RESTART_TIMEOUT_S."""
    _, model, art = qwen
    cfg = BenchConfig(out=tmp_path, configs=("triton", "flashinfer", "flashinfer-fp8"), measures=("capacity",),
                        command="oscar bench", start_timeout_s=400.0, budget_s=3600.0)
    limits = []

    def start(config, cfg_, model_, artifact, timeout):
        limits.append((config.name, round(timeout)))
        return StubServer()

    run(cfg, start=start, measures={"capacity": lambda run: run.add("admission", requests=1)},
          gpu=lambda: 1000.0, device="test device", prepare=lambda c: (model, art))
    assert [n for n, _ in limits].index("flashinfer") < [n for n, _ in limits].index("flashinfer-fp8")
    assert dict(limits) == {"triton": 400, "flashinfer": 400, "flashinfer-fp8": round(RESTART_TIMEOUT_S)}
