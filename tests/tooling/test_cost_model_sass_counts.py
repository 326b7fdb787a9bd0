"""The CUDA kernels' instruction counts the performance model reads (benchmarks/model/sass_counts.py) are those of the
kernels as built: benchmarks/model/make_sass_counts.py compiles csrc/kernels.cu for sm_90a and counts them again."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sass_counts_tool", ROOT / "benchmarks" / "model" / "make_sass_counts.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["sass_counts_tool"] = tool
spec.loader.exec_module(tool)

sys.path.insert(0, str(ROOT))
from benchmarks.model import sass_counts  # noqa: E402


def _toolchain() -> str:
    try:
        tool.find_cuobjdump(tool.find_nvcc())
    except FileNotFoundError as exc:
        return str(exc)
    return ""


@pytest.mark.skipif(bool(_toolchain()), reason=_toolchain() or "toolchain present")
def test_checked_in_table_matches_the_kernels_as_built():
    sass, version = tool.compile_sass()
    counts = tool.table(sass)
    assert counts == sass_counts.KERNELS, ("run python benchmarks/model/make_sass_counts.py and commit "
                                           "benchmarks/model/sass_counts.py")
    assert tool.render(counts, version) == (ROOT / "benchmarks" / "model" / "sass_counts.py").read_text()


def test_every_kernel_the_plans_launch_has_counts():
    """fold / dx over fp32 tiles for every (entropy, teacher, plain) and dx output dtype the CUDA plan names."""
    from benchmarks.model import cost, cuda

    for op in cost.OPS:
        for dtype in ("bfloat16", "float16", "float32"):
            for plain in (True, False):
                w = cost.Workload(op=op, n=4096, d=1024, v=32000, dtype=dtype, plain=plain)
                for kind in ("fold", "dx", "jsd"):
                    row = sass_counts.KERNELS[cuda.kernel_name(kind, w)]
                    assert row["columns"] >= 4 and 0 < row["per_column"] < 200


def test_the_loop_finder_on_a_hand_written_loop():
    """Shortest path through a loop with a rare branch: the branch's body is not counted."""
    sass = """
        Function : _ZN2fl43_GLOBAL__N__x10fold_kernelIfLb0ELb0ELb1EEEvNS_8TileArgsE
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.EF.128 R8, desc[UR4][R2.64] ;
        /*0020*/                   FMNMX R4, R8, R9, !PT ;
        /*0030*/              @!P0 BRA 0x70 ;
        /*0040*/                   MUFU.EX2 R5, R4 ;
        /*0050*/                   FMUL R6, R6, R5 ;
        /*0060*/                   FMUL R7, R7, R5 ;
        /*0070*/                   MUFU.EX2 R10, R8 ;
        /*0080*/                   FADD R11, R11, R10 ;
        /*0090*/                   NOP ;
        /*00a0*/               @P1 BRA 0x10 ;
        /*00b0*/                   EXIT ;
    """
    counts = tool.table(sass)
    row = counts["fold_kernel<float, false, false, true>"]
    # LDG, FMNMX, BRA, MUFU, FADD, (NOP free), BRA back: 6 instructions, 1 MUFU, for 4 columns
    assert row == {"loop_instructions": 6, "loop_mufu": 1, "columns": 4, "per_column": 1.5, "mufu_per_column": 0.25}
