"""One decode step on Qwen3-8B shapes through ``DecodePlan``, for a profiler (``ncu``) to attach to.

Usage: ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section LaunchStats -k regex:_decode_rows_kernel --launch-skip 1 --launch-count 1 \
    python benchmarks/profile_decode.py --bs 16 --ctx 131072
Runs the attention twice (the first compiles); ``--run`` profiles ``DecodePlan.run`` (the new token's writes too);
extra ``--opt key=value`` pairs go to ``decode_int2`` (with ``--run``: to ``DecodePlan``, e.g. ``async_tiles=False``
for the Triton split kernel where the Gluon one is the default: then profile ``regex:_decode_rows_kernel``, else
``regex:_decode_rows_async_kernel``).

Where the warps wait, per SASS instruction (the stall reasons the ``ncu`` RESULTS.md readings quote):
``ncu --clock-control none --set full --import-source no -k regex:_decode_rows --launch-skip 1 --launch-count 1
-o rep python benchmarks/profile_decode.py --run --bs 50 --ctx 100000``, then
``ncu -i rep.ncu-rep --page source --csv --print-source sass`` (one row per instruction, ``stall_*`` sample columns).
"""

from __future__ import annotations

import argparse

import torch
from bench_decode import Int2Case
from sass_count import parse_opts  # sibling scripts: benchmarks/ is sys.path[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--run", action="store_true", help="DecodePlan.run (write + attention) instead of the attention")
    ap.add_argument("--opt", action="append", default=[], help="decode_int2 keyword, e.g. num_warps=2")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    kw = parse_opts(args.opt)
    case = Int2Case(args.bs, args.ctx, torch.Generator(device="cuda").manual_seed(0), **({} if not args.run else kw))
    fn = case.run() if args.run else case.fn(**kw)
    fn()
    fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
