"""Distillation from a teacher that only returns its top-k log-probs (a teacher served by vLLM), TRL 1.16's
``ServerDistillationTrainer`` loss (``trl.experimental.server_distillation``).

Per scored position, on a sparse support S of token ids, with q the student (at ``temperature``) and p the
teacher's log-probs as served::

    beta == 0     S = the teacher's top-k ids (entries whose teacher log-prob is -inf left out)
    beta == 1     S = {the sampled token}
    0 < beta < 1  S = {the teacher's top-1, the sampled token} (one entry when they coincide)

    loss_add_tail: both sides get a (|S|+1)-th bucket log(1 - sum_S exp(log-prob)), the sum capped at 1 - 1e-7
                   (the mass outside S), and are used as they are; else both are renormalised over S
                   (``renormalize``), or, verl's ``forward_kl_topk``, taken as they are, each clamped below at
                   ``log_prob_min_clamp``, and the KL clamped below at 0.
    divergence:    beta == 0 KL(p || q), beta == 1 KL(q || p), else beta KL(p || m) + (1 - beta) KL(q || m),
                   m = (1 - beta) q + beta p, summed over the support (and the tail); at most ``loss_max_clamp``.

then ``sum / max(1, scored positions)`` ("batchmean"; verl's "token-mean"). The student side is K + 1
log-probabilities per position: ``token_logprobs`` with K ids (named columns of one statistics pass,
``core/columns.py``), never the logits. The per-position math is a few operations on
``[N, |S|+1]`` tensors, written in the order of TRL's own code so that float64 results and gradients agree
with it to rounding.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch

from .. import _validation as v
from .implicit_logits import implicit_logits
from .options import HEAD, RUN, SHARDING, shared_arguments, shared_options
from .reductions import reduce_per_token
from .token_logprobs import several_logprobs

REDUCTIONS = ("batchmean", "sum", "none")
TAIL_CAP = -1e-7  # TRL's cap on the log of the support's mass, so that the tail log(1 - mass) stays finite


@shared_options(*RUN, *SHARDING)
@shared_arguments(*HEAD, "ignore_index", "backend", *RUN, *SHARDING)
def sparse_distillation_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher_ids: Optional[torch.Tensor],
                             teacher_logprobs: Optional[torch.Tensor], targets: Optional[torch.Tensor] = None, *,
                             teacher_target_logprobs: Optional[torch.Tensor] = None, beta: float = 1.0,
                             loss_top_k: Optional[int] = None, loss_add_tail: bool = True,
                             reverse_kl_top_1_mode: Literal["sampled"] = "sampled", renormalize: bool = True,
                             log_prob_min_clamp: Optional[float] = None, loss_max_clamp: Optional[float] = None,
                             bias: Optional[torch.Tensor] = None, temperature: float = 1.0, logit_scale: float = 1.0,
                             softcap: Optional[float] = None, ignore_index: int = -100,
                             reduction: Literal["batchmean", "sum", "none"] = "batchmean", num_items_in_batch=None,
                             backend: str = "auto", **head) -> torch.Tensor:
    """Distillation on a teacher's top-k log-probs (TRL 1.16 ``ServerDistillationTrainer``, verl 0.9's
    ``forward_kl_topk``), from the student's hidden states, without its logits.

    Option names and defaults are TRL's ``ServerDistillationConfig``'s. On the support S of each position (the
    teacher's top-k ids when ``beta == 0``; the sampled token when ``beta == 1``; the teacher's top-1 and the
    sampled token otherwise), with a tail bucket for the mass outside S (``loss_add_tail``) or renormalised::

        beta == 0: KL(p || q)    beta == 1: KL(q || p)    else: beta KL(p || m) + (1 - beta) KL(q || m)

    verl's ``forward_kl_topk`` (loss_mode, with its ``log_prob_min_clamp`` and ``loss_max_clamp``, token-mean):
    ``beta=0.0, loss_add_tail=False, renormalize=False, log_prob_min_clamp=-10.0, loss_max_clamp=10.0``.

    Args:
        hidden: ``[..., D]`` student hidden states; position i is scored against ``targets[i]``.
        weight: ``[V, D]`` student lm_head weight.
        teacher_ids: integer ``[..., K]`` the teacher's top-k token ids per position (sorted, top-1 first),
            read only where ``teacher_logprobs`` is finite; may be None when ``beta == 1``.
        teacher_logprobs: ``[..., K]`` the teacher's log-probs of those ids (-inf: no entry); may be None when
            ``beta == 1``. NaN or +inf where read (a scored position, the first ``loss_top_k`` columns; with
            ``beta > 0`` the top-1, which must then be finite) is a ValueError; elsewhere never read.
        targets: integer ``[...]`` the sampled tokens (TRL's completion labels): positions whose target is
            ignore_index are not scored; required when ``beta > 0`` (the sampled token is on the support).
            None with ``beta == 0``: every position is scored.
        teacher_target_logprobs: ``[...]`` the teacher's log-prob of each sampled token; required when
            ``beta > 0``.
        beta: in ``[0, 1]``, see above; ``beta > 0`` needs ``loss_top_k == 1`` (TRL's rule).
        loss_top_k: how many of the teacher's ids to use (the first ``loss_top_k`` columns); None: all K.
        loss_add_tail: add the tail bucket ``log(1 - sum exp(log-probs on S))`` to both sides (True), or
            renormalise both over S (False).
        reverse_kl_top_1_mode: ``"sampled"``, the reverse-KL token is the sampled one (a served teacher cannot
            score the student's own argmax, so TRL accepts only this).
        renormalize: without the tail, renormalise both sides over S (True, TRL); False (verl, ``beta == 0``
            only) takes the top-k log-probs as they are, and clamps the per-position KL, which can then be
            negative, below at 0.
        log_prob_min_clamp: with ``renormalize=False``, both sides' log-probs are clamped below at this value
            (verl's option); None: not clamped.
        loss_max_clamp: the per-position divergence is clamped to ``[-loss_max_clamp, loss_max_clamp]`` (verl's
            option); None: not clamped.
        temperature: divides the student's logits (the teacher's log-probs are served at that temperature).
        reduction: ``"batchmean"`` (sum / number of scored positions, 0 when none), ``"sum"`` or ``"none"``
            (per-position ``[...]``, 0 where not scored).
        num_items_in_batch: when given (> 0), the loss is ``sum / num_items_in_batch``.
        {shared}

    Returns:
        The loss, fp32 (float64 for float64 inputs): a scalar, or ``[...]`` with ``reduction="none"``.

    Example::

        served = vllm_client.get_sequence_logprobs(..., top_logprobs=20)      # ids, log-probs [B, T, 20]
        loss = fusedloss.sparse_distillation_loss(hidden, model.lm_head.weight, ids, logprobs, labels, beta=0.0)
    """
    v.require_real("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    v.require_bool("loss_add_tail", loss_add_tail)
    v.require_bool("renormalize", renormalize)
    v.require_real("log_prob_min_clamp", log_prob_min_clamp, allow_none=True)
    v.require_real("loss_max_clamp", loss_max_clamp, allow_none=True, nonnegative=True)
    if not renormalize and (beta != 0 or loss_add_tail):
        raise ValueError(f"renormalize=False (verl's forward_kl_topk) needs beta=0.0 and loss_add_tail=False, got "
                         f"beta={beta!r}, loss_add_tail={loss_add_tail!r}")
    if log_prob_min_clamp is not None and renormalize:
        raise ValueError("log_prob_min_clamp applies to the top-k log-probs taken as they are: it needs "
                         "renormalize=False (verl's forward_kl_topk)")
    v.require_choice("reduction", reduction, REDUCTIONS)
    if reverse_kl_top_1_mode != "sampled":
        raise ValueError(f"reverse_kl_top_1_mode must be 'sampled' (a served teacher cannot score the student's own "
                         f"top-1 token), got {reverse_kl_top_1_mode!r}")
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                             backend=backend, **head)
    lead = logits.lead_shape
    n = logits.num_rows
    acc = torch.float64 if logits.hidden.dtype == torch.float64 else torch.float32

    if targets is None:
        if beta > 0:
            raise ValueError(f"targets (the sampled tokens) are required when beta > 0 (beta={beta!r}): the "
                             "sampled token is on the support")
        scored = torch.ones(n, dtype=torch.bool, device=logits.hidden.device)
        sampled = None
    else:
        sampled = logits.targets("targets", targets, ignore_index)
        scored = sampled >= 0

    top = None
    if beta < 1:
        top = _teacher_top_k(logits, teacher_ids, teacher_logprobs, loss_top_k, beta, scored, acc)
    if beta > 0:
        if teacher_target_logprobs is None:
            raise ValueError(f"teacher_target_logprobs (the teacher's log-prob of each sampled token) is required "
                             f"when beta > 0 (beta={beta!r})")
        v.require_tensor("teacher_target_logprobs", teacher_target_logprobs, floating=True)
        v.require_shape("teacher_target_logprobs", teacher_target_logprobs, lead, "the leading dimensions of hidden")
        v.require_same_device(hidden=logits.hidden, teacher_target_logprobs=teacher_target_logprobs)
        sampled_lp = teacher_target_logprobs.reshape(n).to(acc)
        _require_finite("teacher_target_logprobs", sampled_lp, scored, "the reverse-KL term")
        sampled_lp = torch.where(scored, sampled_lp, torch.zeros_like(sampled_lp))

    if beta == 0:
        ids, teacher_lp = top
        support = ids >= 0
    elif beta == 1:
        ids, teacher_lp = sampled.unsqueeze(-1), sampled_lp.unsqueeze(-1)
        support = scored.unsqueeze(-1)
    else:
        top_ids, top_lp = top
        ids = torch.stack((top_ids[:, 0], torch.where(sampled == top_ids[:, 0], -1, sampled)), dim=-1)
        teacher_lp = torch.stack((top_lp[:, 0], sampled_lp), dim=-1)
        support = ids >= 0

    student_lp, _, _ = several_logprobs(logits, ids)
    # The per-position math in float64 (a few values per position; MPS has none): the tail bucket divides by
    # 1 - mass, which fp32 rounds at 1.5e-3 relative for a student 4e-5 short of its teacher's top-k.
    wide = torch.float64 if student_lp.device.type != "mps" else student_lp.dtype
    per_position = sparse_divergence(student_lp.to(wide), teacher_lp.to(wide), support, float(beta), loss_add_tail,
                                     renormalize=renormalize, log_prob_min_clamp=log_prob_min_clamp).to(acc)
    if loss_max_clamp is not None:
        per_position = per_position.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    per_position = torch.where(scored, per_position, torch.zeros_like(per_position))
    return reduce_per_token(per_position, scored, reduction, num_items_in_batch, mean_name="batchmean",
                            unflatten=logits.unflatten)


def _teacher_top_k(logits, teacher_ids, teacher_logprobs, loss_top_k, beta, scored, acc):
    """The teacher's first ``loss_top_k`` ids (-1 where the position is not scored or the log-prob is -inf)
    and log-probs, ``[N, k]``, validated."""
    lead = logits.lead_shape
    for name, t, floating in (("teacher_ids", teacher_ids, False), ("teacher_logprobs", teacher_logprobs, True)):
        if t is None:
            raise ValueError(f"{name} is required when beta < 1 (beta={beta!r}): the teacher's top-k support")
        v.require_tensor(name, t, floating=floating)
        if t.dim() != len(lead) + 1 or tuple(t.shape[:-1]) != lead or t.shape[-1] < 1:
            raise ValueError(f"{name} must have shape {lead + ('K',)} (the leading dimensions of hidden, then the "
                             f"teacher's K >= 1 top ids), got {tuple(t.shape)}")
    if teacher_ids.shape != teacher_logprobs.shape:
        raise ValueError(f"teacher_logprobs must have the shape of teacher_ids {tuple(teacher_ids.shape)}, got "
                         f"{tuple(teacher_logprobs.shape)}")
    v.require_same_device(hidden=logits.hidden, teacher_ids=teacher_ids, teacher_logprobs=teacher_logprobs)
    available = teacher_ids.shape[-1]
    k = available if loss_top_k is None else loss_top_k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= available:
        raise ValueError(f"loss_top_k must be an int in [1, {available}] (the teacher's ids per position) or None, "
                         f"got {loss_top_k!r}")
    if beta > 0 and k != 1:
        raise ValueError(f"loss_top_k must be 1 with beta > 0 (got loss_top_k={k}, beta={beta!r}): the mixed "
                         "divergence on a served teacher is defined on the top-1 support (TRL's rule)")
    n = logits.num_rows
    lp = teacher_logprobs[..., :k].reshape(n, k).to(acc)
    if beta > 0:
        _require_finite("teacher_logprobs", lp[:, 0], scored, "the forward-KL term (the teacher's top-1)")
    else:
        _require_log_probs("teacher_logprobs", lp, scored)
    present = scored.unsqueeze(-1) & (lp > -math.inf)
    ids = teacher_ids[..., :k].reshape(n, k)
    ids = v.map_targets("teacher_ids", torch.where(present, ids, -1), logits.vocab_size, -1).reshape(n, k)
    return ids, torch.where(present, lp, torch.zeros_like(lp))


def _require_finite(name: str, values: torch.Tensor, scored: torch.Tensor, why: str) -> None:
    """TRL refuses a served log-prob missing at a scored position; so do we, without a host synchronisation on
    a GPU (``_validation.refuse_values``)."""
    missing = scored & ~torch.isfinite(values)
    v.refuse_values(missing.any(),
                    lambda: f"{name} is missing (not finite) at {int(missing.sum())} of {int(scored.sum())} scored "
                            f"positions; {why} needs it at every scored position",
                    f"{name} is missing (not finite) at a scored position")


def _require_log_probs(name: str, values: torch.Tensor, scored: torch.Tensor) -> None:
    """The top-k log-probs read at scored positions are log-probabilities or -inf (no entry, as TRL pads): a
    NaN or +inf there is a broken teacher, refused rather than dropped as absent (TRL's ``> -inf`` test keeps
    +inf and drops NaN). Positions that are not scored and columns past ``loss_top_k`` are never read."""
    bad = scored.unsqueeze(-1) & (torch.isnan(values) | (values == math.inf))
    v.refuse_values(bad.any(),
                    lambda: f"{name} holds NaN or +inf at {int(bad.any(-1).sum())} of {int(scored.sum())} scored "
                            f"positions (in the first {values.shape[-1]} columns, the ones read): a log-prob is "
                            f"finite, or -inf where the teacher returned no entry",
                    f"{name} holds NaN or +inf at a scored position")


def with_tail(log_probs: torch.Tensor, support: torch.Tensor):
    """TRL's ``_add_tail_bucket``: append ``log(1 - sum exp(log_probs))`` (the sum capped at 1 - 1e-7) and
    its always-present mask entry."""
    mass = torch.clamp(torch.logsumexp(log_probs, dim=-1, keepdim=True), max=TAIL_CAP)
    tail = torch.log(-torch.expm1(mass))
    return torch.cat((log_probs, tail), dim=-1), torch.cat((support, torch.ones_like(support[..., :1])), dim=-1)


def sparse_divergence(student: torch.Tensor, teacher: torch.Tensor, support: torch.Tensor, beta: float,
                      add_tail: bool, *, renormalize: bool = True,
                      log_prob_min_clamp: Optional[float] = None) -> torch.Tensor:
    """Per-position divergence ``[N]`` of student and teacher log-probs ``[N, S]`` on the entries of
    ``support``, in the operations and order of TRL's server path (``_jsd_divergence`` with a support
    mask): entries off the support are -inf before the tail or the renormalisation, and 0 after. Without
    ``renormalize``, verl's ``forward_kl_topk``: ``sum p (log p - log q)`` on the raw (clamped) log-probs,
    at least 0."""
    if not renormalize:
        zero = torch.zeros_like(student)
        student, teacher = torch.where(support, student, zero), torch.where(support, teacher, zero)
        if log_prob_min_clamp is not None:
            student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
        terms = torch.where(support, teacher.exp() * (teacher - student), zero)
        return terms.sum(-1).clamp_min(0.0)
    neg_inf = torch.full((), -math.inf, dtype=student.dtype, device=student.device)
    student = torch.where(support, student, neg_inf)
    teacher = torch.where(support, teacher, neg_inf)
    if add_tail:
        student, mask = with_tail(student, support)
        teacher, _ = with_tail(teacher, support)
    else:
        mask = support
        student = student - torch.logsumexp(student, dim=-1, keepdim=True)
        teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    zero = torch.zeros_like(student)
    log_q, log_p = torch.where(mask, student, zero), torch.where(mask, teacher, zero)
    q, p = torch.where(mask, student.exp(), zero), torch.where(mask, teacher.exp(), zero)
    if beta == 0:
        terms = torch.nan_to_num(p * (log_p - log_q), nan=0.0)
    elif beta == 1:
        terms = torch.nan_to_num(q * (log_q - log_p), nan=0.0)
    else:
        b = torch.tensor(beta, dtype=student.dtype, device=student.device)
        mixture = (1 - b) * q + b * p
        log_m = torch.where(mask, torch.log(mixture.clamp_min(torch.finfo(student.dtype).tiny)), zero)
        kl_teacher = torch.nan_to_num(p * (log_p - log_m), nan=0.0)
        kl_student = torch.nan_to_num(q * (log_q - log_m), nan=0.0)
        terms = b * kl_teacher + (1 - b) * kl_student
    return terms.sum(-1)
