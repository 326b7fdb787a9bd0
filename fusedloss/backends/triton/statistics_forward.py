"""Forward kernel: partial per-token statistics of one (row block, vocabulary split).

A 1-D grid of ``row_blocks * num_splits`` programs in grouped order (``tile_math.grouped_program``):
program (i, k) walks the vocabulary tiles of split k for the rows of block i. Each tile of logits (and of
the teacher's) is computed with ``tl.dot`` in registers, folded into the running statistics
(``tile_math.online_update``) and dropped, so no logits reach memory. The vocabulary is split so that the
programs fill whole waves of the GPU whatever the number of tokens (``plan.forward_grid``); each
program writes its partial statistics, relative to its own maxima, to ``part[field, k, row]`` in the order
of ``core/partials.FIELDS``, and ``core/partials.merge`` combines the splits exactly.

With ``F.STORE_LOGITS`` (the grad-in-forward path) the tile is also kept in a workspace: c (the capped logits), for the
teacher fold and the gradient pass that follow without forming the product again. The grad-in-forward path's teacher is
no product here: cuBLAS wrote its raw logits x_t beside c, and with ``F.TEACHER_AT_MAX`` (a reverse KL) the
kernel keeps in ztm's slot only where the teacher's logit at its rows' first maximum column is to be read (the
first column of the tile holding that maximum, ``tile_math.online_update``); ``teacher_fold`` reads it there and
forms the teacher's statistics once the student's are final (docs/design.md, "The Triton teacher on the grad-in-forward
path").

With ``F.HAS_COLUMNS`` the kernel also stores the logits at the rows' named columns (``named``; core/columns.py)
as it meets them, the very z its statistics fold.

Row blocks whose targets are all ignored skip the whole sweep and write the empty state (m = -inf,
sums 0). N, V, D and the grid sizes are runtime values and are not specialised: one compiled variant
serves every sequence length.
"""

import triton
import triton.language as tl

from .tile_math import (
    Head,
    Named,
    both_tiles,
    empty_state,
    online_update,
    split_program,
    split_tile,
    store_named_logits,
    store_state,
    store_tiles,
)


@triton.jit(do_not_specialize=["N", "V", "D", "DT", "tiles_per_split", "num_splits", "group_m"])
def statistics_forward_kernel(
    student: Head, teacher: Head, ws: Head, tgt_ptr, params_ptr, part_ptr, named: Named,
    N, V, D, DT, tiles_per_split, num_splits, group_m,
    F: tl.constexpr, T: tl.constexpr, ACC: tl.constexpr,
):
    split, rows, row_mask, tgt, active = split_program(N, num_splits, group_m, tgt_ptr, F.HAS_TARGETS, T.BLOCK_M)
    state = empty_state(T.BLOCK_M, ACC)
    if tl.max(active.to(tl.int32), axis=0) > 0:
        for i in range(tiles_per_split):
            v0, cols, col_mask = split_tile(split, tiles_per_split, i, V, T.BLOCK_V)
            if v0 < V:
                z, c, zt = both_tiles(student, teacher, ws, D, DT, params_ptr, rows, row_mask, cols, col_mask,
                                      F.HAS_TEACHER, F, T, ACC)
                if F.STORE_LOGITS:
                    store_tiles(c, ws, rows, row_mask, cols, col_mask)
                if F.HAS_COLUMNS:
                    store_named_logits(z, named, rows, active, cols)
                state = online_update(state, z, zt, tgt, v0, cols, col_mask, F)
    store_state(state, part_ptr, split, num_splits, N, rows, row_mask)
