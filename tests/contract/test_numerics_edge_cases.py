"""Regressions from review: inputs at the edges of what trainers pass."""

from __future__ import annotations

import functools
import math

import oracle
import pytest
import torch
from _errors import plain_rel_err, rel_err

import fusedloss
from fusedloss import reference
from fusedloss.core import registry


@pytest.mark.parametrize("op", ["cross_entropy", "distillation_loss", "grpo_loss"])
def test_ignored_rows_with_huge_logits_give_finite_gradients(backend, device, op, monkeypatch):
    """Ignored / masked rows must not contribute, even when exp of their logits overflows (inf * 0 = NaN)."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 6, 8, 37
    h = torch.randn(n, d, generator=g)
    h[2] *= 300.0  # this row is ignored / masked below: its logits reach ~1e3
    h[4] *= 100.0
    w = torch.randn(v, d, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[2] = y[4] = -100
    h, w, y = h.to(device), w.to(device), y.to(device)
    for grad_in_forward in ("1", "0"):
        monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if op == "cross_entropy":
            loss = fusedloss.cross_entropy(hh, ww, y, temperature=0.3, backend=backend)
        elif op == "distillation_loss":
            loss = fusedloss.distillation_loss(hh, ww, h.nan_to_num(), w, y, beta=0.5, backend=backend)
        else:
            mask = (y >= 0).reshape(2, 3)
            loss = fusedloss.grpo_loss(hh.reshape(2, 3, d), ww, y.clamp(min=0).reshape(2, 3),
                                       torch.tensor([1.0, -1.0], device=device),
                                       mask, temperature=0.3, backend=backend)
        loss.backward()
        assert torch.isfinite(loss), (op, grad_in_forward)
        assert torch.isfinite(ww.grad).all(), (op, grad_in_forward)
        assert torch.isfinite(hh.grad).all(), (op, grad_in_forward)
        assert (hh.grad[[2, 4]] == 0).all(), (op, grad_in_forward)


def test_grpo_ids_outside_the_mask_are_never_read_and_inside_must_be_tokens(backend, device):
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 3, 5, generator=g, dtype=torch.float64), torch.randn(11, 5, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0], dtype=torch.float64)
    h, w, ids, mask, adv = (t.to(device) for t in (h, w, ids, mask, adv))
    padded = ids.clone()
    padded[~mask] = -1  # pad ids outside the vocabulary, outside the mask: fine
    a = fusedloss.grpo_loss(h, w, padded, adv, mask, backend=backend)
    b = fusedloss.grpo_loss(h, w, ids, adv, mask, backend=backend)
    assert plain_rel_err(a, b, 1e-300) < 1e-12
    bad = ids.clone()
    bad[0, 0] = -100  # inside the mask: not a token
    with pytest.raises(ValueError, match="completion_ids"):
        fusedloss.grpo_loss(h, w, bad, adv, mask, backend=backend)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_grpo_fractional_mask_weights_tokens_like_trl(backend, device, level, loss_type):
    """TRL multiplies per-token terms by the mask (tool masks, partial credit): a 0.5 weighs half."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 4, 6, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(13, 6, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 13, (2, 4), generator=g)
    mask = torch.tensor([[1.0, 0.5, 0.25, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([0.7, -0.3], dtype=torch.float64)
    old = torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.1 - 2.0
    h = h.detach().to(device).requires_grad_()
    w, ids, mask, adv, old = (t.to(device) for t in (w, ids, mask, adv, old))
    kw = dict(old_logprobs=old, loss_type=loss_type, importance_sampling_level=level, return_details=True)
    loss, det = fusedloss.grpo_loss(h, w, ids, adv, mask, backend=backend, **kw)
    ref_loss, ref_det = reference.grpo_loss(h, w, ids, adv, mask, **kw)
    assert plain_rel_err(loss, ref_loss, 1e-300) < 1e-12
    assert plain_rel_err(torch.autograd.grad(loss, h)[0], torch.autograd.grad(ref_loss, h)[0], 1e-300) < 1e-10
    # TRL by hand, token level: bnpo = sum(mask * l) / sum(mask)
    if level == "token" and loss_type == "bnpo":
        logp = reference.token_logprobs(h, w, ids)
        r = torch.exp(logp - old)
        a = adv[:, None]
        l = -torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
        assert plain_rel_err(loss, (l * mask).sum() / mask.sum(), 1e-300) < 1e-12


def test_num_items_in_batch_tensor_must_be_one_number():
    h, w, y = torch.randn(3, 4), torch.randn(7, 4), torch.tensor([1, 2, 3])
    loss = fusedloss.cross_entropy(h, w, y, num_items_in_batch=torch.tensor([5]))
    assert loss.shape == ()
    with pytest.raises(ValueError, match="num_items_in_batch"):
        fusedloss.cross_entropy(h, w, y, num_items_in_batch=torch.tensor([5, 6]))


def test_zero_hidden_size_is_a_clear_error():
    with pytest.raises(ValueError, match="hidden"):
        fusedloss.token_logprobs(torch.randn(3, 0), torch.randn(7, 0), torch.tensor([1, 2, 3]))


def test_triton_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("with a GPU, CPU tensors are the case to check: covered by the device script")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        registry.resolve("triton", torch.device("cpu"))


@pytest.mark.parametrize("name,kwargs", [("unbiased", {"unbiased": 1}),
                                         ("drop_silent_groups", {"drop_silent_groups": "yes"})])
def test_group_advantages_flags_are_bools(name, kwargs):
    with pytest.raises(TypeError, match=name):
        fusedloss.group_advantages(torch.tensor([0.0, 1.0]), 2, **kwargs)


@pytest.mark.parametrize("case", ["ce_mean_smooth_z", "ce_sum", "ce_items", "grpo_dapo", "grpo_bnpo_kl", "distill_jsd"])
def test_forced_grad_in_forward_path_matches_the_reference_across_chunks(case, monkeypatch):
    """The 3-product path (taken on GPUs and for distillation by policy) on every row-local loss, forced and
    cut into chunks of 3 rows, against the float64 reference: values and gradients."""
    from fusedloss.backends import torch as torch_backend

    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")
    monkeypatch.setattr(torch_backend, "grad_in_forward_rows", lambda p: 3)
    g = torch.Generator().manual_seed(3)
    dt = torch.float64
    h = torch.randn(2, 5, 6, generator=g, dtype=dt)
    w, b = torch.randn(31, 6, generator=g, dtype=dt) * 2, torch.randn(31, generator=g, dtype=dt)
    y = torch.randint(0, 31, (2, 5), generator=g)
    y[0, :2] = -100
    mask = y >= 0
    ht, wt = torch.randn(2, 5, 4, generator=g, dtype=dt), torch.randn(31, 4, generator=g, dtype=dt)
    old = torch.randn(2, 5, generator=g, dtype=dt) * 0.2 - 3.5
    calls = {
        "ce_mean_smooth_z": lambda m, h, w, b: m.cross_entropy(h, w, y, bias=b, label_smoothing=0.1, z_loss=1e-3,
                                                             softcap=5.0),
        "ce_sum": lambda m, h, w, b: m.cross_entropy(h, w, y, bias=b, reduction="sum", temperature=0.7),
        "ce_items": lambda m, h, w, b: m.cross_entropy(h, w, y, bias=b, num_items_in_batch=17),
        "grpo_dapo": lambda m, h, w, b: m.grpo_loss(h, w, y.clamp(min=0), torch.tensor([1.0, -0.5], dtype=dt),
                                                  mask, old_logprobs=old, bias=b, epsilon_high=0.28),
        "grpo_bnpo_kl": lambda m, h, w, b: m.grpo_loss(h, w, y.clamp(min=0), torch.tensor([0.3, -1.0], dtype=dt),
                                                     mask, old_logprobs=old, ref_logprobs=old + 0.1, beta=0.04,
                                                     loss_type="bnpo", bias=b),
        "distill_jsd": lambda m, h, w, b: m.distillation_loss(h, w, ht, wt, y, beta=0.3, temperature=1.5,
                                                            hard_weight=0.0, bias=b),
    }
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    got = calls[case](fusedloss, *leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    want = calls[case](reference, *ref_leaves)
    assert plain_rel_err(got, want, 1e-300) < 1e-12
    for a, e in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, ref_leaves)):
        assert plain_rel_err(a, e, 1e-300) < 1e-10


def test_nan_padding_rows_stay_out_of_the_weight_gradient(backend, device, monkeypatch):
    """Fully masked attention rows can leave NaN hidden states in padding: ignored rows must not touch d weight."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(4, 6, generator=g), torch.randn(19, 6, generator=g)
    h[1] = float("nan")
    y = torch.tensor([3, -100, 7, 5])
    h, w, y = h.to(device), w.to(device), y.to(device)
    for grad_in_forward in ("0", "1"):
        monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        fusedloss.cross_entropy(hh, ww, y, backend=backend).backward()
        assert torch.isfinite(ww.grad).all(), grad_in_forward
        assert torch.isfinite(hh.grad[[0, 2, 3]]).all() and (hh.grad[1] == 0).all(), grad_in_forward


def _with_backend(backend):
    """The public functions with ``backend`` fixed, shaped like the ``reference`` module."""
    import types

    return types.SimpleNamespace(**{name: functools.partial(getattr(fusedloss, name), backend=backend)
                                    for name in ("token_logprobs", "cross_entropy", "distillation_loss")})


@pytest.mark.parametrize("op", ["token_logprobs", "cross_entropy", "kl_fwd", "kl_rev", "jsd"])
def test_minus_inf_bias_masks_vocabulary_entries(backend, device, op, monkeypatch):
    """A -inf bias (vocabulary masking) gives q = 0 there: finite statistics and gradients like the reference,
    also when a whole vocabulary tile is masked."""
    from fusedloss.backends import torch as torch_backend

    monkeypatch.setattr(torch_backend, "VOCAB_TILE", 8)
    g = torch.Generator().manual_seed(6)
    n, d, v = 3, 5, 40
    h, w = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(v, d, generator=g, dtype=torch.float64)
    b = torch.zeros(v, dtype=torch.float64)
    b[8:16] = -math.inf  # one whole tile of the torch backend
    b[-3:] = -math.inf
    y = torch.tensor([1, 20, 30])
    ht, wt = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(v, d, generator=g, dtype=torch.float64)
    h, w, b, y, ht, wt = (t.to(device) for t in (h, w, b, y, ht, wt))

    # The reference's autograd turns 0 * log 0 into NaN gradients; a bias of -1e4 underflows exp to exactly 0
    # in float64 and is the same problem for it.
    b_ref = torch.where(torch.isinf(b), torch.full_like(b, -1e4), b)

    def run(m, hh, ww, b):
        if op == "token_logprobs":
            logp, ent = m.token_logprobs(hh, ww, y, bias=b, return_entropy=True)
            return logp.sum() + ent.sum()
        if op == "cross_entropy":
            return m.cross_entropy(hh, ww, y, bias=b, label_smoothing=0.0)
        beta = {"kl_fwd": 0.0, "kl_rev": 1.0, "jsd": 0.5}[op]
        return m.distillation_loss(hh, ww, ht, wt, y, beta=beta, bias=b, teacher_bias=b)

    for grad_in_forward in ("0", "1"):
        monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        got = run(_with_backend(backend), *leaves, b)
        ref_leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        want = run(reference, *ref_leaves, b_ref)
        assert torch.isfinite(got), (op, grad_in_forward)
        assert plain_rel_err(got, want, 1e-300) < 1e-10, (op, grad_in_forward)
        for a, e in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, ref_leaves)):
            assert torch.isfinite(a).all(), (op, grad_in_forward)
            assert plain_rel_err(a, e, 1e-300) < 1e-9, (op, grad_in_forward)


def test_grpo_kl_metric_is_a_masked_mean_even_for_one_token_completions(backend, device):
    g = torch.Generator().manual_seed(7)
    h, w = torch.randn(2, 1, 4, generator=g, dtype=torch.float64), torch.randn(9, 4, generator=g, dtype=torch.float64)
    ids = torch.tensor([[2], [5]])
    mask = torch.tensor([[1], [0]], dtype=torch.bool)
    ref_lp = torch.full((2, 1), -1.0, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    h, w, ids, mask, ref_lp, adv = (t.to(device) for t in (h, w, ids, mask, ref_lp, adv))
    _, det = fusedloss.grpo_loss(h, w, ids, adv, mask,
                                 ref_logprobs=ref_lp, beta=0.1, return_details=True, backend=backend)
    _, want = reference.grpo_loss(h, w, ids, adv, mask,
                                  ref_logprobs=ref_lp, beta=0.1, return_details=True)
    assert plain_rel_err(det.kl, want.kl, 1e-300) < 1e-12


# --------------------------------------------------------------------------------------------------
# Exactness under adversarial inputs: each test reproduces a defect found by differential fuzzing against
# the float64 oracle of tests/oracle.py. The kernel-math ones run on every backend here (any_engine).

F64 = torch.float64
INF = math.inf


def _leaf(t, dtype, device):
    return t.detach().to(device=device, dtype=dtype).requires_grad_(True)


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_a_rows_gradient_does_not_depend_on_which_other_rows_carry_gradient(any_engine, dtype, monkeypatch):
    """The backward must recompute the forward's logits to the last bit: a product of another shape (the rows
    that carry gradient only) rounds differently, and on a confident row (1 - q ~ 1e-7) that last bit of z
    became the leading digit of 1 - q: d hidden off by 3e-8 relative in float64, 3e-3 in fp32."""
    backend, device = any_engine
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "0")
    g = torch.Generator().manual_seed(284)
    h = torch.randn(2, 8, generator=g, dtype=F64)
    w = torch.zeros(2, 8, dtype=F64)
    w[0] = h[1] / h[1].norm() ** 2 * 16  # row 1: z = (16, 0) up to rounding, confident
    h, w = h.to(dtype).to(F64), w.to(dtype).to(F64)
    y = torch.tensor([0, 0])
    hh = _leaf(h, dtype, device)
    lp = fusedloss.token_logprobs(hh, w.to(device, dtype), y.to(device), backend=backend)
    (alone,) = torch.autograd.grad(lp[1], [hh], retain_graph=True)
    (together,) = _grads((lp * torch.tensor([1e-30, 1.0], dtype=lp.dtype, device=device)).sum(), [hh])
    assert torch.equal(alone[1], together[1]), (alone[1], together[1])
    h64 = h.clone().requires_grad_(True)
    (want,) = _grads(oracle.token_logprobs(h64, w, y)[1], [h64])
    assert rel_err(alone, want) <= (1e-10 if dtype == F64 else 1e-5)


def test_confident_rows_next_to_ignored_rows_keep_fp32_accuracy(any_engine, monkeypatch):
    """Ignored rows (every SFT batch has them) must not change the products a valid row's logits come from
    (the CUDA forward kept them, its backward dropped them): confident fp32 rows stay within 1e-5."""
    backend, device = any_engine
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "0")
    g = torch.Generator().manual_seed(3)
    v, d = 37, 16
    w = (torch.randn(v, d, generator=g, dtype=F64) / 4).float().double()
    h = torch.randn(6, d, generator=g, dtype=F64)
    y = torch.tensor([-100, 5, -100, 11, 7, -100])
    for i in (1, 3, 4):  # 1 - q_y about 1e-4: z_y about 9 above the rest
        h[i] += w[y[i]] / w[y[i]].norm() ** 2 * 9.0
    h = h.float().double()
    hh, ww = _leaf(h, torch.float32, device), _leaf(w, torch.float32, device)
    loss = fusedloss.cross_entropy(hh, ww, y.to(device), reduction="sum", backend=backend)
    got = _grads(loss, [hh, ww])
    h64, w64 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = _grads(oracle.cross_entropy(h64, w64, y, reduction="sum"), [h64, w64])
    for name, a, e in zip(("d hidden", "d weight"), got, want):
        assert rel_err(a, e) <= 1e-5, name


def test_target_column_gradient_keeps_its_digits(any_engine):
    """The former ``(a + inner) + inner expm1(log q_y)`` was exact only where a = -inner; for an improbable
    target with an entropy (or KL) term it lost q_y inner: 3.5e-9 in float64 (naive autograd: exact), 1e-5 in
    fp32. ``-a expm1(log q_y) + q_y inner_y`` keeps both ends (docs/design.md, "The dz formula")."""
    backend, device = any_engine
    if backend != "cuda":  # the CUDA backend hands float64 problems to the torch backend
        h, w, y = torch.tensor([[1.0]], dtype=F64), torch.tensor([[20.0], [0.0], [1.0]], dtype=F64), torch.tensor([1])
        ww = _leaf(w, F64, device)
        _, ent = fusedloss.token_logprobs(h.to(device), ww, y.to(device), return_entropy=True, backend=backend)
        (got,) = _grads(ent.sum(), [ww])
        w64 = w.clone().requires_grad_(True)
        (want,) = _grads(oracle.token_logprobs(h, w64, y, return_entropy=True)[1].sum(), [w64])
        assert rel_err(got, want) <= 1e-12
    # fp32: an entropy bonus on an improbable target
    h, w, y = torch.tensor([[1.541]]), torch.tensor([[-0.2934], [-54.4697]]), torch.tensor([1])
    hh = _leaf(h, torch.float32, device)
    logp, ent = fusedloss.token_logprobs(hh, w.to(device), y.to(device), return_entropy=True, backend=backend)
    (got,) = _grads(0.0461 * logp.sum() + 0.4024 * ent.sum(), [hh])
    h64 = h.double().requires_grad_(True)
    lp64, ent64 = oracle.token_logprobs(h64, w.double(), y, return_entropy=True)
    (want,) = _grads(0.0461 * lp64.sum() + 0.4024 * ent64.sum(), [h64])
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_masked_teacher_entry_gives_finite_gradients(any_engine, beta, dtype):
    """A teacher that masks a vocabulary entry (-inf: padded rows, banned tokens) with forward KL or JSD: the
    loss is finite and so must be the gradient. The dz kernels formed c2 log p with c2 = 0: 0 * -inf = NaN
    (now c2 r_j, formed only with a reverse KL, and 0 wherever c2 is)."""
    backend, device = any_engine
    if backend == "cuda" and dtype == F64:
        pytest.skip("the CUDA backend hands float64 problems to the torch backend")
    h, w = torch.tensor([[1.541]], dtype=F64), torch.tensor([[-0.2934], [-2.1788]], dtype=F64)
    ht, wt = torch.tensor([[0.6127]], dtype=F64), torch.tensor([[-1.1754], [-0.7646]], dtype=F64)
    tb = torch.tensor([-INF, 0.0], dtype=F64)
    h, w, ht, wt = (t.to(dtype).to(F64) for t in (h, w, ht, wt))
    hh, ww = _leaf(h, dtype, device), _leaf(w, dtype, device)
    loss = fusedloss.distillation_loss(hh, ww, ht.to(device, dtype), wt.to(device, dtype), beta=beta,
                                       teacher_bias=tb.to(device, dtype), backend=backend)
    got = _grads(loss, [hh, ww])
    h64, w64 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want_loss = oracle.distillation_loss(h64, w64, ht, wt, beta=beta, teacher_bias=tb)
    want = _grads(want_loss, [h64, w64])
    tol = 1e-9 if dtype == F64 else 1e-5
    assert rel_err(loss, want_loss) <= tol
    for name, a, e in zip(("d hidden", "d weight"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, e) <= tol, name


def test_a_label_on_a_masked_student_entry_gives_finite_gradients(any_engine):
    """TRL-style distillation passes labels only to mark ignored tokens; a label on an entry the student
    masks gives a finite loss, and the target column must then contribute exactly its coefficient
    (0 log 0 -> 0 as on every other column), not 0 * inf = NaN."""
    backend, device = any_engine
    h, w = torch.tensor([[1.541]]), torch.tensor([[-0.2934], [-2.1788]])
    ht, wt = torch.tensor([[0.6127]]), torch.tensor([[-1.1754], [-0.7646]])
    b, y = torch.tensor([0.2842, -INF]), torch.tensor([1])
    for objective in ("reverse_kl", "jsd", "entropy"):
        hh, ww = _leaf(h, torch.float32, device), _leaf(w, torch.float32, device)
        h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
        if objective == "entropy":
            loss = fusedloss.token_logprobs(hh, ww, y.to(device), bias=b.to(device), return_entropy=True,
                                            backend=backend)[1].sum()
            want_loss = oracle.token_logprobs(h64, w64, y, bias=b.double(), return_entropy=True)[1].sum()
        else:
            beta = 1.0 if objective == "reverse_kl" else 0.5
            loss = fusedloss.distillation_loss(hh, ww, ht.to(device), wt.to(device), y.to(device), beta=beta,
                                               bias=b.to(device), backend=backend)
            want_loss = oracle.distillation_loss(h64, w64, ht.double(), wt.double(), y, beta=beta, bias=b.double())
        got, want = _grads(loss, [hh, ww]), _grads(want_loss, [h64, w64])
        assert rel_err(loss, want_loss) <= 1e-5, objective
        for name, a, e in zip(("d hidden", "d weight"), got, want):
            assert torch.isfinite(a).all(), (objective, name, a)
            assert rel_err(a, e) <= 1e-5, (objective, name)


def test_forward_kl_against_a_masked_student_entry_is_inf_on_every_backend(any_engine):
    """Teacher mass where the student has none: KL(p || q) = +inf (not NaN, on every backend)."""
    backend, device = any_engine
    h, w = torch.tensor([[1.541]]), torch.tensor([[-0.2934], [-2.1788]])
    ht, wt = torch.tensor([[0.6127]]), torch.tensor([[-1.1754], [-0.7646]])
    b = torch.tensor([0.2842, -INF])
    loss = fusedloss.distillation_loss(h.to(device), w.to(device), ht.to(device), wt.to(device), beta=0.0,
                                       bias=b.to(device), backend=backend)
    assert float(loss) == INF


@pytest.mark.parametrize("grad_in_forward", ["0", "1"])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_kl_next_to_a_masked_entry_does_not_depend_on_the_tiling(beta, grad_in_forward, monkeypatch):
    """A probability that underflows only at the row's scale (logit -490 against a maximum of 688) facing a
    masked (-inf) entry on the other side: the KL is +inf (mass where the other side has none), whatever the
    vocabulary tile; it was 1.79, inf or NaN depending on VOCAB_TILE."""
    from fusedloss.backends import torch as torch_backend

    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
    v = 7
    h, w = torch.ones(1, 1, dtype=F64), torch.zeros(v, 1, dtype=F64)
    finite = torch.zeros(v, dtype=F64)
    finite[0], finite[5], finite[6] = 688.0, -490.0, -480.0
    masked = torch.zeros(v, dtype=F64)
    masked[5] = -INF
    # reverse KL: the student has the tiny mass, the teacher masks; forward KL: the other way round
    b, tb = (finite, masked) if beta == 1.0 else (masked, finite)
    assert float(oracle.distillation_loss(h, w, h, w, beta=beta, bias=b, teacher_bias=tb)) == INF
    for tile in (4096, 3, 2, 1):
        monkeypatch.setattr(torch_backend, "VOCAB_TILE", tile)
        hh = h.clone().requires_grad_(True)
        loss = fusedloss.distillation_loss(hh, w, h, w, beta=beta, bias=b, teacher_bias=tb, backend="torch")
        assert float(loss.detach()) == INF, tile


@pytest.mark.parametrize("grad_in_forward", ["1", "0"])
def test_create_graph_is_refused_clearly(grad_in_forward, monkeypatch):
    """Second-order gradients are not implemented: differentiating a gradient must raise, never treat the
    gradient as a constant (a gradient penalty was silently off by 60%)."""
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 4, generator=g, dtype=F64, requires_grad=True)
    w, ht = torch.randn(5, 4, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)
    with pytest.raises(RuntimeError, match="first-order gradients only"):
        loss = fusedloss.distillation_loss(h, w, ht, w, backend="torch")
        (grad,) = torch.autograd.grad(loss, h, create_graph=True)
        (loss + (grad ** 2).sum()).backward()


@pytest.mark.parametrize("grad_in_forward", ["1", "0"])
def test_backward_twice_without_retain_graph_raises_like_pytorch(grad_in_forward, monkeypatch):
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 4, generator=g, dtype=F64, requires_grad=True)
    w, ht = torch.randn(5, 4, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)
    loss = fusedloss.distillation_loss(h, w, ht, w, backend="torch")
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
    first = h.grad.clone()
    h.grad = None
    loss = fusedloss.distillation_loss(h, w, ht, w, backend="torch")
    loss.backward(retain_graph=True)
    loss.backward()
    assert torch.allclose(h.grad, 2 * first, rtol=1e-14, atol=0)


@pytest.mark.parametrize("fn", ["distillation_loss", "cross_entropy"])
def test_meta_tensors_on_the_grad_in_forward_path(fn, monkeypatch):
    """Shape-only (meta) tensors give a meta loss whatever path the policy picks (FUSEDLOSS_GRAD_IN_FORWARD=1 forces the
    grad-in-forward one for every row-local loss), as the composable op does."""
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")
    h = torch.empty(2, 3, 4, device="meta", requires_grad=True)
    w = torch.empty(11, 4, device="meta", requires_grad=True)
    y = torch.empty(2, 3, dtype=torch.long, device="meta")
    if fn == "cross_entropy":
        loss = fusedloss.cross_entropy(h, w, y, backend="torch")
    else:
        loss = fusedloss.distillation_loss(h, w, torch.empty(2, 3, 4, device="meta"), w.detach(), y,
                                           backend="torch")
    assert loss.device.type == "meta" and loss.shape == () and loss.requires_grad


@pytest.mark.parametrize("grad_in_forward", ["1", "0"])
def test_num_items_in_batch_is_the_divisor(grad_in_forward, monkeypatch):
    """The loss is sum / num_items_in_batch (transformers divides by it; so does the reference): 0.5 gives
    twice the sum, not the sum; a number or tensor that is not > 0 is a ValueError, not a silent 1."""
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 5, generator=g, dtype=F64, requires_grad=True)
    w, ht = torch.randn(7, 5, generator=g, dtype=F64), torch.randn(4, 5, generator=g, dtype=F64)
    y = torch.tensor([1, -100, 3, 6])
    calls = {
        "cross_entropy": lambda m, n: m.cross_entropy(h, w, y, num_items_in_batch=n),
        "distillation_loss": lambda m, n: m.distillation_loss(h, w, ht, w, y, num_items_in_batch=n),
    }
    for name, call in calls.items():
        for n in (0.5, 3, torch.tensor(2.5), torch.tensor([4])):
            got, want = call(fusedloss, n), call(reference, n)
            assert plain_rel_err(got, want, 1e-300) < 1e-12, (name, n)
            grads = torch.autograd.grad(got, h)[0], torch.autograd.grad(want, h)[0]
            assert plain_rel_err(*grads, 1e-300) < 1e-12, (name, n)
        summed = call(fusedloss, None) if name == "distillation_loss" else None
        if summed is not None:
            twice_the_sum = 2 * fusedloss.distillation_loss(h, w, ht, w, y, reduction="sum")
            assert plain_rel_err(call(fusedloss, 0.5), twice_the_sum, 1e-300) < 1e-12
        for bad in (0, -1, 0.0, torch.tensor(-3.0), torch.tensor(0), torch.tensor(math.nan)):
            with pytest.raises(ValueError, match="num_items_in_batch"):
                call(fusedloss, bad)


@pytest.mark.parametrize("grad_in_forward", ["0", "1"])
def test_an_empty_batch_gives_zero_loss_and_zero_gradients(any_engine, grad_in_forward, monkeypatch):
    """No tokens at all, on every backend and gradient path: loss 0, d hidden [0, D], d weight exactly 0
    (the plans model at least one row; the buffers a first product would fill are zeros)."""
    backend, device = any_engine
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
    w = torch.randn(19, 6, generator=torch.Generator().manual_seed(2)).to(device)
    calls = {
        "cross_entropy": lambda h, w: fusedloss.cross_entropy(h, w, torch.zeros(0, dtype=torch.long, device=device),
                                                              reduction="sum", backend=backend),
        "token_logprobs": lambda h, w: fusedloss.token_logprobs(h, w, torch.zeros(0, dtype=torch.long,
                                                                                  device=device),
                                                                backend=backend).sum(),
        "distillation_loss": lambda h, w: fusedloss.distillation_loss(h, w, h.detach(), w.detach(),
                                                                      reduction="sum", backend=backend),
    }
    for name, call in calls.items():
        hh, ww = torch.zeros(0, 6, device=device, requires_grad=True), w.clone().requires_grad_()
        loss = call(hh, ww)
        loss.backward()
        assert loss.item() == 0.0, name
        assert hh.grad.shape == (0, 6) and torch.equal(ww.grad, torch.zeros_like(w)), name
