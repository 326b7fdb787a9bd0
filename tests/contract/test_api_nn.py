"""fusedloss.nn: each module is its function, configured in __init__ and called with tensors in forward."""

from __future__ import annotations

import inspect

import pytest
import torch

import fusedloss
from fusedloss import nn as fnn

PAIRS = [
    (fnn.TokenLogProbs, fusedloss.token_logprobs),
    (fnn.LinearCrossEntropy, fusedloss.cross_entropy),
    (fnn.DistillationLoss, fusedloss.distillation_loss),
    (fnn.SparseDistillationLoss, fusedloss.sparse_distillation_loss),
    (fnn.GRPOLoss, fusedloss.grpo_loss),
    (fnn.DPOLoss, fusedloss.dpo_loss),
    (fnn.KTOLoss, fusedloss.kto_loss),
    (fnn.ORPOLoss, fusedloss.orpo_loss),
    (fnn.CPOLoss, fusedloss.cpo_loss),
]


def _params(fn):
    return {name: p.default for name, p in inspect.signature(fn).parameters.items() if name != "self"}


@pytest.mark.parametrize("module,function", PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_module_arguments_are_exactly_the_function_arguments(module, function):
    init, forward, func = _params(module.__init__), _params(module.forward), _params(function)
    assert not init.keys() & forward.keys()
    assert init.keys() | forward.keys() == func.keys()
    for name, default in init.items():  # same defaults, so a module and its function never disagree
        assert default == func[name], name
    for name, default in forward.items():
        if default is not inspect.Parameter.empty:
            assert default == func[name], name


def _data(seed=0, b=3, t=5, d=8, v=37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, d, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(v, d, generator=g, dtype=torch.float64).requires_grad_()
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    targets = torch.randint(0, v, (b, t), generator=g)
    targets[0, :2] = -100
    return g, hidden, weight, bias, targets


def _same(a, b):
    if isinstance(a, tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b


def test_token_logprobs_and_cross_entropy():
    _, hidden, weight, bias, targets = _data()
    opts = dict(temperature=0.7, logit_scale=1.5, softcap=4.0, return_entropy=True, backend="torch")
    _same(fnn.TokenLogProbs(**opts)(hidden, weight, targets, bias),
          fusedloss.token_logprobs(hidden, weight, targets, bias=bias, **opts))
    opts = dict(label_smoothing=0.1, z_loss=1e-3, reduction="sum", backend="torch")
    loss_fn = fnn.LinearCrossEntropy(**opts)
    got = loss_fn(hidden, weight, targets, bias, num_items_in_batch=7)
    _same(got, fusedloss.cross_entropy(hidden, weight, targets, bias=bias, num_items_in_batch=7, **opts))
    got.backward()  # differentiable through the module
    assert hidden.grad is not None and weight.grad is not None
    assert "label_smoothing=0.1" in repr(loss_fn)
    assert list(loss_fn.parameters()) == []


def test_distillation():
    g, hidden, weight, _, targets = _data(1)
    teacher_hidden = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)
    teacher_weight = torch.randn(37, 6, generator=g, dtype=torch.float64)
    opts = dict(beta=0.3, temperature=2.0, hard_weight=0.5, soft_weight=0.5, t_squared=True, backend="torch")
    _same(fnn.DistillationLoss(**opts)(hidden, weight, teacher_hidden, teacher_weight, targets),
          fusedloss.distillation_loss(hidden, weight, teacher_hidden, teacher_weight, targets, **opts))


def test_grpo():
    g, hidden, weight, _, targets = _data(2)
    ids = targets.clamp(min=0)
    mask = targets >= 0
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.1 - 3.5
    ref = old + 0.05
    opts = dict(loss_type="grpo", beta=0.04, epsilon_high=0.28, return_details=True, backend="torch")
    got = fnn.GRPOLoss(**opts)(hidden, weight, ids, adv, mask, old_logprobs=old, ref_logprobs=ref)
    _same(got, fusedloss.grpo_loss(hidden, weight, ids, adv, mask, old_logprobs=old, ref_logprobs=ref, **opts))


def test_grpo_catalogue_options():
    g, hidden, weight, _, targets = _data(5)
    ids, mask = targets.clamp(min=0), targets >= 0
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.1 - 3.5
    sampling = old + 0.1
    for opts in (dict(loss_type="sapo", sapo_temperature_neg=2.0, entropy_coef=0.01),
                 dict(loss_type="vespo", vespo_k_pos=1.5, return_details=True),
                 dict(loss_type="luspo", importance_sampling_level="sequence", off_policy_mask_threshold=0.05,
                      top_entropy_quantile=0.5)):
        opts["backend"] = "torch"
        got = fnn.GRPOLoss(**opts)(hidden, weight, ids, adv, mask, old_logprobs=old, sampling_logprobs=sampling)
        _same(got, fusedloss.grpo_loss(hidden, weight, ids, adv, mask, old_logprobs=old, sampling_logprobs=sampling,
                                       **opts))


def test_dpo():
    g, hidden, weight, _, labels = _data(3, b=4)
    ref_c, ref_r = torch.randn(2, generator=g, dtype=torch.float64), torch.randn(2, generator=g, dtype=torch.float64)
    opts = dict(beta=0.2, loss_type="ipo", return_details=True, backend="torch")
    _same(fnn.DPOLoss(**opts)(hidden, weight, labels, ref_c, ref_r),
          fusedloss.dpo_loss(hidden, weight, labels, ref_c, ref_r, **opts))
    opts = dict(beta=0.2, loss_type=["sigmoid", "bco_pair"], loss_weights=[0.8, 0.2], ld_alpha=0.5,
                use_weighting=True, backend="torch")
    _same(fnn.DPOLoss(**opts)(hidden, weight, labels, ref_c, ref_r),
          fusedloss.dpo_loss(hidden, weight, labels, ref_c, ref_r, **opts))


def test_kto_orpo_cpo():
    g, hidden, weight, bias, labels = _data(4, b=4)
    pref = torch.tensor([True, False, False, True])
    ref = torch.randn(4, generator=g, dtype=torch.float64) - 15
    opts = dict(beta=0.3, desirable_weight=1.2, return_details=True, backend="torch")
    _same(fnn.KTOLoss(**opts)(hidden, weight, labels, pref, ref, kl_hidden=hidden.flip(0), kl_labels=labels,
                              ref_kl_logps=ref - 1, bias=bias),
          fusedloss.kto_loss(hidden, weight, labels, pref, ref, kl_hidden=hidden.flip(0), kl_labels=labels,
                             ref_kl_logps=ref - 1, bias=bias, **opts))
    nll = torch.where(labels >= 0, labels, torch.zeros_like(labels))
    _same(fnn.ORPOLoss(beta=0.2, backend="torch")(hidden, weight, labels, nll_labels=nll),
          fusedloss.orpo_loss(hidden, weight, labels, nll_labels=nll, beta=0.2, backend="torch"))
    opts = dict(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.7, return_details=True, backend="torch")
    _same(fnn.CPOLoss(**opts)(hidden, weight, labels), fusedloss.cpo_loss(hidden, weight, labels, **opts))


def test_bad_option_reaches_the_function_error():
    _, hidden, weight, _, targets = _data()
    with pytest.raises(ValueError, match="reduction"):
        fnn.LinearCrossEntropy(reduction="avg")(hidden, weight, targets)


def test_a_subclass_keeps_its_parent_function_and_options():
    class SummedCrossEntropy(fnn.LinearCrossEntropy):
        """A user's subclass: same function, same options."""

    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(9, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([1, 8, -100, 0])
    got = SummedCrossEntropy(reduction="sum", backend="torch")(h, w, y)
    want = fusedloss.cross_entropy(h, w, y, reduction="sum", backend="torch")
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match="SummedCrossEntropy got unexpected option"):
        SummedCrossEntropy(no_such_option=1)
