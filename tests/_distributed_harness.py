"""Spawned gloo ranks on the CPU for the distributed tests (docs/design.md, "Distributed").

Spawning costs seconds here, so one spawn runs many checks: ``run(world, checks, tmp)`` starts ``world``
ranks (gloo, one thread each); every rank runs every check in order, catching its exceptions, and saves
what it returns; the parent gets ``results[rank][check name]``, either ``{"value": ...}`` or
``{"error": (type name, message)}``. A check is ``(name, module, function, kwargs)``; the function is
called as ``fn(rank=..., world=..., **kwargs)`` in every rank and must enter the same collectives on every
rank unless it raises on every rank. The process group times out after ``timeout`` seconds, so a rank left
waiting in a collective fails the run instead of hanging it.
"""

from __future__ import annotations

import importlib
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fusedloss.distributed.layout import forget as forget_layouts


def run(world: int, checks: list, tmp, *, debug: bool = False, timeout: float = 60.0) -> list:
    tmp = str(tmp)
    mp.spawn(_worker, args=(world, checks, tmp, debug, timeout), nprocs=world, join=True)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _worker(rank: int, world: int, checks: list, tmp: str, debug: bool, timeout: float) -> None:
    torch.set_num_threads(1)
    if debug:
        # Turns a collective entered with different shapes on different ranks into an error.
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    results = {}
    try:
        for name, module, function, kwargs in checks:
            # Checks shard heads in many ways over one group: each starts with no layout learnt (training has
            # one sharding per group; fusedloss.distributed.layout explains why it caches).
            forget_layouts()
            fn = getattr(importlib.import_module(module), function)
            try:
                results[name] = {"value": fn(rank=rank, world=world, **kwargs)}
            except Exception as exc:  # recorded, judged by the parent
                results[name] = {"error": (type(exc).__name__, str(exc)), "traceback": traceback.format_exc()}
    finally:
        torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
        dist.destroy_process_group()


def value(results: list, name: str, rank: int = 0):
    """The value a check returned on ``rank``; a check that raised fails the test with its traceback."""
    got = results[rank][name]
    if "error" in got:
        raise AssertionError(f"check {name!r} raised on rank {rank}:\n{got['traceback']}")
    return got["value"]
