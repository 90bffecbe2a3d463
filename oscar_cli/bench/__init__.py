"""``oscar bench``'s library: OSCAR INT2 KV in SGLang 0.5.17 against SGLang's own BF16 and FP8 KV caches, end to end
through the HTTP server (behind ``oscar_cli/cli/bench.py`` and ``benchmarks/bench_e2e.py``).

:mod:`.spec` what runs (the Qwen3-8B-shaped model, its data-free artifact, the engine configurations, one run's
:class:`BenchConfig`), :mod:`.server` one SGLang server and the parsers of its logs and traces, :mod:`.measure` the
measurements and :func:`run`, :mod:`.records` the results file, :mod:`.render` the tables, the RESULTS.md section
and the plot. How to run it: ``oscar bench --help``.
"""

from ..progress import Progress
from .measure import run
from .records import Recorder, load_records
from .render import (
    PROFILE_HEADERS,
    SUMMARY_HEADERS,
    append_results,
    notes,
    plot,
    plot_series,
    profile_rows,
    results_section,
    summary_rows,
)
from .server import (
    Server,
    ServerError,
    Stream,
    decode_lines,
    decode_window,
    http_json,
    kv_allocation,
    max_tokens_from_log,
    missing_runtime,
    oscar_budget,
    server_decode_rate,
    token_gaps_ms,
    trace_summary,
)
from .spec import (
    CONFIGS,
    MEASURES,
    NULL_FILL_FLAG,
    PROFILE_STEPS,
    QWEN3_8B_SHAPED,
    RESULTS_FILE,
    SUFFIX_TOKENS,
    BenchConfig,
    BenchError,
    check_with_plugin,
    model_fingerprint,
    parse_names,
    prepare_model,
    server_argv,
)

__all__ = [
    "CONFIGS", "MEASURES", "NULL_FILL_FLAG", "PROFILE_HEADERS", "PROFILE_STEPS", "Progress", "QWEN3_8B_SHAPED", "RESULTS_FILE", "SUFFIX_TOKENS", "SUMMARY_HEADERS", "BenchConfig",
    "BenchError", "Recorder", "Server", "ServerError", "Stream", "append_results", "check_with_plugin", "decode_lines",
    "decode_window", "http_json", "kv_allocation", "load_records", "max_tokens_from_log", "missing_runtime",
    "model_fingerprint", "notes", "oscar_budget", "parse_names", "plot", "plot_series", "prepare_model",
    "profile_rows", "results_section", "run", "server_argv", "server_decode_rate", "summary_rows", "token_gaps_ms",
    "trace_summary",
]
