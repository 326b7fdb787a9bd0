"""Bad input gets a ValueError or TypeError whose message names the argument (docs/design.md, "Bad input").

All checks run before any kernel, so these tests use the torch backend's defaults (``backend="auto"``)
except where the backend argument itself is under test.
"""

from __future__ import annotations

import pytest
import torch

import fusedloss

N, D, V = 5, 8, 11


def head(n=N, d=D, v=V, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = torch.randn(v, d, generator=g).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    return h, w, t


def raises(fn, *names, exc=(ValueError, TypeError)):
    """``fn()`` raises ``exc`` and the message mentions one of ``names``."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert any(n in msg for n in names), f"message {msg!r} names none of {names}"
    return msg


# --------------------------------------------------------------------------------------------------
# The LM head, for every op that takes one


def _ops():
    """Each op as f(hidden, weight, targets, **kw) on a [N, D] / [2, N, D] head."""
    g = torch.Generator().manual_seed(1)

    def tl(h, w, t, **kw):
        return fusedloss.token_logprobs(h, w, t, **kw)

    def ce(h, w, t, **kw):
        return fusedloss.cross_entropy(h, w, t, **kw)

    def distill(h, w, t, **kw):
        ht = torch.randn(h.shape, generator=g).to(h.dtype) if h.dtype.is_floating_point else h.float()
        wt = torch.randn(w.shape, generator=g).to(ht.dtype) if w.dtype.is_floating_point else w.float()
        return fusedloss.distillation_loss(h, w, ht.to(h.device), wt.to(w.device), t, **kw)

    def grpo(h, w, t, **kw):
        h3, t2 = h.reshape(1, *h.shape), t.reshape(1, *t.shape)
        mask = torch.ones(t2.shape, dtype=torch.bool, device=t2.device)
        adv = torch.ones(1, device=t2.device)
        return fusedloss.grpo_loss(h3, w, t2, adv, mask, **kw)

    def dpo(h, w, t, **kw):
        h3 = torch.stack([h, h]) if h.device.type != "meta" else h.expand(2, *h.shape)
        t2 = torch.stack([t, t]) if t.device.type != "meta" else t.expand(2, *t.shape)
        ref = torch.zeros(1, device=t2.device)
        return fusedloss.dpo_loss(h3, w, t2, ref, ref, **kw)

    return {"token_logprobs": tl, "cross_entropy": ce, "distillation_loss": distill, "grpo_loss": grpo,
            "dpo_loss": dpo}


OPS = list(_ops())
TARGET_NAME = {"grpo_loss": "completion_ids", "dpo_loss": "labels"}


@pytest.fixture(params=OPS)
def op(request):
    return request.param, _ops()[request.param]


def test_good_input_runs(op):
    name, f = op
    h, w, t = head()
    out = f(h, w, t)
    assert torch.isfinite(out if isinstance(out, torch.Tensor) else out[0]).all()


def test_hidden_size_mismatch(op):
    name, f = op
    h, w, t = head()
    raises(lambda: f(h, w[:, :-1], t), "weight", "hidden")


def test_integer_hidden(op):
    name, f = op
    h, w, t = head()
    raises(lambda: f(h.long(), w, t), "hidden")


def test_float_targets(op):
    name, f = op
    h, w, t = head()
    raises(lambda: f(h, w, t.float()), TARGET_NAME.get(name, "targets"))


def test_targets_shape_mismatch(op):
    name, f = op
    h, w, t = head()
    raises(lambda: f(h, w, t[:-1]), TARGET_NAME.get(name, "targets"), "hidden")


@pytest.mark.parametrize("bad", [V, V + 5, -1, -101])
def test_target_out_of_range(op, bad):
    name, f = op
    h, w, t = head()
    t = t.clone()
    t[2] = bad
    msg = raises(lambda: f(h, w, t), TARGET_NAME.get(name, "targets"), exc=ValueError)
    assert str(bad) in msg


def test_ignore_index_is_not_out_of_range(op):
    name, f = op
    if name == "grpo_loss":
        pytest.skip("grpo_loss has no ignore_index: completion_mask marks the scored tokens")
    h, w, t = head()
    t = t.clone()
    t[1] = -100
    f(h, w, t)  # must not raise


def test_bias_shape(op):
    name, f = op
    h, w, t = head()
    raises(lambda: f(h, w, t, bias=torch.zeros(V + 1)), "bias")


def test_different_devices(op):
    name, f = op
    h, w, t = head()
    raises(lambda: f(h.to("meta"), w, t.to("meta")), "device", "weight", "hidden", exc=ValueError)
    raises(lambda: f(h, w.to("meta"), t), "device", "weight", "hidden", exc=ValueError)


def test_unknown_backend(op):
    name, f = op
    h, w, t = head()
    raises(lambda: f(h, w, t, backend="tpu"), "backend", exc=ValueError)


def test_unavailable_backend_says_why(op):
    name, f = op
    status = fusedloss.backend_status()
    unavailable = [b for b, s in status.items() if b != "gpu" and s != "available"]
    if not unavailable:
        pytest.skip("every backend is available here")
    h, w, t = head()
    for backend in unavailable:
        msg = raises(lambda: f(h, w, t, backend=backend), "backend", backend, exc=ValueError)
        assert status[backend] in msg, f"the message {msg!r} does not say why ({status[backend]!r})"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_backend_on_cpu_machine(op):
    name, f = op
    h, w, t = head()
    msg = raises(lambda: f(h, w, t, backend="cuda"), "cuda", exc=ValueError)
    assert len(msg) > len("backend='cuda'") + 10, f"the message {msg!r} does not say why"


def test_transform_values(op):
    name, f = op
    if name == "distillation_loss":
        raises(lambda: f(*head(), temperature=0.0), "temperature")
        return
    h, w, t = head()
    raises(lambda: f(h, w, t, temperature=0.0), "temperature")
    raises(lambda: f(h, w, t, temperature=-1.0), "temperature")
    raises(lambda: f(h, w, t, softcap=-2.0), "softcap")


# --------------------------------------------------------------------------------------------------
# Options


@pytest.mark.parametrize("reduction", ["avg", "batchmean", None])
def test_cross_entropy_reduction(reduction):
    raises(lambda: fusedloss.cross_entropy(*head(), reduction=reduction), "reduction")


@pytest.mark.parametrize("reduction", ["mean", "avg"])
def test_distillation_reduction(reduction):
    h, w, t = head()
    raises(lambda: fusedloss.distillation_loss(h, w, h, w, t, reduction=reduction), "reduction")


def test_distillation_teacher_shapes():
    h, w, t = head()
    raises(lambda: fusedloss.distillation_loss(h, w, h, w[:-1], t), "teacher_weight", "vocab")
    raises(lambda: fusedloss.distillation_loss(h, w, h[:-1], w, t), "teacher_hidden")
    raises(lambda: fusedloss.distillation_loss(h, w, h, w[:, :-1], t), "teacher_weight", "teacher_hidden")
    raises(lambda: fusedloss.distillation_loss(h, w, h, w, t, teacher_bias=torch.zeros(V + 2)), "teacher_bias")
    raises(lambda: fusedloss.distillation_loss(h, w, h.long(), w, t), "teacher_hidden")
    raises(lambda: fusedloss.distillation_loss(h, w, h.to("meta"), w.to("meta"), t), "teacher", "device")


def test_distillation_hard_weight_needs_targets():
    h, w, _ = head()
    raises(lambda: fusedloss.distillation_loss(h, w, h, w, None, hard_weight=0.5), "hard_weight", "targets")


@pytest.mark.parametrize("beta", [-0.1, 1.5])
def test_distillation_beta_range(beta):
    h, w, t = head()
    raises(lambda: fusedloss.distillation_loss(h, w, h, w, t, beta=beta), "beta")


def grpo_inputs(b=2, c=3):
    g = torch.Generator().manual_seed(2)
    h = torch.randn(b, c, D, generator=g)
    w = torch.randn(V, D, generator=g)
    ids = torch.randint(0, V, (b, c), generator=g)
    adv = torch.randn(b, generator=g)
    mask = torch.ones(b, c, dtype=torch.bool)
    return h, w, ids, adv, mask


def test_grpo_good_input_runs():
    loss = fusedloss.grpo_loss(*grpo_inputs(), old_logprobs=torch.zeros(2, 3) - 2.0)
    assert torch.isfinite(loss)


def test_grpo_bad_inputs():
    h, w, ids, adv, mask = grpo_inputs()
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv, mask, loss_type="ppo"), "loss_type")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv, mask, importance_sampling_level="seq"),
           "importance_sampling_level")
    raises(lambda: fusedloss.grpo_loss(h[0], w, ids, adv, mask), "hidden")
    raises(lambda: fusedloss.grpo_loss(h, w, ids[:, :-1], adv, mask), "completion_ids")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv[:1], mask), "advantages")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, torch.randn(2, 4), mask), "advantages")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv, mask[:, :-1]), "completion_mask")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv, mask, old_logprobs=torch.zeros(2, 4)), "old_logprobs")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv, mask, old_logprobs=torch.zeros(2, 3, dtype=torch.long)),
           "old_logprobs")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv, mask, beta=0.1), "ref_logprobs")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv, mask, beta=0.1, ref_logprobs=torch.zeros(3, 3)),
           "ref_logprobs")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv, mask, importance_weights=torch.ones(5)),
           "importance_weights")
    raises(lambda: fusedloss.grpo_loss(h, w, ids.float(), adv, mask), "completion_ids")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv, mask, num_processes=0), "num_processes")
    raises(lambda: fusedloss.grpo_loss(h, w, ids, adv.to("meta"), mask), "advantages", "device")
    bad = ids.clone()
    bad[0, 1] = V
    raises(lambda: fusedloss.grpo_loss(h, w, bad, adv, mask), "completion_ids")


def dpo_inputs():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(4, 3, D, generator=g)
    w = torch.randn(V, D, generator=g)
    labels = torch.randint(0, V, (4, 3), generator=g)
    ref = torch.zeros(2)
    return h, w, labels, ref, ref.clone()


def test_dpo_good_input_runs():
    assert torch.isfinite(fusedloss.dpo_loss(*dpo_inputs()))


def test_dpo_bad_inputs():
    h, w, labels, rc, rr = dpo_inputs()
    raises(lambda: fusedloss.dpo_loss(h, w, labels, rc, rr, loss_type="kto"), "loss_type")
    raises(lambda: fusedloss.dpo_loss(h[:3], w, labels[:3], rc, rr), "hidden")  # odd number of rows
    raises(lambda: fusedloss.dpo_loss(h, w, labels[:, :-1], rc, rr), "labels")
    raises(lambda: fusedloss.dpo_loss(h, w, labels, torch.zeros(3), rr), "ref_chosen_logps")
    raises(lambda: fusedloss.dpo_loss(h, w, labels, rc, torch.zeros(2, 1)), "ref_rejected_logps")
    raises(lambda: fusedloss.dpo_loss(h, w, labels.float(), rc, rr), "labels")
    raises(lambda: fusedloss.dpo_loss(h, w, labels, rc, rr, beta=0.0), "beta")
    raises(lambda: fusedloss.dpo_loss(h, w, labels, rc, rr, loss_type="robust", label_smoothing=0.5),
           "label_smoothing")
    raises(lambda: fusedloss.dpo_loss(h, w, labels, rc.to("meta"), rr), "ref_chosen_logps", "device")


def test_group_advantages_bad_inputs():
    r = torch.rand(12)
    raises(lambda: fusedloss.group_advantages(r, 5), "group_size", "rewards")
    raises(lambda: fusedloss.group_advantages(r, 0), "group_size")
    raises(lambda: fusedloss.group_advantages(r, 4, scale="global"), "scale")
    raises(lambda: fusedloss.group_advantages(r.reshape(3, 4), 4), "rewards")
    raises(lambda: fusedloss.group_advantages([0.0, 1.0], 2), "rewards")
    raises(lambda: fusedloss.group_advantages(r, 4, eps=-1.0), "eps")


# --------------------------------------------------------------------------------------------------
# NaN and inf propagate; they never crash or hang (docs/design.md, "Bad input")


def test_nonfinite_inputs_propagate(backend, device):
    h, w, t = head()
    h, w, t = h.to(device), w.to(device), t.to(device)
    h = h.clone()
    h[1, 0] = float("nan")
    h[3, 2] = float("inf")
    logp = fusedloss.token_logprobs(h, w, t, backend=backend)
    assert torch.isnan(logp[1]), "a NaN in hidden must reach that row's output"
    assert not bool(torch.isfinite(logp[3])), "an inf in hidden must not give a finite log-prob"
    assert bool(torch.isfinite(logp[[0, 2, 4]]).all()), "other rows must be unaffected"
    loss = fusedloss.cross_entropy(h, w, t, backend=backend)
    assert not bool(torch.isfinite(loss))


def test_grpo_traps_name_their_fix():
    h, w, ids, adv, mask = grpo_inputs()
    labels = ids.clone()
    labels[0, 1] = -100  # labels with -100 passed as completion ids, inside the mask
    msg = raises(lambda: fusedloss.grpo_loss(h, w, labels, adv, mask), "completion_ids", exc=ValueError)
    assert "-100" in msg and "use completion_mask" in msg
    assert "ignore_index (" not in msg and str(-(2**63)) not in msg  # no internal sentinel value
    masked = mask.clone()
    masked[0, 1] = False  # outside the mask an id is never read
    assert torch.isfinite(fusedloss.grpo_loss(h, w, labels, adv, masked))
    # the hidden states of prompt + completion instead of the completion's rows
    prompt = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(5))
    full = torch.cat((prompt, h), dim=1)
    msg = raises(lambda: fusedloss.grpo_loss(full, w, ids, adv, mask), "completion_ids", exc=ValueError)
    assert "pass hidden[:, P - 1:-1]" in msg


def test_value_checks_off_the_cpu_are_device_side_assertions():
    """On an accelerator the range checks never read a value on the host (a training step runs ahead of it and
    can be captured in a CUDA graph): they become ``torch._assert_async``, which carries the argument's name.
    On the CPU, where the host owns the data, the error names the offending value."""
    from fusedloss import _validation

    targets = torch.tensor([3, -100, V + 2])
    with pytest.raises(ValueError, match=rf"targets contains {V + 2}, outside \[0, {V}\)"):
        _validation.map_targets("targets", targets, V, -100)
    with pytest.raises(RuntimeError, match=rf"targets contains a value outside \[0, {V}\) and not ignore_index"):
        bad = (targets >= V).any()
        _validation.refuse_values(bad, lambda: "not read", f"targets contains a value outside [0, {V}) and not "
                                  "ignore_index (-100)", synchronise=False)
    for good in (torch.tensor(False), torch.tensor([False])):
        _validation.refuse_values(good, lambda: "not read", "never raised", synchronise=False)
        _validation.refuse_values(good, lambda: "not read", "never raised")
    mapped = _validation.map_targets("targets", targets[:2], V, -100)
    assert mapped.tolist() == [3, -1]


@pytest.mark.gpu
def test_value_checks_do_not_synchronise_on_a_gpu():
    from fusedloss import _validation
    from fusedloss.losses.implicit_logits import items_divisor

    targets = torch.tensor([3, -100, 7], device="cuda")
    like = torch.zeros((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        mapped = _validation.map_targets("targets", targets, V, -100)
        divisor = items_divisor(torch.tensor(4, device="cuda"), like, positive=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert mapped.tolist() == [3, -1, 7] and divisor.item() == 4
