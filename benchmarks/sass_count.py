"""SASS instructions per INT2 tile of the decode split kernel, by pipe, compiled for sm_90 on a machine without a GPU.

Usage (from the repository root; the Gluon kernel needs the H200 image's Triton, which ``make setup`` puts in
``.venv/triton-h200``)::

    PYTHONPATH=.venv/triton-h200 .venv/bin/python benchmarks/sass_count.py --set int8-values
    PYTHONPATH=.venv/triton-h200 .venv/bin/python benchmarks/sass_count.py --opt int8_scores=True --top 20
    PYTHONPATH=.venv/triton-h200 .venv/bin/python benchmarks/sass_count.py --set lean --results benchmarks/RESULTS.md

Each variant (``--set`` names the same variant lists as ``bench_decode.py --variants``; ``--opt key=value`` adds
one) builds a Qwen3-8B-shaped ``DecodePlan`` (8 KV heads, GQA 4, d = 128, row scales) over CPU tensors inside
:func:`oscar_kernels.compile_check.compile_only`, so its launch compiles to a cubin and nothing runs. The split
kernel's cubin is disassembled with the ``nvdisasm`` Triton ships, and the INT2 tile loop is found as the backward
branch whose body holds the most tensor-core instructions (the kernel is one warp, so its body's length is the
instructions one warp issues per 128-token tile). Those are counted per issue pipe, as ``ncu`` names them for sm_90
(``alu``: logic, shifts, permutes, compares, selects, integer adds; ``fma``: fp32 and ``IMAD``; ``xu``: ``MUFU``;
``tensor``: ``HMMA``/``IMMA``; ``lsu``: shared/global memory and shuffles; ``cvt``: conversions; ``uniform``: the
``U``-prefixed datapath; ``ctrl``: branches, barriers, ``NOP``), so a change's instruction cost shows before a GPU
run. Counts are static: what one pass over a full tile issues, not what a profiler would sample. Prints one row per
variant (with the cubin's registers and stack bytes per thread, and the loop's local-memory loads and stores:
spills inside the loop); ``--top N`` adds each variant's most frequent opcodes; ``--dump DIR`` writes each loop's
SASS. ``--max-registers`` sets the register cap where a variant sets none (default: the cap a large batch's launch
gets, ``ROWS_MAX_REGISTERS``; 0: none, as at batch 1). ``--results`` appends the table to a RESULTS.md as a
section whose device is the compile (nothing ran).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from typing import NamedTuple

PIPES = ("alu", "fma", "xu", "tensor", "lsu", "cvt", "uniform", "ctrl", "other")
"""The pipes counted, in column order."""

_PIPE_OF = {
    "alu": ("LOP3", "LOP", "SHF", "SHL", "SHR", "PRMT", "ISETP", "FSETP", "HSETP2", "FMNMX", "IMNMX", "FSEL", "SEL",
            "LEA", "IADD3", "IABS", "BMSK", "SGXT", "PLOP3", "P2R", "R2P", "MOV", "FLO", "POPC", "BREV", "VIADD",
            "VIMNMX", "VIADDMNMX", "CS2R", "S2R", "R2UR", "VOTE"),
    "fma": ("FFMA", "FMUL", "FADD", "IMAD", "IMUL", "HFMA2", "HMUL2", "HADD2", "FSWZADD", "IDP", "IDP4A"),
    "xu": ("MUFU",),
    "tensor": ("HMMA", "IMMA", "HGMMA", "IGMMA", "QGMMA"),
    "lsu": ("LDS", "LDSM", "STS", "LDG", "STG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "LD", "ST", "ATOM", "ATOMS", "RED",
            "SHFL", "LDC", "MEMBAR", "CCTL", "STSM", "LDL", "STL"),
    "cvt": ("F2F", "F2I", "I2F", "F2FP", "I2FP", "FRND", "I2I"),
    "ctrl": ("BRA", "BSSY", "BSYNC", "EXIT", "NOP", "WARPSYNC", "BAR", "CALL", "RET", "YIELD", "BPT", "ERRBAR"),
}
_PIPE = {op: pipe for pipe, ops in _PIPE_OF.items() for op in ops}

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)\s*([^;]*);")
_TARGET = re.compile(r"`\(\.L_x_(\d+)\)")
_LABEL = re.compile(r"^\.L_x_(\d+):")


class Instr(NamedTuple):
    """One SASS instruction: address, opcode without modifiers, the whole line."""

    addr: int
    op: str
    text: str

    @property
    def pipe(self) -> str:
        if self.op in _PIPE:
            return _PIPE[self.op]
        return "uniform" if self.op.startswith("U") else "other"


def disassemble(cubin: bytes) -> tuple[list[Instr], dict[int, int]]:
    """The cubin's instructions (address order) and its labels (label number -> address), by ``nvdisasm``."""
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return parse_sass(out)


def parse_sass(text: str) -> tuple[list[Instr], dict[int, int]]:
    """``nvdisasm -c`` text -> its instructions (address order) and labels (label number -> address)."""
    instrs, labels, pending = [], {}, []
    for line in text.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            pending.append(int(m.group(1)))
            continue
        m = _LINE.search(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            instrs.append(Instr(addr, m.group(3), line.strip()))
    return instrs, labels


def tile_loop(instrs: list[Instr], labels: dict[int, int]) -> list[Instr]:
    """The body of the backward branch whose body holds the most tensor-core instructions (the INT2 tile loop)."""
    best: list[Instr] = []
    best_mma = -1
    for ins in instrs:
        if ins.op != "BRA":
            continue
        m = _TARGET.search(ins.text)
        if not m or int(m.group(1)) not in labels:
            continue
        start = labels[int(m.group(1))]
        if start > ins.addr:
            continue
        body = [i for i in instrs if start <= i.addr <= ins.addr]
        mma = sum(i.pipe == "tensor" for i in body)
        if mma > best_mma:
            best, best_mma = body, mma
    if not best:
        raise RuntimeError("no loop found in the split kernel's SASS")
    return best


def plan_kernel(tuning: dict, kv_heads: int = 8, gqa: int = 4, d: int = 128):
    """The decode split kernel's :class:`~oscar_kernels.compile_check.Compiled` for a plan with ``tuning``."""
    import torch
    from bench_decode import plan_kwargs
    from oscar_kernels.compile_check import compile_only
    from oscar_kernels.plan import DecodePlan
    from oscar_kernels.pool import Int2KVPool
    from oscar_kernels.scheme import QuantScheme

    torch.manual_seed(0)
    scheme = QuantScheme(group=d, sink=4, recent=8)
    rot = torch.linalg.qr(torch.randn(1, kv_heads, d, d))[0].contiguous()
    pool = Int2KVPool(scheme, 1, kv_heads, d, 512, 2, rot, rot.clone(), clip_k=0.9, clip_v=0.95)
    r2t = torch.arange(512, dtype=torch.int32).view(2, 256)
    i = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with compile_only() as compiled:
        dec = DecodePlan(pool, 2, 256, q_heads=kv_heads * gqa, **plan_kwargs(tuning))
        dec.plan(r2t, i(0, 1), i(201, 135), torch.stack([r2t[0, 200], r2t[1, 134]]))
        dec.run(0, *(torch.randn(2, h, d).bfloat16() for h in (kv_heads * gqa, kv_heads, kv_heads)))
    split = [c for c in compiled if c.name.startswith("_decode_rows")]
    if not split:
        raise RuntimeError(f"no row-scale split kernel among {[c.name for c in compiled]}")
    return split[0]


def count(tuning: dict):
    """(compiled kernel, per-pipe counts, per-opcode counts, the loop) of the split kernel's tile loop."""
    c = plan_kernel(tuning)
    instrs, labels = disassemble(c.cubin)
    loop = tile_loop(instrs, labels)
    return c, Counter(i.pipe for i in loop), Counter(i.op for i in loop), loop


def parse_opts(opts: list[str]) -> dict:
    """``--opt key=value`` strings -> keyword arguments (``True``/``False`` as booleans, the rest as integers); also
    ``profile_decode.py``'s."""
    out = {}
    for o in opts:
        if "=" not in o:
            raise SystemExit(f"--opt {o!r}: expected key=value, e.g. int8_scores=True")
        k, v = o.split("=", 1)
        out[k] = v == "True" if v in ("True", "False") else int(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", default=None, help="a variant set of bench_decode.py --variants (e.g. int8-values)")
    ap.add_argument("--opt", action="append", default=[], help="one more variant: DecodePlan keyword, e.g. "
                    "int8_scores=True (repeat for several keywords of one variant)")
    ap.add_argument("--max-registers", type=int, default=None, help="register cap where a variant sets none "
                    "(default: ROWS_MAX_REGISTERS, the cap of a large batch's launch; 0 for none)")
    ap.add_argument("--top", type=int, default=0, help="print each variant's N most frequent opcodes")
    ap.add_argument("--dump", default=None, help="write each variant's loop SASS into this folder")
    ap.add_argument("--results", default=None, help="also append the table to this RESULTS.md")
    ap.add_argument("--commit", default=None, help="commit recorded with --results (default: the checkout's)")
    args = ap.parse_args(argv)
    variants: list[tuple[str, dict]] = []
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_decode: the variant sets and keywords
    if args.set is not None:
        from bench_decode import VARIANT_SETS

        if args.set not in VARIANT_SETS:
            raise SystemExit(f"--set {args.set!r}: unknown; choose one of {', '.join(VARIANT_SETS)}")
        variants += list(VARIANT_SETS[args.set])
    if args.opt:
        variants.append((" ".join(args.opt), parse_opts(args.opt)))
    if not variants:
        variants = [("default", {})]
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the compiler this count reads")
    from oscar_kernels.decode import ROWS_MAX_REGISTERS

    cap = ROWS_MAX_REGISTERS if args.max_registers is None else args.max_registers
    head = (f"{'variant':<36} {'kernel':<26} {'regs':>4} {'stack':>5} {'total':>6} "
            + " ".join(f"{p:>7}" for p in PIPES) + f" {'LDL/STL':>7}")
    print(head)
    print("-" * len(head))
    rows = []
    for name, tuning in variants:
        c, pipes, ops, loop = count({"max_registers": cap, **tuning} if cap else tuning)
        regs, stack = ("?" if v is None else v for v in (c.registers, c.stack))
        print(f"{name:<36} {c.name:<26} {regs:>4} {stack:>5} {len(loop):>6} "
              + " ".join(f"{pipes.get(p, 0):>7}" for p in PIPES) + f" {ops['LDL'] + ops['STL']:>7}")
        rows.append([name, regs, stack, len(loop), *(pipes.get(p, 0) for p in PIPES), ops["LDL"] + ops["STL"]])
        if args.top:
            print("    " + ", ".join(f"{op} {n}" for op, n in ops.most_common(args.top)))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            safe = re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)
            with open(os.path.join(args.dump, f"{safe}.sass"), "w") as f:
                f.write("\n".join(i.text for i in loop) + "\n")
    if args.results:
        append_results(args.results, rows, args.commit, cap)
    return 0


def append_results(path: str, rows: list[list], commit: str | None, cap: int) -> str:
    """The table as a RESULTS.md section (the compile's Triton as the device: nothing ran)."""
    import triton

    from oscar_cli import code_version
    from oscar_cli.results_md import append_section, markdown_table

    table = markdown_table(["variant", "registers", "stack B", "instructions", *PIPES, "LDL/STL"], rows)
    cap_text = f"register cap {cap} (a large batch's launch)" if cap else "no register cap (a small batch's launch)"
    return append_section(
        path, "Decode split kernel, sm_90 SASS per 128-token tile and warp",
        f"a CPU machine (sm_90 cubins from Triton {triton.__version__}, counted; nothing ran)",
        commit or code_version(),
        f"The Gluon split kernel of a Qwen3-8B-shaped DecodePlan (8 KV heads, GQA 4, d 128, row scales), "
        f"{cap_text}, compiled with the H200 image's Triton (`PYTHONPATH=.venv/triton-h200`); its tile loop's "
        f"instructions by issue pipe, and local-memory loads/stores inside it (spills).",
        table, command=["benchmarks/sass_count.py", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
