"""Argument checks shared by every public function (docs/design.md, "Bad input"). Each error names the
argument and what was expected. Checks on values (targets in range) are skipped while torch.compile traces,
because they need a host synchronisation; the kernels never index out of bounds anyway, since targets outside
``[0, V)`` reach them as ignored rows."""

from __future__ import annotations

import math
from numbers import Real
from typing import Iterable, Optional

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


def map_targets(name: str, targets: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """Flatten targets to int64 ``[N]`` with -1 on ignored rows, after checking they lie in ``[0, V)``."""
    flat = targets.reshape(-1).long()
    ignored = flat == ignore_index
    out_of_range = (flat < 0) | (flat >= vocab_size)
    if not torch.compiler.is_compiling() and flat.device.type != "meta":
        bad = out_of_range & ~ignored
        if bool(bad.any()):
            value = int(flat[bad][0])
            raise ValueError(f"{name} contains {value}, outside [0, {vocab_size}) and not ignore_index "
                             f"({ignore_index})")
    return torch.where(ignored | out_of_range, torch.full_like(flat, -1), flat)
