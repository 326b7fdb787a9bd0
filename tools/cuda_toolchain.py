"""The sm_90a toolchain of tools/epilogue_kernels.py: nvcc, cuobjdump and the CUTLASS headers found, and what
ptxas and cuobjdump report of a kernel read back (no GPU).

The CUTLASS headers come from the ``nvidia-cutlass`` wheel (tools/dev_setup.sh pins it), found through its
installed files, not imported. nvcc: ``$NVCC``, else /usr/local/bin/nvcc, /usr/local/cuda/bin, PATH; cuobjdump
(with its nvdisasm, which -sass needs): beside nvcc, on PATH, or the copy in the ``triton`` package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCH = "90a"
# -DNDEBUG: CUTLASS's device asserts are calls, and a call between WGMMAs makes ptxas serialise them (its C7510
# warning); CUTLASS's own builds define it too.
NVCC_FLAGS = [f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}", "-std=c++17", "--expt-relaxed-constexpr", "-O3",
              "-DNDEBUG"]
# fusedloss_epilogue_kernel_info's fields (csrc/sm90_epilogue.h)
INFO_FIELDS = ["threads", "min_blocks_per_sm", "dynamic_shared_bytes", "stages", "tile_m", "tile_n", "tile_k",
               "cluster_m", "cluster_n", "epi_tile_m", "epi_tile_n"]
SASS_OPS = {  # reported name: opcode prefix
    "HGMMA": "HGMMA",
    "UTMALDG": "UTMALDG",
    "MUFU.EX2": "MUFU.EX2",
    "SHFL": "SHFL",
    "STG": "STG",
    "USETMAXREG": "USETMAXREG",
    "STL": "STL",
    "LDL": "LDL",
}

_spec = importlib.util.spec_from_file_location("_sass_counts_for_toolchain",
                                               ROOT / "benchmarks" / "model" / "make_sass_counts.py")
_sass_counts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sass_counts)
find_nvcc = _sass_counts.find_nvcc
find_cuobjdump = _sass_counts.find_cuobjdump


def cutlass_dist():
    """(CUTLASS include dirs, nvidia-cutlass version); FileNotFoundError when the wheel is missing."""
    try:
        dist = importlib.metadata.distribution("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("nvidia-cutlass is not installed (pip install --no-deps nvidia-cutlass==4.2.0.0, "
                                "as tools/dev_setup.sh does)") from None
    source = Path(dist.locate_file("cutlass_library")) / "source"
    dirs = [source / "include", source / "tools" / "util" / "include"]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise FileNotFoundError(f"nvidia-cutlass {dist.version} lacks the CUTLASS headers: {', '.join(missing)}")
    return dirs, dist.version


def toolchain_missing(read_back: bool = True) -> str:
    """Why the epilogue kernels cannot be compiled here (and, with ``read_back``, its SASS read), or '' when it can."""
    try:
        nvcc = find_nvcc()
        if read_back:
            find_cuobjdump(nvcc)
        cutlass_dist()
    except FileNotFoundError as exc:
        return str(exc)
    return ""


def _version_line(exe: str) -> str:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True).stdout
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return next((ln for ln in lines if "release" in ln), lines[-1])


def _header_version(include: Path) -> str:
    text = (include / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{k} (\d+)", text).group(1) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def _commit() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def parse_resource_usage(text: str, mark: str) -> tuple[str, dict]:
    """(mangled kernel name, {REG, STACK, SHARED, LOCAL}) from cuobjdump --dump-resource-usage."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*Function (\S+):", line)
        if m and mark in m.group(1):
            usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", lines[i + 1]))
            return m.group(1), {k.lower(): int(v) for k, v in usage.items()}
    raise ValueError(f"no function named with {mark} in cuobjdump's resource usage")


def sass_counts(sass: str, mark: str) -> dict:
    """Instruction counts of the kernel (the function whose name holds ``mark``)."""
    funcs = _sass_counts.functions(sass)
    code = next((c for name, c in funcs.items() if mark in name), None)
    if code is None:
        raise ValueError(f"no function named with {mark} in the SASS")
    ops = [_sass_counts._opcode(text) for _, text in code]
    counts = {name: sum(op.startswith(prefix) for op in ops) for name, prefix in SASS_OPS.items()}
    counts["instructions"] = sum(op != "NOP" for op in ops)
    counts["multicast_tma_loads"] = sum(op.startswith("UTMALDG") and ".MULTICAST" in op for op in ops)
    # What the code really uses: the highest general register named, + 1 (RZ is not one), and the per-thread
    # budgets setmaxnreg sets (the consumer warpgroups' allocation, the producer's release).
    regs = [int(r) for _, text in code for r in re.findall(r"\bR(\d+)\b", text)]
    counts["registers_named"] = max(regs) + 1 if regs else 0
    for kind in ("TRY_ALLOC", "DEALLOC"):
        values = [int(m.group(1), 16) for _, text in code
                  for m in [re.search(rf"USETMAXREG\.{kind}\S*\s+(?:UP\d,\s*)?0x([0-9a-f]+)", text)] if m]
        counts[f"setmaxnreg_{kind.lower()}"] = max(values) if values else None
    return counts
