"""The logits at a few given columns of each row: ``z[i, k] = logits[i, columns[i, k]]``, differentiable.

A teacher's top-k ids, the k candidates of a ranking loss, a sampled token beside them: each is a column of
the ``[N, V]`` logits the statistics core never holds. Reading K of them costs ``N K D`` multiply-adds (the
rows of ``weight`` they name, against each hidden row), nothing beside the ``2 N V D`` of one statistics pass
when K is far below V. The log-probabilities follow from the core's log-sum-exp:
``log q_k = (z_k - row_max) - log s`` (``losses/token_logprobs.py``).

The gradient is the one-hot share of ``d log q_k / dz_j = [j = y_k] - q_j``: ``dz`` at the K named columns,
through the elementwise chain rule of the logit transform (docs/design.md, "The dz formula"), then
``d hidden_i = sum_k dx_ik W[y_ik]``, ``d W[y] = sum over the entries naming y of dx h``, ``d b[y]`` likewise.
The rows are processed in chunks, so no ``[N, K, D]`` tensor is ever held; ``d weight`` is accumulated in
the accumulation dtype over the rows that are named only, with a sort-based accumulation (no atomics), so
the result does not depend on the order of the entries.
"""

from __future__ import annotations

from typing import Optional

import torch

from .problem import LogitTransform, accumulation_dtype

# Rows per chunk are chosen so that a chunk's gathered weight rows hold about this many elements.
_CHUNK_ELEMENTS = 1 << 22


def _rows_per_chunk(k: int, d: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, k * d))


def _chain(c: torch.Tensor, tf: LogitTransform) -> torch.Tensor:
    """dz/dx of ``z = softcap(logit_scale * x) / temperature`` given the capped value c."""
    factor = tf.logit_scale / tf.temperature
    if tf.softcap is None:
        return torch.full_like(c, factor)
    return factor * (1.0 - (c / tf.softcap) ** 2)


def _transformed(x: torch.Tensor, tf: LogitTransform) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, c) for raw logits x: c the scaled and capped value, z = c / temperature."""
    u = tf.logit_scale * x
    c = u if tf.softcap is None else tf.softcap * torch.tanh(u / tf.softcap)
    return c / tf.temperature, c


class _GatheredLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, columns, temperature, logit_scale, softcap):
        tf = LogitTransform(temperature, logit_scale, softcap)
        acc = accumulation_dtype(hidden.dtype)
        n, k = columns.shape
        valid = columns >= 0
        safe = torch.where(valid, columns, torch.zeros_like(columns))
        raw = hidden.new_empty((n, k), dtype=acc)
        step = _rows_per_chunk(k, hidden.shape[1])
        for start in range(0, n, step):
            rows = slice(start, start + step)
            # Products of half values are exact in fp32, so the sums are the core's up to their order.
            picked = weight[safe[rows]].to(acc)  # [n, K, D]
            raw[rows] = torch.bmm(picked, hidden[rows].to(acc).unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            raw = raw + bias[safe].to(acc)
        z, c = _transformed(raw, tf)
        z = torch.where(valid, z, torch.zeros_like(z))
        ctx.save_for_backward(hidden, weight, bias, safe, valid, c)
        ctx.transform = tf
        return z

    @staticmethod
    def backward(ctx, grad_z):
        hidden, weight, bias, safe, valid, c = ctx.saved_tensors
        acc = c.dtype
        # An entry without a column has no gradient, whatever grad_z holds there.
        dx = torch.where(valid, grad_z.to(acc) * _chain(c, ctx.transform), torch.zeros_like(c))
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = dw = db = None
        n, k = safe.shape
        step = _rows_per_chunk(k, hidden.shape[1])
        if need_h:
            dh = hidden.new_empty(hidden.shape, dtype=acc)
            for start in range(0, n, step):
                rows = slice(start, start + step)
                picked = weight[safe[rows]].to(acc)
                dh[rows] = torch.bmm(dx[rows].unsqueeze(1), picked).squeeze(1)
            dh = dh.to(hidden.dtype)
        if need_w or need_b:
            named, slot = torch.unique(safe.reshape(-1), return_inverse=True)
            slot = slot.reshape(n, k)
            if need_w:
                acc_w = hidden.new_zeros((named.shape[0], hidden.shape[1]), dtype=acc)
                for start in range(0, n, step):
                    rows = slice(start, start + step)
                    share = dx[rows].unsqueeze(-1) * hidden[rows].to(acc).unsqueeze(1)  # [n, K, D]
                    acc_w.index_put_((slot[rows].reshape(-1),), share.reshape(-1, hidden.shape[1]), accumulate=True)
                dw = torch.zeros_like(weight)
                dw[named] = acc_w.to(weight.dtype)
            if need_b and bias is not None:
                acc_b = dx.new_zeros(named.shape[0]).index_put_((slot.reshape(-1),), dx.reshape(-1), accumulate=True)
                db = torch.zeros_like(bias)
                db[named] = acc_b.to(bias.dtype)
        return dh, dw, db, None, None, None, None


def gathered_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], columns: torch.Tensor,
                    transform: LogitTransform = LogitTransform()) -> torch.Tensor:
    """``[N, K]`` logits of ``hidden [N, D]`` at ``columns [N, K]`` (int64 ids in ``[0, V)``, -1 for none: 0
    there, no gradient), in the accumulation dtype, differentiable in hidden, weight and bias."""
    return _GatheredLogits.apply(hidden, weight, bias, columns, float(transform.temperature),
                                 float(transform.logit_scale),
                                 None if transform.softcap is None else float(transform.softcap))
