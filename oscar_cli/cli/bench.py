"""``oscar bench``: OSCAR INT2 KV in SGLang 0.5.17 against SGLang's BF16 and FP8 KV, end to end on a GPU.

The command parses flags into the library's ``BenchConfig`` (:mod:`oscar_cli.bench`; each measurement is defined
in :mod:`oscar_cli.bench.measure`), runs it with a progress bar, and renders the recorded results: one table, a
section appended to ``benchmarks/RESULTS.md``, and with ``--plot`` a figure. ``--render RESULTS_JSON`` only renders
recorded results (no GPU, no SGLang).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..config import DEFAULT_MODEL, DEFAULT_STORE
from ..errors import OscarError
from ._app import DecodeTuningOpt, JsonOpt, StoreOpt, app, console, decode_options, guarded, out

DEFAULT_OUT = Path(".oscar/bench")
TABLE_WIDTH = 220
"""Characters the summary table is laid out in when the terminal is narrower (its 16 columns need about 200)."""


def driver():
    """The benchmark library (:mod:`oscar_cli.bench`), imported on first use."""
    from .. import bench

    return bench


def _names(kind: str):
    def check(spec: str) -> str:
        d = driver()
        allowed = d.CONFIGS if kind == "configuration" else d.MEASURES
        try:
            d.parse_names(spec, allowed, kind)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        return spec

    return check


def _contexts(spec: str) -> str:
    try:
        vals = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise typer.BadParameter(f"{spec!r} must be comma-separated token counts, e.g. 8192,32768,100000")
    return spec


@app.command("bench", context_settings={"allow_extra_args": True})
@guarded(interrupted="interrupted; OUT/results.jsonl keeps every measurement that finished")
def bench_cmd(
    ctx: typer.Context,
    configs: Annotated[str, typer.Option("--configs", callback=_names("configuration"), help="Comma-separated: "
                                         "oscar, oscar-int8 (oscar serve --int8-scores), oscar-int8-pv (--int8-scores "
                                         "--int8-values), oscar-lean and oscar-int8-pv-lean (the decode kernel's "
                                         "lean_tiles, movmatrix, fused_update), flashinfer (BF16, the baseline), "
                                         "flashinfer-fp8, triton, triton-fp8; run baselines first.")] = "flashinfer,flashinfer-fp8,oscar",
    measure: Annotated[str, typer.Option("--measure", callback=_names("measurement"), help="Comma-separated: "
                                         "capacity (admission run), throughput, latency, profile.")]
    = "capacity,throughput,latency",
    profile: Annotated[bool, typer.Option("--profile", help="Also profile one decode step at bs1/100k and at the "
                                          "largest batch (oscar and BF16; same as adding profile to --measure).")]
    = False,
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for results.jsonl (appended after every "
                                          "measurement), server logs, profiles, the model and its artifact.")]
    = DEFAULT_OUT,
    tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="Tokenizer folder for the Qwen3-8B-shaped "
                                                   "model (default: STORE/models/smollm2-135m).")] = None,
    mem_fraction: Annotated[float, typer.Option("--mem-fraction-static", help="SGLang's static memory fraction, "
                                                "every configuration.")] = 0.85,
    context_length: Annotated[int, typer.Option("--context-length", help="SGLang's --context-length.")] = 131072,
    long_context: Annotated[int, typer.Option("--long-context", help="Tokens of one long request: the capacity "
                                              "count, the throughput and profile context.")] = 100_000,
    admission_context: Annotated[int, typer.Option("--admission-context", help="Context of the admission run "
                                                   "(the long-request count, at a context whose prefill fits).")]
    = 32768,
    latency_contexts: Annotated[str, typer.Option("--latency-contexts", callback=_contexts,
                                                  help="Batch-1 latency contexts.")] = "8192,32768,100000",
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", help="Tokens decoded per request.")] = 128,
    equal_batch: Annotated[int | None, typer.Option("--equal-batch", help="The equal batch of every configuration "
                                                    "(default: the BF16 largest batch recorded)")] = None,
    fill: Annotated[str, typer.Option("--fill", help="How the cache of a throughput batch is filled: prefill "
                                      "(distinct prompts), prefix (one shared prefix reused), auto (prefill up to "
                                      "--prefill-budget tokens), null (distinct prompts whose prefill skips the "
                                      "model: each request gets its own pages at the full context for about no "
                                      "prefill time; the benchmark plugin oscar_bench_fill is loaded in every "
                                      "server). --profile fills its streams with distinct pages under null, with "
                                      "one shared prefix otherwise.")] = "auto",
    prefill_budget: Annotated[int, typer.Option("--prefill-budget", help="Largest batch x context that --fill auto "
                                                "really prefills.")] = 400_000,
    max_running: Annotated[int, typer.Option("--max-running-requests", help="oscar's request slots (the baselines "
                                             "keep SGLang's default).")] = 64,
    graph_bs: Annotated[int, typer.Option("--cuda-graph-max-bs", help="Largest decode CUDA-graph batch, every "
                                          "configuration.")] = 64,
    budget_s: Annotated[float, typer.Option("--budget-s", help="No measurement starts after this many seconds; "
                                            "request timeouts are capped by what is left.")] = 540.0,
    start_timeout: Annotated[float, typer.Option("--start-timeout", help="Seconds a backend's first server may "
                                                 "take to start (a restart of one already started in the same "
                                                 "command: at most 180).")] = 300.0,
    port: Annotated[int, typer.Option("--port", help="Port of the servers (one at a time).")] = 31000,
    render: Annotated[Path | None, typer.Option("--render", help="Only render this recorded results file (no GPU, "
                                                "no SGLang).")] = None,
    results_md: Annotated[Path | None, typer.Option("--results-md", help="Append the section here (default: "
                                                    "benchmarks/RESULTS.md when measuring, none with --render).")] = None,
    no_results_md: Annotated[bool, typer.Option("--no-results-md", help="Do not append to any RESULTS.md.")] = False,
    commit: Annotated[str | None, typer.Option("--commit", help="Commit recorded with the results (default: the "
                                               "checkout's, from git; give it where the checkout's git metadata "
                                               "is not the code's, e.g. a copied working tree).")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw tokens/s and memory against batch and context "
                                              "into this image.")] = None,
    decode_tuning: DecodeTuningOpt = "",
    json_out: JsonOpt = False,
    store: StoreOpt = DEFAULT_STORE,
) -> None:
    """Capacity, decode throughput and latency of oscar vs SGLang BF16/FP8 KV on a Qwen3-8B-shaped model (random
    weights) in SGLang 0.5.17; needs CUDA and SGLang.

    Example: oscar bench --configs flashinfer,oscar --tokenizer .oscar/models/smollm2-135m --out /tmp/oscar-bench

    Each measurement is appended to OUT/results.jsonl as it ends; a later run into the same --out adds to it.

    Under a time limit: one configuration per call, baselines first (oscar's equal batch is BF16's largest).

    Render recorded results only (no GPU): oscar bench --render /tmp/oscar-bench/results.jsonl --plot bench.png

    Arguments after -- go to every server: oscar bench --configs oscar -- --chunked-prefill-size 4096

    Decode-kernel options on every oscar configuration, recorded as CONFIG+KEY=VALUE,...:
    oscar bench --configs flashinfer,oscar-int8-pv --decode-tuning split_tokens=4096
    """
    decode_options(decode_tuning)  # a bad item is a usage error before anything runs
    d = driver()
    if render is not None:
        records = _bench_errors(d.load_records, render)
        _render(d, records, json_out, None if no_results_md else results_md, plot)
        return
    why = d.missing_runtime()
    if why is not None:
        raise OscarError(why)
    if tokenizer is None:
        tokenizer = store / "models" / DEFAULT_MODEL
        if not (tokenizer / "tokenizer.json").is_file():
            raise OscarError(f"no tokenizer at {tokenizer}; pass --tokenizer DIR (a folder with tokenizer.json, "
                             "e.g. the converted SmolLM2 that `oscar collect` writes under STORE/models/)")
    measures = list(d.parse_names(measure, d.MEASURES, "measurement")) + (["profile"] if profile else [])
    cfg = _bench_errors(
        d.BenchConfig, out=out_dir, tokenizer=tokenizer, configs=d.parse_names(configs, d.CONFIGS, "configuration"),
        measures=tuple(measures), mem_fraction=mem_fraction, context_length=context_length,
        long_context=long_context, admission_context=admission_context,
        latency_contexts=tuple(int(s) for s in latency_contexts.split(",") if s.strip()),
        decode_tokens=decode_tokens, equal_batch=equal_batch, fill=fill, prefill_budget=prefill_budget,
        max_running_requests=max_running, cuda_graph_max_bs=graph_bs, budget_s=budget_s,
        start_timeout_s=start_timeout, port=port, extra=tuple(ctx.args), command=_command(), commit=commit,
        decode_tuning=decode_tuning)
    _bench_errors(_run, d, cfg, json_out)
    records = d.load_records(Path(cfg.out) / d.RESULTS_FILE)
    default_md = Path("benchmarks/RESULTS.md")  # as the other benchmarks: relative to the checkout it runs in
    _render(d, records, json_out, None if no_results_md else (results_md or default_md), plot)


def _command() -> str:
    args = sys.argv[1:]
    return "oscar " + shlex.join(args) if args[:1] == ["bench"] else "oscar bench"


def _bench_errors(fn, *args, **kwargs):
    """The driver's one-line errors as OscarError (exit 1)."""
    d = driver()
    try:
        return fn(*args, **kwargs)
    except d.BenchError as e:
        raise OscarError(str(e)) from None


def _run(d, cfg, quiet: bool) -> list[dict]:
    from ._progress import task_progress

    with task_progress("oscar bench", quiet) as bar:
        return d.run(cfg, bar)


def _render(d, records: list[dict], json_out: bool, results_md: Path | None, plot: Path | None) -> None:
    """Table (or JSON) on stdout, the RESULTS.md section and the plot, all from ``records``."""
    from rich.table import Table

    if not records:
        raise OscarError("the results file holds no records yet; run oscar bench first")
    if results_md is not None:
        _bench_errors(d.append_results, results_md, d.results_section(records))
        console.print(f"appended the section to {results_md}", highlight=False)
    if plot is not None:
        _bench_errors(d.plot, records, plot)
        console.print(f"wrote {plot}", highlight=False)
    if json_out:
        out.print_json(json.dumps(records, default=str))
        return
    from rich.console import Console

    synthetic = " (SYNTHETIC SAMPLE, not measured)" if any(r.get("synthetic") for r in records) else ""
    wide = Console(width=max(out.width, TABLE_WIDTH))  # 16 columns: wider than the terminal rather than cropped
    t = Table(title=f"oscar bench{synthetic}", title_justify="left")
    for h in d.SUMMARY_HEADERS:
        t.add_column(h, justify="left" if h in ("config", "KV", "admitted") else "right")
    for row in d.summary_rows(records):
        t.add_row(*row)
    wide.print(t)
    prof = d.profile_rows(records)
    if prof:
        p = Table(title="one decode step (ms of kernel time)", title_justify="left")
        for h in d.PROFILE_HEADERS:
            p.add_column(h, justify="left" if h in ("config", "point") else "right")
        for row in prof:
            p.add_row(*row)
        out.print(p)
    for note in d.notes(records):
        console.print(note, highlight=False, soft_wrap=True)
