"""The embedded server under a load sized for the 2-core machine (benchmarks/bench_serve_load.py): concurrent clients
mixing generations, streams dropped mid-way, malformed and oversized bodies; no 5xx, every refusal typed, nothing
leaked."""

from __future__ import annotations

import time

from helpers import load_benchmark
from serve_kit import Server, load_engine, wait_until


def test_mixed_load_is_served_typed_and_leaves_nothing_behind(word_model, serve_store):
    bench = load_benchmark("bench_serve_load")
    srv = Server(load_engine(word_model, serve_store, max_queue=32), model_id="tiny", max_queue=32,
                 max_body_bytes=4096)
    try:
        before = bench.rss_mb()
        res = bench.run_load(srv.url, clients=8, per_client=15, max_tokens=3, max_body=4096, seed=1)
        assert res.failures == [] and res.requests == 120
        assert set(res.latencies) >= {"completion", "stream", "dropped-stream", "malformed", "oversized"}
        assert all(code < 500 for c in res.statuses.values() for code in c)
        assert res.statuses["oversized"].keys() == {413}
        wait_until(lambda: srv.engine.queue_depth() == 0 and not srv.engine.busy, timeout=30)
        time.sleep(0.2)
        in_flight = [ln for ln in __import__("requests").get(srv.base + "/metrics", timeout=10).text.splitlines()
                     if ln.startswith("oscar_requests_in_flight")]
        assert in_flight and float(in_flight[0].split()[-1]) == 0
        assert bench.rss_mb() - before < 300  # no growth with the request count (measured ~10 MB)
        assert srv.engine.stats.cancelled >= len(res.latencies["dropped-stream"]) - 2  # dropped streams stop
    finally:
        srv.stop()


def test_the_load_benchmark_runs_end_to_end(word_model, serve_store, tmp_path):
    bench = load_benchmark("bench_serve_load")
    results = tmp_path / "RESULTS.md"
    assert bench.main(["--model", str(word_model), "--store", str(serve_store), "--clients", "4", "--requests", "6",
                       "--max-tokens", "2", "--max-body-bytes", "4096", "--results", str(results)]) == 0
    text = results.read_text()
    assert "## Embedded server under load" in text and "| kind | requests |" in text and "failures: 0" in text
