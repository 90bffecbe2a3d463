"""benchmarks/sass_count.py: the tile loop is found in ``nvdisasm`` text and counted per pipe (a recorded sample),
bad options are refused, and end to end (slow; the H200 image's Triton that ``make setup`` installs) the Gluon split
kernel compiles for sm_90 and its tile loop holds the MMAs each variant issues per tile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
H200_TRITON = Path(sys.prefix) / "triton-h200"

SAMPLE = """
        .global         _k
_k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/               @P0 BRA `(.L_x_3) ;
.L_x_0:
        /*0020*/                   LOP3.LUT R1, R0, 0x3, RZ, 0xc0, !PT ;
        /*0030*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0040*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0050*/                   IMMA.16832.S8.S8.SAT R4, R8.ROW, R12.COL, R4 ;
        /*0060*/                   IMMA.16832.S8.S8.SAT R16, R8.ROW, R14.COL, R16 ;
        /*0070*/                   FFMA R1, R2, R3, R4 ;
        /*0080*/                   IMAD.SHL.U32 R2, R1, 0x10, RZ ;
        /*0090*/                   LDL R5, [R1+0x8] ;
        /*00a0*/                   MUFU.EX2 R6, R6 ;
        /*00b0*/                   F2FP.F16.F32.PACK_AB R7, R6, R5 ;
        /*00c0*/                   UIADD3 UR4, UR4, 0x80, URZ ;
        /*00d0*/               @P1 BRA `(.L_x_1) ;
.L_x_3:
        /*00e0*/                   EXIT ;
"""


@pytest.fixture
def sass():
    return load_benchmark("sass_count")


def test_the_tile_loop_is_the_backward_branch_with_the_most_mmas(sass):
    instrs, labels = sass.parse_sass(SAMPLE)
    assert [i.op for i in instrs][:3] == ["S2R", "BRA", "LOP3"] and len(instrs) == 15
    assert labels == {0: 0x20, 1: 0x50, 3: 0xE0}
    loop = sass.tile_loop(instrs, labels)  # the forward branch to .L_x_3 is not a loop; .L_x_0 has one MMA
    assert [i.addr for i in loop] == list(range(0x50, 0xE0, 0x10))
    pipes = {p: sum(i.pipe == p for i in loop) for p in sass.PIPES}
    assert pipes == {"alu": 0, "fma": 2, "xu": 1, "tensor": 2, "lsu": 1, "cvt": 1, "uniform": 1, "ctrl": 1,
                     "other": 0}


def test_no_loop_and_bad_options_are_refused(sass):
    instrs, labels = sass.parse_sass(SAMPLE.split(".L_x_1:")[0])
    with pytest.raises(RuntimeError, match="no loop"):
        sass.tile_loop([i for i in instrs if i.op != "BRA"], labels)
    assert sass.parse_opts(["int8_scores=True", "max_registers=168", "lean_tiles=False"]) == dict(
        int8_scores=True, max_registers=168, lean_tiles=False)
    with pytest.raises(SystemExit, match="key=value"):
        sass.parse_opts(["int8_scores"])
    with pytest.raises(SystemExit, match="unknown; choose one of"):
        sass.main(["--set", "nope"])


def test_the_table_is_appended_as_a_results_section(sass, tmp_path):
    results = tmp_path / "RESULTS.md"
    rows = [["default", 168, 152, 1740, *range(9), 0], ["lean tiles", 168, 160, 1606, *range(9), 17]]
    text = sass.append_results(str(results), rows, "abc1234", 168)
    assert results.read_text() == text
    assert "## Decode split kernel, sm_90 SASS per 128-token tile and warp: " in text and "commit abc1234" in text
    assert "nothing ran" in text and "register cap 168" in text and "Command: `python benchmarks/sass_count.py" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert lines[0].startswith("| variant | registers | stack B | instructions | alu |") and len(lines) == 4
    assert lines[3] == "| lean tiles | 168 | 160 | 1606 | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 17 |"


@pytest.mark.slow
def test_the_gluon_split_kernel_compiles_and_its_tile_loop_is_counted():
    if not (H200_TRITON / "triton").is_dir():
        pytest.skip(f"no Triton in {H200_TRITON}: make setup installs the H200 image's there")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(H200_TRITON), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sass_count.py"), "--opt", "int8_scores=True",
                        "--opt", "int8_values=True", "--max-registers", "0", "--top", "12"],
                       env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    head, _, row, top = r.stdout.strip().splitlines()
    cols = dict(zip(head.split()[1:], row.split()[-14:], strict=True))  # the name has spaces, the counts none
    assert cols["kernel"] == "_decode_rows_async_kernel"
    assert int(cols["tensor"]) == 64  # int8 scores and values: 32 + 32 k = 32 MMAs per 128-token tile
    assert sum(int(cols[p]) for p in ("alu", "fma", "xu", "tensor", "lsu", "cvt", "uniform", "ctrl", "other")) \
        == int(cols["total"]) > 1000
    assert "IMMA 64" in top
