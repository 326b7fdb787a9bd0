"""Tile math shared by the Triton kernels: one ``[BLOCK_M, BLOCK_V]`` logits tile, its online
statistics update, and its gradient. Every kernel of this package is a loop around these helpers,
so the statistics and their gradient are written once, with the names of ``core/problem.py``.

Conventions shared by all kernels:

* ``params`` is a small tensor in the accumulation dtype holding the scalars of the problem
  (see ``backend._params``). Scalars travel in memory rather than as kernel arguments because
  Triton passes Python floats as fp32 (and so does the CPU interpreter), which would round
  ``temperature = 0.7`` before a float64 computation.
* Padded columns (``cols >= V``) get ``z = -inf`` and contribute exactly zero to every sum;
  padded rows are loaded as zeros and never stored. Row and column offsets are int64, so
  ``V * D`` or ``N * D`` above 2**31 never wraps.
* Products accumulate in ``ACC`` (fp32, or float64 for float64 inputs) whatever the input dtype.
"""

import triton
import triton.language as tl

# Offsets into the params tensor (backend._params builds it in this order). Globals read by a kernel
# must be tl.constexpr. P_T_SCALE is also the offset of the teacher's (scale, cap, temperature).
P_SCALE = tl.constexpr(0)
P_CAP = tl.constexpr(1)
P_TEMP = tl.constexpr(2)
P_T_SCALE = tl.constexpr(3)
P_LOG1M_BETA = tl.constexpr(6)
P_LOG_BETA = tl.constexpr(7)
P_DX_SCALE = tl.constexpr(8)


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
def logits_tile(h_ptr, stride_h, w_ptr, stride_w, b_ptr, params_ptr, rows, row_mask, cols, col_mask, D,
                P_OFF: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                ACC: tl.constexpr, PRECISION: tl.constexpr):
    """(z, c) for one tile: x = h @ W.T (+ b) with a K-loop over D, then
    c = softcap * tanh(logit_scale * x / softcap) (or logit_scale * x) and z = c / temperature.
    Padded columns get z = -inf. ``P_OFF`` selects the student or the teacher scalars."""
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=ACC)
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < D
        h = tl.load(h_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION, out_dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    u = acc * tl.load(params_ptr + P_OFF + P_SCALE)
    if HAS_SOFTCAP:
        cap = tl.load(params_ptr + P_OFF + P_CAP)
        c = cap * tanh(u / cap)
    else:
        c = u
    z = c / tl.load(params_ptr + P_OFF + P_TEMP)
    z = tl.where(col_mask[None, :], z, float("-inf"))
    return z, c


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
def online_update(z, zt, zy, tgt, cols, col_mask, m, s, t, e, s2, sz, mt, st, a, b,
                  HAS_TEACHER: tl.constexpr, WANT_E: tl.constexpr, WANT_S2: tl.constexpr, WANT_SZ: tl.constexpr,
                  HAS_TARGETS: tl.constexpr):
    """Fold one tile into the running statistics, all relative to the running maxima
    (torch_backend's partial statistics, merged into the running ones element-wise):

        s = sum e^(z-m)        e = sum e^(z-m) (z-m)        s2 = sum e^(2(z-m))       sz = sum z
        st = sum e^(zt-mt)     a = sum e^(z-m) ((z-m) - (zt-mt))      b = sum e^(zt-mt) ((zt-mt) - (z-m))
        t = s - 1, the sum without the running maximum column's own e^0 = 1 (log s = log1p(t))

    and the target logit zy. t never cancels: when the tile holds a new (strictly larger) maximum, the
    old columns become f (1 + t) and the tile's first maximum column is left out of its sum; otherwise
    every column of the tile is added (a column tied with the running maximum adds exactly 1).
    Terms with e^(.) = 0 (padded columns) are dropped explicitly: 0 * -inf would be NaN."""
    tile_max = tl.max(z, axis=1)
    m_new, f, dm, m_sub = rebase(m, tile_max)
    zc = z - m_sub[:, None]
    ez = tl.exp(zc)
    s_old = s
    s = f * s + tl.sum(ez, axis=1)
    new_max = tile_max > m
    first_max = tl.min(tl.where(z == tile_max[:, None], cols[None, :], 2147483647), axis=1)
    left_out = new_max[:, None] & (cols[None, :] == first_max[:, None])
    t = tl.where(new_max, f * (1.0 + t), t) + tl.sum(tl.where(left_out, 0.0, ez), axis=1)
    if WANT_E:
        e = f * (e + s_old * dm) + tl.sum(tl.where(ez == 0.0, 0.0, ez * zc), axis=1)
    if WANT_S2:
        s2 = f * f * s2 + tl.sum(ez * ez, axis=1)
    if WANT_SZ:
        sz += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
    if HAS_TEACHER:
        mt_new, g, dmt, mt_sub = rebase(mt, tl.max(zt, axis=1))
        ztc = zt - mt_sub[:, None]
        ezt = tl.exp(ztc)
        st_old = st
        st = g * st + tl.sum(ezt, axis=1)
        diff = zc - ztc
        a = f * (a + s_old * (dm - dmt)) + tl.sum(tl.where(ez == 0.0, 0.0, ez * diff), axis=1)
        b = g * (b + st_old * (dmt - dm)) - tl.sum(tl.where(ezt == 0.0, 0.0, ezt * diff), axis=1)
        mt = mt_new
    if HAS_TARGETS:
        zy += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    return zy, m_new, s, t, e, s2, sz, mt, st, a, b


@triton.jit
def max_before_target(z, tgt, cols):
    """max of z over the tile's columns before each row's target (-inf where there are none; padded
    columns are -inf already). With it, is_top1 follows argmax's rule on ties: the first maximum."""
    return tl.max(tl.where(cols[None, :] < tgt[:, None], z, float("-inf")), axis=1)


@triton.jit
def load_coefficients(coef_ptr, N, rows, row_mask):
    """The seven per-row dz coefficients (problem.py order a, c0, c1, c2, c3, c4, c5; ``[7, N]``
    contiguous) and which rows have any non-zero one (the others are skipped)."""
    a = tl.load(coef_ptr + rows, mask=row_mask, other=0.0)
    c0 = tl.load(coef_ptr + N + rows, mask=row_mask, other=0.0)
    c1 = tl.load(coef_ptr + 2 * N + rows, mask=row_mask, other=0.0)
    c2 = tl.load(coef_ptr + 3 * N + rows, mask=row_mask, other=0.0)
    c3 = tl.load(coef_ptr + 4 * N + rows, mask=row_mask, other=0.0)
    c4 = tl.load(coef_ptr + 5 * N + rows, mask=row_mask, other=0.0)
    c5 = tl.load(coef_ptr + 6 * N + rows, mask=row_mask, other=0.0)
    active = row_mask & ((a != 0) | (c0 != 0) | (c1 != 0) | (c2 != 0) | (c3 != 0) | (c4 != 0) | (c5 != 0))
    return a, c0, c1, c2, c3, c4, c5, active


@triton.jit
def load_normaliser(ptr, N, rows, mask):
    """A log-normaliser as an unevaluated sum hi + lo (``[2, N]``: row 0 hi, row 1 lo). In fp32 the
    lse of a confident row (~30) carries an absolute rounding error of 1e-6, which log q = z - lse
    would pass to 1 - q_y ~ 1e-2 as a 1e-4 relative error; with lo = (m - hi) + log s the gradient is
    as accurate as a naive log-softmax."""
    hi = tl.load(ptr + rows, mask=mask, other=0.0)
    lo = tl.load(ptr + N + rows, mask=mask, other=0.0)
    return hi, lo


@triton.jit
def logits_gradient(z, c, zt, lse, lse_lo, lse_t, lse_t_lo, tgt, cols, col_mask, active, a, c0, c1, c2, c3, c4, c5,
                    params_ptr,
                    HAS_TEACHER: tl.constexpr, HAS_JSD: tl.constexpr, HAS_KL_FWD: tl.constexpr,
                    HAS_MEAN_LOGIT: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """dx for one tile (torch_backend.logits_gradient_tile): the generic dz of problem.py,

        dz_j = a [j = y] + q_j (c0 + c1 log q_j + c2 log p_j + c4 log m_j) + c3 p_j + c5,

    then the chain rule dx = dz * (logit_scale / temperature) * (1 - (c / softcap)**2).
    Padded columns and inactive rows are forced to exactly 0 (their q may be inf * 0 = NaN)."""
    logq = (z - lse[:, None]) - lse_lo[:, None]
    inner = c0[:, None] + c1[:, None] * logq
    if HAS_TEACHER:
        logpt = (zt - lse_t[:, None]) - lse_t_lo[:, None]
        inner += c2[:, None] * logpt
        if HAS_JSD:
            log_m = logaddexp(logq + tl.load(params_ptr + P_LOG1M_BETA), logpt + tl.load(params_ptr + P_LOG_BETA))
            inner += c4[:, None] * log_m
    q = tl.exp(logq)
    dz = tl.where(q == 0.0, 0.0, q * inner)  # q_j log q_j -> 0 where q_j = 0 (a -inf logit)
    if HAS_TARGETS:
        # The target column: a + q inner = (a + inner) + inner (q - 1) with q - 1 = expm1(log q). For
        # log-probability terms a + inner cancels exactly (a = -c0), so a confident row keeps the digits
        # of 1 - q_y (1e-4 in fp32 would otherwise carry q's rounding, 6e-8, as 6e-4 relative). Formed
        # per row ([BLOCK_M]) on the gathered target column, with expm1 in float64.
        is_y = cols[None, :] == tgt[:, None]
        logq_y = tl.sum(tl.where(is_y, logq, 0.0), axis=1)
        inner_y = tl.sum(tl.where(is_y, inner, 0.0), axis=1)
        q_y = tl.sum(tl.where(is_y, q, 0.0), axis=1)
        qm1_y = expm1(logq_y.to(tl.float64)).to(logq_y.dtype)
        at_y = tl.where(q_y != 0.0, (a + inner_y) + inner_y * qm1_y, q_y * inner_y + a)
        dz = tl.where(is_y, at_y[:, None], dz)
    if HAS_TEACHER:
        if HAS_KL_FWD:
            dz += c3[:, None] * tl.exp(logpt)
    if HAS_MEAN_LOGIT:
        dz += c5[:, None]
    dx_scale = tl.load(params_ptr + P_DX_SCALE)
    if HAS_SOFTCAP:
        r = c / tl.load(params_ptr + P_CAP)
        dx = dz * (dx_scale * (1.0 - r * r))
    else:
        dx = dz * dx_scale
    return tl.where(active[:, None] & col_mask[None, :], dx, 0.0)
