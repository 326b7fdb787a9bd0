"""Contrastive Preference Optimization and SimPO, as TRL 1.16's experimental ``CPOTrainer`` computes them
(Liger: ``LigerFusedLinearCPOLoss``, ``LigerFusedLinearSimPOLoss``).

Paired batch (``sequences.py``: chosen rows, then rejected). Per pair, with sequence log-probs l (summed
over the completion for sigmoid and hinge, averaged for ipo and simpo), rewards r = l, or with AlphaPO
(``alpha != 0``) r = (1 - e^(-alpha l)) / alpha, x = r_c - r_r, e = label_smoothing::

    sigmoid  -(1 - e) log sig(b x) - e log sig(-b x)
    simpo    the same on x - simpo_gamma / b                    (SimPO; TRL's AlphaPO is simpo with alpha)
    hinge    relu(1 - b x)
    ipo      (x - 1 / (2 b))^2

loss = mean over pairs + cpo_alpha * NLL(chosen), the chosen rows' cross-entropy averaged over their
scored tokens (the behaviour-cloning term; SimPO proper is ``cpo_alpha=0``). After the one statistics
pass, a few operations on ``[B]`` vectors, written once in Python for every backend (docs/design.md,
"Losses as per-token math").
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch

from .. import _validation as v
from ..types import CPODetails
from . import sequences
from .implicit_logits import implicit_logits
from .options import RUN, SHARDING, shared_arguments, shared_options

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


@shared_options(*RUN, *SHARDING)
@shared_arguments("backend", *RUN, *SHARDING)
def cpo_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, beta: float = 0.1,
             loss_type: Literal["sigmoid", "hinge", "ipo", "simpo"] = "sigmoid", label_smoothing: float = 0.0,
             cpo_alpha: float = 1.0, simpo_gamma: float = 0.5, alpha: float = 0.0, bias: Optional[torch.Tensor] = None,
             temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None,
             ignore_index: int = -100, return_details: bool = False,
             backend: str = "auto", **head) -> Union[torch.Tensor, tuple[torch.Tensor, CPODetails]]:
    """CPO's loss from the hidden states (option names and defaults are TRL's CPOConfig's).

    Args:
        hidden: ``[2B, T, D]``: rows ``0..B-1`` chosen, ``B..2B-1`` rejected; position t predicts ``labels[:, t]``.
        weight: ``[V, D]`` lm_head weight. bias: ``[V]`` or None.
        labels: ``[2B, T]`` token ids, ``ignore_index`` outside the completions.
        beta: the preference temperature (IPO's tau).
        loss_type: ``"sigmoid"``, ``"hinge"``, ``"ipo"`` or ``"simpo"`` (each one's formula:
            ``help(fusedloss.losses.cpo)``).
        label_smoothing: the sigmoid/simpo smoothing e. cpo_alpha: weight of the chosen NLL term.
        simpo_gamma: SimPO's target margin. alpha: AlphaPO's reward shape (0: log-prob rewards).
        temperature, logit_scale, softcap: the logits ``softcap(logit_scale * (h @ W.T + b)) / temperature``.
        ignore_index: the label of tokens that are not scored.
        return_details: also return a ``CPODetails``.
        {shared}

    Returns:
        The scalar loss, or ``(loss, CPODetails)`` with TRL's logged quantities.
    """
    v.require_choice("loss_type", loss_type, LOSS_TYPES)
    v.require_real("beta", beta, positive=True)
    v.require_real("label_smoothing", label_smoothing, nonnegative=True, below=1.0)
    for name, value in (("cpo_alpha", cpo_alpha), ("simpo_gamma", simpo_gamma), ("alpha", alpha)):
        v.require_real(name, value)
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale,
                             softcap=softcap, backend=backend, **head)
    pairs = sequences.require_rows(logits, paired=True)
    tokens = sequences.token_logps(logits, labels, ignore_index)
    logps = tokens.means() if loss_type in ("ipo", "simpo") else tokens.sums()
    chosen, rejected = logps[:pairs], logps[pairs:]
    reward_c, reward_r = _reward(chosen, alpha), _reward(rejected, alpha)
    x = reward_c - reward_r
    e = label_smoothing
    if loss_type == "simpo":
        x = x - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        per_pair = sequences.smoothed_sigmoid_loss(x, beta, e)
    elif loss_type == "hinge":
        per_pair = torch.relu(1 - beta * x)
    else:
        per_pair = (x - 1 / (2 * beta)) ** 2
    nll = sequences.chosen_nll(tokens.logp, tokens.valid) if cpo_alpha != 0 else torch.zeros_like(logps.sum())
    loss = sequences.mean_or_zero(per_pair) + cpo_alpha * nll
    if not return_details:
        return loss
    return loss, CPODetails(chosen_logps=chosen, rejected_logps=rejected, chosen_rewards=(beta * reward_c).detach(),
                            rejected_rewards=(beta * reward_r).detach(), nll_loss=nll.detach())


def _reward(logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """AlphaPO's r = (1 - p^-alpha) / alpha with p = e^logps, written as -expm1(-alpha logps) / alpha (the
    same number without forming p); the log-prob itself when alpha == 0."""
    if alpha == 0:
        return logps
    return -torch.expm1(-alpha * logps) / alpha
