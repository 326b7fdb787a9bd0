"""torch.autograd.gradcheck in float64 for every op and backend (docs/design.md, "Numerical doctrine").

Finite differences against the analytic backward of the public functions, on tiny peaked shapes with a
prime vocabulary. The Triton interpreter is slow, so every backend uses gradcheck's fast mode (a
random projection of the Jacobian instead of every column); so does the torch backend, to keep CI fast.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_head, make_teacher, peak_ids_of

import fusedloss
from fusedloss import reference

N, D, V = 4, 7, 37


@pytest.fixture(autouse=True)
def _deterministic_backward(monkeypatch):
    """gradcheck runs the backward twice and demands bit-identical results (nondet_tol=0): the Triton
    backward's atomic adds are not reproducible at realistic sizes, so gradcheck uses the deterministic mode."""
    monkeypatch.setenv("FUSEDLOSS_DETERMINISTIC", "1")


def _check(fn, inputs, backend):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def _head(device, *, bias=True, leading=None, seed=0, ignore_fraction=0.2):
    h, w, b, t = make_head(N, D, V, bias=True, leading=leading, seed=seed, ignore_fraction=ignore_fraction)
    # the peaks of make_head (+30) give probabilities of 1e-13 off the peak: finite differences of size
    # 1e-6 would see nothing there. Scale them down so every entry of the Jacobian is exercised.
    h, w = h * 0.3, w.clone()
    leaves = [h.to(device).requires_grad_(True), w.to(device).requires_grad_(True)]
    if bias:
        leaves.append(b.to(device).requires_grad_(True))
    return leaves, t.to(device)


@pytest.mark.parametrize("return_entropy", [False, True])
def test_gradcheck_token_logprobs(backend, device, return_entropy):
    leaves, t = _head(device)

    def fn(h, w, b):
        return fusedloss.token_logprobs(h, w, t, bias=b, temperature=0.8, logit_scale=1.2, softcap=5.0,
                                        return_entropy=return_entropy, backend=backend)

    _check(fn, leaves, backend)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck_cross_entropy(backend, device, reduction):
    leaves, t = _head(device)

    def fn(h, w, b):
        return fusedloss.cross_entropy(h, w, t, bias=b, reduction=reduction, label_smoothing=0.1, z_loss=1e-2,
                                       temperature=1.3, backend=backend)

    _check(fn, leaves, backend)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_gradcheck_distillation_loss(backend, device, beta):
    leaves, t = _head(device)
    ht, wt, bt = make_teacher(N, 6, V, bias=True, seed=3, peak_ids=peak_ids_of(V, 0))
    ht, wt, bt = (ht * 0.3).to(device), wt.to(device), bt.to(device)

    def fn(h, w, b):
        return fusedloss.distillation_loss(h, w, ht, wt, t, beta=beta, temperature=1.5, hard_weight=0.3,
                                           t_squared=True, bias=b, teacher_bias=bt, reduction="none",
                                           backend=backend)

    _check(fn, leaves, backend)


@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("dapo", "token"), ("cispo", "token"),
                                              ("bnpo", "sequence"), ("dr_grpo", "token")])
def test_gradcheck_grpo_loss(backend, device, loss_type, level):
    leaves, _ = _head(device, leading=(2, 3))
    h, w, b = leaves
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (2, 3), generator=g).to(device)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)
    with torch.no_grad():
        logp = reference.token_logprobs(h.cpu(), w.cpu(), ids.cpu(), bias=b.cpu())
    # ratios away from every clip boundary: finite differences must not cross a kink. CISPO's weight
    # sg(min(r, eps_high)) is a stop-gradient, which finite differences cannot see unless it is constant:
    # with eps_high = eps_low = 0.2 every ratio here is capped, so it is.
    ratios = torch.tensor([[0.5, 1.0, 1.1], [1.7, 0.9, 1.0]], dtype=torch.float64)
    if level == "sequence":
        ratios = torch.tensor([[0.6], [1.1]], dtype=torch.float64).expand(2, 3)
    old = (logp - ratios.log()).to(device)
    ref = (logp + 0.2).to(device)
    adv = torch.tensor([1.0, -0.7], dtype=torch.float64, device=device)

    def fn(h, w, b):
        loss, details = fusedloss.grpo_loss(h, w, ids, adv, mask, old_logprobs=old, ref_logprobs=ref, bias=b,
                                            loss_type=loss_type, beta=0.1, importance_sampling_level=level,
                                            return_details=True, backend=backend)
        return loss, details.logprobs

    _check(fn, leaves, backend)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust"])
def test_gradcheck_dpo_loss(backend, device, loss_type):
    leaves, labels = _head(device, leading=(4, 3), ignore_fraction=0.0)
    labels = labels.clone()
    labels[:, 0] = -100
    ref_c = torch.tensor([-9.0, -7.5], dtype=torch.float64, device=device)
    ref_r = torch.tensor([-8.0, -10.0], dtype=torch.float64, device=device)

    def fn(h, w, b):
        loss, det = fusedloss.dpo_loss(h, w, labels, ref_c, ref_r, beta=0.2, loss_type=loss_type,
                                       label_smoothing=0.1 if loss_type in ("sigmoid", "robust") else 0.0,
                                       bias=b, softcap=4.0, return_details=True, backend=backend)
        return loss, det.chosen_logps, det.rejected_logps

    _check(fn, leaves, backend)


def test_gradcheck_reference_grpo_kink_free():
    """The reference itself, through gradcheck, on the clip example's unclipped side (ratio 1.1 inside
    [0.8, 1.2]): the gradient is A * r * grad logp."""
    h = torch.ones(1, 1, 1, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[math.log(0.55)], [math.log(0.45)]], dtype=torch.float64, requires_grad=True)
    old = torch.full((1, 1), math.log(0.5), dtype=torch.float64)

    def fn(h, w):
        return reference.grpo_loss(h, w, torch.tensor([[0]]), torch.tensor([1.0], dtype=torch.float64),
                                   torch.ones(1, 1), old_logprobs=old)

    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("op", ["cross_entropy", "distillation_loss", "grpo_loss", "dpo_loss", "token_logprobs"])
def test_backward_twice_with_retain_graph(backend, device, op):
    """Autograd semantics: a graph kept with retain_graph=True can be differentiated again, with the
    same result (gradcheck relies on it, and so do trainers that probe gradients)."""
    (h, w, b), t = _head(device)
    if op == "cross_entropy":
        loss = fusedloss.cross_entropy(h, w, t, bias=b, backend=backend)
    elif op == "token_logprobs":
        loss = fusedloss.token_logprobs(h, w, t, bias=b, backend=backend).sum()
    elif op == "distillation_loss":
        loss = fusedloss.distillation_loss(h, w, h.detach(), w.detach() * 0.5, t, bias=b, backend=backend)
    elif op == "grpo_loss":
        mask = torch.ones(1, N, dtype=torch.bool, device=device)
        adv = torch.tensor([0.7], dtype=torch.float64, device=device)
        loss = fusedloss.grpo_loss(h[None], w, t.clamp(min=0)[None], adv, mask, bias=b, backend=backend)
    else:
        labels = t.clamp(min=0).reshape(2, 2)
        ref = torch.tensor([-5.0], dtype=torch.float64, device=device)
        loss = fusedloss.dpo_loss(h.reshape(2, 2, D), w, labels, ref, ref - 1.0, bias=b, backend=backend)
    first = torch.autograd.grad(loss, (h, w, b), retain_graph=True)
    second = torch.autograd.grad(loss, (h, w, b))
    for a, c in zip(first, second):
        assert torch.equal(a, c)
    assert float(first[0].abs().max()) > 0
