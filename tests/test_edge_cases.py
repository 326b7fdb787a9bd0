"""Regressions from review: inputs at the edges of what trainers pass."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import fusedloss
from fusedloss import reference
from fusedloss.core import backends


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("op", ["cross_entropy", "distillation_loss", "grpo_loss"])
def test_ignored_rows_with_huge_logits_give_finite_gradients(backend, op, monkeypatch):
    """Ignored / masked rows must not contribute, even when exp of their logits overflows (inf * 0 = NaN)."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 6, 8, 37
    h = torch.randn(n, d, generator=g)
    h[2] *= 300.0  # this row is ignored / masked below: its logits reach ~1e3
    h[4] *= 100.0
    w = torch.randn(v, d, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[2] = y[4] = -100
    for eager in ("1", "0"):
        monkeypatch.setenv("FUSEDLOSS_EAGER", eager)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if op == "cross_entropy":
            loss = fusedloss.cross_entropy(hh, ww, y, temperature=0.3, backend=backend)
        elif op == "distillation_loss":
            loss = fusedloss.distillation_loss(hh, ww, h.nan_to_num(), w, y, beta=0.5, backend=backend)
        else:
            mask = (y >= 0).reshape(2, 3)
            loss = fusedloss.grpo_loss(hh.reshape(2, 3, d), ww, y.clamp(min=0).reshape(2, 3), torch.tensor([1.0, -1.0]),
                                       mask, temperature=0.3, backend=backend)
        loss.backward()
        assert torch.isfinite(loss), (op, eager)
        assert torch.isfinite(ww.grad).all(), (op, eager)
        assert torch.isfinite(hh.grad).all(), (op, eager)
        assert (hh.grad[[2, 4]] == 0).all(), (op, eager)


def test_grpo_ids_outside_the_mask_are_never_read_and_inside_must_be_tokens(backend):
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 3, 5, generator=g, dtype=torch.float64), torch.randn(11, 5, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0], dtype=torch.float64)
    padded = ids.clone()
    padded[~mask] = -1  # pad ids outside the vocabulary, outside the mask: fine
    a = fusedloss.grpo_loss(h, w, padded, adv, mask, backend=backend)
    b = fusedloss.grpo_loss(h, w, ids, adv, mask, backend=backend)
    assert _rel(a, b) < 1e-12
    bad = ids.clone()
    bad[0, 0] = -100  # inside the mask: not a token
    with pytest.raises(ValueError, match="completion_ids"):
        fusedloss.grpo_loss(h, w, bad, adv, mask, backend=backend)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_grpo_fractional_mask_weights_tokens_like_trl(backend, level, loss_type):
    """TRL multiplies per-token terms by the mask (tool masks, partial credit): a 0.5 weighs half."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 4, 6, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(13, 6, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 13, (2, 4), generator=g)
    mask = torch.tensor([[1.0, 0.5, 0.25, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([0.7, -0.3], dtype=torch.float64)
    old = torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.1 - 2.0
    kw = dict(old_logprobs=old, loss_type=loss_type, importance_sampling_level=level, return_details=True)
    loss, det = fusedloss.grpo_loss(h, w, ids, adv, mask, backend=backend, **kw)
    ref_loss, ref_det = reference.grpo_loss(h, w, ids, adv, mask, **kw)
    assert _rel(loss, ref_loss) < 1e-12
    assert _rel(torch.autograd.grad(loss, h)[0], torch.autograd.grad(ref_loss, h)[0]) < 1e-10
    # TRL by hand, token level: bnpo = sum(mask * l) / sum(mask)
    if level == "token" and loss_type == "bnpo":
        logp = reference.token_logprobs(h, w, ids)
        r = torch.exp(logp - old)
        a = adv[:, None]
        l = -torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
        assert _rel(loss, (l * mask).sum() / mask.sum()) < 1e-12


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
        backends.resolve("triton", torch.device("cpu"))


@pytest.mark.parametrize("name,kwargs", [("unbiased", {"unbiased": 1}), ("drop_silent_groups", {"drop_silent_groups": "yes"})])
def test_group_advantages_flags_are_bools(name, kwargs):
    with pytest.raises(TypeError, match=name):
        fusedloss.group_advantages(torch.tensor([0.0, 1.0]), 2, **kwargs)


@pytest.mark.parametrize("case", ["ce_mean_smooth_z", "ce_sum", "ce_items", "grpo_dapo", "grpo_bnpo_kl", "distill_jsd"])
def test_forced_eager_path_matches_the_reference_across_chunks(case, monkeypatch):
    """The 3-product path (taken on GPUs and for distillation by policy) on every row-local loss, forced and
    cut into chunks of 3 rows, against the float64 reference: values and gradients."""
    from fusedloss.core import torch_backend

    monkeypatch.setenv("FUSEDLOSS_EAGER", "1")
    monkeypatch.setattr(torch_backend, "eager_rows", lambda p: 3)
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
    assert _rel(got, want) < 1e-12
    for a, e in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, ref_leaves)):
        assert _rel(a, e) < 1e-10


def test_nan_padding_rows_stay_out_of_the_weight_gradient(backend, monkeypatch):
    """Fully masked attention rows can leave NaN hidden states in padding: ignored rows must not touch d weight."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(4, 6, generator=g), torch.randn(19, 6, generator=g)
    h[1] = float("nan")
    y = torch.tensor([3, -100, 7, 5])
    for eager in ("0", "1"):
        monkeypatch.setenv("FUSEDLOSS_EAGER", eager)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        fusedloss.cross_entropy(hh, ww, y, backend=backend).backward()
        assert torch.isfinite(ww.grad).all(), eager
        assert torch.isfinite(hh.grad[[0, 2, 3]]).all() and (hh.grad[1] == 0).all(), eager


def _with_backend(backend):
    """The public functions with ``backend`` fixed, shaped like the ``reference`` module."""
    import types

    return types.SimpleNamespace(**{name: functools.partial(getattr(fusedloss, name), backend=backend)
                                    for name in ("token_logprobs", "cross_entropy", "distillation_loss")})


@pytest.mark.parametrize("op", ["token_logprobs", "cross_entropy", "kl_fwd", "kl_rev", "jsd"])
def test_minus_inf_bias_masks_vocabulary_entries(backend, op, monkeypatch):
    """A -inf bias (vocabulary masking) gives q = 0 there: finite statistics and gradients like the reference,
    also when a whole vocabulary tile is masked."""
    from fusedloss.core import torch_backend

    monkeypatch.setattr(torch_backend, "VOCAB_TILE", 8)
    g = torch.Generator().manual_seed(6)
    n, d, v = 3, 5, 40
    h, w = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(v, d, generator=g, dtype=torch.float64)
    b = torch.zeros(v, dtype=torch.float64)
    b[8:16] = -math.inf  # one whole tile of the torch backend
    b[-3:] = -math.inf
    y = torch.tensor([1, 20, 30])
    ht, wt = torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(v, d, generator=g, dtype=torch.float64)

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

    for eager in ("0", "1"):
        monkeypatch.setenv("FUSEDLOSS_EAGER", eager)
        leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        got = run(_with_backend(backend), *leaves, b)
        ref_leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
        want = run(reference, *ref_leaves, b_ref)
        assert torch.isfinite(got), (op, eager)
        assert _rel(got, want) < 1e-10, (op, eager)
        for a, e in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, ref_leaves)):
            assert torch.isfinite(a).all(), (op, eager)
            assert _rel(a, e) < 1e-9, (op, eager)


def test_grpo_kl_metric_is_a_masked_mean_even_for_one_token_completions(backend):
    g = torch.Generator().manual_seed(7)
    h, w = torch.randn(2, 1, 4, generator=g, dtype=torch.float64), torch.randn(9, 4, generator=g, dtype=torch.float64)
    ids = torch.tensor([[2], [5]])
    mask = torch.tensor([[1], [0]], dtype=torch.bool)
    ref_lp = torch.full((2, 1), -1.0, dtype=torch.float64)
    _, det = fusedloss.grpo_loss(h, w, ids, torch.tensor([1.0, -1.0], dtype=torch.float64), mask,
                                 ref_logprobs=ref_lp, beta=0.1, return_details=True, backend=backend)
    _, want = reference.grpo_loss(h, w, ids, torch.tensor([1.0, -1.0], dtype=torch.float64), mask,
                                  ref_logprobs=ref_lp, beta=0.1, return_details=True)
    assert _rel(det.kl, want.kl) < 1e-12
