"""``sparse_distillation_loss`` (a teacher's top-k log-probs, TRL 1.16 ``ServerDistillationTrainer``) and
``token_logprobs`` with K targets per position.

The oracle is TRL's own code: ``_compute_server_forward_kl_loss`` (beta == 0) and
``_compute_server_sparse_top_1_divergence_loss`` (beta > 0), unbound, with a stand-in ``self`` carrying the
config values, on float64 log-probs materialised from ``hidden @ weight.T``; the gradients of hidden, weight
and bias come from autograd through TRL's code. Every available backend, float64 within 1e-10 (torch) or
1e-9; ``fusedloss.reference`` against the same oracle; fp32 against the float64 reference within 1e-5.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from _errors import rel_err
from _trl_oracle import float64_default, head_logits
from conftest import FP32_TOL, fp64_tol, make_head

import fusedloss
from fusedloss import reference

trl_server = pytest.importorskip("trl.experimental.server_distillation.server_distillation_trainer")

B, T, D, V = 3, 5, 19, 131
TRANSFORMS = dict(temperature=0.8, logit_scale=1.2, softcap=20.0)


def served_teacher(k, *, seed=3, missing_entries=True):
    """What a vLLM teacher returns for a [B, T] completion: top-k ids and log-probs (sorted, distinct ids, from
    a random teacher distribution), the log-prob of the sampled token, and labels with ignored positions
    (prompt padding and a fully ignored row). Some top-k entries are -inf (the server returned fewer)."""
    g = torch.Generator().manual_seed(seed)
    teacher_logq = torch.log_softmax(3.0 * torch.randn(B, T, V, generator=g, dtype=torch.float64), dim=-1)
    top_lp, top_ids = teacher_logq.topk(k, dim=-1)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :2] = -100
    labels[2] = -100
    labels[1, 1] = top_ids[1, 1, 0]  # the sampled token is the teacher's top-1 there
    sampled_lp = teacher_logq.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    if missing_entries and k > 1:
        top_lp[0, 3, k - 1:] = -math.inf
        top_lp[1, 4, 1:] = -math.inf
    # Ignored positions carry what TRL's padding carries: id 0 and -inf log-probs.
    ignored = labels == -100
    top_ids = torch.where(ignored.unsqueeze(-1), 0, top_ids)
    top_lp = torch.where(ignored.unsqueeze(-1), -math.inf, top_lp)
    sampled_lp = torch.where(ignored, -math.inf, sampled_lp)
    return top_ids, top_lp, labels, sampled_lp


def trl_loss(hidden, weight, bias, top_ids, top_lp, labels, sampled_lp, *, beta, loss_add_tail, temperature=1.0,
             logit_scale=1.0, softcap=None):
    """TRL 1.16's server distillation loss on float64 logits (before its gradient-accumulation scaling)."""
    trainer = trl_server.ServerDistillationTrainer
    stand_in = types.SimpleNamespace(beta=beta, loss_add_tail=loss_add_tail, reverse_kl_top_1_mode="sampled")
    for name in ("_get_reverse_kl_top_1_tokens", "_compute_sparse_top_1_divergence_loss"):
        setattr(stand_in, name, types.MethodType(getattr(trainer, name), stand_in))
    stand_in._reduce_divergence_loss = trainer._reduce_divergence_loss
    z = head_logits(hidden, weight, bias, logit_scale=logit_scale, softcap=softcap)
    student_log_probs = torch.log_softmax(z / temperature, dim=-1)
    served = {"actual_logprobs": sampled_lp, "topk_logprobs": top_lp, "topk_token_ids": top_ids}
    with float64_default():
        if beta > 0:
            return trainer._compute_server_sparse_top_1_divergence_loss(stand_in, served, student_log_probs,
                                                                         labels.clamp(min=0), labels)
        return trainer._compute_server_forward_kl_loss(stand_in, served, student_log_probs, labels)


def head(bias=True, dtype=torch.float64):
    h, w, b, _ = make_head(0, D, V, leading=(B, T), bias=bias, seed=11)
    return [None if t is None else t.to(dtype).requires_grad_() for t in (h, w, b)]


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


CASES = [  # (beta, loss_top_k served, loss_add_tail, transforms)
    (0.0, 5, True, {}),
    (0.0, 5, False, TRANSFORMS),
    (0.0, 1, True, TRANSFORMS),
    (1.0, 1, True, {}),
    (1.0, 1, True, TRANSFORMS),
    (0.5, 1, True, TRANSFORMS),
    (0.3, 1, False, {}),
]


@pytest.mark.parametrize("beta,k,tail,transforms", CASES)
def test_matches_trl_server_distillation(backend, device, beta, k, tail, transforms):
    top_ids, top_lp, labels, sampled_lp = served_teacher(k)
    h, w, b = head()
    want = trl_loss(h, w, b, top_ids, top_lp, labels, sampled_lp, beta=beta, loss_add_tail=tail, **transforms)
    want_grads = grads(want, (h, w, b))
    hd, wd, bd = (t.detach().to(device).requires_grad_() for t in (h, w, b))
    got = fusedloss.sparse_distillation_loss(
        hd, wd, top_ids.to(device), top_lp.to(device), labels.to(device),
        teacher_target_logprobs=sampled_lp.to(device), beta=beta, loss_add_tail=tail, bias=bd, backend=backend,
        **transforms)
    tol = fp64_tol(backend)
    assert rel_err(got, want) <= tol, (got.item(), want.item())
    for name, g, r in zip("hwb", grads(got, (hd, wd, bd)), want_grads):
        assert rel_err(g, r) <= tol, (name, rel_err(g, r))
    ref = reference.sparse_distillation_loss(h, w, top_ids, top_lp, labels, teacher_target_logprobs=sampled_lp,
                                             beta=beta, loss_add_tail=tail, bias=b, **transforms)
    assert rel_err(ref, want) <= 1e-12
    for name, g, r in zip("hwb", grads(ref, (h, w, b)), want_grads):
        assert rel_err(g, r) <= 1e-12, (name, rel_err(g, r))


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_and_items_against_reference(backend, device, reduction):
    top_ids, top_lp, labels, _ = served_teacher(4, seed=5)
    h, w, b = head(bias=False)
    opts = dict(beta=0.0, loss_top_k=3, reduction=reduction)
    got = fusedloss.sparse_distillation_loss(h.detach().to(device), w.detach().to(device), top_ids.to(device),
                                             top_lp.to(device), labels.to(device), backend=backend, **opts)
    want = reference.sparse_distillation_loss(h, w, top_ids, top_lp, labels, **opts)
    assert rel_err(got, want) <= fp64_tol(backend)
    if reduction == "none":
        assert got.shape == (B, T) and bool((got[labels.to(device) == -100] == 0).all())
    items = fusedloss.sparse_distillation_loss(h.detach(), w.detach(), top_ids, top_lp, labels, beta=0.0,
                                               num_items_in_batch=7, backend="torch")
    total = fusedloss.sparse_distillation_loss(h.detach(), w.detach(), top_ids, top_lp, labels, beta=0.0,
                                               reduction="sum", backend="torch")
    assert rel_err(items, total / 7) <= 1e-14


@pytest.mark.parametrize("log_prob_min_clamp,loss_max_clamp", [(-10.0, 6.0), (-6.0, 3.0)])
def test_raw_top_k_convention_against_reference(backend, device, log_prob_min_clamp, loss_max_clamp):
    """verl's forward_kl_topk (tests/frameworks has verl's own code as the oracle): raw top-k log-probs,
    clamped below, the KL clamped to [0, loss_max_clamp]; both clamps bite on these data."""
    top_ids, top_lp, labels, _ = served_teacher(6, seed=9)
    h, w, b = head()
    opts = dict(beta=0.0, loss_add_tail=False, renormalize=False, log_prob_min_clamp=log_prob_min_clamp,
                loss_max_clamp=loss_max_clamp, **TRANSFORMS)
    want = reference.sparse_distillation_loss(h, w, top_ids, top_lp, labels, bias=b, **opts)
    hd, wd, bd = (t.detach().to(device).requires_grad_() for t in (h, w, b))
    got = fusedloss.sparse_distillation_loss(hd, wd, top_ids.to(device), top_lp.to(device), labels.to(device),
                                             bias=bd, backend=backend, **opts)
    tol = fp64_tol(backend)
    assert want.item() > 0 and rel_err(got, want) <= tol
    for name, g, r in zip("hwb", grads(got, (hd, wd, bd)), grads(want, (h, w, b))):
        assert r.norm() > 0 and rel_err(g, r) <= tol, (name, rel_err(g, r))


def test_fp32_within_tolerance_of_float64():
    top_ids, top_lp, labels, sampled_lp = served_teacher(1, seed=7)
    h64, w64, b64 = head()
    h32, w32, b32 = (t.detach().float().requires_grad_() for t in (h64, w64, b64))
    opts = dict(beta=0.5, **TRANSFORMS)
    want = reference.sparse_distillation_loss(h64, w64, top_ids, top_lp, labels, teacher_target_logprobs=sampled_lp,
                                              bias=b64, **opts)
    got = fusedloss.sparse_distillation_loss(h32, w32, top_ids, top_lp.float(), labels,
                                             teacher_target_logprobs=sampled_lp.float(), bias=b32, backend="torch",
                                             **opts)
    assert got.dtype == torch.float32 and rel_err(got, want) <= FP32_TOL
    for g, r in zip(grads(got, (h32, w32, b32)), grads(want, (h64, w64, b64))):
        assert rel_err(g, r) <= FP32_TOL


def test_bad_input_names_the_argument():
    top_ids, top_lp, labels, sampled_lp = served_teacher(3)
    h, w, _ = head(bias=False)
    call = fusedloss.sparse_distillation_loss
    with pytest.raises(ValueError, match="loss_top_k must be 1 with beta > 0"):
        call(h, w, top_ids, top_lp, labels, teacher_target_logprobs=sampled_lp, beta=0.5)
    with pytest.raises(ValueError, match="teacher_target_logprobs"):
        call(h, w, None, None, labels, beta=1.0)
    with pytest.raises(ValueError, match="targets"):
        call(h, w, None, None, None, teacher_target_logprobs=sampled_lp, beta=1.0)
    with pytest.raises(ValueError, match="teacher_ids"):
        call(h, w, None, top_lp, labels, beta=0.0)
    with pytest.raises(ValueError, match="teacher_logprobs must have the shape"):
        call(h, w, top_ids, top_lp[..., :2], labels, beta=0.0)
    with pytest.raises(ValueError, match="loss_top_k"):
        call(h, w, top_ids, top_lp, labels, beta=0.0, loss_top_k=4)
    with pytest.raises(ValueError, match="reverse_kl_top_1_mode"):
        call(h, w, None, None, labels, teacher_target_logprobs=sampled_lp, reverse_kl_top_1_mode="argmax")
    with pytest.raises(ValueError, match="beta"):
        call(h, w, top_ids, top_lp, labels, beta=1.5)
    with pytest.raises(ValueError, match="renormalize=False"):
        call(h, w, top_ids, top_lp, labels, beta=0.0, renormalize=False)
    with pytest.raises(ValueError, match="log_prob_min_clamp"):
        call(h, w, top_ids, top_lp, labels, beta=0.0, log_prob_min_clamp=-10.0)
    with pytest.raises(ValueError, match="loss_max_clamp"):
        call(h, w, top_ids, top_lp, labels, beta=0.0, loss_max_clamp=-1.0)
    bad_ids = top_ids.clone()
    bad_ids[1, 0, 0] = V
    with pytest.raises(ValueError, match="teacher_ids contains"):
        call(h, w, bad_ids, top_lp, labels, beta=0.0)
    missing = sampled_lp.clone()
    missing[1, 0] = -math.inf
    with pytest.raises(ValueError, match="teacher_target_logprobs is missing"):
        call(h, w, None, None, labels, teacher_target_logprobs=missing, beta=1.0)


# --------------------------------------------------------------------------------------------------
# token_logprobs with K targets per position


def several_targets_case(dtype):
    h, w, b, t = make_head(0, 24, 131, leading=(3, 4), bias=True, seed=8)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 131, (3, 4, 6), generator=g)
    ids[..., 0] = t  # the peaked rows' targets, logp ~ 0, beside tokens ~30 nats below
    ids[0, 1, 2:] = -100
    ids[2, 3] = -100  # a position with no target at all
    ids[1, 2, 3] = ids[1, 2, 1]  # a repeated id
    return [x.to(dtype) for x in (h, w, b)], ids


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("return_entropy", [False, True])
def test_token_logprobs_several_targets(backend, device, dtype, return_entropy):
    (h, w, b), ids = several_targets_case(dtype)
    leaves = [x.detach().to(device).requires_grad_() for x in (h, w, b)]
    masters = [x.detach().double().requires_grad_() for x in (h, w, b)]
    got = fusedloss.token_logprobs(*leaves[:2], ids.to(device), bias=leaves[2], return_entropy=return_entropy,
                                   backend=backend, **TRANSFORMS)
    want = reference.token_logprobs(*masters[:2], ids, bias=masters[2], return_entropy=return_entropy,
                                    **TRANSFORMS)
    got, want = (got, want) if return_entropy else ((got,), (want,))
    assert got[0].shape == (3, 4, 6) and bool((got[0][ids.to(device) == -100] == 0).all())
    tol = fp64_tol(backend) if dtype == torch.float64 else FP32_TOL
    cotangents = [torch.randn(x.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
                  for i, x in enumerate(want)]
    for a, e in zip(got, want):
        assert rel_err(a, e) <= tol
    objective = sum((a.double() * c.to(a.device)).sum() for a, c in zip(got, cotangents))
    expected = sum((e * c).sum() for e, c in zip(want, cotangents))
    for name, g, r in zip("hwb", grads(objective, leaves), grads(expected, masters)):
        assert rel_err(g, r) <= tol, (name, rel_err(g, r))


def test_token_logprobs_several_targets_equal_one_call_per_column():
    (h, w, b), ids = several_targets_case(torch.float64)
    got = fusedloss.token_logprobs(h, w, ids, bias=b, backend="torch")
    for k in range(ids.shape[-1]):
        one = fusedloss.token_logprobs(h, w, ids[..., k], bias=b, backend="torch")
        assert rel_err(got[..., k], one) <= 1e-14


def test_token_logprobs_several_targets_bad_input():
    (h, w, b), ids = several_targets_case(torch.float64)
    with pytest.raises(ValueError, match="targets must have shape"):
        fusedloss.token_logprobs(h, w, ids[:2])
    bad = ids.clone()
    bad[0, 0, 0] = 131
    with pytest.raises(ValueError, match="targets contains 131"):
        fusedloss.token_logprobs(h, w, bad)


def test_several_targets_and_sparse_distillation_on_the_cuda_host_path(monkeypatch):
    """The CUDA backend's statistics (its kernels' host twins, on the CPU) under K targets per position and
    the sparse distillation loss: float64 values and gradients as the reference's."""
    from fusedloss.backends.cuda import backend as cuda
    from fusedloss.core import registry

    if not cuda.extension_built():
        pytest.skip(f"CUDA extension not built: {cuda.availability()}")
    original = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))
    (h, w, b), ids = several_targets_case(torch.float64)
    leaves = [x.detach().requires_grad_() for x in (h, w, b)]
    masters = [x.detach().requires_grad_() for x in (h, w, b)]
    got = fusedloss.token_logprobs(*leaves[:2], ids, bias=leaves[2], backend="cuda", **TRANSFORMS)
    want = reference.token_logprobs(*masters[:2], ids, bias=masters[2], **TRANSFORMS)
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert rel_err(got, want) <= 1e-9
    for g, r in zip(grads((got * cotangent).sum(), leaves), grads((want * cotangent).sum(), masters)):
        assert rel_err(g, r) <= 1e-9
    top_ids, top_lp, labels, sampled_lp = served_teacher(1)
    hd, wd, bd = head()
    opts = dict(teacher_target_logprobs=sampled_lp, beta=0.5, **TRANSFORMS)
    got = fusedloss.sparse_distillation_loss(hd, wd, top_ids, top_lp, labels, bias=bd, backend="cuda", **opts)
    want = reference.sparse_distillation_loss(hd, wd, top_ids, top_lp, labels, bias=bd, **opts)
    assert rel_err(got, want) <= 1e-9
    for g, r in zip(grads(got, (hd, wd, bd)), grads(want, (hd, wd, bd))):
        assert rel_err(g, r) <= 1e-9


# --------------------------------------------------------------------------------------------------
# token_logprobs' sum of squared probabilities (verl's sum_pi_squared)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("several", [False, True], ids=["one_target", "k_targets"])
def test_sum_sq_probs(backend, device, dtype, several):
    (h, w, b), ids = several_targets_case(dtype)
    targets = ids if several else ids[..., 0]
    got = fusedloss.token_logprobs(h.to(device), w.to(device), targets.to(device), bias=b.to(device),
                                   return_entropy=True, return_sum_sq_probs=True, backend=backend, **TRANSFORMS)
    want = reference.token_logprobs(h.double(), w.double(), targets, bias=b.double(), return_entropy=True,
                                    return_sum_sq_probs=True, **TRANSFORMS)
    assert len(got) == 3 and not got[2].requires_grad
    ignored = (targets == -100).all(-1) if several else targets == -100
    assert bool(ignored.any()) and bool((got[2][ignored.to(device)] == 0).all())
    peaked = want[2][~ignored]
    assert float(peaked.max()) > 0.9 and float(peaked.min()) < 0.1  # confident and spread rows both present
    tol = fp64_tol(backend) if dtype == torch.float64 else FP32_TOL
    for a, e in zip(got, want):
        assert rel_err(a, e) <= tol
    alone = fusedloss.token_logprobs(h.to(device), w.to(device), targets.to(device), bias=b.to(device),
                                     return_sum_sq_probs=True, backend=backend, **TRANSFORMS)
    assert len(alone) == 2 and rel_err(alone[1], want[2]) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_several_targets_half_no_worse_than_naive(dtype):
    """bf16/fp16 heads: the K log-probs, the entropy and the gradients are no worse than the naive same-dtype
    path's (fusedloss.reference on the half-precision tensors), both against float64."""
    (h, w, b), ids = several_targets_case(torch.float64)
    half = [x.to(dtype) for x in (h, w, b)]
    runs = {}
    for name, fn, tensors, run in (("fused", fusedloss.token_logprobs, half, dict(backend="torch")),
                                   ("naive", reference.token_logprobs, half, {}),
                                   ("exact", reference.token_logprobs, [x.double() for x in half], {})):
        leaves = [x.detach().clone().requires_grad_() for x in tensors]
        logp, entropy = fn(*leaves[:2], ids, bias=leaves[2], return_entropy=True, **run)
        runs[name] = (logp, entropy, *grads(logp.sum() + entropy.sum(), leaves))
    for got, naive, exact in zip(runs["fused"], runs["naive"], runs["exact"]):
        assert rel_err(got, exact) <= max(rel_err(naive, exact), FP32_TOL)


@pytest.mark.parametrize("where,value", [((1, 0, 0), math.nan), ((1, 2, 2), math.nan), ((1, 2, 2), math.inf),
                                         ((0, 4, 0), math.inf)],
                         ids=["nan-top1", "nan-column-3", "inf-column-3", "inf-top1"])
def test_non_finite_teacher_logprobs_where_read(where, value):
    """beta == 0 reads the first loss_top_k log-probs of every scored position: -inf there is an absent entry
    (TRL's padding), NaN or +inf a broken teacher, refused naming the argument (TRL's ``> -inf`` test would
    keep +inf, a loss of ~1e308 with NaN gradients, and drop NaN as absent)."""
    top_ids, top_lp, labels, _ = served_teacher(4, seed=13)
    h, w, _ = head(bias=False)
    assert labels[where[:2]] != -100
    bad = top_lp.clone()
    bad[where] = value
    with pytest.raises(ValueError, match="teacher_logprobs holds NaN or \\+inf at 1 of 8 scored positions"):
        fusedloss.sparse_distillation_loss(h, w, top_ids, bad, labels, beta=0.0, backend="torch")
    with pytest.raises(ValueError, match="teacher_logprobs"):
        fusedloss.sparse_distillation_loss(h, w, top_ids, bad, labels, beta=0.0, loss_add_tail=False, backend="torch")
    if where[-1] == 0:  # the top-1, read by the mixed divergence too
        with pytest.raises(ValueError, match="teacher_logprobs is missing"):
            fusedloss.sparse_distillation_loss(h, w, top_ids, bad, labels, beta=0.5, loss_top_k=1,
                                               teacher_target_logprobs=torch.zeros(B, T, dtype=torch.float64),
                                               backend="torch")


def test_non_finite_teacher_logprobs_where_not_read(backend, device):
    """NaN or +inf at positions that are not scored, or past loss_top_k, are never read: the loss and its
    gradients are those with -inf there (TRL's padding), equal to TRL's own on that data; -inf inside the
    scored top-k stays an absent entry."""
    top_ids, top_lp, labels, _ = served_teacher(4, seed=13)
    assert bool((top_lp[labels != -100][:, :3] == -math.inf).any())  # absent entries among those read
    noisy = top_lp.clone()
    noisy[0, 0] = torch.tensor([math.nan, math.inf, math.nan, math.inf])  # labels[0, 0] == -100
    noisy[2, 1, 1] = math.nan  # the fully ignored row
    noisy[1, 3, 3] = math.inf  # past loss_top_k=3
    noisy[1, 4, 3] = math.nan
    assert bool(labels[0, 0] == -100) and bool(labels[1, 3] != -100)
    h, w, b = head()
    want = trl_loss(h, w, b, top_ids[..., :3], top_lp[..., :3], labels, None, beta=0.0, loss_add_tail=True)
    want_grads = grads(want, (h, w, b))
    hd, wd, bd = (t.detach().to(device).requires_grad_() for t in (h, w, b))
    got = fusedloss.sparse_distillation_loss(hd, wd, top_ids.to(device), noisy.to(device), labels.to(device),
                                             beta=0.0, loss_top_k=3, bias=bd, backend=backend)
    tol = fp64_tol(backend)
    assert rel_err(got, want) <= tol
    for name, g, r in zip("hwb", grads(got, (hd, wd, bd)), want_grads):
        assert r.norm() > 0 and rel_err(g, r) <= tol, (name, rel_err(g, r))
