"""Compile every kernel for a GPU target on a machine without one: ``python -m oscar_kernels.compile_check``.

The Triton interpreter (what the CPU tests run) accepts code a GPU compile refuses, e.g. a ``tl.dot`` with an inner
dimension under 16, and never builds the GPU-only variants (fp16/bf16 tensor-core dots, the PTX unpacks). This check
drives the public API (``Int2KVPool``, ``ExtendPlan``, ``DecodePlan``, ``quantize_pack``) over CPU tensors with a
compile-only Triton driver that reports the target (sm_90 by default): every launch compiles to a cubin through
Triton's own pipeline (its bundled ``ptxas`` included) with the launch parameters a CUDA tensor would get
(:data:`oscar_kernels.layout.COMPILE_ONLY`), and nothing runs. It prints one line per compiled kernel variant (with
the cubin's registers and stack bytes per thread: spills show before any GPU run) and exits 1 naming the first
configuration that fails.

Must run in a process where ``TRITON_INTERPRET`` is not set (the interpreter replaces the compiler) and no GPU
driver has been initialised. Options: ``--arch 90``, ``--head-dims 16,32,64,128``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


class CompileOnlyDriver:
    """The parts of a Triton driver that compiling needs: a target, device 0, stream 0. Nothing is launched."""

    def __init__(self, arch: int = 90, warp_size: int = 32):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, warp_size)

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise RuntimeError("a compile-only driver cannot time kernels")


@dataclass
class Compiled:
    """One compiled launch: kernel, compile seconds, warps, stages, its compile-time parameters, the cubin's
    registers per thread and stack bytes per thread (spills; None where ``cuobjdump`` is not at hand), and the cubin
    itself (``benchmarks/sass_count.py`` disassembles it)."""

    name: str
    seconds: float
    warps: int
    stages: int
    constants: dict
    registers: int | None
    stack: int | None
    cubin: bytes | None = field(default=None, repr=False)

    def describe(self) -> str:
        res = "" if self.registers is None else f", {self.registers} registers, {self.stack} B stack"
        keys = " ".join(f"{k}={v}" for k, v in self.constants.items() if k in SHOWN)
        return f"{self.name} ({self.seconds:.1f} s{res}; {self.warps} warps, {self.stages} stages; {keys})"


SHOWN = ("HEAD_DIM", "GROUP_SIZE", "BLOCK_N", "BLOCK_T", "BLOCK_H", "PRECISION", "ROT_FMA", "QK_T", "MAGIC",
         "PTX_UNPACK", "STORE_CODES", "STORE_BF16")
"""Compile-time parameters shown per compiled variant."""


def resource_usage(cubin: bytes | None) -> tuple[int | None, int | None]:
    """(registers, stack bytes) per thread of a cubin, read with the ``cuobjdump`` Triton ships."""
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    if not cubin or not os.path.isfile(tool):
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    reg, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return (int(reg.group(1)) if reg else None), (int(stack.group(1)) if stack else None)


@contextmanager
def compile_only(arch: int = 90) -> Iterator[list[Compiled]]:
    """Within: Triton compiles each launch for ``sm_<arch>`` and skips running it; yields the list of
    :class:`Compiled` it fills."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces the compiler this check exercises")
    from triton.runtime import driver, jit

    from . import layout

    compiled: list[Compiled] = []
    run = jit.JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        consts = {self.arg_names[k[0]]: v for k, v in kernel.src.constants.items()
                  if isinstance(k, tuple) and self.arg_names[k[0]].isupper()}
        compiled.append(Compiled(self.fn.__name__, time.perf_counter() - t0, kernel.metadata.num_warps,
                                 kernel.metadata.num_stages, consts, *resource_usage(kernel.asm.get("cubin")),
                                 cubin=kernel.asm.get("cubin")))
        return kernel

    previous = getattr(driver, "_active", None)
    driver.set_active(CompileOnlyDriver(arch))
    jit.JITFunction.run = compile_launch
    layout.COMPILE_ONLY = True
    try:
        yield compiled
    finally:
        jit.JITFunction.run = run
        layout.COMPILE_ONLY = False
        driver._active = previous  # reset_active() would look for a real driver, which this machine may not have


def exercise(head_dim: int, kv_heads: int = 2, gqa: int = 4) -> None:
    """One extend and one decode step of two requests through the pool and plans (every serving kernel), at
    ``head_dim`` with its row group (``g = d``, the row-scale decode path) and, where ``d >= 64``, ``g = 32``; then
    the decode step under each option and launch knob that compiles other code; then the same pool with FP8 scales
    and zeros, and with 4-bit codes, through every kernel that reads them."""
    from .decode import DecodeLaunch
    from .plan import DecodePlan, ExtendPlan
    from .pool import Int2KVPool
    from .scheme import DecodeOptions, QuantScheme

    d, hq = head_dim, kv_heads * gqa
    r2t = torch.arange(256, dtype=torch.int32).view(2, 128)
    i = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731

    def step(dec: DecodePlan) -> DecodePlan:
        dec.plan(r2t, i(0, 1), i(41, 35), torch.stack([r2t[0, 40], r2t[1, 34]]))
        dec.run(0, *(torch.randn(2, h, d).bfloat16() for h in (hq, kv_heads, kv_heads)))
        return dec

    def extends(pool) -> None:
        """An extend of two requests through the dequantised-prefix path (the default here), then the fused one."""
        for deq in (None, 0):
            ext = ExtendPlan(pool, 2, 64, 128, dequant_tokens=deq)
            ext.plan(r2t, i(0, 1), i(0, 10), i(40, 24), torch.cat([r2t[0, :40], r2t[1, 10:34]]))
            ext.run(0, *(torch.randn(64, h, d).bfloat16() for h in (hq, kv_heads, kv_heads)))

    for g in (d, 32) if d >= 64 else (d,):
        scheme = QuantScheme(group=g, sink=4, recent=8)
        rot = torch.linalg.qr(torch.randn(1, kv_heads, d, d))[0].contiguous()
        pool = Int2KVPool(scheme, 1, kv_heads, d, 256, 2, rot, rot.clone(), clip_k=0.9, clip_v=0.95)
        extends(pool)

        for row_kernel in (None, False):  # the default path for this group, and the general one (PTX unpacks at g = d)
            dec = step(DecodePlan(pool, 2, 128, q_heads=hq, row_kernel=row_kernel))
        dec.write_tuning = {}  # the write with quantize_pack_kv's own (prefill) parameters
        for chunk in (1, 256):  # the merge's one-partial-per-step loop, and 256 per step with 8 warps
            dec.launch = DecodeLaunch(merge_chunk=chunk)
            dec.run(0, *(torch.randn(2, h, d).bfloat16() for h in (hq, kv_heads, kv_heads)))
        # the query rotation in its own launch (decode_int2's default, DecodePlan.attend), and exact rows shared by
        # three programs for every sequence (no per-sequence counts: balance off)
        step(DecodePlan(pool, 2, 128, q_heads=hq, fuse_q_rotation=False, exact_splits=3, balance=False))
        # the Triton split kernel at 64-token INT2 tiles and 16-row exact tiles, at 16-row exact tiles alone, and
        # where the Gluon one runs by default (Triton 3.6)
        for launch in (DecodeLaunch(block_n=64, block_nb=16), DecodeLaunch(block_nb=16),
                       DecodeLaunch(async_tiles=False)):
            step(DecodePlan(pool, 2, 128, q_heads=hq, exact_splits=2, launch=launch))
        # the Gluon split kernel with three shared-memory stages, int8 scores, int8 scores and values, the lean tile
        # bookkeeping, the movmatrix transposes, and all of int8 scores and values, lean tiles, the fused value
        # update and the transposes
        for options in (DecodeOptions(num_stages=3), DecodeOptions(int8_scores=True),
                        DecodeOptions(int8_scores=True, int8_values=True), DecodeOptions(lean_tiles=True),
                        DecodeOptions(movmatrix=True),
                        DecodeOptions(int8_scores=True, int8_values=True, lean_tiles=True, fused_update=True,
                                      movmatrix=True)):
            step(DecodePlan(pool, 2, 128, q_heads=hq, options=options))

        # FP8 scales and zeros (e4m3 times per-head multipliers): the write, both extend paths, and the decode split
        # kernels that read them (the default for this group, the general one, the Triton row-scale one, the Gluon
        # one with every option)
        fp8 = QuantScheme(group=g, sink=4, recent=8, scale_dtype="fp8")
        mult = torch.full((1, kv_heads), 2.0 ** -5)
        pool = Int2KVPool(fp8, 1, kv_heads, d, 256, 2, rot, rot.clone(), clip_k=0.9, clip_v=0.95, mult_k=mult,
                          mult_v=mult)
        extends(pool)
        for row_kernel in (None, False):
            step(DecodePlan(pool, 2, 128, q_heads=hq, row_kernel=row_kernel))
        step(DecodePlan(pool, 2, 128, q_heads=hq, launch=DecodeLaunch(async_tiles=False)))
        step(DecodePlan(pool, 2, 128, q_heads=hq, options=DecodeOptions(
            int8_scores=True, int8_values=True, lean_tiles=True, fused_update=True, movmatrix=True)))

        # 4-bit codes (two planes): keys and values (fp16 scales), and keys alone with FP8 scales, through the write,
        # both extend paths and the decode split kernels that read them (the default for this group: the Gluon one
        # at d = 128; the general one; the Triton row-scale one)
        for widths, scheme_4, m4 in (([(4, 4)], scheme, None), ([(4, 2)], fp8, mult)):
            pool = Int2KVPool(scheme_4, 1, kv_heads, d, 256, 2, rot, rot.clone(), clip_k=0.9, clip_v=0.95,
                              mult_k=m4, mult_v=m4, widths=widths)
            extends(pool)
            for row_kernel in (None, False):
                step(DecodePlan(pool, 2, 128, q_heads=hq, row_kernel=row_kernel))
            step(DecodePlan(pool, 2, 128, q_heads=hq, launch=DecodeLaunch(async_tiles=False)))

        # centered keys (FP8 scales, as gemma's recipe stores them): the write subtracts each head's center; the
        # attention kernels are the ones above
        centered = QuantScheme(group=g, sink=4, recent=8, scale_dtype="fp8", center_keys=True)
        pool = Int2KVPool(centered, 1, kv_heads, d, 256, 2, rot, rot.clone(), clip_k=0.9, clip_v=0.95, mult_k=mult,
                          mult_v=mult, center_k=torch.randn(1, kv_heads, d))
        extends(pool)
        step(DecodePlan(pool, 2, 128, q_heads=hq))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--head-dims", default="16,32,64,128")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with compile_only(args.arch) as compiled:
        for d in (int(x) for x in args.head_dims.split(",")):
            start = len(compiled)
            try:
                exercise(d)
            except Exception as e:  # a compile error names the kernel and the line
                last = str(e).strip().splitlines()
                print(f"head dim {d}: does not compile for sm_{args.arch}: {type(e).__name__}: "
                      f"{last[-1] if last else ''}", file=sys.stderr)
                print(str(e), file=sys.stderr)
                return 1
            for c in compiled[start:]:
                print(f"sm_{args.arch} head dim {d}: {c.describe()}")
    spilled = [c for c in compiled if c.stack]
    print(f"{len(compiled)} launches compiled for sm_{args.arch}, none run; {len(spilled)} use stack (spills)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
