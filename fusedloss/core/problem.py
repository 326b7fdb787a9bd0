"""What every backend computes: the per-token statistics problem (docs/design.md, "The statistics problem").

A backend implements ``core/registry.py::Backend``: ``forward_statistics(problem)`` and
``backward_gradients(problem, saved, coeffs, needs)`` (the grad-in-forward path and the JSD sweep are optional
protocols beside it). Nothing loss-specific ever reaches a backend: the losses (``fusedloss/losses``) only turn
these per-row statistics into a loss, and their gradients into the per-row coefficients below. That is what lets one
tuned kernel pair serve every loss, and keeps the loss math written once for all backends.

Logits of one side (student or teacher), for rows ``h`` of ``hidden`` and rows ``W`` of ``weight``::

    x = h @ W.T + b                 (fp32 accumulation; float64 for float64 inputs)
    u = logit_scale * x
    c = softcap * tanh(u / softcap)  (c = u when softcap is None)
    z = c / temperature

Forward outputs, each ``[N]`` in the accumulation dtype (zeros where not requested, and zeros on
ignored rows, i.e. rows whose target is negative)::

    lse        log sum_v exp(z_v)
    logp       z_y - lse                                     (needs targets)
    entropy    -sum_v q_v log q_v                            (want_entropy)
    kl_rev     KL(q || p) = sum_v q_v (log q_v - log p_v)    (want_kl_rev, needs a teacher)
    kl_fwd     KL(p || q) = sum_v p_v (log p_v - log q_v)    (want_kl_fwd, needs a teacher)
    jsd        beta KL(p || m) + (1 - beta) KL(q || m),  m = (1 - beta) q + beta p  (jsd_beta set)
    lse_t      teacher log-sum-exp                            (with a teacher)
    kl_qm      KL(q || m), kept for the jsd backward          (jsd_beta set)
    mean_logit (1/V) sum_v z_v                                (want_mean_logit; label smoothing, TRL's mean_logits)
    log_sum_sq_probs  log sum_v q_v^2                         (want_extras; forward only, never differentiated)
    is_top1    1.0 where y is the first argmax of z, else 0.0  (want_extras and targets; forward only)
               i.e. z_y >= max_v z_v and z_y > max_{v<y} z_v (argmax's rule on exact ties, as TRL)
    lse_lo     (m - lse) + log s: what rounding lse = m + log s dropped (always; forward only)
    lse_t_lo   the same for the teacher (with a teacher)
    row_max    max_v z_v (always): with is_top1, what decides the first argmax across the shards of a
               vocabulary-parallel head (docs/design.md, "Distributed"); the reverse KL's frame below
    teacher_at_max  z_t at the student's (first) maximum column            (want_kl_rev, with a teacher)
    kl_rev_rel sum_v q_v ((z_v - row_max) - (z_t,v - teacher_at_max))      (want_kl_rev, with a teacher)
               = KL(q || p) - log(q_* / p_*) at that column *: the reverse KL relative to the student's
               maximum, small for a confident student however large KL is. Backward only.

Why the ``_lo`` terms: in fp32 the lse of a confident row (~30) carries an absolute rounding error of
1e-6, which ``log q = z - lse`` would pass on to ``1 - q_y ~ 1e-2`` as a 1e-4 relative error of the
gradient. Backends form ``log q_j = (z_j - lse) - lse_lo`` (``z_j - lse`` is exact near the maximum), and
``logp = (z_y - m) - log s``. They also keep ``s = 1 + t`` with t the sum without the (first) maximum's own
exp(0) = 1 and take ``log s = log1p(t)``, so that ``1 - q_y`` keeps its digits down to 1e-4 and below:
confident fp32 rows stay within 1e-5 of float64 (tests/contract/test_numerics_confident_rows.py).

q = softmax(z) is the student, p = softmax(z_t) the teacher (frozen: never differentiated).

Backward: the gradient of the loss with respect to the student logits is, per element::

    dz_j = a * ([j == y] - q_j) + q_j * (c0 + c1 * log q_j + c2 * r_j + c4 * log m_j) + c3 * p_j + c5
    r_j  = (z_j - row_max) - (z_t,j - teacher_at_max) - kl_rev_rel        (= log q_j - log p_j - KL(q || p))

with per-row coefficients ``coeffs = (a, c0, c1, c2, c3, c4, c5)`` (``[7, N]``, accumulation dtype), built by
``fusedloss.core.statistics.dz_coefficients``: a = d loss / d logp, c0 the rest of the per-row constants,
c1 of log q (entropy, JSD), c2 = d loss / d KL(q || p), c3 of p (forward KL), c4 of log m (JSD), c5 the
constant of d mean_logit / dz_j = 1 / V. Each term carries its own centred quantity, so that no per-row
constant is rounded at the scale of another (docs/design.md, "The dz formula"):

* the log-probability's share a ([j = y] - q_j) is kept out of c0: at the target column it is formed as
  ``-a * expm1(log q_y)``, exact to rounding for every q_y (1 - q_y keeps its digits on confident rows, q_y
  on improbable ones), and ``q_y * inner_y`` is added with c0 unrounded by a, so an entropy or KL share on a
  confident row is not rounded at ulp(a). Elsewhere ``q_j (c0 - a + ...)``;
* the reverse KL's share is formed as ``r_j`` from the logits relative to the student's maximum column, where
  the forward formed ``kl_rev_rel``: at that column r = -kl_rev_rel exactly, however large KL is (a
  confident student 10 nats from its teacher would otherwise get ulp(KL) ~ 1e-6 instead of ~0).

The log-probabilities rather than z and z_t (which differ by per-row constants) because ``c1 * z + c0``
cancels catastrophically when |z| is large (1e4 in fp32 loses three digits), while ``log q_j = z_j - lse``
is formed per element and is exact to rounding; r_j likewise subtracts the row's own maxima per element.
A product of a coefficient and an infinite quantity whose coefficient is 0 is 0 (a row outside the loss
whose KL is +inf contributes nothing).

The chain rule back to the raw product x is elementwise::

    dx = dz * (logit_scale / temperature) * (1 - (c / softcap) ** 2)   (the last factor is 1 without softcap)

then ``d hidden = dx @ W``, ``d weight = dx.T @ h``, ``d bias = dx.sum(0)``. Gradients are returned in
the dtype of the tensor they belong to; backends accumulate them in fp32 (float64 for float64).
Ignored rows (negative target) have all-zero coefficients, and a backend may skip them entirely.
``d bias`` sums dx before it is rounded to a half dtype: each of its entries is a sum over the rows, and the
sum of rounded values would carry every row's rounding.

Named columns (``StatsProblem.columns``, ``core/columns.py``; the K log-probs of ``token_logprobs`` with
``[..., K]`` targets): the forward also returns the logits at K given columns of each row, read from the
tiles the statistics are folded from, so that ``z_k - row_max`` is exact near the maximum, as ``z_y - m`` is.
The backward takes the dz of those columns as given (``column_dz``, ``[N, K]``: the column's dz before the
teacher and uniform terms, formed per row by ``core/columns.py`` as the target formula above generalised to
K one-hot shares), in place of the formula, before the chain rule and the single rounding of dx. A row whose
coefficients are all zero still carries gradient where one of its ``column_dz`` is not.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

# Indices of the rows of the [NUM_COEFFS, N] coefficient tensor.
COEF_ONEHOT, COEF_CONST, COEF_LOGQ, COEF_KL_REV, COEF_TEACHER_PROB, COEF_LOGM, COEF_UNIFORM = range(7)
NUM_COEFFS = 7


class LogitTransform(NamedTuple):
    """``z = softcap(logit_scale * x) / temperature``: scale, then soft-cap, then temperature, the order TRL's
    fused path uses (docs/design.md, "The statistics problem").
    A NamedTuple (not a dataclass) so that torch.compile traces through its construction."""

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: Optional[float] = None


@dataclass(frozen=True)
class StatsProblem:
    """All inputs of one statistics pass: the one table of the op's arguments. The custom op's schema, its
    fake, its backward and the argument builders are generated from these fields (``core/statistics.py``),
    so adding a field here is all the op needs.

    Tensors are 2-D (``[N, D]``, ``[V, D]``), contiguous in their
    last dimension, on one device. ``targets`` is int64 ``[N]`` with -1 for ignored rows (the API maps
    ``ignore_index`` to -1 after validating), or None when no row has a target (then every row is valid
    and ``logp`` is not computed)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    targets: Optional[torch.Tensor]
    transform: LogitTransform
    # Named columns (``core/columns.py``): int64 ``[N, K]`` vocabulary ids, -1 for none. The forward also
    # returns the logits at them, read from the tiles the statistics are folded from, and the backward takes
    # the dz of each named column as given (``column_dz``) instead of the one-target formula. A row's target,
    # where it has one, is one of its named columns. No teacher: dz at a named column has no teacher term.
    columns: Optional[torch.Tensor] = None
    teacher_hidden: Optional[torch.Tensor] = None
    teacher_weight: Optional[torch.Tensor] = None
    teacher_bias: Optional[torch.Tensor] = None
    teacher_transform: LogitTransform = LogitTransform()
    want_entropy: bool = False
    want_kl_rev: bool = False
    want_kl_fwd: bool = False
    jsd_beta: Optional[float] = None  # strictly between 0 and 1 when set
    want_mean_logit: bool = False
    want_extras: bool = False  # log_sum_sq_probs and is_top1 (TRL's per-token metrics)
    # How to run, not what to compute (fusedloss/config.py): the logits workspace of the GPU backends in MiB
    # and whether fp32 inputs may use TF32 products; None: the environment's override, else the default
    # (workspace sized from free device memory; full fp32 products).
    workspace_mb: Optional[float] = None
    allow_tf32: Optional[bool] = None

    @property
    def has_teacher(self) -> bool:
        return self.teacher_hidden is not None

    @property
    def acc_dtype(self) -> torch.dtype:
        return accumulation_dtype(self.hidden.dtype)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where sums over the vocabulary and per-token outputs live: float64 for float64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Statistics(NamedTuple):
    """Per-row outputs of ``forward_statistics``; every field is ``[N]`` in ``problem.acc_dtype``."""

    lse: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    kl_rev: torch.Tensor
    kl_fwd: torch.Tensor
    jsd: torch.Tensor
    lse_t: torch.Tensor
    kl_qm: torch.Tensor
    mean_logit: torch.Tensor
    log_sum_sq_probs: torch.Tensor
    is_top1: torch.Tensor
    lse_lo: torch.Tensor
    lse_t_lo: torch.Tensor
    row_max: torch.Tensor
    teacher_at_max: torch.Tensor
    kl_rev_rel: torch.Tensor


class GradientNeeds(NamedTuple):
    hidden: bool
    weight: bool
    bias: bool


class DeferredProduct(NamedTuple):
    """A gradient a grad-in-forward forward leaves as the product ``lhs.T @ rhs`` for the backward (docs/design.md,
    "Deferred d weight"): the backward scales ``rhs`` by the incoming gradient (in fp32, rounded once to
    ``rhs``'s dtype), zeroes its rows outside ``rows`` (NaN padding must stay out, as 0 * NaN is not 0) and
    forms the product once in ``rhs``'s dtype with ``product(lhs.T, scaled)``. The grad-in-forward path's d weight when
    keeping dx ([N, V]) costs no more memory than keeping d weight ([V, D]) would."""
    lhs: torch.Tensor  # dx [N, V]
    rhs: torch.Tensor  # hidden [N, D]
    rows: torch.Tensor  # [N] bool: the rows inside the loss
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def valid_rows(p: StatsProblem) -> Optional[torch.Tensor]:
    """The rows with a target (``targets >= 0``) as an index tensor, or None when every row has one (or there
    are no targets). One host sync: the row count sizes what follows."""
    if p.targets is None:
        return None
    rows = torch.nonzero(p.targets >= 0).squeeze(1)
    return None if rows.numel() == p.targets.numel() else rows


def gathered_rows(p: StatsProblem, rows: torch.Tensor) -> StatsProblem:
    """The problem restricted to the given rows (an index tensor), gathered once."""
    def pick(t):
        return None if t is None else t.index_select(0, rows)

    return dataclasses.replace(p, hidden=pick(p.hidden), targets=pick(p.targets), columns=pick(p.columns),
                               teacher_hidden=pick(p.teacher_hidden))

