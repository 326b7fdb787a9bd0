"""Reduced precision, judged the way docs/design.md ("Numerical doctrine") says: for every output and gradient,
the error of the fused path against the float64 reference is no larger than the error of the naive reference run in the
same dtype (logits rounded to that dtype before an fp32 softmax), plus a small slack
(``_harness.HALF_SLACK``: about one rounding of the output dtype).

This is what catches bf16 accumulation of d weight across tiles and logits rounded to half before the
softmax. fp16 runs for every backend; bf16 for the torch backend on the CPU (the Triton interpreter has no
bf16 dot product), and for every backend on a GPU. The same criterion (with a factor, see
``_harness.NAIVE_FACTOR``) judges fp32 on the inputs where fp32 is ill-conditioned: extreme logits and a
teacher that confidently disagrees with the student.
"""

from __future__ import annotations

import pytest
import torch
from _harness import compare
from conftest import FP32_TOL, make_head, make_teacher, peak_ids_of
from test_numerics_equivalence import dpo_inputs, grpo_inputs, token_case

HALF = [torch.float16, torch.bfloat16]


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


@pytest.fixture(params=HALF, ids=_dtype_id)
def half(request, backend):
    dtype = request.param
    if dtype == torch.bfloat16 and backend != "torch":
        request.node.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            pytest.skip("bf16 dot products need a GPU (the Triton interpreter cannot do them)")
    return dtype


@pytest.mark.parametrize("case", ["basic", "bias_transforms", "leading_3d", "extreme", "softcap_extreme"])
def test_token_logprobs_half(backend, device, half, case):
    inputs, options = token_case(case)
    compare("token_logprobs", inputs, dict(options, return_entropy=True), backend, half, device)


@pytest.mark.parametrize("case, extra", [("basic", dict(label_smoothing=0.1, z_loss=1e-3)),
                                         ("bias_transforms", dict(reduction="sum")),
                                         ("extreme", dict(reduction="none"))])
def test_cross_entropy_half(backend, device, half, case, extra):
    inputs, options = token_case(case)
    compare("cross_entropy", inputs, dict(options, **extra), backend, half, device)


def distill_inputs(agree: bool, seed=50):
    h, w, b, t = make_head(13, 24, 131, bias=True, ignore_fraction=0.2, seed=seed)
    ht, wt, bt = make_teacher(13, 17, 131, bias=True, seed=seed + 1,
                              peak_ids=peak_ids_of(131, seed) if agree else None)
    return dict(hidden=h, weight=w, teacher_hidden=ht, teacher_weight=wt, targets=t, bias=b, teacher_bias=bt)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("agree", [True, False], ids=["teacher-agrees", "teacher-disagrees"])
def test_distillation_half(backend, device, half, beta, agree):
    compare("distillation_loss", distill_inputs(agree), dict(beta=beta, temperature=1.5, hard_weight=0.2),
            backend, half, device)


@pytest.mark.parametrize("opt", [dict(loss_type="dapo"), dict(loss_type="grpo", beta=0.04),
                                 dict(loss_type="cispo", epsilon_high=1.3),
                                 dict(loss_type="bnpo", importance_sampling_level="sequence")],
                         ids=lambda o: o["loss_type"])
def test_grpo_half(backend, device, half, opt):
    inputs = grpo_inputs(bias=True, per_sequence_ratio=opt.get("importance_sampling_level") == "sequence")
    if not opt.get("beta"):
        inputs.pop("ref_logprobs")
    compare("grpo_loss", inputs, dict(opt, return_details=True), backend, half, device)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_half(backend, device, half, loss_type):
    compare("dpo_loss", dpo_inputs(bias=True), dict(loss_type=loss_type, beta=0.3, return_details=True),
            backend, half, device)


# --------------------------------------------------------------------------------------------------
# fp32 where fp32 itself is ill-conditioned: no worse than a few times the naive fp32 path


@pytest.mark.parametrize("case", ["extreme", "softcap_extreme"])
def test_token_logprobs_fp32_extreme(backend, device, case):
    inputs, options = token_case(case)
    compare("token_logprobs", inputs, dict(options, return_entropy=True), backend, torch.float32, device,
            FP32_TOL)
    compare("cross_entropy", inputs, dict(options, label_smoothing=0.1), backend, torch.float32, device,
            FP32_TOL)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_distillation_fp32_disagreeing_teacher(backend, device, beta):
    compare("distillation_loss", distill_inputs(False), dict(beta=beta, temperature=1.5, hard_weight=0.2),
            backend, torch.float32, device, FP32_TOL)
