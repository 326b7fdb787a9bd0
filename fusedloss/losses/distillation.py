"""Distillation from a frozen teacher over the full vocabulary (TRL's generalized_jsd_loss convention).

    beta == 0 : KL(p || q)   forward KL, teacher first (Hinton)
    beta == 1 : KL(q || p)   reverse KL, student first (on-policy distillation, MiniLLM)
    otherwise : beta KL(p || m) + (1 - beta) KL(q || m),  m = (1 - beta) q + beta p

with q = softmax(z_s / T) the student, p = softmax(z_t / T) the teacher, each model's raw logits first scaled
and soft-capped by its own ``logit_scale`` / ``softcap`` (a Gemma 2 teacher's ``final_logit_softcapping``, a
Cohere teacher's ``logit_scale``: leaving them out distils towards a different distribution). Per token::

    soft_weight * soft * (T**2 if t_squared else 1) + hard_weight * CE(z_s at T = 1, y)
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

import torch

from .. import _validation as v
from ..core import LogitTransform, TeacherHead
from ..distributed.head import check_same_rows
from ..types import Teacher
from .implicit_logits import implicit_logits
from .multi_teacher import multi_teacher_distillation
from .options import RUN, SHARDING, shared_arguments, shared_options
from .reductions import reduced_token_loss


@shared_options(*RUN, "grad_in_forward", *SHARDING)
@shared_arguments("bias", "logit_scale", "softcap", "ignore_index", "backend", *RUN, "grad_in_forward", *SHARDING)
def distillation_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: Optional[torch.Tensor] = None,
                      teacher_weight: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None, *,
                      teachers: Optional[Sequence[Teacher]] = None, teacher_index: Optional[torch.Tensor] = None,
                      beta: float = 1.0,
                      temperature: float = 1.0, hard_weight: float = 0.0, soft_weight: float = 1.0,
                      t_squared: bool = False, bias: Optional[torch.Tensor] = None,
                      teacher_bias: Optional[torch.Tensor] = None, logit_scale: float = 1.0,
                      softcap: Optional[float] = None, teacher_logit_scale: float = 1.0,
                      teacher_softcap: Optional[float] = None, ignore_index: int = -100,
                      reduction: Literal["batchmean", "sum", "none"] = "batchmean", num_items_in_batch=None,
                      backend: str = "auto", **head) -> torch.Tensor:
    """Distillation from a frozen teacher over the full vocabulary (TRL's ``generalized_jsd_loss`` convention),
    from both models' hidden states, without either's logits.

    With q = softmax(student logits / T) and p = softmax(teacher logits / T), each model's logits
    ``softcap(logit_scale * (h @ W.T + b))`` with its own scale and cap, per token::

        soft = KL(p || q)                                  beta == 0 (forward KL, Hinton)
               KL(q || p)                                  beta == 1 (reverse KL, on-policy distillation)
               beta KL(p || m) + (1 - beta) KL(q || m)     otherwise, m = (1 - beta) q + beta p
        loss = soft_weight * soft * (T**2 if t_squared else 1) + hard_weight * CE(student logits at T = 1, y)

    Hinton et al. with mixing weight lam: ``beta=0, hard_weight=1-lam, soft_weight=lam, t_squared=True``.

    Several teachers (multi-teacher distillation, one expert per prompt): leave ``teacher_hidden`` and
    ``teacher_weight`` out and pass ``teachers=[fusedloss.Teacher(hidden, weight, bias=, logit_scale=,
    softcap=, temperature=), ...]`` with ``teacher_index`` (integer ``[...]``, the leading shape of hidden):
    position i is distilled from ``teachers[teacher_index[i]]`` (its own head, width, bias, scale, soft-cap and
    temperature; each teacher's hidden states for every position or only for its own rows, see
    ``fusedloss.Teacher``), -1: from none (the position is not scored, in either term). The loss is the
    single-teacher loss of each position with its teacher, reduced over all positions as above (batchmean
    divides by the scored positions of every teacher together). Each teacher's head is read only on its rows;
    the teachers are frozen (no gradient reaches any of their tensors). One single-teacher pass per teacher
    that has rows, so every backend and option applies; ``teacher_index`` is read on the host once.

    Args:
        hidden: ``[..., D]`` student hidden states. weight: ``[V, D]`` student lm_head weight.
        teacher_hidden: ``[..., D_t]`` teacher hidden states (the student's leading shape and dtype).
        teacher_weight: ``[V, D_t]`` teacher lm_head weight (the same vocabulary). The teacher is frozen: it
            never gets a gradient. Both None with ``teachers``.
        targets: integer ``[...]`` labels: positions whose label is ignore_index count in neither term;
            None scores every position (``hard_weight`` must then be 0).
        teachers: several teachers (``fusedloss.Teacher``), with ``teacher_index``; see above.
        teacher_index: integer ``[...]``, which of ``teachers`` each position is distilled from (-1: none).
        beta: in ``[0, 1]``, see above. temperature: T, applied to both models.
        hard_weight, soft_weight, t_squared: the mixture above.
        teacher_bias: ``[V]`` teacher lm_head bias, or None.
        teacher_logit_scale, teacher_softcap: the teacher's ``logit_scale`` and ``softcap`` (its config's, e.g.
            Gemma 2's ``final_logit_softcapping``), applied to its logits before the temperature as the
            student's own ``logit_scale`` and ``softcap`` (below) are to the student's; None: no cap.
        reduction: ``"batchmean"`` (sum / number of scored tokens, 0 when none), ``"sum"`` or ``"none"``
            (per-token ``[...]``).
        num_items_in_batch: when given (> 0), the loss is ``sum / num_items_in_batch``.
        {shared}

    Returns:
        The loss, fp32 (float64 for float64 inputs): a scalar, or ``[...]`` with ``reduction="none"``.

    Example::

        loss = fusedloss.distillation_loss(h_student, student.lm_head.weight, h_teacher,
                                           teacher.lm_head.weight, beta=1.0)   # reverse KL
        loss = fusedloss.distillation_loss(h_student, student.lm_head.weight, teachers=[
            fusedloss.Teacher(h_math, math_model.lm_head.weight),
            fusedloss.Teacher(h_code, code_model.lm_head.weight, softcap=30.0)], teacher_index=expert_of_position)
    """
    if teachers is not None or teacher_index is not None:
        if teachers is None or teacher_index is None:
            raise ValueError("teachers and teacher_index go together: pass both (several teachers) or neither")
        single_only = dict(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias,
                           teacher_softcap=teacher_softcap)
        given = [name for name, value in single_only.items() if value is not None]
        given += ["teacher_logit_scale"] if teacher_logit_scale != 1.0 else []
        if given:
            raise ValueError(f"{', '.join(given)} belong to a single teacher: with teachers=, each Teacher carries "
                             "its own hidden states, weight, bias, logit_scale and softcap")
        v.require_choice("reduction", reduction, ("batchmean", "sum", "none"))
        return multi_teacher_distillation(
            distillation_loss, hidden, weight, targets, teachers, teacher_index, temperature=temperature,
            ignore_index=ignore_index, reduction=reduction, num_items_in_batch=num_items_in_batch, beta=beta,
            hard_weight=hard_weight, soft_weight=soft_weight, t_squared=t_squared, bias=bias,
            logit_scale=logit_scale, softcap=softcap, backend=backend, **head)
    if teacher_hidden is None or teacher_weight is None:
        raise TypeError("distillation_loss needs teacher_hidden and teacher_weight (one teacher), or teachers= and "
                        "teacher_index= (several)")
    v.require_real("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    v.require_real("hard_weight", hard_weight)
    v.require_real("soft_weight", soft_weight)
    v.require_choice("reduction", reduction, ("batchmean", "sum", "none"))
    v.require_bool("t_squared", t_squared)
    v.require_real("teacher_logit_scale", teacher_logit_scale)
    v.require_real("teacher_softcap", teacher_softcap, positive=True, allow_none=True)
    student = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale,
                              softcap=softcap, backend=backend, **head)
    # The teacher's head is laid out as the student's (its gradient is never asked: no reduction option).
    placement = {k: head[k] for k in SHARDING if k != "reduce_hidden_grad"}
    teacher = implicit_logits(teacher_hidden, teacher_weight, teacher_bias, temperature=temperature,
                              logit_scale=teacher_logit_scale, softcap=teacher_softcap, backend="torch",
                              hidden_name="teacher_hidden", weight_name="teacher_weight", bias_name="teacher_bias",
                              **placement)
    if teacher.lead_shape != student.lead_shape:
        raise ValueError(f"teacher_hidden must have the leading shape of hidden {student.lead_shape}, "
                         f"got {teacher.lead_shape}")
    if teacher.vocab_size != student.vocab_size:
        raise ValueError(f"teacher_weight has {teacher.vocab_size} vocabulary rows but weight has "
                         f"{student.vocab_size}: the vocabularies must match")
    check_same_rows(student, teacher)
    v.require_same_device(hidden=hidden, teacher_hidden=teacher_hidden)
    if teacher_hidden.dtype != hidden.dtype:
        raise TypeError(f"teacher_hidden has dtype {teacher_hidden.dtype} but hidden has {hidden.dtype}: "
                        "cast the teacher to the student's dtype")
    if targets is None:
        if hard_weight != 0:
            raise ValueError("targets is None, so every token is scored without a label: hard_weight must be 0, "
                             f"got {hard_weight!r}")
        tgt = None
    else:
        tgt = student.targets("targets", targets, ignore_index)

    frozen = TeacherHead(teacher.hidden, teacher.weight, teacher.bias, *teacher.transform)
    soft_kind = {0.0: "want_kl_fwd", 1.0: "want_kl_rev"}.get(float(beta))
    wants = {soft_kind: True} if soft_kind else {"jsd_beta": float(beta)}
    valid = torch.ones(student.num_rows, dtype=torch.bool, device=hidden.device) if tgt is None else tgt >= 0
    soft_scale = soft_weight * (temperature ** 2 if t_squared else 1.0)
    # The label term is read at temperature 1: from the same pass when T is 1, else from a second one.
    label_logp = None
    if hard_weight != 0 and temperature != 1:
        at_one = LogitTransform(1.0, student.transform.logit_scale, student.transform.softcap)
        label_logp = student.statistics(targets=tgt, transform=at_one).logp

    def per_token(stats, rows):
        soft = stats.kl_fwd if beta == 0 else stats.kl_rev if beta == 1 else stats.jsd
        loss = soft_scale * soft
        if hard_weight != 0:
            loss = loss - hard_weight * (stats.logp if label_logp is None else label_logp[rows])
        # without targets every row counts: no mask (ops once per grad-in-forward row chunk)
        return loss if tgt is None else torch.where(valid[rows], loss, torch.zeros_like(loss))

    return reduced_token_loss(student, per_token, valid, reduction, num_items_in_batch, mean_name="batchmean",
                              row_local=label_logp is None, targets=tgt, teacher=frozen, **wants)
