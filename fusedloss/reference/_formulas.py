"""The logits and the formulas every reference loss is built from: log-probs at the targets, entropy, KL, the
generalized JSD, and the reductions."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

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
