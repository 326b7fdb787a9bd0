"""Compile the CUDA backend's sm_90 epilogue kernels for sm_90a and report what ptxas made of each (no GPU).

    python tools/epilogue_kernels.py              # compile, print the table, write the results below
    python tools/epilogue_kernels.py --no-write   # compile and print only

csrc/sm90_epilogue_statistics.cu and csrc/sm90_epilogue_dlogits.cu (csrc/sm90_epilogue.cuh; docs/design.md, "The
statistics in the GEMM epilogue") are compiled with the device flags setup.py gives them inside the extension, into
a shared object of this tool's own, then read back per kernel (statistics and statistics with the entropy, d logits;
bf16 and fp16): ptxas's registers, stack and spills; cuobjdump's registers, shared and local memory; the SASS
counts that say each is what it claims (HGMMA, UTMALDG, UTMASTG: the d logits' TMA store, MUFU.EX2, SHFL, STL/LDL);
the launch constants from ``fusedloss_epilogue_kernel_info``. Writes benchmarks/results/epilogue-kernels-sm90.{md,json}
with the nvcc, cuobjdump and CUTLASS versions and the compile time. tests/tooling/test_compile_cuda_epilogue_kernels.py
runs it. The CUTLASS headers, nvcc and cuobjdump are found as tools/cuda_toolchain.py finds them.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "csrc" / "sm90_epilogue_statistics.cu", ROOT / "csrc" / "sm90_epilogue_dlogits.cu"]
RESULTS = ROOT / "benchmarks" / "results"
STEM = "epilogue-kernels-sm90"
MARK = "Sm90Epilogue"  # both EVT nodes' names start with it

_spec = importlib.util.spec_from_file_location("_cuda_toolchain_for_epilogue",
                                               ROOT / "tools" / "cuda_toolchain.py")
toolchain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(toolchain)
NVCC_FLAGS = toolchain.NVCC_FLAGS  # setup.py's epilogue flags for the device code (-O3, c++17, NDEBUG)
SASS_OPS = {**toolchain.SASS_OPS, "UTMASTG": "UTMASTG"}
# (kind, dtype code) -> the info call's kernel index (fusedloss_epilogue_kernel_info)
KINDS = {"statistics": 0, "statistics_entropy": 1, "dlogits": 2}
DTYPES = {"bf16": 1, "fp16": 2}


def toolchain_missing() -> str:
    return toolchain.toolchain_missing(read_back=True)


def label(mangled: str) -> str:
    """``statistics_entropy/bf16`` and the like, from a kernel's mangled name."""
    if "Sm90EpilogueDlogits" in mangled:
        kind = "dlogits"
    else:
        tail = mangled.split("Sm90EpilogueStatistics", 1)[1]
        kind = "statistics_entropy" if re.search(r"Lb([01])E", tail).group(1) == "1" else "statistics"
    bf = mangled.find("bfloat16_t")
    hf = mangled.find("half_t")
    dtype = "bf16" if bf >= 0 and (hf < 0 or bf < hf) else "fp16"
    return f"{kind}/{dtype}"


def parse_ptxas_all(log: str) -> dict:
    """{mangled name: {ptxas_registers, stack_frame, spill_stores, spill_loads}} for every epilogue kernel."""
    out, current = {}, None
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([^' ]+)'?", line)
        if m:
            current = m.group(1) if MARK in m.group(1) else None
            continue
        if current is None:
            continue
        entry = out.setdefault(current, {})
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            entry["stack_frame"], entry["spill_stores"], entry["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            entry["ptxas_registers"] = int(m.group(1))
    return out


def build(keep: Path | None = None) -> dict:
    nvcc = toolchain.find_nvcc()
    cuobjdump = toolchain.find_cuobjdump(nvcc)
    includes, wheel_version = toolchain.cutlass_dist()
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(keep or tmp) / "fusedloss_epilogue_sm90a.so"
        lib.parent.mkdir(parents=True, exist_ok=True)
        cmd = [nvcc, *NVCC_FLAGS, *[f"-I{d}" for d in includes], f"-I{ROOT / 'csrc'}", "-Xptxas=-v", "-shared",
               "-Xcompiler", "-fPIC", "-o", str(lib), *map(str, SOURCES)]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"nvcc failed ({r.returncode}):\n{r.stderr[-4000:]}")
        warnings = sorted({ln.strip() for ln in r.stderr.splitlines() if "warning" in ln.lower()})
        ptxas = parse_ptxas_all(r.stderr)
        usage_text = subprocess.run([cuobjdump, "--dump-resource-usage", str(lib)], capture_output=True, text=True,
                                    check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", str(lib)], capture_output=True, text=True, check=True).stdout
        so = ctypes.CDLL(str(lib))
        kernels = {}
        names = sorted({name for name in ptxas})
        toolchain.SASS_OPS.update(SASS_OPS)  # count the TMA stores too
        for name in names:
            lab = label(name)
            kind, dtype = lab.split("/")
            _, usage = toolchain.parse_resource_usage(usage_text, name)
            counts = toolchain.sass_counts(sass, name)
            info = (ctypes.c_int * len(toolchain.INFO_FIELDS))()
            so.fusedloss_epilogue_kernel_info(KINDS[kind], DTYPES[dtype], info)
            info = dict(zip(toolchain.INFO_FIELDS, list(info)))
            kernels[lab] = {"kernel": name, "info": info,
                            "register_bound": (65536 // (info["threads"] * info["min_blocks_per_sm"])) // 8 * 8,
                            "resources": usage, "ptxas": ptxas[name], "sass": counts}
    return {
        "sources": [str(s.relative_to(ROOT)) for s in SOURCES],
        "commit": toolchain._commit(),
        "nvcc": toolchain._version_line(nvcc),
        "cuobjdump": toolchain._version_line(cuobjdump),
        "cutlass_wheel": f"nvidia-cutlass {wheel_version}",
        "cutlass_headers": toolchain._header_version(includes[0]),
        "flags": NVCC_FLAGS,
        "compile_seconds": round(seconds, 1),
        "kernels": dict(sorted(kernels.items())),
        "warnings": warnings,
    }


def render(report: dict) -> str:
    head = ["kernel", "regs / bound", "named regs (setmaxnreg)", "spills (B)", "stack / local", "smem KiB (stages)",
            "HGMMA", "UTMALDG", "UTMASTG", "MUFU.EX2", "SHFL", "STL/LDL", "instructions"]
    rows = []
    for lab, k in report["kernels"].items():
        i, u, p, s = k["info"], k["resources"], k["ptxas"], k["sass"]
        rows.append([lab, f"{u['reg']} / {k['register_bound']}",
                     f"{s['registers_named']} ({s['setmaxnreg_try_alloc']}/{s['setmaxnreg_dealloc']})",
                     f"{p.get('spill_stores')}/{p.get('spill_loads')}", f"{u['stack']} / {u['local']}",
                     f"{(i['dynamic_shared_bytes'] + u['shared']) / 1024:.1f} ({i['stages']})", s["HGMMA"],
                     s["UTMALDG"], s["UTMASTG"], s["MUFU.EX2"], s["SHFL"], f"{s['STL']}/{s['LDL']}",
                     s["instructions"]])
    any_k = next(iter(report["kernels"].values()))["info"]
    lines = [
        "# The CUDA backend's sm_90 epilogue kernels, as compiled",
        "",
        f"`python tools/epilogue_kernels.py` at commit {report['commit']}: {', '.join(report['sources'])} compiled for "
        "sm_90a, never run here (no GPU). Static counts, not a measurement of speed.",
        "",
        f"- nvcc: {report['nvcc']}; cuobjdump: {report['cuobjdump']}",
        f"- CUTLASS: {report['cutlass_wheel']} (headers {report['cutlass_headers']})",
        f"- flags: `{' '.join(report['flags'])}`; compile time of both sources: {report['compile_seconds']} s",
        f"- every kernel: {any_k['threads']} threads (1 producer + 2 consumer warpgroups), tile {any_k['tile_m']} x "
        f"{any_k['tile_n']} x {any_k['tile_k']}, cluster {any_k['cluster_m']} x {any_k['cluster_n']}, epilogue "
        f"subtile {any_k['epi_tile_m']} x {any_k['epi_tile_n']}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *["| " + " | ".join(str(c) for c in r) + " |" for r in rows],
        "",
        "Registers: ptxas compiles for the launch bound (64 K over 384 threads); the code's own need is the highest",
        "register named, within the consumer warpgroups' setmaxnreg allocation. smem: dynamic + static.",
        "",
    ]
    if report["warnings"]:
        lines += ["Compiler warnings:", "", *[f"- `{w}`" for w in report["warnings"]], ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the .md and .json go (default: %(default)s)")
    args = ap.parse_args(argv)
    why = toolchain_missing()
    if why:
        print(f"epilogue_kernels: cannot compile: {why}", file=sys.stderr)
        return 2
    report = build()
    text = render(report)
    print(text)
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{STEM}.md").write_text(text)
        (args.out / f"{STEM}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
