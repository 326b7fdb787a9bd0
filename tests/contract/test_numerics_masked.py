"""Masked (-inf) vocabulary entries give one answer on every backend (docs/design.md, "Numerical doctrine").

Rule G, the rule of the KL partials (``backends/torch.py::_kl_terms``, ``core/partials.py::merge``,
``csrc/fusedloss/math.h::kl_term``): a column adds +inf to KL(q || p) where its student logit is finite and
the teacher's is -inf, and 0 where its student logit is -inf (0 log 0), whatever exp underflows to at the
scale of the piece (tile, lane, split) that holds the column; a piece's +inf survives every merge. Likewise
for KL(p || q) with the sides exchanged. So the KLs are +inf exactly where mathematics says, and not NaN,
whatever the tiling.

Each case is a small fp32 problem with masked entries in the student, the teacher, both alike or both
independently, with logits of magnitude 1 and of magnitude ~1e3 (where columns underflow at their piece's
scale), run on every backend with tiles smaller than the vocabulary (torch tiles of 5 columns, CUDA tiles of
8 columns and lanes of one column each, Triton splits of 16 columns). Checked against the torch backend in
float64: the non-finite entries of every statistic match exactly, the finite ones within 1e-5, and the
gradients of every finite objective within 1e-4 (the gradients' precision is judged by the property suite;
here what matters is that they are finite and right).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from _errors import plain_rel_err
from conftest import engine_params

from fusedloss.backends import torch as torch_backend
from fusedloss.core.statistics import TeacherHead, token_statistics

F64 = torch.float64
MASKS = ("student", "teacher", "same", "independent")
STATS = ("lse", "logp", "entropy", "kl_rev", "kl_fwd", "jsd", "lse_t", "kl_qm")


@pytest.fixture(params=engine_params())
def engine(request):
    return request.param


@contextlib.contextmanager
def small_pieces(engine: str):
    """Tiles smaller than the vocabulary, for the forward and the backward alike."""
    if engine == "torch":
        saved = torch_backend.VOCAB_TILE, torch_backend.ROW_CHUNK
        torch_backend.VOCAB_TILE, torch_backend.ROW_CHUNK = 5, 3
        try:
            yield
        finally:
            torch_backend.VOCAB_TILE, torch_backend.ROW_CHUNK = saved
    elif engine == "cuda":
        from fusedloss.backends.cuda import backend as cuda

        with cuda.override_plan(tile_rows=3, tile_cols=8):
            yield
    else:
        from fusedloss.backends.triton import backend as triton_backend

        saved = triton_backend.INTERPRETER_TILES
        triton_backend.INTERPRETER_TILES = triton_backend.TileConfig(16, 16, 16, 4, 1, slots=3)
        try:
            yield
        finally:
            triton_backend.INTERPRETER_TILES = saved


def case(seed: int, mask: str, scale: float, n: int = 5, v: int = 37, d: int = 4):
    """float64 masters (values exact in fp32) of a student and a teacher head with masked entries."""
    g = torch.Generator().manual_seed(seed)

    def head(dd):
        h = torch.randn(n, dd, generator=g, dtype=F64)
        w = torch.randn(v, dd, generator=g, dtype=F64) * scale / math.sqrt(dd)
        return h.float().double(), w.float().double(), (torch.randn(v, generator=g, dtype=F64) * 0.5).float().double()

    h, w, b = head(d)
    ht, wt, bt = head(d + 1)
    ms = torch.rand(v, generator=g) < 0.3
    mt = torch.rand(v, generator=g) < 0.3
    if mask == "student":
        mt[:] = False
    elif mask == "teacher":
        ms[:] = False
    elif mask == "same":
        mt = ms.clone()
    ms[int(torch.randint(0, v, (1,), generator=g))] = False  # a row keeps at least one entry on each side
    mt[int(torch.randint(0, v, (1,), generator=g))] = False
    b = torch.where(ms, -math.inf, b)
    bt = torch.where(mt, -math.inf, bt)
    y = torch.randint(0, v, (n,), generator=g)
    masked = torch.nonzero(ms).squeeze(1)
    if masked.numel():  # labels on masked entries: TRL passes labels only to mark the ignored tokens
        y[1::3] = masked[torch.randint(0, masked.numel(), (len(y[1::3]),), generator=g)]
    y[2] = -1
    return h, w, b, ht, wt, bt, y


def run(engine: str, data, dtype, wants: dict, cot_seed: int, cot_rows=None):
    """(statistics, (d hidden, d weight, d bias)) of ``data`` on ``engine`` in ``dtype``; the objective is a
    random combination of the requested statistics on the rows ``cot_rows`` (a bool [N] mask)."""
    h, w, b, ht, wt, bt, y = (t if t.dtype == torch.int64 else t.to(dtype) for t in data)
    h, w, b = (t.clone().requires_grad_(True) for t in (h, w, b))
    teacher = TeacherHead(ht, wt, bt, 1.0)
    with small_pieces(engine):
        stats = token_statistics(h, w, backend=engine, bias=b, targets=y, teacher=teacher, **wants)
        grads = None
        if cot_rows is not None:
            g = torch.Generator().manual_seed(cot_seed)
            objective = 0.0
            for name in STATS:
                if name in ("lse_t",):
                    continue
                c = torch.rand(y.shape[0], generator=g, dtype=F64) - 0.5
                # Indexing, not a zero cotangent: 0 * inf would make the objective NaN.
                objective = objective + (getattr(stats, name).double()[cot_rows] * c[cot_rows]).sum()
            grads = torch.autograd.grad(objective, (h, w, b))
    return stats, grads


WANTS = {
    "kl": dict(want_kl_rev=True, want_kl_fwd=True, want_entropy=True),
    "jsd": dict(jsd_beta=0.3, want_entropy=True),
}


@pytest.mark.parametrize("problem", sorted(WANTS))
@pytest.mark.parametrize("scale", [1.0, 300.0])
@pytest.mark.parametrize("mask", MASKS)
def test_masked_entries_give_the_float64_answer_on_every_backend(engine, mask, scale, problem):
    for seed in range(3):
        data = case(seed, mask, scale)
        wants = WANTS[problem]
        want, _ = run("torch", data, F64, wants, 0)
        finite_rows = torch.ones(data[-1].shape[0], dtype=torch.bool)
        for name in STATS:
            finite_rows &= torch.isfinite(getattr(want, name))
        want, want_grads = run("torch", data, F64, wants, seed, finite_rows)
        got, got_grads = run(engine, data, torch.float32, wants, seed, finite_rows)
        label = f"{engine} {mask} scale {scale} {problem} seed {seed}"
        for name in STATS:
            a, e = getattr(got, name).detach().double(), getattr(want, name).detach()
            bad = ~torch.isfinite(e)
            assert torch.equal(torch.isposinf(a), torch.isposinf(e)), f"{label}: {name} +inf at {a} want {e}"
            assert not bool(torch.isnan(a).any()), f"{label}: {name} NaN: {a} want {e}"
            scale_of = e[~bad].abs().max().clamp_min(1.0) if bool((~bad).any()) else 1.0
            diff = (a[~bad] - e[~bad]).abs()
            assert float(diff.max()) <= 1e-5 * float(scale_of) if diff.numel() else True, \
                f"{label}: {name} {a} want {e}"
        if bool(finite_rows.any()):
            for what, a, e in zip(("hidden", "weight", "bias"), got_grads, want_grads):
                assert bool(torch.isfinite(a).all()), f"{label}: d {what} not finite: {a}"
                err = plain_rel_err(a, e, 1e-30)
                assert err <= 1e-4, f"{label}: d {what} relative error {err:.2e}"
