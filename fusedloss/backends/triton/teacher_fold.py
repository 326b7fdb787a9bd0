"""Grad-in-forward path: the teacher's statistics from the kept tiles, once the student's are final.

On the grad-in-forward path the teacher's raw logits x_t come from cuBLAS (one fp32-output product per row chunk) into
the workspace beside the student's capped logits c, which the student's forward kept. This elementwise kernel
sweeps both, a grouped (row block, vocabulary split) grid over the tiles of the gradient pass's layout, and
forms per row the teacher's partial statistics of ``core/partials.py``::

    mt = max z_t                st = sum e^(z_t - mt)
    a  = sum e^(z - m) ((z - m) - (z_t - ztm))         (the reverse KL's, with a reverse KL)
    b  = sum e^(z_t - mt) ((z_t - mt) - (z - m))       (the forward KL's, with a forward KL)

relative to the student's *final* maximum m (``frame[0]``) and ztm, the teacher's logit at the student's first
maximum column. The forward kept, in ztm's slot, the first column of the forward tile that holds that maximum
(``frame[1]``; ``tile_math.online_update`` with ``TEACHER_AT_MAX``): each program first reads that tile of c for
its rows (``SEARCH_V`` columns), takes the first column where z == m, and reads x_t there (``teacher_at``). a is
then one plain sum in one frame (its holder column adds exactly 0); mt, st and b run online in the split's own
teacher maximum and merge across splits as ``core/partials.merge_teacher_sweep`` does; every split writes the
same ztm. Rule G as in ``online_update``: a column adds +inf to a where its z is finite and its z_t -inf, to b
where its z_t is finite and its z -inf. Rows that carry no loss (ignored targets; their tiles may never have
been written) are not read and give the empty state.
"""

import triton
import triton.language as tl

from .tile_math import (
    NO_COLUMN,
    P_TEMP,
    Head,
    reverse_kl_columns,
    split_program,
    split_tile,
    teacher_at,
    teacher_of_raw,
    teacher_step,
    tempered,
)


@triton.jit(do_not_specialize=["N", "V", "tiles_per_split", "num_splits", "group_m"])
def teacher_fold_kernel(
    teacher: Head, ws: Head, tgt_ptr, params_ptr, frame_ptr, part_ptr,
    N, V, tiles_per_split, num_splits, group_m,
    F: tl.constexpr, T: tl.constexpr, ACC: tl.constexpr, SEARCH_V: tl.constexpr,
):
    BLOCK_M: tl.constexpr = tl.constexpr(T.BLOCK_M)  # a constexpr on every Triton (tile_math.raw_product)
    split, rows, row_mask, tgt, active = split_program(N, num_splits, group_m, tgt_ptr, F.HAS_TARGETS, BLOCK_M)
    m = tl.load(frame_ptr + rows, mask=active, other=float("-inf"))
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    ztm = tl.zeros((BLOCK_M,), ACC)
    if F.HAS_KL_REV:  # the first column where z == m, in the forward tile that holds it, and x_t there
        loc = tl.load(frame_ptr + N + rows, mask=active, other=0.0).to(tl.int32)
        search = loc[:, None] + tl.arange(0, SEARCH_V)[None, :]
        in_row = active[:, None] & (search < V)
        # (names of their own: Triton's compiler keeps one type per name, and the sweep's z has other columns)
        c_held = tl.load(ws.hidden + rows.to(tl.int64)[:, None] * ws.stride_h + search, mask=in_row, other=0.0)
        z_held = tl.where(in_row, c_held / tl.load(params_ptr + P_TEMP), float("-inf"))
        first = tl.min(tl.where(z_held == m[:, None], search, NO_COLUMN), axis=1)
        found = active & (first < V) & (m != float("-inf"))
        ztm = tl.where(found, teacher_at(ws, teacher, params_ptr, rows, first, found, F), 0.0)
    ztm_sub = tl.where(ztm == float("-inf"), 0.0, ztm)
    mt = tl.full((BLOCK_M,), float("-inf"), ACC)
    st = tl.zeros((BLOCK_M,), ACC)
    a = tl.zeros((BLOCK_M,), ACC)
    b = tl.zeros((BLOCK_M,), ACC)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        for i in range(tiles_per_split):
            v0, cols, col_mask = split_tile(split, tiles_per_split, i, V, T.BLOCK_V)
            if v0 < V:
                offs = rows.to(tl.int64)[:, None] * ws.stride_h + cols[None, :]
                mask = active[:, None]
                zt = teacher_of_raw(tl.load(ws.weight + offs, mask=mask, other=0.0), teacher, params_ptr, cols,
                                    col_mask, F)
                zt = tl.where(mask, zt, float("-inf"))
                z = zt  # a JSD-only fold reads no student tile (b is not formed then)
                zc = zt
                if F.HAS_KL_REV or F.HAS_KL_FWD:
                    z = tempered(tl.load(ws.hidden + offs, mask=mask, other=0.0), params_ptr, col_mask, 0)
                    z = tl.where(mask, z, float("-inf"))
                    zc = z - m_sub[:, None]
                # the student's maximum is final here: its frame does not move (dm = 0)
                mt, st, b = teacher_step(mt, st, b, zt, z, zc, 0.0, F.HAS_KL_FWD)
                if F.HAS_KL_REV:
                    a += tl.sum(reverse_kl_columns(tl.exp(zc), z, zc, zt, zt - ztm_sub[:, None]), axis=1)
    out = part_ptr + split.to(tl.int64) * N + rows
    plane = num_splits.to(tl.int64) * N
    tl.store(out, mt, mask=row_mask)
    tl.store(out + plane, st, mask=row_mask)
    tl.store(out + 2 * plane, a, mask=row_mask)
    tl.store(out + 3 * plane, b, mask=row_mask)
    tl.store(out + 4 * plane, ztm, mask=row_mask)
