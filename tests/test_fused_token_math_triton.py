"""The fused per-token GRPO and per-pair DPO launches of the Triton backend (``fusedloss/triton/token_math``)
against the loss modules' math, values and gradients.

Two kinds of checks:

* per token / per pair, against ``grpo_terms`` / ``dpo_terms`` below: the torch ops of
  ``fusedloss/losses/grpo.py``'s ``token_terms`` (with ``token_log_ratio``) and of ``dpo.py``, written
  out on flat vectors and differentiated by autograd, in the same dtype as the launch, for every loss
  type, with and without old/ref log-probs, importance weights and delta, masked tokens (old log-prob
  -inf and ref NaN there), extreme log ratios (+-30), strided and broadcast (stride 0) inputs and sizes
  that are not a multiple of the block;
* end to end, against the modules themselves: ``grpo_loss`` / ``dpo_loss`` (torch backend) and the same
  loss assembled from the fused launch (aggregation weights of ``grpo._token_weights``, mean over pairs),
  compared in value and in the gradients of hidden and weight.

Criterion: norm-wise relative error (conftest.rel_err) and, element by element, |a - e| / max(|e|, 1)
(relative for large values, absolute below 1, where e^g - g - 1 cancels), both within 1e-6 for fp32 and
1e-12 for float64. Under the interpreter the kernels run on the CPU (conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedloss
from fusedloss.losses import dpo as dpo_module
from fusedloss.losses import grpo as grpo_module
from conftest import make_head, rel_err

triton_backend = pytest.importorskip("fusedloss.triton.backend")
if triton_backend.availability() != "available":  # pragma: no cover - depends on the machine
    pytest.skip(f"triton backend: {triton_backend.availability()}", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
GRPO_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
DPO_TYPES = ("sigmoid", "ipo", "hinge", "robust")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def assert_close(actual, expected, dtype, what):
    tol = TOL[dtype]
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    assert bool(torch.isfinite(a).all()), f"{what}: non-finite values {a}"
    err = rel_err(a, e)
    assert err <= tol, f"{what}: norm-wise relative error {err:.3e} > {tol:.0e}"
    elem = ((a - e).abs() / e.abs().clamp(min=1.0)).max().item() if a.numel() else 0.0
    assert elem <= tol, f"{what}: element-wise error {elem:.3e} > {tol:.0e}"


# ------------------------------------------------------------------------------------------------------
# The modules' math on flat vectors


def grpo_terms(logp, old, adv, ref, w, valid, *, loss_type, epsilon_low, epsilon_high, delta, beta):
    """grpo.py's token log-ratio and token_terms (the definition), token level; kl zeros when beta == 0."""
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    old_rows = logp.detach() if old is None else old
    log_ratio = torch.where(valid, logp - old_rows, torch.zeros_like(logp))
    loss, kl, ratio = grpo_module.token_terms(logp, log_ratio, adv, valid, ref_logprobs=ref, weights=w,
                                              loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=eps_high,
                                              delta=delta, beta=beta)
    return loss, torch.zeros_like(logp) if kl is None else kl, ratio


def dpo_terms(chosen, rejected, ref_c, ref_r, n_c, n_r, *, loss_type, beta, label_smoothing):
    """dpo.py's pair_losses (the definition); n: completion token counts."""
    n_c, n_r = n_c.to(chosen.dtype).clamp(min=1), n_r.to(chosen.dtype).clamp(min=1)
    return dpo_module.pair_losses(chosen - ref_c, rejected - ref_r, n_c, n_r, loss_type=loss_type, beta=beta,
                                  label_smoothing=label_smoothing)


# ------------------------------------------------------------------------------------------------------
# GRPO per token


def grpo_data(t, dtype, seed=0):
    """Log-probs in (-12, 0], log ratios mostly within +-0.6 with a few at +-30, advantages of both signs,
    a quarter of the tokens masked with an old log-prob of -inf and a ref log-prob of NaN there."""
    g = torch.Generator().manual_seed(seed)
    logp = -12 * torch.rand(t, generator=g, dtype=torch.float64) ** 2
    log_ratio = 0.6 * (2 * torch.rand(t, generator=g, dtype=torch.float64) - 1)
    log_ratio[3::17] = 30.0
    log_ratio[5::19] = -30.0
    old = logp - log_ratio
    ref = logp + 0.5 * torch.randn(t, generator=g, dtype=torch.float64)
    ref[7::23] = logp[7::23] + 30.0
    ref[9::29] = logp[9::29] - 30.0
    adv = torch.randn(t, generator=g, dtype=torch.float64)
    w = 0.5 + torch.rand(t, generator=g, dtype=torch.float64)
    valid = torch.rand(t, generator=g) > 0.25
    valid[0] = True
    old[~valid] = -math.inf
    ref[~valid] = math.nan
    cot = torch.randn(t, generator=g, dtype=torch.float64)
    return {k: x.to(DEVICE, dtype) if x.is_floating_point() else x.to(DEVICE)
            for k, x in dict(logp=logp, old=old, ref=ref, adv=adv, w=w, valid=valid, cot=cot).items()}


GRPO_OPTIONS = {
    "plain": dict(old=True, ref=False, w=False, delta=None, beta=0.0),
    "on_policy": dict(old=False, ref=False, w=False, delta=None, beta=0.0),
    "kl_weights": dict(old=True, ref=True, w=True, delta=None, beta=0.04),
    "delta_kl": dict(old=True, ref=True, w=False, delta=1.5, beta=-0.1),
    "on_policy_all": dict(old=False, ref=True, w=True, delta=2.0, beta=0.3),
}


def run_grpo_pair(d, dtype, loss_type, opts, eps=(0.2, 0.28)):
    kwargs = dict(loss_type=loss_type, epsilon_low=eps[0], epsilon_high=eps[1], delta=opts["delta"],
                  beta=opts["beta"])
    args = dict(old=d["old"] if opts["old"] else None, adv=d["adv"], ref=d["ref"] if opts["ref"] else None,
                w=d["w"] if opts["w"] else None, valid=d["valid"])
    out = {}
    for name, fn in (("fused", triton_backend.grpo_token_loss), ("module", grpo_terms)):
        logp = d["logp"].clone().requires_grad_(True)
        loss, kl, ratio = fn(logp, args["old"], args["adv"], args["ref"], args["w"], args["valid"], **kwargs)
        (grad,) = torch.autograd.grad((loss * d["cot"]).sum(), logp)
        out[name] = (loss, kl, ratio, grad)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("option", list(GRPO_OPTIONS))
@pytest.mark.parametrize("loss_type", GRPO_TYPES)
def test_grpo_token_loss_matches_module_math(loss_type, option, dtype):
    d = grpo_data(101, dtype)
    out = run_grpo_pair(d, dtype, loss_type, GRPO_OPTIONS[option])
    for i, what in enumerate(("loss", "kl", "ratio", "d loss / d logp")):
        fused, module = out["fused"][i], out["module"][i]
        assert fused.dtype == dtype
        assert_close(fused, module, dtype, f"{loss_type}/{option}/{what}")
    valid = d["valid"]
    assert bool((out["fused"][0][~valid] == 0).all()) and bool((out["fused"][3][~valid] == 0).all())


def test_grpo_masked_garbage_never_leaks_and_no_out_of_bounds():
    """NaN/inf anywhere at masked tokens (advantages and weights too, which the module itself would turn into
    a NaN gradient) give 0 there; strided and broadcast (stride 0) inputs; views into NaN-padded buffers."""
    t = 45
    d = grpo_data(t, torch.float32, seed=1)
    masked = ~d["valid"]
    adv, w = d["adv"].clone(), d["w"].clone()
    adv[masked], w[masked] = math.nan, math.inf
    pad = torch.full((2 * t + 64,), math.nan, device=DEVICE)
    logp_strided = pad.clone()
    logp_strided[: 2 * t : 2] = d["logp"]
    logp = logp_strided[: 2 * t : 2].clone().requires_grad_(True)
    assert logp.is_contiguous()
    logp_view = logp_strided[: 2 * t : 2]
    old_buf = pad.clone()
    old_buf[:t] = d["old"]
    kwargs = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, delta=1.5, beta=0.1)
    loss, kl, ratio = triton_backend.grpo_token_loss(logp, old_buf[:t], adv, d["ref"], w, d["valid"], **kwargs)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    for x in (loss, kl, ratio, grad):
        assert bool(torch.isfinite(x).all())
    assert bool((loss[masked] == 0).all()) and bool((grad[masked] == 0).all()) and bool((kl[masked] == 0).all())
    ok = d["valid"]
    expected = grpo_terms(d["logp"], d["old"], d["adv"], d["ref"], d["w"], ok, **kwargs)
    assert_close(loss[ok], expected[0][ok], torch.float32, "masked garbage: loss")
    # a strided logp (stride 2) and one advantage broadcast to every token (stride 0)
    adv0 = torch.tensor([0.7], device=DEVICE).expand(t)
    assert adv0.stride(0) == 0
    got = triton_backend.grpo_token_loss(logp_view, d["old"], adv0, None, None, d["valid"], loss_type="grpo",
                                         epsilon_low=0.2, epsilon_high=None, delta=None, beta=0.0)
    want = grpo_terms(d["logp"], d["old"], adv0.contiguous(), None, None, d["valid"], loss_type="grpo",
                      epsilon_low=0.2, epsilon_high=None, delta=None, beta=0.0)
    for a, e in zip(got, want):
        assert_close(a, e, torch.float32, "strided")
    # empty input
    empty = torch.zeros(0, device=DEVICE)
    outs = triton_backend.grpo_token_loss(empty, None, empty, None, None, empty.bool(), **kwargs)
    assert all(x.shape == (0,) for x in outs)


@pytest.mark.parametrize("size", [1, 31, 32, 33])
def test_grpo_sizes_around_the_block(size):
    d = grpo_data(size, torch.float64, seed=size)
    out = run_grpo_pair(d, torch.float64, "grpo", GRPO_OPTIONS["kl_weights"])
    for i in range(4):
        assert_close(out["fused"][i], out["module"][i], torch.float64, f"size {size}")


# ------------------------------------------------------------------------------------------------------
# DPO per pair


def dpo_data(b, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    chosen = -40 * torch.rand(b, generator=g, dtype=torch.float64)
    rejected = -40 * torch.rand(b, generator=g, dtype=torch.float64)
    ref_c = chosen + 3 * torch.randn(b, generator=g, dtype=torch.float64)
    ref_r = rejected + 3 * torch.randn(b, generator=g, dtype=torch.float64)
    # extreme margins: beta * Delta = +-30 for beta = 0.1
    ref_c[2::11] = chosen[2::11] - 150.0
    ref_r[2::11] = rejected[2::11] + 150.0
    ref_c[4::13] = chosen[4::13] + 150.0
    ref_r[4::13] = rejected[4::13] - 150.0
    n_c = torch.randint(0, 40, (b,), generator=g)
    n_r = torch.randint(0, 40, (b,), generator=g)
    cot = torch.randn(b, generator=g, dtype=torch.float64)
    f = (lambda x: x.to(DEVICE, dtype))
    return dict(chosen=f(chosen), rejected=f(rejected), ref_c=f(ref_c), ref_r=f(ref_r), n_c=n_c.to(DEVICE),
                n_r=n_r.to(DEVICE), cot=f(cot))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0),
                                                  ("robust", 0.0), ("robust", 0.2)])
def test_dpo_pair_loss_matches_module_math(loss_type, smoothing, dtype):
    d = dpo_data(77, dtype)
    kwargs = dict(loss_type=loss_type, beta=0.1, label_smoothing=smoothing)
    out = {}
    for name, fn in (("fused", triton_backend.dpo_pair_loss), ("module", dpo_terms)):
        c = d["chosen"].clone().requires_grad_(True)
        r = d["rejected"].clone().requires_grad_(True)
        loss = fn(c, r, d["ref_c"], d["ref_r"], d["n_c"], d["n_r"], **kwargs)
        gc, gr = torch.autograd.grad((loss * d["cot"]).sum(), (c, r))
        out[name] = (loss, gc, gr)
    assert out["fused"][0].dtype == dtype
    for i, what in enumerate(("loss", "d chosen", "d rejected")):
        assert_close(out["fused"][i], out["module"][i], dtype, f"{loss_type}/{smoothing}/{what}")
        if loss_type in ("sigmoid", "robust") and smoothing == 0:
            # -log sigmoid(x) and its derivative have no cancellation: relative accuracy even where they are
            # 1e-13 (beta Delta = 30), which log(1 + e^-x) without a log1p would round to 0
            a, e = out["fused"][i].double(), out["module"][i].double()
            worst = ((a - e).abs() / e.abs()).max().item()
            assert worst <= 4 * TOL[dtype], f"{loss_type}/{what}: element-wise relative error {worst:.2e}"


# ------------------------------------------------------------------------------------------------------
# End to end: the fused launches assembled into the modules' losses


@pytest.mark.parametrize("loss_type", GRPO_TYPES)
def test_grpo_loss_module_assembled_from_the_fused_launch(loss_type):
    from fusedloss.losses.grpo import _token_weights

    b, c, d, v = 3, 5, 7, 37
    h, w, bias, ids = make_head(b * c, d, v, leading=(b, c), bias=True, seed=2)
    ids = ids.clamp(min=0)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        logp0 = fusedloss.token_logprobs(h, w, ids, bias=bias, backend="torch")
    old = logp0 - 0.5 * torch.randn(b, c, generator=g, dtype=torch.float64)
    old[~mask] = -math.inf
    ref = logp0 + 0.3 * torch.randn(b, c, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.7, 0.4], dtype=torch.float64)
    weights = 0.5 + torch.rand(b, generator=g, dtype=torch.float64)
    opts = dict(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, delta=1.8 if loss_type != "cispo" else None,
                beta=0.05)
    h, w, bias = (x.to(DEVICE) for x in (h, w, bias))
    ids, mask, old, ref, adv, weights = (x.to(DEVICE) for x in (ids, mask, old, ref, adv, weights))

    grads = {}
    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, details = fusedloss.grpo_loss(hl, wl, ids, adv, mask, old_logprobs=old, ref_logprobs=ref, bias=bias,
                                        importance_weights=weights, return_details=True, backend="torch", **opts)
    grads["module"] = (loss,) + torch.autograd.grad(loss, (hl, wl))

    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp = fusedloss.token_logprobs(hl, wl, torch.where(mask, ids, torch.full_like(ids, -100)), bias=bias,
                                    backend="torch")
    per_token, kl, ratio = triton_backend.grpo_token_loss(
        logp.reshape(-1), old.reshape(-1), adv[:, None].expand(b, c).reshape(-1), ref.reshape(-1),
        weights[:, None].expand(b, c).reshape(-1), mask.reshape(-1), **opts)
    m = mask.to(torch.float64)
    fused = (_token_weights(m, loss_type, b, c, None, None, 1).reshape(-1) * per_token).sum()
    grads["fused"] = (fused,) + torch.autograd.grad(fused, (hl, wl))
    for what, a, e in zip(("loss", "d hidden", "d weight"), grads["fused"], grads["module"]):
        assert_close(a.reshape(-1), e.reshape(-1), torch.float64, f"{loss_type}: {what}")
    assert_close(((kl * m.reshape(-1)).sum() / m.sum()).reshape(1), details.kl.reshape(1), torch.float64, "kl metric")
    sign = adv[:, None].expand(b, c).reshape(-1)
    eps_high = 0.28
    high = (ratio > (eps_high if loss_type == "cispo" else 1 + eps_high)) & (sign > 0)
    assert_close(((high.to(m.dtype) * m.reshape(-1)).sum() / m.sum()).reshape(1),
                 details.clip_ratio_high.reshape(1), torch.float64, "clip_ratio_high")


@pytest.mark.parametrize("loss_type", DPO_TYPES)
def test_dpo_loss_module_assembled_from_the_fused_launch(loss_type):
    pairs, t, d, v = 3, 4, 7, 37
    h, w, bias, labels = make_head(2 * pairs * t, d, v, leading=(2 * pairs, t), bias=True, seed=5)
    labels = labels.clone()
    labels[:, 0] = -100
    labels[1, 1:3] = -100
    ref_c = torch.tensor([-9.0, -7.5, -30.0], dtype=torch.float64)
    ref_r = torch.tensor([-8.0, -10.0, -12.0], dtype=torch.float64)
    h, w, bias, labels, ref_c, ref_r = (x.to(DEVICE) for x in (h, w, bias, labels, ref_c, ref_r))
    smoothing = 0.1 if loss_type in ("sigmoid", "robust") else 0.0
    kwargs = dict(beta=0.2, loss_type=loss_type, label_smoothing=smoothing)

    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss, det = fusedloss.dpo_loss(hl, wl, labels, ref_c, ref_r, bias=bias, return_details=True, backend="torch",
                                   **kwargs)
    expected = (loss,) + torch.autograd.grad(loss, (hl, wl))

    hl, wl = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    _, det = fusedloss.dpo_loss(hl, wl, labels, ref_c, ref_r, bias=bias, return_details=True, backend="torch",
                                **kwargs)
    n = (labels != -100).sum(-1)
    fused = triton_backend.dpo_pair_loss(det.chosen_logps, det.rejected_logps, ref_c, ref_r, n[:pairs], n[pairs:],
                                         **kwargs).mean()
    got = (fused,) + torch.autograd.grad(fused, (hl, wl))
    for what, a, e in zip(("loss", "d hidden", "d weight"), got, expected):
        assert_close(a.reshape(-1), e.reshape(-1), torch.float64, f"{loss_type}: {what}")
