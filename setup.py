"""Build script. The pure-Python package always builds; the CUDA extension ``fusedloss._C`` (csrc/) is
added when nvcc is available, steered by FUSEDLOSS_CUDA:

* ``FUSEDLOSS_CUDA=0``: skip the extension.
* ``FUSEDLOSS_CUDA=1``: require it; the build fails when nvcc is not found.
* unset: build it when nvcc is found at $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, /usr/local/bin/nvcc
  or on PATH.

The extension is compiled by nvcc (kernels.cu, for sm_80, sm_90a and, with CUDA >= 12.8, sm_100a) and the
host C++ compiler (host.cpp, bindings.cpp) through ninja, and linked with the CUDA runtime *statically*: the
.so needs no libcudart at import, and no torch headers or libraries at all (pointers and streams cross the
boundary as integers), so one wheel works with any torch version. Never imports torch.

The outcome is recorded in a generated ``fusedloss/_build_info.py`` so that
``fusedloss.backend_status()["cuda"]`` can say why the CUDA backend is missing.

The sm_90 epilogue kernels (csrc/sm90_epilogue*.cu: the statistics and the d logits in the GEMM epilogue,
docs/design.md "The statistics in the GEMM epilogue") join the extension when sm_90a is a target and the CUTLASS
headers are found: the ``nvidia-cutlass`` wheel (pinned in pyproject.toml's [build-system].requires, a build-only
dependency) or FUSEDLOSS_CUTLASS_DIR (a CUTLASS checkout). Without them the build goes on and says the epilogue
kernels are not built; FUSEDLOSS_CUDA_EPILOGUE_BUILD=0 leaves them out on purpose.

Environment knobs: FUSEDLOSS_CUDA_ARCHS (default "80;90a;100a", without 100a before CUDA 12.8),
FUSEDLOSS_NVCC_THREADS (default 2),
CXX (host compiler, default c++), MAX_JOBS (ninja parallelism).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
CUDA_SOURCES = ["kernels.cu"]
# The sm_90a-only epilogue kernels, one translation unit per kernel so that ninja compiles them side by side.
EPILOGUE_SOURCES = ["sm90_epilogue_statistics.cu", "sm90_epilogue_dlogits.cu"]
EPILOGUE_ARCH = "90a"
CXX_SOURCES = ["host.cpp", "bindings.cpp"]
BUILD_INFO = Path("fusedloss") / "_build_info.py"


def find_nvcc() -> str | None:
    candidates = []
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        candidates.append(Path(cuda_home) / "bin" / "nvcc")
    candidates += [Path("/usr/local/cuda/bin/nvcc"), Path("/usr/local/bin/nvcc")]
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def cuda_plan() -> tuple[str | None, str]:
    """(nvcc or None, the status line recorded for backend_status)."""
    flag = os.environ.get("FUSEDLOSS_CUDA", "").strip()
    if flag == "0":
        return None, "not built: FUSEDLOSS_CUDA=0"
    if flag not in ("", "1"):
        raise SystemExit(f"FUSEDLOSS_CUDA must be 0, 1 or unset, got {flag!r}")
    nvcc = find_nvcc()
    if nvcc is None:
        if flag == "1":
            raise SystemExit(
                "FUSEDLOSS_CUDA=1 but nvcc was not found ($CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc, "
                "/usr/local/bin/nvcc, PATH); install the CUDA toolkit or unset FUSEDLOSS_CUDA"
            )
        return None, "not built: nvcc was not found when the package was built"
    return nvcc, "built"


NVCC, CUDA_STATUS = cuda_plan()


def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    lines = [ln for ln in out.splitlines() if "release" in ln]
    return lines[-1].strip() if lines else "unknown"


# The cubins built unless FUSEDLOSS_CUDA_ARCHS names others: A100 (sm_80, and the PTX every newer GPU can JIT),
# H100/H200 (sm_90a) and B200/GB200 (sm_100a), each with the oldest nvcc that can build it; a toolkit too old for
# one (CUDA 12.4, the release wheels': no sm_100a before 12.8) leaves it out, and those GPUs JIT the PTX.
DEFAULT_ARCHS = (("80", (11, 0)), ("90a", (12, 0)), ("100a", (12, 8)))


def archs() -> list[str]:
    spec = os.environ.get("FUSEDLOSS_CUDA_ARCHS", "").strip()
    if spec:
        return [a.strip() for a in spec.replace(",", ";").split(";") if a.strip()]
    runtime = runtime_version(NVCC) if NVCC else None
    have = tuple(int(x) for x in runtime.split(".")) if runtime else (0, 0)
    return [arch for arch, since in DEFAULT_ARCHS if have >= since or runtime is None and arch != "100a"]


# The oldest Linux driver each CUDA major version's runtime runs on (CUDA minor version compatibility,
# NVIDIA's release notes): a runtime linked from toolkit X.Y needs a driver of at least CUDA X.0.
MIN_DRIVER_LINUX = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}


def runtime_version(nvcc: str) -> str | None:
    """"X.Y" of the toolkit nvcc belongs to: the static cudart linked into the extension is that one."""
    import re

    m = re.search(r"release (\d+)\.(\d+)", nvcc_version(nvcc))
    return f"{m.group(1)}.{m.group(2)}" if m else None


def ptx_arch() -> str:
    """The virtual architecture whose PTX the extension also carries: the oldest target's."""
    oldest = min(archs(), key=lambda a: int("".join(ch for ch in a if ch.isdigit())))
    return oldest.rstrip("a")


def ptx_isa(nvcc: str) -> str | None:
    """The PTX ISA version nvcc writes (".version 8.4" for CUDA 12.4): a driver JIT-compiles the embedded PTX
    only if it knows that ISA, i.e. if it supports this CUDA version or a newer one."""
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "isa.cu", Path(tmp) / "isa.ptx"
        src.write_text("__global__ void isa_probe() {}\n")
        try:
            subprocess.run([nvcc, f"-arch=compute_{ptx_arch()}", "-ptx", str(src), "-o", str(out)],
                           capture_output=True, check=True, timeout=300)
        except (OSError, subprocess.SubprocessError):
            return None
        m = re.search(r"^\.version\s+(\d+\.\d+)", out.read_text(), re.M)
        return m.group(1) if m else None


def find_cutlass() -> tuple[list[Path] | None, str]:
    """(CUTLASS include dirs, where they came from), or (None, why not): FUSEDLOSS_CUTLASS_DIR, else the
    ``nvidia-cutlass`` wheel's headers, found through its installed files (never imported)."""
    root = os.environ.get("FUSEDLOSS_CUTLASS_DIR", "").strip()
    if root:
        dirs = [Path(root) / "include", Path(root) / "tools" / "util" / "include"]
        origin = f"FUSEDLOSS_CUTLASS_DIR={root}"
    else:
        import importlib.metadata

        try:
            dist = importlib.metadata.distribution("nvidia-cutlass")
        except importlib.metadata.PackageNotFoundError:
            return None, "the CUTLASS headers were not found (pip install nvidia-cutlass, or FUSEDLOSS_CUTLASS_DIR)"
        source = Path(dist.locate_file("cutlass_library")) / "source"
        dirs, origin = [source / "include", source / "tools" / "util" / "include"], f"nvidia-cutlass {dist.version}"
    if not all((d / m).exists() for d, m in zip(dirs, ("cutlass/cutlass.h", "cutlass/util/packed_stride.hpp"))):
        return None, f"{origin} lacks the CUTLASS headers"
    return dirs, origin


def epilogue_plan() -> tuple[list[Path] | None, str]:
    """(CUTLASS include dirs or None, the status line recorded for the epilogue kernels)."""
    if NVCC is None:
        return None, "not built: the CUDA extension is not built"
    if os.environ.get("FUSEDLOSS_CUDA_EPILOGUE_BUILD", "").strip() == "0":
        return None, "not built: FUSEDLOSS_CUDA_EPILOGUE_BUILD=0"
    if EPILOGUE_ARCH not in archs():
        return None, f"not built: sm_{EPILOGUE_ARCH} is not among the targets ({', '.join(archs())})"
    dirs, origin = find_cutlass()
    if dirs is None:
        return None, f"not built: {origin}"
    return dirs, f"built for sm_{EPILOGUE_ARCH} with {origin}"


CUTLASS_INCLUDES, EPILOGUE_STATUS = epilogue_plan()


def write_build_info(package_dir: Path) -> None:
    runtime = runtime_version(NVCC) if NVCC else None
    major = int(runtime.split(".")[0]) if runtime else None
    lines = [
        '"""Generated by setup.py: how the CUDA extension fusedloss._C was built (read by backend_status)."""',
        "",
        f"CUDA_EXTENSION = {CUDA_STATUS!r}",
        f"NVCC_VERSION = {nvcc_version(NVCC) if NVCC else None!r}",
        "# Device code: cubins for CUDA_ARCHS; PTX (ISA CUDA_PTX_ISA) for CUDA_PTX_ARCHS, JIT-compiled by newer GPUs.",
        f"CUDA_ARCHS = {tuple('sm_' + a for a in archs()) if NVCC else ()!r}",
        f"CUDA_PTX_ARCHS = {('compute_' + ptx_arch(),) if NVCC else ()!r}",
        f"CUDA_PTX_ISA = {ptx_isa(NVCC) if NVCC else None!r}",
        "# The CUDA runtime inside fusedloss._C (linked statically) and what it needs from the driver:",
        "# cudaDriverGetVersion() must report at least CUDA_MIN_DRIVER_API (major * 1000), which Linux",
        "# drivers CUDA_MIN_DRIVER_LINUX and newer do.",
        f"CUDA_RUNTIME_VERSION = {runtime!r}",
        "# The sm_90 epilogue kernels (statistics and d logits in the GEMM epilogue): built, or why not.",
        f"CUDA_EPILOGUE = {EPILOGUE_STATUS!r}",
        f"CUDA_RUNTIME_LINKAGE = {'static' if NVCC else None!r}",
        f"CUDA_MIN_DRIVER_API = {major * 1000 if major else None!r}",
        f"CUDA_MIN_DRIVER_LINUX = {MIN_DRIVER_LINUX.get(major) if major else None!r}",
        "",
    ]
    package_dir.mkdir(parents=True, exist_ok=True)
    (package_dir / "_build_info.py").write_text("\n".join(lines))


class BuildPy(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            write_build_info(ROOT / "fusedloss")
        else:
            write_build_info(Path(self.build_lib) / "fusedloss")


def _ninja() -> str | None:
    try:
        import ninja  # the build requirement ships the binary

        exe = Path(ninja.BIN_DIR) / "ninja"
        if exe.is_file():
            return str(exe)
    except ImportError:
        pass
    return shutil.which("ninja")


class BuildExt(build_ext):
    """Compiles fusedloss._C with nvcc + the host compiler through ninja (one .cu, two .cpp)."""

    def build_extension(self, ext: Extension) -> None:
        import pybind11

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(self.build_temp).resolve() / "fusedloss_C"
        tmp.mkdir(parents=True, exist_ok=True)
        cxx = os.environ.get("CXX", "c++")
        includes = [f"-I{CSRC}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs()]
        # PTX of the oldest target too, so that newer GPUs (e.g. sm_100/sm_120) JIT-compile the kernels
        # instead of failing with "no kernel image is available".
        gencode.append(f"-gencode=arch=compute_{ptx_arch()},code=compute_{ptx_arch()}")
        threads = os.environ.get("FUSEDLOSS_NVCC_THREADS", "2")
        cuda_flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                      f"--threads={threads}", "-lineinfo", f"-I{CSRC}"] + gencode
        cxx_flags = ["-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden"] + includes
        # The epilogue kernels: sm_90a only (wgmma, TMA and setmaxnreg exist nowhere else), CUTLASS's flags;
        # -DNDEBUG: CUTLASS's device asserts are calls, and a call between WGMMAs makes ptxas serialise them.
        epilogue_flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                          f"--threads={threads}", "--expt-relaxed-constexpr", "-DNDEBUG", f"-I{CSRC}",
                          f"-gencode=arch=compute_{EPILOGUE_ARCH},code=sm_{EPILOGUE_ARCH}"]
        if CUTLASS_INCLUDES:
            epilogue_flags += [f"-I{d}" for d in CUTLASS_INCLUDES]
            cxx_flags.append("-DFUSEDLOSS_EPILOGUE")
        # libstdc++ stays dynamic: statically linked (gcc 12) it pulls in glibc 2.35/2.36 symbols
        # (_dl_find_object, arc4random) and the wheel's manylinux tag would rise from 2_34 to 2_36.
        link_flags = ["-shared", "-cudart=static", "-Xcompiler", "-fvisibility=hidden"]

        objects, steps = [], []
        for src in CUDA_SOURCES:
            obj = tmp / (src + ".o")
            objects.append(obj)
            steps.append(("nvcc", CSRC / src, obj))
        for src in EPILOGUE_SOURCES if CUTLASS_INCLUDES else []:
            obj = tmp / (src + ".o")
            objects.append(obj)
            steps.append(("nvcc_epilogue", CSRC / src, obj))
        for src in CXX_SOURCES:
            obj = tmp / (src + ".o")
            objects.append(obj)
            steps.append(("cxx", CSRC / src, obj))

        print(f"fusedloss: compiling the CUDA extension fusedloss._C with {NVCC} ({nvcc_version(NVCC)}) for "
              f"{', '.join('sm_' + a for a in archs())}; this takes a few minutes. Set FUSEDLOSS_CUDA=0 to skip it "
              "(the torch and Triton backends need no compiled code).", flush=True)
        print(f"fusedloss: the sm_90 epilogue kernels are {EPILOGUE_STATUS}", flush=True)
        ninja = _ninja()
        q = lambda items: " ".join(str(i) for i in items)  # noqa: E731 (paths have no spaces here)
        if ninja:
            text = [
                "ninja_required_version = 1.3",
                f"nvcc = {NVCC}",
                f"cxx = {cxx}",
                f"cuda_flags = {q(cuda_flags)}",
                f"epilogue_flags = {q(epilogue_flags)}",
                f"cxx_flags = {q(cxx_flags)}",
                f"link_flags = {q(link_flags)}",
                "rule nvcc",
                "  command = $nvcc $cuda_flags -MD -MF $out.d -c $in -o $out",
                "  depfile = $out.d",
                "  deps = gcc",
                "  description = nvcc $in",
                "rule nvcc_epilogue",
                "  command = $nvcc $epilogue_flags -MD -MF $out.d -c $in -o $out",
                "  depfile = $out.d",
                "  deps = gcc",
                "  description = nvcc (sm_90 epilogue) $in",
                "rule cxx",
                "  command = $cxx $cxx_flags -MMD -MF $out.d -c $in -o $out",
                "  depfile = $out.d",
                "  deps = gcc",
                "  description = c++ $in",
                "rule link",
                "  command = $nvcc $link_flags $in -o $out",
                "  description = link $out",
            ]
            text += [f"build {obj}: {rule} {src}" for rule, src, obj in steps]
            text += [f"build {target}: link {q(objects)}", f"default {target}", ""]
            (tmp / "build.ninja").write_text("\n".join(text))
            cmd = [ninja, "-C", str(tmp)]
            if os.environ.get("MAX_JOBS"):
                cmd += ["-j", os.environ["MAX_JOBS"]]
            self.announce("building fusedloss._C with ninja: " + " ".join(cmd), level=2)
            subprocess.run(cmd, check=True)
        else:  # no ninja: the same commands, one after the other
            for rule, src, obj in steps:
                if rule in ("nvcc", "nvcc_epilogue"):
                    flags = cuda_flags if rule == "nvcc" else epilogue_flags
                    subprocess.run([NVCC, *flags, "-c", str(src), "-o", str(obj)], check=True)
                else:
                    subprocess.run([cxx, *cxx_flags, "-c", str(src), "-o", str(obj)], check=True)
            subprocess.run([NVCC, *link_flags, *map(str, objects), "-o", str(target)], check=True)


ext_modules = []
if NVCC is not None:
    sources = CUDA_SOURCES + (EPILOGUE_SOURCES if CUTLASS_INCLUDES else []) + CXX_SOURCES
    ext_modules.append(Extension("fusedloss._C", sources=[str(Path("csrc") / s) for s in sources]))

setup(ext_modules=ext_modules, cmdclass={"build_py": BuildPy, "build_ext": BuildExt})
