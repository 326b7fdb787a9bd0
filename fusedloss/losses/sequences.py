"""Sequence log-probabilities from one statistics pass: what every preference loss starts from.

The preference losses (``dpo``, ``kto``, ``orpo``, ``cpo``) score whole completions. They share one
layout, TRL's: ``hidden`` is ``[rows, T, D]``, row r position t predicts ``labels[r, t]``, and labels are
``ignore_index`` outside the completion. The paired losses (DPO, ORPO, CPO) concatenate the chosen
completions (rows ``0..B-1``) and then the rejected ones (rows ``B..2B-1``), pair i being rows i and B + i.
Everything after the statistics pass is a masked sum over ``[rows, T]`` per-token vectors, written once in
Python for every backend (docs/design.md, "Losses as per-token math").
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .. import _validation as v
from .implicit_logits import ImplicitLogits, count_or_one


class TokenLogps(NamedTuple):
    logp: torch.Tensor  # [rows, T] per-token log-probs of the labels, 0 where not scored (differentiable)
    valid: torch.Tensor  # [rows, T] bool: the tokens of ``labels``
    extra: Optional["TokenLogps"]  # the same for ``extra_labels`` (None without them)
    log_sum_sq_probs: Optional[torch.Tensor]  # [rows, T] log sum_v q_v^2 (detached), when asked

    @property
    def counts(self) -> torch.Tensor:
        """Scored tokens per row, as ``logp``'s dtype."""
        return self.valid.sum(-1).to(self.logp.dtype)

    def sums(self) -> torch.Tensor:
        return self.logp.sum(-1)

    def means(self) -> torch.Tensor:
        """Mean token log-prob per row (0 for a row with no scored token)."""
        return self.sums() / count_or_one(self.counts)


def require_rows(logits: ImplicitLogits, *, paired: bool) -> int:
    """Check the ``[rows, T, D]`` layout (an even number of rows when paired); return B (pairs, or rows)."""
    shape = tuple(logits.lead_shape) + (logits.hidden.shape[-1],)
    if len(logits.lead_shape) != 2:
        raise ValueError(f"hidden must be [{'2B' if paired else 'B'}, T, D], got shape {shape}")
    rows = logits.lead_shape[0]
    if paired and rows % 2:
        raise ValueError(f"hidden must be [2B, T, D], chosen rows then rejected rows, with an even first "
                         f"dimension; got shape {shape}")
    return rows // 2 if paired else rows


def token_logps(logits: ImplicitLogits, labels, ignore_index: int, *, extra_labels=None,
                want_log_sum_sq: bool = False) -> TokenLogps:
    """One statistics pass for the log-probs of ``labels`` and of ``extra_labels`` (ORPO's NLL also scores
    the prompt). Where both label a token they must agree: a token has one target in the pass."""
    tgt = logits.targets("labels", labels, ignore_index)
    targets, extra = tgt, None
    if extra_labels is not None:
        extra = logits.targets("nll_labels", extra_labels, ignore_index)
        if not torch.compiler.is_compiling() and tgt.device.type != "meta":
            clash = (tgt >= 0) & (extra >= 0) & (tgt != extra)
            if bool(clash.any()):
                raise ValueError(f"nll_labels and labels label a token differently; where both are not "
                                 f"ignore_index ({ignore_index}) they must agree")
        targets = torch.where(tgt >= 0, tgt, extra)
    stats = logits.statistics(targets=targets, want_extras=want_log_sum_sq)
    logp = logits.unflatten(stats.logp)  # 0 on rows without a target

    def scored(t):
        valid = logits.unflatten(t >= 0)
        return TokenLogps(logp=torch.where(valid, logp, torch.zeros_like(logp)), valid=valid, extra=None,
                          log_sum_sq_probs=logits.unflatten(stats.log_sum_sq_probs) if want_log_sum_sq else None)

    return scored(tgt)._replace(extra=None if extra is None else scored(extra))


def chosen_nll(logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """TRL's ``CrossEntropyLoss()`` on the chosen half: minus the mean log-prob over its scored tokens
    (0 when it has none)."""
    half = logp.shape[0] // 2
    return -logp[:half].sum() / count_or_one(valid[:half].sum().to(logp.dtype))


def require_refs(count: int, hidden, *, per: str = "pair", **refs) -> None:
    """Reference log-probs (or other per-sequence values): floating ``[count]`` tensors, one value ``per``
    pair or row, on ``hidden``'s device."""
    for name, ref in refs.items():
        v.require_tensor(name, ref, floating=True)
        v.require_shape(name, ref, (count,), f"one value per {per}")
    v.require_same_device(hidden=hidden, **refs)


def smoothed_sigmoid_loss(x: torch.Tensor, beta: float, e: float) -> torch.Tensor:
    """``-(1 - e) log sig(beta x) - e log sig(-beta x)``: the sigmoid preference loss of a margin x with label
    smoothing e (conservative DPO; DPO's sigmoid and aot, CPO's sigmoid and SimPO)."""
    return -(1 - e) * F.logsigmoid(beta * x) - e * F.logsigmoid(-beta * x)


def mean_or_zero(x: torch.Tensor) -> torch.Tensor:
    """The mean over pairs (or rows), 0 rather than NaN for an empty batch."""
    return x.mean() if x.numel() else x.sum()
