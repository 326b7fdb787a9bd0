"""verl 0.9's KL estimators and loss aggregations (``verl/trainer/ppo/core_algos.py``: ``kl_penalty``,
``agg_loss``), for ``grpo_loss``'s ``kl_loss_type`` and ``loss_agg_mode``: a few operations on ``[B, C]``
tensors, written once for every backend (docs/design.md, "Losses as per-token math").

KL estimators of ``KL(pi || pi_ref)`` per token, with d = logp - ref (J. Schulman, "Approximating KL
divergence")::

    kl, k1            d
    abs               |d|
    mse, k2           d^2 / 2
    low_var_kl, k3    exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10]
    <name>+           the value of <name> with the gradient of k2 (straight through): k2 gives an unbiased
                      gradient of the KL, k1 and k3 unbiased values only

Aggregations, ``loss = sum_t w_t l_t`` over the mask m (``dp_size`` data-parallel ranks, each rank's loss
averaged by the data-parallel all-reduce)::

    token-mean               sum m l / batch_num_tokens * dp_size        (batch_num_tokens None: sum m)
    token-sum                sum m l * dp_size
    seq-mean-token-sum       sum_i (sum_t m l) / global_batch_size * dp_size
    seq-mean-token-mean      sum_i (sum_t m l / (sum_t m + 1e-8)) / global_batch_size * dp_size
    seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor     (None: C)

with ``global_batch_size`` None: the completions that have at least one token (fully masked ones count in
no mean). The local fallbacks (``batch_num_tokens`` / ``global_batch_size`` None) hold for ``dp_size`` 1 only:
``grpo_loss`` refuses them otherwise, as verl's ``agg_loss`` does. Where verl divides 0 by 0 (no token, no
completion) the loss is 0 here.
"""

from __future__ import annotations

from typing import Optional

import torch

from .implicit_logits import count_or_one, items_divisor

KL_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_LOSS_TYPES = KL_BASE + tuple(name + "+" for name in KL_BASE)
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_SEQ_MEAN_EPS = 1e-8  # verl's guard in seq-mean-token-mean's per-sequence mean


def kl_estimate(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (``kind`` in ``KL_LOSS_TYPES``), verl's ``kl_penalty``."""
    base = kind[:-1] if kind.endswith("+") else kind
    value = _kl_forward(logp, ref, base)
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    straight = 0.5 * (logp - ref).square()
    return straight - straight.detach() + value.detach()


def _kl_forward(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    if kind in ("kl", "k1"):
        return logp - ref
    if kind == "abs":
        return (logp - ref).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logp - ref).square()
    gap = torch.clamp(ref - logp, min=-20.0, max=20.0)  # low_var_kl, k3
    return torch.clamp(torch.exp(gap) - gap - 1, min=-10.0, max=10.0)


def aggregation_weights(m: torch.Tensor, mode: str, *, batch_num_tokens=None, dp_size: int = 1,
                        global_batch_size: Optional[int] = None,
                        loss_scale_factor: Optional[int] = None) -> torch.Tensor:
    """Weights ``w`` ``[B, C]`` with ``loss = sum_t w_t l_t`` for verl's ``loss_agg_mode`` ``mode``."""
    if mode == "token-mean":
        tokens = m.sum() if batch_num_tokens is None else items_divisor(batch_num_tokens, m)
        return m * (dp_size / count_or_one(tokens))
    if mode == "token-sum":
        return m * dp_size
    per_sequence = m.sum(-1, keepdim=True)
    present = (per_sequence > 0).to(m.dtype)  # fully masked completions count in no mean
    sequences = present.sum() if global_batch_size is None else items_divisor(global_batch_size, m)
    scale = dp_size / count_or_one(sequences)
    if mode == "seq-mean-token-mean":
        return m / (per_sequence + _SEQ_MEAN_EPS) * present * scale
    weights = m * present * scale
    if mode == "seq-mean-token-sum-norm":
        weights = weights / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return weights


# ------------------------------------------------------------------------------------------------
# verl's policy losses (``@register_policy_loss``) that TRL lacks, per token, before the aggregation. r is
# the ratio exp(clamp(logp - old, -20, 20)), A the advantage, sg stop-gradient, p = e^logp, p_old = e^old:
#
#   vanilla   PPO's clip with the dual clip (verl's default policy loss): u = max(-A r, -A clamp(r, 1 - eps_low,
#             1 + eps_high)), then min(-A c, u) where A < 0, u elsewhere (c > 1). The same as TRL's clipped
#             surrogate with delta = c, but for the clamp of the log-ratio to +-20 inside r (no gradient past it)
#   dppo_tv   -A sg(min(r, c)) logp [A > 0 ? p - p_old <= eps_high : p - p_old >= -eps_low]
#   dppo_kl   -A sg(min(r, c)) logp [A > 0 ? D <= eps_high or p <= p_old : D <= eps_low or p >= p_old],
#             D = p_old (old - logp) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8)) (binary KL)
#   dro       -(A logp - dro_beta / 2 (logp - old)^2)        (no clamp)
#   cispo, two-sided:  -sg(clamp(r, 1 - eps_low, 1 + eps_high)) A logp
#   clip_cov  max(-A r', -A clamp(r', 1 - eps_low, 1 + eps_high)) * (0 on a few tokens, else 1), r' = e^(logp - old):
#             among the tokens the clip leaves alone whose covariance (A - mean A)(logp - mean logp) lies in
#             (clip_cov_lb, clip_cov_ub), max(1, int(clip_cov_ratio * tokens)) drawn by torch.randperm (the
#             global generator, as verl: torch.manual_seed reproduces a draw)
#   kl_cov    -A r', plus ppo_kl_coef |logp - old| on the max(1, int(kl_cov_ratio * tokens)) tokens of largest
#             covariance
#   geo_mean  (GMPO) per completion, whatever loss_agg_mode: -mean_t(A) exp(mean_t(s min(s d, s clamp(d, -eps_low,
#             eps_high)))), d = logp - old, s = sign(A), token means over the mask with +1e-8; times the geometric
#             mean of the importance weights; then the plain mean over the B completions
#
# (DPPO's eps are divergence thresholds, c its truncation of the ratio: verl's clip_ratio_low/high, _c; vanilla's
# c is its dual-clip bound, verl's clip_ratio_c too.)
# ------------------------------------------------------------------------------------------------

COVARIANCE_LOSS_TYPES = ("clip_cov", "kl_cov")  # their token selection needs the whole batch
VERL_LOSS_TYPES = ("vanilla", "dppo_tv", "dppo_kl", "dro", "geo_mean") + COVARIANCE_LOSS_TYPES
_LOG_RATIO_CLAMP = 20.0
_DPPO_EPS = 1e-8  # verl's guard in the binary KL
_MASKED_MEAN_EPS = 1e-8  # verl's masked_mean: sum / (count + 1e-8)


def _clamped_ratio(logp: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(logp - old, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP))


def two_sided_cispo(logp, old, adv, epsilon_low: float, epsilon_high: float) -> torch.Tensor:
    """verl's cispo: the ratio clamped to [1 - epsilon_low, 1 + epsilon_high], stop-gradient, times A logp."""
    clipped = torch.clamp(_clamped_ratio(logp, old), 1 - epsilon_low, 1 + epsilon_high)
    return -clipped.detach() * adv * logp


def policy_term(kind: str, logp, old, adv, *, epsilon_low: float, epsilon_high: float, clip_ratio_c: float,
                dro_beta: Optional[float]) -> torch.Tensor:
    """Per-token loss of verl's ``kind`` (``VERL_LOSS_TYPES``)."""
    if kind == "dro":
        return -(logp * adv - 0.5 * dro_beta * (logp - old).square())
    if kind == "vanilla":  # verl's compute_policy_loss_vanilla, in its order
        ratio = _clamped_ratio(logp, old)
        surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high))
        return torch.where(adv < 0, torch.minimum(-adv * clip_ratio_c, surrogate), surrogate)
    truncated = torch.clamp(_clamped_ratio(logp, old), max=clip_ratio_c).detach()
    with torch.no_grad():
        prob, old_prob = torch.exp(logp), torch.exp(old)
        if kind == "dppo_tv":
            up = (prob - old_prob) <= epsilon_high
            down = (prob - old_prob) >= -epsilon_low
        else:
            binary_kl = old_prob * (old - logp) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + _DPPO_EPS) / (1.0 - prob + _DPPO_EPS))
            up = (binary_kl <= epsilon_high) | (prob <= old_prob)
            down = (binary_kl <= epsilon_low) | (prob >= old_prob)
        inside = torch.where(adv > 0, up, down).to(logp.dtype)
    return -adv * truncated * logp * inside


def covariance_term(kind: str, logp, old, adv, valid: torch.Tensor, *, epsilon_low: float, epsilon_high: float,
                    clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float, kl_cov_ratio: float,
                    ppo_kl_coef: float) -> torch.Tensor:
    """Per-token loss of verl's ``clip_cov`` or ``kl_cov`` over the whole ``[B, C]`` batch (``valid``: the
    mask); the token selection is detached and reads the batch's tokens in row-major order, as verl's."""
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    surrogate = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) if kind == "clip_cov" else None
    with torch.no_grad():
        lp = logp.detach()
        if kind == "kl_cov":
            flat_valid = valid.reshape(-1)
            adv_v, lp_v = adv.reshape(-1)[flat_valid], lp.reshape(-1)[flat_valid]
            chosen = torch.zeros_like(flat_valid)
            if adv_v.numel() > 0:
                covariance = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())
                count = max(1, int(covariance.numel() * kl_cov_ratio))
                top = torch.topk(covariance, count, largest=True).indices
                chosen[torch.nonzero(flat_valid, as_tuple=True)[0][top]] = True
            chosen = chosen.reshape(valid.shape)
        else:
            m = valid.to(lp.dtype)
            tokens = m.sum()

            def masked_mean(x):
                return (x * m).sum() / (tokens + _MASKED_MEAN_EPS)

            covariance = (adv - masked_mean(adv)) * (lp - masked_mean(lp))
            candidate = (valid & ~(clipped.detach() > surrogate.detach()) & (covariance < clip_cov_ub)
                         & (covariance > clip_cov_lb))
            where = torch.nonzero(candidate)
            draw = max(int(clip_cov_ratio * int(tokens.item())), 1)
            chosen = torch.zeros_like(valid)
            if len(where) > 0:
                pick = where[torch.randperm(len(where))[:min(draw, len(where))].to(where.device)]
                chosen[pick[:, 0], pick[:, 1]] = True
    if kind == "kl_cov":
        return torch.where(chosen, surrogate + ppo_kl_coef * log_ratio.abs(), surrogate)
    return torch.maximum(surrogate, clipped) * (~chosen).to(surrogate.dtype)


def geo_mean_policy(logp, old, adv, m, weights: Optional[torch.Tensor], *, epsilon_low: float,
                    epsilon_high: float) -> torch.Tensor:
    """verl's ``geo_mean`` (GMPO) policy loss, a scalar: the per-completion objective above, averaged over the
    completions (``m``: the mask; ``weights``: per-token importance weights or None)."""
    log_ratio = logp - old
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -epsilon_low, epsilon_high)
    pessimistic = sign * torch.min(sign * log_ratio, sign * clamped)
    tokens = m.sum(-1) + _MASKED_MEAN_EPS
    ratio = torch.exp((pessimistic * m).sum(-1) / tokens)
    losses = -(adv * m).sum(-1) / tokens * ratio
    if weights is not None:
        losses = losses * torch.exp((torch.log(weights + 1e-10) * m).sum(-1) / tokens)
    return losses.sum() / max(losses.shape[0], 1)  # no completion: 0
