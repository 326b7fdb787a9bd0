"""Linear cross-entropy: torch.nn.functional.cross_entropy on the logits, plus the z-loss."""

from __future__ import annotations

from typing import Literal, Optional

import torch

from .. import _validation as v
from .implicit_logits import implicit_logits
from .options import HEAD, RUN, SHARDING, shared_arguments, shared_options
from .reductions import reduced_token_loss


@shared_options(*RUN, "grad_in_forward", *SHARDING)
@shared_arguments(*HEAD, "ignore_index", "backend", *RUN, "grad_in_forward", *SHARDING)
def cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                  bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                  reduction: Literal["mean", "sum", "none"] = "mean", label_smoothing: float = 0.0,
                  z_loss: float = 0.0, temperature: float = 1.0, logit_scale: float = 1.0,
                  softcap: Optional[float] = None, num_items_in_batch=None, backend: str = "auto",
                  **head) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy(hidden @ weight.T + bias, targets)`` plus a z-loss, without the
    logits. Per valid token::

        (1 - eps) * (lse - z_y) + eps * (lse - mean_v z_v) + z_loss * lse**2

    which is ``F.cross_entropy(z, y, label_smoothing=eps)`` (the smoothed target puts eps / V on every class)
    plus the z-loss, reduced over the valid tokens.

    Args:
        hidden: ``[..., D]`` hidden states (float32, bfloat16, float16 or float64); position i is scored
            against ``targets[i]`` (next-token SFT: ``hidden[:, :-1]`` with ``labels[:, 1:]``).
        weight: ``[V, D]`` lm_head weight, same dtype as ``hidden``.
        targets: integer ``[...]`` token ids in ``[0, V)`` or ignore_index.
        reduction: ``"mean"`` over valid tokens (0 when there are none), ``"sum"``, or ``"none"`` (per-token
            ``[...]`` losses).
        label_smoothing: eps in ``[0, 1]``, as ``F.cross_entropy``.
        z_loss: coefficient of ``lse**2`` per valid token (PaLM's auxiliary loss).
        num_items_in_batch: when given (> 0, int or one-element tensor), the loss is ``sum / num_items_in_batch``
            (gradient accumulation, as transformers' ``ForCausalLMLoss``).
        {shared}

    Returns:
        The loss, fp32 (float64 for float64 inputs): a scalar, or ``[...]`` with ``reduction="none"``.

    Example::

        loss = fusedloss.cross_entropy(hidden[:, :-1], model.lm_head.weight, labels[:, 1:], z_loss=1e-4)
    """
    v.require_choice("reduction", reduction, ("mean", "sum", "none"))
    v.require_real("label_smoothing", label_smoothing, nonnegative=True)
    if label_smoothing > 1:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    v.require_real("z_loss", z_loss, nonnegative=True)
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                             backend=backend, **head)
    tgt = logits.targets("targets", targets, ignore_index)
    valid = tgt >= 0
    wants = dict(targets=tgt, want_mean_logit=label_smoothing > 0)

    def per_token(stats, rows):
        loss = -stats.logp
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (stats.lse - stats.mean_logit)
        if z_loss > 0:
            loss = loss + z_loss * stats.lse.square()
        return torch.where(valid[rows], loss, torch.zeros_like(loss))

    return reduced_token_loss(logits, per_token, valid, reduction, num_items_in_batch, **wants)
