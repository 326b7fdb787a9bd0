"""Per-token log-probabilities of the targets, and optionally the entropy: the composable building block
(RL trainers gather these and apply their own loss)."""

from __future__ import annotations

from typing import Literal, Optional, overload

import torch

from .. import _validation as v
from .implicit_logits import ImplicitLogits, alignment_hint, implicit_logits
from .options import HEAD, RUN, SHARDING, shared_arguments, shared_options


@overload
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   return_entropy: Literal[False] = False, return_sum_sq_probs: Literal[False] = False,
                   **options) -> torch.Tensor: ...


@overload
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   return_entropy: Literal[True], return_sum_sq_probs: Literal[False] = False,
                   **options) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, return_entropy: bool = False,
                   return_sum_sq_probs: Literal[True], **options) -> tuple[torch.Tensor, ...]: ...


@shared_options(*RUN, *SHARDING)
@shared_arguments(*HEAD, "ignore_index", "backend", *RUN, *SHARDING)
def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   bias: Optional[torch.Tensor] = None, temperature: float = 1.0, logit_scale: float = 1.0,
                   softcap: Optional[float] = None, ignore_index: int = -100, return_entropy: bool = False,
                   return_sum_sq_probs: bool = False,
                   backend: str = "auto", **head):
    """Per-token ``log p(targets)`` and optionally the entropy, from the hidden states, without the logits.

    The composable building block: RL trainers gather these and apply their own loss. Its backward recomputes
    the logits (4 GEMM-sized products in all).

    Args:
        hidden: ``[..., D]`` hidden states (float32, bfloat16, float16 or float64); position i is scored
            against ``targets[i]`` (for next-token log-probs pass ``hidden[:, :-1]`` with ``ids[:, 1:]``).
        weight: ``[V, D]`` lm_head weight, same dtype as ``hidden``.
        targets: integer ``[...]`` (the leading shape of ``hidden``) token ids in ``[0, V)`` or ignore_index;
            or ``[..., K]``, K ids per position (a teacher's top-k ids and the sampled token): ``logp`` is
            then ``[..., K]``, each entry ignored on its own (the entropy is 0 where all K are ignored).
        return_entropy: also return the entropy ``-sum_v p_v log p_v`` of each position.
        return_sum_sq_probs: also return ``sum_v p_v^2`` of each position (detached; verl's
            ``sum_pi_squared`` for its optimal token baseline), last.
        {shared}

    Returns:
        ``logp`` ``[...]`` fp32 (float64 for float64 inputs), 0 at ignored positions (``[..., K]`` for K
        targets per position); with ``return_entropy``, ``(logp, entropy)``, the entropy ``[...]``. Both are
        differentiable in hidden, weight and bias. With ``return_sum_sq_probs``, ``sum_v p_v^2`` ``[...]``
        (0 at ignored positions) is appended: ``(logp, sum_sq)`` or ``(logp, entropy, sum_sq)``.

    Example::

        logp, entropy = fusedloss.token_logprobs(hidden[:, :-1], model.lm_head.weight, ids[:, 1:],
                                                 temperature=0.7, return_entropy=True)
    """
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                             backend=backend, **head)
    v.require_bool("return_entropy", return_entropy)
    v.require_bool("return_sum_sq_probs", return_sum_sq_probs)
    if isinstance(targets, torch.Tensor) and targets.dim() == len(logits.lead_shape) + 1:
        logp, stats, row_targets = _several_targets(logits, targets, ignore_index, return_entropy, return_sum_sq_probs)
    else:
        row_targets = logits.targets("targets", targets, ignore_index)
        stats = logits.statistics(targets=row_targets, want_entropy=return_entropy, want_extras=return_sum_sq_probs)
        logp = logits.unflatten(stats.logp)
    outputs = (logp,)
    if return_entropy:
        outputs += (logits.unflatten(stats.entropy),)
    if return_sum_sq_probs:
        # The core leaves 0 (log 1) on ignored rows; sum p^2 is a metric: no gradient.
        sum_sq = torch.exp(stats.log_sum_sq_probs.detach())
        outputs += (logits.unflatten(torch.where(row_targets >= 0, sum_sq, torch.zeros_like(sum_sq))),)
    return outputs[0] if len(outputs) == 1 else outputs


def _several_targets(logits: ImplicitLogits, targets: torch.Tensor, ignore_index: int, want_entropy: bool,
                     want_extras: bool):
    """``token_logprobs`` with K ids per position: validated, then ``several_logprobs``; returns the
    ``[..., K]`` log-probs, the statistics and the core's row targets (-1 where the row has no id)."""
    v.require_tensor("targets", targets, floating=False)
    if tuple(targets.shape[:-1]) != logits.lead_shape:
        raise ValueError(f"targets must have shape {logits.lead_shape} or {logits.lead_shape + ('K',)} (the leading "
                         f"dimensions of hidden, then K ids per position), got {tuple(targets.shape)}"
                         f"{alignment_hint('targets', tuple(targets.shape[:-1]), logits.lead_shape)}")
    v.require_same_device(hidden=logits.hidden, targets=targets)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    k = targets.shape[-1]
    ids = v.map_targets("targets", targets, logits.vocab_size, ignore_index).reshape(logits.num_rows, k)
    logp, stats, row_target = several_logprobs(logits, ids, want_entropy=want_entropy, want_extras=want_extras)
    return logp.reshape(*logits.lead_shape, k), stats, row_target


def several_logprobs(logits: ImplicitLogits, ids: torch.Tensor, **wants):
    """``([N, K] log q at ids, the row statistics, [N] row targets)`` for validated ids ``[N, K]`` (-1: none,
    0 there) on a head held whole on this device; ``wants``: more statistics (``want_entropy``, ...).

    One statistics pass that also reads the logits at the K columns from its own tiles (named columns,
    ``core/columns.py``): ``log q_k = (z_k - row_max) - log s`` keeps the digits of a confident row, and the
    backward forms each named column's dz with every one-hot share in fp32, before dx is rounded once. A row
    with at least one id is a valid row of the core (its largest id is the core's target, whose own log-prob
    is left unused); a row with none is ignored there and gives 0."""
    if logits.distributed is not None:
        raise ValueError("K log-probs per position (token_logprobs with [..., K] targets, "
                         "sparse_distillation_loss) need the whole head on this device: a vocabulary-parallel, "
                         "FSDP2 or ZeRO-3 head (process_group, a sharded weight) is not supported there; with "
                         "token_logprobs, call once per column of targets")
    k = ids.shape[-1]
    row_target = ids.amax(-1) if k > 0 else ids.new_full((logits.num_rows,), -1)
    stats, logp = logits.column_statistics(ids, targets=row_target, **wants)
    return logp, stats, row_target
