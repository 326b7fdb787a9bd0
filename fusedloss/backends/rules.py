"""The plans' choices, as named rules: which path a call takes and how its grad-in-forward rows are grouped.

Each rule is a plain function of the call's shapes (``core/workload.py``), the shapes its backend's plan can run
(chunks, groups, tiles) and one figure of the GPU, the balance of its products' rate and its bandwidth
(``GPU.flops_per_byte``), which weighs bytes against flops; no rate, efficiency or time. The rules weigh each
candidate's GEMM-sized products (flops, or the bytes they stream where that takes longer) and the traffic the
products cannot hide, with the named constants below saying what each candidate moves and why.
``tests/test_model_plan_rules.py`` prices the rules' choices with the performance model (``benchmarks/model/``,
docs/design.md, "Plans and the performance model") against every plan the backend could run, over a grid of
shapes, dtypes, GPUs and workspaces, and pins how often and how far they miss the cheapest. A choice is a matter
of speed, never of correctness: every path runs any shape the rules may give it.
"""

from __future__ import annotations

from ..core.workload import GPU, Workload

# ------------------------------------------------------------------------------------------------
# Grad-in-forward (3 products) or composable (4)
# ------------------------------------------------------------------------------------------------

# [V, D] bytes per entry the grad-in-forward path moves beyond the composable path's when d weight is complete in
# one product: its backward scales the d weight the forward wrote (read and write it: 2 x 2 bytes in bf16); fp16
# and fp32 write the forward's product in fp32 (fp16: 2 bytes more than its own dtype) and read it back for the
# scaling (4 + their own bytes). Deferred d weight (bf16) moves none: the backward forms it once.
D_WEIGHT_EXTRA_BYTES = {"bfloat16": 4, "float16": 8, "float32": 8}
# [V, D] bytes per entry each further beta = 1 accumulation of the fp32 d weight reads and writes.
ACCUMULATION_BYTES = 8
# Bytes per logit fp16's grad-in-forward dx moves beyond the composable path's: it is formed in fp32 in place
# (4 written) and pre-scaled into an fp16 copy by torch ops (4 read, 2 written, and its maximum's 4 read before):
# GradScaler's scale is not known in the forward.
FP16_DX_EXTRA_BYTES = 12
# What a grad-in-forward chunk's own small kernels cost, as HBM bytes: 20-40 launches of the loss's per-token math
# and masks (tests/test_cost_model_launches.py counts them) of a few microseconds each, ~100 us, in which an
# H200 streams ~0.5 GB. Many small chunks lose more to these than a grouped d weight saves.
CHUNK_OVERHEAD_BYTES = 0.5e9


def _product(balance: float, m: float, n: float, k: float, count: float, streamed: float, after: float) -> float:
    """Flop-equivalents of ``count`` products [m, n] over k: their flops, or the bytes they stream (``streamed``
    each) where that takes longer, plus the bytes they move after the main loop (``after``: C written, and read
    for beta = 1), which are not hidden behind the math. Bytes count ``balance`` flops each."""
    return count * max(2.0 * m * n * k, balance * streamed) + balance * after


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
            cost += balance * v * d * D_WEIGHT_EXTRA_BYTES[w.dtype]
    if w.dtype == "float16":
        cost += balance * n * v * FP16_DX_EXTRA_BYTES
    return cost + balance * CHUNK_OVERHEAD_BYTES * (chunks - 1)


def _composable_cost(w: Workload, balance: float, row_chunks: int, vocab_tiles: int) -> float:
    """The composable path's products in flop-equivalents, as ``_grad_in_forward_cost``: the logits formed twice
    (forward and backward; a JSD over several tiles twice more), d hidden accumulated over the vocabulary tiles, d
    weight over the row chunks."""
    n, v, d, b = float(w.n), float(w.v), float(w.d), w.operand_bytes
    teacher_d = float(w.teacher_d or w.d) if w.has_teacher else 0.0
    rows, cols, tiles = n / row_chunks, v / vocab_tiles, row_chunks * vocab_tiles
    forms = 2 + (2 if w.op == "distill_jsd" and tiles > 1 else 0)
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
    return cost


def cuda_grad_in_forward(w: Workload, gpu: GPU, chunks: int, groups: int, deferred: bool,
                         tile_row_chunks: int, tile_vocab_tiles: int) -> tuple[bool, str]:
    """Grad-in-forward where its products cost less than the composable path's, each product weighed at the
    larger of its flops and the bytes it streams, plus the bytes it writes after its main loop, bytes counted at
    the GPU's balance of the dtype (``GPU.flops_per_byte``). The grad-in-forward path forms the logits once (the
    composable path twice; a composable JSD over several tiles four times), but its chunks are as small as the
    workspace makes them: a chunk below ``balance x bytes / 2`` rows streams the weight for longer than it
    multiplies, each group beyond the first accumulates d weight once more (beta = 1, ``ACCUMULATION_BYTES``),
    unless d weight is deferred the backward rescales the [V, D] the forward wrote (``D_WEIGHT_EXTRA_BYTES``),
    fp16's dx takes two more passes (``FP16_DX_EXTRA_BYTES``), and every chunk beyond the first pays its small
    kernels (``CHUNK_OVERHEAD_BYTES``). (whether, why)."""
    balance = gpu.flops_per_byte(w.dtype)
    fused = _grad_in_forward_cost(w, balance, chunks, groups, deferred)
    composable = _composable_cost(w, balance, tile_row_chunks, tile_vocab_tiles)
    if fused <= composable:
        return True, f"its products weigh {fused:.3g} flop-equivalents against the composable path's {composable:.3g}"
    return False, f"the composable path's products weigh {composable:.3g} flop-equivalents against {fused:.3g}"


# What a Triton grad-in-forward chunk's own small kernels cost beyond the composable path's, as HBM bytes: ~20
# launches of the loss's per-token math and masks, ~60 with a teacher (its fold's merge; tests/test_triton_launches.py
# counts them), of a few microseconds each: ~60 and ~180 us, in which an H200 streams ~0.25 and ~0.75 GB.
TRITON_CHUNK_OVERHEAD_BYTES = {"student": 0.25e9, "teacher": 0.75e9}
# The Triton products' rates relative to each other, by the tiles their kernels compile to (triton/plan.py's
# tables): a student's lean tile (128 x 128 for bf16/fp16, 128 x 64 for fp32) keeps its wgmma fed from shared
# memory at about 0.8 (0.7 for fp32's) of the products' peak; a teacher's tile (64 x 64, two products per tile,
# registers for both) at about 0.58, so a composable distillation's products take ~1.4x (fp32: ~1.2x) as long
# per flop as the grad-in-forward student's; cuBLAS reaches the peak.
TRITON_STUDENT_TILE_SHARE = {"half": 0.80, "fp32": 0.70}
TRITON_TEACHER_TILE_SHARE = 0.58


def triton_grad_in_forward(w: Workload, gpu: GPU, chunk_rows: int, backward_rows: int,
                           backward_cols: int) -> tuple[bool, str]:
    """The Triton backend's path, weighed as ``cuda_grad_in_forward`` (products at the larger of their flops and
    their streamed bytes, bytes at the GPU's balance): the composable path forms the logits (both heads') in its
    forward and again in its backward (a JSD thrice: its second sweep), on the teacher's tile where there is a
    teacher (``TRITON_TEACHER_TILE_SHARE``); the grad-in-forward path forms the student's once on the student's tile
    and the teacher's once through cuBLAS, but writes the logits tiles (4 bytes a logit, a head) and reads them
    back for dx (a teacher fold and a JSD's second sweep read them again), accumulates d weight in fp32 over its
    chunks and casts it once, and each chunk streams the weight and pays its small kernels
    (``TRITON_CHUNK_OVERHEAD_BYTES``). The composable backward accumulates d hidden over its vocabulary chunks and
    d weight over its row chunks (written in its dtype when one row chunk holds every row). (whether, why)."""
    half = w.dtype in ("bfloat16", "float16")
    share = TRITON_STUDENT_TILE_SHARE["half" if half else "fp32"]
    # rates in units of the products' peak on the tensor cores: bf16/fp16, or TF32 thirds for fp32's tf32x3
    peak_per_byte = gpu.half_flops_per_byte if half else gpu.tf32_flops_per_byte / 3
    cublas = 1.0 if half else gpu.fp32_flops_per_byte / peak_per_byte  # cuBLAS's fp32 products run without TF32
    n, v, d, b = float(w.n), float(w.v), float(w.d), w.operand_bytes
    acc = 8 if w.dtype == "float64" else 4
    teacher_d = float(w.teacher_d or w.d) if w.has_teacher else 0.0
    heads = 2 if w.has_teacher else 1
    chunks = -(-w.n // chunk_rows)
    rows_r, cols_v = -(-w.n // backward_rows), -(-w.v // backward_cols)

    def product(flops, rate, streamed):  # time in peak flops: flops at ``rate`` of the peak, or the stream
        return max(flops / rate, peak_per_byte * streamed)

    tile = TRITON_TEACHER_TILE_SHARE if w.has_teacher else share
    forms = 2 + (1 if w.op == "distill_jsd" else 0)
    composable = forms * product(2 * n * v * (d + teacher_d), tile, v * (d + teacher_d) * b)
    fused = chunks * product(2 * n / chunks * v * d, share, v * d * b)
    if w.has_teacher:
        fused += chunks * product(2 * n / chunks * v * teacher_d, cublas, v * teacher_d * b)
        fused += peak_per_byte * n * v * acc * (4 if w.op == "distill_jsd" else 2)  # the fold (and second sweep)
    overhead = TRITON_CHUNK_OVERHEAD_BYTES["teacher" if w.has_teacher else "student"]
    fused += peak_per_byte * (2 * n * v * acc * heads + overhead * chunks)
    if w.weight_grad:
        fused += peak_per_byte * v * d * acc * (2 * chunks - 1)
        composable += peak_per_byte * v * d * (acc * (2 * rows_r - 1) if rows_r > 1 else b)
    if w.hidden_grad:
        fused += peak_per_byte * n * d * acc
        composable += peak_per_byte * n * d * acc * (2 * cols_v - 1)
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
