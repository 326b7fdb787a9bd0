"""Reductions of per-token losses (PyTorch's ``reduction`` names), shared by cross-entropy and distillation."""

from __future__ import annotations

import torch

from .implicit_logits import ImplicitLogits, count_or_one, items_divisor


def reduced_token_loss(logits: ImplicitLogits, per_token, valid: torch.Tensor, reduction: str, num_items_in_batch, *,
                       mean_name: str = "mean", row_local: bool = True, **wants) -> torch.Tensor:
    """Reduce ``per_token(stats, rows) -> [rows]`` (0 on invalid tokens) over the statistics asked by ``wants``.

    ``mean_name`` ("mean" or "batchmean"): sum / max(1, valid tokens); "sum"; "none": the per-token tensor
    with the leading shape of hidden. With ``num_items_in_batch`` a reduced loss is sum / num_items_in_batch
    (gradient accumulation over micro-batches, as transformers passes it and divides by it); it must be > 0.
    A reduced loss is a weighted sum of per-row terms, so it may take the grad-in-forward 3-product path unless
    ``row_local`` is False (a per-token term that also depends on another statistics pass)."""
    if reduction == "none":  # reduction was checked by the caller, before any work
        return logits.unflatten(per_token(logits.statistics(**wants), slice(None)))
    scale = _scale(valid, reduction, num_items_in_batch, mean_name)

    scales = {}  # the scale in the loss's dtype, converted once per call, not once per grad-in-forward row chunk

    def row_loss(stats, rows):
        total = per_token(stats, rows).sum()
        if scale is None:
            return total
        if total.dtype not in scales:
            scales[total.dtype] = scale.to(total.dtype)
        return total * scales[total.dtype]

    if row_local:
        return logits.row_local_loss(row_loss, **wants)
    return row_loss(logits.statistics(**wants), slice(None))


def _scale(valid: torch.Tensor, reduction: str, num_items_in_batch, mean_name: str):
    """The factor a reduced loss multiplies the sum by (float64 scalar tensor), or None for "sum"."""
    if num_items_in_batch is not None:
        return 1.0 / items_divisor(num_items_in_batch, valid.new_zeros((), dtype=torch.float64), positive=True)
    if reduction == mean_name:
        return 1.0 / count_or_one(valid.sum()).double()
    return None


def reduce_per_token(per_token: torch.Tensor, valid: torch.Tensor, reduction: str, num_items_in_batch, *,
                     mean_name: str = "mean", unflatten=None) -> torch.Tensor:
    """``reduced_token_loss`` for a per-token loss ``[N]`` already formed (0 on invalid tokens); "none" gives
    it back through ``unflatten`` (the leading shape of hidden)."""
    if reduction == "none":
        return per_token if unflatten is None else unflatten(per_token)
    total = per_token.sum()
    scale = _scale(valid, reduction, num_items_in_batch, mean_name)
    return total if scale is None else total * scale.to(total.dtype)
