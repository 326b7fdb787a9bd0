"""Backend registry: which implementations of the statistics core exist, and which can run here.

Each backend is a module with ``availability() -> str`` ("available" or the reason it cannot run),
``forward_statistics(problem)`` and ``backward_gradients(problem, saved, coeffs, needs)`` (problem.py).
Modules are imported lazily, so a missing Triton or an unbuilt CUDA extension never breaks
``import fusedloss``.
"""

from __future__ import annotations

import importlib
import os
from functools import lru_cache

import torch

BACKEND_MODULES = {
    "torch": "fusedloss.core.torch_backend",
    "triton": "fusedloss.triton.backend",
    "cuda": "fusedloss.cuda.backend",
}
BACKEND_NAMES = ("auto",) + tuple(BACKEND_MODULES)


@lru_cache(maxsize=None)
def _module(name: str):
    return importlib.import_module(BACKEND_MODULES[name])


def get(name: str):
    return _module(name)


@torch.compiler.assume_constant_result
def availability(name: str) -> str:
    """Constant for a process: torch.compile takes the answer at trace time instead of tracing imports."""
    if name == "torch":
        return "available"
    try:
        module = _module(name)
    except ImportError as exc:  # pragma: no cover - depends on the install
        return f"not importable: {exc}"
    return module.availability()


def status() -> dict:
    return {name: availability(name) for name in BACKEND_MODULES}


def resolve(backend: str, device: torch.device) -> str:
    """Map the user's ``backend`` argument to a concrete backend for tensors on ``device``.

    ``"auto"``: on a CUDA device, the CUDA backend when it is built (cuBLAS products, 3-product eager
    path), else Triton, else torch; on any other device, torch (the Triton interpreter is a correctness
    tool, orders of magnitude slower than the tiled torch path on a CPU)."""
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda":
            for name in ("cuda", "triton"):
                if availability(name) == "available":
                    return name
        return "torch"
    state = availability(backend)
    if state != "available":
        raise ValueError(f"backend={backend!r} is not available here: {state}")
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"backend='cuda' needs tensors on a CUDA device, got device {device}")
    if backend == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError(f"backend='triton' needs tensors on a CUDA device, got device {device} "
                         "(TRITON_INTERPRET=1 runs the kernels on CPU tensors, slowly)")
    return backend


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
