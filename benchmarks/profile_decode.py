"""One decode_int2 call on Qwen3-8B shapes, for a profiler (``ncu``) to attach to.

Usage: ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section LaunchStats -k regex:_decode_rows_kernel --launch-skip 1 --launch-count 1 \
    python benchmarks/profile_decode.py --bs 16 --ctx 131072
Runs the call twice (the first compiles); extra ``--opt key=value`` pairs go to ``decode_int2``.
"""

from __future__ import annotations

import argparse

import torch
from bench_decode import Int2Case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--opt", action="append", default=[], help="decode_int2 keyword, e.g. num_warps=2")
    args = ap.parse_args()
    kw = {k: (v == "True" if v in ("True", "False") else int(v)) for k, v in (o.split("=") for o in args.opt)}
    case = Int2Case(args.bs, args.ctx, torch.Generator(device="cuda").manual_seed(0))
    fn = case.fn(**kw)
    fn()
    fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
