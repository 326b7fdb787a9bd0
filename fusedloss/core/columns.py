"""Named columns: the log-probabilities at K given columns of each row, and the dz they give.

A teacher's top-k ids, the k candidates of a ranking loss, a sampled token beside them: each is a column of
the ``[N, V]`` logits the statistics core never holds (``StatsProblem.columns``, ``[N, K]`` ids, -1 for
none). Every backend reads the logits at those columns from the very tiles it folds into the statistics, so
``log q_k = (z_k - row_max) - log s`` keeps the digits of a confident row exactly as the one-target
``logp = (z_y - m) - log s`` does (a second product, rounded in another order, would make the last bit of
z the leading digit of ``log q_k ~ -1e-13``).

The backward is the target formula of problem.py with K one-hot shares. For gradients ``g_k`` of the K
log-probabilities, ``d/dz_j = sum_k g_k ([j = y_k] - q_j)``: off the named columns ``-a q_j`` with
``a = sum_k g_k`` (the coefficient ``a`` of every other column), and at a named column ``j``

    dz_j = -g_j expm1(log q_j) + q_j (c0 - r_j + c1 log q_j)

with ``g_j`` the sum of the gradients naming column j and ``r_j`` that of the others, each summed from the
g_k themselves (``a - g_j`` would round at ulp(a)): ``g_j (1 - q_j)`` keeps its digits on a confident row
and the gradients' shares never meet as rounded values. Every backend writes this ``column_dz`` into its
fp32 dz tile before the chain rule and the single rounding of dx (docs/design.md, "The dz formula").
"""

from __future__ import annotations

from typing import Optional

import torch

from .problem import COEF_CONST, COEF_LOGQ, COEF_ONEHOT, Statistics

# Rows per chunk of the backward's [rows, K, K + 1] comparisons: about this many elements.
_CHUNK_ELEMENTS = 1 << 22


def log_probs(stats: Statistics, logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` log q at the named columns from their logits ``[N, K]`` (as the backend read them) and the
    row's statistics: ``(z_k - row_max) - log s`` with ``log s = (lse - row_max) + lse_lo`` (the log-sum-exp
    to twice the working precision, docs/design.md "Numerical doctrine"); 0 where there is no column."""
    m = stats.row_max[:, None]
    log_s = (stats.lse[:, None] - m) + stats.lse_lo[:, None]
    return torch.where(columns >= 0, (logits - m) - log_s, torch.zeros((), dtype=logits.dtype, device=logits.device))


def gradients(coeffs: torch.Tensor, columns: torch.Tensor, logp: torch.Tensor, grad: torch.Tensor,
              targets: Optional[torch.Tensor], target_grad: Optional[torch.Tensor]) -> tuple:
    """``(coefficients, column_dz)``: the ``[7, N]`` coefficients with ``a`` the sum of every one-hot share,
    and ``[N, K]`` the dz of each named column (0 where there is none). ``logp``, ``grad``: the columns'
    log-probabilities and their gradients; the row's target (``targets``, with ``target_grad`` the gradient
    of the ``logp`` statistic) is one more one-hot share, at a column that is also named. Entries naming the
    same column get the same value, bit for bit."""
    n, k = columns.shape
    valid = columns >= 0
    if targets is not None:  # an ignored row has no gradient whatever its entries hold
        valid = valid & (targets >= 0)[:, None]
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    g = torch.where(valid, grad.to(logp.dtype), zero)
    cols, shares = columns, g
    if target_grad is not None and targets is not None:
        cols = torch.cat((columns, targets[:, None]), dim=1)
        shares = torch.cat((g, torch.where(targets >= 0, target_grad.to(logp.dtype), zero)[:, None]), dim=1)
    c0, c1 = coeffs[COEF_CONST], coeffs[COEF_LOGQ]
    column_dz = torch.zeros_like(logp)
    # A compiled graph takes every row at once (a loop over a dynamic N would fix it in the graph).
    step = n if torch.compiler.is_compiling() else max(1, _CHUNK_ELEMENTS // max(1, k * cols.shape[1]))
    for r0 in range(0, n, max(1, step)):
        rows = slice(r0, r0 + step)
        same = (columns[rows, :, None] == cols[rows, None, :]) & (cols[rows, None, :] >= 0)
        share = shares[rows, None, :]
        own = torch.where(same, share, zero).sum(-1)  # g_j: every share naming this entry's column
        rest = torch.where(same, zero, share).sum(-1)  # r_j: every other share
        lq = logp[rows]
        c1_log_q = torch.where(c1[rows, None] == 0, zero, c1[rows, None] * lq)  # 0 log 0: a masked column
        inner = (c0[rows, None] - rest) + c1_log_q
        q = torch.exp(lq)
        value = torch.where(q == 0, zero, q * inner) - own * torch.expm1(lq)
        column_dz[rows] = torch.where(valid[rows], value, zero)
    a = shares.sum(1)
    return torch.cat((a[None], coeffs[COEF_ONEHOT + 1:])), column_dz


def gather(tile: torch.Tensor, columns: torch.Tensor, v0: int, current: torch.Tensor) -> torch.Tensor:
    """``current`` (``[rows, K]``) with the tile's values at the named columns inside it (columns ``[v0, v0 +
    tile.shape[1])``)."""
    inside = (columns >= v0) & (columns < v0 + tile.shape[1])
    idx = torch.where(inside, columns - v0, torch.zeros_like(columns))
    return torch.where(inside, tile.gather(1, idx), current)


def put(tile: torch.Tensor, columns: torch.Tensor, values: torch.Tensor, v0: int) -> None:
    """``tile[r, columns[r, k] - v0] = values[r, k]`` (rounded once to the tile's dtype) for the named columns
    inside the tile, columns ``[v0, v0 + tile.shape[1])``; ``columns``, ``values``: the tile's rows' ``[rows,
    K]``. No host synchronisation: an entry outside the tile writes what its row writes anyway (its first
    entry inside, or column 0's own value where it has none), and entries naming one column hold one value,
    so the order of the writes never matters."""
    if tile.shape[1] == 0 or columns.shape[1] == 0:
        return
    inside = (columns >= v0) & (columns < v0 + tile.shape[1])
    idx = torch.where(inside, columns - v0, torch.zeros_like(columns))
    values = values.to(tile.dtype)
    first = inside.to(torch.uint8).argmax(1, keepdim=True)
    has = inside.any(1, keepdim=True)
    fill_idx = torch.where(has, idx.gather(1, first), torch.zeros_like(first))
    fill_value = torch.where(has, values.gather(1, first), tile[:, :1].clone())
    tile.scatter_(1, torch.where(inside, idx, fill_idx), torch.where(inside, values, fill_value))

