"""The teacher's top-k log-probs straight from its hidden states (docs/design.md, "Losses as per-token math").

On-policy distillation ships the teacher's hidden states instead of its logits; ``sparse_distillation_loss``
needs the teacher's top-k ids and log-probs. ``topk_logprobs`` forms them one ``[rows, tile]`` logits block at
a time: a running top-k per row merged with each tile's, and the log-normaliser accumulated online from the
same tiles, so that the top-k values and the lse come from one and the same product (memory O(N k) plus one
bounded tile). The selection is exact, with one tie rule on every backend and shard layout: by value, then
the smaller vocabulary id first.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Optional

import torch

from .. import _validation as v
from ..backends.torch import ROW_CHUNK, VOCAB_TILE, Scratch, _logits_tile
from ..distributed import _comm
from ..types import TopK
from .implicit_logits import implicit_logits


def topk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, k: int, *, bias: Optional[torch.Tensor] = None,
                  temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None,
                  mask: Optional[torch.Tensor] = None, return_lse: bool = False, return_entropy: bool = False,
                  backend: str = "auto", process_group=None, vocab_start: Optional[int] = None,
                  vocab_size: Optional[int] = None) -> TopK:
    """The ``k`` most likely ids per position and their log-probs, from hidden states and the head's weight,
    without the ``[tokens x vocab]`` logits. For the teacher side of on-policy distillation: feed ``ids`` and
    ``logprobs`` to ``sparse_distillation_loss`` as ``teacher_ids`` and ``teacher_logprobs``.

    The logits are every op's, ``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature`` (fp32
    products for half inputs, float64 for float64), and ``logprobs = z - lse`` with ``lse`` accumulated from
    the very tiles the top-k values come from. No gradient: this runs under ``torch.no_grad()`` (a teacher's
    outputs are constants of the student's loss).

    Args:
        hidden: ``[..., D]`` hidden states.
        weight: ``[V, D]`` lm_head weight (this rank's contiguous rows with ``process_group``).
        k: how many ids per position, an int in ``[1, V]`` (V the global vocabulary under vocabulary
            parallelism, padding excluded).
        bias: ``[V]`` lm_head bias (this rank's rows with ``process_group``), or None.
        temperature, logit_scale, softcap: the logit transform, as in every loss.
        mask: bool ``[...]``; positions where it is False are not computed: ids -1, logprobs -inf, lse and
            entropy 0. None: every position.
        return_lse, return_entropy: also return the log-normaliser / the entropy per position (else None).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"cuda"``, validated as for every loss (a backend
            not available here is an error). Every backend computes the same tiles with plain torch products
            (cuBLAS on a GPU): the selection is exact, so the result is the same whichever is named.
        process_group: a vocabulary-parallel group: each rank computes its local top-k and lse partials, merged
            exactly by all-gathers; every rank gets the single-device result. ``hidden`` (and ``mask``) must be
            the same on every rank.
        vocab_start: global id of this rank's first row; None: derived from the shard sizes in rank order.
        vocab_size: the logical vocabulary: rows at or past it are padding and never selected.

    Ties: among equal log-probs the smaller vocabulary id comes first, exactly (on every backend and for
    every shard layout), and the ``k`` returned are the smallest ids among those tied at the cut.

    Returns:
        ``TopK(ids [..., k] int64, logprobs [..., k], lse [...] or None, entropy [...] or None)``, most likely
        first; float values fp32 (float64 for float64 inputs).

    Example::

        top = fusedloss.topk_logprobs(teacher_hidden, teacher.lm_head.weight, 20)
        loss = fusedloss.sparse_distillation_loss(hidden, model.lm_head.weight, top.ids, top.logprobs, beta=0.0)
    """
    with torch.no_grad():
        logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale,
                                 softcap=softcap, backend=backend, process_group=process_group,
                                 vocab_start=vocab_start, vocab_size=vocab_size)
        total = logits.vocab_size
        if isinstance(k, bool) or not isinstance(k, Integral) or not 1 <= k <= total:
            raise ValueError(f"k must be an int in [1, {total}] (the vocabulary size), got {k!r}")
        k = int(k)
        v.require_bool("return_lse", return_lse)
        v.require_bool("return_entropy", return_entropy)
        n = logits.num_rows
        h = logits.hidden.detach()
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        rows = None
        if mask is not None:
            v.require_mask("mask", mask, logits.lead_shape)
            v.require_same_device(hidden=h, mask=mask)
            rows = mask.reshape(n).to(torch.bool).nonzero().squeeze(1)
            h = h.index_select(0, rows)
        spread = logits.distributed
        start = 0 if spread is None else spread.layout.start
        w = logits.weight.detach()
        b = None if logits.bias is None else logits.bias.detach()
        values, ids, partial = _local_topk(h, w, b, logits.transform, k, start, acc, return_entropy)
        if spread is not None:
            values, ids, partial = _merge_ranks(values, ids, partial, k, spread.layout.group_name)
        values, ids = _ordered(values, ids)
        m, s, t = partial.unbind(0)
        log_s = torch.log(s)
        lse = m + log_s
        logprobs = values - lse.unsqueeze(1)
        entropy = log_s - t / s if return_entropy else None
        if rows is not None:
            logprobs = _scatter(logprobs, rows, n, -math.inf)
            ids = _scatter(ids, rows, n, -1)
            lse = _scatter(lse, rows, n, 0.0)
            entropy = None if entropy is None else _scatter(entropy, rows, n, 0.0)
        lead = logits.lead_shape
        return TopK(ids=ids.reshape(*lead, k), logprobs=logprobs.reshape(*lead, k),
                    lse=lse.reshape(lead) if return_lse else None,
                    entropy=None if entropy is None else entropy.reshape(lead))


def _scatter(x: torch.Tensor, rows: torch.Tensor, n: int, fill) -> torch.Tensor:
    out = x.new_full((n, *x.shape[1:]), fill)
    out.index_copy_(0, rows, x)
    return out


def _local_topk(h, w, b, transform, k: int, start: int, acc, want_entropy: bool):
    """This device's running top-k ``(values [n, k], global ids [n, k] (-1: none yet), partials [3, n])`` over
    its rows of the head, one ``[ROW_CHUNK, VOCAB_TILE]`` block at a time. The candidates are kept in id order
    (the merge's tie rule relies on it); ``partials`` are the online (max m, sum exp(z - m), sum exp(z - m)
    (z - m)) of every row (the last one 0 unless ``want_entropy``)."""
    n, vocab = h.shape[0], w.shape[0]
    dev = h.device
    values = torch.full((n, k), -math.inf, dtype=acc, device=dev)
    ids = torch.full((n, k), -1, dtype=torch.int64, device=dev)
    partial = torch.stack((torch.full((n,), -math.inf, dtype=acc, device=dev),
                           torch.zeros(n, dtype=acc, device=dev), torch.zeros(n, dtype=acc, device=dev)))
    scratch = Scratch(dev, acc)
    for r0 in range(0, n, ROW_CHUNK):
        r1 = min(n, r0 + ROW_CHUNK)
        run_v, run_i, run_p = values[r0:r1], ids[r0:r1], partial[:, r0:r1]
        for v0 in range(0, vocab, VOCAB_TILE):
            v1 = min(vocab, v0 + VOCAB_TILE)
            z, _ = _logits_tile(h[r0:r1], w[v0:v1], None if b is None else b[v0:v1], transform, acc,
                                scratch("z", r1 - r0, v1 - v0))
            tile_v, tile_i, row_max = _tile_candidates(z, k, start + v0)
            new_v, new_i = _select(torch.cat((run_v, tile_v), 1), torch.cat((run_i, tile_i), 1), k)
            run_v.copy_(new_v)
            run_i.copy_(new_i)
            run_p.copy_(_merge_partials(run_p, _tile_partials(z, row_max, want_entropy)))
    return values, ids, partial


def _tile_candidates(z: torch.Tensor, k: int, first_id: int):
    """The tile's ``min(k, cols)`` best entries by ``(value, -id)``, in id order, with their global ids, and
    the row maxima. One ``topk`` of ``k + 1`` decides them, except in rows where the (k+1)-th value equals the
    k-th (a tie across the cut, where ``topk`` picks any of the tied): those rows are selected exactly."""
    rows, cols = z.shape
    if cols <= k:
        ids = torch.arange(first_id, first_id + cols, device=z.device).expand(rows, cols)
        return z, ids, z.amax(1)
    top_v, top_i = z.topk(k + 1, dim=1)
    row_max = top_v[:, 0]
    cut = top_v[:, k] == top_v[:, k - 1]
    top_v, top_i = top_v[:, :k], top_i[:, :k]
    top_i, order = top_i.sort(dim=1)
    top_v = top_v.gather(1, order)
    if bool(cut.any()):
        tied = cut.nonzero().squeeze(1)
        local = torch.arange(cols, device=z.device).expand(tied.numel(), cols)
        exact_v, exact_i = _select(z.index_select(0, tied), local, k)
        top_v = top_v.index_copy(0, tied, exact_v)
        top_i = top_i.index_copy(0, tied, exact_i)
    return top_v, top_i + first_id, row_max


def _tile_partials(z: torch.Tensor, m: torch.Tensor, want_entropy: bool) -> torch.Tensor:
    """(max, sum exp(z - max), sum exp(z - max) (z - max)) of a tile, given its row maxima; ``z`` is
    overwritten."""
    shift = torch.where(torch.isneginf(m), torch.zeros_like(m), m).unsqueeze(1)
    e = z.sub_(shift).exp_()
    s = e.sum(1)
    # -entr(e) = e log e = e (z - max), 0 where e is 0 (a -inf logit) rather than 0 * -inf
    t = torch.special.entr(e).sum(1).neg_() if want_entropy else torch.zeros_like(s)
    return torch.stack((m, s, t))


def _merge_partials(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(m, s, t) of the union of two sets of columns, each ``[3, n]``, or ``[3, P, n]`` reduced over P when ``b``
    is None."""
    parts = a if b is None else torch.stack((a, b), 1)  # [3, P, n]
    pm, ps, pt = parts.unbind(0)
    m = pm.amax(0)
    shift = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    delta = pm - shift  # <= 0; -inf for a part with no finite column
    scale = delta.exp()
    present = ps > 0
    zero = torch.zeros_like(ps)
    s = torch.where(present, ps * scale, zero).sum(0)
    t = torch.where(present, (pt + delta * ps) * scale, zero).sum(0)
    return torch.stack((m, s, t))


def _select(values: torch.Tensor, ids: torch.Tensor, k: int):
    """The ``k`` entries of each row with the largest ``(value, -id)``, kept in their order along the row.
    Entries with id -1 are not candidates; the others must have ascending ids along the row (then the order
    along the row is the id order that breaks ties). Every row must hold the same number of candidates."""
    valid = ids >= 0
    kth = values.topk(k, dim=1).values[:, k - 1:]
    greater = (values > kth) & valid
    tied = (values == kth) & valid
    room = k - greater.sum(1, keepdim=True)
    chosen = greater | (tied & (tied.cumsum(1) <= room))
    count = int(chosen[:1].sum()) if values.shape[0] else k
    out_v = values[chosen].reshape(values.shape[0], count)
    out_i = ids[chosen].reshape(values.shape[0], count)
    if count < k:  # fewer candidates than k so far (the first tiles, a small shard)
        out_v = torch.cat((out_v, out_v.new_full((values.shape[0], k - count), -math.inf)), 1)
        out_i = torch.cat((out_i, out_i.new_full((values.shape[0], k - count), -1)), 1)
    return out_v, out_i


def _ordered(values: torch.Tensor, ids: torch.Tensor):
    """Most likely first; a stable sort of candidates held in id order puts the smaller id first among ties."""
    order = values.sort(dim=1, descending=True, stable=True).indices
    return values.gather(1, order), ids.gather(1, order)


def _merge_ranks(values, ids, partial, k: int, group_name: str):
    """The global top-k and partials from every rank's: gathered in rank order (so that the candidates stay in
    id order), then selected with the same rule. Every rank enters the same collectives."""
    group = _comm.resolve(group_name)
    world = _comm.size(group)
    n = values.shape[0]
    all_v = _comm.all_gather(values, group)  # [P, n, k]
    all_i = _comm.all_gather(ids, group)
    all_p = _comm.all_gather(partial, group)  # [P, 3, n]
    cand_v = all_v.permute(1, 0, 2).reshape(n, world * k)
    cand_i = all_i.permute(1, 0, 2).reshape(n, world * k)
    # Ranks in order: the real candidates (id >= 0) stay in id order, whatever empty slots lie between them.
    top_v, top_i = _select(cand_v, cand_i, k)
    return top_v, top_i, _merge_partials(all_p.permute(1, 0, 2), None)


def multi_teacher_topk_logprobs(teachers, teacher_index: torch.Tensor, k: int, *, temperature: float = 1.0,
                                mask: Optional[torch.Tensor] = None, return_lse: bool = False,
                                return_entropy: bool = False, backend: str = "auto", process_group=None,
                                vocab_start: Optional[int] = None, vocab_size: Optional[int] = None) -> TopK:
    """``topk_logprobs`` with a teacher per position: position i's top-k from ``teachers[teacher_index[i]]``
    (``fusedloss.Teacher``: its own hidden states, head, bias, logit_scale, softcap and temperature, the
    call's ``temperature`` when None), one ``topk_logprobs`` call per teacher over its own rows. The result
    feeds ``sparse_distillation_loss`` as a single teacher's does.

    Args:
        teachers: a non-empty list of ``fusedloss.Teacher``; each one's ``hidden`` holds every position
            (``teacher_index``'s shape + ``[D_t]``) or only its own rows ``[n_t, D_t]`` in position order.
            All teachers' hidden states share one dtype.
        teacher_index: integer ``[...]``: which teacher each position's top-k comes from; -1: none (as masked).
        k, mask, return_lse, return_entropy, backend, process_group, vocab_start, vocab_size: as in
            ``topk_logprobs`` (``process_group``: every teacher's head is sharded over it the same way).

    Returns:
        ``TopK`` with the leading shape of ``teacher_index``; ids -1, log-probs -inf, lse and entropy 0 at
        masked positions and positions without a teacher.
    """
    from .multi_teacher import teacher_groups

    if isinstance(teachers, (list, tuple)) and teachers and hasattr(teachers[0], "hidden"):
        dtype = teachers[0].hidden.dtype if isinstance(teachers[0].hidden, torch.Tensor) else None
    else:
        dtype = None
    device = teacher_index.device if isinstance(teacher_index, torch.Tensor) else torch.device("cpu")
    lead = tuple(teacher_index.shape) if isinstance(teacher_index, torch.Tensor) else ()
    groups, _ = teacher_groups(teachers, teacher_index, lead, device, dtype)
    v.require_real("temperature", temperature, positive=True)
    n = teacher_index.numel()
    flat_mask = None
    if mask is not None:
        v.require_mask("mask", mask, lead)
        flat_mask = mask.reshape(n).to(torch.bool)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if isinstance(k, bool) or not isinstance(k, Integral) or k < 1:
        raise ValueError(f"k must be an int in [1, V] (the vocabulary size), got {k!r}")
    ids = torch.full((n, k), -1, dtype=torch.int64, device=device)
    logprobs = torch.full((n, k), -math.inf, dtype=acc, device=device)
    lse = torch.zeros(n, dtype=acc, device=device)
    entropy = torch.zeros(n, dtype=acc, device=device)
    for g in groups:
        t = g.teacher
        part = topk_logprobs(g.hidden, t.weight, k, bias=t.bias,
                             temperature=temperature if t.temperature is None else t.temperature,
                             logit_scale=t.logit_scale, softcap=t.softcap,
                             mask=None if flat_mask is None else flat_mask.index_select(0, g.rows),
                             return_lse=return_lse, return_entropy=return_entropy, backend=backend,
                             process_group=process_group, vocab_start=vocab_start, vocab_size=vocab_size)
        ids.index_copy_(0, g.rows, part.ids)
        logprobs.index_copy_(0, g.rows, part.logprobs)
        if return_lse:
            lse.index_copy_(0, g.rows, part.lse)
        if return_entropy:
            entropy.index_copy_(0, g.rows, part.entropy)
    return TopK(ids=ids.reshape(*lead, k), logprobs=logprobs.reshape(*lead, k),
                lse=lse.reshape(lead) if return_lse else None,
                entropy=entropy.reshape(lead) if return_entropy else None)
