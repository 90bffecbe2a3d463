"""``oscar eval``: accuracy of KV-cache methods on perplexity and lm-eval tasks, stored in the ``evals`` table.

The command parses flags (over a recipe's eval section) into an :class:`~oscar_cli.config.EvalConfig`, calls
:func:`oscar_cli.eval.run.run_eval` and renders the rows; a recipe's thresholds that the rows miss print one line
each and exit 1.
"""

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


def _ints(spec: str, flag: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        vals = ()
    if not vals or any(v <= 1 for v in vals):
        raise OscarError(f"{flag} {spec!r} must be a comma-separated list of token counts, e.g. {flag} 1024,4096")
    return vals


def _names(spec: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in spec.split(",") if t.strip())


@app.command("eval")
@guarded(interrupted="interrupted; the store keeps the rows of every method that finished")
def eval_cmd(
    tasks: Annotated[str | None, typer.Option("--tasks", "-t", help="Comma-separated: oscar_ppl, ruler, niah_single_1, "
                                              "niah_multikey_2/3, oscar_niah, or any lm-eval task. [oscar_ppl]")] = None,
    methods: Annotated[str | None, typer.Option("--methods", help="Comma-separated KV methods (oscar_cli.methods): "
                                                "bf16, int2-naive, int2-kivi, int2-hadamard[-clip], oscar[@REF], "
                                                "oscar-noclip, oscar-int8 (int8-rounded queries over INT2 keys), "
                                                "oscar-int8-pv (and int8-rounded probabilities over INT2 values), "
                                                "int4-*, hf-quantized. REF: latest, vN, a path, or "
                                                "fit:ROTATION[+per-head] (newest artifact fitted with that "
                                                "rotation recipe, see oscar fit --method). "
                                                "[bf16,int2-naive,int2-hadamard,oscar]")] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help=f"Model spec (see oscar collect). [{DEFAULT_MODEL}]")] = None,
    artifact: Annotated[str | None, typer.Option("--artifact", help="Artifact for oscar methods without @REF: latest, "
                                                 "vN, model/vN or a path. [latest]")] = None,
    sink: Annotated[int | None, typer.Option("--sink", help="Override the scheme's sink (first real tokens kept "
                                             "exact) for every method. [the artifact's; 64 without one]")] = None,
    recent: Annotated[int | None, typer.Option("--recent", help="Override the scheme's recent (last tokens kept "
                                               "exact) for every method. [the artifact's; 256 without one]")] = None,
    group: Annotated[int | None, typer.Option("--group", help="Override the quantization group (must divide the head "
                                              "dim). [the scheme's]")] = None,
    bits: Annotated[int | None, typer.Option("--bits", help="Assert the code width; refused when a method runs at "
                                             "another (an artifact runs at the bits it was fitted for).")] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Text segments per length (oscar_ppl, default 4) / "
                                              "samples per task.")] = None,
    seq_lengths: Annotated[str | None, typer.Option("--seq-lengths", help="Token lengths: oscar_ppl segments, "
                                                    "RULER/NIAH contexts. [1024]")] = None,
    data: Annotated[Path | None, typer.Option("--data", help="Text file for oscar_ppl (default: built-in held-out "
                                              "text).")] = None,
    decode: Annotated[bool | None, typer.Option("--decode/--teacher-forced", help="oscar_ppl: feed tokens one at a "
                                                "time through the cache (on CUDA through the fused INT2 kernels) "
                                                "instead of teacher-forced decode-equivalent attention.")] = None,
    server: Annotated[str | None, typer.Option("--server", help="Evaluate a running server instead (`oscar serve`, "
                                               "either engine): oscar_ppl from its prompt logprobs, lm-eval tasks "
                                               "through local-completions; rows record its artifact and scheme.")] = None,
    recipe: RecipeOpt = None,
    json_out: JsonOpt = False,
    csv: Annotated[Path | None, typer.Option("--csv", help="Also write the results to this CSV file.")] = None,
    store: StoreOpt = DEFAULT_STORE,
) -> None:
    """Evaluate KV methods; every metric goes to the store's evals table.

    Every method runs at its quant scheme: an artifact's own (bits, group, sink, recent from its manifest); data-free
    baselines take the artifact's sink/recent. --sink/--recent/--group/--bits override it for every method (recorded
    in each row), and are refused where they cannot hold.

    Example: oscar eval --tasks oscar_ppl --methods bf16,int2-naive,int2-hadamard,oscar --seq-lengths 1024 --limit 8

    With --recipe, the recipe's eval section fills the flags that are not given, and its thresholds are checked:
    each missed threshold prints one line and the command exits 1.
    """
    import dataclasses

    from ..config import EvalConfig, load_recipe

    base = EvalConfig()
    if recipe is not None:
        rec = load_recipe(recipe)
        if not rec.has_eval:
            raise OscarError(f"recipe {recipe} has no eval section; add one (tasks, methods, seq_lengths) or drop --recipe")
        base = rec.eval
    flags = {
        "model": model, "artifact": artifact, "limit": limit, "data": data, "decode": decode, "server": server,
        "tasks": _names(tasks) if tasks is not None else None,
        "methods": _names(methods) if methods is not None else None,
        "seq_lengths": _ints(seq_lengths, "--seq-lengths") if seq_lengths is not None else None,
    }
    given = {k: v for k, v in flags.items() if v is not None}
    if "tasks" in given and recipe is not None and base.thresholds:
        raise OscarError("--tasks replaces the recipe's tasks, which its thresholds are about; drop --tasks or --recipe")
    over = dict(base.overrides)
    over.update({k: v for k, v in dict(sink=sink, recent=recent, group=group, bits=bits).items() if v is not None})
    if server is not None:
        if over:
            raise OscarError("--sink/--recent/--group/--bits cannot change a running server's scheme; restart "
                             "`oscar serve` with another artifact instead")
        if methods is not None or decode is not None:
            raise OscarError("--methods/--decode do not apply to --server: the server runs its own artifact")
        given["methods"] = ("server",)
    cfg = dataclasses.replace(base, **given, scheme_overrides=tuple(sorted(over.items())))
    if recipe is not None and "methods" in given:
        missing = sorted({t.method for t in cfg.thresholds} - set(cfg.methods))
        if missing:
            raise OscarError(f"--methods drops {', '.join(missing)}, which the recipe's thresholds check; "
                             "keep them or drop --recipe")

    result = _run(cfg, store, json_out)
    _render([r.to_dict() for r in result.rows], json_out, csv)
    if result.misses:
        for miss in result.misses:
            console.print(f"[bold red]{miss.message()}[/]", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if cfg.thresholds:
        console.print(f"all {len(cfg.thresholds)} recipe thresholds met")


def _scheme_label(s: dict) -> str:
    """A row's scheme in the table: ``int2 g64 s16/r64``, an allocation ``mix2-4k7v0 g64 fp8 s16/r64``."""
    from ..config import QuantScheme

    try:
        sch = QuantScheme.from_dict(s)
    except Exception:  # noqa: BLE001  (a row stored by another version: show what it has)
        return f"int{s.get('bits')} g{s.get('group')} s{s.get('sink')}/r{s.get('recent')}"
    width = sch.describe().split(".")[0]
    extras = "".join(f" {x}" for x in (sch.scale_dtype if sch.scale_dtype != "fp16" else "",
                                        "centered" if sch.center_keys else "",
                                        sch.levels if sch.levels != "uniform" else "") if x)
    return f"{width} g{sch.group}{extras} s{sch.sink}/r{sch.recent}"


@contextlib.contextmanager
def quiet_stdout():
    """Libraries under lm-eval print to stdout; keep stdout for results (``--json`` stays parseable)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _run(cfg, store: Path, quiet: bool):
    from ..eval.run import run_eval
    from ._progress import task_progress

    with quiet_stdout(), task_progress("evaluating", quiet) as bar:
        return run_eval(cfg, store, bar)


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
            w.writerow(["method", "artifact", "task", "metric", "seq_len", "value", "delta_bf16", "bits_per_element",
                        "sink", "recent", "group", "bits"])
            for r in rows:
                s = r["config"].get("scheme")
                w.writerow([r["method"], r["artifact"] or "", r["task"], r["metric"], r["config"].get("seq_len"),
                            r["value"], "" if r["delta_bf16"] is None else r["delta_bf16"], r["bits_per_element"],
                            *((s or {}).get(k, "") for k in ("sink", "recent", "group", "bits"))])
    if json_out:
        out.print_json(json.dumps(rows))
        return
    t = Table(title="oscar eval")
    for c in ("method", "task", "metric", "len", "value", "Δ bf16", "bits/el", "scheme"):
        t.add_column(c, justify="right" if c in ("len", "value", "Δ bf16", "bits/el") else "left")
    for r in rows:
        d, s, b = r["delta_bf16"], r["config"].get("scheme"), r["bits_per_element"]
        scheme = "exact" if r["method"] == "bf16" else "?" if not s else _scheme_label(s)
        t.add_row(r["method"], r["task"], r["metric"], str(r["config"].get("seq_len")), f"{r['value']:.4g}",
                  "" if d is None or r["method"] == "bf16" else f"{d:+.4g}", "" if b is None else f"{b:.3f}", scheme)
    out.print(t)
