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
import math
from typing import NamedTuple, Optional, Union

import torch

from . import columns, registry
from .problem import NUM_COEFFS, GradientNeeds, LogitTransform, Statistics, StatsProblem, accumulation_dtype

_NUM_OUTPUTS = len(Statistics._fields)


def _on_device_of(t: torch.Tensor):
    """Make t's GPU current while kernels launch (Triton and the extension launch on the current device),
    and restore the caller's afterwards: tensors on cuda:1 must not run on, or leave behind, cuda:0."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _traced(tensors) -> bool:
    """A compiler traces this call: Dynamo, or AOTAutograd tracing a registered backward with fake tensors.
    Before torch 2.13 ``torch.compiler.is_compiling()`` is False inside AOTAutograd's backward trace, so the
    fake mode (active, or carried by the tensors) is asked as well."""
    if torch.compiler.is_compiling():
        return True
    from torch._guards import detect_fake_mode

    return detect_fake_mode(tensors) is not None


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
    """Inside the op (statistics, gradients, the grad-in-forward path) autocast is off: the inputs were already cast as
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
_NUM_FLAT = sum(len(args) for _, args in _ARGUMENTS)
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


# The op's output: the statistics, one [N] row each (Statistics' order), then with named columns one row per
# column, log q there (core/columns.py).
@torch.library.custom_op("fusedloss::token_statistics", mutates_args=(),
                         schema=f"({_PROBLEM_SCHEMA}, str backend) -> Tensor")
def _statistics_op(*args) -> torch.Tensor:
    *flat, backend = args
    problem = _unflatten(flat)
    with _on_device_of(problem.hidden), autocast_off(problem.hidden.device):
        out = registry.get(backend).forward_statistics(problem)
        if problem.columns is None:
            return torch.stack(tuple(out))
        stats, logits = out
        return torch.cat((torch.stack(tuple(stats)), columns.log_probs(stats, logits, problem.columns).T))


@_statistics_op.register_fake
def _(*args):
    p = _unflatten(args[:-1])
    rows = _NUM_OUTPUTS + (0 if p.columns is None else p.columns.shape[1])
    return p.hidden.new_empty((rows, p.hidden.shape[0]), dtype=accumulation_dtype(p.hidden.dtype))


@torch.library.custom_op("fusedloss::token_statistics_backward", mutates_args=(),
                         schema=f"({_PROBLEM_SCHEMA}, str backend, Tensor stats, Tensor coeffs, "
                                f"{', '.join('bool ' + n for n in _NEEDS)}, Tensor? column_dz=None) "
                                "-> (Tensor, Tensor, Tensor)")
def _statistics_backward_op(*args) -> tuple:
    flat = args[:_NUM_FLAT]
    backend, stats, coeffs, need_hidden, need_weight, need_bias, *rest = args[_NUM_FLAT:]
    column_dz = rest[0] if rest else None  # (a default argument may not be passed on)
    problem = _unflatten(flat)
    needs = GradientNeeds(need_hidden, need_weight, need_bias and problem.bias is not None)
    named = {} if column_dz is None else {"column_dz": column_dz}
    with _on_device_of(problem.hidden), autocast_off(problem.hidden.device):
        grads = registry.get(backend).backward_gradients(problem, Statistics(*stats[:_NUM_OUTPUTS].unbind(0)),
                                                         coeffs, needs, **named)
    # custom ops cannot return None: an unneeded gradient travels as an empty tensor.
    return tuple(g if g is not None else problem.hidden.new_empty(0) for g in grads)


@_statistics_backward_op.register_fake
def _(*args):
    flat = args[:_NUM_FLAT]
    need_hidden, need_weight, need_bias = args[_NUM_FLAT + 3:_NUM_FLAT + 6]
    p = _unflatten(flat)
    return (
        torch.empty_like(p.hidden) if need_hidden else p.hidden.new_empty(0),
        torch.empty_like(p.weight) if need_weight else p.hidden.new_empty(0),
        torch.empty_like(p.bias) if need_bias and p.bias is not None else p.hidden.new_empty(0),
    )


# An unused statistic's gradient is None (``core/grad_in_forward.py`` takes it so from autograd): exactly 0.0 in every
# row,
# and the arithmetic it would feed is done on Python floats instead. The rules below keep every coefficient the
# bits the materialised zero rows gave (signed zeros included): -0.0 is the exact identity of +, while +0.0 is not
# (-0.0 + 0.0 = +0.0), and 0.0 - x differs from -x where x is +0.0.
_Term = Union[torch.Tensor, float]


def _negative_zero(x: _Term) -> bool:
    return isinstance(x, float) and x == 0.0 and math.copysign(1.0, x) < 0


def _add(x: _Term, y: _Term, out: Optional[torch.Tensor] = None) -> _Term:
    if isinstance(x, float) and isinstance(y, float):
        return x + y
    if isinstance(x, float):  # + commutes, in the sign of a zero sum too
        x, y = y, x
    if _negative_zero(y):
        return x
    return torch.add(x, y, out=out)


def _neg(x: _Term, out: Optional[torch.Tensor] = None) -> _Term:
    return -x if isinstance(x, float) else torch.neg(x, out=out)


def _sub(x: _Term, y: _Term, out: Optional[torch.Tensor] = None) -> _Term:
    """``x - y``; ``out``, when given, holds the running value ``x`` or is still all +0.0 (a fresh row)."""
    if isinstance(y, float):
        return _add(x, -y, out)  # x - c = x + (-c) exactly
    if isinstance(x, float):
        if _negative_zero(x):
            return torch.neg(y, out=out)  # -0.0 - y = -y
        if x == 0.0 and math.copysign(1.0, x) > 0 and out is not None:
            return out.sub_(y)  # the fresh row is the +0.0 operand
        x = torch.full_like(y, x)
    return torch.sub(x, y, out=out)


def _mul(x: _Term, k: float, out: Optional[torch.Tensor] = None) -> _Term:
    return x * k if isinstance(x, float) else torch.mul(x, k, out=out)


def _div(x: _Term, k: int, out: Optional[torch.Tensor] = None) -> _Term:
    if isinstance(x, float):
        return x / k if k else x * math.nan  # a tensor's 0 / 0 is NaN, Python's raises
    return torch.div(x, k, out=out)


def _times(g: _Term, stat: torch.Tensor) -> _Term:
    """g * stat, 0 where g is 0: a row outside the loss contributes nothing even where its statistic is +inf
    (a reverse KL next to a masked teacher entry; 0 * inf would be NaN in every row's d weight)."""
    if isinstance(g, float):
        if g == 0.0:
            return 0.0
        g = torch.full_like(stat, g)
    return (g * stat).masked_fill_(g == 0, 0.0)


def _put(row: torch.Tensor, value: _Term) -> None:
    """Write a coefficient into its row of the fresh (+0.0) coefficients, unless it is there already."""
    if isinstance(value, float):
        if not (value == 0.0 and math.copysign(1.0, value) > 0):
            row.fill_(value)
    elif value is not row:
        row.copy_(value)


def _fill_negative_zeros(coeffs: torch.Tensor, rows: list) -> None:
    """-0.0 into the given coefficient rows, with one fill where they are evenly spaced (c1 and c3 when neither
    the entropy's nor the forward KL's gradient is there: -(0.0) in the materialised form)."""
    if len(rows) == 1 or (len(rows) > 1 and len({b - a for a, b in zip(rows, rows[1:])}) == 1):
        step = rows[1] - rows[0] if len(rows) > 1 else 1
        coeffs[rows[0]:rows[-1] + 1:step].fill_(-0.0)
    else:
        for r in rows:
            coeffs[r].fill_(-0.0)


def dz_coefficients(grad, stats, jsd_beta: Optional[float], targets: Optional[torch.Tensor], vocab_size: int, *,
                    ignored: Optional[torch.Tensor] = None) -> torch.Tensor:
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

    ``grad`` and ``stats``: stacked ``[fields, rows]`` tensors, or one entry per field of ``Statistics``; an
    entry of ``grad`` may be None (the loss does not use that statistic: exactly 0.0, and the arithmetic it
    would feed is skipped, with the bits the zero rows would give). Rows whose target is < 0 get 0;
    ``ignored`` (``targets < 0`` already formed for these rows) replaces ``targets`` there.
    """
    if len(grad) != _NUM_OUTPUTS or len(stats) != _NUM_OUTPUTS:
        raise ValueError(f"grad and stats must hold the {_NUM_OUTPUTS} statistics of Statistics, got "
                         f"{len(grad)} and {len(stats)}")
    s = Statistics(*stats)
    g = Statistics(*(0.0 if x is None else x for x in grad))
    dtype = s.lse.dtype
    for x in g:
        if not isinstance(x, float) and x.dtype != dtype:  # (promote_types is an op of its own)
            dtype = torch.promote_types(dtype, x.dtype)
    # Out of place, formed apart and stacked: under create_graph=True (the gradients require grad, and out= ops
    # cannot be differentiated; the backward op's own error is then the one raised), and under torch.compile
    # (out= ops would fix the token count of the graph; the compiler fuses the small ops anyway).
    tensors = [x for x in (*g, *s) if isinstance(x, torch.Tensor)]
    tracked = _traced(tensors) or (torch.is_grad_enabled() and any(x.requires_grad for x in tensors))
    # (a, c0, c1, c2, c3, c4, c5); +0.0 where nothing is written. Each coefficient's last op writes its row.
    coeffs = None if tracked else torch.zeros((NUM_COEFFS, *s.lse.shape), dtype=dtype, device=s.lse.device)
    out = (None,) * NUM_COEFFS if tracked else coeffs.unbind(0)
    c0 = _sub(_add(g.lse, g.kl_fwd, out=out[1]), _times(g.entropy, s.entropy), out=out[1])
    if jsd_beta is None:
        c1, c4 = _neg(g.entropy, out=out[2]), 0.0
    else:
        # with no entropy term c1 is w itself (-0.0 + w), so w is formed in c1's row
        w = _mul(g.jsd, 1.0 - jsd_beta, out=out[2] if isinstance(g.entropy, float) else None)
        c0 = _sub(c0, _times(w, s.kl_qm), out=out[1])
        c1 = _add(_neg(g.entropy, out=out[2]), w, out=out[2])
        c4 = _neg(w, out=out[5])
    c3 = _neg(g.kl_fwd, out=out[4])
    c5 = _div(g.mean_logit, vocab_size, out=out[6])
    values = (g.logp, c0, c1, g.kl_rev, c3, c4, c5)
    if ignored is None and targets is not None:
        ignored = targets < 0
    if tracked:
        coeffs = torch.stack([c if isinstance(c, torch.Tensor) else s.lse.new_full(s.lse.shape, c, dtype=dtype)
                              for c in values])
        return coeffs if ignored is None else coeffs.masked_fill(ignored, 0.0)
    negative_zeros = []
    for i, c in enumerate(values):
        if _negative_zero(c):
            negative_zeros.append(i)
        else:
            _put(out[i], c)
    if negative_zeros:
        _fill_negative_zeros(coeffs, negative_zeros)
    if ignored is not None:
        coeffs.masked_fill_(ignored, 0.0)
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
    coeffs = dz_coefficients(grad_stats[:_NUM_OUTPUTS], stats[:_NUM_OUTPUTS], problem.jsd_beta, problem.targets,
                             vocab_size)
    column_dz = None
    if problem.columns is not None:  # the named columns' one-hot shares (core/columns.py)
        logp_row = Statistics._fields.index("logp")
        coeffs, column_dz = columns.gradients(coeffs, problem.columns, stats[_NUM_OUTPUTS:].T,
                                              grad_stats[_NUM_OUTPUTS:].T, problem.targets, grad_stats[logp_row])
    need_h, need_w, need_b = needs_input_grad[:3]
    need_b = need_b and problem.bias is not None
    dh, dw, db = _statistics_backward_op(*_flatten(problem), backend, stats, coeffs, need_h, need_w, need_b,
                                         column_dz)
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
                  teacher: Optional[TeacherHead] = None, columns: Optional[torch.Tensor] = None,
                  **wants) -> StatsProblem:
    """The StatsProblem of a call, with the teacher detached (gradients flow to the student only) and every
    option a plain Python value, so that torch.compile traces it without meeting a user-defined class."""
    if columns is not None and teacher is not None:
        raise ValueError("named columns (K log-probs per position) take no teacher: their dz has no teacher term")
    teacher_fields = {}
    if teacher is not None:
        teacher_fields = dict(
            teacher_hidden=teacher.hidden.detach(), teacher_weight=teacher.weight.detach(),
            teacher_bias=None if teacher.bias is None else teacher.bias.detach(),
            teacher_transform=_plain_transform(LogitTransform(teacher.temperature, teacher.logit_scale,
                                                              teacher.softcap)))
    flags = {k: _plain(_FIELD_TYPES[k], v) for k, v in wants.items()}
    return StatsProblem(hidden=hidden, weight=weight, bias=bias, targets=targets,
                        transform=_plain_transform(transform), columns=columns, **teacher_fields, **flags)


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


def column_statistics(hidden: torch.Tensor, weight: torch.Tensor, columns: torch.Tensor, *, backend: str = "torch",
                      **problem) -> tuple[Statistics, torch.Tensor]:
    """``token_statistics`` and the ``[N, K]`` log-probabilities at ``columns`` (int64 ids ``[N, K]``, -1 for
    none: 0 there), read from the same tiles (core/columns.py); each row's target, where it has one, is one of
    its columns. Differentiable in hidden, weight and bias."""
    out = _statistics_op(*_flatten(build_problem(hidden, weight, columns=columns, **problem)), backend)
    return Statistics(*out[:_NUM_OUTPUTS].unbind(0)), out[_NUM_OUTPUTS:].T
