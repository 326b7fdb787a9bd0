"""Result types shared by the public API and ``fusedloss.reference``."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class GRPODetails(NamedTuple):
    logprobs: torch.Tensor  # [B, C] fp32, differentiable
    entropy: torch.Tensor  # [B, C] detached
    kl: Optional[torch.Tensor]  # masked mean of the per-token KL penalty, None when beta == 0
    clip_ratio_low: torch.Tensor
    clip_ratio_high: torch.Tensor
    clip_ratio_region: torch.Tensor


class DPODetails(NamedTuple):
    chosen_logps: torch.Tensor  # [B], differentiable
    rejected_logps: torch.Tensor  # [B], differentiable
    chosen_rewards: torch.Tensor  # [B], detached, beta * (chosen_logps - ref_chosen_logps)
    rejected_rewards: torch.Tensor  # [B], detached


class GroupAdvantages(NamedTuple):
    advantages: torch.Tensor  # [N]
    std: torch.Tensor  # [num_groups]
    keep: torch.Tensor  # [N] bool
