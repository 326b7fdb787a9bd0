"""Which rows of the full head each rank holds, agreed once per group and shard shape.

A vocabulary-parallel head is any partition of the rows into contiguous shards in rank order: equal
(Megatron), ceil-div with a short or empty last rank (``torch.chunk``, DTensor ``Shard(0)``), balanced, or
64-granular. Each rank knows its own row count; ``vocab_start`` may be given or derived. One tiny
all-gather of ``(rows, vocab_start, vocab_size)`` gives every rank the whole table; it is checked on every
rank from the same table, so a bad layout raises the same ``ValueError`` on every rank instead of hanging
the ones that would have gone on. The result is cached per (group, this rank's rows, vocab_start,
vocab_size): a training step pays no collective and no host synchronisation for it. The cache assumes
what training does, one sharding per group and shard shape: two heads sharded differently over one group
whose shards coincide on some rank but not on another would make that rank skip the collective the others
enter (``forget`` clears the cache, on every rank at the same point). A DTensor head needs no collective
at all: its global shape and mesh give every rank's rows (``from_chunks``).

Rows at or past ``vocab_size`` (the logical vocabulary) are padding (Megatron's
``make_vocab_size_divisible_by``, tokenizers padded to 64): each rank drops its padded tail before any
statistic is formed (``real_rows``), so they never enter a softmax and get zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import _comm


@dataclass(frozen=True)
class VocabLayout:
    group_name: str
    rank: int
    starts: tuple  # global id of each rank's first row
    rows: tuple  # weight rows each rank holds, padding included
    vocab_size: int  # the logical vocabulary: rows at or past it are padding

    @property
    def world(self) -> int:
        return len(self.rows)

    @property
    def real_rows(self) -> tuple:
        """Rows of each rank that are real tokens (its rows below ``vocab_size``)."""
        return tuple(max(0, min(n, self.vocab_size - s)) for s, n in zip(self.starts, self.rows))

    @property
    def start(self) -> int:
        return self.starts[self.rank]

    @property
    def local_real_rows(self) -> int:
        return self.real_rows[self.rank]


def resolve(group, local_rows: int, vocab_start: Optional[int], vocab_size: Optional[int],
            device: torch.device) -> VocabLayout:
    """The layout of a head sharded over ``group``, of which this rank holds ``local_rows`` rows."""
    name = _comm.name_of(group)
    rank, starts, rows, size = _layout(name, int(local_rows), -1 if vocab_start is None else int(vocab_start),
                                       -1 if vocab_size is None else int(vocab_size), device.type)
    return VocabLayout(group_name=name, rank=rank, starts=starts, rows=rows, vocab_size=size)


_CACHE: dict = {}


def forget() -> None:
    """Clear the layouts learnt so far (call it on every rank of the group at the same point)."""
    _CACHE.clear()


def from_chunks(group, total_rows: int, vocab_size: Optional[int]) -> VocabLayout:
    """The layout of a DTensor ``Shard(0)`` head of ``total_rows`` rows over ``group``: ``torch.chunk``'s
    split (ceil-div rows per rank, the last ranks short or empty), known to every rank without a collective."""
    world = _comm.size(group)
    chunk = -(-total_rows // world)
    rows = tuple(max(0, min(chunk, total_rows - r * chunk)) for r in range(world))
    table = [(n, sum(rows[:r]), -1 if vocab_size is None else int(vocab_size)) for r, n in enumerate(rows)]
    starts, rows, size = _checked(table)
    return VocabLayout(group_name=_comm.name_of(group), rank=_comm.rank(group), starts=starts, rows=rows,
                       vocab_size=size)


@torch.compiler.assume_constant_result
def _layout(group_name: str, local_rows: int, vocab_start: int, vocab_size: int, device_type: str) -> tuple:
    """``(rank, starts, rows, vocab_size)`` (-1: not given). Constant for a process and its arguments:
    torch.compile takes it at trace time, as eager mode takes it from the cache. Only layouts that passed the
    checks are cached: after a misuse raised on every rank, no rank may skip the collective of the next call
    while another enters it."""
    key = (group_name, local_rows, vocab_start, vocab_size, device_type)
    if key not in _CACHE:
        group = _comm.resolve(group_name)
        device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
                  else torch.device(device_type))
        mine = torch.tensor([local_rows, vocab_start, vocab_size], dtype=torch.int64, device=device)
        table = [tuple(int(x) for x in row) for row in _comm.all_gather(mine, group).cpu().tolist()]
        _CACHE[key] = (_comm.rank(group),) + _checked(table)
    return _CACHE[key]


def _checked(table: list) -> tuple:
    """``(starts, rows, vocab_size)`` from every rank's ``(rows, vocab_start, vocab_size)``, or the ValueError
    that every rank raises alike (they all hold the same table)."""
    rows = tuple(r[0] for r in table)
    given = [r[1] for r in table]
    sizes = {r[2] for r in table}
    described = ", ".join(f"rank {i}: {n} rows" + (f" from {s}" if s >= 0 else "")
                          for i, (n, s, _) in enumerate(table))
    if len(sizes) > 1:
        raise ValueError(f"vocab_size differs between the ranks of the process group ({sorted(sizes)}; -1: not "
                         "given): every rank must pass the same logical vocabulary size, or none")
    if any(s >= 0 for s in given) and not all(s >= 0 for s in given):
        raise ValueError("vocab_start must be given on every rank of the process group or on none "
                         f"({described})")
    starts = tuple(sum(rows[:i]) for i in range(len(rows)))
    if given[0] >= 0 and tuple(given) != starts:
        raise ValueError("the vocabulary shards do not add up: each rank's weight must hold contiguous rows of "
                         f"the full head, in rank order, starting at 0 ({described})")
    total = sum(rows)
    vocab_size = sizes.pop()
    if vocab_size < 0:
        vocab_size = total
    if vocab_size > total:
        raise ValueError(f"vocab_size={vocab_size} but the shards of the process group hold {total} rows in "
                         f"total ({described})")
    if vocab_size == 0:
        raise ValueError(f"the head has no vocabulary rows on any rank ({described})")
    return starts, rows, vocab_size
