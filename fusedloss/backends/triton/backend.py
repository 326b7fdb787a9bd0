"""Triton backend of the statistics core (the ``Backend`` protocol of ``core/registry.py``).

Forward (``statistics_forward``; ``jsd_forward`` for the JSD mixture)
    A grouped 1-D grid of (row block, vocabulary split) programs. Each program forms ``[BLOCK_M, BLOCK_V]``
    logits tiles with ``tl.dot`` (fp32 accumulation, K-loop over D), applies bias, logit_scale, soft-cap and
    temperature, folds the tile into online statistics and drops it. The splits are chosen so that the
    programs fill whole waves of the GPU (``forward_grid``), and their partial statistics are merged exactly
    by ``core/partials.py``. One GEMM-sized product (plus one for the JSD's second pass; a teacher adds its
    own products of size N x V x D_t).

Backward (``logits_gradient`` + cuBLAS)
    For each vocabulary chunk, the Triton kernel forms the logits tile again, bit for bit as the forward did,
    and writes dx into a bounded workspace (in the input dtype for bf16/fp16, the naive path's rounding;
    fp32 / float64 otherwise); two cuBLAS products accumulate ``d hidden += dx @ W[chunk]`` and
    ``d weight[chunk] = dx.T @ h`` in fp32 (float64), ``d bias`` is the column sum of dx as formed (a half dx's
    sums are stored by the kernel before the cast, per row block, and added here in a fixed order). Three
    GEMM-sized products, no atomics: the same bits from run to run. A frozen weight skips the d weight product.
    Named columns (core/columns.py): the forward kernel stores the logits at them as it folds them, the
    gradient kernel writes their given dz into its fp32 tile before the cast.

Grad-in-forward path (``grad_in_forward_gradients``, ``core/grad_in_forward.py``), for losses known in the forward
    For each chunk of rows, the forward kernel keeps the capped logits in the workspace while it forms the
    statistics; a teacher's raw logits come from one cuBLAS product into the workspace beside them, and the
    teacher fold (``teacher_fold``) forms its statistics from both kept tiles once the student's are final
    (docs/design.md, "The Triton teacher on the grad-in-forward path"); the loss gives the chunk's coefficients; the
    gradient kernel reads the tiles back instead of forming them again; cuBLAS does d hidden and d weight.
    Three products instead of four. ``plan`` (``plan.py``, by the rules of ``backends/rules.py``) chooses the path
    and sizes the chunks.

Precision
    fp32 inputs multiply with ``tf32x3`` on the GPU (three TF32 products, about fp32's accuracy, on the
    tensor cores) whatever PyTorch's global TF32 flags say, and the cuBLAS products of an fp32 problem run
    with TF32 off; the problem's ``allow_tf32`` (``FUSEDLOSS_ALLOW_TF32=1`` when the call leaves it unset)
    opts in to plain TF32 for both, and ``FUSEDLOSS_TRITON_FP32_PRECISION`` overrides the Triton choice for
    experiments (``fp32_precision``).
    float64 inputs accumulate in float64. Confident rows keep their digits as in the CUDA kernels: the
    forward carries t = s - 1 and takes log s = log1p(t), the target column's gradient is
    -a expm1(log q_y) + q_y inner_y, the reverse KL's is formed relative to the student's maximum column
    (docs/design.md, "The dz formula" and "Numerical doctrine").

The plan of a call (tiles, grids, chunks, the workspace and the path; its memory) is ``plan.py``; the products
and the workspace policy it shares with the CUDA backend are ``backends/gpu.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from functools import lru_cache
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from ... import config
from ...core import partials
from ...core.problem import GradientNeeds, Statistics, StatsProblem
from .. import gpu
from .interpreter_compat import numpy_compat as _interpreter_numpy_compat
from .plan import (  # noqa: F401 - the plan's public names are the backend's too (plan, tiles, workspace)
    _DTYPE_NAMES,
    ARCH_ELEMENTWISE_TILES,
    ELEMENTWISE_TILES,
    GRADIENT_GROUP,
    INTERPRETER_TILES,
    TEACHER_FOLD_TILES,
    TileConfig,
    _allow_tf32,
    _cdiv,
    _grad_in_forward_row_align,
    backward_chunks,
    candidates,
    d_bucket,
    deterministic,
    device_target,
    elementwise_grid,
    epilogue,
    fp32_precision,
    gpu_of,
    grad_in_forward_rows,
    grid_of,
    plan,
    tile_family,
    workload_of,
    workspace_budget,
)

_INTERPRET_HINT = ("no CUDA device visible; set TRITON_INTERPRET=1 to run the Triton kernels on the CPU "
                   "interpreter (slow)")


def _interpret_requested() -> bool:
    return config.interpreting_triton()


# The Triton releases the kernels are compiled and tested with (pyproject.toml's ``triton`` extra; the CI's
# compile check and compatibility jobs run the oldest): an older one lacks language features they use.
TRITON_RANGE = ((3, 4), (3, 10))


# float64 products (tl.dot) from Triton 3.5 on.
TRITON_FLOAT64 = (3, 5)


def _triton_version() -> tuple:
    """The installed Triton's ``(version string, (major, minor))``."""
    import triton

    version = getattr(triton, "__version__", "0")
    parts = []
    for piece in (version.split("+")[0].split(".") + ["0"])[:2]:
        parts.append(int("".join(itertools.takewhile(str.isdigit, piece)) or 0))
    return version, tuple(parts)


def _unsupported_triton() -> Optional[str]:
    """Why the installed Triton is too old for the kernels, or None."""
    version, parts = _triton_version()
    low, high = TRITON_RANGE
    if parts < low:
        return (f"triton {version} is too old: fusedloss's Triton kernels need triton>={low[0]}.{low[1]},"
                f"<{high[0]}.{high[1]}")
    return None


def availability() -> str:
    """"available", or why the Triton kernels cannot run here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton not installed"
    too_old = _unsupported_triton()
    if too_old:
        return too_old
    if _KERNELS is not None and _KERNELS.interpreted != _interpret_requested():
        return ("TRITON_INTERPRET changed after the Triton kernels were first used in this process; "
                "set it before using fusedloss")
    if _interpret_requested() or torch.cuda.is_available():
        return "available"
    return _INTERPRET_HINT


_KERNELS: Optional[SimpleNamespace] = None


def _kernels() -> SimpleNamespace:
    """Import the kernel modules on first use: ``triton.jit`` reads TRITON_INTERPRET when a kernel is
    defined, so importing this module early must not freeze the choice."""
    global _KERNELS
    if _KERNELS is None:
        if _interpret_requested():
            _interpreter_numpy_compat()
        from . import tile_math
        from .jsd_forward import jsd_forward_kernel
        from .logits_gradient import logits_gradient_kernel, packed_gradient_kernel
        from .statistics_forward import statistics_forward_kernel
        from .teacher_fold import teacher_fold_kernel

        if tile_math.STATE_FIELDS != partials.FIELDS:  # the kernels write the partials in this order
            raise ImportError(f"triton/tile_math.py keeps {tile_math.STATE_FIELDS}, core/partials.py merges "
                              f"{partials.FIELDS}: update the kernels' state")
        _KERNELS = SimpleNamespace(forward=statistics_forward_kernel, jsd=jsd_forward_kernel,
                                   gradient=logits_gradient_kernel, packed_gradient=packed_gradient_kernel,
                                   fold=teacher_fold_kernel, tm=tile_math,
                                   interpreted=_interpret_requested())
    return _KERNELS


# ----------------------------------------------------------------------------------------------
# The tiles and the plan of a call at run time (tuned by timing the forward kernel)


_TUNED: dict = {}


def autotune(key, configs: tuple, measure: Callable[[TileConfig], float]) -> TileConfig:
    """The fastest of ``configs`` by ``measure`` (seconds of one run), measured once per ``key``."""
    if key not in _TUNED:
        _TUNED[key] = min(configs, key=measure) if len(configs) > 1 else configs[0]
    return _TUNED[key]


def tiles_for(p: StatsProblem, path: str = "composable", tune: bool = True) -> TileConfig:
    """The tile configuration of a problem's kernels on ``path`` ("composable": the forward and the gradient
    kernel, which must share it; "grad_in_forward": the grad-in-forward forward): the interpreter's on CPU tensors; on a
    GPU the
    tuned one of ``candidates`` (the first without tuning in deterministic mode, where a timing must not
    choose the summation order; during CUDA graph capture, where nothing may be timed, the choice tuned before
    the capture, so that a captured forward and a backward outside the graph form the same tiles).
    ``tune=False``: the tuned choice if there is one, else the first, without measuring (a plan that only
    compares the paths)."""
    dev = p.hidden.device
    if dev.type == "cpu":
        return INTERPRETER_TILES
    configs = candidates(p.hidden.dtype, epilogue(p, path), path, device_target(dev))
    if dev.type != "cuda" or len(configs) == 1 or deterministic():
        return configs[0]
    key = (dev.index if dev.index is not None else torch.cuda.current_device(), p.hidden.dtype,
           d_bucket(p.hidden.shape[1]), epilogue(p, path))
    if not tune or torch.cuda.is_current_stream_capturing():
        return _TUNED.get(key, configs[0])

    def measure(cfg: TileConfig) -> float:
        import triton.testing

        return triton.testing.do_bench(lambda: _forward_partials(p, cfg, store=None), warmup=5, rep=20,
                                       return_mode="median") * 1e-3

    return autotune(key, configs, measure)


_free_bytes = gpu.free_bytes  # fixed per device for the process (backends/gpu.py)


def _plan_of(p: StatsProblem, needs: GradientNeeds, path: Optional[str], tiles: Optional[TileConfig] = None):
    """``plan`` for a problem at run time: its device, its free memory, its tiles (``tiles``: the given path's)
    and precision."""
    dev = p.hidden.device
    capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    target = device_target(dev)
    # Only the tiles of the path(s) the plan weighs, and tuned only for the path taken: choosing between the
    # paths (path None) compares them with the untuned tiles, so a grad-in-forward call never times composable kernels.
    tune = path is not None
    cfg = (tiles if tiles is not None and path == "composable" else None if path == "grad_in_forward"
           else tiles_for(p, tune=tune))
    grad_in_forward_cfg = (tiles if tiles is not None and path == "grad_in_forward" else None if path == "composable"
                 else tiles_for(p, "grad_in_forward", tune=tune))
    return plan(workload_of(p, needs, row_local=path != "composable"), gpu_of(dev), _free_bytes(dev), tiles=cfg,
                grad_in_forward_tiles=grad_in_forward_cfg, workspace_mb=p.workspace_mb,
                precision=fp32_precision(p, capability, target), allow_tf32=_allow_tf32(p), path=path)


# ----------------------------------------------------------------------------------------------
# Launch arguments


def _on_device(t: torch.Tensor):
    """Triton launches on the current device: make it the tensors' (they may live on cuda:1)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@contextlib.contextmanager
def _cublas_tf32(device: torch.device, allowed: bool):
    """cuBLAS products of an fp32 problem use TF32 exactly when the problem allows it, whatever the global
    flags say. PyTorch refuses to mix its legacy (``allow_tf32``) and new (``fp32_precision``) flag APIs, so
    the flag is set and restored through the one the caller's state can be read with, and only when it
    differs from what the problem needs."""
    matmul = torch.backends.cuda.matmul
    if device.type != "cuda" or (matmul.fp32_precision == "tf32") == allowed:
        yield
        return
    try:
        legacy = matmul.allow_tf32
    except RuntimeError:
        legacy = None
    if legacy is not None:
        matmul.allow_tf32 = allowed
        try:
            yield
        finally:
            matmul.allow_tf32 = legacy
    else:
        previous = matmul.fp32_precision
        matmul.fp32_precision = "tf32" if allowed else "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision = previous


@lru_cache(maxsize=64)
def _cached_params(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _device_params(values, dtype, device)


def _device_params(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The scalars as a device tensor written by fill kernels: no host-to-device copy, so building it inside
    a CUDA graph capture records the fills (a copy from pageable memory would break the capture)."""
    t = torch.empty(len(values), dtype=dtype, device=device)
    for i, x in enumerate(values):
        t[i].fill_(x)
    return t


def _params(p: StatsProblem, acc: torch.dtype) -> torch.Tensor:
    """Scalars in the accumulation dtype, in tile_math's ``P_*`` order, cached per value set; during a CUDA
    graph capture made fresh (a cached tensor filled by a captured kernel holds nothing until a replay)."""
    tf, tt = p.transform, p.teacher_transform
    beta = p.jsd_beta
    values = (
        float(tf.logit_scale), float(tf.softcap or 1.0), float(tf.temperature),
        float(tt.logit_scale), float(tt.softcap or 1.0), float(tt.temperature),
        math.log1p(-beta) if beta is not None else 0.0, math.log(beta) if beta is not None else 0.0,
        float(tf.logit_scale) / float(tf.temperature),
    )
    dev = p.hidden.device
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _device_params(values, acc, dev)
    return _cached_params(values, acc, dev)


def _alloc(shape, dtype: torch.dtype, device: torch.device, zero: bool = True) -> torch.Tensor:
    """Every device buffer of this backend is made here (tests wrap it to check the memory bounds)."""
    return torch.zeros(shape, dtype=dtype, device=device) if zero else torch.empty(shape, dtype=dtype, device=device)


def _align(*strides: int) -> int:
    """The largest power of two, at most 16, dividing every row stride (in elements)."""
    a = 16
    for s in strides:
        while a > 1 and s % a:
            a //= 2
    return a


@dataclasses.dataclass
class _Launch:
    """What every kernel of one call needs: the two heads, the scalars, the tile constants."""

    p: StatsProblem
    cfg: TileConfig
    acc: torch.dtype
    student: tuple
    teacher: tuple
    params: torch.Tensor
    tiles: tuple
    dummy: torch.Tensor

    def run(self, kernel, programs: int, *args, flags, **constexprs) -> None:
        import triton.language as tl

        kernel[(programs,)](*args, F=flags, T=self.tiles, ACC=tl.float64 if self.acc == torch.float64 else tl.float32,
                            num_warps=self.cfg.num_warps, num_stages=self.cfg.num_stages, **constexprs)

    def workspace(self, c: Optional[torch.Tensor], zt: Optional[torch.Tensor]) -> tuple:
        """The grad-in-forward path's kept tiles as a Head (c, z_t, row stride); the student head when unused."""
        if c is None:
            return self.student
        ld = c.stride(0)
        return _kernels().tm.Head(c, zt if zt is not None else c, self.dummy, ld, ld)


def _teacher_tensors(p: StatsProblem, acc: torch.dtype):
    """Teacher hidden/weight in a dtype the kernels can multiply with ``acc`` accumulation (a float64 problem
    multiplies a teacher in float64; an fp32 teacher beside a bf16 student stays fp32, on tf32x3)."""
    th, tw = p.teacher_hidden, p.teacher_weight
    want = th.dtype
    if (acc == torch.float64) != (want == torch.float64):
        want = torch.float64 if acc == torch.float64 else torch.float32
    return th.to(want), tw.to(want)


def _launch(p: StatsProblem, cfg: TileConfig) -> _Launch:
    tm = _kernels().tm
    acc = p.acc_dtype
    h, w = p.hidden, p.weight
    dummy = h
    # The kernels read a bias at unit stride (tile_math.capped): a strided view is copied once here.
    student = tm.Head(h, w, p.bias.contiguous() if p.bias is not None else dummy, h.stride(0), w.stride(0))
    strides = [h.stride(0), w.stride(0)]
    operand_dtypes = {h.dtype}
    teacher = student
    if p.has_teacher:
        th, tw = _teacher_tensors(p, acc)
        teacher = tm.Head(th, tw, p.teacher_bias.contiguous() if p.teacher_bias is not None else dummy, th.stride(0),
                          tw.stride(0))
        strides += [th.stride(0), tw.stride(0)]
        operand_dtypes.add(th.dtype)
    dev = h.device
    capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    # tf32x3 (or the problem's TF32 choice) only where a product has fp32 operands (an fp32 teacher beside a
    # half student shares the launch's precision); half and float64 products are asked for plain ones.
    precision = fp32_precision(p, capability, device_target(dev)) if torch.float32 in operand_dtypes else "ieee"
    tiles = tm.Tiles(cfg.block_m, cfg.block_v, cfg.block_k, precision, _align(*strides))
    return _Launch(p, cfg, acc, student, teacher, _params(p, acc), tiles, dummy)


def _rows(p: StatsProblem, r0: int, r1: int) -> StatsProblem:
    """The problem restricted to rows [r0, r1) (views; r0 a multiple of BLOCK_M keeps the forward's blocks)."""
    if r0 == 0 and r1 == p.hidden.shape[0]:
        return p
    return dataclasses.replace(
        p, hidden=p.hidden[r0:r1], targets=None if p.targets is None else p.targets[r0:r1],
        columns=None if p.columns is None else p.columns[r0:r1],
        teacher_hidden=None if p.teacher_hidden is None else p.teacher_hidden[r0:r1])


def _named(lc: "_Launch", columns: Optional[torch.Tensor], values: Optional[torch.Tensor]):
    """The kernels' ``Named`` (tile_math): the problem's named columns and their values, or nothing."""
    if columns is None:
        return _kernels().tm.Named(lc.dummy, lc.dummy, 0)
    if values is None:  # logits nobody reads (a tuning run of the forward)
        values = _alloc(columns.shape, lc.acc, columns.device)
    return _kernels().tm.Named(columns.contiguous(), values, columns.shape[1])


def _forward_flags(p: StatsProblem, store: bool):
    """With ``store`` (the grad-in-forward path) the teacher is no product of the forward: for a reverse KL it only
    keeps
    where the teacher fold is to read ztm (``TEACHER_AT_MAX``)."""
    tm = _kernels().tm
    in_tile = p.has_teacher and not store
    at_max = p.has_teacher and store and p.want_kl_rev
    return tm.Flags(HAS_BIAS=p.bias is not None, HAS_SOFTCAP=p.transform.softcap is not None,
                    HAS_TEACHER=in_tile, HAS_TEACHER_BIAS=in_tile and p.teacher_bias is not None,
                    HAS_TEACHER_SOFTCAP=in_tile and p.teacher_transform.softcap is not None,
                    HAS_TARGETS=p.targets is not None, WANT_E=p.want_entropy, WANT_S2=p.want_extras,
                    WANT_SZ=p.want_mean_logit, WANT_TOP1=p.want_extras and p.targets is not None,
                    STORE_LOGITS=store, TEACHER_AT_MAX=at_max, HAS_COLUMNS=p.columns is not None)


def _fold_flags(p: StatsProblem):
    tm = _kernels().tm
    return tm.Flags(HAS_TEACHER_BIAS=p.teacher_bias is not None,
                    HAS_TEACHER_SOFTCAP=p.teacher_transform.softcap is not None, HAS_TARGETS=p.targets is not None,
                    HAS_KL_REV=p.want_kl_rev, HAS_KL_FWD=p.want_kl_fwd, LOAD_LOGITS=True)


def _jsd_flags(p: StatsProblem, load: bool):
    tm = _kernels().tm
    if load:  # the kept tiles are c and the teacher's raw x_t: the temperature, and the teacher's transform
        return tm.Flags(HAS_TEACHER=True, HAS_TEACHER_BIAS=p.teacher_bias is not None,
                        HAS_TEACHER_SOFTCAP=p.teacher_transform.softcap is not None,
                        HAS_TARGETS=p.targets is not None, LOAD_LOGITS=True)
    return tm.Flags(HAS_BIAS=p.bias is not None, HAS_SOFTCAP=p.transform.softcap is not None, HAS_TEACHER=True,
                    HAS_TEACHER_BIAS=p.teacher_bias is not None,
                    HAS_TEACHER_SOFTCAP=p.teacher_transform.softcap is not None, HAS_TARGETS=p.targets is not None)


def _gradient_flags(p: StatsProblem, load: bool, column_sums: bool = False):
    """Only the terms the problem can produce: c2 r with reverse KL, c3 p with forward KL, c4 log m with
    the JSD (a teacher's -inf entry never meets a zero coefficient), c1 log q with entropy or JSD, c5 with
    the mean logit. ``column_sums``: the kernel also stores the column sums of dx (d bias of a half dx)."""
    tm = _kernels().tm
    t = p.has_teacher
    kl_rev, kl_fwd, jsd = t and p.want_kl_rev, t and p.want_kl_fwd, t and p.jsd_beta is not None
    teacher = t and (kl_rev or kl_fwd or jsd)
    # the kept teacher tile is the raw product (grad-in-forward path): its transform is applied as it is loaded
    return tm.Flags(HAS_BIAS=p.bias is not None and not load, HAS_SOFTCAP=p.transform.softcap is not None,
                    HAS_TEACHER=teacher, HAS_TEACHER_BIAS=teacher and p.teacher_bias is not None,
                    HAS_TEACHER_SOFTCAP=teacher and p.teacher_transform.softcap is not None,
                    HAS_TARGETS=p.targets is not None,
                    HAS_LOG_TERMS=p.want_entropy or jsd,
                    HAS_KL_REV=kl_rev, HAS_KL_FWD=kl_fwd, HAS_JSD=jsd, HAS_MEAN_LOGIT=p.want_mean_logit,
                    LOAD_LOGITS=load, HAS_COLUMNS=p.columns is not None, HAS_DB=column_sums)


def dtype_refusal(dtype: torch.dtype) -> Optional[str]:
    """Why the installed Triton cannot compute in ``dtype``, or None (``backend="auto"`` then passes this
    backend over)."""
    if dtype == torch.float64:
        version, parts = _triton_version()
        if parts < TRITON_FLOAT64:
            return (f"triton backend: float64 hidden needs triton>={TRITON_FLOAT64[0]}.{TRITON_FLOAT64[1]} "
                    f"(its float64 tl.dot), installed {version}; use backend='torch' for float64")
    return None


def _check_inputs(p: StatsProblem) -> None:
    refusal = dtype_refusal(p.hidden.dtype)
    if refusal:
        raise TypeError(refusal)
    for name in ("hidden", "weight", "teacher_hidden", "teacher_weight"):
        t = getattr(p, name)
        if t is not None and t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"triton backend: {name} must be contiguous in its last dimension")


# ----------------------------------------------------------------------------------------------
# Forward


def _forward_partials(p: StatsProblem, cfg: TileConfig, store: Optional[tuple], launch: Optional[_Launch] = None,
                      named_logits: Optional[torch.Tensor] = None):
    """Launch the statistics kernel on all rows of ``p``; returns the ``[F, splits, N]`` partials. ``store``:
    the grad-in-forward path's (c, z_t) workspace views to keep the tiles in; ``named_logits``: ``[N, K]`` zeros that
    take the logits at the problem's named columns."""
    k = _kernels()
    lc = launch or _launch(p, cfg)
    n, v = p.hidden.shape[0], p.weight.shape[0]
    gpu = gpu_of(p.hidden.device)
    row_blocks, per, splits, group = grid_of(n, v, cfg, gpu, _DTYPE_NAMES[p.hidden.dtype])
    part = _alloc((len(partials.FIELDS), splits, n), lc.acc, p.hidden.device, zero=False)
    ws = lc.workspace(*(store or (None, None)))
    tgt = p.targets if p.targets is not None else lc.dummy
    lc.run(k.forward, row_blocks * splits, lc.student, lc.teacher, ws, tgt, lc.params, part,
           _named(lc, p.columns, named_logits), n, v, p.hidden.shape[1],
           p.teacher_hidden.shape[1] if p.has_teacher else 0, per, splits, group,
           flags=_forward_flags(p, store is not None))
    return part, (row_blocks, per, splits, group)


def _statistics(p: StatsProblem, cfg: TileConfig, store: Optional[tuple] = None,
                named_logits: Optional[torch.Tensor] = None) -> dict:
    """Every statistic of ``p``'s rows, ``{name: [N]}`` (zeros on ignored rows and where not asked);
    ``named_logits``: as ``_forward_partials``."""
    lc = _launch(p, cfg)
    part, (row_blocks, per, splits, group) = _forward_partials(p, cfg, store, lc, named_logits)
    out = _finalized(part, p, p.weight.shape[0])
    if p.jsd_beta is not None:
        qm, pm = _jsd_pass(lc, (out["lse"], out["lse_lo"]), (out["lse_t"], out["lse_t_lo"]),
                           (row_blocks, per, splits, group), store)
        jsd = dict(kl_qm=qm, jsd=p.jsd_beta * pm + (1.0 - p.jsd_beta) * qm)
        out.update(_on_valid_rows(jsd, p))
    return out


_TEACHER_SWEEP = ("mt", "st", "a", "b", "ztm")  # the teacher fold's partials (teacher_fold.py), in its order


def _grad_in_forward_statistics(p: StatsProblem, cfg: TileConfig, elementwise: TileConfig, store: tuple) -> dict:
    """``_statistics`` of a grad-in-forward row chunk whose tiles the forward keeps in ``store`` (c, x_t): with a
    teacher,
    ``store[1]`` already holds its raw logits (cuBLAS); the student's forward gives the student's partials (and,
    in ztm's slot, the first column of the tile holding the first maximum), the teacher fold (``elementwise``
    tiles) ztm and the teacher's partials relative to the student's final (m, ztm), and both are finalised
    together as ``_finalized`` does (docs/design.md, "The Triton teacher on the grad-in-forward path")."""
    if not p.has_teacher:
        return _statistics(p, cfg, store)
    lc = _launch(p, cfg)
    n, v = p.hidden.shape[0], p.weight.shape[0]
    part, _ = _forward_partials(p, cfg, store, lc)
    student = [name for name in merged_fields(p) if name not in _TEACHER_SWEEP[:4]]  # ztm's slot: where it is
    state = partials.merge({name: part[partials.FIELDS.index(name)] for name in student})
    where = state.pop("ztm") if p.want_kl_rev else torch.zeros_like(state["m"])
    frame = torch.stack((state["m"], where)).contiguous()
    fold_cfg = elementwise if p.hidden.device.type == "cpu" else TEACHER_FOLD_TILES
    ew = _launch(p, fold_cfg)
    row_blocks, per, splits, group = elementwise_grid(n, v, fold_cfg, gpu_of(p.hidden.device))
    fold = _alloc((len(_TEACHER_SWEEP), splits, n), lc.acc, p.hidden.device, zero=False)
    tgt = p.targets if p.targets is not None else lc.dummy
    ew.run(_kernels().fold, row_blocks * splits, ew.teacher, ew.workspace(*store), tgt, ew.params, frame, fold, n,
           v, per, splits, group, flags=_fold_flags(p), SEARCH_V=cfg.block_v)
    sweep = {name: fold[i] for i, name in enumerate(_TEACHER_SWEEP) if name in merged_fields(p)}
    state.update(partials.merge_teacher_sweep(sweep, state["m"]))
    out = _finalized_state(state, p, v)
    if p.jsd_beta is not None:  # the same grid: both layouts have the same tiles
        qm, pm = _jsd_pass(_launch(p, elementwise), (out["lse"], out["lse_lo"]), (out["lse_t"], out["lse_t_lo"]),
                           (row_blocks, per, splits, group), store)
        out.update(_on_valid_rows(dict(kl_qm=qm, jsd=p.jsd_beta * pm + (1.0 - p.jsd_beta) * qm), p))
    return out


def merged_fields(p: StatsProblem) -> tuple:
    """The partials (``core/partials.FIELDS``) that ``p``'s statistics are finalised from: only these are
    merged across the splits (each field merged is a few small kernels more per call)."""
    t = p.has_teacher
    wanted = dict(e=p.want_entropy, s2=p.want_extras, sz=p.want_mean_logit, mt=t, st=t, a=t and p.want_kl_rev,
                  ztm=t and p.want_kl_rev, b=t and p.want_kl_fwd, zy=p.targets is not None,
                  mb=p.want_extras and p.targets is not None)
    return tuple(name for name in partials.FIELDS if wanted.get(name, True))


def _finalized(part: torch.Tensor, p: StatsProblem, v: int) -> dict:
    """Every statistic, ``{name: [N]}``, from the ``[F, splits, N]`` partials: the splits merged exactly
    (``partials.merge``, only the fields ``p`` needs), finalised, zero on ignored rows and where not asked."""
    return _finalized_state(partials.merge({name: part[partials.FIELDS.index(name)] for name in merged_fields(p)}),
                            p, v)


def _finalized_state(state: dict, p: StatsProblem, v: int) -> dict:
    """``_finalized`` of merged partials."""
    m = state["m"]
    stats = partials.finalize(state, p, v)
    out = dict(zip(Statistics._fields, torch.zeros((len(Statistics._fields), m.shape[-1]), dtype=m.dtype,
                                                   device=m.device).unbind(0)))
    out.update(_on_valid_rows(stats, p))
    return out


def _on_valid_rows(stats: dict, p: StatsProblem) -> dict:
    """The statistics with zeros on ignored rows (target < 0)."""
    if p.targets is None:
        return stats
    valid = p.targets >= 0
    return {name: torch.where(valid, x, 0.0) for name, x in stats.items()}


def _jsd_pass(lc: _Launch, lse: tuple, lse_t: tuple, grid: tuple, store: Optional[tuple] = None) -> tuple:
    """The generalized JSD's second sweep over the forward's grid with the given (hi, lo) normalisers:
    ``(KL(q || m), KL(p || m))``, each ``[N]``, the splits' partial sums added."""
    p = lc.p
    n, v = p.hidden.shape[0], p.weight.shape[0]
    row_blocks, per, splits, group = grid
    norm = torch.stack(tuple(x.to(lc.acc) for x in lse)).contiguous()
    norm_t = torch.stack(tuple(x.to(lc.acc) for x in lse_t)).contiguous()
    part = _alloc((2, splits, n), lc.acc, p.hidden.device, zero=False)
    tgt = p.targets if p.targets is not None else lc.dummy
    lc.run(_kernels().jsd, row_blocks * splits, lc.student, lc.teacher, lc.workspace(*(store or (None, None))), tgt,
           lc.params, norm, norm_t, part, n, v, p.hidden.shape[1], p.teacher_hidden.shape[1], per, splits,
           group, flags=_jsd_flags(p, store is not None))
    return part.sum(1).unbind(0)


def jsd_sums(p: StatsProblem, lse: tuple, lse_t: tuple, *, tiles: Optional[TileConfig] = None) -> tuple:
    """``(KL(q || m), KL(p || m))`` summed over this problem's columns, ``[N]`` each in the accumulation dtype,
    q and p normalised by the given (hi, lo) pairs: the JSD kernel launched with normalisers from elsewhere, as
    a vocabulary-parallel head needs them (core/registry.py, ``JsdBackend``; docs/design.md, "Distributed").
    Ignored rows give 0."""
    _check_inputs(p)
    n, v = p.hidden.shape[0], p.weight.shape[0]
    if n == 0 or v == 0:
        zero = torch.zeros(n, dtype=p.acc_dtype, device=p.hidden.device)
        return zero, zero.clone()
    cfg = tiles or tiles_for(p)
    with _on_device(p.hidden):
        gpu = gpu_of(p.hidden.device)
        grid = grid_of(n, v, cfg, gpu, _DTYPE_NAMES[p.hidden.dtype])
        return _jsd_pass(_launch(p, cfg), lse, lse_t, grid)


def forward_statistics(p: StatsProblem, *, tiles: Optional[TileConfig] = None):
    """Every statistic the problem asks for; with named columns, ``(Statistics, [N, K] logits at them)``, as
    the statistics kernel met them (core/columns.py). ``tiles``: a launch configuration other than
    ``tiles_for``'s (tests use it to cross tile and split borders; the backward must then be given the same
    one)."""
    _check_inputs(p)
    n = p.hidden.shape[0]
    named = None if p.columns is None else _alloc(p.columns.shape, p.acc_dtype, p.hidden.device)
    if n == 0:
        zero = torch.zeros(n, dtype=p.acc_dtype, device=p.hidden.device)
        stats = Statistics(*([zero] * len(Statistics._fields)))
    else:
        with _on_device(p.hidden):
            stats = Statistics(**_statistics(p, tiles or tiles_for(p), named_logits=named))
    return stats if named is None else (stats, named)


# ----------------------------------------------------------------------------------------------
# Backward: the gradient kernel into the workspace, cuBLAS products out of it


def _gradient_block(lc: _Launch, p: StatsProblem, coeffs: torch.Tensor, norm: torch.Tensor, norm_t: torch.Tensor,
                    v0: int, v1: int, dx: torch.Tensor, store: Optional[tuple] = None,
                    column_dz: Optional[torch.Tensor] = None, column_sums: Optional[torch.Tensor] = None) -> None:
    """dx of rows ``p`` (a row chunk) and columns [v0, v1) into ``dx`` (``[rows, v1 - v0]`` view);
    ``column_dz``: the given dz of the rows' named columns; ``column_sums``: ``[row blocks, >= v1 - v0]`` that
    take each row block's sums of dx before its cast (d bias)."""
    n = p.hidden.shape[0]
    cfg = lc.cfg
    programs = _cdiv(n, cfg.block_m) * _cdiv(v1 - v0, cfg.block_v)
    tgt = p.targets if p.targets is not None else lc.dummy
    db = column_sums if column_sums is not None else lc.dummy
    lc.run(_kernels().gradient, programs, lc.student, lc.teacher, lc.workspace(*(store or (None, None))), tgt,
           lc.params, coeffs, norm, norm_t, dx, _named(lc, p.columns, column_dz), db, n, v0, v1, p.hidden.shape[1],
           p.teacher_hidden.shape[1] if p.has_teacher else 0, dx.stride(0), db.stride(0), GRADIENT_GROUP,
           flags=_gradient_flags(p, store is not None, column_sums is not None))


def _packed_gradient(lc: _Launch, p: StatsProblem, coeffs: torch.Tensor, norm: torch.Tensor, norm_t: torch.Tensor,
                     dx: torch.Tensor, store: tuple, column_sums: Optional[torch.Tensor] = None) -> None:
    """The grad-in-forward chunk's half-precision dx over its kept fp32 tile (``dx``: the tile's 16-bit view, ``[rows,
    V]`` with row stride 2 ld): one program per row block, walking the columns in order; ``column_sums`` as
    ``_gradient_block``'s."""
    n = p.hidden.shape[0]
    tgt = p.targets if p.targets is not None else lc.dummy
    db = column_sums if column_sums is not None else lc.dummy
    lc.run(_kernels().packed_gradient, _cdiv(n, lc.cfg.block_m), lc.student, lc.teacher, lc.workspace(*store), tgt,
           lc.params, coeffs, norm, norm_t, dx, _named(lc, None, None), db, n, p.weight.shape[0], p.hidden.shape[1],
           p.teacher_hidden.shape[1] if p.has_teacher else 0, dx.stride(0), db.stride(0),
           flags=_gradient_flags(p, True, column_sums is not None))


def _column_sums(lc: _Launch, rows: int, cols: int, half: bool) -> Optional[torch.Tensor]:
    """Where a gradient launch over ``rows`` x ``cols`` leaves its row blocks' column sums of dx for d bias:
    needed where dx is rounded to a half dtype (an fp32 or float64 dx is summed as it is), else None."""
    if not half:
        return None
    cfg = lc.cfg
    return _alloc((_cdiv(rows, cfg.block_m), _cdiv(cols, cfg.block_v) * cfg.block_v), lc.acc, lc.p.hidden.device,
                  zero=False)


def _dx_dtype(p: StatsProblem) -> torch.dtype:
    return p.hidden.dtype if p.hidden.dtype in (torch.bfloat16, torch.float16) else p.acc_dtype


def _normalisers(saved: Statistics, acc: torch.dtype, teacher: bool) -> tuple:
    """``[4, N]`` (lse, lse_lo, logp, row_max) of the student, ``[4, N]`` (lse_t, lse_t_lo, teacher_at_max,
    kl_rev_rel) of the teacher (the last two and row_max: the reverse KL's frame, problem.py's r_j)."""
    norm = torch.stack((saved.lse, saved.lse_lo, saved.logp, saved.row_max)).to(acc).contiguous()
    if not teacher:
        return norm, norm
    return norm, torch.stack((saved.lse_t, saved.lse_t_lo, saved.teacher_at_max, saved.kl_rev_rel)).to(acc).contiguous()


def backward_gradients(p: StatsProblem, saved: Statistics, coeffs: torch.Tensor, needs: GradientNeeds, *,
                       column_dz: Optional[torch.Tensor] = None, tiles: Optional[TileConfig] = None):
    """(d hidden, d weight, d bias), each None when not needed; see the module docstring. ``column_dz``: the
    given dz of the named columns (``[N, K]``, core/columns.py). ``tiles`` must be the forward's."""
    _check_inputs(p)
    if column_dz is None:  # no given dz: the formula at every column
        p = dataclasses.replace(p, columns=None)
    acc = p.acc_dtype
    h, w, b = p.hidden, p.weight, p.bias
    n, v, d = h.shape[0], w.shape[0], h.shape[1]
    dev = h.device
    need_h, need_w, need_b = needs.hidden, needs.weight, needs.bias and b is not None
    # d hidden and d weight: every element is written by the first product into it (zeros only for no rows)
    dh = _alloc(h.shape, h.dtype, dev, zero=n == 0) if need_h else None
    dw = _alloc(w.shape, w.dtype, dev, zero=n == 0) if need_w else None
    db = _alloc(b.shape, b.dtype, dev) if need_b else None
    if n == 0 or not (need_h or need_w or need_b):
        return dh, dw, db
    cfg = tiles or tiles_for(p)
    with _on_device(h), _cublas_tf32(dev, _allow_tf32(p)):
        pl = _plan_of(p, GradientNeeds(need_h, need_w, need_b), "composable", cfg)
        rows, cols = pl.params.get("row_chunk"), pl.params.get("vocab_chunk")
        if rows is None:  # only d bias: the model's chunks are those of the products
            rows, cols = backward_chunks(n, v, d, _DTYPE_NAMES[h.dtype], pl.params["workspace_bytes"], cfg)
        lc = _launch(p, cfg)
        coeffs = coeffs.to(acc).contiguous()
        carries = (coeffs != 0).any(dim=0)
        if p.columns is not None:
            column_dz = column_dz.to(acc).contiguous()
            carries = carries | (column_dz != 0).any(dim=1)
        norm, norm_t = _normalisers(saved, acc, p.has_teacher)
        dh_acc = (dh if dh.dtype == acc else _alloc((n, d), acc, dev, zero=False)) if need_h else None
        db_acc = (db if db.dtype == acc else _alloc((v,), acc, dev)) if need_b else None
        # One row chunk holds every row: each d weight block is one product, written in the weight's dtype.
        direct = rows >= n
        dw_block = (_alloc((min(cols, v), d), acc, dev, zero=False) if need_w and w.dtype != acc and not direct
                    else None)
        h_w = gpu.zero_rows_outside(h, carries) if need_w else None
        # Rows of a whole number of tiles: the kernel stores them without a column mask.
        work = _alloc((min(rows, n), _cdiv(min(cols, v), cfg.block_v) * cfg.block_v), _dx_dtype(p), dev, zero=False)
        sums = _column_sums(lc, min(rows, n), min(cols, v), _dx_dtype(p) != acc) if need_b else None
        for v0 in range(0, v, cols):
            v1 = min(v, v0 + cols)
            dw_out = None if not need_w else dw[v0:v1] if dw_block is None else dw_block[: v1 - v0]
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                part = _rows(p, r0, r1)
                chunk_lc = lc if part is p else _launch(part, cfg)
                dx = work[: r1 - r0, : v1 - v0]
                _gradient_block(chunk_lc, part, coeffs[:, r0:r1].contiguous(), norm[:, r0:r1].contiguous(),
                                norm_t[:, r0:r1].contiguous(), v0, v1, dx,
                                column_dz=None if p.columns is None else column_dz[r0:r1],
                                column_sums=sums)
                if need_h:
                    gpu.product(dh_acc[r0:r1], dx, w[v0:v1], accumulate=v0 > 0)
                if need_w and direct and w.dtype != acc:
                    gpu.direct_product(dw_out, dx.T, h_w[r0:r1], acc)
                elif need_w:
                    gpu.product(dw_out, dx.T, h_w[r0:r1], accumulate=r0 > 0)
                if need_b:  # from dx as formed, never from its rounded copy (problem.py)
                    blocks = _cdiv(r1 - r0, cfg.block_m)
                    db_acc[v0:v1] += dx.sum(0, dtype=acc) if sums is None else sums[:blocks, : v1 - v0].sum(0)
            if dw_block is not None:
                dw[v0:v1].copy_(dw_out)
        if need_h and dh_acc is not dh:
            dh.copy_(dh_acc)
        if need_b and db_acc is not db:
            db.copy_(db_acc)
    return dh, dw, db


# ----------------------------------------------------------------------------------------------
# Grad-in-forward path: 3 products for losses known in the forward (core/grad_in_forward.py)


def grad_in_forward_pays(p: StatsProblem) -> bool:
    """Whether the plan's rule takes the grad-in-forward path for this problem (on CPU tensors, i.e. the interpreter,
    as on an H200, so that tests take the path a GPU would)."""
    needs = GradientNeeds(p.hidden.requires_grad, p.weight.requires_grad, p.bias is not None and p.bias.requires_grad)
    if not (needs.hidden or needs.weight):
        needs = GradientNeeds(True, True, needs.bias)
    return _plan_of(p, needs, None).path == "grad_in_forward"


def grad_in_forward_gradients(p: StatsProblem, chunk_fn, needs: GradientNeeds, *, tiles: Optional[TileConfig] = None):
    """3-product path: ``(loss, (d hidden, d weight, d bias))`` in the accumulation dtype (the caller scales,
    then rounds once). For each chunk of rows the forward keeps its logits tiles in the workspace, gives the
    statistics, ``chunk_fn(stats, slice(r0, r1)) -> (chunk loss, [7, rows] coefficients)`` gives the
    coefficients, the gradient kernel reads the tiles back into dx, and cuBLAS does d hidden (complete per
    chunk) and d weight (summed over chunks in fp32)."""
    _check_inputs(p)
    acc = p.acc_dtype
    h, w = p.hidden, p.weight
    n, v, d = h.shape[0], w.shape[0], h.shape[1]
    dev = h.device
    # written whole by each chunk's product (d hidden) or the first chunk's (d weight): zeros only for no rows
    dh = _alloc((n, d), acc, dev, zero=False) if needs.hidden else None
    dw = _alloc((v, d), acc, dev, zero=n == 0) if needs.weight else None
    db = _alloc((v,), acc, dev) if needs.bias and p.bias is not None else None
    loss = torch.zeros((), dtype=acc, device=dev)
    if n == 0:
        return loss, (dh, dw, db)
    cfg = tiles or tiles_for(p, "grad_in_forward")
    with _on_device(h), _cublas_tf32(dev, _allow_tf32(p)):
        step = _plan_of(p, needs, "grad_in_forward", cfg).params["grad_in_forward_rows"]
        elementwise = cfg if dev.type == "cpu" else ARCH_ELEMENTWISE_TILES.get(tile_family(device_target(dev)),
                                                                               ELEMENTWISE_TILES)
        # Rows of a whole number of both kernels' tiles: they move the kept tiles without a column mask.
        ld = _cdiv(v, _grad_in_forward_row_align(cfg, elementwise)) * _grad_in_forward_row_align(cfg, elementwise)
        m_max = min(step, n)
        c_ws = _alloc((m_max, ld), acc, dev, zero=False)
        zt_ws = _alloc((m_max, ld), acc, dev, zero=False) if p.has_teacher else None
        # dx in place (fp32, float64), or packed over the student's tile: its 16-bit view [rows, 2 ld], whose row
        # r starts where the tile's does (docs/design.md, "The logits workspace")
        packed = _dx_dtype(p) != acc
        dx_ws = c_ws.view(_dx_dtype(p)) if packed else c_ws
        sums = _column_sums(_launch(p, elementwise), m_max, v, packed) if db is not None else None
        teacher_weight = _teacher_tensors(p, acc)[1] if p.has_teacher else None
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            m = r1 - r0
            part = _rows(p, r0, r1)
            store = (c_ws[:m], None if zt_ws is None else zt_ws[:m])
            if p.has_teacher:  # the teacher's raw logits, fp32 (float64) out of cuBLAS, beside the student's
                th = part.teacher_hidden.to(teacher_weight.dtype)  # the weight converted once, above
                gpu.product(zt_ws[:m, :v], th, teacher_weight.T, accumulate=False)
            stats = _grad_in_forward_statistics(part, cfg, elementwise, store)
            chunk_loss, coeffs = chunk_fn(Statistics(**stats), slice(r0, r1))
            if tuple(coeffs.shape) != (7, m):
                raise ValueError(f"chunk_fn must return coefficients of shape [7, {m}], got {tuple(coeffs.shape)}")
            loss = loss + chunk_loss.to(acc)
            coeffs = coeffs.to(acc).contiguous()
            norm, norm_t = _normalisers(Statistics(**stats), acc, p.has_teacher)
            dx = dx_ws[:m, :v]
            if packed:
                _packed_gradient(_launch(part, elementwise), part, coeffs, norm, norm_t, dx, store, sums)
            else:
                _gradient_block(_launch(part, elementwise), part, coeffs, norm, norm_t, 0, v, dx, store)
            if dh is not None:
                gpu.product(dh[r0:r1], dx, w, accumulate=False)
            if dw is not None:
                gpu.product(dw, dx.T, gpu.zero_rows_outside(part.hidden, (coeffs != 0).any(dim=0)), accumulate=r0 > 0)
            if db is not None:  # from dx as formed, never from its rounded copy (problem.py)
                db += dx.sum(0, dtype=acc) if sums is None else sums[:_cdiv(m, elementwise.block_m), :v].sum(0)
    return loss, (dh, dw, db)
