"""Where the INT2 error lives and what budgeted mixed precision buys: perplexity of one collected run's fits on two
texts the calibration never saw, at equal bits.

Usage: python benchmarks/bench_accuracy.py --store DIR [--run latest] [--model smollm2-135m] [--data2 FILE]
       [--segments 16] [--seq-len 1024] [--budgets 2.5,2.75,3.0,3.5] [--sensitivity-tokens 1024] [--group G]
       [--layers SPEC] [--key-layouts] [--peers hf-hqq[,...]] [--peers-only] [--plot FILE.png]
       [--recipe recipes/smollm2-135m.yaml] [--commit SHA] [--results benchmarks/RESULTS.md]

From a complete ``oscar collect`` run it fits, with the recipe's fit settings (:func:`oscar_cli.jobs.run_fit` into a
temporary artifact folder): uniform INT2 with fp16 scales (the scheme before allocations), the same with centered keys
and with fitted levels (the ablations) and with clips scaled by the final-logit KL, uniform INT2 with fp8 scales, and
the budgeted allocation with fp8 scales and the recipe's clip criterion at every ``--budgets`` value (one sensitivity
pass, reused; registered in the store as any fit is). It scores each, and BF16, INT2-Hadamard (uniform and Gaussian levels), KIVI-2
and INT4-Hadamard (data-free baselines), teacher-forced through the decode-equivalent attention on ``--segments``
segments of the built-in held-out text and of ``--data2`` (a text outside the repository), and the fp16-scale fit with
only its keys or only its values quantized (where the gap lives). Bits per element are the quantized part's (codes and
scale/zero, K and V averaged over the rows each layer holds: at the evaluated length and at 32k, where a sliding-
window layer holds only its window; sinks and recent rows are BF16 in every row alike). Prints one table and appends
it to RESULTS.md with date, device, commit and command.

``--peers`` adds transformers' ``QuantizedCache`` peers (``hf-hqq``: the HQQ backend at 2 bits, group 64, its own
default axes, a BF16 residual of the recipe's recent window and no sink; needs ``pip install hqq``), scored token by
token through the cache (they have no teacher-forced path: ~20 tokens/s on two cores); ``--peers-only`` scores BF16
and the peers alone (no fits).

``--key-layouts`` instead compares key layouts at equal bits, keys alone quantized (values exact): OSCAR's per-token
key groups after rotation (one group per head row, fp16 scale/zero), per-token groups of half a row with fp8
scale/zero (its own fit), and per-channel key groups over blocks of as many tokens as the head has dims after the
same rotation (KIVI's layout; the BF16 recent window stages a block until it is whole; no clip, as KIVI) —
``2 + 32/d`` bits per key element each.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

from oscar_cli.results_md import append_section, markdown_table

LONG = 32768
"""The long context at which bits per element are also reported (and the allocation's budget holds, ``oscar fit``'s
default ``--context``): a sliding-window layer holds at most its window."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", default="latest")
    ap.add_argument("--model", default=None, help="the run's model (default: the store's copy or the embedded one)")
    ap.add_argument("--recipe", default="recipes/smollm2-135m.yaml")
    ap.add_argument("--data2", default=None, help="a second held-out text file (outside the repository)")
    ap.add_argument("--segments", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--budgets", default="2.5,2.75,3.0,3.5")
    ap.add_argument("--sensitivity-tokens", type=int, default=1024)
    ap.add_argument("--group", type=int, default=None, help="override the recipe's scheme group (0: the head dim)")
    ap.add_argument("--layers", default=None, help="override the recipe's fitted layers (others stay BF16)")
    ap.add_argument("--key-layouts", action="store_true",
                    help="compare key layouts at equal bits (per-token rows, per-channel blocks, half-row groups)")
    ap.add_argument("--peers", default="", help="transformers QuantizedCache peers to score too, e.g. hf-hqq")
    ap.add_argument("--peers-only", action="store_true", help="score BF16 and --peers only (no fits)")
    ap.add_argument("--plot", default=None, help="also draw perplexity against bits per element (PNG)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    args = ap.parse_args(argv)

    from oscar_cli import attention
    from oscar_cli.artifact import load_artifact
    from oscar_cli.config import load_recipe
    from oscar_cli.data import heldout_text, read_text_file
    from oscar_cli.eval.perplexity import perplexity
    from oscar_cli.eval.segments import segments_of, token_ids
    from oscar_cli.jobs import load_run_model, run_fit
    from oscar_cli.kvquant import EXACT, build_layer_quants
    from oscar_cli.methods import get_method, hf_backend, scheme_for
    from oscar_cli.models import layer_tokens
    from oscar_cli.prepare import Prepared, head_dim_of, prepare
    from oscar_cli.sensitivity import Sensitivity
    from oscar_cli.store import Store

    torch.set_grad_enabled(False)
    store = Store(Path(args.store), create=False)
    run = store.get_run(args.run)
    rec = load_recipe(Path(args.recipe))
    budgets = [float(b) for b in args.budgets.split(",") if b]
    base_cfg = dataclasses.replace(rec.fit, model=args.model)
    if args.layers is not None:
        base_cfg = dataclasses.replace(base_cfg, layers=args.layers)
    if args.group is not None:
        base_cfg = dataclasses.replace(base_cfg, scheme=dataclasses.replace(base_cfg.scheme, group=args.group))
    loaded = load_run_model(store, run, base_cfg)
    model, tok = loaded.model, loaded.tokenizer
    d = head_dim_of(model.config)
    texts = {"held-out (built-in)": heldout_text()}
    if args.data2:
        texts[f"held-out ({Path(args.data2).name})"] = read_text_file(args.data2)
    segs = {name: segments_of(token_ids(tok, t), args.seq_len, args.segments) for name, t in texts.items()}

    tmp = Path(tempfile.mkdtemp(prefix="oscar-bench-accuracy-"))
    if args.key_layouts:
        return key_layouts(args, argv, store, run, base_cfg, model, d, segs, tmp)
    peers = [get_method(name) for name in args.peers.split(",") if name]
    if any(not m.cache_only for m in peers):
        raise SystemExit(f"--peers takes transformers QuantizedCache methods (hf-hqq, hf-quanto), not {args.peers}")
    for m in peers:
        hf_backend(m)  # a missing backend package fails now, before the fits
    if args.peers_only:
        return peers_only(args, argv, run, model, d, segs, base_cfg, peers)
    fits: dict[str, Path] = {}
    t0 = time.time()
    fp16 = dataclasses.replace(base_cfg.without_model_pass(),
                               scheme=dataclasses.replace(base_cfg.scheme, scale_dtype="fp16"))
    fits["oscar, INT2, fp16 scales"] = run_fit(store, args.run, fp16, tmp, "")[0]
    for label, change in (("centered keys", dict(center_keys=True)), ("fitted levels", dict(levels="fitted"))):
        cfg = dataclasses.replace(fp16, scheme=dataclasses.replace(fp16.scheme, **change))
        fits[f"oscar, INT2, fp16 scales, {label}"] = run_fit(store, args.run, cfg, tmp, "")[0]
    kl_clips = dict(clip_criterion="logit-kl", sensitivity_tokens=args.sensitivity_tokens)
    fits["oscar, INT2, fp16 scales, clips by logit-KL"] = run_fit(
        store, args.run, dataclasses.replace(fp16, **kl_clips), tmp, "")[0]
    fp8_scheme = dataclasses.replace(base_cfg.scheme, scale_dtype="fp8")
    fp8 = dataclasses.replace(fp16, scheme=fp8_scheme)
    fits["oscar, INT2, fp8 scales"] = run_fit(store, args.run, fp8, tmp, "")[0]
    measured = None  # one sensitivity pass, reused by every budget
    # the allocated fits use the recipe's clip criterion (the recipe is what `oscar fit` runs)
    alloc_clips = dict(clip_criterion=base_cfg.clip_criterion, sensitivity_tokens=args.sensitivity_tokens)
    clips_label = "clips by logit-KL" if base_cfg.clip_criterion == "logit-kl" else "each layer's own clips"
    uniform_bits = fp8_scheme.resolved(d).bits_per_element(d)
    for b in budgets:
        # the recipe's split keys are a choice of the allocation (offered where the budget buys anything)
        split = base_cfg.key_split if b > uniform_bits + 1e-9 else 0
        cfg = dataclasses.replace(fp8, bits_per_element=b, key_split=split, **alloc_clips)
        path, manifest = run_fit(store, args.run, cfg, tmp, "", measured=measured)
        fits[f"oscar, allocated @{b:g}{f' (split keys {split})' if split else ''}, fp8 scales, {clips_label}"] = path
        if "allocation" in manifest.metrics:  # a budget at the uniform scheme's bits allocates nothing
            measured = (Sensitivity.from_dict(manifest.metrics["sensitivity"]),
                        manifest.metrics["allocation"]["layer_tokens"], manifest.metrics.get("clip_scale"))
    fit_s = time.time() - t0

    def score(prep) -> dict[str, float]:
        return {name: perplexity(model, s, prep) for name, s in segs.items()}

    rows, ref = [], None

    at_eval, at_long = layer_tokens(model.config, args.seq_len), layer_tokens(model.config, LONG)

    def add(label: str, scheme, layers, ppl: dict[str, float]) -> None:
        nonlocal ref
        ref = ref or ppl
        cells = [f"{ppl[n]:.3f} (x{ppl[n] / ref[n]:.3f})" for n in segs]
        bits = (["16", "16"] if scheme is None
                else [f"{scheme.bits_per_element(d, layers, t):.3f}" for t in (at_eval, at_long)])
        rows.append([label, *bits, *cells])
        print(rows[-1], flush=True)

    m = get_method("bf16")
    add("bf16", None, None, score(prepare(model, m, scheme_for(m, d))))
    art0 = load_artifact(fits["oscar, INT2, fp16 scales"])
    sink_recent = {"sink": art0.scheme.sink, "recent": art0.scheme.recent}
    for name in ("int2-hadamard", "int2-hadamard-gauss", "int2-kivi", "int4-hadamard"):
        m = get_method(name)
        s = scheme_for(m, d, overrides=sink_recent)
        add(f"{name} (its own sink/recent)" if m.own_sink_recent else name, s, None, score(prepare(model, m, s)))
    for m in peers:
        s = scheme_for(m, d, overrides=sink_recent)
        rows.append(peer_row(m, s, score(prepare(model, m, s)), ref, list(segs)))
        print(rows[-1], flush=True)
    oscar = get_method("oscar")
    for label, path in fits.items():
        art = load_artifact(path)
        add(label, art.scheme, art.layers, score(prepare(model, oscar, art.scheme, art)))
    # where the gap lives: the fp16 fit with only one kind quantized
    quants = build_layer_quants(oscar, art0.scheme, model.config.num_hidden_layers, d,
                                model.config.num_key_value_heads, art0)
    for label, kw in (("oscar fp16, keys only (values exact)", dict(bits_v=EXACT)),
                      ("oscar fp16, values only (keys exact)", dict(bits_k=EXACT))):
        qs = [None if q is None else dataclasses.replace(q, **kw) for q in quants]
        attention.install(model, qs, art0.scheme)
        add(label, art0.scheme, art0.layers, score(Prepared(oscar, art0.scheme, qs, art0.name)))

    headers = ["method", f"bits/element at {args.seq_len}", f"at {LONG}", *(f"ppl {n}" for n in segs)]
    table = markdown_table(headers, rows)
    print(table)
    if args.plot:
        plot_curve(rows, list(segs), args.plot, run.model_slug)
    alloc = {label: load_artifact(p).scheme for label, p in fits.items() if "allocated" in label}
    extra = "\n".join(f"- {label}: 4-bit keys in layers "
                      f"{[i for i, w in enumerate(s.bits_k) if w == 4]}, 4-bit values in "
                      f"{[i for i, w in enumerate(s.bits_v) if w == 4]}"
                      + (f", split keys in {[i for i, m in enumerate(s.split_k) if m]}" if s.split else "")
                      for label, s in alloc.items())
    append_section(
        args.results, f"Accuracy at equal bits ({run.model_slug})", cpu_device(model), args.commit or "unknown",
        f"Run {run.run_id} ({run.tokens} calibration tokens), recipe {args.recipe}; {args.segments} segments of "
        f"{args.seq_len} tokens per text, group {art0.scheme.group}, layers {base_cfg.layers}, teacher-forced "
        f"through the decode-equivalent attention; sink "
        f"{art0.scheme.sink}, recent {art0.scheme.recent}; fits and the sensitivity pass "
        f"({args.sensitivity_tokens} calibration tokens) took {fit_s:.0f} s.",
        table, command=sys.argv if argv is None else ["benchmarks/bench_accuracy.py", *argv], extra=extra + "\n")
    return 0


def cpu_device(model) -> str:
    """The device column of the tables: the CPU, the model's dtype if fp32, and torch's thread count."""
    fp32 = "fp32, " if next(model.parameters()).dtype == torch.float32 else ""
    return f"CPU ({fp32}{torch.get_num_threads()} threads)"


def peer_row(m, scheme, ppl: dict[str, float], ref: dict[str, float], texts: list[str]) -> list[str]:
    """A table row for a QuantizedCache peer: its label (backend, group, residual), the bits of its quantized rows
    (2-bit codes with a scale and zero in the model dtype per 64 elements, as it stores them on a GPU) and the
    perplexity cells."""
    bits = f"{m.bits + 2 * 16 / 64:.3f}"
    label = (f"{m.name} (transformers QuantizedCache, {m.backend} backend: {m.bits}-bit, group 64, default axes, "
             f"BF16 residual up to {scheme.recent}, no sink; decoded token by token)")
    return [label, bits, bits, *(f"{ppl[n]:.3f} (x{ppl[n] / ref[n]:.3f})" for n in texts)]


def peers_only(args, argv, run, model, d: int, segs: dict, base_cfg, peers) -> int:
    """``--peers-only``: BF16 (teacher-forced) and each peer (through its cache), one table appended."""
    from oscar_cli.eval.perplexity import perplexity
    from oscar_cli.methods import get_method, scheme_for
    from oscar_cli.prepare import prepare

    bf16 = get_method("bf16")
    t0 = time.time()
    ref = {n: perplexity(model, s, prepare(model, bf16, scheme_for(bf16, d))) for n, s in segs.items()}
    rows = [["bf16", "16", "16", *(f"{ref[n]:.3f} (x1.000)" for n in segs)]]
    print(rows[-1], flush=True)
    recent = {"sink": base_cfg.scheme.sink, "recent": base_cfg.scheme.recent}
    for m in peers:
        s = scheme_for(m, d, overrides=recent)
        rows.append(peer_row(m, s, {n: perplexity(model, seg, prepare(model, m, s)) for n, seg in segs.items()},
                             ref, list(segs)))
        print(rows[-1], flush=True)
    headers = ["method", f"bits/element at {args.seq_len}", f"at {LONG}", *(f"ppl {n}" for n in segs)]
    table = markdown_table(headers, rows)
    print(table)
    append_section(
        args.results, f"Accuracy at equal bits, QuantizedCache peers ({run.model_slug})", cpu_device(model),
        args.commit or "unknown",
        f"{args.segments} segments of {args.seq_len} tokens per text (the same segments as the \"Accuracy at equal "
        f"bits\" tables); BF16 teacher-forced, each peer decoded token by token through its cache; "
        f"{time.time() - t0:.0f} s.",
        table, command=sys.argv if argv is None else ["benchmarks/bench_accuracy.py", *argv])
    return 0


TOP_RATIO = 1.4
"""The plot's perplexity ratio axis ends here; a method above it is drawn on the edge, its ratio in the legend."""


def plot_curve(rows: list[list[str]], texts: list[str], path: str, model: str) -> None:
    """Perplexity x BF16 against bits per element (at 32k tokens): the allocated fits as a curve per text, every
    other method as a point (the table's rows; those above :data:`TOP_RATIO` on the edge, named in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def ratio(cell: str) -> float:
        return float(cell.split("(x")[1].rstrip(")"))

    fig, axes = plt.subplots(1, len(texts), figsize=(6 * len(texts), 4.5), squeeze=False)
    for ax, (i, text) in zip(axes[0], enumerate(texts), strict=True):
        curve = sorted((float(r[2]), ratio(r[3 + i])) for r in rows if "allocated" in r[0])
        if curve:
            ax.plot(*zip(*curve, strict=True), "o-", color="C0", label="oscar, allocated (fp8 scales)")
        top = TOP_RATIO
        for k, r in enumerate(r for r in rows if "allocated" not in r[0] and r[0] != "bf16" and "only" not in r[0]):
            y = ratio(r[3 + i])
            label = r[0] if y <= top else f"{r[0]} (x{y:.2f}, off the scale)"
            ax.plot(float(r[2]), min(y, top), "s^vD<>p*hX"[k % 10], color=f"C{k % 9 + 1}", label=label)
        ax.set_ylim(top=top + 0.02)
        ax.set_xlabel("bits per quantized element (scale/zero included, at 32k tokens)")
        ax.set_ylabel("perplexity / BF16")
        ax.set_title(f"{model}: {text}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def key_layouts(args, argv, store, run, base_cfg, model, d: int, segs: dict, tmp: Path) -> int:
    """``--key-layouts``: one table of perplexity for the key layouts at ``2 + 32/d`` bits per key element."""
    from oscar_cli import attention
    from oscar_cli.artifact import load_artifact
    from oscar_cli.eval.perplexity import perplexity
    from oscar_cli.jobs import run_fit
    from oscar_cli.kvquant import EXACT, build_layer_quants
    from oscar_cli.methods import get_method, scheme_for
    from oscar_cli.prepare import Prepared, prepare

    t0 = time.time()
    row = dataclasses.replace(base_cfg.without_model_pass(),
                              scheme=dataclasses.replace(base_cfg.scheme, scale_dtype="fp16", group=0))
    half = dataclasses.replace(row, scheme=dataclasses.replace(row.scheme, scale_dtype="fp8", group=d // 2))
    arts = {name: load_artifact(run_fit(store, args.run, cfg, tmp, "")[0]) for name, cfg in
            (("row", row), ("half", half))}
    fit_s = time.time() - t0
    oscar = get_method("oscar")
    n_layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    rows, ref = [], None

    def add(label: str, key_bits: str, prep) -> None:
        nonlocal ref
        ppl = {name: perplexity(model, seg, prep) for name, seg in segs.items()}
        ref = ref or ppl
        rows.append([label, key_bits, *(f"{ppl[n]:.3f} (x{ppl[n] / ref[n]:.3f})" for n in segs)])
        print(rows[-1], flush=True)

    m = get_method("bf16")
    add("bf16", "16", prepare(model, m, scheme_for(m, d)))
    bits = f"{2 + 32 / d:.3f}"

    def keys_only(art, **change):
        """The artifact's quantizers with values exact (the key layout alone) and ``change`` applied."""
        qs = build_layer_quants(oscar, art.scheme, n_layers, d, kv, art)
        return [None if q is None else dataclasses.replace(q, bits_v=EXACT, **change) for q in qs]

    variants = [("per token, one group per row, fp16 scales", arts["row"], {}),
                (f"per token, groups of {d // 2}, fp8 scales (its own fit)", arts["half"], {}),
                (f"per channel over {d}-token blocks (KIVI's layout), fp16 scales, no clip", arts["row"],
                 dict(key_axis="channel", key_group=d))]
    for label, art, change in variants:
        qs = keys_only(art, **change)
        if change:
            qs = [None if q is None else dataclasses.replace(q, clip_k=torch.ones_like(q.clip_k)) for q in qs]
        attention.install(model, qs, art.scheme)
        add(f"OSCAR keys {label}", bits, Prepared(oscar, art.scheme, qs, art.name))
    head = ["key layout", "bits per key element", *(f"ppl {n}" for n in segs)]
    table = markdown_table(head, rows)
    print(table)
    append_section(
        args.results, f"Key layout at equal bits ({run.model_slug})", cpu_device(model), args.commit or "unknown",
        f"Run {run.run_id} ({run.tokens} calibration tokens), recipe {args.recipe}; {args.segments} segments of "
        f"{args.seq_len} tokens per text, teacher-forced through the decode-equivalent attention; sink "
        f"{art.scheme.sink}, recent {art.scheme.recent}; keys only (values exact in every row); fits took "
        f"{fit_s:.0f} s.", table,
        command=sys.argv if argv is None else ["benchmarks/bench_accuracy.py", *argv])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
