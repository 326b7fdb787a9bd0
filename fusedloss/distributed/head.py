"""Where the rows of a head live: one device, a vocabulary-parallel group, FSDP2 or ZeRO-3 shards.

``prepare_head`` is the one place a loss hands its ``hidden``, ``weight`` and ``bias`` (and the keyword
arguments ``process_group``, ``reduce_hidden_grad``, ``vocab_start``, ``vocab_size``,
``fsdp_vocab_parallel``) to: it returns plain tensors for the loss's usual checks, and a *distributed head*
that computes the per-token statistics when the rows are spread over ranks (None on one device). Rules:

* ``process_group`` given: ``weight`` / ``bias`` are this rank's contiguous rows of the full head, in rank
  order (``layout.py``); vocabulary-parallel.
* a DTensor ``weight`` sharded ``Shard(0)`` on one mesh dimension (Replicate on the others), with a DTensor
  ``hidden`` replicated on that dimension: tensor parallelism (torchtitan, ``ColwiseParallel``), the same
  as passing that dimension's group and the DTensor's offset.
* a DTensor ``weight`` with a plain ``hidden``: FSDP2 (each rank holds other tokens), ``fsdp.py``:
  gathered, or vocabulary-parallel over the data-parallel group with ``fsdp_vocab_parallel=True``.
* a DeepSpeed ZeRO-3 parameter: gathered in the forward and again in the backward (``zero3.py``).
* ``vocab_size`` below the rows held: the rows at or past it are padding. On one device the weight's
  prefix does it, with no kernel change; they get zero gradient (autograd of the slice).

Outputs are plain tensors, the full head's, the same on every rank of a vocabulary-parallel group.
"""

from __future__ import annotations

from numbers import Integral

import torch

from .. import _validation as v
from . import dtensor, fsdp, zero3
from . import layout as layouts
from .laid_out import padded_prefix, vocab_parallel_head

_PLAIN = (torch.Tensor, torch.nn.Parameter, type(None))  # not DTensors nor other tensor subclasses


def _check_options(reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel) -> None:
    v.require_bool("reduce_hidden_grad", reduce_hidden_grad)
    v.require_bool("fsdp_vocab_parallel", fsdp_vocab_parallel)
    for name, value, least in (("vocab_start", vocab_start, 0), ("vocab_size", vocab_size, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, Integral) or value < least):
            raise ValueError(f"{name} must be an int >= {least} or None, got {value!r}")


def prepare_head(hidden, weight, bias, *, process_group=None, reduce_hidden_grad=True, vocab_start=None,
                 vocab_size=None, fsdp_vocab_parallel=False, weight_name="weight"):
    """``(hidden, weight, bias, head)``: plain tensors for the loss's checks and, when the rows are spread over
    ranks, the distributed head that computes the statistics (else None)."""
    _check_options(reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel)
    if (process_group is None and vocab_start is None and not fsdp_vocab_parallel
            and all(type(t) in _PLAIN for t in (hidden, weight, bias)) and not zero3.is_partitioned(weight)):
        return (hidden, *padded_prefix(weight, bias, vocab_size, weight_name), None)  # one device: no dispatch
    if dtensor.is_dtensor(weight) and not dtensor.is_dtensor(hidden):  # FSDP2: each rank holds other tokens
        dim = dtensor.vocab_mesh_dim(weight, weight_name)
        if process_group is not None or vocab_start is not None:
            raise ValueError(f"{weight_name} is {dtensor.describe(weight)} and hidden a plain tensor (FSDP2): it is "
                             "gathered, or vocabulary-parallel over its mesh with fsdp_vocab_parallel=True; "
                             "process_group and vocab_start do not apply")
        return fsdp.prepare(hidden, weight, bias, dim=dim, vocab_size=vocab_size,
                            fsdp_vocab_parallel=fsdp_vocab_parallel, weight_name=weight_name)
    if dtensor.is_dtensor(weight) or dtensor.is_dtensor(hidden) or dtensor.is_dtensor(bias):
        return dtensor.prepare(hidden, weight, bias, process_group=process_group,
                               reduce_hidden_grad=reduce_hidden_grad, vocab_start=vocab_start, vocab_size=vocab_size,
                               fsdp_vocab_parallel=fsdp_vocab_parallel, weight_name=weight_name)
    if fsdp_vocab_parallel:
        raise ValueError(f"fsdp_vocab_parallel=True needs {weight_name} to be an FSDP2-sharded DTensor parameter "
                         f"(fully_shard), got a plain tensor")
    if zero3.is_partitioned(weight):
        if process_group is not None or vocab_start is not None:
            raise ValueError(f"{weight_name} is a DeepSpeed ZeRO-3 parameter (its partitions are not rows of the "
                             "head): it is gathered, so process_group and vocab_start do not apply")
        if not weight.requires_grad:  # a frozen head (a teacher): gathered once, a plain tensor from here on
            weight = zero3.frozen_copy(weight, hidden.dtype)
            bias = None if bias is None else zero3.frozen_copy(bias, hidden.dtype)
            weight, bias = padded_prefix(weight, bias, vocab_size, weight_name)
            return hidden, weight, bias, None
        head = zero3.Zero3Head(weight, bias, vocab_size)
        return (hidden, *head.stand_ins(hidden), head)
    if process_group is not None:
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"{weight_name} must be a 2-D tensor [rows of this rank, D], got {v._describe(weight)}")
        layout = layouts.resolve(process_group, weight.shape[0], vocab_start, vocab_size, hidden.device)
        return vocab_parallel_head(hidden, weight, bias, layout, reduce_hidden_grad)
    if vocab_start is not None:
        raise ValueError(f"vocab_start={vocab_start!r} needs a process_group (it places this rank's rows in a "
                         "vocabulary-parallel head)")
    weight, bias = padded_prefix(weight, bias, vocab_size, weight_name)
    return hidden, weight, bias, None


def check_same_rows(student, teacher) -> None:
    """A teacher head must be spread over the ranks exactly as the student's when the statistics are merged
    across ranks (each rank pairs its columns of both); a head gathered whole (FSDP2, ZeRO-3) also takes a
    whole teacher. Raised alike on every rank: the layouts come from the same gathered tables."""
    s, t = student.distributed, teacher.distributed
    if s is None and t is None:
        return
    if t is None and getattr(s, "takes_whole_teacher", False):
        return
    if s is None or t is None or not s.same_rows(t):
        raise ValueError("teacher_weight must be sharded exactly as weight (the same process group and the same "
                         f"rows on every rank); got {_describe_rows(t)} for teacher_weight and {_describe_rows(s)} "
                         "for weight")


def _describe_rows(head) -> str:
    if head is None:
        return "the whole head on this rank"
    layout = getattr(head, "layout", None)
    if layout is None:
        return type(head).__name__
    return "rows " + ", ".join(f"[{s}, {s + n})" for s, n in zip(layout.starts, layout.real_rows))
