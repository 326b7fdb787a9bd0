"""DeepSpeed ZeRO-3 heads: gathered in the forward and again in the backward.

A ZeRO-3 parameter holds a flat partition of the flattened tensor (``param.data`` is empty outside its
module's forward), not rows of the head, so it cannot be vocabulary-parallel; it is gathered whole. The
forward gathers it (``deepspeed.zero.GatheredParameters``) around the statistics, and the backward, which
recomputes the logits, gathers it again: ZeRO-3 re-partitions the head between the two, so the weight the
op saved would be empty by then (why TRL used to fall back to its own chunked function). The gradient of
the whole parameter goes to autograd's accumulator, where ZeRO-3's own hook reduce-scatters it into the
partitions. Parameters that are already gathered (inside their module's forward, or TRL's
``maybe_gather_lm_head_ctx``) are used as they are: GatheredParameters cannot nest over one parameter.
A frozen ZeRO-3 head (a distillation teacher) has no gradient to reduce: it is gathered once and kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple, Optional

import torch

from ..core import statistics as core
from ..core.problem import Statistics


def is_partitioned(t) -> bool:
    """A DeepSpeed ZeRO-3 parameter (its data is a flat partition, gathered around its module's forward)."""
    return hasattr(t, "ds_id") and hasattr(t, "ds_status")


def gathered(*params):
    """Gather the ZeRO-3 parameters among ``params`` that are not gathered now, for the ``with`` block."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    todo = [p for p in params if p is not None and is_partitioned(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    return deepspeed.zero.GatheredParameters(todo, modifier_rank=None) if todo else contextlib.nullcontext()


def full_shape(param) -> torch.Size:
    return torch.Size(param.ds_shape)


def stand_in(param, dtype, device) -> torch.Tensor:
    """A tensor with the whole parameter's shape and no memory (a broadcast view), for the loss's checks."""
    shape = full_shape(param)
    return torch.empty(shape[1:], dtype=dtype, device=device).expand(shape)


def frozen_copy(param, dtype) -> torch.Tensor:
    """A frozen ZeRO-3 head (a teacher) gathered once, as a plain tensor kept for the backward's recompute."""
    with gathered(param):
        return param.detach().to(dtype, copy=True)


class Zero3Head:
    """A ZeRO-3 head (and bias), gathered whole for each pass; ``vocab_size`` rows of it are real."""

    takes_whole_teacher = True

    def __init__(self, weight, bias, vocab_size):
        self.weight, self.bias = weight, bias
        self.rows = full_shape(weight)[0]
        if vocab_size is not None and vocab_size > self.rows:
            raise ValueError(f"vocab_size={vocab_size} but weight has only {self.rows} rows")
        self._vocab = self.rows if vocab_size is None else vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def same_rows(self, other) -> bool:
        return isinstance(other, Zero3Head) and other.vocab_size == self.vocab_size

    def stand_ins(self, hidden):
        w = stand_in(self.weight, hidden.dtype, hidden.device)[: self._vocab]
        b = None if self.bias is None else stand_in(self.bias, hidden.dtype, hidden.device)[: self._vocab]
        return w, b

    def statistics(self, logits, *, targets=None, teacher=None, transform=None, **wants) -> Statistics:
        p = core.build_problem(logits.hidden, logits.weight, bias=logits.bias, targets=targets, transform=transform,
                               teacher=teacher, **wants)
        # Applied while gathered: autograd records the shapes of the inputs here, and checks the gradients the
        # backward returns against them (the whole parameter's, not an empty partition's).
        with gathered(self.weight, self.bias):
            stats = _Zero3.apply(logits.hidden, self.weight, self.bias, p, logits.backend, self._vocab)
        return Statistics(*stats.unbind(0))


def token_statistics(hidden: torch.Tensor, weight, *, bias=None, backend: str, teacher=None, **problem) -> Statistics:
    """``core.token_statistics`` for a ZeRO-3 ``weight`` (and ``bias``), gathered or not at the call (TRL
    calls inside its own gather). A frozen ZeRO-3 teacher head is gathered once."""
    if teacher is not None and is_partitioned(teacher.weight):
        dtype = teacher.hidden.dtype
        teacher = teacher._replace(weight=frozen_copy(teacher.weight, dtype),
                                   bias=None if teacher.bias is None else frozen_copy(teacher.bias, dtype))
    head = Zero3Head(weight, bias, None)
    w, b = head.stand_ins(hidden)
    logits = _Logits(hidden, w, b, backend)
    return head.statistics(logits, teacher=teacher, **problem)


class _Logits(NamedTuple):
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    backend: str


def _student(p, w_param, b_param, vocab: int, dtype):
    """The problem with the gathered head's real rows in the compute dtype (call inside ``gathered``)."""
    w = w_param[:vocab].to(dtype)
    b = None if b_param is None else b_param[:vocab].to(dtype)
    return dataclasses.replace(p, weight=w, bias=b)


class _Zero3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, w_param, b_param, p, backend, vocab):
        full = _student(p, w_param, b_param, vocab, hidden.dtype)
        stats = core._statistics_op(*core._flatten(full), backend)
        ctx.save_for_backward(hidden, stats)
        # The parameters themselves, not their data: ZeRO-3 swaps the data between the passes.
        ctx.params, ctx.problem, ctx.backend, ctx.vocab = (w_param, b_param), p, backend, vocab
        return stats

    @staticmethod
    def backward(ctx, grad):
        hidden, stats = ctx.saved_tensors
        (w_param, b_param), p = ctx.params, ctx.problem
        gather = gathered(w_param, b_param)
        gather.__enter__()
        full = dataclasses.replace(_student(p, w_param, b_param, ctx.vocab, hidden.dtype), hidden=hidden)
        dh, dw, db = core.head_gradients(full, ctx.backend, stats, grad, ctx.vocab, ctx.needs_input_grad)
        need_w, need_b = dw is not None, db is not None
        # Autograd accumulates a gradient into a tensor of the parameter's current shape, and ZeRO-3's hook
        # reduce-scatters it from there: the parameters stay gathered until their gradients are accumulated.
        _release_after_accumulation(gather, [q for q, need in ((w_param, need_w), (b_param, need_b)) if need])

        def whole(g, param):  # zero rows past vocab_size, in the parameter's dtype and full shape
            out = torch.zeros(full_shape(param), dtype=param.dtype, device=g.device)
            out[: g.shape[0]] = g
            return out

        return (dh, whole(dw, w_param) if need_w else None, whole(db, b_param) if need_b else None,
                None, None, None)


def _release_after_accumulation(gather, params) -> None:
    """Leave ``gather`` once every one of ``params`` has its gradient accumulated (at once if none)."""
    if not params:
        gather.__exit__(None, None, None)
        return
    pending = {id(q) for q in params}
    handles = []

    def done(param):
        pending.discard(id(param))
        if not pending:
            for h in handles:
                h.remove()
            gather.__exit__(None, None, None)

    handles.extend(q.register_post_accumulate_grad_hook(done) for q in params)
