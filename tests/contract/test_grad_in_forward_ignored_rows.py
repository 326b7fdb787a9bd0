"""Rows without a target cost nothing on the 3-product path: they are gathered away before the products.

A padded GRPO batch (a quarter or more of its completion positions masked) or a cross-entropy batch with prompt
tokens ignored spends the ignored rows' share of all three GEMM-sized products for nothing unless the backend
only sees the valid rows. These tests pin both halves: every backend's ``grad_in_forward_gradients`` is handed only the
valid
rows, and the loss and every gradient equal those of the same loss on materialised float64 logits (ignored rows:
exactly zero gradient).
"""

from __future__ import annotations

import pytest
import torch
from _errors import rel_err

import fusedloss
from fusedloss import reference
from fusedloss.core import registry


def _recording(monkeypatch, backend):
    """Record the row count of every problem the backend's grad-in-forward path is handed."""
    seen = []
    module = registry.get(backend)
    original = module.grad_in_forward_gradients

    def grad_in_forward_gradients(p, chunk_fn, needs):
        seen.append(p.hidden.shape[0])
        return original(p, chunk_fn, needs)

    monkeypatch.setattr(module, "grad_in_forward_gradients", grad_in_forward_gradients)
    return seen


def _head(n, v, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.5
    w[3] += 25.0 * h.mean(0) / h.mean(0).norm() ** 2  # a peaked column
    return (h.to(device, dtype).requires_grad_(True), w.to(device, dtype).requires_grad_(True))


def _tol(dtype):
    return 1e-9 if dtype == torch.float64 else 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_sees_only_valid_rows(backend, device, dtype, monkeypatch):
    if backend != "torch" and dtype == torch.float64 and device.type == "cpu":
        pytest.skip("the Triton interpreter runs fp32/fp16 here")
    n, v, d = 13, 131, 19
    h, w = _head(n, v, d, dtype, device)
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1)).to(device)
    y[[0, 4, 5, 11]] = -100
    seen = _recording(monkeypatch, backend)
    loss = fusedloss.cross_entropy(h, w, y, backend=backend, grad_in_forward=True)
    loss.backward()
    assert seen == [n - 4]

    h64 = h.detach().double().cpu().requires_grad_(True)
    w64 = w.detach().double().cpu().requires_grad_(True)
    ref = reference.cross_entropy(h64, w64, y.cpu())
    ref.backward()
    tol = _tol(dtype)
    assert rel_err(loss, ref) < tol
    assert rel_err(h.grad, h64.grad) < tol
    assert rel_err(w.grad, w64.grad) < tol
    assert torch.equal(h.grad[[0, 4, 5, 11]].cpu(), torch.zeros(4, d, dtype=dtype))


def test_grpo_masked_positions_skip_the_products(backend, device, monkeypatch):
    b, c, v, d = 3, 5, 37, 24
    g = torch.Generator().manual_seed(2)
    h, w = _head(b * c, v, d, torch.float32, device)
    hidden = h.detach().reshape(b, c, d).requires_grad_(True)
    ids = torch.randint(0, v, (b, c), generator=g).to(device)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool, device=device)
    adv = torch.randn(b, generator=g).to(device)
    seen = _recording(monkeypatch, backend)
    loss = fusedloss.grpo_loss(hidden, w, ids, adv, mask, backend=backend, grad_in_forward=True)
    loss.backward()
    assert seen == [int(mask.sum())]

    h64 = hidden.detach().double().cpu().requires_grad_(True)
    w64 = w.detach().double().cpu().requires_grad_(True)
    ref = reference.grpo_loss(h64, w64, ids.cpu(), adv.cpu(), mask.cpu())
    ref.backward()
    assert rel_err(loss, ref) < 1e-5
    assert rel_err(hidden.grad, h64.grad) < 1e-5
    assert rel_err(w.grad, w64.grad) < 1e-5
    assert torch.equal(hidden.grad[~mask].cpu(), torch.zeros(int((~mask).sum()), d))


def test_every_row_ignored(backend, device):
    n, v, d = 7, 37, 19
    h, w = _head(n, v, d, torch.float32, device)
    y = torch.full((n,), -100, device=device)
    loss = fusedloss.cross_entropy(h, w, y, backend=backend, grad_in_forward=True)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(h.grad).item() == 0
    assert torch.count_nonzero(w.grad).item() == 0
