"""Per-token log-probabilities of the targets, and optionally the entropy: the composable building block
(RL trainers gather these and apply their own loss)."""

from __future__ import annotations

from typing import Literal, Optional, overload

import torch

from .implicit_logits import implicit_logits
from .options import HEAD, RUN, SHARDING, shared_arguments, shared_options


@overload
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   return_entropy: Literal[False] = False, **options) -> torch.Tensor: ...


@overload
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   return_entropy: Literal[True], **options) -> tuple[torch.Tensor, torch.Tensor]: ...


@shared_options(*RUN, *SHARDING)
@shared_arguments(*HEAD, "ignore_index", "backend", *RUN, *SHARDING)
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   bias: Optional[torch.Tensor] = None, temperature: float = 1.0, logit_scale: float = 1.0,
                   softcap: Optional[float] = None, ignore_index: int = -100, return_entropy: bool = False,
                   backend: str = "auto", **head):
    """Per-token ``log p(targets)`` and optionally the entropy, from the hidden states, without the logits.

    The composable building block: RL trainers gather these and apply their own loss. Its backward recomputes
    the logits (4 GEMM-sized products in all).

    Args:
        hidden: ``[..., D]`` hidden states (float32, bfloat16, float16 or float64); position i is scored
            against ``targets[i]`` (for next-token log-probs pass ``hidden[:, :-1]`` with ``ids[:, 1:]``).
        weight: ``[V, D]`` lm_head weight, same dtype as ``hidden``.
        targets: integer ``[...]`` (the leading shape of ``hidden``) token ids in ``[0, V)`` or ignore_index.
        return_entropy: also return the entropy ``-sum_v p_v log p_v`` of each position.
        {shared}

    Returns:
        ``logp`` ``[...]`` fp32 (float64 for float64 inputs), 0 at ignored positions; with ``return_entropy``,
        ``(logp, entropy)``. Both are differentiable in hidden, weight and bias.

    Example::

        logp, entropy = fusedloss.token_logprobs(hidden[:, :-1], model.lm_head.weight, ids[:, 1:],
                                                 temperature=0.7, return_entropy=True)
    """
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                             backend=backend, **head)
    tgt = logits.targets("targets", targets, ignore_index)
    stats = logits.statistics(targets=tgt, want_entropy=bool(return_entropy))
    logp = logits.unflatten(stats.logp)
    if return_entropy:
        return logp, logits.unflatten(stats.entropy)
    return logp
