"""The statistics of a vocabulary-parallel head: each rank's, merged exactly into those of the full head.

Each rank runs whichever backend it has on its own rows and gets finalised per-row statistics
(``problem.Statistics``) of its columns. To merge them with the one exact merge of ``core/partials.py``
(the one tiles and Triton splits use), each rank's statistics are written as the partials of its columns
in the frame of its own log-sum-exp ``(hi, lo)`` instead of its row maximum (q_r: the rank-local softmax)::

    m = hi      t = expm1(lo)      s = 1 + t = e^lo = sum e^(z - hi)
    e  = s (lo - H_r)                    = sum e^(z - hi) (z - hi)
    s2 = e^(2 lo + log sum q_r^2)        = sum e^(2 (z - hi))
    sz = mean_logit_r * V_r
    mt = hi_t   st = e^lo_t
    ztm = teacher_at_max_r               a = s (kl_rev_rel_r - (hi - row_max_r))
    b  = st (KL_r(p||q) + lo_t - lo)

which is exact for any backend without asking it for its internal state. Two statistics are not sums over
columns and are merged apart:

* ``logp`` is formed in the frame of the rank that owns the target: ``(logp_o + lo_o) + (hi_o - M) -
  log s``, where ``logp_o + lo_o = z_y - hi_o`` keeps its digits (the owner formed it as
  ``(z_y - m) - log s``) and ``hi_o - M`` is exactly 0 when the owner holds the largest log-sum-exp, as it
  does for the confident rows whose ``1 - q_y`` matters (docs/design.md, "Numerical doctrine").
* ``is_top1`` (the target is the first argmax): the owner says whether y is the first maximum of its rows,
  then z_y (= the owner's row maximum, exactly) must exceed the row maximum of every rank before it and
  reach at least that of every rank after it: exact ties across a shard boundary go to the lower id, as
  ``argmax`` does.

Which statistics travel depends only on what the call asks for, never on the data, so every rank packs
the same fields and enters the same collective.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Sequence

import torch

from ..core import partials
from ..core.problem import Statistics, StatsProblem

NOT_HERE = 2**62
"""Local target of a valid row whose target another rank holds: a column id that no backend's tile, padded
or not, ever reaches, so the row keeps every statistic and gets no target column (-1 would ignore it)."""


# Which local statistics the merge needs, in packing order, and when (a few values per token travel).
_PACKED = (
    ("lse", lambda p: True), ("lse_lo", lambda p: True),
    ("logp", lambda p: p.targets is not None),
    ("entropy", lambda p: p.want_entropy),
    ("log_sum_sq_probs", lambda p: p.want_extras),
    ("row_max", lambda p: p.want_extras or (p.has_teacher and p.want_kl_rev)),
    ("is_top1", lambda p: p.want_extras and p.targets is not None),
    ("mean_logit", lambda p: p.want_mean_logit),
    ("lse_t", lambda p: p.has_teacher), ("lse_t_lo", lambda p: p.has_teacher),
    # the reverse KL relative to each rank's maximum column (core/partials.py), moved to the row's in the merge
    ("kl_rev_rel", lambda p: p.has_teacher and p.want_kl_rev),
    ("teacher_at_max", lambda p: p.has_teacher and p.want_kl_rev),
    ("kl_fwd", lambda p: p.has_teacher and p.want_kl_fwd),
)


def packed_fields(p: StatsProblem) -> tuple:
    """The local statistics the merge needs for this problem, in packing order."""
    return tuple(name for name, wanted in _PACKED if wanted(p))


_EMPTY_SHARD = {"lse": -math.inf, "lse_t": -math.inf, "row_max": -math.inf}


def pack(stats: Optional[Statistics], fields: Sequence[str], rows: int, device, dtype) -> torch.Tensor:
    """``[len(fields), rows]``: this rank's statistics, or those of no columns at all (``stats`` None: an
    empty shard, whose log-sum-exp and row maximum are -inf)."""
    if stats is None:
        return torch.stack([torch.full((rows,), _EMPTY_SHARD.get(f, 0.0), device=device, dtype=dtype)
                            for f in fields])
    return torch.stack([getattr(stats, f) for f in fields])


def local_targets(targets: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Global target ids -> this rank's columns: -1 stays -1 (ignored), ids in ``[start, start + rows)``
    become local ids, every other valid row gets ``NOT_HERE``."""
    here = (targets >= start) & (targets < start + rows)
    return torch.where(targets < 0, targets, torch.where(here, targets - start, torch.full_like(targets, NOT_HERE)))


def owners(targets: torch.Tensor, starts: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
    """``[N]``: the rank whose real rows hold each row's target, -1 for ignored rows. A rank owns y when the
    shards before it end at or below y and its own does not; empty shards end where the previous one does."""
    ends = _host_constant(tuple(s + n for s, n in zip(starts, rows)), targets.device)
    owner = torch.searchsorted(ends, targets, right=True)
    return torch.where(targets < 0, torch.full_like(owner, -1), owner)


@lru_cache(maxsize=64)
def _host_constant(values: tuple, device: torch.device) -> torch.Tensor:
    # Cached: building it copies from the host, which must not happen (and synchronise) every call.
    return torch.tensor(values, dtype=torch.int64, device=device)


def merge(gathered: torch.Tensor, fields: Sequence[str], p: StatsProblem, rows: Sequence[int], vocab_size: int,
          owner: Optional[torch.Tensor]) -> dict:
    """Statistics of the full head (``problem.Statistics`` names) from every rank's packed statistics
    (``gathered``: ``[P, len(fields), N]``, rank order). ``rows``: the real rows of each rank; ``owner``:
    ``owners(...)`` of the global targets (None without targets). Rows are not zeroed here."""
    x = dict(zip(fields, gathered.unbind(1)))
    hi, lo = x["lse"], x["lse_lo"]
    zero = torch.zeros_like(hi)
    none = torch.isneginf(hi)  # an empty shard, or a row whose every logit on it is -inf

    def where_some(value):
        return torch.where(none, zero, value)

    t = where_some(torch.expm1(lo))
    s = where_some(1.0 + t)
    pieces = dict(m=hi, s=s, t=t)
    if "entropy" in x:
        pieces["e"] = where_some(s * (lo - x["entropy"]))
    if "log_sum_sq_probs" in x:
        pieces["s2"] = where_some(torch.exp(2.0 * lo + x["log_sum_sq_probs"]))
    if "mean_logit" in x:
        counts = _host_constant(tuple(rows), hi.device).to(hi.dtype)[:, None]
        pieces["sz"] = where_some(x["mean_logit"] * counts)
    if p.has_teacher:
        hi_t, lo_t = x["lse_t"], x["lse_t_lo"]
        none_t = torch.isneginf(hi_t)
        st = torch.where(none_t, zero, torch.exp(lo_t))
        pieces.update(mt=hi_t, st=st)
        if "kl_rev_rel" in x:
            pieces["a"] = where_some(s * (x["kl_rev_rel"] - (hi - x["row_max"])))
            pieces["ztm"] = x["teacher_at_max"]
        if "kl_fwd" in x:
            pieces["b"] = torch.where(none_t, zero, st * (x["kl_fwd"] + lo_t - lo))
    state = partials.merge(pieces)
    out = partials.finalize(state, p, vocab_size, has_targets=False)
    out.pop("row_max", None)
    row_max = x["row_max"].amax(0) if "row_max" in x else None
    if "kl_rev_rel" in x:  # finalised in the frame of the largest log-sum-exp: move it to the row maximum's
        shift = torch.where(torch.isneginf(row_max), zero[0], state["m"] - row_max)
        out["kl_rev_rel"] = out["kl_rev_rel"] + shift
    if owner is not None:
        rank = torch.arange(hi.shape[0], device=hi.device)[:, None]
        own = rank == owner[None, :]
        log_s = partials.log_s(state)
        if "logp" in x:
            in_owner_frame = torch.where(own, (x["logp"] + lo) + (hi - state["m"]), zero).sum(0)
            out["logp"] = in_owner_frame - log_s
        if "is_top1" in x:
            rank_max = x["row_max"]
            top_here = torch.where(own, x["is_top1"], zero).sum(0) > 0
            z_y = torch.where(own, rank_max, torch.full_like(rank_max, -math.inf)).amax(0)
            before = torch.where(rank < owner[None, :], rank_max < z_y, True).all(0)
            after = torch.where(rank > owner[None, :], rank_max <= z_y, True).all(0)
            out["is_top1"] = (top_here & before & after).to(hi.dtype)
    if row_max is not None:
        out["row_max"] = row_max
    return out
