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
from .implicit_logits import count_or_one, items_divisor, implicit_logits

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
_NO_IGNORE_INDEX = -(2**63)  # completion ids have no ignore value: the mask says which tokens count
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def grpo_loss(hidden, weight, completion_ids, advantages, completion_mask, *, old_logprobs=None, ref_logprobs=None,
              bias=None, temperature=1.0, logit_scale=1.0, softcap=None, loss_type="dapo", epsilon_low=0.2,
              epsilon_high=None, delta=None, beta=0.0, importance_sampling_level="token", max_completion_length=None,
              num_items_in_batch=None, num_processes=1, importance_weights=None, return_details=False,
              backend="auto", process_group=None, reduce_hidden_grad=True, vocab_start=None, vocab_size=None,
              fsdp_vocab_parallel=False):
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
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                   backend=backend, process_group=process_group, reduce_hidden_grad=reduce_hidden_grad,
                   vocab_start=vocab_start, vocab_size=vocab_size, fsdp_vocab_parallel=fsdp_vocab_parallel)
    if len(logits.lead_shape) != 2:
        raise ValueError(f"hidden must be [B, C, D] (row t predicts completion_ids[:, t]), got shape "
                         f"{tuple(hidden.shape)}")
    b, c = logits.lead_shape
    v.require_tensor("completion_ids", completion_ids, floating=False)
    v.require_shape("completion_ids", completion_ids, (b, c), "the leading dimensions of hidden")
    mask = v.require_mask("completion_mask", completion_mask, (b, c))
    v.require_same_device(hidden=hidden, completion_ids=completion_ids, completion_mask=completion_mask)
    # Ids outside the mask (padding) are never read; every id inside it must be a real token.
    valid = mask != 0
    ids = logits.targets("completion_ids", torch.where(valid, completion_ids, torch.zeros_like(completion_ids)),
                       ignore_index=_NO_IGNORE_INDEX)
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

    # Tokens outside the completion mask are ignored rows of the core: no work, logprobs 0, no gradient.
    # Every per-token term is masked (not only the sum), so garbage there (an old log-prob of -inf on a
    # padded position) cannot turn the loss into NaN.
    ids = torch.where(valid.reshape(-1), ids, torch.full_like(ids, -1))
    acc = torch.float64 if logits.hidden.dtype == torch.float64 else torch.float32
    m = mask.to(acc)  # TRL multiplies by the mask, so a fractional mask weights its tokens
    adv = advantages.to(acc)
    adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).expand(b, c)
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    weights = None
    if importance_weights is not None:
        weights = importance_weights.to(acc)
        weights = (weights.unsqueeze(1) if weights.dim() == 1 else weights).expand(b, c)
    ref = None if ref_logprobs is None else ref_logprobs.to(acc)
    old = None if old_logprobs is None else old_logprobs.to(acc)
    # The loss is sum_t token_weight_t * l_t, the aggregation of the loss type written as weights.
    token_weight = _token_weights(m, loss_type, b, c, max_completion_length, num_items_in_batch, num_processes)

    def picker(rows):
        """Per-token inputs restricted to ``rows`` of the flat batch (rows None: the [B, C] batch as it is)."""
        if rows is None:
            return lambda t: t
        return lambda t: None if t is None else t.reshape(-1)[rows]

    def terms(logp, log_ratio, rows):
        pick = picker(rows)
        return token_terms(logp, log_ratio, pick(adv), pick(valid), ref_logprobs=pick(ref), weights=pick(weights),
                           loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=eps_high, delta=delta,
                           beta=beta)

    def token_log_ratio(logp, rows):
        old_rows = logp.detach() if old is None else old.reshape(-1)[rows]
        return torch.where(valid.reshape(-1)[rows], logp - old_rows, torch.zeros_like(logp))

    # The per-token math is a few elementwise operations on [B, C] vectors: negligible beside the GEMM-sized
    # products (docs/design.md, "Losses as per-token math"), so it is written once, here, for every backend.
    def flat_token_terms(logp, rows):
        return terms(logp, token_log_ratio(logp, rows), rows)

    if importance_sampling_level == "token" and not return_details:
        # A row-local loss: eligible for the eager 3-product path.
        def row_loss(stats, rows):
            return (token_weight.reshape(-1)[rows] * flat_token_terms(stats.logp, rows)[0]).sum()

        return logits.row_local_loss(row_loss, targets=ids)

    stats = logits.statistics(targets=ids, want_entropy=bool(return_details))
    logp = logits.unflatten(stats.logp)
    if importance_sampling_level == "token":
        per_token, kl, ratio = (None if t is None else logits.unflatten(t)
                                for t in flat_token_terms(stats.logp, slice(None)))
    else:  # GSPO: one ratio per completion
        log_ratio = token_log_ratio(stats.logp, slice(None)).reshape(b, c)
        log_ratio = ((log_ratio * m).sum(-1) / count_or_one(m.sum(-1))).unsqueeze(-1)
        per_token, kl, ratio = terms(logp, log_ratio, None)
    loss = (token_weight * per_token).sum()
    if not return_details:
        return loss

    def masked_mean(x):
        return (x * m).sum() / count_or_one(m.sum())

    def clip_mean(x):
        if x.shape[1] == 1:  # one value per completion (a GSPO ratio): TRL takes a plain mean
            return x.sum() / count_or_one(torch.tensor(float(x.shape[0]), dtype=acc, device=x.device))
        return masked_mean(x)

    # Shapes broadcast as in TRL: [B, 1] only for a sequence-level ratio with per-completion advantages.
    sign = advantages.to(acc).reshape(b, -1)
    if loss_type == "cispo":  # TRL tracks only the upper clip of CISPO (its cispo_clip_ratio)
        high = (ratio > eps_high) & (sign > 0)
        low = torch.zeros_like(high)
    else:
        low = (ratio < 1 - epsilon_low) & (sign < 0)
        high = (ratio > 1 + eps_high) & (sign > 0)
    with torch.no_grad():
        details = GRPODetails(
            logprobs=logp,
            entropy=logits.unflatten(stats.entropy).detach(),
            kl=None if kl is None else masked_mean(kl.detach()),
            clip_ratio_low=clip_mean(low.to(acc)),
            clip_ratio_high=clip_mean(high.to(acc)),
            clip_ratio_region=clip_mean((low | high).to(acc)),
        )
    return loss, details


def token_terms(logp, log_ratio, advantages, valid, *, ref_logprobs=None, weights=None, loss_type, epsilon_low,
                epsilon_high, delta, beta):
    """The per-token math of SPEC section 5 (shapes broadcast): returns the per-token loss (0 where not
    ``valid``), the KL penalty term (None when beta == 0) and the ratio the clip metrics read (capped by
    delta, as TRL's coef_1). ``log_ratio`` is log r (per token, or per sequence for GSPO), already 0
    outside ``valid``."""
    zero = torch.zeros_like(logp)
    ratio = torch.exp(log_ratio)
    if loss_type == "cispo":
        loss = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logp
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            ratio = torch.clamp(ratio, max=delta)  # first argument only; TRL's clip metrics read it too
        loss = -torch.min(ratio * advantages, clipped * advantages)
    if weights is not None:
        loss = loss * weights
    kl = None
    if beta != 0:
        ref_gap = torch.where(valid, ref_logprobs - logp, zero)
        kl = torch.exp(ref_gap) - ref_gap - 1
        loss = loss + beta * kl
    return torch.where(valid, loss, zero), kl, ratio


def _token_weights(m, loss_type, b, c, max_completion_length, num_items_in_batch, num_processes):
    """Weights w with loss = sum_t w_t l_t for each aggregation (m: the completion mask)::

        grpo     mean_i( sum_t m l / max(1, sum_t m) )
        bnpo     sum m l / max(1, sum m)
        dr_grpo  sum m l / (B * max_completion_length)
        dapo, cispo  sum m l / (max(1, num_items_in_batch) / num_processes)
    """
    if loss_type == "grpo":
        return m / (b * count_or_one(m.sum(-1, keepdim=True)))
    if loss_type == "bnpo":
        return m / count_or_one(m.sum())
    if loss_type == "dr_grpo":
        return m / (b * (c if max_completion_length is None else max_completion_length))
    items = m.sum() if num_items_in_batch is None else items_divisor(num_items_in_batch, m)
    return m * (num_processes / count_or_one(items))
