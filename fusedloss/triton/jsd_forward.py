"""Forward kernel, second pass of the generalized JSD: partial KL(q || m) and KL(p || m).

The mixture m = (1 - beta) q + beta p needs both normalisers, known only after the first pass
(``statistics_forward``), so the JSD takes a second sweep over the same (row block, vocabulary
split) grid. log m is formed in the log domain (no underflow for tiny q and p); terms with zero
probability are dropped (0 * log 0 = 0). Plain sums: the splits merge by addition.
"""

import triton
import triton.language as tl

from .tile_math import P_LOG1M_BETA, P_LOG_BETA, P_T_SCALE, load_normaliser, logaddexp, logits_tile


@triton.jit
def jsd_forward_kernel(
    h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, tgt_ptr, params_ptr, lse_ptr, lse_t_ptr, part_ptr,
    N, V, D, DT, stride_h, stride_w, stride_th, stride_tw, tiles_per_split, num_splits,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEACHER_BIAS: tl.constexpr,
    HAS_TEACHER_SOFTCAP: tl.constexpr, HAS_TARGETS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    if HAS_TARGETS:
        active = row_mask & (tl.load(tgt_ptr + rows, mask=row_mask, other=-1) >= 0)
    else:
        active = row_mask
    lse, lse_lo = load_normaliser(lse_ptr, N, rows, active)
    lse_t, lse_t_lo = load_normaliser(lse_t_ptr, N, rows, active)
    log1m_beta = tl.load(params_ptr + P_LOG1M_BETA)
    log_beta = tl.load(params_ptr + P_LOG_BETA)
    kl_qm = tl.zeros((BLOCK_M,), ACC)
    kl_pm = tl.zeros((BLOCK_M,), ACC)

    if tl.max(active.to(tl.int32), axis=0) > 0:
        for t in range(0, tiles_per_split):
            # Tiles past V (the last split may hold fewer) would add exact zeros: a bound check
            # is cheaper than their products.
            v0 = (split * tiles_per_split + t) * BLOCK_V
            if v0 < V:
                cols = v0 + tl.arange(0, BLOCK_V)
                col_mask = cols < V
                z, c = logits_tile(h_ptr, stride_h, w_ptr, stride_w, b_ptr, params_ptr, rows, row_mask, cols,
                                   col_mask, D, 0, HAS_BIAS, HAS_SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_K, ACC, PRECISION)
                zt, ct = logits_tile(th_ptr, stride_th, tw_ptr, stride_tw, tb_ptr, params_ptr, rows, row_mask, cols,
                                     col_mask, DT, P_T_SCALE, HAS_TEACHER_BIAS, HAS_TEACHER_SOFTCAP, BLOCK_M, BLOCK_V,
                                     BLOCK_K, ACC, PRECISION)
                logq = (z - lse[:, None]) - lse_lo[:, None]
                logp = (zt - lse_t[:, None]) - lse_t_lo[:, None]
                log_m = logaddexp(logq + log1m_beta, logp + log_beta)
                q = tl.exp(logq)
                p = tl.exp(logp)
                kl_qm += tl.sum(tl.where(q == 0.0, 0.0, q * (logq - log_m)), axis=1)
                kl_pm += tl.sum(tl.where(p == 0.0, 0.0, p * (logp - log_m)), axis=1)

    out = part_ptr + split * N + rows
    tl.store(out, kl_qm, mask=row_mask)
    tl.store(out + num_splits * N, kl_pm, mask=row_mask)
