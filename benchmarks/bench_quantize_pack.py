"""quantize_pack for a 32k-token prefill (Qwen3-8B: 8 KV heads, d 128): fused rotation vs separate matmul.

Usage: python benchmarks/bench_quantize_pack.py [--decode [--one-launch]] [--commit SHA] [--results benchmarks/RESULTS.md]
``--decode``: instead, the write of one decode step (``N`` = batch = 1, 8, 32, 64 new tokens): K and V as two
``quantize_pack`` launches against one ``quantize_pack_kv`` launch, over tokens per program, warps and rotation
precision, CUDA-graph replay median (a decode step's writes are latency-bound: one program per KV head at bs1).
Per-KV-head clip ratios come from an fp32 device tensor (one launch for all heads, as ``Int2KVPool.write`` runs it);
one variant also stores the rotated bf16 rows (the exact-row output of an extend step). Appends the table to
RESULTS.md with the date, device, commit and command.
"""

from __future__ import annotations

import argparse

import torch
import triton
from oscar_kernels import Int2Pool, quantize_pack
from triton.runtime.errors import OutOfResources

from oscar_cli import code_version
from oscar_cli.results_md import append_section, markdown_table

N, HKV, D = 32768, 8, 128
DEV = "cuda"
VARIANTS = [(64, "ieee", 4), (32, "tf32x3", 4), (64, "tf32x3", 4), (64, "tf32x3", 8), (128, "tf32x3", 4),
            (128, "tf32x3", 8), (64, "tf32", 4)]  # (block_n, rot_precision, num_warps)



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default=None, help="commit recorded in RESULTS.md (default: git rev-parse HEAD)")
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    ap.add_argument("--decode", action="store_true", help="decode-step writes (K and V of N = batch tokens)")
    ap.add_argument("--one-launch", action="store_true",
                    help="with --decode: only the one-launch quantize_pack_kv rows (not the two-launch ones)")
    return ap.parse_args(argv)


DECODE_BATCHES = (1, 8, 32, 64)
DECODE_VARIANTS = [(16, "tf32x3", 4), (16, "tf32x3", 2), (16, "tf32", 4), (32, "tf32x3", 4), (64, "tf32x3", 4),
                   (1, "fma", 1), (1, "fma", 2), (1, "fma", 4), (1, "fma", 8), (4, "fma", 4), (16, "fma", 4)]
"""(block_n, rot_precision, num_warps) of the decode-step sweep; ``fma``: CUDA-core multiply-adds, few rows."""


def decode_main(args, commit: str) -> None:
    from oscar_kernels import quantize_pack_kv

    gen = torch.Generator(device=DEV).manual_seed(0)
    slots = 4096
    rots = [torch.linalg.qr(torch.randn(HKV, D, D, device=DEV, generator=gen))[0].contiguous() for _ in range(2)]
    clips = [(0.7 + 0.3 * torch.rand(HKV, device=DEV, generator=gen)).contiguous() for _ in range(2)]
    pools = [Int2Pool.empty(slots, HKV, D, device=DEV) for _ in range(2)]
    exact = [torch.empty(slots, HKV, D, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    rows = []
    for pair in (True,) if args.one_launch else (False, True):
        for bn, prec, nw in DECODE_VARIANTS:
            cells = []
            for b in DECODE_BATCHES:
                k, v = (torch.randn(b, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen) for _ in range(2))
                loc = torch.randperm(slots, device=DEV, generator=gen)[:b]
                bloc = torch.randperm(slots, device=DEV, generator=gen)[:b]
                kw = dict(block_n=bn, rot_precision=prec, num_warps=nw)

                def fn(k=k, v=v, loc=loc, bloc=bloc, kw=kw, pair=pair):
                    if pair:
                        quantize_pack_kv(k, v, rots[0], rots[1], clips[0], clips[1],
                                         (pools[0].codes, pools[0].scale, pools[0].zero),
                                         (pools[1].codes, pools[1].scale, pools[1].zero), loc,
                                         bf16_out=(exact[0], exact[1]), bf16_loc=bloc, **kw)
                    else:
                        for x, r, c, pl, ex in zip((k, v), rots, clips, pools, exact, strict=True):
                            quantize_pack(x, r, c, pl.codes, pl.scale, pl.zero, loc, bf16_out=ex, bf16_loc=bloc, **kw)

                try:
                    fn()
                    torch.cuda.synchronize()
                    cells.append(f"{1e3 * triton.testing.do_bench_cudagraph(fn, rep=25, return_mode='median'):.1f}")
                except OutOfResources as e:
                    cells.append("—")
                    print(f"block_n {bn} {prec} {nw} warps, bs{b}: {e}")
            how = "quantize_pack_kv (one launch)" if pair else "quantize_pack x2"
            name = f"{how}, block_n {bn}, {prec}, {nw} warps"
            rows.append([name, *cells])
            print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(["variant", *[f"bs{b} µs" for b in DECODE_BATCHES]], rows)
    print(table)
    append_section(args.results, "quantize_pack, decode-step writes", torch.cuda.get_device_name(), commit,
                   f"K and V bf16 [bs, {HKV}, {D}] of one decode step, per-head fp32 rotations and clip tensors, INT2 "
                   "codes into head-major pools plus the exact bf16 rows, scattered slots, CUDA-graph replay median.",
                   table)


def main() -> None:
    args = parse_args()
    commit = args.commit or code_version()
    if args.decode:
        decode_main(args, commit)
        return
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(N, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    rot = torch.linalg.qr(torch.randn(HKV, D, D, device=DEV, generator=gen))[0].contiguous()
    clip = (0.7 + 0.3 * torch.rand(HKV, device=DEV, generator=gen)).contiguous()  # per KV head, on the device
    pool = Int2Pool.empty(N, HKV, D, device=DEV)  # head-major, as Int2KVPool allocates
    exact = torch.empty(N, HKV, D, device=DEV, dtype=torch.bfloat16)
    loc = torch.randperm(N, device=DEV, generator=gen)
    bloc = torch.randperm(N, device=DEV, generator=gen)
    nbytes = x.numel() * 2 + pool.codes.numel() + 4 * pool.scale.numel() + loc.numel() * 8 + rot.numel() * 4

    def separate():
        xr = torch.einsum("nhd,hde->nhe", x.float(), rot)
        quantize_pack(xr, None, clip, pool.codes, pool.scale, pool.zero, loc)

    rows = []
    for bn, prec, nw in VARIANTS:
        def fn(bn=bn, prec=prec, nw=nw):
            quantize_pack(x, rot, clip, pool.codes, pool.scale, pool.zero, loc, block_n=bn, rot_precision=prec,
                          num_warps=nw)

        try:  # a configuration that does not fit this device's shared memory or registers is reported, not timed
            rows.append((f"fused rotation, block_n {bn}, {prec}, {nw} warps", nbytes,
                         triton.testing.do_bench(fn, return_mode="median")))
        except OutOfResources as e:
            print(f"block_n {bn} {prec} {nw} warps: {e}")

    def with_exact():
        quantize_pack(x, rot, clip, pool.codes, pool.scale, pool.zero, loc, bf16_out=exact, bf16_loc=bloc)

    rows.append(("fused rotation + bf16 exact rows (defaults)", nbytes + exact.numel() * 2 + bloc.numel() * 8,
                 triton.testing.do_bench(with_exact, return_mode="median")))
    rows.append(("separate fp32 einsum + pack", nbytes, triton.testing.do_bench(separate, return_mode="median")))
    table = markdown_table(["variant", "µs", "GB/s (x read + slots written)"],
                           [[name, f"{ms * 1e3:.1f}", f"{nb / (ms * 1e-3) / 1e9:.0f}"] for name, nb, ms in rows])
    print(table)
    append_section(args.results, "quantize_pack, 32k-token prefill", torch.cuda.get_device_name(), commit,
                   f"x bf16 [{N}, {HKV}, {D}], per-head fp32 rotation, per-head clip ratios as an fp32 device tensor, "
                   "head-major pool, scattered slots, `triton.testing.do_bench` median.", table)


if __name__ == "__main__":
    main()
