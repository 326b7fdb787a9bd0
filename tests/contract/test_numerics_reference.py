"""The worked numbers of the seed articles, and the reference against torch.nn.functional.

Every worked number is checked on ``fusedloss.reference`` and on the public API for every available
backend (the ``impl`` parametrisation), so that the executable specification and the library agree with
the hand computation, not only with each other.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _errors import rel_err
from conftest import BACKENDS, device_for, make_head, make_teacher

import fusedloss
from fusedloss import reference

IMPLS = ["reference"] + list(BACKENDS)


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def call(impl: str, name: str, *args, **kwargs):
    """Run ``name`` from the reference (impl == "reference") or from the public API with that backend,
    with every tensor argument moved to the backend's device."""
    if impl == "reference":
        return getattr(reference, name)(*args, **kwargs)
    dev = device_for(impl)
    mv = (lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x)
    args = [mv(a) for a in args]
    kwargs = {k: mv(v) for k, v in kwargs.items()}
    return getattr(fusedloss, name)(*args, backend=impl, **kwargs)


def two_token_head(p_first: float, dtype=torch.float64):
    """hidden [[1.]] and a V=2 weight whose logits are (log p, log(1 - p)), so softmax = (p, 1 - p)."""
    h = torch.ones(1, 1, dtype=dtype)
    w = torch.tensor([[math.log(p_first)], [math.log(1.0 - p_first)]], dtype=dtype)
    return h, w


# --------------------------------------------------------------------------------------------------
# Seed 001: temperature on the logits (2, 0)


@pytest.mark.parametrize("temperature, expected", [(1.0, (0.8808, 0.1192)), (2.0, (0.7311, 0.2689))])
def test_temperature_softmax_cat_dog(impl, temperature, expected):
    h = torch.ones(2, 1, dtype=torch.float64)
    w = torch.tensor([[2.0], [0.0]], dtype=torch.float64)  # logits (2, 0): "cat", "dog"
    targets = torch.tensor([0, 1])
    logp = call(impl, "token_logprobs", h, w, targets, temperature=temperature)
    probs = logp.exp().cpu()
    assert torch.allclose(probs, torch.tensor(expected, dtype=torch.float64), atol=1e-4)
    # exact values: softmax((2, 0) / T)
    exact = torch.softmax(torch.tensor([2.0, 0.0], dtype=torch.float64) / temperature, 0)
    assert torch.allclose(probs, exact, rtol=1e-12, atol=0)
    assert logp.dtype == torch.float64


def test_temperature_entropy_rises(impl):
    h = torch.ones(1, 1, dtype=torch.float64)
    w = torch.tensor([[2.0], [0.0]], dtype=torch.float64)
    targets = torch.tensor([0])
    ents = []
    for t in (1.0, 2.0):
        _, ent = call(impl, "token_logprobs", h, w, targets, temperature=t, return_entropy=True)
        q = torch.softmax(torch.tensor([2.0, 0.0], dtype=torch.float64) / t, 0)
        assert torch.allclose(ent.cpu(), -(q * q.log()).sum().reshape(1), rtol=1e-12, atol=0)
        ents.append(ent.item())
    assert ents[1] > ents[0]


# --------------------------------------------------------------------------------------------------
# Seed 001: reverse KL of the student q = (0.5, 0.2, 0.3) to the teacher p = (0.6, 0.3, 0.1)


def _three_token_heads():
    q = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64)
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    return h, q.log()[:, None], h.clone(), p.log()[:, None], q, p


def test_reverse_kl_worked_example(impl):
    h, w, ht, wt, q, p = _three_token_heads()
    d_t = call(impl, "distillation_loss", h, w, ht, wt, beta=1.0, reduction="sum")
    assert abs(d_t.item() - 0.157) < 5e-4
    exact = 0.5 * math.log(0.5 / 0.6) + 0.2 * math.log(0.2 / 0.3) + 0.3 * math.log(0.3 / 0.1)
    assert abs(d_t.item() - exact) < 1e-12
    # the single sampled log-ratio of "cat" is about -0.182: a sample can be negative
    logq = call(impl, "token_logprobs", h, w, torch.tensor([0]))
    logp = call(impl, "token_logprobs", ht, wt, torch.tensor([0]))
    assert abs((logq - logp).item() - math.log(0.5 / 0.6)) < 1e-12
    assert abs((logq - logp).item() - (-0.182)) < 5e-4


def test_forward_kl_and_jsd_worked_example(impl):
    h, w, ht, wt, q, p = _three_token_heads()
    fwd = call(impl, "distillation_loss", h, w, ht, wt, beta=0.0, reduction="sum")
    assert abs(fwd.item() - (p * (p / q).log()).sum().item()) < 1e-12
    m = 0.5 * q + 0.5 * p
    jsd = call(impl, "distillation_loss", h, w, ht, wt, beta=0.5, reduction="sum")
    expected = 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()
    assert abs(jsd.item() - expected.item()) < 1e-12
    assert 0 < jsd.item() < math.log(2)


# --------------------------------------------------------------------------------------------------
# Seed 001: GRPO clipped objective


@pytest.mark.parametrize("adv, ratio, objective", [(1.0, 1.5, 1.2), (-1.0, 0.5, -0.8)])
def test_grpo_clip_worked_example(impl, adv, ratio, objective):
    # old probability 0.5 of the sampled token, current probability 0.5 * ratio
    h, w = two_token_head(0.5 * ratio)
    h = h.reshape(1, 1, 1).requires_grad_(True)
    w = w.requires_grad_(True)
    ids = torch.tensor([[0]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    old = torch.full((1, 1), math.log(0.5), dtype=torch.float64)
    a = torch.tensor([adv], dtype=torch.float64)
    if impl != "reference":
        dev = device_for(impl)
        h = h.detach().to(dev).requires_grad_(True)
        w = w.detach().to(dev).requires_grad_(True)
    loss, details = call(impl, "grpo_loss", h, w, ids, a, mask, old_logprobs=old, epsilon_low=0.2,
                         return_details=True)
    assert abs(loss.item() - (-objective)) < 1e-12
    assert abs(details.logprobs.exp().item() - 0.5 * ratio) < 1e-12
    # the clipped branch is constant: no gradient
    loss.backward()
    assert h.grad is None or float(h.grad.abs().max()) < 1e-14
    assert w.grad is None or float(w.grad.abs().max()) < 1e-14
    if adv > 0:
        assert details.clip_ratio_high.item() == 1.0 and details.clip_ratio_low.item() == 0.0
    else:
        assert details.clip_ratio_low.item() == 1.0 and details.clip_ratio_high.item() == 0.0
    assert details.clip_ratio_region.item() == 1.0


def test_grpo_ratio_worked_example(impl):
    # probability 0.20 under the old policy, 0.24 now: ratio 1.2, inside the clip range, gradient A * r * grad logp
    h, w = two_token_head(0.24)
    h = h.reshape(1, 1, 1)
    old = torch.full((1, 1), math.log(0.20), dtype=torch.float64)
    loss = call(impl, "grpo_loss", h, w, torch.tensor([[0]]), torch.tensor([1.0], dtype=torch.float64),
                torch.ones(1, 1), old_logprobs=old, epsilon_low=0.3)
    assert abs(loss.item() - (-1.2)) < 1e-12


def test_grpo_on_policy_aggregations_by_hand(impl):
    # On-policy (ratio 1): per-token loss is -A. Two sequences of 3 and 1 valid tokens, C = 4.
    h, w, _, _ = make_head(8, 5, 7, seed=3, peaked=False)
    h = h.reshape(2, 4, 5)
    ids = torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    a = torch.tensor([2.0, -1.0], dtype=torch.float64)
    expected = {
        "grpo": ((-2.0 * 3 / 3) + (1.0 * 1 / 1)) / 2,
        "bnpo": (-2.0 * 3 + 1.0) / 4,
        "dr_grpo": (-2.0 * 3 + 1.0) / (2 * 4),
        "dapo": (-2.0 * 3 + 1.0) / 4,
    }
    for loss_type, value in expected.items():
        loss = call(impl, "grpo_loss", h, w, ids, a, mask, loss_type=loss_type)
        assert abs(loss.item() - value) < 1e-12, loss_type
    loss = call(impl, "grpo_loss", h, w, ids, a, mask, loss_type="dr_grpo", max_completion_length=10)
    assert abs(loss.item() - (-5.0 / 20)) < 1e-12
    loss = call(impl, "grpo_loss", h, w, ids, a, mask, loss_type="dapo", num_items_in_batch=10, num_processes=2)
    assert abs(loss.item() - (-5.0 / 5)) < 1e-12


def test_grpo_kl_penalty_by_hand(impl):
    # KL estimator exp(ref - logp) - (ref - logp) - 1, masked mean; on-policy with A = 0 it is the whole loss.
    h, w = two_token_head(0.25)
    h = h.reshape(1, 1, 1)
    ref = torch.full((1, 1), math.log(0.5), dtype=torch.float64)
    loss, details = call(impl, "grpo_loss", h, w, torch.tensor([[0]]), torch.zeros(1, dtype=torch.float64),
                         torch.ones(1, 1), ref_logprobs=ref, beta=0.5, loss_type="bnpo", return_details=True)
    d = math.log(0.5) - math.log(0.25)
    kl = math.exp(d) - d - 1
    assert abs(details.kl.item() - kl) < 1e-12
    assert abs(loss.item() - 0.5 * kl) < 1e-12


# --------------------------------------------------------------------------------------------------
# Seed 001 / 003: group advantages


def test_group_advantages_worked_example(impl):
    if impl == "reference":
        out = reference.group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0]), 4, unbiased=False, eps=0.0)
    else:
        out = fusedloss.group_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0]), 4, unbiased=False, eps=0.0)
    assert torch.equal(out.advantages, torch.tensor([-1.0, 1.0, 1.0, -1.0]))
    assert torch.allclose(out.std, torch.tensor([0.5]))
    assert out.keep.dtype == torch.bool and bool(out.keep.all())


def _advantages(impl, *args, **kwargs):
    fn = reference.group_advantages if impl == "reference" else fusedloss.group_advantages
    return fn(*args, **kwargs)


def test_group_advantages_scales_and_silent_groups(impl):
    # groups: (0, 1, 1, 0), silent (1, 1, 1, 1), silent (0.1, 0.1, 0.1, 0.1), (1, 0, 0, 0)
    r = torch.tensor([0.0, 1, 1, 0, 1, 1, 1, 1, 0.1, 0.1, 0.1, 0.1, 1, 0, 0, 0], dtype=torch.float64)
    g = r.reshape(4, 4)
    mean = g.mean(1, keepdim=True)
    std_u = g.std(1, unbiased=True)
    std_u[1:3] = 0.0
    for unbiased in (True, False):
        std = g.std(1, unbiased=unbiased)
        std[1:3] = 0.0
        out = _advantages(impl, r, 4, unbiased=unbiased, eps=0.0)
        expected = (g - mean) / std[:, None]
        expected[1:3] = 0.0
        assert torch.allclose(out.advantages, expected.reshape(-1), rtol=1e-12, atol=0)
        assert torch.allclose(out.std, std, rtol=1e-12, atol=0)
        # silent groups: advantage exactly 0 even with eps = 0 (no 0/0)
        assert torch.equal(out.advantages[4:12], torch.zeros(8, dtype=out.advantages.dtype))
    out = _advantages(impl, r, 4, eps=1e-4)
    expected = ((g - mean) / (std_u[:, None] + 1e-4))
    expected[1:3] = 0.0
    assert torch.allclose(out.advantages, expected.reshape(-1), rtol=1e-12, atol=0)
    # Dr. GRPO: no division
    out = _advantages(impl, r, 4, scale="none")
    expected = g - mean
    expected[1:3] = 0.0
    assert torch.allclose(out.advantages, expected.reshape(-1), rtol=1e-12, atol=0)
    # batch scale: mean per group, std of the whole batch
    out = _advantages(impl, r, 4, scale="batch", eps=1e-4)
    expected = (g - mean) / (r.std() + 1e-4)
    expected[1:3] = 0.0
    assert torch.allclose(out.advantages, expected.reshape(-1), rtol=1e-12, atol=0)
    assert torch.allclose(out.std, std_u, rtol=1e-12, atol=0)
    # DAPO: drop the silent groups
    out = _advantages(impl, r, 4, drop_silent_groups=True)
    keep = torch.tensor([True] * 4 + [False] * 8 + [True] * 4)
    assert torch.equal(out.keep, keep)
    assert torch.equal(out.advantages[~keep], torch.zeros(8, dtype=out.advantages.dtype))
    out = _advantages(impl, r, 4, drop_silent_groups=False)
    assert bool(out.keep.all())


def test_group_std_identity(impl):
    # seed 003: binary rewards, k correct of G: population std sqrt(k (G - k)) / G
    G = 8
    rewards = torch.cat([torch.tensor([1.0] * k + [0.0] * (G - k)) for k in range(G + 1)])
    out = _advantages(impl, rewards.double(), G, unbiased=False)
    k = torch.arange(G + 1, dtype=torch.float64)
    assert torch.allclose(out.std, (k * (G - k)).sqrt() / G, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------------------------------------------
# Seed 001: DPO


@pytest.mark.parametrize("chosen_gain, rejected_gain", [(2.0, -1.0), (-1.0, -4.0)])
def test_dpo_worked_example(impl, chosen_gain, rejected_gain):
    beta = 0.1
    h = torch.ones(2, 1, 1, dtype=torch.float64)  # [2B, T, D] with B = 1, T = 1
    w = torch.zeros(2, 1, dtype=torch.float64)  # uniform over V = 2: token logp = log 0.5
    labels = torch.tensor([[0], [1]])
    lp = math.log(0.5)
    ref_c = torch.tensor([lp - chosen_gain], dtype=torch.float64)
    ref_r = torch.tensor([lp - rejected_gain], dtype=torch.float64)
    loss, det = call(impl, "dpo_loss", h, w, labels, ref_c, ref_r, beta=beta, return_details=True)
    assert abs(loss.item() - (-F.logsigmoid(torch.tensor(beta * 3.0, dtype=torch.float64))).item()) < 1e-12
    assert abs(det.chosen_rewards.item() - beta * chosen_gain) < 1e-12
    assert abs(det.rejected_rewards.item() - beta * rejected_gain) < 1e-12
    assert abs(det.chosen_logps.item() - lp) < 1e-12 and abs(det.rejected_logps.item() - lp) < 1e-12
    for loss_type, value in [
        ("hinge", max(0.0, 1 - beta * 3.0)),
        ("ipo", (3.0 - 1 / (2 * beta)) ** 2),
        ("robust", -math.log(1 / (1 + math.exp(-beta * 3.0)))),
    ]:
        got = call(impl, "dpo_loss", h, w, labels, ref_c, ref_r, beta=beta, loss_type=loss_type)
        assert abs(got.item() - value) < 1e-12, loss_type
    e = 0.1
    got = call(impl, "dpo_loss", h, w, labels, ref_c, ref_r, beta=beta, label_smoothing=e)
    s = torch.tensor(beta * 3.0, dtype=torch.float64)
    assert abs(got.item() - (-(1 - e) * F.logsigmoid(s) - e * F.logsigmoid(-s)).item()) < 1e-12
    got = call(impl, "dpo_loss", h, w, labels, ref_c, ref_r, beta=beta, loss_type="robust", label_smoothing=e)
    assert abs(got.item() - ((-(1 - e) * F.logsigmoid(s) + e * F.logsigmoid(-s)) / (1 - 2 * e)).item()) < 1e-12


def test_dpo_ipo_normalises_by_length(impl):
    # chosen has 3 completion tokens, rejected 1; IPO uses u / n for each side.
    h = torch.ones(2, 3, 1, dtype=torch.float64)
    w = torch.zeros(4, 1, dtype=torch.float64)  # uniform over V = 4
    labels = torch.tensor([[1, 2, 3], [-100, -100, 0]])
    lq = math.log(0.25)
    ref_c = torch.tensor([3 * lq - 1.5], dtype=torch.float64)
    ref_r = torch.tensor([lq + 0.5], dtype=torch.float64)
    beta = 0.5
    got = call(impl, "dpo_loss", h, w, labels, ref_c, ref_r, beta=beta, loss_type="ipo")
    assert abs(got.item() - (1.5 / 3 - (-0.5) / 1 - 1 / (2 * beta)) ** 2) < 1e-12


# --------------------------------------------------------------------------------------------------
# The reference against torch.nn.functional (ground the executable specification itself)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
def test_reference_cross_entropy_matches_functional(reduction, label_smoothing):
    h, w, b, t = make_head(13, 24, 131, bias=True, ignore_fraction=0.3)
    z = h @ w.T + b
    expected = F.cross_entropy(z, t, reduction=reduction, label_smoothing=label_smoothing)
    got = reference.cross_entropy(h, w, t, bias=b, reduction=reduction, label_smoothing=label_smoothing)
    assert rel_err(got, expected) < 1e-13
    # z_loss adds z_loss * lse**2 per valid token
    got = reference.cross_entropy(h, w, t, bias=b, reduction="sum", z_loss=1e-3)
    valid = t != -100
    extra = 1e-3 * (torch.logsumexp(z, -1)[valid] ** 2).sum()
    assert rel_err(got, F.cross_entropy(z, t, reduction="sum") + extra) < 1e-13


def test_reference_cross_entropy_transform_order():
    # scale, then soft-cap, then temperature (docs/design.md, "The statistics problem")
    h, w, _, t = make_head(7, 19, 37)
    z = 20.0 * torch.tanh(3.0 * (h @ w.T) / 20.0) / 0.7
    got = reference.cross_entropy(h, w, t, logit_scale=3.0, softcap=20.0, temperature=0.7, reduction="none")
    assert rel_err(got, F.cross_entropy(z, t, reduction="none")) < 1e-13


def test_reference_all_ignored_mean_is_zero():
    h, w, _, t = make_head(5, 19, 37)
    t = torch.full_like(t, -100)
    h.requires_grad_(True)
    loss = reference.cross_entropy(h, w, t)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h))
    assert reference.distillation_loss(h, w, h.detach(), w, t).item() == 0.0


def test_reference_token_logprobs_and_entropy_match_torch():
    h, w, b, t = make_head(13, 24, 257, bias=True, ignore_fraction=0.3, leading=(13,))
    z = h @ w.T + b
    logp, ent = reference.token_logprobs(h, w, t, bias=b, return_entropy=True)
    valid = t != -100
    lq = torch.log_softmax(z, -1)
    exp_logp = torch.where(valid, lq.gather(1, t.clamp(min=0)[:, None]).squeeze(1), 0.0)
    exp_ent = torch.where(valid, torch.distributions.Categorical(logits=z).entropy(), 0.0)
    assert rel_err(logp, exp_logp) < 1e-14
    assert rel_err(ent, exp_ent) < 1e-13


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, 0.1])
def test_reference_distillation_matches_kl_div(beta):
    h, w, _, t = make_head(13, 24, 131, ignore_fraction=0.3)
    ht, wt, _ = make_teacher(13, 11, 131)
    T = 2.0
    lq = torch.log_softmax((h @ w.T) / T, -1)
    lp = torch.log_softmax((ht @ wt.T) / T, -1)
    if beta == 0.0:
        per = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    elif beta == 1.0:
        per = F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)
    else:
        lm = torch.log((1 - beta) * lq.exp() + beta * lp.exp())
        per = (beta * F.kl_div(lm, lp, reduction="none", log_target=True)
               + (1 - beta) * F.kl_div(lm, lq, reduction="none", log_target=True)).sum(-1)
    valid = t != -100
    ce = F.cross_entropy(h @ w.T, t, reduction="none")
    per_all = 0.7 * per * T ** 2 + 0.3 * ce
    per_all = torch.where(valid, per_all, 0.0)
    got = reference.distillation_loss(h, w, ht, wt, t, beta=beta, temperature=T, hard_weight=0.3, soft_weight=0.7,
                                      t_squared=True, reduction="none")
    assert rel_err(got, per_all) < 1e-12
    got = reference.distillation_loss(h, w, ht, wt, t, beta=beta, temperature=T, hard_weight=0.3,
                                      soft_weight=0.7, t_squared=True)
    assert rel_err(got, per_all.sum() / valid.sum()) < 1e-12
    got = reference.distillation_loss(h, w, ht, wt, None, beta=beta, temperature=T)
    assert rel_err(got, per.mean()) < 1e-12


# --------------------------------------------------------------------------------------------------
# The reference against the independent oracle (tests/oracle.py), where the executable specification must
# hold: masked vocabularies, garbage outside a GRPO mask. Its autograd is the plain log-softmax one, so
# moderate (not peaked) rows; the oracle's stable backward is checked on peaked rows by the properties.

import oracle  # noqa: E402


def _masked_case(seed=0, v=11):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(5, 4, generator=g, dtype=torch.float64)
    w = torch.randn(v, 4, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64)
    b[[2, 7]] = -math.inf
    ht = torch.randn(5, 3, generator=g, dtype=torch.float64)
    wt = torch.randn(v, 3, generator=g, dtype=torch.float64)
    tb = torch.randn(v, generator=g, dtype=torch.float64)
    tb[[2, 7]] = -math.inf  # the same entries: a vocabulary both heads mask
    y = torch.tensor([1, 7, -100, 3, 2])  # labels on masked entries only mark valid tokens
    return h, w, b, ht, wt, tb, y


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_reference_gradients_with_masked_entries_are_finite(beta):
    """A -inf bias masks vocabulary entries: 0 log 0 -> 0 in the KL and the entropy, and the gradients the
    reference gives are finite and right (its torch.where guards used to send 0 * inf = NaN into them)."""
    h, w, b, ht, wt, tb, y = _masked_case()
    for fn in ("distillation", "entropy"):
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
        o_leaves = [h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
        if fn == "distillation":
            got = reference.distillation_loss(leaves[0], leaves[1], ht, wt, y, beta=beta, bias=leaves[2],
                                              teacher_bias=tb)
            want = oracle.distillation_loss(o_leaves[0], o_leaves[1], ht, wt, y, beta=beta, bias=o_leaves[2],
                                            teacher_bias=tb)
        else:
            got = reference.token_logprobs(leaves[0], leaves[1], y, bias=leaves[2], return_entropy=True)[1].sum()
            want = oracle.token_logprobs(o_leaves[0], o_leaves[1], y, bias=o_leaves[2], return_entropy=True)[1].sum()
        assert rel_err(got, want) < 1e-12, fn
        for a, e in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, o_leaves)):
            assert torch.isfinite(a).all(), fn
            assert rel_err(a, e) < 1e-10, fn


def test_reference_kl_is_inf_where_mass_meets_a_masked_entry():
    """The reference follows the mathematics (and every backend): +inf, whatever exp underflows to."""
    h, w, b, ht, wt, tb, y = _masked_case()
    tb = tb.clone()
    tb[4] = -math.inf  # masked by the teacher only
    assert reference.distillation_loss(h, w, ht, wt, y, beta=1.0, bias=b, teacher_bias=tb).item() == math.inf
    assert reference.distillation_loss(h, w, ht, wt, y, beta=0.0, bias=tb, teacher_bias=b).item() == math.inf
    assert math.isfinite(reference.distillation_loss(h, w, ht, wt, y, beta=0.5, bias=b, teacher_bias=tb).item())


@pytest.mark.parametrize("garbage", ["advantages", "importance_weights"])
def test_reference_gspo_garbage_outside_the_mask_stays_out_of_the_gradient(garbage):
    """Per-token inputs outside the completion mask are never read, in the gradient either: with a
    per-sequence ratio a NaN there reached the shared ratio through a discarded torch.where branch."""
    h = torch.tensor([[[1.541], [-0.2934], [-2.1788]]], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[0.5684], [0.1]], dtype=torch.float64, requires_grad=True)
    ids, mask = torch.tensor([[0, 1, 0]]), torch.tensor([[True, True, False]])
    adv = torch.tensor([[1.0012, -0.0573, 0.3]], dtype=torch.float64)
    weights = torch.tensor([[0.9, 1.2, 1.0]], dtype=torch.float64)
    clean = dict(advantages=adv, importance_weights=weights)
    dirty = dict(clean)
    dirty[garbage] = torch.where(mask, clean[garbage], torch.full_like(clean[garbage], math.nan))
    results = []
    for kw in (clean, dirty):
        for fn in (reference.grpo_loss, oracle.grpo_loss):
            loss = fn(h, w, ids, kw["advantages"], mask, loss_type="grpo",
                      importance_sampling_level="sequence", importance_weights=kw["importance_weights"])
            results.append((loss,) + torch.autograd.grad(loss, [h, w]))
    for got in results[1:]:
        for a, e in zip(got, results[0]):
            assert torch.isfinite(a).all()
            assert rel_err(a, e) < 1e-12


@pytest.mark.parametrize("case", ["token_logprobs", "cross_entropy", "distillation", "grpo", "dpo"])
def test_reference_matches_the_oracle(case):
    """Two independent writings of the same formulas agree (moderate logits, masked entries, ignored rows)."""
    h, w, b, ht, wt, tb, y = _masked_case(seed=4)
    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    o_leaves = [h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    y_ok = torch.tensor([1, 5, -100, 3, 0])  # labels on unmasked entries (a masked one makes the CE inf)
    ids, mask = y_ok.clamp(min=0).reshape(1, 5), (y_ok >= 0).reshape(1, 5)
    old = torch.full((1, 5), -2.5, dtype=torch.float64)

    def run(m, hh, ww, bb):
        if case == "token_logprobs":
            lp, ent = m.token_logprobs(hh, ww, y_ok, bias=bb, temperature=0.7, return_entropy=True)
            return (lp * torch.linspace(-1, 1, 5, dtype=lp.dtype)).sum() + ent.sum()
        if case == "cross_entropy":
            return m.cross_entropy(hh, ww, y_ok, bias=bb, label_smoothing=0.1, z_loss=1e-3, softcap=3.0)
        if case == "distillation":
            return m.distillation_loss(hh, ww, ht, wt, y, beta=0.3, temperature=1.5, bias=bb, teacher_bias=tb)
        if case == "grpo":
            return m.grpo_loss(hh.reshape(1, 5, 4), ww, ids, torch.tensor([0.7], dtype=torch.float64), mask,
                               old_logprobs=old, ref_logprobs=old + 0.1, beta=0.04, bias=bb, loss_type="bnpo")
        labels = torch.tensor([[1, 5], [3, -100]])
        return m.dpo_loss(hh[:4].reshape(2, 2, 4), ww, labels, torch.tensor([-3.0], dtype=torch.float64),
                          torch.tensor([-4.0], dtype=torch.float64), bias=bb, beta=0.5)

    got, want = run(reference, *leaves), run(oracle, *o_leaves)
    assert rel_err(got, want) < 1e-12
    for a, e in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, o_leaves)):
        assert rel_err(a, e) < 1e-10
