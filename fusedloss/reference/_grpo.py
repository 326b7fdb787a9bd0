"""The reference losses (fusedloss.reference, whose docstring says what they are and how precise)."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

from ..types import CPODetails, DPODetails, GroupAdvantages, GRPODetails, KTODetails, ORPODetails, TopK

Number = Union[int, float, torch.Tensor]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None) -> torch.Tensor:
    """``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature`` (docs/design.md, "The statistics
    problem").

    The product and the bias are in the input dtype (the naive path); the result is upcast to fp32
    (float64 for float64 inputs) before the transform."""
    x = hidden @ weight.T
    if bias is not None:
        x = x + bias
    x = x.to(_acc_dtype(hidden))
    u = logit_scale * x
    c = softcap * torch.tanh(u / softcap) if softcap is not None else u
    return c / temperature


def _gather(logq: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """logq[..., targets] where valid, else 0 (ignored targets are replaced by 0 before indexing)."""
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    picked = logq.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


# Masked vocabulary entries (log q = -inf) need care with autograd: torch.where sends a zero gradient to the
# branch it discards, but that branch's own backward still runs, and 0 * inf there is NaN. So the entries
# that a formula leaves out are first replaced by a harmless 0 (``_safe``) before any arithmetic.


def _safe(x: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    return torch.where(dead, torch.zeros_like(x), x)


def _entropy(logq: torch.Tensor) -> torch.Tensor:
    """-sum_v q_v log q_v, with 0 log 0 = 0."""
    dead = torch.isneginf(logq)
    logq = _safe(logq, dead)
    return -torch.where(dead, torch.zeros_like(logq), logq.exp() * logq).sum(-1)  # a NaN q stays NaN


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) = sum_v a_v (log a_v - log b_v), over the last dimension, with 0 log 0 = 0, and +inf
    where some a_v > 0 meets b_v = 0 (log a_v finite, log b_v = -inf), even if exp(log a_v) underflows:
    the answer of the mathematics, whatever the scale the probabilities are formed at."""
    a_zero, b_zero = torch.isneginf(log_a), torch.isneginf(log_b)
    log_a, log_b = _safe(log_a, a_zero | b_zero), _safe(log_b, a_zero | b_zero)
    terms = torch.where(b_zero, torch.full_like(log_a, math.inf), log_a.exp() * (log_a - log_b))
    return torch.where(a_zero, torch.zeros_like(terms), terms).sum(-1)  # a NaN a stays NaN


def _log_mixture(logq: torch.Tensor, logp: torch.Tensor, beta: float) -> torch.Tensor:
    """log m with m = (1 - beta) q + beta p (-inf where both are 0)."""
    dead = torch.isneginf(logq) & torch.isneginf(logp)
    logm = torch.logsumexp(torch.stack((_safe(logq, dead) + math.log(1.0 - beta),
                                        _safe(logp, dead) + math.log(beta))), dim=0)
    return torch.where(dead, torch.full_like(logm, -math.inf), logm)


def _generalized_jsd(logq: torch.Tensor, logp: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalized JSD of student q and teacher p per row: KL(p || q) at beta = 0 (forward), KL(q || p)
    at beta = 1 (reverse), else beta KL(p || m) + (1 - beta) KL(q || m) with m = (1 - beta) q + beta p."""
    if beta == 0:
        return _kl(logp, logq)
    if beta == 1:
        return _kl(logq, logp)
    logm = _log_mixture(logq, logp, beta)
    return beta * _kl(logp, logm) + (1.0 - beta) * _kl(logq, logm)


def _as_float(x: Number) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _reduce(per_token: torch.Tensor, valid: torch.Tensor, reduction: str,
            num_items_in_batch: Optional[Number], mean_name: str) -> torch.Tensor:
    """Shared reduction of cross_entropy and distillation_loss. ``mean_name`` is the reduction that
    divides by the number of valid tokens ("mean" or "batchmean")."""
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if num_items_in_batch is not None:
        return total / _as_float(num_items_in_batch)
    if reduction == "sum":
        return total
    if reduction == mean_name:
        return total / max(1, int(valid.sum()))
    raise ValueError(f"reduction must be one of {(mean_name, 'sum', 'none')}, got {reduction!r}")


# --------------------------------------------------------------------------------------------------
# token_logprobs


def token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
                   ignore_index=-100, return_entropy=False, return_sum_sq_probs=False):
    """log p(targets) per token (0 at ignored positions); with ``return_entropy`` also the entropy
    ``-sum_v p log p`` of the full distribution (0 at ignored positions). Targets ``[..., K]`` (one more
    dimension than the leading shape of hidden) give ``[..., K]`` log-probs, each entry ignored on its own;
    the entropy is then 0 where all K are ignored. ``return_sum_sq_probs`` appends ``sum_v p_v^2``
    (detached, 0 at ignored positions)."""
    z = logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    logq = torch.log_softmax(z, dim=-1)
    valid = targets != ignore_index
    several = targets.dim() == hidden.dim()
    if several:
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        logp = torch.where(valid, logq.gather(-1, safe), torch.zeros_like(safe, dtype=logq.dtype))
        valid = valid.any(-1)
    else:
        logp = _gather(logq, targets, valid)
    outputs = (logp,)
    if return_entropy:
        ent = _entropy(logq)
        outputs += (torch.where(valid, ent, torch.zeros_like(ent)),)
    if return_sum_sq_probs:
        sum_sq = (2 * logq.detach()).exp().sum(-1)
        outputs += (torch.where(valid, sum_sq, torch.zeros_like(sum_sq)),)
    return outputs[0] if len(outputs) == 1 else outputs


# --------------------------------------------------------------------------------------------------
# cross_entropy


def cross_entropy(hidden, weight, targets, *, bias=None, ignore_index=-100, reduction="mean",
                  label_smoothing=0.0, z_loss=0.0, temperature=1.0, logit_scale=1.0, softcap=None,
                  num_items_in_batch=None):
    """``F.cross_entropy(z, targets, ignore_index, label_smoothing)`` per valid token, plus
    ``z_loss * lse(z)**2``; "mean" divides by the number of valid tokens (0 when there are none),
    ``num_items_in_batch`` makes it ``sum / num_items_in_batch``."""
    z = logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    logq = torch.log_softmax(z, dim=-1)
    valid = targets != ignore_index
    per_token = -_gather(logq, targets, valid)
    if label_smoothing:
        # PyTorch's smoothing: (1 - e) * nll + e * mean_v(-log q_v)
        smooth = -logq.mean(dim=-1)
        per_token = (1.0 - label_smoothing) * per_token + label_smoothing * smooth
    if z_loss:
        per_token = per_token + z_loss * torch.logsumexp(z, dim=-1) ** 2
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return _reduce(per_token, valid, reduction, num_items_in_batch, "mean")


# --------------------------------------------------------------------------------------------------
# distillation_loss


def distillation_loss(hidden, weight, teacher_hidden=None, teacher_weight=None, targets=None, *, teachers=None,
                      teacher_index=None, beta=1.0, temperature=1.0, hard_weight=0.0, soft_weight=1.0,
                      t_squared=False, bias=None, teacher_bias=None, logit_scale=1.0, softcap=None,
                      teacher_logit_scale=1.0, teacher_softcap=None, ignore_index=-100, reduction="batchmean",
                      num_items_in_batch=None):
    """TRL's ``generalized_jsd_loss`` between the student q = softmax(z_s / T) and the frozen teacher
    p = softmax(z_t / T), plus ``hard_weight`` times the cross-entropy of the student at T = 1; each model's
    z is ``softcap(logit_scale * (h @ W.T + b))`` with its own scale and cap.

    beta == 0: KL(p || q); beta == 1: KL(q || p); else beta KL(p || m) + (1 - beta) KL(q || m) with
    m = (1 - beta) q + beta p.

    With ``teachers`` and ``teacher_index``: the teachers' logits of every position are materialised, each
    row from its own teacher's head (with that teacher's temperature, the call's when None), -1 rows unscored."""
    z_s = logits(hidden, weight, bias, logit_scale=logit_scale, softcap=softcap)
    routed = torch.ones(z_s.shape[:-1], dtype=torch.bool, device=z_s.device)
    temp = col = temperature
    with torch.no_grad():
        if teachers is None:
            z_t = logits(teacher_hidden, teacher_weight, teacher_bias, logit_scale=teacher_logit_scale,
                         softcap=teacher_softcap).to(z_s.dtype)
        else:
            z_t, routed, temp = _teachers_logits(teachers, teacher_index, z_s, float(temperature))
            col = temp.unsqueeze(-1)
    logq = torch.log_softmax(z_s / col, dim=-1)
    logp = torch.log_softmax(z_t / col, dim=-1)
    soft = _generalized_jsd(logq, logp, beta)
    per_token = soft_weight * soft * (temp ** 2 if t_squared else 1.0)
    if targets is None:
        valid = routed
    else:
        valid = targets != ignore_index
        if hard_weight:
            ce = -_gather(torch.log_softmax(z_s, dim=-1), targets, valid)
            per_token = per_token + hard_weight * ce
        valid = valid & routed
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return _reduce(per_token, valid, reduction, num_items_in_batch, "batchmean")


def _teachers_logits(teachers, teacher_index, z_s, temperature):
    """Every position's teacher logits ``[..., V]`` (0 where no teacher), whether it has one, and its
    temperature; a teacher's ``hidden`` covers every position or only its own rows, in position order."""
    lead = z_s.shape[:-1]
    flat = teacher_index.reshape(-1)
    z_t = torch.zeros(flat.numel(), z_s.shape[-1], dtype=z_s.dtype, device=z_s.device)
    temp = torch.full((flat.numel(),), temperature, dtype=z_s.dtype, device=z_s.device)
    for i, t in enumerate(teachers):
        rows = (flat == i).nonzero().squeeze(1)
        h = t.hidden.reshape(-1, t.hidden.shape[-1])
        if h.shape[0] != rows.numel() or tuple(t.hidden.shape[:-1]) == tuple(lead):
            h = h[rows]
        z_t[rows] = logits(h, t.weight, t.bias, logit_scale=t.logit_scale, softcap=t.softcap).to(z_s.dtype)
        if t.temperature is not None:
            temp[rows] = float(t.temperature)
    return z_t.reshape(*lead, -1), (flat >= 0).reshape(lead), temp.reshape(lead)


# --------------------------------------------------------------------------------------------------
# sparse_distillation_loss


def sparse_distillation_loss(hidden, weight, teacher_ids, teacher_logprobs, targets=None, *,
                             teacher_target_logprobs=None, beta=1.0, loss_top_k=None, loss_add_tail=True,
                             reverse_kl_top_1_mode="sampled", renormalize=True, log_prob_min_clamp=None,
                             loss_max_clamp=None, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
                             ignore_index=-100, reduction="batchmean", num_items_in_batch=None):
    """TRL's server distillation loss on a teacher's top-k log-probs. Per scored position (target not
    ignore_index; every position when targets is None), on the support S: the teacher's first loss_top_k
    ids with a finite log-prob (beta == 0), the sampled token (beta == 1), or the teacher's top-1 and the
    sampled token, once when they coincide (otherwise). Both sides get the tail log(1 - min(sum_S e^lp,
    e^-1e-7)) (loss_add_tail) or are renormalised over S (renormalize; else taken as they are, clamped below
    at log_prob_min_clamp, the KL then clamped below at 0), then KL(p || q), KL(q || p) or the generalized
    JSD with m = (1 - beta) q + beta p, summed over the entries, clamped to +-loss_max_clamp."""
    assert reverse_kl_top_1_mode == "sampled"
    logq = torch.log_softmax(logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale,
                                    softcap=softcap), dim=-1)
    lead = logq.shape[:-1]
    scored = torch.ones(lead, dtype=torch.bool, device=logq.device) if targets is None else targets != ignore_index
    rows = logq[scored]  # [M, V]: only the scored positions are computed
    if beta < 1:
        k = teacher_ids.shape[-1] if loss_top_k is None else loss_top_k
        top_ids, top_lp = teacher_ids[scored][:, :k], teacher_logprobs[scored][:, :k].to(logq.dtype)
    if beta > 0:
        sampled, sampled_lp = targets[scored], teacher_target_logprobs[scored].to(logq.dtype)
    if beta == 0:
        ids, teacher, on = top_ids, top_lp, top_lp > -math.inf
    elif beta == 1:
        ids, teacher, on = sampled[:, None], sampled_lp[:, None], torch.ones_like(sampled[:, None], dtype=torch.bool)
    else:
        ids = torch.stack((top_ids[:, 0], sampled), dim=-1)
        teacher = torch.stack((top_lp[:, 0], sampled_lp), dim=-1)
        on = torch.stack((torch.ones_like(sampled, dtype=torch.bool), sampled != top_ids[:, 0]), dim=-1)
    student = torch.where(on, rows.gather(-1, torch.where(on, ids, torch.zeros_like(ids))), -math.inf)
    teacher = torch.where(on, teacher, -math.inf)

    def spread(lp):
        if loss_add_tail:
            mass = torch.logsumexp(lp, dim=-1, keepdim=True).clamp(max=-1e-7)
            return torch.cat((lp, torch.log(-torch.expm1(mass))), dim=-1)
        if not renormalize:
            return lp if log_prob_min_clamp is None else torch.where(on, lp.clamp(min=log_prob_min_clamp), lp)
        return torch.log_softmax(lp, dim=-1)

    student, teacher = spread(student), spread(teacher)
    soft = _generalized_jsd(student, teacher, beta)
    if not renormalize:
        soft = soft.clamp(min=0.0)
    if loss_max_clamp is not None:
        soft = soft.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    per_token = torch.zeros(lead, dtype=logq.dtype, device=logq.device).masked_scatter(scored, soft)
    return _reduce(per_token, scored, reduction, num_items_in_batch, "batchmean")


# --------------------------------------------------------------------------------------------------
# grpo_loss


def topk_logprobs(hidden, weight, k, *, bias=None, temperature=1.0, logit_scale=1.0, softcap=None, mask=None,
                  return_lse=False, return_entropy=False, vocab_size=None):
    """``fusedloss.topk_logprobs`` on materialised logits: ``log_softmax`` then the top ``k``, most likely first,
    the smaller id first among equal log-probs (a stable sort); ids -1, log-probs -inf, lse and entropy 0 where
    ``mask`` is False."""
    if vocab_size is not None:
        weight, bias = weight[:vocab_size], (None if bias is None else bias[:vocab_size])
    with torch.no_grad():
        z = logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
        logq = torch.log_softmax(z, dim=-1)
        order = logq.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        ids, lp = order, logq.gather(-1, order)
        lse = torch.logsumexp(z, dim=-1)
        entropy = _entropy(logq)
        if mask is not None:
            keep = mask.to(torch.bool)
            ids = torch.where(keep.unsqueeze(-1), ids, -1)
            lp = torch.where(keep.unsqueeze(-1), lp, -math.inf)
            lse, entropy = torch.where(keep, lse, 0.0), torch.where(keep, entropy, 0.0)
    return TopK(ids=ids, logprobs=lp, lse=lse if return_lse else None, entropy=entropy if return_entropy else None)


def _verl_kl(logp, ref, kind):
    """verl's ``kl_penalty``: k1 = logp - ref, abs = |k1|, k2 = k1^2 / 2, k3 = e^(ref - logp) - (ref - logp) - 1
    (the exponent clamped to [-20, 20], the value to [-10, 10]); "+": the value, k2's gradient."""
    base = kind.rstrip("+")
    if base in ("kl", "k1"):
        value = logp - ref
    elif base == "abs":
        value = (logp - ref).abs()
    elif base in ("mse", "k2"):
        value = 0.5 * (logp - ref) ** 2
    elif base in ("low_var_kl", "k3"):
        gap = (ref - logp).clamp(-20.0, 20.0)
        value = (gap.exp() - gap - 1).clamp(-10.0, 10.0)
    else:
        raise ValueError(f"unknown kl_loss_type {kind!r}")
    if kind.endswith("+") and base not in ("mse", "k2"):
        k2 = 0.5 * (logp - ref) ** 2
        value = k2 - k2.detach() + value.detach()
    return value


def _verl_aggregate(x, m, mode, batch_num_tokens, dp_size, global_batch_size, loss_scale_factor):
    """verl's ``agg_loss`` of a per-token ``[B, C]`` x over the mask m (0, not NaN, for an empty batch)."""
    if mode == "token-mean":
        tokens = m.sum() if batch_num_tokens is None else _as_float(batch_num_tokens)
        return (x * m).sum() / max(1.0, float(tokens)) * dp_size
    if mode == "token-sum":
        return (x * m).sum() * dp_size
    counts = m.sum(-1)
    present = (counts > 0).to(x.dtype)
    sequences = max(1.0, float(present.sum() if global_batch_size is None else global_batch_size))
    if mode == "seq-mean-token-mean":
        seq_losses = (x * m).sum(-1) / (counts + 1e-8)
    else:
        seq_losses = (x * m).sum(-1)
    loss = (seq_losses * present).sum() / sequences * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    elif mode not in ("seq-mean-token-sum", "seq-mean-token-mean"):
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    return loss


def grpo_loss(hidden, weight, completion_ids, advantages, completion_mask, *, old_logprobs=None,
              ref_logprobs=None, bias=None, temperature=1.0, logit_scale=1.0, softcap=None, loss_type="dapo",
              epsilon_low=0.2, epsilon_high=None, delta=None, beta=0.0, use_bias_correction_kl=True,
              importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
              vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
              off_policy_mask_threshold=None, sampling_logprobs=None, top_entropy_quantile=1.0, entropy_coef=0.0,
              kl_loss_type=None, loss_agg_mode=None, global_batch_size=None, cispo_two_sided=False, dro_beta=None,
              clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, kl_cov_ratio=0.0002, ppo_kl_coef=0.1,
              max_completion_length=None,
              num_items_in_batch=None, num_processes=1, importance_weights=None, return_details=False):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` (gradient accumulation 1, one process), written in TRL's order.

    Per-token inputs outside the mask are replaced by neutral values (advantage 0, log-probs 0, weight 1)
    before any arithmetic, so that whatever was there produces nothing, gradient included. TRL's shapes
    are kept: per-completion advantages are ``[B, 1]``, and so is a GSPO ratio. ``kl_loss_type`` and
    ``loss_agg_mode`` are verl 0.9's (``kl_penalty``, ``agg_loss``), written as verl writes them, and so are
    its losses vanilla, dppo_tv, dppo_kl, dro, clip_cov, kl_cov, geo_mean and two-sided cispo (token-mean unless
    ``loss_agg_mode`` says)."""
    verl_losses = ("vanilla", "dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov", "geo_mean")
    if loss_type in verl_losses and loss_agg_mode is None:
        loss_agg_mode = "token-mean"
    if epsilon_high is None:
        epsilon_high = epsilon_low
    mask = completion_mask != 0
    ids = torch.where(mask, completion_ids, torch.full_like(completion_ids, -100))
    logp, entropy = token_logprobs(hidden, weight, ids, bias=bias, temperature=temperature,
                                   logit_scale=logit_scale, softcap=softcap, ignore_index=-100,
                                   return_entropy=True)
    acc = logp.dtype
    B, C = logp.shape
    m = completion_mask.to(acc)  # TRL multiplies by the mask: a fractional mask weights tokens

    def inside(x, fill=0.0):
        if x is None:
            return None
        x = x.to(acc)
        x = (x.unsqueeze(1) if x.dim() == 1 else x).expand(B, C)
        return torch.where(mask, x, torch.full_like(x, fill))

    A = inside(advantages)
    # TRL's [B, 1] advantages (per completion, or per token with C == 1) are used as given, masked entries
    # included (its plain-mean clip metrics read them so).
    A_trl = advantages.to(acc).reshape(B, 1) if advantages.dim() == 1 or C == 1 else A
    old = logp.detach() if old_logprobs is None else inside(old_logprobs)
    log_ratio = logp - old
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    elif importance_sampling_level == "sequence":  # GSPO
        log_importance_weights = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    coef_1 = torch.exp(log_importance_weights)

    per_token_kl = None
    if beta != 0.0:
        ref = inside(ref_logprobs)
        if kl_loss_type is None:
            per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        else:
            per_token_kl = _verl_kl(logp, ref, kl_loss_type)
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    off_policy_mask = None
    if off_policy_mask_threshold is not None:  # DeepSeek-V3.2's off-policy sequence mask
        sampling = old if sampling_logprobs is None else inside(sampling_logprobs)
        kl_div = torch.nan_to_num(sampling - logp.detach(), nan=0.0)
        avg_seq_kl = (kl_div * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((A_trl >= 0) | (avg_seq_kl <= off_policy_mask_threshold)).to(acc)

    entropy_mask = None
    if top_entropy_quantile < 1.0:  # keep the top quantile of the masked tokens by entropy
        ent = entropy.detach()
        if bool(mask.any()):
            threshold = torch.quantile(ent[mask], 1 - top_entropy_quantile)
            entropy_mask = ((ent * m) >= threshold) & mask
        else:
            entropy_mask = torch.zeros_like(mask)

    weights = None if importance_weights is None else inside(importance_weights, 1.0)
    phi_seq = None
    if loss_type == "cispo" and cispo_two_sided:  # verl's: clamped on both sides, log-ratio within +-20
        r = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
        per_token_loss = -torch.clamp(r, 1 - epsilon_low, 1 + epsilon_high).detach() * A * logp
    elif loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=epsilon_high).detach() * A * logp
    elif loss_type == "vanilla":  # PPO's clip and the dual clip at clip_ratio_c where A < 0, log-ratio within +-20
        r = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
        clip_pg = torch.maximum(-A * r, -A * torch.clamp(r, 1 - epsilon_low, 1 + epsilon_high))
        per_token_loss = torch.where(A < 0, torch.min(-A * (3.0 if delta is None else delta), clip_pg), clip_pg)
    elif loss_type == "dro":
        per_token_loss = -(logp * A - 0.5 * dro_beta * (logp - old) ** 2)
    elif loss_type in ("dppo_tv", "dppo_kl"):  # binary trust-region masks, truncated importance sampling
        r = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
        truncated = torch.clamp(r, max=3.0 if delta is None else delta).detach()
        p, p_old = logp.detach().exp(), old.exp()
        if loss_type == "dppo_tv":
            keep = torch.where(A > 0, p - p_old <= epsilon_high, p - p_old >= -epsilon_low)
        else:
            kl = p_old * (old - logp.detach()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            keep = torch.where(A > 0, (kl <= epsilon_high) | (p <= p_old), (kl <= epsilon_low) | (p >= p_old))
        per_token_loss = -A * truncated * logp * keep.to(acc)
    elif loss_type == "geo_mean":  # GMPO: a per-completion objective, added after the aggregation below
        per_token_loss = torch.zeros_like(logp)
    elif loss_type == "kl_cov":  # |log-ratio| penalty on the tokens of largest covariance of A and logp
        r = torch.exp(logp - old)
        per_token_loss = -A * r
        a, lp = A[mask], logp.detach()[mask]
        if a.numel():
            cov = (a - a.mean()) * (lp - lp.mean())
            top = torch.topk(cov, max(1, int(cov.numel() * kl_cov_ratio))).indices
            rows, cols = torch.nonzero(mask, as_tuple=True)
            penalised = torch.zeros_like(mask)
            penalised[rows[top], cols[top]] = True
            per_token_loss = torch.where(penalised, per_token_loss + ppo_kl_coef * (logp - old).abs(), per_token_loss)
    elif loss_type == "clip_cov":  # PPO clip, and a random few unclipped tokens of moderate covariance dropped
        r = torch.exp(logp - old)
        unclipped_loss, clipped_loss = -A * r, -A * torch.clamp(r, 1 - epsilon_low, 1 + epsilon_high)
        n = mask.sum()
        lp = logp.detach()
        cov = (A - (A * mask).sum() / (n + 1e-8)) * (lp - (lp * mask).sum() / (n + 1e-8))
        eligible = mask & (clipped_loss <= unclipped_loss) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        where = torch.nonzero(eligible)
        kept = torch.ones_like(A)
        if len(where):
            drawn = where[torch.randperm(len(where))[:max(int(clip_cov_ratio * int(n)), 1)]]
            kept[drawn[:, 0], drawn[:, 1]] = 0.0
        per_token_loss = torch.maximum(unclipped_loss, clipped_loss) * kept
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:  # after the clamp is formed: the first argument only (TRL reassigns coef_1)
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * A, coef_2 * A)
    elif loss_type == "sapo":
        temperatures = torch.where(A > 0, torch.full_like(A, sapo_temperature_pos),
                                   torch.full_like(A, sapo_temperature_neg))
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * A
    elif loss_type == "vespo":  # TRL's get_gamma_weights: a detached per-sequence gamma weight
        with torch.no_grad():
            log_w = (torch.clamp(log_ratio, -20.0, 20.0) * m).sum(-1, keepdim=True)
            if weights is not None:
                log_w = log_w + torch.clamp(torch.log(weights), math.log(1e-8), 20.0).sum(-1, keepdim=True)
            log_w = torch.clamp(log_w, math.log(1e-8), 20.0)
            k = torch.where(A_trl >= 0, torch.full_like(A_trl, vespo_k_pos), torch.full_like(A_trl, vespo_k_neg))
            lam = torch.where(A_trl >= 0, torch.full_like(A_trl, vespo_lambda_pos),
                              torch.full_like(A_trl, vespo_lambda_neg)).clamp(min=1e-4)
            phi_seq = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0,
                                                                                    neginf=0.0)
        per_token_loss = -phi_seq * A * logp
    else:
        raise ValueError(f"loss_type must be one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo, "
                         f"got {loss_type!r}")
    if off_policy_mask is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if weights is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * weights
    if per_token_kl is not None:
        per_token_loss = per_token_loss + beta * per_token_kl

    if loss_agg_mode is not None:
        def aggregate(x):
            return _verl_aggregate(x, m, loss_agg_mode, num_items_in_batch, num_processes, global_batch_size,
                                   max_completion_length)
        loss = aggregate(per_token_loss)
    elif loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * m).sum() / m.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * m).sum() / (B * (C if max_completion_length is None else max_completion_length))
    elif loss_type == "luspo":
        loss = (per_token_loss * m).sum(-1).mean()
    else:  # dapo, cispo, vespo
        items = m.sum() if num_items_in_batch is None else _as_float(num_items_in_batch)
        loss = (per_token_loss * m).sum() / (max(1.0, _as_float(items)) / num_processes)
    if loss_type == "geo_mean":
        d = logp - old
        s = torch.sign(A)
        d_min = s * torch.min(s * d, s * d.clamp(-epsilon_low, epsilon_high))
        n = m.sum(-1) + 1e-8
        seq = -(A * m).sum(-1) / n * torch.exp((d_min * m).sum(-1) / n)
        if weights is not None:
            seq = seq * torch.exp((torch.log(weights + 1e-10) * m).sum(-1) / n)
        loss = loss + seq.mean()
    if B == 0 or C == 0:  # no token: 0, as TRL (dr_grpo's B * C denominator is then 0 too)
        loss = loss.nan_to_num(nan=0.0)
    policy_loss = loss.detach()
    if entropy_coef != 0.0 and loss_agg_mode is not None:
        loss = loss - entropy_coef * aggregate(entropy)
    elif entropy_coef != 0.0:
        effective = m if entropy_mask is None else m * entropy_mask
        loss = loss - entropy_coef * (entropy * effective).sum() / effective.sum().clamp(min=1.0)
    if not return_details:
        return loss

    def global_masked_mean(x):  # TRL's: a plain mean of one value per completion, else a masked mean
        x = x.to(acc)
        if x.shape[1] == 1:
            return x.sum() / max(B, 1)
        return (x * m).sum() / m.sum().clamp(min=1.0)

    def masked_seq_extreme(x, reduce):  # TRL's nanmin/nanmax of per-completion masked means; 0 if none
        x = x.to(acc)
        if x.shape[1] == 1:
            values = x[:, 0]
        else:
            values = ((x * m).sum(-1) / m.sum(-1))[m.sum(-1) != 0]
        return reduce(values) if values.numel() else torch.zeros((), dtype=acc)

    with torch.no_grad():
        r = coef_1.detach()  # after the delta cap, as TRL measures it
        sign = A_trl if r.shape[1] == 1 else A
        low = high = region = low_min = high_max = None
        unclipped = ("sapo", "vespo", "vanilla", "dppo_tv", "dppo_kl", "dro", "clip_cov", "kl_cov", "geo_mean")
        if loss_type in unclipped or cispo_two_sided:
            pass  # no TRL clip metrics
        elif loss_type == "cispo":
            high = global_masked_mean((r > epsilon_high) & (sign > 0))
            low, region = torch.zeros_like(high), high
        else:
            is_low = (r < 1 - epsilon_low) & (sign < 0)
            is_high = (r > 1 + epsilon_high) & (sign > 0)
            low, high = global_masked_mean(is_low), global_masked_mean(is_high)
            region = global_masked_mean(is_low | is_high)
            low_min, high_max = masked_seq_extreme(is_low, torch.amin), masked_seq_extreme(is_high, torch.amax)
        details = GRPODetails(
            logprobs=logp,
            entropy=entropy.detach(),
            kl=None if per_token_kl is None else (per_token_kl.detach() * m).sum() / m.sum().clamp(min=1.0),
            clip_ratio_low=low, clip_ratio_high=high, clip_ratio_region=region,
            clip_ratio_low_min=low_min, clip_ratio_high_max=high_max,
            vespo_phi_seq_mean=None if phi_seq is None else global_masked_mean(phi_seq),
            policy_loss=policy_loss,
        )
    return loss, details


# --------------------------------------------------------------------------------------------------
# Preference losses: chosen rows 0..B-1, rejected rows B..2B-1 (TRL's concatenation)


def _sequence_logps(hidden, weight, labels, bias, temperature, logit_scale, softcap, ignore_index):
    """Per-token log-probs ``[rows, T]`` (0 at ignored labels) and the mask of scored tokens."""
    per_token = token_logprobs(hidden, weight, labels, bias=bias, temperature=temperature,
                               logit_scale=logit_scale, softcap=softcap, ignore_index=ignore_index)
    per_token = per_token.reshape(per_token.shape[0], -1)
    return per_token, (labels != ignore_index).reshape(labels.shape[0], -1)


def _chosen_nll(per_token, valid):
    """TRL's CrossEntropyLoss over the chosen half: mean over its scored tokens (0 when there are none)."""
    half = per_token.shape[0] // 2
    return -per_token[:half].sum() / max(1, int(valid[:half].sum()))


def _log1mexp(x):
    """log(1 - exp(x)) for x <= 0, branching at -log 2 to avoid cancellation (TRL's ORPO helper)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


# dpo_loss


def dpo_loss(hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, *, beta=0.1, loss_type="sigmoid",
             loss_weights=None, label_smoothing=0.0, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5,
             ld_alpha=None, discopop_tau=0.05, use_weighting=False, bias=None, temperature=1.0, logit_scale=1.0,
             softcap=None, ignore_index=-100, return_details=False):
    """TRL 1.16 ``DPOTrainer._compute_loss`` with precomputed reference log-probs, written in TRL's order;
    ``sigmoid`` keeps the conservative-DPO ``label_smoothing`` (cDPO; TRL 1.16's sigmoid ignores it)."""
    z = logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    logq = torch.log_softmax(z, dim=-1)
    valid_tok = labels != ignore_index
    per_token_logps = _gather(logq, labels, valid_tok).reshape(labels.shape[0], -1)
    mask = valid_tok.reshape(labels.shape[0], -1)
    acc = per_token_logps.dtype
    B = per_token_logps.shape[0] // 2
    if ld_alpha is None:
        logps = per_token_logps.sum(-1)
    else:  # LD-DPO: the tokens past the shorter completion of the pair count ld_alpha
        comp_pos = mask.long().cumsum(-1)
        lens = mask.sum(-1)
        shared = torch.minimum(lens[:B], lens[B:]).repeat(2).unsqueeze(1)
        shared_mask = (comp_pos > 0) & (comp_pos <= shared)
        tail_mask = comp_pos > shared
        logps = (per_token_logps * shared_mask).sum(-1) + ld_alpha * (per_token_logps * tail_mask).sum(-1)
    chosen_logps, rejected_logps = logps[:B], logps[B:]
    ref_c, ref_r = ref_chosen_logps.to(acc), ref_rejected_logps.to(acc)
    chosen_logratios, rejected_logratios = chosen_logps - ref_c, rejected_logps - ref_r

    if f_divergence_type == "reverse_kl":
        chosen_scores, rejected_scores = chosen_logratios, rejected_logratios
    elif f_divergence_type == "forward_kl":
        chosen_scores, rejected_scores = 1 - torch.exp(-chosen_logratios), 1 - torch.exp(-rejected_logratios)
    elif f_divergence_type == "js_divergence":
        chosen_scores = math.log(2) + F.logsigmoid(chosen_logratios)
        rejected_scores = math.log(2) + F.logsigmoid(rejected_logratios)
    elif f_divergence_type == "alpha_divergence":
        if abs(f_alpha_divergence_coef - 1.0) < 1e-6:
            chosen_scores, rejected_scores = chosen_logratios, rejected_logratios
        else:
            a = f_alpha_divergence_coef - 1.0
            chosen_scores = (torch.exp(torch.clamp(a * chosen_logratios, max=80.0)) - 1.0) / a
            rejected_scores = (torch.exp(torch.clamp(a * rejected_logratios, max=80.0)) - 1.0) / a
    else:
        raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}")
    delta_score = chosen_scores - rejected_scores
    n = mask.sum(-1).to(acc).clamp(min=1.0)
    e = label_smoothing
    logsig = F.logsigmoid

    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    loss_weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    loss = torch.zeros((), dtype=acc)
    for lt, lw in zip(loss_types, loss_weights):
        if lt == "sigmoid" and e == 0:  # TRL's form: 0, not 0 * -inf, at an infinite margin
            losses = -logsig(beta * delta_score)
        elif lt == "sigmoid":
            losses = -(1 - e) * logsig(beta * delta_score) - e * logsig(-beta * delta_score)
        elif lt == "hinge":
            losses = torch.relu(1 - beta * delta_score)
        elif lt == "ipo":
            losses = (chosen_scores / n[:B] - rejected_scores / n[B:] - 1 / (2 * beta)) ** 2
        elif lt == "exo_pair":
            eps = torch.tensor(e, dtype=acc)
            losses = (torch.sigmoid(beta * delta_score) * (logsig(beta * delta_score) - torch.log1p(-eps))
                      + torch.sigmoid(-beta * delta_score) * (logsig(-beta * delta_score) - torch.log(eps)))
        elif lt == "nca_pair":
            rc, rr = beta * chosen_logratios, beta * rejected_logratios
            losses = -logsig(rc) - 0.5 * logsig(-rc) - 0.5 * logsig(-rr)
        elif lt == "robust":
            losses = (-(1 - e) * logsig(beta * delta_score) + e * logsig(-beta * delta_score)) / (1 - 2 * e)
        elif lt == "bco_pair":
            losses = -logsig(beta * chosen_logratios) - logsig(-beta * rejected_logratios)
        elif lt == "sppo_hard":
            losses = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif lt == "aot":
            d = torch.sort(chosen_logps - rejected_logps)[0] - torch.sort(ref_c - ref_r)[0]
            losses = -(1 - e) * logsig(beta * d) - e * logsig(-beta * d)
        elif lt == "aot_unpaired":
            d = torch.sort(chosen_logratios)[0] - torch.sort(rejected_logratios)[0]
            losses = -(1 - e) * logsig(beta * d) - e * logsig(-beta * d)
        elif lt == "apo_zero":
            losses = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
        elif lt == "apo_down":
            losses = torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(beta * (chosen_logratios
                                                                                         - rejected_logratios))
        elif lt == "discopop":
            x = beta * delta_score
            mod = torch.sigmoid(x / discopop_tau)
            losses = -logsig(x) * (1 - mod) + torch.exp(-x) * mod
        elif lt == "sft":
            losses = (-per_token_logps[:B].sum() / max(1, int(mask[:B].sum()))).expand(B)
        elif lt == "sigmoid_norm":
            losses = -logsig(beta * (chosen_scores / n[:B] - rejected_scores / n[B:]))
        else:
            raise ValueError(f"unknown DPO loss_type {lt!r}")
        if use_weighting:  # WPO: the pair's length-normalised probabilities, aligned to the policy's own
            with torch.no_grad():
                log_sum_sq = torch.logsumexp(2 * logq, dim=-1).reshape(mask.shape)
                aligned = torch.where(mask, per_token_logps - log_sum_sq, torch.zeros_like(log_sum_sq))
                weights = torch.exp(aligned.sum(-1) / mask.sum(-1).clamp(min=1))
            losses = losses * weights[:B] * weights[B:]
        loss = loss + (losses.mean() if B else losses.sum()) * lw
    if not return_details:
        return loss
    return loss, DPODetails(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                            chosen_rewards=(beta * chosen_logratios).detach(),
                            rejected_rewards=(beta * rejected_logratios).detach())


# kto_loss


def kto_loss(hidden, weight, labels, preference_labels, ref_logps, *, kl_hidden=None, kl_labels=None,
             ref_kl_logps=None, kl=None, beta=0.1, loss_type="kto", desirable_weight=1.0, undesirable_weight=1.0,
             bias=None, temperature=1.0, logit_scale=1.0, softcap=None, ignore_index=-100, return_details=False):
    """TRL 1.16 ``KTOTrainer._compute_loss`` with precomputed reference log-probs, one process."""
    kw = dict(bias=bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap, ignore_index=ignore_index)
    logps = _sequence_logps(hidden, weight, labels, **kw)[0].sum(-1)
    acc = logps.dtype
    if loss_type == "apo_zero_unpaired":
        z0 = torch.zeros((), dtype=acc)
    elif kl is not None:
        z0 = torch.as_tensor(kl, dtype=acc).reshape(()).detach()
    else:
        with torch.no_grad():  # the KL term is estimated from mismatched pairs without gradient
            kl_logps = _sequence_logps(kl_hidden, weight, kl_labels, **kw)[0].sum(-1)
            z0 = (kl_logps - ref_kl_logps.to(acc)).mean().clamp(min=0)
    desirable = preference_labels.bool()
    logratios = logps - ref_logps.to(acc)
    if loss_type == "kto":
        chosen = 1 - torch.sigmoid(beta * (logratios - z0))
        rejected = 1 - torch.sigmoid(beta * (z0 - logratios))
    elif loss_type == "apo_zero_unpaired":
        chosen = 1 - torch.sigmoid(beta * logratios)
        rejected = torch.sigmoid(beta * logratios)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}")
    losses = torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)
    loss = losses.mean() if losses.numel() else losses.sum()
    if not return_details:
        return loss
    return loss, KTODetails(logps=logps, rewards=(beta * logratios).detach(), kl=z0.detach())


# orpo_loss


def orpo_loss(hidden, weight, labels, *, beta=0.1, nll_labels=None, bias=None, temperature=1.0, logit_scale=1.0,
              softcap=None, ignore_index=-100, return_details=False):
    """TRL 1.16 experimental ``ORPOTrainer.get_batch_loss_metrics``: NLL of the chosen completions minus
    beta times the mean log-sigmoid of the log odds ratio of the mean token log-probs."""
    kw = dict(bias=bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap, ignore_index=ignore_index)
    per_token, valid = _sequence_logps(hidden, weight, labels, **kw)
    avg = per_token.sum(-1) / valid.sum(-1).clamp(min=1)
    B = avg.shape[0] // 2
    chosen, rejected = avg[:B], avg[B:]
    nll = _chosen_nll(*(_sequence_logps(hidden, weight, nll_labels, **kw) if nll_labels is not None
                        else (per_token, valid)))
    # A pair with an empty completion has no odds (log(1 - e^0) = -inf): left out of the mean, 0 if none left.
    scored = (valid[:B].sum(-1) > 0) & (valid[B:].sum(-1) > 0)
    c, r = (torch.where(scored, x, torch.full_like(x, -1.0)) for x in (chosen, rejected))
    log_odds = torch.where(scored, (c - r) - (_log1mexp(c) - _log1mexp(r)), torch.zeros_like(c))
    ratio = torch.where(scored, F.logsigmoid(log_odds), torch.zeros_like(c))

    def mean(x):
        return x.sum() / scored.sum().clamp(min=1)

    loss = nll - beta * mean(ratio)
    if not return_details:
        return loss

    return loss, ORPODetails(chosen_logps=chosen, rejected_logps=rejected, chosen_rewards=(beta * chosen).detach(),
                             rejected_rewards=(beta * rejected).detach(), log_odds_ratio=mean(ratio).detach(),
                             log_odds_chosen=mean(log_odds).detach(), nll_loss=nll.detach())


# cpo_loss


def cpo_loss(hidden, weight, labels, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, cpo_alpha=1.0,
             simpo_gamma=0.5, alpha=0.0, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
             ignore_index=-100, return_details=False):
    """TRL 1.16 experimental ``CPOTrainer.get_batch_loss_metrics`` (SimPO is ``loss_type="simpo"``; AlphaPO
    is ``alpha != 0``)."""
    kw = dict(bias=bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap, ignore_index=ignore_index)
    per_token, valid = _sequence_logps(hidden, weight, labels, **kw)
    logps = per_token.sum(-1)
    if loss_type in ("ipo", "simpo"):
        logps = logps / valid.sum(-1).clamp(min=1)
    B = logps.shape[0] // 2
    chosen, rejected = logps[:B], logps[B:]
    if alpha != 0.0:
        chosen_r = (1 - torch.exp(chosen).pow(-alpha)) / alpha
        rejected_r = (1 - torch.exp(rejected).pow(-alpha)) / alpha
    else:
        chosen_r, rejected_r = chosen, rejected
    x = chosen_r - rejected_r
    e = label_smoothing
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            x = x - simpo_gamma / beta
        losses = -F.logsigmoid(beta * x) * (1 - e) - F.logsigmoid(-beta * x) * e
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * x)
    elif loss_type == "ipo":
        losses = (x - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown CPO loss_type {loss_type!r}")
    nll = _chosen_nll(per_token, valid) if cpo_alpha != 0 else torch.zeros((), dtype=logps.dtype)
    loss = (losses.mean() if B else losses.sum()) + cpo_alpha * nll
    if not return_details:
        return loss
    return loss, CPODetails(chosen_logps=chosen, rejected_logps=rejected, chosen_rewards=(beta * chosen_r).detach(),
                            rejected_rewards=(beta * rejected_r).detach(), nll_loss=nll.detach())


# --------------------------------------------------------------------------------------------------
# group_advantages


def group_advantages(rewards, group_size, *, scale="group", drop_silent_groups=False, eps=1e-4, unbiased=True):
    """A_i = (r_i - mean of its group) / (std + eps), with std the group's ("group"), the batch's
    ("batch"), or no division at all ("none"). A silent group (all rewards equal) gets advantage
    exactly 0 and std exactly 0, whatever eps; with ``drop_silent_groups`` its members have keep=False."""
    acc = _acc_dtype(rewards) if rewards.is_floating_point() else torch.float32
    r = rewards.to(acc).reshape(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    silent = r.amax(dim=1) == r.amin(dim=1)
    std = r.std(dim=1, unbiased=unbiased)
    std = torch.where(silent, torch.zeros_like(std), std)
    centred = r - mean
    if scale == "group":
        adv = centred / (std.unsqueeze(1) + eps)
    elif scale == "batch":
        adv = centred / (r.reshape(-1).std(unbiased=unbiased) + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"scale must be one of 'group', 'batch', 'none', got {scale!r}")
    adv = torch.where(silent.unsqueeze(1), torch.zeros_like(adv), adv)
    if drop_silent_groups:
        keep = (~silent).unsqueeze(1).expand_as(r)
    else:
        keep = torch.ones_like(r, dtype=torch.bool)
    return GroupAdvantages(advantages=adv.reshape(-1), std=std, keep=keep.reshape(-1))

