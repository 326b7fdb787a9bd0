"""The clipped GRPO objective and its variants, as TRL's GRPOTrainer computes it (gradient accumulation 1).

Per token t of completion i, with r the importance ratio against the sampling policy::

    grpo, bnpo, dr_grpo, dapo : l = -min(r A, clamp(r, 1 - eps_low, 1 + eps_high) A)
                                (with delta set, r <- min(r, delta) in the first argument only)
    cispo                     : l = -sg(min(r, eps_high)) A logp
    importance weights        : l <- l * w
    KL penalty (beta != 0)    : l <- l + beta (exp(ref - logp) - (ref - logp) - 1)

then aggregated over the completion mask m as the loss type says (``_aggregate``).
"""

from __future__ import annotations

import torch

from .. import _validation as v
from ..types import GRPODetails
from ._head import count_or_one, items_divisor, lm_head

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def grpo_loss(hidden, weight, completion_ids, advantages, completion_mask, *, old_logprobs=None, ref_logprobs=None,
              bias=None, temperature=1.0, logit_scale=1.0, softcap=None, loss_type="dapo", epsilon_low=0.2,
              epsilon_high=None, delta=None, beta=0.0, importance_sampling_level="token", max_completion_length=None,
              num_items_in_batch=None, num_processes=1, importance_weights=None, return_details=False,
              backend="auto"):
    v.require_choice("loss_type", loss_type, LOSS_TYPES)
    v.require_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    v.require_real("epsilon_low", epsilon_low, nonnegative=True)
    v.require_real("epsilon_high", epsilon_high, nonnegative=True, allow_none=True)
    v.require_real("delta", delta, positive=True, allow_none=True)
    v.require_real("beta", beta)
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    if max_completion_length is not None and (isinstance(max_completion_length, bool) or
                                              not isinstance(max_completion_length, int) or
                                              max_completion_length < 1):
        raise ValueError(f"max_completion_length must be a positive int or None, got {max_completion_length!r}")
    head = lm_head(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                   backend=backend)
    if len(head.lead_shape) != 2:
        raise ValueError(f"hidden must be [B, C, D] (row t predicts completion_ids[:, t]), got shape "
                         f"{tuple(hidden.shape)}")
    b, c = head.lead_shape
    ids = head.targets("completion_ids", completion_ids, ignore_index=-100)
    mask = v.require_mask("completion_mask", completion_mask, (b, c))
    v.require_tensor("advantages", advantages, floating=None)
    if tuple(advantages.shape) not in ((b,), (b, c)):
        raise ValueError(f"advantages must have shape ({b},) or ({b}, {c}), got {tuple(advantages.shape)}")
    if beta != 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs is required when beta != 0 (beta={beta!r}): the KL penalty needs the "
                         "reference model's per-token log-probs")
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if t is not None:
            v.require_tensor(name, t, floating=True)
            v.require_shape(name, t, (b, c))
    if importance_weights is not None:
        v.require_tensor("importance_weights", importance_weights, floating=True)
        if tuple(importance_weights.shape) not in ((b,), (b, 1), (b, c)):
            raise ValueError(f"importance_weights must have shape ({b},), ({b}, 1) or ({b}, {c}), "
                             f"got {tuple(importance_weights.shape)}")
    v.require_same_device(hidden=hidden, completion_ids=completion_ids, advantages=advantages,
                          completion_mask=completion_mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                          importance_weights=importance_weights)

    stats = head.statistics(targets=ids, want_entropy=bool(return_details))
    logp = head.unflatten(stats.logp)
    acc = logp.dtype
    m = mask.to(acc)
    adv = advantages.to(acc)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    eps_high = epsilon_low if epsilon_high is None else epsilon_high

    old = logp.detach() if old_logprobs is None else old_logprobs.to(acc)
    log_ratio = logp - old
    if importance_sampling_level == "sequence":  # GSPO: one ratio per completion
        log_ratio = ((log_ratio * m).sum(-1) / count_or_one(m.sum(-1))).unsqueeze(-1)
    ratio = torch.exp(log_ratio)

    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=eps_high).detach() * adv * logp
        clip_ratio = ratio
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high)
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)
        per_token = -torch.min(ratio * adv, clipped * adv)
        clip_ratio = ratio  # TRL measures clipping on the (delta-capped) first argument
    if importance_weights is not None:
        w = importance_weights.to(acc)
        per_token = per_token * (w.unsqueeze(1) if w.dim() == 1 else w)
    kl = None
    if beta != 0:
        ref_gap = ref_logprobs.to(acc) - logp
        kl = torch.exp(ref_gap) - ref_gap - 1
        per_token = per_token + beta * kl

    loss = _aggregate(per_token * m, m, loss_type, b, c, max_completion_length, num_items_in_batch, num_processes)
    if not return_details:
        return loss

    def masked_mean(x):
        if x.shape[1] == 1:  # sequence level: already one value per completion (TRL's convention)
            return x.sum() / count_or_one(torch.tensor(float(x.shape[0]), dtype=acc, device=x.device))
        return (x * m).sum() / count_or_one(m.sum())

    low = (clip_ratio < 1 - epsilon_low) & (adv < 0)
    high = (clip_ratio > 1 + eps_high) & (adv > 0)
    with torch.no_grad():
        details = GRPODetails(
            logprobs=logp,
            entropy=head.unflatten(stats.entropy).detach(),
            kl=None if kl is None else masked_mean(kl.detach()),
            clip_ratio_low=masked_mean(low.to(acc)),
            clip_ratio_high=masked_mean(high.to(acc)),
            clip_ratio_region=masked_mean((low | high).to(acc)),
        )
    return loss, details


def _aggregate(masked_loss, m, loss_type, b, c, max_completion_length, num_items_in_batch, num_processes):
    if loss_type == "grpo":
        return (masked_loss.sum(-1) / count_or_one(m.sum(-1))).mean()
    if loss_type == "bnpo":
        return masked_loss.sum() / count_or_one(m.sum())
    if loss_type == "dr_grpo":
        return masked_loss.sum() / (b * (c if max_completion_length is None else max_completion_length))
    # dapo, cispo: normalised by the number of completion tokens of the whole (global) batch
    items = m.sum() if num_items_in_batch is None else items_divisor(num_items_in_batch, masked_loss)
    return masked_loss.sum() / (count_or_one(items) / num_processes)
