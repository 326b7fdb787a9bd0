"""The backends: what one must provide (``Backend``), which exist, and which can run here.

A backend is a module that implements the per-token statistics problem of ``core/problem.py``. It is
never asked about losses: the loss modules (``fusedloss/losses``) only turn its statistics into a loss and
the loss's gradients into the per-row dz coefficients (docs/design.md, "Adding a statistic, a loss or a
backend"). Modules are imported lazily, so a missing Triton or an unbuilt CUDA extension never breaks
``import fusedloss``.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from functools import lru_cache
from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from .. import config
from . import workload
from .problem import GradientNeeds, Statistics, StatsProblem


@runtime_checkable
class Backend(Protocol):
    """The required part of a backend module."""

    def availability(self) -> str:
        """"available", or one sentence saying why this backend cannot run here (shown by backend_status)."""

    def forward_statistics(self, problem: StatsProblem) -> Statistics:
        """Every statistic the problem asks for, ``[N]`` each in ``problem.acc_dtype`` (zeros where not asked
        and on ignored rows), without holding the ``[N, V]`` logits."""

    def backward_gradients(self, problem: StatsProblem, saved: Statistics, coeffs: torch.Tensor,
                           needs: GradientNeeds) -> tuple:
        """``(d hidden, d weight, d bias)`` for dz built from the ``[7, N]`` coefficients (None where
        ``needs`` says so), recomputing the logits exactly as ``forward_statistics`` formed them."""


class GradInForwardBackend(Protocol):
    """Optional: the 3-product path for losses known in the forward (``core/grad_in_forward.py``)."""

    def grad_in_forward_gradients(self, problem: StatsProblem, chunk_fn: Callable, needs: GradientNeeds) -> tuple:
        """``(loss, (d hidden, d weight, d bias))``: each row chunk's logits are formed once, folded into its
        statistics, and ``chunk_fn(stats, rows) -> (chunk loss, coefficients)`` gives its dz right away."""

    def grad_in_forward_pays(self, problem: StatsProblem) -> bool:
        """Whether the grad-in-forward path is the faster one for this problem, by this backend's own plan."""


class JsdBackend(Protocol):
    """Optional: the generalized JSD's second sweep with given normalisers (a vocabulary-parallel head
    forms them from every rank's statistics first; docs/design.md, "Distributed")."""

    def jsd_sums(self, problem: StatsProblem, lse: tuple, lse_t: tuple) -> tuple:
        """``(KL(q || m), KL(p || m))`` summed over the problem's columns, ``[N]`` each, q and p normalised by
        the (hi, lo) pairs ``lse`` and ``lse_t`` (``[N]`` tensors each)."""


def jsd_sums(name: str) -> Callable:
    """The backend's ``jsd_sums``, or the torch backend's (plain tensor ops: it runs on any device)."""
    return getattr(get(name), "jsd_sums", None) or get("torch").jsd_sums


def has_grad_in_forward_path(name: str) -> bool:
    return callable(getattr(get(name), "grad_in_forward_gradients", None))


def grad_in_forward_policy(name: str) -> Optional[Callable[[StatsProblem], bool]]:
    return getattr(get(name), "grad_in_forward_pays", None)


BACKEND_MODULES = {
    "torch": "fusedloss.backends.torch",
    "triton": "fusedloss.backends.triton.backend",
    "cuda": "fusedloss.backends.cuda.backend",
}
BACKEND_NAMES = ("auto",) + tuple(BACKEND_MODULES)


@lru_cache(maxsize=None)
def _module(name: str):
    module = importlib.import_module(BACKEND_MODULES[name])
    if not isinstance(module, Backend):
        raise TypeError(f"{module.__name__} does not implement the Backend protocol (core/registry.py)")
    return module


def get(name: str):
    return _module(name)


def release_workspace(device=None) -> int:
    """``release_workspace(device)`` of every backend already imported that keeps buffers between calls (the
    CUDA backend's per-stream workspace); a backend never imported keeps nothing and is not imported for it.
    Returns the bytes released."""
    released = 0
    for module_name in BACKEND_MODULES.values():
        release = getattr(sys.modules.get(module_name), "release_workspace", None)
        if release is not None:
            released += release(device)
    return released


@torch.compiler.assume_constant_result
def availability(name: str) -> str:
    """Constant for a process: torch.compile takes the answer at trace time instead of tracing imports."""
    try:
        module = _module(name)
    except ImportError as exc:  # pragma: no cover - depends on the install
        return f"not importable: {exc}"
    return module.availability()


@torch.compiler.assume_constant_result
def _runs_dtype(name: str, dtype: Optional[torch.dtype]) -> bool:
    """Whether backend ``name`` computes in ``dtype`` here (None: any); constant for a process like
    ``availability``."""
    refusal = getattr(_module(name), "dtype_refusal", None)
    return dtype is None or refusal is None or refusal(dtype) is None


def status() -> dict:
    return {name: availability(name) for name in BACKEND_MODULES}


def resolve(backend: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> str:
    """Map the user's ``backend`` argument to a concrete backend for tensors on ``device``.

    ``"auto"``: on a CUDA device, the CUDA backend when it is built (cuBLAS products, 3-product grad-in-forward
    path), else Triton, else torch; on any other device, torch (the Triton interpreter is a correctness
    tool, orders of magnitude slower than the tiled torch path on a CPU). A backend that refuses the inputs'
    ``dtype`` (the Triton backend's float64 before Triton 3.5) is passed over."""
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        chosen = next((name for name in ("cuda", "triton")
                       if availability(name) == "available" and _runs_dtype(name, dtype)), "torch")
        if chosen != "cuda":
            _warn_cuda_skipped(chosen)
        return chosen
    state = availability(backend)
    if state != "available":
        raise ValueError(f"backend={backend!r} is not available here: {state}")
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"backend='cuda' needs tensors on a CUDA device, got device {device}")
    if backend == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError(f"backend='triton' needs tensors on a CUDA device, got device {device} "
                         "(TRITON_INTERPRET=1 runs the kernels on CPU tensors, slowly)")
    return backend


_CUDA_SKIP_WARNED = []  # one warning per process


@torch.compiler.disable
def _warn_cuda_skipped(chosen: str) -> None:
    """Say once, with the reason and the fix, that CUDA tensors run on ``chosen`` because the CUDA backend's
    driver or build is not right (never for a choice: FUSEDLOSS_CUDA=0, a ROCm torch)."""
    if _CUDA_SKIP_WARNED:
        return
    try:
        reason = _module("cuda").auto_skip_reason()
    except ImportError as exc:  # pragma: no cover - depends on the install
        reason = f"not importable: {exc}"
    if reason is None:
        return
    _CUDA_SKIP_WARNED.append(reason)
    warnings.warn(f"fusedloss: backend='auto' runs CUDA tensors on the {chosen} backend because the CUDA backend "
                  f"cannot run: {reason}. (backend_status() says the same; pass backend='{chosen}' to choose it "
                  "explicitly.)", UserWarning, stacklevel=_first_frame_outside_fusedloss())


def _first_frame_outside_fusedloss() -> int:
    """The ``stacklevel`` that attributes a warning to the user's code (whatever wraps the calls in between)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(package) or "/torch/" in frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level


def _interpreting() -> bool:
    return config.interpreting_triton()


def device_gpu(device: torch.device) -> workload.GPU:
    """The GPU the plans take tensors on ``device`` for (``workload.gpu_for_device``: by the device's name, else its
    architecture, with its own SM count and memory); the H200 for CPU (host mode) and meta tensors, so that tests
    on a CPU take the plans of the GPU the rules were set for. Both GPU backends plan with it."""
    if device.type != "cuda":
        return workload.GPUS["h200"]
    return _device_gpu(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=16)
def _device_gpu(index: int) -> workload.GPU:
    props = torch.cuda.get_device_properties(index)
    arch = (getattr(props, "gcnArchName", "") or "").split(":")[0] if torch.version.hip is not None else ""
    return workload.gpu_for_device(props.name, (props.major, props.minor), props.multi_processor_count,
                                   props.total_memory, arch)


def gpu_model() -> str:
    """What ``backend_status()["gpu"]`` says: the GPU model the plans take the current device for."""
    try:
        visible = torch.cuda.is_available()
    except Exception:  # a broken driver install: the backends say why
        visible = False
    if not visible:
        return "no GPU visible (plans price an H200)"
    index = torch.cuda.current_device()
    spec = _device_gpu(index)
    props = torch.cuda.get_device_properties(index)
    arch = (getattr(props, "gcnArchName", "") or "").split(":")[0] if torch.version.hip is not None else ""
    return (f"{spec.name} figures for {props.name} ({arch or f'sm_{props.major}{props.minor}'}, "
            f"{spec.sm_count} {'CUs' if arch else 'SMs'}, {spec.memory_bytes / 1e9:.0f} GB)")
