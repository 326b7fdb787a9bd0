"""The torch backend's grad-in-forward fast route (backends/torch.py: ``_grad_in_forward_partials``,
``_dz_from_frame``).

On a CPU a grad-in-forward chunk of a cross-entropy, GRPO or reverse-KL distillation loss forms its statistics in place
and its dz from the forward's exp(z - m), in fewer passes over the [rows, V] tile than the general route. Both
routes must give the same loss and gradients up to rounding: each case runs twice, the general route forced
once, and both are held to the float64 reference. The cases put the route's exceptions in front of it: -inf
logits (a masked vocabulary on either head, whose rows go back to the general route), ties at the student's
maximum, a teacher far above its logit at the student's maximum (the teacher sum taken at its own maximum),
ignored rows, a single row, a prime vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedloss
from fusedloss.backends import torch as torch_backend

V = 53  # prime


def _case(kind: str, dtype: torch.dtype, n: int = 9, d: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(V, d, generator=g, dtype=torch.float64)
    ht = 0.8 * h + 0.6 * torch.randn(n, d, generator=g, dtype=torch.float64)
    wt = w + 0.5 * torch.randn(V, d, generator=g, dtype=torch.float64)
    tb = None
    if kind == "ties":  # two equal maxima per row: the first one is the frame's column
        w[7] = w[3]
    elif kind == "masked_teacher":  # the teacher has no mass on some columns, among them a student maximum
        tb = torch.zeros(V, dtype=torch.float64)
        tb[:5] = -math.inf
        w[2] = 10.0 * h[0] / h[0].norm()  # row 0's maximum lands on a masked column
    elif kind == "far_teacher":  # teacher logits ~100 above its logit at the student's maximum
        tb = torch.zeros(V, dtype=torch.float64)
        tb[11] = 120.0
    targets = torch.randint(0, V, (n,), generator=g)
    targets[1] = -100
    cast = [t.to(dtype) for t in (h, w, ht, wt)]
    return cast, targets, None if tb is None else tb.to(dtype)


def _run(fn, leaves, fast: bool, monkeypatch):
    if not fast:
        monkeypatch.setattr(torch_backend, "_fast_route", lambda p: False)
    leaves = [t.clone().requires_grad_(i < 2) for i, t in enumerate(leaves)]
    loss = fn(*leaves)
    loss.backward()
    monkeypatch.undo()
    return loss.detach(), [t.grad for t in leaves]


def _losses(targets, teacher_bias):
    return {
        "cross_entropy": (lambda h, w, ht, wt: fusedloss.cross_entropy(h, w, targets, backend="torch"), 2),
        "distillation": (lambda h, w, ht, wt: fusedloss.distillation_loss(
            h, w, ht, wt, targets, beta=1.0, hard_weight=0.3, teacher_bias=teacher_bias, backend="torch"), 2),
    }


@pytest.mark.parametrize("kind", ["plain", "ties", "masked_teacher", "far_teacher"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss_name", ["cross_entropy", "distillation"])
def test_fast_route_matches_the_general_route_and_float64(kind, dtype, loss_name, monkeypatch):
    leaves, targets, tb = _case(kind, dtype)
    fn, used = _losses(targets, tb)[loss_name]
    calls = []
    real = torch_backend._dz_from_frame
    monkeypatch.setattr(torch_backend, "_dz_from_frame", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast_loss, fast_grads = _run(fn, leaves, True, monkeypatch)
    assert calls, "the grad-in-forward chunk did not take the fast route"
    slow_loss, slow_grads = _run(fn, leaves, False, monkeypatch)
    ref_fn, _ = _losses(targets, None if tb is None else tb.double())[loss_name]
    ref_loss, ref_grads = _run(ref_fn, [t.double() for t in leaves], False, monkeypatch)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    assert torch.isfinite(fast_loss) == torch.isfinite(slow_loss)
    if torch.isfinite(slow_loss):
        torch.testing.assert_close(fast_loss, slow_loss, **tol)
        torch.testing.assert_close(fast_loss.double(), ref_loss, **tol)
    for fast, slow, ref in list(zip(fast_grads, slow_grads, ref_grads))[:used]:
        assert torch.equal(torch.isfinite(fast), torch.isfinite(slow))
        keep = torch.isfinite(slow)
        torch.testing.assert_close(fast[keep], slow[keep], **tol)
        torch.testing.assert_close(fast[keep].double(), ref[keep], **tol)


def test_rows_with_an_infinite_column_go_back_to_the_general_route(monkeypatch):
    """A teacher with -inf logits puts 0 x inf into the fast route's dz on those rows: they must be formed
    again on the general route (and only they), giving the general route's gradient."""
    leaves, targets, tb = _case("masked_teacher", torch.float32)
    redone = []
    real = torch_backend._general_rows
    monkeypatch.setattr(torch_backend, "_general_rows",
                        lambda q, rows, bad, *a: redone.append(bad.clone()) or real(q, rows, bad, *a))
    fn, _ = _losses(targets, tb)["distillation"]
    _, grads = _run(fn, leaves, True, monkeypatch)
    assert redone and 0 < sum(b.numel() for b in redone) < leaves[0].shape[0]
    _, general = _run(fn, leaves, False, monkeypatch)
    for fast, slow in zip(grads[:2], general[:2]):
        torch.testing.assert_close(fast, slow, rtol=2e-5, atol=2e-6, equal_nan=True)


def test_the_teacher_sum_at_its_own_maximum_where_the_frame_overflows():
    """exp(z_t - z_t[first max]) overflows when a teacher logit lies 88 above its value at the student's
    maximum: those rows take the teacher's maximum, and the teacher's log-normaliser stays exact."""
    z = torch.zeros(2, 6)
    z[:, 0] = 1.0  # the student's maximum: column 0
    zt = torch.zeros(2, 6)
    zt[0, 4] = 200.0  # row 0: exp(200) overflows in the frame of column 0
    scratch = torch_backend.Scratch(z.device, z.dtype)

    class Problem:
        want_entropy = want_kl_fwd = want_extras = want_mean_logit = False
        jsd_beta = None
        want_kl_rev = True

    part, frame, _ = torch_backend._grad_in_forward_partials(z.clone(), zt.clone(), Problem(), None, scratch)
    lse_t = part["mt"] + torch.log(part["st"])
    torch.testing.assert_close(lse_t, torch.logsumexp(zt, 1), rtol=1e-6, atol=1e-6)
    assert torch.isfinite(part["st"]).all()
