"""The token-level reference losses: log-probs, cross-entropy, distillation on a teacher's head or on its top-k
log-probs, and the top-k log-probs themselves."""

from __future__ import annotations

import math

import torch

from ..types import TopK
from ._formulas import _entropy, _gather, _generalized_jsd, _reduce, logits

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
# topk_logprobs


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
