"""Which NVIDIA drivers the CUDA extension of this checkout runs on, and what users are told when theirs cannot.

* Its fatbinary (read with cuobjdump): cubins for exactly ``_build_info.CUDA_ARCHS`` in the ELF ABI of the
  toolkit's major version, PTX for ``CUDA_PTX_ARCHS`` at ISA ``CUDA_PTX_ISA``.
* Under a stand-in ``libcuda.so.1`` reporting the drivers of branches 525, 550, 575 and 580, the extension's
  own static CUDA runtime accepts or refuses the driver, and ``backend_status()["cuda"]`` and the
  ``backend="auto"`` warning say why and what to do.
* The warning's rules in-process: once per process, never for a deliberate choice.

tests/tooling/test_build_wheels.py runs the same checks on the wheel ``tools/build_wheels.sh`` builds.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
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

import fusedloss
from fusedloss.backends.cuda import backend as cuda
from fusedloss.core import registry

ROOT = Path(__file__).resolve().parents[2]
built = pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: {cuda.availability()}")


def _extension_file() -> Path:
    import fusedloss._C as ext

    return Path(ext.__file__)


def build_info_of_checkout() -> dict:
    from fusedloss import _build_info

    return {k: v for k, v in vars(_build_info).items() if k.isupper()}


@built
@pytest.mark.skipif(cuobjdump() is None, reason="cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
def test_fatbinary_matches_the_build_info(tmp_path):
    info = build_info_of_checkout()
    images = fatbinary(_extension_file(), tmp_path)
    assert images["cubins"] and images["ptx"], images
    check_fatbinary(images, info)


@built
@pytest.mark.skipif(c_compiler() is None, reason="no C compiler for the stand-in libcuda")
@pytest.mark.parametrize("driver", sorted(DRIVER_API))
def test_status_and_warning_under_a_stand_in_driver(tmp_path_factory, driver):
    libcuda = stand_in_libcuda(tmp_path_factory.mktemp("libcuda"))
    result = status_under_driver(sys.executable, DRIVER_API[driver], libcuda, ROOT)
    assert result["file"] == str(ROOT / "fusedloss" / "__init__.py"), result  # this checkout's extension
    check_status_under_driver(result, driver, build_info_of_checkout()["CUDA_MIN_DRIVER_LINUX"])


def _fake_extension(devices, runtime, driver, error=""):
    real = cuda._C
    return SimpleNamespace(device_count=lambda: devices, runtime_version=lambda: runtime,
                           driver_version=lambda: driver, device_error=lambda: error,
                           **{k: getattr(real, k) for k in ("TileArgs", "Transform", "JsdConsts", "STATE_FIELDS")})


def _auto_on_cuda(times: int) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = {registry.resolve("auto", torch.device("cuda")) for _ in range(times)}
    return chosen, [str(w.message) for w in caught if "fusedloss" in str(w.message)]


@built
def test_auto_warns_once_naming_the_reason_and_the_fix(monkeypatch):
    monkeypatch.setattr(registry, "_CUDA_SKIP_WARNED", [])
    monkeypatch.setattr(cuda, "_C", _fake_extension(0, 13000, 12080, "CUDA driver version is insufficient"))
    chosen, messages = _auto_on_cuda(3)
    assert chosen <= {"triton", "torch"} and len(chosen) == 1
    (message,) = messages
    status = fusedloss.backend_status()["cuda"]
    assert f"runs CUDA tensors on the {chosen.pop()} backend because the CUDA backend cannot run: {status}" in message
    assert "supports CUDA 12.8 (R570)" in message and "CUDA_HOME=/path/to/cuda-12.x pip install" in message
    # explicit backends never warn: they raise, or run
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.resolve("torch", torch.device("cuda")) == "torch"


@pytest.mark.parametrize("case", ["FUSEDLOSS_CUDA=0", "rocm", "old GPU"])
def test_auto_does_not_warn_about_a_choice_or_the_hardware(monkeypatch, case):
    monkeypatch.setattr(registry, "_CUDA_SKIP_WARNED", [])
    if case == "FUSEDLOSS_CUDA=0":
        monkeypatch.setattr(cuda, "availability", lambda: "not built: FUSEDLOSS_CUDA=0")
    elif case == "rocm":
        monkeypatch.setattr(torch.version, "hip", "6.4.0")
        monkeypatch.setattr(cuda, "availability", lambda: "not built: nvcc was not found when the package was built")
    else:
        monkeypatch.setattr(cuda, "availability", lambda: "built for sm_80 and newer; this GPU is sm_75")
    chosen, messages = _auto_on_cuda(2)
    assert chosen <= {"triton", "torch"} and messages == []


def test_a_build_without_nvcc_says_how_to_get_the_extension(monkeypatch):
    monkeypatch.setattr(registry, "_CUDA_SKIP_WARNED", [])
    monkeypatch.setattr(cuda, "_C", None)
    monkeypatch.setattr(cuda, "_build_status", lambda: "not built: nvcc was not found when the package was built")
    status = cuda.availability()
    assert status.startswith("not built: nvcc was not found when the package was built; fix: install a manylinux "
                             "wheel of fusedloss (it carries the extension), or reinstall with a CUDA toolkit: "
                             "CUDA_HOME=/path/to/cuda pip install --force-reinstall --no-deps --no-binary fusedloss")
    _, messages = _auto_on_cuda(2)
    assert len(messages) == 1 and status in messages[0]
