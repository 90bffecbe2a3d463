"""quantize_pack for a 32k-token prefill (Qwen3-8B: 8 KV heads, d 128): fused rotation vs separate matmul.

Usage: python benchmarks/bench_quantize_pack.py [--commit SHA] [--results benchmarks/RESULTS.md]
Per-KV-head clip ratios come from an fp32 device tensor (one launch for all heads, as ``Int2KVPool.write`` runs it);
one variant also stores the rotated bf16 rows (the exact-row output of an extend step). Appends the table to
RESULTS.md with the date, device, commit and command.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton
from oscar_kernels import Int2Pool, quantize_pack
from triton.runtime.errors import OutOfResources

from oscar_cli import code_version

N, HKV, D = 32768, 8, 128
DEV = "cuda"
VARIANTS = [(64, "ieee", 4), (32, "tf32x3", 4), (64, "tf32x3", 4), (64, "tf32x3", 8), (128, "tf32x3", 4),
            (128, "tf32x3", 8), (64, "tf32", 4)]  # (block_n, rot_precision, num_warps)



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commit", default=None, help="commit recorded in RESULTS.md (default: git rev-parse HEAD)")
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    commit = args.commit or code_version()
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
    lines = ["| variant | µs | GB/s (x read + slots written) |", "| --- | --- | --- |"]
    for name, nb, ms in rows:
        lines.append(f"| {name} | {ms * 1e3:.1f} | {nb / (ms * 1e-3) / 1e9:.0f} |")
    table = "\n".join(lines)
    print(table)
    with open(args.results, "a") as f:
        f.write(f"\n## quantize_pack, 32k-token prefill: {datetime.date.today()}, measured on "
                f"{torch.cuda.get_device_name()}, commit {commit}\n\n"
                f"Command: `{' '.join(['python'] + sys.argv)}`. x bf16 [{N}, {HKV}, {D}], per-head fp32 rotation, "
                f"per-head clip ratios as an fp32 device tensor, head-major pool, scattered slots, "
                f"`triton.testing.do_bench` median.\n\n{table}\n")


if __name__ == "__main__":
    main()
