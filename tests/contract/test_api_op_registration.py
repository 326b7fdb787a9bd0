"""``torch.library.opcheck`` on the statistics ops: schema, fake (meta) implementation, autograd registration
and AOT dispatch agree with the real implementation, for every backend that runs here.

The op's schema is generated from ``StatsProblem``'s fields (core/statistics.py); these checks catch a
generated schema, fake or backward that disagrees with what the backends return. Inputs: the problems that
exercise every argument kind (optional tensors present and absent, a teacher, soft-cap set and None, JSD's
optional float)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import BACKENDS

from fusedloss.core import statistics
from fusedloss.core.problem import LogitTransform, StatsProblem
from fusedloss.core.statistics import TeacherHead, build_problem

N, D, V = 5, 8, 37


def _problem(kind: str, dtype=torch.float64) -> StatsProblem:
    g = torch.Generator().manual_seed(7)
    h = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    y[1] = -1  # an ignored row
    if kind == "plain":
        return build_problem(h, w, targets=y, want_entropy=True)
    if kind == "bias_softcap_extras":
        return build_problem(h, w, bias=b, targets=y, transform=LogitTransform(0.7, 1.3, 5.0), want_entropy=True,
                             want_mean_logit=True, want_extras=True)
    teacher = TeacherHead(torch.randn(N, D, generator=g, dtype=dtype), torch.randn(V, D, generator=g, dtype=dtype),
                          None, 0.7)
    if kind == "teacher_kl":
        return build_problem(h, w, targets=None, transform=LogitTransform(0.7), teacher=teacher, want_kl_rev=True,
                             want_kl_fwd=True)
    return build_problem(h, w, targets=y, transform=LogitTransform(0.7), teacher=teacher, jsd_beta=0.3)


KINDS = ("plain", "bias_softcap_extras", "teacher_kl", "teacher_jsd")


def test_schema_is_generated_from_every_problem_field():
    """Every field of StatsProblem reaches the op: a field added to the table cannot be forgotten."""
    schema = str(statistics._statistics_op._opoverload._schema)
    for f in dataclasses.fields(StatsProblem):
        assert f.name in schema, f.name
    p = _problem("teacher_jsd")
    assert statistics._unflatten(statistics._flatten(p)) == p


# The Triton interpreter is slow: one problem covers the op's registration there (the kernels themselves are
# tested on every kind of problem in test_triton_kernels.py).
CASES = [(b, k) for b in BACKENDS for k in (KINDS if b != "triton" else ("plain",))]


@pytest.mark.parametrize("backend_name, kind", CASES)
def test_opcheck_forward_op(backend_name, kind):
    backend = backend_name
    p = _problem(kind, torch.float32 if backend == "triton" else torch.float64)
    if backend == "cuda":  # host twins take fp32; float64 problems are delegated to the torch backend
        p = dataclasses.replace(p, hidden=p.hidden.detach().float().requires_grad_(),
                                weight=p.weight.detach().float().requires_grad_(),
                                bias=None if p.bias is None else p.bias.detach().float().requires_grad_(),
                                teacher_hidden=None if p.teacher_hidden is None else p.teacher_hidden.float(),
                                teacher_weight=None if p.teacher_weight is None else p.teacher_weight.float())
    torch.library.opcheck(statistics._statistics_op, (*statistics._flatten(p), backend))


@pytest.mark.parametrize("kind", KINDS)
def test_opcheck_backward_op(kind):
    p = _problem(kind)
    # The backward op is first-order only (double backward is refused by the autograd wiring): detached inputs.
    flat = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in statistics._flatten(p))
    stats = statistics._statistics_op(*flat, "torch")
    coeffs = statistics.dz_coefficients(torch.randn_like(stats), stats, p.jsd_beta, p.targets, V)
    torch.library.opcheck(statistics._statistics_backward_op,
                          (*flat, "torch", stats, coeffs, True, True, p.bias is not None),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_opcheck_with_named_columns():
    """Named columns (core/columns.py): the forward op's extra rows (log q at the columns) and the backward op's
    given dz of those columns."""
    p = _problem("plain")
    g = torch.Generator().manual_seed(3)
    columns = torch.randint(0, V, (N, 3), generator=g)
    columns[:, 0] = p.targets.clamp(min=0)  # each row's target is one of its columns
    columns[p.targets < 0] = -1
    p = dataclasses.replace(p, columns=columns)
    torch.library.opcheck(statistics._statistics_op, (*statistics._flatten(p), "torch"))
    flat = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in statistics._flatten(p))
    stats = statistics._statistics_op(*flat, "torch")
    assert stats.shape == (len(statistics.Statistics._fields) + 3, N)
    column_dz = torch.randn(N, 3, generator=g, dtype=stats.dtype)
    rows = len(statistics.Statistics._fields)
    coeffs = statistics.dz_coefficients(torch.randn_like(stats[:rows]), stats[:rows], None, p.targets, V)
    torch.library.opcheck(statistics._statistics_backward_op,
                          (*flat, "torch", stats, coeffs, True, True, False, column_dz),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
