"""The plans' choices, as named rules: which path a call takes and how its grad-in-forward rows are grouped.

Each rule is a plain function of the call's shapes (``core/workload.py``), the shapes its backend's plan can run
(chunks, groups, tiles) and one figure of the GPU, the balance of its products' rate and its bandwidth
(``GPU.flops_per_byte``), which weighs bytes against flops, with its SM count where a grid's waves matter; no
rate, efficiency or time. The rules weigh each candidate's GEMM-sized products (flops, at the share of a tile's
work their tile shapes fill, or the bytes they stream where that takes longer), the traffic the products cannot
hide and the small launches, as bytes, with the named constants below saying what each candidate moves and why.
``tests/tooling/test_model_plan_rules.py`` prices the rules' choices with the performance model (``benchmarks/model/``,
docs/design.md, "Plans and the performance model") against every plan the backend could run, over a grid of
shapes, dtypes, GPUs and workspaces, and pins how often and how far they miss the cheapest. A choice is a matter
of speed, never of correctness: every path runs any shape the rules may give it.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.workload import GPU, Workload

# ------------------------------------------------------------------------------------------------
# Grad-in-forward (3 products) or composable (4)
# ------------------------------------------------------------------------------------------------

# [V, D] bytes per entry the grad-in-forward backward's scaling of the d weight the forward wrote reads, beyond the
# d weight it writes in its own dtype: the forward's d weight, in fp32 where it was accumulated there (several
# groups; fp16 always, whose accumulator follows the chunks' power-of-two scales), else in its own dtype. Deferred
# d weight (bf16) moves none: the backward forms it once.
D_WEIGHT_SCALING_READ_BYTES = {"accumulated": 4, "bfloat16": 2, "float16": 2, "float32": 4}
# [V, D] bytes per entry each further beta = 1 accumulation of the fp32 d weight reads and writes.
ACCUMULATION_BYTES = 8
# Bytes per logit fp16's grad-in-forward dx moves beyond the composable path's: it is formed in fp32 in place
# (4 written) and pre-scaled into an fp16 copy by torch ops (4 read, 2 written, and its maximum's 4 read before):
# GradScaler's scale is not known in the forward.
FP16_DX_EXTRA_BYTES = 12
# What one small launch costs, as HBM bytes: a kernel or torch op on a few [rows] vectors costs the gap between
# back-to-back launches, ~3 us, whatever its bytes; in that time a GPU in the geometric middle of the supported
# ones' bandwidths (0.7-7 TB/s: ~2.7 TB/s, about an H100's) streams ~8 MB. Many small chunks or tiles lose more to
# their launches than a grouped d weight saves, and at a handful of rows the choice is launches against one more
# stream of the weight. A fixed byte count is off by at most ~3x at either end of the range of bandwidths (the
# rules know no rate: docs/design.md, "Plans and the performance model").
LAUNCH_BYTES = 8e6
# Small launches of a CUDA grad-in-forward chunk beside its products and kernels, as a trace of the aten ops of
# one forward and backward counts them with the losses' defaults (tests/tooling/test_cost_model_cuda_launches.py): the
# loss module's autograd on [rows] vectors, the dz coefficients, the masks; other ops take the most.
CUDA_CHUNK_LAUNCHES = {"cross_entropy": 20, "grpo": 41, "distill_reverse_kl": 13, "distill_forward_kl": 14,
                       "distill_jsd": 18}
CUDA_CHUNK_LAUNCHES_DEFAULT = 41


# cuBLAS's products (the gradients, the grad-in-forward teacher's logits) run on output tiles of 128 x 256: a
# product of 7 rows does a 128-row tile's work. Each tile's prologue and epilogue cost about as long as 64 steps
# of its main loop over k, which a short k (d weight over a few rows) does not hide.
CUBLAS_TILE = (128, 256)
CUBLAS_TILE_FIXED_K = 64


def cublas_share(m: float, n: float, k: float) -> float:
    """The share of the products' peak a cuBLAS product with an [m, n] output over k keeps: its output tiles'
    filled share (``CUBLAS_TILE``) and its main loop's share of each tile's time (``CUBLAS_TILE_FIXED_K``)."""
    tm, tn = CUBLAS_TILE
    if m <= 0 or n <= 0 or k <= 0:
        return 1.0
    filled = (m * n) / (-(-m // tm) * tm * -(-n // tn) * tn)
    return filled * k / (k + CUBLAS_TILE_FIXED_K)


def _product(balance: float, m: float, n: float, k: float, count: float, streamed: float, after: float) -> float:
    """Flop-equivalents of ``count`` products [m, n] over k: their flops at the share of the peak their tiles keep
    (``cublas_share``), or the bytes they stream (``streamed`` each) where that takes longer, plus the bytes they
    move after the main loop (``after``: C written, and read for beta = 1), which are not hidden behind the math.
    Bytes count ``balance`` flops each."""
    return count * max(2.0 * m * n * k / cublas_share(m, n, k), balance * streamed) + balance * after


def _grad_in_forward_cost(w: Workload, balance: float, chunks: int, groups: int, deferred: bool) -> float:
    """The grad-in-forward path's products and big passes in flop-equivalents: per chunk the logits (and the
    teacher's) with their fp32 output, per group d hidden and d weight (the first group's d weight written, each
    later one accumulated with beta = 1), the backward's rescaling of a d weight the forward wrote, fp16's extra dx
    passes."""
    n, v, d, b = float(w.n), float(w.v), float(w.d), w.operand_bytes
    teacher_d = float(w.teacher_d or w.d) if w.has_teacher else 0.0
    rows, group_rows = n / chunks, n / groups
    cost = _product(balance, rows, v, d, chunks, v * d * b + rows * d * b, n * v * 4)
    if teacher_d:
        cost += _product(balance, rows, v, teacher_d, chunks, v * teacher_d * b + rows * teacher_d * b, n * v * 4)
    if w.hidden_grad:
        cost += _product(balance, group_rows, d, v, groups, v * d * b + group_rows * v * b, n * d * 4)
    if w.weight_grad:
        accumulated = groups > 1 or w.dtype == "float16"
        # fp16's accumulator also follows each later chunk's power-of-two scale (read and write it once more)
        later = ACCUMULATION_BYTES * (groups - 1) * (2 if w.dtype == "float16" else 1)
        out = v * d * (later + 4) if accumulated else v * d * b
        cost += _product(balance, v, d, group_rows, groups, group_rows * (v + d) * b, out)
        if not deferred:
            cost += balance * v * d * (D_WEIGHT_SCALING_READ_BYTES["accumulated" if accumulated else w.dtype] + b)
    if w.dtype == "float16":
        cost += balance * n * v * FP16_DX_EXTRA_BYTES
    # per chunk the logits (both heads'), the fold, a JSD's sweep and dx (fp16: three pre-scaling ops more) and the
    # loss's small ops; per group d hidden, d weight and the masked hidden
    heads = 2 if w.has_teacher else 1
    per_chunk = heads + 2 + (w.op == "distill_jsd") + (3 if w.dtype == "float16" else 0)
    per_chunk += CUDA_CHUNK_LAUNCHES.get(w.op, CUDA_CHUNK_LAUNCHES_DEFAULT)
    per_group = int(w.hidden_grad) + 2 * int(w.weight_grad)
    return cost + balance * LAUNCH_BYTES * (chunks * per_chunk + groups * per_group)


def _composable_cost(w: Workload, balance: float, row_chunks: int, vocab_tiles: int) -> float:
    """The composable path's products in flop-equivalents, as ``_grad_in_forward_cost``: the logits formed twice
    (forward and backward; a JSD over several tiles once more, its second sweep), d hidden accumulated over the
    vocabulary tiles, d weight over the row chunks, and each tile's launches."""
    n, v, d, b = float(w.n), float(w.v), float(w.d), w.operand_bytes
    teacher_d = float(w.teacher_d or w.d) if w.has_teacher else 0.0
    rows, cols, tiles = n / row_chunks, v / vocab_tiles, row_chunks * vocab_tiles
    forms = 2 + (1 if w.op == "distill_jsd" and tiles > 1 else 0)
    cost = forms * _product(balance, rows, cols, d, tiles, cols * d * b + rows * d * b, n * v * 4)
    if teacher_d:
        cost += forms * _product(balance, rows, cols, teacher_d, tiles, cols * teacher_d * b + rows * teacher_d * b,
                                 n * v * 4)
    if w.hidden_grad:
        out = n * d * 4 * (2 * vocab_tiles - 1) if vocab_tiles > 1 else n * d * b
        cost += _product(balance, rows, d, cols, tiles, cols * d * b + rows * cols * b, out)
    if w.weight_grad:
        out = v * d * 4 * (2 * row_chunks - 1) if row_chunks > 1 else v * d * b
        cost += _product(balance, cols, d, rows, tiles, rows * (cols + d) * b, out)
    # per tile each formation of the logits (both heads'), the fold, a JSD's sweep, dx and the gradients' products;
    # the loss's small ops once
    heads = 2 if w.has_teacher else 1
    per_tile = forms * heads + 2 + (w.op == "distill_jsd") + int(w.hidden_grad) + int(w.weight_grad)
    small = CUDA_CHUNK_LAUNCHES.get(w.op, CUDA_CHUNK_LAUNCHES_DEFAULT)
    return cost + balance * LAUNCH_BYTES * (tiles * per_tile + small)


def cuda_grad_in_forward(w: Workload, gpu: GPU, chunks: int, groups: int, deferred: bool,
                         tile_row_chunks: int, tile_vocab_tiles: int) -> tuple[bool, str]:
    """Grad-in-forward where its products cost less than the composable path's, each product weighed at the
    larger of its flops (at the share of the peak its tiles keep, ``cublas_share``) and the bytes it streams, plus
    the bytes it writes after its main loop, bytes counted at the GPU's balance of the dtype
    (``GPU.flops_per_byte``). The grad-in-forward path forms the logits once (the composable path twice; a
    composable JSD over several tiles three times), but its chunks are as small as the workspace makes them: a
    chunk below ``balance x bytes / 2`` rows streams the weight for longer than it multiplies, each group beyond
    the first accumulates d weight once more (beta = 1, ``ACCUMULATION_BYTES``), unless d weight is deferred the
    backward rescales the [V, D] the forward wrote (``D_WEIGHT_SCALING_READ_BYTES``), fp16's dx takes two more
    passes (``FP16_DX_EXTRA_BYTES``), and every chunk and group pays its launches (``CUDA_CHUNK_LAUNCHES`` and its
    kernels', ``LAUNCH_BYTES`` each), as the composable path's tiles pay theirs. (whether, why)."""
    balance = gpu.flops_per_byte(w.dtype)
    fused = _grad_in_forward_cost(w, balance, chunks, groups, deferred)
    composable = _composable_cost(w, balance, tile_row_chunks, tile_vocab_tiles)
    if fused <= composable:
        return True, f"its products weigh {fused:.3g} flop-equivalents against the composable path's {composable:.3g}"
    return False, f"the composable path's products weigh {composable:.3g} flop-equivalents against {fused:.3g}"


# Small launches of a grad-in-forward chunk beyond its statistics kernel, as a trace of one forward and backward
# counts them with the losses' defaults (tests/tooling/test_cost_model_triton_launches.py): the loss's per-token math,
# the dz coefficients, normalisers and masks and the gradient kernel, per op (others take the most).
TRITON_CHUNK_LAUNCHES = {"cross_entropy": 20, "grpo": 41, "distill_reverse_kl": 35, "distill_forward_kl": 29,
                         "distill_jsd": 11}
TRITON_CHUNK_LAUNCHES_DEFAULT = 41
# Per statistics forward (the composable forward, each grad-in-forward chunk): the kernel and the torch ops that
# merge and finalise its splits' partials (~50).
TRITON_FORWARD_LAUNCHES = 51
# Per grad-in-forward chunk with a teacher: the teacher's cuBLAS product, the fold kernel and the ~26 small ops of
# its frame and split merge (a JSD's second sweep two more).
TRITON_TEACHER_CHUNK_LAUNCHES = 28
# The Triton products' rates relative to each other, by the tiles their kernels compile to (triton/plan.py's
# tables): a student's lean tile (128 x 128 for bf16/fp16, 128 x 64 for fp32) keeps its wgmma fed from shared
# memory at about 0.8 (0.7 for fp32's) of the products' peak; a teacher's tile (64 x 64, two products per tile,
# registers for both) at about 0.58, so a composable distillation's products take ~1.4x (fp32: ~1.2x) as long
# per flop as the grad-in-forward student's.
TRITON_STUDENT_TILE_SHARE = {"half": 0.80, "fp32": 0.70}
TRITON_TEACHER_TILE_SHARE = 0.58
class ForwardGrid(NamedTuple):
    """What a Triton statistics forward's grid (``triton/plan.py::grid_of``) costs beyond its products:
    ``streams``, how often it streams the weight from HBM (once per group of row blocks that share it through L2);
    ``idle``, the tile steps its last wave leaves idle, as a share of its products."""

    streams: int = 1
    idle: float = 0.0


def triton_grad_in_forward(w: Workload, gpu: GPU, chunk_rows: int, backward_rows: int, backward_cols: int,
                           forward: ForwardGrid = ForwardGrid(), chunk: ForwardGrid = ForwardGrid(),
                           last_chunk: ForwardGrid = ForwardGrid(), backward_streams: int = 1) -> tuple[bool, str]:
    """The Triton backend's path, weighed as ``cuda_grad_in_forward`` (each pass at the larger of its flops and the
    bytes it streams, plus the bytes it moves after a cuBLAS main loop and its small launches, bytes at the GPU's
    balance). The composable path forms the logits (both heads') in its forward (``forward``: its weight streams and
    idle wave) and again in its backward (a JSD thrice: its second sweep), on the teacher's tile where there is a
    teacher (``TRITON_TEACHER_TILE_SHARE``), the backward streaming the weight once per group of its row blocks
    (``backward_streams``) and writing dx; the grad-in-forward path forms the student's once per chunk on the
    student's tile (``chunk``, ``last_chunk``: the shorter last one's grid) and writes the logits tiles, the
    teacher's through cuBLAS (``cublas_share``: a chunk of a few rows does a whole tile's work), reads them back
    for dx (a teacher fold and a JSD's second sweep read them again) and pays each chunk's small launches
    (``LAUNCH_BYTES``). Both take d hidden and d weight through cuBLAS: the composable path over its
    blocks (d hidden accumulated over the vocabulary chunks, d weight over the row chunks, written in its dtype
    when one row chunk holds every row), the grad-in-forward path per chunk (d weight accumulated in fp32, then
    cast). (whether, why)."""
    half = w.dtype in ("bfloat16", "float16")
    share = TRITON_STUDENT_TILE_SHARE["half" if half else "fp32"]
    # rates in units of the products' peak on the tensor cores: bf16/fp16, or TF32 thirds for fp32's tf32x3
    peak_per_byte = gpu.half_flops_per_byte if half else gpu.tf32_flops_per_byte / 3
    cublas = 1.0 if half else gpu.fp32_flops_per_byte / peak_per_byte  # cuBLAS's fp32 products run without TF32
    n, v, d, e = w.n, w.v, w.d, w.operand_bytes
    acc = 8 if w.dtype == "float64" else 4
    e_dx = e if e < acc else acc
    teacher_d = (w.teacher_d or w.d) if w.has_teacher else 0
    jsd = w.op == "distill_jsd"

    def product(flops, rate, streamed, after=0.0):  # time in peak flops: flops at ``rate`` of the peak, or the stream
        return max(flops / rate, peak_per_byte * streamed) + peak_per_byte * after

    flops, all_flops = 2.0 * n * v * d, 2.0 * n * v * (d + teacher_d)
    dx = n * v * e_dx
    weight = v * (d + teacher_d) * e
    # the composable path
    tile = TRITON_TEACHER_TILE_SHARE if w.has_teacher else share
    rows, cols = min(backward_rows, n), min(backward_cols, v)
    rows_r, cols_v = -(-n // rows), -(-v // cols)
    composable = (1 + jsd) * product(all_flops, tile, forward.streams * weight) + all_flops / tile * forward.idle
    composable += product(all_flops, tile, backward_streams * weight + dx)
    composable += peak_per_byte * LAUNCH_BYTES * (TRITON_FORWARD_LAUNCHES + jsd + rows_r * cols_v)
    if w.hidden_grad:
        composable += product(flops, cublas * cublas_share(rows, d, cols), dx + rows_r * v * d * e,
                              (2 * cols_v - 1) * n * d * acc)
    if w.weight_grad:
        direct = rows_r == 1
        cast = v * d * (acc + e) if e != acc and not direct else 0
        composable += product(flops, cublas * cublas_share(cols, d, rows), dx + cols_v * n * d * e + cast,
                              v * d * e if direct else (2 * rows_r - 1) * v * d * acc)
    # the grad-in-forward path
    chunks = -(-n // chunk_rows)
    m = min(chunk_rows, n)
    fused = 0.0
    for rows_c, count, grid in ((m, n // m, chunk), (n % m, 1, last_chunk)):
        if rows_c and count:
            chunk_flops = 2.0 * rows_c * v * d
            fused += count * (product(chunk_flops, share, grid.streams * v * d * e + rows_c * v * acc)
                              + chunk_flops / share * grid.idle)
            if w.has_teacher:
                fused += count * product(2.0 * rows_c * v * teacher_d, cublas * cublas_share(rows_c, v, teacher_d),
                                         (rows_c + v) * teacher_d * e, rows_c * v * acc)
    launches = chunks * (TRITON_FORWARD_LAUNCHES + TRITON_CHUNK_LAUNCHES.get(w.op, TRITON_CHUNK_LAUNCHES_DEFAULT))
    if w.has_teacher:
        fused += peak_per_byte * n * v * acc * (3 if jsd else 2)  # the fold (and the JSD's second sweep)
        launches += chunks * (TRITON_TEACHER_CHUNK_LAUNCHES + 2 * jsd)
    fused += peak_per_byte * (n * v * acc * (2 if w.has_teacher else 1) + dx + LAUNCH_BYTES * launches)
    if w.hidden_grad:
        fused += product(flops, cublas * cublas_share(m, d, v), dx + chunks * v * d * e, n * d * acc)
    if w.weight_grad:
        cast = v * d * (acc + e) if e != acc else 0
        fused += product(flops, cublas * cublas_share(v, d, m), dx + n * d * e + cast, (2 * chunks - 1) * v * d * acc)
    if fused <= composable:
        return True, f"its passes weigh {fused:.3g} peak flop-equivalents, the composable path's {composable:.3g}"
    return False, f"the composable path's passes weigh {composable:.3g} peak flop-equivalents against {fused:.3g}"


# ------------------------------------------------------------------------------------------------
# d weight of the CUDA grad-in-forward path: deferred, grouped or per chunk
# ------------------------------------------------------------------------------------------------


def cuda_d_weight_layout(w: Workload, gpu: GPU, layouts: list) -> int:
    """Which of ``layouts`` the grad-in-forward path takes: ``(chunks, groups, deferred)`` of each shape the
    workspace allows (per chunk, grouped by each number of groups, deferred d weight), the ungrouped chunks first.
    The one whose products weigh least (``_grad_in_forward_cost``): fewer groups save beta = 1 accumulations of
    the fp32 [V, D] d weight, but the dx of a group shares the workspace with the chunk's tiles, so its chunks
    are smaller and may stream the weight for longer than they multiply; deferring d weight saves the backward's
    rescaling of it. Ties keep the earlier. Returns the index into ``layouts``."""
    balance = gpu.flops_per_byte(w.dtype)
    costs = [(_grad_in_forward_cost(w, balance, chunks, groups, deferred), i)
             for i, (chunks, groups, deferred) in enumerate(layouts)]
    return min(costs)[1]
