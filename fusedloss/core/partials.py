"""Partial statistics: what a set of vocabulary columns contributes to a row, and the one exact merge.

Every backend walks the vocabulary in pieces (tiles of the torch backend, splits of the Triton grid,
shards of a vocabulary-parallel head on several ranks). A piece is summarised per row by *partial
statistics* relative to the piece's own maxima (m = max z, m_t = max z_t over its columns)::

    m, mt  the maxima                      s  = sum e^(z - m)          st = sum e^(z_t - m_t)
    t   = s - 1 without cancellation: the sum without the (first) maximum column's own e^0 = 1
    ztm = z_t at the (first) maximum column of z
    e   = sum e^(z - m) (z - m)                                entropy:  H = log s - e / s
    a   = sum e^(z - m) ((z - m) - (z_t - ztm))                KL(q||p) = a / s + (m_t - ztm) - log s + log s_t
    b   = sum e^(z_t - m_t) ((z_t - m_t) - (z - m))            KL(p||q) = b / s_t - log s_t + log s
    s2  = sum e^(2 (z - m))                                    log sum q^2 = log s2 - 2 log s
    sz  = sum z  (no maximum needed)                           mean logit = sz / V
    zy  = z at the row's target if the piece holds it, else 0
    mb  = max of z over the piece's columns before the target (-inf where there are none)

``merge`` combines pieces exactly (rebase each to the common maxima, then add), in a fixed order, so
the result does not depend on how the vocabulary was cut; ``finalize`` turns the merged partials of all
columns into the per-row statistics of ``problem.Statistics``. Keeping every sum relative to the running
maxima avoids forming ``lse - sum p z`` from two large numbers (peaked rows with logits near 1e4 would lose
every digit of the entropy in fp32). ``t`` is kept beside ``s`` for confident rows: with 1 - q_y = 1e-3,
s = 1 + 1e-3 rounded to fp32 holds t to 1e-4 relative only, and log s = log1p(t) keeps it
(docs/design.md, "Numerical doctrine"). ``a`` is relative to the student's maximum column (z - m and
z_t - ztm are both 0 there) rather than to the teacher's maximum, for the same reason: a confident student
puts nearly all of a on that column, whose term is then exactly 0, so a / s (``kl_rev_rel``) is small and
keeps its digits however far the teacher is, and the backward's r_j (problem.py) cancels exactly there.

The KL partials follow rule G: a column adds +inf to a where its z is finite and its z_t is -inf, and 0
where its z is -inf (0 log 0), whatever exp underflows to at the piece's scale; a is +inf outright where
ztm is -inf (the student's maximum column has mass the teacher lacks); b likewise with the sides
exchanged; a +inf partial survives every merge.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .problem import StatsProblem

FIELDS = ("m", "s", "t", "e", "s2", "sz", "mt", "st", "a", "b", "zy", "mb", "ztm")
"""Names of the partial statistics, in the order of a packed ``[len(FIELDS), ..., N]`` buffer."""

_MAXIMA = ("m", "mt", "mb")


def empty(rows: int, device, dtype) -> dict:
    """The partials of no columns at all: maxima -inf, sums 0."""
    neg_inf = torch.full((rows,), -math.inf, device=device, dtype=dtype)
    zero = torch.zeros(rows, device=device, dtype=dtype)
    return {name: (neg_inf if name in _MAXIMA else zero) for name in FIELDS}


def _rebase(m: torch.Tensor):
    """For pieces stacked along dim 0: the common maximum, each piece's factor exp(m_k - max) and shift
    m_k - max, both 0 for an empty piece (m_k = -inf: exp(-inf - -inf) would be NaN)."""
    mx = m.amax(0)
    empty_piece = torch.isneginf(m)
    f = torch.where(empty_piece, torch.zeros_like(m), torch.exp(m - mx))
    dm = torch.where(empty_piece, torch.zeros_like(m), m - mx)
    return mx, f, dm


def _keep_inf(part: torch.Tensor, rebased: torch.Tensor) -> torch.Tensor:
    """A KL partial of +inf (mass where the other side has none) stays +inf whatever its piece's factor
    (0 * inf would be NaN where the piece's maximum underflows against the row's)."""
    return torch.where(torch.isposinf(part), part, rebased)


def reverse_kl_infinite(a: torch.Tensor, m: torch.Tensor, ztm: torch.Tensor) -> torch.Tensor:
    """a, +inf where the student's maximum column has mass the teacher lacks (ztm = -inf, m finite): the
    reverse KL is then +inf whatever the other columns give (their z_t - ztm would be +inf)."""
    return torch.where(torch.isneginf(ztm) & torch.isfinite(m), math.inf, a)


def merge(pieces: dict) -> dict:
    """Merge partials stacked along dim 0 (``[pieces, rows]`` per field) into ``[rows]``. Exact up to
    rounding and independent of how the columns were cut. Only the fields present are merged (``m``, ``s``
    and ``t`` always; the teacher's with ``mt``; ``a`` with ``ztm``): the ranks of a vocabulary-parallel head
    send only the fields their call asks for, and each field merged is a few more kernels per call."""
    m, f, dm = _rebase(pieces["m"])
    s = pieces["s"]
    # t without cancellation: the first piece holding the maximum keeps its t, every other piece adds all
    # of its columns, f (1 + t) (a piece tied at the maximum adds 1 + t; an empty one 0).
    holder = pieces["m"].argmax(0, keepdim=True)
    index = torch.arange(s.shape[0], device=s.device).reshape(-1, *([1] * (s.dim() - 1)))
    is_holder = index == holder
    t = torch.where(is_holder, pieces["t"], f * (1.0 + pieces["t"])).sum(0)
    out = dict(m=m, s=(f * s).sum(0), t=t)
    if "e" in pieces:
        out["e"] = (f * (pieces["e"] + s * dm)).sum(0)
    if "s2" in pieces:
        out["s2"] = (f * f * pieces["s2"]).sum(0)
    if "sz" in pieces:
        out["sz"] = pieces["sz"].sum(0)
    if "ztm" in pieces:  # the teacher's logit at the first maximum column: the holder's
        out["ztm"] = pieces["ztm"].gather(0, holder).squeeze(0)
    if "mt" in pieces:
        mt, g, dmt = _rebase(pieces["mt"])
        out.update(mt=mt, st=(g * pieces["st"]).sum(0))
        if "a" in pieces:
            # a is relative to (m, ztm) of the piece holding the maximum: the holder's a is taken as it is
            # (its shifts are exactly 0), every other piece's is shifted by (m_k - m) - (ztm_k - ztm).
            ztm = out["ztm"]
            dztm = torch.where(is_holder | torch.isneginf(pieces["m"]), 0.0, pieces["ztm"] - ztm)
            a = _keep_inf(pieces["a"], torch.where(is_holder, pieces["a"], f * (pieces["a"] + s * (dm - dztm))))
            out["a"] = reverse_kl_infinite(a.sum(0), m, ztm)
        if "b" in pieces:
            out["b"] = _keep_inf(pieces["b"], g * (pieces["b"] + pieces["st"] * (dmt - dm))).sum(0)
    if "zy" in pieces:
        out["zy"] = pieces["zy"].sum(0)
    if "mb" in pieces:
        out["mb"] = pieces["mb"].amax(0)
    return out


def merge_teacher_sweep(pieces: dict, m: torch.Tensor) -> dict:
    """The teacher's partials (``mt``, ``st``; ``a``, ``b`` and ``ztm`` where present) of pieces swept after
    the student's statistics were final (the Triton grad-in-forward path's teacher fold), stacked along dim 0: every
    piece's a and b are relative to the same final (m, ztm), and every piece found the same ztm, so a adds as
    it is and b rebases with the teacher's maxima only (``merge``'s rules with every student shift 0); a is
    +inf where ztm is -inf (``reverse_kl_infinite``)."""
    mt, g, dmt = _rebase(pieces["mt"])
    out = dict(mt=mt, st=(g * pieces["st"]).sum(0))
    if "a" in pieces:
        out["ztm"] = pieces["ztm"][0]
        out["a"] = reverse_kl_infinite(pieces["a"].sum(0), m, out["ztm"])
    if "b" in pieces:
        out["b"] = _keep_inf(pieces["b"], g * (pieces["b"] + pieces["st"] * dmt)).sum(0)
    return out


def merge_pair(run: dict, part: dict) -> dict:
    """``merge`` of two pieces (a running state and the next tile)."""
    return merge({name: torch.stack((run[name], part[name])) for name in FIELDS})


def log_s(state: dict) -> torch.Tensor:
    """log s = log1p(t) (s = 1 + t keeps the digits of a confident row); log s itself for an empty row
    (m = -inf) or a non-finite s (NaN or inf inputs)."""
    s, m = state["s"], state["m"]
    direct = torch.isneginf(m) | ~torch.isfinite(s)
    return torch.where(direct, torch.log(s), torch.log1p(state["t"]))


def rounding_residual(hi: torch.Tensor, m: torch.Tensor, log_sum: torch.Tensor) -> torch.Tensor:
    """(m - hi) + log s, with hi = m + log s rounded: m - hi is exact (Sterbenz), so this is what the
    rounding dropped, and hi + lo carries the log-sum-exp to twice the working precision. 0 on rows whose
    log-sum-exp is not finite (NaN input, or no columns)."""
    lo = (m - hi) + log_sum
    return torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))


def finalize(state: dict, p: StatsProblem, vocab: int, *, has_targets: Optional[bool] = None) -> dict:
    """Per-row statistics (``problem.Statistics`` names) from the merged partials of every column."""
    has_targets = p.targets is not None if has_targets is None else has_targets
    ls = log_s(state)
    lse = state["m"] + ls
    out = {"lse": lse, "lse_lo": rounding_residual(lse, state["m"], ls), "row_max": state["m"]}
    if has_targets:
        # (z_y - m) - log s, not z_y - lse: for a confident row z_y ~ m ~ lse ~ 30 and logp ~ -0.01, and
        # subtracting the rounded lse would cost the digits that z_y - m (exact near the max) keeps.
        out["logp"] = (state["zy"] - state["m"]) - ls
    if p.want_entropy:
        out["entropy"] = ls - state["e"] / state["s"]
    if p.want_extras:
        out["log_sum_sq_probs"] = torch.log(state["s2"]) - 2.0 * ls
        if has_targets:
            # argmax's rule on exact ties (as TRL): the target must be the *first* maximum.
            out["is_top1"] = ((state["zy"] >= state["m"]) & (state["zy"] > state["mb"])).to(lse.dtype)
    if p.want_mean_logit:
        out["mean_logit"] = state["sz"] / vocab
    if p.has_teacher:
        log_st = torch.log(state["st"])
        out["lse_t"] = state["mt"] + log_st
        out["lse_t_lo"] = rounding_residual(out["lse_t"], state["mt"], log_st)
        if p.want_kl_rev:
            out["kl_rev_rel"] = state["a"] / state["s"]
            out["teacher_at_max"] = state["ztm"]
        if p.want_kl_rev or p.want_kl_fwd:
            # Per row in float64: KL = ... - log s + log s_t cancels to ulp(log V) (2.4e-7 at V = 13, where
            # KL ~ 2e-7 for two near-uniform rows) if each term is rounded to fp32 first.
            w = _wide(state)
            wls, wlst = log_s(w), torch.log(w["st"])
            if p.want_kl_rev:
                out["kl_rev"] = (w["a"] / w["s"] + (w["mt"] - w["ztm"]) - wls + wlst).to(ls.dtype)
            if p.want_kl_fwd:
                out["kl_fwd"] = (w["b"] / w["st"] - wlst + wls).to(ls.dtype)
    return out


def _wide(state: dict) -> dict:
    """The fields the KLs combine, in float64 (fp32 partials; as they are where float64 is missing: MPS)."""
    m = state["m"]
    if m.dtype == torch.float64 or m.device.type == "mps":
        return state
    return {k: state[k].double() for k in ("m", "s", "t", "st", "mt", "a", "b", "ztm") if k in state}
