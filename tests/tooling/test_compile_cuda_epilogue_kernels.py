"""The CUDA backend's sm_90 epilogue kernels (csrc/sm90_epilogue*.cu; docs/design.md, "The statistics in the GEMM
epilogue") compile for sm_90a into what they claim to be: warpgroup MMA fed by TMA, warp-specialised, the
statistics' exponentials and lane merge in the epilogue, the d logits stored by TMA, no spills, no local memory,
within the launch bound and sm_90's shared memory. Compile-only: tools/epilogue_kernels.py does the work."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("epilogue_kernels_tool", ROOT / "tools" / "epilogue_kernels.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["epilogue_kernels_tool"] = tool
spec.loader.exec_module(tool)

MISSING = tool.toolchain_missing()
SM90_MAX_DYNAMIC_SHARED = 232448  # sm_90's opt-in shared memory per block (227 KiB)
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"cannot compile the epilogue kernels: {MISSING}")


@pytest.fixture(scope="module")
def report():
    return tool.build()


def test_every_kernel_is_built(report):
    assert set(report["kernels"]) == {f"{k}/{d}" for k in tool.KINDS for d in tool.DTYPES}, report["kernels"].keys()


@pytest.mark.parametrize("kind", sorted(tool.KINDS))
@pytest.mark.parametrize("dtype", sorted(tool.DTYPES))
def test_epilogue_kernel_compiles_into_a_tma_wgmma_kernel_without_spills(report, kind, dtype):
    k = report["kernels"][f"{kind}/{dtype}"]
    info, usage, ptxas, sass = k["info"], k["resources"], k["ptxas"], k["sass"]
    assert k["kernel"].startswith("_ZN7cutlass13device_kernel") and "GemmUniversal" in k["kernel"]
    # no spills, no stack, no local memory
    assert ptxas["spill_stores"] == 0 and ptxas["spill_loads"] == 0, ptxas
    assert usage["local"] == 0 and usage["stack"] == 0 and sass["STL"] == 0 and sass["LDL"] == 0, (usage, sass)
    # 384 threads, 1 CTA per SM: 168 registers per thread, ptxas and cuobjdump agree
    assert info["threads"] == 384 and info["min_blocks_per_sm"] == 1 and k["register_bound"] == 168, info
    assert 0 < usage["reg"] <= k["register_bound"] and ptxas["ptxas_registers"] == usage["reg"]
    # warpgroup MMA, TMA loads (one multicast across the 2 x 1 cluster), setmaxnreg's warp specialisation
    assert sass["HGMMA"] > 0 and sass["UTMALDG"] > 0 and sass["multicast_tma_loads"] > 0, sass
    assert sass["USETMAXREG"] >= 2 and 0 < sass["registers_named"] <= sass["setmaxnreg_try_alloc"], sass
    assert 2 * 128 * sass["setmaxnreg_try_alloc"] + 128 * sass["setmaxnreg_dealloc"] <= 65536, sass
    # fits: at least 3 mainloop stages in the shared memory sm_90 grants
    assert info["dynamic_shared_bytes"] + usage["shared"] <= SM90_MAX_DYNAMIC_SHARED and info["stages"] >= 3, info
    # at least one exponential per logit a consumer thread holds (128 x 256 over 256 consumer threads)
    assert sass["MUFU.EX2"] >= info["tile_m"] * info["tile_n"] // (info["threads"] - 128), sass
    if kind == "dlogits":  # d logits leave by TMA store; no lane merge
        assert sass["UTMASTG"] > 0, sass
    else:  # no logits stored: no TMA store; the lane merge's shuffles
        assert sass["UTMASTG"] == 0 and sass["SHFL"] > 0, sass
    # ptxas did not serialise the WGMMAs (its C7510 warning: a call between them, e.g. an assert)
    assert not any("C7510" in w or "serialized" in w for w in report["warnings"]), report["warnings"]


def test_checked_in_report_is_the_kernels_as_built(report):
    """benchmarks/results/epilogue-kernels-sm90.json describes these sources (same nvcc and CUTLASS)."""
    saved = json.loads((ROOT / "benchmarks" / "results" / f"{tool.STEM}.json").read_text())
    if (saved["nvcc"], saved["cutlass_headers"]) != (report["nvcc"], report["cutlass_headers"]):
        pytest.skip(f"checked-in report is from {saved['nvcc']}, CUTLASS {saved['cutlass_headers']}")
    assert saved["flags"] == report["flags"]
    for lab, k in report["kernels"].items():
        for key in ("kernel", "info", "register_bound", "resources", "ptxas", "sass"):
            assert saved["kernels"][lab][key] == k[key], f"{lab} {key} differs: run python tools/epilogue_kernels.py"


def test_label_reads_kind_and_dtype_from_mangled_names():
    stats = ("_ZN7cutlass13device_kernelI...10bfloat16_t...22Sm90EpilogueStatisticsIN4cute5tupleIJNS1_1CILi128EEEE"
             "EELb1EEE")
    assert tool.label(stats) == "statistics_entropy/bf16"
    assert tool.label(stats.replace("Lb1E", "Lb0E").replace("10bfloat16_t", "6half_t")) == "statistics/fp16"
    assert tool.label("_ZN...6half_t...19Sm90EpilogueDlogitsIN4cute5tupleE") == "dlogits/fp16"


def test_build_without_cutlass_says_the_epilogue_kernels_are_not_built(tmp_path):
    """setup.py with no CUTLASS headers: the extension's build goes on, and its record says why the epilogue
    kernels are missing (fusedloss/_build_info.py, read by the backend's message)."""
    import os
    import subprocess

    env = {**os.environ, "FUSEDLOSS_CUTLASS_DIR": str(tmp_path / "none"), "FUSEDLOSS_CUDA_ARCHS": "90a"}
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    info = (tmp_path / "lib" / "fusedloss" / "_build_info.py").read_text()
    assert f"CUDA_EPILOGUE = 'not built: FUSEDLOSS_CUTLASS_DIR={tmp_path / 'none'} lacks the CUTLASS headers'" in info
