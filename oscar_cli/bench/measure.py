"""The measurements over one started server, and :func:`run`, which walks the configurations within the time budget.

Each measurement is recorded in ``OUT/results.jsonl`` as soon as it ends (:mod:`.records`):

* ``server`` (always): SGLang's ``max_total_num_tokens`` (``/server_info``, the start log as fallback) as concurrent
  long requests, the KV allocation SGLang logs and reports, and for oscar the plugin's budget line; bits per KV
  element per token slot and over the pool's real allocation (for oscar this includes the exact sink/recent regions).
* ``capacity`` (record ``admission``): the long-request count started at once at ``--admission-context`` (a context
  whose prefill fits the budget), read back from ``/v1/loads`` and the ``Decode batch`` log lines.
* ``throughput``: decode tokens/s at the configuration's largest batch and at the equal batch (the BF16 largest, or
  ``--equal-batch``), each request at ``--long-context``. Client side: all streams' tokens over the window in which
  every stream decodes; server side: the median ``gen throughput`` of its log lines. ``--fill`` says how the cache
  is filled: ``prefill`` (distinct prompts), ``prefix`` (one shared prefix and distinct 32-token suffixes: an
  optimistic fill, L2 may serve the shared pages), ``null`` (distinct prompts whose prefill skips the model through
  the benchmark plugin :mod:`oscar_cli.serve.sglang.bench_fill`), ``auto`` (prefill up to ``--prefill-budget``).
* ``latency``: batch-1 inter-token latency (median token gap) and time to first token at each latency context,
  after one unrecorded warm-up request (:data:`WARMUP_TOKENS`).
* ``profile``: SGLang's torch profiler over :data:`~.spec.PROFILE_STEPS` decode steps at bs1 and at the largest
  batch; kernel time per step as attention, GEMM and other.

Budget: no measurement starts after ``--budget-s`` (it is recorded as skipped), request timeouts are ceilings from
their token counts capped by the time left, and timed-out requests are aborted. A backend's first start gets
``--start-timeout``, a restart :data:`~.spec.RESTART_TIMEOUT_S`.
"""

from __future__ import annotations

import http.client
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..progress import Progress
from .records import Recorder, load_records
from .render import tokens_label
from .server import (
    Monitor,
    Stream,
    decode_lines,
    decode_window,
    device_name,
    gpu_used_mib,
    kv_allocation,
    max_tokens_from_log,
    oscar_budget,
    percentile,
    read_trace,
    server_decode_rate,
    start_server,
    stream_generate,
    token_gaps_ms,
    trace_summary,
    wait_gpu_free,
)
from .spec import (
    BASELINE,
    CONFIGS,
    ELEMENTS_PER_TOKEN,
    FIRST_TOKEN_ID,
    MIN_MEASURE_S,
    NULL_FILL_FLAG,
    PREFILL_FLOOR_TOK_S,
    PREFIX_SLACK,
    PROFILE_STEPS,
    PROFILE_TIMEOUT_S,
    PROFILED,
    QWEN3_8B_SHAPED,
    REQUEST_SLACK_S,
    RESTART_TIMEOUT_S,
    RESULTS_FILE,
    STEP_CEIL_S,
    STEP_CEIL_S_PER_TOKEN,
    SUFFIX_TOKENS,
    BenchConfig,
    BenchError,
    EngineConfig,
    check_with_plugin,
    prepare_model,
    requests_at,
    tokenizer_vocab,
    tuned,
)


# ---------------------------------------------------------------------------------------------------- measurements
class Run:
    """One configuration's server and everything its measurements share."""

    def __init__(self, cfg: BenchConfig, config: EngineConfig, server: Any, recorder: Recorder, progress: Progress,
                 deadline: float, records: list[dict], gpu: Callable[[], float | None] = gpu_used_mib):
        self.cfg, self.config, self.server, self.recorder = cfg, config, server, recorder
        self.progress, self.deadline, self.records, self.gpu = progress, deadline, records, gpu
        self.max_total: int | None = None
        self.max_running: int | None = None
        self.vocab = 32000
        self._seed = 0
        self._prefix: list[int] | None = None
        self._warm = False

    # helpers
    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def ceiling(self, prefill_tokens: int, steps: int, batch: int, context: int) -> float:
        """A request's timeout: prefill at :data:`PREFILL_FLOOR_TOK_S`, steps at the decode ceiling, plus slack;
        capped by the time left."""
        step = STEP_CEIL_S + STEP_CEIL_S_PER_TOKEN * batch * context
        return max(5.0, min(REQUEST_SLACK_S + prefill_tokens / PREFILL_FLOOR_TOK_S + steps * step, self.left()))

    def prompt(self, n: int) -> list[int]:
        """``n`` random token ids (a new seed for every prompt, so prompts share no prefix)."""
        import random

        self._seed += 1
        rng = random.Random(f"{self.config.name}-{self._seed}")
        return [rng.randrange(FIRST_TOKEN_ID, self.vocab) for _ in range(n)]

    def largest_batch(self) -> int | None:
        n = requests_at(self.max_total, self.cfg.long_context)
        if n is None:
            return None
        return min(n, self.max_running) if self.max_running else n

    def add(self, measure: str, **values: Any) -> dict:
        rec = self.recorder.add(measure, self.config.name, **values)
        self.records.append(rec)
        return rec

    def flush(self) -> None:
        try:
            self.server.post("/flush_cache", timeout=60)
        except (OSError, RuntimeError, http.client.HTTPException):
            pass
        self._prefix = None

    def generate(self, prompts: list[list[int]], new_tokens: int, timeout: float, what: str,
                 all_started: Callable[[], None] | None = None) -> list[Stream]:
        """Stream all ``prompts`` at once; abort what is still running at ``timeout``. ``all_started`` is called once,
        as soon as every stream has its first token."""
        streams = [Stream(prompt_tokens=len(p)) for p in prompts]
        threads = [threading.Thread(target=stream_generate, args=(self.server.url, p, new_tokens, timeout, s),
                                    daemon=True) for p, s in zip(prompts, streams, strict=True)]
        for t in threads:
            t.start()
        end = time.perf_counter() + timeout
        while time.perf_counter() < end:
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                break
            done, first = sum(s.tokens for s in streams), sum(1 for s in streams if s.events)
            if all_started is not None and first == len(streams):
                all_started()
                all_started = None
            self.progress.describe(f"{self.config.name}: {what}: {first}/{len(streams)} decoding, {done} tokens")
            alive[0].join(timeout=min(0.5, max(0.0, end - time.perf_counter())))
        if any(t.is_alive() for t in threads):
            try:
                self.server.post("/abort_request", {"abort_all": True}, timeout=30)
            except (OSError, RuntimeError, http.client.HTTPException):
                pass
            for t in threads:
                t.join(timeout=10)
            for s in streams:
                if s.done is None and s.error is None:
                    s.error = f"timed out after {timeout:.0f} s"
        return streams

    def ensure_prefix(self, context: int) -> tuple[list[int], int]:
        """The shared prefix of a ``prefix`` fill (``context - decode - 32`` tokens), prefilled once, and the
        ``cached_tokens`` of a probe (prefix + a new suffix, one token). A probe that finds the prefix evicted (e.g.
        its oscar anchor recycled) prefills it again itself, and a second probe must then find it."""
        plen = context - self.cfg.decode_tokens - SUFFIX_TOKENS
        if self._prefix is None or len(self._prefix) != plen:
            self._prefix = self.prompt(plen)
            warm = self.generate([self._prefix], 1, self.ceiling(plen, 1, 1, context), "prefix prefill")[0]
            if warm.error:
                raise RuntimeError(f"prefix prefill failed: {warm.error}")
        cached = 0
        for _ in range(2):
            probe = self.generate([self._prefix + self.prompt(SUFFIX_TOKENS)], 1,
                                  self.ceiling(context, 1, 1, context), "prefix probe")[0]
            if probe.error:
                raise RuntimeError(f"prefix probe failed: {probe.error}")
            cached = int(probe.meta.get("cached_tokens", 0))
            if cached >= plen - PREFIX_SLACK:
                return self._prefix, cached
        raise RuntimeError(f"the prefix is not reused (cached_tokens {cached} of {plen} after prefilling it)")


def fill_prompts(run: Run, fill: str, batch: int, context: int) -> tuple[list[list[int]], int, int | None]:
    """``batch`` prompts that bring each stream to ``context`` tokens once ``decode_tokens`` are decoded, filled as
    ``fill`` says: ``prefix``, one shared prefix (prefilled once) plus a new suffix each; otherwise distinct prompts
    after a cache flush. Returns the prompts, the tokens their prefill computes, and the prefix probe's
    ``cached_tokens`` (None without a prefix)."""
    cfg = run.cfg
    if fill == "prefix":
        prefix, cached = run.ensure_prefix(context)
        return [prefix + run.prompt(SUFFIX_TOKENS) for _ in range(batch)], batch * SUFFIX_TOKENS, cached
    run.flush()
    return [run.prompt(context - cfg.decode_tokens) for _ in range(batch)], batch * (context - cfg.decode_tokens), None


@contextmanager
def null_fill_flag(cfg: BenchConfig, fill: str) -> Iterator[Path | None]:
    """For a ``null`` fill, the flag file that makes the servers' extends skip the model, present from entry until the
    caller removes it (once every stream has its first token) or the block ends; None for other fills."""
    flag = Path(cfg.out) / NULL_FILL_FLAG if fill == "null" else None
    if flag is not None:
        flag.touch()
    try:
        yield flag
    finally:
        if flag is not None:
            flag.unlink(missing_ok=True)


def fill_for(cfg: BenchConfig, batch: int, context: int) -> str:
    if cfg.fill != "auto":
        return cfg.fill
    return "prefill" if batch * context <= cfg.prefill_budget else "prefix"


def server_record(run: Run) -> dict:
    """What the server says about itself right after start (see the module docstring)."""
    info = run.server.get("/server_info")
    state = (info.get("internal_states") or [{}])[0] if isinstance(info, dict) else {}
    text = run.server.log_text()
    max_total = info.get("max_total_num_tokens") if isinstance(info, dict) else None
    run.max_total = int(max_total) if max_total else max_tokens_from_log(text)
    mrr = state.get("effective_max_running_requests_per_dp") or info.get("max_running_requests")
    run.max_running = int(mrr) if mrr else None
    return run.add("server", max_total_num_tokens=run.max_total, max_running_requests=run.max_running,
                   memory_usage=state.get("memory_usage"), kv_alloc=kv_allocation(text), oscar_pool=oscar_budget(text),
                   kv=run.config.kv, backend=run.config.backend, kv_dtype=run.config.kv_dtype or "auto",
                   sglang_version=info.get("version"), start_s=getattr(run.server, "start_s", None),
                   mem_fraction=run.cfg.mem_fraction, context_length=run.cfg.context_length,
                   long_context=run.cfg.long_context, elements_per_token=ELEMENTS_PER_TOKEN,
                   requests_long=requests_at(run.max_total, run.cfg.long_context), gpu_mib=run.gpu(),
                   cuda_graph_max_bs=run.cfg.cuda_graph_max_bs, argv=getattr(run.server, "argv", None))


def measure_capacity(run: Run) -> list[dict]:
    """Admission: the 100k count of requests at ``--admission-context``, all sent at once."""
    cfg = run.cfg
    n = run.largest_batch()
    if not n:
        return [run.add("admission", skipped=f"the pool holds no {cfg.long_context}-token request")]
    prompt_len = cfg.admission_context - cfg.admission_new_tokens
    run.flush()
    mark = run.server.log_size()
    timeout = run.ceiling(n * prompt_len, cfg.admission_new_tokens, n, cfg.admission_context)
    t0 = time.perf_counter()
    with Monitor(run.server.url, run.gpu) as mon:
        streams = run.generate([run.prompt(prompt_len) for _ in range(n)], cfg.admission_new_tokens, timeout,
                               f"admission {n} x {cfg.admission_context}")
    lines = decode_lines(run.server.log_text(mark))
    errors = sorted({s.error for s in streams if s.error})
    return [run.add("admission", requests=n, context=cfg.admission_context, prompt_tokens=prompt_len,
                    new_tokens=cfg.admission_new_tokens, max_running_loads=mon.peak["running"],
                    max_running_log=max((x["running"] for x in lines), default=0),
                    used_tokens_peak=mon.peak["used_tokens"], token_usage_peak=max(
                        [mon.peak["token_usage"], *(x["usage"] for x in lines)]),
                    seconds=time.perf_counter() - t0, finished=sum(1 for s in streams if s.done and not s.error),
                    gpu_mib_peak=mon.peak["gpu_mib"], errors=errors,
                    label=f"{n} x {tokens_label(cfg.admission_context)} (the {tokens_label(cfg.long_context)} count "
                          f"at a {tokens_label(cfg.admission_context)} context)")]


def decode_at(run: Run, batch: int, context: int, roles: list[str]) -> dict:
    """One throughput point: ``batch`` requests at ``context`` tokens, filled as :func:`fill_for` says."""
    cfg = run.cfg
    fill = fill_for(cfg, batch, context)
    prompts, prefill_tokens, cached = fill_prompts(run, fill, batch, context)
    mark = run.server.log_size()
    timeout = run.ceiling(prefill_tokens, cfg.decode_tokens, batch, context)
    with null_fill_flag(cfg, fill) as flag, Monitor(run.server.url, run.gpu) as mon:
        streams = run.generate(prompts, cfg.decode_tokens, timeout, f"decode bs{batch} at {context} ({fill})",
                               all_started=None if flag is None else (lambda: flag.unlink(missing_ok=True)))
    win = decode_window(streams)
    srv = server_decode_rate(run.server.log_text(mark), batch)
    errors = sorted({s.error for s in streams if s.error})
    return run.add("throughput", batch=batch, context=context, roles=roles, fill=fill, decode_tokens=cfg.decode_tokens,
                   tok_s=win and win["tok_s"], window_tokens=win and win["tokens"], window_s=win and win["seconds"],
                   server_tok_s=srv and srv["tok_s"], server_lines=srv and srv["lines"],
                   cuda_graph=srv and srv["cuda_graph"], probe_cached_tokens=cached,
                   cached_tokens_min=min((int(s.meta.get("cached_tokens", 0)) for s in streams), default=None),
                   used_tokens_peak=mon.peak["used_tokens"], running_peak=mon.peak["running"],
                   gpu_mib_peak=mon.peak["gpu_mib"], errors=errors)


def equal_batch(run: Run) -> int | None:
    """``--equal-batch``, else the BF16 baseline's largest batch recorded (this run or earlier in the file)."""
    if run.cfg.equal_batch:
        return run.cfg.equal_batch
    for rec in reversed(run.records):
        if rec["config"] == BASELINE and rec["measure"] == "server" and rec.get("max_total_num_tokens"):
            n = requests_at(rec["max_total_num_tokens"], run.cfg.long_context)
            mrr = rec.get("max_running_requests")
            return min(n, mrr) if mrr else n
    return None


def measure_throughput(run: Run) -> list[dict]:
    largest, equal = run.largest_batch(), equal_batch(run)
    points: dict[int, list[str]] = {}
    if largest:
        points.setdefault(largest, []).append("largest")
    if equal and (largest is None or equal <= largest):
        points.setdefault(equal, []).append("equal")
    out = []
    if not points:
        return [run.add("throughput", skipped="no batch: no capacity read and no BF16 record (run --configs "
                        f"{BASELINE} first or pass --equal-batch)")]
    if equal and largest and equal > largest:
        out.append(run.add("throughput", skipped=f"equal batch {equal} exceeds this configuration's largest {largest}"))
    for batch, roles in sorted(points.items()):
        if run.left() < MIN_MEASURE_S:
            out.append(run.add("throughput", batch=batch, roles=roles, skipped="time budget spent"))
            continue
        out.append(decode_at(run, batch, run.cfg.long_context, roles))
    return out


WARMUP_TOKENS = 4096
"""Prompt of the one unrecorded request a server gets before its first latency measurement: the first extend and
decode at a new shape compile kernels (Triton JIT), which is not the time a user's request waits."""


def warm_up(run: Run) -> None:
    if run._warm:
        return
    run._warm = True
    n = min(WARMUP_TOKENS, min(run.cfg.latency_contexts) - run.cfg.decode_tokens)
    if n > 0:
        run.generate([run.prompt(n)], 4, run.ceiling(n, 4, 1, n + 4), "warm-up")
    run.flush()


def measure_latency(run: Run) -> list[dict]:
    cfg = run.cfg
    out = []
    if run.left() >= MIN_MEASURE_S:
        warm_up(run)
    for context in cfg.latency_contexts:
        if run.left() < MIN_MEASURE_S:
            out.append(run.add("latency", context=context, skipped="time budget spent"))
            continue
        run.flush()
        mark = run.server.log_size()
        prompt_len = context - cfg.decode_tokens
        with Monitor(run.server.url, run.gpu) as mon:
            s = run.generate([run.prompt(prompt_len)], cfg.decode_tokens,
                             run.ceiling(prompt_len, cfg.decode_tokens, 1, context), f"bs1 at {context}")[0]
        gaps = token_gaps_ms(s)
        srv = server_decode_rate(run.server.log_text(mark), 1)
        out.append(run.add(
            "latency", context=context, prompt_tokens=prompt_len, decode_tokens=cfg.decode_tokens,
            ttft_s=(s.events[0][0] - s.sent) if s.events else None,
            itl_ms=statistics.median(gaps) if gaps else None, itl_p90_ms=percentile(gaps, 0.9) if gaps else None,
            server_itl_ms=(1e3 / srv["tok_s"]) if srv and srv["tok_s"] else None,
            used_tokens_peak=mon.peak["used_tokens"], gpu_mib_peak=mon.peak["gpu_mib"], errors=[s.error] if s.error
            else []))
    return out


def profile_point(run: Run, batch: int, context: int) -> dict:
    """SGLang's torch profiler over :data:`PROFILE_STEPS` decode steps of ``batch`` streams at ``context``,
    summarised by :func:`trace_summary`. The cache is filled as the throughput point at that batch is
    (:func:`fill_for`): with ``--fill null`` distinct pages, as the tok/s it explains; otherwise one shared prefix
    (each step still attends over batch x context positions, but the streams read the same pages, which the L2
    partly serves: a lower bound on a distinct-page step's attention)."""
    cfg = run.cfg
    fill = "null" if fill_for(cfg, batch, context) == "null" else "prefix"
    prompts, prefill_tokens, cached = fill_prompts(run, fill, batch, context)
    pid = f"{run.config.name}-bs{batch}-{context}-{int(time.time())}"
    folder = Path(cfg.out).resolve() / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    steps = max(cfg.decode_tokens, 4 * PROFILE_STEPS)
    streams = [Stream(prompt_tokens=len(p)) for p in prompts]
    timeout = run.ceiling(prefill_tokens, steps, batch, context)
    threads = [threading.Thread(target=stream_generate, args=(run.server.url, p, steps, timeout, s), daemon=True)
               for p, s in zip(prompts, streams, strict=True)]
    with null_fill_flag(cfg, fill):  # gone once every stream has its first token
        for t in threads:
            t.start()
        end = time.perf_counter() + timeout
        while not all(s.events or s.error for s in streams) and time.perf_counter() < end:
            time.sleep(0.05)
    run.progress.describe(f"{run.config.name}: profiling bs{batch} at {context}")
    run.server.post("/start_profile", {"output_dir": str(folder), "num_steps": PROFILE_STEPS, "activities": ["GPU"],
                                       "with_stack": False, "record_shapes": False, "profile_id": pid}, timeout=120)
    trace, t_end = None, time.perf_counter() + min(PROFILE_TIMEOUT_S, max(5.0, run.left()))
    while trace is None and time.perf_counter() < t_end:
        for f in folder.glob(f"{pid}*.trace.json*"):
            try:
                trace = (f, read_trace(f))
            except (OSError, EOFError, ValueError):
                trace = None  # still being written
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=max(1.0, end - time.perf_counter()))
    if trace is None:
        return run.add("profile", batch=batch, context=context, fill=fill, error=f"no trace {pid}* under {folder}")
    summary = trace_summary(trace[1], PROFILE_STEPS)
    if not summary["kernels"]:
        return run.add("profile", batch=batch, context=context, fill=fill, trace=str(trace[0]),
                       error="the trace holds no GPU kernels (graph replays not traced?); rerun with -- "
                             "--cuda-graph-backend-decode disabled")
    return run.add("profile", batch=batch, context=context, fill=fill, steps=PROFILE_STEPS, trace=str(trace[0]),
                   probe_cached_tokens=cached, **summary)


def measure_profile(run: Run) -> list[dict]:
    if run.config.name not in PROFILED and run.config.backend != "oscar":
        return [run.add("profile", skipped=f"profiles compare {', '.join(PROFILED)} only")]
    out = []
    for batch in dict.fromkeys([1, run.largest_batch() or 1]):
        if run.left() < MIN_MEASURE_S:
            out.append(run.add("profile", batch=batch, context=run.cfg.long_context, skipped="time budget spent"))
            continue
        out.append(profile_point(run, batch, run.cfg.long_context))
    return out


MEASURE_FUNCS: dict[str, Callable[[Run], list[dict]]] = {
    "capacity": measure_capacity, "throughput": measure_throughput, "latency": measure_latency,
    "profile": measure_profile,
}


def run(cfg: BenchConfig, progress: Progress | None = None, *, start: Callable[..., Any] = start_server,
        measures: dict[str, Callable[[Run], list[dict]]] | None = None, gpu: Callable[[], float | None] = gpu_used_mib,
        device: str | None = None, prepare: Callable[[BenchConfig], tuple[Path, Path]] | None = None) -> list[dict]:
    """Every selected configuration: start its server, record ``server``, run each selected measurement (a failing
    one is recorded with its error and the next one runs), stop the server. Returns this run's records; earlier
    records of the same results file count for the equal batch."""
    from oscar_cli import code_version

    progress = progress or Progress()
    measures = MEASURE_FUNCS if measures is None else measures
    t0 = time.perf_counter()
    deadline = t0 + cfg.budget_s
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out / RESULTS_FILE, device or device_name(), cfg.commit or code_version(), cfg.command)
    earlier = load_records(rec.path) if rec.path.is_file() else []
    records: list[dict] = list(earlier)
    model, artifact = (prepare or (lambda c: prepare_model(c.out, _tokenizer(c))))(cfg)
    vocab = min(QWEN3_8B_SHAPED["vocab_size"], tokenizer_vocab(model))
    progress.start(len(cfg.configs) * (1 + len(cfg.measures)))
    started: set[str] = set()  # backends started in this command
    for i, name in enumerate(cfg.configs):
        config = tuned(CONFIGS[name], cfg.decode_tuning)
        name = config.name
        steps_left = 1 + len(cfg.measures)
        if deadline - time.perf_counter() < MIN_MEASURE_S:
            r = rec.add("server", name, skipped="time budget spent before the server start")
            records.append(r)
            for _ in range(steps_left):
                progress.advance()
            continue
        if i:
            wait_gpu_free(gpu)
        progress.describe(f"{name}: starting SGLang")
        try:
            if config.backend == "oscar":
                check = check_with_plugin(model, artifact, cfg.max_running_requests, cfg.context_length)
                records.append(rec.add("plugin_check", name, **check))
            # a backend's first start may build its JIT kernels and capture its graphs cold (flashinfer BF16 was
            # still capturing prefill graphs after 200 s there); a restart of one already started is capped
            limit = cfg.start_timeout_s if config.backend not in started else min(cfg.start_timeout_s,
                                                                                 RESTART_TIMEOUT_S)
            started.add(config.backend)
            server = start(config, cfg, model, artifact if config.backend == "oscar" else None,
                           min(limit, max(5.0, deadline - time.perf_counter())))
        except Exception as e:  # noqa: BLE001  (one configuration's failure is a record, not the end of the run)
            records.append(rec.add("server", name, error=f"{type(e).__name__}: {e}"))
            for _ in range(steps_left):
                progress.advance()
            continue
        try:
            r = Run(cfg, config, server, rec, progress, deadline, records, gpu)
            r.vocab = vocab
            server_record(r)
            progress.advance()
            for m in cfg.measures:
                progress.describe(f"{name}: {m}")
                if r.left() < MIN_MEASURE_S:
                    r.add(m, skipped="time budget spent")
                elif not server.alive():
                    r.add(m, error="the server is not running")
                else:
                    try:
                        measures[m](r)
                    except Exception as e:  # noqa: BLE001  (recorded; the next measurement still runs)
                        r.add(m, error=f"{type(e).__name__}: {e}")
                progress.advance()
        finally:
            server.stop()
    return records[len(earlier):]


def _tokenizer(cfg: BenchConfig) -> Path:
    if cfg.tokenizer is None:
        raise BenchError("pass --tokenizer with a tokenizer folder")
    return Path(cfg.tokenizer)
