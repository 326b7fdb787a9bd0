"""The performance model of the CUDA backend's plans: the passes of the choice ``fusedloss.backends.cuda.plan.plan``
makes (its rules, its shapes), each with its flops, HBM bytes, instructions and small launches, priced by
``cost.evaluate``. ``candidates`` lists every plan the backend could run for a workload (both paths, and on the
grad-in-forward path the ungrouped, grouped and deferred d weight), so that the rules' choice can be compared
with the cheapest (tests/tooling/test_model_plan_rules.py).
"""

from __future__ import annotations

from typing import Optional

from fusedloss.backends.cuda import plan as cuda_plan
from fusedloss.backends.cuda.extension import STATE_FIELDS
from fusedloss.backends.cuda.plan import (
    _layout_sizes,
    _Shape,
)

from . import cost, sass_counts
from .cost import Workload

# Small kernels (aten ops that are neither views nor the GEMM-sized products) of the grad-in-forward path: (per row
# chunk, per call). Per chunk: the loss module's autograd on [rows] vectors, the dz coefficients, the masks;
# per call: validation, the targets, the loss's reductions and the backward's scaling. As a trace of the aten
# ops of one forward and backward counts them with the losses' defaults
# (tests/tooling/test_cost_model_cuda_launches.py); other ops take the largest.
_SMALL_LAUNCHES = {"cross_entropy": (20, 25), "grpo": (41, 35), "distill_reverse_kl": (13, 14),
                   "distill_forward_kl": (14, 14), "distill_jsd": (18, 14)}
_SMALL_LAUNCHES_DEFAULT = (41, 33)


def small_launches(op: str) -> tuple[int, int]:
    """(per row chunk, per call): the small kernels the model charges ``cost.LAUNCH_US`` each for."""
    return _SMALL_LAUNCHES.get(op, _SMALL_LAUNCHES_DEFAULT)



def _gemm(name, m, n, k, count, w, gpu, hbm_bytes, launches, epilogue_bytes) -> cost.Pass:
    """A product of ``count`` GEMMs with [m, n] outputs over k (the totals: 2 m n k count flops), of whose
    ``hbm_bytes`` ``epilogue_bytes`` are C (written in fp32 or the operands' dtype, read too for beta = 1)."""
    math_ = "float32" if w.dtype == "float32" else w.dtype
    return cost.Pass(name, flops=2.0 * m * n * k * count, hbm_bytes=hbm_bytes, math=math_,
                     efficiency=cost.gemm_efficiency(m, n, k, gpu), fixed_us=launches * cost.LAUNCH_US,
                     epilogue_bytes=epilogue_bytes)


def _sweep(name, elements, bytes_per_element, flops_per_element, launches) -> cost.Pass:
    return cost.Pass(name, flops=float(elements) * flops_per_element, hbm_bytes=float(elements) * bytes_per_element,
                     math="cuda_core", fixed_us=launches * cost.LAUNCH_US)


def _flag(b: bool) -> str:
    return "true" if b else "false"


def kernel_name(kind: str, w: Workload, dx_out: Optional[str] = None, packed: bool = False) -> str:
    """The fp32-tile kernel instantiation a pass of ``w`` launches (kernels.cu), as sass_counts.py names it."""
    teacher, plain = _flag(w.has_teacher), _flag(w.plain)
    if kind == "fold":
        return f"fold_kernel<float, {_flag(w.op == 'token_logprobs_entropy')}, {teacher}, {plain}>"
    if kind == "dx":
        out = dx_out or {"bfloat16": "bf16", "float16": "fp16", "float32": "float"}[w.dtype]
        if packed:
            return f"dx_packed_kernel<{out}, {teacher}, {plain}>"
        return f"dx_kernel<float, {out}, {teacher}, {plain}>"
    return "jsd_kernel<float>"


def _kernel(name: str, kind: str, w: Workload, elements: float, bytes_per_element: float, launches: int,
            extra_bytes: float = 0.0, dx_out: Optional[str] = None, packed: bool = False) -> cost.Pass:
    """An elementwise kernel over ``elements`` logits: its bytes, and the warp-instructions of its vector loop
    per logit as compiled (benchmarks/model/sass_counts.py, from make_sass_counts.py)."""
    counts = sass_counts.KERNELS[kernel_name(kind, w, dx_out, packed)]
    return cost.Pass(name, hbm_bytes=float(elements) * bytes_per_element + extra_bytes, math="cuda_core",
                     fixed_us=launches * cost.LAUNCH_US, instructions=float(elements) * counts["per_column"] / 32,
                     mufu=float(elements) * counts["mufu_per_column"] / 32)


def _token_math(w: Workload, chunks: int, extra: int = 0) -> cost.Pass:
    """The loss's per-token math (GRPO clipping, DPO sigmoid, KL penalty, normalisation, dz coefficients) and
    the call's own small ops: tens of elementwise kernels on [tokens] vectors, ~1 KB per token in all. At
    N = 16384 that is 16 MB: microseconds beside the GEMM-sized products; launches, not bytes, are its cost."""
    per_chunk, per_call = small_launches(w.op)
    return cost.Pass("token math", flops=200.0 * w.n, hbm_bytes=1024.0 * w.n, math="cuda_core",
                     fixed_us=(per_chunk * chunks + per_call + extra) * cost.LAUNCH_US)


def _composable_passes(w: Workload, gpu: cost.GPUSpec, s: _Shape, accumulate: bool) -> list:
    n, v, d, b = w.n, w.v, w.d, w.operand_bytes
    dt = w.teacher_d or d
    tiles = s.row_chunks * s.vocab_tiles
    nv = float(n) * v
    teacher = w.has_teacher
    jsd = w.op == "distill_jsd"
    grads = w.hidden_grad or w.weight_grad

    def logits(name, dim):
        return _gemm(name, s.rows, s.cols, dim, tiles, w, gpu,
                     n * dim * b * s.vocab_tiles + v * dim * b * s.row_chunks + nv * 4, tiles, nv * 4)

    passes = [logits("logits", d)]
    if teacher:
        passes.append(logits("teacher logits", dt))
    # the state merges of a fold over several vocabulary tiles: [kStateFields, rows] read and written per tile
    state = 2 * STATE_FIELDS * 4 * n * (s.vocab_tiles - 1)
    passes.append(_kernel("fold", "fold", w, nv, 8 if teacher else 4, tiles, extra_bytes=state))
    if jsd:
        if tiles > 1:  # the JSD's second sweep recomputes the tiles (one tile stays in the workspace)
            passes += [logits("jsd recompute", d), logits("jsd teacher recompute", dt)]
        passes.append(_kernel("jsd", "jsd", w, nv, 8, tiles))
    passes.append(_token_math(w, 1))
    if not grads:
        return passes
    dx_bytes = 4 if w.dtype == "float32" else b
    passes.append(logits("recompute", d))
    if teacher:
        passes.append(logits("teacher recompute", dt))
    # the same bytes packed or not: a packed dx is written over the tile instead of beside it
    passes.append(_kernel("dx", "dx", w, nv, (8 if teacher else 4) + dx_bytes, tiles, packed=s.packed))
    if w.hidden_grad:
        # d hidden [rows, D] over the vocabulary tiles: one product when one tile covers V, else fp32
        # accumulation (beta = 1: the accumulator read and written by each later tile's product)
        acc = n * d * 4 * (1 + 2 * (s.vocab_tiles - 1)) if s.vocab_tiles > 1 else n * d * b
        moved = nv * dx_bytes + v * d * b * s.row_chunks + acc
        passes.append(_gemm("d hidden", s.rows, d, s.cols, tiles, w, gpu, moved, tiles, acc))
        if s.vocab_tiles > 1 and not accumulate:  # a product block, then a separate add kernel
            passes.append(_sweep("d hidden add", n * d * (s.vocab_tiles - 1), 12, 1, tiles))
    if w.weight_grad:
        acc = v * d * 4 * (1 + 2 * (s.row_chunks - 1)) if s.row_chunks > 1 else v * d * b
        moved = nv * dx_bytes + n * d * b * s.vocab_tiles + acc
        passes.append(_gemm("d weight", s.cols, d, s.rows, tiles, w, gpu, moved, tiles, acc))
        if s.row_chunks > 1 and not accumulate:
            passes.append(_sweep("d weight add", v * d * (s.row_chunks - 1), 12, 1, tiles))
        # rows outside the loss must not bring NaN padding into d weight: a masked copy of hidden
        passes.append(_sweep("hidden mask", n * d, 2 * b, 1, 1))
    rounding = (v * d * (4 + b) if w.weight_grad and s.row_chunks > 1 else 0) + (
        n * d * (4 + b) if w.hidden_grad and s.vocab_tiles > 1 else 0)
    if rounding:
        passes.append(_sweep("round gradients", rounding / 6, 6, 1, 2))
    return passes


def _grad_in_forward_passes(w: Workload, gpu: cost.GPUSpec, s: _Shape, accumulate: bool) -> list:
    n, v, d, b = w.n, w.v, w.d, w.operand_bytes
    dt = w.teacher_d or d
    sizes = _layout_sizes(n, s)
    chunk_rows, group_rows = sizes.chunk_rows, sizes.group_rows
    c, groups = sizes.chunks, sizes.groups
    nv = float(n) * v
    teacher = w.has_teacher
    fp16 = w.dtype == "float16"
    dx_bytes = 4 if w.dtype == "float32" else b
    accumulated = groups > 1 or fp16  # d weight in an fp32 accumulator, not written once in its own dtype

    def per_size(counts, make):
        """One pass per distinct chunk or group size (each product priced at its own shape)."""
        return [make(m, k) for m, k in sorted(counts.items())]

    def logits(name, dim):
        return per_size(chunk_rows, lambda m, k: _gemm(name, m, v, dim, k, w, gpu,
                                                      m * k * dim * b + v * dim * b * k + m * k * v * 4, k,
                                                      m * k * v * 4))

    passes = logits("logits", d)
    if teacher:
        passes += logits("teacher logits", dt)
    passes.append(_kernel("fold", "fold", w, nv, 8 if teacher else 4, c))
    if w.op == "distill_jsd":
        passes.append(_kernel("jsd", "jsd", w, nv, 8, c))
    # a group of several chunks joins its chunks' row masks (one small op)
    passes.append(_token_math(w, c, sizes.multi_chunk_groups if w.weight_grad else 0))
    if fp16:
        # dx in fp32 in place, its max, then x 2^k rounded to fp16 (GradScaler's scale is not known yet)
        passes.append(_kernel("dx", "dx", w, nv, (8 if teacher else 4) + 4, c, dx_out="float"))
        passes.append(_sweep("dx pre-scale", nv, 4 + 4 + 2, 2, 3 * c))
    else:
        passes.append(_kernel("dx", "dx", w, nv, (8 if teacher else 4) + dx_bytes, c, packed=s.packed))
    if w.hidden_grad:  # one product per group (per chunk without groups), written in fp32
        passes += per_size(group_rows, lambda m, k: _gemm("d hidden", m, d, v, k, w, gpu,
                                                          m * k * v * dx_bytes + v * d * b * k + m * k * d * 4, k,
                                                          m * k * d * 4))
    if w.weight_grad and s.deferred:
        # the backward: hidden scaled by the incoming gradient and masked (read, write; read, write), then one
        # product written in the weight's dtype
        passes.append(_sweep("scale hidden in the backward", n * d, 4 * b, 1, 3))
        passes.append(_gemm("d weight in the backward", v, d, n, 1, w, gpu, nv * dx_bytes + n * d * b + v * d * b,
                            1, v * d * b))
    elif w.weight_grad:
        # the first group's product writes the fp32 accumulator, each later one reads and writes it (beta = 1);
        # one group writes d weight once in its own dtype
        first = sizes.first_group

        def d_weight(m, k):
            acc = (v * d * 4 * (2 * k - (m == first)) if accumulated else v * d * b * k)
            return _gemm("d weight", v, d, m, k, w, gpu, m * k * v * dx_bytes + m * k * d * b + acc, k, acc)

        passes += per_size(group_rows, d_weight)
        if groups > 1 and not accumulate:  # a product block, then a separate add kernel
            passes.append(_sweep("d weight add", v * d * (groups - 1), 12, 1, groups - 1))
    if w.weight_grad and not s.deferred:
        passes.append(_sweep("hidden mask", n * d, 2 * b, 1, groups))
        if fp16 and groups > 1:  # the accumulator follows each chunk's power-of-two scale
            passes.append(_sweep("d weight rescale", v * d * (groups - 1), 8, 1, groups - 1))
    # core/grad_in_forward.py's backward (scaled_gradient): one kernel per gradient reads it once and writes the scaled
    # result once in the parameter's dtype
    scale_bytes = 0
    if w.weight_grad and not s.deferred:
        scale_bytes += v * d * (2 * b if not (accumulated or w.dtype == "float32") else 4 + b)
    if w.hidden_grad:
        scale_bytes += n * d * (4 + b)
    if scale_bytes:
        passes.append(_sweep("scale and round gradients", scale_bytes, 1, 0.1, 2))
    return passes


def _priced(choice, w: Workload, gpu: cost.GPUSpec, shape: _Shape, accumulate: bool) -> cost.Plan:
    passes = (_grad_in_forward_passes if choice.path == "grad_in_forward" else _composable_passes)(w, gpu, shape,
                                                                                                  accumulate)
    return cost.Plan(backend="cuda", path=choice.path, products=choice.products, passes=passes,
                     params=dict(choice.params))


def plan(workload: Workload, gpu, free_bytes: Optional[int] = None, *, path: Optional[str] = None,
         workspace: Optional[int] = None, accumulate_in_gemm: bool = True) -> cost.Plan:
    """The CUDA backend's plan for ``workload`` on ``gpu`` (``fusedloss.backends.cuda.plan.plan``: the same
    arguments, the same choice) with its passes; where the backend chose the path, ``params["alternative"]`` is
    the other path's modelled time."""
    spec = cost.spec_of(gpu)
    hardware = cost.hardware_of(spec)
    choice = cuda_plan.plan(workload, hardware, free_bytes, path=path, workspace=workspace,
                            accumulate_in_gemm=accumulate_in_gemm)
    budget = choice.params["workspace_bytes"]
    caps = dict(cuda_plan._OVERRIDES.get())
    shape = cuda_plan.shape_of(workload, hardware, budget, caps, choice.path, bool(accumulate_in_gemm))
    chosen = _priced(choice, workload, spec, shape, bool(accumulate_in_gemm))
    if path is None and "reason" in choice.params:
        other = plan(workload, spec, free_bytes, workspace=budget, accumulate_in_gemm=accumulate_in_gemm,
                     path="composable" if choice.path == "grad_in_forward" else "grad_in_forward")
        chosen.params["alternative"] = {"path": other.path,
                                        "model_ms": round(cost.evaluate(other, workload, spec).model_ms, 3)}
    return chosen


def candidates(workload: Workload, gpu, budget: int, accumulate: bool = True) -> list:
    """``(label, plan)`` for every plan the CUDA backend can run ``workload`` with in ``budget`` bytes of
    workspace: the composable path, and for a loss known in the forward with a gradient the grad-in-forward path
    with each d weight layout its shapes allow (per chunk, each number of groups, deferred)."""
    spec = cost.spec_of(gpu)
    hardware = cost.hardware_of(spec)
    caps = dict(cuda_plan._OVERRIDES.get())
    out = [("composable", plan(workload, spec, workspace=budget, path="composable", accumulate_in_gemm=accumulate))]
    if not (workload.row_local and (workload.hidden_grad or workload.weight_grad)):
        return out
    w = workload
    base = cuda_plan._with_packing(w, budget, caps, cuda_plan._grad_in_forward_shape_as, w.dtype == "bfloat16")
    shapes = [("grad_in_forward chunks", base)]
    shapes += [(f"grad_in_forward {g} groups", s) for g, s in cuda_plan._group_candidates(w, budget, caps, base)]
    deferred = cuda_plan._deferred_shape(w, budget, caps, base)
    if deferred is not None:
        shapes.append(("grad_in_forward deferred", deferred))
    choice = cuda_plan.plan(w, hardware, workspace=budget, path="grad_in_forward", accumulate_in_gemm=accumulate)
    for label, shape in shapes:
        out.append((label, cost.Plan("cuda", "grad_in_forward", choice.products,
                                     _grad_in_forward_passes(w, spec, shape, accumulate), {})))
    return out
