"""Several teachers, one per position: ``distillation_loss(..., teachers=, teacher_index=)`` and
``multi_teacher_topk_logprobs``, against a loop over the teachers in float64 on materialised logits.

Three teachers of different widths (12, 5 and the student's 8), each with its own bias, logit_scale,
soft-cap and temperature; one teacher's hidden states cover every position, another's only its own rows;
positions without a teacher (-1) and ignored labels; peaked rows. Every backend whose kernel math runs here
(torch, the Triton interpreter, the CUDA host twins) and float64, fp32 and fp16.
"""

from __future__ import annotations

import math

import _distributed_harness as harness
import pytest
import torch
import torch.distributed as dist
from _errors import rel_err

import fusedloss
from fusedloss import Teacher, reference

F64 = torch.float64
MODULE = __name__
B, T, D, V = 3, 7, 8, 53
INDEX = torch.tensor([[0, 1, 2, -1, 1, 0, 2], [2, 2, 0, 1, 0, 0, 1], [1, -1, 2, 0, 2, 1, 0]])


def problem(seed=0, *, peaked=True, dtype=F64):
    """Student (h, w, b, y) and three teachers, in ``dtype`` (values drawn in float64, rounded once)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=F64)).to(dtype)

    h, w, b = r(B, T, D), r(V, D, scale=0.7), r(V, scale=0.5)
    if peaked:  # a few positions whose student is confident
        h[0, 0] += (6.0 * w[3] / w[3].norm() ** 2).to(dtype)
        h[2, 4] += (9.0 * w[11] / w[11].norm() ** 2).to(dtype)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, 2] = y[1, 5] = -100
    n1 = int((INDEX == 1).sum())
    teachers = [
        Teacher(r(B, T, 12), r(V, 12, scale=0.6), bias=r(V), temperature=2.0),
        Teacher(r(n1, 5), r(V, 5), bias=r(V, scale=0.3), logit_scale=1.3, softcap=3.0),
        Teacher(r(B, T, D), r(V, D, scale=0.8), softcap=5.0, temperature=0.6),
    ]
    return h, w, b, y, teachers


def loop_over_teachers(h, w, b, y, teachers, index, *, reduction, temperature=1.0, t_squared=False,
                       num_items_in_batch=None, **kw):
    """The single-teacher float64 reference, one call per teacher on its rows, merged by hand."""
    flat = index.reshape(-1)
    hf, yf = h.reshape(-1, h.shape[-1]), y.reshape(-1)
    per_token = torch.zeros(flat.numel(), dtype=F64 if h.dtype == F64 else torch.float32)
    count = 0
    for i, t in enumerate(teachers):
        rows = (flat == i).nonzero().squeeze(1)
        th = t.hidden.reshape(-1, t.hidden.shape[-1])
        th = th[rows] if th.shape[0] == flat.numel() else th
        temp = temperature if t.temperature is None else t.temperature
        part = reference.distillation_loss(hf[rows], w, th, t.weight, yf[rows], bias=b, teacher_bias=t.bias,
                                           teacher_logit_scale=t.logit_scale, teacher_softcap=t.softcap,
                                           temperature=temp, t_squared=t_squared, reduction="none", **kw)
        per_token = per_token.index_put((rows,), part)
        count += int((yf[rows] != -100).sum())
    if reduction == "none":
        return per_token.reshape(index.shape)
    if num_items_in_batch is not None:
        return per_token.sum() / num_items_in_batch
    return per_token.sum() if reduction == "sum" else per_token.sum() / max(count, 1)


def as64(teachers):
    return [t._replace(hidden=t.hidden.double(), weight=t.weight.double(),
                       bias=None if t.bias is None else t.bias.double()) for t in teachers]


OPTIONS = [
    dict(beta=1.0),
    dict(beta=0.0, temperature=1.7, hard_weight=0.4, soft_weight=0.6, t_squared=True),
    dict(beta=0.3, reduction="sum"),
    dict(beta=0.5, reduction="none", softcap=4.0, logit_scale=0.9),
    dict(beta=1.0, num_items_in_batch=11, hard_weight=0.5),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_reference_equals_the_loop_over_teachers(options):
    """The materialised multi-teacher reference is the single-teacher reference, teacher by teacher."""
    h, w, b, y, teachers = problem()
    opts = dict(options)
    reduction = opts.pop("reduction", "batchmean")
    want = loop_over_teachers(h, w, b, y, teachers, INDEX, reduction=reduction, **opts)
    got = reference.distillation_loss(h, w, targets=y, bias=b, teachers=teachers, teacher_index=INDEX,
                                      reduction=reduction, **opts)
    assert (got - want).abs().max().item() <= 1e-13 * max(1.0, want.abs().max().item())


def run_both(engine, dtype, options, seed=0):
    """(values, grads) of the public call on ``engine`` in ``dtype`` and of the float64 loop, same rounded data."""
    backend, device = engine
    h, w, b, y, teachers = problem(seed, dtype=dtype)
    opts = dict(options)
    reduction = opts.pop("reduction", "batchmean")
    hg = h.to(device).requires_grad_(True)
    wg = w.to(device).requires_grad_(True)
    bg = b.to(device).requires_grad_(True)
    moved = [t._replace(hidden=t.hidden.to(device), weight=t.weight.to(device),
                        bias=None if t.bias is None else t.bias.to(device)) for t in teachers]
    got = fusedloss.distillation_loss(hg, wg, targets=y.to(device), bias=bg, teachers=moved,
                                      teacher_index=INDEX.to(device), reduction=reduction, backend=backend, **opts)
    seed_grad = torch.linspace(0.5, 1.5, got.numel(), dtype=F64).reshape(got.shape)
    got_grads = torch.autograd.grad(got, (hg, wg, bg), seed_grad.to(got.dtype).to(device))
    h64, w64, b64 = (x.double().requires_grad_(True) for x in (h, w, b))
    want = loop_over_teachers(h64, w64, b64, y, as64(teachers), INDEX, reduction=reduction, **opts)
    want_grads = torch.autograd.grad(want, (h64, w64, b64), seed_grad)
    return got, got_grads, want, want_grads, (h, w, b, y, teachers, reduction, opts)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_float64_equals_the_loop_on_every_backend(any_engine, options):
    got, got_grads, want, want_grads, _ = run_both(any_engine, F64, options)
    tol = 1e-10 if any_engine[0] == "torch" else 1e-9
    assert got.dtype == F64 and got.shape == want.shape
    assert rel_err(got.cpu(), want) <= tol
    for name, g, e in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        assert rel_err(g.cpu(), e) <= tol, name


def naive_error(dtype, ctx):
    """The same loop on materialised logits in ``dtype`` (the naive path), its error against float64."""
    h, w, b, y, teachers, reduction, opts = ctx
    hn, wn, bn = (x.clone().requires_grad_(True) for x in (h, w, b))
    naive = loop_over_teachers(hn, wn, bn, y, teachers, INDEX, reduction=reduction, **opts)
    return naive, hn, wn, bn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("options", OPTIONS[:3], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_half_and_single_precision_within_the_naive_error(any_engine, dtype, options):
    """Against float64 on the same rounded values: fp32 within max(1e-5, 4x the naive fp32 path's error);
    fp16 within the naive fp16 path's error + 1e-4 (the harness's rules)."""
    got, got_grads, want, want_grads, ctx = run_both(any_engine, dtype, options)
    assert got.dtype == torch.float32
    h, w, b, y, teachers, reduction, opts = ctx
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    naive = loop_over_teachers(*leaves, y, teachers, INDEX, reduction=reduction, **opts)
    seed_grad = torch.linspace(0.5, 1.5, naive.numel(), dtype=F64).reshape(naive.shape)
    naive_grads = torch.autograd.grad(naive, leaves, seed_grad.to(naive.dtype))

    def bound(naive_value, expected):
        err = rel_err(naive_value, expected)
        return max(1e-5, 4 * err) if dtype == torch.float32 else err + 1e-4

    assert rel_err(got.cpu(), want) <= bound(naive, want)
    for name, g, n, e in zip(("hidden", "weight", "bias"), got_grads, naive_grads, want_grads):
        assert g.dtype == dtype, name
        assert rel_err(g.cpu(), e) <= bound(n, e), name


def test_teachers_are_frozen_and_unrouted_rows_get_no_gradient(any_engine):
    backend, device = any_engine
    h, w, b, y, teachers = problem()
    leaves = [t._replace(hidden=t.hidden.clone().requires_grad_(True), weight=t.weight.clone().requires_grad_(True),
                         bias=None if t.bias is None else t.bias.clone().requires_grad_(True)) for t in teachers]
    hg = h.clone().requires_grad_(True)
    loss = fusedloss.distillation_loss(hg, w, targets=y, teachers=leaves, teacher_index=INDEX, beta=0.5,
                                       hard_weight=0.3, backend=backend)
    loss.backward()
    for i, t in enumerate(leaves):
        for name in ("hidden", "weight", "bias"):
            x = getattr(t, name)
            if x is None:
                continue
            assert x.grad is None or float(x.grad.abs().max()) == 0.0, f"teachers[{i}].{name} received a gradient"
    unrouted = INDEX == -1
    assert float(hg.grad[unrouted].abs().max()) == 0.0
    assert float(hg.grad[~unrouted & (y != -100)].abs().amin(-1).max()) > 0


def test_a_teacher_reads_only_its_own_rows():
    """Changing teacher 1's hidden states or head moves only the per-token losses of teacher 1's rows."""
    h, w, b, y, teachers = problem()
    kw = dict(targets=y, teacher_index=INDEX, reduction="none", beta=0.5)
    base = fusedloss.distillation_loss(h, w, teachers=teachers, **kw)
    poked = list(teachers)
    poked[1] = poked[1]._replace(hidden=poked[1].hidden + 1.0, weight=poked[1].weight * 2)
    moved = fusedloss.distillation_loss(h, w, teachers=poked, **kw)
    changed = (moved != base)
    assert torch.equal(changed, (INDEX == 1) & (y != -100))


def test_packed_and_full_teacher_hidden_states_agree():
    h, w, b, y, teachers = problem()
    rows = (INDEX.reshape(-1) == 0).nonzero().squeeze(1)
    packed = list(teachers)
    packed[0] = packed[0]._replace(hidden=teachers[0].hidden.reshape(-1, 12)[rows])
    kw = dict(targets=y, teacher_index=INDEX, beta=0.2, reduction="none")
    a = fusedloss.distillation_loss(h, w, teachers=teachers, **kw)
    c = fusedloss.distillation_loss(h, w, teachers=packed, **kw)
    assert torch.equal(a, c)


def test_one_teacher_everywhere_is_the_single_teacher_loss():
    h, w, b, y, teachers = problem()
    t = teachers[2]._replace(temperature=None)
    kw = dict(bias=b, beta=0.5, hard_weight=0.2, temperature=1.3)
    multi = fusedloss.distillation_loss(h, w, targets=y, teachers=[t], teacher_index=torch.zeros_like(y), **kw)
    single = fusedloss.distillation_loss(h, w, t.hidden, t.weight, y, teacher_softcap=t.softcap, **kw)
    assert (multi - single).abs().item() <= 1e-14


def test_several_teachers_hold_no_head_sized_gradient_per_teacher_unless_asked(monkeypatch):
    """With two or more teachers, each group runs the composable path (no [V, D] d weight held per teacher from
    the forward to the backward) unless grad_in_forward is set; one teacher keeps the single-teacher plan. The
    loss and gradients are the same either way."""
    from fusedloss.core import grad_in_forward as gif

    calls = []
    real = gif.grad_in_forward_loss
    monkeypatch.setattr(gif, "grad_in_forward_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.delenv("FUSEDLOSS_GRAD_IN_FORWARD", raising=False)
    h, w, b, y, teachers = problem(dtype=torch.float32)
    kw = dict(bias=b, targets=y, teachers=teachers, teacher_index=INDEX, beta=0.5, backend="torch")

    def run(**extra):
        calls.clear()
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fusedloss.distillation_loss(hh, ww, **kw, **extra)
        loss.backward()
        return len(calls), loss.detach(), hh.grad, ww.grad

    held, *default = run()
    assert held == 0
    forced, *asked = run(grad_in_forward=True)
    assert forced == 3  # one per teacher with rows
    for a, e in zip(default, asked):
        assert rel_err(a, e) < 1e-5
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")
    assert run()[0] == 3
    monkeypatch.delenv("FUSEDLOSS_GRAD_IN_FORWARD")
    one = dict(kw, teachers=[teachers[2]], teacher_index=torch.zeros_like(INDEX))
    calls.clear()
    fusedloss.distillation_loss(h.clone().requires_grad_(), w.clone().requires_grad_(), **one).backward()
    single = len(calls)
    calls.clear()
    fusedloss.distillation_loss(h.clone().requires_grad_(), w.clone().requires_grad_(), teachers[2].hidden,
                                teachers[2].weight, y, bias=b, beta=0.5, teacher_softcap=teachers[2].softcap,
                                temperature=teachers[2].temperature, backend="torch").backward()
    assert single == len(calls)  # one teacher: the single-teacher plan, whichever it is


def test_no_position_routed_gives_zero_with_zero_gradients():
    h, w, b, y, teachers = problem()
    hg = h.clone().requires_grad_(True)
    none = torch.full_like(y, -1)
    for reduction in ("batchmean", "sum", "none"):
        loss = fusedloss.distillation_loss(hg, w, targets=y, teachers=teachers[:1], teacher_index=none,
                                           reduction=reduction)
        assert loss.dtype == F64 and float(loss.detach().abs().max()) == 0.0
        (g,) = torch.autograd.grad(loss.sum(), hg)
        assert float(g.abs().max()) == 0.0


def test_bad_arguments_are_refused():
    h, w, b, y, teachers = problem()
    kw = dict(targets=y)
    with pytest.raises(ValueError, match="teachers and teacher_index"):
        fusedloss.distillation_loss(h, w, teachers=teachers, **kw)
    with pytest.raises(ValueError, match="teacher_hidden, teacher_weight belong to a single teacher"):
        fusedloss.distillation_loss(h, w, teachers[2].hidden, teachers[2].weight, teachers=teachers,
                                    teacher_index=INDEX, **kw)
    with pytest.raises(TypeError, match="needs teacher_hidden and teacher_weight"):
        fusedloss.distillation_loss(h, w, **kw)
    with pytest.raises(TypeError, match="teachers must be a non-empty list"):
        fusedloss.distillation_loss(h, w, teachers=teachers[0], teacher_index=INDEX, **kw)
    with pytest.raises(TypeError, match=r"teachers\[1\] must be a fusedloss.Teacher"):
        fusedloss.distillation_loss(h, w, teachers=[teachers[0], (h, w)], teacher_index=INDEX, **kw)
    with pytest.raises(ValueError, match=r"teacher_index must hold values in \[-1, 3\)"):
        fusedloss.distillation_loss(h, w, teachers=teachers, teacher_index=INDEX + 1, **kw)
    with pytest.raises(ValueError, match="teacher_index must have shape"):
        fusedloss.distillation_loss(h, w, teachers=teachers, teacher_index=INDEX[:2], **kw)
    with pytest.raises(TypeError, match="teacher_index must be an integer tensor"):
        fusedloss.distillation_loss(h, w, teachers=teachers, teacher_index=INDEX.double(), **kw)
    bad = list(teachers)
    bad[1] = bad[1]._replace(hidden=bad[1].hidden[:-1])
    with pytest.raises(ValueError, match=r"teachers\[1\].hidden must have the student's leading shape"):
        fusedloss.distillation_loss(h, w, teachers=bad, teacher_index=INDEX, **kw)
    bad[1] = teachers[1]._replace(hidden=teachers[1].hidden.float())
    with pytest.raises(TypeError, match=r"teachers\[1\].hidden has dtype torch.float32"):
        fusedloss.distillation_loss(h, w, teachers=bad, teacher_index=INDEX, **kw)
    bad[1] = teachers[1]._replace(temperature=0.0)
    with pytest.raises(ValueError, match=r"teachers\[1\].temperature must be > 0"):
        fusedloss.distillation_loss(h, w, teachers=bad, teacher_index=INDEX, **kw)


def test_gradcheck_small():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, 4, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(11, 4, generator=g, dtype=F64, requires_grad=True)
    teachers = [Teacher(torch.randn(5, 6, generator=g, dtype=F64), torch.randn(11, 6, generator=g, dtype=F64),
                        softcap=2.0),
                Teacher(torch.randn(2, 3, generator=g, dtype=F64), torch.randn(11, 3, generator=g, dtype=F64),
                        temperature=1.5)]
    index = torch.tensor([0, 1, 0, -1, 1])
    assert torch.autograd.gradcheck(
        lambda a, c: fusedloss.distillation_loss(a, c, teachers=teachers, teacher_index=index, beta=0.4,
                                                 reduction="sum"), (h, w))


# --------------------------------------------------------------------------------------------------
# multi_teacher_topk_logprobs


def topk_loop(teachers, index, k, **kw):
    flat = index.reshape(-1)
    ids = torch.full((flat.numel(), k), -1)
    lp = torch.full((flat.numel(), k), -math.inf, dtype=F64)
    lse = torch.zeros(flat.numel(), dtype=F64)
    ent = torch.zeros(flat.numel(), dtype=F64)
    for i, t in enumerate(teachers):
        rows = (flat == i).nonzero().squeeze(1)
        th = t.hidden.reshape(-1, t.hidden.shape[-1])
        th = th[rows] if th.shape[0] == flat.numel() else th
        temp = kw.get("temperature", 1.0) if t.temperature is None else t.temperature
        ref = reference.topk_logprobs(th.double(), t.weight.double(), k, bias=None if t.bias is None
                                      else t.bias.double(), temperature=temp, logit_scale=t.logit_scale,
                                      softcap=t.softcap, return_lse=True, return_entropy=True)
        ids[rows], lp[rows], lse[rows], ent[rows] = ref.ids, ref.logprobs, ref.lse, ref.entropy
    return ids.reshape(*index.shape, k), lp.reshape(*index.shape, k), lse.reshape(index.shape), \
        ent.reshape(index.shape)


@pytest.mark.parametrize("k", [1, 6, V])
def test_multi_teacher_topk_equals_the_loop(backend, k):
    h, w, b, y, teachers = problem()
    got = fusedloss.multi_teacher_topk_logprobs(teachers, INDEX, k, return_lse=True, return_entropy=True,
                                                temperature=0.8, backend=backend)
    ids, lp, lse, ent = topk_loop(teachers, INDEX, k, temperature=0.8)
    assert torch.equal(got.ids, ids)
    finite = torch.isfinite(lp)
    assert torch.equal(torch.isfinite(got.logprobs), finite)
    assert (got.logprobs - lp)[finite].abs().max().item() <= 1e-10
    assert (got.lse - lse).abs().max().item() <= 1e-10 and (got.entropy - ent).abs().max().item() <= 1e-10
    assert (got.ids[INDEX == -1] == -1).all()


def test_multi_teacher_topk_round_trip_into_sparse_distillation():
    """Teachers' top-k from their hidden states -> the student's sparse loss = the materialised pipeline."""
    h, w, b, y, teachers = problem()
    k = 9
    top = fusedloss.multi_teacher_topk_logprobs(teachers, INDEX, k, mask=y != -100)
    ids, lp, _, _ = topk_loop(teachers, INDEX, k)
    scored = (INDEX != -1) & (y != -100)
    ids[~scored], lp[~scored] = -1, -math.inf
    kw = dict(beta=0.0, bias=b)
    y_all = torch.where(scored, y, -100)
    got = fusedloss.sparse_distillation_loss(h, w, top.ids, top.logprobs, y_all, **kw)
    want = reference.sparse_distillation_loss(h, w, ids, lp, y_all, **kw)
    assert abs(got.item() - want.item()) <= 1e-12


# --------------------------------------------------------------------------------------------------
# Vocabulary-parallel: every teacher's head sharded like the student's


def check_sharded(rank, world, *, sizes):
    h, w, b, y, teachers = problem(seed=4)
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    shard = [t._replace(weight=t.weight[rows], bias=None if t.bias is None else t.bias[rows]) for t in teachers]
    hg = h.clone().requires_grad_(True)
    wg = w[rows].clone().requires_grad_(True)
    kw = dict(beta=0.5, hard_weight=0.3, temperature=1.2)
    loss = fusedloss.distillation_loss(hg, wg, targets=y, bias=b[rows], teachers=shard, teacher_index=INDEX,
                                       process_group=dist.group.WORLD, **kw)
    loss.backward()
    top = fusedloss.multi_teacher_topk_logprobs(shard, INDEX, 5, return_lse=True, process_group=dist.group.WORLD)
    h64, w64 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = loop_over_teachers(h64, w64, b, y, teachers, INDEX, reduction="batchmean", **kw)
    want.backward()
    ids, lp, lse, _ = topk_loop(teachers, INDEX, 5)
    return dict(loss=loss.detach(), want=want.detach(), dh=hg.grad, want_dh=h64.grad, dw=wg.grad,
                want_dw=w64.grad[rows], top=top, ids=ids, lp=lp, lse=lse)


@pytest.fixture(scope="module", params=[2, 3])
def sharded_run(request, tmp_path_factory):
    world = request.param
    sizes = [20, 33] if world == 2 else [0, 31, 22]
    checks = [("uneven", MODULE, "check_sharded", dict(sizes=sizes))]
    return world, harness.run(world, checks, tmp_path_factory.mktemp(f"multi{world}"))


def test_vocabulary_parallel_equals_the_loop(sharded_run):
    world, results = sharded_run
    for rank in range(world):
        out = harness.value(results, "uneven", rank)
        assert abs(out["loss"].item() - out["want"].item()) <= 1e-12
        assert rel_err(out["dh"], out["want_dh"]) <= 1e-10
        if out["dw"].numel():
            assert rel_err(out["dw"], out["want_dw"]) <= 1e-10
        top = out["top"]
        assert torch.equal(top.ids, out["ids"])
        finite = torch.isfinite(out["lp"])
        assert (top.logprobs - out["lp"])[finite].abs().max().item() <= 1e-12
        assert (top.lse - out["lse"]).abs().max().item() <= 1e-12
