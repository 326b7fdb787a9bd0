"""The executable specification: every public loss of fusedloss, written the obvious way.

Each function here has the name and the arguments (minus ``backend``) of its public counterpart, and
computes the same thing on *materialised* logits with plain PyTorch: ``logits = hidden @ weight.T + bias``,
then logit_scale, soft-cap and temperature (SPEC section 2), then ``torch.log_softmax``. Nothing is tiled,
fused or clever, so that it can be read against SPEC section 5 line by line. Every backend is tested
against it.

Precision. In float64 this is the ground truth. For fp32/bf16/fp16 inputs it is the *naive same-dtype
path* of a plain trainer: the product ``hidden @ weight.T + bias`` is computed in the input dtype (so half
inputs give logits rounded to half), then upcast to fp32 for the transform and the softmax. The fused
path's error is judged against the error of this path (SPEC section 6). Per-token outputs and losses are
fp32 (float64 for float64 inputs); gradients reach ``hidden``, ``weight`` and ``bias`` through autograd.

Ignored positions (``ignore_index`` targets, ``completion_mask == 0``) give 0 per-token outputs and no
gradient; they are selected with ``torch.where`` rather than multiplied by a mask, so that an inf or NaN
computed at an ignored position can never leak into the result. A mean over zero valid tokens is 0.
Validation is deliberately light: the public API validates, the reference only computes.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .types import DPODetails, GroupAdvantages, GRPODetails

__all__ = [
    "logits",
    "token_logprobs",
    "cross_entropy",
    "distillation_loss",
    "grpo_loss",
    "dpo_loss",
    "group_advantages",
]

Number = Union[int, float, torch.Tensor]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None) -> torch.Tensor:
    """``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature`` (SPEC section 2).

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
                   ignore_index=-100, return_entropy=False):
    """log p(targets) per token (0 at ignored positions); with ``return_entropy`` also the entropy
    ``-sum_v p log p`` of the full distribution (0 at ignored positions)."""
    z = logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    logq = torch.log_softmax(z, dim=-1)
    valid = targets != ignore_index
    logp = _gather(logq, targets, valid)
    if not return_entropy:
        return logp
    ent = _entropy(logq)
    return logp, torch.where(valid, ent, torch.zeros_like(ent))


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


def distillation_loss(hidden, weight, teacher_hidden, teacher_weight, targets=None, *, beta=1.0,
                      temperature=1.0, hard_weight=0.0, soft_weight=1.0, t_squared=False, bias=None,
                      teacher_bias=None, ignore_index=-100, reduction="batchmean", num_items_in_batch=None):
    """TRL's ``generalized_jsd_loss`` between the student q = softmax(z_s / T) and the frozen teacher
    p = softmax(z_t / T), plus ``hard_weight`` times the cross-entropy of the student at T = 1.

    beta == 0: KL(p || q); beta == 1: KL(q || p); else beta KL(p || m) + (1 - beta) KL(q || m) with
    m = (1 - beta) q + beta p."""
    z_s = logits(hidden, weight, bias)
    with torch.no_grad():
        z_t = logits(teacher_hidden, teacher_weight, teacher_bias).to(z_s.dtype)
    logq = torch.log_softmax(z_s / temperature, dim=-1)
    logp = torch.log_softmax(z_t / temperature, dim=-1)
    if beta == 0:
        soft = _kl(logp, logq)
    elif beta == 1:
        soft = _kl(logq, logp)
    else:
        logm = _log_mixture(logq, logp, beta)
        soft = beta * _kl(logp, logm) + (1.0 - beta) * _kl(logq, logm)
    per_token = soft_weight * soft * (temperature ** 2 if t_squared else 1.0)
    if targets is None:
        valid = torch.ones(per_token.shape, dtype=torch.bool, device=per_token.device)
    else:
        valid = targets != ignore_index
        if hard_weight:
            ce = -_gather(torch.log_softmax(z_s, dim=-1), targets, valid)
            per_token = per_token + hard_weight * ce
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    return _reduce(per_token, valid, reduction, num_items_in_batch, "batchmean")


# --------------------------------------------------------------------------------------------------
# grpo_loss


def grpo_loss(hidden, weight, completion_ids, advantages, completion_mask, *, old_logprobs=None,
              ref_logprobs=None, bias=None, temperature=1.0, logit_scale=1.0, softcap=None, loss_type="dapo",
              epsilon_low=0.2, epsilon_high=None, delta=None, beta=0.0, importance_sampling_level="token",
              max_completion_length=None, num_items_in_batch=None, num_processes=1, importance_weights=None,
              return_details=False):
    """TRL GRPOTrainer's loss (gradient accumulation 1), SPEC section 5, written as TRL writes it."""
    if epsilon_high is None:
        epsilon_high = epsilon_low
    mask = completion_mask != 0
    ids = torch.where(mask, completion_ids, torch.full_like(completion_ids, -100))
    logp, entropy = token_logprobs(hidden, weight, ids, bias=bias, temperature=temperature,
                                   logit_scale=logit_scale, softcap=softcap, ignore_index=-100,
                                   return_entropy=True)
    acc = logp.dtype
    zero = torch.zeros_like(logp)
    B, C = logp.shape
    mask_f = completion_mask.to(acc)  # TRL multiplies by the mask: a fractional mask weights tokens
    n_seq = mask_f.sum(-1)
    n_tok = mask_f.sum()

    # Per-token advantages and weights outside the mask are never read: with a per-sequence (GSPO) ratio, a
    # NaN there would reach the shared ratio through the gradient of a discarded torch.where branch.
    A_given = advantages.to(acc).reshape(B, -1)  # the clip metrics read it as TRL does
    A = torch.where(mask, A_given, zero) if A_given.shape[1] == C else A_given
    old = logp.detach() if old_logprobs is None else old_logprobs.to(acc)

    log_ratio = torch.where(mask, logp - old, zero)
    if importance_sampling_level == "token":
        log_w = log_ratio
    elif importance_sampling_level == "sequence":
        log_w = ((log_ratio * mask_f).sum(-1) / n_seq.clamp(min=1.0)).unsqueeze(-1)  # GSPO, [B, 1]
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    r = torch.exp(log_w)

    if loss_type == "cispo":
        per_token = -torch.clamp(r, max=epsilon_high).detach() * A * logp
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        r_clipped = torch.clamp(r, 1.0 - epsilon_low, 1.0 + epsilon_high)
        if delta is not None:  # after the clamp is formed: the first argument only (TRL reassigns coef_1)
            r = torch.clamp(r, max=delta)
        per_token = -torch.minimum(r * A, r_clipped * A)
    else:
        raise ValueError(f"loss_type must be one of grpo, bnpo, dr_grpo, dapo, cispo, got {loss_type!r}")
    per_token = per_token.expand(B, C)

    if importance_weights is not None:
        w = importance_weights.to(acc)
        if w.dim() == 1:
            w = w.unsqueeze(1)
        elif w.shape[1] == C:
            w = torch.where(mask, w, zero)
        per_token = per_token * w
    kl = None
    if beta != 0.0:
        ref = ref_logprobs.to(acc)
        d = torch.where(mask, ref - logp, zero)
        per_token_kl = torch.exp(d) - d - 1.0
        per_token = per_token + beta * per_token_kl
        kl = (torch.where(mask, per_token_kl, zero) * mask_f).sum().detach() / n_tok.clamp(min=1.0)
    per_token = torch.where(mask, per_token, zero) * mask_f

    if loss_type == "grpo":
        loss = (per_token.sum(-1) / n_seq.clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = per_token.sum() / n_tok.clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (B * (C if max_completion_length is None else max_completion_length))
    else:  # dapo, cispo
        items = n_tok if num_items_in_batch is None else _as_float(num_items_in_batch)
        loss = per_token.sum() / (max(1.0, _as_float(items)) / num_processes)
    if not return_details:
        return loss

    def masked_batch_mean(x: torch.Tensor) -> torch.Tensor:
        x = x.to(acc)
        if x.shape[1] == 1:  # sequence-level ratio: TRL takes a plain mean
            return x.mean()
        return (torch.where(mask, x, torch.zeros_like(x)) * mask_f).sum() / n_tok.clamp(min=1.0)

    r_d = r.detach()  # TRL measures clipping on coef_1, i.e. after the delta cap
    if loss_type == "cispo":
        # TRL tracks only the upper clip for CISPO (its cispo_clip_ratio).
        high = (r_d > epsilon_high) & (A_given > 0)
        low = torch.zeros_like(high)
    else:
        low = (r_d < 1.0 - epsilon_low) & (A_given < 0)
        high = (r_d > 1.0 + epsilon_high) & (A_given > 0)
    details = GRPODetails(
        logprobs=logp,
        entropy=entropy.detach(),
        kl=kl,
        clip_ratio_low=masked_batch_mean(low),
        clip_ratio_high=masked_batch_mean(high),
        clip_ratio_region=masked_batch_mean(low | high),
    )
    return loss, details


# --------------------------------------------------------------------------------------------------
# dpo_loss


def dpo_loss(hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, *, beta=0.1, loss_type="sigmoid",
             label_smoothing=0.0, bias=None, temperature=1.0, logit_scale=1.0, softcap=None, ignore_index=-100,
             return_details=False):
    """DPO on TRL's concatenated batch: rows 0..B-1 chosen, rows B..2B-1 rejected. Sequence log-prob =
    sum of token log-probs over non-ignored labels; u = logp - ref; Delta = u_chosen - u_rejected."""
    logp_tok = token_logprobs(hidden, weight, labels, bias=bias, temperature=temperature,
                              logit_scale=logit_scale, softcap=softcap, ignore_index=ignore_index)
    acc = logp_tok.dtype
    seq = logp_tok.reshape(logp_tok.shape[0], -1).sum(-1)
    n = (labels != ignore_index).reshape(labels.shape[0], -1).sum(-1).to(acc)
    B = seq.shape[0] // 2
    chosen, rejected = seq[:B], seq[B:]
    u_c = chosen - ref_chosen_logps.to(acc)
    u_r = rejected - ref_rejected_logps.to(acc)
    delta = u_c - u_r
    e = label_smoothing
    logsig = torch.nn.functional.logsigmoid
    if loss_type == "sigmoid":
        losses = -(1.0 - e) * logsig(beta * delta) - e * logsig(-beta * delta)
    elif loss_type == "ipo":
        losses = (u_c / n[:B].clamp(min=1.0) - u_r / n[B:].clamp(min=1.0) - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * delta)
    elif loss_type == "robust":
        losses = (-(1.0 - e) * logsig(beta * delta) + e * logsig(-beta * delta)) / (1.0 - 2.0 * e)
    else:
        raise ValueError(f"loss_type must be one of sigmoid, ipo, hinge, robust, got {loss_type!r}")
    loss = losses.mean()
    if not return_details:
        return loss
    return loss, DPODetails(
        chosen_logps=chosen,
        rejected_logps=rejected,
        chosen_rewards=(beta * u_c).detach(),
        rejected_rewards=(beta * u_r).detach(),
    )


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
