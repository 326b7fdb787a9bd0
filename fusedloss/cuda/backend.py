"""CUDA backend of the statistics core (``core/problem.py``'s protocol): cuBLAS products, CUDA kernels
(``csrc/``, built into ``fusedloss._C``) for everything between them. See docs/design.md, "Backends and
their plans" and "Plans and the cost model".

Design
    Products ``x = h @ W.T`` go through cuBLAS (``torch.mm``; bf16/fp16 operands with
    ``out_dtype=torch.float32``, so the logits are never rounded to half precision before the softmax)
    into a workspace tile ``[rows, cols]`` whose leading dimension is padded to 64 elements (16-byte rows
    for every dtype, so cuBLAS keeps its aligned kernels whatever V is). The kernels then work on the tile:

    ``fold_tile``   one block per row folds the tile (bias, logit_scale, soft-cap, temperature applied per
                    element) into the running partial statistics and writes the per-row outputs on the last
                    vocabulary tile;
    ``jsd_tile``    the generalized JSD's second sweep;
    ``dx_tile``     turns the tile into d loss / d x from the per-row coefficients (problem.py's dz formula
                    and the chain rule), in place for fp32; for bf16/fp16 packed over the fp32 tile it reads
                    (one block per row, ``PACKED_MIN_ROWS``), or into a separate half copy for tiles of few
                    rows and the fp16 eager path; that dx feeds the two gradient products. Rows outside the
                    loss get exact zeros. d bias sums dx as formed, never its half copy: a bf16/fp16 tile's dx
                    is formed once more into an fp32 scratch for it (``_unrounded_column_sums``). Named columns
                    (core/columns.py): the fold writes their logits, and their given dz is written over dx in
                    fp32 (``_named_dx``, ``columns.put``) before the products read it.

The plan
    ``plan(workload, gpu, free_bytes)`` decides everything about a call (workspace, tile shape, eager or
    composable path, how gradients are accumulated) and describes it as a ``fusedloss.core.cost.Plan``,
    whose modelled time ``cost.evaluate`` computes without a GPU (``benchmarks/cost_model.py``). The backend
    takes the same choices at run time (``_choose_path``, ``_eager_shape``: priced at ``decision_rows(N)`` and
    cached per step of it, then cut for N), so what the model evaluates is what runs:

    * workspace: ``FUSEDLOSS_WORKSPACE_MB`` (fusedloss/config.py) if set, else an eighth of the memory free for
      torch on the device when the backend first runs there, between 256 MiB and 4 GiB (then fixed for the process, so
      that a backward recomputes exactly the tiles its forward used);
    * composable path (``forward_statistics`` then ``backward_gradients``, 4 products): one tile shape for
      both passes (all rows when that leaves >= 4096 columns, else square), the same row blocks and GEMM
      shapes, so recomputed logits equal the forward's bit for bit whichever rows carry gradient;
    * eager path (``eager_gradients``, 3 products, losses known in the forward): chunks of whole rows, cut at
      multiples of 128 rows; bf16 d weight once per group of chunks whose dx the workspace keeps together,
      or deferred to the backward where dx is no larger than d weight (docs/design.md, "Grouped d weight",
      "Deferred d weight"), whichever the model prices fastest; taken only where the model says it beats the
      composable path (big enough chunks), so no op is slower than its 4-product plan;
    * d hidden and d weight accumulate inside the GEMM (beta = 1 into fp32 accumulators) where torch
      supports it on the device (probed once per device), else a product block and an add; a gradient that
      one product completes is written in its own dtype directly.
    * not done: running the fold and dx kernels on a second stream beside the products. They are ~7% of the
      modelled time at N = 16384, V = 151936 on an H200 (6 of 91 ms), which a double-buffered workspace and
      cross-stream lifetimes could save at most; the first device run's timings decide whether it pays.

Numerics
    fp32 products run in full fp32 whatever torch's TF32 settings are (``FUSEDLOSS_ALLOW_TF32=1``
    opts in to TF32 for this backend's products). fp16 eager chunks scale dx by a power of two before
    rounding it (the loss scale of a GradScaler is not known yet when the eager path forms dx) and divide
    the fp32 products by it again, exactly. No host synchronisation in steady state: the path and every
    shape are decided on the host from shapes alone, so a training step can be captured in a CUDA graph.

Host mode (tests without a GPU)
    When the extension is built, every entry point also accepts CPU tensors: the products run in fp32 on
    the CPU and the kernels' host twins (``_C.host_*``, the same ``__host__ __device__`` math of
    ``csrc/fusedloss/*.h``) do the rest. ``override_plan`` shrinks tiles and chunks for the tests.

Float64 problems are delegated to the torch backend (the tile kernels compute in fp32).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import math
import warnings
from typing import NamedTuple, Optional

import torch

from .. import config
from ..core import backends, columns, cost, torch_backend
from ..core import problem as coef  # coef.COEF_*: the dz formula's coefficient rows (docs/design.md)
from ..core.problem import NUM_COEFFS, DeferredProduct, GradientNeeds, Statistics, StatsProblem
from . import epilogue as _epilogue
from . import sass_counts

_NUM_OUTPUTS = len(Statistics._fields)
# Rows of the fold's running-state buffer (csrc/fusedloss/args.h kStateFields: the RowState fields and the
# target logit); the cost model prices its traffic, and an extension with another layout is refused.
_STATE_FIELDS = 14
_COEF_ORDER = [coef.COEF_ONEHOT, coef.COEF_CONST, coef.COEF_LOGQ, coef.COEF_KL_REV, coef.COEF_TEACHER_PROB,
               coef.COEF_LOGM, coef.COEF_UNIFORM]


def _load_extension():
    """``(fusedloss._C, None)``, or ``(None, why)``: not built, or built from sources whose protocol
    (output names, coefficient order) differs from problem.py's, which it would then read and write wrongly."""
    try:
        from .. import _C
    except ImportError as exc:  # not built (no nvcc, FUSEDLOSS_CUDA=0) or a plain source checkout
        return None, exc
    expected = {"OUTPUT_NAMES": list(Statistics._fields), "NUM_COEFFS": NUM_COEFFS, "COEF_INDEX": _COEF_ORDER,
                "STATE_FIELDS": _STATE_FIELDS}
    for name, want in expected.items():
        got = getattr(_C, name, None)
        if got != want:
            return None, ImportError(f"fusedloss._C is stale: its {name} is {got!r}, the protocol has {want!r}; "
                                     "rebuild the extension (python setup.py build_ext --inplace)")
    return _C, None


_C, _IMPORT_ERROR = _load_extension()
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# ------------------------------------------------------------------------------------------------
# Availability
# ------------------------------------------------------------------------------------------------
# The oldest Linux driver that runs each CUDA major version's runtime (CUDA minor-version compatibility; setup.py
# records the one of the build in _build_info.CUDA_MIN_DRIVER_LINUX).
_MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# The driver branch that first supported each CUDA version, to name what cudaDriverGetVersion reports.
_DRIVER_BRANCH = {(11, 8): "R520", (12, 0): "R525", (12, 1): "R530", (12, 2): "R535", (12, 3): "R545",
                  (12, 4): "R550", (12, 5): "R555", (12, 6): "R560", (12, 8): "R570", (12, 9): "R575",
                  (13, 0): "R580"}
# What to run for a CUDA 12 build (drivers >= 525.60.13); the README's wheel paragraph says more.
_REBUILD_CUDA12 = ("CUDA_HOME=/path/to/cuda-12.x pip install --force-reinstall --no-deps --no-binary fusedloss "
                   "fusedloss (in a checkout, `bash tools/fetch_cuda12.sh` prints such a CUDA_HOME and "
                   "`bash tools/build_wheels.sh` builds the wheels with it)")


def _needs_driver(runtime: int) -> str:
    """The oldest Linux driver a CUDA runtime (``cudaRuntimeGetVersion``) runs on, for messages."""
    return _MIN_DRIVER.get(runtime // 1000, f"one for CUDA {runtime // 1000}.x")


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _driver_name(driver: int) -> str:
    """"CUDA 12.4 (R550)": what a driver reporting ``driver`` (``cudaDriverGetVersion``) supports."""
    branch = _DRIVER_BRANCH.get((driver // 1000, driver % 1000 // 10))
    return f"CUDA {_version(driver)}" + (f" ({branch})" if branch else "")


def _driver_too_old(runtime: int, driver: int) -> str:
    """What to do about a driver older than the extension's runtime: a CUDA 12 build where the driver runs
    one (>= 525.60.13), else a newer driver."""
    need = _needs_driver(runtime)
    if runtime // 1000 > 12 and driver // 1000 >= 12:
        return (f"fix: install a fusedloss wheel built with CUDA 12 (it needs a driver >= {_MIN_DRIVER[12]}), or "
                f"rebuild against a CUDA 12.x toolkit: {_REBUILD_CUDA12}; or upgrade the driver to >= {need}")
    if runtime // 1000 > 12:
        return f"fix: upgrade the driver to >= {_MIN_DRIVER[12]} and use a CUDA 12 build, or to >= {need}"
    return f"fix: upgrade the driver to >= {need}"


_NOT_BUILT_FIX = ("fix: install a manylinux wheel of fusedloss (it carries the extension), or reinstall with a "
                  "CUDA toolkit: " + _REBUILD_CUDA12.replace("cuda-12.x", "cuda"))


def _build_status() -> str:
    try:
        from .. import _build_info
    except ImportError:
        return ("not built: fusedloss._C is missing (install the package with pip so that setup.py builds "
                "the CUDA extension)")
    return _build_info.CUDA_EXTENSION


def auto_skip_reason() -> Optional[str]:
    """Why ``backend="auto"`` cannot give CUDA tensors this backend when the driver or the build is to blame
    (the availability sentence, with its fix), for the warning ``core/backends.py`` gives once; None when the
    backend is available or nothing is to be fixed (built without it on purpose, a ROCm torch, a GPU older
    than sm_80)."""
    state = availability()
    if state == "available" or state == "not built: FUSEDLOSS_CUDA=0" or torch.version.hip:
        return None
    if state.startswith("built for sm_80 and newer"):
        return None
    return state


def extension_built() -> bool:
    """Whether ``fusedloss._C`` imports (kernels and their host twins)."""
    return _C is not None


def runtime_info() -> dict:
    """The CUDA versions behind ``availability()``: the runtime the extension carries (static), the
    newest CUDA version the driver supports (None without a driver), the oldest driver branch the
    runtime needs, and the devices the extension's runtime sees."""
    if _C is None:
        return {"extension": availability()}
    runtime, driver = _C.runtime_version(), _C.driver_version()
    return {"runtime": _version(runtime), "driver": _version(driver) if driver else None,
            "needs_driver": _needs_driver(runtime),
            "devices": _C.device_count()}


def availability() -> str:
    """"available", or why not: the extension is missing or stale, its own CUDA runtime finds no usable
    device (a driver older than the runtime it was built with, typically), or the GPU is too old."""
    if _C is None:
        status = _build_status()
        if status == "built" and "stale" in str(_IMPORT_ERROR):
            return f"built but stale: {_IMPORT_ERROR}"
        if status == "built":
            return f"built but not importable: {_IMPORT_ERROR}"
        if status.startswith("not built: nvcc"):
            return f"{status}; {_NOT_BUILT_FIX}"
        return status
    if _C.device_count() == 0:
        runtime, driver = _C.runtime_version(), _C.driver_version()
        if driver == 0:
            return "built; no CUDA device visible"
        if driver // 1000 < runtime // 1000:
            return (f"built with the CUDA {_version(runtime)} runtime, which needs an NVIDIA driver >= "
                    f"{_needs_driver(runtime)}; this driver supports {_driver_name(driver)}; "
                    + _driver_too_old(runtime, driver))
        return f"built; the extension's CUDA {_version(runtime)} runtime sees no device ({_C.device_error()})"
    if not torch.cuda.is_available():
        return f"built; torch {torch.__version__} sees no CUDA device (a CPU build of torch?)"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"built for sm_80 and newer; this GPU is sm_{major}{minor}"
    return "available"


# ------------------------------------------------------------------------------------------------
# The plan (docs/design.md, "Plans and the cost model")
# ------------------------------------------------------------------------------------------------
WORKSPACE_MIN_BYTES = 256 * 2**20
# 4 GiB: beside a training step's own state, and one persistent buffer per device and stream. The model's price
# of the cap against 8 GiB at N = 16384, V = 151936: ~+3% for cross-entropy (two groups of 3 row chunks
# instead of one group of 3: one more beta = 1 accumulation of d weight) and ~+2% for reverse-KL distillation
# (two groups of 6 instead of one of 6); none at N = 4096, V = 128256 (one chunk either way)
# (docs/design.md, "Plans and the cost model").
WORKSPACE_MAX_BYTES = 4 * 2**30
WORKSPACE_FRACTION = 8  # of the memory free for torch when the backend first runs on a device
ALIGN = 64  # elements: leading dimensions and vocabulary tile widths (256 B of fp32, 128 B of bf16)
MIN_TILE_COLS = 4096  # below this many columns per row, square tiles instead of all rows
# Eager chunks of more rows than one are cut at multiples of the 128-row output tiles of cuBLAS's products
# (``_chunked``): 16384 rows in 4 x 3456 + 2560 fill 128 tiles, where 5 near-equal parts of 3277 would
# start 130, the last of each part mostly empty.
ROW_ALIGN = 128
# Packed dx (docs/design.md, "The logits workspace"): a bf16/fp16 dx written over the fp32 tile it is computed
# from, by one block of 256 threads per row, frees the 2 bytes per logit of a separate copy. Taken when a tile
# (or eager chunk) still has this many rows with it: two waves of 256-thread blocks (8 per SM) on the GPUs the
# model lists (132-148 SMs). Fewer rows would leave the GPU underfilled by one block per row; such tiles keep
# the separate copy and the (rows, column blocks) grid, and there the workspace does not limit the rows anyway
# (few rows: N is small, or V so large that a packed tile holds fewer rows than two waves).
PACKED_MIN_ROWS = 2048
# Small kernels (aten ops that are neither views nor the GEMM-sized products) of the eager path: (per row
# chunk, per call). Per chunk: the loss module's autograd on [rows] vectors, the dz coefficients, the masks;
# per call: validation, the targets, the loss's reductions and the backward's scaling. As a trace of the aten
# ops of one forward and backward counts them with the losses' defaults (tests/test_cost_model_launches.py);
# other ops take the largest.
_SMALL_LAUNCHES = {"cross_entropy": (20, 25), "grpo": (41, 35), "distill_reverse_kl": (13, 14),
                   "distill_forward_kl": (14, 14), "distill_jsd": (18, 14)}
_SMALL_LAUNCHES_DEFAULT = (41, 33)


def small_launches(op: str) -> tuple[int, int]:
    """(per row chunk, per call): the small kernels the model charges ``cost.LAUNCH_US`` each for."""
    return _SMALL_LAUNCHES.get(op, _SMALL_LAUNCHES_DEFAULT)


_OVERRIDES: contextvars.ContextVar = contextvars.ContextVar("fusedloss_cuda_plan_overrides", default=())
_OVERRIDE_KEYS = ("tile_rows", "tile_cols", "eager_rows", "workspace_mb", "packed_min_rows", "group_rows",
                  "defer_d_weight")


@contextlib.contextmanager
def override_plan(**fields):
    """Cap parts of the plan inside a ``with`` block (this context only): ``tile_rows`` / ``tile_cols``
    (the composable tile), ``eager_rows`` (rows per eager chunk), ``workspace_mb``, ``packed_min_rows`` (the
    fewest rows of a tile that packs dx, ``PACKED_MIN_ROWS``), ``group_rows`` (eager rows whose dx is kept
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
    """The logits workspace of one call: ``override_plan(workspace_mb=)`` or ``FUSEDLOSS_WORKSPACE_MB``
    (fusedloss/config.py) if set; else ``free_bytes / 8`` between 256 MiB and 4 GiB; 256 MiB when nothing
    is known."""
    override = dict(_OVERRIDES.get()).get("workspace_mb")
    if override is None:
        override = config.from_environment().workspace_mb
    if override is not None:
        return max(1, int(override * 2**20))
    if free_bytes is None:
        return WORKSPACE_MIN_BYTES
    return int(min(WORKSPACE_MAX_BYTES, max(WORKSPACE_MIN_BYTES, free_bytes // WORKSPACE_FRACTION)))


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _balanced(total: int, most: int) -> tuple[int, int]:
    """(size, count): ``total`` split into ``count = ceil(total / most)`` near-equal parts of at most ``size``."""
    most = max(1, min(total, most))
    count = -(-total // most)
    return -(-total // count), count


def _chunked(total: int, most: int) -> tuple[int, int]:
    """(size, count): ``total`` rows in eager chunks of at most ``most``: one chunk where it fits; else chunks of
    a multiple of ``ROW_ALIGN`` rows, the last one shorter; below ``ROW_ALIGN`` (tiny caps) near-equal parts."""
    most = max(1, min(total, most))
    if most == total or most < ROW_ALIGN:
        return _balanced(total, most)
    size = most // ROW_ALIGN * ROW_ALIGN
    return size, -(-total // size)


class _Shape(NamedTuple):
    """The tile (composable) or chunk (eager) shape of a plan."""

    rows: int
    row_chunks: int
    cols: int
    vocab_tiles: int
    ld: int  # leading dimension of the fp32 tiles (and of the dx copy), padded to ALIGN
    packed: bool = False  # a bf16/fp16 dx packed over the fp32 student tile (no copy in the workspace)
    # eager only: rows whose dx is kept together in one region of the workspace before their d hidden and
    # d weight products, several chunks at a time (0: each chunk's own dx, products per chunk)
    group_rows: int = 0
    # eager only: d weight deferred to the backward (``core.eager.DeferredProduct``): dx of every row kept
    # outside the workspace until then, one product in the weight's dtype with hidden scaled by the gradient
    deferred: bool = False


def _eager_layout(n: int, s: _Shape) -> list:
    """The eager plan's row groups and their chunks, ``[(g0, g1, [(r0, r1), ...]), ...]``: groups of
    ``s.group_rows`` rows (one chunk each when the shape has no groups), chunks of ``s.rows`` rows inside each
    group, the last of each shorter. The model prices exactly these products, and eager_gradients runs them."""
    group = s.group_rows or s.rows
    layout = []
    for g0 in range(0, n, group):
        g1 = min(n, g0 + group)
        layout.append((g0, g1, [(r0, min(g1, r0 + s.rows)) for r0 in range(g0, g1, s.rows)]))
    return layout


class _Sizes(NamedTuple):
    """``_eager_layout``'s counts without its list (a plan's cost must not grow with N): how many chunks and
    groups of each size, the groups of more than one chunk, and the first group's rows."""

    chunk_rows: dict  # rows -> chunks of that many rows, by increasing rows
    group_rows: dict  # rows -> groups of that many rows, by increasing rows
    chunks: int
    groups: int
    multi_chunk_groups: int
    first_group: int


def _chunk_count(n: int, group: int, rows: int) -> int:
    """The chunks of ``_eager_layout``: groups of ``group`` rows, each cut in chunks of ``rows``."""
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


def _bytes_per_element(w: cost.Workload, packed: bool) -> int:
    """Workspace bytes per logit: the fp32 student tile, the fp32 teacher tile, and the half-precision dx copy
    unless dx is fp32 (in place) or packed over the student tile."""
    return 4 + (4 if w.has_teacher else 0) + (0 if w.dtype == "float32" or packed else w.operand_bytes)


def _with_packing(w: cost.Workload, budget: int, caps: dict, shape_fn, can_pack: bool) -> _Shape:
    """``shape_fn(w, budget, caps, packed)`` packed where dx is half precision and the packed tile has at least
    ``PACKED_MIN_ROWS`` rows, else with a separate dx copy."""
    if can_pack and w.dtype != "float32":
        shape = shape_fn(w, budget, caps, True)
        if shape.rows >= caps.get("packed_min_rows", PACKED_MIN_ROWS):
            return shape
    return shape_fn(w, budget, caps, False)


def _composable_shape(w: cost.Workload, budget: int, caps: dict) -> _Shape:
    """One tile shape for the forward and the recompute backward (rule: the backward recomputes exactly the
    forward's row blocks and GEMM shapes). All rows when that leaves >= MIN_TILE_COLS columns (one row chunk:
    d weight needs no accumulator and W is read once per pass), else a square tile (fewest accumulator
    round trips for d hidden and d weight together). Packs dx (bf16 and fp16) where the tile has the rows."""
    return _with_packing(w, budget, caps, _composable_shape_as, True)


def _composable_shape_as(w: cost.Workload, budget: int, caps: dict, packed: bool) -> _Shape:
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


def _eager_shape(w: cost.Workload, budget: int, caps: dict, gpu: cost.GPUSpec, accumulate: bool) -> _Shape:
    """Chunks of whole rows (all V columns), as many rows as the workspace holds (``_chunked``). Packs a bf16
    dx where the chunk has the rows; never fp16's, which is formed in fp32 in place and pre-scaled into a copy
    by torch ops (``_scaled_half_dx``: torch ops over overlapping memory are undefined). A bf16 problem with a
    weight gradient over several chunks may instead group its rows (``_grouped_shapes``) or defer d weight
    (``_deferred_shape``): the model takes whichever of these candidates it prices fastest at the plan's
    decision rows (``decision_rows``; docs/design.md, "Grouped d weight", "Plans and the cost model"), and the
    chosen kind is then cut for N itself."""
    kind = _eager_kind(_decision_key(w), budget, tuple(sorted(caps.items())), _gpu_key(gpu), accumulate)
    return _eager_shape_of(w, budget, caps, kind)


class _EagerKind(NamedTuple):
    """Which eager shape a plan takes, independent of the exact N: whole chunks (``"chunks"``), ``groups``
    groups of chunks (``"grouped"``; 0: the size ``override_plan(group_rows=)`` forces), or d weight deferred to
    the backward (``"deferred"``)."""

    name: str
    groups: int = 0


_CHUNKS = _EagerKind("chunks")


def _eager_shape_of(w: cost.Workload, budget: int, caps: dict, kind: _EagerKind) -> _Shape:
    """The shape of ``kind`` for ``w``'s own N (a few divisions: the kind was chosen at the decision rows).
    The ungrouped chunks where the kind does not apply at this N (fewer chunks than groups)."""
    base = _with_packing(w, budget, caps, _eager_shape_as, w.dtype == "bfloat16")
    shape = None
    if kind.name == "deferred":
        shape = _deferred_shape(w, budget, caps, base)
    elif kind.name == "grouped" and kind.groups == 0:
        shape = next(iter(_grouped_shapes(w, budget, caps, base)), None)
    elif kind.name == "grouped" and kind.groups < base.row_chunks:
        shape = _grouped_shape(w, budget, caps, base, min(w.n, _round_up(-(-w.n // kind.groups), ROW_ALIGN)))
    return shape or base


@functools.lru_cache(maxsize=1024)
def _eager_kind(key: tuple, budget: int, caps_items: tuple, gpu_key: tuple, accumulate: bool) -> _EagerKind:
    """The eager shape kind the model prices fastest for the workload ``key`` (``_decision_key``: N at its
    decision rows): the plan's cached part, so that calls whose N falls in the same step of ``decision_rows``
    share it."""
    w, caps = _decided(key), dict(caps_items)
    base = _with_packing(w, budget, caps, _eager_shape_as, w.dtype == "bfloat16")
    deferred = _deferred_shape(w, budget, caps, base)
    if "defer_d_weight" in caps and deferred is not None:
        return _EagerKind("deferred")
    grouped = []
    if "group_rows" in caps:
        if next(iter(_grouped_shapes(w, budget, caps, base)), None) is not None:
            return _EagerKind("grouped")
    else:
        grouped = [(_EagerKind("grouped", g), shape) for g, shape in _group_candidates(w, budget, caps, base)]
    if "eager_rows" in caps:  # a cap on the chunk's rows (tests, device checks): the chunks it asks for
        return _CHUNKS
    candidates = [(_CHUNKS, base)] + grouped
    if deferred is not None:
        candidates.append((_EagerKind("deferred"), deferred))
    if len(candidates) == 1:
        return _CHUNKS
    gpu = _gpu_of_key(gpu_key)
    try:
        timed = [(cost.evaluate(cost.Plan("cuda", "eager", 3.0, _eager_passes(w, gpu, s, accumulate)), w,
                                gpu).model_ms, i) for i, (_, s) in enumerate(candidates)]
    except Exception as exc:  # the choice is a matter of speed: the ungrouped chunks run correctly
        cost.unpriced(f"the CUDA eager shapes of {w}", exc)
        return _CHUNKS
    return candidates[min(timed)[1]][0]  # ties keep the earlier candidate: the ungrouped shape first


def decision_rows(n: int) -> int:
    """The rows at which the plan's choices (eager or composable path, grouped or deferred d weight) are priced
    for a call of ``n`` rows: ``n`` rounded up to a step of 1/32 of its power of two, at least ``ROW_ALIGN``
    (exact at multiples of 128 below 8192, and at 16384, 32768, ...). The choices are cached per step, so that
    calls of varying sequence lengths share them; the chunks are then cut for ``n`` itself."""
    return _round_up(n, max(ROW_ALIGN, 1 << max(0, n.bit_length() - 6)))


_WORKLOAD_FIELDS = tuple(f.name for f in dataclasses.fields(cost.Workload))


def _decision_key(w: cost.Workload) -> tuple:
    """``w``'s fields in order, N at its decision rows: the key of the plan's cached choices
    (``_decided``)."""
    return tuple(decision_rows(w.n) if name == "n" else getattr(w, name) for name in _WORKLOAD_FIELDS)


def _decided(key: tuple) -> cost.Workload:
    return cost.Workload(**dict(zip(_WORKLOAD_FIELDS, key)))


def _gpu_key(gpu: cost.GPUSpec) -> tuple:
    """A hashable description of a GPU spec (its ``tflops`` is a dict), for the plan's caches."""
    return (gpu.name, tuple(sorted(gpu.tflops.items())), gpu.hbm_tbps, gpu.l2_bytes, gpu.sm_count,
            gpu.memory_bytes, gpu.sm_clock_ghz)


def _gpu_of_key(key: tuple) -> cost.GPUSpec:
    name, tflops, *rest = key
    return cost.GPUSpec(name, dict(tflops), *rest)


def _eager_shape_as(w: cost.Workload, budget: int, caps: dict, packed: bool) -> _Shape:
    ld = _round_up(w.v, ALIGN)
    rows_max = max(1, budget // (ld * _bytes_per_element(w, packed)))
    rows_max = min(rows_max, caps.get("eager_rows", rows_max))
    rows, chunks = _chunked(w.n, rows_max)
    return _Shape(rows, chunks, w.v, 1, ld, packed)


def _deferred_shape(w: cost.Workload, budget: int, caps: dict, base: _Shape) -> Optional[_Shape]:
    """The eager shape that defers d weight to the backward (docs/design.md, "Deferred d weight"): a bf16
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
    rows_max = min(max(1, budget // (base.ld * live)), caps.get("eager_rows", w.n))
    rows = _chunked(w.n, rows_max)[0]
    return _Shape(rows, _chunk_count(w.n, w.n, rows), w.v, 1, base.ld, False, w.n, True)


def _grouped_shapes(w: cost.Workload, budget: int, caps: dict, base: _Shape):
    """Eager shapes whose dx of ``group_rows`` rows (bf16, 2 bytes a logit) stays in a region of the workspace
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


def _group_candidates(w: cost.Workload, budget: int, caps: dict, base: _Shape):
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
        # (more than 64 groups: sizes that close differ in the model by less than its precision)
        gap = size // 64 if size > 64 * ROW_ALIGN else 1
        below = min(largest, size - gap) // ROW_ALIGN * ROW_ALIGN
        if below < ROW_ALIGN:
            return
        groups = max(groups + 1, -(-n // below))


def _grouped_shape(w: cost.Workload, budget: int, caps: dict, base: _Shape, group: int) -> Optional[_Shape]:
    """Groups of ``group`` rows, their chunks as large as the workspace left beside the group's dx region holds
    (None where no row fits)."""
    region = 4 if w.dtype == "float32" else 2
    live = 4 + (4 if w.has_teacher else 0)
    rows_max = min((budget // base.ld - region * group) // live, caps.get("eager_rows", group), group)
    if rows_max < 1:
        return None
    rows = _chunked(group, rows_max)[0]
    return _Shape(rows, _chunk_count(w.n, group, rows), w.v, 1, base.ld, False, group)


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


def kernel_name(kind: str, w: cost.Workload, dx_out: Optional[str] = None, packed: bool = False) -> str:
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


def _kernel(name: str, kind: str, w: cost.Workload, elements: float, bytes_per_element: float, launches: int,
            extra_bytes: float = 0.0, dx_out: Optional[str] = None, packed: bool = False) -> cost.Pass:
    """An elementwise kernel over ``elements`` logits: its bytes, and the warp-instructions of its vector loop
    per logit as compiled (fusedloss/cuda/sass_counts.py, from tools/sass_counts.py)."""
    counts = sass_counts.KERNELS[kernel_name(kind, w, dx_out, packed)]
    return cost.Pass(name, hbm_bytes=float(elements) * bytes_per_element + extra_bytes, math="cuda_core",
                     fixed_us=launches * cost.LAUNCH_US, instructions=float(elements) * counts["per_column"] / 32,
                     mufu=float(elements) * counts["mufu_per_column"] / 32)


def _token_math(w: cost.Workload, chunks: int, extra: int = 0) -> cost.Pass:
    """The loss's per-token math (GRPO clipping, DPO sigmoid, KL penalty, normalisation, dz coefficients) and
    the call's own small ops: tens of elementwise kernels on [tokens] vectors, ~1 KB per token in all. At
    N = 16384 that is 16 MB: microseconds beside the GEMM-sized products; launches, not bytes, are its cost."""
    per_chunk, per_call = small_launches(w.op)
    return cost.Pass("token math", flops=200.0 * w.n, hbm_bytes=1024.0 * w.n, math="cuda_core",
                     fixed_us=(per_chunk * chunks + per_call + extra) * cost.LAUNCH_US)


def _composable_passes(w: cost.Workload, gpu: cost.GPUSpec, s: _Shape, accumulate: bool) -> list:
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
    state = 2 * _STATE_FIELDS * 4 * n * (s.vocab_tiles - 1)
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


def _eager_passes(w: cost.Workload, gpu: cost.GPUSpec, s: _Shape, accumulate: bool) -> list:
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
    # core/eager.py's backward (scaled_gradient): one kernel per gradient reads it once and writes the scaled
    # result once in the parameter's dtype
    scale_bytes = 0
    if w.weight_grad and not s.deferred:
        scale_bytes += v * d * (2 * b if not (accumulated or w.dtype == "float32") else 4 + b)
    if w.hidden_grad:
        scale_bytes += n * d * (4 + b)
    if scale_bytes:
        passes.append(_sweep("scale and round gradients", scale_bytes, 1, 0.1, 2))
    return passes


def _products(w: cost.Workload, path: str) -> tuple[float, float]:
    grads = int(w.hidden_grad) + int(w.weight_grad)
    if path == "eager":
        return float(1 + grads), 1.0 if w.has_teacher else 0.0
    forms = 1 + (1 if grads else 0)
    return float(forms + grads), float(forms) if w.has_teacher else 0.0


def _candidate(w, gpu, budget, caps, path, accumulate) -> cost.Plan:
    shape = (_eager_shape(w, budget, caps, gpu, accumulate) if path == "eager"
             else _composable_shape(w, budget, caps))
    passes = (_eager_passes if path == "eager" else _composable_passes)(w, gpu, shape, accumulate)
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
        dx = f"{half} copy" + (", power-of-two pre-scaled per chunk" if path == "eager" and half == "fp16" else "")
    if path == "eager":
        groups = _layout_sizes(w.n, shape).groups
        d_weight = ("deferred to the backward: one product in the weight's dtype, hidden scaled by the incoming "
                    "gradient" if shape.deferred else
                    "written once in the weight's dtype" if groups == 1 and w.dtype == "bfloat16"
                    else "fp32 accumulator [V, D]")
        params = {"eager_rows": shape.rows, "chunks": shape.row_chunks, "group_rows": shape.group_rows,
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
    return cost.Plan(backend="cuda", path=path, products=products, passes=passes, params=params)


def plan(workload: cost.Workload, gpu: cost.GPUSpec, free_bytes: Optional[int] = None, *,
         path: Optional[str] = None, workspace: Optional[int] = None, accumulate_in_gemm: bool = True) -> cost.Plan:
    """How the CUDA backend runs ``workload`` on ``gpu`` (``fusedloss.core.cost``'s interface).

    ``free_bytes``: memory free for torch on the device (sizes the workspace, ``workspace_bytes``), or
    ``workspace`` the workspace itself. ``path``: "eager" or "composable" to force one (the forward and the
    backward of the composable op force "composable"); None takes the eager path for a loss known in the
    forward (``workload.row_local``) with a gradient to compute when the model says it is faster than the
    composable one, else the composable path. ``accumulate_in_gemm``: whether torch can accumulate half
    products into fp32 inside the GEMM on the device (``_capabilities``; assumed for the model).
    The same inputs always give the same plan."""
    if path not in (None, "eager", "composable"):
        raise ValueError(f"path must be None, 'eager' or 'composable', got {path!r}")
    if workload.dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"the CUDA backend plans float32, bfloat16 and float16 workloads (float64 runs on the "
                         f"torch backend), got {workload.dtype!r}")
    if workspace is not None and (isinstance(workspace, bool) or not isinstance(workspace, int) or workspace < 1):
        raise ValueError(f"workspace must be a positive int of bytes or None, got {workspace!r}")
    budget = workspace if workspace is not None else workspace_bytes(free_bytes)
    caps, accumulate = dict(_OVERRIDES.get()), bool(accumulate_in_gemm)
    can_eager = workload.row_local and (workload.hidden_grad or workload.weight_grad)
    if path == "eager" and not can_eager:
        raise ValueError(f"the eager path needs a loss known in the forward and a gradient; {workload.op!r} with "
                         f"hidden_grad={workload.hidden_grad}, weight_grad={workload.weight_grad} has none")
    if path is not None or not can_eager:
        return _candidate(workload, gpu, budget, caps, path or "composable", accumulate)
    choice = _choose_path(workload, gpu, budget, accumulate)
    chosen = _candidate(workload, gpu, budget, caps, choice.path, accumulate)
    chosen.params["reason"] = choice.reason
    if choice.model_ms is None:  # unpriced (cost.unpriced said why): the rule of _path_of_unpriced
        return chosen
    other = _candidate(workload, gpu, budget, caps, "composable" if choice.path == "eager" else "eager", accumulate)
    try:
        chosen.params["alternative"] = {"path": other.path,
                                        "model_ms": round(cost.evaluate(other, workload, gpu).model_ms, 3)}
    except Exception as exc:  # the choice stands; only its description lacks the figure
        cost.unpriced(f"the CUDA {other.path} plan of {workload}", exc)
    return chosen


class _PathChoice(NamedTuple):
    """The path a plan takes, and why: the modelled times of both paths at the decision rows (None where they
    could not be priced)."""

    path: str
    model_ms: Optional[tuple]
    reason: str


def _choose_path(w: cost.Workload, gpu: cost.GPUSpec, budget: int, accumulate: bool) -> _PathChoice:
    """The eager or the composable path for ``w``: the composable one where the eager path cannot run, else the
    one the model prices faster at the decision rows (cached per step of ``decision_rows``: the host time of a
    call whose N was seen in that step is a dictionary lookup)."""
    if not (w.row_local and (w.hidden_grad or w.weight_grad)):
        return _PathChoice("composable", None, f"{w.op} needs the composable path")
    return _path_choice(_decision_key(w), _gpu_key(gpu), budget, accumulate, _OVERRIDES.get())


@functools.lru_cache(maxsize=1024)
def _path_choice(key: tuple, gpu_key: tuple, budget: int, accumulate: bool, overrides: tuple) -> _PathChoice:
    w, gpu, caps = _decided(key), _gpu_of_key(gpu_key), dict(overrides)
    try:
        eager = _candidate(w, gpu, budget, caps, "eager", accumulate)
        composable = _candidate(w, gpu, budget, caps, "composable", accumulate)
        t_eager = cost.evaluate(eager, w, gpu).model_ms
        t_comp = cost.evaluate(composable, w, gpu).model_ms
    except Exception as exc:  # the choice is a matter of speed: either path runs correctly
        cost.unpriced(f"the CUDA plans of {w}", exc)
        return _path_of_unpriced(w, budget, caps)
    chosen, other = ("eager", "composable") if t_eager <= t_comp else ("composable", "eager")
    fast, slow = min(t_eager, t_comp), max(t_eager, t_comp)
    return _PathChoice(chosen, (t_eager, t_comp),
                       f"{chosen} is modelled faster than {other} ({fast:.3g} ms vs {slow:.3g} ms) at {w.n} rows "
                       f"(the decision rows of N) of {w.v} at this workspace")


def _path_of_unpriced(w: cost.Workload, budget: int, caps: dict) -> _PathChoice:
    """The path without the model's prices: the eager path (3 products instead of 4) where its chunks fill
    cuBLAS's 128-row output tiles (or hold every row), else the composable path."""
    rows = _with_packing(w, budget, caps, _eager_shape_as, w.dtype == "bfloat16").rows
    path = "eager" if rows >= min(w.n, ROW_ALIGN) else "composable"
    return _PathChoice(path, None, f"{path}: the cost model could not price the plans, and the eager chunks have "
                                   f"{rows} rows")


def gpu_of(device: torch.device) -> cost.GPUSpec:
    """The cost model's spec for the device's GPU (``backends.device_gpu``, the Triton backend's too: by name,
    else by architecture); the H200's for CPU tensors (host mode)."""
    return backends.device_gpu(device)


workload_of = cost.Workload.of  # the cost model's description of a problem


_free_bytes = backends.free_bytes  # fixed per device for the process (core/backends.py)


def _problem_plan(p: StatsProblem, *, row_local: bool, path: Optional[str],
                  needs: GradientNeeds = GradientNeeds(True, True, False)) -> cost.Plan:
    dev = p.hidden.device
    w = workload_of(p, row_local=row_local, hidden_grad=needs.hidden, weight_grad=needs.weight)
    return plan(w, gpu_of(dev), _free_bytes(dev), path=path, accumulate_in_gemm=_capabilities(dev).accumulate)


def _shapes(p: StatsProblem) -> tuple[_Shape, _Shape]:
    """(composable tile, eager chunk) of a problem. They depend on its shapes, dtype, teacher and the
    device's workspace only, never on which gradients a call wants: a backward recomputes exactly the tiles
    of its forward."""
    w = workload_of(p, row_local=True)
    budget, caps = workspace_bytes(_free_bytes(p.hidden.device)), dict(_OVERRIDES.get())
    return _composable_shape(w, budget, caps), _eager_chunk(p)


def _eager_chunk(p: StatsProblem, needs: GradientNeeds = GradientNeeds(True, True, False)) -> _Shape:
    """The eager shape of a problem for the gradients a call wants (the plan's, ``_candidate``)."""
    dev = p.hidden.device
    w = workload_of(p, row_local=True, hidden_grad=needs.hidden, weight_grad=needs.weight)
    budget, caps = workspace_bytes(_free_bytes(dev)), dict(_OVERRIDES.get())
    return _eager_shape(w, budget, caps, gpu_of(dev), _capabilities(dev).accumulate)


@_call_options
def eager_pays(p: StatsProblem) -> bool:
    """The plan's choice for a loss known in the forward (core/eager.py): the 3-product eager path where the
    cost model says its chunks are big enough to beat the composable path."""
    if p.acc_dtype == torch.float64:
        return torch_backend.eager_pays(p)
    if _epilogue.wanted(p):  # FUSEDLOSS_CUDA_EPILOGUE=1: the composable path on the epilogue kernels
        return False
    needs = GradientNeeds(p.hidden.requires_grad, p.weight.requires_grad, False)
    if not (needs.hidden or needs.weight):
        return False
    dev = p.hidden.device
    w = workload_of(p, row_local=True, hidden_grad=needs.hidden, weight_grad=needs.weight)
    budget = workspace_bytes(_free_bytes(dev))
    return _choose_path(w, gpu_of(dev), budget, _capabilities(dev).accumulate).path == "eager"


def eager_rows(p: StatsProblem) -> int:
    """Rows of one eager chunk of this problem."""
    return _shapes(p)[1].rows


# ------------------------------------------------------------------------------------------------
# Products: what torch can do on the device (probed once), fp32 precision, accumulation
# ------------------------------------------------------------------------------------------------
class Capabilities(NamedTuple):
    out_dtype: bool   # torch.mm(a16, b16, out_dtype=torch.float32, out=c32): half operands, fp32 output
    accumulate: bool  # torch.baddbmm(c32, a16, b16, out_dtype=torch.float32, out=c32): beta = 1 into fp32


_CAPS: dict = {}
_WARNED: set = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _device_failure(exc: BaseException) -> bool:
    """Errors a probe must never swallow: out of memory, and a broken device (not an unsupported call)."""
    accelerator = getattr(torch, "AcceleratorError", None)
    return isinstance(exc, torch.OutOfMemoryError) or (accelerator is not None and isinstance(exc, accelerator)) \
        or "CUDA error" in str(exc)


def _probe(device: torch.device) -> Capabilities:
    """One tiny product of each kind on the device, checked against its known result. Only this probe
    catches errors (an unsupported signature raises TypeError, NotImplementedError or a RuntimeError from a
    dtype check); the real products never do."""
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, dtype=torch.bfloat16)
    b = torch.tensor([[1.0, 0.5], [0.25, 2.0]], device=device, dtype=torch.bfloat16)
    want = a.float() @ b.float()

    def fp32_output():
        return torch.mm(a, b, out_dtype=torch.float32, out=torch.full((2, 2), 7.0, device=device))

    def accumulation():
        acc = torch.ones(1, 2, 2, device=device)
        torch.baddbmm(acc, a[None], b[None], out_dtype=torch.float32, out=acc)
        return acc[0] - 1.0

    supported = []
    for attempt in (fp32_output, accumulation):
        try:
            supported.append(bool(torch.equal(attempt(), want)))
        except (TypeError, NotImplementedError, RuntimeError) as exc:
            if _device_failure(exc):
                raise
            supported.append(False)
    caps = Capabilities(out_dtype=supported[0], accumulate=supported[0] and supported[1])
    if not caps.out_dtype:
        _warn_once("out_dtype", f"fusedloss CUDA backend: torch {torch.__version__} cannot multiply half-precision "
                   "operands into fp32 outputs on this device (torch.mm(..., out_dtype=torch.float32), torch >= "
                   "2.8); each product converts its operands to fp32 instead: correct, but several times slower")
    elif not caps.accumulate:
        _warn_once("accumulate", f"fusedloss CUDA backend: torch {torch.__version__} cannot accumulate half "
                   "products into an fp32 tensor inside the GEMM on this device (torch.baddbmm(..., "
                   "out_dtype=torch.float32, out=acc)); gradients are summed with a separate add (slower)")
    return caps


def _capabilities(device: torch.device) -> Capabilities:
    """Per device, probed once per process. CPU tensors (host mode): fp32 products and ``addmm_``."""
    if device.type != "cuda":
        return Capabilities(out_dtype=False, accumulate=True)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPS:
        _CAPS[index] = _probe(torch.device("cuda", index))
    return _CAPS[index]


def _fp32_precision() -> str:
    """"ieee" (default: full fp32 products whatever torch's TF32 flags say, the fp32 accuracy contract) or
    "tf32" (the explicit opt-in: the call's ``allow_tf32=True``, else ``FUSEDLOSS_ALLOW_TF32=1``,
    fusedloss/config.py)."""
    allow = _ALLOW_TF32.get()
    if allow is None:
        allow = config.from_environment().allow_tf32
    return "tf32" if allow else "ieee"




def _torch_fp32_precision() -> str:
    """What torch's matmul would use for fp32 operands now: "tf32" or "ieee"."""
    matmul = torch.backends.cuda.matmul
    value = getattr(matmul, "fp32_precision", None)  # torch >= 2.9; readable whichever API set it
    if value is None:
        return "tf32" if matmul.allow_tf32 else "ieee"
    if value == "none":
        value = getattr(torch.backends, "fp32_precision", "none")
    return "tf32" if value == "tf32" else "ieee"


@contextlib.contextmanager
def _fp32_products(device: torch.device, dtype: torch.dtype):
    """Run the block's fp32 CUDA products at ``_fp32_precision()``, restoring torch's setting after it.
    torch refuses to read its TF32 flag through one API once the other API set it, so the flag is changed
    through the API the caller used (the legacy ``allow_tf32`` when it is readable, else
    ``fp32_precision``), and only when it differs from what is wanted."""
    want = _fp32_precision()
    if device.type != "cuda" or dtype != torch.float32 or _torch_fp32_precision() == want:
        yield
        return
    matmul = torch.backends.cuda.matmul
    try:
        previous = matmul.allow_tf32  # raises when the new API set the flag
        legacy = True
    except RuntimeError:
        legacy = False
    if legacy:
        matmul.allow_tf32 = want == "tf32"
    else:
        previous = matmul.fp32_precision
        matmul.fp32_precision = want
    try:
        yield
    finally:
        if legacy:
            matmul.allow_tf32 = previous
        else:
            matmul.fp32_precision = previous


class _Products:
    """The products of one call: fp32 outputs from the operands' dtype, accumulation into fp32 inside the
    GEMM where the device's torch can, one product straight into a gradient's own dtype."""

    def __init__(self, device: torch.device):
        self.host = device.type != "cuda"
        self.caps = _capabilities(device)

    def _fp32_operands(self, a: torch.Tensor) -> bool:
        return self.host or a.dtype == torch.float32 or not self.caps.out_dtype

    def into(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``out = a @ b`` (out fp32, possibly a row-padded view)."""
        if self._fp32_operands(a):
            return torch.mm(a.float(), b.float(), out=out)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)

    def accumulate(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``acc += a @ b`` for an fp32 accumulator: beta = 1 inside the GEMM where possible."""
        if self._fp32_operands(a):
            return acc.addmm_(a.float(), b.float())
        if self.caps.accumulate:
            torch.baddbmm(acc[None], a[None], b[None], out_dtype=torch.float32, out=acc[None])
            return acc
        return acc.add_(torch.mm(a, b, out_dtype=torch.float32))

    def direct(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``out = a @ b`` in out's own dtype (the operands'), accumulated in fp32 and rounded once."""
        if self.host:
            return out.copy_(torch.mm(a.float(), b.float()))
        return torch.mm(a, b, out=out)


# ------------------------------------------------------------------------------------------------
# Launch helpers
# ------------------------------------------------------------------------------------------------
class _Exec:
    """Runs the kernels on the tensors' device: CUDA kernels on the current stream (the extension makes the
    device current for the launch and restores the caller's), or the host twins for CPU tensors."""

    def __init__(self, device: torch.device):
        if _C is None:
            raise RuntimeError(f"fusedloss CUDA backend: {availability()}")
        self.host = device.type == "cpu"
        if not self.host and device.type != "cuda":
            raise ValueError(f"the CUDA backend runs on CUDA tensors (or CPU tensors in host mode), got {device}")
        self.device = device
        self.index = 0 if self.host else (device.index if device.index is not None else torch.cuda.current_device())

    def _run(self, name: str, args) -> None:
        args.device = self.index
        if self.host:
            getattr(_C, "host_" + name)(args)
        else:
            getattr(_C, name)(args, torch.cuda.current_stream(self.device).cuda_stream)

    def fold(self, args):
        self._run("fold_tile", args)

    def jsd(self, args):
        self._run("jsd_tile", args)

    def dx(self, args):
        self._run("dx_tile", args)


def _code(t: torch.Tensor) -> int:
    try:
        return _DTYPE_CODES[t.dtype]
    except KeyError:
        raise TypeError(f"the CUDA backend handles float32, bfloat16 and float16 tensors, got {t.dtype}") from None


def _ptr(t: Optional[torch.Tensor], offset: int = 0) -> int:
    """Address of element ``offset`` of a contiguous tensor (0 for None)."""
    return 0 if t is None else t.data_ptr() + offset * t.element_size()


def _transform(tf) -> "_C.Transform":
    return _C.Transform(logit_scale=float(tf.logit_scale), softcap=float(tf.softcap or 0.0),
                        temperature=float(tf.temperature), chain=float(tf.logit_scale) / float(tf.temperature))


def _tile_args(p: StatsProblem, targets: Optional[torch.Tensor], r0: int, out: torch.Tensor) -> "_C.TileArgs":
    """The arguments shared by every tile of a call; per-tile fields are set by ``_set_tile``."""
    a = _C.TileArgs()
    a.bias = _ptr(p.bias)
    a.bias_dtype = _code(p.bias) if p.bias is not None else 0
    a.tf = _transform(p.transform)
    if p.has_teacher:
        a.teacher_bias = _ptr(p.teacher_bias)
        a.teacher_bias_dtype = _code(p.teacher_bias) if p.teacher_bias is not None else 0
        a.teacher_tf = _transform(p.teacher_transform)
        a.want_kl_rev = bool(p.want_kl_rev)
        a.want_kl_fwd = bool(p.want_kl_fwd)
        if p.jsd_beta is not None:
            beta = float(p.jsd_beta)
            a.jsd = _C.JsdConsts(beta=beta, log_1m_beta=math.log1p(-beta), log_beta=math.log(beta))
            a.has_jsd = True
    a.targets = _ptr(targets, r0)
    a.want_entropy = bool(p.want_entropy)
    a.want_mean_logit = bool(p.want_mean_logit)
    a.want_extras = bool(p.want_extras)
    a.vocab = p.weight.shape[0]
    a.out = _ptr(out, r0)
    a.out_stride = out.shape[1]
    return a


def _set_tile(a, x: torch.Tensor, xt: Optional[torch.Tensor], v0: int) -> None:
    a.x = _ptr(x)
    a.xt = _ptr(xt)
    a.dtype = _code(x)
    a.ld = x.stride(0)
    a.rows, a.cols = x.shape
    a.v0 = v0


def _contiguous_problem(p: StatsProblem) -> StatsProblem:
    targets = None if p.targets is None else p.targets.to(torch.int64).contiguous()
    columns = None if p.columns is None else p.columns.to(torch.int64).contiguous()
    bias = None if p.bias is None else p.bias.contiguous()
    tbias = None if p.teacher_bias is None else p.teacher_bias.contiguous()
    if targets is p.targets and columns is p.columns and bias is p.bias and tbias is p.teacher_bias:
        return p
    return dataclasses.replace(p, targets=targets, columns=columns, bias=bias, teacher_bias=tbias)


def _with_columns(a, p: StatsProblem, r0: int, logits: torch.Tensor) -> None:
    """The fold also writes the logits at the named columns of rows from ``r0`` into ``logits`` ([N, K] fp32)."""
    k = p.columns.shape[1]
    a.columns, a.num_columns, a.column_logits = _ptr(p.columns, r0 * k), k, _ptr(logits, r0 * k)


def _named_dx(p: StatsProblem, column_dz: torch.Tensor, coeffs: torch.Tensor, x: torch.Tensor, r0: int,
              v0: int) -> torch.Tensor:
    """``[rows, K]`` fp32 dx of the named columns of the tile ``x`` (rows from ``r0``, columns from ``v0``), from
    their given dz (core/columns.py) and the uniform term, through the chain rule at the tile's raw logits
    (read before dx overwrites them; 0 outside the tile): the value ``columns.put`` writes over the dx kernel's
    formula there, rounded once to dx's dtype."""
    rows, cols = x.shape
    named = p.columns[r0:r0 + rows]
    dz = column_dz[r0:r0 + rows].to(torch.float32)
    if p.want_mean_logit:
        dz = dz + coeffs[coef.COEF_UNIFORM, r0:r0 + rows, None]
    tf = p.transform
    chain = float(tf.logit_scale) / float(tf.temperature)  # formed in double, as the kernels' Transform.chain
    if tf.softcap is None:
        return dz * chain
    u = columns.gather(x, named, v0, torch.zeros_like(dz))
    if p.bias is not None:
        u = u + p.bias[named.clamp(min=0)].to(torch.float32)
    c = float(tf.softcap) * torch.tanh(u * float(tf.logit_scale) / float(tf.softcap))
    return dz * (chain * (1.0 - (c / float(tf.softcap)) ** 2))


def _active_rows(coeffs: torch.Tensor, targets: Optional[torch.Tensor],
                 column_dz: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[rows] bool: the rows whose gradient is not identically zero (the dx kernel's row_inactive, or a
    given dz at a named column)."""
    active = (coeffs != 0).any(dim=0)
    if column_dz is not None:
        active = active | (column_dz != 0).any(dim=1)
    return active if targets is None else active & (targets >= 0)


# fp32 elements of the scratch in which the column sums of an unrounded dx are formed (16 MiB)
_SUM_SCRATCH_ELEMENTS = 1 << 22


def _unrounded_column_sums(ex: "_Exec", p: StatsProblem, targets, r0: int, out: torch.Tensor, coeffs: torch.Tensor,
                           coeff_stride: int, x: torch.Tensor, xt: Optional[torch.Tensor], v0: int,
                           named: Optional[tuple] = None) -> torch.Tensor:
    """``[cols]`` fp32: the sums over the rows of the tile ``x`` (rows from ``r0`` of ``targets``, ``out`` and
    ``coeffs``, whose rows are ``coeff_stride`` apart) of dx as the kernel forms it, never of its half-precision
    rounding: d bias (problem.py). The dx kernel runs again into an fp32 scratch, a slice of rows at a time,
    while the tile still holds the logits; ``named``: (columns, fp32 dx) of the named columns, written over it
    first."""
    rows, cols = x.shape
    step = max(1, min(rows, _SUM_SCRATCH_ELEMENTS // max(1, cols)))
    scratch = torch.empty((step, cols), device=x.device, dtype=torch.float32)
    total = torch.zeros(cols, device=x.device, dtype=torch.float32)
    for s0 in range(0, rows, step):
        s1 = min(rows, s0 + step)
        a = _tile_args(p, targets, r0 + s0, out)
        a.coeffs, a.coeff_stride = _ptr(coeffs, r0 + s0), coeff_stride
        _set_tile(a, x[s0:s1], None if xt is None else xt[s0:s1], v0)
        dx = _dx_into(ex, a, scratch[: s1 - s0])
        if named is not None:
            columns.put(dx, named[0][s0:s1], named[1][s0:s1], v0)
        total += dx.sum(0)
    return total


def _zero_rows_outside(h: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """hidden with the rows outside the loss set to 0: their dx is 0, but 0 * NaN is not, and NaN padding
    rows (fully masked attention) must stay out of d weight. No host synchronisation."""
    return torch.where(active[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))


# One workspace buffer per (device, stream), kept for the process and grown when a call needs more: every call
# on a stream runs its kernels in stream order, so consecutive calls can share it, and the caching allocator is
# not asked for gigabytes on every call (a fragmented pool would then free and allocate, synchronising).
# Not kept: buffers of a CUDA graph capture (they belong to the graph's pool) and host-mode (CPU) buffers.
# ``release_workspace`` drops them (``fusedloss.release_workspace()``).
_BUFFERS: dict = {}


def release_workspace(device=None) -> int:
    """Drop the workspace buffers this backend keeps per (device, stream) (all devices, or only ``device``'s),
    returning them to torch's caching allocator; ``torch.cuda.empty_cache()`` then returns them to the driver.
    The next call on a stream allocates its buffer again. Safe at any time: a call still running holds its own
    reference, and the allocator reuses the memory in stream order. Returns the bytes released."""
    index = None
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return 0  # nothing is kept for other devices
        index = device.index if device.index is not None else (
            torch.cuda.current_device() if torch.cuda.is_available() else 0)
    released = 0
    for key in list(_BUFFERS):
        if index is None or key[0] == index:
            buf = _BUFFERS.pop(key, None)
            released += 0 if buf is None else buf.numel() * buf.element_size()
    return released


def _workspace_buffer(device: torch.device, nbytes: int) -> torch.Tensor:
    """A uint8 buffer of at least ``nbytes`` on ``device``, the stream's persistent one where it can be."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.empty(nbytes, device=device, dtype=torch.uint8)
    key = (device.index if device.index is not None else torch.cuda.current_device(),
           torch.cuda.current_stream(device).cuda_stream)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < nbytes:
        _BUFFERS.pop(key, None)
        buf = _BUFFERS[key] = torch.empty(nbytes, device=device, dtype=torch.uint8)
    return buf


class _Workspace:
    """The tiles of one call (student logits, teacher logits, dx copy) with padded rows, carved out of the
    stream's persistent buffer (``_workspace_buffer``). ``packed``: a half-precision dx goes over the student
    tile (``dx_of``; docs/design.md, "The logits workspace"), so there is no copy. ``dx_rows``: the copy's
    rows when it holds a group of chunks (``dx_at``); ``dx_kept``: that copy is allocated apart, for a dx
    the call keeps (deferred d weight)."""

    def __init__(self, rows: int, ld: int, p: StatsProblem, dx_copy: bool, packed: bool = False,
                 dx_rows: Optional[int] = None, dx_kept: bool = False):
        dev = p.hidden.device
        self.ld = ld
        self.packed = packed
        dx_copy = dx_copy and not packed and not dx_kept
        tile = rows * ld
        # the copy holds dx_rows rows: a group of chunks (eager grouped shape), else one tile's
        dx_bytes = (dx_rows or rows) * ld * p.hidden.element_size() if dx_copy else 0
        nbytes = tile * 4 * (2 if p.has_teacher else 1) + dx_bytes
        buf = _workspace_buffer(dev, nbytes)
        self.x = buf[: tile * 4].view(torch.float32)
        self.xt = buf[tile * 4: tile * 8].view(torch.float32) if p.has_teacher else None
        start = tile * 4 * (2 if p.has_teacher else 1)
        self.dx = buf[start: start + dx_bytes].view(p.hidden.dtype) if dx_copy else None
        if dx_kept:  # a dx the call keeps after it returns: its own allocation, not the shared buffer
            self.dx = torch.empty((dx_rows or rows) * ld, device=dev, dtype=p.hidden.dtype)

    def view(self, buf: Optional[torch.Tensor], rows: int, cols: int) -> Optional[torch.Tensor]:
        return None if buf is None else buf[: rows * self.ld].view(rows, self.ld)[:, :cols]

    def dx_at(self, row: int, rows: int, cols: int) -> torch.Tensor:
        """Rows ``[row, row + rows)`` of the dx copy: a chunk's place in its group's region."""
        return self.dx[row * self.ld: (row + rows) * self.ld].view(rows, self.ld)[:, :cols]

    def dx_of(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Where dx_tile writes the gradient of the tile ``x`` (a view of the student tile): ``x`` itself for
        fp32; packed, the student tile's memory as ``dtype`` elements [rows, 2 ld] (row r's dx where its fp32
        logits were, read by the products with leading dimension 2 ld); else the copy."""
        rows, cols = x.shape
        if dtype == torch.float32:
            return x
        if self.packed:
            return self.x.view(dtype)[: rows * 2 * self.ld].view(rows, 2 * self.ld)[:, :cols]
        return self.view(self.dx, rows, cols)

    def logits(self, products: _Products, p: StatsProblem, rows: slice, v0: int, v1: int):
        n = rows.stop - rows.start
        x = products.into(self.view(self.x, n, v1 - v0), p.hidden[rows], p.weight[v0:v1].T)
        xt = None
        if p.has_teacher:
            xt = products.into(self.view(self.xt, n, v1 - v0), p.teacher_hidden[rows], p.teacher_weight[v0:v1].T)
        return x, xt


def _dx_into(ex: _Exec, a, dx: torch.Tensor) -> torch.Tensor:
    """Runs dx_tile on the tile in ``a``, writing ``dx`` (the tile itself, a half copy, or packed over the tile:
    ``_Workspace.dx_of``). Nothing reads the tile's logits after it: fold and JSD ran before."""
    a.dx, a.dx_dtype, a.dx_ld = _ptr(dx), _code(dx), dx.stride(0)
    ex.dx(a)
    return dx


# ------------------------------------------------------------------------------------------------
# Forward: the composable op's statistics (1 product; 2 for the JSD over several tiles)
# ------------------------------------------------------------------------------------------------
@_call_options
def forward_statistics(p: StatsProblem):
    """The problem's ``Statistics``; with named columns, ``(Statistics, [N, K] logits at them)``, which the fold
    reads from the tiles it folds (core/columns.py)."""
    if p.acc_dtype == torch.float64:
        return torch_backend.forward_statistics(p)
    p = _contiguous_problem(p)
    if _epilogue.wanted(p):  # FUSEDLOSS_CUDA_EPILOGUE=1: the sm_90 epilogue kernels (cuda/epilogue.py)
        return _epilogue.forward_statistics(p)
    ex = _Exec(p.hidden.device)
    n, v = p.hidden.shape[0], p.weight.shape[0]
    dev = p.hidden.device
    out = torch.empty((_NUM_OUTPUTS, n), device=dev, dtype=torch.float32)
    named = None if p.columns is None else torch.zeros(p.columns.shape, device=dev, dtype=torch.float32)

    def result():
        stats = Statistics(*out.unbind(0))
        return stats if named is None else (stats, named)

    if n == 0:
        return result()
    shape = _shapes(p)[0]
    products = _Products(dev)
    ws = _Workspace(shape.rows, shape.ld, p, dx_copy=False)
    multi = shape.vocab_tiles > 1
    state = torch.empty((_STATE_FIELDS, shape.rows), device=dev, dtype=torch.float32) if multi else None
    jsd_acc = torch.empty((2, shape.rows), device=dev, dtype=torch.float32) if multi else None
    one_tile = shape.row_chunks == 1 and not multi

    def sweep(launch, attach, reuse=False):
        """One pass over all (row chunk, vocabulary tile) pairs: the fold, then (JSD) the mixture pass."""
        for r0 in range(0, n, shape.rows):
            rows = slice(r0, min(n, r0 + shape.rows))
            a = _tile_args(p, p.targets, r0, out)
            attach(a, r0)
            for v0 in range(0, v, shape.cols):
                v1 = min(v, v0 + shape.cols)
                if reuse:  # the one tile is still in the workspace
                    x, xt = ws.view(ws.x, n, v), ws.view(ws.xt, n, v)
                else:
                    x, xt = ws.logits(products, p, rows, v0, v1)
                _set_tile(a, x, xt, v0)
                a.first, a.last = v0 == 0, v1 == v
                launch(a)

    def with_state(a, r0):
        a.state, a.state_stride = _ptr(state), shape.rows
        if named is not None:
            _with_columns(a, p, r0, named)

    def with_jsd_acc(a, r0):
        a.jsd_acc, a.jsd_acc_stride = _ptr(jsd_acc), shape.rows

    with _fp32_products(dev, p.hidden.dtype):
        sweep(ex.fold, with_state)
        if p.jsd_beta is not None and p.has_teacher:
            sweep(ex.jsd, with_jsd_acc, reuse=one_tile)
    return result()


_LSE_ROWS = tuple(Statistics._fields.index(k) for k in ("lse", "lse_lo", "lse_t", "lse_t_lo"))


@_call_options
def jsd_sums(p: StatsProblem, lse: tuple, lse_t: tuple) -> tuple:
    """``(KL(q || m), KL(p || m))`` summed over this problem's columns, ``[N]`` each (fp32), q and p normalised
    by the given (hi, lo) pairs: the generalized JSD's second sweep (the forward's jsd pass, host twins included)
    with normalisers from elsewhere, as a vocabulary-parallel head needs them (core/backends.py, ``JsdBackend``;
    docs/design.md, "Distributed"). The pass keeps its two sums in its accumulators (no tile is the last),
    which are the answer; ignored rows give 0."""
    if p.acc_dtype == torch.float64:
        return torch_backend.jsd_sums(p, lse, lse_t)
    p = _contiguous_problem(p)
    n, v = p.hidden.shape[0], p.weight.shape[0]
    dev = p.hidden.device
    sums = torch.zeros((2, n), device=dev, dtype=torch.float32)
    if n == 0 or v == 0:
        return sums[0], sums[1]
    ex = _Exec(dev)
    out = torch.zeros((_NUM_OUTPUTS, n), device=dev, dtype=torch.float32)
    for row, value in zip(_LSE_ROWS, (*lse, *lse_t)):
        out[row].copy_(value)
    shape = _shapes(p)[0]
    products = _Products(dev)
    ws = _Workspace(shape.rows, shape.ld, p, dx_copy=False)
    with _fp32_products(dev, p.hidden.dtype):
        for r0 in range(0, n, shape.rows):
            rows = slice(r0, min(n, r0 + shape.rows))
            a = _tile_args(p, p.targets, r0, out)
            a.jsd_acc, a.jsd_acc_stride = _ptr(sums, r0), n
            for v0 in range(0, v, shape.cols):
                v1 = min(v, v0 + shape.cols)
                _set_tile(a, *ws.logits(products, p, rows, v0, v1), v0)
                a.first, a.last = v0 == 0, False
                ex.jsd(a)
    return sums[0], sums[1]


# ------------------------------------------------------------------------------------------------
# Backward (recompute): 3 products over exactly the forward's tiles
# ------------------------------------------------------------------------------------------------
@_call_options
def backward_gradients(p: StatsProblem, saved: Statistics, coeffs: torch.Tensor, needs: GradientNeeds, *,
                       column_dz: Optional[torch.Tensor] = None):
    """(d hidden, d weight, d bias) in the dtypes of their tensors, each None when not needed; ``column_dz``:
    the given dz of the named columns (``[N, K]``, core/columns.py), written over the dx kernel's formula there
    in fp32 before dx is rounded (``_named_dx``).

    Every row block of the forward is recomputed with the same GEMM shapes (rows outside the loss are not
    skipped: their dx is written as zeros), so the recomputed logits equal the forward's bit for bit and a
    row's gradient does not depend on which other rows carry gradient. Vocabulary tiles outside, row chunks
    inside: d weight of a tile is summed in fp32 over the row chunks (or written once when one chunk holds
    every row); d hidden is summed in fp32 over the vocabulary tiles (or written once for one tile)."""
    if p.acc_dtype == torch.float64:
        return torch_backend.backward_gradients(p, saved, coeffs, needs, column_dz=column_dz)
    p = _contiguous_problem(p)
    if column_dz is None:  # no given dz: the formula at every column
        p = dataclasses.replace(p, columns=None)
    if _epilogue.wanted(p):  # FUSEDLOSS_CUDA_EPILOGUE=1: the sm_90 epilogue kernels (cuda/epilogue.py)
        return _epilogue.backward_gradients(p, saved, coeffs, needs, column_dz=column_dz)
    ex = _Exec(p.hidden.device)
    h_all, w = p.hidden, p.weight
    n, v = h_all.shape[0], w.shape[0]
    dev = h_all.device
    if n == 0 or not (needs.hidden or needs.weight or needs.bias):
        return (torch.zeros_like(h_all) if needs.hidden else None, torch.zeros_like(w) if needs.weight else None,
                torch.zeros_like(p.bias) if needs.bias else None)
    shape = _shapes(p)[0]
    products = _Products(dev)
    coeffs = coeffs.to(torch.float32).contiguous()
    stats = torch.stack(tuple(saved)).to(torch.float32).contiguous()
    h_dw = _zero_rows_outside(h_all, _active_rows(coeffs, p.targets, column_dz)) if needs.weight else None
    half = h_all.dtype != torch.float32
    one_vocab_tile = shape.vocab_tiles == 1
    # d hidden: fp32 over the vocabulary tiles (the hidden's own buffer when it is fp32), or direct
    dh = dh_acc = None
    if needs.hidden:
        dh = torch.empty_like(h_all)
        dh_acc = dh if (h_all.dtype == torch.float32 or one_vocab_tile) else torch.empty(h_all.shape, device=dev,
                                                                                           dtype=torch.float32)
    dw = torch.empty_like(w) if needs.weight else None
    db = torch.empty_like(p.bias) if needs.bias else None
    dw_tile = None
    if needs.weight and shape.row_chunks > 1 and w.dtype != torch.float32:
        dw_tile = torch.empty((shape.cols, w.shape[1]), device=dev, dtype=torch.float32)
    db_tile = torch.empty(shape.cols, device=dev, dtype=torch.float32) if needs.bias else None

    ws = _Workspace(shape.rows, shape.ld, p, dx_copy=h_all.dtype != torch.float32, packed=shape.packed)
    with _fp32_products(dev, h_all.dtype):
        for v0 in range(0, v, shape.cols):
            v1 = min(v, v0 + shape.cols)
            cols = v1 - v0
            dw_acc = None
            if needs.weight:
                dw_acc = dw[v0:v1] if (dw_tile is None) else dw_tile[:cols]
            for r0 in range(0, n, shape.rows):
                rows = slice(r0, min(n, r0 + shape.rows))
                x, xt = ws.logits(products, p, rows, v0, v1)
                named = None
                if p.columns is not None:  # read from the logits before dx is written over them
                    named = (p.columns[rows], _named_dx(p, column_dz, coeffs, x, r0, v0))
                part = None
                if db_tile is not None and half:
                    part = _unrounded_column_sums(ex, p, p.targets, r0, stats, coeffs, n, x, xt, v0, named)
                a = _tile_args(p, p.targets, r0, stats)
                a.coeffs, a.coeff_stride = _ptr(coeffs, r0), n
                _set_tile(a, x, xt, v0)
                dx = _dx_into(ex, a, ws.dx_of(x, h_all.dtype))
                if named is not None:
                    columns.put(dx, *named, v0)
                if dh is not None:
                    if one_vocab_tile:
                        (products.into if dh_acc.dtype == torch.float32 else products.direct)(dh[rows], dx, w)
                    elif v0 == 0:
                        products.into(dh_acc[rows], dx, w[v0:v1])
                    else:
                        products.accumulate(dh_acc[rows], dx, w[v0:v1])
                if dw_acc is not None:
                    if shape.row_chunks == 1:
                        (products.into if w.dtype == torch.float32 else products.direct)(dw_acc, dx.T, h_dw[rows])
                    elif r0 == 0:
                        products.into(dw_acc, dx.T, h_dw[rows])
                    else:
                        products.accumulate(dw_acc, dx.T, h_dw[rows])
                if db_tile is not None:
                    if part is None:  # an fp32 dx: summed as it is
                        part = dx.sum(0, dtype=torch.float32)
                    if r0 == 0:
                        db_tile[:cols].copy_(part)
                    else:
                        db_tile[:cols].add_(part)
            if dw_tile is not None:
                dw[v0:v1].copy_(dw_acc)
            if db is not None:
                db[v0:v1].copy_(db_tile[:cols])
    if dh is not None and dh_acc is not dh:
        dh.copy_(dh_acc)
    return dh, dw, db


# ------------------------------------------------------------------------------------------------
# Eager: 3 products, no recompute (core/eager.py)
# ------------------------------------------------------------------------------------------------
def _scaled_half_dx(x: torch.Tensor, dx16: torch.Tensor) -> torch.Tensor:
    """fp16 dx from the fp32 dx in ``x``, scaled by 2^k so that its largest magnitude lands in [2^14, 2^15]:
    rounding to fp16 then keeps the small gradients of a long mean that would flush to zero (the loss scale
    of a GradScaler is applied only after the eager path). Returns 2^-k (a device scalar), by which the fp32
    products are divided again, exactly. On the device: no host synchronisation."""
    amax = torch.linalg.vector_norm(x, float("inf"))
    k = torch.floor(torch.log2(2.0**15 / amax))
    k = torch.where(torch.isfinite(k), k, torch.zeros_like(k)).clamp(-64.0, 64.0)  # all-zero dx: no scale
    torch.mul(x, torch.exp2(k), out=dx16)
    return torch.exp2(-k)


@_call_options
def eager_gradients(p: StatsProblem, chunk_fn, needs: GradientNeeds):
    """Losses known in the forward (core/eager.py). ``chunk_fn(stats, slice(r0, r1)) -> (loss, coeffs
    [7, r1 - r0])``. For each chunk of rows the full ``[rows, V]`` logits are formed in the workspace,
    folded into the chunk's statistics and turned into dx with the loss's coefficients; the gradient products
    follow each chunk, or each group of chunks whose dx the workspace keeps together (``_grouped_shapes``).
    Returns the summed loss and the gradients: d hidden and d bias in fp32; d weight in fp32, except for a
    bf16 weight whose rows all fit one chunk or group, returned in bf16 (each entry rounded once from its
    fp32 product)."""
    if p.acc_dtype == torch.float64:
        return torch_backend.eager_gradients(p, chunk_fn, needs)
    p = _contiguous_problem(p)
    ex = _Exec(p.hidden.device)
    h_all, w = p.hidden, p.weight
    n, v = h_all.shape[0], w.shape[0]
    dev = h_all.device
    chunk = _eager_chunk(p, needs)
    step, grouped = chunk.rows, chunk.group_rows > 0
    layout = _eager_layout(n, chunk)
    products = _Products(dev)
    half16 = h_all.dtype == torch.float16
    dh = torch.empty(h_all.shape, device=dev, dtype=torch.float32) if needs.hidden else None
    db = torch.zeros(v, device=dev, dtype=torch.float32) if needs.bias else None
    dw = None
    deferred = chunk.deferred and needs.weight
    direct_dw = len(layout) == 1 and w.dtype == torch.bfloat16
    if needs.weight and not deferred:
        # written whole by the first group's product; zeros when there is no chunk (no rows)
        dw = (torch.zeros if n == 0 else torch.empty)(w.shape, device=dev,
                                                      dtype=w.dtype if direct_dw else torch.float32)
    loss = torch.zeros((), device=dev, dtype=torch.float32)
    ws = _Workspace(step, chunk.ld, p, dx_copy=h_all.dtype != torch.float32 or grouped, packed=chunk.packed,
                    dx_rows=chunk.group_rows or None, dx_kept=deferred)
    out_chunk = torch.empty((_NUM_OUTPUTS, step), device=dev, dtype=torch.float32)
    dw_scale = None  # fp16: the power of two d weight's accumulator currently carries
    with _fp32_products(dev, h_all.dtype):
        for g0, g1, chunks in layout:
            active = []  # per chunk: the rows whose gradient is not identically zero
            for r0, r1 in chunks:
                m = r1 - r0
                out = out_chunk if m == step else out_chunk[:, :m].contiguous()
                x, xt = ws.logits(products, p, slice(r0, r1), 0, v)
                tgt = None if p.targets is None else p.targets[r0:r1]
                a = _tile_args(p, tgt, 0, out)
                _set_tile(a, x, xt, 0)
                ex.fold(a)
                if p.jsd_beta is not None and p.has_teacher:
                    ex.jsd(a)
                chunk_loss, coeffs = chunk_fn(Statistics(*out.unbind(0)), slice(r0, r1))
                loss = loss + chunk_loss.to(torch.float32)
                if coeffs.shape != (NUM_COEFFS, m):
                    raise ValueError(f"chunk_fn must return coefficients of shape [{NUM_COEFFS}, {m}], "
                                     f"got {tuple(coeffs.shape)}")
                coeffs = coeffs.to(torch.float32).contiguous()
                a.coeffs, a.coeff_stride = _ptr(coeffs), m
                unscale = None
                part = None  # d bias of the chunk, from dx as formed (problem.py)
                if db is not None and h_all.dtype == torch.bfloat16:
                    part = _unrounded_column_sums(ex, p, tgt, 0, out, coeffs, m, x, xt, 0)
                if grouped:
                    dx = _dx_into(ex, a, ws.dx_at(r0 - g0, m, v))
                elif half16:
                    _dx_into(ex, a, x)  # fp32 in place first: the scale comes from its largest entry
                    if db is not None:
                        part = x.sum(0)
                    dx = ws.view(ws.dx, m, v)
                    unscale = _scaled_half_dx(x, dx)
                else:
                    dx = _dx_into(ex, a, ws.dx_of(x, h_all.dtype))
                if db is not None:
                    db.add_(dx.sum(0, dtype=torch.float32) if part is None else part)
                if needs.weight:
                    active.append(_active_rows(coeffs, tgt))
            # the group's products (one chunk's without groups: its dx is where the chunk left it)
            rows = slice(g0, g1)
            if grouped:
                dx = ws.dx_at(0, g1 - g0, v)
            if dh is not None:
                products.into(dh[rows], dx, w)
                if unscale is not None:
                    dh[rows].mul_(unscale)
            if deferred:  # one group: every row's dx
                dw = DeferredProduct(dx, h_all, active[0] if len(active) == 1 else torch.cat(active),
                                     _deferred_product)
            elif dw is not None:
                h = _zero_rows_outside(h_all[rows], active[0] if len(active) == 1 else torch.cat(active))
                if direct_dw:
                    products.direct(dw, dx.T, h)
                elif g0 == 0:
                    products.into(dw, dx.T, h)
                else:
                    if unscale is not None:  # bring the accumulator to this chunk's scale (powers of two: exact)
                        dw.mul_(dw_scale / unscale)
                    products.accumulate(dw, dx.T, h)
                dw_scale = unscale
    if dw is not None and dw_scale is not None:
        dw.mul_(dw_scale)
    return loss, (dh, dw, db)


def _deferred_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in ``b``'s dtype, rounded once from fp32 (a deferred d weight: ``DeferredProduct``)."""
    out = torch.empty((a.shape[0], b.shape[1]), device=b.device, dtype=b.dtype)
    with _fp32_products(b.device, b.dtype):
        return _Products(b.device).direct(out, a, b)
