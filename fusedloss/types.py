"""Result types shared by the public API and ``fusedloss.reference``.

Per-sequence fields are ``[B]`` (one per pair, or per example for KTO); scalars are 0-d tensors. Fields named
``*_logps`` stay differentiable; rewards and metrics are detached. All are fp32, or float64 for float64 inputs.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class GRPODetails(NamedTuple):
    """What TRL 1.16's GRPOTrainer logs, computed from the same statistics as the loss."""

    logprobs: torch.Tensor  # [B, C], differentiable
    entropy: torch.Tensor  # [B, C], detached; its masked mean is TRL's "entropy"
    kl: Optional[torch.Tensor]  # masked mean of the KL term as it enters the loss (times the ratio with
    # use_bias_correction_kl); None when beta == 0
    clip_ratio_low: Optional[torch.Tensor]  # TRL's clip_ratio/low_mean; None for sapo and vespo
    clip_ratio_high: Optional[torch.Tensor]  # clip_ratio/high_mean; cispo: its cispo_clip_ratio
    clip_ratio_region: Optional[torch.Tensor]  # clip_ratio/region_mean
    clip_ratio_low_min: Optional[torch.Tensor] = None  # clip_ratio/low_min (grpo family only)
    clip_ratio_high_max: Optional[torch.Tensor] = None  # clip_ratio/high_max (grpo family only)
    vespo_phi_seq_mean: Optional[torch.Tensor] = None  # vespo/phi_seq_mean (vespo only)
    policy_loss: Optional[torch.Tensor] = None  # the loss before the entropy bonus (TRL's policy_loss)


class DPODetails(NamedTuple):
    chosen_logps: torch.Tensor  # [B], differentiable (LD-DPO weighted when ld_alpha is set)
    rejected_logps: torch.Tensor  # [B], differentiable
    chosen_rewards: torch.Tensor  # [B], detached, beta * (chosen_logps - ref_chosen_logps)
    rejected_rewards: torch.Tensor  # [B], detached


class KTODetails(NamedTuple):
    logps: torch.Tensor  # [B] sequence log-probs, differentiable
    rewards: torch.Tensor  # [B] beta * (logps - ref_logps), detached
    kl: torch.Tensor  # the KL reference point z0 the loss used (0-d, detached; 0 for apo_zero_unpaired)


class ORPODetails(NamedTuple):
    chosen_logps: torch.Tensor  # [B] mean token log-prob of each chosen completion, differentiable
    rejected_logps: torch.Tensor  # [B], differentiable
    chosen_rewards: torch.Tensor  # [B] beta * chosen_logps, detached
    rejected_rewards: torch.Tensor  # [B], detached
    log_odds_ratio: torch.Tensor  # mean of log sigmoid(log odds), detached (TRL's log_odds_ratio)
    log_odds_chosen: torch.Tensor  # mean log odds, detached (TRL's log_odds_chosen)
    nll_loss: torch.Tensor  # the chosen completions' NLL term, detached


class CPODetails(NamedTuple):
    chosen_logps: torch.Tensor  # [B] summed (sigmoid, hinge) or mean (ipo, simpo) token log-probs, differentiable
    rejected_logps: torch.Tensor  # [B], differentiable
    chosen_rewards: torch.Tensor  # [B] beta * reward (the AlphaPO transform when alpha != 0), detached
    rejected_rewards: torch.Tensor  # [B], detached
    nll_loss: torch.Tensor  # the chosen completions' NLL term (0 when cpo_alpha == 0), detached


class GroupAdvantages(NamedTuple):
    advantages: torch.Tensor  # [N]
    std: torch.Tensor  # [num_groups]
    keep: torch.Tensor  # [N] bool


class TopK(NamedTuple):
    """``fusedloss.topk_logprobs``'s result: per row the k most likely ids, most likely first (among equal
    log-probs the smaller id first), and their log-probs; ids -1 and log-probs -inf on masked rows."""

    ids: torch.Tensor  # [..., k] int64
    logprobs: torch.Tensor  # [..., k] fp32 (float64 for float64 inputs)
    lse: Optional[torch.Tensor] = None  # [...] the logits' log-normaliser, when asked for
    entropy: Optional[torch.Tensor] = None  # [...] the distribution's entropy, when asked for


class Teacher(NamedTuple):
    """One teacher of a multi-teacher distillation (``distillation_loss(..., teachers=, teacher_index=)``,
    ``multi_teacher_topk_logprobs``): its lm_head and its hidden states, with its own logit processing.

    ``hidden`` holds either every position (the student's leading shape, ``[..., D_t]``: only this teacher's
    rows are read) or only this teacher's rows, ``[n_t, D_t]`` in position order (``n_t`` the number of
    positions whose ``teacher_index`` is this teacher's). ``D_t`` may differ from the student's width and from
    the other teachers'. ``weight`` ``[V, D_t]`` (the student's vocabulary; this rank's rows under vocabulary
    parallelism), ``bias`` ``[V]`` or None, ``logit_scale`` and ``softcap`` as the student's (its config's
    ``logit_scale`` / ``final_logit_softcapping``). ``temperature``: the distillation temperature on this
    teacher's rows, applied to the student and to this teacher as the single-teacher ``temperature`` is;
    None: the call's. A teacher is frozen: none of its tensors receives a gradient."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    logit_scale: float = 1.0
    softcap: Optional[float] = None
    temperature: Optional[float] = None
