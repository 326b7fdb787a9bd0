"""Linear cross-entropy: torch.nn.functional.cross_entropy on the logits, plus the z-loss."""

from __future__ import annotations

import torch

from .. import _validation as v
from .implicit_logits import implicit_logits
from .reductions import reduced_token_loss


def cross_entropy(hidden, weight, targets, *, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  z_loss=0.0, temperature=1.0, logit_scale=1.0, softcap=None, num_items_in_batch=None,
                  backend="auto", process_group=None, reduce_hidden_grad=True, vocab_start=None, vocab_size=None,
                  fsdp_vocab_parallel=False):
    """Per valid token::

        (1 - eps) * (lse - z_y) + eps * (lse - mean_v z_v) + z_loss * lse**2

    which is F.cross_entropy(z, y, label_smoothing=eps) (the smoothed target puts eps / V on every class)
    plus the z-loss. Reduced by ``reduction`` over valid tokens; with ``num_items_in_batch``, sum / that."""
    v.require_choice("reduction", reduction, ("mean", "sum", "none"))
    v.require_real("label_smoothing", label_smoothing, nonnegative=True)
    if label_smoothing > 1:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    v.require_real("z_loss", z_loss, nonnegative=True)
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                   backend=backend, process_group=process_group, reduce_hidden_grad=reduce_hidden_grad,
                   vocab_start=vocab_start, vocab_size=vocab_size, fsdp_vocab_parallel=fsdp_vocab_parallel)
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
