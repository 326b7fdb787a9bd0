"""core/grad_in_forward.py::scaled_gradient, the grad-in-forward path's backward: the stored gradient times the incoming
scalar,
rounded once, the scalar never rounded to the gradient's half precision."""

from __future__ import annotations

import pytest
import torch

from fusedloss.core.grad_in_forward import scaled_gradient


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_once_in_fp32_and_rounded_once(stored):
    g = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)).to(stored)
    grad = torch.tensor(0.7)  # bf16(0.7) = 0.69921875: a scale rounded first would be off by 0.11%
    out = scaled_gradient(g, grad, torch.bfloat16)
    want = (g.double() * 0.7).float().to(torch.bfloat16)  # fp32 product, one rounding to bf16
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert not torch.equal(out, (g * grad.to(stored)).to(torch.bfloat16)) or stored == torch.float32


def test_the_stored_gradient_is_left_as_it_is_and_float64_stays_float64():
    g = torch.randn(5, 3, dtype=torch.float64)
    keep = g.clone()
    out = scaled_gradient(g, torch.tensor(3.0, dtype=torch.float64), torch.float64)
    assert torch.equal(g, keep) and out.dtype == torch.float64 and torch.equal(out, g * 3.0)
    vec = scaled_gradient(torch.ones(7), torch.tensor(2.0), torch.float32)
    assert torch.equal(vec, torch.full((7,), 2.0))
