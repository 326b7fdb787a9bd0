"""The generalized JSD's second sweep with given normalisers (``Backend.jsd_sums``, core/registry.py).

A vocabulary-parallel head (docs/design.md, "Distributed") merges every rank's log-sum-exps first, then asks
each rank's backend for KL(q || m) and KL(p || m) over its own columns, q and p normalised by the global
(hi, lo) pairs. Each backend that runs here (torch; Triton under its interpreter; CUDA through its host twins)
must give the torch backend's sums on a shard-like problem: a slice of the columns of a head, with the
full head's normalisers, local targets that are ignored (-1), inside the shard, or on another rank
(``distributed.merge.NOT_HERE``), masked entries in both heads, and tiles smaller than the shard. The sums of
the shards must also add up to the full head's statistics.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import engine_params

from fusedloss.backends import torch as torch_backend
from fusedloss.core import registry
from fusedloss.core.problem import LogitTransform, StatsProblem
from fusedloss.distributed.merge import NOT_HERE

F64 = torch.float64
V, D, DT, N = 41, 6, 5, 9
SHARDS = ((0, 17), (17, 30), (30, 41))


@pytest.fixture(params=engine_params())
def engine(request):
    return request.param


def full_problem(dtype, beta: float, seed: int = 0, masked: bool = True) -> StatsProblem:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=F64)
    w = torch.randn(V, D, generator=g, dtype=F64) * 2.0
    b = torch.randn(V, generator=g, dtype=F64)
    ht = torch.randn(N, DT, generator=g, dtype=F64)
    wt = torch.randn(V, DT, generator=g, dtype=F64) * 2.0
    bt = torch.randn(V, generator=g, dtype=F64)
    h[0] = w[3] * 8.0 / w[3].norm() ** 2 * w[3].norm()  # a confident row
    if masked:
        b[torch.rand(V, generator=g) < 0.2] = -math.inf
        bt[torch.rand(V, generator=g) < 0.2] = -math.inf
        bt[5] = b[5] = -math.inf  # an entry masked on both sides
    y = torch.randint(0, V, (N,), generator=g)
    y[2] = -1
    cast = (lambda t: t.to(dtype))
    return StatsProblem(hidden=cast(h), weight=cast(w), bias=cast(b), targets=y, transform=LogitTransform(1.3),
                        teacher_hidden=cast(ht), teacher_weight=cast(wt), teacher_bias=cast(bt),
                        teacher_transform=LogitTransform(0.8), jsd_beta=beta)


def shard(p: StatsProblem, start: int, stop: int) -> StatsProblem:
    """The columns [start, stop) of ``p`` with local targets, as a rank of a vocabulary-parallel head sees them."""
    y = p.targets
    here = (y >= start) & (y < stop)
    local = torch.where(y < 0, y, torch.where(here, y - start, torch.full_like(y, NOT_HERE)))
    return dataclasses.replace(p, weight=p.weight[start:stop], bias=p.bias[start:stop], targets=local,
                               teacher_weight=p.teacher_weight[start:stop], teacher_bias=p.teacher_bias[start:stop])


@pytest.fixture
def small_tiles(engine):
    """Tiles smaller than a shard (the sweep then crosses tiles, splits or lanes)."""
    if engine == "cuda":
        from fusedloss.backends.cuda import backend as cuda

        with cuda.override_plan(tile_rows=4, tile_cols=6):
            yield
    elif engine == "triton":
        from fusedloss.backends.triton import backend as triton_backend

        saved = triton_backend.INTERPRETER_TILES
        triton_backend.INTERPRETER_TILES = triton_backend.TileConfig(16, 16, 16, 4, 1, slots=2)
        yield
        triton_backend.INTERPRETER_TILES = saved
    else:
        saved = torch_backend.VOCAB_TILE, torch_backend.ROW_CHUNK
        torch_backend.VOCAB_TILE, torch_backend.ROW_CHUNK = 4, 5
        yield
        torch_backend.VOCAB_TILE, torch_backend.ROW_CHUNK = saved


def test_every_backend_provides_its_own_jsd_sums(engine):
    """registry.jsd_sums falls back to the torch backend only for a backend without the hook."""
    assert registry.jsd_sums(engine) is registry.get(engine).jsd_sums


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("beta", [0.5, 0.1])
def test_jsd_sums_with_given_normalisers_match_torch(engine, dtype, beta, small_tiles):
    p = full_problem(dtype, beta)
    full = torch_backend.forward_statistics(dataclasses.replace(p, jsd_beta=None))
    lse, lse_t = (full.lse, full.lse_lo), (full.lse_t, full.lse_t_lo)
    fn = registry.get(engine).jsd_sums
    valid = p.targets >= 0
    tol = (1e-10 if engine == "torch" else 1e-9) if dtype == F64 else 1e-5
    total = torch.zeros(2, N, dtype=F64)
    for start, stop in SHARDS:
        local = shard(p, start, stop)
        got = torch.stack(fn(local, lse, lse_t)).double()
        want = torch.stack(torch_backend.jsd_sums(local, lse, lse_t)).double()
        assert got.dtype == F64 and got.shape == (2, N)
        assert bool(torch.isfinite(got[:, valid]).all()), got
        scale = want[:, valid].abs().max().clamp_min(1e-3)
        err = float((got[:, valid] - want[:, valid]).abs().max() / scale)
        assert err <= tol, f"shard [{start}, {stop}): error {err:.2e}\n got {got}\nwant {want}"
        total += got
    # the shards add up to the full head's sums, and to its JSD
    whole = torch_backend.forward_statistics(p)
    want_total = torch.stack(torch_backend.jsd_sums(p, lse, lse_t)).double()
    assert float((total[:, valid] - want_total[:, valid]).abs().max()) <= max(tol, 4e-6 if dtype != F64 else 1e-12)
    jsd = beta * total[1] + (1 - beta) * total[0]
    assert float((jsd[valid] - whole.jsd.double()[valid]).abs().max()) <= (1e-12 if dtype == F64 else 4e-6) + tol
