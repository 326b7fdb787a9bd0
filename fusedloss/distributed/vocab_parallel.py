"""Per-token statistics of a vocabulary-parallel head: the differentiable op behind every loss's
``process_group=`` (docs/design.md, "Distributed").

Forward, on every rank of the group:

1. the rank's backend computes the statistics of its own rows (targets mapped to its columns; rows whose
   target another rank holds stay valid with no target column, ``merge.NOT_HERE``);
2. one all-gather of the packed statistics (``merge.packed_fields``: 3 values per row for cross-entropy,
   up to 11 with a teacher), merged on every rank in rank order by ``merge.merge``: every rank holds the
   same bits, whatever the collective's algorithm;
3. the generalized JSD only: a second sweep of the rank's rows with the merged normalisers of both heads
   (the backend's ``jsd_sums``) and a second all-gather of two values per row.

Backward: the dz coefficients depend only on merged per-row scalars, so each rank's backend, handed the
*merged* log-sum-exps and coefficients, computes exactly its share of dz, d weight and d bias of its rows
without any statistics collective; one all-reduce (SUM) of d hidden completes it (skipped with
``reduce_hidden_grad=False``, for callers whose framework reduces it, e.g. sequence parallelism).

It is a ``torch.library`` op like the single-device one, with the group passed by name, so
``torch.compile(fullgraph=True)`` keeps a training step in one graph. No host synchronisation: every
shape and every collective depends only on the call's arguments, so a rank with an empty shard or no
valid row enters the same collectives as the others.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import registry
from ..core import statistics as core
from ..core.problem import GradientNeeds, Statistics, StatsProblem, accumulation_dtype
from . import _comm, merge
from .layout import VocabLayout

_LAYOUT_SCHEMA = "str group_name, int[] starts, int[] rows, int vocab_size, bool reduce_hidden_grad"
_NUM_OUTPUTS = len(Statistics._fields)


def _local(p: StatsProblem, start: int, rows: int) -> StatsProblem:
    """The problem of this rank's rows: targets as its column ids."""
    if p.targets is None:
        return p
    return dataclasses.replace(p, targets=merge.local_targets(p.targets, start, rows))


@torch.library.custom_op("fusedloss::vocab_parallel_statistics", mutates_args=(),
                         schema=f"({core._PROBLEM_SCHEMA}, str backend, {_LAYOUT_SCHEMA}) -> Tensor")
def _statistics_op(*args) -> torch.Tensor:
    *flat, backend, group_name, starts, rows, vocab_size, _reduce = args
    p = core._unflatten(flat)
    with core._on_device_of(p.hidden):
        return _forward(p, backend, _comm.resolve(group_name), starts, rows, vocab_size)


@_statistics_op.register_fake
def _(*args):
    hidden = args[0]
    return hidden.new_empty((_NUM_OUTPUTS, hidden.shape[0]), dtype=accumulation_dtype(hidden.dtype))


def _forward(p: StatsProblem, backend: str, group, starts, rows, vocab_size: int) -> torch.Tensor:
    rank = _comm.rank(group)
    n, acc, dev = p.hidden.shape[0], p.acc_dtype, p.hidden.device
    local = _local(p, starts[rank], rows[rank])
    fields = merge.packed_fields(p)
    # The JSD's mixture needs the merged normalisers: its sweep comes after the merge, not inside the backend.
    mine = registry.get(backend).forward_statistics(dataclasses.replace(local, jsd_beta=None)) if rows[rank] else None
    gathered = _comm.all_gather(merge.pack(mine, fields, n, dev, acc), group)
    owner = None if p.targets is None else merge.owners(p.targets, starts, rows)
    out = {name: torch.zeros(n, device=dev, dtype=acc) for name in Statistics._fields}
    out.update(merge.merge(gathered, fields, p, rows, vocab_size, owner))
    if p.jsd_beta is not None:
        if rows[rank]:
            sums = registry.jsd_sums(backend)(local, (out["lse"], out["lse_lo"]), (out["lse_t"], out["lse_t_lo"]))
            sums = torch.stack(sums)
        else:
            sums = torch.zeros((2, n), device=dev, dtype=acc)
        kl_qm, kl_pm = _comm.all_gather(sums, group).sum(0).unbind(0)  # summed in rank order
        out["kl_qm"] = kl_qm
        out["jsd"] = p.jsd_beta * kl_pm + (1.0 - p.jsd_beta) * kl_qm
    stacked = torch.stack([out[name] for name in Statistics._fields])
    if p.targets is not None:
        stacked = torch.where((p.targets >= 0)[None, :], stacked, torch.zeros((), device=dev, dtype=acc))
    return stacked


@torch.library.custom_op("fusedloss::vocab_parallel_statistics_backward", mutates_args=(),
                         schema=f"({core._PROBLEM_SCHEMA}, str backend, {_LAYOUT_SCHEMA}, Tensor stats, "
                                f"Tensor coeffs, {', '.join('bool ' + n for n in core._NEEDS)}) "
                                "-> (Tensor, Tensor, Tensor)")
def _backward_op(*args) -> tuple:
    *flat, backend, group_name, starts, rows, _vocab_size, reduce, stats, coeffs, need_h, need_w, need_b = args
    p = core._unflatten(flat)
    group = _comm.resolve(group_name)
    rank = _comm.rank(group)
    needs = GradientNeeds(need_h, need_w, need_b and p.bias is not None)
    with core._on_device_of(p.hidden):
        if rows[rank]:
            dh, dw, db = registry.get(backend).backward_gradients(_local(p, starts[rank], rows[rank]),
                                                                  Statistics(*stats.unbind(0)), coeffs, needs)
        else:  # an empty shard: no columns, no share of d hidden, but the same all-reduce as every rank
            dh = torch.zeros_like(p.hidden) if needs.hidden else None
            dw = torch.zeros_like(p.weight) if needs.weight else None
            db = torch.zeros_like(p.bias) if needs.bias else None
        if dh is not None and reduce:
            # Summed in fp32 (float64) whatever the dtype of hidden: bf16 partial sums rounded at every hop of
            # a ring would add P roundings of the full gradient.
            total = _comm.all_reduce_sum_(dh.to(p.acc_dtype), group)
            dh = total.to(p.hidden.dtype)
    empty = p.hidden.new_empty(0)
    return (empty if dh is None else dh, empty if dw is None else dw, empty if db is None else db)


@_backward_op.register_fake
def _(*args):
    *flat, _backend, _g, _s, _r, _v, _reduce, _stats, _coeffs, need_h, need_w, need_b = args
    p = core._unflatten(flat)
    return (
        torch.empty_like(p.hidden) if need_h else p.hidden.new_empty(0),
        torch.empty_like(p.weight) if need_w else p.hidden.new_empty(0),
        torch.empty_like(p.bias) if need_b and p.bias is not None else p.hidden.new_empty(0),
    )


def _setup_context(ctx, inputs, output):
    *flat, backend, group_name, starts, rows, vocab_size, reduce = inputs
    ctx.is_tensor = [isinstance(x, torch.Tensor) for x in flat]
    ctx.constants = [None if t else x for x, t in zip(flat, ctx.is_tensor)]
    ctx.layout = (backend, group_name, starts, rows, vocab_size, reduce)
    ctx.save_for_backward(*(x for x, t in zip(flat, ctx.is_tensor) if t), output)


def _backward(ctx, grad_stats):
    *tensors, stats = ctx.saved_tensors
    saved = iter(tensors)
    flat = [next(saved) if t else x for x, t in zip(ctx.constants, ctx.is_tensor)]
    p = core._unflatten(flat)
    backend, group_name, starts, rows, vocab_size, reduce = ctx.layout
    # Global targets, merged statistics, the logical vocabulary: the same coefficients on every rank.
    coeffs = core.dz_coefficients(grad_stats, stats, p.jsd_beta, p.targets, vocab_size)
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = need_b and p.bias is not None
    dh, dw, db = _backward_op(*flat, backend, group_name, starts, rows, vocab_size, reduce, stats, coeffs,
                              need_h, need_w, need_b)
    return ((dh if need_h else None, dw if need_w else None, db if need_b else None)
            + (None,) * (len(flat) - 3 + 6))


_statistics_op.register_autograd(_backward, setup_context=_setup_context)


def token_statistics(layout: VocabLayout, hidden: torch.Tensor, weight: torch.Tensor, *, backend: str,
                     reduce_hidden_grad: bool = True, **problem) -> Statistics:
    """``core.token_statistics`` for this rank's real rows ``weight`` (``[layout.local_real_rows, D]``) of a
    head laid out as ``layout``; ``problem`` takes ``core.statistics.build_problem``'s keywords, with
    global target ids. Every output is the full head's, the same on every rank."""
    p = core.build_problem(hidden, weight, **problem)
    stats = _statistics_op(*core._flatten(p), backend, layout.group_name, list(layout.starts),
                           list(layout.real_rows), layout.vocab_size, bool(reduce_hidden_grad))
    return Statistics(*stats.unbind(0))

