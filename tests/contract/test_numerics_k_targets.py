"""K log-probs per position on confident rows: ``token_logprobs`` with ``[..., K]`` targets and
``sparse_distillation_loss``, every backend that runs here (torch; triton under its interpreter; cuda through its
host twins), against a float64 oracle on the same rounded inputs, and the bias gradient of half-precision heads.

The K columns are named columns of the statistics pass (core/columns.py): their logits come from the tiles the
statistics fold, and their dz is formed with every one-hot share in fp32 before dx is rounded once, so the K
path meets the one-target bounds (docs/design.md, "Numerical doctrine"):

* float64 within 1e-10 (1e-9 off the torch backend) of the float64 oracle, also on rows whose log-probability is
  -1e-13 (a logit read from a second product, rounded in another order, made its last bit the leading digit);
* float32 within 1e-5, or 4x the naive fp32 path's error where that is larger;
* bf16 / fp16 gradients no worse than the naive same-dtype path's (two shares rounded apart cancelled to noise
  on a confident row: 0.5 relative against 9e-3 naive, 0.4 to 2.8 through the sparse tail bucket);
* a deterministic d weight: bitwise the same from run to run with several CPU threads;
* d bias of a bf16 / fp16 head summed from dx as formed, never from its rounded copy: every entry within half a
  unit in the last place of the float64 value (summing rounded dx left entries 1.2 ulp off in bf16, 0.8 to 22 in
  fp16).

The float64 oracle is a stable log-softmax (tests/oracle.py: the maximum's log-probability is -log1p(t), which
keeps the digits torch.log_softmax loses at 1 - q = 1e-13) and TRL's tail bucket written from its formula.
"""

from __future__ import annotations

import math

import oracle
import pytest
import torch
from _errors import rel_err
from conftest import FP32_TOL, fp64_tol

import fusedloss
from fusedloss import reference

F64 = torch.float64
V, D = 131, 24  # a prime vocabulary: padded tiles everywhere
GAPS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-8, 1e-11, 1e-13)  # 1 - q of the confident rows' target


def confident_head(seed: int, dtype: torch.dtype, *, gaps=GAPS, bias: bool = True):
    """(hidden, weight, bias, ids [N, K]) rounded to ``dtype`` (float64 on the CPU): row i puts 1 - q ~ gaps[i] on
    column ids[i, 0]; the other ids are two random columns, a repeat of the first and an ignored entry, and one
    more row has no id at all."""
    g = torch.Generator().manual_seed(seed)
    n = len(gaps) + 1
    h = torch.randn(n, D, generator=g, dtype=F64)
    w = torch.randn(V, D, generator=g, dtype=F64) * 0.3
    b = torch.randn(V, generator=g, dtype=F64) * 0.2 if bias else None
    top = torch.randperm(V, generator=g)[:n]
    for i, gap in enumerate(gaps):
        z = h[i] @ w.T + (0.0 if b is None else b)
        others = torch.logsumexp(torch.cat((z[:top[i]], z[top[i] + 1:])), 0)
        w[top[i]] += h[i] / h[i].norm() ** 2 * (others - math.log(gap) - z[top[i]])  # q ~ 1 - gap there
    ids = torch.stack((top, torch.randint(0, V, (n,), generator=g), torch.randint(0, V, (n,), generator=g), top,
                       torch.full((n,), -100)), dim=1)
    ids[-1] = -100
    rounded = (None if t is None else t.to(dtype).to(F64) for t in (h, w, b))
    return (*rounded, ids)


def leaves(tensors, dtype, device):
    return [None if t is None else t.detach().to(device=device, dtype=dtype).requires_grad_() for t in tensors]


def grads(out, tensors):
    return torch.autograd.grad(out, [t for t in tensors if t is not None])


def naive_logprobs(h, w, b, ids):
    """The naive fp32 path: fp32 logits, torch.log_softmax."""
    return torch.where(ids != -100, torch.log_softmax(h @ w.T + b, -1).gather(1, ids.clamp(min=0)), 0.0)


TRANSFORMS = (None, dict(temperature=0.8, logit_scale=1.2, softcap=20.0))


# ----------------------------------------------------------------------------------------------------------------
# token_logprobs with K targets


@pytest.mark.parametrize("transform", TRANSFORMS, ids=["plain", "transformed"])
def test_float64_k_log_probs_keep_the_digits_of_confident_rows(any_engine, transform):
    backend, device = any_engine
    h, w, b, ids = confident_head(0, F64)
    got_in = leaves((h, w, b), F64, device)
    want_in = leaves((h, w, b), F64, "cpu")
    got, entropy = fusedloss.token_logprobs(*got_in[:2], ids.to(device), bias=got_in[2], return_entropy=True,
                                            backend=backend, **(transform or {}))
    want = oracle.target_logprobs(*want_in, ids, transform=transform)
    tol = fp64_tol(backend)
    confident = ids[:, 0] >= 0
    # each confident entry on its own (log q from -1e-2 to -1e-13): a norm over the row would hide them
    for i in torch.nonzero(confident).squeeze(1).tolist():
        assert rel_err(got[i, 0], want[i, 0]) <= tol, (i, float(got[i, 0]), float(want[i, 0]))
    assert rel_err(got, want) <= tol
    cot = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    cot_h = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(2), dtype=F64)
    want_entropy = oracle.entropy(oracle.log_softmax(oracle.logits(*want_in, **(transform or {}))))
    want_entropy = torch.where(confident, want_entropy, 0.0)
    assert rel_err(entropy, want_entropy) <= tol
    for name, g, r in zip("hwb", grads((got * cot.to(device)).sum() + (entropy * cot_h.to(device)).sum(), got_in),
                          grads((want * cot).sum() + (want_entropy * cot_h).sum(), want_in)):
        assert rel_err(g, r) <= tol, (name, rel_err(g, r))


def test_float64_k_log_probs_equal_the_one_target_call_on_confident_rows(any_engine):
    backend, device = any_engine
    h, w, b, ids = confident_head(3, F64)
    args = [t.to(device) for t in (h, w)]
    got = fusedloss.token_logprobs(*args, ids.to(device), bias=b.to(device), backend=backend)
    for k in range(ids.shape[1]):
        one = fusedloss.token_logprobs(*args, ids[:, k].to(device), bias=b.to(device), backend=backend)
        # entry by entry: log q from -30 to -1e-13 in one column
        assert float(((got[:, k] - one).abs() / one.abs().clamp(min=1e-300)).max()) <= 1e-14, k


def test_float32_k_log_probs_and_gradients_on_confident_rows(any_engine):
    """Within 1e-5 of float64 on the fp32 inputs, or 4x the naive fp32 path's error where that is larger: each
    confident entry, and the gradients."""
    backend, device = any_engine
    h, w, b, ids = confident_head(1, torch.float32, gaps=GAPS[:6])
    got_in = leaves((h, w, b), torch.float32, device)
    want_in = leaves((h, w, b), F64, "cpu")
    naive_in = leaves((h, w, b), torch.float32, "cpu")
    got = fusedloss.token_logprobs(*got_in[:2], ids.to(device), bias=got_in[2], backend=backend)
    want = oracle.target_logprobs(*want_in, ids)
    naive = naive_logprobs(*naive_in, ids)
    for i in range(len(GAPS[:6])):
        bound = max(FP32_TOL, 4 * rel_err(naive[i, 0], want[i, 0]))
        assert rel_err(got[i, 0], want[i, 0]) <= bound, (i, float(got[i, 0]), float(want[i, 0]))
    cot = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    for name, g, r, nv in zip("hwb", grads((got.double() * cot.to(device)).sum(), got_in),
                              grads((want * cot).sum(), want_in), grads((naive.double() * cot).sum(), naive_in)):
        assert rel_err(g, r) <= max(FP32_TOL, 4 * rel_err(nv, r)), (name, rel_err(g, r), rel_err(nv, r))


def _half_dtypes(backend):
    return (torch.float16,) if backend == "triton" else (torch.bfloat16, torch.float16)  # no bf16 in the interpreter


def test_half_k_gradients_no_worse_than_naive_on_confident_rows(any_engine):
    """bf16 / fp16: the K log-probs' gradients (the confident target and the others) no worse than the naive
    same-dtype path's, both against float64 on the same half-precision inputs; or within 1.5x of the float64
    gradient rounded once to the dtype, which no path can beat (the GPU backends round dx to the dtype as the
    naive path does, and both then sit at that floor, a few percent apart either way)."""
    backend, device = any_engine
    for dtype in _half_dtypes(backend):
        h, w, b, ids = confident_head(2, dtype, gaps=GAPS[:5])
        runs = {}
        for name, dt, dev, fn in (("fused", dtype, device, lambda *a, **k: fusedloss.token_logprobs(
                *a, backend=backend, **k)), ("naive", dtype, "cpu", reference.token_logprobs),
                ("exact", F64, "cpu", reference.token_logprobs)):
            x = leaves((h, w, b), dt, dev)
            logp = fn(*x[:2], ids.to(dev), bias=x[2])
            cot = torch.randn(ids.shape, generator=torch.Generator().manual_seed(5), dtype=F64).to(dev)
            runs[name] = grads((logp.double() * cot).sum(), x)
        for name, got, naive, exact in zip("hwb", runs["fused"], runs["naive"], runs["exact"]):
            bound = max(rel_err(naive, exact), 1.5 * rel_err(exact.to(dtype), exact))
            assert rel_err(got, exact) <= bound, (dtype, name, rel_err(got, exact), rel_err(naive, exact))


def test_k_log_probs_whose_gradients_sum_to_zero(any_engine):
    """A row whose K gradients sum to zero has every dz coefficient zero, and still carries gradient at its
    named columns: log q_1 - log q_2 = z_1 - z_2, so d hidden = W_1 - W_2 exactly."""
    backend, device = any_engine
    h, w, b, _ = confident_head(4, F64, gaps=GAPS[:3])
    ids = torch.tensor([[5, 17]] * h.shape[0])
    x = leaves((h, w), F64, device)
    logp = fusedloss.token_logprobs(*x, ids.to(device), backend=backend)
    dh, dw = grads((logp[:, 0] - logp[:, 1]).sum(), x)
    assert rel_err(dh, (w[5] - w[17]).expand_as(h)) <= 1e-14
    want = torch.zeros_like(w)
    want[5], want[17] = h.sum(0), -h.sum(0)
    assert rel_err(dw, want) <= 1e-14


# ----------------------------------------------------------------------------------------------------------------
# sparse_distillation_loss on a confident student: the tail bucket log(1 - sum_k q_k) divides by 1 - mass


def sparse_case(seed: int, dtype: torch.dtype):
    """A student confident on a served teacher's top-4 (its top-k mass from 1 - 1e-1 to 1 - 4e-5), a flatter
    teacher, beta = 0 with the tail bucket (TRL's default for beta = 0)."""
    g = torch.Generator().manual_seed(seed)
    n, k = 6, 4
    h = torch.randn(n, D, generator=g, dtype=F64)
    w = torch.randn(V, D, generator=g, dtype=F64) * 0.3
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n)])
    for i in range(n):
        for j in range(k):
            w[ids[i, j]] += h[i] / h[i].norm() ** 2 * (7.0 + 7.0 * i / (n - 1) - 0.7 * j)
    teacher = torch.log_softmax(0.25 * (h @ w.T) + 0.3 * torch.randn(n, V, generator=g, dtype=F64), -1)
    served = teacher.gather(1, ids).float().double()  # as a server returns them: float32
    return h.to(dtype).to(F64), w.to(dtype).to(F64), ids, served


def tail_forward_kl(student_lp, teacher_lp):
    """TRL's forward KL with the tail bucket (``_add_tail_bucket``, ``_jsd_divergence`` at beta 0), summed."""
    def tail(lp):
        mass = torch.logsumexp(lp, -1, keepdim=True).clamp(max=-1e-7)
        return torch.cat((lp, torch.log(-torch.expm1(mass))), -1)
    s, t = tail(student_lp), tail(teacher_lp)
    return (t.exp() * (t - s)).sum()


def sparse_loss(h, w, ids, served, dtype, device, backend=None):
    x = leaves((h, w), dtype, device)
    if backend is not None:
        loss = fusedloss.sparse_distillation_loss(*x, ids.to(device), served.to(device, x[0].dtype if dtype == F64
                                                                            else torch.float32),
                                                  beta=0.0, reduction="sum", backend=backend)
    elif dtype == F64:
        loss = tail_forward_kl(oracle.target_logprobs(*x, None, ids), served)
    else:  # the naive same-dtype path: logits in dtype, fp32 log-softmax and loss (TRL's code)
        lp = torch.log_softmax((x[0] @ x[1].T).float(), -1).gather(1, ids)
        loss = tail_forward_kl(lp, served.float())
    return loss, grads(loss, x)


def test_sparse_distillation_float64_on_a_confident_student(any_engine):
    backend, device = any_engine
    for seed in range(2):
        h, w, ids, served = sparse_case(seed, F64)
        got, got_grads = sparse_loss(h, w, ids, served, F64, device, backend)
        want, want_grads = sparse_loss(h, w, ids, served, F64, "cpu")
        assert rel_err(got, want) <= fp64_tol(backend)
        for name, g, r in zip("hw", got_grads, want_grads):
            assert rel_err(g, r) <= fp64_tol(backend), (seed, name, rel_err(g, r))


def test_sparse_distillation_float32_loss_on_a_confident_student(any_engine):
    """The loss within 1e-5 of float64, or 4x the naive fp32 path's error where that is larger (the worst over
    seeds on both sides: one naive run can be exact by luck, and fp32's own tail arithmetic is ill-conditioned
    here, 1 - mass down to 4e-5)."""
    backend, device = any_engine
    worst = worst_naive = 0.0
    for seed in range(6):
        h, w, ids, served = sparse_case(seed, torch.float32)
        want, _ = sparse_loss(h, w, ids, served, F64, "cpu")
        got, _ = sparse_loss(h, w, ids, served, torch.float32, device, backend)
        naive, _ = sparse_loss(h, w, ids, served, torch.float32, "cpu")
        worst, worst_naive = max(worst, rel_err(got, want)), max(worst_naive, rel_err(naive, want))
    assert worst <= max(FP32_TOL, 4 * worst_naive), (worst, worst_naive)


def test_sparse_distillation_half_gradients_no_worse_than_naive(any_engine):
    backend, device = any_engine
    for dtype in _half_dtypes(backend):
        for seed in range(2):
            h, w, ids, served = sparse_case(seed, dtype)
            _, exact = sparse_loss(h, w, ids, served, F64, "cpu")
            _, got = sparse_loss(h, w, ids, served, dtype, device, backend)
            _, naive = sparse_loss(h, w, ids, served, dtype, "cpu")
            for name, g, nv, e in zip("hw", got, naive, exact):
                assert rel_err(g, e) <= rel_err(nv, e), (dtype, seed, name, rel_err(g, e), rel_err(nv, e))


# ----------------------------------------------------------------------------------------------------------------
# Determinism


def test_k_targets_gradients_are_bitwise_reproducible_with_several_threads(any_engine):
    """The K path's d weight, d hidden and d bias come out of the statistics op's products: no atomic
    accumulation, the same bits from run to run on a multi-threaded CPU (entries naming a few columns many
    times over were where an index_put_ accumulation differed)."""
    backend, device = any_engine
    n = 60 if backend == "triton" else 600  # the interpreter is slow
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3, (n, 8), generator=g)
    tensors = (torch.randn(n, 64, generator=g), torch.randn(50, 64, generator=g), torch.randn(50, generator=g))
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        runs = []
        for _ in range(3):
            x = leaves(tensors, torch.float32, device)
            logp = fusedloss.token_logprobs(*x[:2], ids.to(device), bias=x[2], backend=backend)
            served = torch.full((n, 8), -2.5).to(device)
            loss = fusedloss.sparse_distillation_loss(*x[:2], ids.to(device), served, bias=x[2], beta=0.0,
                                                      backend=backend)
            runs.append(grads(logp.sum() + loss, x))
    finally:
        torch.set_num_threads(threads)
    for run in runs[1:]:
        for name, a, e in zip("hwb", run, runs[0]):
            assert torch.equal(a, e), name


# ----------------------------------------------------------------------------------------------------------------
# d bias of a half-precision head


def _spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between consecutive ``dtype`` values around x (float64)."""
    bits = 8 if dtype == torch.bfloat16 else 11  # significand bits, the implicit one included
    _, exponent = torch.frexp(x)
    smallest = torch.finfo(dtype).smallest_normal * 2.0 ** (1 - bits)
    return torch.ldexp(torch.ones_like(x), exponent - bits).clamp(min=smallest)


@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["grad_in_forward", "composable"])
def test_half_bias_gradient_is_rounded_once(any_engine, grad_in_forward):
    """cross_entropy of a bf16 / fp16 head with a bias and a temperature (the grad-in-forward path, and the statistics
    op's backward): every entry of d bias within half a unit in the last place of the float64 value, i.e. the
    sum of dx as formed, rounded once. Summed from dx rounded to the half dtype, entries were 1.2 ulp off (bf16)
    and up to 22 (fp16, the composable path), where the naive path is 1.4 and 7."""
    backend, device = any_engine
    n, v, d = (37, 257, 16) if backend == "triton" else (67, 1031, 32)
    g = torch.Generator().manual_seed(0)
    tensors = (torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) * 0.08,
               torch.randn(v, generator=g) * 0.5)
    y = torch.randint(0, v, (n,), generator=g)
    for dtype in _half_dtypes(backend):
        x = leaves(tensors, dtype, device)
        loss = fusedloss.cross_entropy(*x[:2], y.to(device), bias=x[2], temperature=0.9, backend=backend,
                                       grad_in_forward=grad_in_forward)
        (db,) = torch.autograd.grad(loss, x[2])
        e = leaves(tensors, dtype, "cpu")
        e = [t.detach().double().requires_grad_() for t in e]
        (want,) = torch.autograd.grad(torch.nn.functional.cross_entropy((e[0] @ e[1].T + e[2]) / 0.9, y), e[2])
        ulps = ((db.double().cpu() - want).abs() / _spacing(want, dtype)).max().item()
        assert ulps <= 0.51, (dtype, ulps)
