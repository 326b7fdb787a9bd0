"""FSDP2 heads: a ``Shard(0)`` DTensor weight with plain per-rank hidden states (each rank its own tokens).

Read outside its module's forward, an FSDP2 parameter is the sharded DTensor (the fp32 master under a
MixedPrecisionPolicy). Two ways to use it (docs/design.md, "Distributed"):

* gathered (default): the head is all-gathered (cast to the dtype of ``hidden``, as FSDP's ``param_dtype``
  would) once in the forward and once more in the backward, never per chunk and never kept in between;
  the backward reduce-scatters d weight and divides it by the group size, FSDP2's gradient averaging, into
  the sharded parameter's ``.grad``. ``register_fsdp_forward_method`` is the other hook for this: running
  the loss inside the head module's FSDP forward (``call_in_forward``) lets FSDP do the gather, the cast
  and the reduce-scatter with its own settings (reduce dtype, divide factor, HSDP), and is the one to use
  when those are not FSDP2's defaults.
* ``fsdp_vocab_parallel=True``: the head is never gathered. The hidden states (and targets, teacher hidden
  states) of every rank are all-gathered, every rank computes the statistics of all tokens on its own rows
  (``vocab_parallel``), keeps those of its tokens, and the backward reduce-scatters d hidden back to the
  tokens' ranks; d weight of its rows is complete (every rank's tokens), divided by the group size. It moves
  ``P N D`` hidden values instead of ``V D`` weights each way: it pays when the tokens of the whole group are
  fewer than the vocabulary (small RL batches, huge vocabularies). It needs one tiny all-gather of the
  token counts per call (a host synchronisation) since ranks may hold different numbers of tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import statistics as core
from ..core.problem import Statistics
from . import _comm, dtensor, vocab_parallel
from . import layout as layouts
from .laid_out import LaidOutHead


def prepare(hidden, weight, bias, *, dim: int, vocab_size, fsdp_vocab_parallel: bool, weight_name: str):
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"{weight_name} is a DTensor on a {mesh.ndim}-D mesh with a plain hidden: only a 1-D FSDP2 "
                         "mesh is handled here (HSDP needs FSDP's own reduction: run the loss inside the head "
                         "module's forward with fusedloss.distributed.fsdp.call_in_forward)")
    layout = dtensor.layout_of(weight, dim, vocab_size, weight_name)
    w_local = weight.to_local()
    b_local = dtensor.local_bias(bias, weight)
    # The sharded parameter is FSDP's master copy (fp32 under a MixedPrecisionPolicy): compute in the
    # dtype of hidden, as FSDP's param_dtype cast would; the cast's backward returns the master's dtype.
    w_local = w_local.to(hidden.dtype)
    b_local = None if b_local is None else b_local.to(hidden.dtype)
    if fsdp_vocab_parallel:
        real = layout.local_real_rows
        return hidden, w_local[:real], None if b_local is None else b_local[:real], VocabParallelOverData(layout)
    return hidden, w_local, b_local, GatheredHead(layout)


class GatheredHead(LaidOutHead):
    """Each rank's rows of an FSDP2 head, gathered whole for each pass."""

    takes_whole_teacher = True

    def statistics(self, logits, *, targets=None, teacher=None, transform=None, **wants) -> Statistics:
        if teacher is not None and teacher.weight.shape[0] != self.layout.vocab_size:
            teacher = _gathered_teacher(teacher, self.layout)
        p = core.build_problem(logits.hidden, logits.weight, bias=logits.bias, targets=targets, transform=transform,
                               teacher=teacher, **wants)
        stats = _Gathered.apply(logits.hidden, logits.weight, logits.bias, p, logits.backend, self.layout)
        return Statistics(*stats.unbind(0))


def _gathered_teacher(teacher, layout):
    """A frozen FSDP2 teacher's rows, gathered once (it has no gradient; the backward recomputes from it)."""
    w, b = _gather_head(teacher.weight, teacher.bias, layout)
    return teacher._replace(weight=w, bias=b)


def _gather_head(w_local, b_local, layout: layouts.VocabLayout):
    group = _comm.resolve(layout.group_name)
    w = _comm.all_gather_rows(w_local, layout.rows, group)[:layout.vocab_size]
    b = None if b_local is None else _comm.all_gather_rows(b_local, layout.rows, group)[:layout.vocab_size]
    return w, b


def _scatter_mean(grad: torch.Tensor, like: torch.Tensor, layout: layouts.VocabLayout) -> torch.Tensor:
    """This rank's rows of the sum over ranks of ``grad`` (``[vocab_size, ...]``, zero on the padding), divided
    by the group size (FSDP2's averaging), summed in fp32 (float64)."""
    group = _comm.resolve(layout.group_name)
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    pad = sum(layout.rows) - grad.shape[0]
    full = torch.cat((grad.to(acc), grad.new_zeros((pad, *grad.shape[1:]), dtype=acc)))
    mine = _comm.reduce_scatter_rows(full, layout.rows, group)
    return (mine / layout.world).to(like.dtype)


class _Gathered(torch.autograd.Function):
    """Statistics of an FSDP2 head gathered in the forward and again in the backward (never held between)."""

    @staticmethod
    def forward(ctx, hidden, w_local, b_local, p, backend, layout):
        w, b = _gather_head(w_local, b_local, layout)
        stats = core._statistics_op(*core._flatten(dataclasses.replace(p, weight=w, bias=b)), backend)
        ctx.save_for_backward(hidden, w_local, b_local, stats)
        ctx.problem, ctx.backend, ctx.layout = p, backend, layout
        return stats

    @staticmethod
    def backward(ctx, grad):
        hidden, w_local, b_local, stats = ctx.saved_tensors
        p, layout = ctx.problem, ctx.layout
        w, b = _gather_head(w_local, b_local, layout)
        full = dataclasses.replace(p, hidden=hidden, weight=w, bias=b)
        dh, dw, db = core.head_gradients(full, ctx.backend, stats, grad, layout.vocab_size, ctx.needs_input_grad)
        return (dh, None if dw is None else _scatter_mean(dw, w_local, layout),
                None if db is None else _scatter_mean(db, b_local, layout), None, None, None)


class VocabParallelOverData(LaidOutHead):
    """An FSDP2 head used as vocabulary-parallel over its data-parallel group (``fsdp_vocab_parallel=True``)."""

    def statistics(self, logits, *, targets=None, teacher=None, transform=None, **wants) -> Statistics:
        group = _comm.resolve(self.layout.group_name)
        n = logits.hidden.shape[0]
        counts = tuple(int(c) for c in _comm.all_gather(torch.tensor([n], device=logits.hidden.device), group).view(-1))
        hidden = _GatherTokens.apply(logits.hidden, counts, self.layout.group_name)
        if targets is not None:
            targets = _comm.all_gather_rows(targets, counts, group)
        if teacher is not None:
            teacher = teacher._replace(hidden=_comm.all_gather_rows(teacher.hidden.detach(), counts, group))
        # d weight of this rank's rows sums every rank's tokens; FSDP2 averages over the group.
        weight = _ScaleGrad.apply(logits.weight, 1.0 / self.layout.world)
        bias = None if logits.bias is None else _ScaleGrad.apply(logits.bias, 1.0 / self.layout.world)
        stats = vocab_parallel.token_statistics(self.layout, hidden, weight, bias=bias, targets=targets,
                                                transform=transform, teacher=teacher, backend=logits.backend,
                                                reduce_hidden_grad=False, **wants)
        mine = _OwnTokens.apply(torch.stack(tuple(stats)), counts, self.layout.group_name)
        return Statistics(*mine.unbind(0))


class _GatherTokens(torch.autograd.Function):
    """Every rank's rows, concatenated in rank order; the backward sums the partial gradients of every rank
    and returns this rank's rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, t, counts, group_name):
        ctx.counts, ctx.group_name = counts, group_name
        return _comm.all_gather_rows(t, counts, _comm.resolve(group_name))

    @staticmethod
    def backward(ctx, grad):
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        mine = _comm.reduce_scatter_rows(grad.to(acc).contiguous(), ctx.counts, _comm.resolve(ctx.group_name))
        return mine.to(grad.dtype), None, None


class _OwnTokens(torch.autograd.Function):
    """This rank's tokens of statistics that every rank holds for all tokens (``[F, sum(counts)]``); the
    backward gathers every rank's gradients, so that every rank forms the same coefficients."""

    @staticmethod
    def forward(ctx, stats, counts, group_name):
        rank = _comm.rank(_comm.resolve(group_name))
        ctx.counts, ctx.group_name = counts, group_name
        start = sum(counts[:rank])
        return stats[:, start:start + counts[rank]].clone()

    @staticmethod
    def backward(ctx, grad):
        gathered = _comm.all_gather_rows(grad.T.contiguous(), ctx.counts, _comm.resolve(ctx.group_name))
        return gathered.T.contiguous(), None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def call_in_forward(module, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` inside the FSDP2 forward of ``module`` (``register_fsdp_forward_method``): FSDP
    gathers and casts the module's parameters before, frees them after, gathers them again before the
    backward reaches the outputs and reduce-scatters their gradients, with its own settings. Inside ``fn``,
    ``module.weight`` is the plain gathered tensor. Pass the tensors the loss differentiates through (the
    hidden states) in ``args``, so that FSDP's post-backward runs once their gradients are done. On a module
    that is not an FSDPModule, plainly ``fn(*args, **kwargs)``."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(module, FSDPModule):
        return fn(*args, **kwargs)
    if "_fusedloss_call" not in module.__dict__:
        module._fusedloss_call = _run.__get__(module, type(module))
        register_fsdp_forward_method(module, "_fusedloss_call")
    return module._fusedloss_call(fn, *args, **kwargs)


def _run(self, fn, *args, **kwargs):
    return fn(*args, **kwargs)
