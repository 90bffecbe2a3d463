"""Rendering of recorded runs (pure functions over the records): the summary and profile tables, the
``benchmarks/RESULTS.md`` section and the plot."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from ..results_md import markdown_table
from .spec import BASELINE, CONFIGS, ELEMENTS_PER_TOKEN, SGLANG_VERSION, BenchError, requests_at

# ---------------------------------------------------------------------------------------------------- rendering
SUMMARY_HEADERS = ("config", "KV", "max tokens", "x BF16", "req @100k", "admitted", "bits/el", "bits/el pool",
                   "tok/s largest", "x BF16", "x FP8", "tok/s equal", "x BF16", "ITL 8k ms", "ITL 32k ms", "ITL 100k ms",
                   "TTFT 100k s", "x BF16", "peak GiB")
PROFILE_HEADERS = ("config", "point", "attention ms", "GEMM ms", "other ms", "total ms", "attention %")
DASH = "—"
GIB = 1 << 30


def _latest(records: list[dict], config: str, measure: str, pred: Callable[[dict], bool] = lambda r: True) -> dict | None:
    for r in reversed(records):
        if r["config"] == config and r["measure"] == measure and pred(r) and not r.get("skipped") and not r.get("error"):
            return r
    return None


def bits_per_element(server: dict) -> tuple[float | None, float | None]:
    """(bits per KV element of one token slot, bits per element over the pool's real allocation) of a ``server``
    record."""
    ept = server.get("elements_per_token") or ELEMENTS_PER_TOKEN
    cell = None
    if server.get("oscar_pool"):
        cell = 8 * server["oscar_pool"]["cell_bytes"] / ept
    else:
        dtype = str((server.get("kv_alloc") or {}).get("dtype") or server.get("kv_dtype") or "")
        cell = 8.0 if "fp8" in dtype or "float8" in dtype else 16.0 if ("bfloat16" in dtype or dtype == "auto") else None
    tokens = server.get("max_total_num_tokens")
    gib = (server.get("memory_usage") or {}).get("kvcache")
    if gib is None and server.get("kv_alloc"):
        gib = server["kv_alloc"]["k_gib"] + server["kv_alloc"]["v_gib"]
    pool = 8 * gib * GIB / (tokens * ept) if gib and tokens else None
    return cell, pool


def tokens_label(n: int) -> str:
    """32768 -> 32k, 100000 -> 100k, 512 -> 512."""
    if n >= 1000 and n % 1024 == 0:
        return f"{n // 1024}k"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return DASH if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return DASH if a is None or not b else f"{a / b:.2f}x"


def _fill_mark(r: dict | None) -> str:
    if r is None:
        return ""
    return {"prefill": " P", "prefix": " R", "null": " N"}.get(r.get("fill", ""), "")


def _peak_gib(records: list[dict], config: str) -> float | None:
    peaks = [r.get("gpu_mib_peak") or r.get("gpu_mib") for r in records if r["config"] == config]
    peaks = [p for p in peaks if p]
    return max(peaks) / 1024 if peaks else None


def configs_of(records: list[dict]) -> list[str]:
    seen = {r["config"] for r in records}
    return [c for c in CONFIGS if c in seen] + sorted(seen - set(CONFIGS))


def _throughput(records: list[dict], config: str, role: str | None = None, like: dict | None = None,
                same: tuple[str, ...] = ("context", "fill")) -> dict | None:
    """The latest throughput record of ``config`` with a rate (in ``role``, if given; with ``like``: equal to it in
    every key of ``same``, so a ratio never sets distinct pages against a shared prefix)."""
    return _latest(records, config, "throughput",
                   lambda r: bool(r.get("tok_s")) and (role is None or role in r.get("roles", []))
                   and (like is None or all(r.get(k) == like.get(k) for k in same)))


FP8_CONFIGS = tuple(c.name for c in CONFIGS.values() if (c.kv_dtype or "").startswith("fp8"))
"""The FP8 KV configurations: ``x FP8`` is taken against the fastest of them at its largest batch."""


def _best_fp8(records: list[dict], like: dict) -> dict | None:
    cands = [r for c in FP8_CONFIGS if (r := _throughput(records, c, "largest", like)) is not None]
    return max(cands, key=lambda r: r["tok_s"], default=None)


def summary_rows(records: list[dict]) -> list[list[str]]:
    """One row per configuration (cells as in :data:`SUMMARY_HEADERS`), from the latest record of each kind; ratios
    against :data:`BASELINE` (throughput at the same context and cache fill, ``tok/s equal`` at the same batch too);
    ``x FP8`` against the fastest FP8 configuration's largest batch, same context and fill."""
    base = _latest(records, BASELINE, "server")
    base_tokens = base and base.get("max_total_num_tokens")
    rows = []
    for c in configs_of(records):
        srv = _latest(records, c, "server")
        if srv is None and not any(r["config"] == c and r["measure"] != "plugin_check" for r in records):
            continue
        tokens = srv and srv.get("max_total_num_tokens")
        long_ctx = (srv or {}).get("long_context") or 100_000
        cell, pool = bits_per_element(srv) if srv else (None, None)
        adm = _latest(records, c, "admission")
        admitted = DASH if adm is None else (f"{max(adm.get('max_running_loads', 0), adm.get('max_running_log', 0))}"
                                             f"/{adm['requests']} @{tokens_label(adm['context'])}")
        large = _throughput(records, c, "largest")
        base_large = large and _throughput(records, BASELINE, "largest", large)
        fp8_large = large and _best_fp8(records, large)
        eq = _throughput(records, c, "equal")
        base_eq = eq and _throughput(records, BASELINE, like=eq, same=("batch", "context", "fill"))
        itl = _per_context(records, c, "itl_ms")
        ttft = _nearest(_per_context(records, c, "ttft_s"), long_ctx)
        base_ttft = _nearest(_per_context(records, BASELINE, "ttft_s"), long_ctx)
        rows.append([
            c, (srv or {}).get("kv") or (CONFIGS[c].kv if c in CONFIGS else DASH),
            DASH if tokens is None else f"{tokens:,}", _ratio(tokens, base_tokens),
            _fmt(requests_at(tokens, long_ctx), "d") if tokens else DASH, admitted, _fmt(cell, ".2f"), _fmt(pool, ".2f"),
            DASH if large is None else f"{large['tok_s']:,.0f} (bs{large['batch']}{_fill_mark(large)})",
            _ratio(large and large["tok_s"], base_large and base_large["tok_s"]),
            _ratio(large and large["tok_s"], fp8_large and fp8_large["tok_s"]),
            DASH if eq is None else f"{eq['tok_s']:,.0f} (bs{eq['batch']}{_fill_mark(eq)})",
            _ratio(eq and eq["tok_s"], base_eq and base_eq["tok_s"]),
            *(_fmt(_nearest(itl, k), ".2f") for k in (8192, 32768, 100_000)), _fmt(ttft, ".1f"),
            _ratio(ttft, base_ttft), _fmt(_peak_gib(records, c), ".1f"),
        ])
    return rows


def _per_context(records: list[dict], config: str, key: str) -> dict[int, float]:
    """``key`` of the latest latency record of ``config`` at each context."""
    out = {}
    for r in records:
        if r["config"] == config and r["measure"] == "latency" and r.get(key) is not None:
            out[r["context"]] = r[key]
    return out


def _nearest(values: dict[int, float], context: int) -> float | None:
    """The value measured at ``context`` (8k = 8192 or 8000, 100k = 100000 or 102400...: within 5%)."""
    for k, v in values.items():
        if abs(k - context) <= 0.05 * context:
            return v
    return None


def profile_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    for r in records:
        if r["measure"] != "profile" or r.get("skipped") or r.get("error") or r.get("total_ms") is None:
            continue
        total = r["total_ms"]
        point = f"bs{r['batch']}/{tokens_label(r['context'])}{_fill_mark(r)}"
        rows.append([r["config"], point, f"{r['attention_ms']:.2f}", f"{r['gemm_ms']:.2f}", f"{r['other_ms']:.2f}",
                     f"{total:.2f}", DASH if not total else f"{r['attention_ms'] / total:.0%}"])
    return rows


def markdown(headers: Iterable[str], rows: list[list[str]]) -> str:
    return markdown_table(headers, rows)


def notes(records: list[dict]) -> list[str]:
    """What did not run or failed, one line each. A skip or failure is left out where another record measured the
    same point (configuration and measurement, and the batch and context where the skip names them): the tables show
    that record."""
    out = []
    good = [r for r in records if not (r.get("skipped") or r.get("error") or r.get("errors"))]

    def measured(r: dict) -> bool:
        return any(g["config"] == r["config"] and g["measure"] == r["measure"]
                   and all(r.get(k) is None or g.get(k) == r.get(k) for k in ("batch", "context")) for g in good)

    for r in records:
        why = r.get("skipped") or r.get("error")
        if (why or r.get("errors")) and measured(r):
            continue
        if why:
            where = f" bs{r['batch']}" if r.get("batch") else f" at {r['context']}" if r.get("context") else ""
            out.append(f"{r['config']} {r['measure']}{where}: {'skipped: ' if r.get('skipped') else 'error: '}{why}")
        elif r.get("errors"):
            out.append(f"{r['config']} {r['measure']}: {'; '.join(r['errors'])}")
    return out


def results_section(records: list[dict]) -> str:
    """The ``benchmarks/RESULTS.md`` section of ``records``: title with date(s), device(s) and commit(s) of the
    records, the commands, the settings, the summary and profile tables, the labels and the notes."""
    if not records:
        raise BenchError("no records to render")
    dates = sorted({str(r.get("time", ""))[:10] for r in records if r.get("time")})
    devices = sorted({r.get("device") or "unknown device" for r in records})
    commits = sorted({r.get("commit") or "unknown" for r in records})
    synthetic = any(r.get("synthetic") for r in records)
    srv = next((r for r in records if r["measure"] == "server" and r.get("mem_fraction")), {})
    long_ctx = srv.get("long_context", 100_000)
    title = (f"## oscar bench, SGLang {srv.get('sglang_version') or SGLANG_VERSION} end to end at Qwen3-8B shapes: "
             f"{' to '.join(dict.fromkeys([dates[0], dates[-1]])) if dates else 'undated'}, {', '.join(devices)}, "
             f"commit {', '.join(commits)}")
    if synthetic:
        title += " (SYNTHETIC SAMPLE, not measured)"
    cmds = list(dict.fromkeys(r.get("command") for r in records if r.get("command")))
    check = next((r for r in reversed(records) if r["measure"] == "plugin_check"), None)
    parts = [title, ""]
    parts += [f"Command: `{c}`" for c in cmds] or ["Command: (not recorded)"]
    parts += ["", f"Random weights (`--load-format dummy`), `--mem-fraction-static {srv.get('mem_fraction', 0.85)}`, "
              f"`--context-length {srv.get('context_length', 131072)}`, `--sampling-backend pytorch`, decode CUDA "
              f"graphs up to bs{srv.get('cuda_graph_max_bs', 64)}; oscar: "
              f"{check['scheme'] if check else 'the artifact scheme'}, data-free random orthogonal rotations, "
              "`--max-running-requests` as in the command, 64 anchors. Ratios against flashinfer BF16 (throughput at "
              "the same context and cache fill); x FP8: against the fastest FP8 configuration's largest batch.", "",
              markdown(SUMMARY_HEADERS, summary_rows(records)), "",
              f"req @100k: `max_total_num_tokens // {long_ctx}`. admitted: the most requests `/v1/loads` or the "
              "`Decode batch` log showed running at once, of those sent, at the context shown (a scaled-down "
              "context: the same count of shorter requests). bits/el: per token slot; bits/el pool: SGLang's KV "
              "allocation over its token capacity (oscar: with the exact regions of every request slot and anchor). "
              "tok/s: decode tokens/s of all streams while all were decoding, at a "
              f"{tokens_label(long_ctx)} context; P = distinct prompts really prefilled, R = one shared prefix reused "
              "(each step still attends over batch x context positions; the pool holds the prefix once), N = distinct "
              "prompts whose prefill skipped the model (distinct pages, values left as the pool held them). "
              "ITL: batch-1 median inter-token latency, prompt really prefilled. peak GiB: nvidia-smi, whole device."]
    prof = profile_rows(records)
    if prof:
        parts += ["", "One decode step, torch profiler through SGLang's `/start_profile` (kernel time per step; "
                  "attention includes KV writes and attention plans; R: the streams share one prefix, whose pages "
                  "the L2 partly serves, N: distinct pages, as the throughput column's N):", "",
                  markdown(PROFILE_HEADERS, prof)]
    n = notes(records)
    if n:
        parts += ["", "Not measured / failed:", "", *[f"* {x}" for x in n]]
    return "\n".join(parts) + "\n"


def append_results(path: Path, section: str) -> None:
    with open(path, "a") as f:
        f.write("\n" + section)


PLOT_PANELS = (("tok_s_batch", "decode tokens/s vs batch (long context)", "batch", "tokens/s"),
               ("tok_s_context", "batch-1 decode tokens/s vs context", "context (tokens)", "tokens/s"),
               ("mem_batch", "memory vs batch", "batch", "GiB"),
               ("mem_context", "memory vs context (batch 1)", "context (tokens)", "GiB"))


def plot_series(records: list[dict]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """What :func:`plot` draws: panel -> line label -> sorted (x, y) points. Tokens/s against batch (throughput
    records) and context (batch-1 latency: 1000 / ITL); memory against both: the KV in use (``/v1/loads`` tokens x
    the pool's bytes per token, label ``CONFIG KV in use``) and the device's peak (``CONFIG device peak``), GiB."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {k: {} for k, *_ in PLOT_PANELS}
    for c in configs_of(records):
        srv = _latest(records, c, "server")
        per_token = None
        if srv and srv.get("max_total_num_tokens") and (srv.get("memory_usage") or {}).get("kvcache"):
            per_token = srv["memory_usage"]["kvcache"] * GIB / srv["max_total_num_tokens"]
        for measure, x_key, speed, mem in (("throughput", "batch", "tok_s_batch", "mem_batch"),
                                           ("latency", "context", "tok_s_context", "mem_context")):
            pts: dict[float, dict] = {}
            for r in records:
                if r["config"] == c and r["measure"] == measure and not r.get("skipped") and not r.get("error"):
                    pts[r[x_key]] = r
            for x in sorted(pts):
                r = pts[x]
                y = r.get("tok_s") if measure == "throughput" else (1e3 / r["itl_ms"] if r.get("itl_ms") else None)
                if y is not None:
                    out[speed].setdefault(c, []).append((x, y))
                if per_token and r.get("used_tokens_peak"):
                    out[mem].setdefault(f"{c} KV in use", []).append((x, r["used_tokens_peak"] * per_token / GIB))
                if r.get("gpu_mib_peak"):
                    out[mem].setdefault(f"{c} device peak", []).append((x, r["gpu_mib_peak"] / 1024))
    return out


def plot(records: list[dict], path: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Draw :func:`plot_series` into ``path`` (matplotlib, Agg; 2 x 2 panels; device peaks dashed); returns the
    series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = plot_series(records)
    if not any(series.values()):
        raise BenchError("no throughput or latency records to plot")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    colors = {c: f"C{i}" for i, c in enumerate(configs_of(records))}
    for ax, (key, title, xl, yl) in zip(axes.flat, PLOT_PANELS, strict=True):
        for label, pts in series[key].items():
            config = label.split(" ")[0]
            ax.plot(*zip(*pts, strict=True), marker="o", ls="--" if label.endswith("device peak") else "-",
                    color=colors.get(config), label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        if series[key]:
            ax.legend(fontsize=7)
    if any(r.get("synthetic") for r in records):
        fig.suptitle("SYNTHETIC SAMPLE, not measured", color="red")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return series
