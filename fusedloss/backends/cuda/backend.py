"""CUDA backend of the statistics core (``core/problem.py``'s protocol): cuBLAS products, CUDA kernels
(``csrc/``, built into ``fusedloss._C``) for everything between them. See docs/design.md, "Backends and
their plans". The plan of a call (tiles, chunks, the path) is ``plan.py``; the GPU glue shared with
the Triton backend (the products, the workspace policy) is ``backends/gpu.py``.

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
                    rows and the fp16 grad-in-forward path; that dx feeds the two gradient products. Rows outside the
                    loss get exact zeros. d bias sums dx as formed, never its half copy: a bf16/fp16 tile's dx
                    is formed once more into an fp32 scratch for it (``_unrounded_column_sums``). Named columns
                    (core/columns.py): the fold writes their logits, and their given dz is written over dx in
                    fp32 (``_named_dx``, ``columns.put``) before the products read it.

Numerics
    fp32 products run in full fp32 whatever torch's TF32 settings are (``FUSEDLOSS_ALLOW_TF32=1``
    opts in to TF32 for this backend's products). fp16 grad-in-forward chunks scale dx by a power of two before
    rounding it (the loss scale of a GradScaler is not known yet when the grad-in-forward path forms dx) and divide
    the fp32 products by it again, exactly. No host synchronisation in steady state: the path and every
    shape are decided on the host from shapes alone, so a training step can be captured in a CUDA graph.

Host mode (tests without a GPU)
    When the extension is built, every entry point also accepts CPU tensors: the products run in fp32 on
    the CPU and the kernels' host twins (``_C.host_*``, the same ``__host__ __device__`` math of
    ``csrc/fusedloss/*.h``) do the rest. ``override_plan`` shrinks tiles and chunks for the tests.

Float64 problems are delegated to the torch backend (the tile kernels compute in fp32).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Optional

import torch

from ...core import columns
from ...core import problem as coef  # coef.COEF_*: the dz formula's coefficient rows (docs/design.md)
from ...core.problem import NUM_COEFFS, DeferredProduct, GradientNeeds, Statistics, StatsProblem
from .. import gpu
from .. import torch as torch_backend
from . import epilogue as _epilogue
from .plan import (  # noqa: F401 - the plan's public names are the backend's too (override_plan, grad_in_forward_pays, ...)
    _call_options,
    _fp32_precision,
    _grad_in_forward_chunk,
    _grad_in_forward_layout,
    _shapes,
    decision_rows,
    gpu_of,
    grad_in_forward_pays,
    grad_in_forward_rows,
    override_plan,
    plan,
    workload_of,
    workspace_bytes,
)

_NUM_OUTPUTS = len(Statistics._fields)
# A copy of the handle, which tests replace to stand in for an extension of another build.
from .extension import _C, _IMPORT_ERROR, STATE_FIELDS  # noqa: E402

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
        _build_info = importlib.import_module("fusedloss._build_info")
    except ImportError:
        return ("not built: fusedloss._C is missing (install the package with pip so that setup.py builds "
                "the CUDA extension)")
    return _build_info.CUDA_EXTENSION


def auto_skip_reason() -> Optional[str]:
    """Why ``backend="auto"`` cannot give CUDA tensors this backend when the driver or the build is to blame
    (the availability sentence, with its fix), for the warning ``core/registry.py`` gives once; None when the
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


def _fp32_products(device: torch.device, dtype: torch.dtype):
    """The block's fp32 products at the call's precision (``_fp32_precision``: full fp32 unless opted in)."""
    return gpu.fp32_products(device, dtype, _fp32_precision())


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
        # the copy holds dx_rows rows: a group of chunks (grad-in-forward grouped shape), else one tile's
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

    def logits(self, products: gpu.Products, p: StatsProblem, rows: slice, v0: int, v1: int):
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
    if _epilogue.wanted(p):  # FUSEDLOSS_CUDA_EPILOGUE=1: the sm_90 epilogue kernels (backends/cuda/epilogue.py)
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
    products = gpu.Products(dev)
    ws = _Workspace(shape.rows, shape.ld, p, dx_copy=False)
    multi = shape.vocab_tiles > 1
    state = torch.empty((STATE_FIELDS, shape.rows), device=dev, dtype=torch.float32) if multi else None
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
    with normalisers from elsewhere, as a vocabulary-parallel head needs them (core/registry.py, ``JsdBackend``;
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
    products = gpu.Products(dev)
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
    if _epilogue.wanted(p):  # FUSEDLOSS_CUDA_EPILOGUE=1: the sm_90 epilogue kernels (backends/cuda/epilogue.py)
        return _epilogue.backward_gradients(p, saved, coeffs, needs, column_dz=column_dz)
    ex = _Exec(p.hidden.device)
    h_all, w = p.hidden, p.weight
    n, v = h_all.shape[0], w.shape[0]
    dev = h_all.device
    if n == 0 or not (needs.hidden or needs.weight or needs.bias):
        return (torch.zeros_like(h_all) if needs.hidden else None, torch.zeros_like(w) if needs.weight else None,
                torch.zeros_like(p.bias) if needs.bias else None)
    shape = _shapes(p)[0]
    products = gpu.Products(dev)
    coeffs = coeffs.to(torch.float32).contiguous()
    stats = torch.stack(tuple(saved)).to(torch.float32).contiguous()
    h_dw = gpu.zero_rows_outside(h_all, gpu.active_rows(coeffs, p.targets, column_dz)) if needs.weight else None
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
# Grad-in-forward: 3 products, no recompute (core/grad_in_forward.py)
# ------------------------------------------------------------------------------------------------
def _scaled_half_dx(x: torch.Tensor, dx16: torch.Tensor) -> torch.Tensor:
    """fp16 dx from the fp32 dx in ``x``, scaled by 2^k so that its largest magnitude lands in [2^14, 2^15]:
    rounding to fp16 then keeps the small gradients of a long mean that would flush to zero (the loss scale
    of a GradScaler is applied only after the grad-in-forward path). Returns 2^-k (a device scalar), by which the fp32
    products are divided again, exactly. On the device: no host synchronisation."""
    amax = torch.linalg.vector_norm(x, float("inf"))
    k = torch.floor(torch.log2(2.0**15 / amax))
    k = torch.where(torch.isfinite(k), k, torch.zeros_like(k)).clamp(-64.0, 64.0)  # all-zero dx: no scale
    torch.mul(x, torch.exp2(k), out=dx16)
    return torch.exp2(-k)


@_call_options
def grad_in_forward_gradients(p: StatsProblem, chunk_fn, needs: GradientNeeds):
    """Losses known in the forward (core/grad_in_forward.py). ``chunk_fn(stats, slice(r0, r1)) -> (loss, coeffs
    [7, r1 - r0])``. For each chunk of rows the full ``[rows, V]`` logits are formed in the workspace,
    folded into the chunk's statistics and turned into dx with the loss's coefficients; the gradient products
    follow each chunk, or each group of chunks whose dx the workspace keeps together (``_grouped_shapes``).
    Returns the summed loss and the gradients: d hidden and d bias in fp32; d weight in fp32, except for a
    bf16 weight whose rows all fit one chunk or group, returned in bf16 (each entry rounded once from its
    fp32 product)."""
    if p.acc_dtype == torch.float64:
        return torch_backend.grad_in_forward_gradients(p, chunk_fn, needs)
    p = _contiguous_problem(p)
    ex = _Exec(p.hidden.device)
    h_all, w = p.hidden, p.weight
    n, v = h_all.shape[0], w.shape[0]
    dev = h_all.device
    chunk = _grad_in_forward_chunk(p, needs)
    step, grouped = chunk.rows, chunk.group_rows > 0
    layout = _grad_in_forward_layout(n, chunk)
    products = gpu.Products(dev)
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
                    active.append(gpu.active_rows(coeffs, tgt))
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
                h = gpu.zero_rows_outside(h_all[rows], active[0] if len(active) == 1 else torch.cat(active))
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
        return gpu.Products(b.device).direct(out, a, b)
