"""Forward kernel: partial per-token statistics of one (row block, vocabulary split).

Grid ``(cdiv(N, BLOCK_M), splits)``. Program (i, k) walks the vocabulary tiles of split k for the
rows of block i: each tile of logits (and of the teacher's logits) is computed with ``tl.dot`` in
registers, folded into the running statistics (``tile_math.online_update``) and dropped, so no
logits ever reach memory. The vocabulary is split across programs so that a few tokens still fill
the GPU; each program writes its partial statistics, relative to its own maxima, to
``part[slot, k, row]`` and the backend merges the splits exactly (the same associative merge).

With ``WANT_TOP1`` (TRL's is_top1 metric) it also keeps ``mb``, the running max of z over the columns
*before* each row's target (-inf where there are none; splits merge it by max): the target is the first
argmax, argmax's rule on exact ties, iff z_y >= max_v z_v and z_y > mb.

Beside s it keeps ``t`` = s - 1, the sum without the running maximum column's own e^0 = 1 (slot "t"), so
that log s = log1p(t) keeps the digits of a confident row; the backend merges it across splits without
cancellation (``core/partials.merge``).

Row blocks whose targets are all ignored skip the whole sweep and write the empty state
(m = -inf, sums 0). N, V and D are runtime values: a new sequence length never recompiles.
"""

import triton
import triton.language as tl

from .tile_math import P_T_SCALE, logits_tile, max_before_target, online_update

# Slots of the partial-statistics buffer part[slot, split, row] (tile_math.online_update's names).
SLOTS = ("m", "s", "e", "s2", "sz", "mt", "st", "a", "b", "zy", "mb", "t")


@triton.jit
def statistics_forward_kernel(
    h_ptr, w_ptr, b_ptr, th_ptr, tw_ptr, tb_ptr, tgt_ptr, params_ptr, part_ptr,
    N, V, D, DT, stride_h, stride_w, stride_th, stride_tw, tiles_per_split, num_splits,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_TEACHER: tl.constexpr,
    HAS_TEACHER_BIAS: tl.constexpr, HAS_TEACHER_SOFTCAP: tl.constexpr, HAS_TARGETS: tl.constexpr,
    WANT_E: tl.constexpr, WANT_S2: tl.constexpr, WANT_SZ: tl.constexpr, WANT_TOP1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    tgt = tl.full((BLOCK_M,), 0, tl.int64)
    if HAS_TARGETS:
        tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1)
        active = row_mask & (tgt >= 0)
    else:
        active = row_mask

    neg_inf = tl.full((BLOCK_M,), float("-inf"), ACC)
    zero = tl.zeros((BLOCK_M,), ACC)
    m, s, t_sum, e, s2, sz, zy = neg_inf, zero, zero, zero, zero, zero, zero
    mt, st, a, b = neg_inf, zero, zero, zero
    mb = neg_inf

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
                zt = z
                if HAS_TEACHER:
                    zt, ct = logits_tile(th_ptr, stride_th, tw_ptr, stride_tw, tb_ptr, params_ptr, rows, row_mask,
                                         cols, col_mask, DT, P_T_SCALE, HAS_TEACHER_BIAS, HAS_TEACHER_SOFTCAP,
                                         BLOCK_M, BLOCK_V, BLOCK_K, ACC, PRECISION)
                zy, m, s, t_sum, e, s2, sz, mt, st, a, b = online_update(
                    z, zt, zy, tgt, cols, col_mask, m, s, t_sum, e, s2, sz, mt, st, a, b,
                    HAS_TEACHER, WANT_E, WANT_S2, WANT_SZ, HAS_TARGETS)
                if WANT_TOP1:
                    mb = tl.maximum(mb, max_before_target(z, tgt, cols))

    out = part_ptr + split * N + rows
    plane = num_splits * N
    tl.store(out + 0 * plane, m, mask=row_mask)
    tl.store(out + 1 * plane, s, mask=row_mask)
    tl.store(out + 2 * plane, e, mask=row_mask)
    tl.store(out + 3 * plane, s2, mask=row_mask)
    tl.store(out + 4 * plane, sz, mask=row_mask)
    tl.store(out + 5 * plane, mt, mask=row_mask)
    tl.store(out + 6 * plane, st, mask=row_mask)
    tl.store(out + 7 * plane, a, mask=row_mask)
    tl.store(out + 8 * plane, b, mask=row_mask)
    tl.store(out + 9 * plane, zy, mask=row_mask)
    tl.store(out + 10 * plane, mb, mask=row_mask)
    tl.store(out + 11 * plane, t_sum, mask=row_mask)
