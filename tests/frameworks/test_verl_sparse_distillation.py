"""``sparse_distillation_loss`` against verl 0.9's top-k forward-KL distillation (``loss_mode="forward_kl_topk"``).

The oracle is verl's own code in float64: ``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk`` (the
logits processor's per-token KL on the teacher's top-k, with ``log_prob_min_clamp``) on materialised logits in
verl's packed layout, then ``verl.trainer.distillation.losses.distillation_loss`` (the clamp at 0,
``loss_max_clamp`` and the ``token-mean`` aggregation over the response mask), with a stand-in actor config.
Gradients of hidden, weight and bias come from autograd through verl's code.
"""

from __future__ import annotations

import types

import pytest
import torch
from _main_suite import make_head, rel_err
from _trl_oracle import float64_default, head_logits

import fusedloss

verl_losses = pytest.importorskip("verl.trainer.distillation.losses")
fsdp_losses = pytest.importorskip("verl.trainer.distillation.fsdp.losses")
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import DistillationConfig, DistillationLossConfig  # noqa: E402

B, T, D, V, K = 3, 5, 19, 131, 6
PROMPT = 2  # prompt tokens per sequence in verl's packed layout


def served_teacher(seed=3):
    """A teacher's top-K ids and log-probs per response position (sorted, distinct, finite) and a response mask
    with a fully masked sequence."""
    g = torch.Generator().manual_seed(seed)
    teacher_logq = torch.log_softmax(3.0 * torch.randn(B, T, V, generator=g, dtype=torch.float64), dim=-1)
    top_lp, top_ids = teacher_logq.topk(K, dim=-1)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2] = False
    return top_ids, top_lp, mask


def packed(per_response: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``[B, T, ...]`` response-position values in verl's packed layout ``[B * (PROMPT + T), ...]``: the model
    output at position t predicts token t + 1, so the response's predictions sit at PROMPT - 1 .. PROMPT + T - 2."""
    out = torch.full((B, PROMPT + T, *per_response.shape[2:]), fill, dtype=per_response.dtype)
    out[:, PROMPT - 1:PROMPT + T - 1] = per_response
    return out.reshape(B * (PROMPT + T), *per_response.shape[2:])


def verl_loss(hidden, weight, bias, top_ids, top_lp, mask, *, log_prob_min_clamp, loss_max_clamp, transforms):
    z = head_logits(hidden, weight, bias, **transforms)
    student_logits = packed(z).unsqueeze(0)  # [1, total_nnz, V]; prompt rows are zero logits, never read
    nested = [torch.nested.as_nested_tensor(list(packed(x, fill).reshape(B, PROMPT + T, K)), layout=torch.jagged)
              for x, fill in ((top_lp, -1.0), (top_ids, 0))]
    loss_config = DistillationLossConfig(loss_mode="forward_kl_topk", topk=K, log_prob_min_clamp=log_prob_min_clamp,
                                         loss_max_clamp=loss_max_clamp, use_policy_gradient=False)
    config = DistillationConfig(distillation_loss=loss_config)
    actor = types.SimpleNamespace(loss_agg_mode="token-mean", global_batch_info={}, loss_scale_factor=None)
    data = tu.get_tensordict({
        "prompts": torch.ones(B, PROMPT, dtype=torch.long), "responses": torch.ones(B, T, dtype=torch.long),
        "attention_mask": torch.ones(B, PROMPT + T, dtype=torch.long), "response_mask": mask.long(),
    }, non_tensor_dict=dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B))
    with float64_default():
        out = fsdp_losses.compute_forward_kl_topk(student_logits=student_logits, teacher_topk_log_probs=nested[0],
                                                  teacher_topk_ids=nested[1], config=config, data_format="thd")
        model_output = {name: value.squeeze(0) for name, value in out.items()}
        loss, _ = verl_losses.distillation_loss(actor, config, model_output, data)
    return loss


@pytest.mark.parametrize("log_prob_min_clamp,loss_max_clamp", [(-10.0, 10.0), (None, None), (-4.0, 1.5)])
@pytest.mark.parametrize("transforms", [{}, dict(temperature=0.8, logit_scale=1.2, softcap=20.0)])
def test_matches_verl_forward_kl_topk(log_prob_min_clamp, loss_max_clamp, transforms):
    top_ids, top_lp, mask = served_teacher()
    h, w, b, _ = make_head(0, D, V, leading=(B, T), bias=True, seed=11)
    h, w, b = (t.requires_grad_() for t in (h, w, b))
    want = verl_loss(h, w, b, top_ids, top_lp, mask, log_prob_min_clamp=log_prob_min_clamp,
                     loss_max_clamp=loss_max_clamp, transforms=transforms)
    targets = torch.where(mask, 0, -100)  # only the mask matters with beta == 0
    got = fusedloss.sparse_distillation_loss(h, w, top_ids, top_lp, targets, beta=0.0, loss_add_tail=False,
                                             renormalize=False, log_prob_min_clamp=log_prob_min_clamp,
                                             loss_max_clamp=loss_max_clamp, bias=b, backend="torch", **transforms)
    assert want.item() > 0
    assert rel_err(got, want) <= 1e-12, (got.item(), want.item())
    for name, g, r in zip("hwb", torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(want, (h, w, b))):
        assert r.norm() > 0 and rel_err(g, r) <= 1e-12, (name, rel_err(g, r))
    ref = fusedloss.reference.sparse_distillation_loss(
        h, w, top_ids, top_lp, targets, beta=0.0, loss_add_tail=False, renormalize=False,
        log_prob_min_clamp=log_prob_min_clamp, loss_max_clamp=loss_max_clamp, bias=b, **transforms)
    assert rel_err(ref, want) <= 1e-12
