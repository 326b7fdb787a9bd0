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
no mean). Where verl divides 0 by 0 (no token, no completion) the loss is 0 here.
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
