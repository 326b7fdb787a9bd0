"""Confident fp32 rows: the target is the maximum and 1 - q_y is 1e-1 ... 1e-4.

There log s = log(1 + t) and the target column's gradient a (1 - q_y) lose relative accuracy when formed
naively in fp32: s = 1 + 1e-3 rounded holds t to 1e-4 relative only, and q_y rounded to 6e-8 is a 6e-4
relative error of 1 - q_y = 1e-4. The backends keep t = s - 1 separately (log s = log1p(t)) and form the
target column as -a expm1(log q_y) + q_y inner_y (docs/design.md, "The dz formula"); this file checks
logp, the loss, the entropy and the hidden / weight gradients of ``token_logprobs`` and ``cross_entropy``
through the public API against float64 on the same fp32-rounded inputs, within 1e-5 relative, for every
backend that runs here: torch, triton (interpreter without a GPU) and cuda (its host twins, on CPU
tensors, when the extension is built but no GPU is visible). It also checks exact ties at the maximum
spread over vocabulary tiles and splits (each tied column counts 1 in t) and float64 to 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch
from _errors import rel_err

import fusedloss
from fusedloss import reference
from fusedloss.core import registry

F64 = torch.float64
V = 131  # prime: padded tiles everywhere
D = 24
GAPS = (1e-1, 1e-2, 1e-3, 1e-4)  # 1 - q_y
TOL = 1e-5


def _backend_cases():
    status = fusedloss.backend_status()
    cases = ["torch"]
    cases.append(pytest.param("triton", marks=pytest.mark.skipif(
        status["triton"] != "available", reason=f"triton: {status['triton']}")))
    cuda_ok = status["cuda"] == "available" or status["cuda"].startswith("built")
    cases.append(pytest.param("cuda", marks=pytest.mark.skipif(not cuda_ok, reason=f"cuda: {status['cuda']}")))
    return cases


@pytest.fixture(params=_backend_cases())
def engine(request, monkeypatch):
    """(backend name, device). The CUDA backend without a GPU runs its host twins on CPU tensors: the public
    API refuses backend='cuda' for CPU tensors, so its resolution is patched for this test only."""
    name = request.param
    if name == "torch":
        return name, torch.device("cpu")
    if torch.cuda.is_available() and fusedloss.backend_status()[name] == "available":
        return name, torch.device("cuda")
    if name == "cuda":
        original = registry.resolve
        monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))
    return name, torch.device("cpu")


@pytest.fixture(params=["grad_in_forward", "statistics"])
def path(request, monkeypatch):
    """Both gradient paths: the 3-product grad-in-forward one and the statistics op's recompute backward."""
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1" if request.param == "grad_in_forward" else "0")
    return request.param


def confident_inputs(n: int, gap: float, *, seed: int = 0, dtype=torch.float32):
    """``hidden [n, D]``, ``weight [V, D]`` (rounded to ``dtype``) and targets whose every row has its target as
    the maximum logit with 1 - q_y = ``gap`` (to ~1e-6 relative, after the rounding). Each row's hidden is
    moved along its target's weight row until z_y - logsumexp(other z) = log((1 - gap) / gap)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(V, D, generator=g, dtype=F64) / math.sqrt(D)).to(dtype).to(F64)
    h = torch.randn(n, D, generator=g, dtype=F64)
    y = torch.randperm(V, generator=g)[:n]
    want = math.log((1.0 - gap) / gap)
    for i in range(n):
        direction = w[y[i]] / w[y[i]].norm() ** 2
        for _ in range(60):
            z = h[i] @ w.T
            others = z.clone()
            others[y[i]] = -math.inf
            miss = float(torch.logsumexp(others, 0) + want - z[y[i]])
            if abs(miss) < 1e-12:
                break
            h[i] += 0.9 * miss * direction
    h = h.to(dtype)
    z = h.to(F64) @ w.T
    q_y = torch.softmax(z, -1).gather(1, y[:, None]).squeeze(1)
    assert bool((z.argmax(1) == y).all())
    assert torch.allclose(1.0 - q_y, torch.full_like(q_y, gap), rtol=1e-2)
    return h, w.to(dtype), y


def _leaves(h, w, device, dtype=None):
    dtype = dtype or h.dtype
    return (h.detach().to(device, dtype).requires_grad_(True), w.detach().to(device, dtype).requires_grad_(True))


def _run(fn: str, backend: str, h, w, y, cot):
    """(value, d hidden, d weight) of fn, through the public API (the reference when backend is None)."""
    mod = reference if backend is None else fusedloss
    kw = {} if backend is None else {"backend": backend}
    if fn == "token_logprobs":
        out = mod.token_logprobs(h, w, y, **kw)
        objective = (out * cot.to(out.dtype)).sum()
    else:
        out = mod.cross_entropy(h, w, y, reduction="sum", **kw)
        objective = out
    objective.backward()
    return out.detach(), h.grad, w.grad


@pytest.mark.parametrize("gap", GAPS)
@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("fn", ["token_logprobs", "cross_entropy"])
def test_confident_fp32_logp_and_gradients(engine, path, fn, n, gap):
    backend, device = engine
    h, w, y = confident_inputs(n, gap, seed=n)
    cot = torch.linspace(0.5, 1.5, n, dtype=F64)
    got = _run(fn, backend, *_leaves(h, w, device), y.to(device), cot.to(device))
    want = _run(fn, None, *_leaves(h, w, "cpu", F64), y, cot)
    for name, a, e in zip(("value", "d hidden", "d weight"), got, want):
        assert a.dtype == torch.float32
        err = rel_err(a, e)
        assert err <= TOL, f"{backend} {fn} {path}: {name} relative error {err:.2e} at 1 - q_y = {gap:g}"


@pytest.mark.parametrize("gap", GAPS)
def test_confident_fp32_entropy(engine, path, gap):
    """The entropy of a confident row (about gap * (1 + log(1 / gap)): 1e-3 at gap 1e-4) and its gradient.

    The objective is the entropy alone; mixed objectives such as logp + H, whose c0 once carried -g_logp and
    rounded H's part to ulp(1), are tests/contract/test_numerics_dz.py's (docs/design.md, "The dz formula")."""
    backend, device = engine
    h, w, y = confident_inputs(3, gap, seed=7)
    cot = torch.tensor([1.0, -0.5, 0.75], dtype=F64)

    def run(mod, hh, ww, yy, c, **kw):
        logp, ent = mod.token_logprobs(hh, ww, yy, return_entropy=True, **kw)
        (ent * c.to(ent.dtype)).sum().backward()
        return logp.detach(), ent.detach(), hh.grad, ww.grad

    got = run(fusedloss, *_leaves(h, w, device), y.to(device), cot.to(device), backend=backend)
    want = run(reference, *_leaves(h, w, "cpu", F64), y, cot)
    assert float(want[1].min()) > 1e-4  # not tiny: its digits mean something in fp32
    for name, a, e in zip(("logp", "entropy", "d hidden", "d weight"), got, want):
        err = rel_err(a, e)
        assert err <= TOL, f"{backend} {path}: {name} relative error {err:.2e} at 1 - q_y = {gap:g}"


@pytest.mark.parametrize("gap", GAPS)
def test_confident_float64_matches_brute_force(engine, path, gap):
    backend, device = engine
    h, w, y = confident_inputs(4, gap, seed=3, dtype=F64)
    cot = torch.linspace(-1.0, 2.0, 4, dtype=F64)
    got = _run("token_logprobs", backend, *_leaves(h, w, device), y.to(device), cot.to(device))
    want = _run("token_logprobs", None, *_leaves(h, w, "cpu"), y, cot)
    # 1e-12, but logp ~ -gap and the gradients ~ gap: the float64 products' own rounding (|z| ~ 15, ulp 2e-15,
    # summed in another order than the reference's) is already ~1.5e-15 / gap of them, with any backend and
    # before this change alike.
    tol = max(1e-12, 4e-15 / gap)
    for name, a, e in zip(("logp", "d hidden", "d weight"), got, want):
        assert a.dtype == F64
        err = rel_err(a, e)
        assert err <= tol, f"{backend} {path}: float64 {name} relative error {err:.2e} at 1 - q_y = {gap:g}"


@pytest.fixture(params=["default tiles", "small tiles"])
def tiles(request, monkeypatch):
    """Small vocabulary tiles (and, for Triton, more splits) put the tied maxima in different tiles and
    splits, so the merges of t meet ties on both sides."""
    if request.param == "small tiles":
        from fusedloss.backends import torch as torch_backend

        monkeypatch.setattr(torch_backend, "VOCAB_TILE", 16)
        from fusedloss.backends.cuda import backend as cuda_backend

        with cuda_backend.override_plan(tile_cols=16):
            if fusedloss.backend_status()["triton"] == "available":
                from fusedloss.backends.triton import backend as triton_backend

                monkeypatch.setattr(triton_backend, "INTERPRETER_TILES",
                                    triton_backend.TileConfig(16, 16, 16, 4, 1, slots=8))
            yield request.param
        return
    yield request.param


@pytest.mark.parametrize("ties", [1, 2, 6])
def test_ties_at_the_maximum(engine, path, tiles, ties):
    """Exactly tied maxima (exact fp32 logits: one-hot hidden rows pick a column of the weight) spread over
    the vocabulary, across tiles, splits and within one tile: each extra tied column adds exactly 1 to t.
    Rows: the target tied at the maximum (not the first one), the target below it, and a confident target
    (the other columns 12 below the maximum)."""
    backend, device = engine
    d = 8
    z = torch.zeros(3, V, dtype=F64)
    tied = torch.tensor([3, 40, 77, 101, 130, 4][:ties])  # 3 and 4: a tie inside one tile as well
    z[0] = torch.linspace(-4.0, 2.0, V, dtype=F64).to(torch.float32).to(F64)
    z[0, tied] = 6.5
    z[1] = -1.25
    z[1, tied] = 9.0
    z[2] = -12.0
    z[2, tied] = 0.0
    y = torch.tensor([int(tied[-1]), 57, int(tied[0])])
    # hidden row i is e_i, weight column i holds row i's logits: z = h @ w.T is exact in fp32.
    h = torch.zeros(3, d, dtype=F64)
    h[torch.arange(3), torch.arange(3)] = 1.0
    w = torch.randn(V, d, generator=torch.Generator().manual_seed(5), dtype=F64).to(torch.float32).to(F64)
    w[:, :3] = z.T
    cot = torch.tensor([1.0, 0.5, -2.0], dtype=F64)
    got = _run("token_logprobs", backend, *_leaves(h.float(), w.float(), device), y.to(device), cot.to(device))
    want = _run("token_logprobs", None, *_leaves(h, w, "cpu"), y, cot)
    for name, a, e in zip(("logp", "d hidden", "d weight"), got, want):
        err = rel_err(a, e)
        assert err <= TOL, f"{backend} {path} {tiles}: {name} relative error {err:.2e} with {ties} tied maxima"
    if ties > 1:
        assert abs(float(got[0][0]) + math.log(ties + float(torch.exp(z[0] - 6.5)[z[0] < 6.5].sum()))) < 1e-6
