"""The CUDA backend's plan: pure functions of a problem's shapes, its GPU and its workspace (no tensors
allocated, nothing launched; ``backend.py`` runs what they decide).

The plan
    ``plan(workload, gpu, free_bytes)`` decides everything about a call (workspace, tile shape, grad-in-forward or
    composable path, how gradients are accumulated) by the named rules of ``backends/rules.py`` and describes it
    as a ``fusedloss.core.workload.PlanChoice``; the performance model (``benchmarks/model/cuda.py``) lists and
    prices the passes of that same choice. The backend takes the same choices at run time (``_choose_path``,
    ``_grad_in_forward_shape``: decided at ``decision_rows(N)`` and cached per step of it, then cut for N):

    * workspace: ``FUSEDLOSS_WORKSPACE_MB`` (fusedloss/config.py) if set, else an eighth of the memory free for
      torch on the device when the backend first runs there, between 256 MiB and 4 GiB (then fixed for the process, so
      that a backward recomputes exactly the tiles its forward used);
    * composable path (``forward_statistics`` then ``backward_gradients``, 4 products): one tile shape for
      both passes (all rows when that leaves >= 4096 columns, else square), the same row blocks and GEMM
      shapes, so recomputed logits equal the forward's bit for bit whichever rows carry gradient;
    * grad-in-forward path (``grad_in_forward_gradients``, 3 products, losses known in the forward): chunks of whole
    rows, cut at
      multiples of 128 rows; bf16 d weight once per group of chunks whose dx the workspace keeps together,
      or deferred to the backward where dx is no larger than d weight (docs/design.md, "Grouped d weight",
      "Deferred d weight"); taken where its chunks are big enough to beat the composable path (the rules
      ``rules.cuda_grad_in_forward``, ``rules.defer_d_weight``, ``rules.cuda_groups``);
    * d hidden and d weight accumulate inside the GEMM (beta = 1 into fp32 accumulators) where torch
      supports it on the device (probed once per device), else a product block and an add; a gradient that
      one product completes is written in its own dtype directly.
    * not done: running the fold and dx kernels on a second stream beside the products. They are ~7% of the
      modelled time at N = 16384, V = 151936 on an H200 (6 of 91 ms), which a double-buffered workspace and
      cross-stream lifetimes could save at most; the first device run's timings decide whether it pays.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import torch

from ... import config
from ...core import registry
from ...core.problem import GradientNeeds, StatsProblem
from ...core.workload import GPU, PlanChoice, Workload
from .. import gpu, rules
from .. import torch as torch_backend
from . import epilogue

# ------------------------------------------------------------------------------------------------
# The plan (docs/design.md, "Plans and the performance model")
# ------------------------------------------------------------------------------------------------
# The floor of the workspace policy (``gpu.workspace_bytes``): a tile takes all rows of at least
# ``MIN_TILE_COLS`` columns. The policy's 4 GiB cap, priced by the model against 8 GiB at N = 16384,
# V = 151936: ~+3% for cross-entropy (two groups of 3 row chunks instead of one group of 3: one more beta = 1
# accumulation of d weight) and ~+2% for reverse-KL distillation (two groups of 6 instead of one of 6); none at
# N = 4096, V = 128256 (one chunk either way) (docs/design.md, "Plans and the performance model").
WORKSPACE_MIN_BYTES = 256 * 2**20
ALIGN = 64  # elements: leading dimensions and vocabulary tile widths (256 B of fp32, 128 B of bf16)
MIN_TILE_COLS = 4096  # below this many columns per row, square tiles instead of all rows
# Grad-in-forward chunks of more rows than one are cut at multiples of the 128-row output tiles of cuBLAS's products
# (``_chunked``): 16384 rows in 4 x 3456 + 2560 fill 128 tiles, where 5 near-equal parts of 3277 would
# start 130, the last of each part mostly empty.
ROW_ALIGN = 128
# Packed dx (docs/design.md, "The logits workspace"): a bf16/fp16 dx written over the fp32 tile it is computed
# from, by one block of 256 threads per row, frees the 2 bytes per logit of a separate copy. Taken when a tile
# (or grad-in-forward chunk) still has this many rows with it: two waves of 256-thread blocks (8 per SM) on the GPUs the
# model lists (132-148 SMs). Fewer rows would leave the GPU underfilled by one block per row; such tiles keep
# the separate copy and the (rows, column blocks) grid, and there the workspace does not limit the rows anyway
# (few rows: N is small, or V so large that a packed tile holds fewer rows than two waves).
PACKED_MIN_ROWS = 2048
_OVERRIDES: contextvars.ContextVar = contextvars.ContextVar("fusedloss_cuda_plan_overrides", default=())
_OVERRIDE_KEYS = ("tile_rows", "tile_cols", "grad_in_forward_rows", "workspace_mb", "packed_min_rows", "group_rows",
                  "defer_d_weight")


@contextlib.contextmanager
def override_plan(**fields):
    """Cap parts of the plan inside a ``with`` block (this context only): ``tile_rows`` / ``tile_cols``
    (the composable tile), ``grad_in_forward_rows`` (rows per grad-in-forward chunk), ``workspace_mb``,
    ``packed_min_rows`` (the
    fewest rows of a tile that packs dx, ``PACKED_MIN_ROWS``), ``group_rows`` (grad-in-forward rows whose dx is kept
    together for their products, ``_grouped_shapes``: forces the grouped shape), ``defer_d_weight`` (forces
    the deferred d weight, ``_deferred_shape``). Tests use tiny tiles so
    that tiny shapes cross tile borders; keep forward and backward inside one block, since a backward must
    recompute the tiles its forward used."""
    unknown = set(fields) - set(_OVERRIDE_KEYS)
    if unknown:
        raise TypeError(f"override_plan takes {_OVERRIDE_KEYS}, got {sorted(unknown)}")
    for key, value in fields.items():
        if key == "workspace_mb":
            config.workspace_megabytes(value, "override_plan: workspace_mb")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"override_plan: {key} must be a positive number, got {value!r}")
    token = _OVERRIDES.set(tuple(sorted({**dict(_OVERRIDES.get()), **fields}.items())))
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


_ALLOW_TF32: contextvars.ContextVar = contextvars.ContextVar("fusedloss_cuda_allow_tf32", default=None)


def _call_options(entry):
    """Run a backend entry point with the call's own options (``StatsProblem.workspace_mb`` and
    ``allow_tf32``, set by the public functions' keyword arguments) in force, for this context only."""

    @functools.wraps(entry)
    def run(p: StatsProblem, *args, **kwargs):
        with contextlib.ExitStack() as stack:
            if p.workspace_mb is not None and "workspace_mb" not in dict(_OVERRIDES.get()):
                stack.enter_context(override_plan(workspace_mb=p.workspace_mb))
            if p.allow_tf32 is not None:
                token = _ALLOW_TF32.set(bool(p.allow_tf32))
                stack.callback(_ALLOW_TF32.reset, token)
            return entry(p, *args, **kwargs)

    return run


def workspace_bytes(free_bytes: Optional[int] = None) -> int:
    """The logits workspace of one call (``gpu.workspace_bytes``): ``override_plan(workspace_mb=)`` or
    ``FUSEDLOSS_WORKSPACE_MB`` (fusedloss/config.py) if set; else ``free_bytes / 8`` between 256 MiB and
    4 GiB; 256 MiB when nothing is known."""
    override = dict(_OVERRIDES.get()).get("workspace_mb")
    if override is None:
        override = config.from_environment().workspace_mb
    return gpu.workspace_bytes(override, free_bytes, WORKSPACE_MIN_BYTES)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _balanced(total: int, most: int) -> tuple[int, int]:
    """(size, count): ``total`` split into ``count = ceil(total / most)`` near-equal parts of at most ``size``."""
    most = max(1, min(total, most))
    count = -(-total // most)
    return -(-total // count), count


def _chunked(total: int, most: int) -> tuple[int, int]:
    """(size, count): ``total`` rows in grad-in-forward chunks of at most ``most``: one chunk where it fits; else chunks
    of
    a multiple of ``ROW_ALIGN`` rows, the last one shorter; below ``ROW_ALIGN`` (tiny caps) near-equal parts."""
    most = max(1, min(total, most))
    if most == total or most < ROW_ALIGN:
        return _balanced(total, most)
    size = most // ROW_ALIGN * ROW_ALIGN
    return size, -(-total // size)


class _Shape(NamedTuple):
    """The tile (composable) or chunk (grad-in-forward) shape of a plan."""

    rows: int
    row_chunks: int
    cols: int
    vocab_tiles: int
    ld: int  # leading dimension of the fp32 tiles (and of the dx copy), padded to ALIGN
    packed: bool = False  # a bf16/fp16 dx packed over the fp32 student tile (no copy in the workspace)
    # grad-in-forward only: rows whose dx is kept together in one region of the workspace before their d hidden and
    # d weight products, several chunks at a time (0: each chunk's own dx, products per chunk)
    group_rows: int = 0
    # grad-in-forward only: d weight deferred to the backward (``core.grad_in_forward.DeferredProduct``): dx of every
    # row kept
    # outside the workspace until then, one product in the weight's dtype with hidden scaled by the gradient
    deferred: bool = False


def _grad_in_forward_layout(n: int, s: _Shape) -> list:
    """The grad-in-forward plan's row groups and their chunks, ``[(g0, g1, [(r0, r1), ...]), ...]``: groups of
    ``s.group_rows`` rows (one chunk each when the shape has no groups), chunks of ``s.rows`` rows inside each
    group, the last of each shorter. The performance model prices exactly these products, and
    grad_in_forward_gradients runs them."""
    group = s.group_rows or s.rows
    layout = []
    for g0 in range(0, n, group):
        g1 = min(n, g0 + group)
        layout.append((g0, g1, [(r0, min(g1, r0 + s.rows)) for r0 in range(g0, g1, s.rows)]))
    return layout


class _Sizes(NamedTuple):
    """``_grad_in_forward_layout``'s counts without its list (a plan's cost must not grow with N): how many chunks and
    groups of each size, the groups of more than one chunk, and the first group's rows."""

    chunk_rows: dict  # rows -> chunks of that many rows, by increasing rows
    group_rows: dict  # rows -> groups of that many rows, by increasing rows
    chunks: int
    groups: int
    multi_chunk_groups: int
    first_group: int


def _chunk_count(n: int, group: int, rows: int) -> int:
    """The chunks of ``_grad_in_forward_layout``: groups of ``group`` rows, each cut in chunks of ``rows``."""
    whole, last = divmod(n, group)
    return whole * -(-group // rows) + -(-last // rows)


def _layout_sizes(n: int, s: _Shape) -> _Sizes:
    group = s.group_rows or s.rows
    whole, last = divmod(n, group)
    chunk_rows, group_rows = collections.Counter(), collections.Counter()
    for rows, count in ((group, whole), (last, 1)):
        if rows and count:
            group_rows[rows] += count
            chunk_rows[s.rows] += count * (rows // s.rows)
            if rows % s.rows:
                chunk_rows[rows % s.rows] += count
    multi = (whole if group > s.rows else 0) + (1 if last > s.rows else 0)
    return _Sizes(dict(sorted((k, c) for k, c in chunk_rows.items() if c)), dict(sorted(group_rows.items())),
                  sum(chunk_rows.values()), whole + (1 if last else 0), multi, min(n, group))


def _bytes_per_element(w: Workload, packed: bool) -> int:
    """Workspace bytes per logit: the fp32 student tile, the fp32 teacher tile, and the half-precision dx copy
    unless dx is fp32 (in place) or packed over the student tile."""
    return 4 + (4 if w.has_teacher else 0) + (0 if w.dtype == "float32" or packed else w.operand_bytes)


def _with_packing(w: Workload, budget: int, caps: dict, shape_fn, can_pack: bool) -> _Shape:
    """``shape_fn(w, budget, caps, packed)`` packed where dx is half precision and the packed tile has at least
    ``PACKED_MIN_ROWS`` rows, else with a separate dx copy."""
    if can_pack and w.dtype != "float32":
        shape = shape_fn(w, budget, caps, True)
        if shape.rows >= caps.get("packed_min_rows", PACKED_MIN_ROWS):
            return shape
    return shape_fn(w, budget, caps, False)


def _composable_shape(w: Workload, budget: int, caps: dict) -> _Shape:
    """One tile shape for the forward and the recompute backward (rule: the backward recomputes exactly the
    forward's row blocks and GEMM shapes). All rows when that leaves >= MIN_TILE_COLS columns (one row chunk:
    d weight needs no accumulator and W is read once per pass), else a square tile (fewest accumulator
    round trips for d hidden and d weight together). Packs dx (bf16 and fp16) where the tile has the rows."""
    return _with_packing(w, budget, caps, _composable_shape_as, True)


def _composable_shape_as(w: Workload, budget: int, caps: dict, packed: bool) -> _Shape:
    elements = max(1, budget // _bytes_per_element(w, packed))
    v_pad = _round_up(w.v, ALIGN)
    if elements // w.n >= min(v_pad, MIN_TILE_COLS):
        rows_max, cols_max = w.n, min(v_pad, elements // w.n)
    else:
        rows_max = max(1, min(w.n, math.isqrt(elements)))
        cols_max = min(v_pad, max(ALIGN, elements // rows_max))
    cols_max = max(ALIGN, cols_max // ALIGN * ALIGN) if cols_max < w.v else w.v
    rows_max = min(rows_max, caps.get("tile_rows", rows_max))
    cols_max = min(cols_max, caps.get("tile_cols", cols_max))
    rows, row_chunks = _balanced(w.n, rows_max)
    cols, vocab_tiles = _balanced(w.v, cols_max)
    if vocab_tiles > 1 and "tile_cols" not in caps:
        cols = min(cols_max, _round_up(cols, ALIGN))  # tiles start on 64-column boundaries of W
        vocab_tiles = -(-w.v // cols)
    return _Shape(rows, row_chunks, cols, vocab_tiles, _round_up(cols, ALIGN), packed)


def _grad_in_forward_shape(w: Workload, budget: int, caps: dict, gpu: GPU, accumulate: bool) -> _Shape:
    """Chunks of whole rows (all V columns), as many rows as the workspace holds (``_chunked``). Packs a bf16
    dx where the chunk has the rows; never fp16's, which is formed in fp32 in place and pre-scaled into a copy
    by torch ops (``_scaled_half_dx``: torch ops over overlapping memory are undefined). A bf16 problem with a
    weight gradient over several chunks may instead group its rows (``_grouped_shapes``) or defer d weight
    (``_deferred_shape``): the rule ``rules.cuda_d_weight_layout`` takes one of these candidates at the plan's
    decision rows (``decision_rows``; docs/design.md, "Grouped d weight", "Plans and the performance model"), and
    the chosen kind is then cut for N itself."""
    kind = _grad_in_forward_kind(_decision_key(w), budget, tuple(sorted(caps.items())), _gpu_key(gpu), accumulate)
    return _grad_in_forward_shape_of(w, budget, caps, kind)


class _GradInForwardKind(NamedTuple):
    """Which grad-in-forward shape a plan takes, independent of the exact N: whole chunks (``"chunks"``), ``groups``
    groups of chunks (``"grouped"``; 0: the size ``override_plan(group_rows=)`` forces), or d weight deferred to
    the backward (``"deferred"``)."""

    name: str
    groups: int = 0


_CHUNKS = _GradInForwardKind("chunks")


def _grad_in_forward_shape_of(w: Workload, budget: int, caps: dict, kind: _GradInForwardKind) -> _Shape:
    """The shape of ``kind`` for ``w``'s own N (a few divisions: the kind was chosen at the decision rows).
    The ungrouped chunks where the kind does not apply at this N (fewer chunks than groups)."""
    base = _with_packing(w, budget, caps, _grad_in_forward_shape_as, w.dtype == "bfloat16")
    shape = None
    if kind.name == "deferred":
        shape = _deferred_shape(w, budget, caps, base)
    elif kind.name == "grouped" and kind.groups == 0:
        shape = next(iter(_grouped_shapes(w, budget, caps, base)), None)
    elif kind.name == "grouped" and kind.groups < base.row_chunks:
        shape = _grouped_shape(w, budget, caps, base, min(w.n, _round_up(-(-w.n // kind.groups), ROW_ALIGN)))
    return shape or base


@functools.lru_cache(maxsize=1024)
def _grad_in_forward_kind(key: tuple, budget: int, caps_items: tuple, gpu_key: tuple,
                          accumulate: bool) -> _GradInForwardKind:
    """The grad-in-forward shape kind for the workload ``key`` (``_decision_key``: N at its decision rows), by the rule
    ``rules.cuda_d_weight_layout``: the plan's cached part, so that calls whose N falls in the
    same step of ``decision_rows`` share it."""
    w, caps = _decided(key), dict(caps_items)
    base = _with_packing(w, budget, caps, _grad_in_forward_shape_as, w.dtype == "bfloat16")
    deferred = _deferred_shape(w, budget, caps, base)
    if "defer_d_weight" in caps and deferred is not None:
        return _GradInForwardKind("deferred")
    if "group_rows" in caps:
        if next(iter(_grouped_shapes(w, budget, caps, base)), None) is not None:
            return _GradInForwardKind("grouped")
    if "grad_in_forward_rows" in caps or "group_rows" in caps:  # a cap on the chunks (tests, device checks)
        return _CHUNKS
    kinds = [(_CHUNKS, base)] + [(_GradInForwardKind("grouped", g), shape)
                                 for g, shape in _group_candidates(w, budget, caps, base)]
    if deferred is not None:
        kinds.append((_GradInForwardKind("deferred"), deferred))
    if len(kinds) == 1:
        return _CHUNKS
    layouts = []
    for _, shape in kinds:
        sizes = _layout_sizes(w.n, shape)
        layouts.append((sizes.chunks, sizes.groups, shape.deferred))
    return kinds[rules.cuda_d_weight_layout(w, _gpu_of_key(gpu_key), layouts)][0]


def decision_rows(n: int) -> int:
    """The rows at which the plan's choices (grad-in-forward or composable path, grouped or deferred d weight) are
    taken for a call of ``n`` rows: ``n`` rounded up to a step of 1/32 of its power of two, at least ``ROW_ALIGN``
    (exact at multiples of 128 below 8192, and at 16384, 32768, ...). The choices are cached per step, so that
    calls of varying sequence lengths share them; the chunks are then cut for ``n`` itself."""
    return _round_up(n, max(ROW_ALIGN, 1 << max(0, n.bit_length() - 6)))


_WORKLOAD_FIELDS = tuple(f.name for f in dataclasses.fields(Workload))


def _decision_key(w: Workload) -> tuple:
    """``w``'s fields in order, N at its decision rows: the key of the plan's cached choices
    (``_decided``)."""
    return tuple(decision_rows(w.n) if name == "n" else getattr(w, name) for name in _WORKLOAD_FIELDS)


def _decided(key: tuple) -> Workload:
    return Workload(**dict(zip(_WORKLOAD_FIELDS, key)))


def _gpu_key(gpu: GPU) -> tuple:
    """A hashable description of a GPU (the package's ``GPU`` or the model's spec of one), for the plan's caches."""
    return (gpu.name, gpu.sm_count, gpu.memory_bytes, gpu.half_flops_per_byte, gpu.fp32_flops_per_byte,
            gpu.tf32_flops_per_byte)


def _gpu_of_key(key: tuple) -> GPU:
    return GPU(*key)


def _grad_in_forward_shape_as(w: Workload, budget: int, caps: dict, packed: bool) -> _Shape:
    ld = _round_up(w.v, ALIGN)
    rows_max = max(1, budget // (ld * _bytes_per_element(w, packed)))
    rows_max = min(rows_max, caps.get("grad_in_forward_rows", rows_max))
    rows, chunks = _chunked(w.n, rows_max)
    return _Shape(rows, chunks, w.v, 1, ld, packed)


def _deferred_shape(w: Workload, budget: int, caps: dict, base: _Shape) -> Optional[_Shape]:
    """The grad-in-forward shape that defers d weight to the backward (docs/design.md, "Deferred d weight"): a bf16
    weight gradient over at most D rows. The forward keeps dx ([N, V] bf16 with padded rows, outside the
    workspace) instead of d weight ([V, D]): no more memory from the forward to the backward (N ld <= V D).
    The backward scales hidden by the incoming gradient and writes d weight once, instead of reading, scaling
    and writing the d weight the forward wrote. The workspace holds the fp32 tiles only.
    ``override_plan(defer_d_weight=1)`` forces it (tests; also fp32, whose kept dx is fp32)."""
    forced = "defer_d_weight" in caps
    if w.dtype == "float16" or not w.weight_grad or not (forced or (w.dtype == "bfloat16"
                                                                     and w.n * base.ld <= w.v * w.d)):
        return None
    live = 4 + (4 if w.has_teacher else 0)
    rows_max = min(max(1, budget // (base.ld * live)), caps.get("grad_in_forward_rows", w.n))
    rows = _chunked(w.n, rows_max)[0]
    return _Shape(rows, _chunk_count(w.n, w.n, rows), w.v, 1, base.ld, False, w.n, True)


def _grouped_shapes(w: Workload, budget: int, caps: dict, base: _Shape):
    """Grad-in-forward shapes whose dx of ``group_rows`` rows (bf16, 2 bytes a logit) stays in a region of the workspace
    beside the chunk's fp32 tiles, so that d weight takes one product per group (K = group rows) instead of
    one beta = 1 accumulation of the fp32 [V, D] accumulator per chunk (8 bytes per entry each), and d hidden
    one per group. Smaller chunks pay for it (more small launches, shorter products): one candidate per
    number of groups below the ungrouped chunk count, each with the largest chunks that still fit.
    ``override_plan(group_rows=)`` forces one (tests; bf16 or fp32, whose region holds fp32 dx)."""
    forced = caps.get("group_rows")
    if forced is not None:
        if w.dtype != "float16":
            shape = _grouped_shape(w, budget, caps, base, min(int(forced), w.n))
            if shape is not None:
                yield shape
        return
    for _, shape in _group_candidates(w, budget, caps, base):
        yield shape


def _group_candidates(w: Workload, budget: int, caps: dict, base: _Shape):
    """``(groups, shape)`` for each distinct group size of ``_grouped_shapes`` (groups of ``ceil(N / groups)``
    rows rounded up to ``ROW_ALIGN``, for 1 <= groups < the ungrouped chunks), in increasing numbers of groups,
    the fewest groups of each size. Only sizes whose region leaves room for a chunk are visited, and above
    64 x ``ROW_ALIGN`` rows sizes at least 1/64 apart, so the count is bounded by the workspace (a few hundred at
    most: 64 per factor e of sizes), never by N."""
    if w.dtype != "bfloat16" or not w.weight_grad or base.row_chunks < 2:
        return
    n = w.n
    region = 2
    live = 4 + (4 if w.has_teacher else 0)
    largest = (budget // base.ld - live) // region  # the largest group whose region leaves a row of tiles
    groups = 1
    while groups < base.row_chunks:
        size = min(n, _round_up(-(-n // groups), ROW_ALIGN))
        if size <= largest:
            shape = _grouped_shape(w, budget, caps, base, size)
            if shape is not None:
                yield groups, shape
        # the next size worth trying: the next multiple of ROW_ALIGN below, or 1/64 below above 64 of them
        # (more than 64 groups: sizes that close differ in their products' weight by less than the rules' precision)
        gap = size // 64 if size > 64 * ROW_ALIGN else 1
        below = min(largest, size - gap) // ROW_ALIGN * ROW_ALIGN
        if below < ROW_ALIGN:
            return
        groups = max(groups + 1, -(-n // below))


def _grouped_shape(w: Workload, budget: int, caps: dict, base: _Shape, group: int) -> Optional[_Shape]:
    """Groups of ``group`` rows, their chunks as large as the workspace left beside the group's dx region holds
    (None where no row fits)."""
    region = 4 if w.dtype == "float32" else 2
    live = 4 + (4 if w.has_teacher else 0)
    rows_max = min((budget // base.ld - region * group) // live, caps.get("grad_in_forward_rows", group), group)
    if rows_max < 1:
        return None
    rows = _chunked(group, rows_max)[0]
    return _Shape(rows, _chunk_count(w.n, group, rows), w.v, 1, base.ld, False, group)


def _products(w: Workload, path: str) -> tuple[float, float]:
    grads = int(w.hidden_grad) + int(w.weight_grad)
    if path == "grad_in_forward":
        return float(1 + grads), 1.0 if w.has_teacher else 0.0
    forms = 1 + (1 if grads else 0)
    return float(forms + grads), float(forms) if w.has_teacher else 0.0


def shape_of(w: Workload, gpu: GPU, budget: int, caps: dict, path: str, accumulate: bool) -> _Shape:
    """The chunk (grad-in-forward) or tile (composable) shape of ``path`` for ``w`` (the performance model lists
    its passes from it)."""
    return (_grad_in_forward_shape(w, budget, caps, gpu, accumulate) if path == "grad_in_forward"
            else _composable_shape(w, budget, caps))


def _candidate(w, gpu, budget, caps, path, accumulate) -> PlanChoice:
    shape = shape_of(w, gpu, budget, caps, path, accumulate)
    products, teacher_products = _products(w, path)
    if path == "composable" and w.op == "distill_jsd" and shape.row_chunks * shape.vocab_tiles > 1:
        products += 1
        teacher_products += 1
    half = {"bfloat16": "bf16", "float16": "fp16"}.get(w.dtype)
    if half is None:
        dx = "fp32, in place in the logits tile"
    elif shape.packed:
        dx = f"{half} packed over the fp32 logits tile"
    elif shape.deferred:
        dx = f"{half} [N, V] kept for the backward, outside the workspace"
    elif shape.group_rows:
        dx = f"{half} region of {shape.group_rows} rows (a group of chunks) beside the fp32 logits tile"
    else:
        scaled = path == "grad_in_forward" and half == "fp16"
        dx = f"{half} copy" + (", power-of-two pre-scaled per chunk" if scaled else "")
    if path == "grad_in_forward":
        groups = _layout_sizes(w.n, shape).groups
        d_weight = ("deferred to the backward: one product in the weight's dtype, hidden scaled by the incoming "
                    "gradient" if shape.deferred else
                    "written once in the weight's dtype" if groups == 1 and w.dtype == "bfloat16"
                    else "fp32 accumulator [V, D]")
        params = {"grad_in_forward_rows": shape.rows, "chunks": shape.row_chunks, "group_rows": shape.group_rows,
                  "groups": groups, "ld": shape.ld}
    else:
        d_weight = ("written once per vocabulary tile in the weight's dtype" if shape.row_chunks == 1
                    else "fp32 accumulator per vocabulary tile [cols, D]")
        params = {"tile_rows": shape.rows, "tile_cols": shape.cols, "row_chunks": shape.row_chunks,
                  "vocab_tiles": shape.vocab_tiles, "ld": shape.ld}
    params.update(workspace_bytes=budget, teacher_products=teacher_products, dx=dx, dx_packed=shape.packed,
                  d_weight=d_weight,
                  accumulate=("inside the GEMM (beta=1 into fp32)" if accumulate else "product block, then add"),
                  fp32_products=("ieee" if _fp32_precision() == "ieee" else "tf32") if w.dtype == "float32" else None,
                  overlap=False)
    return PlanChoice(backend="cuda", path=path, products=products, params=params)


def plan(workload: Workload, gpu: GPU, free_bytes: Optional[int] = None, *,
         path: Optional[str] = None, workspace: Optional[int] = None, accumulate_in_gemm: bool = True) -> PlanChoice:
    """How the CUDA backend runs ``workload`` on ``gpu``: the path, the products and the parameters it runs with.

    ``free_bytes``: memory free for torch on the device (sizes the workspace, ``workspace_bytes``), or
    ``workspace`` the workspace itself. ``path``: "grad_in_forward" or "composable" to force one (the forward and the
    backward of the composable op force "composable"); None takes the grad-in-forward path for a loss known in the
    forward (``workload.row_local``) with a gradient to compute where the rule ``rules.cuda_grad_in_forward`` says
    its chunks beat the composable path, else the composable path. ``accumulate_in_gemm``: whether torch can
    accumulate half products into fp32 inside the GEMM on the device (``gpu.capabilities``).
    The same inputs always give the same plan."""
    if path not in (None, "grad_in_forward", "composable"):
        raise ValueError(f"path must be None, 'grad_in_forward' or 'composable', got {path!r}")
    if workload.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"the CUDA backend plans float32, bfloat16 and float16 workloads (float64 runs on the "
                         f"torch backend), got {workload.dtype!r}")
    if workspace is not None and (isinstance(workspace, bool) or not isinstance(workspace, int) or workspace < 1):
        raise ValueError(f"workspace must be a positive int of bytes or None, got {workspace!r}")
    budget = workspace if workspace is not None else workspace_bytes(free_bytes)
    caps, accumulate = dict(_OVERRIDES.get()), bool(accumulate_in_gemm)
    can_grad_in_forward = workload.row_local and (workload.hidden_grad or workload.weight_grad)
    if path == "grad_in_forward" and not can_grad_in_forward:
        raise ValueError(f"the grad-in-forward path needs a loss known in the forward and a gradient; {workload.op!r} "
                         f"with hidden_grad={workload.hidden_grad}, weight_grad={workload.weight_grad} has none")
    if path is not None or not can_grad_in_forward:
        return _candidate(workload, gpu, budget, caps, path or "composable", accumulate)
    choice = _choose_path(workload, gpu, budget, accumulate)
    chosen = _candidate(workload, gpu, budget, caps, choice.path, accumulate)
    chosen.params["reason"] = choice.reason
    return chosen


class _PathChoice(NamedTuple):
    """The path a plan takes, and the rule's reason."""

    path: str
    reason: str


def _choose_path(w: Workload, gpu: GPU, budget: int, accumulate: bool) -> _PathChoice:
    """The grad-in-forward or the composable path for ``w``: the composable one where the grad-in-forward path cannot
    run, else ``rules.cuda_grad_in_forward`` at the decision rows (cached per step of ``decision_rows``: the host
    time of a call whose N was seen in that step is a dictionary lookup)."""
    if not (w.row_local and (w.hidden_grad or w.weight_grad)):
        return _PathChoice("composable", f"{w.op} needs the composable path")
    return _path_choice(_decision_key(w), _gpu_key(gpu), budget, accumulate, _OVERRIDES.get())


@functools.lru_cache(maxsize=1024)
def _path_choice(key: tuple, gpu_key: tuple, budget: int, accumulate: bool, overrides: tuple) -> _PathChoice:
    w, gpu, caps = _decided(key), _gpu_of_key(gpu_key), dict(overrides)
    chunk = _grad_in_forward_shape(w, budget, caps, gpu, accumulate)
    tile = _composable_shape(w, budget, caps)
    sizes = _layout_sizes(w.n, chunk)
    pays, why = rules.cuda_grad_in_forward(w, gpu, sizes.chunks, sizes.groups, chunk.deferred, tile.row_chunks,
                                           tile.vocab_tiles)
    path = "grad_in_forward" if pays else "composable"
    return _PathChoice(path, f"{path}: {why} (at {w.n} rows, the decision rows of N, of {w.v} at this workspace)")


def gpu_of(device: torch.device) -> GPU:
    """The device's GPU as the plans know it (``registry.device_gpu``, the Triton backend's too: by name, else by
    architecture); the H200 for CPU tensors (host mode)."""
    return registry.device_gpu(device)


workload_of = Workload.of  # the plan's description of a problem


_free_bytes = gpu.free_bytes  # fixed per device for the process (backends/gpu.py)


def _problem_plan(p: StatsProblem, *, row_local: bool, path: Optional[str],
                  needs: GradientNeeds = GradientNeeds(True, True, False)) -> PlanChoice:
    dev = p.hidden.device
    w = workload_of(p, row_local=row_local, hidden_grad=needs.hidden, weight_grad=needs.weight)
    return plan(w, gpu_of(dev), _free_bytes(dev), path=path, accumulate_in_gemm=gpu.capabilities(dev).accumulate)


def _shapes(p: StatsProblem) -> tuple[_Shape, _Shape]:
    """(composable tile, grad-in-forward chunk) of a problem. They depend on its shapes, dtype, teacher and the
    device's workspace only, never on which gradients a call wants: a backward recomputes exactly the tiles
    of its forward."""
    w = workload_of(p, row_local=True)
    budget, caps = workspace_bytes(_free_bytes(p.hidden.device)), dict(_OVERRIDES.get())
    return _composable_shape(w, budget, caps), _grad_in_forward_chunk(p)


def _grad_in_forward_chunk(p: StatsProblem, needs: GradientNeeds = GradientNeeds(True, True, False)) -> _Shape:
    """The grad-in-forward shape of a problem for the gradients a call wants (the plan's, ``_candidate``)."""
    dev = p.hidden.device
    w = workload_of(p, row_local=True, hidden_grad=needs.hidden, weight_grad=needs.weight)
    budget, caps = workspace_bytes(_free_bytes(dev)), dict(_OVERRIDES.get())
    return _grad_in_forward_shape(w, budget, caps, gpu_of(dev), gpu.capabilities(dev).accumulate)


@_call_options
def grad_in_forward_pays(p: StatsProblem) -> bool:
    """The plan's choice for a loss known in the forward (core/grad_in_forward.py): the 3-product grad-in-forward path
    where the rule ``rules.cuda_grad_in_forward`` says its chunks are big enough to beat the composable path."""
    if p.acc_dtype == torch.float64:
        return torch_backend.grad_in_forward_pays(p)
    if epilogue.wanted(p):  # FUSEDLOSS_CUDA_EPILOGUE=1: the composable path on the epilogue kernels
        return False
    needs = GradientNeeds(p.hidden.requires_grad, p.weight.requires_grad, False)
    if not (needs.hidden or needs.weight):
        return False
    dev = p.hidden.device
    w = workload_of(p, row_local=True, hidden_grad=needs.hidden, weight_grad=needs.weight)
    budget = workspace_bytes(_free_bytes(dev))
    return _choose_path(w, gpu_of(dev), budget, gpu.capabilities(dev).accumulate).path == "grad_in_forward"


def grad_in_forward_rows(p: StatsProblem) -> int:
    """Rows of one grad-in-forward chunk of this problem."""
    return _shapes(p)[1].rows



def _fp32_precision() -> str:
    """"ieee" (default: full fp32 products whatever torch's TF32 flags say, the fp32 accuracy contract) or
    "tf32" (the explicit opt-in: the call's ``allow_tf32=True``, else ``FUSEDLOSS_ALLOW_TF32=1``,
    fusedloss/config.py)."""
    allow = _ALLOW_TF32.get()
    if allow is None:
        allow = config.from_environment().allow_tf32
    return "tf32" if allow else "ieee"
