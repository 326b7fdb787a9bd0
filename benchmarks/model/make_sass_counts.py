"""Instruction counts of the CUDA backend's elementwise kernels, read from their compiled SASS, for the cost model.

    python benchmarks/model/make_sass_counts.py          # compile csrc/kernels.cu for sm_90a, rewrite sass_counts.py
    python benchmarks/model/make_sass_counts.py --check  # the same, but fail (exit 1) if the checked-in table differs

The cost model prices the fold, dx and JSD kernels at ``max(bytes / bandwidth, instructions / issue rate)``
(``benchmarks/model/cuda.py``; docs/design.md, "Plans and the performance model"). The instructions come from here:
``kernels.cu`` is compiled for sm_90a with the flags of setup.py, ``cuobjdump -sass`` disassembles it, and
for every fp32-tile kernel (the ones the backend launches: cuBLAS writes the tiles in fp32; dx_packed_kernel
reads fp32 tiles only) the script finds
the vector loop (the innermost loop around the 16-byte tile loads; the longest one where a kernel has two,
as dx has for rows outside the loss) and counts the instructions of its shortest path from the loop head to
its back edge. The shortest path is the common one: the rare work (a new row maximum, a target column)
sits on branches the path skips. Counted: every instruction issued (predicated ones too, NOPs not), and
the MUFU ones (the special-function pipe, a quarter of the issue rate) apart.

The table is checked in, and a test (tests/tooling/test_cost_model_sass_counts.py) rebuilds it from the sources and
compares, so the model follows the kernels as built. Needs nvcc (``$NVCC``, else /usr/local/bin/nvcc,
/usr/local/cuda/bin or PATH) and cuobjdump (the CUDA toolkit's, else the copy inside the ``triton`` package); no GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "benchmarks" / "model" / "sass_counts.py"
ARCH = "sm_90a"
# setup.py's nvcc flags for the device code (what changes the SASS), for one architecture
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]


def find_nvcc() -> str:
    for c in (os.environ.get("NVCC"), "/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("nvcc not found ($NVCC, /usr/local/bin/nvcc, /usr/local/cuda/bin/nvcc, PATH)")


def find_cuobjdump(nvcc: str) -> str:
    candidates = [Path(nvcc).resolve().parent / "cuobjdump", shutil.which("cuobjdump")]
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except ImportError:
        pass
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return str(c)
    raise FileNotFoundError("cuobjdump not found (beside nvcc, on PATH, or in the triton package)")


def compile_sass(csrc: Path = ROOT / "csrc") -> tuple[str, str]:
    """(SASS text of kernels.cu for ARCH, nvcc's version line)."""
    nvcc = find_nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    version = [ln for ln in version.splitlines() if "release" in ln][-1].strip()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernels.cubin"
        arch = ARCH.split("_")[1]
        subprocess.run([nvcc, *NVCC_FLAGS, f"-I{csrc}", f"-gencode=arch=compute_{arch},code={ARCH}", "-cubin",
                        "-o", str(cubin), str(csrc / "kernels.cu")], check=True)
        sass = subprocess.run([find_cuobjdump(nvcc), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return sass, version


_TYPES = {"f": "float", "NS_4bf16E": "bf16", "NS_4fp16E": "fp16"}
_KERNEL = re.compile(r"(fold|dx_packed|dx|jsd)_kernelI(.*)EEvNS_8TileArgsE$")
_ARG = re.compile(r"f|NS_4bf16E|NS_4fp16E|S\d*_|Lb[01]E")


def kernel_name(mangled: str):
    """``fold_kernel<float, false, false, true>`` from the mangled name, or None for other functions."""
    m = _KERNEL.search(mangled)
    if not m:
        return None
    args = []
    for tok in _ARG.findall(m.group(2)):
        if tok.startswith("Lb"):
            args.append("true" if tok[2] == "1" else "false")
        elif tok.startswith("S"):  # a substitution (a repeated half type): only in kernels of half tiles
            args.append("half")
        else:
            args.append(_TYPES[tok])
    return f"{m.group(1)}_kernel<{', '.join(args)}>"


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def functions(sass: str) -> dict:
    """{mangled name: [(address, instruction text)]}."""
    out, name = {}, None
    for line in sass.splitlines():
        if "Function :" in line:
            name = line.split("Function :")[1].strip()
            out[name] = []
        elif name is not None:
            m = _INSTR.search(line)
            if m:
                out[name].append((int(m.group(1), 16), m.group(2)))
    return out


def _opcode(text: str) -> str:
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def _branch_target(text: str):
    m = re.search(r"\bBRA\s+(?:\S+,\s*)?0x([0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


def hot_loop(code: list) -> dict:
    """The vector loop of a kernel: the innermost loops around 16-byte loads; of those, the one whose shortest
    path is the longest. Returns the path's instruction and MUFU counts and its 16-byte loads."""
    index = {addr: i for i, (addr, _) in enumerate(code)}
    loops = []
    for i, (addr, text) in enumerate(code):
        target = _branch_target(text)
        if target is not None and target <= addr and target in index:
            loops.append((index[target], i))
    best = None
    for head, tail in loops:
        body = range(head, tail + 1)
        if not any(".128" in code[j][1] and _opcode(code[j][1]).startswith("LDG") for j in body):
            continue
        if any(h > head and t < tail for h, t in loops):  # not innermost
            continue
        path = _shortest_path(code, index, head, tail)
        if path is not None and (best is None or path["instructions"] > best["instructions"]):
            best = path
    if best is None:
        raise ValueError("no loop around a 16-byte load found")
    return best


def _shortest_path(code, index, head, tail):
    """Instructions (and MUFU, 16-byte loads) on the shortest path head -> tail through forward edges."""
    inf = float("inf")
    dist = {head: (1, _is_mufu(code[head][1]), _is_ldg128(code[head][1]))}
    for i in range(head, tail + 1):
        if i not in dist:
            continue
        text = code[i][1]
        op = _opcode(text)
        succ = []
        target = _branch_target(text)
        if op == "BRA":
            if target is not None and target in index and head < index[target] <= tail:
                succ.append(index[target])
            if text.startswith("@"):
                succ.append(i + 1)
        elif op in ("EXIT", "RET"):
            if text.startswith("@"):
                succ.append(i + 1)
        else:
            succ.append(i + 1)
        for s in succ:
            if s > tail:
                continue
            cost = 0 if _opcode(code[s][1]) == "NOP" else 1
            cand = (dist[i][0] + cost, dist[i][1] + _is_mufu(code[s][1]), dist[i][2] + _is_ldg128(code[s][1]))
            if cand[0] < dist.get(s, (inf,))[0]:
                dist[s] = cand
    if tail not in dist:
        return None
    n, mufu, loads = dist[tail]
    return {"instructions": n, "mufu": mufu, "loads_16b": loads}


def _is_mufu(text: str) -> int:
    return int(_opcode(text).startswith("MUFU"))


def _is_ldg128(text: str) -> int:
    return int(_opcode(text).startswith("LDG") and ".128" in text)


def table(sass: str) -> dict:
    """{kernel: {instructions, mufu, columns, per_column, mufu_per_column}} for the fp32-tile kernels."""
    out = {}
    for mangled, code in functions(sass).items():
        name = kernel_name(mangled)
        # the kernels of fp32 tiles: the first template argument, or dx_packed's (its tile is always fp32)
        if name is None or not (name.startswith("dx_packed") or name.split("<")[1].startswith("float")):
            continue
        loop = hot_loop(code)
        teacher = name.startswith("jsd") or _teacher_flag(name)
        loads_per_group = 2 if teacher else 1
        columns = 4 * loop["loads_16b"] // loads_per_group  # 4 fp32 values per 16-byte load
        out[name] = {"loop_instructions": loop["instructions"], "loop_mufu": loop["mufu"], "columns": columns,
                     "per_column": round(loop["instructions"] / columns, 3),
                     "mufu_per_column": round(loop["mufu"] / columns, 3)}
    return dict(sorted(out.items()))


def _teacher_flag(name: str) -> bool:
    args = [a.strip() for a in name.split("<")[1].rstrip(">").split(",")]
    if name.startswith("fold"):
        return args[2] == "true"  # fold_kernel<T, kEntropy, kTeacher, kPlain>
    if name.startswith("dx_packed"):
        return args[1] == "true"  # dx_packed_kernel<TO, kTeacher, kPlain>
    return args[2] == "true"  # dx_kernel<T, TO, kTeacher, kPlain>


def render(counts: dict, version: str) -> str:
    lines = [
        '"""Generated by benchmarks/model/make_sass_counts.py: do not edit. Instruction counts of the CUDA',
        f"backend's elementwise kernels (fp32 tiles) compiled for {ARCH} by nvcc (``NVCC``) with "
        f"{' '.join(NVCC_FLAGS)}:",
        "the vector loop's shortest path from its head to its back edge (``loop_instructions``, of them ``loop_mufu``",
        "on the special-function pipe) covers ``columns`` logits. benchmarks/model/cuda.py prices the kernels from",
        'these; tests/tooling/test_cost_model_sass_counts.py checks that they match the kernels as built."""',
        "",
        f"ARCH = {ARCH!r}",
        f"NVCC = {version!r}",
        "KERNELS = {",
    ]
    for name, row in counts.items():
        lines.append(f"    {name!r}:")
        lines.append(f"        {row!r},")
    lines += ["}", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the checked-in table instead of writing it")
    ap.add_argument("--csrc", type=Path, default=ROOT / "csrc", help="the sources to compile (default: csrc/)")
    ap.add_argument("--print", action="store_true", help="print the table instead of writing it")
    args = ap.parse_args(argv)
    sass, version = compile_sass(args.csrc)
    text = render(table(sass), version)
    if args.print:
        print(text)
        return 0
    if args.check:
        current = TABLE.read_text() if TABLE.exists() else ""
        if current != text:
            print(f"{TABLE.relative_to(ROOT)} does not match the kernels as built; run python "
                  "benchmarks/model/make_sass_counts.py", file=sys.stderr)
            return 1
        return 0
    TABLE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
