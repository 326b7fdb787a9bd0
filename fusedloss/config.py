"""Every switch that changes how fusedloss runs, in one place (docs/design.md, "Configuration").

The public functions take the switches as keyword arguments; each has a default here and an environment
variable that overrides the default (never an explicit argument), read by ``from_environment`` and
nowhere else in the package:

===================================  ========  ===============================================================
variable                             default   effect
===================================  ========  ===============================================================
``FUSEDLOSS_GRAD_IN_FORWARD``        unset     ``1``: always take the 3-product path for losses known in the
                                               forward; ``0``: never; unset: each backend's plan decides
                                               (``grad_in_forward=`` argument)
``FUSEDLOSS_WORKSPACE_MB``           unset     logits workspace of the CUDA and Triton backends in MiB; unset:
                                               sized from the memory free on the device (``workspace_mb=``
                                               argument). A finite number, at least 1/1024 (1 KiB;
                                               ``workspace_megabytes``).
``FUSEDLOSS_ALLOW_TF32``             ``0``     ``1``: fp32 inputs may use TF32 products (faster, ~1e-4
                                               relative error) whatever PyTorch's global TF32 flags say
                                               (``allow_tf32=`` argument); by default fp32 stays fp32
``FUSEDLOSS_TRITON_FP32_PRECISION``  unset     Triton's ``tl.dot`` precision for fp32 inputs (``ieee``,
                                               ``tf32x3``, ``tf32``); a tuning override for experiments
``FUSEDLOSS_DETERMINISTIC``          ``0``     ``1``: the same as ``torch.use_deterministic_algorithms`` for
                                               fusedloss's kernels
``FUSEDLOSS_CUDA_EPILOGUE``          ``auto``  ``1``: the CUDA backend's sm_90 epilogue kernels for the
                                               problems they serve (fusedloss/backends/cuda/epilogue.py);
                                               ``auto`` and ``0``: today's path until a GPU run says otherwise
===================================  ========  ===============================================================

``TRITON_INTERPRET=1`` is Triton's own switch (run the kernels on CPU tensors in its interpreter); fusedloss
reads it to report availability. Build-time variables (``FUSEDLOSS_CUDA``, ``FUSEDLOSS_CUDA_ARCHS``,
``FUSEDLOSS_NVCC_THREADS``) are read by ``setup.py`` only.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional


def _flag(name: str) -> Optional[bool]:
    value = os.environ.get(name, "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name} must be 0 or 1, got {value!r}")
    return value == "1"


# The smallest workspace a caller may ask for, in MiB (1 KiB). A smaller number is a slip of units rather than a
# size (bytes or GiB read as MiB, or a value that rounds to no byte at all). Any workspace below the smallest
# chunk a backend runs (one row of the CUDA backend's tiles, one row block of Triton's) is raised to that chunk.
MIN_WORKSPACE_MB = 2.0**-10


def workspace_megabytes(value, name: str, *, environment: bool = False) -> float:
    """``value`` as a workspace in MiB, or a ValueError that names ``name`` (an argument, or with
    ``environment`` the variable whose text ``value`` is): a finite number of at least ``MIN_WORKSPACE_MB``.
    Infinity is refused; a large number is an unbounded workspace, since a plan never takes more than its
    chunks need."""
    mb = None
    if environment or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        try:
            mb = float(value)
        except (ValueError, OverflowError):
            pass
    if mb is None or not math.isfinite(mb) or not mb >= MIN_WORKSPACE_MB:
        what = f"environment variable {name}" if environment else name
        raise ValueError(f"{what} must be a finite number of MiB, at least 1/1024 (1 KiB), got {value!r}")
    return mb


def _megabytes(name: str) -> Optional[float]:
    value = os.environ.get(name, "").strip()
    return None if value == "" else workspace_megabytes(value, name, environment=True)


@dataclass(frozen=True)
class Environment:
    """The overrides set in the environment (None: not set)."""

    grad_in_forward: Optional[bool]
    workspace_mb: Optional[float]
    allow_tf32: Optional[bool]
    triton_fp32_precision: Optional[str]
    deterministic: Optional[bool]
    cuda_epilogue: Optional[bool] = None  # FUSEDLOSS_CUDA_EPILOGUE: None for auto


def _auto_flag(name: str) -> Optional[bool]:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("0", "1"):
        raise ValueError(f"environment variable {name} must be auto, 0 or 1, got {os.environ[name]!r}")
    return value == "1"


def from_environment() -> Environment:
    """Read the environment now (cheap: a few dictionary lookups), so that a variable set after import, as
    tests and notebooks do, still counts."""
    precision = os.environ.get("FUSEDLOSS_TRITON_FP32_PRECISION", "").strip() or None
    if precision is not None and precision not in ("ieee", "tf32", "tf32x3"):
        raise ValueError("environment variable FUSEDLOSS_TRITON_FP32_PRECISION must be ieee, tf32 or tf32x3, "
                         f"got {precision!r}")
    workspace = _megabytes("FUSEDLOSS_WORKSPACE_MB")
    return Environment(grad_in_forward=_flag("FUSEDLOSS_GRAD_IN_FORWARD"), workspace_mb=workspace,
                       allow_tf32=_flag("FUSEDLOSS_ALLOW_TF32"),
                       triton_fp32_precision=precision, deterministic=_flag("FUSEDLOSS_DETERMINISTIC"),
                       cuda_epilogue=_auto_flag("FUSEDLOSS_CUDA_EPILOGUE"))


class RunOptions(NamedTuple):
    """How one call runs, from the public functions' keyword arguments (None: the environment's override,
    else the default). ``grad_in_forward``: take (True) or refuse (False) the 3-product path of a loss known in the
    forward; ``workspace_mb``: the GPU backends' logits workspace; ``allow_tf32``: TF32 products for fp32
    inputs."""

    grad_in_forward: Optional[bool] = None
    workspace_mb: Optional[float] = None
    allow_tf32: Optional[bool] = None

    @classmethod
    def checked(cls, *, grad_in_forward=None, workspace_mb=None, allow_tf32=None) -> "RunOptions":
        for name, value in (("grad_in_forward", grad_in_forward), ("allow_tf32", allow_tf32)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be True, False or None, got {value!r}")
        if workspace_mb is not None:
            workspace_mb = workspace_megabytes(workspace_mb, "workspace_mb")
        return cls(grad_in_forward, workspace_mb, allow_tf32)

    def problem_fields(self) -> dict:
        """The options the backends read, as ``StatsProblem`` fields (only those set)."""
        return {k: v for k, v in (("workspace_mb", self.workspace_mb), ("allow_tf32", self.allow_tf32))
                if v is not None}


def interpreting_triton() -> bool:
    """Whether Triton runs its interpreter (kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
