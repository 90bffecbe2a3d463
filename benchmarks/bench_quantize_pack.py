"""quantize_pack for a 32k-token prefill (Qwen3-8B: 8 KV heads, d 128): fused rotation vs separate matmul.

Usage: python benchmarks/bench_quantize_pack.py --commit $(git rev-parse --short HEAD)
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton
from oscar_kernels import quantize_pack

N, HKV, D = 32768, 8, 128
DEV = "cuda"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(N, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    rot = torch.linalg.qr(torch.randn(HKV, D, D, device=DEV, generator=gen))[0].contiguous()
    codes = torch.empty(N, HKV, D // 4, dtype=torch.uint8, device=DEV)
    scale = torch.empty(N, HKV, 1, dtype=torch.float16, device=DEV)
    zero = torch.empty_like(scale)
    loc = torch.randperm(N, device=DEV, generator=gen)
    nbytes = x.numel() * 2 + codes.numel() + 4 * scale.numel() + loc.numel() * 8 + rot.numel() * 4

    def separate():
        xr = torch.einsum("nhd,hde->nhe", x.float(), rot)
        quantize_pack(xr, None, 0.9, codes, scale, zero, loc)

    rows = []
    for bn, prec, nw in [(64, "ieee", 4), (32, "tf32x3", 4), (64, "tf32x3", 4), (64, "tf32x3", 8), (128, "tf32x3", 4),
                         (128, "tf32x3", 8), (64, "tf32", 4)]:
        def fn(bn=bn, prec=prec, nw=nw):
            quantize_pack(x, rot, 0.9, codes, scale, zero, loc, block_n=bn, rot_precision=prec, num_warps=nw)

        if True:
            try:
                rows.append((f"fused rotation, block_n {bn}, {prec}, {nw} warps",
                             triton.testing.do_bench(fn, return_mode="median")))
            except Exception as e:
                print(f"block_n {bn} {prec}: {type(e).__name__}: {str(e)[:200]}")
    rows.append(("separate fp32 einsum + pack", triton.testing.do_bench(separate, return_mode="median")))
    lines = ["| variant | µs | GB/s (x read + slots written) |", "| --- | --- | --- |"]
    for name, ms in rows:
        lines.append(f"| {name} | {ms * 1e3:.1f} | {nbytes / (ms * 1e-3) / 1e9:.0f} |")
    table = "\n".join(lines)
    print(table)
    with open(args.results, "a") as f:
        f.write(f"\n## quantize_pack, 32k-token prefill: {datetime.date.today()}, measured on an H200, commit {args.commit}\n\n"
                f"Command: `{' '.join(['python'] + sys.argv)}`. x bf16 [{N}, {HKV}, {D}], per-head fp32 rotation, "
                f"scattered slots, `triton.testing.do_bench` median.\n\n{table}\n")


if __name__ == "__main__":
    main()
