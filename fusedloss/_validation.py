"""Argument checks shared by every public function (docs/design.md, "Bad input"). Each error names the
argument and what was expected. Checks on values (targets in range) never synchronise with an accelerator
(``refuse_values``): on CPU tensors they raise the error with the offending value, on a GPU they are
device-side assertions, so that a training step can run ahead of the host and be captured in a CUDA graph.
They are skipped while torch.compile traces; the kernels never index out of bounds anyway, since targets
outside ``[0, V)`` reach them as ignored rows."""

from __future__ import annotations

import math
from numbers import Real
from typing import Callable, Iterable, Optional

import torch


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return f"{type(t).__name__} {t!r}"


def require_tensor(name: str, t, *, floating: Optional[bool] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {_describe(t)}")
    if floating is True and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
                        f"got {t.dtype}")
    if floating is False and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor of token ids, got {t.dtype}")
    return t


def require_shape(name: str, t: torch.Tensor, shape: Iterable[int], what: str = "") -> None:
    shape = tuple(shape)
    if tuple(t.shape) != shape:
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {shape}{extra}, got {tuple(t.shape)}")


def require_same_device(**tensors) -> torch.device:
    present = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    devices = {k: v.device for k, v in present.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{name} is on {dev} but {first_name} is on {first}: all tensors must be on one device")
    return first


def require_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def require_real(name: str, value, *, positive: bool = False, nonnegative: bool = False,
                 allow_none: bool = False, below: Optional[float] = None) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number{' or None' if allow_none else ''}, got {_describe(value)}")
    if not abs(value) < math.inf:  # NaN and +-inf fail; plain arithmetic folds under torch.compile
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if nonnegative and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    if below is not None and not value < below:
        raise ValueError(f"{name} must be < {below}, got {value!r}")


def require_positive_int(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_describe(value)}")


def require_mask(name: str, t, shape) -> torch.Tensor:
    require_tensor(name, t)
    require_shape(name, t, shape)
    if t.is_complex():
        raise TypeError(f"{name} must be a bool or 0/1 tensor, got {t.dtype}")
    return t


def refuse_values(bad: torch.Tensor, message: Callable[[], str], device_message: str, *,
                  synchronise: Optional[bool] = None) -> None:
    """Raise ``ValueError(message())`` when the one-element bool tensor ``bad`` is true, without a host
    synchronisation where one would cost something.

    On the CPU reading ``bad`` is free, so the error is raised here with ``message()`` (which may read values
    of the data to name the offender). On any other device ``bad`` becomes a device-side assertion
    (``torch._assert_async``) carrying ``device_message``: the host never waits for the device, so a step
    can run ahead and be captured in a CUDA graph; a failure surfaces at the next synchronisation as a
    device-side assert (rerun on CPU tensors, or with ``CUDA_LAUNCH_BLOCKING=1``, to see which call). Not
    checked while torch.compile traces or on meta tensors (no values). ``synchronise``: read ``bad`` on the
    host (default: on the CPU only)."""
    if torch.compiler.is_compiling() or bad.device.type == "meta":
        return
    if bad.device.type == "cpu" if synchronise is None else synchronise:
        if bool(bad):
            raise ValueError(message())
        return
    torch._assert_async(~bad, device_message)


def map_targets(name: str, targets: torch.Tensor, vocab_size: int, ignore_index: Optional[int], *,
                hint: str = "") -> torch.Tensor:
    """Flatten targets to int64 ``[N]`` with -1 on ignored rows, after checking they lie in ``[0, V)``
    (``refuse_values``: no host synchronisation on a GPU). ``hint``: what to do about it, appended to the
    message; ``ignore_index=None``: this argument has no ignore_index (every row counts; the caller masks),
    so the message does not name one."""
    flat = targets.reshape(-1).long()
    ignored = flat == ignore_index if ignore_index is not None else torch.zeros_like(flat, dtype=torch.bool)
    out_of_range = (flat < 0) | (flat >= vocab_size)
    bad = out_of_range & ~ignored
    allowed = f"outside [0, {vocab_size})" + (f" and not ignore_index ({ignore_index})" if ignore_index is not None
                                              else "")
    refuse_values(bad.any(), lambda: f"{name} contains {int(flat[bad][0])}, {allowed}{hint}",
                  f"{name} contains a value {allowed}{hint}")
    return torch.where(ignored | out_of_range, torch.full_like(flat, -1), flat)
