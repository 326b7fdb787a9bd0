"""The statistics collective of a vocabulary-parallel head: one packed all-gather merged in rank order
(what fusedloss does) against the MAX + SUM all-reduces most peers use, over gloo on the CPU.

    python -m benchmarks.distributed_collectives [--world 2] [--rows 4096 16384] [--repeats 20]

For each payload (3 statistics per row: cross-entropy; 6: log-prob, entropy, is_top1; 11: forward and
reverse KL with a teacher) it times, per call, median over ``--repeats``: the all-gather of ``[k, N]`` plus
fusedloss's merge (``distributed.merge``), and two all-reduces (``[N]`` MAX, ``[k - 1, N]`` SUM) plus the
rescaling they need. gloo on a shared CPU says which design has fewer round trips and how the merge's
arithmetic compares with them; GPU interconnect figures follow from the sizes (benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fusedloss.core.problem import LogitTransform, StatsProblem
from fusedloss.distributed import _comm, merge

PAYLOADS = {
    3: dict(targets=True),
    6: dict(targets=True, want_entropy=True, want_extras=True),
    11: dict(targets=True, want_entropy=True, want_kl_rev=True, want_kl_fwd=True, teacher=True),
}


def _problem(n: int, flags: dict) -> StatsProblem:
    h = torch.zeros(n, 1)
    w = torch.zeros(1, 1)
    teacher = dict(teacher_hidden=h, teacher_weight=w) if flags.get("teacher") else {}
    wants = {k: v for k, v in flags.items() if k.startswith("want_")}
    return StatsProblem(hidden=h, weight=w, bias=None, targets=torch.zeros(n, dtype=torch.int64) if flags["targets"]
                        else None, transform=LogitTransform(), **teacher, **wants)


def _time(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _worker(rank, world, rows, repeats, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    group = dist.group.WORLD
    lines = []
    for n in rows:
        targets = torch.randint(0, 1000, (n,))
        for flags in PAYLOADS.values():
            p = _problem(n, flags)
            fields = merge.packed_fields(p)
            packed = torch.randn(len(fields), n)
            packed[fields.index("lse")] += 10.0
            per_rank = 1000 // world
            owner = merge.owners(targets % (per_rank * world), [r * per_rank for r in range(world)],
                                 [per_rank] * world)

            def gather_merge():
                gathered = _comm.all_gather(packed, group)
                merge.merge(gathered, fields, p, [per_rank] * world, per_rank * world, owner)

            def reduce_twice():
                m = packed[0].clone()
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
                rest = packed[1:] * torch.exp(packed[0] - m)  # rescale to the global max, then sum
                dist.all_reduce(rest, op=dist.ReduceOp.SUM, group=group)

            a = _time(gather_merge, repeats)
            b = _time(reduce_twice, repeats)
            gather_only = _time(lambda: _comm.all_gather(packed, group), repeats)
            lines.append(f"P={world} N={n:6d} k={len(fields):2d}: all-gather {gather_only * 1e3:7.3f} ms, "
                         f"+ merge {a * 1e3:7.3f} ms | MAX + SUM all-reduces {b * 1e3:7.3f} ms")
    if rank == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.world, args.rows, args.repeats, tmp), nprocs=args.world, join=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
