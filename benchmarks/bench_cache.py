"""Decode time per token of a transformers model through ``OscarCache`` (kernel backend) vs ``DynamicCache`` BF16.

Usage: python benchmarks/bench_cache.py [--model smollm2-135m] [--store .oscar] [--artifact PATH] [--contexts 1024,8192]
       [--steps 64] [--random-weights] [--commit SHA] [--results benchmarks/RESULTS.md]

For each context length: a random prompt of that many tokens is prefilled once per cache, then ``--steps`` greedy
decode steps are timed one by one (``torch.cuda.synchronize`` around each ``model(...)`` call); the table shows the
median ms per token of both caches, their ratio, and the caches' bytes. OscarCache runs the artifact's scheme
(``--artifact``; without one, the data-free ``int2-hadamard`` at the default scheme) on the kernel backend
(``DecodePlan``/``ExtendPlan`` over an ``Int2KVPool``). Both caches see the same model, prompt and steps in the same
run. Appends the table to RESULTS.md with date, device, commit and command. Needs CUDA.

``--random-weights``: ``--model`` is a model folder whose ``config.json`` (and tokenizer, fingerprint file) is all
that is read; the weights are random (time per token does not depend on their values), so a machine that cannot
receive the checkpoint still measures the speed of that architecture. The table says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from oscar_cli import code_version
from oscar_cli.results_md import append_section, markdown_table


def time_decode(model, cache, prompt: torch.Tensor, steps: int, kw: str) -> tuple[float, int]:
    """Median ms per decode step after prefilling ``prompt`` into ``cache``; returns (ms, steps)."""
    ms = []
    with torch.no_grad():
        out = model(prompt, **{kw: cache}, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(nxt, **{kw: cache}, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            ms.append(1e3 * (time.perf_counter() - t))
    return statistics.median(ms[steps // 8:]), steps  # the first steps warm the launch caches


def random_model(folder: Path):
    """The model of ``folder/config.json`` with random bf16 weights on CUDA, with the folder's fingerprint."""
    import json
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM

    from oscar_cli.models import FINGERPRINT_FILE, fingerprint

    cfg = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    meta = folder / FINGERPRINT_FILE
    fp = json.loads(meta.read_text())["fingerprint"] if meta.is_file() else fingerprint(model)
    return SimpleNamespace(model=model, fingerprint=fp, slug=folder.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--store", type=Path, default=Path(".oscar"))
    ap.add_argument("--artifact", type=Path, default=None)
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--random-weights", action="store_true",
                    help="--model is a folder: its config.json with random weights (speed only)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cache needs CUDA (the kernel backend is the point of the measurement)")
    from transformers import DynamicCache

    from oscar_cli.artifact import load_artifact
    from oscar_cli.cache import OscarCache, cache_kwarg
    from oscar_cli.methods import get_method, scheme_for
    from oscar_cli.models import load_model
    from oscar_cli.prepare import head_dim_of, prepare

    loaded = random_model(Path(args.model)) if args.random_weights else load_model(
        args.model, args.store, dtype=torch.bfloat16, device="cuda")
    model, cfg = loaded.model, loaded.model.config
    art = load_artifact(args.artifact, loaded.fingerprint) if args.artifact else None
    method = get_method("oscar" if art else "int2-hadamard")
    scheme = scheme_for(method, head_dim_of(cfg), artifact_scheme=art.scheme if art else None)
    kw = cache_kwarg(model)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        prompt = torch.randint(0, cfg.vocab_size, (1, ctx), generator=gen).cuda()
        model.set_attn_implementation("sdpa")
        dyn = DynamicCache(config=cfg)
        t_dyn, _ = time_decode(model, dyn, prompt, args.steps, kw)
        dyn_mb = sum(t.numel() * t.element_size() for layer in dyn.layers for t in (layer.keys, layer.values)) / 1e6
        del dyn
        prep = prepare(model, method, scheme, art)
        cache = OscarCache(model, prep.quants, scheme, backend="kernels")
        t_osc, _ = time_decode(model, cache, prompt, args.steps, kw)
        osc_mb = cache.nbytes() / 1e6
        del cache
        torch.cuda.empty_cache()
        rows.append([ctx, f"{t_dyn:.2f}", f"{t_osc:.2f}", f"{t_osc / t_dyn:.2f}", f"{dyn_mb:.1f}", f"{osc_mb:.1f}"])
        print(rows[-1], flush=True)
    table = markdown_table(["context", "DynamicCache BF16 ms/token", "OscarCache ms/token", "ratio", "BF16 cache MB",
                            "OscarCache MB"], rows)
    print(table)
    what = f"artifact {art.name} ({scheme.describe()})" if art else f"int2-hadamard ({scheme.describe()})"
    append_section(args.results, "OscarCache decode vs DynamicCache BF16", torch.cuda.get_device_name(),
                   args.commit or code_version(),
                   f"{loaded.slug} in bf16{' (random weights of its config)' if args.random_weights else ''}, batch 1, "
                   f"random prompt of each length prefilled once, median of the last {args.steps - args.steps // 8} "
                   f"of {args.steps} greedy decode steps (synchronised wall time per `model(...)` call); OscarCache "
                   f"on the kernel backend with {what}; OscarCache MB is the pool as allocated (per-row capacity "
                   "doubles).", table)


if __name__ == "__main__":
    main()
