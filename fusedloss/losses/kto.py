"""Kahneman-Tversky Optimization, as TRL 1.16's ``KTOTrainer._compute_loss`` computes it (reference
log-probs passed in, as with ``precompute_ref_log_probs``).

Unpaired batch: rows are independent completions, each desirable or not (``preference_labels``, TRL's
``label`` column). Per row, with sequence log-prob logp = sum_t lp_t and u = logp - ref::

    kto                desirable: w_d (1 - sig(b (u - z0)))     undesirable: w_u (1 - sig(b (z0 - u)))
    apo_zero_unpaired  desirable: w_d (1 - sig(b u))            undesirable: w_u sig(b u)

and the loss is the mean over rows. z0 is the KL reference point, detached: TRL estimates it from
mismatched (prompt, completion) pairs, ``max(0, mean(logp_KL - ref_KL))`` with the policy's log-probs
taken without gradient (``kl_hidden``/``kl_labels``/``ref_kl_logps`` here), or ``kl`` passes it directly
(after a cross-process mean, as TRL gathers it). Everything after the statistics pass is a few operations
on ``[B]`` vectors, written once in Python for every backend (docs/design.md, "Losses as per-token math").
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch

from .. import _validation as v
from ..types import KTODetails
from . import sequences
from .implicit_logits import implicit_logits
from .options import RUN, SHARDING, shared_arguments, shared_options

LOSS_TYPES = ("kto", "apo_zero_unpaired")


@shared_options(*RUN, *SHARDING)
@shared_arguments("backend", *RUN, *SHARDING)
def kto_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, preference_labels: torch.Tensor,
             ref_logps: torch.Tensor, *, kl_hidden: Optional[torch.Tensor] = None,
             kl_labels: Optional[torch.Tensor] = None, ref_kl_logps: Optional[torch.Tensor] = None,
             kl=None, beta: float = 0.1, loss_type: Literal["kto", "apo_zero_unpaired"] = "kto",
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0, bias: Optional[torch.Tensor] = None,
             temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None,
             ignore_index: int = -100, return_details: bool = False,
             backend: str = "auto", **head) -> Union[torch.Tensor, tuple[torch.Tensor, KTODetails]]:
    """TRL 1.16 KTOTrainer's loss from the hidden states (option names and defaults are KTOConfig's).

    Args:
        hidden: ``[B, T, D]``, one completion per row; position t predicts ``labels[:, t]``.
        weight: ``[V, D]`` lm_head weight. bias: ``[V]`` or None.
        labels: ``[B, T]`` token ids, ``ignore_index`` outside the completion.
        preference_labels: ``[B]`` bool (or 0/1): True for a desirable completion (TRL's ``label``).
        ref_logps: ``[B]`` reference sequence log-probs.
        kl_hidden, kl_labels, ref_kl_logps: the mismatched pairs of TRL's KL estimate: ``[B', T', D]`` policy
            hidden states, their ``[B', T']`` labels and ``[B']`` reference log-probs (no gradient flows).
        kl: the reference point z0 itself (a number or 0-d tensor, used as given) instead of the pairs.
            ``loss_type="kto"`` needs one of the two (``kl=0.0`` for none).
        beta: the KTO temperature. loss_type: ``"kto"`` or ``"apo_zero_unpaired"`` (no z0).
        desirable_weight, undesirable_weight: weights of the two kinds of rows.
        temperature, logit_scale, softcap: the logits ``softcap(logit_scale * (h @ W.T + b)) / temperature``.
        ignore_index: the label of tokens that are not scored.
        return_details: also return a ``KTODetails``.
        {shared}

    Returns:
        The scalar loss, or ``(loss, KTODetails)``: sequence log-probs (differentiable), rewards ``beta * u``
        and the z0 used (detached).
    """
    v.require_choice("loss_type", loss_type, LOSS_TYPES)
    v.require_real("beta", beta, positive=True)
    v.require_real("desirable_weight", desirable_weight)
    v.require_real("undesirable_weight", undesirable_weight)
    pairs_given = [t is not None for t in (kl_hidden, kl_labels, ref_kl_logps)]
    if kl is not None and any(pairs_given):
        raise ValueError("pass either kl or the mismatched pairs (kl_hidden, kl_labels, ref_kl_logps), not both")
    if any(pairs_given) and not all(pairs_given):
        given = ", ".join(n for n, g in zip(("kl_hidden", "kl_labels", "ref_kl_logps"), pairs_given) if g)
        raise ValueError(f"kl_hidden, kl_labels and ref_kl_logps go together (TRL's mismatched pairs); got {given}")
    if loss_type == "kto" and kl is None and not any(pairs_given):
        raise ValueError("loss_type='kto' needs the KL reference point: pass kl_hidden, kl_labels and ref_kl_logps "
                         "(TRL's mismatched pairs), or kl (kl=0.0 for none)")
    if isinstance(kl, torch.Tensor):
        _require_kl_tensor(kl, used=loss_type == "kto")
    elif kl is not None:
        v.require_real("kl", kl)
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale,
                             softcap=softcap, backend=backend, **head)
    rows = sequences.require_rows(logits, paired=False)
    desirable = v.require_mask("preference_labels", preference_labels, (rows,)) != 0
    sequences.require_refs(rows, hidden, per="row", ref_logps=ref_logps)
    v.require_same_device(hidden=hidden, preference_labels=preference_labels)
    logps = sequences.token_logps(logits, labels, ignore_index).sums()
    acc = logps.dtype
    z0 = torch.zeros((), dtype=acc, device=logps.device)
    if loss_type == "kto":
        z0 = _reference_point(kl, kl_hidden, kl_labels, ref_kl_logps, weight, bias, acc, ignore_index,
                              dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap, backend=backend,
                                   **head))
    u = logps - ref_logps.to(acc)
    if loss_type == "kto":
        gain, loss_ = 1 - torch.sigmoid(beta * (u - z0)), 1 - torch.sigmoid(beta * (z0 - u))
    else:
        gain, loss_ = 1 - torch.sigmoid(beta * u), torch.sigmoid(beta * u)
    per_row = torch.where(desirable, desirable_weight * gain, undesirable_weight * loss_)
    loss = sequences.mean_or_zero(per_row)
    if not return_details:
        return loss
    return loss, KTODetails(logps=logps, rewards=(beta * u).detach(), kl=z0.detach())


def _require_kl_tensor(kl: torch.Tensor, *, used: bool) -> None:
    """``kl`` given as a tensor: one real value; finite where the loss uses it (``loss_type="kto"``)."""
    if kl.is_complex() or kl.dtype == torch.bool:
        raise TypeError(f"kl must be a real (floating-point or integer) tensor, got {kl.dtype}")
    if kl.numel() != 1:
        raise ValueError(f"kl must be a number or a 0-d tensor, got a tensor of shape {tuple(kl.shape)}")
    if used:  # without a host synchronisation on a GPU (_validation.refuse_values)
        v.refuse_values(~torch.isfinite(kl).all(), lambda: f"kl must be finite, got {kl.item()!r}",
                        "kl must be finite")


def _reference_point(kl, kl_hidden, kl_labels, ref_kl_logps, weight, bias, acc, ignore_index, head) -> torch.Tensor:
    """z0: ``kl`` as given, or TRL's ``max(0, mean(logp_KL - ref_KL))`` from the mismatched pairs, without
    gradient (TRL computes the policy's KL log-probs under no_grad)."""
    if kl is not None:
        return torch.as_tensor(kl, dtype=acc, device=weight.device).detach().reshape(())
    with torch.no_grad():
        logits = implicit_logits(kl_hidden, weight, bias, hidden_name="kl_hidden", **head)
        rows = sequences.require_rows(logits, paired=False)
        sequences.require_refs(rows, kl_hidden, per="row of kl_hidden", ref_kl_logps=ref_kl_logps)
        kl_logps = sequences.token_logps(logits, kl_labels, ignore_index).sums().to(acc)
        if rows == 0:
            return torch.zeros((), dtype=acc, device=kl_logps.device)
        return (kl_logps - ref_kl_logps.to(acc)).mean().clamp(min=0)
