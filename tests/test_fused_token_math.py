"""The CUDA backend's fused per-token GRPO and per-pair DPO math against the loss modules' own math.

``fusedloss.cuda.backend.grpo_token_loss`` / ``dpo_pair_loss`` run SPEC section 5's per-token (per-pair)
math in one launch that also writes the derivative; the loss modules (fusedloss/losses/grpo.py,
dpo.py) stay the single readable definition. Here the launches run through the extension's host twins
(CPU tensors: the same ``__host__ __device__`` code as the kernels) and are compared, values AND
gradients, with

* ``ref_token_terms`` / ``ref_dpo``: grpo.py's ``token_terms`` and dpo.py's per-pair formulas copied
  verbatim, differentiated by autograd, in the same dtype (fp32: within 1e-6, float64: within 1e-12);
* the public ``fusedloss.grpo_loss`` / ``dpo_loss`` end to end, with the torch backend made to dispatch
  to the fused functions, against the same call without them.

Every loss type, with and without old/ref log-probs, importance weights and delta, masked tokens with
garbage (an old log-prob of -inf, a NaN reference) at masked positions, and extreme log-ratios (+-30).
The Triton counterpart lives in tests/test_fused_token_math_triton.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusedloss.cuda import backend as cuda
from fusedloss.losses import dpo as dpo_module
from fusedloss.losses import grpo as grpo_module

pytestmark = pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: {cuda.availability()}")

GRPO_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
DPO_TYPES = ("sigmoid", "ipo", "hinge", "robust")
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def close(got: torch.Tensor, want: torch.Tensor, dtype, what: str) -> None:
    assert got.dtype == want.dtype == dtype, (what, got.dtype, want.dtype)
    tol = TOL[dtype]
    assert not torch.isnan(got).any(), f"{what}: NaN"
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------------
# GRPO
# ------------------------------------------------------------------------------------------------
def ref_token_terms(logp, old, adv, ref, weights, valid, *, loss_type, epsilon_low, eps_high, delta, beta):
    """fusedloss/losses/grpo.py's token log-ratio and token_terms (the definition), on flat [T] tensors."""
    old_rows = logp.detach() if old is None else old
    log_ratio = torch.where(valid, logp - old_rows, torch.zeros_like(logp))
    return grpo_module.token_terms(logp, log_ratio, adv, valid, ref_logprobs=ref, weights=weights,
                                   loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=eps_high, delta=delta,
                                   beta=beta)


VARIANTS = {
    # name: (old, ref + beta, importance weights, delta)
    "on_policy": (False, False, False, False),
    "on_policy_kl": (False, True, False, False),
    "off_policy": (True, False, False, False),
    "off_policy_delta": (True, False, False, True),
    "full": (True, True, True, True),
}


def grpo_data(dtype, variant, *, seed=0, t=53):
    has_old, has_ref, has_iw, has_delta = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(t, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(t, generator=g, dtype=torch.float64)
    valid = torch.rand(t, generator=g) > 0.25
    valid[0] = True
    old = logp + torch.randn(t, generator=g, dtype=torch.float64) * 0.4 if has_old else None
    ref = logp + torch.randn(t, generator=g, dtype=torch.float64) * 0.5 if has_ref else None
    iw = torch.rand(t, generator=g, dtype=torch.float64) * 2 + 0.1 if has_iw else None
    if old is not None:
        # extreme log-ratios (+-30) on valid tokens, with both signs of the advantage
        for i, (lr, sign) in enumerate(((30.0, 1.0), (30.0, -1.0), (-30.0, 1.0), (-30.0, -1.0))):
            k = 1 + i
            valid[k] = True
            old[k] = logp[k] - lr
            adv[k] = sign * abs(float(adv[k])) + sign * 0.1
        # garbage at masked positions: must not produce NaN anywhere
        valid[-1] = valid[-2] = False
        old[-1] = -math.inf
        old[-2] = math.inf
    if ref is not None:
        ref[5] = logp[5] + 30.0  # extreme KL gaps
        ref[6] = logp[6] - 30.0
        valid[5] = valid[6] = True
        valid[-3] = False
        ref[-3] = math.nan
    cast = (lambda x: None if x is None else x.to(dtype))  # noqa: E731
    return dict(logp=logp.to(dtype), old=cast(old), adv=adv.to(dtype), ref=cast(ref), iw=cast(iw), valid=valid,
                beta=0.04 if has_ref else 0.0, delta=1.7 if has_delta else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("loss_type", GRPO_TYPES)
def test_grpo_token_loss_matches_module_math(loss_type, variant, dtype):
    d = grpo_data(dtype, variant, seed=GRPO_TYPES.index(loss_type) * 10 + list(VARIANTS).index(variant))
    eps_low, eps_high = 0.2, (5.0 if loss_type == "cispo" else 0.28)
    kw = dict(loss_type=loss_type, epsilon_low=eps_low, delta=d["delta"], beta=d["beta"])

    lp_ref = d["logp"].clone().requires_grad_(True)
    want_loss, want_kl, want_ratio = ref_token_terms(lp_ref, d["old"], d["adv"], d["ref"], d["iw"], d["valid"],
                                                     eps_high=eps_high, **kw)
    lp = d["logp"].clone().requires_grad_(True)
    got_loss, got_kl, got_ratio = cuda.grpo_token_loss(lp, d["old"], d["adv"], d["ref"], d["iw"], d["valid"],
                                                       epsilon_high=eps_high, **kw)
    close(got_loss.detach(), want_loss.detach(), dtype, "per_token_loss")
    close(got_ratio, want_ratio.detach(), dtype, "ratio")
    if want_kl is None:
        assert bool((got_kl == 0).all())
    else:
        close(got_kl, want_kl.detach(), dtype, "kl")
    assert bool((got_loss[~d["valid"]] == 0).all())

    g = torch.Generator().manual_seed(1)
    upstream = (torch.rand(lp.shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    (want_grad,) = torch.autograd.grad(want_loss, lp_ref, upstream)
    (got_grad,) = torch.autograd.grad(got_loss, lp, upstream)
    close(got_grad, want_grad, dtype, "d loss / d logp")
    assert bool((got_grad[~d["valid"]] == 0).all())


@pytest.mark.parametrize("loss_type", GRPO_TYPES)
def test_grpo_token_loss_epsilon_high_none_and_2d(loss_type):
    """epsilon_high None means eps_low; any shape (it is elementwise) keeps its shape."""
    d = grpo_data(torch.float32, "full", seed=7)
    kw = dict(loss_type=loss_type, epsilon_low=0.3, delta=d["delta"], beta=d["beta"])
    shape = (d["logp"].shape[0],)
    a = cuda.grpo_token_loss(d["logp"], d["old"], d["adv"], d["ref"], d["iw"], d["valid"], epsilon_high=None, **kw)
    b = cuda.grpo_token_loss(d["logp"], d["old"], d["adv"], d["ref"], d["iw"], d["valid"], epsilon_high=0.3, **kw)
    for x, y in zip(a, b):
        assert x.shape == shape and torch.equal(x, y)


def test_grpo_token_loss_gradcheck():
    g = torch.Generator().manual_seed(3)
    t = 11
    logp = (-torch.rand(t, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    # log-ratios well inside or well outside the clip range: away from the kinks of clamp/min
    lr = torch.tensor([0.01, -0.02, 0.8, -0.9, 0.03, 1.2, -1.5, 0.0, 0.05, -0.04, 0.6], dtype=torch.float64)
    old = logp.detach() - lr
    adv = torch.randn(t, generator=g, dtype=torch.float64)
    ref = logp.detach() + torch.randn(t, generator=g, dtype=torch.float64) * 0.3
    iw = torch.rand(t, generator=g, dtype=torch.float64) + 0.5
    valid = torch.ones(t, dtype=torch.bool)
    valid[4] = False
    for loss_type in GRPO_TYPES[:-1]:  # not cispo: its stop-gradient ratio is invisible to finite differences
        for delta in (None, 1.5):
            def f(x):
                return cuda.grpo_token_loss(x, old, adv, ref, iw, valid, loss_type=loss_type, epsilon_low=0.2,
                                            epsilon_high=0.28, delta=delta,
                                            beta=0.05)[0]
            assert torch.autograd.gradcheck(f, (logp,)), (loss_type, delta)


def test_grpo_token_loss_in_place_and_errors():
    d = grpo_data(torch.float32, "off_policy", seed=2)
    loss, kl, ratio = cuda.grpo_token_loss(d["logp"].requires_grad_(True), d["old"], d["adv"], None, None, d["valid"],
                                           loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, delta=None, beta=0.0)
    assert not kl.requires_grad and not ratio.requires_grad
    ratio.mul_(2)  # separate outputs: in-place use is allowed
    with pytest.raises(ValueError, match="loss_type"):
        cuda.grpo_token_loss(d["logp"], None, d["adv"], None, None, d["valid"], loss_type="ppo", epsilon_low=0.2,
                             epsilon_high=None, delta=None, beta=0.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        cuda.grpo_token_loss(d["logp"], None, d["adv"], None, None, d["valid"], loss_type="grpo", epsilon_low=0.2,
                             epsilon_high=None, delta=None, beta=0.1)


def test_grpo_token_loss_empty():
    e = torch.zeros(0)
    loss, kl, ratio = cuda.grpo_token_loss(e.requires_grad_(True), None, e, None, None, e.bool(), loss_type="grpo",
                                           epsilon_low=0.2, epsilon_high=None, delta=None, beta=0.0)
    assert loss.shape == kl.shape == ratio.shape == (0,)
    loss.sum().backward()


# ------------------------------------------------------------------------------------------------
# DPO
# ------------------------------------------------------------------------------------------------
def ref_dpo(chosen_logps, rejected_logps, ref_c, ref_r, n_c, n_r, *, loss_type, beta, label_smoothing):
    """fusedloss/losses/dpo.py's pair_losses (the definition); n already max(1, count)."""
    return dpo_module.pair_losses(chosen_logps - ref_c, rejected_logps - ref_r, n_c, n_r, loss_type=loss_type,
                                  beta=beta, label_smoothing=label_smoothing)


def dpo_data(dtype, seed=0, b=23):
    g = torch.Generator().manual_seed(seed)
    c = -torch.rand(b, generator=g, dtype=torch.float64) * 40
    r = -torch.rand(b, generator=g, dtype=torch.float64) * 40
    rc = c + torch.randn(b, generator=g, dtype=torch.float64) * 3
    rr = r + torch.randn(b, generator=g, dtype=torch.float64) * 3
    nc = torch.randint(0, 30, (b,), generator=g)
    nr = torch.randint(0, 30, (b,), generator=g)
    nc[0] = nr[1] = 0  # empty completions: max(1, n)
    c[2], rc[2] = 1000.0, 0.0  # saturated sigmoids, both signs
    r[3], rr[3] = 1000.0, 0.0
    return [x.to(dtype) for x in (c, r, rc, rr)] + [nc, nr]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("beta", [0.1, 2.0])
@pytest.mark.parametrize("loss_type", DPO_TYPES)
def test_dpo_pair_loss_matches_module_math(loss_type, beta, label_smoothing, dtype):
    c, r, rc, rr, nc, nr = dpo_data(dtype, seed=DPO_TYPES.index(loss_type))
    kw = dict(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing)
    c1, r1 = c.clone().requires_grad_(True), r.clone().requires_grad_(True)
    want = ref_dpo(c1, r1, rc, rr, nc.to(dtype).clamp(min=1), nr.to(dtype).clamp(min=1), **kw)
    c2, r2 = c.clone().requires_grad_(True), r.clone().requires_grad_(True)
    got = cuda.dpo_pair_loss(c2, r2, rc, rr, nc, nr, **kw)
    close(got.detach(), want.detach(), dtype, "loss")
    g = torch.Generator().manual_seed(5)
    upstream = (torch.rand(c.shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    want_g = torch.autograd.grad(want, (c1, r1), upstream)
    got_g = torch.autograd.grad(got, (c2, r2), upstream)
    close(got_g[0], want_g[0], dtype, "d loss / d chosen")
    close(got_g[1], want_g[1], dtype, "d loss / d rejected")


def test_dpo_pair_loss_gradcheck_and_errors():
    c, r, rc, rr, nc, nr = dpo_data(torch.float64, seed=9, b=7)
    c[2], rc[2], r[3], rr[3] = -5.0, -4.0, -6.0, -3.0  # no saturation (finite differences)
    for loss_type in DPO_TYPES:
        def f(x, y):
            return cuda.dpo_pair_loss(x, y, rc, rr, nc, nr, loss_type=loss_type, beta=0.1,
                                      label_smoothing=0.1 if loss_type != "hinge" else 0.0)
        assert torch.autograd.gradcheck(f, (c.clone().requires_grad_(True), r.clone().requires_grad_(True)))
    with pytest.raises(ValueError, match="loss_type"):
        cuda.dpo_pair_loss(c, r, rc, rr, nc, nr, loss_type="kto", beta=0.1, label_smoothing=0.0)


# ------------------------------------------------------------------------------------------------
# End to end: the public losses with the fused functions dispatched, against the same call without them
# ------------------------------------------------------------------------------------------------
def _head(dtype, b, c, d=12, v=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, c, d, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(v, d, generator=g, dtype=torch.float64) / math.sqrt(d)).to(dtype)
    ids = torch.randint(0, v, (b, c), generator=g)
    return h, w, ids, g


def _with_and_without(monkeypatch, name, fn, call):
    """call() with the torch backend dispatching to the fused ``fn`` (counted) and without it."""
    from fusedloss.core import torch_backend

    base = call()
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(torch_backend, name, counted, raising=False)
    fused = call()
    monkeypatch.delattr(torch_backend, name)
    if not calls:
        pytest.skip(f"the loss module does not dispatch to a backend's {name}")
    return base, fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss_type", GRPO_TYPES)
@pytest.mark.parametrize("details", [False, True])
def test_grpo_loss_end_to_end(loss_type, details, dtype, monkeypatch):
    import fusedloss

    b, c = 3, 5
    h, w, ids, g = _head(dtype, b, c, seed=GRPO_TYPES.index(loss_type))
    adv = torch.randn(b, generator=g, dtype=torch.float64).to(dtype)
    mask = torch.rand(b, c, generator=g) > 0.3
    mask[0, 0] = True
    old = torch.randn(b, c, generator=g, dtype=torch.float64).to(dtype) - 3.0
    old[~mask] = -math.inf  # garbage where masked
    ref = torch.randn(b, c, generator=g, dtype=torch.float64).to(dtype) - 3.0
    iw = (torch.rand(b, c, generator=g, dtype=torch.float64) + 0.5).to(dtype)

    def call():
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = fusedloss.grpo_loss(hh, ww, ids, adv, mask, old_logprobs=old, ref_logprobs=ref, loss_type=loss_type,
                                  epsilon_high=0.28 if loss_type != "cispo" else 4.0, delta=2.0, beta=0.05,
                                  importance_weights=iw, return_details=details, backend="torch")
        loss = out[0] if details else out
        gh, gw = torch.autograd.grad(loss, (hh, ww))
        extra = [] if not details else [out[1].kl, out[1].clip_ratio_low, out[1].clip_ratio_high,
                                        out[1].clip_ratio_region]
        return [loss.detach(), gh, gw] + extra

    base, fused = _with_and_without(monkeypatch, "grpo_token_loss", cuda.grpo_token_loss, call)
    tol = 1e-5 if dtype == torch.float32 else 1e-11  # through the logits gradient products
    for k, (x, y) in enumerate(zip(fused, base)):
        assert torch.isfinite(x).all(), k
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("loss_type", DPO_TYPES)
def test_dpo_loss_end_to_end(loss_type, dtype, monkeypatch):
    import fusedloss

    pairs, t = 3, 6
    h, w, labels, g = _head(dtype, 2 * pairs, t, seed=11 + DPO_TYPES.index(loss_type))
    labels[:, :2] = -100  # prompt tokens
    labels[1, :] = -100  # an empty chosen completion (ipo: max(1, n))
    ref_c = torch.randn(pairs, generator=g, dtype=torch.float64).to(dtype) - 10
    ref_r = torch.randn(pairs, generator=g, dtype=torch.float64).to(dtype) - 10

    def call():
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = fusedloss.dpo_loss(hh, ww, labels, ref_c, ref_r, beta=0.5, loss_type=loss_type,
                                  label_smoothing=0.1 if loss_type != "hinge" else 0.0, backend="torch")
        return [loss.detach(), *torch.autograd.grad(loss, (hh, ww))]

    base, fused = _with_and_without(monkeypatch, "dpo_pair_loss", cuda.dpo_pair_loss, call)
    tol = 1e-5 if dtype == torch.float32 else 1e-11
    for x, y in zip(fused, base):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
