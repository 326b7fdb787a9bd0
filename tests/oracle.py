"""An independent float64 oracle of every public function of fusedloss, for the property-based tests.

Written from the formulas of the contract (the logits, the losses and their reductions, TRL's conventions)
on materialised logits, with gradients by autograd. It shares no code with fusedloss: not the backends, and
not ``fusedloss.reference`` either (which is itself checked against this file), so that a mistake made once
in the package cannot be repeated here and go unseen.

Two things make a float64 oracle trustworthy at 1e-10 on the data the tests draw (peaked rows, extreme
logits, masked vocabularies):

* ``log_softmax`` has its own backward (``_StableLogSoftmax``). The maximum's log-probability is
  ``-log1p(t)`` with t the sum of ``e^(z_j - max)`` over the other columns, and its gradient is
  ``-sum_{j != a} g_j + (1 - q_a) G`` with ``1 - q_a = t / (1 + t)``, instead of ``g_a - q_a G``: on a
  confident row (1 - q ~ 1e-20) the plain form loses every digit, and torch.log_softmax's autograd would be
  *less* accurate than the code under test.
* Rows that do not count (ignored targets, tokens outside a completion mask) are never computed: the valid
  rows are selected, and their results scattered back. A NaN hidden row or a -inf teacher entry at an
  ignored position therefore cannot leak NaN through a discarded ``torch.where`` branch. Entries that a sum
  leaves out (0 log 0, masked vocabulary entries) are replaced by harmless values before any arithmetic,
  for the same reason.

KL divergences follow the mathematics: a column with mass on the first side and none on the second
(log a finite, log b = -inf) makes the KL +inf, whatever exp(log a) underflows to.

Beside the public functions: ``statistics``, the per-row statistics of a backend's forward (the backend tests'
ground truth), and closed forms that single checks need (K target log-probs, the log-prob gradients of
confident rows, one row's gradient in 60-digit decimals). The logits of tests/_trl_oracle.py's stand-in model
are ``logits`` here too.

``Config(dtype=torch.float32, stable=False)`` turns the same functions into the *naive fp32 path* a plain
trainer runs (fp32 logits, torch.log_softmax), whose error against the oracle says what fp32 can do on an
input; ``shift`` rounds the logits once more on a grid shifted by a fraction of their scale, a second naive
run whose rounding falls elsewhere (one naive run is sometimes exact by luck, e.g. by symmetry).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch


class Config(NamedTuple):
    dtype: torch.dtype = torch.float64
    stable: bool = True
    shift: float = 0.0


EXACT = Config()


# --------------------------------------------------------------------------------------------------
# The logits and the log-softmax


def logits(hidden, weight, bias=None, *, temperature=1.0, logit_scale=1.0, softcap=None, cfg=EXACT):
    """``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature`` in ``cfg.dtype``."""
    x = hidden.to(cfg.dtype) @ weight.to(cfg.dtype).T
    if bias is not None:
        x = x + bias.to(cfg.dtype)
    u = x * logit_scale
    c = softcap * torch.tanh(u / softcap) if softcap is not None else u
    z = c / temperature
    if cfg.shift and z.numel():
        finite = z.detach()[torch.isfinite(z.detach())]
        if finite.numel():
            s = cfg.shift * float(finite.abs().max())
            z = (z + s) - s
    return z


class _StableLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        a = z.argmax(-1, keepdim=True)  # the first maximum; tied maxima count 1 each in t
        d = z - z.gather(-1, a)
        t = torch.exp(d).scatter(-1, a, 0.0).sum(-1, keepdim=True)
        log1p_t = torch.log1p(t)
        logq = (d - log1p_t).scatter(-1, a, -log1p_t)
        ctx.save_for_backward(logq, a, t)
        return logq

    @staticmethod
    def backward(ctx, g):
        logq, a, t = ctx.saved_tensors
        total = g.sum(-1, keepdim=True)
        dz = g - logq.exp() * total
        others = g.scatter(-1, a, 0.0).sum(-1, keepdim=True)
        return dz.scatter(-1, a, -others + (t / (1.0 + t)) * total)


def log_softmax(z, cfg=EXACT):
    if z.shape[-1] == 0 or z.shape[0] == 0:
        return z - 0.0
    return _StableLogSoftmax.apply(z) if cfg.stable else torch.log_softmax(z, dim=-1)


def _acc(cfg):
    return cfg.dtype


def _scatter_rows(values, rows, n):
    """A [n, ...] tensor with ``values`` at ``rows`` and 0 elsewhere (differentiable in values)."""
    out = values.new_zeros((n,) + tuple(values.shape[1:]))
    return out.index_copy(0, rows, values)


def _where0(dead, x):
    return torch.where(dead, torch.zeros_like(x), x)


def entropy(logq):
    """-sum q log q with 0 log 0 = 0."""
    dead = torch.isneginf(logq)
    safe = _where0(dead, logq)
    return -_where0(dead, safe.exp() * safe).sum(-1)


def kl(log_a, log_b):
    """KL(a || b) = sum a (log a - log b); 0 where a = 0; +inf where a > 0 meets b = 0."""
    a_dead = torch.isneginf(log_a)
    b_dead = torch.isneginf(log_b) & ~a_dead
    out = a_dead | b_dead
    la, lb = _where0(out, log_a), _where0(out, log_b)
    terms = la.exp() * (la - lb)
    terms = torch.where(b_dead, torch.full_like(terms, math.inf), terms)
    return _where0(a_dead, terms).sum(-1)


def log_mixture(logq, logp, beta):
    """log((1 - beta) q + beta p), -inf where both are 0."""
    dead = torch.isneginf(logq) & torch.isneginf(logp)
    lq, lp = _where0(dead, logq), _where0(dead, logp)
    m = torch.logaddexp(lq + math.log1p(-beta), lp + math.log(beta))
    return torch.where(dead, torch.full_like(m, -math.inf), m)


def _flat_rows(hidden):
    return hidden.reshape(-1, hidden.shape[-1])


def _divisor(n):
    return float(n.item()) if isinstance(n, torch.Tensor) else float(n)


def _reduce(per_token, valid, reduction, num_items_in_batch, mean_name):
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if num_items_in_batch is not None:
        return total / _divisor(num_items_in_batch)
    if reduction == mean_name:
        return total / max(1, int(valid.sum()))
    return total


# --------------------------------------------------------------------------------------------------
# token_logprobs, cross_entropy


def _row_logq(hidden, weight, bias, rows, transform, cfg):
    z = logits(_flat_rows(hidden).index_select(0, rows), weight, bias, cfg=cfg, **transform)
    return z, log_softmax(z, cfg)


def token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
                   ignore_index=-100, return_entropy=False, cfg=EXACT):
    y = targets.reshape(-1)
    rows = torch.nonzero(y != ignore_index).squeeze(1)
    tf = dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    _, logq = _row_logq(hidden, weight, bias, rows, tf, cfg)
    logp = _scatter_rows(logq.gather(1, y[rows, None]).squeeze(1), rows, y.numel()).reshape(targets.shape)
    if not return_entropy:
        return logp
    return logp, _scatter_rows(entropy(logq), rows, y.numel()).reshape(targets.shape)


def cross_entropy(hidden, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  z_loss=0.0, temperature=1.0, logit_scale=1.0, softcap=None, num_items_in_batch=None, cfg=EXACT):
    """Per valid token: (1 - eps) (-log q_y) + eps mean_v(-log q_v) + z_loss lse^2 (torch's smoothing)."""
    y = targets.reshape(-1)
    valid = y != ignore_index
    rows = torch.nonzero(valid).squeeze(1)
    tf = dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    z, logq = _row_logq(hidden, weight, bias, rows, tf, cfg)
    loss = -logq.gather(1, y[rows, None]).squeeze(1)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (-logq.mean(-1))
    if z_loss:
        loss = loss + z_loss * torch.logsumexp(z, -1) ** 2
    per_token = _scatter_rows(loss, rows, y.numel()).reshape(targets.shape)
    return _reduce(per_token, valid, reduction, num_items_in_batch, "mean")


# --------------------------------------------------------------------------------------------------
# distillation_loss


def distillation_loss(hidden, weight, teacher_hidden, teacher_weight, targets=None, *, beta=1.0, temperature=1.0,
                      hard_weight=0.0, soft_weight=1.0, t_squared=False, bias=None, teacher_bias=None,
                      logit_scale=1.0, softcap=None, teacher_logit_scale=1.0, teacher_softcap=None,
                      ignore_index=-100, reduction="batchmean", num_items_in_batch=None, cfg=EXACT):
    """TRL's generalized JSD between q = softmax(z_s / T) (student) and p = softmax(z_t / T) (teacher, frozen),
    plus hard_weight times the student's cross-entropy at T = 1; each side's z scaled and soft-capped by its
    own logit_scale / softcap."""
    lead = hidden.shape[:-1]
    n = math.prod(lead)
    y = None if targets is None else targets.reshape(-1)
    valid = torch.ones(n, dtype=torch.bool) if y is None else y != ignore_index
    rows = torch.nonzero(valid).squeeze(1)
    z_s = logits(_flat_rows(hidden).index_select(0, rows), weight, bias, logit_scale=logit_scale, softcap=softcap,
                 cfg=cfg)
    with torch.no_grad():
        z_t = logits(_flat_rows(teacher_hidden).index_select(0, rows), teacher_weight, teacher_bias,
                     logit_scale=teacher_logit_scale, softcap=teacher_softcap, cfg=cfg)
    logq = log_softmax(z_s / temperature, cfg)
    logp = log_softmax(z_t / temperature, cfg).detach()
    if beta == 0:
        soft = kl(logp, logq)
    elif beta == 1:
        soft = kl(logq, logp)
    else:
        logm = log_mixture(logq, logp, beta)
        soft = beta * kl(logp, logm) + (1.0 - beta) * kl(logq, logm)
    loss = soft_weight * soft * (temperature ** 2 if t_squared else 1.0)
    if hard_weight:
        loss = loss - hard_weight * log_softmax(z_s, cfg).gather(1, y[rows, None]).squeeze(1)
    per_token = _scatter_rows(loss, rows, n).reshape(lead)
    return _reduce(per_token, valid, reduction, num_items_in_batch, "batchmean")


# --------------------------------------------------------------------------------------------------
# grpo_loss (TRL's GRPOTrainer, gradient accumulation 1)


class GRPOOut(NamedTuple):
    logprobs: torch.Tensor
    entropy: torch.Tensor
    kl: Optional[torch.Tensor]
    clip_ratio_low: torch.Tensor
    clip_ratio_high: torch.Tensor
    clip_ratio_region: torch.Tensor
    clip_ratio_low_min: Optional[torch.Tensor]  # min over completions of the per-completion low-clip fraction
    clip_ratio_high_max: Optional[torch.Tensor]  # max over completions of the per-completion high-clip fraction
    vespo_phi_seq_mean: Optional[torch.Tensor]  # vespo only (not covered by this oracle)
    policy_loss: torch.Tensor  # the loss before an entropy bonus (none here)


def grpo_loss(hidden, weight, completion_ids, advantages, completion_mask, *, old_logprobs=None, ref_logprobs=None,
              bias=None, temperature=1.0, logit_scale=1.0, softcap=None, loss_type="dapo", epsilon_low=0.2,
              epsilon_high=None, delta=None, beta=0.0, importance_sampling_level="token", max_completion_length=None,
              num_items_in_batch=None, num_processes=1, importance_weights=None, return_details=False,
              use_bias_correction_kl=True, cfg=EXACT):
    acc = _acc(cfg)
    b, c = completion_ids.shape
    inside = completion_mask != 0
    m = completion_mask.to(acc)  # a fractional mask weights its tokens, as TRL multiplies by it
    zero = torch.zeros((b, c), dtype=acc)
    ids = torch.where(inside, completion_ids, torch.zeros_like(completion_ids))  # ids outside are never read
    logp, ent = token_logprobs(hidden, weight, torch.where(inside, ids, torch.full_like(ids, -1)), bias=bias,
                               temperature=temperature, logit_scale=logit_scale, softcap=softcap, ignore_index=-1,
                               return_entropy=True, cfg=cfg)

    def inside_only(t):
        """A per-token input, read inside the mask only; per-sequence inputs as [B, 1]."""
        t = t.to(acc)
        return t.unsqueeze(1) if t.dim() == 1 else torch.where(inside, t, zero) if t.shape[1] == c else t

    adv = inside_only(advantages)
    old = logp.detach() if old_logprobs is None else inside_only(old_logprobs)
    log_ratio = torch.where(inside, logp - old, zero)
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / (m.sum(-1)).clamp(min=1.0)).unsqueeze(1)
    ratio = torch.exp(log_ratio)
    kl_weight = ratio.expand(b, c) if use_bias_correction_kl else 1.0  # TRL 1.16: k3 KL times the ratio (not capped)
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=eps_high).detach() * adv * logp
    else:
        clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + eps_high)
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
    per_token = per_token.expand(b, c)
    if importance_weights is not None:
        per_token = per_token * inside_only(importance_weights)
    kl_tok = None
    if beta != 0:
        gap = torch.where(inside, inside_only(ref_logprobs) - logp, zero)
        kl_tok = (torch.exp(gap) - gap - 1.0) * kl_weight
        per_token = per_token + beta * kl_tok
    per_token = torch.where(inside, per_token, zero) * m
    if loss_type == "grpo":
        loss = (per_token.sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = per_token.sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (b * (c if max_completion_length is None else max_completion_length))
    else:
        items = m.sum() if num_items_in_batch is None else torch.tensor(_divisor(num_items_in_batch), dtype=acc)
        loss = per_token.sum() / (items.clamp(min=1.0) / num_processes)
    if not return_details:
        return loss

    def masked_mean(x):
        x = x.to(acc)
        if x.shape[1] == 1:  # one value per sequence: TRL's plain mean
            return x.mean() if x.numel() else x.sum()
        return (torch.where(inside, x, zero) * m).sum() / m.sum().clamp(min=1.0)

    r = ratio.detach()
    sign = advantages.to(acc).reshape(b, -1)  # as given: TRL's plain mean of [B, 1] metrics reads every row
    if loss_type == "cispo":
        high = (r > eps_high) & (sign > 0)
        low = torch.zeros_like(high)
    else:
        low = (r < 1.0 - epsilon_low) & (sign < 0)
        high = (r > 1.0 + eps_high) & (sign > 0)
    kl_mean = None
    if kl_tok is not None:
        kl_mean = (torch.where(inside, kl_tok, zero) * m).sum().detach() / m.sum().clamp(min=1.0)

    def per_completion_extreme(x, reduce):
        """TRL's nanmin/nanmax over completions of each completion's clipped fraction (0 when none counts)."""
        x = x.to(acc)
        if x.shape[1] == 1:
            values = x[:, 0]
        else:
            counts = m.sum(-1)
            values = ((torch.where(inside, x, zero) * m).sum(-1) / counts)[counts != 0]
        return reduce(values) if values.numel() else torch.zeros((), dtype=acc)

    low_min = high_max = None
    if loss_type != "cispo":
        low_min, high_max = per_completion_extreme(low, torch.amin), per_completion_extreme(high, torch.amax)
    return loss, GRPOOut(logp, ent.detach(), kl_mean, masked_mean(low), masked_mean(high),
                         masked_mean(low | high), low_min, high_max, None, loss.detach())


# --------------------------------------------------------------------------------------------------
# dpo_loss


class DPOOut(NamedTuple):
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, *, beta=0.1, loss_type="sigmoid",
             label_smoothing=0.0, bias=None, temperature=1.0, logit_scale=1.0, softcap=None, ignore_index=-100,
             return_details=False, cfg=EXACT):
    acc = _acc(cfg)
    lp = token_logprobs(hidden, weight, labels, bias=bias, temperature=temperature, logit_scale=logit_scale,
                        softcap=softcap, ignore_index=ignore_index, cfg=cfg)
    seq = lp.sum(-1)
    counts = (labels != ignore_index).sum(-1).to(acc).clamp(min=1.0)
    pairs = seq.shape[0] // 2
    u_c = seq[:pairs] - ref_chosen_logps.to(acc)
    u_r = seq[pairs:] - ref_rejected_logps.to(acc)
    d = u_c - u_r
    e = label_smoothing
    ls = torch.nn.functional.logsigmoid
    if loss_type == "sigmoid":
        losses = -(1.0 - e) * ls(beta * d) - e * ls(-beta * d)
    elif loss_type == "robust":
        losses = (-(1.0 - e) * ls(beta * d) + e * ls(-beta * d)) / (1.0 - 2.0 * e)
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * d)
    else:  # ipo
        losses = (u_c / counts[:pairs] - u_r / counts[pairs:] - 1.0 / (2.0 * beta)) ** 2
    loss = losses.mean() if pairs else losses.sum()
    if not return_details:
        return loss
    return loss, DPOOut(seq[:pairs], seq[pairs:], (beta * u_c).detach(), (beta * u_r).detach())


# --------------------------------------------------------------------------------------------------
# group_advantages


def group_advantages(rewards, group_size, *, scale="group", drop_silent_groups=False, eps=1e-4, unbiased=True):
    r = rewards.to(torch.float64).reshape(-1, group_size)
    ddof = 1 if unbiased else 0

    def std(x, dim=None):
        count = x.shape[dim] if dim is not None else x.numel()
        if count <= ddof:
            return torch.zeros(x.shape[0] if dim is not None else (), dtype=x.dtype)
        mean = x.mean(dim=dim, keepdim=dim is not None)
        return (((x - mean) ** 2).sum(dim=dim) / (count - ddof)).sqrt()

    silent = (r == r[:, :1]).all(1)
    group_std = torch.where(silent, torch.zeros(r.shape[0], dtype=r.dtype), std(r, 1))
    centred = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = centred / (group_std[:, None] + eps)
    elif scale == "batch":
        adv = centred / (std(r.reshape(-1)) + eps)
    else:
        adv = centred
    adv = torch.where(silent[:, None], torch.zeros_like(adv), adv)
    keep = (~silent[:, None]).expand_as(r) if drop_silent_groups else torch.ones_like(r, dtype=torch.bool)
    return adv.reshape(-1), group_std, keep.reshape(-1)


# --------------------------------------------------------------------------------------------------
# The per-row statistics of a backend's forward (``StatsProblem`` -> ``Statistics``, docs/design.md, "The
# statistics problem")


def statistics(p, hidden=None, weight=None, bias=None) -> dict:
    """The statistics ``p`` asks for, per row, in float64 from the materialised logits: a dict by the field
    names of ``Statistics`` (those it does not ask for are left out), 0 on rows whose target is ignored.
    Differentiable in ``hidden``, ``weight`` and ``bias`` (default: ``p``'s own)."""
    h = p.hidden if hidden is None else hidden
    w = p.weight if weight is None else weight
    b = p.bias if bias is None else bias

    def logits_of(h, w, b, tf):
        return logits(h, w, b, temperature=tf.temperature, logit_scale=tf.logit_scale, softcap=tf.softcap)

    z = logits_of(h, w, b, p.transform)
    logq = log_softmax(z)
    q = logq.exp()
    out = {"lse": torch.logsumexp(z, dim=1), "row_max": z.amax(1)}
    if p.targets is not None:
        out["logp"] = logq.gather(1, p.targets.clamp(min=0)[:, None]).squeeze(1)
    if p.want_entropy:
        out["entropy"] = -(q * logq).sum(1)
    if p.want_extras:
        out["log_sum_sq_probs"] = torch.log((q * q).sum(1))
        if p.targets is not None:
            # argmax's rule on exact ties (the first maximum), as TRL
            out["is_top1"] = (z.argmax(1) == p.targets).to(torch.float64)
    if p.want_mean_logit:
        out["mean_logit"] = z.mean(1)
    if p.has_teacher:
        zt = logits_of(p.teacher_hidden, p.teacher_weight, p.teacher_bias, p.teacher_transform)
        logpt = log_softmax(zt)
        pt = logpt.exp()
        out["lse_t"] = torch.logsumexp(zt, dim=1)
        if p.want_kl_rev:
            out["kl_rev"] = (q * (logq - logpt)).sum(1)
            # the reverse KL relative to the student's first maximum column (problem.py)
            ztm = zt.gather(1, z.argmax(1, keepdim=True))
            out["teacher_at_max"] = ztm.squeeze(1)
            out["kl_rev_rel"] = (q * ((z - out["row_max"][:, None]) - (zt - ztm))).sum(1)
        if p.want_kl_fwd:
            out["kl_fwd"] = (pt * (logpt - logq)).sum(1)
        if p.jsd_beta is not None:
            beta = p.jsd_beta
            logm = torch.logaddexp(logq + math.log1p(-beta), logpt + math.log(beta))
            out["kl_qm"] = torch.xlogy(q, q).sum(1) - (q * logm).sum(1)
            kl_pm = torch.xlogy(pt, pt).sum(1) - (pt * logm).sum(1)
            out["jsd"] = beta * kl_pm + (1 - beta) * out["kl_qm"]
    if p.targets is not None:
        valid = p.targets >= 0
        out = {k: torch.where(valid, x, torch.zeros_like(x)) for k, x in out.items()}
    return out


# --------------------------------------------------------------------------------------------------
# Closed forms for single checks


def target_logprobs(h, w, b, ids, *, transform=None):
    """float64 log q at ``ids [N, K]`` (K targets per row; 0 where -100) through the stable log-softmax,
    differentiable."""
    logq = log_softmax(logits(h, w, b, **(transform or {})))
    valid = ids != -100
    return torch.where(valid, logq.gather(1, ids.clamp(min=0)), 0.0)


def logprob_gradients(h, w, y, cot):
    """d/d(h, w) of sum_i cot_i log q_i(y_i), float64, stable for confident rows: d logp_i / dz_j =
    [j = y] - q_j with 1 - q_y summed from the other columns instead of subtracting q_y from 1."""
    z = h @ w.T
    zy = z.gather(1, y[:, None])
    others = torch.exp(z - zy).scatter(1, y[:, None], 0.0)
    q = others / (1.0 + others.sum(1, keepdim=True))  # q_j for j != y, accurately
    dz = -q
    dz.scatter_(1, y[:, None], q.sum(1, keepdim=True))
    dz = dz * cot[:, None]
    return dz @ w, dz.T @ h


def row_gradient_decimal(z, y, c_logp, c_entropy):
    """d/dz of c_logp log q_y + c_entropy H for one row of logits ``z``, in 60-digit decimal arithmetic:
    dz_j = c_logp ([j = y] - q_j) - c_entropy q_j (log q_j + H). (Float64 autograd through log_softmax is no
    oracle here: log q of the confident column carries the rounding of lse, 1e-15 absolute, 1e-7 relative.)"""
    from decimal import Decimal, localcontext

    with localcontext() as ctx:
        ctx.prec = 60
        zs = [Decimal(float(x)) for x in z]
        m = max(zs)
        e = [(x - m).exp() for x in zs]
        s = sum(e)
        q = [x / s for x in e]
        logq = [(x - m) - s.ln() for x in zs]
        entropy = -sum(qj * lj for qj, lj in zip(q, logq))
        dz = [Decimal(c_logp) * ((1 if j == y else 0) - q[j]) - Decimal(c_entropy) * q[j] * (logq[j] + entropy)
              for j in range(len(zs))]
        return torch.tensor([float(x) for x in dz], dtype=torch.float64)
