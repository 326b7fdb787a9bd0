"""The one differentiable primitive every loss is built on: per-token statistics of the logits.

``token_statistics`` is registered as a ``torch.library`` custom op (forward and backward), so that
a training step calling fusedloss compiles under ``torch.compile(fullgraph=True)`` without a graph
break, and the number of tokens is an ordinary dynamic dimension (no recompile per sequence length).
The backend is a string argument of the op: the autograd wiring and the gradient coefficients below
are written once for all backends.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

from . import backends
from .problem import GradientNeeds, LogitTransform, Statistics, StatsProblem

_NUM_OUTPUTS = len(Statistics._fields)


def _on_device_of(t: torch.Tensor):
    """Make t's GPU current while kernels launch (Triton and the extension launch on the current device),
    and restore the caller's afterwards: tensors on cuda:1 must not run on, or leave behind, cuda:0."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _problem(hidden, weight, bias, targets, teacher_hidden, teacher_weight, teacher_bias, temperature,
             logit_scale, softcap, teacher_temperature, teacher_logit_scale, teacher_softcap, want_entropy,
             want_kl_rev, want_kl_fwd, jsd_beta,
             want_mean_logit, want_extras):
    return StatsProblem(
        hidden=hidden, weight=weight, bias=bias, targets=targets,
        transform=LogitTransform(temperature, logit_scale, softcap),
        teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias,
        teacher_transform=LogitTransform(teacher_temperature, teacher_logit_scale, teacher_softcap),
        want_entropy=want_entropy, want_kl_rev=want_kl_rev, want_kl_fwd=want_kl_fwd, jsd_beta=jsd_beta,
        want_mean_logit=want_mean_logit, want_extras=want_extras,
    )


@torch.library.custom_op("fusedloss::token_statistics", mutates_args=())
def _statistics_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: Optional[torch.Tensor],
    teacher_hidden: Optional[torch.Tensor], teacher_weight: Optional[torch.Tensor],
    teacher_bias: Optional[torch.Tensor], temperature: float, logit_scale: float, softcap: Optional[float],
    teacher_temperature: float, teacher_logit_scale: float, teacher_softcap: Optional[float],
    want_entropy: bool, want_kl_rev: bool, want_kl_fwd: bool,
    jsd_beta: Optional[float], want_mean_logit: bool, want_extras: bool, backend: str,
) -> torch.Tensor:
    problem = _problem(hidden, weight, bias, targets, teacher_hidden, teacher_weight, teacher_bias, temperature,
                       logit_scale, softcap, teacher_temperature, teacher_logit_scale, teacher_softcap, want_entropy,
                       want_kl_rev, want_kl_fwd, jsd_beta, want_mean_logit, want_extras)
    with _on_device_of(hidden):
        return torch.stack(tuple(backends.get(backend).forward_statistics(problem)))


@_statistics_op.register_fake
def _(hidden, weight, bias, targets, teacher_hidden, teacher_weight, teacher_bias, temperature, logit_scale,
      softcap, teacher_temperature, teacher_logit_scale, teacher_softcap, want_entropy, want_kl_rev, want_kl_fwd,
      jsd_beta, want_mean_logit,
      want_extras, backend):
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    return hidden.new_empty((_NUM_OUTPUTS, hidden.shape[0]), dtype=acc)


@torch.library.custom_op("fusedloss::token_statistics_backward", mutates_args=())
def _statistics_backward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: Optional[torch.Tensor],
    teacher_hidden: Optional[torch.Tensor], teacher_weight: Optional[torch.Tensor],
    teacher_bias: Optional[torch.Tensor], temperature: float, logit_scale: float, softcap: Optional[float],
    teacher_temperature: float, teacher_logit_scale: float, teacher_softcap: Optional[float],
    want_entropy: bool, want_kl_rev: bool, want_kl_fwd: bool,
    jsd_beta: Optional[float], want_mean_logit: bool, want_extras: bool, backend: str, stats: torch.Tensor,
    coeffs: torch.Tensor,
    need_hidden: bool, need_weight: bool, need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    problem = _problem(hidden, weight, bias, targets, teacher_hidden, teacher_weight, teacher_bias, temperature,
                       logit_scale, softcap, teacher_temperature, teacher_logit_scale, teacher_softcap, want_entropy,
                       want_kl_rev, want_kl_fwd, jsd_beta, want_mean_logit, want_extras)
    needs = GradientNeeds(need_hidden, need_weight, need_bias and bias is not None)
    with _on_device_of(hidden):
        grads = backends.get(backend).backward_gradients(problem, Statistics(*stats.unbind(0)), coeffs, needs)
    # custom ops cannot return None: an unneeded gradient travels as an empty tensor.
    return tuple(g if g is not None else hidden.new_empty(0) for g in grads)


@_statistics_backward_op.register_fake
def _(hidden, weight, bias, targets, teacher_hidden, teacher_weight, teacher_bias, temperature, logit_scale,
      softcap, teacher_temperature, teacher_logit_scale, teacher_softcap, want_entropy, want_kl_rev, want_kl_fwd,
      jsd_beta, want_mean_logit,
      want_extras, backend, stats, coeffs, need_hidden, need_weight, need_bias):
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        torch.empty_like(bias) if need_bias and bias is not None else hidden.new_empty(0),
    )


def dz_coefficients(grad: torch.Tensor, stats: torch.Tensor, jsd_beta: Optional[float],
                    targets: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """Per-row coefficients (a, c0, ..., c5) of the logits gradient (problem.py), from the
    gradients of the loss with respect to each statistic. Derivatives, with log q_j = z_j - lse::

        d lse/dz_j      = q_j                           d logp/dz_j   = [j=y] - q_j
        d H/dz_j        = -q_j (log q_j + H)            d KL(q||p)/dz_j = q_j (log q_j - log p_j - KL(q||p))
        d KL(p||q)/dz_j = q_j - p_j                     d JSD/dz_j    = (1-beta) q_j (log q_j - log m_j - KL(q||m))
        d mean_logit/dz_j = 1 / V
    log_sum_sq_probs and is_top1 are metrics: their gradients are ignored.
    """
    s = Statistics(*stats.unbind(0))
    g = Statistics(*grad.unbind(0))
    zero = torch.zeros_like(s.lse)
    a = g.logp
    c0 = g.lse - g.logp - g.entropy * s.entropy - g.kl_rev * s.kl_rev + g.kl_fwd
    c1 = g.kl_rev - g.entropy
    c2 = -g.kl_rev
    c3 = -g.kl_fwd
    c4 = zero
    if jsd_beta is not None:
        w = g.jsd * (1.0 - jsd_beta)
        c0 = c0 - w * s.kl_qm
        c1 = c1 + w
        c4 = -w
    c5 = g.mean_logit / vocab_size
    coeffs = torch.stack((a, c0, c1, c2, c3, c4, c5))
    if targets is not None:
        coeffs = torch.where(targets >= 0, coeffs, torch.zeros_like(coeffs))
    return coeffs


_FORWARD_ARGS = ("hidden", "weight", "bias", "targets", "teacher_hidden", "teacher_weight", "teacher_bias",
                 "temperature", "logit_scale", "softcap", "teacher_temperature", "teacher_logit_scale",
                 "teacher_softcap", "want_entropy", "want_kl_rev",
                 "want_kl_fwd", "jsd_beta", "want_mean_logit", "want_extras", "backend")


def _setup_context(ctx, inputs, output):
    ctx.args = dict(zip(_FORWARD_ARGS, inputs))
    tensors = {k: v for k, v in ctx.args.items() if isinstance(v, torch.Tensor)}
    ctx.tensor_names = tuple(tensors)
    ctx.save_for_backward(*tensors.values(), output)


def _backward(ctx, grad_stats):
    *tensors, stats = ctx.saved_tensors
    args = dict(ctx.args, **dict(zip(ctx.tensor_names, tensors)))
    coeffs = dz_coefficients(grad_stats, stats, args["jsd_beta"], args["targets"], args["weight"].shape[0])
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    dh, dw, db = _statistics_backward_op(*(args[k] for k in _FORWARD_ARGS), stats, coeffs, need_h, need_w,
                                         need_b and args["bias"] is not None)
    grads = dict.fromkeys(_FORWARD_ARGS)
    grads.update(hidden=dh if need_h else None, weight=dw if need_w else None,
                 bias=db if need_b and args["bias"] is not None else None)
    return tuple(grads.values())


_statistics_op.register_autograd(_backward, setup_context=_setup_context)


class TeacherHead(NamedTuple):
    """The frozen teacher side of a distillation: its hidden states, head and logit transform
    (``softcap(logit_scale * x) / temperature``, as for the student)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    temperature: float
    logit_scale: float = 1.0
    softcap: Optional[float] = None


def _op_arguments(hidden, weight, bias, targets, transform: LogitTransform, teacher: Optional[TeacherHead],
                  want_entropy=False, want_kl_rev=False, want_kl_fwd=False, jsd_beta=None, want_mean_logit=False,
                  want_extras=False) -> tuple:
    """The op's flat arguments (all but ``backend``), with the teacher detached (SPEC: gradients flow to the
    student only). Plain Python values: torch.compile traces this without meeting a user-defined class."""
    t_hidden = t_weight = t_bias = None
    t_temperature, t_scale, t_softcap = 1.0, 1.0, None
    if teacher is not None:
        t_hidden, t_weight = teacher.hidden.detach(), teacher.weight.detach()
        t_bias = None if teacher.bias is None else teacher.bias.detach()
        t_temperature, t_scale = float(teacher.temperature), float(teacher.logit_scale)
        t_softcap = None if teacher.softcap is None else float(teacher.softcap)
    return (hidden, weight, bias, targets, t_hidden, t_weight, t_bias, float(transform.temperature),
            float(transform.logit_scale), None if transform.softcap is None else float(transform.softcap),
            t_temperature, t_scale, t_softcap, bool(want_entropy), bool(want_kl_rev), bool(want_kl_fwd),
            None if jsd_beta is None else float(jsd_beta), bool(want_mean_logit), bool(want_extras))


def build_problem(hidden: torch.Tensor, weight: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                  targets: Optional[torch.Tensor] = None, transform: LogitTransform = LogitTransform(),
                  teacher: Optional[TeacherHead] = None, **wants) -> StatsProblem:
    """The StatsProblem of a call, as the op would see it (for the eager path, which runs outside the op)."""
    return _problem(*_op_arguments(hidden, weight, bias, targets, transform, teacher, **wants))


def token_statistics(hidden: torch.Tensor, weight: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                     targets: Optional[torch.Tensor] = None, transform: LogitTransform = LogitTransform(),
                     teacher: Optional[TeacherHead] = None, want_entropy: bool = False, want_kl_rev: bool = False,
                     want_kl_fwd: bool = False, jsd_beta: Optional[float] = None, want_mean_logit: bool = False,
                     want_extras: bool = False, backend: str = "torch") -> Statistics:
    """Differentiable per-row statistics for 2-D ``hidden`` ``[N, D]`` (validated by the caller; targets
    already mapped to -1 on ignored rows). ``backend`` is a concrete backend name, never "auto"."""
    stats = _statistics_op(*_op_arguments(hidden, weight, bias, targets, transform, teacher, want_entropy,
                                          want_kl_rev, want_kl_fwd, jsd_beta, want_mean_logit, want_extras), backend)
    return Statistics(*stats.unbind(0))
