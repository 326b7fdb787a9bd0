"""Every collective fusedloss issues, in one module (docs/design.md, "Distributed").

Plain c10d collectives only: the statistics they carry feed custom autograd functions with closed-form
backwards, so an autograd-aware collective (``torch.distributed.nn``) would multiply the gradient of a
replicated output by the group size. Every helper here is entered by every rank of the group in the same
order whatever its data (an empty shard, no valid row), because a rank that skips one hangs the others.

Gathers use the concatenated output form (``[P * n]``): gloo rejects the stacked ``[P, n]`` form that
NCCL accepts. torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``;
both spellings are detected here so that older releases keep working.

A ``torch.library`` op cannot take a ProcessGroup argument, so the ops carry the group's name and
``resolve`` turns it back into the group (the same private lookup functional collectives use).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def name_of(group) -> str:
    """The name a process group is registered under (the default group when ``group`` is None)."""
    if group is None:
        group = dist.group.WORLD
    return group.group_name


def resolve(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def rank(group) -> int:
    return dist.get_rank(group)


def size(group) -> int:
    return dist.get_world_size(group)


def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """``[P, *t.shape]``: every rank's ``t`` (same shape on every rank), stacked in rank order."""
    t = t.contiguous()
    out = t.new_empty((size(group) * t.numel(),))
    _all_gather_single(out, t.reshape(-1), group=group)
    return out.reshape(size(group), *t.shape)


def all_gather_rows(t: torch.Tensor, counts: tuple, group) -> torch.Tensor:
    """Concatenate along dim 0 the ``t`` of every rank, which holds ``counts[rank]`` rows (uneven counts:
    padded to the largest for the collective, then cut)."""
    most = max(counts)
    if t.shape[0] < most:
        t = torch.cat((t, t.new_zeros((most - t.shape[0], *t.shape[1:]))))
    stacked = all_gather(t, group)
    return torch.cat([stacked[r, :c] for r, c in enumerate(counts)])


def all_reduce_sum_(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def reduce_scatter_rows(t: torch.Tensor, counts: tuple, group) -> torch.Tensor:
    """The sum over ranks of ``t`` (``[sum(counts), ...]``, same on every rank in shape), this rank's
    ``counts[rank]`` rows of it (uneven counts: each rank's block padded to the largest)."""
    most = max(counts)
    blocks, start = [], 0
    for c in counts:
        block = t[start:start + c]
        if c < most:
            block = torch.cat((block, block.new_zeros((most - c, *t.shape[1:]))))
        blocks.append(block)
        start += c
    out = t.new_empty((most, *t.shape[1:]))
    _reduce_scatter_single(out, torch.cat(blocks).contiguous(), op=dist.ReduceOp.SUM, group=group)
    return out[:counts[rank(group)]]
