"""Forward kernel, second pass of the generalized JSD: partial KL(q || m) and KL(p || m).

The mixture m = (1 - beta) q + beta p needs both normalisers, known only after the first pass
(``statistics_forward``), so the JSD takes a second sweep over the same grouped (row block, vocabulary
split) grid: it forms the products again, or (``F.LOAD_LOGITS``, the grad-in-forward path) reads the tiles the first
pass kept. log m is formed in the log domain (no underflow for tiny q and p); terms with zero
probability are dropped (0 * log 0 = 0). Plain sums: the splits merge by addition.
"""

import triton
import triton.language as tl

from .tile_math import (
    P_LOG1M_BETA,
    P_LOG_BETA,
    Head,
    both_tiles,
    load_normaliser,
    logaddexp,
    split_program,
    split_tile,
)


@triton.jit(do_not_specialize=["N", "V", "D", "DT", "tiles_per_split", "num_splits", "group_m"])
def jsd_forward_kernel(
    student: Head, teacher: Head, ws: Head, tgt_ptr, params_ptr, norm_ptr, norm_t_ptr, part_ptr,
    N, V, D, DT, tiles_per_split, num_splits, group_m,
    F: tl.constexpr, T: tl.constexpr, ACC: tl.constexpr,
):
    split, rows, row_mask, tgt, active = split_program(N, num_splits, group_m, tgt_ptr, F.HAS_TARGETS, T.BLOCK_M)
    lse, lse_lo = load_normaliser(norm_ptr, N, rows, active)
    lse_t, lse_t_lo = load_normaliser(norm_t_ptr, N, rows, active)
    log1m_beta = tl.load(params_ptr + P_LOG1M_BETA)
    log_beta = tl.load(params_ptr + P_LOG_BETA)
    BLOCK_M: tl.constexpr = tl.constexpr(T.BLOCK_M)  # a constexpr on every Triton (tile_math.raw_product)
    kl_qm = tl.zeros((BLOCK_M,), ACC)
    kl_pm = tl.zeros((BLOCK_M,), ACC)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        for i in range(tiles_per_split):
            v0, cols, col_mask = split_tile(split, tiles_per_split, i, V, T.BLOCK_V)
            if v0 < V:
                z, c, zt = both_tiles(student, teacher, ws, D, DT, params_ptr, rows, row_mask, cols, col_mask,
                                      True, F, T, ACC)
                logq = (z - lse[:, None]) - lse_lo[:, None]
                logp = (zt - lse_t[:, None]) - lse_t_lo[:, None]
                log_m = logaddexp(logq + log1m_beta, logp + log_beta)
                q = tl.exp(logq)
                p = tl.exp(logp)
                kl_qm += tl.sum(tl.where(q == 0.0, 0.0, q * (logq - log_m)), axis=1)
                kl_pm += tl.sum(tl.where(p == 0.0, 0.0, p * (logp - log_m)), axis=1)
    out = part_ptr + split.to(tl.int64) * N + rows
    tl.store(out, kl_qm, mask=row_mask)
    tl.store(out + num_splits.to(tl.int64) * N, kl_pm, mask=row_mask)
