"""Which calibration-side criterion predicts held-out perplexity: a clip sweep scored four ways, and their rank
correlation with what a user sees.

Usage: python benchmarks/bench_criteria.py --store DIR [--run latest] [--recipe recipes/smollm2-135m.yaml]
       [--factors 0.8,0.85,0.9,0.95,1.0,1.05,1.1] [--kind k] [--segments 8] [--seq-len 1024]
       [--calibration-tokens 1024] [--commit SHA] [--results benchmarks/RESULTS.md]

It fits the recipe's artifact once (:func:`oscar_cli.jobs.run_fit`, into a temporary folder), then moves every layer's
fitted clip ratio of ``--kind`` (``k`` keys, ``v`` values) by each factor (capped at 1: no clip) and scores the
setting by

* ``layer-local``: the fit's own metric summed over layers (keys: the relative logit error ``D_K``; values: the
  score-weighted ``D_V``), on the held-out half of the calibration reservoir;
* ``attn-output``: the relative attention-output error per layer, summed, on calibration text (one pass,
  :func:`oscar_cli.sensitivity.probe`);
* ``logit-KL``: the final-logit KL per token on calibration text with every layer quantized (one pass);
* the target: perplexity on the built-in held-out text (``--segments`` segments of ``--seq-len``).

Prints the sweep and each criterion's Spearman rank correlation with the held-out perplexity, and appends both to
RESULTS.md with date, device, commit and command.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

from oscar_cli.results_md import append_section, markdown_table


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(x: list[float]) -> torch.Tensor:
        t = torch.tensor(x, dtype=torch.float64)
        order = t.argsort()
        r = torch.empty_like(t)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for v in t.unique():  # ties: average rank
            m = t == v
            r[m] = r[m].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = (ra.norm() * rb.norm()).item()
    return float((ra @ rb).item() / den) if den > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", default="latest")
    ap.add_argument("--recipe", default="recipes/smollm2-135m.yaml")
    ap.add_argument("--model", default=None)
    ap.add_argument("--factors", default="0.8,0.85,0.9,0.95,1.0,1.05,1.1")
    ap.add_argument("--kind", choices=("k", "v"), default="k")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--calibration-tokens", type=int, default=1024)
    ap.add_argument("--commit", default="")
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    args = ap.parse_args(argv)

    from oscar_cli import attention
    from oscar_cli import data as data_mod
    from oscar_cli.artifact import load_artifact
    from oscar_cli.config import AttentionShape, load_recipe
    from oscar_cli.eval.perplexity import perplexity
    from oscar_cli.eval.segments import segments_of, token_ids
    from oscar_cli.fit import key_distortion, pooled, value_distortion
    from oscar_cli.jobs import layer_data, load_run_model, run_fit
    from oscar_cli.kvquant import build_layer_quants
    from oscar_cli.methods import get_method
    from oscar_cli.prepare import Prepared, head_dim_of
    from oscar_cli.sensitivity import logit_kl, probe
    from oscar_cli.stats import KINDS, StatsAccumulator
    from oscar_cli.store import Store

    torch.set_grad_enabled(False)
    store = Store(Path(args.store), create=False)
    run = store.get_run(args.run)
    cfg = dataclasses.replace(load_recipe(Path(args.recipe)).fit, model=args.model).without_model_pass()
    loaded = load_run_model(store, run, cfg)
    model, tok = loaded.model, loaded.tokenizer
    d = head_dim_of(model.config)
    n_layers = model.config.num_hidden_layers
    art = load_artifact(run_fit(store, args.run, cfg, Path(tempfile.mkdtemp(prefix="oscar-criteria-")), "")[0])
    scheme = art.scheme
    group = scheme.group_for(d)
    oscar = get_method("oscar")
    base = build_layer_quants(oscar, scheme, n_layers, d, model.config.num_key_value_heads, art)
    held = segments_of(token_ids(tok, data_mod.heldout_text()), args.seq_len, args.segments)
    calib = data_mod.token_segments(tok, data_mod.load_documents(run.data_spec), run.seq_len,
                                    -(-args.calibration_tokens // run.seq_len))
    shape = AttentionShape(**run.shape)
    acc = StatsAccumulator(shape)
    acc.load_rows(store.load_stats(run.run_id))
    covs = {kind: acc.covariance(kind) for kind in KINDS}
    held_rows = {i: layer_data(store, run, i, covs).split()[1] for i in art.layers}
    metric = key_distortion if args.kind == "k" else value_distortion
    clip_name = f"clip_{args.kind}"

    rows, crit = [], {"layer-local": [], "attn-output": [], "logit-KL": []}
    ppl_all = []
    factors = [float(f) for f in args.factors.split(",") if f]
    for f in factors:
        quants = [None if q is None else
                  dataclasses.replace(q, **{clip_name: (getattr(q, clip_name) * f).clamp(max=1.0)}) for q in base]
        local = 0.0
        for i in art.layers:
            q = quants[i]
            r = q.r_k if args.kind == "k" else q.r_v
            c = getattr(q, clip_name).double().view(1, -1)
            local += pooled(metric(held_rows[i], r.double(), c, scheme.width(i, args.kind), group,
                                   scheme.scale_dtype), held_rows[i], args.kind).item()
        attn_err, _ = probe(model, calib, {i: {scheme.bits: quants[i]} for i in art.layers}, scheme)
        a = sum(float(v.sum()) for (i, kind, w), v in attn_err.items() if kind == args.kind)
        kl = logit_kl(model, calib, {"all": quants}, scheme)["all"]
        attention.install(model, quants, scheme)
        ppl = perplexity(model, held, Prepared(oscar, scheme, quants, art.name))
        attention.install(model, None, None)
        crit["layer-local"].append(local)
        crit["attn-output"].append(a)
        crit["logit-KL"].append(kl)
        ppl_all.append(ppl)
        rows.append([f"{f:g}", f"{local:.4f}", f"{a:.4f}", f"{1e3 * kl:.3f}", f"{ppl:.4f}"])
        print(rows[-1], flush=True)
    rho = {name: spearman(v, ppl_all) for name, v in crit.items()}
    table = markdown_table(["clip factor (" + ("keys" if args.kind == "k" else "values") + ")",
                            "layer-local (sum)", "attn-output (sum)", "logit-KL x1e3", "held-out ppl"], rows)
    corr = markdown_table(["criterion", "Spearman vs held-out ppl"], [[k, f"{v:+.3f}"] for k, v in rho.items()])
    print(table)
    print(corr)
    device = (f"CPU ({torch.get_num_threads()} threads)" if not torch.cuda.is_available()
              else torch.cuda.get_device_name())
    append_section(
        args.results, f"Clip criteria against held-out perplexity ({run.model_slug})", device,
        args.commit or "unknown",
        f"Run {run.run_id}, recipe {args.recipe} ({scheme.describe()}); every layer's fitted {args.kind} clip times "
        f"each factor (capped at 1); criteria on {calib.numel()} calibration tokens (layer-local: the reservoir's "
        f"held-out rows), target: {args.segments} held-out segments of {args.seq_len}.",
        table, command=sys.argv if argv is None else ["benchmarks/bench_criteria.py", *argv], extra="\n" + corr + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
