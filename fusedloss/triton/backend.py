"""Triton backend of the statistics core (the ``Backend`` protocol of ``core/backends.py``).

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

Eager path (``eager_gradients``, ``core/eager.py``), for losses known in the forward
    For each chunk of rows, the forward kernel keeps the capped logits in the workspace while it forms the
    statistics; a teacher's raw logits come from one cuBLAS product into the workspace beside them, and the
    teacher fold (``teacher_fold``) forms its statistics from both kept tiles once the student's are final
    (docs/design.md, "The Triton teacher on the eager path"); the loss gives the chunk's coefficients; the
    gradient kernel reads the tiles back instead of forming them again; cuBLAS does d hidden and d weight.
    Three products instead of four. ``plan`` (the shared cost model, ``core/cost.py``) decides between the two
    paths, and sizes the chunks: the same function the model evaluates runs the backend.

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

Memory
    Besides the gradients, O(N) per-row vectors and the ``[F, splits, N]`` partials (F = len(partials.FIELDS)):
    an fp32 ``[N, D]`` accumulator for d hidden (when hidden is not fp32/float64), and one workspace of at most
    the problem's ``workspace_mb`` (None: a share of the free device memory, bounded; ``workspace_budget``): the
    dx block of a vocabulary chunk and, when the rows take several chunks, its fp32 d weight block (with one
    row chunk each block is one product straight into the weight's dtype), or, on the eager path, a row
    chunk's logits. Nothing
    of size N x V. The eager path returns fp32 (float64) gradients, so d weight is a ``[V, D]`` fp32 buffer
    there, as on the other backends.

Compilation
    N, V, D, the grid sizes and the chunk offsets are runtime values that Triton does not specialise on, and
    the tile configuration depends on (dtype, D bucket, teacher) only (``tiles_for``): one compiled variant
    per kernel and feature set serves every sequence length. With ``TRITON_INTERPRET=1`` (set before this
    module's kernels are first used) the kernels run on CPU tensors in Triton's interpreter: slow, for tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from functools import lru_cache
from types import SimpleNamespace
from typing import Callable, NamedTuple, Optional

import torch

from .. import config
from ..core import backends, cost, partials
from ..core.problem import GradientNeeds, Statistics, StatsProblem

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


def _interpreter_numpy_compat() -> None:
    """Triton's interpreter (3.4 to 3.6 at least) turns a scalar tensor into a Python int with
    ``int(array)``, which NumPy >= 2.4 rejects for its 1-element arrays, so every loop with a runtime bound
    (``range(0, D, BLOCK_K)``) fails there. Wrap the interpreter's tensor patch to convert with ``.item()``."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_fusedloss_compat", False):
        return

    def index(self):
        return int(self.handle.data.item())

    # Triton >= 3.6 patches through a scope that restores the class afterwards; older ones set attributes.
    def patched(tensor, *scope):
        original(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patched._fusedloss_compat = True
    interpreter._patch_lang_tensor = patched


# ----------------------------------------------------------------------------------------------
# Tile configurations


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration, shared by the forward and the gradient kernel of a problem (the gradient
    forms the forward's logits bit for bit only with the forward's tile shape). ``slots``: programs the
    GPU runs at once (None: one per SM, what these tiles' shared memory and registers allow on sm_80+);
    the forward splits the vocabulary to fill whole waves of them."""

    block_m: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int
    slots: Optional[int] = None


# Candidates for the autotuner, by operand dtype and epilogue ("lean": the logits' normaliser and the target;
# "heavy": entropy, TRL's extras, the mean logit or a soft-cap, whose per-element terms need twice the
# registers; "teacher": a second product); the first is the default (deterministic mode, CUDA graph capture
# and the cost model). A 128 x 128 tile on 8 warps holds 64 fp32 values per thread per tile-sized temporary:
# enough for the lean epilogue, a spill for the heavy ones, which take 64 x 128; a teacher's second product
# and its statistics fit 64 x 64 (64 x 128 sits at 255 registers and spills with some feature sets). fp32
# operands step K by 16: tf32x3 holds each operand as two tf32 halves in registers, and a 32-wide step spills
# on Triton 3.6 (docs/design.md, "Triton versions"). Each candidate compiles for sm_90 to wgmma without spills
# and within 227 KB of shared memory on every supported Triton (tests/test_triton_backend.py).
GPU_CANDIDATES = {
    ("half", "lean"): (TileConfig(128, 128, 64, 8, 4), TileConfig(128, 128, 64, 8, 3)),
    ("half", "heavy"): (TileConfig(64, 128, 64, 8, 4), TileConfig(64, 128, 64, 8, 3)),
    ("half", "teacher"): (TileConfig(64, 64, 64, 8, 3),),
    ("fp32", "lean"): (TileConfig(128, 64, 16, 8, 3), TileConfig(64, 128, 16, 8, 3)),
    ("fp32", "heavy"): (TileConfig(64, 64, 16, 8, 3),),
    ("fp32", "teacher"): (TileConfig(64, 64, 16, 8, 3),),
    ("fp64", "lean"): (TileConfig(32, 32, 32, 4, 1),),
    ("fp64", "heavy"): (TileConfig(32, 32, 32, 4, 1),),
    ("fp64", "teacher"): (TileConfig(32, 32, 32, 4, 1),),
}
# The eager path's forward also stores each capped logits tile for the gradient pass: that store holds a tile
# more in registers, so it runs on tiles with more headroom where the epilogue needs it (and, forming the logits
# once, shares its tile with no other kernel). The lean half forward keeps the 128 x 128 tile with its store
# (255 registers, no spill on Triton 3.6.0 and 3.9.0, with and without a bias). A teacher is no product of the
# eager forward: cuBLAS forms its raw logits into the workspace, the student's forward (the lean or heavy
# epilogue of its own features) keeps only which of its tiles holds the row's first maximum, and the teacher
# fold reads the teacher's logit there and forms the teacher's statistics from the kept tiles (docs/design.md,
# "The Triton teacher on the eager path"); a tile forming both products grew no larger than 64 x 64 without
# spilling, on every supported Triton. Not tuned: one configuration per class.
EAGER_TILES = {
    ("half", "lean"): TileConfig(128, 128, 64, 8, 4),
    ("half", "heavy"): TileConfig(64, 64, 64, 8, 4),
    ("fp32", "lean"): TileConfig(128, 64, 16, 8, 3),
    ("fp32", "heavy"): TileConfig(64, 64, 16, 8, 3),
    ("fp64", "lean"): TileConfig(32, 32, 32, 4, 1),
    ("fp64", "heavy"): TileConfig(32, 32, 32, 4, 1),
}
# The eager path's gradient pass reads the kept logits back: no product, so no reason to share the forward's
# tile. Loaded tiles are laid out one row per thread and warp-wide along the vocabulary, so every thread
# holds every per-row value of its rows (coefficients, normalisers, the float64 target column): 4 rows of
# 512 columns keep that at 4 values per row quantity and 16 per tile-sized one (a teacher's terms need ~8).
ELEMENTWISE_TILES = TileConfig(4, 512, 16, 4, 1)
# The teacher fold on the same layout with 8 warps: 8 values per thread per tile-sized quantity, where its terms
# (z, z_t, both exponentials, a's and b's columns) at 16 spilled 4-12 bytes per thread (ptxas held 168 registers).
TEACHER_FOLD_TILES = TileConfig(4, 512, 16, 8, 1)
# The interpreter: small tiles and a few resident programs, so tiny test shapes still cross every tile border
# and the vocabulary splits (tests pass other configurations through the ``tiles`` argument).
INTERPRETER_TILES = TileConfig(16, 32, 16, 4, 1, slots=4)


# Where an architecture's registers or shared memory do not hold a table's tile, its own entries replace them
# (the default tables above are sm_80/sm_90's). The key is the tile family of the device's target
# (``tile_family``); every default tile compiles for that target without spills and within its shared memory
# (LDS) with every supported Triton (tests/test_triton_compile.py, "--arch").
ARCH_CANDIDATES: dict = {
    # B200/GB200/B300 (tcgen05): the 128 x 128 lean tile spills on the oldest and the newest Triton there (3.4.0:
    # 24 bytes per thread; 3.9.0: 12-20), where 64 x 128 holds.
    "sm_100": {
        ("half", "lean"): (TileConfig(64, 128, 64, 8, 4), TileConfig(64, 128, 64, 8, 3)),
        # fp32 with named columns: 64 x 64 spills 4 bytes per thread on Triton 3.9.0, 64 x 32 none
        ("fp32", "heavy"): (TileConfig(64, 32, 16, 8, 3),),
    },
    # RTX 50 / RTX PRO 6000 (mma.sync, 99 KB of shared memory): the 128 x 128 lean tile spills 16-24 bytes per
    # thread there, 64 x 128 none; a teacher's two products fit 64 x 32 (64 x 64 spills 112-144 bytes with fp32
    # operands on Triton 3.7.1, 4 with half ones on 3.6.0), with half operands in steps of 32 (steps of 64 spill
    # 12 bytes in the JSD forward on Triton 3.9.0).
    "sm_120": {
        ("half", "lean"): (TileConfig(64, 128, 64, 8, 4), TileConfig(64, 128, 64, 8, 3)),
        ("half", "heavy"): (TileConfig(64, 64, 64, 8, 4), TileConfig(64, 64, 64, 8, 3)),
        ("half", "teacher"): (TileConfig(64, 32, 32, 8, 3),),
        ("fp32", "teacher"): (TileConfig(64, 32, 16, 8, 3),),
    },
    # MI300X/MI325X (64 KiB of LDS): 4 stages keep three operand buffers in LDS (96 KiB for 128 x 128 x 64 bf16,
    # 72 KiB for 64 x 128); 3 stages keep two (64 and 48 KiB).
    "gfx942": {
        ("half", "lean"): (TileConfig(128, 128, 64, 8, 3), TileConfig(64, 128, 64, 8, 3)),
        ("half", "heavy"): (TileConfig(64, 128, 64, 8, 3),),
    },
}
ARCH_EAGER_TILES: dict = {
    # B200/GB200/B300 (tcgen05): the eager forward's 128 x 128 tile and its logits store spill 80-132 bytes per
    # thread; 64 x 128 none (198-232 registers).
    "sm_100": {("half", "lean"): TileConfig(64, 128, 64, 8, 4)},
    "sm_120": {("half", "lean"): TileConfig(64, 128, 64, 8, 4)},
    "gfx942": {("half", "lean"): TileConfig(128, 128, 64, 8, 3)},
}
# The eager gradient pass's tile where ELEMENTWISE_TILES does not hold (none yet: on sm_120 8 warps spared Triton
# 3.6.0 a 4-byte spill of a teacher's terms and gave 3.7.1 one of its own).
ARCH_ELEMENTWISE_TILES: dict = {}
# Shared memory (LDS on AMD) one block may hold, per tile family: what the default tiles must fit.
SHARED_LIMITS = {"sm_90": 227 * 1024, "sm_100": 227 * 1024, "sm_120": 99 * 1024, "gfx942": 64 * 1024,
                 "gfx950": 160 * 1024}


def device_target(device: torch.device) -> str:
    """The architecture the kernels compile for on ``device``: ``sm_<major><minor>`` on NVIDIA, the ``gfx`` name
    on AMD (ROCm); "sm_90" (the H200 the model targets) for CPU and meta tensors."""
    if device.type != "cuda":
        return "sm_90"
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=16)
def _cuda_target(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    arch = getattr(props, "gcnArchName", "") or ""
    if torch.version.hip is not None and arch:
        return arch.split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
    return f"sm_{props.major}{props.minor}"


def is_amd(target: str) -> bool:
    return target.startswith("gfx")


def tile_family(target: str) -> str:
    """The tile tables' key for a target: sm_100 and sm_103 (B200, GB200, B300) share Blackwell's datacenter SM,
    sm_120 and sm_121 (RTX 50, RTX PRO 6000, DGX Spark) its consumer SM with 99 KB of shared memory; CDNA3
    (gfx94x) has 64 KiB of LDS, CDNA4 (gfx950) 160 KiB; everything else takes sm_90's tables."""
    if is_amd(target):
        return "gfx950" if target >= "gfx950" else "gfx942"
    major = int(target[3:].rstrip("af")) // 10 if target[3:].rstrip("af").isdigit() else 9
    return {10: "sm_100", 11: "sm_100", 12: "sm_120"}.get(major, "sm_90")


def _dtype_class(dtype: torch.dtype) -> str:
    return {torch.float64: "fp64", torch.float32: "fp32"}.get(dtype, "half")


def epilogue(p: StatsProblem, path: str = "composable") -> str:
    """"teacher", "heavy" or "lean": which candidates' registers hold the problem's per-element terms (on the
    eager path the teacher is no product of the forward: its student's)."""
    if p.has_teacher and path != "eager":
        return "teacher"
    heavy = p.want_entropy or p.want_extras or p.want_mean_logit or p.transform.softcap is not None
    return "heavy" if heavy else "lean"


def candidates(dtype: torch.dtype, kind: str, path: str = "composable", target: str = "sm_90") -> tuple:
    """The tile configurations a problem class may run with on a GPU of ``target`` (``device_target``; the
    first: the default)."""
    key, family = (_dtype_class(dtype), kind), tile_family(target)
    if path == "eager":
        return (ARCH_EAGER_TILES.get(family, {}).get(key, EAGER_TILES[key]),)
    return ARCH_CANDIDATES.get(family, {}).get(key, GPU_CANDIDATES[key])


def d_bucket(d: int) -> int:
    """The hidden sizes that share a tuning result: the power of two at or above D (at most 16384)."""
    return min(16384, 1 << max(0, (d - 1).bit_length()))


# Tuning results of this process, one per (device, dtype, D bucket, epilogue): N, V and the exact D never enter
# the key, so no sequence length retunes (or recompiles).
_TUNED: dict = {}


def autotune(key, configs: tuple, measure: Callable[[TileConfig], float]) -> TileConfig:
    """The fastest of ``configs`` by ``measure`` (seconds of one run), measured once per ``key``."""
    if key not in _TUNED:
        _TUNED[key] = min(configs, key=measure) if len(configs) > 1 else configs[0]
    return _TUNED[key]


def tiles_for(p: StatsProblem, path: str = "composable", tune: bool = True) -> TileConfig:
    """The tile configuration of a problem's kernels on ``path`` ("composable": the forward and the gradient
    kernel, which must share it; "eager": the eager forward): the interpreter's on CPU tensors; on a GPU the
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


def fp32_precision(p: StatsProblem, capability: Optional[tuple] = None, target: Optional[str] = None) -> str:
    """``tl.dot``'s input precision for fp32 operands: ``FUSEDLOSS_TRITON_FP32_PRECISION`` if set (a tuning
    override), else ``tf32`` when the problem opts in (``allow_tf32``; unset: ``FUSEDLOSS_ALLOW_TF32=1``), else
    ``tf32x3`` (fp32's accuracy on the tensor cores of sm_80 and newer; ``ieee`` before them). PyTorch's
    global TF32 flags play no part: fp32 stays fp32 unless asked (the interpreter ignores the choice).
    On AMD (``target`` a gfx name) ``tf32x3`` does not exist and ``ieee`` runs on the fp32 MFMA (fp32's own
    accuracy); CDNA4 (gfx950) has no TF32 either, so there every choice is ``ieee``."""
    env = config.from_environment()
    choice = env.triton_fp32_precision or ("tf32" if _allow_tf32(p) else None)
    if target is not None and is_amd(target):
        return "tf32" if choice == "tf32" and tile_family(target) == "gfx942" else "ieee"
    if choice:
        return choice
    return "tf32x3" if capability is None or capability[0] >= 8 else "ieee"


def deterministic() -> bool:
    """Whether the caller asked for bit-reproducible results (``torch.use_deterministic_algorithms`` or
    ``FUSEDLOSS_DETERMINISTIC=1``): every path is deterministic by construction, so this only pins what a
    measurement would otherwise choose (the tile autotuner, the workspace from free memory)."""
    return torch.are_deterministic_algorithms_enabled() or bool(config.from_environment().deterministic)


# ----------------------------------------------------------------------------------------------
# Grids, chunks and the plan (core/cost.py): the same functions size the launches and the model


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=1024)
def forward_grid(n: int, v: int, block_m: int, block_v: int, slots: int, weight_stream: float = 0.0) -> tuple:
    """(row blocks, tiles per split, splits, group of row blocks) of the forward. Every program walks
    ``tiles per split`` tiles, so the compute time is about (waves of programs) x (tiles per program), which
    filling the last wave minimises where a plain 2 x SMs rule left 19-31% of the GPU idle at N = 1024-4096.
    The group puts about one wave of programs on a few row blocks, whose weight tiles are then read from HBM
    once for the group (L2 serves the rest): the weight is streamed once per group. ``weight_stream``: the
    time of one such stream in tile steps of one program (``weight_stream_steps``); the split count
    minimises the larger of the two times (ties: fewer splits, fewer partials to merge), so that at N <= 4096,
    where one split per SM would stream the weight once per row block, a wave covers several row blocks."""
    row_blocks, vtiles = _cdiv(n, block_m), _cdiv(v, block_v)
    max_splits = min(vtiles, max(1, _cdiv(64 * slots, row_blocks)))
    best = None
    s = 1
    while s <= max_splits:
        per = _cdiv(vtiles, s)
        splits = _cdiv(vtiles, per)
        group = max(1, min(row_blocks, slots // splits))
        time = max(_cdiv(row_blocks * splits, slots) * per, _cdiv(row_blocks, group) * weight_stream)
        key = (time, splits)
        if best is None or key < best[0]:
            best = (key, per, splits, group)
        if per == 1:
            break
        s = _cdiv(vtiles, per - 1)  # the next split count with fewer tiles per program
    _, per, splits, group = best
    return row_blocks, per, splits, group


def weight_stream_steps(v: int, cfg: TileConfig, gpu: cost.GPUSpec, dtype: str) -> float:
    """The time to stream a half-precision weight [V, D] from HBM once, in tile steps of one program (a
    BLOCK_M x BLOCK_V x D product at the GPU's rate shared by its SMs); D cancels. 0 where the products are
    far slower than the stream (fp32, float64) and for the interpreter's fixed slots."""
    if cfg.slots is not None or dtype not in ("bfloat16", "float16") or dtype not in gpu.tflops:
        return 0.0
    flops_per_byte = gpu.tflops[dtype] / gpu.hbm_tbps
    return _cdiv(v, cfg.block_v) * _BYTES[dtype] * flops_per_byte / (2.0 * gpu.sm_count * cfg.block_m)


def grid_of(n: int, v: int, cfg: TileConfig, gpu: cost.GPUSpec, dtype: str) -> tuple:
    """``forward_grid`` of ``n`` rows for these tiles on this GPU."""
    return forward_grid(n, v, cfg.block_m, cfg.block_v, cfg.slots or gpu.sm_count,
                        weight_stream_steps(v, cfg, gpu, dtype))


def elementwise_grid(n: int, v: int, cfg: TileConfig, gpu: cost.GPUSpec) -> tuple:
    """``forward_grid`` of an elementwise sweep over the eager workspace (the teacher fold, the JSD's second
    sweep): the same whole waves of (row block, split) programs, no weight to stream."""
    return forward_grid(n, v, cfg.block_m, cfg.block_v, cfg.slots or gpu.sm_count, 0.0)


GRADIENT_GROUP = 8  # row blocks per group of the gradient kernel's one-tile programs (the matmul swizzle)

# Bounds of the workspace when its size comes from the free memory: a share of it, at least enough for
# useful chunks, and the CUDA backend's cap (4 GiB): fewer, larger chunks mean fewer beta = 1 accumulations
# of the fp32 d weight, whose C traffic a cuBLAS product does not hide (the model's price of 2 GiB instead of
# 4 at N = 16384, V = 151936: +7% for cross-entropy, +7% for distillation).
WORKSPACE_SHARE = 8
MIN_WORKSPACE = 64 << 20
MAX_WORKSPACE = 4 << 30
FIXED_WORKSPACE = 1 << 30  # deterministic mode: the chunking (the order of fp32 sums) must not follow free memory


def workspace_budget(workspace_mb: Optional[float], free_bytes: Optional[int], gpu: cost.GPUSpec) -> int:
    """Bytes of workspace for one call: ``workspace_mb`` if given (problem field or FUSEDLOSS_WORKSPACE_MB),
    else 1/8 of the free memory (half the GPU's memory if unknown) within [64 MiB, 4 GiB]; fixed at 1 GiB in
    deterministic mode."""
    if workspace_mb is None:
        workspace_mb = config.from_environment().workspace_mb
    else:
        workspace_mb = config.workspace_megabytes(workspace_mb, "workspace_mb")
    if workspace_mb is not None:
        return max(1, int(workspace_mb * 2**20))
    if deterministic():
        return FIXED_WORKSPACE
    free = gpu.memory_bytes // 2 if free_bytes is None else free_bytes
    return int(min(MAX_WORKSPACE, max(MIN_WORKSPACE, free // WORKSPACE_SHARE)))


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float64: "float64"}
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def _sizes(dtype: str):
    """(operand bytes, accumulation bytes, dx bytes) of a dtype."""
    e = _BYTES[dtype]
    acc = 8 if dtype == "float64" else 4
    return e, acc, (e if e < 4 else acc)


def backward_chunks(n: int, v: int, d: int, dtype: str, budget: int, cfg: TileConfig) -> tuple:
    """(rows, vocabulary columns) of one block of the composable backward's workspace: the dx block plus the
    fp32 d weight block of the chunk (for a bf16/fp16 weight) within ``budget``. All rows when a few tiles of
    columns fit that way (d weight is then complete after one product per chunk); otherwise a few tiles of
    columns and as many row blocks as fit. Multiples of the tiles, so that the row blocks are the forward's;
    one row block of one tile when even that exceeds the budget."""
    e, acc, e_dx = _sizes(dtype)
    scratch = acc * d if e != acc else 0
    v_pad, n_pad = _cdiv(v, cfg.block_v) * cfg.block_v, _cdiv(n, cfg.block_m) * cfg.block_m
    cols = budget // max(1, n_pad * e_dx + scratch) // cfg.block_v * cfg.block_v
    if cols >= min(v_pad, 4 * cfg.block_v):
        return n_pad, min(cols, v_pad)
    cols = max(cfg.block_v, min(v_pad, 8 * cfg.block_v,
                                budget // (cfg.block_m * e_dx + scratch) // cfg.block_v * cfg.block_v))
    rows = max(cfg.block_m, (budget - cols * scratch) // (cols * e_dx) // cfg.block_m * cfg.block_m)
    return min(rows, n_pad), cols


def _eager_row_align(cfg: TileConfig, elementwise: TileConfig) -> int:
    return max(cfg.block_v, elementwise.block_v)


def eager_row_bytes(v: int, dtype: str, teacher: bool) -> int:
    """Workspace bytes per row of an eager chunk: the capped logits (and the teacher's) in the accumulation
    dtype, rows padded to whole tiles. dx takes no bytes of its own: in place for fp32 / float64, and for
    bf16 / fp16 packed over the fp32 tile it is computed from (``packed_gradient_kernel``)."""
    e, acc, e_dx = _sizes(dtype)
    ld = _cdiv(v, ELEMENTWISE_TILES.block_v) * ELEMENTWISE_TILES.block_v
    return ld * acc * (2 if teacher else 1)


def eager_rows(n: int, v: int, dtype: str, teacher: bool, budget: int, cfg: TileConfig) -> int:
    """Rows of one eager chunk within the budget, a multiple of BLOCK_M (at least one row block)."""
    rows = budget // eager_row_bytes(v, dtype, teacher) // cfg.block_m * cfg.block_m
    return max(cfg.block_m, min(rows, _cdiv(n, cfg.block_m) * cfg.block_m))


class SmallLaunches(NamedTuple):
    """Small launches the model charges ``cost.LAUNCH_US`` each for. ``merge``: per statistics forward, the
    splits merged and finalised (torch ops on the [fields, splits, rows] partials); ``chunk``: per eager
    chunk besides its statistics kernel and merge (the loss's per-token math, the dz coefficients, the
    normalisers, the masks, the gradient kernel); ``call``: per call (validation, the targets, the
    reductions, the gradients' scaling; on the composable path the backward's own small ops)."""

    merge: int
    chunk: int
    call: int


# As a trace of the aten ops and kernel launches of one forward and backward counts them with the losses'
# defaults (tests/test_triton_launches.py); other ops take the largest. Per composable backward block: the
# gradient kernel (its two cuBLAS products are priced as products).
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
# The teacher fold (eager distillation): its partials, and the small ops of its frame and split merge
# (partials.merge_teacher_sweep), per eager chunk; tests/test_triton_launches.py counts them with the rest.
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


def _forward_passes(w: cost.Workload, n: int, gpu: cost.GPUSpec, cfg: TileConfig, precision: str, prefix: str,
                    store_bytes: float = 0.0, teacher_product: bool = True) -> list:
    """The statistics kernel over ``n`` rows: products, operand traffic (the weight once per group of row
    blocks, which share it through L2), the programs the last wave leaves idle, and the split merge.
    ``teacher_product``: the teacher's product is formed in the tile (the eager path's comes from cuBLAS)."""
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
    if w.op == "distill_jsd" and teacher_product:  # the mixture's second sweep (the eager path's: _eager_plan)
        passes.append(_pass(f"{prefix}: JSD pass", flops, traffic, math_key, efficiency=tile, launches=1))
    return passes


def _teacher_d(w: cost.Workload) -> int:
    return (w.teacher_d or w.d) if w.has_teacher else 0


def _cublas_math(dtype: str, allow_tf32: bool, gpu: cost.GPUSpec) -> str:
    if dtype in ("bfloat16", "float16"):
        return dtype
    if dtype == "float64":
        return "float64" if "float64" in gpu.tflops else "float32"
    return "tf32" if allow_tf32 else "float32"


def plan(workload: cost.Workload, gpu: cost.GPUSpec, free_bytes: Optional[int] = None, *,
         tiles: Optional[TileConfig] = None, eager_tiles: Optional[TileConfig] = None,
         workspace_mb: Optional[float] = None, workspace: Optional[int] = None, precision: Optional[str] = None,
         allow_tf32: bool = False, path: Optional[str] = None) -> cost.Plan:
    """This backend's execution of ``workload`` on ``gpu`` as a ``cost.Plan``: the eager 3-product path for a
    row-local loss when the model finds it cheaper, else the composable statistics op (forward, then the
    gradient kernel and two cuBLAS products per vocabulary chunk). ``params`` carries what the backend runs
    with: ``tiles``, ``forward_grid``, ``row_chunk`` and ``vocab_chunk`` (composable), ``eager_rows``,
    ``workspace_bytes`` (``workspace``, in bytes, or ``workspace_mb`` fix it; else the free memory sizes it).
    ``tiles`` / ``eager_tiles`` (the composable and the eager path's) default to the first candidates (what the
    autotuner starts from); ``path`` ("eager" or "composable") asks for one path instead of the cheaper."""
    student = "heavy" if workload.op == "token_logprobs_entropy" else "lean"
    kind = "teacher" if workload.has_teacher else student
    dtype = getattr(torch, workload.dtype)
    cfg = tiles or candidates(dtype, kind)[0]
    eager_cfg = eager_tiles or candidates(dtype, student, "eager")[0]
    precision = precision or ("tf32" if allow_tf32 else "tf32x3")
    if path not in (None, "eager", "composable"):
        raise ValueError(f"path must be None, 'eager' or 'composable', got {path!r}")
    if workspace is not None and (isinstance(workspace, bool) or not isinstance(workspace, int) or workspace < 1):
        raise ValueError(f"workspace must be a positive int of bytes or None, got {workspace!r}")
    budget = workspace if workspace is not None else workspace_budget(workspace_mb, free_bytes, gpu)
    if path == "eager":
        return _eager_plan(workload, gpu, eager_cfg, precision, allow_tf32, budget)
    composable = _composable_plan(workload, gpu, cfg, precision, allow_tf32, budget)
    grads = workload.hidden_grad or workload.weight_grad
    if path == "composable" or not (workload.row_local and grads):
        return composable
    eager = _eager_plan(workload, gpu, eager_cfg, precision, allow_tf32, budget)
    model = workload
    if workload.dtype not in gpu.tflops:  # a model without float64 rates: compare the two paths at fp32's
        model = dataclasses.replace(workload, dtype="float32")
    try:
        faster = cost.evaluate(eager, model, gpu).model_ms <= cost.evaluate(composable, model, gpu).model_ms
    except Exception as exc:  # the choice is a matter of speed: either path runs correctly
        cost.unpriced(f"the Triton plans of {workload}", exc)
        # without prices: the eager path (3 products instead of 4) where the workspace holds 128 rows of its
        # chunks (or every row), as the CUDA backend's rule
        rows = budget // eager_row_bytes(workload.v, workload.dtype, workload.has_teacher)
        faster = rows >= min(workload.n, 128)
    return eager if faster else composable


def _common_params(w: cost.Workload, gpu: cost.GPUSpec, cfg: TileConfig, precision: str, budget: int) -> dict:
    return dict(tiles=dataclasses.asdict(cfg), precision=precision if w.dtype == "float32" else "native",
                teacher_products=float(w.has_teacher),
                forward_grid=grid_of(w.n, w.v, cfg, gpu, w.dtype),
                workspace_bytes=budget, eager_rows=eager_rows(w.n, w.v, w.dtype, w.has_teacher, budget, cfg))


def _gradient_products(w: cost.Workload, gpu: cost.GPUSpec, rows: int, cols: int, math: str,
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


def _call_ops(w: cost.Workload) -> cost.Pass:
    """The call's own small ops (``SmallLaunches.call``): [tokens] vectors, ~1 KB per token in all."""
    return _pass("small ops of the call", 0.0, 1024.0 * w.n, "cuda_core", launches=small_launches(w.op).call)


def _composable_plan(w: cost.Workload, gpu: cost.GPUSpec, cfg: TileConfig, precision: str, allow_tf32: bool,
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


def _eager_plan(w: cost.Workload, gpu: cost.GPUSpec, cfg: TileConfig, precision: str, allow_tf32: bool,
                budget: int) -> cost.Plan:
    """Per row chunk: the teacher's raw logits through cuBLAS into the workspace (an fp32-output product whose
    C write is its epilogue), the student's forward keeping its tiles (with no teacher product), the teacher
    fold over the kept tiles (and the JSD's second sweep); then dx from the kept tiles and the two cuBLAS
    gradient products (``eager_gradients``)."""
    e, acc, e_dx = _sizes(w.dtype)
    params = _common_params(w, gpu, cfg, precision, budget)
    rows = params["eager_rows"]
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
            passes.append(cost.Pass("eager logits: teacher (cuBLAS)", flops=2.0 * m * w.v * dt,
                                    hbm_bytes=(m + w.v) * dt * e + out, math=cublas,
                                    efficiency=cost.gemm_efficiency(m, w.v, dt, gpu), fixed_us=cost.LAUNCH_US,
                                    epilogue_bytes=out))
        passes += _forward_passes(w, m, gpu, cfg, precision, "eager logits", store_bytes=m * w.v * acc,
                                  teacher_product=False)
        if w.has_teacher:
            # the fold reads the teacher's kept tile once (and the student's, for a KL); for a reverse KL each of
            # its programs first reads, per row, the forward tile holding the student's maximum and x_t at the
            # first maximum column (ztm; a 32-byte sector); its partials are written, then merged (~4 passes)
            fold_splits = elementwise_grid(m, w.v, TEACHER_FOLD_TILES, gpu)[2]
            fold_partials = TEACHER_FOLD_FIELDS * fold_splits * m * acc
            tiles_read = 1 if w.op == "distill_jsd" else 2
            ztm = fold_splits * m * (cfg.block_v * acc + 32) if w.op == "distill_reverse_kl" else 0
            passes.append(_pass("eager teacher fold", 0.0, tiles_read * m * w.v * acc + ztm + 5 * fold_partials,
                                "cuda_core", launches=1 + TEACHER_FOLD_MERGE_LAUNCHES))
            if w.op == "distill_jsd":
                passes.append(_pass("eager JSD pass", 0.0, 2 * m * w.v * acc, "cuda_core", launches=2))
        passes[first:] = [dataclasses.replace(p, count=count) for p in passes[first:]]
    dx_bytes = w.n * w.v * e_dx
    # dx: the kept logits read back, dx written over them (in place for fp32 / float64, packed for bf16 / fp16)
    passes.append(_pass("eager dx from the kept logits", 0.0, logits + dx_bytes, "cuda_core",
                        launches=chunks * small_launches(w.op).chunk))
    passes += _gradient_products(w, gpu, rows, w.v, cublas, dx_bytes)
    passes.append(_call_ops(w))
    return cost.Plan(backend="triton", path="eager", products=1.0 + int(w.hidden_grad) + int(w.weight_grad),
                     passes=passes, params=params)


def workload_of(p: StatsProblem, needs: GradientNeeds, row_local: bool) -> cost.Workload:
    """The cost model's description of a problem with these gradients (``cost.Workload.of``)."""
    return cost.Workload.of(p, row_local=row_local, hidden_grad=needs.hidden, weight_grad=needs.weight)


def gpu_of(device: torch.device) -> cost.GPUSpec:
    """The GPU a problem runs on (``backends.device_gpu``, the CUDA backend's too); the H200 the model targets
    for CPU (interpreter) and meta tensors."""
    return backends.device_gpu(device)


_free_bytes = backends.free_bytes  # fixed per device for the process (core/backends.py)


def _plan_of(p: StatsProblem, needs: GradientNeeds, path: Optional[str], tiles: Optional[TileConfig] = None):
    """``plan`` for a problem at run time: its device, its free memory, its tiles (``tiles``: the given path's)
    and precision."""
    dev = p.hidden.device
    capability = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    target = device_target(dev)
    # Only the tiles of the path(s) the plan weighs, and tuned only for the path taken: choosing between the
    # paths (path None) compares them with the untuned tiles, so an eager call never times composable kernels.
    tune = path is not None
    cfg = (tiles if tiles is not None and path == "composable" else None if path == "eager"
           else tiles_for(p, tune=tune))
    eager_cfg = (tiles if tiles is not None and path == "eager" else None if path == "composable"
                 else tiles_for(p, "eager", tune=tune))
    return plan(workload_of(p, needs, row_local=path != "composable"), gpu_of(dev), _free_bytes(dev), tiles=cfg,
                eager_tiles=eager_cfg, workspace_mb=p.workspace_mb, precision=fp32_precision(p, capability, target),
                allow_tf32=_allow_tf32(p), path=path)


def _allow_tf32(p: StatsProblem) -> bool:
    """The problem's ``allow_tf32`` when the caller set it, else ``FUSEDLOSS_ALLOW_TF32`` (default: no)."""
    if p.allow_tf32 is None:
        return bool(config.from_environment().allow_tf32)
    return bool(p.allow_tf32)


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
        """The eager path's kept tiles as a Head (c, z_t, row stride); the student head when unused."""
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
    """With ``store`` (the eager path) the teacher is no product of the forward: for a reverse KL it only keeps
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
    # the kept teacher tile is the raw product (eager path): its transform is applied as it is loaded
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
    the eager path's (c, z_t) workspace views to keep the tiles in; ``named_logits``: ``[N, K]`` zeros that
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


def _eager_statistics(p: StatsProblem, cfg: TileConfig, elementwise: TileConfig, store: tuple) -> dict:
    """``_statistics`` of an eager row chunk whose tiles the forward keeps in ``store`` (c, x_t): with a teacher,
    ``store[1]`` already holds its raw logits (cuBLAS); the student's forward gives the student's partials (and,
    in ztm's slot, the first column of the tile holding the first maximum), the teacher fold (``elementwise``
    tiles) ztm and the teacher's partials relative to the student's final (m, ztm), and both are finalised
    together as ``_finalized`` does (docs/design.md, "The Triton teacher on the eager path")."""
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
    a vocabulary-parallel head needs them (core/backends.py, ``JsdBackend``; docs/design.md, "Distributed").
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


def _capabilities(device: torch.device):
    """What this torch's products can do on the device (fp32 outputs of half operands; beta = 1 accumulation
    into fp32 inside the GEMM), probed once per device by the CUDA backend's probe, which warns once when
    either is missing: the products then take the slower form, never silently."""
    from ..cuda import backend as cuda_backend

    return cuda_backend._capabilities(device)


def _product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out = a @ b`` (``out += a @ b`` when ``accumulate``), summed in ``out``'s dtype (fp32 or float64)
    whatever the operands' (cuBLAS's fp32-output GEMM for bf16/fp16 operands, accumulating with beta = 1)."""
    caps = _capabilities(a.device)
    if a.dtype != out.dtype and not caps.out_dtype:
        # the interpreter's host products (no mixed-dtype GEMM on the CPU), or a torch without them (warned)
        a, b = a.to(out.dtype), b.to(out.dtype)
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif not accumulate:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif caps.accumulate:
        torch.baddbmm(out[None], a[None], b[None], out_dtype=out.dtype, out=out[None])
    else:
        out.add_(torch.mm(a, b, out_dtype=out.dtype))


def _direct_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> None:
    """``out = a @ b`` in ``out``'s own (half) dtype: summed in ``acc`` and rounded once, with no fp32 block
    and copy (cuBLAS's half GEMM accumulates in fp32; on the CPU, the interpreter's host, an ``acc`` product)."""
    if a.device.type == "cuda":
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a.to(acc), b.to(acc)))


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
    """The eager chunk's half-precision dx over its kept fp32 tile (``dx``: the tile's 16-bit view, ``[rows,
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


def _masked_rows(h: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """h with the rows that carry no gradient zeroed: dx is 0 there, but 0 * NaN is not (NaN padding rows
    of a fully masked attention must stay out of d weight)."""
    return torch.where(active[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))


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
        h_w = _masked_rows(h, carries) if need_w else None
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
                    _product(dh_acc[r0:r1], dx, w[v0:v1], accumulate=v0 > 0)
                if need_w and direct and w.dtype != acc:
                    _direct_product(dw_out, dx.T, h_w[r0:r1], acc)
                elif need_w:
                    _product(dw_out, dx.T, h_w[r0:r1], accumulate=r0 > 0)
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
# Eager path: 3 products for losses known in the forward (core/eager.py)


def eager_pays(p: StatsProblem) -> bool:
    """Whether the cost model puts the eager path below the composable one for this problem (on CPU tensors,
    i.e. the interpreter, the model of the H200 decides, so tests take the path a GPU would)."""
    needs = GradientNeeds(p.hidden.requires_grad, p.weight.requires_grad, p.bias is not None and p.bias.requires_grad)
    if not (needs.hidden or needs.weight):
        needs = GradientNeeds(True, True, needs.bias)
    return _plan_of(p, needs, None).path == "eager"


def eager_gradients(p: StatsProblem, chunk_fn, needs: GradientNeeds, *, tiles: Optional[TileConfig] = None):
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
    cfg = tiles or tiles_for(p, "eager")
    with _on_device(h), _cublas_tf32(dev, _allow_tf32(p)):
        step = _plan_of(p, needs, "eager", cfg).params["eager_rows"]
        elementwise = cfg if dev.type == "cpu" else ARCH_ELEMENTWISE_TILES.get(tile_family(device_target(dev)),
                                                                               ELEMENTWISE_TILES)
        # Rows of a whole number of both kernels' tiles: they move the kept tiles without a column mask.
        ld = _cdiv(v, _eager_row_align(cfg, elementwise)) * _eager_row_align(cfg, elementwise)
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
                _product(zt_ws[:m, :v], th, teacher_weight.T, accumulate=False)
            stats = _eager_statistics(part, cfg, elementwise, store)
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
                _product(dh[r0:r1], dx, w, accumulate=False)
            if dw is not None:
                _product(dw, dx.T, _masked_rows(part.hidden, (coeffs != 0).any(dim=0)), accumulate=r0 > 0)
            if db is not None:  # from dx as formed, never from its rounded copy (problem.py)
                db += dx.sum(0, dtype=acc) if sums is None else sums[:_cdiv(m, elementwise.block_m), :v].sum(0)
    return loss, (dh, dw, db)
