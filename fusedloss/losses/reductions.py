"""Reductions of per-token losses shared by the losses (PyTorch's ``reduction`` names)."""

from __future__ import annotations

import torch

from .. import _validation as v
from ._head import count_or_one, items_divisor


def reduce_tokens(per_token: torch.Tensor, valid: torch.Tensor, reduction: str, num_items_in_batch,
                  mean_name: str = "mean") -> torch.Tensor:
    """``per_token`` is already 0 on invalid tokens. ``mean_name`` is "mean" (cross-entropy) or
    "batchmean" (distillation): sum / max(1, valid tokens). With ``num_items_in_batch`` a reduced loss is
    sum / num_items_in_batch (gradient accumulation across micro-batches, as transformers passes it)."""
    v.require_choice("reduction", reduction, (mean_name, "sum", "none"))
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if num_items_in_batch is not None:
        return total / count_or_one(items_divisor(num_items_in_batch, total))
    if reduction == "sum":
        return total
    return total / count_or_one(valid.sum()).to(total.dtype)
