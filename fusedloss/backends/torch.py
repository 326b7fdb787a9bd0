"""Portable PyTorch backend of the statistics core: runs on any device torch runs on.

It walks ``[rows_chunk, vocab_tile]`` tiles of the logits with an online max, exactly as the Triton
and CUDA kernels do, so its memory is bounded by one tile (plus the gradients themselves) whatever N
and V are. Each tile is summarised by the partial statistics of ``core/partials.py`` and merged into the running
ones there; the same merge serves the Triton backend's vocabulary splits and the ranks of a
vocabulary-parallel head. The gradient of a tile follows problem.py's dz formula term by term, as the
Triton and CUDA kernels do (``logits_gradient_tile``; docs/design.md, "The dz formula").
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..core import columns, partials
from ..core.problem import (
    COEF_CONST,
    COEF_KL_REV,
    COEF_LOGM,
    COEF_LOGQ,
    COEF_ONEHOT,
    COEF_TEACHER_PROB,
    COEF_UNIFORM,
    GradientNeeds,
    LogitTransform,
    Statistics,
    StatsProblem,
    gathered_rows,
    valid_rows,
)


def availability() -> str:
    """Plain PyTorch ops: this backend runs wherever torch does."""
    return "available"


# Tile sizes. The largest transient tensor is a few [ROW_CHUNK, VOCAB_TILE] fp32 tiles:
# 1024 x 4096 x 4 B = 16 MiB each, independent of N and V.
ROW_CHUNK = 1024
VOCAB_TILE = 4096


def _raw_product(h: torch.Tensor, w: torch.Tensor, acc: torch.dtype, out: Optional[torch.Tensor] = None):
    """``h @ w.T`` with fp32 (float64) accumulation *and output*: rounding the logits to bf16 before the
    softmax is one of the precision bugs peers shipped, so half inputs are multiplied into fp32. ``out``: a
    buffer of the call to write into (same-dtype products)."""
    if h.dtype == acc:
        return torch.mm(h, w.T, out=out) if out is not None else h @ w.T
    if h.is_cuda:
        try:
            return torch.mm(h, w.T, out_dtype=acc)
        except (RuntimeError, TypeError):
            pass
    return h.to(acc) @ w.to(acc).T


def _transform(x: torch.Tensor, b: Optional[torch.Tensor], tf: LogitTransform):
    """Raw product -> (z, capped) where capped is the soft-capped value (needed by the chain rule). ``x`` is
    the tile's own product and is transformed in place: on a CPU a fresh tile costs as much as the pass that
    fills it (its pages are faulted in)."""
    if b is not None:
        x.add_(b.to(x.dtype))
    if tf.logit_scale != 1.0:
        x.mul_(tf.logit_scale)
    if tf.softcap is not None:
        x.div_(tf.softcap).tanh_().mul_(tf.softcap)
        return (x / tf.temperature if tf.temperature != 1.0 else x), x
    if tf.temperature != 1.0:
        x.div_(tf.temperature)
    return x, x


def _logits_tile(h, w, b, tf, acc, out=None):
    return _transform(_raw_product(h, w, acc, out), b, tf)


class Scratch:
    """Tile-sized buffers reused across the tiles of one call, one per name: on a CPU a fresh [rows, cols]
    tensor costs about as much as the pass that fills it (measured 79 ms for ``z - m`` into a new 32 MiB tile
    against 26 ms in place), so the passes write into these."""

    def __init__(self, device, dtype):
        self.device, self.dtype, self.buffers = device, dtype, {}

    def __call__(self, name: str, rows: int, cols: int) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < rows * cols:
            buf = self.buffers[name] = torch.empty(rows * cols, device=self.device, dtype=self.dtype)
        return buf[: rows * cols].view(rows, cols)


def _finite_or_zero(m):
    """A row maximum to subtract: 0 for a row whose every logit is -inf (masked vocabulary), so that
    z - m stays -inf (exp 0) instead of -inf - -inf = NaN."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _xlogy_terms(prob, log_ratio):
    """prob * log_ratio, with 0 where prob == 0 (0 * -inf would be NaN); a NaN prob stays NaN. A scalar 0
    rather than a zeros tensor: one [rows, tile] allocation less per call (measured 1.46x on this op)."""
    return torch.where(prob == 0, 0.0, prob * log_ratio)


def _kl_terms(prob, log_own, log_other):
    """The columns of a KL sum, prob * (log_own - log_other) with prob = e^log_own at some scale (a tile's
    maximum): 0 where log_own = -inf (0 log 0), and +inf where log_own is finite but log_other = -inf (mass
    where the other side has none), whatever exp underflows to at that scale. So the KL does not depend on
    how the vocabulary was cut into tiles, splits or ranks (docs/design.md, "Numerical doctrine")."""
    terms = _xlogy_terms(prob, log_own - log_other)
    return torch.where(torch.isneginf(log_other) & torch.isfinite(log_own), math.inf, terms)


def _row_dot(a, b):
    """sum_j a_j b_j per row (measured on a CPU at [170, 32768] fp32: 1.6 ms, where the batched product
    ``a[:, None] @ b[:, :, None]`` took 6.4 ms)."""
    return torch.linalg.vecdot(a, b, dim=1)


def _guarded_row_sum(prob, log_ratio, careful):
    """``careful(rows).sum(1)`` (the columns of an xlogy or KL sum, with their rules for 0 and infinite
    logs), computed as the plain dot of prob and log_ratio wherever that is finite: the rules change a
    column only where it meets an infinity or a NaN, and such a column makes the row's dot non-finite, so
    only those rows are formed column by column (on a CPU, where the check costs no device wait)."""
    if prob.device.type != "cpu":
        return careful(slice(None)).sum(1)
    out = _row_dot(prob, log_ratio)
    bad = ~torch.isfinite(out)
    if bool(bad.any()):
        out[bad] = careful(bad).sum(1)
    return out


def _student_partials(z: torch.Tensor, zc_out: torch.Tensor, scratch: Scratch):
    """The student's side of a tile's partials: ``(part, first_max, zc, ez)``, with zc = z - m written into
    ``zc_out`` (``z`` itself on the grad-in-forward fast route, which consumes its tile) and ez = e^zc in
    ``scratch("ez")``. The other fields of ``part`` are their empty values."""
    rows, cols = z.shape
    zero = torch.zeros(rows, device=z.device, dtype=z.dtype)
    neg_inf = torch.full_like(zero, -math.inf)
    m, first_max = z.max(dim=1, keepdim=True)  # the first maximum on ties, as argmax
    m = m.squeeze(1)
    zc = torch.sub(z, _finite_or_zero(m)[:, None], out=zc_out)
    ez = torch.exp(zc, out=scratch("ez", rows, cols))
    # t: every column but the first maximum (whose e^0 = 1 is implicit); tied maxima still count 1 each. That
    # column is zeroed in ez: its terms of e and a are 0 anyway (z - m = 0, and z_t - ztm = 0 there).
    ez.scatter_(1, first_max, 0.0)
    t = ez.sum(1)
    part = dict(m=m, s=torch.where(torch.isneginf(m), 0.0, 1.0 + t), t=t, e=zero, s2=zero, sz=zero,
                mt=neg_inf, st=zero, a=zero, b=zero, zy=zero, mb=neg_inf, ztm=zero)
    return part, first_max, zc, ez


def _tile_partials(z: torch.Tensor, zt: Optional[torch.Tensor], p: StatsProblem, tgt, v0: int, v1: int,
                   scratch: Optional[Scratch] = None) -> dict:
    """The partial statistics (core/partials.py) of one tile of student (and teacher) logits. ``scratch``:
    the call's reusable buffers for the tile-sized intermediates; with a teacher, ``scratch("d")`` is left
    holding (z - m) - (z_t - ztm), the reverse KL's log-ratio in its frame, for a gradient of the same tile
    (``logits_gradient_tile``'s ``kl_ratio``)."""
    rows, cols = z.shape
    scratch = scratch or Scratch(z.device, z.dtype)
    part, first_max, zc, ez = _student_partials(z, scratch("zc", rows, cols), scratch)
    m = part["m"]
    if p.want_entropy:
        part["e"] = _guarded_row_sum(ez, zc, lambda r: _xlogy_terms(ez[r], zc[r]))
    if p.want_extras:
        part["s2"] = torch.where(torch.isneginf(m), 0.0, 1.0 + _row_dot(ez, ez))
    if p.want_mean_logit:
        part["sz"] = z.sum(1)
    if zt is not None:
        mt = zt.amax(dim=1)
        ztc = torch.sub(zt, _finite_or_zero(mt)[:, None], out=scratch("ztc", rows, cols))
        ezt = torch.exp(ztc, out=scratch("ezt", rows, cols))
        # a relative to the student's maximum column (core/partials.py): its own term is exactly 0.
        ztm = zt.gather(1, first_max).squeeze(1)
        ztr = torch.sub(zt, _finite_or_zero(ztm)[:, None], out=scratch("ztr", rows, cols))
        a = _guarded_row_sum(ez, torch.sub(zc, ztr, out=scratch("d", rows, cols)),
                             lambda r: _kl_terms(ez[r], zc[r], ztr[r]))
        part.update(mt=mt, st=ezt.sum(1), a=partials.reverse_kl_infinite(a, m, ztm), ztm=ztm)
        if p.want_kl_fwd:
            part["b"] = _guarded_row_sum(ezt, torch.sub(ztc, zc, out=scratch("d_fwd", rows, cols)),
                                         lambda r: _kl_terms(ezt[r], ztc[r], zc[r]))
    if tgt is not None:
        part["zy"] = _gather_target(z, tgt, v0, v1)
        if p.want_extras:
            part["mb"] = _max_before_target(z, tgt, v0, v1)
    return part


def _gather_target(z, targets_rows, v0, v1):
    """z[r, y_r - v0] for rows whose target lies in [v0, v1), else 0."""
    inside = (targets_rows >= v0) & (targets_rows < v1)
    idx = torch.where(inside, targets_rows - v0, torch.zeros_like(targets_rows))
    picked = z.gather(1, idx[:, None]).squeeze(1)
    return torch.where(inside, picked, torch.zeros_like(picked))


def _log_mixture(logq, logp, beta):
    """log m with m = (1 - beta) q + beta p, formed in the log domain (no underflow for tiny q, p)."""
    return torch.logaddexp(logq + math.log1p(-beta), logp + math.log(beta))


def _max_before_target(z, targets_rows, v0, v1):
    """max of z over the tile's columns that come before each row's target (-inf where there are none).
    With it, is_top1 follows argmax's rule on ties: the target must be the *first* maximum."""
    cols = torch.arange(v0, v1, device=z.device)
    before = cols[None, :] < targets_rows[:, None]
    return torch.where(before, z, torch.full_like(z, -math.inf)).amax(1)


def _log_probs(z, lse, lse_lo):
    return (z - lse[:, None]) - lse_lo[:, None]


def _jsd_sums(z, zt, lse, lse_t, beta):
    """KL(q || m) and KL(p || m) of a tile, summed over its columns (lse, lse_t: (hi, lo) pairs)."""
    logq, logpt = _log_probs(z, *lse), _log_probs(zt, *lse_t)
    logm = _log_mixture(logq, logpt, beta)
    return (_xlogy_terms(torch.exp(logq), logq - logm).sum(1),
            _xlogy_terms(torch.exp(logpt), logpt - logm).sum(1))


def _student_tile(p: StatsProblem, rows, v0: int, v1: int, out=None):
    return _logits_tile(p.hidden[rows], p.weight[v0:v1], None if p.bias is None else p.bias[v0:v1], p.transform,
                        p.acc_dtype, out)


def _teacher_tile(p: StatsProblem, rows, v0: int, v1: int, out=None):
    if not p.has_teacher:
        return None
    tb = None if p.teacher_bias is None else p.teacher_bias[v0:v1]
    return _logits_tile(p.teacher_hidden[rows], p.teacher_weight[v0:v1], tb, p.teacher_transform, p.acc_dtype,
                        out)[0]


def forward_statistics(p: StatsProblem):
    """The problem's ``Statistics``; with named columns, ``(Statistics, [N, K] logits at them)``, read from the
    tiles the statistics are folded from (core/columns.py)."""
    # Ignored rows (padding, prompt tokens) cost nothing: run on the valid rows only. backward_gradients
    # recomputes the logits in these same row blocks.
    rows = valid_rows(p)
    if rows is None:
        stats, logits = _forward_rows(p)
    else:
        n = p.hidden.shape[0]
        full = torch.zeros((len(Statistics._fields), n), device=p.hidden.device, dtype=p.acc_dtype)
        logits = None if p.columns is None else torch.zeros(p.columns.shape, device=p.hidden.device,
                                                               dtype=p.acc_dtype)
        if rows.numel():
            some, some_logits = _forward_rows(gathered_rows(p, rows))
            full.index_copy_(1, rows, torch.stack(tuple(some)))
            if logits is not None:
                logits.index_copy_(0, rows, some_logits)
        stats = Statistics(*full.unbind(0))
    return stats if p.columns is None else (stats, logits)


def _forward_rows(p: StatsProblem) -> tuple:
    """(statistics, logits at the named columns or None) of rows that all have a target >= 0 (or none):
    forward_statistics picks them."""
    acc = p.acc_dtype
    n, v = p.hidden.shape[0], p.weight.shape[0]
    dev = p.hidden.device
    out = {name: torch.zeros(n, device=dev, dtype=acc) for name in Statistics._fields}
    named = None if p.columns is None else torch.zeros(p.columns.shape, device=dev, dtype=acc)
    scratch = Scratch(dev, acc)
    for r0 in range(0, n, ROW_CHUNK):
        rows = slice(r0, min(n, r0 + ROW_CHUNK))
        tgt = p.targets[rows] if p.targets is not None else None
        state = partials.empty(rows.stop - r0, dev, acc)
        for v0 in range(0, v, VOCAB_TILE):
            v1 = min(v, v0 + VOCAB_TILE)
            cols = v1 - v0
            z, _ = _student_tile(p, rows, v0, v1, scratch("z", rows.stop - r0, cols))
            zt = _teacher_tile(p, rows, v0, v1, scratch("zt", rows.stop - r0, cols))
            if named is not None:
                named[rows] = columns.gather(z, p.columns[rows], v0, named[rows])
            state = partials.merge_pair(state, _tile_partials(z, zt, p, tgt, v0, v1, scratch))
        for name, value in partials.finalize(state, p, v).items():
            out[name][rows] = value
    if p.jsd_beta is not None:
        # The mixture m needs both normalisers, so the generalized JSD takes a second sweep.
        kl_qm, kl_pm = jsd_sums(p, (out["lse"], out["lse_lo"]), (out["lse_t"], out["lse_t_lo"]))
        out["kl_qm"] = kl_qm
        out["jsd"] = p.jsd_beta * kl_pm + (1.0 - p.jsd_beta) * kl_qm
    return Statistics(**out), named


class RowNorms(NamedTuple):
    """What a tile's dz needs from the forward, per row (``[rows]`` each): the student's and the teacher's
    (hi, lo) log-normalisers, and the reverse KL's frame (problem.py's r_j)."""

    lse: torch.Tensor
    lse_lo: torch.Tensor
    lse_t: torch.Tensor
    lse_t_lo: torch.Tensor
    row_max: torch.Tensor
    teacher_at_max: torch.Tensor
    kl_rev_rel: torch.Tensor


def row_norms(saved) -> RowNorms:
    """The RowNorms fields of a ``Statistics`` (or of a dict with its names)."""
    get = saved.get if isinstance(saved, dict) else (lambda k: getattr(saved, k))
    return RowNorms(*(get(k) for k in RowNorms._fields))


def target_column(a, inner_y, q_y, logq_y):
    """``a (1 - q_y) + q_y inner_y``, the target column's dz before the teacher and uniform terms, per row,
    as ``-a expm1(log q_y) + q_y inner_y``: expm1 keeps the digits of 1 - q_y for a confident target and of
    q_y for an improbable one, and inner_y holds c0 without a, so an entropy or KL share of a confident row is
    not rounded at ulp(a). ``q_y == 0`` (a label on a masked, -inf, logit) gives exactly ``a``, as
    0 log 0 -> 0 on every other column (inner_y holds c1 log 0 = -inf there). The Triton and CUDA kernels
    form the same expression (docs/design.md, "The dz formula")."""
    return _xlogy_terms(q_y, inner_y) - a * torch.expm1(logq_y)


def jsd_sums(p: StatsProblem, lse: tuple, lse_t: tuple) -> tuple:
    """``(KL(q || m), KL(p || m))`` summed over this problem's columns, ``[N]`` each, with q and p normalised
    by the given (hi, lo) log-sum-exps: the problem's own, or those of the full vocabulary when its columns are
    one shard of a vocabulary-parallel head (docs/design.md, "Distributed")."""
    n, v = p.hidden.shape[0], p.weight.shape[0]
    kl_qm = torch.zeros(n, device=p.hidden.device, dtype=p.acc_dtype)
    kl_pm = torch.zeros_like(kl_qm)
    for r0 in range(0, n, ROW_CHUNK):
        rows = slice(r0, min(n, r0 + ROW_CHUNK))
        for v0 in range(0, v, VOCAB_TILE):
            v1 = min(v, v0 + VOCAB_TILE)
            z, _ = _student_tile(p, rows, v0, v1)
            qm, pm = _jsd_sums(z, _teacher_tile(p, rows, v0, v1), (lse[0][rows], lse[1][rows]),
                               (lse_t[0][rows], lse_t[1][rows]), p.jsd_beta)
            kl_qm[rows] += qm
            kl_pm[rows] += pm
    return kl_qm, kl_pm


class ExpFrame(NamedTuple):
    """What the grad-in-forward path's forward leaves of a whole-row tile for its gradient: ``ez`` = exp(z - m) with the
    first maximum's column set to 0 (``_tile_partials``'s buffer, consumed), that column ``first_max``
    ([rows, 1]) and ``inv_s`` = 1 / s ([rows]), so that q = ez / s is one multiply away."""

    ez: torch.Tensor
    first_max: torch.Tensor
    inv_s: torch.Tensor
    target_logit: Optional[torch.Tensor]  # z at each row's target ([rows]), where the problem has targets


def _fast_route(p: StatsProblem) -> bool:
    """Whether a grad-in-forward chunk takes the fast route on this problem (``_grad_in_forward_partials``,
    ``_dz_from_frame``):
    on a CPU, for the statistics and terms it forms. Log q per column (entropy, the JSD's mixture), the
    teacher's probabilities (forward KL), the forward-only metrics, the mean logit and the soft-cap's chain
    rule (which needs the capped logits) take the general route, and so do other devices: the fast route's
    rows with an infinite or NaN column are found by a host check and formed again."""
    return p.hidden.device.type == "cpu" and not (
        p.want_entropy or p.want_kl_fwd or p.jsd_beta is not None or p.want_extras or p.want_mean_logit
        or p.transform.softcap is not None)


def _grad_in_forward_partials(z: torch.Tensor, zt: Optional[torch.Tensor], p: StatsProblem, tgt, scratch: Scratch):
    """(partials, ``ExpFrame``, kl_ratio) of a whole-row tile on the fast route, consuming ``z`` and ``zt``
    (the tiles' own buffers become z - m and z_t - z_t[first max]): the statistics ``_tile_partials`` gives,
    in fewer passes over the tile. The teacher's sum is taken relative to its logit at the student's first
    maximum (a term of 1, so the sum cannot underflow) instead of its own maximum, which saves a max and a
    subtraction over the tile: (mt, st) is a normaliser pair for any reference mt. Rows where that sum
    overflows (a teacher logit 88 above it) or the reference is -inf take the teacher's maximum."""
    rows, cols = z.shape
    zy = _gather_target(z, tgt, 0, cols) if tgt is not None else None  # before z becomes z - m
    part, first_max, zc, ez = _student_partials(z, z, scratch)
    m, s = part["m"], part["s"]
    if zy is not None:
        part["zy"] = zy
    kl_ratio = None
    if zt is not None:
        ztm = zt.gather(1, first_max).squeeze(1)
        ztr = zt.sub_(_finite_or_zero(ztm)[:, None])
        ezt = torch.exp(ztr, out=scratch("ezt", rows, cols))
        st, mt = ezt.sum(1), _finite_or_zero(ztm)
        redo = ~(torch.isfinite(ztm) & torch.isfinite(st))
        if bool(redo.any()):
            top = ztr[redo].amax(1)
            mt[redo] = mt[redo] + _finite_or_zero(top)
            st[redo] = torch.exp(ztr[redo] - _finite_or_zero(top)[:, None]).sum(1)
        kl_ratio = torch.sub(zc, ztr, out=scratch("d", rows, cols))
        a = torch.mul(ez, kl_ratio, out=ezt).sum(1)
        bad = ~torch.isfinite(a)
        if bool(bad.any()):
            a[bad] = _kl_terms(ez[bad], zc[bad], ztr[bad]).sum(1)
        part.update(mt=mt, st=st, a=partials.reverse_kl_infinite(a, m, ztm), ztm=ztm)
    return part, ExpFrame(ez, first_max, 1.0 / s, zy), kl_ratio


def _dz_from_frame(p: StatsProblem, coeffs, norms: RowNorms, tgt, frame: ExpFrame,
                   kl_ratio: Optional[torch.Tensor]):
    """dz = q inner (off the target: inner = c2 (r - KL) + c0 - a), as ``logits_gradient_tile``'s general route
    forms it, with q = ez / s taken from the forward (``ExpFrame``) instead of exp(z - lse) formed again: 4
    passes over the tile with a reverse KL (r - KL; times c2 / s; plus (c0 - a) / s; times ez), 1 without,
    against 7 and 4. The scaling by 1 / s is per row and comes after the difference r - KL is formed, so inner
    keeps the digits the general route keeps (docs/design.md, "The dz formula"). ``kl_ratio`` (the reverse
    KL's, from ``_grad_in_forward_partials``) is consumed. A row this cannot form exactly (an infinite or NaN column:
    0 x inf) comes back non-finite, and the caller forms it again on the general route."""
    a = coeffs[COEF_ONEHOT]
    base = coeffs[COEF_CONST] - a  # off the target, a ([j=y] - q_j) is -a q_j
    inv_s = frame.inv_s
    if tgt is not None:  # every column is in the tile, and a grad-in-forward chunk's rows all have a target >= 0
        idx = tgt[:, None]
        logq_y = (frame.target_logit - norms.lse) - norms.lse_lo
        q_y = torch.exp(logq_y)
        inner_y = coeffs[COEF_CONST]
    if kl_ratio is not None:
        c2 = coeffs[COEF_KL_REV]
        r = kl_ratio.sub_(norms.kl_rev_rel[:, None])
        if tgt is not None:
            inner_y = inner_y + r.gather(1, idx).squeeze(1) * c2
        dz = r.mul_((c2 * inv_s)[:, None]).add_((base * inv_s)[:, None])  # 3x faster than one addcmul on a CPU
        # the first maximum's column: ez holds 0 there and q = e^0 / s, whose inner / s dz already holds
        q_inner_at_max = dz.gather(1, frame.first_max)
        dz.mul_(frame.ez).scatter_(1, frame.first_max, q_inner_at_max)
    else:  # a per-row constant: q (c0 - a)
        dz = frame.ez.mul_((base * inv_s)[:, None]).scatter_(1, frame.first_max, (base * inv_s)[:, None])
    if tgt is not None:
        dz.scatter_(1, idx, target_column(a, inner_y, q_y, logq_y)[:, None])
    return dz


def _finish_dz(p: StatsProblem, dz, c, coeffs, logpt=None, carries=None):
    """The terms every route adds last: the teacher's probabilities (forward KL), the uniform term, the chain
    rule through temperature, soft-cap and logit_scale, and exact zeros on the rows outside the loss (those
    whose coefficients are all zero, or not ``carries`` where given)."""
    coef = coeffs[:, :, None]
    if logpt is not None and p.want_kl_fwd:
        dz.add_(coef[COEF_TEACHER_PROB] * torch.exp(logpt))
    if p.want_mean_logit:
        dz.add_(coef[COEF_UNIFORM])
    tf = p.transform
    scale = tf.logit_scale / tf.temperature
    if tf.softcap is not None:
        dz.mul_(scale * (1.0 - (c / tf.softcap) ** 2))
    elif scale != 1.0:
        dz.mul_(scale)
    # Rows that do not enter the loss (ignored, masked) give exact zeros, as in the kernels: their logits may
    # overflow exp (q = inf, times a zero coefficient = NaN) or be NaN padding.
    return _zero_rows(dz, ~((coeffs != 0).any(dim=0) if carries is None else carries))


class Named(NamedTuple):
    """The named columns of a tile's rows (``StatsProblem.columns``, ``[rows, K]``) and their given dz."""

    columns: torch.Tensor
    dz: torch.Tensor


def logits_gradient_tile(p: StatsProblem, z, c, zt, coeffs, norms: RowNorms, tgt, v0, v1,
                         scratch: Optional[Scratch] = None, kl_ratio: Optional[torch.Tensor] = None,
                         named: Optional[Named] = None):
    """dx for one tile: the generic dz of problem.py, then the chain rule through temperature, soft-cap and
    logit_scale. Shared by the grad-in-forward and the recompute paths. ``norms``: the tile's rows' ``RowNorms``.
    Terms whose coefficients the problem cannot produce are not formed (a cross-entropy tile is exp, one
    multiply and the target column), and the passes run in place, on ``z`` (the caller's tile, consumed) and
    on the call's ``scratch`` buffers: on a CPU these elementwise passes, not the products, set the time.
    ``kl_ratio``: (z - row_max) - (z_t - teacher_at_max) of this tile if the caller formed it (the grad-in-forward
    path's forward did), used on the rows where both maxima are finite (the same operations, so the same
    bits). ``named``: the rows' named columns, whose dz is given (core/columns.py) and written in place of the
    formula's before the teacher and uniform terms."""
    rows, cols = z.shape
    scratch = scratch or Scratch(z.device, z.dtype)
    coef = coeffs[:, :, None]
    a = coeffs[COEF_ONEHOT]
    terms = None  # the per-element part of inner: c1 log q + c2 r + c4 log m (added in any order: exact)
    if zt is not None and p.want_kl_rev:
        # r_j = log q_j - log p_j - KL(q||p), relative to the student's maximum column (problem.py), formed
        # before z becomes log q; 0 where c2 is: a row outside the loss whose KL is +inf contributes nothing.
        def ratio(sel):
            return (z[sel] - norms.row_max[sel, None]).sub_(zt[sel] - norms.teacher_at_max[sel, None])

        if kl_ratio is None:
            r = torch.sub(z, norms.row_max[:, None], out=scratch("terms", rows, cols)).sub_(
                torch.sub(zt, norms.teacher_at_max[:, None], out=scratch("tmp", rows, cols)))
        else:  # consumed in place
            r = kl_ratio
            _repair_rows(r, ratio, ~(torch.isfinite(norms.row_max) & torch.isfinite(norms.teacher_at_max)))
        terms = _zero_rows(r.sub_(norms.kl_rev_rel[:, None]).mul_(coef[COEF_KL_REV]), coeffs[COEF_KL_REV] == 0)
    keep_c = p.transform.softcap is not None and z is c  # the soft-cap's chain rule still needs c
    logq = (z.clone() if keep_c else z).sub_(norms.lse[:, None]).sub_(norms.lse_lo[:, None])
    if p.want_entropy or p.jsd_beta is not None:
        if terms is None:
            terms = torch.mul(logq, coef[COEF_LOGQ], out=scratch("terms", rows, cols))
        else:
            terms.add_(torch.mul(logq, coef[COEF_LOGQ], out=scratch("tmp", rows, cols)))
    logpt = None
    if zt is not None and (p.want_kl_fwd or p.jsd_beta is not None):
        logpt = (zt - norms.lse_t[:, None]).sub_(norms.lse_t_lo[:, None])
        if p.jsd_beta is not None:
            log_m = coef[COEF_LOGM] * _log_mixture(logq, logpt, p.jsd_beta)
            terms = log_m if terms is None else terms.add_(log_m)
    if tgt is not None:
        inside = (tgt >= v0) & (tgt < v1)
        idx = torch.where(inside, tgt - v0, torch.zeros_like(tgt))[:, None]
        logq_y = logq.gather(1, idx).squeeze(1)
        inner_y = coeffs[COEF_CONST] + (0.0 if terms is None else terms.gather(1, idx).squeeze(1))
    q = logq.exp_()
    if tgt is not None:
        q_y = q.gather(1, idx).squeeze(1)
    base = (coeffs[COEF_CONST] - a)[:, None]  # off the target, a ([j=y] - q_j) is -a q_j
    if terms is None:  # a per-row constant: q * (c0 - a) is 0 wherever q is
        dz = q.mul_(base)
    else:  # 0 * (c1 * log 0) would be NaN: q_j log q_j -> 0
        inner = terms.add_(base)
        dz = torch.mul(q, inner, out=scratch("dz", rows, cols))
        _repair_rows(dz, lambda r: _xlogy_terms(q[r], inner[r]))
    if tgt is not None:
        dz.scatter_(1, idx, torch.where(inside, target_column(a, inner_y, q_y, logq_y),
                                        dz.gather(1, idx).squeeze(1))[:, None])
    carries = None
    if named is not None:
        columns.put(dz, named.columns, named.dz, v0)
        carries = (coeffs != 0).any(dim=0) | (named.dz != 0).any(dim=1)
    return _finish_dz(p, dz, c, coeffs, logpt, carries)


def _repair_rows(out, careful, bad=None) -> None:
    """Rows of ``out`` formed again by ``careful(rows)``: those in ``bad``, by default the rows that are not
    finite (the product of q and a term that is infinite where q = 0 is NaN there, and must be 0). On a CPU
    only those rows; elsewhere every row, with no device wait."""
    if out.device.type != "cpu":
        out.copy_(careful(slice(None)))
        return
    if bad is None:
        bad = ~torch.isfinite(out.sum(1))
    if bool(bad.any()):
        out[bad] = careful(bad)


def _zero_rows(t, rows):
    """``t`` with the rows where ``rows`` is True set to 0: on a CPU only those rows are written."""
    if t.device.type != "cpu":
        return t.masked_fill_(rows[:, None], 0.0)
    if bool(rows.any()):
        t[rows] = 0.0
    return t



def backward_gradients(p: StatsProblem, saved: Statistics, coeffs: torch.Tensor, needs: GradientNeeds, *,
                       column_dz: Optional[torch.Tensor] = None):
    """(d hidden, d weight, d bias), each None when not needed; ``column_dz``: the given dz of the named
    columns (``[N, K]``, core/columns.py). Accumulates in fp32 (float64):
    d hidden in an [N, D] accumulator, d weight one vocabulary tile at a time over all row chunks,
    so no full-size fp32 [V, D] buffer is ever held (only the [VOCAB_TILE, D] one of the current tile).

    The logits are recomputed in exactly the row blocks the forward formed them in (its valid rows, gathered
    the same way, cut by ROW_CHUNK, times the same vocabulary tiles): a product's rounding depends on its
    shape, and ``log q = (z - lse) - lse_lo`` needs z to be the forward's to the last bit, or a confident
    row's 1 - q takes the difference as its leading digit. So a row's gradient never depends on which other
    rows carry gradient (docs/design.md, "Numerical doctrine"). Rows whose coefficients are all zero still
    ride in their block; their dz is set to exactly 0 (their logits may overflow, or be NaN padding), and a
    block with no gradient at all is skipped."""
    acc = p.acc_dtype
    h_all, w = p.hidden, p.weight
    v = w.shape[0]
    dw = torch.empty_like(w) if needs.weight else None  # every vocabulary tile writes its rows
    db = torch.empty_like(p.bias) if needs.bias else None
    rows = valid_rows(p)

    def pick(t):
        return t if rows is None or t is None else t.index_select(0, rows)

    h_act, ht_act = pick(h_all), pick(p.teacher_hidden)
    tgt_act = pick(p.targets)
    coeffs_act = coeffs if rows is None else coeffs.index_select(1, rows)
    norms_act = torch.stack(tuple(pick(x) for x in row_norms(saved)))
    n_act = h_act.shape[0]
    carries = (coeffs_act != 0).any(dim=0)  # [n_act]: rows whose dz is not identically zero
    named_act = None
    if column_dz is not None:
        named_act = Named(pick(p.columns), pick(column_dz.to(acc)))
        carries = carries | (named_act.dz != 0).any(dim=1)
    chunks = [(r0, min(n_act, r0 + ROW_CHUNK)) for r0 in range(0, n_act, ROW_CHUNK)]
    live = torch.stack([carries[r0:r1].any() for r0, r1 in chunks]).tolist() if chunks else []
    chunks = [(r0, r1) for (r0, r1), keep in zip(chunks, live) if keep]
    if not chunks:
        dh = torch.zeros_like(h_all) if needs.hidden else None
        return dh, (None if dw is None else dw.zero_()), (None if db is None else db.zero_())
    dh_act = torch.zeros((n_act, h_all.shape[1]), device=h_all.device, dtype=acc) if needs.hidden else None
    scratch = Scratch(h_all.device, acc)
    for v0 in range(0, v, VOCAB_TILE):
        v1 = min(v, v0 + VOCAB_TILE)
        w_tile = w[v0:v1]
        b_tile = None if p.bias is None else p.bias[v0:v1]
        w_acc = w_tile.to(acc)
        dw_tile = torch.zeros(w_tile.shape, device=w.device, dtype=acc) if needs.weight else None
        db_tile = torch.zeros(v1 - v0, device=w.device, dtype=acc) if needs.bias else None
        for r0, r1 in chunks:
            h = h_act[r0:r1]
            z, c = _logits_tile(h, w_tile, b_tile, p.transform, acc, scratch("z", r1 - r0, v1 - v0))
            zt = None
            if p.has_teacher:
                tb = None if p.teacher_bias is None else p.teacher_bias[v0:v1]
                zt, _ = _logits_tile(ht_act[r0:r1], p.teacher_weight[v0:v1], tb, p.teacher_transform, acc,
                                     scratch("zt", r1 - r0, v1 - v0))
            tgt = None if tgt_act is None else tgt_act[r0:r1]
            named = None if named_act is None else Named(named_act.columns[r0:r1], named_act.dz[r0:r1])
            dx = logits_gradient_tile(p, z, c, zt, coeffs_act[:, r0:r1], RowNorms(*norms_act[:, r0:r1].unbind(0)),
                                      tgt, v0, v1, scratch, named=named)
            if dh_act is not None:
                dh_act[r0:r1].addmm_(dx, w_acc)
            if dw_tile is not None:
                dw_tile.addmm_(dx.T, h.to(acc))
            if db_tile is not None:
                db_tile += dx.sum(0)
        if dw is not None:
            dw[v0:v1] = dw_tile.to(w.dtype)
        if db is not None:
            db[v0:v1] = db_tile.to(p.bias.dtype)
    dh = None
    if dh_act is not None:
        if rows is not None:
            dh_act = torch.zeros((h_all.shape[0], h_all.shape[1]), device=h_all.device,
                                 dtype=acc).index_copy_(0, rows, dh_act)
        dh = dh_act.to(h_all.dtype)
    return dh, dw, db


# The grad-in-forward path holds every logits row of a chunk at once; about six [rows, V] fp32 temporaries are
# alive while dz is formed. 256 MiB bounds them whatever N is.
GRAD_IN_FORWARD_WORKSPACE_BYTES = 256 * 2**20


def grad_in_forward_pays(p: StatsProblem) -> bool:
    """Always, now that the tile passes run in place: measured on a shared 2-core CPU (fp32, N=2048,
    V=32768, D=512, forward+backward, fastest of 3, ``benchmarks/portable_ratio.py``), cross-entropy took
    1.16x its 3 products on the grad-in-forward path against 1.65x on the composable one (with a teacher the
    grad-in-forward path
    also saves the recompute of both heads). On a GPU the products set the time, so the path that needs
    fewer of them is taken there too."""
    return True


def grad_in_forward_rows(p: StatsProblem) -> int:
    """Rows per grad-in-forward chunk: within the workspace budget, and at most an eighth of the batch, so that a
    small batch never holds more than the materialised logits would (measured: at N=512, V=32003 one
    full-budget chunk took 255 MiB against the reference's 156 MiB)."""
    per_row = 6 * p.weight.shape[0] * torch.finfo(p.acc_dtype).bits // 8 * (2 if p.has_teacher else 1)
    by_batch = max(32, -(-p.hidden.shape[0] // 8))
    return max(1, min(ROW_CHUNK, by_batch, GRAD_IN_FORWARD_WORKSPACE_BYTES // per_row))


def grad_in_forward_gradients(p: StatsProblem, chunk_fn, needs: GradientNeeds):
    """3-product path (fusedloss/core/grad_in_forward.py): for each chunk of rows, the full [rows, V] logits are
    formed once, give the statistics, the loss's coefficients and the gradients, and are dropped.
    Returns the loss and the gradients in the accumulation dtype (cast after the backward's scaling)."""
    acc = p.acc_dtype
    n, v = p.hidden.shape[0], p.weight.shape[0]
    dev = p.hidden.device
    # Ignored rows (prompt tokens, padding) cost nothing: the valid rows are gathered once and chunked (the
    # grad-in-forward path hands over only valid rows already, core/grad_in_forward.py; a direct caller may not).
    active = valid_rows(p)
    q = p if active is None else gathered_rows(p, active)
    count = q.hidden.shape[0]
    dh = torch.empty((count, q.hidden.shape[1]), device=dev, dtype=acc) if needs.hidden else None
    # written by the first chunk's product (zeros only when there is none)
    dw = (torch.zeros if count == 0 else torch.empty)(p.weight.shape, device=p.weight.device, dtype=acc) \
        if needs.weight else None
    db = torch.zeros(v, device=p.weight.device, dtype=acc) if needs.bias else None
    w_acc = p.weight.to(acc)
    loss = torch.zeros((), device=dev, dtype=acc)
    step = grad_in_forward_rows(p)
    scratch = Scratch(dev, acc)
    fast = _fast_route(q)
    for r0 in range(0, count, step):
        rows = slice(r0, min(count, r0 + step))
        m = rows.stop - r0
        tgt = q.targets[rows] if q.targets is not None else None
        z, c = _student_tile(q, rows, 0, v, scratch("z", m, v))
        zt = _teacher_tile(q, rows, 0, v, scratch("zt", m, v))
        # one piece holds every column: its partials are the merged ones (partials.merge of one piece)
        out = dict(zip(Statistics._fields, torch.zeros((len(Statistics._fields), m), device=dev,
                                                       dtype=acc).unbind(0)))
        if fast:
            part, frame, kl_ratio = _grad_in_forward_partials(z, zt, q, tgt, scratch)
        else:
            part = _tile_partials(z, zt, q, tgt, 0, v, scratch)
            kl_ratio = scratch("d", m, v) if q.want_kl_rev else None  # left there by _tile_partials
        out.update(partials.finalize(part, q, v))
        if q.jsd_beta is not None:
            out["kl_qm"], kl_pm = _jsd_sums(z, zt, (out["lse"], out["lse_lo"]), (out["lse_t"], out["lse_t_lo"]),
                                            q.jsd_beta)
            out["jsd"] = q.jsd_beta * kl_pm + (1.0 - q.jsd_beta) * out["kl_qm"]
        chunk_loss, coeffs = chunk_fn(Statistics(**out), rows if active is None else active[rows])
        loss = loss + chunk_loss.to(acc)
        norms = row_norms(out)
        if fast:
            dx = _finish_dz(q, _dz_from_frame(q, coeffs, norms, tgt, frame, kl_ratio), c, coeffs)
            bad = torch.nonzero(~torch.isfinite(dx.sum(1))).squeeze(1)
            if bad.numel():  # an infinite or NaN column: those rows again on the general route, from the heads
                dx[bad] = _general_rows(q, rows, bad, coeffs, norms, v)
        else:
            dx = logits_gradient_tile(q, z, c, zt, coeffs, norms, tgt, 0, v, scratch, kl_ratio)
        if dh is not None:
            torch.mm(dx, w_acc, out=dh[rows])
        if dw is not None:
            h = q.hidden[rows].to(acc)
            if r0 == 0:
                torch.mm(dx.T, h, out=dw)
            else:
                dw.addmm_(dx.T, h)
        if db is not None:
            db += dx.sum(0)
    if dh is not None and active is not None:
        dh = torch.zeros((n, dh.shape[1]), device=dev, dtype=acc).index_copy_(0, active, dh)
    return loss, (dh, dw, db)


def _general_rows(q: StatsProblem, rows: slice, bad: torch.Tensor, coeffs, norms: RowNorms, v: int):
    """dz of the rows ``bad`` (indices into the chunk ``rows`` of ``q``) on the general route, from logits
    formed again from the heads: the fast route consumed the chunk's tiles."""
    sub = gathered_rows(q, bad + rows.start)
    every = slice(0, bad.numel())
    z, c = _student_tile(sub, every, 0, v)
    zt = _teacher_tile(sub, every, 0, v)
    return logits_gradient_tile(sub, z, c, zt, coeffs[:, bad], RowNorms(*(t[bad] for t in norms)),
                                None if sub.targets is None else sub.targets, 0, v)


