"""``oscar bench``: capacity, decode throughput and latency of OSCAR INT2 KV in SGLang 0.5.17 against SGLang's own
BF16 and FP8 KV caches, end to end through the HTTP server (the library behind ``oscar_cli/cli/bench.py`` and
``benchmarks/bench_e2e.py``: :mod:`.spec` what runs, :mod:`.server` one SGLang server, :mod:`.measure` the
measurements, :mod:`.records` and :mod:`.render` what is kept and shown).

Ran on an H200 on 2026-12-02 to 2026-12-04 (``benchmarks/RESULTS.md``): server facts, throughput (every fill) and
latency of ``oscar``, ``flashinfer`` and ``flashinfer-fp8``, the admission run, and the profiles of ``oscar`` and
``flashinfer`` BF16; throughput, profile and latency of ``oscar-int8`` and ``oscar-int8-pv``; ``triton`` / ``triton-fp8`` not through it (flashinfer is the faster backend there). Its parsing,
records and rendering are tested on CPU over recorded sample data (``tests/test_cli_bench.py``, synthetic).
Batch-1 latency points come after one unrecorded warm-up request (:data:`.measure.WARMUP_TOKENS`).

**Model.** A Qwen3-8B-shaped model: 36 layers, hidden 4096, 32 query / 8 KV heads, head dim 128, intermediate
12288, vocab 151936, RoPE theta 1e6, 131072 positions (:data:`QWEN3_8B_SHAPED`, written by :func:`write_model`),
served with ``--load-format dummy`` (random weights: decode speed does not depend on weight values) and a tokenizer
folder copied in (SmolLM2's, from ``oscar collect``'s converted model, is enough: prompts are random token ids below
its vocabulary). The oscar configuration needs an artifact of that shape: :func:`write_random_artifact` writes a
data-free one through :func:`oscar_cli.artifact.write_artifact` (a seeded Haar-random orthogonal rotation per layer
for K and one for V, shared by the KV heads, clip 1.0, ``QuantScheme`` defaults: INT2, group 128, sink 64, recent
256). The model folder carries ``oscar_model.json`` with a fingerprint of its config and "random weights", the same
fingerprint the manifest records, so the plugin's own check (``refusals.model_refusals``) compares them and notes
that ``--load-format dummy`` serves random weights. :func:`check_with_plugin` runs that check and the plugin's
budget (``setup.rank_setup``) before any server starts.

**Configurations** (:data:`CONFIGS`), each one server, all at one ``--mem-fraction-static`` (0.85),
``--context-length 131072``, ``--sampling-backend pytorch``, ``--load-format dummy``:
``oscar`` (``--attention-backend oscar --radix-cache-backend oscar`` through ``oscar_cli.serve.sglang.launch.
build_launch``, ``--max-running-requests 64``), ``flashinfer`` (BF16, the baseline of every ratio),
``flashinfer-fp8`` (``--kv-cache-dtype fp8_e4m3``), and on request ``oscar-int8`` (``oscar`` with ``oscar serve
--int8-scores``: decode scores over the INT2 rows from int8 MMAs), ``oscar-int8-pv`` (``--int8-scores
--int8-values``: the value products too), ``oscar-lean`` and ``oscar-int8-pv-lean`` (those with the decode kernel's
``lean_tiles`` and ``movmatrix``, and ``fused_update`` with int8 values, through the settings' ``decode_tuning``) and ``triton`` /
``triton-fp8``. Baseline servers
run with ``SGLANG_PLUGINS=none`` (no plugin loaded: unmodified SGLang). Configurations run in that order
(baselines first), so the BF16 batch is known when oscar runs. ``--decode-tuning KEY=VALUE,...`` adds decode-kernel
launch options to every oscar configuration (:func:`~.spec.tuned`); those runs are recorded as
``CONFIG+KEY=VALUE,...``, apart from the plain configuration's.

**What is measured** (``--measure``; each selectable, each written to ``OUT/results.jsonl`` as soon as it ends):

* ``server`` (always, free): SGLang's own ``max_total_num_tokens`` (``/server_info``, from the scheduler's init info;
  the start log's ``max_total_num_tokens=`` line as fallback), turned into concurrent 100k-token requests
  (``max_total_num_tokens // 100000``); the KV allocation SGLang logs (``KV Cache is allocated. dtype, #tokens,
  K size, V size``) and reports (``internal_states[0].memory_usage``: weights, kvcache, graphs, in GiB); for oscar
  the plugin's budget line (``OSCAR pool: N B/token ...; fixed F MiB = ...``). Bits per KV element: per token slot
  (``8 * cell bytes / (layers * 2 * KV heads * head dim)``) and over the pool's real allocation (``8 * kvcache bytes
  / (max_total_num_tokens * elements per token)``: for oscar this includes the exact sink/recent regions of every
  request slot and anchor, not the plan workspaces).
* ``capacity`` (admission): the N concurrent 100k-token requests the pool holds, started at once at a context whose
  prefill fits a ten-minute run (``--admission-context``, 32k: N x 32k tokens, labelled "N x 32k", i.e. 32% of the
  tokens N x 100k would hold), ``--admission-new-tokens`` each; read from the server: the largest
  ``num_running_reqs`` of ``/v1/loads`` (published by the scheduler at every prefill and every 15 decode steps)
  and the largest ``#running-req`` of its ``Decode batch`` log lines, with the token usage there.
* ``throughput``: decode tokens/s through the server's scheduler (streamed ``/generate`` requests, ``ignore_eos``)
  at the configuration's largest batch under its budget (the 100k count, capped by its max running requests) and at
  the equal batch (the BF16 largest batch, or ``--equal-batch``), each request at a 100k context. Client side: the
  tokens all streams received between the moment the last stream got its first token and the moment the first one
  finished, over that window; server side: the median ``gen throughput (token/s)`` of its ``Decode batch`` lines at
  that batch (first line dropped). How the cache is filled (``--fill``): ``prefill`` sends B distinct random
  prompts (B x L tokens of real prefill); ``prefix`` prefills one shared (L - decode - 32)-token prefix once and
  sends B requests of that prefix plus a distinct 32-token suffix (``cached_tokens`` checked on a probe first), so
  every step still attends over B x L positions but the pool holds one prefix (and the B streams read the same
  prefix slots, which L2 may serve more than once: an optimistic fill); ``null`` sends B distinct random prompts
  whose prefill skips the model (every server loads the benchmark plugin ``oscar_bench_fill``, which, while the
  flag file ``OUT/null-fill.flag`` exists, returns zero logits for extend forwards without running them; the flag is
  removed once every stream has its first token): each request holds its own pages at the full context, their
  values whatever the pool held, and the timed steps are real decode forwards over B x L distinct positions, for
  about no prefill time; ``auto`` (default) prefills when B x L <= ``--prefill-budget`` tokens (400k) and reuses
  the prefix otherwise. Every row says which.
* ``latency``: batch-1 inter-token latency (median of streamed token gaps) and time to first token at 8k, 32k and
  100k contexts (``--latency-contexts``), each prompt really prefilled.
* ``profile`` (``--profile``): oscar and BF16 only; SGLang's own ``/start_profile`` (torch profiler, GPU activity,
  ``num_steps`` decode steps, traces under ``SGLANG_TORCH_PROFILER_DIR`` = ``OUT/profiles``) during a decode at
  bs1/100k and at the largest batch (prefix fill); kernel time per step summarised as attention (attention, KV
  write and plan kernels of each backend), GEMM (the weight matmuls) and other.
* Peak GPU memory (``nvidia-smi``, polled every second) for every measurement, and the KV tokens in use
  (``/v1/loads``) to draw memory against batch and context.

**Budget.** A command on the H200 machine may run 10 minutes: every configuration and measurement is
selectable, records are appended (and fsynced) one per line as each measurement ends, a measurement that cannot
start inside ``--budget-s`` is recorded as skipped, each request's timeout is a ceiling from its token counts
(:data:`PREFILL_FLOOR_TOK_S`, :data:`STEP_CEIL_S_PER_TOKEN`) capped by the time left, and timed-out requests are
aborted (``/abort_request``) and recorded as such. The first start of each attention backend times out at
``--start-timeout`` (300 s; oscar took 139 s there, flashinfer with a cold JIT cache more than 200), a restart of one
already started in the same command at :data:`RESTART_TIMEOUT_S` (180 s; 55 s there).

**Rendering** (pure functions over the records: :func:`summary_rows`, :func:`profile_rows`, :func:`markdown`,
:func:`results_section`, :func:`plot`): one table (capacity, ratios to BF16, requests per 100k, bits per element,
admission, tokens/s at the largest and the equal batch with ratios to BF16 and, at the largest batch, to the fastest
FP8 configuration, each ratio only between records of the same context and fill, ITL at each context, peak
memory), the profile
summary, and a ``benchmarks/RESULTS.md`` section with date, device, commit and command taken from the records.

**On the H200**. CPU side, once: SGLang's site archive and a tokenizer folder into the ignored
``.whl/`` (``/work/shared/sglang-h200/README.md``)::

    grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
    bash ../shared/sglang-h200/build_site.sh .whl/sgl && cp ../shared/sglang-h200/unpack.sh .whl/sgl/
    mkdir -p .whl/bench/tokenizer && cp STORE/models/smollm2-135m/tokenizer*.json .whl/bench/tokenizer/

GPU side, one configuration per 10-minute command, carrying ``.whl/sgl`` and ``.whl/bench`` (57 MiB with the
checkout); ``.whl/bench/results.jsonl`` carries the records of the calls before (the BF16 batch for oscar's equal
batch), copied back from ``$OUT`` after each call::

    . .whl/sgl/unpack.sh .whl/sgl/sglsite.tar.xz && mkdir -p /tmp/oscar-bench &&
    { cp .whl/bench/results.jsonl /tmp/oscar-bench/ 2>/dev/null; true; } &&
    python3 benchmarks/bench_e2e.py --configs flashinfer --tokenizer .whl/bench/tokenizer --out /tmp/oscar-bench;
    cp /tmp/oscar-bench/results.jsonl benchmarks/RESULTS.md $OUT/; cp /tmp/oscar-bench/logs/*.log $OUT/

then ``--configs oscar``, ``--configs flashinfer-fp8``, and ``--configs flashinfer,oscar --measure profile``; a
measurement that does not fit a command is recorded as skipped and can run alone (``--measure latency``). Back on
CPU, ``oscar bench --render .whl/bench/results.jsonl --results-md benchmarks/RESULTS.md --plot FILE`` (or the last
call's RESULTS.md, which holds one section over every record). ``python3 benchmarks/bench_e2e.py ARGS`` is ``oscar
bench ARGS`` for a checkout without installed entry points: it puts the checkout's ``oscar_cli`` and ``kernels`` (as
``oscar_kernels``) with the plugin's entry point on the path (``plugin_site`` in that script), for the servers too.
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
