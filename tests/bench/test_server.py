"""One SGLang server under test (:mod:`oscar_cli.bench.server`): the parsers of its log lines and profiler traces,
the decode window and token gaps of streamed requests, and a server process started, checked and stopped."""

from __future__ import annotations

import pytest
from bench_kit import LOG

from oscar_cli.bench import server as bench_server
from oscar_cli.bench.server import (
    Server,
    ServerError,
    Stream,
    decode_lines,
    decode_window,
    kv_allocation,
    max_tokens_from_log,
    oscar_budget,
    server_decode_rate,
    token_gaps_ms,
    trace_summary,
)


def test_log_parsers_read_sglang_and_plugin_lines():
    from oscar_cli.serve.sglang.sizing import Budget

    lines = decode_lines(LOG)
    assert len(lines) == 6 and lines[4] == {"running": 44, "tokens": 4401350, "usage": 0.97, "graph": False,
                                            "tok_s": 5000.0, "queue": 0}
    # at bs45 with an empty queue: first line (prefill inside its interval) dropped, median of 1990, 2010, 2000
    assert server_decode_rate(LOG, 45) == {"tok_s": 2000.0, "lines": 3, "cuda_graph": True}
    assert server_decode_rate(LOG, 7) is None
    assert kv_allocation(LOG) == {"dtype": "torch.bfloat16", "tokens": 4500000, "k_gib": 46.5, "v_gib": 46.5}
    assert max_tokens_from_log(LOG) == 4500000
    budget = Budget(cell=20736, bf16_cell=147456, region=47185920, request_slots=65, anchors=64, workspace=3 << 20)
    line = f"[2026-12-02 10:00:00] oscar: rank 0/1, layers 0..35, 8 KV heads, scheme x: {budget.describe()}"
    assert oscar_budget(line) == {"cell_bytes": 20736, "bf16_cell_bytes": 147456,
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
    s = trace_summary(trace, steps=2)
    assert s["attention_ms"] == pytest.approx(4.0 / 2) and s["gemm_ms"] == pytest.approx(4.0 / 2)
    assert s["other_ms"] == pytest.approx(0.5 / 2) and s["total_ms"] == pytest.approx(8.5 / 2)
    assert s["kernels"] == 9 and s["top"][0][0].startswith("nvjet")


def test_decode_window_and_token_gaps():
    a = Stream(10, sent=0.0, events=[(1.0, 1), (1.1, 2), (1.2, 3), (1.3, 4), (1.4, 5)], done=1.4)
    b = Stream(10, sent=0.0, events=[(1.15, 1), (1.25, 3), (1.35, 4), (1.45, 5), (1.55, 6)], done=1.55)
    w = decode_window([a, b])  # window [1.15, 1.4]: a 2 -> 5, b 1 -> 4
    assert w["tokens"] == 6 and w["seconds"] == pytest.approx(0.25) and w["tok_s"] == pytest.approx(24.0)
    assert token_gaps_ms(b) == pytest.approx([50.0, 50.0, 100.0, 100.0, 100.0])
    assert decode_window([a, Stream(10, events=[(2.0, 1)])]) is None  # b starts after a finished
    assert decode_window([a, Stream(10, error="HTTP 500")]) is None


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

    monkeypatch.setattr(bench_server, "HEALTH_POLL_S", 0.05)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = Server([sys.executable, "-c", "print('loading'); print('ValueError: no such model'); raise SystemExit(3)"],
                    {}, tmp_path / "dead.log", port, tmp_path)
    with pytest.raises(ServerError, match=r"exited with 3 while starting: ValueError: no such model"):
        dead.wait_ready(timeout=30)
    dead.stop()
    srv = Server([sys.executable, "-c", HEALTHY, str(port)], {"X": "1"}, tmp_path / "ok.log", port, tmp_path)
    try:
        assert 0 < srv.wait_ready(timeout=30) < 30 and srv.alive()
        assert "Uvicorn running" in srv.log_text()
    finally:
        srv.stop()
    assert not srv.alive() and srv.proc.returncode is not None
