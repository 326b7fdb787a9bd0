"""The performance model over the planners' grid: every plan the rules choose is priced, finitely. The planners' own
checks over the same axes: tests/contract/test_planner_grid.py.

A plan whose pricing raises fails the call, and the model must price every plan the rules choose (a RuntimeWarning
is an error here).
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest

from benchmarks.model import cost
from benchmarks.model import cuda as cuda_model
from benchmarks.model import triton as triton_model
from fusedloss.backends.cuda import plan as cuda

# The samples of the planners' own grid (tests/contract/test_planner_grid.py), priced here.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contract"))
from test_planner_grid import _samples  # noqa: E402


@pytest.fixture
def strict_pricing():
    """Fresh plan caches, and a fallback without prices is an error (the model must price every plan)."""
    cuda._path_choice.cache_clear()
    cuda._grad_in_forward_kind.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield
    cuda._path_choice.cache_clear()
    cuda._grad_in_forward_kind.cache_clear()


def _check_priced(plan: cost.Plan, w: cost.Workload, gpu: cost.GPUSpec, where) -> None:
    assert plan.path in ("grad_in_forward", "composable"), where
    if plan.path == "grad_in_forward":
        assert w.row_local and plan.params["grad_in_forward_rows"] >= 1, where
    est = cost.evaluate(plan, w, gpu)
    assert math.isfinite(est.model_ms) and est.model_ms > 0 and math.isfinite(est.ratio), where


def test_triton_plans_every_shape(strict_pricing):
    for n, op, v, d, dtype, name, workspace_mb in _samples(24, seed=1):
        w, gpu = cost.Workload(op=op, n=n, d=d, v=v, dtype=dtype), cost.GPUS[name]
        plan = triton_model.plan(w, gpu, gpu.memory_bytes - (2 << 30), workspace_mb=workspace_mb)
        _check_priced(plan, w, gpu, (n, op, v, d, dtype, name, workspace_mb))


def test_cuda_plans_every_shape(strict_pricing):
    for n, op, v, d, dtype, name, workspace_mb in _samples(24, seed=2):
        w, gpu = cost.Workload(op=op, n=n, d=d, v=v, dtype=dtype), cost.GPUS[name]
        workspace = None if workspace_mb is None else workspace_mb << 20
        plan = cuda_model.plan(w, gpu, gpu.memory_bytes - (2 << 30), workspace=workspace)
        where = (n, op, v, d, dtype, name, workspace_mb)
        _check_priced(plan, w, gpu, where)  # the chunks' layout: tests/contract/test_planner_grid.py
        if "alternative" in plan.params:
            assert math.isfinite(plan.params["alternative"]["model_ms"]), where


@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "distill_reverse_kl"])
@pytest.mark.parametrize("d", [3584, 5120])
def test_every_row_count_around_the_first_short_last_chunk_of_a_qwen_head(op, d, strict_pricing):
    """bf16 on an H200 with its memory free: the grad-in-forward chunks hold ~7000 rows of V = 152064, so rows from 7168
    on end with a shorter chunk, whose last wave has idle programs where the whole chunks' has none."""
    gpu = cost.GPUS["h200"]
    for n in list(range(7168, 7168 + 129)) + [18000, 36001]:
        w = cost.Workload(op=op, n=n, d=d, v=152064, dtype="bfloat16")
        for planner in (triton_model.plan, cuda_model.plan):
            _check_priced(planner(w, gpu, 139 << 30), w, gpu, (planner.__module__, op, d, n))


def test_passes_of_one_name_with_and_without_flops_merge_into_one_entry():
    """A pass priced at several shapes is one entry of the plan's detail, whichever of its shapes does
    arithmetic: the idle last wave of the whole chunks has no flops, the last shorter chunk's has some."""
    gpu, w = cost.GPUS["h200"], cost.Workload(op="cross_entropy", n=100, d=64, v=1000)
    idle = cost.Pass("idle", flops=0.0, hbm_bytes=0.0, count=3)
    busy = cost.Pass("idle", flops=1e9, hbm_bytes=0.0, efficiency=0.8, fixed_us=cost.LAUNCH_US)
    for passes in ([idle, busy], [busy, idle]):
        est = cost.evaluate(cost.Plan("triton", "grad_in_forward", 3.0, passes), w, gpu)
        entry = est.pass_detail["idle"]
        assert entry["count"] == 4 and entry["rates"]["efficiency"] == 0.8
        assert entry["rates"]["tflops"] == round(gpu.tflops["bfloat16"] * 0.8, 2)
        assert entry["rates"]["launches"] == 1.0 and entry["rates"]["launch_us"] == cost.LAUNCH_US
        assert est.model_ms == pytest.approx(1e9 / (gpu.tflops["bfloat16"] * 0.8e12) * 1e3 + cost.LAUNCH_US * 1e-3)


def test_a_pass_executed_several_times_counts_its_totals_once_per_execution():
    gpu, w = cost.GPUS["h200"], cost.Workload(op="cross_entropy", n=100, d=64, v=1000)
    one = cost.Pass("fold", hbm_bytes=1e6, math="cuda_core", fixed_us=2 * cost.LAUNCH_US, instructions=320.0)
    three = cost.evaluate(cost.Plan("cuda", "grad_in_forward", 3.0, [cost.Pass(**{**one.__dict__, "count": 3})]), w,
                          gpu)
    merged = cost.evaluate(cost.Plan("cuda", "grad_in_forward", 3.0, [one, one, one]), w, gpu)
    assert three.model_ms == pytest.approx(merged.model_ms)
    assert three.pass_detail["fold"]["rates"] == merged.pass_detail["fold"]["rates"]
    assert three.pass_detail["fold"]["rates"]["launches"] == 6.0


def test_planning_time_does_not_grow_with_n():
    """The grad-in-forward layout's counts come from divisions and the grouped candidates are bounded by the workspace:
    planning a billion rows costs what planning a thousand does."""
    import time

    gpu = cost.GPUS["h200"]
    for n in (10**9, 10**12):
        for op in ("cross_entropy", "distill_jsd"):
            w = cost.Workload(op=op, n=n, d=8192, v=256000)
            start = time.perf_counter()
            cost.evaluate(cuda_model.plan(w, gpu, gpu.memory_bytes // 2), w, gpu)
            cost.evaluate(triton_model.plan(w, gpu), w, gpu)
            assert time.perf_counter() - start < 1.0, (op, n)
