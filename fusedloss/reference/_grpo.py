"""The reference GRPO family (TRL's loss types and verl's policy losses, KL estimators and aggregations) and
GRPO's group advantages."""

from __future__ import annotations

import math

import torch

from ..types import GroupAdvantages, GRPODetails
from ._formulas import _acc_dtype, _as_float
from ._token import token_logprobs

# --------------------------------------------------------------------------------------------------
# grpo_loss


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
