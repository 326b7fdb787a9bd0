"""Backward kernel, deterministic mode: d weight and d bias, one program per vocabulary block.

Grid ``(cdiv(v_end - v_start, BLOCK_V),)`` over one vocabulary chunk. The program owns its rows of
the chunk's fp32 scratch and walks all row blocks in a fixed order: recompute the tile, form dx,
add ``dx.T @ h[rows, :]`` into its rows one ``BLOCK_D`` slice at a time and ``dx.sum(0)`` into a
register accumulator for d bias. No atomics: bit-identical from run to run. Row blocks whose
coefficients are all zero (ignored or masked tokens) are skipped.
"""

import triton
import triton.language as tl

from .tile_math import P_T_SCALE, load_coefficients, load_normaliser, logits_gradient, logits_tile


@triton.jit
def weight_backward_kernel(
    h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, tgt_ptr, params_ptr, coef_ptr, lse_ptr, lse_t_ptr, dw_ptr, db_ptr,
    N, V, D, DT, stride_h, stride_w, stride_th, stride_tw, stride_dw, v_start, v_end,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEACHER: tl.constexpr,
    HAS_TEACHER_BIAS: tl.constexpr, HAS_TEACHER_SOFTCAP: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_JSD: tl.constexpr, HAS_KL_FWD: tl.constexpr, HAS_MEAN_LOGIT: tl.constexpr,
    NEED_WEIGHT: tl.constexpr, NEED_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_v = tl.program_id(0)
    cols = v_start + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < v_end
    cols64 = cols.to(tl.int64)
    db = tl.zeros((BLOCK_V,), ACC)
    for r0 in range(0, N, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_mask = rows < N
        a, c0, c1, c2, c3, c4, c5, active = load_coefficients(coef_ptr, N, rows, row_mask)
        if tl.max(active.to(tl.int32), axis=0) > 0:
            tgt = tl.full((BLOCK_M,), -1, tl.int64)
            if HAS_TARGETS:
                tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
            lse, lse_lo = load_normaliser(lse_ptr, N, rows, active)
            lse_t, lse_t_lo = lse, lse_lo
            z, c = logits_tile(h_ptr, stride_h, w_ptr, stride_w, b_ptr, params_ptr, rows, row_mask, cols,
                               col_mask, D, 0, HAS_BIAS, HAS_SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_K, ACC, PRECISION)
            zt = z
            if HAS_TEACHER:
                lse_t, lse_t_lo = load_normaliser(lse_t_ptr, N, rows, active)
                zt, ct = logits_tile(th_ptr, stride_th, tw_ptr, stride_tw, tb_ptr, params_ptr, rows, row_mask,
                                     cols, col_mask, DT, P_T_SCALE, HAS_TEACHER_BIAS, HAS_TEACHER_SOFTCAP,
                                     BLOCK_M, BLOCK_V, BLOCK_K, ACC, PRECISION)
            dx = logits_gradient(z, c, zt, lse, lse_lo, lse_t, lse_t_lo, tgt, cols, col_mask, active,
                             a, c0, c1, c2, c3, c4, c5,
                                 params_ptr, HAS_TEACHER, HAS_JSD, HAS_KL_FWD, HAS_MEAN_LOGIT, HAS_TARGETS,
                             HAS_SOFTCAP)
            if NEED_BIAS:
                db += tl.sum(dx, axis=0)
            if NEED_WEIGHT:
                dx_in = dx.to(w_ptr.dtype.element_ty)
                rows64 = rows.to(tl.int64)
                for d0 in range(0, D, BLOCK_D):
                    ds = d0 + tl.arange(0, BLOCK_D)
                    d_mask = ds < D
                    h_blk = tl.load(h_ptr + rows64[:, None] * stride_h + ds[None, :],
                                    mask=active[:, None] & d_mask[None, :], other=0.0)  # NaN padding rows stay out
                    out = dw_ptr + (cols64 - v_start)[:, None] * stride_dw + ds[None, :]
                    out_mask = col_mask[:, None] & d_mask[None, :]
                    acc = tl.load(out, mask=out_mask, other=0.0)
                    acc = tl.dot(tl.trans(dx_in), h_blk, acc, input_precision=PRECISION, out_dtype=ACC)
                    tl.store(out, acc, mask=out_mask)
    if NEED_BIAS:
        tl.store(db_ptr + (cols - v_start), db, mask=col_mask)
