"""Every serving kernel compiles for the H100/H200 (sm_90) on a machine without a GPU
(``oscar_kernels.compile_check``): the GPU variants the interpreter never builds (fp16/bf16 tensor-core dots, the PTX
unpacks, the Gluon split kernel) and the shape rules it does not enforce. With the GPU machines' Triton (the H200
image's 3.6, which ``make setup`` puts in ``.venv/triton-h200``; releases have refused kernels others compiled), in a
subprocess (the tests' interpreter setting would replace the compiler). Skipped where CUDA is present: there the GPU
tests compile and run the real kernels."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

H200_TRITON = Path(sys.prefix) / "triton-h200"
"""The H200 image's Triton (3.6.0), installed by ``make setup`` with ``pip install --target``."""

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import triton
    print("triton", triton.__version__)
    import triton.language as tl
    from oscar_kernels.compile_check import compile_only, main

    @triton.jit
    def narrow_dot(A, B, C, K: tl.constexpr):  # a tensor-core dot with an inner dimension under 16
        r, k = tl.arange(0, 16), tl.arange(0, K)
        a = tl.load(A + r[:, None] * K + k[None, :])
        b = tl.load(B + k[:, None] * 16 + r[None, :])
        tl.store(C + r[:, None] * 16 + r[None, :], tl.dot(a, b))

    with compile_only():
        for K, ok in ((16, True), (8, False)):
            try:
                narrow_dot[(1,)](torch.zeros(16, K, dtype=torch.float16), torch.zeros(K, 16, dtype=torch.float16),
                                 torch.zeros(16, 16), K=K)
                got = True
            except triton.CompilationError:
                got = False
            assert got == ok, (K, got)
    print("narrow dot refused")
    sys.path.insert(0, TESTS_DIR)
    import test_decode_int2 as twins  # the tests' own @jit twins of the plan's device rules compile too

    with compile_only():
        z = torch.zeros(64, dtype=torch.int32)
        twins._split_count_kernel[(1,)](z, z, 2048, 128, 256, 128, BLOCK=64)
        twins._balance_count_kernel[(1,)](z, z, z, z, z, 132, 4, 2048, 128, 256, BLOCK=64, BLOCK_N=128, ROWS=40,
                                          MIN_ROWS=80)
    print("test twins compile")
    sys.exit(main(["--head-dims", "16,32,64,128"]))
''').replace("TESTS_DIR", repr(str(Path(__file__).parent)))


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine compiles and runs the real kernels in its tests")
def test_every_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    if not (H200_TRITON / "triton").is_dir():
        pytest.skip(f"no Triton in {H200_TRITON}: make setup installs the H200 image's there")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(H200_TRITON), *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # compile for real, not from an earlier run's cache
    script = tmp_path / "compile_check_sm90.py"  # Triton reads a @jit function's source from its file
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "narrow dot refused" in r.stdout and "test twins compile" in r.stdout and "triton 3.6.0" in r.stdout
    names = {line.split(": ")[1].split(" (")[0] for line in r.stdout.splitlines() if line.startswith("sm_90 head dim")}
    assert names == {"_quantize_pack_kv_kernel", "_plan_lengths_kernel", "_plan_fill_kernel", "_extend_int2_kernel",
                     "_dequant_list_kernel", "_extend_deq_kernel", "_rotate_q_kernel", "_decode_rows_kernel",
                     "_decode_int2_kernel", "_decode_int2_merge_kernel", "_decode_rows_async_kernel"}
    assert "launches compiled for sm_90, none run" in r.stdout
