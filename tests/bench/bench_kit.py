"""What several bench tests share: the recorded sample, an SGLang start log and a server stub that serves it."""

from __future__ import annotations

from pathlib import Path

SAMPLE = Path(__file__).parents[1] / "data" / "bench_e2e_sample.jsonl"
"""A synthetic results file: flashinfer, flashinfer-fp8 and oscar records of every measurement."""

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
"""An oscar server's start log and six ``Decode batch`` lines (SGLang 0.5.17's formats)."""


class StubServer:
    """A started server as :func:`oscar_cli.bench.measure.run` sees it, answering ``/server_info`` and serving
    :data:`LOG`; measurements given to ``run`` by the test decide what else happens."""

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
