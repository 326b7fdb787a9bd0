"""The performance model of the Triton backend's plans: the passes of the choice ``fusedloss.backends.triton.plan.plan``
makes (its rule, its tiles, grids and chunks), each with its flops, HBM bytes and small launches, priced by
``cost.evaluate``. ``candidates`` lists both paths, so that the rule's choice can be compared with the cheaper
(tests/tooling/test_model_plan_rules.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from fusedloss.backends.triton import plan as triton_plan
from fusedloss.backends.triton.plan import (
    GRADIENT_GROUP,
    TEACHER_FOLD_TILES,
    TileConfig,
    _cdiv,
    _common_params,
    _sizes,
    backward_chunks,
    elementwise_grid,
    grid_of,
)
from fusedloss.core import partials

from . import cost
from .cost import Workload


class SmallLaunches(NamedTuple):
    """Small launches the model charges ``cost.LAUNCH_US`` each for. ``merge``: per statistics forward, the
    splits merged and finalised (torch ops on the [fields, splits, rows] partials); ``chunk``: per grad-in-forward
    chunk besides its statistics kernel and merge (the loss's per-token math, the dz coefficients, the
    normalisers, the masks, the gradient kernel); ``call``: per call (validation, the targets, the
    reductions, the gradients' scaling; on the composable path the backward's own small ops)."""

    merge: int
    chunk: int
    call: int


# As a trace of the aten ops and kernel launches of one forward and backward counts them with the losses'
# defaults (tests/tooling/test_cost_model_triton_launches.py); other ops take the largest. Per composable backward
# block: the gradient kernel (its two cuBLAS products are priced as products).
_SMALL_LAUNCHES = {
    "cross_entropy": SmallLaunches(50, 20, 28),
    "grpo": SmallLaunches(50, 41, 38),
    "distill_reverse_kl": SmallLaunches(50, 35, 17),
    "distill_forward_kl": SmallLaunches(50, 29, 17),
    "distill_jsd": SmallLaunches(50, 11, 17),
    "token_logprobs": SmallLaunches(14, 41, 32),
    "token_logprobs_entropy": SmallLaunches(14, 41, 33),
}
_SMALL_LAUNCHES_DEFAULT = SmallLaunches(50, 41, 42)
BACKWARD_BLOCK_LAUNCHES = 1


def small_launches(op: str) -> SmallLaunches:
    """The small launches of an op's call (``SmallLaunches``)."""
    return _SMALL_LAUNCHES.get(op, _SMALL_LAUNCHES_DEFAULT)
# The teacher fold (grad-in-forward distillation): its partials, and the small ops of its frame and split merge
# (partials.merge_teacher_sweep), per grad-in-forward chunk; tests/tooling/test_cost_model_triton_launches.py counts
# them with the rest.
TEACHER_FOLD_MERGE_LAUNCHES = 26
TEACHER_FOLD_FIELDS = 5  # the fold's partials: mt, st, a, b, ztm


def _pass(name: str, flops: float, hbm_bytes: float, math: str, *, efficiency: float = 1.0,
          launches: int = 0, epilogue_bytes: float = 0.0) -> cost.Pass:
    """A ``cost.Pass`` with the efficiency of a skinny product, the fixed cost of its small launches and, for a
    cuBLAS product, the part of its bytes that is its epilogue."""
    return cost.Pass(name, flops, hbm_bytes, math, efficiency=efficiency, fixed_us=launches * cost.LAUNCH_US,
                     epilogue_bytes=epilogue_bytes)


def _product_math(dtype: str, precision: str, gpu: Optional[cost.GPUSpec] = None) -> tuple:
    """(cost-model rate key, products per GEMM-sized product) of a Triton product: tf32x3 is three TF32
    products; float64 at the float64 rate (the fp32 one where the model has none)."""
    if dtype in ("bfloat16", "float16"):
        return dtype, 1
    if dtype == "float64":
        return ("float64" if gpu is not None and "float64" in gpu.tflops else "float32"), 1
    return ("tf32", 3) if precision == "tf32x3" else ("tf32", 1) if precision == "tf32" else ("float32", 1)


def _forward_passes(w: Workload, n: int, gpu: cost.GPUSpec, cfg: TileConfig, precision: str, prefix: str,
                    store_bytes: float = 0.0, teacher_product: bool = True) -> list:
    """The statistics kernel over ``n`` rows: products, operand traffic (the weight once per group of row
    blocks, which share it through L2), the programs the last wave leaves idle, and the split merge.
    ``teacher_product``: the teacher's product is formed in the tile (the grad-in-forward path's comes from cuBLAS)."""
    e, acc, _ = _sizes(w.dtype)
    math_key, factor = _product_math(w.dtype, precision, gpu)
    slots = cfg.slots or gpu.sm_count
    row_blocks, per, splits, group = grid_of(n, w.v, cfg, gpu, w.dtype)
    d_all = w.d + (_teacher_d(w) if teacher_product else 0)
    flops = 2.0 * n * w.v * d_all * factor
    groups = _cdiv(row_blocks, group)
    partials_bytes = len(partials.FIELDS) * splits * n * acc
    traffic = groups * w.v * d_all * e + n * d_all * e + partials_bytes + store_bytes
    busy = row_blocks * _cdiv(w.v, cfg.block_v)
    capacity = _cdiv(row_blocks * splits, slots) * slots * per
    tile = cost.triton_tile_efficiency(cfg.block_m, cfg.block_v)  # the rate this tile's products reach
    passes = [_pass(f"{prefix}: logits and statistics", flops, traffic, math_key, efficiency=tile, launches=1),
              _pass(f"{prefix}: idle in the last wave", flops * (capacity / busy - 1.0), 0.0, math_key,
                    efficiency=tile),
              _pass(f"{prefix}: split merge", 0.0, 4 * partials_bytes, "cuda_core",
                    launches=small_launches(w.op).merge)]
    # the mixture's second sweep (the grad-in-forward path's: _grad_in_forward_plan)
    if w.op == "distill_jsd" and teacher_product:
        passes.append(_pass(f"{prefix}: JSD pass", flops, traffic, math_key, efficiency=tile, launches=1))
    return passes


def _teacher_d(w: Workload) -> int:
    return (w.teacher_d or w.d) if w.has_teacher else 0


def _cublas_math(dtype: str, allow_tf32: bool, gpu: cost.GPUSpec) -> str:
    if dtype in ("bfloat16", "float16"):
        return dtype
    if dtype == "float64":
        return "float64" if "float64" in gpu.tflops else "float32"
    return "tf32" if allow_tf32 else "float32"


def _gradient_products(w: Workload, gpu: cost.GPUSpec, rows: int, cols: int, math: str,
                       dx_bytes: float, direct_weight: bool = False) -> list:
    """d hidden and d weight through cuBLAS from dx blocks of ``rows`` x ``cols``, with their fp32
    accumulators' traffic and the efficiency of products of that shape. Their C (written, and read for a
    beta = 1 accumulation) is the products' epilogue, priced as the CUDA backend's are (``cost.Pass``'s
    ``epilogue_bytes``). ``direct_weight``: a d weight block that one product completes is written in the
    weight's dtype (no fp32 block, no cast) when all rows fit."""
    e, acc, e_dx = _sizes(w.dtype)
    rows, cols = min(rows, w.n), min(cols, w.v)
    chunks_r, chunks_v = _cdiv(w.n, rows), _cdiv(w.v, cols)
    flops = 2.0 * w.n * w.v * w.d
    passes = []
    if w.hidden_grad:
        out_bytes = (2 * chunks_v - 1) * w.n * w.d * acc
        passes.append(_pass("d hidden (cuBLAS)", flops, dx_bytes + chunks_r * w.v * w.d * e + out_bytes, math,
                            efficiency=cost.gemm_efficiency(rows, w.d, cols, gpu), epilogue_bytes=out_bytes))
        if e != acc:
            passes.append(_pass("d hidden: round to the input dtype", 0.0, w.n * w.d * (acc + e), "cuda_core"))
    if w.weight_grad:
        direct = direct_weight and chunks_r == 1
        cast = w.v * w.d * (acc + e) if e != acc and not direct else 0
        out_bytes = w.v * w.d * e if direct else (2 * chunks_r - 1) * w.v * w.d * acc
        passes.append(_pass("d weight (cuBLAS)", flops, dx_bytes + chunks_v * w.n * w.d * e + out_bytes + cast, math,
                            efficiency=cost.gemm_efficiency(cols, w.d, rows, gpu), epilogue_bytes=out_bytes))
        passes.append(_pass("d weight: rows without gradient masked", 0.0, 2 * w.n * w.d * e, "cuda_core"))
    return passes


def _call_ops(w: Workload) -> cost.Pass:
    """The call's own small ops (``SmallLaunches.call``): [tokens] vectors, ~1 KB per token in all."""
    return _pass("small ops of the call", 0.0, 1024.0 * w.n, "cuda_core", launches=small_launches(w.op).call)


def _composable_plan(w: Workload, gpu: cost.GPUSpec, cfg: TileConfig, precision: str, allow_tf32: bool,
                     budget: int) -> cost.Plan:
    e, acc, e_dx = _sizes(w.dtype)
    params = _common_params(w, gpu, cfg, precision, budget)
    passes = _forward_passes(w, w.n, gpu, cfg, precision, "forward")
    grads = int(w.hidden_grad) + int(w.weight_grad)
    if grads:
        rows, cols = backward_chunks(w.n, w.v, w.d, w.dtype, budget, cfg)
        chunks_r, chunks_v = _cdiv(w.n, rows), _cdiv(w.v, cols)
        params.update(row_chunk=rows, vocab_chunk=cols)
        math_key, factor = _product_math(w.dtype, precision, gpu)
        teacher_d = _teacher_d(w)
        flops = 2.0 * w.n * w.v * (w.d + teacher_d) * factor
        groups = chunks_v * _cdiv(_cdiv(min(rows, w.n), cfg.block_m), GRADIENT_GROUP) * chunks_r
        dx_bytes = w.n * w.v * e_dx
        passes.append(_pass("backward: logits again and dx", flops,
                            groups * cols * (w.d + teacher_d) * e + chunks_v * w.n * (w.d + teacher_d) * e
                            + dx_bytes, math_key, efficiency=cost.triton_tile_efficiency(cfg.block_m, cfg.block_v),
                            launches=chunks_r * chunks_v * BACKWARD_BLOCK_LAUNCHES))
        passes += _gradient_products(w, gpu, rows, cols, _cublas_math(w.dtype, allow_tf32, gpu), dx_bytes,
                                     direct_weight=True)
        passes.append(_call_ops(w))
    return cost.Plan(backend="triton", path="composable", products=1.0 + (1.0 + grads if grads else 0.0),
                     passes=passes, params=params)


def _grad_in_forward_plan(w: Workload, gpu: cost.GPUSpec, cfg: TileConfig, precision: str, allow_tf32: bool,
                budget: int) -> cost.Plan:
    """Per row chunk: the teacher's raw logits through cuBLAS into the workspace (an fp32-output product whose
    C write is its epilogue), the student's forward keeping its tiles (with no teacher product), the teacher
    fold over the kept tiles (and the JSD's second sweep); then dx from the kept tiles and the two cuBLAS
    gradient products (``grad_in_forward_gradients``)."""
    e, acc, e_dx = _sizes(w.dtype)
    params = _common_params(w, gpu, cfg, precision, budget)
    rows = params["grad_in_forward_rows"]
    chunks = _cdiv(w.n, rows)
    logits = w.n * w.v * acc * (2 if w.has_teacher else 1)
    cublas = _cublas_math(w.dtype, allow_tf32, gpu)
    dt = _teacher_d(w)
    passes = []
    whole, last = divmod(w.n, rows)
    for m, count in ((rows, whole), (last, 1)):  # the chunks of each size, priced once and counted
        if not (m and count):
            continue
        first = len(passes)
        if w.has_teacher:
            out = m * w.v * acc
            passes.append(cost.Pass("grad-in-forward logits: teacher (cuBLAS)", flops=2.0 * m * w.v * dt,
                                    hbm_bytes=(m + w.v) * dt * e + out, math=cublas,
                                    efficiency=cost.gemm_efficiency(m, w.v, dt, gpu), fixed_us=cost.LAUNCH_US,
                                    epilogue_bytes=out))
        passes += _forward_passes(w, m, gpu, cfg, precision, "grad-in-forward logits", store_bytes=m * w.v * acc,
                                  teacher_product=False)
        if w.has_teacher:
            # the fold reads the teacher's kept tile once (and the student's, for a KL); for a reverse KL each of
            # its programs first reads, per row, the forward tile holding the student's maximum and x_t at the
            # first maximum column (ztm; a 32-byte sector); its partials are written, then merged (~4 passes)
            fold_splits = elementwise_grid(m, w.v, TEACHER_FOLD_TILES, gpu)[2]
            fold_partials = TEACHER_FOLD_FIELDS * fold_splits * m * acc
            tiles_read = 1 if w.op == "distill_jsd" else 2
            ztm = fold_splits * m * (cfg.block_v * acc + 32) if w.op == "distill_reverse_kl" else 0
            passes.append(_pass("grad-in-forward teacher fold", 0.0,
                                tiles_read * m * w.v * acc + ztm + 5 * fold_partials,
                                "cuda_core", launches=1 + TEACHER_FOLD_MERGE_LAUNCHES))
            if w.op == "distill_jsd":
                passes.append(_pass("grad-in-forward JSD pass", 0.0, 2 * m * w.v * acc, "cuda_core", launches=2))
        passes[first:] = [dataclasses.replace(p, count=count) for p in passes[first:]]
    dx_bytes = w.n * w.v * e_dx
    # dx: the kept logits read back, dx written over them (in place for fp32 / float64, packed for bf16 / fp16)
    passes.append(_pass("grad-in-forward dx from the kept logits", 0.0, logits + dx_bytes, "cuda_core",
                        launches=chunks * small_launches(w.op).chunk))
    passes += _gradient_products(w, gpu, rows, w.v, cublas, dx_bytes)
    passes.append(_call_ops(w))
    return cost.Plan(backend="triton", path="grad_in_forward", products=1.0 + int(w.hidden_grad) + int(w.weight_grad),
                     passes=passes, params=params)


def plan(workload: Workload, gpu, free_bytes: Optional[int] = None, *,
         tiles: Optional[TileConfig] = None, grad_in_forward_tiles: Optional[TileConfig] = None,
         workspace_mb: Optional[float] = None, workspace: Optional[int] = None, precision: Optional[str] = None,
         allow_tf32: bool = False, path: Optional[str] = None) -> cost.Plan:
    """The Triton backend's plan for ``workload`` on ``gpu`` (``fusedloss.backends.triton.plan.plan``: the same
    arguments, the same choice) with its passes."""
    spec = cost.spec_of(gpu)
    hardware = cost.hardware_of(spec)
    choice = triton_plan.plan(workload, hardware, free_bytes, tiles=tiles, grad_in_forward_tiles=grad_in_forward_tiles,
                              workspace_mb=workspace_mb, workspace=workspace, precision=precision,
                              allow_tf32=allow_tf32, path=path)
    cfg, grad_in_forward_cfg, precision = triton_plan._plan_tiles(workload, tiles, grad_in_forward_tiles, precision,
                                                                  allow_tf32)
    budget = choice.params["workspace_bytes"]
    if choice.path == "grad_in_forward":
        priced = _grad_in_forward_plan(workload, spec, grad_in_forward_cfg, precision, allow_tf32, budget)
    else:
        priced = _composable_plan(workload, spec, cfg, precision, allow_tf32, budget)
    priced.params = dict(choice.params)
    return priced


def candidates(workload: Workload, gpu, budget: int, **kwargs) -> list:
    """``(label, plan)`` for each path the Triton backend can run ``workload`` on in ``budget`` bytes of workspace."""
    out = [("composable", plan(workload, gpu, workspace=budget, path="composable", **kwargs))]
    if workload.row_local and (workload.hidden_grad or workload.weight_grad):
        out.append(("grad_in_forward", plan(workload, gpu, workspace=budget, path="grad_in_forward", **kwargs)))
    return out
