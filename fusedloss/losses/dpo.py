"""Direct Preference Optimization and its 15 variants, as TRL 1.16's ``DPOTrainer._compute_loss`` computes
them (reference log-probs passed in, as with ``precompute_ref_log_probs``).

Batch: TRL's concatenation, rows ``0..B-1`` the chosen completions and ``B..2B-1`` the rejected ones
(``sequences.py``). Per pair, with sequence log-probs logp = sum_t lp_t (LD-DPO: tokens past the shorter
completion of the pair weigh ``ld_alpha``), log-ratios u = logp - ref, f-divergence scores s = f'(u)
(reverse_kl: s = u; forward_kl: 1 - e^-u; js_divergence: log 2 + log sigmoid(u); alpha_divergence:
(e^((a-1) u) - 1) / (a - 1), exponent capped at 80), Delta = s_c - s_r, n = completion tokens,
e = label_smoothing::

    sigmoid      -(1 - e) log sig(b Delta) - e log sig(-b Delta)   (cDPO; TRL 1.16 has no e here: e = 0 is TRL 1.16)
    hinge        relu(1 - b Delta)
    ipo          (s_c / n_c - s_r / n_r - 1 / (2 b))^2
    exo_pair     sig(b Delta) (log sig(b Delta) - log(1 - e)) + sig(-b Delta) (log sig(-b Delta) - log e)
    nca_pair     -log sig(b u_c) - log sig(-b u_c) / 2 - log sig(-b u_r) / 2
    robust       (-(1 - e) log sig(b Delta) + e log sig(-b Delta)) / (1 - 2 e)
    bco_pair     -log sig(b u_c) - log sig(-b u_r)
    sppo_hard    (u_c - 1 / (2 b))^2 + (u_r + 1 / (2 b))^2
    aot          sigmoid form on sort(logp_c - logp_r) - sort(ref_c - ref_r)   (batch-sorted)
    aot_unpaired sigmoid form on sort(u_c) - sort(u_r)
    apo_zero     1 - sig(b u_c) + sig(b u_r)
    apo_down     sig(b u_c) + 1 - sig(b (u_c - u_r))
    discopop     -log sig(x) (1 - sig(x / tau)) + e^-x sig(x / tau),   x = b Delta
    sft          -mean of the chosen completions' token log-probs (one value for the batch)
    sigmoid_norm -log sig(b (s_c / n_c - s_r / n_r))

loss = sum_k loss_weights[k] * mean over pairs of loss_type[k] (MPO), each pair's loss times the WPO
weight exp(mean_t (lp_t - log sum_v q_v^2))_c * (...)_r when ``use_weighting``. Every formula follows TRL
1.16 except ``sigmoid`` with ``label_smoothing > 0``, which keeps the conservative DPO (cDPO) form this
library has always had (TRL 1.16's sigmoid ignores label_smoothing).

A pair's loss is not a sum of per-token terms, so DPO takes the composable statistics op (4 products).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .. import _validation as v
from ..types import DPODetails
from . import sequences
from .implicit_logits import count_or_one, implicit_logits
from .options import RUN, SHARDING, shared_arguments, shared_options

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# The f-DPO reparameterisation only cancels log Z in a chosen-minus-rejected difference (TRL's list).
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
_ALPHA_EXP_MAX = 80.0  # TRL caps (a - 1) u at 80 before exp in fp32 (11 in fp16; losses here run in fp32/fp64)

LossType = Literal["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                   "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]


@shared_options(*RUN, *SHARDING)
@shared_arguments("backend", *RUN, *SHARDING)
def dpo_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, *, beta: float = 0.1,
             loss_type: Union[LossType, Sequence[LossType]] = "sigmoid",
             loss_weights: Optional[Sequence[float]] = None, label_smoothing: float = 0.0,
             f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5,
             ld_alpha: Optional[float] = None, discopop_tau: float = 0.05, use_weighting: bool = False,
             bias: Optional[torch.Tensor] = None, temperature: float = 1.0, logit_scale: float = 1.0,
             softcap: Optional[float] = None, ignore_index: int = -100, return_details: bool = False,
             backend: str = "auto", **head) -> Union[torch.Tensor, tuple[torch.Tensor, DPODetails]]:
    """TRL 1.16 DPOTrainer's loss from the hidden states (option names and defaults are DPOConfig's).

    Args:
        hidden: ``[2B, T, D]``: rows ``0..B-1`` chosen completions, ``B..2B-1`` rejected; position t
            predicts ``labels[:, t]``.
        weight: ``[V, D]`` lm_head weight. bias: ``[V]`` or None.
        labels: ``[2B, T]`` token ids, ``ignore_index`` outside the completions.
        ref_chosen_logps, ref_rejected_logps: ``[B]`` reference sequence log-probs (LD-DPO weighted like the
            policy's when ``ld_alpha`` is set, as TRL's ``compute_ref_log_probs`` does).
        beta: the DPO temperature (IPO's tau).
        loss_type: sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired,
            apo_zero, apo_down, discopop, sft or sigmoid_norm, or a list of them (MPO); each one's formula:
            ``help(fusedloss.losses.dpo)``.
        loss_weights: one weight per loss type of a list (default 1.0 each); None for a single loss type.
        label_smoothing: robust's flip probability (< 0.5), exo_pair's epsilon (> 0), aot's smoothing, and
            sigmoid's cDPO smoothing.
        f_divergence_type, f_alpha_divergence_coef: the f-DPO divergence (only for ``F_DIVERGENCE_LOSS_TYPES``).
        ld_alpha: LD-DPO weight in [0, 1] of the tokens past the shorter completion of a pair (None: off).
        discopop_tau: DiscoPOP's temperature. use_weighting: WPO pair weights.
        temperature, logit_scale, softcap: the logits ``softcap(logit_scale * (h @ W.T + b)) / temperature``.
        ignore_index: the label of tokens that are not scored.
        return_details: also return a ``DPODetails``.
        {shared}

    Returns:
        The scalar loss (fp32; float64 for float64 inputs), or ``(loss, DPODetails)``: chosen/rejected sequence
        log-probs (differentiable) and rewards ``beta * u`` (detached).
    """
    loss_types, weights = _loss_types(loss_type, loss_weights)
    _check_options(loss_types, beta=beta, label_smoothing=label_smoothing, f_divergence_type=f_divergence_type,
                   f_alpha_divergence_coef=f_alpha_divergence_coef, ld_alpha=ld_alpha, discopop_tau=discopop_tau,
                   use_weighting=use_weighting)
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale,
                             softcap=softcap, backend=backend, **head)
    pairs = sequences.require_rows(logits, paired=True)
    sequences.require_refs(pairs, hidden, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    tokens = sequences.token_logps(logits, labels, ignore_index, want_log_sum_sq=use_weighting)
    logps = tokens.sums()
    if ld_alpha is not None:
        logps = (tokens.logp * _ld_weights(tokens.valid, ld_alpha, tokens.logp.dtype)).sum(-1)
    acc = logps.dtype
    batch = _Pairs.of(logps, tokens.counts, ref_chosen_logps.to(acc), ref_rejected_logps.to(acc),
                      f_divergence_type, f_alpha_divergence_coef)
    pair_weight = _wpo_weights(tokens) if use_weighting else None
    loss = torch.zeros((), dtype=acc, device=logps.device)
    for kind, w in zip(loss_types, weights):
        per_pair = pair_losses(kind, batch, beta=beta, label_smoothing=label_smoothing, discopop_tau=discopop_tau,
                               sft=lambda: sequences.chosen_nll(tokens.logp, tokens.valid))
        if pair_weight is not None:
            per_pair = per_pair * pair_weight
        loss = loss + sequences.mean_or_zero(per_pair) * w
    if not return_details:
        return loss
    return loss, DPODetails(chosen_logps=batch.chosen_logps, rejected_logps=batch.rejected_logps,
                            chosen_rewards=(beta * batch.u_chosen).detach(),
                            rejected_rewards=(beta * batch.u_rejected).detach())


class _Pairs(NamedTuple):
    """Per-pair quantities every loss type reads, ``[B]`` each."""

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    u_chosen: torch.Tensor  # log-ratios logp - ref
    u_rejected: torch.Tensor
    s_chosen: torch.Tensor  # f-divergence scores f'(u)
    s_rejected: torch.Tensor
    n_chosen: torch.Tensor  # completion tokens, at least 1
    n_rejected: torch.Tensor

    @classmethod
    def of(cls, logps, counts, ref_c, ref_r, f_divergence_type, alpha_coef) -> "_Pairs":
        b = logps.shape[0] // 2
        u_c, u_r = logps[:b] - ref_c, logps[b:] - ref_r
        n = count_or_one(counts)
        return cls(logps[:b], logps[b:], ref_c, ref_r, u_c, u_r, _score(u_c, f_divergence_type, alpha_coef),
                   _score(u_r, f_divergence_type, alpha_coef), n[:b], n[b:])


def pair_losses(loss_type: str, p: _Pairs, *, beta: float, label_smoothing: float, discopop_tau: float,
                sft) -> torch.Tensor:
    """The ``[B]`` per-pair losses of one loss type (module docstring); ``sft()`` gives the batch's SFT term."""
    e = label_smoothing
    delta = p.s_chosen - p.s_rejected
    logsig = F.logsigmoid
    if loss_type == "sigmoid":
        # Without smoothing, TRL's -log sig(b Delta): 0 at an infinite margin, where the cDPO form's 0 * -inf is NaN.
        return -logsig(beta * delta) if e == 0 else sequences.smoothed_sigmoid_loss(delta, beta, e)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":
        return (p.s_chosen / p.n_chosen - p.s_rejected / p.n_rejected - 1 / (2 * beta)) ** 2
    if loss_type == "exo_pair":
        x = beta * delta
        return (torch.sigmoid(x) * (logsig(x) - math.log1p(-e))
                + torch.sigmoid(-x) * (logsig(-x) - math.log(e)))
    if loss_type == "nca_pair":
        rc, rr = beta * p.u_chosen, beta * p.u_rejected
        return -logsig(rc) - 0.5 * logsig(-rc) - 0.5 * logsig(-rr)
    if loss_type == "robust":
        return (-(1 - e) * logsig(beta * delta) + e * logsig(-beta * delta)) / (1 - 2 * e)
    if loss_type == "bco_pair":
        return -logsig(beta * p.u_chosen) - logsig(-beta * p.u_rejected)
    if loss_type == "sppo_hard":
        return (p.u_chosen - 0.5 / beta) ** 2 + (p.u_rejected + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            gap = (torch.sort(p.chosen_logps - p.rejected_logps)[0]
                   - torch.sort(p.ref_chosen - p.ref_rejected)[0])
        else:
            gap = torch.sort(p.u_chosen)[0] - torch.sort(p.u_rejected)[0]
        return sequences.smoothed_sigmoid_loss(gap, beta, e)
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * p.u_chosen) + torch.sigmoid(beta * p.u_rejected)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * p.u_chosen) + 1 - torch.sigmoid(beta * (p.u_chosen - p.u_rejected))
    if loss_type == "discopop":
        x = beta * delta
        modulation = torch.sigmoid(x / discopop_tau)
        return -logsig(x) * (1 - modulation) + torch.exp(-x) * modulation
    if loss_type == "sft":
        return sft().expand(p.u_chosen.shape)
    if loss_type == "sigmoid_norm":
        return -logsig(beta * (p.s_chosen / p.n_chosen - p.s_rejected / p.n_rejected))
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def _score(u: torch.Tensor, f_divergence_type: str, alpha_coef: float) -> torch.Tensor:
    """f'(exp(u)) of the f-divergence regulariser (f-DPO), from the log-ratio u."""
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-u)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(u)
    if f_divergence_type == "alpha_divergence" and abs(alpha_coef - 1.0) >= 1e-6:  # the limit a -> 1 is u
        a = alpha_coef - 1.0
        return (torch.exp(torch.clamp(a * u, max=_ALPHA_EXP_MAX)) - 1.0) / a
    return u


def _ld_weights(valid: torch.Tensor, ld_alpha: float, dtype: torch.dtype) -> torch.Tensor:
    """LD-DPO token weights: 1 on a completion's first min(n_chosen, n_rejected) tokens, ld_alpha after."""
    position = valid.long().cumsum(-1)  # 1-based position among the completion's tokens
    lengths = valid.sum(-1)
    half = lengths.shape[0] // 2
    shared = torch.minimum(lengths[:half], lengths[half:]).repeat(2).unsqueeze(1)
    weights = torch.full(valid.shape, ld_alpha, dtype=dtype, device=valid.device)
    return torch.where(valid, torch.where(position <= shared, torch.ones_like(weights), weights), 0.0)


def _wpo_weights(tokens: sequences.TokenLogps) -> torch.Tensor:
    """WPO: exp of each completion's mean of ``lp_t - log sum_v q_v^2`` (detached), chosen times rejected."""
    with torch.no_grad():
        aligned = torch.where(tokens.valid, tokens.logp - tokens.log_sum_sq_probs, torch.zeros_like(tokens.logp))
        weights = torch.exp(aligned.sum(-1) / count_or_one(tokens.counts))
        half = weights.shape[0] // 2
        return weights[:half] * weights[half:]


def _loss_types(loss_type, loss_weights):
    types = [loss_type] if isinstance(loss_type, str) else loss_type
    if not isinstance(types, (list, tuple)) or not types:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES} or a non-empty list of them, got {loss_type!r}")
    for kind in types:
        v.require_choice("loss_type", kind, LOSS_TYPES)
    if loss_weights is None:
        return list(types), [1.0] * len(types)
    if not isinstance(loss_weights, (list, tuple)) or len(loss_weights) != len(types):
        raise ValueError(f"loss_weights must be a list with one weight per loss type ({len(types)}), "
                         f"got {loss_weights!r}")
    for w in loss_weights:
        v.require_real("loss_weights", w)
    return list(types), [float(w) for w in loss_weights]


def _check_options(loss_types, *, beta, label_smoothing, f_divergence_type, f_alpha_divergence_coef, ld_alpha,
                   discopop_tau, use_weighting):
    v.require_real("beta", beta, positive=True)
    v.require_real("label_smoothing", label_smoothing, nonnegative=True,
                   below=0.5 if "robust" in loss_types else 1.0)
    if "exo_pair" in loss_types and label_smoothing == 0:
        raise ValueError("label_smoothing must be > 0 for loss_type 'exo_pair' (its log(label_smoothing) term); "
                         "the EXO paper recommends 1e-3")
    v.require_choice("f_divergence_type", f_divergence_type, F_DIVERGENCE_TYPES)
    v.require_real("f_alpha_divergence_coef", f_alpha_divergence_coef)
    if f_divergence_type != "reverse_kl" and not set(loss_types) <= set(F_DIVERGENCE_LOSS_TYPES):
        raise ValueError(f"f_divergence_type={f_divergence_type!r} applies only to the loss types "
                         f"{F_DIVERGENCE_LOSS_TYPES}, got {loss_types}; use 'reverse_kl' with these")
    v.require_real("ld_alpha", ld_alpha, nonnegative=True, allow_none=True)
    if ld_alpha is not None and ld_alpha > 1:
        raise ValueError(f"ld_alpha must be in [0, 1] or None, got {ld_alpha!r}")
    v.require_real("discopop_tau", discopop_tau, positive=True)
    v.require_bool("use_weighting", use_weighting)
    if use_weighting and set(loss_types) & {"aot", "aot_unpaired"}:
        raise ValueError("use_weighting cannot combine with 'aot' or 'aot_unpaired': they sort the pairs, which "
                         "would misalign the per-pair weights (as TRL refuses)")
