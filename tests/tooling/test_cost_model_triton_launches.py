"""The cost model counts the small launches the Triton backend really issues.

A ``TorchDispatchMode`` logs every aten op of one forward and backward (the interpreter on CPU tensors, where
the backend's Python is the GPU's), and the backend's own kernel launches are counted apart. Views and
allocations (no kernel on a GPU) and the GEMM-sized products (priced apart) are left out, and so are the aten
ops the interpreter itself runs inside a kernel. The grad-in-forward path runs at two chunk counts (the difference is
what one more chunk costs, the rest what the call costs once); the composable one at two backward block
counts. The model's figures (benchmarks/model/triton.py, ``small_launches``) must cover what the trace counts
without overstating it by more than a third, so the model follows the code.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedloss
from benchmarks.model import triton as triton_model
from fusedloss.backends.triton import backend as tb
from fusedloss.backends.triton import plan as tb_plan

_PRODUCTS = {"mm", "addmm", "addmm_", "baddbmm", "bmm", "matmul"}
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "_local_scalar_dense", "set_", "resize_"}
N, V, D = 64, 97, 16


class _Trace(TorchDispatchMode):
    """Small aten ops and kernel launches (``_Launch.run``); nothing inside a kernel's interpretation."""

    def __init__(self):
        super().__init__()
        self.ops, self.kernels, self.inside = 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (self.inside or func.is_view or name in _NO_KERNEL or name in _PRODUCTS):
            self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def trace(monkeypatch):
    mode = _Trace()
    real = tb._Launch.run

    def run(self, *args, **kwargs):
        mode.kernels += 1
        mode.inside = True
        try:
            return real(self, *args, **kwargs)
        finally:
            mode.inside = False

    monkeypatch.setattr(tb._Launch, "run", run)
    return mode


def _inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    return g, h, w, torch.randint(0, V, (N,), generator=g)


def _loss(op: str, workspace_mb: float):
    g, h, w, y = _inputs()
    kw = dict(backend="triton", workspace_mb=workspace_mb)
    if op == "cross_entropy":
        return fusedloss.cross_entropy(h, w, y, **kw)
    if op == "grpo":
        ids, adv = y.view(4, N // 4), torch.randn(4, generator=g)
        return fusedloss.grpo_loss(h.view(4, N // 4, D), w, ids, adv, torch.ones(4, N // 4), **kw)
    if op == "token_logprobs_entropy":
        lp, ent = fusedloss.token_logprobs(h, w, y, return_entropy=True, **kw)
        return lp.sum() + ent.sum()
    th, tw = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    beta = {"distill_reverse_kl": 1.0, "distill_forward_kl": 0.0, "distill_jsd": 0.5}[op]
    return fusedloss.distillation_loss(h, w, th, tw, beta=beta, **kw)


def _count(trace: _Trace, op: str, workspace_mb: float) -> int:
    trace.ops = trace.kernels = 0
    with trace:
        _loss(op, workspace_mb).backward()
    return trace.ops + trace.kernels


def _within(model: float, traced: float) -> bool:
    return traced <= model <= 1.34 * traced


def _grad_in_forward_row_mb(op: str, rows: int) -> float:
    """A workspace of ``rows`` grad-in-forward rows (the plan's ``grad_in_forward_rows``)."""
    return rows * tb_plan.grad_in_forward_row_bytes(V, "float32", op.startswith("distill")) / 2**20


@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "distill_reverse_kl", "distill_forward_kl", "distill_jsd"])
def test_grad_in_forward_small_launches_are_what_the_model_counts(trace, monkeypatch, op):
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")
    _count(trace, op, _grad_in_forward_row_mb(op, 32))  # a first call's one-time work (probes, caches) is not per call
    two, four = _count(trace, op, _grad_in_forward_row_mb(op, 32)), _count(trace, op, _grad_in_forward_row_mb(op, 16))
    per_chunk = (four - two) / 2
    per_call = two - 2 * per_chunk
    assert per_chunk > 0 and per_call > 0, (two, four)
    s = triton_model.small_launches(op)
    # a chunk: its statistics kernel (1) and merge, with a teacher the fold (its kernel and merge) and the
    # JSD's second sweep (its kernel and a stack), and the rest of the chunk
    teacher = 1 + triton_model.TEACHER_FOLD_MERGE_LAUNCHES if op.startswith("distill") else 0
    jsd = 2 if op == "distill_jsd" else 0
    assert _within(1 + s.merge + teacher + jsd + s.chunk, per_chunk), (op, per_chunk, s)
    assert _within(s.call, per_call), (op, per_call, s)


def test_composable_small_launches_are_what_the_model_counts(trace, monkeypatch):
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "0")
    op = "token_logprobs_entropy"
    _count(trace, op, 1.0)
    one, eight = _count(trace, op, 1.0), _count(trace, op, 0.005)  # 1 and 8 backward blocks
    per_block = (eight - one) / 7
    per_call = one - per_block
    s = triton_model.small_launches(op)
    assert _within(triton_model.BACKWARD_BLOCK_LAUNCHES, per_block), per_block
    # the forward's statistics kernel (1) and its merge, and the backward's own small ops
    assert _within(1 + s.merge + s.call, per_call), (per_call, s)
