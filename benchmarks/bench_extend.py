"""Chunked prefill on Qwen3-8B shapes: one layer's extend step (``ExtendPlan``) vs torch SDPA BF16 at the same prefix.

Usage: python benchmarks/bench_extend.py [--chunk 8192] [--prefixes 0,16384,49152,90112] [--sweep] [--sweep-fused]
       [--commit SHA] [--results benchmarks/RESULTS.md]

A prefill of ``L`` tokens runs as chunks of ``--chunk`` tokens (SGLang's chunked prefill); chunk ``i`` attends to
the ``i * chunk`` cached positions before it and causally to itself. For each prefix length this times, for one
layer (32 query / 8 KV heads, d 128, the default scheme int2.g128.s64.r256), one chunk through:

* ``ExtendPlan.run``: the chunk's K/V written (INT2 codes and rotated rows, ``quantize_pack_kv``), the extend
  attention over the cached INT2 prefix, the exact sink/ring rows and the chunk itself (Design P), the chunk's
  exact rows stored -- through the plan's default path, the dequantised prefix;
* the attention alone, both ways: ``extend_int2`` (fused: each INT2 tile dequantised in registers once per block of
  queries) and ``extend_int2_dequant`` (the INT2 rows dequantised once into the plan's scratch, two KV heads per
  pass by default, then a flash-attention loop over plain tiles), and the latter with all eight heads in one pass;
* torch SDPA BF16 (cuDNN and flash backends) over the same ``prefix + chunk`` keys with a lower-right causal mask,
  the attention of an uncompressed cache.

Then, per configuration, the attention time of a whole 100k-token prefill per layer (the sum over its chunks of a
straight-line fit in the prefix length) and over 36 layers. ``--sweep`` first times ``extend_int2_dequant`` at the
longest prefix over tile sizes, warps and stages, ``--sweep-fused`` the fused kernel. Random data (codes, scales,
rows): speed does not depend on values. CUDA-event timing, median of ``triton.testing.do_bench``. Appends the table
to RESULTS.md with date, device, commit and command. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
from bench_decode import fill_random  # a sibling script: benchmarks/ is sys.path[0]
from oscar_kernels import ExtendPlan, Int2KVPool, extend_int2
from oscar_kernels.extend import dequant_scratch, extend_int2_dequant
from oscar_kernels.scheme import QuantScheme

from oscar_cli import code_version
from oscar_cli.results_md import append_section, markdown_table

HQ, HKV, D, LAYERS = 32, 8, 128, 36
DEV = "cuda"
PREFILL = 100_000
SWEEP = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
         for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
SWEEP_DEQ = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
             for bm in (64, 128, 256) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)
             if not (bm == 256 and w == 4) and not (bm == 256 and bn == 128)]


def setup(prefix: int, chunk: int, gen: torch.Generator):
    """A one-layer pool holding ``prefix`` random cached positions of request 0 and a planned extend of ``chunk``."""
    scheme = QuantScheme(group=D)
    ctx = prefix + chunk
    rot = torch.linalg.qr(torch.randn(1, HKV, D, D, device=DEV, generator=gen))[0].contiguous()
    pool = Int2KVPool(scheme, 1, HKV, D, ctx, 1, rot, rot.clone(), device=DEV)
    fill_random(pool.layer(0), gen)
    req_to_token = torch.arange(ctx, dtype=torch.int32, device=DEV)[None]
    plan = ExtendPlan(pool, 1, chunk, ctx)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    loc = torch.arange(prefix, ctx, dtype=torch.int32, device=DEV)
    plan.plan(req_to_token, 0 * one, prefix * one, chunk * one, loc, max_extend_len=chunk)
    q = torch.randn(chunk, HQ, D, device=DEV, generator=gen).to(torch.bfloat16)
    k = torch.randn(chunk, HKV, D, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(chunk, HKV, D, device=DEV, generator=gen).to(torch.bfloat16)
    return pool, plan, q, k, v


def sdpa_fn(prefix: int, chunk: int, backend, gen: torch.Generator):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q = torch.randn(1, HQ, chunk, D, device=DEV, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, HKV, prefix + chunk, D, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn_like(k)
    mask = causal_lower_right(chunk, prefix + chunk)

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return fn


def time_extend(prefix: int, chunk: int, gen: torch.Generator) -> dict[str, float | None]:
    """ms of one chunk after ``prefix`` cached positions: the plan's run, and each attention path alone."""
    pool, plan, q, k, v = setup(prefix, chunk, gen)
    assert plan.dequantised  # one sequence: its INT2 list fits the plan's scratch
    b = plan._buffers
    sk, sv = b["scratch_k"][:chunk], b["scratch_v"][:chunk]
    n_int2 = plan.int2_tokens
    cache, index = pool.layer(0), plan.index
    out = {"ExtendPlan.run": ms(lambda: plan.run(0, q, k, v)),
           "fused extend_int2": ms(lambda: extend_int2(q, sk, sv, cache, index, new_kv_rotated=True)),
           "dequantised, 2 heads/pass": ms(lambda: extend_int2_dequant(q, sk, sv, cache, index, (b["deq_k"], b["deq_v"]),
                                                                       n_int2, new_kv_rotated=True))}
    if n_int2:
        all_heads = dequant_scratch(HKV, D, n_int2, DEV, heads=HKV)
        out["dequantised, 8 heads/pass"] = ms(lambda: extend_int2_dequant(q, sk, sv, cache, index, all_heads, n_int2,
                                                                          new_kv_rotated=True))
        del all_heads
    else:
        out["dequantised, 8 heads/pass"] = out["dequantised, 2 heads/pass"]
    return out


def sweep(prefix: int, chunk: int, gen: torch.Generator, fused: bool) -> list[str]:
    """One attention path of one chunk after ``prefix`` positions over its launch parameters, as table lines."""
    pool, plan, q, _, _ = setup(prefix, chunk, gen)
    b = plan._buffers
    sk, sv = b["scratch_k"][:chunk], b["scratch_v"][:chunk]
    rows = []
    for kw in SWEEP if fused else SWEEP_DEQ:
        if fused:
            fn = lambda kw=kw: extend_int2(q, sk, sv, pool.layer(0), plan.index, new_kv_rotated=True, **kw)  # noqa: E731
        else:
            fn = lambda kw=kw: extend_int2_dequant(q, sk, sv, pool.layer(0), plan.index,  # noqa: E731
                                                   (b["deq_k"], b["deq_v"]), plan.int2_tokens, new_kv_rotated=True,
                                                   **kw)
        t = ms(fn)
        rows.append([kw["block_m"], kw["block_n"], kw["num_warps"], kw["num_stages"], "—" if t is None else f"{t:.3f}"])
        print(rows[-1], flush=True)
    name = "extend_int2 ms" if fused else "extend_int2_dequant ms"
    return markdown_table(["block_m", "block_n", "warps", "stages", name], rows).splitlines()


def ms(fn) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")
    except (RuntimeError, triton.runtime.errors.OutOfResources) as e:
        print(f"  not timed: {str(e).splitlines()[0][:160]}", file=sys.stderr)
        return None


def prefill_total(points: dict[int, float], chunk: int, length: int = PREFILL) -> float | None:
    """Sum over the chunks of a ``length``-token prefill of a least-squares line through (prefix, ms)."""
    pts = [(p, t) for p, t in points.items() if t is not None]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(p for p, _ in pts) / n, sum(t for _, t in pts) / n
    b = sum((p - mx) * (t - my) for p, t in pts) / max(sum((p - mx) ** 2 for p, _ in pts), 1e-9)
    a = my - b * mx
    total, pos = 0.0, 0
    while pos < length:
        c = min(chunk, length - pos)
        total += (a + b * pos) * c / chunk
        pos += c
    return total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--prefixes", default="0,16384,49152,90112")
    ap.add_argument("--sweep", action="store_true", help="sweep the dequantised path's launch parameters first")
    ap.add_argument("--sweep-fused", action="store_true", help="sweep the fused kernel's launch parameters first")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_extend needs CUDA")
    from torch.nn.attention import SDPBackend

    prefixes = [int(p) for p in args.prefixes.split(",")]
    gen = torch.Generator(device=DEV).manual_seed(0)
    sweeps = []
    for flag, fused, what in ((args.sweep, False, "`extend_int2_dequant`"), (args.sweep_fused, True, "`extend_int2`")):
        if flag:
            sweeps.append(f"{what} at the longest prefix over launch parameters:\n\n"
                          + "\n".join(sweep(max(prefixes), args.chunk, gen, fused)))
            torch.cuda.empty_cache()
    cols: dict[str, dict[int, float | None]] = {}
    for p in prefixes:
        for name, t in time_extend(p, args.chunk, gen).items():
            cols.setdefault(name, {})[p] = t
        torch.cuda.empty_cache()
        cols.setdefault("cuDNN BF16", {})[p] = ms(sdpa_fn(p, args.chunk, SDPBackend.CUDNN_ATTENTION, gen))
        cols.setdefault("flash BF16", {})[p] = ms(sdpa_fn(p, args.chunk, SDPBackend.FLASH_ATTENTION, gen))
        print(f"prefix {p}: " + ", ".join(f"{k} {v[p]}" for k, v in cols.items()), flush=True)
    fmt = lambda t: "—" if t is None else f"{t:.3f}"  # noqa: E731
    rows = [[f"{p:,}", *[fmt(c[p]) for c in cols.values()]] for p in prefixes]
    totals = {k: prefill_total(v, args.chunk) for k, v in cols.items()}
    rows.append(["100k prefill, one layer (fit)", *[fmt(t) for t in totals.values()]])
    rows.append([f"100k prefill, {LAYERS} layers, s",
                 *["—" if t is None else f"{t * LAYERS / 1e3:.2f}" for t in totals.values()]])
    table = markdown_table(["prefix", *[f"{k} ms" for k in cols]], rows)
    print(table)
    extra = "\n\n".join(sweeps)
    append_section(args.results, "Chunked prefill, one layer", torch.cuda.get_device_name(),
                   args.commit or code_version(),
                   f"Qwen3-8B attention (32 q / 8 KV heads, d 128), chunks of {args.chunk} tokens after each prefix, "
                   f"int2.g128.s64.r256, random data, `triton.testing.do_bench` median; the 100k rows sum a "
                   f"straight-line fit over the chunks of a {PREFILL:,}-token prefill (attention only: no weights).",
                   table, extra=extra)

if __name__ == "__main__":
    main()
