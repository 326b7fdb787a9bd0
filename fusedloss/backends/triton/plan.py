"""The Triton backend's plan: tiles, grids, chunks, the workspace and the path, pure functions of a problem's
shapes, its GPU and its workspace (no tensors allocated, nothing launched; ``backend.py`` runs what they decide).
``plan`` decides a call by the named rules of ``backends/rules.py`` and describes it as a
``fusedloss.core.workload.PlanChoice``, which the performance model prices (``benchmarks/model/triton.py``;
docs/design.md, "Plans and the performance model").

Memory
    Besides the gradients, O(N) per-row vectors and the ``[F, splits, N]`` partials (F = len(partials.FIELDS)):
    an fp32 ``[N, D]`` accumulator for d hidden (when hidden is not fp32/float64), and one workspace of at most
    the problem's ``workspace_mb`` (None: a share of the free device memory, bounded; ``workspace_budget``): the
    dx block of a vocabulary chunk and, when the rows take several chunks, its fp32 d weight block (with one
    row chunk each block is one product straight into the weight's dtype), or, on the grad-in-forward path, a row
    chunk's logits. Nothing
    of size N x V. The grad-in-forward path returns fp32 (float64) gradients, so d weight is a ``[V, D]`` fp32 buffer
    there, as on the other backends.

Compilation
    N, V, D, the grid sizes and the chunk offsets are runtime values that Triton does not specialise on, and
    the tile configuration depends on (dtype, D bucket, teacher) only (``tiles_for``): one compiled variant
    per kernel and feature set serves every sequence length. With ``TRITON_INTERPRET=1`` (set before this
    module's kernels are first used) the kernels run on CPU tensors in Triton's interpreter: slow, for tests.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Optional

import torch

from ... import config
from ...core import registry
from ...core.problem import GradientNeeds, StatsProblem
from ...core.workload import GPU, PlanChoice, Workload
from .. import gpu, rules

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
# and the performance model). A 128 x 128 tile on 8 warps holds 64 fp32 values per thread per tile-sized temporary:
# enough for the lean epilogue, a spill for the heavy ones, which take 64 x 128; a teacher's second product
# and its statistics fit 64 x 64 (64 x 128 sits at 255 registers and spills with some feature sets). fp32
# operands step K by 16: tf32x3 holds each operand as two tf32 halves in registers, and a 32-wide step spills
# on Triton 3.6 (docs/design.md, "Triton versions"). Each candidate compiles for sm_90 to wgmma without spills
# and within 227 KB of shared memory on every supported Triton (tests/contract/test_triton_kernels.py).
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
# The grad-in-forward path's forward also stores each capped logits tile for the gradient pass: that store holds a tile
# more in registers, so it runs on tiles with more headroom where the epilogue needs it (and, forming the logits
# once, shares its tile with no other kernel). The lean half forward keeps the 128 x 128 tile with its store
# (255 registers, no spill on Triton 3.6.0 and 3.9.0, with and without a bias). A teacher is no product of the
# grad-in-forward forward: cuBLAS forms its raw logits into the workspace, the student's forward (the lean or heavy
# epilogue of its own features) keeps only which of its tiles holds the row's first maximum, and the teacher
# fold reads the teacher's logit there and forms the teacher's statistics from the kept tiles (docs/design.md,
# "The Triton teacher on the grad-in-forward path"); a tile forming both products grew no larger than 64 x 64 without
# spilling, on every supported Triton. Not tuned: one configuration per class.
GRAD_IN_FORWARD_TILES = {
    ("half", "lean"): TileConfig(128, 128, 64, 8, 4),
    ("half", "heavy"): TileConfig(64, 64, 64, 8, 4),
    ("fp32", "lean"): TileConfig(128, 64, 16, 8, 3),
    ("fp32", "heavy"): TileConfig(64, 64, 16, 8, 3),
    ("fp64", "lean"): TileConfig(32, 32, 32, 4, 1),
    ("fp64", "heavy"): TileConfig(32, 32, 32, 4, 1),
}
# The grad-in-forward path's gradient pass reads the kept logits back: no product, so no reason to share the forward's
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
# (LDS) with every supported Triton (tests/tooling/test_compile_triton_kernels.py, "--arch").
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
ARCH_GRAD_IN_FORWARD_TILES: dict = {
    # B200/GB200/B300 (tcgen05): the grad-in-forward forward's 128 x 128 tile and its logits store spill 80-132 bytes
    # per
    # thread; 64 x 128 none (198-232 registers).
    "sm_100": {("half", "lean"): TileConfig(64, 128, 64, 8, 4)},
    "sm_120": {("half", "lean"): TileConfig(64, 128, 64, 8, 4)},
    "gfx942": {("half", "lean"): TileConfig(128, 128, 64, 8, 3)},
}
# The grad-in-forward gradient pass's tile where ELEMENTWISE_TILES does not hold (none yet: on sm_120 8 warps spared
# Triton
# 3.6.0 a 4-byte spill of a teacher's terms and gave 3.7.1 one of its own).
ARCH_ELEMENTWISE_TILES: dict = {}
# Shared memory (LDS on AMD) one block may hold, per tile family: what the default tiles must fit.
SHARED_LIMITS = {"sm_90": 227 * 1024, "sm_100": 227 * 1024, "sm_120": 99 * 1024, "gfx942": 64 * 1024,
                 "gfx950": 160 * 1024}


def device_target(device: torch.device) -> str:
    """The architecture the kernels compile for on ``device``: ``sm_<major><minor>`` on NVIDIA, the ``gfx`` name
    on AMD (ROCm); "sm_90" (the H200 the rules were set for) for CPU and meta tensors."""
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
    grad-in-forward path the teacher is no product of the forward: its student's)."""
    if p.has_teacher and path != "grad_in_forward":
        return "teacher"
    heavy = p.want_entropy or p.want_extras or p.want_mean_logit or p.transform.softcap is not None
    return "heavy" if heavy else "lean"


def candidates(dtype: torch.dtype, kind: str, path: str = "composable", target: str = "sm_90") -> tuple:
    """The tile configurations a problem class may run with on a GPU of ``target`` (``device_target``; the
    first: the default)."""
    key, family = (_dtype_class(dtype), kind), tile_family(target)
    if path == "grad_in_forward":
        return (ARCH_GRAD_IN_FORWARD_TILES.get(family, {}).get(key, GRAD_IN_FORWARD_TILES[key]),)
    return ARCH_CANDIDATES.get(family, {}).get(key, GPU_CANDIDATES[key])


def d_bucket(d: int) -> int:
    """The hidden sizes that share a tuning result: the power of two at or above D (at most 16384)."""
    return min(16384, 1 << max(0, (d - 1).bit_length()))


# Tuning results of this process, one per (device, dtype, D bucket, epilogue): N, V and the exact D never enter
# the key, so no sequence length retunes (or recompiles).
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
# Grids, chunks and the plan: the same functions size the launches and the performance model's passes


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


def weight_stream_steps(v: int, cfg: TileConfig, gpu: GPU, dtype: str) -> float:
    """The time to stream a half-precision weight [V, D] from HBM once, in tile steps of one program (a
    BLOCK_M x BLOCK_V x D product at the GPU's rate shared by its SMs, ``GPU.half_flops_per_byte``); D cancels.
    0 where the products are far slower than the stream (fp32, float64) and for the interpreter's fixed slots."""
    if cfg.slots is not None or dtype not in ("bfloat16", "float16"):
        return 0.0
    flops_per_byte = gpu.half_flops_per_byte
    return _cdiv(v, cfg.block_v) * _BYTES[dtype] * flops_per_byte / (2.0 * gpu.sm_count * cfg.block_m)


def grid_of(n: int, v: int, cfg: TileConfig, gpu: GPU, dtype: str) -> tuple:
    """``forward_grid`` of ``n`` rows for these tiles on this GPU."""
    return forward_grid(n, v, cfg.block_m, cfg.block_v, cfg.slots or gpu.sm_count,
                        weight_stream_steps(v, cfg, gpu, dtype))


def rule_grid(n: int, v: int, cfg: TileConfig, gpu: GPU, dtype: str) -> rules.ForwardGrid:
    """What the rules weigh of the forward's grid over ``n`` rows (``rules.ForwardGrid``): the weight streamed once
    per group of row blocks, and the tile steps of the last wave left idle (as a share of the busy ones)."""
    if n < 1:
        return rules.ForwardGrid(0, 0.0)
    row_blocks, per, splits, group = grid_of(n, v, cfg, gpu, dtype)
    slots = cfg.slots or gpu.sm_count
    busy = row_blocks * _cdiv(v, cfg.block_v)
    return rules.ForwardGrid(_cdiv(row_blocks, group), _cdiv(row_blocks * splits, slots) * slots * per / busy - 1.0)


def elementwise_grid(n: int, v: int, cfg: TileConfig, gpu: GPU) -> tuple:
    """``forward_grid`` of an elementwise sweep over the grad-in-forward workspace (the teacher fold, the JSD's second
    sweep): the same whole waves of (row block, split) programs, no weight to stream."""
    return forward_grid(n, v, cfg.block_m, cfg.block_v, cfg.slots or gpu.sm_count, 0.0)


GRADIENT_GROUP = 8  # row blocks per group of the gradient kernel's one-tile programs (the matmul swizzle)

# The floor of the workspace policy (``gpu.workspace_bytes``): enough for useful chunks (Triton's are cut to any
# size). The policy's cap, priced by the model at 2 GiB instead of 4 at N = 16384, V = 151936: +7% for
# cross-entropy, +7% for distillation.
MIN_WORKSPACE = 64 << 20


def workspace_budget(workspace_mb: Optional[float], free_bytes: Optional[int], gpu_spec: GPU) -> int:
    """Bytes of workspace for one call (``gpu.workspace_bytes``): ``workspace_mb`` if given (problem field or
    FUSEDLOSS_WORKSPACE_MB), else 1/8 of the free memory (half the GPU's memory if unknown) within
    [64 MiB, 4 GiB]; fixed at 1 GiB in deterministic mode."""
    if workspace_mb is None:
        workspace_mb = config.from_environment().workspace_mb
    else:
        workspace_mb = config.workspace_megabytes(workspace_mb, "workspace_mb")
    free = gpu_spec.memory_bytes // 2 if free_bytes is None else free_bytes
    return gpu.workspace_bytes(workspace_mb, free, MIN_WORKSPACE, fixed=workspace_mb is None and deterministic())


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


def _grad_in_forward_row_align(cfg: TileConfig, elementwise: TileConfig) -> int:
    return max(cfg.block_v, elementwise.block_v)


def grad_in_forward_row_bytes(v: int, dtype: str, teacher: bool) -> int:
    """Workspace bytes per row of a grad-in-forward chunk: the capped logits (and the teacher's) in the accumulation
    dtype, rows padded to whole tiles. dx takes no bytes of its own: in place for fp32 / float64, and for
    bf16 / fp16 packed over the fp32 tile it is computed from (``packed_gradient_kernel``)."""
    e, acc, e_dx = _sizes(dtype)
    ld = _cdiv(v, ELEMENTWISE_TILES.block_v) * ELEMENTWISE_TILES.block_v
    return ld * acc * (2 if teacher else 1)


def grad_in_forward_rows(n: int, v: int, dtype: str, teacher: bool, budget: int, cfg: TileConfig) -> int:
    """Rows of one grad-in-forward chunk within the budget, a multiple of BLOCK_M (at least one row block)."""
    rows = budget // grad_in_forward_row_bytes(v, dtype, teacher) // cfg.block_m * cfg.block_m
    return max(cfg.block_m, min(rows, _cdiv(n, cfg.block_m) * cfg.block_m))


def plan(workload: Workload, gpu: GPU, free_bytes: Optional[int] = None, *,
         tiles: Optional[TileConfig] = None, grad_in_forward_tiles: Optional[TileConfig] = None,
         workspace_mb: Optional[float] = None, workspace: Optional[int] = None, precision: Optional[str] = None,
         allow_tf32: bool = False, path: Optional[str] = None) -> PlanChoice:
    """This backend's execution of ``workload`` on ``gpu``: the grad-in-forward 3-product path for a row-local loss
    where the rule ``rules.triton_grad_in_forward`` takes it, else the composable statistics op (forward, then the
    gradient kernel and two cuBLAS products per vocabulary chunk). ``params`` carries what the backend runs
    with: ``tiles``, ``forward_grid``, ``row_chunk`` and ``vocab_chunk`` (composable), ``grad_in_forward_rows``,
    ``workspace_bytes`` (``workspace``, in bytes, or ``workspace_mb`` fix it; else the free memory sizes it).
    ``tiles`` / ``grad_in_forward_tiles`` (the composable and the grad-in-forward path's) default to the first
    candidates (what the autotuner starts from); ``path`` ("grad_in_forward" or "composable") asks for one path
    instead of the rule's. The performance model (``benchmarks/model/triton.py``) prices the same choice."""
    cfg, grad_in_forward_cfg, precision = _plan_tiles(workload, tiles, grad_in_forward_tiles, precision, allow_tf32)
    if path not in (None, "grad_in_forward", "composable"):
        raise ValueError(f"path must be None, 'grad_in_forward' or 'composable', got {path!r}")
    if workspace is not None and (isinstance(workspace, bool) or not isinstance(workspace, int) or workspace < 1):
        raise ValueError(f"workspace must be a positive int of bytes or None, got {workspace!r}")
    budget = workspace if workspace is not None else workspace_budget(workspace_mb, free_bytes, gpu)
    grads = int(workload.hidden_grad) + int(workload.weight_grad)
    reason = None
    if path is None:
        path = "composable"
        if workload.row_local and grads:
            rows = grad_in_forward_rows(workload.n, workload.v, workload.dtype, workload.has_teacher, budget,
                                        grad_in_forward_cfg)
            back_rows, back_cols = backward_chunks(workload.n, workload.v, workload.d, workload.dtype, budget, cfg)
            m, last = min(rows, workload.n), workload.n % rows if workload.n > rows else 0
            streams = _cdiv(workload.n, min(back_rows, workload.n)) * _cdiv(
                _cdiv(min(back_rows, workload.n), cfg.block_m), GRADIENT_GROUP)
            pays, why = rules.triton_grad_in_forward(
                workload, gpu, rows, back_rows, back_cols, forward=rule_grid(workload.n, workload.v, cfg, gpu,
                                                                             workload.dtype),
                chunk=rule_grid(m, workload.v, grad_in_forward_cfg, gpu, workload.dtype),
                last_chunk=rule_grid(last, workload.v, grad_in_forward_cfg, gpu, workload.dtype),
                backward_streams=streams)
            path = "grad_in_forward" if pays else "composable"
            reason = f"{path}: {why}"
    if path == "grad_in_forward":
        params = _common_params(workload, gpu, grad_in_forward_cfg, precision, budget)
        products = 1.0 + grads
    else:
        params = _common_params(workload, gpu, cfg, precision, budget)
        if grads:
            rows, cols = backward_chunks(workload.n, workload.v, workload.d, workload.dtype, budget, cfg)
            params.update(row_chunk=rows, vocab_chunk=cols)
        products = 1.0 + (1.0 + grads if grads else 0.0)
    if reason is not None:
        params["reason"] = reason
    return PlanChoice(backend="triton", path=path, products=products, params=params)


def _plan_tiles(workload: Workload, tiles, grad_in_forward_tiles, precision, allow_tf32) -> tuple:
    """(composable tiles, grad-in-forward tiles, fp32 precision) of a plan: the given ones, else the first
    candidates and tf32x3 (tf32 where allowed)."""
    student = "heavy" if workload.op == "token_logprobs_entropy" else "lean"
    kind = "teacher" if workload.has_teacher else student
    dtype = getattr(torch, workload.dtype)
    cfg = tiles or candidates(dtype, kind)[0]
    grad_in_forward_cfg = grad_in_forward_tiles or candidates(dtype, student, "grad_in_forward")[0]
    return cfg, grad_in_forward_cfg, precision or ("tf32" if allow_tf32 else "tf32x3")


def _common_params(w: Workload, gpu: GPU, cfg: TileConfig, precision: str, budget: int) -> dict:
    return dict(tiles=dataclasses.asdict(cfg), precision=precision if w.dtype == "float32" else "native",
                teacher_products=float(w.has_teacher),
                forward_grid=grid_of(w.n, w.v, cfg, gpu, w.dtype),
                workspace_bytes=budget, grad_in_forward_rows=grad_in_forward_rows(w.n, w.v, w.dtype, w.has_teacher,
                                                                                  budget, cfg))


def workload_of(p: StatsProblem, needs: GradientNeeds, row_local: bool) -> Workload:
    """The plan's description of a problem with these gradients (``Workload.of``)."""
    return Workload.of(p, row_local=row_local, hidden_grad=needs.hidden, weight_grad=needs.weight)


def gpu_of(device: torch.device) -> GPU:
    """The GPU a problem runs on (``registry.device_gpu``, the CUDA backend's too); the H200 for CPU (interpreter)
    and meta tensors."""
    return registry.device_gpu(device)




def _allow_tf32(p: StatsProblem) -> bool:
    """The problem's ``allow_tf32`` when the caller set it, else ``FUSEDLOSS_ALLOW_TF32`` (default: no)."""
    if p.allow_tf32 is None:
        return bool(config.from_environment().allow_tf32)
    return bool(p.allow_tf32)

