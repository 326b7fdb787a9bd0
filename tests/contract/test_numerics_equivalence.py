"""Every public function against ``fusedloss.reference``, for every available backend.

float64: values and the gradients of hidden, weight and bias within 1e-10 norm-wise relative error for the
torch backend, 1e-9 for the others. float32: within 1e-5 of the float64 reference on the same values, or,
where the fp32 problem is itself ill-conditioned, within a few times the naive fp32 path's error
(_harness.compare says why).
Every option of the public API appears in at least one case; the data are peaked, with prime vocabulary
sizes, odd token counts and ignored rows (conftest.make_head).
"""

from __future__ import annotations

import pytest
import torch
from _errors import rel_err
from _harness import compare
from conftest import FP32_TOL, fp64_tol, make_head, make_teacher, peak_ids_of

import fusedloss
from fusedloss import reference

DTYPES = [torch.float64, torch.float32]


def tol_for(backend, dtype):
    return fp64_tol(backend) if dtype == torch.float64 else FP32_TOL


def dtype_id(dtype):
    return str(dtype).replace("torch.", "")


# --------------------------------------------------------------------------------------------------
# token_logprobs

TRANSFORMS = dict(temperature=0.7, logit_scale=1.3, softcap=25.0)


def token_case(name):
    """(inputs, options) for one named token-level case (token_logprobs and cross_entropy share them)."""
    if name == "basic":
        h, w, b, t = make_head(13, 24, 131, ignore_fraction=0.3)
        return dict(hidden=h, weight=w, targets=t), {}
    if name == "bias_transforms":
        h, w, b, t = make_head(11, 19, 257, bias=True, ignore_fraction=0.2, seed=5)
        return dict(hidden=h, weight=w, targets=t, bias=b), dict(TRANSFORMS)
    if name == "single_token":
        h, w, b, t = make_head(1, 19, 37, seed=7)
        return dict(hidden=h, weight=w, targets=t), {}
    if name == "leading_3d":
        h, w, b, t = make_head(0, 24, 131, leading=(3, 4), ignore_fraction=0.2, all_ignored_rows=(1,), seed=8)
        return dict(hidden=h, weight=w, targets=t, bias=b), dict(temperature=2.0)
    if name == "ignore_index":
        h, w, b, t = make_head(7, 19, 37, ignore_fraction=0.4, ignore_index=-1, seed=9)
        return dict(hidden=h, weight=w, targets=t), dict(ignore_index=-1)
    if name == "all_ignored":
        h, w, b, t = make_head(5, 19, 37, seed=10)
        return dict(hidden=h, weight=w, targets=torch.full_like(t, -100)), {}
    if name == "extreme":
        h, w, b, t = make_head(7, 24, 131, extreme=True, seed=11)
        return dict(hidden=h, weight=w, targets=t), {}
    if name == "softcap_extreme":
        h, w, b, t = make_head(7, 24, 131, extreme=True, seed=12)
        return dict(hidden=h, weight=w, targets=t), dict(softcap=30.0)
    raise KeyError(name)


TOKEN_CASES = ["basic", "bias_transforms", "single_token", "leading_3d", "ignore_index", "all_ignored",
               "extreme", "softcap_extreme"]
# Logits in the thousands are only meaningful against the float64 ground truth: an fp32 product of
# such logits already carries ~1e-3 absolute error (test_numerics_half_precision covers fp32 by the naive criterion).
FP64_ONLY = {"extreme"}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", TOKEN_CASES)
@pytest.mark.parametrize("return_entropy", [False, True])
def test_token_logprobs(backend, device, dtype, case, return_entropy):
    if case in FP64_ONLY and dtype != torch.float64:
        pytest.skip("extreme logits: float64 only (fp32 judged in test_numerics_half_precision)")
    inputs, options = token_case(case)
    options["return_entropy"] = return_entropy
    compare("token_logprobs", inputs, options, backend, dtype, device, tol_for(backend, dtype))


# --------------------------------------------------------------------------------------------------
# cross_entropy

CE_OPTIONS = [
    ("basic", dict(reduction="mean")),
    ("basic", dict(reduction="sum")),
    ("basic", dict(reduction="none")),
    ("basic", dict(label_smoothing=0.1)),
    ("basic", dict(z_loss=1e-2, reduction="sum")),
    ("basic", dict(num_items_in_batch=17)),
    ("basic", dict(num_items_in_batch=torch.tensor(17), label_smoothing=0.2, z_loss=1e-3)),
    ("bias_transforms", dict(label_smoothing=0.1, z_loss=1e-3)),
    ("single_token", dict(reduction="mean")),
    ("leading_3d", dict(reduction="none", label_smoothing=0.05)),
    ("ignore_index", dict(reduction="mean")),
    ("all_ignored", dict(reduction="mean")),
    ("all_ignored", dict(reduction="none", z_loss=1e-3)),
    ("extreme", dict(reduction="sum", z_loss=1e-4)),
    ("softcap_extreme", dict(label_smoothing=0.1)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case, extra", CE_OPTIONS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(CE_OPTIONS)])
def test_cross_entropy(backend, device, dtype, case, extra):
    if case in FP64_ONLY and dtype != torch.float64:
        pytest.skip("extreme logits: float64 only")
    inputs, options = token_case(case)
    options.update(extra)
    compare("cross_entropy", inputs, options, backend, dtype, device, tol_for(backend, dtype))


# --------------------------------------------------------------------------------------------------
# distillation_loss


def distill_case(name):
    """A student and a teacher that agree on their confident (peaked) rows. A teacher that confidently
    disagrees makes the fp32 gradient ill-conditioned (even the naive fp32 path misses 1e-5): that case
    is judged by the naive-path criterion in test_half_precision."""
    if name == "basic":
        h, w, _, t = make_head(13, 24, 131, ignore_fraction=0.3)
        ht, wt, _ = make_teacher(13, 24, 131, peak_ids=peak_ids_of(131, 0))
        return dict(hidden=h, weight=w, teacher_hidden=ht, teacher_weight=wt, targets=t)
    if name == "teacher_d_bias":  # teacher with another hidden size and a bias, student bias
        h, w, b, t = make_head(11, 19, 257, bias=True, ignore_fraction=0.2, seed=4)
        ht, wt, bt = make_teacher(11, 13, 257, bias=True, seed=6, peak_ids=peak_ids_of(257, 4))
        return dict(hidden=h, weight=w, teacher_hidden=ht, teacher_weight=wt, targets=t, bias=b, teacher_bias=bt)
    if name == "no_targets_3d":
        h, w, _, _ = make_head(0, 24, 37, leading=(2, 3), seed=13)
        ht, wt, _ = make_teacher(0, 17, 37, leading=(2, 3), seed=14, peak_ids=peak_ids_of(37, 13))
        return dict(hidden=h, weight=w, teacher_hidden=ht, teacher_weight=wt)
    if name == "single_token":
        h, w, _, t = make_head(1, 19, 37, seed=15)
        ht, wt, _ = make_teacher(1, 19, 37, seed=16, peak_ids=peak_ids_of(37, 15))
        return dict(hidden=h, weight=w, teacher_hidden=ht, teacher_weight=wt, targets=t)
    if name == "all_ignored_row_3d":
        h, w, _, t = make_head(0, 19, 131, leading=(3, 3), all_ignored_rows=(0,), seed=17)
        ht, wt, _ = make_teacher(0, 19, 131, leading=(3, 3), seed=18, peak_ids=peak_ids_of(131, 17))
        return dict(hidden=h, weight=w, teacher_hidden=ht, teacher_weight=wt, targets=t)
    raise KeyError(name)


DISTILL_OPTIONS = [
    ("basic", dict(beta=0.0)),
    ("basic", dict(beta=1.0)),
    ("basic", dict(beta=0.5)),
    ("basic", dict(beta=0.1, temperature=2.0)),
    ("basic", dict(beta=0.0, temperature=2.0, hard_weight=0.4, soft_weight=0.6, t_squared=True)),
    ("basic", dict(beta=1.0, reduction="sum", hard_weight=1.0)),
    ("basic", dict(beta=0.5, reduction="none", temperature=0.8)),
    ("basic", dict(beta=1.0, num_items_in_batch=20, hard_weight=0.5)),
    ("teacher_d_bias", dict(beta=0.0, temperature=1.5, hard_weight=0.3)),
    ("teacher_d_bias", dict(beta=1.0)),
    ("teacher_d_bias", dict(beta=0.5, reduction="sum")),
    ("no_targets_3d", dict(beta=1.0)),
    ("no_targets_3d", dict(beta=0.5, reduction="none", temperature=2.0, t_squared=True)),
    ("no_targets_3d", dict(beta=0.0, reduction="sum")),
    ("single_token", dict(beta=0.5, hard_weight=1.0)),
    ("all_ignored_row_3d", dict(beta=1.0, reduction="none")),
    ("all_ignored_row_3d", dict(beta=0.0, ignore_index=-100, hard_weight=0.2)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case, extra", DISTILL_OPTIONS,
                         ids=[f"{c}-{i}" for i, (c, _) in enumerate(DISTILL_OPTIONS)])
def test_distillation_loss(backend, device, dtype, case, extra):
    compare("distillation_loss", distill_case(case), dict(extra), backend, dtype, device, tol_for(backend, dtype))


def test_distillation_teacher_is_frozen(backend, device):
    inputs = distill_case("teacher_d_bias")
    th = inputs["teacher_hidden"].to(device).requires_grad_(True)
    tw = inputs["teacher_weight"].to(device).requires_grad_(True)
    tb = inputs["teacher_bias"].to(device).requires_grad_(True)
    h = inputs["hidden"].to(device).requires_grad_(True)
    loss = fusedloss.distillation_loss(h, inputs["weight"].to(device), th, tw, inputs["targets"].to(device),
                                       beta=0.5, bias=inputs["bias"].to(device), teacher_bias=tb, backend=backend)
    loss.backward()
    assert h.grad is not None and float(h.grad.abs().max()) > 0
    for name, t in (("teacher_hidden", th), ("teacher_weight", tw), ("teacher_bias", tb)):
        assert t.grad is None or float(t.grad.abs().max()) == 0.0, f"{name} received a gradient"


# --------------------------------------------------------------------------------------------------
# grpo_loss

B, C, D_GRPO, V_GRPO = 3, 4, 19, 131
# Ratios of the test data, kept >= 5% away from every clip boundary used below (0.8, 1.2, 1.28, 1.3, 1.5),
# so that rounding in fp32 cannot flip a branch.
RATIOS = torch.tensor([0.5, 0.7, 0.9, 1.0, 1.1, 1.37, 1.7], dtype=torch.float64)


def grpo_inputs(*, seed=20, bias=False, transforms=None, per_sequence_ratio=False, token_advantages=False,
                empty_row=True, mask_dtype=torch.bool):
    h, w, b, _ = make_head(0, D_GRPO, V_GRPO, leading=(B, C), bias=bias, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V_GRPO, (B, C), generator=g)
    ids[0, 0] = int(torch.argmax(h[0, 0] @ w.T))  # one token on its peak
    lengths = torch.tensor([C, 2, 0] if empty_row else [C, 2, 3])
    mask = torch.arange(C)[None, :] < lengths[:, None]
    # padded positions hold arbitrary ids, as a trainer's padding does
    ids = torch.where(mask, ids, torch.zeros_like(ids))
    logp = reference.token_logprobs(h, w, ids, bias=b, **(transforms or {}))
    if per_sequence_ratio:
        pick = RATIOS[torch.randint(0, len(RATIOS), (B, 1), generator=g)].expand(B, C)
    else:
        pick = RATIOS[torch.randint(0, len(RATIOS), (B, C), generator=g)]
    old = (logp - pick.log()).detach()
    old = torch.where(mask, old, torch.full_like(old, -7.0))
    ref = (logp + 0.3 * torch.randn(B, C, generator=g, dtype=torch.float64)).detach()
    if token_advantages:
        adv = torch.randn(B, C, generator=g, dtype=torch.float64)
    else:
        adv = torch.tensor([1.3, -0.4, 0.6], dtype=torch.float64)
    inputs = dict(hidden=h, weight=w, completion_ids=ids, advantages=adv, completion_mask=mask.to(mask_dtype),
                  old_logprobs=old, ref_logprobs=ref)
    if bias:
        inputs["bias"] = b
    return inputs


GRPO_CASES = [
    # (inputs kwargs, options)
    (dict(), dict(loss_type="grpo")),
    (dict(), dict(loss_type="bnpo")),
    (dict(), dict(loss_type="dr_grpo")),
    (dict(), dict(loss_type="dr_grpo", max_completion_length=9)),
    (dict(), dict(loss_type="dapo")),
    (dict(), dict(loss_type="dapo", num_items_in_batch=11, num_processes=2)),
    (dict(), dict(loss_type="dapo", num_items_in_batch=torch.tensor(7))),
    (dict(), dict(loss_type="cispo", epsilon_high=1.3)),
    (dict(), dict(loss_type="cispo")),
    (dict(), dict(loss_type="dapo", epsilon_high=0.28)),
    (dict(), dict(loss_type="grpo", epsilon_high=0.28, delta=1.5)),
    (dict(), dict(loss_type="bnpo", beta=0.04)),
    (dict(), dict(loss_type="dapo", beta=0.1, epsilon_low=0.2, epsilon_high=0.28)),
    (dict(), dict(loss_type="dapo", old_logprobs=None)),
    (dict(), dict(loss_type="grpo", old_logprobs=None, beta=0.05)),
    (dict(), dict(loss_type="cispo", old_logprobs=None, epsilon_high=5.0)),
    (dict(per_sequence_ratio=True), dict(loss_type="grpo", importance_sampling_level="sequence")),
    (dict(per_sequence_ratio=True), dict(loss_type="dapo", importance_sampling_level="sequence", beta=0.02)),
    (dict(per_sequence_ratio=True), dict(loss_type="cispo", importance_sampling_level="sequence",
                                         epsilon_high=1.3)),
    (dict(token_advantages=True), dict(loss_type="dapo")),
    (dict(token_advantages=True, per_sequence_ratio=True),
     dict(loss_type="bnpo", importance_sampling_level="sequence")),
    (dict(), dict(loss_type="dapo", importance_weights="token")),
    (dict(), dict(loss_type="grpo", importance_weights="sequence", beta=0.04)),
    (dict(bias=True, transforms=TRANSFORMS), dict(loss_type="dapo", **TRANSFORMS)),
    (dict(bias=True, transforms=TRANSFORMS, mask_dtype=torch.int64), dict(loss_type="grpo", beta=0.04, **TRANSFORMS)),
    (dict(empty_row=False, mask_dtype=torch.float32), dict(loss_type="bnpo")),
]


def _grpo_ids():
    out = []
    for i, (_kw, opt) in enumerate(GRPO_CASES):
        tag = "-".join(f"{k}={v}" for k, v in opt.items() if k in ("loss_type", "importance_sampling_level"))
        out.append(f"{i}-{tag}")
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kw, opt", GRPO_CASES, ids=_grpo_ids())
def test_grpo_loss(backend, device, dtype, kw, opt):
    inputs = grpo_inputs(**kw)
    opt = dict(opt)
    if "old_logprobs" in opt:
        inputs.pop("old_logprobs")
        opt.pop("old_logprobs")
    if not opt.get("beta"):
        inputs.pop("ref_logprobs")
    iw = opt.pop("importance_weights", None)
    g = torch.Generator().manual_seed(99)
    if iw == "token":
        inputs["importance_weights"] = torch.rand(B, C, generator=g, dtype=torch.float64) + 0.5
    elif iw == "sequence":
        inputs["importance_weights"] = torch.rand(B, generator=g, dtype=torch.float64) + 0.5
    opt["return_details"] = True
    compare("grpo_loss", inputs, opt, backend, dtype, device, tol_for(backend, dtype))


def test_grpo_loss_without_details_is_the_same_loss(backend, device):
    inputs = grpo_inputs(bias=True)
    inputs.pop("ref_logprobs")
    compare("grpo_loss", inputs, dict(loss_type="grpo"), backend, torch.float64, device, fp64_tol(backend))


# --------------------------------------------------------------------------------------------------
# dpo_loss

NPAIRS, T_DPO = 3, 4


def dpo_inputs(*, seed=30, bias=False, vocab=131, d=19):
    h, w, b, labels = make_head(0, d, vocab, leading=(2 * NPAIRS, T_DPO), bias=bias, seed=seed)
    # prompt positions are ignored: first position of every row, first two of the rejected pair 1
    labels[:, 0] = -100
    labels[NPAIRS + 1, :2] = -100
    seq = reference.token_logprobs(h, w, labels, bias=b).sum(-1)
    g = torch.Generator().manual_seed(seed + 1)
    # implicit rewards of both signs: Delta spans hinge's active and inactive regions at beta = 0.5
    gains_c = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
    gains_r = torch.tensor([-1.0, -4.0, 1.5], dtype=torch.float64)
    ref_c = (seq[:NPAIRS] - gains_c + 0.01 * torch.randn(NPAIRS, generator=g, dtype=torch.float64)).detach()
    ref_r = (seq[NPAIRS:] - gains_r).detach()
    inputs = dict(hidden=h, weight=w, labels=labels, ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)
    if bias:
        inputs["bias"] = b
    return inputs


DPO_CASES = [
    (dict(), dict(loss_type="sigmoid")),
    (dict(), dict(loss_type="sigmoid", label_smoothing=0.1, beta=0.5)),
    (dict(), dict(loss_type="ipo", beta=0.5)),
    (dict(), dict(loss_type="hinge", beta=0.5)),
    (dict(), dict(loss_type="robust", label_smoothing=0.2, beta=0.3)),
    (dict(bias=True, vocab=257, d=24), dict(loss_type="sigmoid", beta=0.2, **TRANSFORMS)),
    (dict(bias=True), dict(loss_type="ipo", beta=0.1, temperature=1.5)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kw, opt", DPO_CASES, ids=[f"{i}-{o['loss_type']}" for i, (_, o) in enumerate(DPO_CASES)])
def test_dpo_loss(backend, device, dtype, kw, opt):
    opt = dict(opt, return_details=True)
    compare("dpo_loss", dpo_inputs(**kw), opt, backend, dtype, device, tol_for(backend, dtype))


def test_dpo_loss_custom_ignore_index(backend, device):
    inputs = dpo_inputs(seed=31)
    inputs["labels"] = torch.where(inputs["labels"] == -100, torch.full_like(inputs["labels"], -7), inputs["labels"])
    compare("dpo_loss", inputs, dict(ignore_index=-7, beta=0.3), backend, torch.float64, device, fp64_tol(backend))


# --------------------------------------------------------------------------------------------------
# group_advantages (no backend: plain tensor math)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=dtype_id)
def test_group_advantages(scale, unbiased, drop, dtype):
    g = torch.Generator().manual_seed(40)
    binary = (torch.rand(5, 6, generator=g) < 0.5).to(dtype)
    binary[1] = 1.0  # silent: all correct
    binary[3] = 0.0  # silent: all wrong
    cont = torch.randn(2, 6, generator=g, dtype=torch.float64).to(dtype)
    cont[1] = 0.3  # silent, with a value whose mean is not exact in binary floating point
    rewards = torch.cat([binary, cont]).reshape(-1)
    for eps in (1e-4, 0.0):
        got = fusedloss.group_advantages(rewards, 6, scale=scale, drop_silent_groups=drop, eps=eps, unbiased=unbiased)
        want = reference.group_advantages(rewards, 6, scale=scale, drop_silent_groups=drop, eps=eps,
                                          unbiased=unbiased)
        assert type(got).__name__ == "GroupAdvantages"
        assert got.advantages.shape == (42,) and got.std.shape == (7,) and got.keep.shape == (42,)
        assert got.keep.dtype == torch.bool
        assert torch.equal(got.keep, want.keep)
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        assert rel_err(got.advantages, want.advantages) <= tol
        assert rel_err(got.std, want.std) <= tol
        silent = torch.tensor([False, True, False, True, False, False, True]).repeat_interleave(6)
        assert bool((got.advantages[silent] == 0).all()), "a silent group must get advantage exactly 0"
        assert bool(torch.isfinite(got.advantages).all())
