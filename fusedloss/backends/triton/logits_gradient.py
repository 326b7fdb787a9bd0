"""Backward kernel: d loss / d x for one [rows, vocabulary chunk] block of the logits, into a workspace.

A 1-D grid over the (row block, vocabulary tile) pairs of the block, in grouped order. Each program forms
its ``[BLOCK_M, BLOCK_V]`` tile of logits again (or, with ``F.LOAD_LOGITS``, reads the tile the grad-in-forward
forward kept), turns it into dx with the per-row coefficients (``tile_math.logits_gradient``) and stores
it: in the input dtype for bf16/fp16 (the rounding the naive path applies to its logits gradient), in the
accumulation dtype otherwise. The backend then multiplies the workspace with cuBLAS,
``d hidden += dx @ W[chunk]`` and ``d weight[chunk] = dx.T @ h``, in fp32 (float64): no atomics, a fixed
order of every sum, so the backward is deterministic by construction.

The recomputed tile is the forward's bit for bit: the same ``tile_math.logits_tile`` with the same
``Tiles`` on the same row blocks (the backend's row chunks are multiples of BLOCK_M and the rows are
loaded whether or not they carry gradient), because ``log q = (z - lse) - lse_lo`` takes the forward's
lse, and a confident row's ``1 - q_y`` lives in the last bits of z. ``norm`` holds the forward's
(lse, lse_lo, logp, row_max) per row (``[4, N]``; the target column takes logp itself), ``norm_t`` the
teacher's (lse_t, lse_t_lo, teacher_at_max, kl_rev_rel) (``[4, N]``; the last two with the first student
column, the reverse KL's frame). Row blocks without any row that carries gradient write zeros and skip the
product. ``named`` (``F.HAS_COLUMNS``): the named columns and their given dz (core/columns.py). ``F.HAS_DB``:
each program also stores its tile's column sums of dx before the cast (``db_ptr``, ``[row blocks, columns]``),
which the backend adds up in a fixed order for d bias. ``packed_gradient_kernel``: the grad-in-forward path's
half-precision dx written over the kept fp32 tile.
"""

import triton
import triton.language as tl

from .tile_math import (
    Head,
    Named,
    both_tiles,
    grouped_program,
    load_coefficients,
    load_normaliser,
    load_targets,
    logits_gradient,
    named_rows,
)


@triton.jit
def dx_tile(student: Head, teacher: Head, ws: Head, tgt_ptr, params_ptr, coef_ptr, norm_ptr, norm_t_ptr, named, N,
            v_end, D, DT, rows, row_mask, cols, col_mask, coef, active, F: tl.constexpr, T: tl.constexpr,
            ACC: tl.constexpr):
    """dx of one [BLOCK_M, BLOCK_V] tile (0 where no row carries gradient)."""
    BLOCK_M: tl.constexpr = tl.constexpr(T.BLOCK_M)  # a constexpr on every Triton (tile_math.raw_product)
    BLOCK_V: tl.constexpr = tl.constexpr(T.BLOCK_V)
    dx = tl.zeros((BLOCK_M, BLOCK_V), ACC)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        tgt, _ = load_targets(tgt_ptr, rows, row_mask, F.HAS_TARGETS)
        norm = load_normaliser(norm_ptr, N, rows, active)
        logq_y = tl.load(norm_ptr + 2 * N + rows, mask=active, other=0.0)  # the forward's logp
        norm_t = norm
        frame = (logq_y, logq_y, logq_y)
        want_teacher: tl.constexpr = F.HAS_KL_REV or F.HAS_KL_FWD or F.HAS_JSD
        if want_teacher:
            norm_t = load_normaliser(norm_t_ptr, N, rows, active)
        if F.HAS_KL_REV:  # the reverse KL's frame: row_max, teacher_at_max, kl_rev_rel
            frame = (tl.load(norm_ptr + 3 * N + rows, mask=active, other=0.0),
                     tl.load(norm_t_ptr + 2 * N + rows, mask=active, other=0.0),
                     tl.load(norm_t_ptr + 3 * N + rows, mask=active, other=0.0))
        z, c, zt = both_tiles(student, teacher, ws, D, DT, params_ptr, rows, row_mask, cols, col_mask,
                              want_teacher, F, T, ACC)
        dx = logits_gradient(z, c, zt, norm, norm_t, frame, coef, logq_y, tgt, cols, col_mask, active, params_ptr,
                             named, rows, F)
    return dx


@triton.jit
def carrying_rows(coef_ptr, named, N, rows, row_mask, F: tl.constexpr):
    """(coefficients, rows that carry gradient): a non-zero coefficient, or a non-zero given dz at a named
    column."""
    coef, active = load_coefficients(coef_ptr, N, rows, row_mask)
    if F.HAS_COLUMNS:
        active = active | named_rows(named, rows, row_mask)
    return coef, active


@triton.jit
def store_column_sums(dx, db_ptr, at, cols, mask):
    """The tile's sums over its rows of dx as formed (fp32 or float64), before dx is rounded to a half dtype:
    d bias sums them (problem.py), as the torch backend sums its unrounded tiles."""
    tl.store(db_ptr + at + cols, tl.sum(dx, axis=0), mask=mask)


@triton.jit(do_not_specialize=["N", "v_start", "v_end", "D", "DT", "stride_dx", "group_m"])
def logits_gradient_kernel(
    student: Head, teacher: Head, ws: Head, tgt_ptr, params_ptr, coef_ptr, norm_ptr, norm_t_ptr, dx_ptr,
    named: Named, db_ptr, N, v_start, v_end, D, DT, stride_dx, stride_db, group_m,
    F: tl.constexpr, T: tl.constexpr, ACC: tl.constexpr,
):
    BLOCK_M: tl.constexpr = tl.constexpr(T.BLOCK_M)  # a constexpr on every Triton (tile_math.raw_product)
    BLOCK_V: tl.constexpr = tl.constexpr(T.BLOCK_V)
    row_blocks = tl.cdiv(N, BLOCK_M)
    col_blocks = tl.cdiv(v_end - v_start, BLOCK_V)
    pid_m, pid_v = grouped_program(tl.program_id(0), row_blocks, col_blocks, group_m)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    # Chunks start at multiples of BLOCK_V and workspace rows at multiples of 16 elements (the backend
    # allocates them so): hints on the products, so that the tile moves 16 bytes at a time.
    cols = tl.multiple_of(v_start + pid_v * BLOCK_V, 16) + tl.arange(0, BLOCK_V)
    col_mask = cols < v_end
    coef, active = carrying_rows(coef_ptr, named, N, rows, row_mask, F)
    dx = dx_tile(student, teacher, ws, tgt_ptr, params_ptr, coef_ptr, norm_ptr, norm_t_ptr, named, N, v_end, D, DT,
                 rows, row_mask, cols, col_mask, coef, active, F, T, ACC)
    if F.HAS_DB:  # this row block's sums, [row block, column of the chunk]
        store_column_sums(dx, db_ptr, pid_m.to(tl.int64) * stride_db, pid_v * BLOCK_V + tl.arange(0, BLOCK_V),
                          col_mask)
    out = (dx_ptr + tl.multiple_of(rows.to(tl.int64)[:, None] * stride_dx, [16, 16])
           + (pid_v * BLOCK_V + tl.arange(0, BLOCK_V))[None, :])
    # The workspace's rows hold a whole number of tiles: dx is 0 past the chunk, and stored unmasked there.
    tl.store(out, dx.to(dx_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit(do_not_specialize=["N", "v_end", "D", "DT", "stride_dx"])
def packed_gradient_kernel(
    student: Head, teacher: Head, ws: Head, tgt_ptr, params_ptr, coef_ptr, norm_ptr, norm_t_ptr, dx_ptr,
    named: Named, db_ptr, N, v_end, D, DT, stride_dx, stride_db,
    F: tl.constexpr, T: tl.constexpr, ACC: tl.constexpr,
):
    """The grad-in-forward path's dx in half precision written over the fp32 logits tile it is read from
    (docs/design.md, "The logits workspace"): ``dx_ptr`` is the kept tile ``ws.hidden`` viewed as 16-bit
    elements with row stride ``stride_dx`` = 2 x its fp32 stride, so dx(r, j) overwrites bytes of fp32 column
    j / 2 of the same row. One program per row block walks its rows' columns in order, a tile at a time; the
    program's threads all load a tile before any of them stores its dx (the barrier), and a tile's stores land
    in fp32 columns below its end, all read by then, never in a column a later tile reads."""
    BLOCK_M: tl.constexpr = tl.constexpr(T.BLOCK_M)
    BLOCK_V: tl.constexpr = tl.constexpr(T.BLOCK_V)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    coef, active = carrying_rows(coef_ptr, named, N, rows, row_mask, F)
    base = dx_ptr + tl.multiple_of(rows.to(tl.int64)[:, None] * stride_dx, [16, 16])
    for v0 in range(0, v_end, BLOCK_V):
        cols = tl.multiple_of(v0, 16) + tl.arange(0, BLOCK_V)
        col_mask = cols < v_end
        dx = dx_tile(student, teacher, ws, tgt_ptr, params_ptr, coef_ptr, norm_ptr, norm_t_ptr, named, N, v_end, D,
                     DT, rows, row_mask, cols, col_mask, coef, active, F, T, ACC)
        if F.HAS_DB:
            store_column_sums(dx, db_ptr, tl.program_id(0).to(tl.int64) * stride_db, cols, col_mask)
        tl.debug_barrier()  # every thread's loads of this tile before any store over it
        tl.store(base + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=row_mask[:, None])
