"""The failure modes fused LM-head losses elsewhere have shipped, each checked on every backend that runs here
(torch; Triton, under its interpreter without a GPU; the CUDA backend's host twins on CPU tensors when the
extension is built), on the gradient path that could lose it (the grad-in-forward 3-product path and the statistics
op's recompute backward):

* the true class's d logit on a confident row (softmax >= 0.999), lost when the probability is rounded to
  half precision before 1 is subtracted: d bias at the target, and every gradient, against float64;
* an fp32 loss stored at half precision: the loss and per-token outputs of half inputs are fp32 and equal to
  float64 within fp32's bounds (not half precision's);
* an entropy bonus whose gradient is dropped (the backward ignoring the entropy's cotangent): ``grpo_loss``
  with ``entropy_coef`` and ``token_logprobs(return_entropy=True)`` in a loss, the entropy alone included;
* zero gradients under a label mask that keeps only the last turn of a multi-turn conversation;
* a teacher's soft cap or logit scale left out of a distillation loss: ``distillation_loss`` with the
  teacher's (and the student's) ``softcap`` / ``logit_scale``, against the reference and the independent
  oracle (tests/oracle.py).

Half precision is fp16 on every backend, bf16 on the torch backend and the CUDA host twins (the Triton
interpreter has no bf16 dot product), every backend on a GPU.
"""

from __future__ import annotations

import math

import oracle
import pytest
import torch
from _errors import rel_err
from _harness import NAIVE_FACTOR, compare
from conftest import FP32_TOL, fp64_tol, make_head, make_teacher

import fusedloss
from fusedloss import reference

F64 = torch.float64
V, D = 131, 24
HALF = [torch.float16, torch.bfloat16]
# Half precision's unit roundoff: a gradient formed in fp32 and rounded once to the output dtype.
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


@pytest.fixture(params=["grad_in_forward", "statistics"])
def path(request, monkeypatch):
    """Both gradient paths: the 3-product grad-in-forward one (gradients formed in the forward) and the statistics
    op's recompute backward."""
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1" if request.param == "grad_in_forward" else "0")
    return request.param


def _half(dtype, engine):
    if dtype == torch.bfloat16 and engine == "triton" and not torch.cuda.is_available():
        pytest.skip("bf16 dot products need a GPU (the Triton interpreter cannot do them)")


def _leaves(tensors: dict, dtype, device) -> dict:
    return {k: t.detach().to(device=device, dtype=dtype).requires_grad_() for k, t in tensors.items()}


# --------------------------------------------------------------------------------------------------
# The true class's d logit at softmax >= 0.999 in half precision


def confident_rows(dtype, n=6, seed=0):
    """hidden ``[n, D]``, weight, bias (float64 holding values exact in ``dtype``) and distinct targets, each
    row's target the maximum with softmax between 0.999 and 0.99995 on the rounded values (1 - q_y from
    5e-4 down to 5e-5 before the rounding): the d logit of the target is -(1 - q_y), 1e-3 or less of the
    probability it is formed from."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g, dtype=F64) / math.sqrt(D)
    b = 0.5 * torch.randn(V, generator=g, dtype=F64)
    h = torch.randn(n, D, generator=g, dtype=F64)
    y = torch.randperm(V, generator=g)[:n]
    w, b = w.to(dtype).to(F64), b.to(dtype).to(F64)
    for i, gap in enumerate(torch.logspace(math.log10(5e-4), math.log10(5e-5), n, dtype=F64).tolist()):
        direction = w[y[i]] / w[y[i]].norm() ** 2
        for _ in range(60):
            z = h[i] @ w.T + b
            others = z.clone()
            others[y[i]] = -math.inf
            miss = float(torch.logsumexp(others, 0) + math.log((1 - gap) / gap) - z[y[i]])
            if abs(miss) < 1e-12:
                break
            h[i] += 0.9 * miss * direction
    h = h.to(dtype).to(F64)
    q_y = torch.softmax(h @ w.T + b, -1).gather(1, y[:, None]).squeeze(1)
    assert bool((q_y >= 0.999).all() and (q_y <= 0.99995).all()), q_y
    return dict(hidden=h, weight=w, bias=b, targets=y)


def _target_bias_grad(module, fn, inputs, dtype, device, backend):
    """d bias at each row's target of ``fn`` (sum over the rows; its log-probs weighted by 1 for
    token_logprobs): the true class's d logit, plus the other rows' tiny share in that column."""
    leaves = _leaves({k: inputs[k] for k in ("hidden", "weight", "bias")}, dtype, device)
    y = inputs["targets"].to(device)
    run = {} if backend is None else dict(backend=backend)
    if fn == "cross_entropy":
        out = module.cross_entropy(leaves["hidden"], leaves["weight"], y, bias=leaves["bias"], reduction="sum", **run)
    else:
        out = module.token_logprobs(leaves["hidden"], leaves["weight"], y, bias=leaves["bias"], **run).sum()
    out.backward()
    return leaves["bias"].grad.double().cpu()[inputs["targets"]]


@pytest.mark.parametrize("fn", ["cross_entropy", "token_logprobs"])
@pytest.mark.parametrize("dtype", HALF, ids=_dtype_id)
def test_true_class_gradient_on_a_confident_row(any_engine, path, dtype, fn):
    engine, device = any_engine
    _half(dtype, engine)
    inputs = confident_rows(dtype)
    want = _target_bias_grad(reference, fn, inputs, F64, "cpu", None)
    got = _target_bias_grad(fusedloss, fn, inputs, dtype, device, engine)
    naive = _target_bias_grad(reference, fn, inputs, dtype, "cpu", None)
    sign = -1.0 if fn == "cross_entropy" else 1.0  # d logp / dz_y = 1 - q_y; cross-entropy: -(1 - q_y)
    assert bool((sign * want > 0).all() and (want.abs() <= 1.1e-3).all()), want
    err = ((got - want) / want).abs()
    naive_err = ((naive - want) / want).abs()
    # Rounded once from fp32 (a d logit of 0, as a probability rounded to 1 gives, is a relative error of 1);
    # and no worse than the naive path (logits rounded to the dtype), whose rounding of z_y alone moves it more.
    assert float(err.max()) <= 2 * UNIT[dtype], (err.tolist(), naive_err.tolist())
    assert float(err.max()) <= float(naive_err.max()) + UNIT[dtype], (err.tolist(), naive_err.tolist())
    # Every output and the gradients of hidden, weight and bias: no worse than the naive path.
    options = dict(reduction="sum") if fn == "cross_entropy" else dict(return_entropy=True)
    compare(fn, inputs, options, engine, dtype, device)


# --------------------------------------------------------------------------------------------------
# fp32 outputs of half inputs, at fp32 precision


def _outputs(result):
    return [result] if isinstance(result, torch.Tensor) else [t for t in result if isinstance(t, torch.Tensor)]


def _fp32_case(name):
    h, w, b, t = make_head(0, D, V, leading=(3, 5), bias=True, ignore_fraction=0.2, seed=31)
    head = dict(hidden=h, weight=w, bias=b)
    if name == "cross_entropy-mean":
        return "cross_entropy", head, (t,), dict(z_loss=1e-3)
    if name == "cross_entropy-none":
        return "cross_entropy", head, (t,), dict(reduction="none", softcap=30.0)
    if name == "token_logprobs":
        return "token_logprobs", head, (t,), dict(return_entropy=True, temperature=0.7)
    if name == "distillation_loss":
        ht, wt, bt = make_teacher(0, 17, V, leading=(3, 5), bias=True, seed=32)
        teacher = dict(teacher_hidden=ht, teacher_weight=wt, teacher_bias=bt)
        return "distillation_loss", dict(head, **teacher), (t,), dict(beta=0.5, reduction="none")
    ids = t.clamp(min=0)
    mask = t != -100
    adv = torch.tensor([1.0, -0.5, 0.3], dtype=F64)
    old = (reference.token_logprobs(h, w, ids, bias=b) - 0.1).detach()
    return "grpo_loss", head, (ids, adv, mask), dict(old_logprobs=old, entropy_coef=0.01, return_details=True)


def _call(module, name, tensors, rest, options, backend):
    positional = [tensors["hidden"], tensors["weight"]]
    if name == "distillation_loss":
        positional += [tensors["teacher_hidden"], tensors["teacher_weight"]]
    keywords = {k: t for k, t in tensors.items() if k in ("bias", "teacher_bias")}
    device = tensors["hidden"].device
    options = {k: t.to(device) if isinstance(t, torch.Tensor) else t for k, t in options.items()}
    run = {} if backend is None else dict(backend=backend)
    result = getattr(module, name)(*positional, *rest, **keywords, **options, **run)
    if name == "grpo_loss":
        loss, details = result
        return [loss, details.logprobs, details.entropy]
    return _outputs(result)


@pytest.mark.parametrize("case", ["cross_entropy-mean", "cross_entropy-none", "token_logprobs", "distillation_loss",
                                  "grpo_loss"])
@pytest.mark.parametrize("dtype", HALF, ids=_dtype_id)
def test_outputs_of_half_inputs_are_fp32_at_fp32_precision(any_engine, path, dtype, case):
    engine, device = any_engine
    _half(dtype, engine)
    name, tensors, rest, options = _fp32_case(case)
    rounded = {k: t.to(dtype).to(F64) for k, t in tensors.items()}
    want = _call(reference, name, rounded, rest, options, None)
    naive32 = _call(reference, name, {k: t.float() for k, t in rounded.items()}, rest, options, None)
    # the student's head requires grad, so that the grad-in-forward path (a loss formed with its gradients) is taken
    leaves = {k: t.to(device, dtype).requires_grad_(k in ("hidden", "weight", "bias")) for k, t in rounded.items()}
    got = [t.detach() for t in _call(fusedloss, name, leaves, tuple(x.to(device) for x in rest), options, engine)]
    assert len(got) == len(want) > 0
    for i, (g, w, n) in enumerate(zip(got, want, naive32)):
        assert g.dtype == torch.float32, (case, i, g.dtype)
        bound = max(FP32_TOL, NAIVE_FACTOR * rel_err(n, w))
        # a half-precision store would be off by 2^-9 (bf16) or 2^-12 (fp16) relative
        assert bound < UNIT[dtype] / 4 and rel_err(g, w) <= bound, (case, i, rel_err(g, w), bound)


# --------------------------------------------------------------------------------------------------
# The entropy bonus's gradient


def _grpo_batch():
    h, w, b, _ = make_head(0, D, V, leading=(3, 6), bias=True, peaked=False, seed=41)
    g = torch.Generator().manual_seed(42)
    ids = torch.randint(0, V, (3, 6), generator=g)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 4, 1])[:, None]
    old = (reference.token_logprobs(h, w, ids, bias=b) + 0.2 * torch.randn(3, 6, generator=g, dtype=F64)).detach()
    return dict(hidden=h, weight=w, bias=b, completion_ids=ids, completion_mask=mask, old_logprobs=old)


def _grads(module, fn, tensors, dtype, device, backend, objective):
    leaves = _leaves({k: tensors[k] for k in ("hidden", "weight", "bias")}, dtype, device)
    others = {k: (t.to(device, torch.float64 if dtype == F64 else torch.float32) if t.is_floating_point()
                  else t.to(device)) for k, t in tensors.items() if k not in leaves}
    run = {} if backend is None else dict(backend=backend)
    out = objective(getattr(module, fn), leaves, others, run)
    out.backward()
    return out.detach(), [leaves[k].grad for k in ("hidden", "weight", "bias")]


def _check_grads(got, want, tol):
    (value, grads), (value_want, grads_want) = got, want
    assert rel_err(value, value_want) <= tol, (value, value_want)
    for name, g, r in zip("hwb", grads, grads_want):
        assert r.norm() > 0 and g is not None and rel_err(g, r) <= tol, (name, None if g is None else rel_err(g, r))


def _tol(engine, dtype, naive=None, want=None):
    """float64: the backend's float64 bound. float32: 1e-5, or 4x the naive fp32 path's error on the same
    device where that is larger (a GPU's fp32 products sum in another order than the CPU's)."""
    if dtype == F64:
        return fp64_tol(engine)
    if naive is None:
        return 1e-5
    (value, grads), (value_want, grads_want) = naive, want
    errs = [rel_err(value, value_want)] + [rel_err(g, r) for g, r in zip(grads, grads_want)]
    return max(1e-5, 4 * max(errs))


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=_dtype_id)
@pytest.mark.parametrize("agg", [None, "seq-mean-token-mean"])
def test_grpo_entropy_bonus_gradient(any_engine, path, dtype, agg):
    """With zero advantages the loss is the entropy bonus alone: a dropped entropy gradient leaves zero
    gradients; with advantages, the bonus and the policy term together. Against float64 autograd of the
    reference, every gradient non-zero."""
    engine, device = any_engine
    tensors = {k: t.to(dtype).to(F64) if t.is_floating_point() else t for k, t in _grpo_batch().items()}
    options = dict(entropy_coef=0.7, loss_type="dapo", loss_agg_mode=agg)
    for adv in (torch.zeros(3, dtype=F64), torch.tensor([1.0, -0.5, 0.8], dtype=F64)):
        def objective(fn, leaves, others, run, adv=adv):
            return fn(leaves["hidden"], leaves["weight"], others["completion_ids"], adv.to(leaves["hidden"].device,
                      torch.float64 if leaves["hidden"].dtype == F64 else torch.float32), others["completion_mask"],
                      bias=leaves["bias"], old_logprobs=others["old_logprobs"], **options, **run)
        want = _grads(reference, "grpo_loss", tensors, F64, "cpu", None, objective)
        got = _grads(fusedloss, "grpo_loss", tensors, dtype, device, engine, objective)
        naive = _grads(reference, "grpo_loss", tensors, dtype, device, None, objective) if dtype != F64 else None
        _check_grads(got, want, _tol(engine, dtype, naive, want))


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=_dtype_id)
@pytest.mark.parametrize("which", ["entropy alone", "log-probs and entropy"])
def test_token_logprobs_entropy_in_a_loss(any_engine, dtype, which):
    engine, device = any_engine
    h, w, b, t = make_head(0, D, V, leading=(2, 7), bias=True, ignore_fraction=0.2, seed=43)
    g = torch.Generator().manual_seed(44)
    a, c = torch.randn(2, 7, generator=g, dtype=F64), torch.randn(2, 7, generator=g, dtype=F64)
    tensors = dict(hidden=h.to(dtype), weight=w.to(dtype), bias=b.to(dtype), targets=t)

    def objective(fn, leaves, others, run):
        logp, entropy = fn(leaves["hidden"], leaves["weight"], others["targets"], bias=leaves["bias"],
                           temperature=0.9, return_entropy=True, **run)
        loss = (entropy * c.to(entropy)).sum()
        return loss if which == "entropy alone" else loss + (logp * a.to(logp)).sum()

    want = _grads(reference, "token_logprobs", {k: v.to(F64) if v.is_floating_point() else v
                                                 for k, v in tensors.items()}, F64, "cpu", None, objective)
    got = _grads(fusedloss, "token_logprobs", tensors, dtype, device, engine, objective)
    naive = _grads(reference, "token_logprobs", tensors, dtype, device, None, objective) if dtype != F64 else None
    _check_grads(got, want, _tol(engine, dtype, naive, want))


@pytest.mark.parametrize("dtype", HALF, ids=_dtype_id)
def test_entropy_bonus_gradient_half(any_engine, path, dtype):
    engine, device = any_engine
    _half(dtype, engine)
    tensors = _grpo_batch()
    inputs = dict(tensors, advantages=torch.zeros(3, dtype=F64))
    compare("grpo_loss", inputs, dict(entropy_coef=0.7), engine, dtype, device)
    compare("token_logprobs", dict(hidden=tensors["hidden"], weight=tensors["weight"], bias=tensors["bias"],
                                   targets=tensors["completion_ids"]), dict(return_entropy=True), engine, dtype,
            device)


# --------------------------------------------------------------------------------------------------
# A label mask that keeps only the last turn of a multi-turn conversation


def last_turn_case():
    """Three conversations of 16 tokens (a few turns each); labels -100 everywhere but each row's last
    assistant turn (tokens 11-14, 13-15, and only the final token), Gemma-style soft cap."""
    h, w, b, t = make_head(0, D, V, leading=(3, 16), bias=True, seed=45)
    keep = torch.zeros(3, 16, dtype=torch.bool)
    keep[0, 11:15] = True
    keep[1, 13:16] = True
    keep[2, 15] = True
    labels = torch.where(keep, t, torch.full_like(t, -100))
    return dict(hidden=h, weight=w, bias=b, targets=labels), keep


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16], ids=_dtype_id)
@pytest.mark.parametrize("fn,options", [("cross_entropy", dict(softcap=30.0)),
                                        ("cross_entropy", dict(num_items_in_batch=40)),
                                        ("token_logprobs", dict(softcap=30.0))], ids=["ce", "ce-items", "logprobs"])
def test_last_turn_only_labels(any_engine, path, dtype, fn, options):
    engine, device = any_engine
    inputs, keep = last_turn_case()
    tol = _tol(engine, dtype) if dtype != torch.float16 else None
    compare(fn, inputs, options, engine, dtype, device, tol)
    leaves = _leaves({k: inputs[k] for k in ("hidden", "weight", "bias")}, dtype, device)
    out = getattr(fusedloss, fn)(leaves["hidden"], leaves["weight"], inputs["targets"].to(device),
                                 bias=leaves["bias"], backend=engine, **options)
    out.sum().backward()
    row_norms = leaves["hidden"].grad.double().norm(dim=-1).cpu()
    # a gradient on every kept token's row, none elsewhere; the head's gradients non-zero
    assert bool((row_norms[keep] > 0).all()) and bool((row_norms[~keep] == 0).all()), row_norms
    assert float(leaves["weight"].grad.double().norm()) > 0 and float(leaves["bias"].grad.double().norm()) > 0


# --------------------------------------------------------------------------------------------------
# The teacher's soft cap and logit scale in distillation


def distill_case(seed=51):
    h, w, b, t = make_head(0, D, V, leading=(2, 6), bias=True, ignore_fraction=0.2, seed=seed)
    ht, wt, bt = make_teacher(0, 17, V, leading=(2, 6), bias=True, seed=seed + 1)
    return dict(hidden=h, weight=w, teacher_hidden=ht, teacher_weight=wt, targets=t, bias=b, teacher_bias=bt)


TEACHER_TRANSFORMS = {
    "teacher-softcap": dict(teacher_softcap=2.5),
    "teacher-scale": dict(teacher_logit_scale=0.3),
    "both-models": dict(teacher_softcap=3.0, teacher_logit_scale=-0.7, softcap=20.0, logit_scale=1.3),
}


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=_dtype_id)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("transform", list(TEACHER_TRANSFORMS))
def test_distillation_with_a_transformed_teacher(any_engine, path, dtype, beta, transform):
    engine, device = any_engine
    options = dict(TEACHER_TRANSFORMS[transform], beta=beta, temperature=1.7, hard_weight=0.3)
    compare("distillation_loss", distill_case(), options, engine, dtype, device, _tol(engine, dtype))


@pytest.mark.parametrize("transform", list(TEACHER_TRANSFORMS))
def test_distillation_transforms_against_the_oracle(transform):
    """The reference against tests/oracle.py (which shares no code with fusedloss), loss and student
    gradients; and the teacher's transform is live (its peaked rows put a logit 30 above the rest: capped at
    2.5 or scaled by 0.3 they are another distribution)."""
    inputs = distill_case()
    options = dict(TEACHER_TRANSFORMS[transform], beta=0.5, temperature=1.7, hard_weight=0.3)
    results = []
    for module in (reference, oracle):
        hidden = inputs["hidden"].clone().requires_grad_()
        weight = inputs["weight"].clone().requires_grad_()
        loss = module.distillation_loss(hidden, weight, inputs["teacher_hidden"], inputs["teacher_weight"],
                                        inputs["targets"], bias=inputs["bias"], teacher_bias=inputs["teacher_bias"],
                                        **options)
        results.append((loss, torch.autograd.grad(loss, (hidden, weight))))
    (ref, ref_grads), (want, want_grads) = results
    assert rel_err(ref, want) <= 1e-12
    for g, r in zip(ref_grads, want_grads):
        assert rel_err(g, r) <= 1e-12
    soft = dict(options, beta=0.0, hard_weight=0.0)  # the forward KL alone: the teacher's side of the loss
    with_teacher, without = (
        reference.distillation_loss(inputs["hidden"], inputs["weight"], inputs["teacher_hidden"],
                                    inputs["teacher_weight"], inputs["targets"], bias=inputs["bias"],
                                    teacher_bias=inputs["teacher_bias"], **opts).item()
        for opts in (soft, {k: v for k, v in soft.items() if not k.startswith("teacher_")}))
    assert abs(with_teacher - without) > 0.1 * abs(with_teacher), (with_teacher, without)


@pytest.mark.parametrize("dtype", HALF, ids=_dtype_id)
def test_distillation_with_a_transformed_teacher_half(any_engine, dtype):
    engine, device = any_engine
    _half(dtype, engine)
    options = dict(TEACHER_TRANSFORMS["both-models"], beta=0.0, temperature=1.7)
    compare("distillation_loss", distill_case(), options, engine, dtype, device)


@pytest.mark.parametrize("options,name", [(dict(teacher_softcap=0.0), "teacher_softcap"),
                                          (dict(teacher_softcap=-1.0), "teacher_softcap"),
                                          (dict(teacher_logit_scale=float("nan")), "teacher_logit_scale"),
                                          (dict(teacher_logit_scale="2"), "teacher_logit_scale")])
def test_teacher_transform_bad_input(options, name):
    inputs = distill_case()
    with pytest.raises((ValueError, TypeError), match=name):
        fusedloss.distillation_loss(inputs["hidden"], inputs["weight"], inputs["teacher_hidden"],
                                    inputs["teacher_weight"], inputs["targets"], backend="torch", **options)

