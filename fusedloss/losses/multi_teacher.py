"""Several teachers, one per position (docs/design.md, "Losses as per-token math").

Multi-teacher distillation (one expert teacher per prompt, as DeepSeek-V4's post-training distils its experts
into one student) routes each position to one teacher head: ``teacher_index`` says which. The loss is composed
of one single-teacher call per teacher over its own rows, merged: every backend, reduction and sharding option
of the single-teacher op applies unchanged, a teacher's head is read only on its own rows, and the extra memory
is one copy of the student's hidden rows (none when one teacher holds every position). The reduced losses merge
the groups' sums.

With two or more teachers in a call, each group runs the composable path unless ``grad_in_forward`` is set
(argument or FUSEDLOSS_GRAD_IN_FORWARD): a group on the grad-in-forward path holds its own ``[V, D]`` d weight of
the student's head from the forward to the backward, so k teachers would hold k copies of a head-sized gradient
(3 teachers, N = 1024, V = 131072, D = 256, fp32 on a CPU: 516 MiB extra against 261 MiB composable,
benchmarks/results/cpu-2026-12-04-teacher-topk.md). The composable path holds none and pays one more GEMM-sized
product per group instead.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import _validation as v
from .. import config
from ..types import Teacher
from .implicit_logits import count_or_one, items_divisor


class TeacherRows:
    """One teacher's share of the positions: ``rows`` (flat position ids, ascending), the teacher's hidden
    states on those rows ``[n, D_t]``, and the teacher itself."""

    def __init__(self, index: int, teacher: Teacher, rows: torch.Tensor, hidden: torch.Tensor):
        self.index, self.teacher, self.rows, self.hidden = index, teacher, rows, hidden


def teacher_groups(teachers: Sequence[Teacher], teacher_index, lead_shape: tuple, device: torch.device,
                   dtype: Optional[torch.dtype] = None) -> tuple[list, torch.Tensor]:
    """Validate ``teachers`` and ``teacher_index`` against the student's leading shape and split the positions:
    ``(groups, routed)``: the non-empty ``TeacherRows`` in teacher order, and ``[N]`` bool, True where a
    teacher is named (``teacher_index >= 0``). ``dtype``: the hidden dtype every teacher's must have."""
    if isinstance(teachers, Teacher) or not isinstance(teachers, (list, tuple)) or not teachers:
        raise TypeError("teachers must be a non-empty list of fusedloss.Teacher, got "
                        f"{type(teachers).__name__}")
    for i, t in enumerate(teachers):
        if not isinstance(t, Teacher):
            raise TypeError(f"teachers[{i}] must be a fusedloss.Teacher(hidden, weight, ...), got {type(t).__name__}")
        v.require_tensor(f"teachers[{i}].hidden", t.hidden, floating=True)
        v.require_tensor(f"teachers[{i}].weight", t.weight, floating=True)
        if t.bias is not None:
            v.require_tensor(f"teachers[{i}].bias", t.bias, floating=True)
        v.require_real(f"teachers[{i}].logit_scale", t.logit_scale)
        v.require_real(f"teachers[{i}].softcap", t.softcap, positive=True, allow_none=True)
        v.require_real(f"teachers[{i}].temperature", t.temperature, positive=True, allow_none=True)
        if dtype is not None and t.hidden.dtype != dtype:
            raise TypeError(f"teachers[{i}].hidden has dtype {t.hidden.dtype} but hidden has {dtype}: cast the "
                            "teacher's hidden states to the student's dtype")
        v.require_same_device(**{"hidden": torch.empty(0, device=device), f"teachers[{i}].hidden": t.hidden})
    v.require_tensor("teacher_index", teacher_index, floating=False)
    v.require_shape("teacher_index", teacher_index, lead_shape, "the leading shape of hidden")
    v.require_same_device(**{"hidden": torch.empty(0, device=device), "teacher_index": teacher_index})
    flat = teacher_index.reshape(-1)
    if flat.numel() and bool(((flat < -1) | (flat >= len(teachers))).any()):
        raise ValueError(f"teacher_index must hold values in [-1, {len(teachers)}) (-1: no teacher, the position "
                         f"is not scored), got values in [{int(flat.min())}, {int(flat.max())}]")
    n = flat.numel()
    groups = []
    for i, t in enumerate(teachers):
        rows = (flat == i).nonzero().squeeze(1)
        d_t = t.hidden.shape[-1] if t.hidden.dim() else 0
        if t.hidden.dim() >= 1 and tuple(t.hidden.shape[:-1]) == tuple(lead_shape):
            hidden = t.hidden.reshape(n, d_t)
            hidden = hidden if rows.numel() == n else hidden.index_select(0, rows)
        elif t.hidden.dim() == 2 and t.hidden.shape[0] == rows.numel():
            hidden = t.hidden
        else:
            raise ValueError(f"teachers[{i}].hidden must have the student's leading shape {tuple(lead_shape)} or "
                             f"hold this teacher's {rows.numel()} positions ([{rows.numel()}, D_t]), got shape "
                             f"{tuple(t.hidden.shape)}")
        if rows.numel():
            groups.append(TeacherRows(i, t, rows, hidden))
    return groups, flat >= 0


def multi_teacher_distillation(single: Callable, hidden: torch.Tensor, weight: torch.Tensor,
                               targets: Optional[torch.Tensor], teachers, teacher_index, *, temperature: float,
                               ignore_index: int, reduction: str, num_items_in_batch, **options) -> torch.Tensor:
    """``single`` (the single-teacher ``distillation_loss``) once per teacher over its rows, merged."""
    v.require_tensor("hidden", hidden, floating=True)
    v.require_real("temperature", temperature, positive=True)
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (its last is D)")
    lead = tuple(hidden.shape[:-1])
    groups, routed = teacher_groups(teachers, teacher_index, lead, hidden.device, hidden.dtype)
    n = routed.numel()
    flat_h = hidden.reshape(n, hidden.shape[-1])
    flat_y = None
    if targets is not None:
        v.require_tensor("targets", targets, floating=False)
        v.require_shape("targets", targets, lead, "the leading shape of hidden")
        flat_y = targets.reshape(n)
    out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    per_group = "none" if reduction == "none" else "sum"
    if len(groups) > 1 and options.get("grad_in_forward") is None and config.from_environment().grad_in_forward is None:
        options = {**options, "grad_in_forward": False}  # no held d weight per group (module docstring)
    parts = []
    for g in groups:
        whole = g.rows.numel() == n
        t = g.teacher
        parts.append((g.rows, single(
            flat_h if whole else flat_h.index_select(0, g.rows), weight, g.hidden, t.weight,
            None if flat_y is None else (flat_y if whole else flat_y.index_select(0, g.rows)),
            teacher_bias=t.bias, teacher_logit_scale=t.logit_scale, teacher_softcap=t.softcap,
            temperature=temperature if t.temperature is None else t.temperature, ignore_index=ignore_index,
            reduction=per_group, **options)))
    # A zero that depends on the student's tensors, for when no position is scored (zero gradients, as the
    # single-teacher loss gives).
    nothing = (flat_h[:0].sum() + weight.reshape(-1)[:0].sum()).to(out_dtype)
    if reduction == "none":
        per_token = nothing.expand(n).clone() if n else nothing.new_zeros(0)
        for rows, part in parts:
            per_token = per_token.index_copy(0, rows, part.to(out_dtype))
        return per_token.reshape(lead)
    total = nothing
    for _, part in parts:
        total = total + part
    if num_items_in_batch is not None:
        return total / items_divisor(num_items_in_batch, total.detach().double(), positive=True).to(out_dtype)
    if reduction == "sum":
        return total
    valid = routed if flat_y is None else routed & (flat_y != ignore_index)
    return total / count_or_one(valid.sum()).to(out_dtype)
