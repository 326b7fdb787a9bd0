"""Tile math shared by the Triton kernels: one ``[BLOCK_M, BLOCK_V]`` logits tile, its online statistics
update and its gradient. Every kernel of this package is a loop around these helpers, so the statistics and
their gradient are written once, with the names of ``core/problem.py`` and ``core/partials.py``.

Arguments travel in three named groups instead of long positional lists:

* ``Head`` (a runtime tuple): the pointers and row strides of one side's logits, student or teacher;
* ``Flags`` (a constexpr): which statistics and which gradient terms the problem has. A flag that is off
  removes its code from the compiled kernel, and it is what keeps a term the problem cannot produce from
  ever being formed (a teacher's -inf entry times a zero coefficient would be NaN);
* ``Tiles`` (a constexpr): block shapes, the ``tl.dot`` precision of fp32 operands and the alignment (in
  elements) that every row stride is known to have.

Conventions shared by all kernels:

* ``params`` is a small tensor in the accumulation dtype holding the scalars of the problem
  (``backend._params`` builds it in the ``P_*`` order below). Scalars travel in memory rather than as
  kernel arguments because Triton passes Python floats as fp32, which would round ``temperature = 0.7``
  before a float64 computation.
* Padded columns (``cols >= V``) get ``z = -inf`` and contribute exactly zero to every sum; padded rows
  are loaded as zeros and never stored. Row and column offsets are int64, so ``V * D`` or ``N * D`` above
  2**31 never wraps.
* Products accumulate in ``ACC`` (fp32, or float64 for float64 inputs) whatever the input dtype.
* The logits of a row are a function of that row alone and of the tile shape along D: ``logits_tile`` is
  the only place they are formed, and the forward and the backward call it with the same ``Tiles`` and the
  same row blocks, so the backward sees the forward's logits bit for bit (``log q = (z - lse) - lse_lo``
  relies on it; docs/design.md, "Numerical doctrine").
"""

from typing import Any, NamedTuple

import triton
import triton.language as tl

# Offsets into the params tensor. Globals read by a kernel must be tl.constexpr. P_T_SCALE is also the
# offset of the teacher's (scale, cap, temperature).
P_SCALE = tl.constexpr(0)
P_CAP = tl.constexpr(1)
P_TEMP = tl.constexpr(2)
P_T_SCALE = tl.constexpr(3)
P_LOG1M_BETA = tl.constexpr(6)
P_LOG_BETA = tl.constexpr(7)
P_DX_SCALE = tl.constexpr(8)
# The running state of ``online_update``, in the order of core/partials.FIELDS (the backend checks it).
STATE_FIELDS = ("m", "s", "t", "e", "s2", "sz", "mt", "st", "a", "b", "zy", "mb", "ztm")
NUM_STATE = tl.constexpr(len(STATE_FIELDS))

# Larger than every column id: the "no column" of a min over column ids.
NO_COLUMN = tl.constexpr(2**31 - 1)


class Head(NamedTuple):
    """One side of the logits, ``x = hidden @ weight.T + bias``: pointers and row strides (elements).
    ``bias`` is any valid pointer when the side has none (``Flags`` says whether it is read)."""

    hidden: Any
    weight: Any
    bias: Any
    stride_h: Any
    stride_w: Any


class Flags(NamedTuple):
    """Features of one launch (compile-time). The backend sets only the flags a kernel reads, so problems
    that differ in a flag a kernel ignores share its compiled variant."""

    HAS_BIAS: bool = False
    HAS_SOFTCAP: bool = False
    HAS_TEACHER: bool = False
    HAS_TEACHER_BIAS: bool = False
    HAS_TEACHER_SOFTCAP: bool = False
    HAS_TARGETS: bool = False
    # forward statistics
    WANT_E: bool = False
    WANT_S2: bool = False
    WANT_SZ: bool = False
    WANT_TOP1: bool = False
    # gradient terms: c1 log q (entropy, JSD), c2 r (reverse KL), c3 p (forward KL), c4 log m (JSD),
    # c5 (mean logit)
    HAS_LOG_TERMS: bool = False
    HAS_KL_REV: bool = False
    HAS_KL_FWD: bool = False
    HAS_JSD: bool = False
    HAS_MEAN_LOGIT: bool = False
    # grad-in-forward path: the forward stores the capped logits c in a workspace beside the teacher's raw product x_t
    # (cuBLAS); the teacher fold, the JSD pass and the gradient read both back instead of forming the products
    # again, and apply the teacher's bias, scale, soft-cap and temperature to x_t as they load it
    STORE_LOGITS: bool = False
    LOAD_LOGITS: bool = False
    # grad-in-forward forward of a reverse KL: no teacher in the tile, but where the teacher's logit at the student's
    # first
    # maximum column (ztm) is to be read: the first column of the tile holding that maximum, in ztm's slot
    TEACHER_AT_MAX: bool = False
    # named columns (core/columns.py): the forward stores the logits at them, the gradient writes their given dz
    HAS_COLUMNS: bool = False
    # the gradient also stores each tile's column sums of dx before it is rounded (d bias of a half dx)
    HAS_DB: bool = False


class Tiles(NamedTuple):
    """Block shapes (compile-time). ``PRECISION``: ``tl.dot``'s input precision for fp32 operands (ignored
    for bf16/fp16/float64). ``ALIGN``: a power of two dividing every row stride, so that rows of a hidden size
    that is not a multiple of 16 still load with vector instructions."""

    BLOCK_M: int
    BLOCK_V: int
    BLOCK_K: int
    PRECISION: str
    ALIGN: int


@triton.jit
def grouped_program(pid, row_blocks, col_blocks, group_m):
    """(row block, column block) of program ``pid`` in a grouped launch order: ``group_m`` row blocks take
    every column block before the next rows start, so the programs resident at one time share a few
    hidden blocks and a few weight blocks, which stay in L2."""
    per_group = group_m * col_blocks
    group = pid // per_group
    first = group * group_m
    size = tl.minimum(row_blocks - first, group_m)
    local = pid - group * per_group
    return first + local % size, local // size


@triton.jit
def split_program(N, num_splits, group_m, tgt_ptr, HAS_TARGETS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The (row block, vocabulary split) of a forward program: (split, rows, row mask, targets, rows that
    count)."""
    pid_m, split = grouped_program(tl.program_id(0), tl.cdiv(N, BLOCK_M), num_splits, group_m)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    tgt, active = load_targets(tgt_ptr, rows, row_mask, HAS_TARGETS)
    return split, rows, row_mask, tgt, active


@triton.jit
def split_tile(split, tiles_per_split, i, V, BLOCK_V: tl.constexpr):
    """First column, columns and column mask of the split's i-th vocabulary tile (past V when the last split
    is short: the caller checks the first column against V, cheaper than the products of exact zeros)."""
    v0 = (split * tiles_per_split + i) * BLOCK_V
    cols = v0 + tl.arange(0, BLOCK_V)
    return v0, cols, cols < V


@triton.jit
def tanh(x):
    """tanh to a few ulp in fp32 and float64, written with exp only (the CPU interpreter has no
    libdevice). Below |x| = 0.2 the Taylor series to x**19 (relative error < 1e-17); above it
    1 - 2 / (exp(2|x|) + 1), which has no cancellation there (tanh >= 0.19). exp overflow gives 1."""
    ax = tl.abs(x)
    x2 = ax * ax
    p = -443861162.0 / 1856156927625.0
    p = p * x2 + 6404582.0 / 10854718875.0
    p = p * x2 - 929569.0 / 638512875.0
    p = p * x2 + 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    small = ax + ax * x2 * p
    big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    t = tl.where(ax < 0.2, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def logaddexp(x, y):
    """log(e^x + e^y), with -inf when both are -inf (no NaN from -inf - -inf)."""
    mx = tl.maximum(x, y)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    return safe + tl.log(tl.exp(x - safe) + tl.exp(y - safe))


@triton.jit
def expm1(x):
    """e^x - 1 to a few ulp without libdevice (the CPU interpreter has none): with u = e^x rounded,
    (u - 1) x / log u cancels the rounding of u (Kahan); x itself where u == 1, -1 where u - 1 == -1,
    and u where u is infinite. Called on float64 values (fp32 ``tl.exp``/``tl.log`` are approximate on
    NVIDIA GPUs, and log u near 1 is exactly where their error is largest)."""
    u = tl.exp(x)
    um1 = u - 1.0
    plain = (um1 == 0.0) | (um1 == -1.0) | (u == float("inf"))
    log_u = tl.where(plain, 1.0, tl.log(u))
    kahan = um1 * (x / log_u)
    return tl.where(um1 == 0.0, x, tl.where(plain, um1, kahan))


@triton.jit
def raw_product(head: Head, D, rows, row_mask, cols, col_mask, T: tl.constexpr, ACC: tl.constexpr):
    """x = h[rows] @ W[cols].T accumulated in ACC: full BLOCK_K steps without a mask along D (their loads
    vectorise), then one masked step for the remainder of a hidden size that is not a multiple of BLOCK_K."""
    # The alignment of the row offsets (a hint on the products: a kernel argument carries none) lets rows of
    # D = 1000 load 16 bytes at a time like rows of D = 4096.
    # Fields of a NamedTuple constexpr reach the kernel as plain ints on some Triton versions (3.6 among
    # them); shapes and hints need constexprs, so they are rebound as such (docs/design.md, "Triton versions").
    ALIGN: tl.constexpr = tl.constexpr(T.ALIGN)
    BLOCK_M: tl.constexpr = tl.constexpr(T.BLOCK_M)
    BLOCK_V: tl.constexpr = tl.constexpr(T.BLOCK_V)
    BLOCK_K: tl.constexpr = tl.constexpr(T.BLOCK_K)
    h_rows = head.hidden + tl.multiple_of(rows.to(tl.int64)[:, None] * head.stride_h, [ALIGN, ALIGN])
    w_rows = head.weight + tl.multiple_of(cols.to(tl.int64)[:, None] * head.stride_w, [ALIGN, ALIGN])
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=ACC)
    d_full = D - D % BLOCK_K
    for k0 in range(0, d_full, BLOCK_K):
        ks = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        h = tl.load(h_rows + ks[None, :], mask=row_mask[:, None], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=T.PRECISION, out_dtype=ACC)
    if d_full < D:
        ks = d_full + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        h = tl.load(h_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=T.PRECISION, out_dtype=ACC)
    return acc


@triton.jit
def capped(x, head: Head, params_ptr, cols, col_mask, P_OFF: tl.constexpr, HAS_BIAS: tl.constexpr,
           HAS_SOFTCAP: tl.constexpr):
    """c = softcap * tanh(logit_scale * (x + b) / softcap), or logit_scale * (x + b) without a soft-cap."""
    if HAS_BIAS:
        x += tl.load(head.bias + cols, mask=col_mask, other=0.0).to(x.dtype)[None, :]
    u = x * tl.load(params_ptr + P_OFF + P_SCALE)
    if HAS_SOFTCAP:
        cap = tl.load(params_ptr + P_OFF + P_CAP)
        u = cap * tanh(u / cap)
    return u


@triton.jit
def tempered(c, params_ptr, col_mask, P_OFF: tl.constexpr):
    """z = c / temperature, -inf on padded columns."""
    z = c / tl.load(params_ptr + P_OFF + P_TEMP)
    return tl.where(col_mask[None, :], z, float("-inf"))


@triton.jit
def logits_tile(head: Head, D, params_ptr, rows, row_mask, cols, col_mask, P_OFF: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, T: tl.constexpr, ACC: tl.constexpr):
    """(z, c) of one side for one tile: the product, bias, logit_scale and soft-cap give c, the temperature
    gives z. ``P_OFF`` selects the student or the teacher scalars."""
    c = capped(raw_product(head, D, rows, row_mask, cols, col_mask, T, ACC), head, params_ptr, cols, col_mask,
               P_OFF, HAS_BIAS, HAS_SOFTCAP)
    return tempered(c, params_ptr, col_mask, P_OFF), c


@triton.jit
def teacher_of_raw(x, teacher: Head, params_ptr, cols, col_mask, F: tl.constexpr):
    """z_t of a tile from the teacher's raw product x_t (the grad-in-forward workspace's cuBLAS product): its bias,
    logit_scale, soft-cap and temperature, -inf on padded columns (``logits_tile``'s formula)."""
    c = capped(x, teacher, params_ptr, cols, col_mask, P_T_SCALE, F.HAS_TEACHER_BIAS, F.HAS_TEACHER_SOFTCAP)
    return tempered(c, params_ptr, col_mask, P_T_SCALE)


@triton.jit
def both_tiles(student: Head, teacher: Head, ws: Head, D, DT, params_ptr, rows, row_mask, cols, col_mask,
               WANT_TEACHER: tl.constexpr, F: tl.constexpr, T: tl.constexpr, ACC: tl.constexpr):
    """(z, c, z_t) of a tile: formed from the products, or (``F.LOAD_LOGITS``) read back from the workspace
    ``ws``: c that the forward kept (``store_tiles``) and the teacher's raw product x_t that cuBLAS wrote, its
    transform applied here (``teacher_of_raw``). z_t is z unless ``WANT_TEACHER``. Workspace rows hold a whole
    number of tiles (the backend pads them), so the columns need no mask and move 16 bytes at a time; what
    lies past V is never used (z = z_t = -inf there)."""
    if F.LOAD_LOGITS:
        offs = rows.to(tl.int64)[:, None] * ws.stride_h + cols[None, :]
        mask = row_mask[:, None]
        c = tl.load(ws.hidden + offs, mask=mask, other=0.0)
        z = tempered(c, params_ptr, col_mask, 0)
    else:
        z, c = logits_tile(student, D, params_ptr, rows, row_mask, cols, col_mask, 0, F.HAS_BIAS, F.HAS_SOFTCAP,
                           T, ACC)
    zt = z
    if WANT_TEACHER:
        if F.LOAD_LOGITS:
            zt = teacher_of_raw(tl.load(ws.weight + offs, mask=mask, other=0.0), teacher, params_ptr, cols, col_mask,
                                F)
        else:
            zt, ct = logits_tile(teacher, DT, params_ptr, rows, row_mask, cols, col_mask, P_T_SCALE,
                                 F.HAS_TEACHER_BIAS, F.HAS_TEACHER_SOFTCAP, T, ACC)
    return z, c, zt


@triton.jit
def store_tiles(c, ws: Head, rows, row_mask, cols, col_mask):
    """Keep a tile for the grad-in-forward path: c in ``ws.hidden`` (row stride ``ws.stride_h``). c rather than z:
    z = c / temperature is recomputed bit for bit, and the soft-cap's chain rule needs c."""
    offs = rows.to(tl.int64)[:, None] * ws.stride_h + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]  # (without the column mask the 128 x 128 tile spills)
    tl.store(ws.hidden + offs, c, mask=mask)


@triton.jit
def teacher_at(ws: Head, teacher: Head, params_ptr, rows, col, mask, F: tl.constexpr):
    """z_t at one column per row (``col``, where ``mask``) from the kept raw product x_t: ``teacher_of_raw``'s
    operations, in its order, on one value per row."""
    x = tl.load(ws.weight + rows.to(tl.int64) * ws.stride_h + col, mask=mask, other=0.0)
    if F.HAS_TEACHER_BIAS:
        x += tl.load(teacher.bias + col, mask=mask, other=0.0).to(x.dtype)
    u = x * tl.load(params_ptr + P_T_SCALE + P_SCALE)
    if F.HAS_TEACHER_SOFTCAP:
        cap = tl.load(params_ptr + P_T_SCALE + P_CAP)
        u = cap * tanh(u / cap)
    return u / tl.load(params_ptr + P_T_SCALE + P_TEMP)


@triton.jit
def rebase(m_old, tile_max):
    """New running max, the factor exp(m_old - m_new) and the shift m_old - m_new, both 0 for an
    empty running state (m_old = -inf), and the max to subtract from the tile (0 when all -inf)."""
    m_new = tl.maximum(m_old, tile_max)
    empty = m_old == float("-inf")
    f = tl.where(empty, 0.0, tl.exp(m_old - m_new))
    dm = tl.where(empty, 0.0, m_old - m_new)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, f, dm, m_sub


@triton.jit
def empty_state(BLOCK_M: tl.constexpr, ACC: tl.constexpr):
    """The partial statistics of no columns (``core/partials.FIELDS`` order): maxima -inf, sums 0."""
    neg_inf = tl.full((BLOCK_M,), float("-inf"), ACC)
    zero = tl.zeros((BLOCK_M,), ACC)
    return neg_inf, zero, zero, zero, zero, zero, neg_inf, zero, zero, zero, zero, neg_inf, zero


@triton.jit
def finite(x):
    """x is neither infinite nor NaN."""
    return (x - x) == 0.0


@triton.jit
def keep_inf(part, rebased):
    """A KL partial rebased to new maxima: +inf stays +inf whatever the factor (core/partials.py)."""
    return tl.where(part == float("inf"), part, rebased)


@triton.jit
def reverse_kl_columns(ez, z, zc, zt, ztr):
    """A tile's columns of a: e^(z - m) ((z - m) - (z_t - ztm)), 0 where e^(z - m) is 0, +inf where z is finite
    and z_t is -inf (mass the teacher lacks). ``zc`` = z - m, ``ztr`` = z_t - ztm."""
    return tl.where(finite(z) & (zt == float("-inf")), float("inf"), tl.where(ez == 0.0, 0.0, ez * (zc - ztr)))


@triton.jit
def teacher_step(mt, st, b, zt, z, zc, dm, WANT_B: tl.constexpr):
    """The teacher's running statistics over one more tile: (mt, st) online in its own maximum and, with
    ``WANT_B``, b = sum e^(z_t - mt) ((z_t - mt) - (z - m)), +inf where z_t is finite and z is -inf. ``zc`` =
    z - m in the student's frame of this tile, ``dm`` the shift of that frame from the previous tile's (0 where
    the student's maximum is final: the grad-in-forward teacher fold). Returns (mt, st, b)."""
    mt_new, g, dmt, mt_sub = rebase(mt, tl.max(zt, axis=1))
    ztc = zt - mt_sub[:, None]
    ezt = tl.exp(ztc)
    st_old = st
    st = g * st + tl.sum(ezt, axis=1)
    if WANT_B:
        b_cols = tl.where(finite(zt) & (z == float("-inf")), float("inf"),
                          tl.where(ezt == 0.0, 0.0, ezt * (ztc - zc)))
        b = keep_inf(b, g * (b + st_old * (dmt - dm))) + tl.sum(b_cols, axis=1)
    return mt_new, st, b


@triton.jit
def online_update(state, z, zt, tgt, v0, cols, col_mask, F: tl.constexpr):
    """Fold one tile into the running partial statistics (``core/partials.py``), all relative to the
    running maxima::

        s = sum e^(z-m)        e = sum e^(z-m) (z-m)        s2 = sum e^(2(z-m))       sz = sum z
        st = sum e^(zt-mt)     a = sum e^(z-m) ((z-m) - (zt-ztm))     b = sum e^(zt-mt) ((zt-mt) - (z-m))
        t = s - 1, the sum without the running maximum column's own e^0 = 1 (log s = log1p(t))
        ztm = zt at the (first) maximum column of z (with ``F.TEACHER_AT_MAX``, the grad-in-forward forward's, where the
              teacher fold is to read it: the first column of the tile holding that column)
        zy = z at the target        mb = max of z over the columns before the target

    t never cancels: when the tile holds a new (strictly larger) maximum, the old columns become
    f (1 + t) and the tile's first maximum column is left out of its sum; otherwise every column of the
    tile is added (a column tied with the running maximum adds exactly 1). Terms with e^(.) = 0 (padded
    columns) are dropped explicitly: 0 * -inf would be NaN. The KL partials follow rule G (core/partials.py):
    +inf where the own side's logit is finite and the other's -inf, whatever exp underflows to here."""
    m, s, t, e, s2, sz, mt, st, a, b, zy, mb, ztm = state
    tile_max = tl.max(z, axis=1)
    m_new, f, dm, m_sub = rebase(m, tile_max)
    zc = z - m_sub[:, None]
    ez = tl.exp(zc)
    s_old = s
    tile_sum = tl.sum(ez, axis=1)
    s = f * s + tile_sum
    # The columns at the tile's maximum each add exactly e^0 = 1 (none when the row is all -inf): leaving
    # one of them out is subtracting 1 from their count, not from a rounded sum.
    at_max = tl.where(z == tile_max[:, None], ez, 0.0)
    ties = tl.sum(at_max, axis=1)
    rest = tl.sum(ez - at_max, axis=1) + tl.maximum(ties - 1.0, 0.0)
    moved = tile_max > m
    t = tl.where(moved, f * (1.0 + t) + rest, t + tile_sum)
    if F.WANT_E:
        e = f * (e + s_old * dm) + tl.sum(tl.where(ez == 0.0, 0.0, ez * zc), axis=1)
    if F.WANT_S2:
        s2 = f * f * s2 + tl.sum(ez * ez, axis=1)
    if F.WANT_SZ:
        sz += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
    if F.HAS_TEACHER:
        mt, st, b = teacher_step(mt, st, b, zt, z, zc, dm, True)
        # a's frame is the student's first maximum column: this tile's first one where it holds a new maximum.
        first = tl.min(tl.where(z == tile_max[:, None], cols[None, :], NO_COLUMN), axis=1)
        zt_first = tl.sum(tl.where(cols[None, :] == first[:, None], zt, 0.0), axis=1)
        ztm_new = tl.where(moved, zt_first, ztm)
        dztm = tl.where(m == float("-inf"), 0.0, ztm - ztm_new)
        ztr = zt - tl.where(ztm_new == float("-inf"), 0.0, ztm_new)[:, None]
        a = keep_inf(a, f * (a + s_old * (dm - dztm))) + tl.sum(reverse_kl_columns(ez, z, zc, zt, ztr), axis=1)
        # the maximum column's own mass meets a teacher zero: KL(q || p) = +inf whatever the rest gives
        a = tl.where((ztm_new == float("-inf")) & finite(m_new), float("inf"), a)
        ztm = ztm_new
    if F.TEACHER_AT_MAX:
        # the grad-in-forward forward's ztm slot: the first column of the tile holding the first maximum (exact in ACC:
        # V < 2**24); the teacher fold finds the column in that tile and reads the teacher's logit there
        ztm = tl.where(moved, v0.to(ztm.dtype), ztm)
    if F.HAS_TARGETS:
        zy += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        if F.WANT_TOP1:
            # with it, is_top1 follows argmax's rule on ties: the target must be the first maximum
            mb = tl.maximum(mb, tl.max(tl.where(cols[None, :] < tgt[:, None], z, float("-inf")), axis=1))
    return m_new, s, t, e, s2, sz, mt, st, a, b, zy, mb, ztm


class Named(NamedTuple):
    """Named columns (core/columns.py): ``ids`` int64 ``[N, K]`` (-1: none) and ``entries`` ``[N, K]``, the
    logits at them (forward, written) or their given dz (gradient, read); ``count`` = K. (Not ``values``: a
    compiled kernel's tuple has an attribute of that name, its elements.)"""

    ids: Any
    entries: Any
    count: Any


@triton.jit
def named_hit(named: Named, at, row_mask, cols):
    """Each row's named column at entry offset ``at`` and whether it lies in this tile's columns."""
    col = tl.load(named.ids + at, mask=row_mask, other=-1)
    return col, row_mask & (col >= tl.min(cols, axis=0)) & (col <= tl.max(cols, axis=0))


@triton.jit
def store_named_logits(z, named: Named, rows, row_mask, cols):
    """The tile's logits at the rows' named columns that lie in it, into ``named.entries``: the statistics'
    own z, so that z_k - m is exact near the maximum. A column outside every row's tile costs one load per row
    and entry."""
    at = rows.to(tl.int64) * named.count
    for k in range(named.count):
        col, hit = named_hit(named, at + k, row_mask, cols)
        if tl.max(hit.to(tl.int32), axis=0) > 0:
            value = tl.sum(tl.where(cols[None, :] == col[:, None], z, 0.0), axis=1)
            tl.store(named.entries + at + k, value, mask=hit)


@triton.jit
def named_dz(dz, named: Named, rows, row_mask, cols):
    """dz with the rows' named columns in this tile set to their given values (entries naming one column hold
    one value, so their order does not matter)."""
    at = rows.to(tl.int64) * named.count
    for k in range(named.count):
        col, hit = named_hit(named, at + k, row_mask, cols)
        if tl.max(hit.to(tl.int32), axis=0) > 0:
            value = tl.load(named.entries + at + k, mask=hit, other=0.0)
            dz = tl.where(cols[None, :] == col[:, None], value[:, None].to(dz.dtype), dz)
    return dz


@triton.jit
def named_rows(named: Named, rows, row_mask):
    """The rows with a non-zero given dz at one of their named columns: they carry gradient whatever their
    coefficients."""
    at = rows.to(tl.int64) * named.count
    carries = row_mask & (rows < 0)
    for k in range(named.count):
        value = tl.load(named.entries + at + k, mask=row_mask, other=0.0)
        carries = carries | (row_mask & (value != 0.0))
    return carries


@triton.jit
def store_state(state, part_ptr, split, num_splits, N, rows, row_mask):
    """Partial statistics of one (row block, split) into ``part[field, split, row]``."""
    out = part_ptr + split.to(tl.int64) * N + rows
    plane = num_splits.to(tl.int64) * N
    for i in tl.static_range(NUM_STATE):
        tl.store(out + i * plane, state[i], mask=row_mask)


@triton.jit
def load_targets(tgt_ptr, rows, row_mask, HAS_TARGETS: tl.constexpr):
    """(targets, rows that count): -1 and the row mask itself without targets."""
    tgt = tl.full(rows.shape, -1, tl.int64)
    active = row_mask
    if HAS_TARGETS:
        tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
        active = row_mask & (tgt >= 0)
    return tgt, active


@triton.jit
def load_normaliser(ptr, N, rows, mask):
    """A log-normaliser as an unevaluated sum hi + lo (``[2, N]``: row 0 hi, row 1 lo). In fp32 the lse of a
    confident row (~30) carries an absolute rounding error of 1e-6, which log q = z - lse would pass to
    1 - q_y ~ 1e-2 as a 1e-4 relative error; with lo = (m - hi) + log s the gradient is as accurate as a
    naive log-softmax."""
    hi = tl.load(ptr + rows, mask=mask, other=0.0)
    lo = tl.load(ptr + N + rows, mask=mask, other=0.0)
    return hi, lo


@triton.jit
def load_coefficients(coef_ptr, N, rows, row_mask):
    """The seven per-row dz coefficients (problem.py order a, c0, c1, c2, c3, c4, c5; ``[7, N]``
    contiguous) and which rows have any non-zero one (the others get dx = 0 without being formed)."""
    a = tl.load(coef_ptr + rows, mask=row_mask, other=0.0)
    c0 = tl.load(coef_ptr + N + rows, mask=row_mask, other=0.0)
    c1 = tl.load(coef_ptr + 2 * N + rows, mask=row_mask, other=0.0)
    c2 = tl.load(coef_ptr + 3 * N + rows, mask=row_mask, other=0.0)
    c3 = tl.load(coef_ptr + 4 * N + rows, mask=row_mask, other=0.0)
    c4 = tl.load(coef_ptr + 5 * N + rows, mask=row_mask, other=0.0)
    c5 = tl.load(coef_ptr + 6 * N + rows, mask=row_mask, other=0.0)
    active = row_mask & ((a != 0) | (c0 != 0) | (c1 != 0) | (c2 != 0) | (c3 != 0) | (c4 != 0) | (c5 != 0))
    return (a, c0, c1, c2, c3, c4, c5), active


@triton.jit
def target_column(a, logq_y, inner_y):
    """dz at the target column before the teacher and uniform terms, a (1 - q_y) + q_y inner_y, per row, as
    ``-a expm1(log q_y) + q_y inner_y`` (``backends/torch.py::target_column``): expm1 keeps the digits of 1 - q_y
    for a confident target and of q_y for an improbable one, and inner_y holds c0 unrounded by a. q_y == 0 (a
    masked logit) gives exactly ``a`` (inner_y holds c1 log 0 = -inf there, and 0 * inf would be NaN).
    expm1 in float64."""
    qm1 = expm1(logq_y.to(tl.float64)).to(logq_y.dtype)
    q_y = tl.exp(logq_y)
    return tl.where(q_y == 0.0, 0.0, q_y * inner_y) - a * qm1


@triton.jit
def logits_gradient(z, c, zt, norm, norm_t, frame, coef, logq_y, tgt, cols, col_mask, active, params_ptr, named,
                    rows, F: tl.constexpr):
    """dx for one tile (``backends/torch.py::logits_gradient_tile``): the generic dz of problem.py,

        dz_j = a ([j = y] - q_j) + q_j (c0 + c1 log q_j + c2 r_j + c4 log m_j) + c3 p_j + c5,
        r_j  = (z_j - row_max) - (zt_j - teacher_at_max) - kl_rev_rel    (``frame``: those three per row)

    with only the terms the problem can produce (``Flags``), then the chain rule
    dx = dz * (logit_scale / temperature) * (1 - (c / softcap)**2). Off the target a's share -a q_j joins c0;
    the target column is formed per row (``target_column``) from ``logq_y``, the forward's log-probability of
    the target, ``(z_y - m) - log s``: the most accurate form of it there is. With ``F.HAS_COLUMNS`` the named
    columns' dz is the given one (``named``, core/columns.py), before the teacher and uniform terms. Padded
    columns and inactive rows are forced to exactly 0 (their q may be inf * 0 = NaN)."""
    a, c0, c1, c2, c3, c4, c5 = coef
    lse, lse_lo = norm
    logq = (z - lse[:, None]) - lse_lo[:, None]
    inner = (c0 - a)[:, None]
    inner_y = c0
    if F.HAS_LOG_TERMS:
        inner = inner + c1[:, None] * logq
        inner_y = inner_y + c1 * logq_y
    if F.HAS_KL_REV or F.HAS_KL_FWD or F.HAS_JSD:
        lse_t, lse_t_lo = norm_t
        logpt = (zt - lse_t[:, None]) - lse_t_lo[:, None]
        if F.HAS_TARGETS and (F.HAS_KL_REV or F.HAS_JSD):
            zt_y = tl.sum(tl.where(cols[None, :] == tgt[:, None], zt, 0.0), axis=1)
            logpt_y = (zt_y - lse_t) - lse_t_lo
        if F.HAS_KL_REV:
            # 0 where c2 is: a row outside the loss whose KL is +inf contributes nothing
            row_max, zt_max, rel = frame
            r = ((z - row_max[:, None]) - (zt - zt_max[:, None])) - rel[:, None]
            inner = inner + tl.where(c2[:, None] == 0.0, 0.0, c2[:, None] * r)
            if F.HAS_TARGETS:
                z_y = tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
                r_y = ((z_y - row_max) - (zt_y - zt_max)) - rel
                inner_y = inner_y + tl.where(c2 == 0.0, 0.0, c2 * r_y)
        if F.HAS_JSD:
            log1m_beta = tl.load(params_ptr + P_LOG1M_BETA)
            log_beta = tl.load(params_ptr + P_LOG_BETA)
            inner = inner + c4[:, None] * logaddexp(logq + log1m_beta, logpt + log_beta)
            if F.HAS_TARGETS:
                inner_y = inner_y + c4 * logaddexp(logq_y + log1m_beta, logpt_y + log_beta)
    q = tl.exp(logq)
    dz = tl.where(q == 0.0, 0.0, q * inner)  # q_j log q_j -> 0 where q_j = 0 (a -inf logit)
    if F.HAS_TARGETS:
        dz = tl.where(cols[None, :] == tgt[:, None], target_column(a, logq_y, inner_y)[:, None], dz)
    if F.HAS_COLUMNS:
        dz = named_dz(dz, named, rows, active, cols)
    if F.HAS_KL_FWD:
        dz += c3[:, None] * tl.exp(logpt)
    if F.HAS_MEAN_LOGIT:
        dz += c5[:, None]
    dx_scale = tl.load(params_ptr + P_DX_SCALE)
    if F.HAS_SOFTCAP:
        r = c / tl.load(params_ptr + P_CAP)
        dx = dz * (dx_scale * (1.0 - r * r))
    else:
        dx = dz * dx_scale
    return tl.where(active[:, None] & col_mask[None, :], dx, 0.0)
