"""The grad-in-forward path's dz coefficients, bit for bit as the materialised form gives them.

``core/grad_in_forward.py`` gives each statistic its own leaf, so autograd returns None for the statistics a loss does
not
use, and ``dz_coefficients`` skips the arithmetic they would feed. The reference here is that form written out:
one stacked leaf, ``materialize_grads=True`` (zero rows for the unused statistics) and the coefficients formed
from every row. Both must agree in every bit, signed zeros included (-(0.0) is -0.0 in c1 and c3 where the
entropy's or the forward KL's gradient is a zero row; 0.0 - x is not -x at x = +0.0), with NaN where NaN, on
statistics holding NaN, +-inf, +-0.0 and peaked values, for the real losses' row functions and for every set of
present gradients.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fusedloss
from fusedloss.backends import torch as torch_backend
from fusedloss.backends.cuda import backend as cuda
from fusedloss.backends.triton import plan as tb_plan
from fusedloss.core import grad_in_forward, registry
from fusedloss.core.problem import Statistics
from fusedloss.core.statistics import dz_coefficients

FIELDS = Statistics._fields
# the statistics whose gradients enter the coefficients
USED = ("lse", "logp", "entropy", "kl_rev", "kl_fwd", "jsd", "mean_logit")


def _old_times(g, stat):
    return torch.where(g == 0, 0.0, g * stat)


def _old_dz_coefficients(grad, stats, jsd_beta, targets, vocab_size):
    """The coefficients from stacked, materialised gradients, as every row of them was formed."""
    s = Statistics(*stats.unbind(0))
    g = Statistics(*grad.unbind(0))
    zero = torch.zeros_like(s.lse)
    a = g.logp
    c0 = g.lse + g.kl_fwd - _old_times(g.entropy, s.entropy)
    c1 = -g.entropy
    c2 = g.kl_rev
    c3 = -g.kl_fwd
    c4 = zero
    if jsd_beta is not None:
        w = g.jsd * (1.0 - jsd_beta)
        c0 = c0 - _old_times(w, s.kl_qm)
        c1 = c1 + w
        c4 = -w
    c5 = g.mean_logit / vocab_size
    coeffs = torch.stack((a, c0, c1, c2, c3, c4, c5))
    if targets is not None:
        coeffs = torch.where(targets >= 0, coeffs, torch.zeros_like(coeffs))
    return coeffs


def _old_chunk_function(row_loss, problem):
    vocab = problem.weight.shape[0]

    def chunk_fn(stats, rows):
        with torch.enable_grad():
            leaf = torch.stack(tuple(stats)).detach().requires_grad_(True)
            loss = row_loss(Statistics(*leaf.unbind(0)), rows)
            (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True, materialize_grads=True)
        targets = None if problem.targets is None else problem.targets[rows]
        return loss.detach(), _old_dz_coefficients(grad, leaf.detach(), problem.jsd_beta, targets, vocab)

    return chunk_fn


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (so +0.0 and -0.0 differ), or NaN in both."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return bool(((a.view(ints) == b.view(ints)) | (a.isnan() & b.isnan())).all())


def _special_values(n: int, dtype, seed: int) -> torch.Tensor:
    """Random values with NaN, +-inf, +-0.0, peaked (+-30, 1e30) and tiny ones among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 30.0, -30.0, 1e30, 1e-40],
                           dtype=torch.float64)
    pick = torch.randint(0, 3 * len(special), (n,), generator=g)
    x = torch.where(pick < len(special), special[pick.clamp(max=len(special) - 1)], x)
    return x.to(dtype)


def _stats(n: int, dtype, seed: int) -> Statistics:
    return Statistics(*(_special_values(n, dtype, seed * 100 + i) for i in range(len(FIELDS))))


# ------------------------------------------------------------------------------------------------
# dz_coefficients on its own: every set of present gradients
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("jsd_beta", [None, 0.3])
@pytest.mark.parametrize("with_targets", [False, True])
def test_every_set_of_present_gradients_gives_the_materialised_bits(dtype, jsd_beta, with_targets):
    n = 40
    stats = _stats(n, dtype, seed=1)
    stacked = torch.stack(tuple(stats))
    targets = torch.randint(-1, 5, (n,), generator=torch.Generator().manual_seed(2)) if with_targets else None
    grads = {f: _special_values(n, dtype, seed=50 + i) for i, f in enumerate(FIELDS)}
    grads["lse"][:4] = -0.0  # -0.0 + (+0.0) is +0.0: a sum with an absent term must still turn it
    grads["entropy"][4:8] = 0.0
    checked = 0
    for present in itertools.product((False, True), repeat=len(USED)):
        on = {f for f, p in zip(USED, present) if p}
        seq = [grads[f] if f in on else None for f in FIELDS]
        materialised = torch.stack([grads[f] if f in on else torch.zeros(n, dtype=dtype) for f in FIELDS])
        want = _old_dz_coefficients(materialised, stacked, jsd_beta, targets, 97)
        got = dz_coefficients(seq, stats, jsd_beta, targets, 97)
        assert same_bits(got, want), (sorted(on), (got != want).nonzero()[:4].tolist())
        # the stacked form (the composable backward's) gives the same bits
        assert same_bits(dz_coefficients(materialised, stacked, jsd_beta, targets, 97), want), sorted(on)
        if targets is not None:  # the mask formed once per call by the caller
            assert same_bits(dz_coefficients(seq, stats, jsd_beta, None, 97, ignored=targets < 0), want)
        checked += 1
    assert checked == 2 ** len(USED)


def test_gradients_that_require_grad_give_the_same_bits():
    """create_graph=True: the coefficients are formed out of place (differentiable), with the same bits."""
    n = 24
    stats = _stats(n, torch.float32, seed=6)
    targets = torch.randint(-1, 5, (n,), generator=torch.Generator().manual_seed(7))
    for present in itertools.product((False, True), repeat=len(USED)):
        on = {f for f, p in zip(USED, present) if p}
        seq = [_special_values(n, torch.float32, seed=70 + i) if f in on else None for i, f in enumerate(FIELDS)]
        want = dz_coefficients(seq, stats, 0.3, targets, 97)
        with torch.enable_grad():
            got = dz_coefficients([None if x is None else x.clone().requires_grad_(True) for x in seq], stats, 0.3,
                                  targets, 97)
        assert got.requires_grad == bool(on) and same_bits(got.detach(), want), sorted(on)


def test_the_comparison_sees_a_dropped_gradient_and_a_turned_zero():
    n = 16
    stats = _stats(n, torch.float32, seed=3)
    g = torch.randn(n, generator=torch.Generator().manual_seed(4))
    seq = [g if f in ("kl_rev", "logp") else None for f in FIELDS]
    materialised = torch.stack([g if f in ("kl_rev", "logp") else torch.zeros(n) for f in FIELDS])
    want = _old_dz_coefficients(materialised, torch.stack(tuple(stats)), None, None, 97)
    assert same_bits(dz_coefficients(seq, stats, None, None, 97), want)
    dropped = [None if f == "kl_rev" else x for f, x in zip(FIELDS, seq)]
    assert not same_bits(dz_coefficients(dropped, stats, None, None, 97), want)
    # c1 and c3 are -0.0 here (-(0.0)); +0.0 in their place passes torch.equal but not this comparison
    assert bool(torch.signbit(want[2]).all() and torch.signbit(want[4]).all())
    turned = want.clone()
    turned[2] = 0.0
    assert torch.equal(turned, want) and not same_bits(turned, want)


def test_a_wrong_number_of_gradients_is_refused():
    stats = _stats(3, torch.float32, seed=5)
    with pytest.raises(ValueError, match="grad and stats"):
        dz_coefficients([None] * 5, stats, None, None, 97)


# ------------------------------------------------------------------------------------------------
# The losses' own row functions: the chunk function against the materialised form
# ------------------------------------------------------------------------------------------------
N, V, D = 24, 37, 8


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    y[[1, 5, 6, 17]] = -100
    return g, h, w, y


def _loss(case: str, backend: str, inputs, **kw):
    g, h, w, y = inputs
    kw["backend"] = backend
    if case == "cross_entropy":
        return fusedloss.cross_entropy(h, w, y, label_smoothing=0.1, z_loss=1e-3, **kw)
    if case == "grpo_entropy":
        ids = y.clamp(min=0).view(4, N // 4)
        mask = (y >= 0).float().view(4, N // 4)
        adv = torch.randn(4, generator=g)
        return fusedloss.grpo_loss(h.view(4, N // 4, D), w, ids, adv, mask, entropy_coef=0.01, **kw)
    th, tw = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    if case == "reverse_kl_hard":
        return fusedloss.distillation_loss(h, w, th, tw, beta=1.0, targets=y, hard_weight=0.5, **kw)
    if case == "forward_kl":
        return fusedloss.distillation_loss(h, w, th, tw, beta=0.0, targets=y, hard_weight=0.25, **kw)
    return fusedloss.distillation_loss(h, w, th, tw, beta=0.4, **kw)  # "jsd"


CASES = ["cross_entropy", "grpo_entropy", "reverse_kl_hard", "forward_kl", "jsd"]


def _row_losses(case: str, monkeypatch):
    """The (row_loss, problem) pairs the loss hands the grad-in-forward path (torch backend, grad-in-forward forced)."""
    seen = []
    real = grad_in_forward._chunk_function

    def recording(row_loss, problem, rows_of=None):
        seen.append((row_loss, problem))
        return real(row_loss, problem, rows_of)

    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")
    # the whole batch, ignored rows included, reaches the chunk function
    # (tests/contract/test_grad_in_forward_ignored_rows.py pins
    # that the grad-in-forward path gathers them away first)
    monkeypatch.setattr(grad_in_forward, "valid_rows", lambda problem: None)
    monkeypatch.setattr(grad_in_forward, "_chunk_function", recording)
    _loss(case, "torch", _inputs()).backward()
    monkeypatch.setattr(grad_in_forward, "_chunk_function", real)
    assert len(seen) == 1, case
    return seen[0]


@pytest.mark.parametrize("case", CASES)
def test_the_losses_chunk_coefficients_are_the_materialised_bits(case, monkeypatch):
    row_loss, problem = _row_losses(case, monkeypatch)
    new, old = grad_in_forward._chunk_function(row_loss, problem), _old_chunk_function(row_loss, problem)
    n, dtype = problem.hidden.shape[0], problem.hidden.dtype
    gen = torch.Generator().manual_seed(7)
    ordinary = Statistics(*(torch.randn(n, generator=gen, dtype=dtype) for _ in FIELDS))
    for label, stats, rows in (("ordinary, every row", ordinary, slice(0, n)),
                               ("special, every row", _stats(n, dtype, seed=10), slice(0, n)),
                               ("special, a slice", _stats(14, dtype, seed=11), slice(3, 17)),
                               ("special, an index", _stats(6, dtype, seed=12), torch.tensor([0, 2, 5, 6, 11, 23]))):
        kept = [x.clone() for x in stats]
        loss_new, coeffs_new = new(stats, rows)
        loss_old, coeffs_old = old(stats, rows)
        assert same_bits(loss_new, loss_old), (case, label)
        assert same_bits(coeffs_new, coeffs_old), (case, label, (coeffs_new != coeffs_old).nonzero()[:4].tolist())
        assert coeffs_new.is_contiguous()
        # the statistics are read, never written: a backend may pass its own buffers
        assert all(same_bits(a, b) for a, b in zip(stats, kept)), (case, label)


def test_distillation_without_targets_is_its_masked_form_bit_for_bit(monkeypatch):
    """Without targets every row counts, so the row function leaves out the mask: where(True, x, 0) is x, in
    the loss and in its gradient, for every value (NaN, +-inf, -0.0 included)."""
    row_loss, problem = _row_losses("jsd", monkeypatch)
    assert problem.targets is None
    n = problem.hidden.shape[0]
    scale = (1.0 / torch.tensor(float(n), dtype=torch.float64)).to(torch.float32)  # batchmean over n rows
    ordinary = Statistics(*(torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(len(FIELDS))))
    for seed, stats in ((None, ordinary), (20, _stats(n, torch.float32, seed=20))):
        leaves = [x.clone().requires_grad_(True) for x in stats]
        got = row_loss(Statistics(*leaves), slice(0, n))
        (g_got,) = torch.autograd.grad(got, leaves[FIELDS.index("jsd")])
        leaf = stats.jsd.clone().requires_grad_(True)
        want = torch.where(torch.ones(n, dtype=torch.bool), leaf, torch.zeros_like(leaf)).sum() * scale
        (g_want,) = torch.autograd.grad(want, leaf)
        assert same_bits(got.detach(), want.detach()) and same_bits(g_got, g_want), seed


def _backend_names():
    names = ["torch", "triton"]
    if cuda.extension_built():
        names.append("cuda")
    return names


@pytest.mark.parametrize("backend_name", _backend_names())
@pytest.mark.parametrize("case", ["cross_entropy", "reverse_kl_hard"])
def test_grad_in_forward_gradients_are_the_materialised_bits(backend_name, case, monkeypatch):
    """Whole calls in three row chunks: the loss and every gradient equal bit for bit."""
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")
    kw = {}
    if backend_name == "cuda":  # the CUDA backend's code on CPU tensors (its host twins)
        real = registry.resolve
        monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else real(b, *rest))
    elif backend_name == "torch":
        monkeypatch.setattr(torch_backend, "grad_in_forward_rows", lambda p: 8)
    else:
        kw["workspace_mb"] = 8 * tb_plan.grad_in_forward_row_bytes(V, "float32", case != "cross_entropy") / 2**20
    results = {}
    for label, fn in (("new", grad_in_forward._chunk_function), ("old", _old_chunk_function)):
        monkeypatch.setattr(grad_in_forward, "_chunk_function", fn)
        calls = []
        real_fn = fn

        def counting(row_loss, problem, rows_of=None, real_fn=real_fn, calls=calls):
            if rows_of is not None:  # the valid rows only: the row loss sees their positions in the batch
                row_loss = (lambda loss_of: lambda stats, rows: loss_of(stats, rows_of[rows]))(row_loss)
            chunk_fn = real_fn(row_loss, problem)

            def counted(stats, rows):
                calls.append(rows)
                return chunk_fn(stats, rows)

            return counted

        monkeypatch.setattr(grad_in_forward, "_chunk_function", counting)
        inputs = _inputs(3)
        with cuda.override_plan(grad_in_forward_rows=8):
            loss = _loss(case, backend_name, inputs, **kw)
            loss.backward()
        results[label] = (loss.detach(), inputs[1].grad, inputs[2].grad)
        assert len(calls) >= 2, (backend_name, len(calls))  # several row chunks
    for new, old in zip(results["new"], results["old"]):
        assert same_bits(new, old), backend_name
