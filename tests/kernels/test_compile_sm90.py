"""Every serving kernel compiles for the H200 (sm_90) on a machine without a GPU (``oscar_kernels.compile_check``):
the GPU variants the interpreter never builds (fp16/bf16 tensor-core dots, the PTX unpacks) and the shape rules it
does not enforce. Runs in a subprocess: the tests' interpreter setting would replace the compiler."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import triton
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
    sys.exit(main(["--head-dims", "16,64,128"]))
''')


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # compile for real, not from an earlier run's cache
    script = tmp_path / "compile_check_sm90.py"  # Triton reads a @jit function's source from its file
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "narrow dot refused" in r.stdout
    names = {line.split(": ")[1].split(" (")[0] for line in r.stdout.splitlines() if line.startswith("sm_90 head dim")}
    assert names == {"_quantize_pack_kv_kernel", "_plan_lengths_kernel", "_plan_fill_kernel", "_extend_int2_kernel",
                     "_rotate_q_kernel", "_decode_rows_kernel", "_decode_int2_kernel", "_decode_int2_merge_kernel"}
    assert "launches compiled for sm_90, none run" in r.stdout
