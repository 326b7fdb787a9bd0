"""Packaging: wheels as a package index takes them, built in an isolated environment (no torch there).

- Without CUDA (``FUSEDLOSS_CUDA=0``): a pure-Python wheel whose build info says why there is no extension.
- With nvcc: ``tools/build_wheels.sh`` for this Python builds the wheel with the CUDA extension (CUDA 12.4 from
  Debian's packages when the script can fetch it, else the nvcc found here, which it must then announce),
  ``auditwheel repair`` gives it a manylinux tag (checked with ``auditwheel show``). The wheel's extension is
  read with cuobjdump (cubins, ELF ABI, PTX ISA against its build info, and against the README's wheel
  paragraph when built with the README's toolkit), then installed into a fresh virtual environment whose PATH
  has no nvcc, where it imports, reports its CUDA runtime and minimum driver, computes a loss, and answers
  under stand-in drivers 525/550/575/580 (tests/_driver_compat.py). 5-10 minutes on a busy 2-core machine
  (the CUDA compile, installing the CPU torch into the new environment, four fresh interpreters), plus 2-3
  minutes the first time, to fetch the CUDA 12.4 toolkit (~1 GB) into ~/.cache/fusedloss/cuda-12.4. These
  need pip to reach the package index for the build requirements and auditwheel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _driver_compat import (
    DRIVER_API,
    c_compiler,
    check_fatbinary,
    check_status_under_driver,
    cuobjdump,
    fatbinary,
    stand_in_libcuda,
    status_under_driver,
)

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc")
                                     if os.access(p, os.X_OK)), None)
PY = f"{sys.version_info.major}.{sys.version_info.minor}"


def _names(wheel: Path) -> list:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def _build_info(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        ns: dict = {}
        exec(z.read("fusedloss/_build_info.py").decode(), ns)
        return ns


def test_wheel_without_cuda_is_pure_python_and_says_why(tmp_path):
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                   check=True, env={**os.environ, "FUSEDLOSS_CUDA": "0"}, timeout=1200)
    (wheel,) = out.glob("fusedloss-*.whl")
    names = _names(wheel)
    assert "fusedloss/__init__.py" in names and "fusedloss/backends/triton/backend.py" in names
    assert not any(n.startswith("fusedloss/_C") for n in names)
    info = _build_info(wheel)
    assert info["CUDA_EXTENSION"] == "not built: FUSEDLOSS_CUDA=0" and info["CUDA_RUNTIME_VERSION"] is None
    assert any(n.endswith("licenses/LICENSE") or n.endswith("/LICENSE") for n in names)


def readme_wheel_claims() -> dict:
    """What docs/building.md's wheel paragraph says the release wheels are."""
    text = (ROOT / "docs" / "building.md").read_text()
    start = text.index("\nWheels: ")
    paragraph = " ".join(text[start:text.index("\n\n", start)].split())
    claims = {"tags": re.findall(r"`(manylinux_\d+_\d+_x86_64)`", paragraph),
              "toolkit": re.search(r"built with CUDA (\d+\.\d+)", paragraph).group(1),
              "driver": re.search(r"NVIDIA drivers? >= (\d+\.\d+\.\d+)", paragraph).group(1),
              "cubins": tuple(re.search(r"cubins for ([\w, and]+) \(ELF ABI", paragraph).group(1)
                              .replace(" and ", ", ").split(", ")),
              "elf_abi": int(re.search(r"ELF ABI (\d+)", paragraph).group(1)),
              "ptx": re.search(r"PTX for (compute_\d+) \(ISA (\d+\.\d+)", paragraph).groups()}
    return claims


def check_readme_claims(wheel: Path, info: dict, images: dict) -> None:
    claims = readme_wheel_claims()
    assert wheel.name.rsplit("-", 1)[1].startswith(tuple(claims["tags"])), (wheel.name, claims)
    assert info["NVCC_VERSION"].startswith(f"Cuda compilation tools, release {claims['toolkit']},"), info
    assert info["CUDA_MIN_DRIVER_LINUX"] == claims["driver"] and tuple(info["CUDA_ARCHS"]) == claims["cubins"]
    assert {abi for _, abi in images["cubins"].values()} == {claims["elf_abi"]}, images
    assert (info["CUDA_PTX_ARCHS"][0], info["CUDA_PTX_ISA"]) == claims["ptx"] and set(images["ptx"].values()) == {
        claims["ptx"][1]}


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA wheel cannot be built here")
@pytest.mark.skipif(cuobjdump() is None or c_compiler() is None, reason="needs cuobjdump and a C compiler")
def test_repaired_manylinux_wheel_installs_and_imports_in_a_fresh_venv_without_nvcc(tmp_path):
    dist = tmp_path / "dist"
    log = subprocess.run(["bash", str(ROOT / "tools" / "build_wheels.sh")], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONS": PY, "OUT": str(dist), "PYTHON": sys.executable},
                         timeout=1800)
    assert log.returncode == 0, log.stdout[-3000:] + log.stderr[-3000:]
    assert "compiling the CUDA extension" in log.stdout and "FUSEDLOSS_CUDA=0" in log.stdout
    toolkit = re.search(r"== toolkit: (\S+) \(CUDA (\d+\.\d+)\)", log.stdout)
    assert toolkit, log.stdout[-3000:]
    (wheel,) = dist.glob("fusedloss-*.whl")
    assert "manylinux" in wheel.name and f"cp{PY.replace('.', '')}" in wheel.name, wheel.name
    assert "is consistent with the following platform tag" in log.stdout and '"manylinux_' in log.stdout
    assert list(dist.glob("fusedloss-*.tar.gz")), "no sdist"
    names = _names(wheel)
    assert any(n.startswith("fusedloss/_C") and n.endswith(".so") for n in names), names
    info = _build_info(wheel)
    major = int(info["CUDA_RUNTIME_VERSION"].split(".")[0])
    assert info["CUDA_RUNTIME_VERSION"] == toolkit.group(2), (info, toolkit.groups())
    assert info["CUDA_MIN_DRIVER_API"] == 1000 * major and info["CUDA_RUNTIME_LINKAGE"] == "static"
    assert f"needs a Linux driver >= {info['CUDA_MIN_DRIVER_LINUX']}" in log.stdout
    if major != 12:  # the fallback must say what it costs
        assert f"!! CUDA {toolkit.group(2)}, not 12.x: the wheels will need an NVIDIA driver >= 580.65.06" in log.stdout

    # the device code: what the build info claims, and what the README claims for a build with its toolkit
    (ext,) = [n for n in names if n.startswith("fusedloss/_C") and n.endswith(".so")]
    with zipfile.ZipFile(wheel) as z:
        z.extract(ext, tmp_path / "unpacked")
    images = fatbinary(tmp_path / "unpacked" / ext, tmp_path / "images")
    check_fatbinary(images, info)
    if info["CUDA_RUNTIME_VERSION"] == readme_wheel_claims()["toolkit"]:
        check_readme_claims(wheel, info, images)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # no nvcc anywhere the new environment looks: the wheel must need no compiler
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join((str(venv / "bin"), "/usr/bin", "/bin"))
    assert shutil.which("nvcc", path=env["PATH"]) is None
    # The CPU torch (a local file on these machines); then the wheel itself with no further dependencies.
    subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "numpy"], check=True, env=env,
                   timeout=1200)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, env=env, timeout=600)
    probe = ("import fusedloss, torch, fusedloss._build_info as b; s = fusedloss.backend_status(); print(s['cuda']); "
             "print(fusedloss.__file__); print(b.CUDA_RUNTIME_VERSION); "
             "h = torch.randn(3, 4); w = torch.randn(7, 4); y = torch.tensor([1, 2, 3]); "
             "print(float(fusedloss.cross_entropy(h, w, y)))")
    out = subprocess.run([str(py), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=600).stdout.splitlines()
    assert out[0] in ("built; no CUDA device visible", "available") or "driver" in out[0], out
    assert str(venv) in out[1], out  # the installed wheel, not a checkout
    assert out[2] == info["CUDA_RUNTIME_VERSION"]
    assert float(out[3]) > 0

    # the installed wheel under the drivers of branches 525 to 580
    libcuda = stand_in_libcuda(tmp_path / "libcuda")
    for driver, api in sorted(DRIVER_API.items()):
        result = status_under_driver(str(py), api, libcuda, tmp_path, env=env)
        assert str(venv) in result["file"], result
        check_status_under_driver(result, driver, info["CUDA_MIN_DRIVER_LINUX"])
        assert (api >= info["CUDA_MIN_DRIVER_API"]) == ("sees no device" in result["status"]), result
