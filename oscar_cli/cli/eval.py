"""``oscar eval``: accuracy of KV-cache methods on perplexity and lm-eval tasks, stored in the ``evals`` table."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..config import DEFAULT_MODEL, DEFAULT_STORE
from ..errors import OscarError
from ._app import JsonOpt, RecipeOpt, StoreOpt, app, console, guarded, out

DEFAULT_PPL_WINDOWS = 4
"""Windows per sequence length for ``oscar_ppl`` when ``--limit`` is not given."""


def _ints(spec: str, flag: str) -> list[int]:
    try:
        vals = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        vals = []
    if not vals or any(v <= 1 for v in vals):
        raise OscarError(f"{flag} {spec!r} must be a comma-separated list of token counts, e.g. {flag} 1024,4096")
    return vals


@app.command("eval")
@guarded
def eval_cmd(
    tasks: Annotated[str | None, typer.Option("--tasks", "-t", help="Comma-separated: oscar_ppl, ruler, niah_single_1, "
                                              "niah_multikey_2/3, oscar_niah, or any lm-eval task. [oscar_ppl]")] = None,
    methods: Annotated[str | None, typer.Option("--methods", help="Comma-separated KV methods (oscar_cli.methods): "
                                                "bf16, int2-naive, int2-kivi, int2-hadamard[-clip], oscar[@REF], "
                                                "int4-*, hf-quantized. REF: latest, vN, a path, or fit:METHOD[+per-head] "
                                                "(newest artifact of that fit method). [bf16,int2-naive,int2-hadamard,oscar]")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help=f"Model spec (see oscar collect). [{DEFAULT_MODEL}]")] = None,
    artifact: Annotated[str, typer.Option("--artifact", help="Artifact for oscar methods without @REF: latest, vN, "
                                          "model/vN or a path.")] = "latest",
    sink: Annotated[int | None, typer.Option("--sink", help="First real tokens kept exact. [16]")] = None,
    recent: Annotated[int | None, typer.Option("--recent", help="Last tokens kept exact. [64]")] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Windows per length (oscar_ppl, default 4) / samples "
                                              "per task.")] = None,
    seq_lengths: Annotated[str | None, typer.Option("--seq-lengths", help="Token lengths: oscar_ppl windows, "
                                                    "RULER/NIAH contexts. [1024]")] = None,
    data: Annotated[Path | None, typer.Option("--data", help="Text file for oscar_ppl (default: built-in held-out "
                                              "text).")] = None,
    decode: Annotated[bool, typer.Option("--decode/--teacher-forced", help="oscar_ppl: feed tokens one at a time "
                                         "through the cache (on CUDA through the fused INT2 kernels) instead of "
                                         "teacher-forced decode-equivalent attention.")] = False,
    recipe: RecipeOpt = None,
    json_out: JsonOpt = False,
    csv: Annotated[Path | None, typer.Option("--csv", help="Also write the results to this CSV file.")] = None,
    store: StoreOpt = DEFAULT_STORE,
) -> None:
    """Evaluate KV methods; every metric goes to the store's evals table.

    Example: oscar eval --tasks oscar_ppl --methods bf16,int2-naive,int2-hadamard,oscar --sink 16 --recent 64 \
--seq-lengths 1024 --limit 8

    With --recipe, the recipe's eval section (tasks, methods, sink, recent, limit, seq_lengths) fills the flags that
    are not given.
    """
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .. import evaluate as ev
    from ..methods import parse_methods

    ev_cfg: dict = {}
    if recipe is not None:
        from ..config import load_recipe

        rec = load_recipe(recipe)
        ev_cfg = dict(rec.eval)
        model = model or rec.model

    def pick(flag, key, default):
        if flag is not None:
            return flag
        val = ev_cfg.get(key, default)
        return ",".join(str(v) for v in val) if isinstance(val, list) else val

    tasks = pick(tasks, "tasks", "oscar_ppl")
    methods = pick(methods, "methods", "bf16,int2-naive,int2-hadamard,oscar")
    seq_lengths = str(pick(seq_lengths, "seq_lengths", "1024"))
    sink, recent = int(pick(sink, "sink", 16)), int(pick(recent, "recent", 64))
    limit = pick(limit, "limit", None)
    model = model or DEFAULT_MODEL
    method_list = parse_methods(methods)
    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    if not task_list:
        raise OscarError("--tasks is empty; pass e.g. --tasks oscar_ppl,ruler")
    lengths = _ints(seq_lengths, "--seq-lengths")
    if limit is not None and limit <= 0:
        raise OscarError(f"--limit must be positive, got {limit}")
    if sink < 0 or recent < 0:
        raise OscarError("--sink and --recent must be non-negative")
    if data is not None and not data.is_file():
        raise OscarError(f"--data {data} is not a file; pass a UTF-8 text file")
    lm_tasks = ev.expand_tasks([t for t in task_list if t != ev.PPL_TASK])
    if any(m.cache_only for m in method_list) and ev.PPL_TASK in task_list and max(lengths) > 2048:
        raise OscarError("hf-* peers decode token by token for oscar_ppl; use --seq-lengths of at most 2048")

    from ..artifact import load_artifact
    from ..models import load_model
    from ..store import Store

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    st = Store(store)
    loaded = load_model(model, store, dtype=dtype, device=device)
    artifacts = {}
    for m in method_list:
        if m.needs_artifact:
            ref = m.arg or artifact
            if ref not in artifacts:
                artifacts[ref] = load_artifact(_resolve_ref(st, ref, loaded.slug), loaded.fingerprint)
    text_ids = None
    if ev.PPL_TASK in task_list:
        from ..data import heldout_text, read_text_file

        text = read_text_file(data) if data is not None else heldout_text()
        text_ids = ev.token_ids(loaded.tokenizer, text)

    version = ev.lm_eval_version()
    rows: list[dict] = []
    n_ppl = sum(min(limit or DEFAULT_PPL_WINDOWS, text_ids.numel() // n) for n in lengths) if text_ids is not None else 0
    total = len(method_list) * (n_ppl + (1 if lm_tasks else 0))
    # Libraries under lm-eval print to stdout; keep stdout for the result (JSON stays parseable).
    with contextlib.redirect_stdout(sys.stderr), \
            Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                     TimeElapsedColumn(), console=console, disable=json_out) as progress:
        bar = progress.add_task("evaluating", total=total)
        for m in method_list:
            done = len(rows)
            art = artifacts.get(m.arg or artifact) if m.needs_artifact else None
            prep = ev.prepare(loaded.model, m, sink, recent, art)
            base = dict(model_fingerprint=loaded.fingerprint, model_slug=loaded.slug, method=m.label,
                        artifact=prep.artifact, lm_eval_version=version)
            cfg = dict(sink=prep.windows.sink, recent=prep.windows.recent, limit=limit, device=device,
                       dtype=str(dtype).removeprefix("torch."), bits=m.bits)
            if text_ids is not None:
                for n in lengths:
                    progress.update(bar, description=f"{m.label} oscar_ppl@{n}")
                    wins = ev.windows_of(text_ids, n, limit or DEFAULT_PPL_WINDOWS)
                    ppl = ev.perplexity(loaded.model, wins, prep, lambda: progress.advance(bar), decode=decode)
                    rows.append(dict(base, task=ev.PPL_TASK, metric="ppl", value=ppl,
                                     config=dict(cfg, seq_len=n, windows=len(wins),
                                                 mode="decode" if decode or m.cache_only else "teacher-forced",
                                                 data=str(data) if data else "builtin:heldout"),
                                     bits_per_element=ev.element_bits(prep, loaded.model, n)))
            if lm_tasks:
                progress.update(bar, description=f"{m.label} {','.join(lm_tasks)}")
                from ..tasks import TOKENIZERS

                tok_name = getattr(loaded.tokenizer, "name_or_path", None) or loaded.slug
                TOKENIZERS[tok_name] = loaded.tokenizer
                lm = ev.oscar_lm_class()(pretrained=loaded.model, tokenizer=loaded.tokenizer, method=m,
                                         artifact=art, sink=sink, recent=recent, batch_size=1,
                                         max_length=max(lengths) + 256)
                res = ev.run_lm_eval(lm, lm_tasks, limit, {"tokenizer": tok_name, "max_seq_lengths": lengths})
                for task, metrics in res.items():
                    samples = metrics.pop("sample_len", None)
                    for metric, value in metrics.items():
                        if value == -1.0:
                            continue  # RULER's placeholder for lengths that were not run
                        n = int(metric) if metric.isdigit() else max(lengths)
                        rows.append(dict(base, task=task.removeprefix("oscar_ruler_"), metric=metric, value=value,
                                         config=dict(cfg, seq_len=n, seq_lengths=lengths, samples=samples),
                                         bits_per_element=ev.element_bits(prep, loaded.model, n)))
                progress.advance(bar)
            st.record_evals(rows[done:])  # per method: an interrupted run keeps every finished method
    _render(rows, json_out, csv)


def _resolve_ref(st, ref: str, slug: str) -> Path:
    """``fit:METHOD[+per-head]`` -> the newest artifact of that fit method; anything else -> the store's resolver."""
    if not ref.startswith("fit:"):
        return st.resolve_artifact(ref, slug)
    want, _, flag = ref[4:].partition("+")
    per_head = flag == "per-head"
    if flag not in ("", "per-head"):
        raise OscarError(f"artifact ref {ref!r}: use fit:METHOD or fit:METHOD+per-head")
    for a in reversed(st.list_artifacts(slug)):
        if a["method"] != want:
            continue
        try:
            manifest = json.loads((Path(a["path"]) / "manifest.json").read_text())
        except OSError:
            continue
        if bool(_find(manifest, "per_head")) == per_head:
            return Path(a["path"])
    raise OscarError(f"no artifact fitted with method {want}{' per head' if per_head else ''} for {slug}; "
                     f"run: oscar fit --method {want}{' --per-head' if per_head else ''}")


def _find(d, key):
    """First value of ``key`` anywhere in a nested dict (manifests nest the fit config)."""
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            r = _find(v, key)
            if r is not None:
                return r
    return None


def _render(rows: list[dict], json_out: bool, csv: Path | None) -> None:
    from rich.table import Table

    base = {(r["task"], r["metric"], r["config"].get("seq_len")): r["value"] for r in rows if r["method"] == "bf16"}
    for r in rows:
        ref = base.get((r["task"], r["metric"], r["config"].get("seq_len")))
        r["delta_bf16"] = None if ref is None else r["value"] - ref
    if csv is not None:
        import csv as csvmod

        with open(csv, "w", newline="") as f:
            w = csvmod.writer(f)
            w.writerow(["method", "artifact", "task", "metric", "seq_len", "value", "delta_bf16", "bits_per_element"])
            for r in rows:
                w.writerow([r["method"], r["artifact"] or "", r["task"], r["metric"], r["config"].get("seq_len"),
                            r["value"], "" if r["delta_bf16"] is None else r["delta_bf16"], r["bits_per_element"]])
    if json_out:
        out.print_json(json.dumps(rows))
        return
    t = Table(title="oscar eval")
    for c in ("method", "task", "metric", "len", "value", "Δ bf16", "bits/el"):
        t.add_column(c, justify="right" if c in ("len", "value", "Δ bf16", "bits/el") else "left")
    for r in rows:
        d = r["delta_bf16"]
        t.add_row(r["method"], r["task"], r["metric"], str(r["config"].get("seq_len")), f"{r['value']:.4g}",
                  "" if d is None or r["method"] == "bf16" else f"{d:+.4g}", f"{r['bits_per_element']:.3f}")
    out.print(t)
