"""The cost model counts the small kernels the CUDA backend's grad-in-forward path really issues.

A ``TorchDispatchMode`` logs every aten op of one forward and backward of each grad-in-forward loss (host mode: the
CUDA backend's code on CPU tensors, the kernels' host twins in place of the launches), at two chunk counts;
the difference is what one more row chunk costs, the rest what the call costs once. Views and allocations
(no kernel on a GPU) and the GEMM-sized products (priced apart) are left out. The model's constants
(benchmarks/model/cuda.py, ``small_launches``) must cover what the trace
counts without overstating it, so the model follows the code.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedloss
from benchmarks.model import cuda as cuda_model
from fusedloss.backends.cuda import backend as cuda
from fusedloss.core import registry

pytestmark = pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: {cuda.availability()}")

_PRODUCTS = {"mm", "addmm", "addmm_", "baddbmm", "bmm", "matmul"}
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "_local_scalar_dense", "set_", "resize_"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in _NO_KERNEL or name in _PRODUCTS):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _call(op: str, n: int, chunk_rows: int) -> int:
    g = torch.Generator().manual_seed(0)
    v, d = 97, 16
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    y = torch.randint(0, v, (n,), generator=g)
    with cuda.override_plan(grad_in_forward_rows=chunk_rows), _Count() as trace:
        if op == "cross_entropy":
            loss = fusedloss.cross_entropy(h, w, y, backend="cuda")
        elif op == "grpo":
            ids = y.view(4, n // 4)
            adv = torch.randn(4, generator=g)
            loss = fusedloss.grpo_loss(h.view(4, n // 4, d), w, ids, adv, torch.ones(4, n // 4), backend="cuda")
        else:
            th, tw = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
            beta = {"distill_reverse_kl": 1.0, "distill_forward_kl": 0.0, "distill_jsd": 0.5}[op]
            loss = fusedloss.distillation_loss(h, w, th, tw, beta=beta, backend="cuda")
        loss.backward()
    return len(trace.ops)


@pytest.fixture
def host_mode(monkeypatch):
    """The CUDA backend on CPU tensors (its host twins), the grad-in-forward path forced."""
    real = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else real(b, *rest))
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")


@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "distill_reverse_kl", "distill_forward_kl", "distill_jsd"])
def test_small_launches_per_chunk_and_per_call_are_what_the_model_counts(host_mode, op):
    two, four = _call(op, 64, 32), _call(op, 64, 16)
    per_chunk = (four - two) / 2
    per_call = two - 2 * per_chunk
    assert per_chunk > 0 and per_call > 0, (two, four)
    model_chunk, model_call = cuda_model.small_launches(op)
    # the model's figures cover the traced ops and overstate them by at most a third
    assert per_chunk <= model_chunk <= 1.34 * per_chunk, (op, per_chunk)
    assert per_call <= model_call <= 1.34 * per_call, (op, per_call)
