"""The CUDA backend's plan: the decisions it takes for a call, checked without a GPU.

``fusedloss.backends.cuda.backend.plan`` is what the backend uses at run time (its choices by the rules of
``backends/rules.py``; the performance model's prices of them: tests/tooling/test_model_cuda_plan.py): workspace from
free memory (bounded, overridable), tile and chunk shapes, the grad-in-forward path only where its chunks pay,
accumulation inside the GEMM, padded leading dimensions. These tests pin those decisions at the acceptance shapes
(H200, D=4096, bf16) and check that the run-time code follows the plan (tile shapes, chunk counts).
"""

from __future__ import annotations

import sys

import pytest
import torch

import fusedloss
from fusedloss import config
from fusedloss.backends import gpu
from fusedloss.backends.cuda import backend as cuda
from fusedloss.backends.cuda import plan as cuda_plan
from fusedloss.core import registry
from fusedloss.core import workload as cost
from fusedloss.core.problem import GradientNeeds, LogitTransform, Statistics, StatsProblem

H200 = cost.GPUS["h200"]
GIB = 2**30


def workload(op="cross_entropy", n=16384, d=4096, v=151936, dtype="bfloat16", **kw):
    return cost.Workload(op=op, n=n, d=d, v=v, dtype=dtype, **kw)


@pytest.fixture(autouse=True)
def no_workspace_env(monkeypatch):
    monkeypatch.delenv("FUSEDLOSS_WORKSPACE_MB", raising=False)
    monkeypatch.delenv("FUSEDLOSS_ALLOW_TF32", raising=False)


# ------------------------------------------------------------------------------------------------
# Workspace
# ------------------------------------------------------------------------------------------------
def test_workspace_from_free_memory_is_bounded():
    assert cuda.workspace_bytes(None) == cuda_plan.WORKSPACE_MIN_BYTES
    assert cuda.workspace_bytes(1 * GIB) == cuda_plan.WORKSPACE_MIN_BYTES  # an eighth is below the floor
    assert cuda.workspace_bytes(16 * GIB) == 2 * GIB
    assert cuda.workspace_bytes(140 * GIB) == gpu.WORKSPACE_MAX_BYTES == 4 * GIB


def test_workspace_override_by_environment_and_keyword(monkeypatch):
    monkeypatch.setenv("FUSEDLOSS_WORKSPACE_MB", "1024")
    assert cuda.workspace_bytes(140 * GIB) == 1024 * 2**20
    with cuda.override_plan(workspace_mb=64):
        assert cuda.workspace_bytes(140 * GIB) == 64 * 2**20
    p = cuda.plan(workload(), H200, 140 * GIB)
    assert p.params["workspace_bytes"] == 1024 * 2**20
    assert cuda.plan(workload(), H200, 140 * GIB, workspace=3 * GIB).params["workspace_bytes"] == 3 * GIB
    for bad in ("lots", "0", "-5", "inf", "1e400", "nan", "1e-300"):
        monkeypatch.setenv("FUSEDLOSS_WORKSPACE_MB", bad)
        with pytest.raises(ValueError, match="FUSEDLOSS_WORKSPACE_MB"):
            cuda.workspace_bytes()


@pytest.mark.parametrize("bad", ["inf", "1e400", "-inf", "nan", "1e-300", "0.0009"])
@pytest.mark.parametrize("variable", ["FUSEDLOSS_WORKSPACE_MB"])
def test_the_workspace_must_be_a_finite_size(variable, bad, monkeypatch):
    """The variable and the argument are read by one function (``config.workspace_megabytes``): a finite number
    of MiB, at least 1 KiB; infinity (which overflowed deep in the plan) and a size that rounds to no byte
    (a silent 1-byte workspace) are refused with the name of what set them."""
    monkeypatch.setenv(variable, bad)
    with pytest.raises(ValueError, match=f"environment variable {variable} must be a finite number of MiB"):
        cuda.workspace_bytes(140 * GIB)
    monkeypatch.setenv(variable, "0.0009765625")  # the smallest: 1 KiB
    assert cuda.workspace_bytes(140 * GIB) == 1024
    monkeypatch.delenv(variable)
    value = float(bad)
    with pytest.raises(ValueError, match="workspace_mb must be a finite number of MiB"):
        config.RunOptions.checked(workspace_mb=value)
    with pytest.raises(ValueError, match="workspace_mb"):
        with cuda.override_plan(workspace_mb=value):
            pass
    h, w = torch.randn(3, 8), torch.randn(11, 8)
    with pytest.raises(ValueError, match="workspace_mb must be a finite number of MiB"):
        fusedloss.cross_entropy(h, w, torch.tensor([1, 2, 3]), workspace_mb=value, backend="torch")
    with pytest.raises(ValueError, match="workspace must be a positive int of bytes"):
        cuda.plan(workload(), H200, workspace=4.0 * GIB)


def test_override_plan_checks_its_keys():
    with pytest.raises(TypeError, match="override_plan takes"):
        with cuda.override_plan(max_tile_rows=3):
            pass
    with pytest.raises(ValueError, match="tile_rows must be a positive number"):
        with cuda.override_plan(tile_rows=0):
            pass
    assert not hasattr(cuda, "MAX_TILE_ROWS") and not hasattr(cuda, "MAX_TILE_COLS")


# ------------------------------------------------------------------------------------------------
# The acceptance shapes
# ------------------------------------------------------------------------------------------------


def test_one_chunk_defers_d_weight_to_the_backward():
    p = cuda.plan(workload(n=4096, v=128256), H200, 70 * 10**9)
    assert p.path == "grad_in_forward" and p.params["chunks"] == 1 and p.params["groups"] == 1
    assert p.params["d_weight"].startswith("deferred to the backward")
    assert p.params["dx"] == "bf16 [N, V] kept for the backward, outside the workspace"
    # N > D: the dx kept would be larger than the d weight it replaces; written once in its own dtype instead
    p = cuda.plan(workload(n=4097, v=128256), H200, 70 * 10**9)
    assert p.params["chunks"] == 1 and p.params["d_weight"] == "written once in the weight's dtype"


def test_grad_in_forward_chunks_are_cut_at_multiples_of_128_rows():
    assert cuda_plan._chunked(16384, 3533) == (3456, 5)  # 4 x 3456 + 2560: 128 output tiles of 128 rows
    assert cuda_plan._chunked(16384, 20000) == (16384, 1)
    assert cuda_plan._chunked(50, 16) == (13, 4)  # below 128 rows: near-equal parts
    shape = cuda_plan._Shape(1408, 0, 7, 1, 64, False, 8192)
    layout = cuda._grad_in_forward_layout(16384, shape)
    assert [(g0, g1) for g0, g1, _ in layout] == [(0, 8192), (8192, 16384)]
    chunks = [c for _, _, cs in layout for c in cs]
    assert chunks[:6] == [(0, 1408), (1408, 2816), (2816, 4224), (4224, 5632), (5632, 7040), (7040, 8192)]
    assert sum(r1 - r0 for r0, r1 in chunks) == 16384 and len(chunks) == 12


def test_composable_tile_takes_every_row_when_the_workspace_allows():
    p = cuda.plan(workload("token_logprobs_entropy"), H200, 70 * 10**9)
    assert p.path == "composable" and p.products == 4
    params = p.params
    assert params["tile_rows"] == 16384 and params["row_chunks"] == 1
    # every vocabulary tile starts on a 64-column boundary and the tiles cover V
    assert params["tile_cols"] % cuda_plan.ALIGN == 0 and params["vocab_tiles"] * params["tile_cols"] >= 151936
    assert (params["vocab_tiles"] - 1) * params["tile_cols"] < 151936
    assert params["dx_packed"]  # 4 bytes per logit: the bf16 dx is packed over the fp32 tile
    assert params["tile_cols"] * params["tile_rows"] * 4 <= params["workspace_bytes"]
    assert params["d_weight"] == "written once per vocabulary tile in the weight's dtype"


def test_plan_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="float64"):
        cuda.plan(workload(dtype="float64"), H200)
    with pytest.raises(ValueError, match="grad-in-forward path needs"):
        cuda.plan(workload("token_logprobs"), H200, path="grad_in_forward")
    with pytest.raises(ValueError, match="path must be"):
        cuda.plan(workload(), H200, path="fast")


def test_the_forward_and_backward_tile_is_the_same_whatever_the_gradients():
    for op in ("token_logprobs", "cross_entropy"):
        shapes = {cuda_plan._composable_shape(workload(op, hidden_grad=hg, weight_grad=wg), GIB, {})
                  for hg in (True, False) for wg in (True, False)}
        assert len(shapes) == 1


def _rows_for(w, budget, bytes_per_logit):
    """The grad-in-forward chunk rows a workspace of ``budget`` holds at ``bytes_per_logit``, cut at a multiple of 128
    rows, and the chunks of N they make."""
    ld = -(-w.v // cuda_plan.ALIGN) * cuda_plan.ALIGN
    most = budget // (ld * bytes_per_logit)
    if most >= w.n:
        return w.n, 1
    rows = most // 128 * 128
    return rows, -(-w.n // rows)


# a cap on the chunk's rows that does not bind: the ungrouped shape, d weight accumulated per chunk
UNGROUPED = {"grad_in_forward_rows": 10**9}


def test_few_row_tiles_keep_the_dx_copy():
    """One block per row would underfill the GPU below PACKED_MIN_ROWS rows: such tiles keep the separate copy
    (and the (rows, column blocks) grid), whether N is small or V so large that few packed rows fit."""
    with cuda.override_plan(**UNGROUPED):
        small = cuda.plan(workload(n=1024, v=128256), H200, workspace=4 * GIB, path="grad_in_forward")
    assert small.params["grad_in_forward_rows"] == 1024 and not small.params["dx_packed"]
    assert small.params["dx"] == "bf16 copy"
    assert not cuda_plan._composable_shape(workload("token_logprobs", n=1024), 4 * GIB, {}).packed
    huge_v = workload(n=16384, v=2**21)
    shape = cuda_plan._grad_in_forward_shape(huge_v, 4 * GIB, UNGROUPED, H200,
                                             True)  # 512 packed rows would fit: below the rule
    assert not shape.packed and shape.rows == _rows_for(huge_v, 4 * GIB, 6)[0]
    at_rule = workload(n=cuda_plan.PACKED_MIN_ROWS, v=128256)
    assert cuda_plan._grad_in_forward_shape(at_rule, 4 * GIB, UNGROUPED, H200, True).packed
    assert not cuda_plan._grad_in_forward_shape(workload(n=cuda_plan.PACKED_MIN_ROWS - 1, v=128256), 4 * GIB,
                                                UNGROUPED, H200,
                                 True).packed
    # fp16: the composable tile packs (dx written straight from the kernel), the grad-in-forward chunk does not
    w16 = workload(n=4096, v=128256, dtype="float16")
    assert cuda_plan._composable_shape(w16, 4 * GIB, {}).packed and not cuda_plan._grad_in_forward_shape(w16, 4 * GIB,
                                                                                                         {}, H200,
                                                                                     True).packed


def test_odd_vocabulary_gets_a_padded_leading_dimension():
    p = cuda.plan(workload(v=32003, n=4096), H200, 70 * 10**9)
    assert p.params["ld"] == 32064  # rows of 16-byte multiples whatever V is
    shape = cuda_plan._composable_shape(workload("token_logprobs", v=131071, n=4096), 256 * 2**20, {})
    assert shape.ld % cuda_plan.ALIGN == 0 and shape.ld >= shape.cols


# ------------------------------------------------------------------------------------------------
# The run-time code follows the plan (host mode)
# ------------------------------------------------------------------------------------------------
def _problem(n=37, v=131, d=8, seed=0, teacher=False):
    g = torch.Generator().manual_seed(seed)
    kw = {}
    if teacher:
        kw = dict(teacher_hidden=torch.randn(n, d, generator=g), teacher_weight=torch.randn(v, d, generator=g),
                  want_kl_rev=True)
    return StatsProblem(hidden=torch.randn(n, d, generator=g), weight=torch.randn(v, d, generator=g), bias=None,
                        targets=torch.randint(0, v, (n,), generator=g), transform=LogitTransform(), **kw)


@pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: {cuda.availability()}")
def test_grad_in_forward_chunks_follow_the_plan():
    p = _problem(n=37)
    calls = []

    def chunk_fn(stats: Statistics, rows):
        calls.append(rows)
        coeffs = torch.zeros(7, rows.stop - rows.start)
        coeffs[0] = 1.0  # d sum(logp) / dz = onehot(y) - q
        return stats.logp.sum(), coeffs

    with cuda.override_plan(grad_in_forward_rows=10):
        assert cuda.grad_in_forward_rows(p) == 10
        cuda.grad_in_forward_gradients(p, chunk_fn, GradientNeeds(True, True, False))
    # 37 rows in chunks of at most 10: four even chunks (10, 10, 10, 7)
    assert [(r.start, r.stop) for r in calls] == [(0, 10), (10, 20), (20, 30), (30, 37)]


@pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: {cuda.availability()}")
def test_grad_in_forward_pays_follows_the_plan(monkeypatch):
    p = _problem(n=64, v=131)
    p = StatsProblem(**{**p.__dict__, "hidden": p.hidden.requires_grad_()})
    want = cuda_plan._problem_plan(p, row_local=True, path=None, needs=GradientNeeds(True, False, False)).path
    assert cuda.grad_in_forward_pays(p) == (want == "grad_in_forward")
    frozen = StatsProblem(**{**p.__dict__, "hidden": p.hidden.detach()})
    assert cuda.grad_in_forward_pays(frozen) is False  # no gradient: nothing to do in the forward


# ------------------------------------------------------------------------------------------------
# The kept workspace
# ------------------------------------------------------------------------------------------------
def test_release_workspace_drops_the_kept_buffers(monkeypatch):
    """One buffer is kept per (device, stream) between calls; ``fusedloss.release_workspace`` drops them, all or
    one device's, and returns the bytes. (CPU stand-ins for the buffers: the bookkeeping is what is checked.)"""
    monkeypatch.setattr(cuda, "_BUFFERS", {(0, 7): torch.empty(1000, dtype=torch.uint8),
                                           (0, 9): torch.empty(300, dtype=torch.uint8),
                                           (1, 7): torch.empty(50, dtype=torch.uint8)})
    assert fusedloss.release_workspace("cpu") == 0  # nothing is kept for other devices
    assert fusedloss.release_workspace(torch.device("cuda", 1)) == 50
    assert set(cuda._BUFFERS) == {(0, 7), (0, 9)}
    assert fusedloss.release_workspace() == 1300 and cuda._BUFFERS == {}
    assert fusedloss.release_workspace() == 0


def test_release_workspace_never_imports_a_backend(monkeypatch):
    """A backend never imported keeps nothing: releasing does not import it (the CUDA backend loads its
    extension on import)."""
    monkeypatch.delitem(sys.modules, "fusedloss.backends.cuda.backend")
    monkeypatch.setattr(cuda, "_BUFFERS", {(0, 7): torch.empty(64, dtype=torch.uint8)})
    assert registry.release_workspace() == 0
    assert "fusedloss.backends.cuda.backend" not in sys.modules
