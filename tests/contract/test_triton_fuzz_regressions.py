"""Numerical defects of the GPU kernels found by differential fuzzing (each test names its fuzzed case by
number), as regressions on the Triton backend, and the grad-in-forward path against the composable one.

The per-element rules every backend follows at dz (docs/design.md, "The dz formula"):

* (A) a term whose coefficient the problem cannot produce is never formed: c2 r only with a reverse KL,
  c4 log m only with the JSD, c3 p only with a forward KL, so a teacher's -inf entry never gives 0 * inf;
* (B) at the target column, q_y == 0 contributes exactly ``a`` (0 log 0 -> 0, as on every other column);
* (C) the target column is ``-a expm1(log q_y) + q_y inner_y`` with inner_y free of a: no cancellation for a
  confident target nor for an improbable one (the former ``(a + inner) + inner expm1(log q_y)`` lost q_y inner
  when a != -inner).

And the backward forms log q = (z - lse) - lse_lo from the forward's lse, so the logits it forms again must
be the forward's bit for bit: a row's gradient may not depend on which other rows carry gradient.
Shapes are tiny (the interpreter); with a GPU the same tests run on it.
"""

from __future__ import annotations

import math

import oracle
import pytest
import torch
from _errors import rel_err
from conftest import make_head, make_teacher

import fusedloss
from fusedloss.backends import torch as torch_backend
from fusedloss.core.problem import (
    GradientNeeds,
    LogitTransform,
    Statistics,
    StatsProblem,
)
from fusedloss.core.statistics import dz_coefficients

triton_backend = pytest.importorskip("fusedloss.backends.triton.backend")
triton_plan = pytest.importorskip("fusedloss.backends.triton.plan")
if triton_backend.availability() != "available":  # pragma: no cover - depends on the machine
    pytest.skip(f"triton backend: {triton_backend.availability()}", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def leaves(*tensors, dtype):
    return [torch.tensor(t, dtype=dtype, device=DEVICE).requires_grad_(True) for t in tensors]


@pytest.fixture(params=["grad_in_forward", "composable"])
def path(request, monkeypatch):
    """Both gradient paths of the row-local losses: the 3-product grad-in-forward one and the statistics op's."""
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1" if request.param == "grad_in_forward" else "0")
    return request.param


# ----------------------------------------------------------------------------------------------------------
# Fuzz finding 1 (rule A): a teacher's masked vocabulary entry


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_masked_teacher_entry_gives_finite_gradients(beta, dtype, path):
    """Fuzzed case #1: forward KL and JSD with a teacher bias of -inf: the loss was finite and d hidden,
    d W NaN (c2 log p was formed with c2 = 0 and log p = -inf). Expected: the torch backend's gradients."""
    grads = {}
    for backend in ("triton", "torch"):
        h, w = leaves([[1.541]], [[-0.2934], [-2.1788]], dtype=dtype)
        ht, wt, tb = (torch.tensor(x, dtype=dtype, device=DEVICE) for x in ([[0.6127]], [[-1.1754], [-0.7646]],
                                                                             [-math.inf, 0.0]))
        loss = fusedloss.distillation_loss(h, w, ht, wt, beta=beta, teacher_bias=tb, backend=backend)
        loss.backward()
        grads[backend] = (loss.detach(), h.grad, w.grad)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    for got, want in zip(grads["triton"], grads["torch"]):
        assert bool(torch.isfinite(got).all()), grads["triton"]
        assert rel_err(got, want) <= tol


# ----------------------------------------------------------------------------------------------------------
# Fuzz finding 2 (rule B): a label on a masked student logit


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_label_on_a_masked_entry_gives_finite_gradients(dtype, path):
    """Fuzzed case #2: distillation with the label only marking a valid token, on a student entry masked
    by its bias, and the entropy of token_logprobs at such a label: finite loss, NaN gradients before
    (q_y inner_y with q_y = 0 and inner_y = c1 log 0). With entry 1 masked the student is the constant
    one-hot q = e_0: the reverse KL is -log p_0 and the entropy 0, and no gradient moves either."""
    ht, wt = (torch.tensor(x, dtype=dtype, device=DEVICE) for x in ([[0.6127]], [[-1.1754], [-0.7646]]))
    y = torch.tensor([1], device=DEVICE)
    zt = (ht @ wt.T).double()
    expected = {"distillation": float(torch.logsumexp(zt[0], 0) - zt[0, 0]), "entropy": 0.0}
    tiny = 1e-12 if dtype == torch.float64 else 1e-6  # a few ulp of the O(1) terms that cancel
    for run in ("distillation", "entropy"):
        h, w, b = leaves([[1.541]], [[-0.2934], [-2.1788]], [0.2842, -math.inf], dtype=dtype)
        if run == "distillation":
            loss = fusedloss.distillation_loss(h, w, ht, wt, y, beta=1.0, bias=b, backend="triton")
        else:
            loss = fusedloss.token_logprobs(h, w, y, bias=b, return_entropy=True, backend="triton")[1].sum()
        loss.backward()
        assert abs(float(loss.detach()) - expected[run]) <= tiny * 10, (run, float(loss.detach()))
        for grad in (h.grad, w.grad, b.grad):
            assert bool(torch.isfinite(grad).all()) and float(grad.abs().max()) <= tiny, (run, h.grad, w.grad, b.grad)


# ----------------------------------------------------------------------------------------------------------
# Fuzz finding 7 (rule C): the target column keeps its digits for improbable targets too


def test_target_column_gradient_keeps_its_digits_float64(path):
    """Fuzzed case #7: q_y = 2e-9 under an entropy term: (a + inner) + inner (q_y - 1) lost q_y inner
    (3.5e-9 relative error of d W before; float64 keeps 1e-15 of it now)."""
    h, w = leaves([[1.0]], [[20.0], [0.0], [1.0]], dtype=F64)
    y = torch.tensor([1], device=DEVICE)
    _, entropy = fusedloss.token_logprobs(h, w, y, return_entropy=True, backend="triton")
    entropy.sum().backward()
    dz = oracle.row_gradient_decimal([20.0, 0.0, 1.0], 1, 0.0, 1.0)
    assert rel_err(w.grad.cpu(), dz[:, None] * 1.0) <= 1e-13
    assert rel_err(h.grad.cpu(), dz[None, :] @ w.detach().cpu()) <= 1e-13


def test_target_column_gradient_keeps_its_digits_float32_entropy_bonus(path):
    """Fuzzed case #7 (a): 0.0461 logp + 0.4024 entropy with an improbable target (q_y = 1e-23): d W
    1.3e-5 off in fp32 before, where the naive fp32 path is 7e-8 off; fp32's 1e-5 now."""
    h, w = leaves([[1.0]], [[-0.2934], [-54.47]], dtype=torch.float32)
    y = torch.tensor([1], device=DEVICE)
    logp, entropy = fusedloss.token_logprobs(h, w, y, return_entropy=True, backend="triton")
    (0.0461 * logp + 0.4024 * entropy).sum().backward()
    z = (h.detach().double() @ w.detach().double().T)[0].cpu()
    dz = oracle.row_gradient_decimal(z.tolist(), 1, 0.0461, 0.4024)
    assert rel_err(w.grad.cpu(), dz[:, None] * float(h[0, 0])) <= 1e-5
    assert rel_err(h.grad.cpu(), dz[None, :] @ w.detach().cpu().double()) <= 1e-5


def _fp32_within_bound(run):
    """``run(dtype, how) -> gradients`` after backward: the fp32 gradients within 1e-5 of float64 or 4x the
    naive fp32 materialised path's own error (the fp32 criterion of docs/design.md, "Numerical doctrine")."""
    fused32, naive32, truth = run(torch.float32, "triton"), run(torch.float32, "naive"), run(F64, "naive")
    for got, naive, want in zip(fused32, naive32, truth):
        bound = max(1e-5, 4 * rel_err(naive, want))
        assert rel_err(got, want) <= bound, (rel_err(got, want), rel_err(naive, want))


def test_target_column_gradient_keeps_its_digits_float32_distillation(path):
    """Fuzzed case #7 (b): JSD distillation with the labels only marking valid tokens, on a label the
    student gives q_y = 2e-5 and the teacher 1/2: 1.6e-3 off in fp32 before, 21 times the bound (the expm1
    form computed q_y inner as inner - inner (1 - q_y))."""

    def run(dtype, how):
        h, w = leaves([[1.0]], [[0.0], [-10.0], [0.0]], dtype=dtype)
        ht, wt = (torch.tensor(x, dtype=dtype, device=DEVICE) for x in ([[1.0]], [[0.0], [0.6931], [0.0]]))
        y = torch.tensor([1], device=DEVICE)
        if how == "naive":
            logq = torch.log_softmax(h @ w.T, dim=1)
            logp = torch.log_softmax(ht @ wt.T, dim=1)
            logm = torch.logaddexp(logq + math.log(0.5), logp + math.log(0.5))
            loss = 0.5 * (logq.exp() * (logq - logm)).sum() + 0.5 * (logp.exp() * (logp - logm)).sum()
        else:
            loss = fusedloss.distillation_loss(h, w, ht, wt, y, beta=0.5, backend="triton")
        loss.backward()
        return h.grad, w.grad

    _fp32_within_bound(run)


# ----------------------------------------------------------------------------------------------------------
# Fuzz finding 4: the backward's logits are the forward's, whichever rows carry gradient


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_rows_gradient_does_not_depend_on_which_other_rows_carry_gradient(dtype):
    """Fuzzed case #4: rows whose coefficients are zero (a GRPO silent group, masked padding) beside
    confident rows (1 - q_y ~ 1e-7 .. 1e-3). The gradients of the confident rows must match a stable float64
    oracle as closely when their neighbours carry no gradient as when every row does, and d hidden of a
    row must be the same bits either way. 40 rows cross three row blocks of the interpreter's tiles."""
    g = torch.Generator().manual_seed(284)
    n, d, v = 40, 8, 37
    h = torch.randn(n, d, generator=g, dtype=F64)
    w = torch.randn(v, d, generator=g, dtype=F64) * 0.1
    w[:, 0] = 0.0
    w[0, 0] = 1.0
    h[:, 0] = 0.0
    h[1::2, 0] = torch.linspace(10.0, 16.0, n // 2, dtype=F64)  # odd rows: confident in their target 0
    y = torch.zeros(n, dtype=torch.int64)
    h, w = h.to(dtype).to(F64), w.to(dtype).to(F64)  # exactly representable in the dtype under test
    gap = 1.0 - torch.softmax(h @ w.T, 1)[:, 0]
    assert float(gap[1::2].max()) < 1e-2 and float(gap[1::2].min()) < 1e-5
    ones = torch.ones(n, dtype=F64)
    sparse = torch.where(torch.arange(n) % 2 == 1, ones, torch.zeros_like(ones))  # even rows: no gradient
    dense = torch.where(torch.arange(n) % 2 == 1, ones, torch.full_like(ones, 1e-30))
    results = {}
    for name, cot in (("sparse", sparse), ("dense", dense)):
        hh, ww = (t.to(DEVICE, dtype).clone().requires_grad_(True) for t in (h, w))
        lp = fusedloss.token_logprobs(hh, ww, y.to(DEVICE), backend="triton")
        (lp * cot.to(DEVICE, lp.dtype)).sum().backward()
        results[name] = (hh.grad, ww.grad)
        want = oracle.logprob_gradients(h, w, y, cot)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert rel_err(hh.grad[1::2], want[0][1::2]) <= tol, name
        assert rel_err(ww.grad, want[1]) <= tol, name
    assert torch.equal(results["sparse"][0][1::2], results["dense"][0][1::2])


# ----------------------------------------------------------------------------------------------------------
# The grad-in-forward path against the float64 truth, across row chunks


def _problem(case: str, dtype) -> StatsProblem:
    h, w, b, y = make_head(37, 19, 131, seed=3, bias=True, ignore_fraction=0.2)
    y = torch.where(y < 0, torch.full_like(y, -1), y)
    kw = dict(hidden=h.to(DEVICE, dtype), weight=w.to(DEVICE, dtype), bias=b.to(DEVICE, dtype), targets=y.to(DEVICE))
    if case == "cross_entropy":
        return StatsProblem(transform=LogitTransform(), **kw)
    if case == "softcap_entropy":
        return StatsProblem(transform=LogitTransform(0.7, 1.3, 5.0), want_entropy=True, want_mean_logit=True, **kw)
    th, tw, tb = make_teacher(37, 24, 131, seed=4, bias=True)
    return StatsProblem(transform=LogitTransform(1.2), teacher_hidden=th.to(DEVICE, dtype),
                        teacher_weight=tw.to(DEVICE, dtype), teacher_bias=tb.to(DEVICE, dtype),
                        teacher_transform=LogitTransform(1.2), want_kl_rev=True, want_kl_fwd=True, jsd_beta=0.3, **kw)


def _weights(p: StatsProblem, seed=5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    names = {"lse", "logp"} | ({"entropy", "mean_logit"} if p.want_entropy else set()) | (
        {"kl_rev", "kl_fwd", "jsd"} if p.has_teacher else set())
    return torch.stack([torch.randn(p.hidden.shape[0], generator=g, dtype=F64) if f in names
                        else torch.zeros(p.hidden.shape[0], dtype=F64) for f in Statistics._fields])


def _chunk_fn(p: StatsProblem, weights: torch.Tensor):
    """A row-local loss sum_k w_k . stat_k over the chunk's rows, with its dz coefficients."""

    def chunk_fn(stats: Statistics, rows):
        stacked = torch.stack(tuple(stats))
        wts = weights[:, rows].to(stacked.device, stacked.dtype)
        tgt = None if p.targets is None else p.targets[rows]
        return (wts * stacked).sum(), dz_coefficients(wts, stacked, p.jsd_beta, tgt, p.weight.shape[0])

    return chunk_fn


@pytest.mark.parametrize("case", ["cross_entropy", "softcap_entropy", "teacher"])
@pytest.mark.parametrize("workspace_mb", [None, 0.05])
def test_grad_in_forward_path_matches_the_composable_path_and_the_torch_backend(case, workspace_mb):
    """grad_in_forward_gradients (the forward keeps its tiles, the gradient reads them back) against the composable
    backward of the same problem and against the torch backend's grad-in-forward path, in float64, in one chunk and in
    several (a 50 KB workspace holds 16-row chunks of 37 rows here)."""
    p = _problem(case, F64)
    p = StatsProblem(**{**p.__dict__, "workspace_mb": workspace_mb})
    weights = _weights(p)
    needs = GradientNeeds(True, True, True)
    loss, grads = triton_backend.grad_in_forward_gradients(p, _chunk_fn(p, weights), needs)
    t_loss, t_grads = torch_backend.grad_in_forward_gradients(p, _chunk_fn(p, weights), needs)
    stats = triton_backend.forward_statistics(p)
    stacked = torch.stack(tuple(stats))
    coeffs = dz_coefficients(weights.to(stacked), stacked, p.jsd_beta, p.targets, p.weight.shape[0])
    composable = triton_backend.backward_gradients(p, stats, coeffs, needs)
    assert abs(float(loss) - float(t_loss)) <= 1e-10 * max(1.0, abs(float(t_loss)))
    assert abs(float(loss) - float((weights.to(stacked) * stacked).sum())) <= 1e-10 * max(1.0, abs(float(loss)))
    for name, got, want, other in zip(("d hidden", "d weight", "d bias"), grads, t_grads, composable):
        assert got.dtype == F64
        assert rel_err(got, want) <= 1e-9, name
        assert rel_err(got, other) <= 1e-9, name


def test_grad_in_forward_path_rows_per_chunk_follow_the_workspace():
    """The chunk rows come from the plan: whole row blocks within the workspace budget, and several chunks
    when the budget is small."""
    p = _problem("teacher", torch.float32)
    cfg = triton_backend.tiles_for(p, "grad_in_forward")
    small = StatsProblem(**{**p.__dict__, "workspace_mb": 0.05})
    needs = GradientNeeds(True, True, False)
    rows = triton_backend._plan_of(small, needs, "grad_in_forward").params["grad_in_forward_rows"]
    assert rows % cfg.block_m == 0 and rows < p.hidden.shape[0]
    per_row = triton_plan.grad_in_forward_row_bytes(131, "float32", True)
    assert rows == cfg.block_m or rows * per_row <= 0.05 * 2**20
    assert triton_backend._plan_of(p, needs, "grad_in_forward").params["grad_in_forward_rows"] >= p.hidden.shape[0]


@pytest.mark.parametrize("case", ["cross_entropy", "softcap_entropy", "teacher"])
@pytest.mark.parametrize("workspace_mb", [None, 0.05])
def test_grad_in_forward_half_precision_dx_packed_over_its_tile(case, workspace_mb):
    """fp16: the grad-in-forward path writes dx over the fp32 tile it reads (``packed_gradient_kernel``, one program per
    row block walking the columns in order). The gradients must be those of the composable path, whose dx
    has a buffer of its own and whose recomputed tiles are the forward's bit for bit: exactly equal in one
    chunk (the same products of the same dx), within fp32 rounding in several (d weight summed by chunk)."""
    p = _problem(case, torch.float16)
    p = StatsProblem(**{**p.__dict__, "workspace_mb": workspace_mb})
    weights = _weights(p)
    needs = GradientNeeds(True, True, True)
    launched = []
    real = triton_backend._packed_gradient
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_backend, "_packed_gradient", lambda *a: launched.append(1) or real(*a))
        _, grads = triton_backend.grad_in_forward_gradients(p, _chunk_fn(p, weights), needs)
    chunks = -(-p.hidden.shape[0] // triton_backend._plan_of(p, needs,
                                                             "grad_in_forward").params["grad_in_forward_rows"])
    assert len(launched) == chunks and (chunks > 1) == (workspace_mb is not None)
    stats = triton_backend.forward_statistics(p)
    stacked = torch.stack(tuple(stats))
    coeffs = dz_coefficients(weights.to(stacked), stacked, p.jsd_beta, p.targets, p.weight.shape[0])
    composable = triton_backend.backward_gradients(p, stats, coeffs, needs)
    for name, got, want in zip(("d hidden", "d weight", "d bias"), grads, composable):
        got = got.to(want.dtype)  # the grad-in-forward path returns its fp32 sums (the caller scales, then rounds)
        if chunks == 1:
            assert torch.equal(got, want), name
        else:
            assert rel_err(got, want) <= 1e-3, name  # fp16 rounding of sums taken in another order


# ----------------------------------------------------------------------------------------------------------
# The grad-in-forward path's teacher: cuBLAS raw logits, the student's forward reading ztm, the teacher fold


# (statistics, student-masked columns, teacher-masked columns, teacher soft-cap, +inf reverse KL expected): 7 and
# 60 masked on both sides, 90 on the student's only (0 log 0 in the reverse KL, +inf in the forward KL), 120 on
# the teacher's only (+inf in the reverse KL, finite in the forward KL and the JSD); a teacher soft-cap turns a
# masked teacher logit into -cap (finite), so that every student-masked column makes the forward KL +inf.
_DIVERGENCES = {
    "kl_rev": (dict(want_kl_rev=True), [7, 60, 90], [7, 60], 4.0, False),
    "kl_rev_inf": (dict(want_kl_rev=True), [7, 60, 90], [7, 60, 120], None, True),
    "kl_fwd": (dict(want_kl_fwd=True), [7, 60], [7, 60, 120], None, False),
    "jsd": (dict(jsd_beta=0.3), [7, 60, 90], [7, 60, 120], None, False),
    "all": (dict(want_kl_rev=True, want_kl_fwd=True, jsd_beta=0.7), [], [7, 60, 120], 4.0, False),
}


def _teacher_problem(divergence: str, dtype, workspace_mb=None) -> StatsProblem:
    """37 rows, V = 131 (odd; 5 interpreter tiles of 32, several splits), the rows 16..31 (a whole row block)
    and a fifth of the others ignored; the student's peak column 5 duplicated (exact ties at its maximum in
    tile 0, tile 1 and tile 3, where the teacher differs: the first one must frame the reverse KL); masked columns
    (``_DIVERGENCES``); a teacher with its own bias, scale, temperature and soft-cap, and a student with a
    temperature."""
    stats, masked, masked_t, cap, _ = _DIVERGENCES[divergence]
    peaks = (5, 70, 110)
    h, w, b, y = make_head(37, 19, 131, seed=11, bias=True, ignore_fraction=0.2, peak_ids=peaks,
                           all_ignored_rows=range(16, 32))
    y = torch.where(y < 0, torch.full_like(y, -1), y)
    th, tw, tb = make_teacher(37, 24, 131, seed=12, bias=True)
    for dup in (20, 40, 101):  # the same tile, the next one (the same split in 16-row chunks), a later split
        w[dup], b[dup] = w[5], b[5]
    b[masked] = -math.inf
    tb[masked_t] = -math.inf
    cast = dict(device=DEVICE, dtype=dtype)
    return StatsProblem(hidden=h.to(**cast), weight=w.to(**cast), bias=b.to(**cast), targets=y.to(DEVICE),
                        transform=LogitTransform(1.3), teacher_hidden=th.to(**cast),
                        teacher_weight=tw.to(**cast), teacher_bias=tb.to(**cast),
                        teacher_transform=LogitTransform(0.9, 1.1, cap), workspace_mb=workspace_mb, **stats)


def _teacher_weights(p: StatsProblem) -> torch.Tensor:
    names = {"lse", "logp", "lse_t"} | {name for name, on in (("kl_rev", p.want_kl_rev), ("kl_fwd", p.want_kl_fwd),
                                                                ("jsd", p.jsd_beta is not None)) if on}
    g = torch.Generator().manual_seed(6)
    return torch.stack([torch.randn(p.hidden.shape[0], generator=g, dtype=F64) if f in names
                        else torch.zeros(p.hidden.shape[0], dtype=F64) for f in Statistics._fields])


def _recording(chunk_fn, seen: dict):
    def record(stats: Statistics, rows):
        seen.setdefault("rows", []).append(rows)
        seen.setdefault("stats", []).append(stats)
        return chunk_fn(stats, rows)

    return record


def _stacked(seen: dict) -> dict:
    return {name: torch.cat([getattr(s, name) for s in seen["stats"]]) for name in Statistics._fields}


@pytest.mark.parametrize("divergence", list(_DIVERGENCES))
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16])
@pytest.mark.parametrize("workspace_mb", [None, 0.05])
def test_grad_in_forward_teacher_fold_matches_float64_and_the_torch_backend(divergence, dtype, workspace_mb):
    """The grad-in-forward path with a teacher (its raw logits through a product into the workspace, ztm read by the
    student's forward, the teacher's statistics from the fold over the kept tiles): every teacher statistic
    and the three gradients against the torch backend on the same values in float64, and the float64 run
    against the torch backend's to 1e-9; in one chunk and in 16-row chunks (a 50 KB workspace)."""
    p = _teacher_problem(divergence, dtype, workspace_mb)
    p64 = StatsProblem(**{**p.__dict__, **{name: getattr(p, name).to(F64) for name in (
        "hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias")}})  # the same values
    weights = _teacher_weights(p)
    needs = GradientNeeds(True, True, True)
    seen = {}
    loss, grads = triton_backend.grad_in_forward_gradients(p, _recording(_chunk_fn(p, weights), seen), needs)
    t_loss, t_grads = torch_backend.grad_in_forward_gradients(p64, _chunk_fn(p64, weights), needs)
    chunks = len(seen["rows"])
    assert chunks == (1 if workspace_mb is None else 3)
    got, want = _stacked(seen), torch_backend.forward_statistics(p64)._asdict()
    # the ties: rows whose student maximum sits on both duplicated columns read the teacher at the first
    z = (p64.hidden @ p64.weight.T + p64.bias) / 1.3
    tied = (z[:, 5] == z.amax(1)) & (p64.targets >= 0)
    assert int(tied.sum()) >= 4
    ignored = p.targets < 0
    stat_tol = 1e-12 if dtype == F64 else 1e-5
    grad_tol = 1e-10 if dtype == F64 else 1e-5 if dtype == torch.float32 else 2e-3
    names = ["lse", "lse_t"] + (["kl_rev", "kl_rev_rel", "teacher_at_max"] if p.want_kl_rev else []) + (
        ["kl_fwd"] if p.want_kl_fwd else []) + (["jsd", "kl_qm"] if p.jsd_beta is not None else [])
    # Which of the duplicated columns is the student's first maximum is decided by the computed logits: in
    # float64 the duplicates are equal to the last bit, in float32/fp16 the BLAS under the interpreter may round
    # one of them a unit above the others (its kernel for edge columns sums in another order). The statistics
    # framed at that column (the teacher there, the reverse KL's log-ratio) are then the teacher at that
    # duplicate: compared on the other rows here, and below against the teacher at one of the duplicates.
    framed = {"kl_rev_rel", "teacher_at_max"}
    exact_tie = dtype == F64
    for name in names:
        rows = slice(None) if exact_tie or name not in framed else ~tied
        assert rel_err(got[name][rows], want[name][rows]) <= stat_tol, (name, got[name], want[name])
    # lse_t as hi + lo: the residual carries what rounding hi dropped
    assert rel_err(got["lse_t"].double() + got["lse_t_lo"].double(), want["lse_t"] + want["lse_t_lo"]) <= stat_tol
    if p.want_kl_rev:
        infinite = _DIVERGENCES[divergence][4]
        assert bool(torch.isposinf(got["kl_rev"][~ignored]).all()) == infinite
        assert bool(torch.isfinite(got["kl_rev"]).all()) == (not infinite)
        zt = (p64.teacher_hidden @ p64.teacher_weight.T + p64.teacher_bias) * 1.1
        cap = _DIVERGENCES[divergence][3]
        zt = (zt if cap is None else cap * torch.tanh(zt / cap)) / 0.9
        # the teacher at column 5, not at its duplicates (20, 40, 101, at least 1e-3 away): equal up to the
        # float64 product's own rounding (a tile of columns there, the whole head here; BLAS picks the order)
        assert (zt[tied][:, [20, 40, 101]] - zt[tied, 5, None]).abs().amin() > 1e-3
        assert bool(((want["teacher_at_max"][tied].double() - zt[tied, 5]).abs()
                     <= 16 * torch.finfo(F64).eps * zt[tied, 5].abs()).all())
        if exact_tie:
            assert rel_err(got["teacher_at_max"][tied], zt[tied, 5]) <= stat_tol
        else:  # the teacher at one of the student's duplicated maxima, whichever the rounding put first
            gap = (got["teacher_at_max"][tied].double()[:, None] - zt[tied][:, [5, 20, 40, 101]]).abs().amin(1)
            assert bool((gap <= stat_tol * zt[tied][:, [5, 20, 40, 101]].abs().amax(1)).all()), gap
    assert torch.isfinite(loss) or not torch.isfinite(t_loss)
    if bool(torch.isfinite(t_loss)):
        assert abs(float(loss) - float(t_loss)) <= stat_tol * 10 * max(1.0, abs(float(t_loss)))
        for name, g, g64 in zip(("d hidden", "d weight", "d bias"), grads, t_grads):
            assert g.dtype == p.acc_dtype
            assert bool(torch.isfinite(g).all()), name
            assert rel_err(g, g64) <= grad_tol, (name, rel_err(g, g64))
    # every ignored row: zero statistics
    for name in names:
        assert bool((got[name][ignored] == 0).all()), name
