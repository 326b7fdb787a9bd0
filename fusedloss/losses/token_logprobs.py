"""Per-token log-probabilities of the targets, and optionally the entropy: the composable building block
(RL trainers gather these and apply their own loss)."""

from __future__ import annotations

from typing import Literal, Optional, overload

import torch

from .docs import HEAD, RUN, SHARDING, shared_arguments
from .implicit_logits import implicit_logits


@overload
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   return_entropy: Literal[False] = False, **options) -> torch.Tensor: ...


@overload
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   return_entropy: Literal[True], **options) -> tuple[torch.Tensor, torch.Tensor]: ...


@shared_arguments(*HEAD, "ignore_index", *RUN, *SHARDING)
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   bias: Optional[torch.Tensor] = None, temperature: float = 1.0, logit_scale: float = 1.0,
                   softcap: Optional[float] = None, ignore_index: int = -100, return_entropy: bool = False,
                   backend: str = "auto", workspace_mb: Optional[float] = None, allow_tf32: Optional[bool] = None,
                   process_group=None, reduce_hidden_grad: bool = True, vocab_start: Optional[int] = None,
                   vocab_size: Optional[int] = None, fsdp_vocab_parallel: bool = False):
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
                             backend=backend, workspace_mb=workspace_mb, allow_tf32=allow_tf32,
                             process_group=process_group, reduce_hidden_grad=reduce_hidden_grad,
                             vocab_start=vocab_start, vocab_size=vocab_size, fsdp_vocab_parallel=fsdp_vocab_parallel)
    tgt = logits.targets("targets", targets, ignore_index)
    stats = logits.statistics(targets=tgt, want_entropy=bool(return_entropy))
    logp = logits.unflatten(stats.logp)
    if return_entropy:
        return logp, logits.unflatten(stats.entropy)
    return logp
