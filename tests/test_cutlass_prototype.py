"""The CUTLASS 3 epilogue prototype (csrc/prototypes/, docs/design.md "Beyond the bound of this design") compiles
for sm_90a into the kernel it claims to be: warpgroup MMA fed by TMA, the fold's exponentials in the epilogue, no
spills, within its launch bound. Compile-only: no GPU has run it. tools/cutlass_prototype.py does the work."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("cutlass_prototype_tool", ROOT / "tools" / "cutlass_prototype.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["cutlass_prototype_tool"] = tool
spec.loader.exec_module(tool)

MISSING = tool.toolchain_missing()
# sm_90's opt-in limit of shared memory per block (227 KiB)
SM90_MAX_DYNAMIC_SHARED = 232448


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The one compile of this module (about a minute of nvcc on two cores): the report, and the folder where
    the shared object stays for the tests that load it."""
    keep = tmp_path_factory.mktemp("proto-lib")
    return tool.build(keep=keep), keep


@pytest.fixture(scope="module")
def report(built):
    return built[0]


@pytest.mark.skipif(bool(MISSING), reason=f"cannot compile the CUTLASS prototype: {MISSING}")
def test_prototype_compiles_into_a_tma_wgmma_kernel_without_spills(report):
    info, usage, ptxas, sass = report["info"], report["resources"], report["ptxas"], report["sass"]
    # the kernel is CUTLASS's device_kernel around a GemmUniversal whose epilogue holds the prototype's EVT node
    assert report["kernel"].startswith("_ZN7cutlass13device_kernel") and tool.KERNEL_MARK in report["kernel"]
    assert "GemmUniversal" in report["kernel"] and "Sm90TreeVisitor" in report["kernel"]
    # no spills, no local memory
    assert ptxas["spill_stores"] == 0 and ptxas["spill_loads"] == 0, ptxas
    assert usage["local"] == 0 and usage["stack"] == 0 and sass["STL"] == 0 and sass["LDL"] == 0, (usage, sass)
    # registers within the launch bound (384 threads, 1 CTA per SM: 168), and ptxas and cuobjdump agree
    assert info["threads"] == 384 and info["min_blocks_per_sm"] == 1, info
    assert report["register_bound"] == 168
    assert 0 < usage["reg"] <= report["register_bound"] and ptxas["ptxas_registers"] == usage["reg"]
    # warpgroup MMA, TMA loads (one of them multicast across the 2 x 1 cluster), setmaxnreg's warp specialisation
    assert sass["HGMMA"] > 0 and sass["UTMALDG"] > 0 and sass["multicast_tma_loads"] > 0, sass
    assert sass["USETMAXREG"] >= 2, sass
    # the code's own registers fit the consumer warpgroups' setmaxnreg budget, and the budgets fit the register
    # file: two consumer warpgroups at their allocation and the producer warpgroup at its release
    assert 0 < sass["registers_named"] <= sass["setmaxnreg_try_alloc"], sass
    assert 2 * 128 * sass["setmaxnreg_try_alloc"] + 128 * sass["setmaxnreg_dealloc"] <= 65536, sass
    # ptxas did not serialise the WGMMAs (its C7510 warning: a call between them, e.g. an assert)
    assert not any("C7510" in w or "serialized" in w for w in report["warnings"]), report["warnings"]
    # the fold is there: at least one exponential per logit a consumer thread holds (128 x 256 over 256
    # threads), and the lane merge's shuffles
    consumers = info["threads"] - 128  # one producer warpgroup
    assert sass["MUFU.EX2"] >= info["tile_m"] * info["tile_n"] // consumers, sass
    assert sass["SHFL"] > 0
    # it fits: the mainloop keeps at least 3 stages in the shared memory sm_90 grants
    assert info["dynamic_shared_bytes"] + usage["shared"] <= SM90_MAX_DYNAMIC_SHARED and info["stages"] >= 3, info


@pytest.mark.skipif(bool(MISSING), reason=f"cannot compile the CUTLASS prototype: {MISSING}")
def test_checked_in_report_is_the_kernel_as_built(report):
    """benchmarks/results/cutlass-prototype-sm90.json describes this source: with the same nvcc and CUTLASS,
    the same kernel, resources and instruction counts (the compile time and commit may differ)."""
    saved = json.loads((ROOT / "benchmarks" / "results" / f"{tool.STEM}.json").read_text())
    if (saved["nvcc"], saved["cutlass_headers"]) != (report["nvcc"], report["cutlass_headers"]):
        pytest.skip(f"checked-in report is from {saved['nvcc']}, CUTLASS {saved['cutlass_headers']}")
    for key in ("kernel", "info", "register_bound", "resources", "ptxas", "sass", "flags"):
        assert saved[key] == report[key], f"{key} differs: run python tools/cutlass_prototype.py and commit"


@pytest.mark.skipif(bool(MISSING), reason=f"cannot compile the CUTLASS prototype: {MISSING}")
def test_host_entry_points_are_in_the_object_and_check_their_arguments(built):
    """The launcher benchmarks/cutlass_prototype_device.py calls on a GPU is exported from the same object, with
    its workspace query and error message; without a device, a problem CUTLASS cannot run is refused before any
    device call (no pointers; hidden rows not 16-byte aligned)."""
    _, keep = built
    lib_path = keep / tool.LIB_NAME
    assert (keep / tool.HASH_FILE).read_text().strip() == tool.source_hash()
    nm = shutil.which("nm")
    if nm:
        exported = set(re.findall(r"\bT (fusedloss_proto_\w+)", subprocess.run(
            [nm, "-D", "--defined-only", str(lib_path)], capture_output=True, text=True, check=True).stdout))
        assert exported == {"fusedloss_proto_softmax_partials", "fusedloss_proto_workspace_bytes",
                            "fusedloss_proto_last_error", "fusedloss_proto_kernel_info"}, exported
    device = _load_device_driver()
    proto = device.Prototype(lib_path)  # binds every entry point: an absent one raises AttributeError
    assert (proto.info["tile_m"], proto.info["tile_n"]) == (device.TILE_M, device.TILE_N)
    # the persistent tile scheduler and the EVT node need no workspace, at the device check's shapes too
    assert [proto.workspace_bytes(n, v, 4096) for n, v in ((4096, 128256), (16384, 151936))] == [0, 0]
    invalid_problem = 4  # cutlass::Status::kErrorInvalidProblem
    assert proto.run(None, None, 16, 1000, 64, None, None, None, None, None, 0, None) == invalid_problem
    assert proto.last_error().decode().startswith("can_implement: Error Invalid Problem")
    fake = 1 << 20  # never dereferenced: can_implement refuses d = 60 (rows of 120 bytes) first
    assert proto.run(fake, fake, 16, 1000, 60, fake, fake, fake, fake, None, 0, None) == invalid_problem


def _load_device_driver():
    spec = importlib.util.spec_from_file_location("cutlass_prototype_device",
                                                  ROOT / "benchmarks" / "cutlass_prototype_device.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_source_hash_follows_the_included_headers(tmp_path):
    """A prebuilt object is trusted by this hash: it must change with any header the source includes."""
    (tmp_path / "inc.h").write_text("#pragma once\n#include \"fusedloss/math.h\"\nconstexpr int k = 1;\n")
    src = tmp_path / "k.cu"
    src.write_text('#include "inc.h"\n')
    first = tool.source_hash(src)
    assert first == tool.source_hash(src) and len(first) == 16
    (tmp_path / "inc.h").write_text("#pragma once\n#include \"fusedloss/math.h\"\nconstexpr int k = 2;\n")
    assert tool.source_hash(src) != first
    seen = set()
    tool._local_includes(tool.SOURCE.resolve(), seen)  # the prototype: itself, its step and merge, math.h
    assert {p.name for p in seen} == {"sm90_softmax_partials.cu", "softmax_partials.h", "math.h"}


def test_the_prototype_is_not_part_of_the_library_or_its_build():
    """Never called, never built into the extension, never shipped."""
    for path in list((ROOT / "fusedloss").rglob("*.py")) + [ROOT / "setup.py"]:
        text = path.read_text()
        assert "prototypes" not in text and "fusedloss_proto" not in text, path
    assert re.search(r"^prune csrc/prototypes$", (ROOT / "MANIFEST.in").read_text(), re.M)
    project = (ROOT / "pyproject.toml").read_text().split("[project]")[1]
    deps = project.split("[project.optional-dependencies]")[0]
    assert "cutlass" not in deps  # never a runtime dependency: the build (the epilogue kernels' headers) and tests


def test_parsers_on_hand_written_tool_output():
    """The readers of ptxas -v, cuobjdump --dump-resource-usage and -sass, on text in their formats."""
    mark = tool.KERNEL_MARK
    log = (
        "ptxas info    : Compiling entry function '_Z5otherv' for 'sm_90a'\n"
        "ptxas info    : Function properties for _Z5otherv\n"
        "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers\n"
        f"ptxas info    : Compiling entry function '_Z3k{mark}v' for 'sm_90a'\n"
        f"ptxas info    : Function properties for _Z3k{mark}v\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem\n"
    )
    assert tool.parse_ptxas(log) == {"stack_frame": 0, "spill_stores": 0, "spill_loads": 0, "ptxas_registers": 168}
    usage = (
        "Resource usage:\n Common:\n  GLOBAL:0\n"
        " Function _Z5otherv:\n  REG:40 STACK:8 SHARED:0 LOCAL:8 CONSTANT[0]:100\n"
        f" Function _Z3k{mark}v:\n  REG:168 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:2432 TEXTURE:0\n"
    )
    assert tool.parse_resource_usage(usage) == (f"_Z3k{mark}v", {"reg": 168, "stack": 0, "shared": 1024, "local": 0})
    sass = (
        "\t\tFunction : _Z5otherv\n"
        "        /*0000*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;\n"
        f"\t\tFunction : _Z3k{mark}v\n"
        "        /*0000*/                   UTMALDG.3D.MULTICAST [UR8], [UR4], UR10 ;\n"
        "        /*0010*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;\n"
        "        /*0020*/              @!P0 MUFU.EX2 R5, R4 ;\n"
        "        /*0028*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;\n"
        "        /*002c*/                   USETMAXREG.DEALLOC.CTAPOOL 0x28 ;\n"
        "        /*0030*/                   STL [R1], R2 ;\n"
        "        /*0040*/                   NOP ;\n"
    )
    counts = tool.sass_counts(sass)
    assert (counts["HGMMA"], counts["UTMALDG"], counts["multicast_tma_loads"], counts["MUFU.EX2"]) == (1, 1, 1, 1)
    assert (counts["STL"], counts["LDL"], counts["instructions"]) == (1, 0, 6)
    assert (counts["registers_named"], counts["setmaxnreg_try_alloc"], counts["setmaxnreg_dealloc"]) == (25, 232, 40)
    with pytest.raises(ValueError, match=mark):
        tool.sass_counts(sass.split(f"\t\tFunction : _Z3k{mark}v")[0])


# --------------------------------------------------------------------------------------------------
# The fold's math on the host: csrc/prototypes/softmax_partials.h compiled by the host compiler, driven in the
# kernel's lane order by softmax_partials_host.cpp, against float64.

CXX = next((c for c in (os.environ.get("CXX"), shutil.which("c++"), shutil.which("g++")) if c), None)


@pytest.fixture(scope="module")
def fold_tile(tmp_path_factory):
    lib = tmp_path_factory.mktemp("proto") / "softmax_partials_host.so"
    subprocess.run([CXX, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{ROOT / 'csrc'}", "-o", str(lib),
                    str(ROOT / "csrc" / "prototypes" / "softmax_partials_host.cpp")], check=True)
    fn = ctypes.CDLL(str(lib)).fl_proto_fold_tile
    fn.restype = None

    def run(z: np.ndarray, valid: int | None = None):
        z = np.ascontiguousarray(z, dtype=np.float32)
        rows, cols = z.shape
        m, t = np.empty(rows, np.float32), np.empty(rows, np.float32)
        ptr = lambda a: a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        fn(ptr(z), rows, cols, cols if valid is None else valid, ptr(m), ptr(t))
        return m, t

    return run


def _reference(z: np.ndarray):
    """(max, sum e^(z - max) - 1) in float64, the latter without the maximum's own 1 subtracted."""
    z = z.astype(np.float64)
    m = z.max(axis=1)
    e = np.exp(z - m[:, None])
    first = z.argmax(axis=1)
    e[np.arange(len(z)), first] = 0.0  # t: every column but the (first) maximum's own e^0 = 1
    return m, e.sum(axis=1)


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler (c++ / g++ / $CXX)")
def test_host_fold_of_a_tile_matches_float64(fold_tile):
    rng = np.random.default_rng(0)
    z = rng.standard_normal((64, 256)).astype(np.float32) * 3
    z[1] += 1e4  # extreme logits: t relative to the maximum keeps its digits
    z[2, 17] = 30.0  # a confident row: t ~ 1e-11, which s = 1 + t in fp32 could not hold
    z[3] = -1e4
    z[3, [5, 200]] = 2.0  # a tie and nothing else: t is the twin's 1 exactly
    m, t = fold_tile(z)
    m_ref, t_ref = _reference(z)
    assert np.array_equal(m, m_ref.astype(np.float32))
    np.testing.assert_allclose(t, t_ref, rtol=2e-5)
    assert 0 < t[2] < 1e-9 and t[3] == 1.0


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler (c++ / g++ / $CXX)")
def test_host_fold_skips_the_zero_fill_and_merges_empty_lanes(fold_tile):
    rng = np.random.default_rng(1)
    z = rng.standard_normal((4, 256)).astype(np.float32)
    z[:, 100:] = 1e3  # beyond V: must not count
    m, t = fold_tile(z, valid=100)
    m_ref, t_ref = _reference(z[:, :100])
    assert np.array_equal(m, m_ref.astype(np.float32))
    np.testing.assert_allclose(t, t_ref, rtol=2e-5)
    # three columns: lanes 2 and 3 hold nothing and merge in as empty sides (m = -inf), not as NaN
    m, t = fold_tile(z, valid=3)
    m_ref, t_ref = _reference(z[:, :3])
    assert np.array_equal(m, m_ref.astype(np.float32)) and np.all(np.isfinite(t))
    np.testing.assert_allclose(t, t_ref, rtol=2e-6)
    # a NaN logit reaches t
    z[0, 7] = np.nan
    m, t = fold_tile(z, valid=100)
    assert np.isnan(t[0]) and np.all(np.isfinite(t[1:]))
