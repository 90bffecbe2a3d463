"""``oscar runs``: what the store holds (calibration runs and the artifacts fitted from them)."""

from __future__ import annotations

from ._app import DEFAULTS, JsonOpt, StoreOpt, app, guarded, out


@app.command("runs")
@guarded
def runs(store: StoreOpt = DEFAULTS["store"], json_out: JsonOpt = False) -> None:
    """List calibration runs (status, progress, model, data) and registered artifacts.

    Example: oscar runs --store .oscar
    """
    import dataclasses
    import json

    from rich.table import Table

    from ..store import Store

    st = Store(store, create=False)
    run_rows = [{**dataclasses.asdict(r), "status": r.live_status} for r in st.list_runs()]
    arts = st.list_artifacts()
    if json_out:
        out.print_json(json.dumps({"runs": run_rows, "artifacts": arts}, default=str))
        return
    t = Table(title=f"runs in {st.path}")
    for col in ("run", "status", "model", "tokens", "seq len", "batches", "data digest"):
        t.add_column(col, justify="right" if col in ("run", "tokens", "seq len", "batches") else "left")
    for r in run_rows:
        t.add_row(str(r["run_id"]), r["status"], r["model_slug"], f"{r['tokens_done']}/{r['tokens']}",
                  str(r["seq_len"]), f"{r['batches_done']}/{r['num_batches']}", r["data_digest"][:19])
    out.print(t)
    a = Table(title="artifacts")
    for col in ("id", "model", "version", "method", "run", "path"):
        a.add_column(col)
    for x in arts:
        a.add_row(str(x["artifact_id"]), x["model_slug"], f"v{x['version']}", x["method"], str(x["run_id"]), x["path"])
    out.print(a)
