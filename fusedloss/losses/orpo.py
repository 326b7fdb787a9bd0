"""Odds Ratio Preference Optimization, as TRL 1.16's experimental ``ORPOTrainer`` and Liger's
``LigerFusedLinearORPOLoss`` compute it.

Paired batch (``sequences.py``: chosen rows, then rejected). Per pair, with the mean token log-probs
l_c, l_r of the two completions::

    log odds = (l_c - l_r) - (log(1 - e^l_c) - log(1 - e^l_r))
    loss     = NLL(chosen) - beta * mean over pairs of log sigmoid(log odds)

NLL(chosen) is the cross-entropy of the chosen rows, averaged over their scored tokens; TRL scores the
prompt there too (``nll_labels``, Liger's ``nll_target``), and the completion only in the odds.
``log(1 - e^l)`` is TRL's ``log1mexp`` (branching at -log 2). A pair with an empty completion has no odds
(its mean log-prob 0 would give log(1 - e^0) = -inf and a NaN loss in TRL): it is left out of the mean over
pairs, which is 0 when no pair is left. After the one statistics pass, a few
operations on ``[B]`` vectors, written once in Python for every backend (docs/design.md, "Losses as
per-token math").
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

from .. import _validation as v
from ..types import ORPODetails
from . import sequences
from .implicit_logits import count_or_one, implicit_logits
from .options import RUN, SHARDING, shared_arguments, shared_options


@shared_options(*RUN, *SHARDING)
@shared_arguments("backend", *RUN, *SHARDING)
def orpo_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, beta: float = 0.1,
              nll_labels: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
              temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None,
              ignore_index: int = -100, return_details: bool = False,
              backend: str = "auto", **head) -> Union[torch.Tensor, tuple[torch.Tensor, ORPODetails]]:
    """ORPO's loss from the hidden states (option names and defaults are TRL's ORPOConfig's).

    Args:
        hidden: ``[2B, T, D]``: rows ``0..B-1`` chosen, ``B..2B-1`` rejected; position t predicts ``labels[:, t]``.
        weight: ``[V, D]`` lm_head weight. bias: ``[V]`` or None.
        labels: ``[2B, T]`` token ids, ``ignore_index`` outside the completions (the odds-ratio term).
        beta: weight of the odds-ratio term (TRL's lambda).
        nll_labels: ``[2B, T]`` labels of the NLL term (only the chosen rows are read); TRL labels prompt and
            completion there. They must agree with ``labels`` where both score a token. None: ``labels``.
        temperature, logit_scale, softcap: the logits ``softcap(logit_scale * (h @ W.T + b)) / temperature``.
        ignore_index: the label of tokens that are not scored.
        return_details: also return an ``ORPODetails``.
        {shared}

    Returns:
        The scalar loss, or ``(loss, ORPODetails)`` with TRL's logged quantities.
    """
    v.require_real("beta", beta)
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale,
                             softcap=softcap, backend=backend, **head)
    pairs = sequences.require_rows(logits, paired=True)
    tokens = sequences.token_logps(logits, labels, ignore_index, extra_labels=nll_labels)
    mean_logps = tokens.means()
    chosen, rejected = mean_logps[:pairs], mean_logps[pairs:]
    nll_tokens = tokens if tokens.extra is None else tokens.extra
    nll = sequences.chosen_nll(nll_tokens.logp, nll_tokens.valid)
    counts = tokens.counts
    scored = (counts[:pairs] > 0) & (counts[pairs:] > 0)

    # a stand-in where a completion is empty, so that no -inf reaches the gradient
    c, r = (torch.where(scored, x, torch.full_like(x, -1.0)) for x in (chosen, rejected))
    log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
    log_odds = torch.where(scored, log_odds, torch.zeros_like(log_odds))
    ratio = torch.where(scored, F.logsigmoid(log_odds), torch.zeros_like(log_odds))

    def mean(x):  # over the scored pairs; 0 when there are none
        return x.sum() / count_or_one(scored.sum().to(x.dtype))

    loss = nll - beta * mean(ratio)
    if not return_details:
        return loss
    return loss, ORPODetails(chosen_logps=chosen, rejected_logps=rejected, chosen_rewards=(beta * chosen).detach(),
                             rejected_rewards=(beta * rejected).detach(), log_odds_ratio=mean(ratio).detach(),
                             log_odds_chosen=mean(log_odds).detach(), nll_loss=nll.detach())


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x <= 0: log1p(-e^x) below -log 2, log(-expm1(x)) above, where each keeps its digits."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
