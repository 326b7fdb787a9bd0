"""Group-relative advantages: GRPO, Dr. GRPO and DAPO as three operations on one number, the group
standard deviation (the group-standard-deviation identity: docs/design.md, "Losses as per-token math").

    A_i = (r_i - mean_group(r)) / (std + eps)     scale="group": std of the group (GRPO)
                                                  scale="batch": std of the whole batch (mean stays per group)
                                                  scale="none":  no division (Dr. GRPO)

A silent group (every reward equal, std 0) has no learning signal: its advantages are exactly 0, even with
eps = 0, and with ``drop_silent_groups`` (DAPO's dynamic-sampling filter) its members are marked
``keep = False``.
"""

from __future__ import annotations

from typing import Literal

import torch

from .. import _validation as v
from ..types import GroupAdvantages

SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: Literal["group", "batch", "none"] = "group",
                     drop_silent_groups: bool = False, eps: float = 1e-4, unbiased: bool = True) -> GroupAdvantages:
    """Group-relative advantages of GRPO (``scale="group"``), Dr. GRPO (``"none"``) and DAPO's dynamic
    sampling (``drop_silent_groups=True``): ``A_i = (r_i - mean_group(r)) / (std + eps)``.

    Args:
        rewards: ``[num_groups * group_size]`` real rewards, consecutive completions of one prompt together.
        group_size: completions per prompt (G).
        scale: ``"group"`` divides by the group's std (GRPO), ``"batch"`` by the std of the whole batch (the
            mean stays per group), ``"none"`` does not divide (Dr. GRPO).
        drop_silent_groups: mark every member of a group whose rewards are all equal (std 0, no learning
            signal) with ``keep = False`` (DAPO's filter); their advantages are 0 either way.
        eps: added to the std before dividing.
        unbiased: Bessel-corrected std (as ``torch.std``), else the population std.

    Returns:
        ``GroupAdvantages(advantages [N], std [num_groups], keep [N] bool)``, fp32 (float64 for float64 rewards),
        detached.

    Example::

        adv = fusedloss.group_advantages(rewards, group_size=8).advantages
    """
    v.require_tensor("rewards", rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_groups * group_size], got shape {tuple(rewards.shape)}")
    v.require_positive_int("group_size", group_size)
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    v.require_choice("scale", scale, SCALES)
    v.require_real("eps", eps, nonnegative=True)
    v.require_bool("unbiased", unbiased)
    v.require_bool("drop_silent_groups", drop_silent_groups)
    if rewards.is_complex():
        raise TypeError(f"rewards must be real, got {rewards.dtype}")
    r = rewards.detach()
    r = r if r.dtype == torch.float64 else r.to(torch.float32)
    groups = r.reshape(-1, group_size)
    correction = 1 if unbiased else 0
    # A single-sample group has no spread (Bessel's correction would divide by zero); no groups, no spreads.
    has_spread = group_size > correction and groups.shape[0] > 0
    std = groups.std(dim=1, correction=correction) if has_spread else torch.zeros_like(groups[:, 0])
    silent = groups.amax(dim=1) == groups.amin(dim=1)
    std = torch.where(silent, torch.zeros_like(std), std)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = centered / (std[:, None] + eps)
    elif scale == "batch":
        batch_std = r.std(correction=correction) if r.numel() > correction else torch.zeros((), dtype=r.dtype)
        adv = centered / (batch_std + eps)
    else:
        adv = centered
    adv = torch.where(silent[:, None], torch.zeros_like(adv), adv)
    keep = ~silent[:, None].expand_as(groups) if drop_silent_groups else torch.ones_like(groups, dtype=torch.bool)
    return GroupAdvantages(advantages=adv.reshape(-1), std=std, keep=keep.reshape(-1))
