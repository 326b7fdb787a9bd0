"""The CUDA backend's kernel math, checked on the CPU through the extension's host twins.

``fusedloss._C`` exports, beside the device kernels, host loops that run the same ``__host__ __device__``
functions (csrc/fusedloss/math.h, tile.h) over CPU pointers, and ``fusedloss.backends.cuda.backend`` runs them
when handed CPU tensors. These tests compare them with float64 brute force on materialised logits and
with the torch backend: every statistic, ignored rows, bias, scale, soft-cap, temperature, peaked rows,
prime vocabularies, one token, a teacher (with its own logit_scale and soft-cap), the JSD, multi-tile
merging, bf16/fp16 tiles, the lse_lo residuals, is_top1's first-argmax rule on exact ties, and fp32 confident
rows (lse ~ 30) within 1e-5 of float64. Skipped (with the reason) only when the extension is not built.
"""

from __future__ import annotations

import dataclasses
import math

import oracle
import pytest
import torch
from _errors import plain_rel_err

from fusedloss.backends import torch as torch_backend
from fusedloss.backends.cuda import backend as cuda
from fusedloss.core.problem import NUM_COEFFS, GradientNeeds, LogitTransform, Statistics, StatsProblem

pytestmark = pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: {cuda.availability()}")

F64 = torch.float64


@pytest.fixture
def small_tiles():
    """Tiles of 3 rows x 40 columns: every row's vocabulary spans several tiles (merge exercised)."""
    with cuda.override_plan(tile_rows=3, tile_cols=40):
        yield


def make_problem(n, v, d=19, *, seed=0, peaked=False, teacher=False, bias=False, ignored=(), tf=LogitTransform(),
                 ttemp=1.0, jsd_beta=None, targets=True, dtype=torch.float32, **wants):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) / math.sqrt(d)
    if peaked:  # a few logits ~30 above the rest: the distribution is nearly one-hot
        hot = torch.randint(0, v, (3,), generator=g)
        w[hot] += 30.0 * h.mean(0) / h.mean(0).norm() ** 2
    b = torch.randn(v, generator=g) if bias else None
    y = torch.randint(0, v, (n,), generator=g) if targets else None
    if y is not None:
        for i in ignored:
            y[i] = -1
    kw = {}
    if teacher:
        kw = dict(teacher_hidden=torch.randn(n, d, generator=g),
                  teacher_weight=torch.randn(v, d, generator=g) / math.sqrt(d),
                  teacher_bias=torch.randn(v, generator=g) if bias else None, teacher_transform=LogitTransform(ttemp))
    cast = (lambda t: None if t is None else t.to(dtype))
    p = StatsProblem(hidden=h.to(dtype), weight=w.to(dtype), bias=cast(b), targets=y, transform=tf, jsd_beta=jsd_beta,
                     **{k: cast(t) if isinstance(t, torch.Tensor) else t for k, t in kw.items()}, **wants)
    return p


def as64(p: StatsProblem) -> StatsProblem:
    c = lambda t: None if t is None else t.to(F64)  # noqa: E731
    return dataclasses.replace(p, hidden=c(p.hidden), weight=c(p.weight), bias=c(p.bias),
                               teacher_hidden=c(p.teacher_hidden), teacher_weight=c(p.teacher_weight),
                               teacher_bias=c(p.teacher_bias))


def brute(p: StatsProblem) -> Statistics:
    """Float64 statistics on materialised logits, straight from problem.py's definitions (tests/oracle.py)."""
    want = oracle.statistics(p)
    zero = torch.zeros(p.hidden.shape[0], dtype=F64)
    return Statistics(**{name: want.get(name, zero) for name in Statistics._fields})


LO_FIELDS = {"lse_lo": "lse", "lse_t_lo": "lse_t"}


def check_normalisers(got: Statistics, want: Statistics, atol=4e-6):
    """The _lo fields are rounding residuals (problem.py), not comparable element by element: check that
    hi + lo is the float64 normaliser to within a few ulps of log s (the sum m + log s, unrounded), plus
    the rounding of the fp32 logits themselves (a few ulps of |lse|)."""
    eps = torch.finfo(torch.float32).eps
    for lo, hi in LO_FIELDS.items():
        g_hi, g_lo, w_hi = getattr(got, hi), getattr(got, lo), getattr(want, hi)
        assert g_lo.dtype == torch.float32 and torch.isfinite(g_lo).all(), lo
        err = (g_hi.to(F64) + g_lo.to(F64) - w_hi).abs()
        bound = atol + 4 * eps * w_hi.abs()
        assert bool((err <= bound).all()), f"{hi} + {lo}: max |err| {float(err.max()):.3e}"
        # the residual is at most half an ulp of hi (one ulp allowing for log s's own rounding)
        ulp = torch.finfo(torch.float32).eps * g_hi.abs().clamp_min(1e-30)
        assert bool((g_lo.abs() <= ulp).all()), lo


def check_stats(got: Statistics, want: Statistics, tol=2e-5):
    check_normalisers(got, want)
    for name in Statistics._fields:
        if name in LO_FIELDS:
            continue
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == torch.float32, name
        assert torch.isfinite(g).all(), name
        # norm-wise relative error, with an absolute floor for statistics that are ~0 (peaked entropy)
        err = float((g.to(F64) - w).norm())
        assert err <= tol * max(float(w.norm()), 1.0), f"{name}: |err| {err:.3e} vs |ref| {float(w.norm()):.3e}"


ALL_WANTS = dict(want_entropy=True, want_mean_logit=True, want_extras=True)


# ------------------------------------------------------------------------------------------------
# Forward statistics
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 13])
@pytest.mark.parametrize("v", [37, 131, 257])
@pytest.mark.parametrize("tiles", ["whole", "small"])
def test_forward_student(n, v, tiles, request):
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    p = make_problem(n, v, seed=n * v, bias=True, ignored=(0,) if n > 1 else (), **ALL_WANTS)
    check_stats(cuda.forward_statistics(p), brute(p))


@pytest.mark.parametrize("tf", [LogitTransform(1.0, 1.0, None), LogitTransform(0.7, 1.0, None),
                                LogitTransform(1.3, 2.5, 20.0), LogitTransform(1.0, 1.0, 5.0)])
@pytest.mark.parametrize("peaked", [False, True])
def test_forward_transforms_and_peaked(tf, peaked, small_tiles):
    p = make_problem(13, 131, seed=3, bias=True, peaked=peaked, tf=tf, ignored=(2, 5), **ALL_WANTS)
    check_stats(cuda.forward_statistics(p), brute(p))


@pytest.mark.parametrize("jsd_beta", [None, 0.3])
@pytest.mark.parametrize("tiles", ["whole", "small"])
def test_forward_teacher(jsd_beta, tiles, request):
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    p = make_problem(7, 257, seed=11, teacher=True, bias=True, ttemp=2.0, tf=LogitTransform(2.0), ignored=(3,),
                     jsd_beta=jsd_beta, want_kl_rev=True, want_kl_fwd=True, **ALL_WANTS)
    check_stats(cuda.forward_statistics(p), brute(p))


def test_forward_peaked_teacher_extreme(small_tiles):
    """Logits near 1e3 (x scale 40): sums relative to the running maxima keep their digits."""
    p = make_problem(7, 131, seed=5, teacher=True, peaked=True, tf=LogitTransform(1.0, 40.0, None),
                     want_kl_rev=True, want_kl_fwd=True, jsd_beta=0.5, **ALL_WANTS)
    check_stats(cuda.forward_statistics(p), brute(p), tol=5e-5)


def test_forward_no_targets_and_all_ignored():
    p = make_problem(5, 37, targets=False, **ALL_WANTS)
    check_stats(cuda.forward_statistics(p), brute(p))
    p = make_problem(4, 37, ignored=(0, 1, 2, 3), **ALL_WANTS)
    got = cuda.forward_statistics(p)
    assert all(bool((t == 0).all()) for t in got)


def test_forward_matches_torch_backend(small_tiles):
    p = make_problem(13, 257, seed=7, teacher=True, bias=True, ignored=(1,), jsd_beta=0.7, want_kl_rev=True,
                     want_kl_fwd=True, **ALL_WANTS)
    want = torch_backend.forward_statistics(p)
    got = cuda.forward_statistics(p)
    check_normalisers(got, want)
    for name in Statistics._fields:
        if name in LO_FIELDS:
            continue
        g, w = getattr(got, name), getattr(want, name)
        assert plain_rel_err(g, w) < 2e-5 or float(w.norm()) == 0, name


def test_nan_propagates():
    p = make_problem(3, 37, want_entropy=True)
    h = p.hidden.clone()
    h[1, 0] = float("nan")
    got = cuda.forward_statistics(dataclasses.replace(p, hidden=h))
    assert torch.isnan(got.lse[1]) and torch.isfinite(got.lse[0]) and torch.isfinite(got.lse[2])


def test_teacher_logit_scale_and_softcap(small_tiles):
    """The teacher's whole transform (logit_scale, soft-cap, temperature), not only its temperature."""
    p = make_problem(7, 131, seed=13, teacher=True, bias=True, ignored=(2,), jsd_beta=0.35, want_kl_rev=True,
                     want_kl_fwd=True, **ALL_WANTS)
    p = dataclasses.replace(p, teacher_transform=LogitTransform(1.7, 2.5, 6.0))
    want = brute(p)
    check_stats(cuda.forward_statistics(p), want)
    # the transform is really applied: the plain-temperature teacher gives other statistics
    other = brute(dataclasses.replace(p, teacher_transform=LogitTransform(1.7)))
    assert plain_rel_err(other.kl_rev, want.kl_rev) > 1e-2 and plain_rel_err(other.lse_t, want.lse_t) > 1e-2
    coeffs = random_coeffs(p, seed=4)
    needs = GradientNeeds(True, True, True)
    p64 = as64(p)
    grads64 = torch_backend.backward_gradients(p64, torch_backend.forward_statistics(p64), coeffs, needs)
    check_grads(cuda.backward_gradients(p, cuda.forward_statistics(p), coeffs.float(), needs), grads64)


@pytest.mark.parametrize("tiles", ["whole", "small"])
def test_is_top1_first_argmax_on_exact_ties(tiles, request):
    """is_top1: y is the FIRST argmax (TRL / torch.argmax on exact ties). Duplicate rows of the weight give
    bit-identical logits; with small tiles the tied columns sit in different vocabulary tiles."""
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    g = torch.Generator().manual_seed(21)
    n, v, d = 8, 131, 19
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    h = torch.randn(n, d, generator=g) * 0.3 + u  # every token aligned with u
    w = torch.randn(v, d, generator=g) / math.sqrt(d)
    lead = 6.0 * u  # a row that every token ranks first, by a margin
    for col in (5, 9, 77):  # exact duplicates: tied maxima (columns 5 and 9 in the first 40-column tile)
        w[col] = lead
    y = torch.tensor([5, 9, 77, 0, 5, 130, 9, 77])
    p = StatsProblem(hidden=h, weight=w, bias=None, targets=y, transform=LogitTransform(), want_extras=True)
    z = h.double() @ w.double().T
    assert bool((z[:, 5] == z[:, 9]).all() and (z[:, 9] == z[:, 77]).all() and (z.argmax(1) == 5).all())
    got = cuda.forward_statistics(p)
    want = (z.argmax(1) == y).float()
    assert want.tolist() == [1, 0, 0, 0, 1, 0, 0, 0]
    assert torch.equal(got.is_top1, want)
    assert torch.equal(torch_backend.forward_statistics(p).is_top1, want)
    # and a unique maximum that is not the first column is top-1
    w2 = w.clone()
    w2[9] = 2 * lead
    got2 = cuda.forward_statistics(dataclasses.replace(p, weight=w2))
    assert got2.is_top1.tolist() == [0, 1, 0, 0, 0, 0, 1, 0]


@pytest.mark.parametrize("v, tied", [(256, (4, 128)), (256, (4, 8)), (131, (5, 9, 77)), (1031, (700, 3))])
@pytest.mark.parametrize("tiles", ["whole", "small"])
def test_teacher_at_max_is_taken_at_the_first_tied_maximum(v, tied, tiles, request):
    """teacher_at_max is z_t at the student's FIRST maximum column, whichever lane, warp or tile holds the tied
    columns (the merges break ties by column), as torch's argmax; kl_rev_rel is relative to that column."""
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    g = torch.Generator().manual_seed(5)
    n, d = 6, 19
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    h = torch.randn(n, d, generator=g) * 0.3 + u
    w = torch.randn(v, d, generator=g) / math.sqrt(d)
    for col in tied:  # bit-identical student logits: tied maxima
        w[col] = 6.0 * u
    p = StatsProblem(hidden=h, weight=w, bias=None, targets=torch.zeros(n, dtype=torch.long),
                     transform=LogitTransform(), teacher_hidden=torch.randn(n, d, generator=g),
                     teacher_weight=torch.randn(v, d, generator=g), teacher_bias=None,
                     teacher_transform=LogitTransform(), want_kl_rev=True)
    z = h.double() @ w.double().T
    first = min(tied)
    assert bool((z.argmax(1) == first).all())
    want = (p.teacher_hidden @ p.teacher_weight.T)[:, first]
    got, ref = cuda.forward_statistics(p), torch_backend.forward_statistics(p)
    assert plain_rel_err(got.teacher_at_max, want) < 1e-6 and plain_rel_err(ref.teacher_at_max, want) < 1e-6
    assert plain_rel_err(got.kl_rev_rel, ref.kl_rev_rel) < 1e-5
    assert plain_rel_err(got.kl_rev, ref.kl_rev) < 1e-5


def confident_problem(n, gap, *, seed=0, top=30.0, v=131, d=19, peaked_weight=False):
    """Rows whose target logit is ~top (30) and the rest ~top - gap: lse ~ 30 and 1 - q_y from ~0.1
    (gap 6) to ~1e-4 (gap 13). peaked_weight: the same through a scaled weight row instead of the bias."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) / math.sqrt(d) * 0.5
    y = torch.randint(0, v, (n,), generator=g)
    if peaked_weight:  # one token: x_y = top exactly in exact arithmetic, the rest ~ N(0, 0.25) + (top - gap)
        assert n == 1
        b = torch.full((v,), top - gap)
        w[y[0]] += (gap - float(h[0] @ w[y[0]])) * h[0] / h[0].norm() ** 2
    else:
        b = torch.full((v,), top - gap) + torch.randn(v, generator=g) * 0.5
        b[y] = top
    return StatsProblem(hidden=h, weight=w, bias=b, targets=y, transform=LogitTransform())


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("gap", [6.0, 8.0, 10.0, 13.0])
@pytest.mark.parametrize("tiles", ["whole", "small"])
def test_fp32_confident_rows_within_1e5(n, gap, tiles, request):
    """docs/design.md, "Numerical doctrine" on peaked fp32 rows (lse ~ 30): logp and the gradients of sum(logp)
    within 1e-5 (norm-wise relative) of float64, through the recompute backward and the grad-in-forward path. Needs both
    log s = log1p(t) (s - 1 kept apart from the maximum's 1) and log q = (z - lse) - lse_lo."""
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    p = confident_problem(n, gap, seed=int(gap) * 7 + n)
    p64 = as64(p)
    s64 = torch_backend.forward_statistics(p64)
    s = cuda.forward_statistics(p)
    assert plain_rel_err(s.logp, s64.logp) <= 1e-5
    assert plain_rel_err(s.lse, s64.lse) <= 1e-6
    coeffs = torch.zeros(NUM_COEFFS, n, dtype=F64)
    coeffs[0] = 1.0  # d sum(logp) / dz = onehot(y) - q
    needs = GradientNeeds(True, True, True)
    want = torch_backend.backward_gradients(p64, s64, coeffs, needs)
    check_grads(cuda.backward_gradients(p, s, coeffs.float(), needs), want, tol=1e-5)
    _, grad_in_forward = cuda.grad_in_forward_gradients(p, lambda st, rows: (st.logp.sum(), coeffs[:, rows].float()),
                                                        needs)
    check_grads(grad_in_forward, want, tol=1e-5)


@pytest.mark.parametrize("gap", [6.0, 10.0])
def test_fp32_single_token_peaked_weight(gap):
    p = confident_problem(1, gap, seed=3, peaked_weight=True)
    p64 = as64(p)
    s64 = torch_backend.forward_statistics(p64)
    assert float(s64.lse[0]) > 29.0
    s = cuda.forward_statistics(p)
    assert plain_rel_err(s.logp, s64.logp) <= 1e-5
    coeffs = torch.zeros(NUM_COEFFS, 1, dtype=F64)
    coeffs[0] = 1.0
    needs = GradientNeeds(True, True, False)
    want = torch_backend.backward_gradients(p64, s64, coeffs, needs)
    check_grads(cuda.backward_gradients(p, s, coeffs.float(), needs), want, tol=1e-5)


# ------------------------------------------------------------------------------------------------
# Gradients: recompute backward and grad-in-forward path
# ------------------------------------------------------------------------------------------------
def random_coeffs(p: StatsProblem, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(NUM_COEFFS, p.hidden.shape[0], generator=g, dtype=F64)
    if not p.has_teacher:
        c[3:6] = 0  # c2, c3, c4 need a teacher
    elif p.jsd_beta is None:
        c[5] = 0
    if p.targets is not None:
        c[:, p.targets < 0] = 0
    return c


def check_grads(got, want, tol=2e-5):
    for name, g, w in zip(("d hidden", "d weight", "d bias"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert plain_rel_err(g, w) < tol, f"{name}: {plain_rel_err(g, w):.3e}"


@pytest.mark.parametrize("teacher,jsd_beta", [(False, None), (True, None), (True, 0.4)])
@pytest.mark.parametrize("tf", [LogitTransform(), LogitTransform(1.5, 0.8, 4.0)])
@pytest.mark.parametrize("tiles", ["whole", "small"])
def test_backward(teacher, jsd_beta, tf, tiles, request):
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    p = make_problem(7, 131, seed=2, teacher=teacher, bias=True, tf=tf, ignored=(4,), jsd_beta=jsd_beta,
                     want_kl_rev=teacher, want_kl_fwd=teacher, want_entropy=True, want_mean_logit=True)
    p64 = as64(p)
    saved64 = torch_backend.forward_statistics(p64)
    coeffs = random_coeffs(p)
    needs = GradientNeeds(True, True, True)
    want = torch_backend.backward_gradients(p64, saved64, coeffs, needs)
    saved = cuda.forward_statistics(p)
    got = cuda.backward_gradients(p, saved, coeffs.float(), needs)
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32
    check_grads(got, want)


def test_backward_frozen_weight_and_masked_rows(small_tiles):
    p = make_problem(7, 37, seed=4, want_entropy=True)
    coeffs = random_coeffs(p)
    coeffs[:, 2:5] = 0  # masked tokens: skipped rows
    needs = GradientNeeds(True, False, False)
    got = cuda.backward_gradients(p, cuda.forward_statistics(p), coeffs.float(), needs)
    p64 = as64(p)
    want = torch_backend.backward_gradients(p64, torch_backend.forward_statistics(p64), coeffs, needs)
    assert got[1] is None and got[2] is None
    assert bool((got[0][2:5] == 0).all())
    check_grads(got, want)


def _chunk_fn_for(p: StatsProblem, coeffs64: torch.Tensor):
    """A row-local 'loss' sum(logp + entropy) whose coefficients are given (stand-in for a real loss)."""
    calls = []

    def chunk_fn(stats: Statistics, rows):
        calls.append(rows)
        loss = (stats.logp + stats.entropy).sum()
        return loss, coeffs64[:, rows].to(stats.lse.dtype)

    return chunk_fn, calls


@pytest.mark.parametrize("rows_per_chunk", [None, 3])
@pytest.mark.parametrize("teacher", [False, True])
def test_grad_in_forward(rows_per_chunk, teacher):
    p = make_problem(7, 257, seed=9, teacher=teacher, bias=True, tf=LogitTransform(1.2, 1.0, 10.0), ignored=(6,),
                     jsd_beta=0.6 if teacher else None, want_kl_rev=teacher, want_entropy=True, want_mean_logit=True)
    coeffs = random_coeffs(p, seed=1)
    needs = GradientNeeds(True, True, True)
    fn, calls = _chunk_fn_for(p, coeffs)
    with cuda.override_plan(**({"grad_in_forward_rows": rows_per_chunk} if rows_per_chunk else {})):
        loss, got = cuda.grad_in_forward_gradients(p, fn, needs)
    fn64, _ = _chunk_fn_for(p, coeffs)
    loss64, want = torch_backend.grad_in_forward_gradients(as64(p), fn64, needs)
    assert len(calls) == (3 if rows_per_chunk else 1)
    assert abs(float(loss) - float(loss64)) <= 2e-5 * max(1.0, abs(float(loss64)))
    check_grads(got, want)


def _grad_in_forward_with(p, coeffs, needs, **plan):
    fn, calls = _chunk_fn_for(p, coeffs)
    with cuda.override_plan(**plan):
        shape = cuda._grad_in_forward_chunk(p, needs)
        loss, grads = cuda.grad_in_forward_gradients(p, fn, needs)
    return shape, calls, loss, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("teacher", [False, True])
def test_grad_in_forward_grouped_rows_keep_their_dx_for_one_product_per_group(dtype, teacher):
    """Groups of 5 rows in chunks of 2 (groups 5, 5, 3; chunks 2, 2, 1 each): every chunk's dx goes to its
    place in the group's region, and d hidden, d weight and d bias take one product per group. Against float64,
    and (bf16) against the ungrouped chunks of the same rows: the same dx, summed in another order."""
    p = make_problem(13, 257, seed=11, teacher=teacher, bias=True, ignored=(3, 12), jsd_beta=0.6 if teacher else None,
                     want_kl_rev=teacher, want_entropy=True, want_mean_logit=True, dtype=dtype)
    coeffs = random_coeffs(p, seed=2)
    needs = GradientNeeds(True, True, True)
    shape, calls, loss, got = _grad_in_forward_with(p, coeffs, needs, group_rows=5, grad_in_forward_rows=2)
    assert shape.group_rows == 5 and shape.rows == 2 and not shape.packed
    assert [(r.start, r.stop) for r in calls] == [(0, 2), (2, 4), (4, 5), (5, 7), (7, 9), (9, 10), (10, 12),
                                                  (12, 13)]
    fn64, _ = _chunk_fn_for(p, coeffs)
    loss64, want = torch_backend.grad_in_forward_gradients(as64(p), fn64, needs)
    assert abs(float(loss) - float(loss64)) <= 2e-5 * max(1.0, abs(float(loss64)))
    assert got[1].dtype == torch.float32  # three groups: d weight accumulated in fp32
    if dtype == torch.float32:
        check_grads(got, want)
    else:
        _, _, _, plain = _grad_in_forward_with(p, coeffs, needs, grad_in_forward_rows=2)
        for a, b, ref in zip(got, plain, want):
            assert plain_rel_err(a, ref) <= 1.5 * plain_rel_err(b, ref) + 1e-6
            assert plain_rel_err(a, b) <= 1e-5  # the same bf16 dx; fp32 sums in another order
    assert bool((got[0][[3, 12]] == 0).all())  # ignored rows


def test_grad_in_forward_group_of_every_row_writes_d_weight_once():
    """One group over all rows (chunks of 3): d weight is one product, in bf16 for a bf16 weight."""
    p = make_problem(9, 131, seed=12, bias=True, ignored=(4,), want_entropy=True, dtype=torch.bfloat16)
    coeffs = random_coeffs(p, seed=3)
    needs = GradientNeeds(True, True, True)
    shape, calls, _, got = _grad_in_forward_with(p, coeffs, needs, group_rows=9, grad_in_forward_rows=3)
    assert len(calls) == 3 and shape.group_rows == 9
    assert got[1].dtype == torch.bfloat16
    fn64, _ = _chunk_fn_for(p, coeffs)
    _, want = torch_backend.grad_in_forward_gradients(as64(p), fn64, needs)
    _, _, _, plain = _grad_in_forward_with(p, coeffs, needs,
                                           grad_in_forward_rows=9)  # one chunk: also written once in bf16
    assert plain[1].dtype == torch.bfloat16
    assert plain_rel_err(got[1], want[1]) <= 1.5 * plain_rel_err(plain[1], want[1]) + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_grad_in_forward_deferred_d_weight_is_the_product_the_backward_forms(dtype, chunk_rows):
    """The deferred d weight: the forward keeps dx (every row's, outside the workspace) and hidden; the
    backward scales hidden by the incoming gradient, zeroes the rows outside the loss (NaN padding there) and
    forms one product. At grad 0.7 against float64 times 0.7."""
    from fusedloss.core.grad_in_forward import deferred_gradient, formed
    from fusedloss.core.problem import DeferredProduct

    p = make_problem(8, 131, d=19, seed=13, teacher=True, bias=True, ignored=(2,), want_kl_rev=True,
                     want_entropy=True, dtype=dtype)
    h = p.hidden.clone()
    h[2] = float("nan")  # the ignored row: padding
    p = dataclasses.replace(p, hidden=h)
    coeffs = random_coeffs(p, seed=5)
    coeffs[:, 2] = 0
    needs = GradientNeeds(True, True, True)
    plan = {"defer_d_weight": 1, **({"grad_in_forward_rows": chunk_rows} if chunk_rows else {})}
    shape, calls, _, got = _grad_in_forward_with(p, coeffs, needs, **plan)
    assert shape.deferred and len(calls) == (3 if chunk_rows else 1)
    dw = got[1]
    assert isinstance(dw, DeferredProduct) and dw.lhs.shape == (8, 131) and dw.rhs is p.hidden
    assert dw.rows.tolist() == [True, True, False] + [True] * 5
    p64 = as64(dataclasses.replace(p, hidden=torch.where(dw.rows[:, None], p.hidden, 0)))
    fn64, _ = _chunk_fn_for(p, coeffs)
    _, want = torch_backend.grad_in_forward_gradients(p64, fn64, needs)
    scaled = deferred_gradient(*dw, torch.tensor(0.7))
    assert scaled.dtype == dtype and torch.isfinite(scaled).all()
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert plain_rel_err(scaled, 0.7 * want[1]) <= tol
    assert plain_rel_err(formed(got)[1], want[1]) <= tol
    assert plain_rel_err(got[0][[0, 1, 3, 4, 5, 6, 7]], want[0][[0, 1, 3, 4, 5, 6, 7]]) <= tol


def test_deferred_d_weight_through_autograd(monkeypatch):
    """The public API on the host path with the deferred d weight forced: a backward with a non-unit incoming
    gradient scales d hidden and d weight as the torch backend's autograd does; a second backward raises, as
    for any graph that was not retained."""
    import fusedloss
    from fusedloss.core import registry

    original = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(6, 16, generator=g), torch.randn(53, 16, generator=g) / 4
    y = torch.tensor([3, -100, 7, 5, 52, 0])
    grads = {}
    for backend in ("cuda", "torch"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with cuda.override_plan(defer_d_weight=1):
            loss = fusedloss.cross_entropy(hh, ww, y, backend=backend)
            (loss * 0.7).backward()
        grads[backend] = (hh.grad, ww.grad)
        if backend == "cuda":
            with pytest.raises(RuntimeError, match="second time"):
                (loss * 0.7).backward()
    for a, b in zip(grads["cuda"], grads["torch"]):
        assert plain_rel_err(a, b) <= 2e-5


# ------------------------------------------------------------------------------------------------
# Half-precision tiles and dx outputs (the kernels' bf16/fp16 load and store paths)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_tiles(dtype):
    """A bf16/fp16 tile folds exactly like the fp32 tile of the same (rounded) values, including rows that
    start off a 16-byte boundary (odd leading dimension)."""
    from fusedloss import _C

    g = torch.Generator().manual_seed(0)
    rows, cols = 5, 131
    x16 = (torch.randn(rows, cols, generator=g) * 4).to(dtype)
    x32 = x16.float()
    y = torch.randint(0, cols, (rows,), generator=g)
    outs = []
    for x in (x16, x32):
        out = torch.zeros(len(Statistics._fields), rows)
        a = _C.TileArgs()
        a.x, a.dtype, a.ld, a.rows, a.cols, a.v0, a.vocab = x.data_ptr(), cuda._code(x), cols, rows, cols, 0, cols
        a.tf = _C.Transform()
        a.targets = y.data_ptr()
        a.want_entropy = True
        a.vocab = cols
        a.out, a.out_stride = out.data_ptr(), rows
        _C.host_fold_tile(a)
        outs.append(out)
    assert torch.allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    want = torch.log_softmax(x32.double(), 1).gather(1, y[:, None]).squeeze(1)
    assert plain_rel_err(outs[0][1], want) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dx_half_output_rounding(dtype):
    """dx written as bf16/fp16 equals the fp32 dx rounded to nearest even (the host conversion matches
    __float2bfloat16_rn / __float2half_rn), subnormals, overflow and NaN included."""
    from fusedloss import _C

    vals = torch.tensor([0.0, -0.0, 1.0, 1.00390625, 1.0 + 2**-9, 3.14159, -2.71828, 65504.0, 65519.0, 65520.0, 1e6,
                         6e-8, 3e-8, 1e-5, -1e-7, 1e-40, float("inf"), float("-inf"), float("nan")] * 2)
    lse = torch.zeros(len(Statistics._fields), 1)
    coeffs = torch.zeros(NUM_COEFFS, 1)
    # dx_j = c5 (the uniform coefficient) times a chain factor of 1 on a tile of zeros: each value in turn.
    for v in vals.tolist():
        coeffs[6] = v
        out = torch.zeros(1, 8, dtype=dtype)
        a = _C.TileArgs()
        xx = torch.zeros(1, 8)
        a.x, a.dtype, a.ld, a.rows, a.cols, a.vocab = xx.data_ptr(), 0, 8, 1, 8, 8
        a.tf = _C.Transform()
        a.want_mean_logit = True  # the uniform term is formed only when the mean logit is asked for
        a.out, a.out_stride = lse.data_ptr(), 1
        a.coeffs, a.coeff_stride = coeffs.data_ptr(), 1
        a.dx, a.dx_dtype, a.dx_ld = out.data_ptr(), cuda._code(out), 8
        _C.host_dx_tile(a)
        want = torch.tensor([v], dtype=torch.float32).to(dtype)
        got = out[0, 0:1]
        if math.isnan(v):
            assert torch.isnan(got).all()
        elif v == 0:
            continue  # an all-zero coefficient row is inactive (written as exact zeros)
        else:
            assert got.view(torch.int16).item() == want.view(torch.int16).item(), (v, got, want)


@pytest.mark.parametrize("grad_in_forward", ["0", "1"])
def test_public_api_edges_on_the_host_path(grad_in_forward, monkeypatch):
    """NaN padding rows stay out of d weight, and a -inf bias (masked vocabulary) gives finite statistics and
    gradients, through the public API routed to the CUDA backend's host path, on both gradient paths."""
    import math

    import fusedloss
    from fusedloss.core import registry

    original = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(4, 6, generator=g), torch.randn(19, 6, generator=g)
    h[1] = float("nan")
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    fusedloss.cross_entropy(hh, ww, torch.tensor([3, -100, 7, 5]), backend="cuda").backward()
    assert torch.isfinite(ww.grad).all() and torch.isfinite(hh.grad[[0, 2, 3]]).all()
    b = torch.zeros(19)
    b[4:8] = -math.inf
    hh, ww = torch.randn(3, 6, generator=g).requires_grad_(), w.clone().requires_grad_()
    lp, ent = fusedloss.token_logprobs(hh, ww, torch.tensor([1, 9, 12]), bias=b, return_entropy=True, backend="cuda")
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert torch.isfinite(ww.grad).all() and torch.isfinite(hh.grad).all()


# ------------------------------------------------------------------------------------------------
# Packed dx: a bf16/fp16 dx written over the fp32 tile it is computed from (docs/design.md, "The logits
# workspace"). The host twin runs a row's rounds with the device block's 256 lanes (every lane's loads,
# then every lane's stores), so a round whose stores reached columns a later round reads would show here.
# ------------------------------------------------------------------------------------------------
def _dx_args(x, xt, out, coeffs, targets, *, rows, cols, ld, v0=0, vocab=None, bias=None, tf=None, teacher_tf=None,
             want_kl_rev=False, want_entropy=False, want_mean_logit=False):
    from fusedloss import _C

    a = _C.TileArgs()
    a.x, a.xt, a.dtype, a.ld, a.rows, a.cols, a.v0 = x.data_ptr(), 0 if xt is None else xt.data_ptr(), 0, ld, rows, \
        cols, v0
    a.vocab = vocab or v0 + cols
    a.tf = tf or _C.Transform()
    if xt is not None:
        a.teacher_tf = teacher_tf or _C.Transform()
        a.want_kl_rev = want_kl_rev
    if bias is not None:
        a.bias, a.bias_dtype = bias.data_ptr(), 0
    a.targets = targets.data_ptr()
    a.want_entropy, a.want_mean_logit = want_entropy, want_mean_logit
    a.out, a.out_stride = out.data_ptr(), rows
    a.coeffs, a.coeff_stride = coeffs.data_ptr(), rows
    return a


# (rows, cols, ld, offset): offset shifts the tile by that many fp32 elements inside its buffer, so rows
# start off a 16-byte boundary (single columns before the first vector group); the teacher tile is shifted
# by offset + 1 when `misaligned_teacher`, so that no column of the row is read as a vector group.
PACKED_SHAPES = [
    (1, 1, 1, 0), (1, 1, 64, 0), (3, 5, 5, 0), (2, 7, 64, 1), (5, 131, 192, 0), (4, 131, 131, 3),
    (1, 2565, 2624, 0), (3, 2565, 2565, 2), (2, 4099, 4160, 1), (6, 64, 64, 0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("teacher", [False, True])
@pytest.mark.parametrize("rows,cols,ld,offset", PACKED_SHAPES)
@pytest.mark.parametrize("plain", [True, False])
def test_packed_dx_equals_the_copy_bit_for_bit(dtype, teacher, rows, cols, ld, offset, plain):
    from fusedloss import _C

    g = torch.Generator().manual_seed(rows * 7919 + cols)
    buf = torch.randn(rows * ld + offset + 8, generator=g) * 3
    tbuf = torch.randn(rows * ld + offset + 8, generator=g) * 3
    x = buf[offset: offset + rows * ld]
    xt = tbuf[offset + 1: offset + 1 + rows * ld] if teacher and offset % 2 else \
        tbuf[offset: offset + rows * ld] if teacher else None
    targets = torch.randint(0, cols, (rows,), generator=g)
    if rows > 2:
        targets[1] = -1  # ignored row: exact zeros
    coeffs = torch.randn(NUM_COEFFS, rows, generator=g)
    if not teacher:
        coeffs[3:6] = 0
    coeffs[5] = 0  # no JSD
    if rows > 3:
        coeffs[:, 3] = 0  # masked row: exact zeros
    bias = None if plain else torch.randn(cols, generator=g)
    tf = None if plain else _C.Transform(logit_scale=1.3, softcap=9.0, temperature=2.0, chain=1.3 / 2.0)
    kw = dict(rows=rows, cols=cols, ld=ld, bias=bias, tf=tf, want_kl_rev=teacher, want_entropy=True,
              want_mean_logit=True)
    out = torch.zeros(len(Statistics._fields), rows)
    _C.host_fold_tile(_dx_args(x, xt, out, coeffs, targets, **kw))
    assert torch.isfinite(out[0][targets >= 0]).all()

    copy = torch.full((rows, ld), float("nan"), dtype=dtype)
    a = _dx_args(x, xt, out, coeffs, targets, **kw)
    a.dx, a.dx_dtype, a.dx_ld = copy.data_ptr(), cuda._code(copy), ld
    _C.host_dx_tile(a)

    before = buf.clone()
    a = _dx_args(x, xt, out, coeffs, targets, **kw)
    a.dx, a.dx_dtype, a.dx_ld = x.data_ptr(), cuda._code(copy), 2 * ld
    _C.host_dx_tile(a)
    packed = x.view(dtype).view(rows, 2 * ld)
    got, want = packed[:, :cols].view(torch.int16), copy[:, :cols].view(torch.int16)
    assert torch.equal(got, want), (got != want).nonzero()[:5]
    if rows > 2:
        assert (packed[1, :cols] == 0).all()
    # nothing else of the buffer moved: the rows' fp32 columns past the packed values, the padding, the ends
    touched = torch.zeros(buf.numel(), dtype=torch.bool)
    for r in range(rows):
        start = offset + r * ld
        touched[start: start + (cols + 1) // 2] = True
    assert torch.equal(buf[~touched], before[~touched])


def test_packed_dx_is_refused_where_it_cannot_be_laid_out():
    from fusedloss import _C

    x = torch.zeros(2, 8)
    out, coeffs, targets = torch.zeros(len(Statistics._fields), 2), torch.zeros(NUM_COEFFS, 2), torch.zeros(2).long()
    for dtype, dx_dtype, dx_ld in ((0, 1, 8), (0, 1, 17), (1, 2, 16)):
        a = _dx_args(x, None, out, coeffs, targets, rows=2, cols=8, ld=8)
        a.dtype = dtype
        a.dx, a.dx_dtype, a.dx_ld = x.data_ptr(), dx_dtype, dx_ld
        with pytest.raises(ValueError, match="dx_ld = 2 \\* ld"):
            _C.host_dx_tile(a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("teacher", [False, True])
def test_packed_and_copied_dx_give_the_same_gradients(dtype, teacher):
    """The backend's composable backward and (bf16) grad-in-forward path with dx packed over the tile, against the same
    tiles with a separate dx copy: every gradient bit for bit."""
    p = make_problem(9, 261, d=16, seed=3, teacher=teacher, bias=True, ignored=(2,), want_kl_rev=teacher,
                     want_entropy=True, want_mean_logit=True, dtype=dtype)
    coeffs = random_coeffs(p, seed=4).float()
    needs = GradientNeeds(True, True, True)
    results = {}
    for packed_min_rows in (1, 10**9):
        with cuda.override_plan(tile_rows=4, tile_cols=100, grad_in_forward_rows=4, packed_min_rows=packed_min_rows):
            shape, chunk = cuda._shapes(p)
            assert shape.packed == (packed_min_rows == 1)
            assert chunk.packed == (packed_min_rows == 1 and dtype == torch.bfloat16)
            saved = cuda.forward_statistics(p)
            grads = cuda.backward_gradients(p, saved, coeffs, needs)
            fn, _ = _chunk_fn_for(p, coeffs.double())
            grad_in_forward = cuda.grad_in_forward_gradients(p, fn, needs)
        results[packed_min_rows] = (saved, grads, grad_in_forward)
    (s1, g1, e1), (s2, g2, e2) = results[1], results[10**9]
    assert all(torch.equal(a, b) for a, b in zip(s1, s2))
    for a, b in zip((*g1, *e1[1]), (*g2, *e2[1])):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(e1[0], e2[0])
    assert g1[0].abs().sum() > 0 and g1[1].abs().sum() > 0
