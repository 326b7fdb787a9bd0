"""Compile the CUTLASS 3 epilogue prototype for sm_90a and report what ptxas made of it (no GPU).

    python tools/cutlass_prototype.py              # compile, print the table, write the results below
    python tools/cutlass_prototype.py --no-write   # compile and print only
    python tools/cutlass_prototype.py --prebuild DIR
        # compile only, into DIR/fusedloss_proto_sm90a.so with DIR/PROTO_SOURCES (the sources' hash) and
        # DIR/prototype_build.json: what benchmarks/cutlass_prototype_device.py runs on a GPU without nvcc time

csrc/prototypes/sm90_softmax_partials.cu is the logits GEMM with the softmax statistics in its epilogue, an EVT
node on a TMA / WGMMA warp-specialised kernel (docs/design.md, "Beyond the bound of this design"). It is not part
of the extension: setup.py never builds it, the library never calls it. This tool builds it as a shared object
with nvcc (the flags below), then reads
  * ptxas's report (-Xptxas -v): registers, stack frame, spill stores and loads of the kernel;
  * ``cuobjdump --dump-resource-usage``: registers, stack, static shared and local memory;
  * ``cuobjdump -sass``: counts of the instructions that say the kernel is what it claims (HGMMA: warpgroup
    MMA; UTMALDG: TMA loads; MUFU.EX2: the exponentials of the fold; SHFL: the row merge; STL / LDL: spills);
  * the object's ``fusedloss_proto_kernel_info`` (host constants, no device): threads per block, dynamic shared
    memory, mainloop stages, tile, cluster and epilogue subtile;
and writes benchmarks/results/cutlass-prototype-sm90.{md,json} with the commit, the nvcc, cuobjdump and CUTLASS
versions, the flags and the compile time. tests/test_cutlass_prototype.py runs it and checks the kernel.

The CUTLASS headers come from the ``nvidia-cutlass`` wheel (tools/dev_setup.sh pins it), found through its
installed files, not imported. nvcc: ``$NVCC``, else /usr/local/bin/nvcc, /usr/local/cuda/bin, PATH; cuobjdump
(with its nvdisasm, which -sass needs): beside nvcc, on PATH, or the copy in the ``triton`` package.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "prototypes" / "sm90_softmax_partials.cu"
RESULTS = ROOT / "benchmarks" / "results"
STEM = "cutlass-prototype-sm90"
ARCH = "90a"
# -DNDEBUG: CUTLASS's device asserts are calls, and a call between WGMMAs makes ptxas serialise them (its C7510
# warning); CUTLASS's own builds define it too.
NVCC_FLAGS = [f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}", "-std=c++17", "--expt-relaxed-constexpr", "-O3",
              "-DNDEBUG"]
LIB_NAME = "fusedloss_proto_sm90a.so"  # the shared object's name wherever it is kept (prebuilt, device runs)
HASH_FILE = "PROTO_SOURCES"  # beside a prebuilt one: source_hash() of what it was built from
KERNEL_MARK = "Sm90RowSoftmaxPartials"  # the EVT node's name inside the kernel's mangled name
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

_spec = importlib.util.spec_from_file_location("_sass_counts_for_cutlass",
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
    """Why the prototype cannot be compiled here (and, with ``read_back``, its SASS read), or '' when it can."""
    try:
        nvcc = find_nvcc()
        if read_back:
            find_cuobjdump(nvcc)
        cutlass_dist()
    except FileNotFoundError as exc:
        return str(exc)
    return ""


def _local_includes(path: Path, seen: set) -> None:
    """``path`` and every file it includes with quotes from csrc/ (or its own folder), transitively, into seen."""
    seen.add(path)
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.M):
        for base in (path.parent, ROOT / "csrc"):
            dep = (base / name).resolve()
            if dep.is_file():
                if dep not in seen:
                    _local_includes(dep, seen)
                break


def source_hash(source: Path = SOURCE) -> str:
    """16 hex digits over the source, the repository headers it includes (transitively) and the nvcc flags:
    a prebuilt shared object is run only when built from the same (the CUTLASS headers are the pinned wheel's)."""
    files: set = set()
    _local_includes(Path(source).resolve(), files)
    h = hashlib.sha256(" ".join(NVCC_FLAGS).encode())
    for f in sorted(files):
        rel = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
        h.update(f"\0{rel.as_posix()}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def compile_library(lib: Path, source: Path = SOURCE, extra: tuple = ()) -> tuple:
    """nvcc ``source`` into the shared object ``lib`` with NVCC_FLAGS (+ ``extra``): (seconds, nvcc's stderr).
    RuntimeError when nvcc fails, FileNotFoundError when nvcc or the CUTLASS wheel is missing."""
    nvcc = find_nvcc()
    includes, _ = cutlass_dist()
    flags = NVCC_FLAGS + [f"-I{d}" for d in includes] + [f"-I{ROOT / 'csrc'}"]
    cmd = [nvcc, *flags, *extra, "-shared", "-Xcompiler", "-fPIC", "-o", str(lib), str(source)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return seconds, r.stderr


def prebuild(folder: Path, source: Path = SOURCE) -> dict:
    """The shared object into ``folder`` for a GPU machine that should not spend nvcc's minute: LIB_NAME, its
    source hash in HASH_FILE, and prototype_build.json (versions, flags, compile time)."""
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / LIB_NAME
    (folder / HASH_FILE).unlink(missing_ok=True)  # never a hash beside a library it does not describe
    seconds, _ = compile_library(lib, source)
    info = (ctypes.c_int * len(INFO_FIELDS))()
    ctypes.CDLL(str(lib)).fusedloss_proto_kernel_info(info)  # it loads, and its host constants read back
    _, wheel_version = cutlass_dist()
    meta = {"library": LIB_NAME, "source_hash": source_hash(source), "commit": _commit(),
            "nvcc": _version_line(find_nvcc()), "cutlass_wheel": f"nvidia-cutlass {wheel_version}",
            "flags": NVCC_FLAGS, "compile_seconds": round(seconds, 1), "info": dict(zip(INFO_FIELDS, list(info)))}
    (folder / "prototype_build.json").write_text(json.dumps(meta, indent=1) + "\n")
    (folder / HASH_FILE).write_text(meta["source_hash"] + "\n")
    return meta


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


def parse_ptxas(log: str, mark: str = KERNEL_MARK) -> dict:
    """Registers, stack frame and spills of the function whose name holds ``mark``, from nvcc -Xptxas -v."""
    out, current = {}, False
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([^' ]+)'?", line)
        if m:
            current = mark in m.group(1)
            continue
        if not current:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out["stack_frame"], out["spill_stores"], out["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out["ptxas_registers"] = int(m.group(1))
    return out


def parse_resource_usage(text: str, mark: str = KERNEL_MARK) -> tuple[str, dict]:
    """(mangled kernel name, {REG, STACK, SHARED, LOCAL}) from cuobjdump --dump-resource-usage."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*Function (\S+):", line)
        if m and mark in m.group(1):
            usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", lines[i + 1]))
            return m.group(1), {k.lower(): int(v) for k, v in usage.items()}
    raise ValueError(f"no function named with {mark} in cuobjdump's resource usage")


def sass_counts(sass: str, mark: str = KERNEL_MARK) -> dict:
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


def build(source: Path = SOURCE, keep: Path | None = None) -> dict:
    """Compile ``source`` and read the kernel back: the report written to benchmarks/results. ``keep``: a folder
    where the shared object stays (as LIB_NAME, with its HASH_FILE), for a caller that loads it afterwards."""
    nvcc = find_nvcc()
    cuobjdump = find_cuobjdump(nvcc)
    includes, wheel_version = cutlass_dist()
    with tempfile.TemporaryDirectory() as tmp:
        lib = Path(keep or tmp) / LIB_NAME
        lib.parent.mkdir(parents=True, exist_ok=True)
        seconds, stderr = compile_library(lib, source, ("-Xptxas=-v",))
        if keep:
            (lib.parent / HASH_FILE).write_text(source_hash(source) + "\n")
        warnings = sorted({ln.strip() for ln in stderr.splitlines() if "warning" in ln.lower()})
        ptxas = parse_ptxas(stderr)
        usage_text = subprocess.run([cuobjdump, "--dump-resource-usage", str(lib)], capture_output=True, text=True,
                                    check=True).stdout
        kernel, usage = parse_resource_usage(usage_text)
        sass = subprocess.run([cuobjdump, "-sass", str(lib)], capture_output=True, text=True, check=True).stdout
        counts = sass_counts(sass)
        info = (ctypes.c_int * len(INFO_FIELDS))()
        ctypes.CDLL(str(lib)).fusedloss_proto_kernel_info(info)
        info = dict(zip(INFO_FIELDS, list(info)))
    # The register budget ptxas compiles the whole kernel for: 64 K registers over the launch bound's threads and
    # blocks, allocated in units of 8 (the consumer warpgroups raise theirs at run time with setmaxnreg).
    register_bound = (65536 // (info["threads"] * info["min_blocks_per_sm"])) // 8 * 8
    return {
        "source": str(source.relative_to(ROOT)) if source.is_relative_to(ROOT) else str(source),
        "commit": _commit(),
        "nvcc": _version_line(nvcc),
        "cuobjdump": _version_line(cuobjdump),
        "cutlass_wheel": f"nvidia-cutlass {wheel_version}",
        "cutlass_headers": _header_version(includes[0]),
        "flags": NVCC_FLAGS,
        "compile_seconds": round(seconds, 1),
        "kernel": kernel,
        "info": info,
        "register_bound": register_bound,
        "resources": usage,
        "ptxas": ptxas,
        "sass": counts,
        "warnings": warnings,
    }


def render(report: dict) -> str:
    i, u, p, s = report["info"], report["resources"], report["ptxas"], report["sass"]
    rows = [
        ("tile (M, N, K), cluster", f"{i['tile_m']} x {i['tile_n']} x {i['tile_k']}, {i['cluster_m']} x "
                                    f"{i['cluster_n']}"),
        ("epilogue subtile", f"{i['epi_tile_m']} x {i['epi_tile_n']}"),
        ("threads per CTA (launch bound)", f"{i['threads']} ({i['min_blocks_per_sm']} CTA per SM)"),
        ("registers per thread / bound", f"{u['reg']} / {report['register_bound']}"),
        ("spill stores / loads (bytes)", f"{p.get('spill_stores')} / {p.get('spill_loads')}"),
        ("stack / local memory (bytes)", f"{u['stack']} / {u['local']}"),
        ("dynamic shared memory (KiB)", f"{i['dynamic_shared_bytes'] / 1024:.1f} ({i['stages']} mainloop stages)"),
        ("static shared memory (bytes)", f"{u['shared']}"),
        ("SASS: HGMMA / UTMALDG (multicast)", f"{s['HGMMA']} / {s['UTMALDG']} ({s['multicast_tma_loads']})"),
        ("SASS: MUFU.EX2 / SHFL / STG", f"{s['MUFU.EX2']} / {s['SHFL']} / {s['STG']}"),
        ("SASS: STL / LDL", f"{s['STL']} / {s['LDL']}"),
        ("highest register named + 1", f"{s['registers_named']}"),
        ("setmaxnreg: consumer alloc / producer dealloc", f"{s['setmaxnreg_try_alloc']} / "
                                                          f"{s['setmaxnreg_dealloc']}"),
        ("SASS instructions", f"{s['instructions']}"),
        ("compile time (s)", f"{report['compile_seconds']}"),
    ]
    lines = [
        "# CUTLASS 3 sm_90a prototype: logits GEMM with the softmax partials in its epilogue",
        "",
        f"`python tools/cutlass_prototype.py` at commit {report['commit']}: `{report['source']}` compiled, never run "
        "(no GPU has timed it). Static counts of the compiled kernel, not a measurement of speed.",
        "",
        f"- nvcc: {report['nvcc']}; cuobjdump: {report['cuobjdump']}",
        f"- CUTLASS: {report['cutlass_wheel']} (headers {report['cutlass_headers']})",
        f"- flags: `{' '.join(report['flags'])}` (+ the CUTLASS include dirs, `-Xptxas=-v`, `-shared -fPIC`)",
        f"- kernel: `{report['kernel'][:120]}...`",
        "",
        "| what | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
    ]
    lines += [
        "ptxas compiles the kernel for its launch bound (64 K registers over the threads of one CTA, in units of 8),",
        "so the first register row is the budget of the launch; the code's own need is the highest register it",
        "names, and the consumer warpgroups raise their budget at run time (setmaxnreg). Spills and local memory",
        "are the signal of pressure.",
        "",
    ]
    if report["warnings"]:
        lines += ["Compiler warnings:", "", *[f"- `{w}`" for w in report["warnings"]], ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the .md and .json go (default: %(default)s)")
    ap.add_argument("--prebuild", type=Path, metavar="DIR",
                    help=f"compile only, into DIR/{LIB_NAME} with DIR/{HASH_FILE}; no SASS read back")
    ap.add_argument("--source-hash", action="store_true", help="print the sources' hash and exit")
    args = ap.parse_args(argv)
    if args.source_hash:
        print(source_hash())
        return 0
    why = toolchain_missing(read_back=args.prebuild is None)
    if why:
        print(f"cutlass_prototype: cannot compile: {why}", file=sys.stderr)
        return 2
    if args.prebuild is not None:
        try:
            meta = prebuild(args.prebuild)
        except RuntimeError as exc:
            print(f"cutlass_prototype: {exc}", file=sys.stderr)
            return 1
        print(f"cutlass_prototype: {args.prebuild / LIB_NAME} ({meta['compile_seconds']} s of nvcc), sources "
              f"{meta['source_hash']}")
        return 0
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
