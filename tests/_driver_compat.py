"""What a built CUDA extension needs from the NVIDIA driver, checked without a GPU or a driver.

* ``stand_in_libcuda``: compiles (with ``cc``) a tiny ``libcuda.so.1`` that reports a chosen driver version
  (``FAKE_CUDA_DRIVER``, what ``cuDriverGetVersion`` returns: 12040 for a R550 driver) and no device.
  The extension's static CUDA runtime loads it like the real driver, so its own version gate decides:
  a runtime newer than the driver refuses with "CUDA driver version is insufficient", an accepted one goes on
  to ``cuInit`` and finds no device. ``status_under_driver`` runs a Python in a subprocess with it and
  returns what fusedloss then reports (``backend_status()["cuda"]``, the ``backend="auto"`` warning).
* ``fatbinary``: the device images in a shared library, read with ``cuobjdump``: each cubin's architecture
  and ELF ABI, each PTX's architecture and ISA version.

Used by tests/tooling/test_build_driver_compat.py (the extension of this checkout) and
tests/tooling/test_build_wheels.py (a built wheel).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Optional

# cuDriverGetVersion of the first driver of each branch (the CUDA version it supports, major * 1000 + minor * 10).
DRIVER_API = {525: 12000, 550: 12040, 575: 12090, 580: 13000}

# The cubin ELF ABI each driver generation loads: ptxas 12.x writes ELF ABI version 7 (OS/ABI 0x33), which
# every driver >= 525 loads; ptxas 13.x writes version 8 (OS/ABI 0x41), which drivers before 580 predate.
CUBIN_ELF_ABI = {12: (0x33, 7), 13: (0x41, 8)}

_STAND_IN_SOURCE = r"""
/* A stand-in for the NVIDIA driver's libcuda.so.1: the entry points the CUDA runtime resolves before it
   looks for devices. cuDriverGetVersion reports FAKE_CUDA_DRIVER; cuInit reports no device (100). */
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
static int reported(void) { const char *v = getenv("FAKE_CUDA_DRIVER"); return v ? atoi(v) : 0; }

CUresult cuDriverGetVersion(int *version) { *version = reported(); return 0; }
CUresult cuInit(unsigned int flags) { (void)flags; return 100; /* CUDA_ERROR_NO_DEVICE */ }
CUresult cuDeviceGetCount(int *count) { *count = 0; return 0; }
CUresult cuGetExportTable(const void **table, const void *id) { (void)id; *table = 0; return 500; }
CUresult cuGetProcAddress_v2(const char *name, void **fn, int version, unsigned long long flags, int *found);

static const struct { const char *name; void *fn; } entries[] = {
    {"cuDriverGetVersion", (void *)cuDriverGetVersion}, {"cuInit", (void *)cuInit},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount}, {"cuGetExportTable", (void *)cuGetExportTable},
    {"cuGetProcAddress", (void *)cuGetProcAddress_v2}, {0, 0}};

CUresult cuGetProcAddress_v2(const char *name, void **fn, int version, unsigned long long flags, int *found) {
  (void)version; (void)flags;
  for (int i = 0; entries[i].name; ++i)
    if (name && strcmp(name, entries[i].name) == 0) { *fn = entries[i].fn; if (found) *found = 1; return 0; }
  *fn = 0;
  if (found) *found = 0;
  return 500; /* CUDA_ERROR_NOT_FOUND */
}
CUresult cuGetProcAddress(const char *name, void **fn, int version, unsigned long long flags) {
  return cuGetProcAddress_v2(name, fn, version, flags, 0);
}
"""


def c_compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def stand_in_libcuda(directory: Path) -> Path:
    """Compile the stand-in driver into ``directory/libcuda.so.1``; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "stand_in_libcuda.c"
    source.write_text(_STAND_IN_SOURCE)
    subprocess.run([c_compiler(), "-shared", "-fPIC", "-O1", "-o", str(directory / "libcuda.so.1"), str(source)],
                   check=True, capture_output=True, timeout=120)
    return directory


_PROBE = r"""
import json, warnings, torch, fusedloss
from fusedloss.core import registry
from fusedloss._build_info import CUDA_MIN_DRIVER_API
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    chosen = [registry.resolve("auto", torch.device("cuda")) for _ in range(3)]
print(json.dumps({"status": fusedloss.backend_status()["cuda"], "chosen": chosen,
                  "warnings": [str(w.message) for w in caught if "fusedloss" in str(w.message)],
                  "file": fusedloss.__file__, "min_driver_api": CUDA_MIN_DRIVER_API}))
"""


def status_under_driver(python: str, driver_api: int, libcuda_dir: Path, cwd: Path,
                        env: Optional[dict] = None) -> dict:
    """``backend_status()["cuda"]``, what ``backend="auto"`` chose for CUDA tensors three times and the
    fusedloss warnings it gave, in a fresh ``python`` whose only libcuda is the stand-in."""
    env = dict(os.environ if env is None else env)
    # LD_LIBRARY_PATH comes before the system's library directories, so a real driver stays out of the way
    env.update(FAKE_CUDA_DRIVER=str(driver_api), LD_LIBRARY_PATH=str(libcuda_dir))
    out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_status_under_driver(result: dict, driver: int, min_driver_linux: str) -> None:
    """What fusedloss must say on driver branch ``driver`` (525, 550, ...) for an extension whose runtime needs
    ``cudaDriverGetVersion() >= result["min_driver_api"]`` (Linux driver ``min_driver_linux``)."""
    status, api = result["status"], DRIVER_API[driver]
    if api >= result["min_driver_api"]:
        # the runtime accepted the driver and asked it for devices: none here
        assert status.startswith("built; the extension's CUDA ") and "runtime sees no device" in status, status
        assert "no CUDA-capable device is detected" in status, status
        # a CUDA tensor with the extension's runtime seeing no device: auto falls back, and says why, once
        assert result["chosen"][0] != "cuda" and len(result["warnings"]) == 1, result
        assert status in result["warnings"][0], result
        return
    runtime = result["min_driver_api"] // 1000
    version = f"{api // 1000}.{api % 1000 // 10}"
    assert status.startswith(f"built with the CUDA {runtime}.") and f"needs an NVIDIA driver >= {min_driver_linux}" \
        in status, status
    assert f"this driver supports CUDA {version} (R{driver})" in status, status
    # the fix: which build to install, the command that rebuilds it, the driver that would do instead
    assert "install a fusedloss wheel built with CUDA 12 (it needs a driver >= 525.60.13)" in status, status
    assert "CUDA_HOME=/path/to/cuda-12.x pip install --force-reinstall --no-deps --no-binary fusedloss" in status
    assert "bash tools/fetch_cuda12.sh" in status and f"upgrade the driver to >= {min_driver_linux}" in status
    assert result["chosen"] == [result["chosen"][0]] * 3 and result["chosen"][0] != "cuda", result
    assert len(result["warnings"]) == 1 and status in result["warnings"][0], result
    assert result["warnings"][0].startswith(f"fusedloss: backend='auto' runs CUDA tensors on the "
                                            f"{result['chosen'][0]} backend because the CUDA backend cannot run")


# ------------------------------------------------------------------------------------------------
# The fatbinary
# ------------------------------------------------------------------------------------------------
def cuobjdump() -> Optional[str]:
    """cuobjdump from the nvidia-cuda-cuobjdump package (13.2+ reads the cubins of CUDA 12 and 13 alike),
    else $CUDA_HOME's, else PATH's."""
    for scheme in ("purelib", "platlib"):
        candidate = Path(sysconfig.get_paths()[scheme]) / "nvidia" / "cu13" / "bin" / "cuobjdump"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    home = os.environ.get("CUDA_HOME")
    if home and os.access(Path(home) / "bin" / "cuobjdump", os.X_OK):
        return str(Path(home) / "bin" / "cuobjdump")
    return shutil.which("cuobjdump")


def fatbinary(library: Path, workdir: Path) -> dict:
    """``{"cubins": {"sm_80": (os_abi, abi_version), ...}, "ptx": {"sm_80": "8.4", ...}}`` for the device
    images in ``library`` that hold fusedloss kernels (the static CUDA runtime brings a cubin of its own)."""
    tool = cuobjdump()
    workdir.mkdir(parents=True, exist_ok=True)
    for what in ("-xelf", "-xptx"):
        subprocess.run([tool, what, "all", str(library)], cwd=workdir, check=True, capture_output=True, timeout=300)
    cubins, ptx = {}, {}
    for path in sorted(workdir.glob("*.cubin")):
        data = path.read_bytes()
        assert data[:4] == b"\x7fELF", path
        if b"_ZN2fl" not in data:  # no kernel of the fl namespace: the CUDA runtime's own image
            continue
        arch = re.search(r"\.(sm_\w+)\.cubin$", path.name).group(1)
        cubins[arch] = (data[7], data[8])  # e_ident[EI_OSABI], e_ident[EI_ABIVERSION]
    for path in sorted(workdir.glob("*.ptx")):
        text = path.read_text(errors="replace")
        if "_ZN2fl" not in text:
            continue
        arch = re.search(r"^\.target\s+(sm_\w+)", text, re.M).group(1)
        ptx[arch] = re.search(r"^\.version\s+(\d+\.\d+)", text, re.M).group(1)
    return {"cubins": cubins, "ptx": ptx}


def check_fatbinary(images: dict, info: dict) -> None:
    """The images of a built extension against what its ``_build_info`` claims."""
    major = int(info["CUDA_RUNTIME_VERSION"].split(".")[0])
    assert sorted(images["cubins"]) == sorted(info["CUDA_ARCHS"]), images
    for arch, abi in images["cubins"].items():
        assert abi == CUBIN_ELF_ABI[major], f"{arch}: ELF OS/ABI {abi[0]:#x} version {abi[1]}, expected CUDA {major}'s"
    assert sorted("compute_" + a[len("sm_"):] for a in images["ptx"]) == sorted(info["CUDA_PTX_ARCHS"]), images
    assert set(images["ptx"].values()) == {info["CUDA_PTX_ISA"]}, images
    # PTX ISA 8.x comes from CUDA 12.x toolkits (8.4 from 12.4), 9.x from 13.x
    isa_major = int(info["CUDA_PTX_ISA"].split(".")[0])
    assert isa_major == major - 4, info
    # the claim: a 12.x runtime (and its cubins) load on drivers >= 525.60.13, 13.x needs >= 580.65.06
    assert info["CUDA_MIN_DRIVER_LINUX"] == {12: "525.60.13", 13: "580.65.06"}[major], info
