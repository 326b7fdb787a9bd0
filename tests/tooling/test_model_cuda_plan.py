"""The performance model of the CUDA backend's plans (benchmarks/model/cuda.py): modelled times at the acceptance
shapes (H200, D=4096, bf16) and what each choice of the plan is worth in the model. The plan's own decisions without
the model: tests/contract/test_cuda_plan.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.model import cost
from benchmarks.model import cuda as cuda_model
from fusedloss.backends.cuda import backend as cuda
from fusedloss.backends.cuda import plan as cuda_plan

# The plan's own tests (tests/contract/test_cuda_plan.py): the acceptance workload, the environment they clear and
# the chunk arithmetic these prices are read at.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contract"))
from test_cuda_plan import GIB, UNGROUPED, _rows_for, no_workspace_env, workload  # noqa: E402, F401

H200 = cost.GPUS["h200"]  # the model's H200 (its rates), where the plan's tests hold the package's

# ------------------------------------------------------------------------------------------------
# Workspace
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["cross_entropy", "grpo"])
def test_row_local_loss_at_the_h200_shape_takes_big_grad_in_forward_chunks(op):
    p = cuda_model.plan(workload(op), H200, 70 * 10**9)
    assert p.path == "grad_in_forward" and p.products == 3
    assert p.params["workspace_bytes"] == 4 * GIB
    # grouped: 4 GiB / 151936 columns = 28268 B a column; two groups of 8192 rows keep their bf16 dx (16384 B),
    # which leaves (28268 - 16384) / 4 B of fp32 logits = 2971 rows a chunk, cut at 23 x 128 = 2944:
    # 2944 + 2944 + 2304 per group
    assert p.params["groups"] == 2 and p.params["group_rows"] == 8192
    assert p.params["grad_in_forward_rows"] == 2944 and p.params["chunks"] == 6
    assert not p.params["dx_packed"] and p.params["dx"].startswith("bf16 region of 8192 rows")
    assert p.params["accumulate"].startswith("inside the GEMM")
    assert p.params["d_weight"] == "fp32 accumulator [V, D]"
    assert p.params["alternative"]["path"] == "composable"
    # the ungrouped shape it beat: 7067 rows a chunk with dx packed, cut at 55 x 128 = 7040: 3 chunks, so 5
    # passes of the fp32 accumulator instead of 3
    with cuda.override_plan(grad_in_forward_rows=7067):
        ungrouped = cuda_model.plan(workload(op), H200, 70 * 10**9)
    assert ungrouped.params["grad_in_forward_rows"] == 7040 and ungrouped.params["chunks"] == 3
    assert ungrouped.params["groups"] == 3 and ungrouped.params["dx_packed"]
    t = cost.evaluate(p, workload(op), H200)
    assert t.model_ms < cost.evaluate(ungrouped, workload(op), H200).model_ms
    d_weight = t.pass_detail["d weight"]["rates"]["epilogue_bytes"]
    assert d_weight == 151936 * 4096 * 4 * 3  # written once, then read and written once


def test_a_small_workspace_makes_square_tiles_and_turns_grad_in_forward_off():
    p = cuda_model.plan(workload(), H200, workspace=128 * 2**20)
    assert p.path == "composable"  # 147-row grad-in-forward chunks would re-add an fp32 [V, D] 112 times
    assert p.params["alternative"]["path"] == "grad_in_forward"
    assert p.params["alternative"]["model_ms"] > cost.evaluate(p, workload(), H200).model_ms
    assert p.params["row_chunks"] > 1 and p.params["vocab_tiles"] > 1
    ratio = p.params["tile_cols"] / p.params["tile_rows"]
    assert 0.5 < ratio < 2.0


@pytest.mark.parametrize("op", ["cross_entropy", "grpo", "token_logprobs", "token_logprobs_entropy",
                                "distill_reverse_kl"])
@pytest.mark.parametrize("n,v", [(16384, 151936), (4096, 128256)])
def test_target_ratio(op, n, v):
    """The cost model's ratio to the product-count bound at the default (4 GiB) workspace: <= 1.2 for
    cross-entropy, GRPO and token_logprobs (+entropy); reverse-KL distillation is priced above it (its two
    fp32 tiles halve the chunk rows, so d weight takes twice the beta = 1 accumulations, and the fold and dx
    read both tiles: docs/design.md, "Plans and the performance model"), within 1.25. And no row-local op is slower
    than its 4-product (composable) plan."""
    w = workload(op, n=n, v=v)
    p = cuda_model.plan(w, H200, H200.memory_bytes // 2)
    est = cost.evaluate(p, w, H200)
    assert est.ratio <= (1.25 if w.has_teacher else 1.2), (op, n, v, est.ratio, est.pass_ms)
    if w.row_local:
        comp = cuda_model.plan(w, H200, H200.memory_bytes // 2, path="composable")
        assert est.model_ms <= cost.evaluate(comp, w, H200).model_ms


def test_model_of_the_token_math_is_small():
    """The per-token loss math (the traced ~70 small ops per chunk of elementwise work on [tokens] vectors, at
    LAUNCH_US each) next to the products: about 1%."""
    w = workload("grpo")
    est = cost.evaluate(cuda_model.plan(w, H200, H200.memory_bytes // 2), w, H200)
    assert 0.002 * est.model_ms < est.pass_ms["token math"] < 0.02 * est.model_ms


def test_fp16_grad_in_forward_pre_scales_and_frozen_weight_skips_d_weight():
    p16 = cuda_model.plan(workload(dtype="float16"), H200, 70 * 10**9)
    assert p16.path == "grad_in_forward" and "dx pre-scale" in [ps.name for ps in p16.passes]
    assert "power-of-two" in p16.params["dx"]
    assert "dx pre-scale" not in [ps.name for ps in cuda_model.plan(workload(), H200, 70 * 10**9).passes]
    frozen = cuda_model.plan(workload(weight_grad=False), H200, 70 * 10**9)
    assert frozen.products == 2 and "d weight" not in [ps.name for ps in frozen.passes]


def test_without_gemm_accumulation_the_plan_adds_blocks_and_costs_more():
    w = workload("token_logprobs", n=16384)
    fast = cuda_model.plan(w, H200, workspace=128 * 2**20)
    slow = cuda_model.plan(w, H200, workspace=128 * 2**20, accumulate_in_gemm=False)
    assert fast.params["row_chunks"] > 1  # d weight is summed over row chunks
    assert "d weight add" in [ps.name for ps in slow.passes] and "d weight add" not in [ps.name for ps in fast.passes]
    assert cost.evaluate(slow, w, H200).model_ms > cost.evaluate(fast, w, H200).model_ms


def test_plan_is_deterministic_and_a_copy():
    a = cuda_model.plan(workload(), H200, 70 * 10**9)
    a.params["grad_in_forward_rows"] = -1
    a.passes.clear()
    b = cuda_model.plan(workload(), H200, 70 * 10**9)
    assert b.params["grad_in_forward_rows"] == 2944 and b.passes


@pytest.mark.parametrize("op,dtype,packed_bytes,copy_bytes", [
    ("cross_entropy", "bfloat16", 4, 6), ("distill_reverse_kl", "bfloat16", 8, 10),
    ("cross_entropy", "float16", None, 6), ("cross_entropy", "float32", None, 4)])
def test_packed_dx_grows_the_grad_in_forward_chunks_as_modelled(op, dtype, packed_bytes, copy_bytes):
    """bf16: the dx packed over the fp32 tile leaves 4 bytes per logit (8 with the teacher's tile), so a 4 GiB
    workspace holds 7067 rows of V = 151936 instead of 4711 (3533 instead of 2826 with a teacher): fewer chunks,
    fewer beta = 1 accumulations of d weight, a lower modelled time. fp16's grad-in-forward dx is pre-scaled into a copy
    by
    torch ops, and fp32's is in place: both as before. (The ungrouped shapes: ``UNGROUPED``.)"""
    w = workload(op, dtype=dtype)
    with cuda.override_plan(**UNGROUPED):
        p = cuda_model.plan(w, H200, workspace=4 * GIB, path="grad_in_forward")
    rows, chunks = _rows_for(w, 4 * GIB, packed_bytes or copy_bytes)
    assert (p.params["grad_in_forward_rows"], p.params["chunks"], p.params["dx_packed"]) == (rows, chunks,
                                                                                             bool(packed_bytes))
    shape = cuda_plan._grad_in_forward_shape(w, 4 * GIB, UNGROUPED, H200, True)
    assert shape.rows * shape.ld * cuda_plan._bytes_per_element(w, shape.packed) <= 4 * GIB
    dx_pass = next(ps for ps in p.passes if ps.name == "dx")
    kernel = cuda_model.kernel_name("dx", w, "float" if dtype == "float16" else None, shape.packed)
    assert kernel.startswith("dx_packed_kernel" if packed_bytes else "dx_kernel")
    assert dx_pass.instructions == pytest.approx(w.n * w.v * cuda_model.sass_counts.KERNELS[kernel]["per_column"] / 32)
    if packed_bytes:
        with cuda.override_plan(packed_min_rows=10**9, **UNGROUPED):  # the copy: fewer rows, more chunks, slower
            unpacked = cuda_model.plan(w, H200, workspace=4 * GIB, path="grad_in_forward")
        assert (unpacked.params["grad_in_forward_rows"], unpacked.params["chunks"]) == _rows_for(w, 4 * GIB, copy_bytes)
        assert unpacked.params["chunks"] > chunks and not unpacked.params["dx_packed"]
        assert cost.evaluate(p, w, H200).model_ms < cost.evaluate(unpacked, w, H200).model_ms
