"""``oscar inspect``: what an artifact holds and how well it is predicted to quantize."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ._app import DEFAULTS, JsonOpt, StoreOpt, app, guarded, out


@app.command("inspect")
@guarded
def inspect(
    artifact: Annotated[str, typer.Argument(help="'latest', v<N>, <model>/v<N>, an artifact id or a folder.")] = "latest",
    store: StoreOpt = DEFAULTS["store"],
    json_out: JsonOpt = False,
    plot: Annotated[Path | None, typer.Option(help="Write spectra and per-layer distortion to this PNG.")] = None,
) -> None:
    """Per layer: spectrum concentration, clip ratios, orthogonality error, predicted INT2 distortion, and where
    the fit measured it (with a sensitivity pass): each layer's final-logit KL with its keys or values quantized
    alone, the attention-output error and probability-weighted key logit error per KV head, the allocated widths.

    Example: oscar inspect latest --plot inspect.png
    """
    import json

    from rich.table import Table

    from ..artifact import load_artifact
    from ..jobs import SUMMARY_KEYS, inspect_report, plot_report

    SHORT = ("ident", "had", "had+clip", "oscar")
    from ..store import Store

    path = Path(artifact) if Path(artifact).is_dir() else Store(store, create=False).resolve_artifact(artifact)
    report = inspect_report(load_artifact(path))
    if plot is not None:
        plot_report(report, plot)
    if json_out:
        out.print_json(json.dumps(report))
        return
    q = report["scheme"]
    out.print(f"[bold]{report['name']}[/] method={report['method']} bits={q['bits']} group={q['group']} "
              f"sink={q['sink']} recent={q['recent']} per_head={report['per_head']} run={report['run_id']}")
    out.print(f"model {report['model_slug']} {report['model_fingerprint']}  content {report['content_hash'][:16]}")
    rt = Table(title="rotations")
    for col in ("layer", "K top-1/8 energy", "V top-1/8 energy", "K eff. rank", "V eff. rank", "clip K", "clip V",
                "orth. error"):
        rt.add_column(col, justify="right")
    dt = Table(title="predicted INT2 distortion, held-out rows (relative, lower is better)")
    for col in ("layer", *(f"K {k}" for k in SHORT), *(f"V {k}" for k in SHORT)):
        dt.add_column(col, justify="right")
    for r in report["layers"]:
        sk, sv = r["spectrum_k"], r["spectrum_v"]
        rt.add_row(str(r["layer"]), f"{sk['top_eighth_energy']:.2f}", f"{sv['top_eighth_energy']:.2f}",
                   f"{sk['effective_rank']:.1f}", f"{sv['effective_rank']:.1f}",
                   "/".join(f"{c:.3f}" for c in r["clip_k"]), "/".join(f"{c:.3f}" for c in r["clip_v"]),
                   f"{r['orthogonality_error']:.1e}")
        dt.add_row(str(r["layer"]), *(f"{r['distortion_k'][k]:.3f}" for k in SUMMARY_KEYS),
                   *(f"{r['distortion_v'][k]:.3f}" for k in SUMMARY_KEYS))
    out.print(rt)
    out.print(dt)
    if report["sensitivity"] is not None:
        base = report["sensitivity"]["base"]
        st = Table(title=f"sensitivity on {report['sensitivity']['tokens']} calibration tokens, INT{base} alone in "
                         "that part (KL x1e3 per token; attention-output error and key logit error per KV head)")
        split = report["sensitivity"].get("split")
        cols = ("layer", "K KL", "V KL", *((f"K split {split} KL",) if split else ()), "K attn err", "V attn err",
                "key logit err", "bits K/V")
        for col in cols:
            st.add_column(col, justify="right")
        for r in report["layers"]:
            s = r.get("sensitivity")
            if s is None:
                continue
            bits_k = f"2+{r['split_k']}x4" if r.get("split_k") else str(r["bits_k"])
            st.add_row(str(r["layer"]), f"{1e3 * s['kl_k']:.2f}", f"{1e3 * s['kl_v']:.2f}",
                       *((f"{1e3 * s['kl_k_split']:.2f}",) if split else ()),
                       "/".join(f"{x:.3f}" for x in s[f"attn_k{base}"]), "/".join(f"{x:.3f}" for x in s[f"attn_v{base}"]),
                       "/".join(f"{x:.3f}" for x in s[f"logit_err{base}"]), f"{bits_k}/{r['bits_v']}")
        out.print(st)
    c = report["clip_scale"]
    if c is not None:
        out.print(f"clips (the table's) are the layer-local fit's scaled by the least final-logit KL on calibration "
                  f"text: keys x{c['k']:g}, values x{c['v']:g}; the distortions above are at the unscaled clips")
    a = report["allocation"]
    if a is not None:
        out.print(f"allocation: {a['bits_per_element']:.3f} bits per quantized element (budget {a['budget']:g}), "
                  f"predicted summed KL {a['predicted_kl']:.4f}")
        if a.get("split_layers"):
            out.print(f"split keys ({a['split']} most-read rotated channels 4-bit, the rest 2-bit; clips "
                      f"{a['split_clips'][0]:g}/{a['split_clips'][1]:g} by final-logit KL) in layers "
                      f"{a['split_layers']}")
    for kv, label in (("distortion_k", "keys"), ("distortion_v", "values")):
        s = report["summary"][kv]
        m = s["mean"]
        wins = ", ".join(f"{k} on {v}/{s['layers']}" for k, v in s["artifact_better_layers"].items())
        ratios = ", ".join(f"{m['artifact'] / m[k]:.2f}x {k}" for k in SUMMARY_KEYS if k != "artifact")
        out.print(f"{label}: mean distortion {m['artifact']:.4f} = {ratios}; better than {wins} layers")
    if plot is not None:
        out.print(f"plot written to {plot}")
