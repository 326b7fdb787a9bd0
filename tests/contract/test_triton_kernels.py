"""The Triton backend against a float64 brute force on materialised logits and against the torch backend,
through the backend protocol itself (``forward_statistics`` / ``backward_gradients`` of problem.py).

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets ``TRITON_INTERPRET=1``), with
tiny tiles (``backend.INTERPRETER_TILES``: 16 rows x 32 vocabulary columns x 16 of D, 4 resident programs),
so that the tiny shapes below still cross every tile border: prime V (37, 131, 257) leaves padded vocabulary
columns, odd N and D leave padded rows and a masked remainder of D, and the forward splits the vocabulary
across programs.
The interpreter cannot run bf16 ``tl.dot`` (triton-lang/triton#11584): bf16 is checked on a GPU by
``benchmarks/device/check_triton.py``. ``test_kernels_compile_for_sm90`` compiles every launch the backend
makes for an H100/H200 target without a GPU (``tests/tooling/test_compile_triton_kernels.py``), which catches what the
interpreter does not check (registers, spills, shared memory, the tensor-core instructions).
"""

from __future__ import annotations

import sys

import oracle
import pytest
import torch
from _errors import rel_err
from conftest import make_head, make_teacher

from fusedloss import reference
from fusedloss.backends import torch as torch_backend
from fusedloss.core.problem import (
    GradientNeeds,
    LogitTransform,
    Statistics,
    StatsProblem,
)
from fusedloss.core.statistics import dz_coefficients

triton_backend = pytest.importorskip("fusedloss.backends.triton.backend")
if triton_backend.availability() != "available":  # pragma: no cover - depends on the machine
    pytest.skip(f"triton backend: {triton_backend.availability()}", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP64_TOL = 1e-9
FP32_TOL = 1e-5
DIFFERENTIABLE = ("lse", "logp", "entropy", "kl_rev", "kl_fwd", "jsd", "mean_logit")

# The interpreter evaluates padded rows and columns too; their NaN/inf are masked out, but numpy warns.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ------------------------------------------------------------------------------------------------------
# Cases and the brute force


CASES = {
    # targets with ignored rows, entropy, TRL's extras, mean logit, bias, peaked rows
    "targets": dict(n=7, v=131, d=37, bias=True, ignore_fraction=0.3, want_entropy=True, want_extras=True,
                    want_mean_logit=True),
    # a teacher with its own hidden size and bias; every KL; soft-cap, scale and temperature
    "teacher": dict(n=13, v=257, d=19, dt=24, bias=True, teacher_bias=True, want_entropy=True, want_kl_rev=True,
                    want_kl_fwd=True, jsd_beta=0.3, transform=LogitTransform(0.7, 1.3, 5.0), teacher_temperature=1.5),
    # logits in the thousands
    "extreme": dict(n=5, v=131, d=19, extreme=True, want_entropy=True, want_extras=True),
    # one token, no targets (every row scored)
    "one_token": dict(n=1, v=37, d=24, no_targets=True, want_entropy=True, want_mean_logit=True),
    # every row ignored: zeros out, zero gradients
    "all_ignored": dict(n=7, v=37, d=19, bias=True, ignore_fraction=1.0, want_entropy=True),
}


def build(case: dict, dtype: torch.dtype, seed: int = 0) -> StatsProblem:
    c = dict(case)
    n, v, d = c.pop("n"), c.pop("v"), c.pop("d")
    h, w, b, y = make_head(n, d, v, seed=seed, bias=c.pop("bias", False), extreme=c.pop("extreme", False),
                           ignore_fraction=0.0 if c.get("ignore_fraction", 0) >= 1 else c.get("ignore_fraction", 0))
    if c.pop("ignore_fraction", 0) >= 1:
        y = torch.full_like(y, -100)
    y = torch.where(y < 0, torch.full_like(y, -1), y)
    if c.pop("no_targets", False):
        y = None
    teacher = {}
    dt = c.pop("dt", None)
    t_bias = c.pop("teacher_bias", False)
    t_temp = c.pop("teacher_temperature", 1.0)
    if dt is not None:
        th, tw, tb = make_teacher(n, dt, v, seed=seed + 1, bias=t_bias)
        teacher = dict(teacher_hidden=th.to(DEVICE, dtype), teacher_weight=tw.to(DEVICE, dtype),
                       teacher_bias=None if tb is None else tb.to(DEVICE, dtype),
                       teacher_transform=LogitTransform(t_temp))
    return StatsProblem(hidden=h.to(DEVICE, dtype), weight=w.to(DEVICE, dtype),
                        bias=None if b is None else b.to(DEVICE, dtype),
                        targets=None if y is None else y.to(DEVICE), transform=c.pop("transform", LogitTransform()),
                        **teacher, **c)


def _logits(h, w, b, tf: LogitTransform, dtype):
    """The logits materialised in ``dtype`` (product and bias in it, as the naive path computes them)."""
    return reference.logits(h.to(dtype), w.to(dtype), None if b is None else b.to(dtype), temperature=tf.temperature,
                            logit_scale=tf.logit_scale, softcap=tf.softcap).to(dtype)


def _log_softmax_log1p(z):
    """log-softmax with log s = log1p(t), t the sum without the (first) maximum's own 1: log_softmax rounds
    log(1 + t) to 0 for t < 1e-16 and so loses the entropy of extremely peaked rows (-q log q ~ t)."""
    m = z.amax(1, keepdim=True)
    t = torch.exp(z - m).scatter(1, z.argmax(1, keepdim=True), 0.0).sum(1, keepdim=True)
    return (z - m) - torch.log1p(t)


def brute_force(p: StatsProblem, dtype=torch.float64, h=None, w=None, b=None) -> dict:
    """Every statistic of problem.py from the materialised logits, in ``dtype`` (float64: the ground truth,
    tests/oracle.py's; fp16: the naive same-dtype computation). Differentiable in h, w, b."""
    if dtype == torch.float64:
        want = oracle.statistics(p, h, w, b)
        zero = torch.zeros(p.hidden.shape[0], dtype=dtype)
        return {name: want.get(name, zero) for name in Statistics._fields}
    h = p.hidden if h is None else h
    w = p.weight if w is None else w
    b = p.bias if b is None else b
    z = _logits(h, w, b, p.transform, dtype)
    n, v = z.shape
    zero = torch.zeros(n, dtype=dtype, device=z.device)
    out = dict.fromkeys(Statistics._fields, zero)
    logq = _log_softmax_log1p(z)
    q = logq.exp()
    out["lse"] = torch.logsumexp(z, dim=1)
    out["row_max"] = z.amax(1)
    if p.targets is not None:
        out["logp"] = logq.gather(1, p.targets.clamp(min=0)[:, None]).squeeze(1)
    if p.want_entropy:
        out["entropy"] = -(q * logq).sum(1)
    if p.want_extras:
        out["log_sum_sq_probs"] = torch.log((q * q).sum(1))
        if p.targets is not None:
            # argmax's rule on exact ties (the first maximum), as TRL
            out["is_top1"] = (z.argmax(1) == p.targets).to(dtype)
    if p.want_mean_logit:
        out["mean_logit"] = z.mean(1)
    if p.has_teacher:
        zt = _logits(p.teacher_hidden, p.teacher_weight, p.teacher_bias, p.teacher_transform, dtype)
        logpt = _log_softmax_log1p(zt)
        pt = logpt.exp()
        out["lse_t"] = torch.logsumexp(zt, dim=1)
        if p.want_kl_rev:
            out["kl_rev"] = (q * (logq - logpt)).sum(1)
            # the reverse KL relative to the student's first maximum column (problem.py)
            ztm = zt.gather(1, z.argmax(1, keepdim=True))
            out["teacher_at_max"] = ztm.squeeze(1)
            out["kl_rev_rel"] = (q * ((z - out["row_max"][:, None]) - (zt - ztm))).sum(1)
        if p.want_kl_fwd:
            out["kl_fwd"] = (pt * (logpt - logq)).sum(1)
        if p.jsd_beta is not None:
            beta = p.jsd_beta
            logm = torch.logaddexp(logq + torch.log1p(torch.tensor(-beta, dtype=dtype)),
                                   logpt + torch.log(torch.tensor(beta, dtype=dtype)))
            out["kl_qm"] = torch.xlogy(q, q).sum(1) - (q * logm).sum(1)
            kl_pm = torch.xlogy(pt, pt).sum(1) - (pt * logm).sum(1)
            out["jsd"] = beta * kl_pm + (1 - beta) * out["kl_qm"]
    if p.targets is not None:
        valid = p.targets >= 0
        out = {k: torch.where(valid, x, torch.zeros_like(x)) for k, x in out.items()}
    return out


def cotangents(p: StatsProblem, seed: int = 3) -> torch.Tensor:
    """Random weights of the differentiable statistics the problem asks for, [11, N] float64."""
    g = torch.Generator().manual_seed(seed)
    n = p.hidden.shape[0]
    wanted = {"lse": True, "logp": p.targets is not None, "entropy": p.want_entropy,
              "kl_rev": p.want_kl_rev and p.has_teacher, "kl_fwd": p.want_kl_fwd and p.has_teacher,
              "jsd": p.jsd_beta is not None, "mean_logit": p.want_mean_logit}
    rows = [torch.randn(n, generator=g, dtype=torch.float64) if wanted.get(name, False)
            else torch.zeros(n, dtype=torch.float64) for name in Statistics._fields]
    return torch.stack(rows)


def reference_gradients(p: StatsProblem, grad: torch.Tensor, dtype=torch.float64):
    """Gradients of sum_k grad_k . stat_k by autograd through the materialised logits (in ``dtype``)."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in (p.hidden, p.weight, p.bias)]
    out = brute_force(p, dtype, *leaves)
    objective = sum((grad[i].to(out[name].device, dtype) * out[name]).sum()
                    for i, name in enumerate(Statistics._fields) if name in DIFFERENTIABLE)
    targets = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(objective, targets, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, targets)]
    return tuple(grads) + ((None,) if p.bias is None else ())


def triton_gradients(p: StatsProblem, grad: torch.Tensor, needs=None, module=triton_backend, **tiles):
    stats = module.forward_statistics(p, **tiles)
    stacked = torch.stack(tuple(stats))
    coeffs = dz_coefficients(grad.to(stacked.device, stacked.dtype), stacked, p.jsd_beta, p.targets, p.weight.shape[0])
    needs = needs or GradientNeeds(True, True, p.bias is not None)
    return module.backward_gradients(p, stats, coeffs, needs, **tiles)


def assert_stats_close(actual: Statistics, expected: dict, tol: float, what: str) -> None:
    for name in Statistics._fields:
        if name.endswith("_lo"):
            # lse_lo is the low word of the unevaluated sum lse + lse_lo: a rounding residual (~1e-16 for
            # float64) whose own digits depend on the summation order, so it is judged relative to lse.
            hi = name[: -len("_lo")]
            diff = getattr(actual, name).double().cpu() - expected[name].double().cpu()
            scale = max(torch.linalg.vector_norm(expected[hi].double()).item(), 1.0)
            err = torch.linalg.vector_norm(diff).item() / scale
            assert err <= tol, f"{what}: {name} error {err:.3e} (relative to {hi}) > {tol:.1e}"
            continue
        err = rel_err(getattr(actual, name), expected[name])
        assert err <= tol, f"{what}: {name} relative error {err:.3e} > {tol:.1e}"


def assert_grads_close(actual, expected, tol: float, what: str) -> None:
    for name, a, e in zip(("d hidden", "d weight", "d bias"), actual, expected):
        if e is None:
            assert a is None, f"{what}: {name} should be None"
            continue
        err = rel_err(a, e)
        assert err <= tol, f"{what}: {name} relative error {err:.3e} > {tol:.1e}"


# ------------------------------------------------------------------------------------------------------
# Forward and backward against the float64 brute force and the torch backend


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_brute_force_and_torch_backend(name):
    p = build(CASES[name], torch.float64)
    grad = cotangents(p)
    stats = triton_backend.forward_statistics(p)
    for field in stats:
        assert field.dtype == torch.float64
    expected = brute_force(p)
    assert_stats_close(stats, expected, FP64_TOL, name)
    assert_stats_close(stats, torch_backend.forward_statistics(p)._asdict(), FP64_TOL, f"{name} vs torch")
    grads = triton_gradients(p, grad)
    assert_grads_close(grads, reference_gradients(p, grad), FP64_TOL, name)
    assert_grads_close(grads, triton_gradients(p, grad, module=torch_backend), FP64_TOL, f"{name} vs torch")


@pytest.mark.parametrize("name", ["targets", "teacher", "extreme", "all_ignored"])
def test_float32_within_1e5_of_float64(name):
    p32 = build(CASES[name], torch.float32)
    p64 = build(CASES[name], torch.float64)  # the same (exactly representable) values
    grad = cotangents(p64)
    stats = triton_backend.forward_statistics(p32)
    for field in stats:
        assert field.dtype == torch.float32
    expected = brute_force(p64)
    if name == "extreme":
        # Entropies of 1e-23 nats come from the tail e^(z - max) of logits near 4000, whose fp32 rounding
        # (ulp 2.4e-4) alone moves them by ~1e-4 relative: an ill-conditioned quantity, checked in nats.
        assert (stats.entropy.double() - expected["entropy"]).abs().max() < FP32_TOL
        expected["entropy"] = stats.entropy.double()
    assert_stats_close(stats, expected, FP32_TOL, name)
    grads = triton_gradients(p32, grad.float())
    for g, t in zip(grads, (p32.hidden, p32.weight, p32.bias)):
        assert g is None or g.dtype == t.dtype
    assert_grads_close(grads, reference_gradients(p64, grad), FP32_TOL, name)


@pytest.mark.parametrize("name", ["targets", "teacher"])
def test_float16_no_worse_than_naive_float16(name):
    """The fused error against float64 is at most the naive fp16 error plus a little (docs/design.md,
    "Numerical doctrine")."""
    p16 = build(CASES[name], torch.float16)
    p64 = build(CASES[name], torch.float16)
    p64 = StatsProblem(**{f: (getattr(p64, f).double() if isinstance(getattr(p64, f), torch.Tensor)
                              and getattr(p64, f).is_floating_point() else getattr(p64, f))
                          for f in p64.__dataclass_fields__})
    grad = cotangents(p64)
    truth = brute_force(p64)
    naive = brute_force(p16, torch.float16)
    fused = triton_backend.forward_statistics(p16)
    for f in Statistics._fields:
        e_fused, e_naive = rel_err(getattr(fused, f), truth[f]), rel_err(naive[f], truth[f])
        assert e_fused <= e_naive + 1e-4, f"{name}: {f} fused {e_fused:.2e} > naive fp16 {e_naive:.2e}"
    true_grads = reference_gradients(p64, grad)
    naive_grads = reference_gradients(p16, grad, torch.float16)
    fused_grads = triton_gradients(p16, grad.float())
    for g in fused_grads:
        assert g is None or g.dtype == torch.float16
    for label, f, nv, tr in zip(("d hidden", "d weight", "d bias"), fused_grads, naive_grads, true_grads):
        if tr is None:
            continue
        e_fused, e_naive = rel_err(f, tr), rel_err(nv, tr)
        assert e_fused <= e_naive + 1e-3, f"{name}: {label} fused {e_fused:.2e} > naive fp16 {e_naive:.2e}"


def test_tile_and_split_layout_does_not_change_the_result():
    """One vocabulary split per row block, many splits, wider tiles, a BLOCK_K that divides D (no masked
    remainder) and one larger than D (only the remainder): the same statistics and gradients."""
    p = build(dict(CASES["teacher"], d=32, dt=24), torch.float64)
    expected = brute_force(p)
    grad = cotangents(p)
    reference = reference_gradients(p, grad)
    TileConfig = triton_backend.TileConfig
    for tiles in (TileConfig(16, 32, 16, 4, 1, slots=1), TileConfig(16, 32, 16, 4, 1, slots=64),
                  TileConfig(32, 64, 32, 4, 1, slots=4), TileConfig(16, 32, 64, 4, 1, slots=3)):
        assert_stats_close(triton_backend.forward_statistics(p, tiles=tiles), expected, FP64_TOL, str(tiles))
        assert_grads_close(triton_gradients(p, grad, tiles=tiles), reference, FP64_TOL, str(tiles))


def test_frozen_weight_and_partial_needs():
    p = build(CASES["targets"], torch.float32)
    grad = cotangents(p)
    full = triton_gradients(p, grad)
    dh, dw, db = triton_gradients(p, grad, needs=GradientNeeds(True, False, False))
    assert dw is None and db is None
    assert torch.equal(dh, full[0]) or rel_err(dh, full[0]) < 1e-6
    dh, dw, db = triton_gradients(p, grad, needs=GradientNeeds(False, False, True))
    assert dh is None and dw is None and rel_err(db, full[2]) < 1e-6
    dh, dw, db = triton_gradients(p, grad, needs=GradientNeeds(False, True, False))
    assert dh is None and db is None and rel_err(dw, full[1]) < 1e-6


def test_nan_input_propagates_to_its_row_only():
    p = build(CASES["targets"], torch.float32)
    h = p.hidden.clone()
    h[1, 3] = float("nan")
    stats = triton_backend.forward_statistics(StatsProblem(**{**p.__dict__, "hidden": h}))
    valid = p.targets >= 0
    assert bool(torch.isnan(stats.lse[1])) or not bool(valid[1])
    others = torch.ones_like(valid)
    others[1] = False
    assert bool(torch.isfinite(stats.lse[others]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_is_top1_first_argmax_on_exact_ties(dtype):
    """Tokens 3, 7, 40 and 100 have identical weight rows and are the maximum on every row: only the
    first of them (3) is the argmax (torch.argmax's and TRL's rule). 3 and 7 share a vocabulary tile,
    40 is in the next tile and 100 in another vocabulary split, so the running "max before the target"
    is checked within a tile, across tiles and across the split merge. Small integers make every logit
    exact, so the ties are exact whatever the summation order."""
    g = torch.Generator().manual_seed(0)
    n, v, d = 10, 131, 19
    h = torch.randint(-2, 3, (n, d), generator=g).to(torch.float64)
    w = torch.randint(-2, 3, (v, d), generator=g).to(torch.float64) / 8
    h[:, 0] = 1.0
    w[:, 0] = 0.0
    w[3, 0] = 64.0
    for j in (7, 40, 100):
        w[j] = w[3]
    y = torch.tensor([3, 7, 40, 100, 5, 3, 100, 7, -1, 0])
    expected = torch.tensor([1, 0, 0, 0, 0, 1, 0, 0, 0, 0], dtype=dtype)
    TileConfig = triton_backend.TileConfig
    for tiles in (None, TileConfig(16, 32, 16, 4, 1, slots=1), TileConfig(16, 32, 16, 4, 1, slots=64),
                  TileConfig(16, 8, 16, 4, 1, slots=4)):
        p = StatsProblem(hidden=h.to(DEVICE, dtype), weight=w.to(DEVICE, dtype), bias=None, targets=y.to(DEVICE),
                         transform=LogitTransform(), want_extras=True)
        got = triton_backend.forward_statistics(p, tiles=tiles).is_top1
        assert torch.equal(got.cpu(), expected), (tiles, got)
        assert torch.equal(torch_backend.forward_statistics(p).is_top1.cpu(), expected)
    # ties broken by the other rows' logits: the target is top-1 exactly when it is torch.argmax
    p = build(CASES["targets"], dtype)
    z = p.hidden.double() @ p.weight.double().T + p.bias.double()
    valid = p.targets >= 0
    assert torch.equal(triton_backend.forward_statistics(p).is_top1.bool()[valid],
                       (z.argmax(1) == p.targets)[valid])


# ------------------------------------------------------------------------------------------------------
# Determinism: no atomics anywhere, so every run gives the same bits; deterministic mode pins only what a
# measurement would otherwise choose (the tuned tiles, a workspace sized from free memory)


@pytest.mark.parametrize("switch", ["env", "torch"])
def test_gradients_are_bit_identical_run_to_run_and_in_deterministic_mode(switch, monkeypatch):
    p = build(CASES["teacher"], torch.float32)
    grad = cotangents(p)
    runs = [triton_gradients(p, grad) for _ in range(2)]
    if switch == "env":
        monkeypatch.setenv("FUSEDLOSS_DETERMINISTIC", "1")
        assert triton_backend.deterministic()
        runs.append(triton_gradients(p, grad))
    else:
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            assert triton_backend.deterministic()
            runs.append(triton_gradients(p, grad))
        finally:
            torch.use_deterministic_algorithms(previous)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------------
# Memory: nothing of size N x V, no fp32 [V, D] buffer


@pytest.mark.parametrize("workspace_mb", [0.004, 0.02, 1.0])
def test_buffers_stay_within_the_workspace(workspace_mb, monkeypatch):
    """Besides the gradients (and d hidden's fp32 accumulator), every buffer of the backward fits the problem's
    workspace budget, whatever N and V: nothing is N x V. The small budgets force several vocabulary chunks and
    several row chunks (d weight then sums over row chunks in fp32); the large one holds every row in one chunk,
    and d weight is then written by one product per block in its own dtype, with no fp32 block. The result
    stays the fused one."""
    n, v, d = 37, 257, 19
    p = build(dict(n=n, v=v, d=d, bias=True, want_entropy=True), torch.float16)
    p = StatsProblem(**{**p.__dict__, "workspace_mb": workspace_mb})
    seen = []
    original = triton_backend._alloc

    def recording(shape, dtype, device, zero=True):
        seen.append((tuple(shape), dtype))
        return original(shape, dtype, device, zero)

    monkeypatch.setattr(triton_backend, "_alloc", recording)
    grads = triton_gradients(p, cotangents(p))
    assert grads[1].dtype == torch.float16
    allowed = {(n, d), (v, d), (v,)}  # the gradients and d hidden's fp32 accumulator
    budget = workspace_mb * 2**20
    # The documented floor: one row block of one column tile, when even that exceeds the budget (a GPU's
    # tiles are larger than the interpreter's, so a few KiB hold a whole block only under the interpreter).
    cfg = triton_backend.tiles_for(p, tune=False)
    floor = min(n, cfg.block_m) * cfg.block_v * 4
    rows, _ = triton_backend.backward_chunks(n, v, d, "float16", int(budget), cfg)
    for shape, dtype in seen:
        numel = 1
        for s in shape:
            numel *= s
        assert numel < n * v or shape in allowed or budget >= n * v * 4, (shape, dtype)
        if shape not in allowed and len(shape) == 2:
            assert numel * dtype.itemsize <= max(budget, floor), (shape, dtype, budget, floor)
    # d weight is summed over row chunks in fp32 exactly when the rows do not fit one chunk
    fp32_weight_blocks = [shape for shape, dtype in seen if dtype == torch.float32 and shape[1:] == (d,)
                          and shape[0] != n]
    assert bool(fp32_weight_blocks) == (rows < n), (seen, rows)
    if not torch.cuda.is_available():  # the interpreter's tiles: both small budgets split the rows
        assert (rows < n) == (workspace_mb < 1), rows
    expected = reference_gradients(build(dict(n=n, v=v, d=d, bias=True, want_entropy=True), torch.float64),
                                   cotangents(p))
    for got, want in zip(grads, expected):
        assert rel_err(got, want) < 2e-3


# ------------------------------------------------------------------------------------------------------
# Through the differentiable op, and gradcheck


def test_token_statistics_op_with_triton_backend():
    from fusedloss.core import TeacherHead, token_statistics

    p = build(CASES["teacher"], torch.float64)
    h = p.hidden.clone().requires_grad_(True)
    w = p.weight.clone().requires_grad_(True)
    teacher = TeacherHead(p.teacher_hidden, p.teacher_weight, p.teacher_bias, 1.5)
    kwargs = dict(targets=p.targets, transform=p.transform, teacher=teacher, want_entropy=True, want_kl_rev=True,
                  want_kl_fwd=True, jsd_beta=0.3)
    grads = {}
    for backend in ("triton", "torch"):
        h.grad = w.grad = None
        s = token_statistics(h, w, backend=backend, **kwargs)
        (s.logp.sum() + s.entropy.sum() + 0.5 * s.kl_rev.sum() + 0.25 * s.kl_fwd.sum() + s.jsd.sum()).backward()
        grads[backend] = (h.grad.clone(), w.grad.clone())
    for a, b in zip(grads["triton"], grads["torch"]):
        assert rel_err(a, b) < FP64_TOL


def test_gradcheck_float64():
    from fusedloss.core import token_statistics

    p = build(dict(n=3, v=37, d=5, bias=True), torch.float64)
    h, w, b = (t.clone().requires_grad_(True) for t in (p.hidden, p.weight, p.bias))

    def fn(h, w, b):
        s = token_statistics(h, w, bias=b, targets=p.targets, transform=LogitTransform(0.8, 1.1, 4.0),
                             want_entropy=True, backend="triton")
        return s.logp, s.entropy

    assert torch.autograd.gradcheck(fn, (h, w, b), fast_mode=True, atol=1e-7, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------
# Availability and GPU compilation


def test_availability_reasons(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(triton_backend, "_KERNELS", None)
    reason = triton_backend.availability()
    assert "no CUDA device visible" in reason and "TRITON_INTERPRET=1" in reason
    monkeypatch.setitem(sys.modules, "triton", None)
    assert triton_backend.availability() == "triton not installed"
