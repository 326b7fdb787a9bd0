"""Direct Preference Optimization on TRL's concatenated batch (rows 0..B-1 chosen, B..2B-1 rejected).

    logp = sum_t m_t lp_t ;  u = logp - ref ;  Delta = u_chosen - u_rejected   (e = label_smoothing)
    sigmoid : -(1 - e) log sigmoid(beta Delta) - e log sigmoid(-beta Delta)
    ipo     : (u_c / n_c - u_r / n_r - 1 / (2 beta))**2          (n = completion tokens)
    hinge   : relu(1 - beta Delta)
    robust  : (-(1 - e) log sigmoid(beta Delta) + e log sigmoid(-beta Delta)) / (1 - 2 e)

The loss is the mean over pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _validation as v
from ..types import DPODetails
from .implicit_logits import count_or_one, implicit_logits

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def dpo_loss(hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, *, beta=0.1, loss_type="sigmoid",
             label_smoothing=0.0, bias=None, temperature=1.0, logit_scale=1.0, softcap=None, ignore_index=-100,
             return_details=False, backend="auto", process_group=None, reduce_hidden_grad=True, vocab_start=None,
             vocab_size=None, fsdp_vocab_parallel=False):
    v.require_choice("loss_type", loss_type, LOSS_TYPES)
    v.require_real("beta", beta, positive=True)
    v.require_real("label_smoothing", label_smoothing, nonnegative=True, below=0.5 if loss_type == "robust" else 1.0)
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                   backend=backend, process_group=process_group, reduce_hidden_grad=reduce_hidden_grad,
                   vocab_start=vocab_start, vocab_size=vocab_size, fsdp_vocab_parallel=fsdp_vocab_parallel)
    if len(logits.lead_shape) != 2 or logits.lead_shape[0] % 2:
        raise ValueError("hidden must be [2B, T, D], chosen rows then rejected rows, with an even first dimension; "
                         f"got shape {tuple(hidden.shape)}")
    two_b, t = logits.lead_shape
    pairs = two_b // 2
    tgt = logits.targets("labels", labels, ignore_index)
    for name, ref in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
        v.require_tensor(name, ref, floating=True)
        v.require_shape(name, ref, (pairs,), "one value per pair")
    v.require_same_device(hidden=hidden, labels=labels, ref_chosen_logps=ref_chosen_logps,
                          ref_rejected_logps=ref_rejected_logps)

    stats = logits.statistics(targets=tgt)
    seq_logps = logits.unflatten(stats.logp).sum(-1)  # ignored tokens contribute 0
    acc = seq_logps.dtype
    chosen_logps, rejected_logps = seq_logps[:pairs], seq_logps[pairs:]
    u_chosen = chosen_logps - ref_chosen_logps.to(acc)
    u_rejected = rejected_logps - ref_rejected_logps.to(acc)
    n = count_or_one(logits.unflatten(tgt >= 0).sum(-1).to(acc))  # completion tokens, for ipo
    losses = pair_losses(u_chosen, u_rejected, n[:pairs], n[pairs:], loss_type=loss_type, beta=beta,
                         label_smoothing=label_smoothing)
    loss = losses.mean() if pairs else losses.sum()
    if not return_details:
        return loss
    return loss, DPODetails(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                            chosen_rewards=(beta * u_chosen).detach(), rejected_rewards=(beta * u_rejected).detach())


def pair_losses(u_chosen, u_rejected, n_chosen, n_rejected, *, loss_type, beta, label_smoothing):
    """Per-pair losses from the log-ratio gains u = logp - ref and the completion token counts n (>= 1)."""
    delta = u_chosen - u_rejected
    e = label_smoothing
    if loss_type == "sigmoid":
        return -(1 - e) * F.logsigmoid(beta * delta) - e * F.logsigmoid(-beta * delta)
    if loss_type == "robust":
        return (-(1 - e) * F.logsigmoid(beta * delta) + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    return (u_chosen / n_chosen - u_rejected / n_rejected - 1 / (2 * beta)) ** 2  # ipo: length-normalised
