"""``oscar bench`` on CPU: argument handling and refusals, rendering over a recorded (synthetic) sample, records
appended as measurements end, the measurements themselves against a fake SGLang HTTP server, and the generated
Qwen3-8B-shaped model and artifact through the SGLang plugin's own checks. Nothing here ran on a GPU."""

from __future__ import annotations

import dataclasses
import gzip
import importlib.machinery
import importlib.util
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from oscar_cli.bench.spec import RESTART_TIMEOUT_S
from oscar_cli.cli import app
from oscar_cli.cli.bench import driver

SAMPLE = Path(__file__).parent / "data" / "bench_e2e_sample.jsonl"
runner = CliRunner()
d = driver()


def invoke(*args):
    return runner.invoke(app, ["bench", *map(str, args)])


def one_line_error(result, *words):
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A tokenizer folder: a tokenizer.json with 480 tokens and 20 added ones (ids 0..499)."""
    folder = tmp_path_factory.mktemp("tok")
    tok = {"model": {"type": "WordLevel", "vocab": {f"w{i}": i for i in range(20, 500)}},
           "added_tokens": [{"id": i, "content": f"<s{i}>"} for i in range(20)]}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, tokenizer) -> tuple[Path, Path, Path]:
    """The bench's own Qwen3-8B-shaped model folder and data-free artifact (written once)."""
    out = tmp_path_factory.mktemp("bench")
    model, art = d.prepare_model(out, tokenizer)
    return out, model, art


# ------------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("args, words", [
    (["--configs", "oscar,vllm"], ["vllm", "flashinfer-fp8"]),
    (["--configs", " , "], ["configuration"]),
    (["--measure", "capacity,speed"], ["speed", "throughput"]),
    (["--latency-contexts", "8k,32k"], ["8k,32k"]),
])
def test_bad_values_are_usage_errors(args, words, tmp_path):
    r = invoke(*args, "--out", tmp_path / "o")
    assert r.exit_code == 2, r.output
    for w in words:
        assert w in r.output
    assert not (tmp_path / "o").exists()


def test_refuses_with_one_line_without_sglang(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    r = invoke("--out", tmp_path / "o", "--tokenizer", tmp_path)
    one_line_error(r, "SGLang is not importable", "--render")
    assert not (tmp_path / "o").exists()


def test_refuses_with_one_line_without_cuda(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    fake = importlib.machinery.ModuleSpec("sglang", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "sglang" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = invoke("--out", tmp_path / "o", "--tokenizer", tmp_path)
    one_line_error(r, "CUDA is not available", "--render")
    assert not (tmp_path / "o").exists()


def test_bad_decode_tuning_is_a_one_line_error_before_anything_runs(tmp_path):
    r = invoke("--configs", "oscar", "--decode-tuning", "lean=1", "--out", tmp_path / "o")
    one_line_error(r, "--decode-tuning 'lean=1'", "lean_tiles", "split_tokens")
    assert not (tmp_path / "o").exists()
    with pytest.raises(d.BenchError, match="--decode-tuning applies to the oscar configurations"):
        d.BenchConfig(out=tmp_path, configs=("flashinfer",), decode_tuning=(("split_tokens", 4096),))


def test_bench_config_refuses_contexts_that_do_not_fit(tmp_path):
    with pytest.raises(d.BenchError, match="--context-length 65536"):
        d.BenchConfig(out=tmp_path, context_length=65536)
    cfg = d.BenchConfig(out=tmp_path, configs=("oscar", "flashinfer"), measures=("latency", "profile", "capacity"))
    assert cfg.configs == ("flashinfer", "oscar")  # baselines first
    assert cfg.measures == ("capacity", "profile", "latency")  # the profile reuses the throughput's prefix


# ------------------------------------------------------------------------------------------------ rendering
def test_summary_rows_put_the_numbers_in_their_cells():
    records = d.load_records(SAMPLE)
    rows = {r[0]: dict(zip(d.SUMMARY_HEADERS[:8], r[:8], strict=True)) | {"rest": r[8:]}
            for r in d.summary_rows(records)}
    assert list(rows) == ["flashinfer", "flashinfer-fp8", "oscar"]
    o, f8, bf = rows["oscar"], rows["flashinfer-fp8"], rows["flashinfer"]
    assert (bf["max tokens"], bf["x BF16"], bf["req @100k"], bf["bits/el"], bf["bits/el pool"]) == \
        ("700,000", "1.00x", "7", "16.00", "16.00")
    assert (f8["x BF16"], f8["req @100k"], f8["bits/el"], f8["bits/el pool"], f8["admitted"]) == \
        ("2.00x", "14", "8.00", "8.00", "14/14 @32k")
    assert o["max tokens"] == "4,500,000" and o["x BF16"] == f"{4_500_000 / 700_000:.2f}x" == "6.43x"
    assert o["req @100k"] == "45" and o["admitted"] == "45/45 @32k"  # the larger of /v1/loads (44) and the log (45)
    assert o["bits/el"] == f"{8 * 20736 / 73728:.2f}" == "2.25"  # the plugin's cell bytes over 36 x 2 x 8 x 128
    assert o["bits/el pool"] == f"{8 * 93.0 * 2**30 / (4_500_000 * 73728):.2f}" == "2.41"  # SGLang's kvcache GiB
    large, x_large, x_fp8, equal, x_equal, itl8, itl32, itl100, ttft, x_ttft, peak = o["rest"]
    assert (large, x_large, equal, x_equal) == ("2,000 (bs45 R)", "4.00x", "800 (bs7 R)", "1.60x")
    assert x_fp8 == f"{2000 / 900:.2f}x"  # against flashinfer-fp8's largest batch (900 tok/s at bs14)
    assert (itl8, itl32, itl100, ttft, x_ttft) == ("8.00", "8.30", "—", "—", "—")  # the 100k latency failed
    assert peak == f"{127000 / 1024:.1f}"
    assert rows["flashinfer-fp8"]["rest"][8:10] == ["5.0", "1.00x"]  # time to first token of the 100k prompt
    assert rows["flashinfer-fp8"]["rest"][:5] == ["900 (bs14 R)", "1.80x", "1.00x", "520 (bs7 R)", "1.04x"]
    assert rows["flashinfer"]["rest"][2] == f"{500 / 900:.2f}x"


def test_equal_batch_ratio_needs_the_same_batch():
    records = [r for r in d.load_records(SAMPLE) if not (r["config"] == "flashinfer" and r["measure"] == "throughput")]
    records.append({**next(r for r in d.load_records(SAMPLE) if r["measure"] == "throughput"), "batch": 8,
                    "roles": ["largest", "equal"]})
    o = next(r for r in d.summary_rows(records) if r[0] == "oscar")
    assert o[11] == "800 (bs7 R)" and o[12] == "—"  # BF16 ran bs8, not bs7: no ratio at equal batch
    assert o[9] == "4.00x"  # the largest-batch ratio does not need equal batches


def test_throughput_ratios_need_the_same_cache_fill():
    """A distinct-pages run is never set against a shared-prefix baseline (BF16 pages served from L2): the ratios
    take the baseline's record with the same fill and context, or show none."""
    records = d.load_records(SAMPLE)
    tp = [r for r in records if r["measure"] == "throughput" and r["config"] == "oscar"]
    records += [{**r, "fill": "null", "tok_s": r["tok_s"] / 2} for r in tp]  # oscar again, on distinct pages
    o = next(r for r in d.summary_rows(records) if r[0] == "oscar")
    assert o[8].endswith(" N)") and o[9:11] == ["—", "—"] and o[12] == "—"
    base = [r for r in records if r["measure"] == "throughput" and r["config"] == "flashinfer"]
    records += [{**r, "fill": "null", "tok_s": 250.0} for r in base]
    o = next(r for r in d.summary_rows(records) if r[0] == "oscar")
    assert o[9] == "4.00x" and o[10] == "—" and o[12] == "1.60x"  # 1000 / 250, 400 / 250; no FP8 on distinct pages


def test_results_section_and_profile_rows(tmp_path):
    records = d.load_records(SAMPLE)
    text = d.results_section(records)
    title = text.splitlines()[0]
    assert title.startswith("## oscar bench, SGLang 0.5.17") and "2026-12-02" in title and "NVIDIA H200" in title
    assert "commit 0.1.0+gsample" in title and "SYNTHETIC SAMPLE, not measured" in title
    assert "Command: `oscar bench --configs flashinfer,flashinfer-fp8,oscar --profile (synthetic sample)`" in text
    assert ("| oscar | INT2 g128 s64/r256 | 4,500,000 | 6.43x | 45 | 45/45 @32k | 2.25 | 2.41 | 2,000 (bs45 R) | "
            "4.00x | 2.22x | 800 (bs7 R) | 1.60x | 8.00 | 8.30 | — | — | — | 124.0 |") in text
    assert "| oscar | bs45/100k | 30.00 | 9.00 | 3.00 | 42.00 | 71% |" in text
    assert "| flashinfer | bs1/100k | 2.50 | 6.00 | 0.90 | 9.40 | 27% |" in text
    assert "* oscar latency at 100000: error: RuntimeError: the server is not running" in text
    assert "* flashinfer-fp8 profile: skipped:" in text
    md = tmp_path / "R.md"
    md.write_text("# Results\n")
    d.append_results(md, text)
    assert md.read_text() == "# Results\n\n" + text


def test_notes_leave_out_what_a_later_record_made_good():
    base = dict(config="oscar", measure="throughput", batch=50, context=100000)
    lat = dict(base, measure="latency", batch=None)
    records = [dict(base, skipped="time budget spent"), dict(base, tok_s=1046.0), dict(lat, itl_ms=9.4),
               dict(lat, context=None, skipped="time budget spent"), dict(lat, context=8192, error="boom")]
    assert d.notes(records) == ["oscar latency at 8192: error: boom"]  # the bs50 rate and a 100k latency exist


def test_plot_series_and_file(tmp_path):
    records = d.load_records(SAMPLE)
    s = d.plot_series(records)
    assert s["tok_s_batch"]["oscar"] == [(7, 800.0), (45, 2000.0)]
    assert s["tok_s_batch"]["flashinfer"] == [(7, 500.0)]
    assert s["tok_s_context"]["flashinfer"] == [(c, pytest.approx(1e3 / itl)) for c, itl in
                                                ((8192, 7.1), (32768, 7.9), (100000, 9.4))]
    assert [x for x, _ in s["tok_s_context"]["oscar"]] == [8192, 32768]  # the failed 100k point is not drawn
    per_token = 93.0 / 4_500_000  # GiB per token slot of oscar's pool
    assert s["mem_batch"]["oscar KV in use"] == [(7, pytest.approx(100800 * per_token)),
                                                 (45, pytest.approx(107000 * per_token))]
    assert s["mem_batch"]["oscar device peak"] == [(7, 124000 / 1024), (45, 127000 / 1024)]
    out = d.plot(records, tmp_path / "p.png")
    assert out == s and (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_writes_section_plot_and_json(tmp_path):
    md, png = tmp_path / "R.md", tmp_path / "p.png"
    r = invoke("--render", SAMPLE, "--results-md", md, "--plot", png)
    assert r.exit_code == 0, r.output
    assert "4,500,000" in r.output and "SYNTHETIC SAMPLE" in r.output
    assert md.read_text() == "\n" + d.results_section(d.load_records(SAMPLE))
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = invoke("--render", SAMPLE, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == d.load_records(SAMPLE)


def test_render_without_results_md_writes_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    default = tmp_path / "benchmarks" / "RESULTS.md"
    default.write_text("before\n")
    r = invoke("--render", SAMPLE)
    assert r.exit_code == 0, r.output
    assert default.read_text() == "before\n"


def test_render_refuses_bad_files_with_one_line(tmp_path):
    one_line_error(invoke("--render", tmp_path / "missing.jsonl"), "cannot read")
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n{"b": 2}\n')
    one_line_error(invoke("--render", tmp_path / "x.jsonl"), "no oscar bench records")


def test_load_records_keeps_what_a_killed_run_wrote(tmp_path):
    lines = SAMPLE.read_text().splitlines()
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])  # killed while writing line 4
    assert [r["measure"] for r in d.load_records(f)] == ["server", "admission", "throughput"]
    f.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.raises(d.BenchError, match=":2 is not a JSON record"):
        d.load_records(f)


# ------------------------------------------------------------------------------------------------ parsing
LOG = """\
[2026-12-02 10:00:01] OSCAR INT2 KV Cache is allocated. dtype: torch.bfloat16, #tokens: 4500000, K size: 46.50 GB, V size: 46.50 GB
[2026-12-02 10:00:02] max_total_num_tokens=4500000, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=64, context_len=131072, available_gpu_mem=12.00 GB
[2026-12-02 10:01:00] Decode batch, #running-req: 45, #token: 4500000, token usage: 0.99, cuda graph: True, gen throughput (token/s): 100.00, #queue-req: 0
[2026-12-02 10:01:01] Decode batch, #running-req: 45, #token: 4500450, token usage: 0.99, cuda graph: True, gen throughput (token/s): 1990.00, #queue-req: 0
[2026-12-02 10:01:02] Decode batch, #running-req: 45, #token: 4500900, token usage: 0.99, cuda graph: True, gen throughput (token/s): 2010.00, #queue-req: 0
[2026-12-02 10:01:03] Decode batch, #running-req: 45, #token: 4501350, token usage: 0.99, cuda graph: True, gen throughput (token/s): 2000.00, #queue-req: 0
[2026-12-02 10:01:04] Decode batch, #running-req: 44, #token: 4401350, token usage: 0.97, cuda graph: False, gen throughput (token/s): 5000.00, #queue-req: 0
[2026-12-02 10:01:05] Decode batch, #running-req: 45, #token: 4401350, token usage: 0.97, cuda graph: True, gen throughput (token/s): 9000.00, #queue-req: 3
"""


def test_log_parsers_read_sglang_and_plugin_lines():
    from oscar_cli.serve.sglang.sizing import Budget

    lines = d.decode_lines(LOG)
    assert len(lines) == 6 and lines[4] == {"running": 44, "tokens": 4401350, "usage": 0.97, "graph": False,
                                            "tok_s": 5000.0, "queue": 0}
    # at bs45 with an empty queue: first line (prefill inside its interval) dropped, median of 1990, 2010, 2000
    assert d.server_decode_rate(LOG, 45) == {"tok_s": 2000.0, "lines": 3, "cuda_graph": True}
    assert d.server_decode_rate(LOG, 7) is None
    assert d.kv_allocation(LOG) == {"dtype": "torch.bfloat16", "tokens": 4500000, "k_gib": 46.5, "v_gib": 46.5}
    assert d.max_tokens_from_log(LOG) == 4500000
    budget = Budget(cell=20736, bf16_cell=147456, region=47185920, request_slots=65, anchors=64, workspace=3 << 20)
    line = f"[2026-12-02 10:00:00] oscar: rank 0/1, layers 0..35, 8 KV heads, scheme x: {budget.describe()}"
    assert d.oscar_budget(line) == {"cell_bytes": 20736, "bf16_cell_bytes": 147456,
                                    "fixed_mib": round(budget.fixed / 2**20, 1)}


def test_trace_summary_splits_attention_gemm_and_other():
    ev = [("void flashinfer::BatchDecodeWithPagedKVCacheKernel<128>", "kernel", 2000.0),
          ("_decode_int2_kernel", "kernel", 1000.0), ("_quantize_pack_kv_kernel", "kernel", 500.0),
          ("_fwd_grouped_kernel_stage1", "kernel", 500.0),
          ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "kernel", 3000.0),
          ("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 1000.0),
          ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>", "kernel", 300.0),  # not attention
          ("_layer_norm_fwd_kernel", "kernel", 100.0), ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 100.0),
          ("aten::mm", "cpu_op", 9999.0)]
    trace = {"traceEvents": [{"ph": "X", "cat": c, "name": n, "dur": us, "ts": i} for i, (n, c, us) in enumerate(ev)]
             + [{"ph": "i", "cat": "kernel", "name": "marker"}]}
    s = d.trace_summary(trace, steps=2)
    assert s["attention_ms"] == pytest.approx(4.0 / 2) and s["gemm_ms"] == pytest.approx(4.0 / 2)
    assert s["other_ms"] == pytest.approx(0.5 / 2) and s["total_ms"] == pytest.approx(8.5 / 2)
    assert s["kernels"] == 9 and s["top"][0][0].startswith("nvjet")


def test_decode_window_and_token_gaps():
    a = d.Stream(10, sent=0.0, events=[(1.0, 1), (1.1, 2), (1.2, 3), (1.3, 4), (1.4, 5)], done=1.4)
    b = d.Stream(10, sent=0.0, events=[(1.15, 1), (1.25, 3), (1.35, 4), (1.45, 5), (1.55, 6)], done=1.55)
    w = d.decode_window([a, b])  # window [1.15, 1.4]: a 2 -> 5, b 1 -> 4
    assert w["tokens"] == 6 and w["seconds"] == pytest.approx(0.25) and w["tok_s"] == pytest.approx(24.0)
    assert d.token_gaps_ms(b) == pytest.approx([50.0, 50.0, 100.0, 100.0, 100.0])
    assert d.decode_window([a, d.Stream(10, events=[(2.0, 1)])]) is None  # b starts after a finished
    assert d.decode_window([a, d.Stream(10, error="HTTP 500")]) is None


# ------------------------------------------------------------------------------------------------ records
class StubServer:
    def __init__(self, max_total=700_000, mrr=2734):
        self.url, self.argv, self.start_s, self.stopped = "http://127.0.0.1:9", ["python", "-m", "sglang"], 1.0, False
        self.info = {"max_total_num_tokens": max_total, "version": "0.5.17",
                     "internal_states": [{"effective_max_running_requests_per_dp": mrr,
                                          "memory_usage": {"kvcache": 96.13}}]}

    def get(self, path, timeout=30):
        assert path == "/server_info"
        return self.info

    def post(self, *a, **k):
        return {}

    def log_text(self, start=0):
        return LOG[start:]

    def log_size(self):
        return len(LOG)

    def alive(self):
        return True

    def stop(self):
        self.stopped = True


def test_every_measurement_is_on_disk_when_the_next_one_runs(tmp_path, qwen):
    _, model, art = qwen
    cfg = d.BenchConfig(out=tmp_path, configs=("flashinfer",), measures=("capacity", "throughput", "latency"),
                        command="oscar bench --configs flashinfer")
    path = tmp_path / d.RESULTS_FILE
    servers, seen = [], {}

    def start(config, cfg_, model_, artifact, timeout):
        assert artifact is None and timeout <= cfg.start_timeout_s
        servers.append(StubServer())
        return servers[-1]

    def capacity(run):
        seen["capacity"] = [r["measure"] for r in d.load_records(path)]
        run.add("admission", requests=7)

    def throughput(run):
        seen["throughput"] = [r["measure"] for r in d.load_records(path)]
        raise RuntimeError("HTTP 500")

    def latency(run):
        seen["latency"] = [r["measure"] for r in d.load_records(path)]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        d.run(cfg, start=start, measures={"capacity": capacity, "throughput": throughput, "latency": latency},
              gpu=lambda: 1000.0, device="test device", prepare=lambda c: (model, art))
    assert seen == {"capacity": ["server"], "throughput": ["server", "admission"],
                    "latency": ["server", "admission", "throughput"]}
    recs = d.load_records(path)
    assert [r["measure"] for r in recs] == ["server", "admission", "throughput"]
    assert recs[2]["error"] == "RuntimeError: HTTP 500"
    assert recs[0]["max_total_num_tokens"] == 700_000 and recs[0]["requests_long"] == 7
    assert recs[0]["kv_alloc"]["tokens"] == 4500000 and recs[0]["device"] == "test device"
    assert all(r["command"] == "oscar bench --configs flashinfer" and r["commit"] for r in recs)
    assert servers[0].stopped  # the server is stopped on the way out
    # --commit names the code where the checkout's git metadata does not (a copied working tree)
    d.run(dataclasses.replace(cfg, measures=("capacity",), commit="abc1234"), start=start,
          measures={"capacity": lambda run: []}, gpu=lambda: 1000.0, device="test device",
          prepare=lambda c: (model, art))
    assert d.load_records(path)[-1]["commit"] == "abc1234"
    assert d.load_records(path)[0]["commit"] != "abc1234"


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
        return d.http_json(self.url, "GET", path, timeout=timeout)

    def post(self, path, payload=None, timeout=60):
        return d.http_json(self.url, "POST", path, {} if payload is None else payload, timeout=timeout)

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
    monkeypatch.setattr(d.server, "POLL_S", 0.01)
    cfg = d.BenchConfig(out=tmp_path, configs=("oscar", "flashinfer"), measures=d.MEASURES, context_length=2048,
                        long_context=1024, admission_context=512, admission_new_tokens=12,
                        latency_contexts=(256, 512, 1024), decode_tokens=12, prefill_budget=5000,
                        max_running_requests=12, budget_s=120, command="oscar bench (fake server)")
    sizes = {"flashinfer": (4096, 100), "oscar": (30000, 12)}  # largest batches at 1024 tokens: 4 and 12 (capped)
    started, fakes = [], {}

    def start(config, cfg_, model_, artifact, timeout):
        argv, env = d.server_argv(config, cfg_, model_, artifact, tmp_path / "profiles")
        started.append((config.name, argv, env))
        fake = FakeSGLang(tmp_path / f"{config.name}.log", *sizes[config.name], oscar=config.name == "oscar")
        fakes[config.name] = fake
        return FakeProcess(fake, argv)

    recs = d.run(cfg, start=start, gpu=lambda: 2048.0, device="fake", prepare=lambda c: (model, art))
    assert [s[0] for s in started] == ["flashinfer", "oscar"]
    assert started[1][2]["SGLANG_PLUGINS"] == "oscar" and "--radix-cache-backend" in started[1][1]
    assert d.load_records(tmp_path / d.RESULTS_FILE) == recs
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
    plen = 1024 - 12 - d.SUFFIX_TOKENS
    assert large["probe_cached_tokens"] == plen and large["cached_tokens_min"] == plen
    for r, b in ((fi, 4), (eq, 4), (large, 12)):
        assert r["server_tok_s"] == pytest.approx(FAKE_RATE * b)  # the fake's Decode batch lines at that batch
        assert 0.3 < r["tok_s"] / (b / TOKEN_S) < 1.05, r  # all streams' tokens over the common decode window

    for config in ("flashinfer", "oscar"):
        for ctx in (256, 512, 1024):
            lat = by[(config, "latency", None, ctx)]
            assert lat["prompt_tokens"] == ctx - 12 and lat["ttft_s"] > 0
            assert 0.9 * TOKEN_S * 1e3 < lat["itl_ms"] < 4 * TOKEN_S * 1e3
        for b in (1, 4 if config == "flashinfer" else 12):
            p = by[(config, "profile", b, 1024)]
            assert (p["attention_ms"], p["gemm_ms"], p["other_ms"]) == (3.0, 5.0, 1.5)
            assert p["steps"] == d.PROFILE_STEPS and Path(p["trace"]).is_file() and p["fill"] == "prefix"
    for fake in fakes.values():  # one unrecorded warm-up (kernel JIT) right before the first latency request
        first = fake.requests.index((256 - 12, 12))
        assert fake.requests[first - 1] == (256 - 12, 4) and fake.requests.count((256 - 12, 4)) == 1
    section = d.results_section(recs)
    assert "| oscar | INT2 g128 s64/r256 | 30,000 | 7.32x | 29 | 12/12 @512 |" in section  # 29 fit, 12 slots


def test_null_fill_holds_the_flag_until_every_stream_decodes(tmp_path, qwen, monkeypatch):
    """--fill null: the servers get the flag path and the benchmark plugin; the flag exists while the distinct
    prompts arrive (their extends would skip the model) and is gone before they finish and after the run; the
    profile fills its streams the same way (distinct pages, marked N in its table)."""
    _, model, art = qwen
    monkeypatch.setattr(d.server, "POLL_S", 0.01)
    cfg = d.BenchConfig(out=tmp_path, configs=("flashinfer",), measures=("throughput", "profile"), context_length=2048,
                        long_context=1024, admission_context=512, latency_contexts=(512,), decode_tokens=80, fill="null",
                        budget_s=60, command="oscar bench (null)")
    fakes = []

    def start(config, cfg_, model_, artifact, timeout):
        argv, env = d.server_argv(config, cfg_, model_, artifact, tmp_path / "profiles")
        assert env["SGLANG_PLUGINS"] == "oscar_bench_fill"
        fakes.append(FakeSGLang(tmp_path / f"{config.name}.log", 4096, 100, oscar=False))
        fakes[-1].null_flag = env["OSCAR_BENCH_NULL_FILL"]
        return FakeProcess(fakes[-1], argv)

    recs = d.run(cfg, start=start, gpu=lambda: 2048.0, device="fake", prepare=lambda c: (model, art))
    tp = [r for r in recs if r["measure"] == "throughput"]
    assert tp and all(r["fill"] == "null" and not r.get("errors") for r in tp), tp
    flag = Path(fakes[0].null_flag)
    assert flag == (tmp_path / d.NULL_FILL_FLAG).resolve() and not flag.exists()
    assert fakes[0].requests and {n for _, n in fakes[0].requests} == {80}
    assert len({tuple(ids) for ids in fakes[0].seen}) == len(fakes[0].seen)  # distinct prompts
    assert fakes[0].flag_at and all(at_start and not at_end for at_start, at_end in fakes[0].flag_at), \
        fakes[0].flag_at
    assert " N" in d.summary_rows(recs)[0][8] and "N = distinct prompts whose prefill skipped" in \
        d.results_section(recs)
    prof = [r for r in recs if r["measure"] == "profile"]
    assert [r["batch"] for r in prof] == [1, 4] and all(r["fill"] == "null" and r["total_ms"] for r in prof), prof
    assert [r[1] for r in d.profile_rows(recs)] == ["bs1/1k N", "bs4/1k N"]
    assert len(fakes[0].flag_at) == 4 + 1 + 4  # the throughput streams', then the profiles' (1 + 4): flag at arrival


# ------------------------------------------------------------------------------------------------ model, plugin
def test_generated_model_and_artifact_pass_the_plugins_checks(qwen):
    from oscar_cli.artifact import load_artifact
    from oscar_cli.serve.sglang.refusals import ModelFacts, model_refusals

    out, model, art = qwen
    cfg = json.loads((model / "config.json").read_text())
    assert {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "intermediate_size", "vocab_size", "rope_theta",
                                "max_position_embeddings")} == {
        "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "rope_theta": 1e6,
        "max_position_embeddings": 131072}
    a = load_artifact(art, d.model_fingerprint(d.QWEN3_8B_SHAPED))
    s = a.scheme
    assert (s.bits, s.group, s.sink, s.recent) == (2, 128, 64, 256)
    assert torch.equal(a.tensors["clip_k"], torch.ones(36, 1)) and torch.equal(a.tensors["clip_v"], torch.ones(36, 1))
    for key in ("r_k", "r_v"):
        r = a.tensors[key][:, 0].double()
        torch.testing.assert_close(r @ r.transpose(-1, -2), torch.eye(128, dtype=torch.float64).expand(36, 128, 128),
                                   atol=1e-5, rtol=0)
    assert not torch.allclose(a.tensors["r_k"][0], a.tensors["r_k"][1])  # one rotation per layer
    assert not torch.allclose(a.tensors["r_k"], a.tensors["r_v"])

    problems, notes = model_refusals(a.manifest, ModelFacts.from_folder(model), 1, "dummy")
    assert problems == [] and any("fingerprint matches" in n for n in notes)
    check = d.check_with_plugin(model, art, max_running_requests=64, context_length=131072)
    assert check["cell_bytes"] == 36 * 2 * 8 * (128 // 4 + 2 * 2) == 20736
    assert check["bf16_cell_bytes"] == 36 * 2 * 8 * 128 * 2
    assert check["scheme"] == "int2.g128.s64.r256"
    assert d.prepare_model(out, model)[1] == art  # reused, not rewritten


def test_plugin_refuses_a_folder_of_another_model(qwen, tmp_path):
    import shutil

    from oscar_cli.models import FINGERPRINT_FILE
    from oscar_cli.serve.sglang.refusals import ServeRefusal

    _, model, art = qwen
    other = tmp_path / "other"
    shutil.copytree(model, other)
    (other / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": "sha256:someone-else"}))
    with pytest.raises(ServeRefusal, match="fingerprint"):
        d.check_with_plugin(other, art, max_running_requests=64, context_length=131072)


def test_server_argv_goes_through_build_launch_and_keeps_baselines_plugin_free(qwen, tmp_path):
    from oscar_cli.serve.sglang.refusals import ServeRefusal

    _, model, art = qwen
    cfg = d.BenchConfig(out=tmp_path)
    argv, env = d.server_argv(d.CONFIGS["oscar"], cfg, model, art, tmp_path / "p")
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in (("--attention-backend", "oscar"), ("--radix-cache-backend", "oscar"),
                        ("--load-format", "dummy"), ("--mem-fraction-static", "0.85"),
                        ("--context-length", "131072"), ("--sampling-backend", "pytorch"),
                        ("--max-running-requests", "64")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--kv-cache-dtype" not in argv and json.loads(flags["--json-model-override-args"])["oscar"]["artifact"] \
        == str(art.resolve())
    assert env["SGLANG_PLUGINS"] == "oscar" and env["SGLANG_TORCH_PROFILER_DIR"] == str((tmp_path / "p").resolve())
    fp8, env8 = d.server_argv(d.CONFIGS["flashinfer-fp8"], cfg, model, None, tmp_path / "p")
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and fp8[fp8.index("--attention-backend") + 1] == \
        "flashinfer"
    assert env8["SGLANG_PLUGINS"] == "none" and "OSCAR_BENCH_NULL_FILL" not in env8
    null = d.BenchConfig(out=tmp_path, fill="null")  # the benchmark plugin beside oscar's, or alone
    flag = str((tmp_path / d.NULL_FILL_FLAG).resolve())
    _, env_o = d.server_argv(d.CONFIGS["oscar"], null, model, art, tmp_path / "p")
    _, env_b = d.server_argv(d.CONFIGS["flashinfer"], null, model, None, tmp_path / "p")
    assert env_o["SGLANG_PLUGINS"] == "oscar,oscar_bench_fill" and env_o["OSCAR_BENCH_NULL_FILL"] == flag
    assert env_b["SGLANG_PLUGINS"] == "oscar_bench_fill" and env_b["OSCAR_BENCH_NULL_FILL"] == flag
    q8, env_q8 = d.server_argv(d.CONFIGS["oscar-int8"], cfg, model, art, tmp_path / "p")
    assert json.loads(dict(zip(q8[3::2], q8[4::2], strict=False))["--json-model-override-args"])["oscar"][
        "int8_scores"] is True and env_q8["SGLANG_PLUGINS"] == "oscar"
    assert json.loads(flags["--json-model-override-args"])["oscar"]["int8_scores"] is False
    pv, _ = d.server_argv(d.CONFIGS["oscar-int8-pv"], cfg, model, art, tmp_path / "p")
    pv_settings = json.loads(dict(zip(pv[3::2], pv[4::2], strict=False))["--json-model-override-args"])["oscar"]
    assert pv_settings["int8_scores"] is True and pv_settings["int8_values"] is True
    assert json.loads(flags["--json-model-override-args"])["oscar"]["int8_values"] is False
    lean, _ = d.server_argv(d.CONFIGS["oscar-int8-pv-lean"], cfg, model, art, tmp_path / "p")
    lean_settings = json.loads(dict(zip(lean[3::2], lean[4::2], strict=False))["--json-model-override-args"])["oscar"]
    assert lean_settings["int8_values"] is True and lean_settings["decode_tuning"] == {
        "lean_tiles": True, "fused_update": True, "movmatrix": True}
    assert json.loads(flags["--json-model-override-args"])["oscar"]["decode_tuning"] == {}
    bf16, _ = d.server_argv(d.CONFIGS["triton"], cfg, model, None, tmp_path / "p")
    assert "--kv-cache-dtype" not in bf16
    with pytest.raises(ServeRefusal, match="--kv-cache-dtype"):  # the plugin's own refusal, through build_launch
        d.server_argv(d.CONFIGS["oscar"], d.BenchConfig(out=tmp_path, extra=("--kv-cache-dtype", "fp8_e4m3")),
                      model, art, tmp_path / "p")


def test_plugin_site_exposes_the_checkout_and_its_entry_point(tmp_path):
    from importlib.metadata import distributions

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_e2e_script", script)
    boot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)
    site = boot.plugin_site(tmp_path / "site")
    repo = script.parents[1]
    assert (site / "oscar_cli").resolve() == repo / "oscar_cli"
    assert (site / "oscar_kernels").resolve() == repo / "kernels"  # as installed: no top-level kernels/ on the path
    (dist,) = list(distributions(path=[str(site)]))
    eps = {(e.group, e.name): e.value for e in dist.entry_points}
    assert eps[("sglang.srt.plugins", "oscar")] == "oscar_cli.serve.sglang:register"
    assert eps[("lm_eval.models", "oscar")] == "oscar_cli.evaluate:OscarLM"
    assert boot.plugin_site(tmp_path / "site") == site  # idempotent: the links are kept


HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
print("Uvicorn running", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_process_start_and_stop(tmp_path, monkeypatch):
    import socket
    import sys

    monkeypatch.setattr(d.server, "HEALTH_POLL_S", 0.05)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = d.Server([sys.executable, "-c", "print('loading'); print('ValueError: no such model'); raise SystemExit(3)"],
                    {}, tmp_path / "dead.log", port, tmp_path)
    with pytest.raises(d.ServerError, match=r"exited with 3 while starting: ValueError: no such model"):
        dead.wait_ready(timeout=30)
    dead.stop()
    srv = d.Server([sys.executable, "-c", HEALTHY, str(port)], {"X": "1"}, tmp_path / "ok.log", port, tmp_path)
    try:
        assert 0 < srv.wait_ready(timeout=30) < 30 and srv.alive()
        assert "Uvicorn running" in srv.log_text()
    finally:
        srv.stop()
    assert not srv.alive() and srv.proc.returncode is not None


def test_decode_tuning_runs_every_oscar_configuration_under_its_own_name(tmp_path, qwen):
    """``--decode-tuning`` goes over each oscar configuration's own options (the baselines run as they are); its
    records are named CONFIG+KEY=VALUE,... and its KV label says the options, so the table keeps them apart; the
    server gets the merged options through the plugin's settings."""
    _, model, art = qwen
    tuning = (("split_tokens", 4096), ("movmatrix", False))
    cfg = d.BenchConfig(out=tmp_path, configs=("flashinfer", "oscar-int8-pv-lean"), measures=("capacity",),
                        command="oscar bench", budget_s=3600.0, decode_tuning=tuning)
    started = []

    def start(config, cfg_, model_, artifact, timeout):
        started.append(config)
        return StubServer()

    recs = d.run(cfg, start=start, measures={"capacity": lambda run: run.add("admission", requests=1,
                                                                         context=32768)},
                 gpu=lambda: 1000.0, device="test device", prepare=lambda c: (model, art))
    name = "oscar-int8-pv-lean+split_tokens=4096,movmatrix=false"
    assert [c.name for c in started] == ["flashinfer", name]
    assert started[0] == d.CONFIGS["flashinfer"]
    assert dict(started[1].decode_tuning) == {"lean_tiles": True, "fused_update": True, "movmatrix": False,
                                              "split_tokens": 4096}
    assert started[1].int8_values and started[1].kv.endswith(", split_tokens=4096, movmatrix=false")
    assert {r["config"] for r in recs if r["measure"] != "plugin_check"} == {"flashinfer", name}
    assert [row[0] for row in d.summary_rows(recs)] == ["flashinfer", name]
    argv, _ = d.server_argv(started[1], cfg, model, art, tmp_path / "p")
    settings = json.loads(dict(zip(argv[3::2], argv[4::2], strict=False))["--json-model-override-args"])["oscar"]
    assert settings["decode_tuning"] == dict(started[1].decode_tuning) and settings["int8_scores"] is True


def test_each_backends_first_start_gets_the_start_timeout(tmp_path, qwen):
    """A backend's first start may build its JIT kernels cold: it gets ``--start-timeout``; a restart of a backend
    already started in the same command (flashinfer-fp8 after flashinfer) is capped at RESTART_TIMEOUT_S."""
    _, model, art = qwen
    cfg = d.BenchConfig(out=tmp_path, configs=("triton", "flashinfer", "flashinfer-fp8"), measures=("capacity",),
                        command="oscar bench", start_timeout_s=400.0, budget_s=3600.0)
    limits = []

    def start(config, cfg_, model_, artifact, timeout):
        limits.append((config.name, round(timeout)))
        return StubServer()

    d.run(cfg, start=start, measures={"capacity": lambda run: run.add("admission", requests=1)},
          gpu=lambda: 1000.0, device="test device", prepare=lambda c: (model, art))
    assert [n for n, _ in limits].index("flashinfer") < [n for n, _ in limits].index("flashinfer-fp8")
    assert dict(limits) == {"triton": 400, "flashinfer": 400, "flashinfer-fp8": round(RESTART_TIMEOUT_S)}
