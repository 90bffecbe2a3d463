"""Prometheus text exposition (format 0.0.4) of the server's counters, without a client library.

Metrics: ``oscar_requests_total{endpoint,status}``, ``oscar_request_latency_seconds{endpoint}`` (histogram, from the
request's arrival to its last byte), ``oscar_prompt_tokens_total``, ``oscar_generated_tokens_total``,
``oscar_requests_cancelled_total``, ``oscar_queue_depth`` and ``oscar_requests_in_flight`` (gauges).
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the latency histogram: from a health check to a long completion on a CPU."""
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Thread-safe request counters and latency histograms, keyed by endpoint (and status)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = tuple(sorted(buckets))
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, int], int] = defaultdict(int)
        self._hist: dict[str, list[int]] = {}
        self._sum: dict[str, float] = defaultdict(float)
        self.in_flight = 0

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, endpoint: str, status: int, seconds: float, counted_in_flight: bool) -> None:
        with self._lock:
            if counted_in_flight:
                self.in_flight -= 1
            self._requests[(endpoint, status)] += 1
            h = self._hist.setdefault(endpoint, [0] * (len(self.buckets) + 1))
            h[bisect.bisect_left(self.buckets, seconds)] += 1
            self._sum[endpoint] += seconds

    def render(self, gauges: dict[str, tuple[str, float]], counters: dict[str, tuple[str, float]]) -> str:
        """The exposition text; ``gauges``/``counters``: ``name -> (help, value)`` read from the engine."""
        lines: list[str] = []

        def head(name: str, kind: str, help_: str) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")

        with self._lock:
            head("oscar_requests_total", "counter", "HTTP requests by endpoint and status.")
            for (ep, st), n in sorted(self._requests.items()):
                lines.append(f'oscar_requests_total{{endpoint="{_esc(ep)}",status="{st}"}} {n}')
            head("oscar_request_latency_seconds", "histogram", "Time from a request's arrival to its last byte.")
            for ep, h in sorted(self._hist.items()):
                acc = 0
                for le, c in zip((*self.buckets, float("inf")), h, strict=True):
                    acc += c
                    bound = "+Inf" if le == float("inf") else repr(le)
                    lines.append(f'oscar_request_latency_seconds_bucket{{endpoint="{_esc(ep)}",le="{bound}"}} {acc}')
                lines.append(f'oscar_request_latency_seconds_sum{{endpoint="{_esc(ep)}"}} {self._sum[ep]!r}')
                lines.append(f'oscar_request_latency_seconds_count{{endpoint="{_esc(ep)}"}} {acc}')
            gauges = {"oscar_requests_in_flight": ("Generation requests being handled.", self.in_flight), **gauges}
        for name, (help_, v) in counters.items():
            head(name, "counter", help_)
            lines.append(f"{name} {v}")
        for name, (help_, v) in gauges.items():
            head(name, "gauge", help_)
            lines.append(f"{name} {v}")
        return "\n".join(lines) + "\n"


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
