"""Decode attention on Qwen3-8B shapes: INT2 (decode_int2) vs torch SDPA BF16 (cuDNN, flash), CUDA-graph replay.

Usage: python benchmarks/bench_decode.py --commit $(git rev-parse --short HEAD) [--sweep] [--results benchmarks/RESULTS.md]
Prints a table (median µs, GB/s on the bytes each kernel reads, ratio to the best BF16 backend, fraction of
the copy bandwidth measured in the same run) and appends it to RESULTS.md. Random data, never zeros.
Each INT2 context is ``ctx - BF16_TOKENS`` INT2 tokens plus a BF16 sink/recent segment of ``BF16_TOKENS``.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.nn.functional as F
import triton
from oscar_kernels import decode_int2, decode_workspace
from oscar_kernels.decode_int2 import default_num_splits
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128  # Qwen3-8B attention
BF16_TOKENS = 128
SHAPES = [(1, 8192), (1, 32768), (1, 131072), (8, 8192), (8, 32768), (8, 131072), (16, 8192), (16, 32768),
          (16, 131072), (32, 8192), (32, 32768)]
DEV = "cuda"


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.randn(256 * 2**20, device=DEV)  # 1 GiB
    y = torch.empty_like(x)
    t = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return 2 * x.numel() * 4 / (t * 1e-3)


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


class Int2Case:
    def __init__(self, bs: int, ctx: int, gen: torch.Generator, head_major: bool = True):
        """``head_major``: pools stored [Hkv, S, ...] behind [S, Hkv, ...] views (``Int2Pool``'s layout); else slot-major."""
        n2 = ctx - BF16_TOKENS
        self.bs, self.ctx, self.n2 = bs, ctx, n2
        slots = bs * n2

        def pool(make, last):
            t = make((HKV, slots, last) if head_major else (slots, HKV, last))
            return t.transpose(0, 1) if head_major else t

        self.k_codes = pool(lambda sh: torch.randint(0, 256, sh, dtype=torch.uint8, device=DEV, generator=gen), D // 4)
        self.v_codes = pool(lambda sh: torch.randint(0, 256, sh, dtype=torch.uint8, device=DEV, generator=gen), D // 4)
        self.k_scale = pool(lambda sh: (torch.rand(sh, device=DEV, generator=gen) * 0.1 + 0.01).half(), 1)
        self.v_scale = pool(lambda sh: (torch.rand(sh, device=DEV, generator=gen) * 0.1 + 0.01).half(), 1)
        self.k_zero = pool(lambda sh: (torch.randn(sh, device=DEV, generator=gen) * 0.1).half(), 1)
        self.v_zero = pool(lambda sh: (torch.randn(sh, device=DEV, generator=gen) * 0.1).half(), 1)
        self.kv_indptr = (torch.arange(bs + 1, device=DEV) * n2).int()
        self.kv_indices = torch.arange(slots, device=DEV, dtype=torch.int32)  # a token pool filled in order
        nb = bs * BF16_TOKENS
        self.k_bf16 = torch.randn(nb, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        self.v_bf16 = torch.randn(nb, HKV, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        self.bf16_indptr = (torch.arange(bs + 1, device=DEV) * BF16_TOKENS).int()
        self.bf16_indices = torch.arange(nb, device=DEV, dtype=torch.int32)
        self.rot_k = torch.linalg.qr(torch.randn(HKV, D, D, device=DEV, generator=gen))[0].contiguous()
        self.rot_v = torch.linalg.qr(torch.randn(HKV, D, D, device=DEV, generator=gen))[0].contiguous()
        self.q = torch.randn(bs, HQ, D, device=DEV, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.q)

    def bytes_read(self) -> int:
        int2 = self.bs * self.n2 * HKV * 2 * (D // 4 + 4)  # codes + fp16 scale + fp16 zero, K and V
        bf16 = self.bs * BF16_TOKENS * HKV * D * 2 * 2
        idx = (self.bs * self.ctx) * 4
        rot = 2 * HKV * D * D * 4
        return int2 + bf16 + idx + rot + 2 * self.q.numel() * 2

    def fn(self, num_splits=None, **kw):
        ns = num_splits or default_num_splits(self.bs, HKV, self.n2, kw.get("row_kernel", True) is not False)
        ws = decode_workspace(self.bs, HQ, D, ns, DEV)
        args = (self.q, self.rot_k, self.rot_v, self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale,
                self.v_zero, self.kv_indptr, self.kv_indices, self.k_bf16, self.v_bf16, self.bf16_indptr,
                self.bf16_indices)
        return lambda: decode_int2(*args, max_kv_len=self.n2, num_splits=ns, out=self.out, workspace=ws, **kw)


def sdpa_case(bs, ctx, gen):
    q = torch.randn(bs, HQ, 1, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(bs, HKV, ctx, D, device=DEV, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(bs, HKV, ctx, D, device=DEV, dtype=torch.bfloat16, generator=gen)

    def make(backend):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return fn
    return make, 2 * k.numel() * 2 + 2 * q.numel() * 2


SWEEP = [  # (block_n, warps, stages, register cap; 0: none) of the row-scale kernel
    (128, 1, 1, 0), (128, 1, 1, 168), (128, 1, 1, 144), (128, 1, 1, 128), (64, 1, 1, 0), (64, 1, 1, 128),
    (128, 2, 1, 0),
]


def sweep(gen, shapes):
    """Tile size, warps, pipelining, register cap and split count of the row-scale kernel, and the general kernel."""
    print("\n## sweep (µs, median of CUDA-graph replays)")
    for bs, ctx in shapes:
        case = Int2Case(bs, ctx, gen)
        base = default_num_splits(bs, HKV, case.n2, row_kernel=True)
        rows = [(graph_us(case.fn(row_kernel=False)), "general kernel")]
        for bn, nw, st, reg in SWEEP:
            for ns in sorted({max(base // 2, 1), base}):
                rows.append((graph_us(case.fn(num_splits=ns, num_warps=nw, block_n=bn, num_stages=st,
                                              max_registers=reg)),
                             f"block_n={bn} warps={nw} stages={st} maxnreg={reg} splits={ns}"))
        rows.sort()
        print(f"bs{bs} ctx{ctx} (default splits {base}): " + "; ".join(f"{c}: {t:.1f}" for t, c in rows), flush=True)
        del case
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    ap.add_argument("--sweep", action="store_true", help="sweep tile/warps/splits on a few shapes first")
    ap.add_argument("--sweep-only", action="store_true", help="sweep, then stop (no table, nothing appended)")
    ap.add_argument("--layouts", action="store_true", help="compare slot-major and head-major pools, then stop")
    ap.add_argument("--label", default="decode_int2 defaults")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    if args.layouts:
        print("\n## pool layout (µs, defaults): slot-major [S, Hkv, ...] vs head-major [Hkv, S, ...]")
        for bs, ctx in [(1, 8192), (1, 131072), (8, 32768), (16, 131072), (32, 32768)]:
            ts = []
            for hm in (False, True):
                case = Int2Case(bs, ctx, gen, head_major=hm)
                ts.append(graph_us(case.fn()))
                del case
                torch.cuda.empty_cache()
            print(f"bs{bs} ctx{ctx}: slot-major {ts[0]:.1f}, head-major {ts[1]:.1f}", flush=True)
        return
    if args.sweep or args.sweep_only:
        sweep(gen, [(1, 8192), (1, 131072), (8, 32768), (16, 131072)])
        if args.sweep_only:
            return
    lines = [
        "| bs | context | cuDNN BF16 µs | flash BF16 µs | INT2 µs | INT2 MB read | INT2 GB/s | INT2 / best BF16 | INT2 frac of copy bw |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for bs, ctx in SHAPES:
        make, _ = sdpa_case(bs, ctx, gen)
        t_cudnn = graph_us(make(SDPBackend.CUDNN_ATTENTION))
        t_flash = graph_us(make(SDPBackend.FLASH_ATTENTION))
        del make
        torch.cuda.empty_cache()
        case = Int2Case(bs, ctx, gen)
        t = graph_us(case.fn())
        nbytes = case.bytes_read()
        gbs = nbytes / (t * 1e-6) / 1e9
        best = min(t_cudnn, t_flash)
        lines.append(f"| {bs} | {ctx // 1024}k | {t_cudnn:.1f} | {t_flash:.1f} | {t:.1f} | {nbytes / 1e6:.1f} | "
                     f"{gbs:.0f} | {t / best:.2f} | {gbs * 1e9 / bw:.2f} |")
        print(lines[-1], flush=True)
        del case
        torch.cuda.empty_cache()
    table = "\n".join(lines)
    print(table)
    cmd = " ".join(["python"] + sys.argv)
    with open(args.results, "a") as f:
        f.write(f"\n## Decode, {args.label}: {datetime.date.today()}, measured on an H200 ({torch.cuda.get_device_name()}), "
                f"commit {args.commit}\n\nCommand: `{cmd}`. Copy bandwidth measured in the same run: {bw / 1e9:.0f} GB/s "
                f"(read+write). Qwen3-8B shapes (32 q heads, 8 KV heads, d 128), INT2 at g = d = 128 "
                f"(2.25 bits/element) + {BF16_TOKENS} BF16 tokens per sequence, CUDA-graph replay median.\n\n{table}\n")


if __name__ == "__main__":
    main()
