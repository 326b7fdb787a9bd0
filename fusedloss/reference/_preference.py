"""The reference preference losses (DPO, KTO, ORPO, CPO / SimPO): chosen rows 0..B-1, rejected rows B..2B-1
(TRL's concatenation)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..types import CPODetails, DPODetails, KTODetails, ORPODetails
from ._formulas import _gather, logits
from ._token import token_logprobs


def _sequence_logps(hidden, weight, labels, bias, temperature, logit_scale, softcap, ignore_index):
    """Per-token log-probs ``[rows, T]`` (0 at ignored labels) and the mask of scored tokens."""
    per_token = token_logprobs(hidden, weight, labels, bias=bias, temperature=temperature,
                               logit_scale=logit_scale, softcap=softcap, ignore_index=ignore_index)
    per_token = per_token.reshape(per_token.shape[0], -1)
    return per_token, (labels != ignore_index).reshape(labels.shape[0], -1)


def _chosen_nll(per_token, valid):
    """TRL's CrossEntropyLoss over the chosen half: mean over its scored tokens (0 when there are none)."""
    half = per_token.shape[0] // 2
    return -per_token[:half].sum() / max(1, int(valid[:half].sum()))


def _log1mexp(x):
    """log(1 - exp(x)) for x <= 0, branching at -log 2 to avoid cancellation (TRL's ORPO helper)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


# dpo_loss


def dpo_loss(hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, *, beta=0.1, loss_type="sigmoid",
             loss_weights=None, label_smoothing=0.0, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5,
             ld_alpha=None, discopop_tau=0.05, use_weighting=False, bias=None, temperature=1.0, logit_scale=1.0,
             softcap=None, ignore_index=-100, return_details=False):
    """TRL 1.16 ``DPOTrainer._compute_loss`` with precomputed reference log-probs, written in TRL's order;
    ``sigmoid`` keeps the conservative-DPO ``label_smoothing`` (cDPO; TRL 1.16's sigmoid ignores it)."""
    z = logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    logq = torch.log_softmax(z, dim=-1)
    valid_tok = labels != ignore_index
    per_token_logps = _gather(logq, labels, valid_tok).reshape(labels.shape[0], -1)
    mask = valid_tok.reshape(labels.shape[0], -1)
    acc = per_token_logps.dtype
    B = per_token_logps.shape[0] // 2
    if ld_alpha is None:
        logps = per_token_logps.sum(-1)
    else:  # LD-DPO: the tokens past the shorter completion of the pair count ld_alpha
        comp_pos = mask.long().cumsum(-1)
        lens = mask.sum(-1)
        shared = torch.minimum(lens[:B], lens[B:]).repeat(2).unsqueeze(1)
        shared_mask = (comp_pos > 0) & (comp_pos <= shared)
        tail_mask = comp_pos > shared
        logps = (per_token_logps * shared_mask).sum(-1) + ld_alpha * (per_token_logps * tail_mask).sum(-1)
    chosen_logps, rejected_logps = logps[:B], logps[B:]
    ref_c, ref_r = ref_chosen_logps.to(acc), ref_rejected_logps.to(acc)
    chosen_logratios, rejected_logratios = chosen_logps - ref_c, rejected_logps - ref_r

    if f_divergence_type == "reverse_kl":
        chosen_scores, rejected_scores = chosen_logratios, rejected_logratios
    elif f_divergence_type == "forward_kl":
        chosen_scores, rejected_scores = 1 - torch.exp(-chosen_logratios), 1 - torch.exp(-rejected_logratios)
    elif f_divergence_type == "js_divergence":
        chosen_scores = math.log(2) + F.logsigmoid(chosen_logratios)
        rejected_scores = math.log(2) + F.logsigmoid(rejected_logratios)
    elif f_divergence_type == "alpha_divergence":
        if abs(f_alpha_divergence_coef - 1.0) < 1e-6:
            chosen_scores, rejected_scores = chosen_logratios, rejected_logratios
        else:
            a = f_alpha_divergence_coef - 1.0
            chosen_scores = (torch.exp(torch.clamp(a * chosen_logratios, max=80.0)) - 1.0) / a
            rejected_scores = (torch.exp(torch.clamp(a * rejected_logratios, max=80.0)) - 1.0) / a
    else:
        raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}")
    delta_score = chosen_scores - rejected_scores
    n = mask.sum(-1).to(acc).clamp(min=1.0)
    e = label_smoothing
    logsig = F.logsigmoid

    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    loss_weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    loss = torch.zeros((), dtype=acc)
    for lt, lw in zip(loss_types, loss_weights):
        if lt == "sigmoid" and e == 0:  # TRL's form: 0, not 0 * -inf, at an infinite margin
            losses = -logsig(beta * delta_score)
        elif lt == "sigmoid":
            losses = -(1 - e) * logsig(beta * delta_score) - e * logsig(-beta * delta_score)
        elif lt == "hinge":
            losses = torch.relu(1 - beta * delta_score)
        elif lt == "ipo":
            losses = (chosen_scores / n[:B] - rejected_scores / n[B:] - 1 / (2 * beta)) ** 2
        elif lt == "exo_pair":
            eps = torch.tensor(e, dtype=acc)
            losses = (torch.sigmoid(beta * delta_score) * (logsig(beta * delta_score) - torch.log1p(-eps))
                      + torch.sigmoid(-beta * delta_score) * (logsig(-beta * delta_score) - torch.log(eps)))
        elif lt == "nca_pair":
            rc, rr = beta * chosen_logratios, beta * rejected_logratios
            losses = -logsig(rc) - 0.5 * logsig(-rc) - 0.5 * logsig(-rr)
        elif lt == "robust":
            losses = (-(1 - e) * logsig(beta * delta_score) + e * logsig(-beta * delta_score)) / (1 - 2 * e)
        elif lt == "bco_pair":
            losses = -logsig(beta * chosen_logratios) - logsig(-beta * rejected_logratios)
        elif lt == "sppo_hard":
            losses = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif lt == "aot":
            d = torch.sort(chosen_logps - rejected_logps)[0] - torch.sort(ref_c - ref_r)[0]
            losses = -(1 - e) * logsig(beta * d) - e * logsig(-beta * d)
        elif lt == "aot_unpaired":
            d = torch.sort(chosen_logratios)[0] - torch.sort(rejected_logratios)[0]
            losses = -(1 - e) * logsig(beta * d) - e * logsig(-beta * d)
        elif lt == "apo_zero":
            losses = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
        elif lt == "apo_down":
            losses = torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(beta * (chosen_logratios
                                                                                         - rejected_logratios))
        elif lt == "discopop":
            x = beta * delta_score
            mod = torch.sigmoid(x / discopop_tau)
            losses = -logsig(x) * (1 - mod) + torch.exp(-x) * mod
        elif lt == "sft":
            losses = (-per_token_logps[:B].sum() / max(1, int(mask[:B].sum()))).expand(B)
        elif lt == "sigmoid_norm":
            losses = -logsig(beta * (chosen_scores / n[:B] - rejected_scores / n[B:]))
        else:
            raise ValueError(f"unknown DPO loss_type {lt!r}")
        if use_weighting:  # WPO: the pair's length-normalised probabilities, aligned to the policy's own
            with torch.no_grad():
                log_sum_sq = torch.logsumexp(2 * logq, dim=-1).reshape(mask.shape)
                aligned = torch.where(mask, per_token_logps - log_sum_sq, torch.zeros_like(log_sum_sq))
                weights = torch.exp(aligned.sum(-1) / mask.sum(-1).clamp(min=1))
            losses = losses * weights[:B] * weights[B:]
        loss = loss + (losses.mean() if B else losses.sum()) * lw
    if not return_details:
        return loss
    return loss, DPODetails(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                            chosen_rewards=(beta * chosen_logratios).detach(),
                            rejected_rewards=(beta * rejected_logratios).detach())


# kto_loss


def kto_loss(hidden, weight, labels, preference_labels, ref_logps, *, kl_hidden=None, kl_labels=None,
             ref_kl_logps=None, kl=None, beta=0.1, loss_type="kto", desirable_weight=1.0, undesirable_weight=1.0,
             bias=None, temperature=1.0, logit_scale=1.0, softcap=None, ignore_index=-100, return_details=False):
    """TRL 1.16 ``KTOTrainer._compute_loss`` with precomputed reference log-probs, one process."""
    kw = dict(bias=bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap, ignore_index=ignore_index)
    logps = _sequence_logps(hidden, weight, labels, **kw)[0].sum(-1)
    acc = logps.dtype
    if loss_type == "apo_zero_unpaired":
        z0 = torch.zeros((), dtype=acc)
    elif kl is not None:
        z0 = torch.as_tensor(kl, dtype=acc).reshape(()).detach()
    else:
        with torch.no_grad():  # the KL term is estimated from mismatched pairs without gradient
            kl_logps = _sequence_logps(kl_hidden, weight, kl_labels, **kw)[0].sum(-1)
            z0 = (kl_logps - ref_kl_logps.to(acc)).mean().clamp(min=0)
    desirable = preference_labels.bool()
    logratios = logps - ref_logps.to(acc)
    if loss_type == "kto":
        chosen = 1 - torch.sigmoid(beta * (logratios - z0))
        rejected = 1 - torch.sigmoid(beta * (z0 - logratios))
    elif loss_type == "apo_zero_unpaired":
        chosen = 1 - torch.sigmoid(beta * logratios)
        rejected = torch.sigmoid(beta * logratios)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}")
    losses = torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)
    loss = losses.mean() if losses.numel() else losses.sum()
    if not return_details:
        return loss
    return loss, KTODetails(logps=logps, rewards=(beta * logratios).detach(), kl=z0.detach())


# orpo_loss


def orpo_loss(hidden, weight, labels, *, beta=0.1, nll_labels=None, bias=None, temperature=1.0, logit_scale=1.0,
              softcap=None, ignore_index=-100, return_details=False):
    """TRL 1.16 experimental ``ORPOTrainer.get_batch_loss_metrics``: NLL of the chosen completions minus
    beta times the mean log-sigmoid of the log odds ratio of the mean token log-probs."""
    kw = dict(bias=bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap, ignore_index=ignore_index)
    per_token, valid = _sequence_logps(hidden, weight, labels, **kw)
    avg = per_token.sum(-1) / valid.sum(-1).clamp(min=1)
    B = avg.shape[0] // 2
    chosen, rejected = avg[:B], avg[B:]
    nll = _chosen_nll(*(_sequence_logps(hidden, weight, nll_labels, **kw) if nll_labels is not None
                        else (per_token, valid)))
    # A pair with an empty completion has no odds (log(1 - e^0) = -inf): left out of the mean, 0 if none left.
    scored = (valid[:B].sum(-1) > 0) & (valid[B:].sum(-1) > 0)
    c, r = (torch.where(scored, x, torch.full_like(x, -1.0)) for x in (chosen, rejected))
    log_odds = torch.where(scored, (c - r) - (_log1mexp(c) - _log1mexp(r)), torch.zeros_like(c))
    ratio = torch.where(scored, F.logsigmoid(log_odds), torch.zeros_like(c))

    def mean(x):
        return x.sum() / scored.sum().clamp(min=1)

    loss = nll - beta * mean(ratio)
    if not return_details:
        return loss

    return loss, ORPODetails(chosen_logps=chosen, rejected_logps=rejected, chosen_rewards=(beta * chosen).detach(),
                             rejected_rewards=(beta * rejected).detach(), log_odds_ratio=mean(ratio).detach(),
                             log_odds_chosen=mean(log_odds).detach(), nll_loss=nll.detach())


# cpo_loss


def cpo_loss(hidden, weight, labels, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, cpo_alpha=1.0,
             simpo_gamma=0.5, alpha=0.0, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
             ignore_index=-100, return_details=False):
    """TRL 1.16 experimental ``CPOTrainer.get_batch_loss_metrics`` (SimPO is ``loss_type="simpo"``; AlphaPO
    is ``alpha != 0``)."""
    kw = dict(bias=bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap, ignore_index=ignore_index)
    per_token, valid = _sequence_logps(hidden, weight, labels, **kw)
    logps = per_token.sum(-1)
    if loss_type in ("ipo", "simpo"):
        logps = logps / valid.sum(-1).clamp(min=1)
    B = logps.shape[0] // 2
    chosen, rejected = logps[:B], logps[B:]
    if alpha != 0.0:
        chosen_r = (1 - torch.exp(chosen).pow(-alpha)) / alpha
        rejected_r = (1 - torch.exp(rejected).pow(-alpha)) / alpha
    else:
        chosen_r, rejected_r = chosen, rejected
    x = chosen_r - rejected_r
    e = label_smoothing
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            x = x - simpo_gamma / beta
        losses = -F.logsigmoid(beta * x) * (1 - e) - F.logsigmoid(-beta * x) * e
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * x)
    elif loss_type == "ipo":
        losses = (x - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown CPO loss_type {loss_type!r}")
    nll = _chosen_nll(per_token, valid) if cpo_alpha != 0 else torch.zeros((), dtype=logps.dtype)
    loss = (losses.mean() if B else losses.sum()) + cpo_alpha * nll
    if not return_details:
        return loss
    return loss, CPODetails(chosen_logps=chosen, rejected_logps=rejected, chosen_rewards=(beta * chosen_r).detach(),
                            rejected_rewards=(beta * rejected_r).detach(), nll_loss=nll.detach())
