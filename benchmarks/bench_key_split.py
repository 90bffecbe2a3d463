"""Spectral split of the key rows at equal bits: the directions the queries read most get 4-bit codes, the rest 2.

Usage: python benchmarks/bench_key_split.py --store DIR [--run latest] [--model gemma3-270m]
       [--recipe recipes/gemma3-270m.yaml] [--data2 FILE] [--segments 8] [--seq-len 1024] [--split 64]
       [--clips-hi 0.9,1.0] [--clips-lo 0.55,0.6,0.65,0.7] [--sensitivity-tokens 1024] [--commit SHA]
       [--results benchmarks/RESULTS.md]

Why: the logit error a key row's quantization causes is ``Δkᵀ C_Q Δk``. In the basis of C_Q's eigenvectors the
signal a direction carries into the logits is ``λ_i σ_i²`` (query energy times key energy along it), and on
gemma-3-270m the top eighth of the directions carries 89-98% of it in every layer. OSCAR's rotation spreads every
direction over the whole row (U·P·H), so all of them are coded at the same 2 bits. Here each layer's key rows are
split instead: the ``--split`` directions with the largest ``λ_i σ_i²`` form one group of 4-bit codes, the others one
group of 2-bit codes, each group with its own FP8 scale/zero and its own placement + Hadamard over its directions
(the keys' shared offset, the leading direction of their uncentred second moment, stays first in the 2-bit group,
on the Hadamard's constant row, where the zero point absorbs it — :func:`oscar_cli.rotation.anchored_eigh`). The
query is rotated by the same matrix, so scores stay exact up to the codes' error.

From a complete ``oscar collect`` run it fits the recipe's uniform INT2 scheme with FP8 scales (layer-local clips,
:func:`oscar_cli.jobs.run_fit`), then for each split size chooses one (4-bit clip, 2-bit clip) pair for all layers
from the ``--clips-hi`` x ``--clips-lo`` grid by the final-logit KL on ``--sensitivity-tokens`` calibration tokens
(:func:`oscar_cli.sensitivity.logit_kl`, the criterion that ranks clip settings like held-out perplexity), and
scores BF16, the uniform fit and each split (values: the uniform fit's INT2 rows) teacher-forced through the
decode-equivalent attention on two texts the calibration never saw. Bits per element: codes plus scale/zero, K and V
averaged (the same in every layer, so at any context). The split lives in this script only (the reference
quantizer and the kernels store one width per layer and kind); prints one table and appends it to RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

from oscar_cli.results_md import append_section, markdown_table
from oscar_cli.rotation import split_rotation


@dataclasses.dataclass
class Split:
    """One layer's split keys: ``m`` 4-bit directions then ``d - m`` 2-bit ones, clip ratio per block."""

    m: int
    clip_hi: float
    clip_lo: float


@contextlib.contextmanager
def split_keys(splits: dict[int, Split]):
    """Route the decode-equivalent attention's key round trips of the rotations in ``splits`` (keyed by the id of
    the layer's ``r_k`` tensor) through the split quantizer; everything else as before."""
    from oscar_cli import attention, quantizer

    plain = attention.roundtrip

    def roundtrip(x, lq, which):
        s = splits.get(id(lq.r_k)) if which == "k" else None
        if s is None:
            return plain(x, lq, which)
        y = x.float() @ lq.r_k
        parts = []
        for sl, bits, clip in ((slice(0, s.m), 4, s.clip_hi), (slice(s.m, None), 2, s.clip_lo)):
            p = y[..., sl]
            parts.append(quantizer.dequantize(quantizer.quantize(p, clip, bits, p.shape[-1], "fp8")))
        return torch.cat(parts, -1) @ lq.r_k.transpose(-1, -2)

    attention.roundtrip = roundtrip
    try:
        yield
    finally:
        attention.roundtrip = plain


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", default="latest")
    ap.add_argument("--model", default=None)
    ap.add_argument("--recipe", default="recipes/gemma3-270m.yaml")
    ap.add_argument("--data2", default=None, help="a second held-out text file (outside the repository)")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--split", default="64", help="4-bit directions per key row, comma-separated sizes")
    ap.add_argument("--clips-hi", default="0.9,1.0")
    ap.add_argument("--clips-lo", default="0.55,0.6,0.65,0.7")
    ap.add_argument("--sensitivity-tokens", type=int, default=1024)
    ap.add_argument("--least", action="store_true",
                    help="the control instead: the directions of the least energy in the 4-bit block")
    ap.add_argument("--commit", default="")
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    args = ap.parse_args(argv)

    from oscar_cli import attention
    from oscar_cli import data as data_mod
    from oscar_cli.artifact import load_artifact
    from oscar_cli.config import load_recipe
    from oscar_cli.eval.perplexity import perplexity
    from oscar_cli.eval.segments import segments_of, token_ids
    from oscar_cli.jobs import load_run_model, run_fit
    from oscar_cli.kvquant import build_layer_quants
    from oscar_cli.methods import get_method, scheme_for
    from oscar_cli.prepare import Prepared, head_dim_of, prepare
    from oscar_cli.quantizer import bits_per_element
    from oscar_cli.sensitivity import logit_kl
    from oscar_cli.store import Store

    torch.set_grad_enabled(False)
    store = Store(Path(args.store), create=False)
    run = store.get_run(args.run)
    rec = load_recipe(Path(args.recipe))
    base = dataclasses.replace(rec.fit, model=args.model)
    cfg = dataclasses.replace(base.without_model_pass(),
                              scheme=dataclasses.replace(base.scheme, scale_dtype="fp8"))
    loaded = load_run_model(store, run, base)
    model, tok = loaded.model, loaded.tokenizer
    d = head_dim_of(model.config)
    n_layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    texts = {"held-out (built-in)": data_mod.heldout_text()}
    if args.data2:
        texts[f"held-out ({Path(args.data2).name})"] = data_mod.read_text_file(args.data2)
    segs = {name: segments_of(token_ids(tok, t), args.seq_len, args.segments) for name, t in texts.items()}
    n_cal = -(-args.sensitivity_tokens // run.seq_len)
    cal = data_mod.token_segments(tok, data_mod.load_documents(run.data_spec), run.seq_len, n_cal)

    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="oscar-bench-key-split-"))
    art = load_artifact(run_fit(store, args.run, cfg, tmp, "")[0])
    oscar = get_method("oscar")
    uniform = build_layer_quants(oscar, art.scheme, n_layers, d, kv, art)
    group = art.scheme.group_for(d)
    v_bits = bits_per_element(2, group, 16)
    stats = store.load_stats(run.run_id)

    def cov(layer: int, head: int, kind: str) -> torch.Tensor:
        return torch.as_tensor(stats[(layer, head, kind)][2], dtype=torch.float64)

    rows = []

    def add(label: str, bits: float, clips: str, quants) -> None:
        attention.install(model, quants, art.scheme)
        prep = Prepared(oscar, art.scheme, quants, art.name)
        ppl = {name: perplexity(model, seg, prep) for name, seg in segs.items()}
        rows.append([label, f"{bits:.3f}", clips, *(f"{ppl[n]:.3f} (x{ppl[n] / ref[n]:.3f})" for n in segs)])
        print(rows[-1], flush=True)

    mb = get_method("bf16")
    prep = prepare(model, mb, scheme_for(mb, d))
    ref = {name: perplexity(model, seg, prep) for name, seg in segs.items()}
    rows.append(["bf16", "16", "", *(f"{ref[n]:.3f} (x1.000)" for n in segs)])
    add("OSCAR uniform INT2 (K and V), fp8 scales, each layer's own clips", v_bits, "fitted", uniform)
    his = [float(c) for c in args.clips_hi.split(",")]
    los = [float(c) for c in args.clips_lo.split(",")]
    kl_table = []
    for m, least in ((int(s), args.least) for s in args.split.split(",") if s):
        rots = {i: torch.stack([split_rotation(cov(i, h, "q"), cov(i, h, "k"), m, least)
                                for h in range(kv)]).float()
                for i, q in enumerate(uniform) if q is not None}
        quants = [None if q is None else dataclasses.replace(q, r_k=rots[i], center_k=None, levels_k=None)
                  for i, q in enumerate(uniform)]
        # one rotation tensor per clip pair, so one KL pass (one exact reference) scores every pair
        configs, splits = {}, {}
        for pair in ((hi, lo) for hi in his for lo in los):
            configs[pair] = [None if q is None else dataclasses.replace(q, r_k=q.r_k.clone()) for q in quants]
            splits.update({id(q.r_k): Split(m, *pair) for q in configs[pair] if q is not None})
        with split_keys(splits):
            kl = logit_kl(model, cal, configs, art.scheme)
        best = min(kl, key=kl.get)
        kl_table.append([f"{m}{' (least energy)' if least else ''}", *(f"{hi}/{lo}: {kl[(hi, lo)]:.4f}" for hi, lo in kl)])
        quants = configs[best]
        k_bits = (m * 4 + (d - m) * 2 + 2 * 16) / d
        with split_keys(splits):
            which = "least" if least else "most"
            add(f"OSCAR keys split: the {m} {which}-read directions 4-bit + {d - m} 2-bit (fp8 scales each), values "
                "uniform INT2",
                (k_bits + v_bits) / 2, f"{best[0]} / {best[1]} (calibration KL)", quants)
    elapsed = time.time() - t0
    head = ["method", "bits per element (K and V)", "key clips (4-bit / 2-bit)", *(f"ppl {n}" for n in segs)]
    table = markdown_table(head, rows)
    kl_head = ["split", *(f"KL {hi}/{lo}" for hi in his for lo in los)]
    kl_md = markdown_table(kl_head, [[r[0], *(c.split(": ")[1] for c in r[1:])] for r in kl_table])
    print(table)
    print(kl_md)
    append_section(
        args.results, f"Key rows split by query energy ({run.model_slug})",
        f"CPU ({'fp32, ' if next(model.parameters()).dtype == torch.float32 else ''}{torch.get_num_threads()} threads)",
        args.commit or "unknown",
        f"Run {run.run_id} ({run.tokens} calibration tokens), recipe {args.recipe}; {args.segments} segments of "
        f"{args.seq_len} tokens per text, teacher-forced through the decode-equivalent attention; sink "
        f"{art.scheme.sink}, recent {art.scheme.recent}; clip pairs chosen by final-logit KL per token on "
        f"{n_cal * run.seq_len} calibration tokens (second table); {elapsed:.0f} s in all.",
        table, extra="\n" + kl_md,
        command=sys.argv if argv is None else ["benchmarks/bench_key_split.py", *argv])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
