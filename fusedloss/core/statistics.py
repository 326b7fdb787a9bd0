"""The one differentiable primitive every loss is built on: per-token statistics of the logits.

``token_statistics`` is registered as a ``torch.library`` custom op (forward and backward), so that
a training step calling fusedloss compiles under ``torch.compile(fullgraph=True)`` without a graph
break, and the number of tokens is an ordinary dynamic dimension (no recompile per sequence length).
The backend is a string argument of the op: the autograd wiring and the gradient coefficients below
are written once for all backends.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple, Optional

import torch

from . import backends
from .problem import GradientNeeds, LogitTransform, Statistics, StatsProblem, accumulation_dtype

_NUM_OUTPUTS = len(Statistics._fields)


def _on_device_of(t: torch.Tensor):
    """Make t's GPU current while kernels launch (Triton and the extension launch on the current device),
    and restore the caller's afterwards: tensors on cuda:1 must not run on, or leave behind, cuda:0."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------
# Autocast and higher-order gradients, decided once for every backend and device.
# ------------------------------------------------------------------------------------------------
def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast would run a linear layer in on ``device``, or None when autocast is off there."""
    try:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
    except (RuntimeError, TypeError):  # a device type autocast does not know (meta)
        pass
    return None


def autocast_off(device: torch.device):
    """Inside the op (statistics, gradients, the eager path) autocast is off: the inputs were already cast as
    a linear layer would cast them (``losses/implicit_logits.py``), the logits are formed in fp32 from them,
    and the backward, which runs outside any autocast region, recomputes exactly the forward's logits."""
    if autocast_dtype(device) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


SECOND_ORDER_MESSAGE = (
    "fusedloss computes first-order gradients only: differentiating a gradient of a fusedloss loss again "
    "(create_graph=True for a gradient penalty, a Hessian-vector product, meta-learning) is not supported; "
    "compute such a loss on materialised logits (fusedloss.reference has the same functions)")


# ------------------------------------------------------------------------------------------------
# The op's arguments, generated from StatsProblem's fields (the one table): each field becomes one or
# more schema arguments, and ``_flatten`` / ``_unflatten`` convert between a problem and the op's flat
# argument list. A LogitTransform field becomes three (temperature, logit_scale, softcap).
# ------------------------------------------------------------------------------------------------
_SCHEMA_TYPES = {
    "torch.Tensor": "Tensor", "Optional[torch.Tensor]": "Tensor?", "bool": "bool", "float": "float",
    "Optional[float]": "float?", "Optional[bool]": "bool?", "int": "int", "Optional[int]": "int?", "str": "str",
    "Optional[str]": "str?",
}


def _argument_table() -> tuple:
    """``(field name, [(argument name, schema type), ...])`` for every field of StatsProblem."""
    table = []
    for f in dataclasses.fields(StatsProblem):
        if f.type == "LogitTransform":
            table.append((f.name, [(f"{f.name}_{k}", "float?" if k == "softcap" else "float")
                                   for k in LogitTransform._fields]))
        else:
            table.append((f.name, [(f.name, _SCHEMA_TYPES[f.type])]))
    return tuple(table)


_ARGUMENTS = _argument_table()
_PROBLEM_SCHEMA = ", ".join(f"{kind} {name}" for _, args in _ARGUMENTS for name, kind in args)


def _flatten(p: StatsProblem) -> tuple:
    """The op's arguments (all but ``backend``) for a problem, as plain Python values and tensors."""
    flat = []
    for name, args in _ARGUMENTS:
        value = getattr(p, name)
        flat.extend(value if len(args) > 1 else (value,))
    return tuple(flat)


def _unflatten(flat) -> StatsProblem:
    values, i = {}, 0
    for name, args in _ARGUMENTS:
        if len(args) > 1:
            values[name] = LogitTransform(*flat[i:i + len(args)])
        else:
            values[name] = flat[i]
        i += len(args)
    return StatsProblem(**values)


_NEEDS = ("need_hidden", "need_weight", "need_bias")


@torch.library.custom_op("fusedloss::token_statistics", mutates_args=(),
                         schema=f"({_PROBLEM_SCHEMA}, str backend) -> Tensor")
def _statistics_op(*args) -> torch.Tensor:
    *flat, backend = args
    problem = _unflatten(flat)
    with _on_device_of(problem.hidden), autocast_off(problem.hidden.device):
        return torch.stack(tuple(backends.get(backend).forward_statistics(problem)))


@_statistics_op.register_fake
def _(*args):
    hidden = args[0]
    return hidden.new_empty((_NUM_OUTPUTS, hidden.shape[0]), dtype=accumulation_dtype(hidden.dtype))


@torch.library.custom_op("fusedloss::token_statistics_backward", mutates_args=(),
                         schema=f"({_PROBLEM_SCHEMA}, str backend, Tensor stats, Tensor coeffs, "
                                f"{', '.join('bool ' + n for n in _NEEDS)}) -> (Tensor, Tensor, Tensor)")
def _statistics_backward_op(*args) -> tuple:
    *flat, backend, stats, coeffs, need_hidden, need_weight, need_bias = args
    problem = _unflatten(flat)
    needs = GradientNeeds(need_hidden, need_weight, need_bias and problem.bias is not None)
    with _on_device_of(problem.hidden), autocast_off(problem.hidden.device):
        grads = backends.get(backend).backward_gradients(problem, Statistics(*stats.unbind(0)), coeffs, needs)
    # custom ops cannot return None: an unneeded gradient travels as an empty tensor.
    return tuple(g if g is not None else problem.hidden.new_empty(0) for g in grads)


@_statistics_backward_op.register_fake
def _(*args):
    *flat, _backend, _stats, _coeffs, need_hidden, need_weight, need_bias = args
    p = _unflatten(flat)
    return (
        torch.empty_like(p.hidden) if need_hidden else p.hidden.new_empty(0),
        torch.empty_like(p.weight) if need_weight else p.hidden.new_empty(0),
        torch.empty_like(p.bias) if need_bias and p.bias is not None else p.hidden.new_empty(0),
    )


def _times(g: torch.Tensor, stat: torch.Tensor) -> torch.Tensor:
    """g * stat, 0 where g is 0: a row outside the loss contributes nothing even where its statistic is +inf
    (a reverse KL next to a masked teacher entry; 0 * inf would be NaN in every row's d weight)."""
    return torch.where(g == 0, 0.0, g * stat)


def dz_coefficients(grad: torch.Tensor, stats: torch.Tensor, jsd_beta: Optional[float],
                    targets: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """Per-row coefficients (a, c0, ..., c5) of the logits gradient (problem.py), from the gradients of the
    loss with respect to each statistic (docs/design.md, "The dz formula")::

        d lse/dz_j      = q_j                            -> c0
        d logp/dz_j     = [j=y] - q_j                    -> a (the kernels form a ([j=y] - q_j) themselves)
        d H/dz_j        = -q_j (log q_j + H)             -> c0, c1
        d KL(q||p)/dz_j = q_j r_j                        -> c2 (r_j: problem.py)
        d KL(p||q)/dz_j = q_j - p_j                      -> c0, c3
        d JSD/dz_j      = (1-beta) q_j (log q_j - log m_j - KL(q||m))   -> c0, c1, c4
        d mean_logit/dz_j = 1 / V                        -> c5
    c0 holds only the per-row constants that are not a log-probability's or a reverse KL's share, so that
    neither is rounded into it. log_sum_sq_probs and is_top1 are metrics: their gradients are ignored.
    """
    s = Statistics(*stats.unbind(0))
    g = Statistics(*grad.unbind(0))
    zero = torch.zeros_like(s.lse)
    a = g.logp
    c0 = g.lse + g.kl_fwd - _times(g.entropy, s.entropy)
    c1 = -g.entropy
    c2 = g.kl_rev
    c3 = -g.kl_fwd
    c4 = zero
    if jsd_beta is not None:
        w = g.jsd * (1.0 - jsd_beta)
        c0 = c0 - _times(w, s.kl_qm)
        c1 = c1 + w
        c4 = -w
    c5 = g.mean_logit / vocab_size
    coeffs = torch.stack((a, c0, c1, c2, c3, c4, c5))
    if targets is not None:
        coeffs = torch.where(targets >= 0, coeffs, torch.zeros_like(coeffs))
    return coeffs


def _setup_context(ctx, inputs, output):
    *flat, backend = inputs
    # Tensors go through save_for_backward (autograd's checks on in-place changes); the rest is kept as is.
    ctx.is_tensor = [isinstance(x, torch.Tensor) for x in flat]
    ctx.constants = [None if t else x for x, t in zip(flat, ctx.is_tensor)]
    ctx.backend = backend
    ctx.save_for_backward(*(x for x, t in zip(flat, ctx.is_tensor) if t), output)


def head_gradients(problem: StatsProblem, backend: str, stats: torch.Tensor, grad_stats: torch.Tensor,
                   vocab_size: int, needs_input_grad) -> tuple:
    """(d hidden, d weight, d bias) of a statistics problem, each None where autograd does not ask for it
    (``needs_input_grad``: hidden, weight, bias first, as the op's table). The backward of every autograd
    function over the op: this one, and the distributed heads' (gathered FSDP2, ZeRO-3), whose ``problem`` has
    the gathered head and whose ``vocab_size`` is the logical vocabulary."""
    coeffs = dz_coefficients(grad_stats, stats, problem.jsd_beta, problem.targets, vocab_size)
    need_h, need_w, need_b = needs_input_grad[:3]
    need_b = need_b and problem.bias is not None
    dh, dw, db = _statistics_backward_op(*_flatten(problem), backend, stats, coeffs, need_h, need_w, need_b)
    return dh if need_h else None, dw if need_w else None, db if need_b else None


def _backward(ctx, grad_stats):
    *tensors, stats = ctx.saved_tensors
    saved = iter(tensors)
    flat = [next(saved) if t else x for x, t in zip(ctx.constants, ctx.is_tensor)]
    problem = _unflatten(flat)
    grads = head_gradients(problem, ctx.backend, stats, grad_stats, problem.weight.shape[0], ctx.needs_input_grad)
    return grads + (None,) * (len(flat) - 2)


_statistics_op.register_autograd(_backward, setup_context=_setup_context)


def _second_order(ctx, *grads):
    raise RuntimeError(SECOND_ORDER_MESSAGE)


# The gradients depend on hidden and weight, but their own derivatives are not implemented: with
# create_graph=True they stay attached to the graph, and differentiating them raises this clear error
# instead of treating them as constants.
_statistics_backward_op.register_autograd(_second_order, setup_context=lambda ctx, inputs, output: None)


class TeacherHead(NamedTuple):
    """The frozen teacher side of a distillation: its hidden states, head and logit transform
    (``softcap(logit_scale * x) / temperature``, as for the student)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    temperature: float
    logit_scale: float = 1.0
    softcap: Optional[float] = None


def build_problem(hidden: torch.Tensor, weight: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                  targets: Optional[torch.Tensor] = None, transform: LogitTransform = LogitTransform(),
                  teacher: Optional[TeacherHead] = None, **wants) -> StatsProblem:
    """The StatsProblem of a call, with the teacher detached (gradients flow to the student only) and every
    option a plain Python value, so that torch.compile traces it without meeting a user-defined class."""
    teacher_fields = {}
    if teacher is not None:
        teacher_fields = dict(
            teacher_hidden=teacher.hidden.detach(), teacher_weight=teacher.weight.detach(),
            teacher_bias=None if teacher.bias is None else teacher.bias.detach(),
            teacher_transform=_plain_transform(LogitTransform(teacher.temperature, teacher.logit_scale,
                                                              teacher.softcap)))
    flags = {k: _plain(_FIELD_TYPES[k], v) for k, v in wants.items()}
    return StatsProblem(hidden=hidden, weight=weight, bias=bias, targets=targets,
                        transform=_plain_transform(transform), **teacher_fields, **flags)


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(StatsProblem)}


def _plain(kind: str, value):
    """A problem option as the plain Python value its schema type asks for (None kept where allowed)."""
    if value is None and kind.startswith("Optional["):
        return None
    return float(value) if kind.endswith("float]") or kind == "float" else bool(value)


def _plain_transform(tf: LogitTransform) -> LogitTransform:
    return LogitTransform(float(tf.temperature), float(tf.logit_scale),
                          None if tf.softcap is None else float(tf.softcap))


def token_statistics(hidden: torch.Tensor, weight: torch.Tensor, *, backend: str = "torch",
                     **problem) -> Statistics:
    """Differentiable per-row statistics for 2-D ``hidden`` ``[N, D]`` (validated by the caller; targets
    already mapped to -1 on ignored rows). ``problem`` takes ``build_problem``'s keywords (bias, targets,
    transform, teacher and the ``want_*`` flags). ``backend`` is a concrete backend name, never "auto"."""
    stats = _statistics_op(*_flatten(build_problem(hidden, weight, **problem)), backend)
    return Statistics(*stats.unbind(0))
