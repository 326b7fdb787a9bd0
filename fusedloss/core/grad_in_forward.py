"""The 3-product path for losses known in the forward (docs/design.md, "Backends and their plans").

``token_statistics`` is composable: its backward recomputes every logits tile, so a loss costs 4
GEMM-sized products (statistics, then recompute, d hidden, d weight). When the whole loss is a sum of
*row-local* terms, ``loss = sum_rows f(stats_row)`` with weights known up front (cross-entropy,
distillation, token-level GRPO), a chunk of rows can be finished in the forward instead: the backend
keeps that chunk's logits in a bounded workspace, computes its statistics, asks ``f`` for the gradient
of the chunk's loss with respect to them (autograd on the loss module's own per-token math, so the math
is still written once), forms dz and accumulates d hidden, d weight, d bias right away: 3 products, no
recompute. The backward then only scales the stored gradients by the incoming scalar gradient.

Backends opt in with ``grad_in_forward_gradients(problem, chunk_fn, needs)``; the loss modules call
``grad_in_forward_loss`` only through ``fusedloss.losses.implicit_logits.ImplicitLogits.row_local_loss``, which falls
back to the
composable op when the backend has no grad-in-forward path, when no gradient is needed, or under torch.compile
(a Python callback cannot live inside a compiled graph; the custom op can).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from .. import config
from . import registry
from .problem import DeferredProduct, GradientNeeds, Statistics, StatsProblem, gathered_rows, valid_rows
from .statistics import SECOND_ORDER_MESSAGE, autocast_off, dz_coefficients

RowLoss = Callable[[Statistics, "slice | torch.Tensor"], torch.Tensor]
"""``row_loss(stats_of_rows, rows) -> scalar``: the loss contribution of those rows of the flattened batch;
``rows`` is a slice or an int64 index tensor (a backend may skip ignored rows), usable to index any
per-row tensor of the loss."""


def _chunk_function(row_loss: RowLoss, problem: StatsProblem, rows_of: Optional[torch.Tensor] = None):
    """Wrap a row-local loss into ``chunk_fn(stats, rows) -> (chunk loss, [7, len(rows)] coefficients)``.

    ``stats`` may be the backend's own buffers, valid during the call: they are read, never written or kept.
    Each statistic is its own leaf, so autograd gives None for those the loss does not use, and
    ``dz_coefficients`` skips them: no zero gradient rows are formed and stacked per chunk (the small kernels
    of a chunk, docs/design.md, "Plans and the performance model").

    ``rows_of``: where ``problem``'s rows sit in the loss's batch (an index tensor) when the problem holds
    only some of them; ``row_loss`` is then called with those positions."""
    vocab = problem.weight.shape[0]
    # per call, not per chunk: the ignored rows' mask, and the loss's seed gradient (autograd's ones_like)
    ignored = None if problem.targets is None else problem.targets < 0
    seed = {}

    def chunk_fn(stats: Statistics, rows):
        with torch.enable_grad():
            leaves = Statistics(*(s.detach().requires_grad_(True) for s in stats))
            loss = row_loss(leaves, rows if rows_of is None else rows_of[rows])
            if loss.numel() != 1:
                raise RuntimeError(f"row_loss must return a scalar, got shape {tuple(loss.shape)}")
            key = (loss.shape, loss.dtype, loss.device)
            if key not in seed:
                seed[key] = torch.ones_like(loss)
            grads = torch.autograd.grad(loss, leaves, seed[key], allow_unused=True)
        return loss.detach(), dz_coefficients(grads, stats, problem.jsd_beta, None, vocab,
                                              ignored=None if ignored is None else ignored[rows])

    return chunk_fn


class _GradInForwardLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, problem: StatsProblem, backend_name: str, row_loss: RowLoss,
                needs: GradientNeeds):
        device = torch.cuda.device(hidden.device) if hidden.is_cuda else contextlib.nullcontext()
        # Rows without a target (prompt tokens, padding, masked completion positions) add nothing to a
        # row-local loss and get no gradient: they are gathered away before the products, which then cost
        # only the valid rows' share (a padded GRPO batch: a quarter or more of all three products).
        active = valid_rows(problem)
        kept = problem if active is None else gathered_rows(problem, active)
        with device, autocast_off(hidden.device):
            loss, grads = registry.get(backend_name).grad_in_forward_gradients(
                kept, _chunk_function(row_loss, kept, active), needs)
        # Saved (not kept on ctx) so that autograd frees them after the backward, and a second backward
        # without retain_graph=True raises as it does for any PyTorch graph. A deferred d weight saves its
        # two operands and its row mask in its place.
        dh, dw, db = grads
        if dh is not None and active is not None:
            dh = torch.zeros((problem.hidden.shape[0], dh.shape[1]), device=dh.device,
                             dtype=dh.dtype).index_copy_(0, active, dh)
        ctx.deferred = dw.product if isinstance(dw, DeferredProduct) else None
        ctx.save_for_backward(dh, db, *((dw.lhs, dw.rhs, dw.rows) if ctx.deferred else (dw,)))
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss.to(problem.acc_dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            # create_graph=True: the stored gradients are constants here, so a gradient of them would be
            # silently wrong. (The composable op raises when its gradient is differentiated.)
            raise RuntimeError(SECOND_ORDER_MESSAGE)
        dh, db, *dw = ctx.saved_tensors
        dh_dtype, dw_dtype, db_dtype = ctx.dtypes
        if ctx.deferred:
            dw = deferred_gradient(*dw, ctx.deferred, grad_loss)
        else:
            dw = None if dw[0] is None else scaled_gradient(dw[0], grad_loss, dw_dtype)
        dh = None if dh is None else scaled_gradient(dh, grad_loss, dh_dtype)
        db = None if db is None else scaled_gradient(db, grad_loss, db_dtype)
        return dh, dw, db, None, None, None, None


def scaled_gradient(g: torch.Tensor, grad_loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g * grad_loss`` rounded once to ``dtype``, for a gradient ``g`` the grad-in-forward path stored (fp32, float64,
    or already in a half dtype when one product wrote it): one kernel that reads ``g`` once and writes the
    result once, no full-size intermediate. The scalar is expanded (a stride-0 view, not a 0-dim tensor), so
    that type promotion forms the product in fp32 (float64 for a float64 ``g``) and the incoming gradient is
    never rounded to ``g``'s half precision first (bf16(0.7) would scale every entry by 0.69921875). ``g``
    itself is left as it is: a graph kept with retain_graph=True may run this again."""
    wide = torch.float64 if g.dtype == torch.float64 else torch.float32
    scale = grad_loss.to(device=g.device, dtype=wide).expand(g.shape)
    return torch.mul(g, scale, out=torch.empty(g.shape, dtype=dtype, device=g.device))


def deferred_gradient(lhs: torch.Tensor, rhs: torch.Tensor, rows: torch.Tensor, product, grad_loss: torch.Tensor
                      ) -> torch.Tensor:
    """A ``DeferredProduct``'s gradient: ``lhs.T @ (rhs * grad_loss)`` with ``rhs``'s rows outside ``rows``
    zeroed, the scaled ``rhs`` rounded once to its dtype and the product written once in it."""
    scaled = scaled_gradient(rhs, grad_loss, rhs.dtype)
    scaled = torch.where(rows[:, None], scaled, torch.zeros((), dtype=scaled.dtype, device=scaled.device))
    return product(lhs.T, scaled)


def formed(grads: tuple) -> tuple:
    """A backend's ``grad_in_forward_gradients`` gradients with a ``DeferredProduct`` formed at an incoming gradient of
    1 (what the backward computes for ``loss.backward()``): for callers that check the gradients themselves."""
    return tuple(deferred_gradient(g.lhs, g.rhs, g.rows, g.product, torch.ones((), device=g.rhs.device))
                 if isinstance(g, DeferredProduct) else g for g in grads)


def supports_grad_in_forward(backend_name: str) -> bool:
    return registry.has_grad_in_forward_path(backend_name)


def grad_in_forward_loss(problem: StatsProblem, backend_name: str, row_loss: RowLoss) -> torch.Tensor:
    """The scalar ``sum over row chunks of row_loss``, with gradients for hidden, weight and bias computed
    in the forward. The teacher (if any) is frozen."""
    needs = GradientNeeds(problem.hidden.requires_grad, problem.weight.requires_grad,
                          problem.bias is not None and problem.bias.requires_grad)
    return _GradInForwardLoss.apply(problem.hidden, problem.weight, problem.bias, problem, backend_name, row_loss,
                                    needs)


def _forced(grad_in_forward: Optional[bool]) -> Optional[bool]:
    """The caller's ``grad_in_forward=`` argument, else ``FUSEDLOSS_GRAD_IN_FORWARD`` (fusedloss/config.py), else
    None."""
    return config.from_environment().grad_in_forward if grad_in_forward is None else grad_in_forward


def pays(backend_name: str, problem: StatsProblem, grad_in_forward: Optional[bool] = None) -> bool:
    """The backend's own plan (``grad_in_forward_pays(problem)``), if it has one; else yes. ``grad_in_forward=True`` (or
    ``FUSEDLOSS_GRAD_IN_FORWARD=1``) forces the grad-in-forward path, ``False`` (``0``) turns it off, None follows the
    plan."""
    if _forced(grad_in_forward):
        return True
    policy = registry.grad_in_forward_policy(backend_name)
    return True if policy is None else bool(policy(problem))


def want_grad_in_forward(backend_name: str, hidden: torch.Tensor, weight: torch.Tensor, bias,
               grad_in_forward: Optional[bool] = None) -> bool:
    """The grad-in-forward path can apply: a gradient will be asked for and the backend has one (``pays`` decides)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or _forced(grad_in_forward) is False:
        return False
    if hidden.device.type == "meta":  # no data to compute on: the composable op's fake gives the shapes
        return False
    wants_grad = hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return wants_grad and supports_grad_in_forward(backend_name)
