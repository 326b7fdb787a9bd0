"""Edge inputs of the post-training losses whose answers are known: an empty batch or empty completions in
GRPO (0, with zero gradients, as TRL and the reference give), DPO's sigmoid at an infinite margin (TRL's 0,
not NaN), KTO's ``kl`` given as a tensor (validated like the number form), and the reference's clip metric
with one-token completions (TRL's plain mean over the advantages as given). Every backend whose kernel math
runs here: torch, Triton (its interpreter without a GPU), CUDA (its host twins on CPU tensors)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _trl_oracle import trl_dpo, trl_grpo  # noqa: E402

import fusedloss  # noqa: E402
from fusedloss import reference  # noqa: E402
from fusedloss.losses.grpo import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES  # noqa: E402

F64 = torch.float64


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("b, c", [(0, 3), (2, 0), (0, 0)], ids=["B=0", "C=0", "B=C=0"])
def test_grpo_without_tokens_is_zero_with_zero_gradients(any_engine, b, c, level):
    """No scored token (an empty batch, empty completions, both), every loss type, with and without the
    top-entropy mask: the loss is 0 as the reference's, and hidden and weight get zero gradients."""
    backend, device = any_engine
    for loss_type in LOSS_TYPES:
        for quantile in (1.0, 0.5):
            hidden = torch.zeros(b, c, 4, dtype=F64, device=device, requires_grad=True)
            weight = torch.randn(7, 4, dtype=F64, generator=torch.Generator().manual_seed(1)).to(device)
            weight.requires_grad_()
            ids, mask = torch.zeros(b, c, dtype=torch.long, device=device), torch.ones(b, c, device=device)
            advantages = torch.zeros(b, dtype=F64, device=device)
            options = dict(loss_type=loss_type, importance_sampling_level=level, top_entropy_quantile=quantile,
                           beta=0.04, ref_logprobs=torch.zeros(b, c, dtype=F64, device=device))
            label = f"{loss_type} quantile={quantile}"
            loss = fusedloss.grpo_loss(hidden, weight, ids, advantages, mask, backend=backend, **options)
            loss.backward()
            expected = reference.grpo_loss(hidden.detach().cpu(), weight.detach().cpu(), ids.cpu(),
                                           advantages.cpu(), mask.cpu(),
                                           **{**options, "ref_logprobs": options["ref_logprobs"].cpu()})
            assert loss.item() == 0.0 and expected.item() == 0.0, label
            assert hidden.grad.shape == (b, c, 4), label
            assert torch.equal(weight.grad, torch.zeros_like(weight)), label


def test_grpo_top_entropy_mask_on_empty_completions_equals_trl():
    """TRL keeps no token when none is valid (its entropy mask is all False): the loss is 0 there too."""
    hidden, weight = torch.zeros(2, 0, 4, dtype=F64), torch.randn(7, 4, dtype=F64)
    args = (torch.zeros(2, 0, dtype=torch.long), torch.tensor([0.5, -0.5], dtype=F64), torch.ones(2, 0))
    trl_loss, _, _ = trl_grpo(hidden, weight, *args, top_entropy_quantile=0.5)
    assert trl_loss.item() == 0.0
    assert fusedloss.grpo_loss(hidden, weight, *args, top_entropy_quantile=0.5).item() == 0.0


def _infinite_margin_batch():
    """A DPO pair whose rejected completion holds a token the policy cannot emit (a -inf bias entry): the
    rejected log-prob is -inf, the margin +inf."""
    torch.manual_seed(0)
    length, dim, vocab = 4, 3, 6
    full = torch.randn(2, length, dim, dtype=F64)
    weight = torch.randn(vocab, dim, dtype=F64)
    bias = torch.zeros(vocab, dtype=F64)
    bias[5] = -math.inf
    ids = torch.randint(0, 5, (2, length))
    ids[1, 2] = 5
    completion_mask = torch.ones_like(ids)
    completion_mask[:, 0] = 0
    labels = torch.where(completion_mask[:, 1:] != 0, ids[:, 1:], -100)
    refs = torch.tensor([-3.0], dtype=F64), torch.tensor([-4.0], dtype=F64)
    return full, weight, bias, ids, completion_mask, labels, refs


def test_dpo_sigmoid_at_an_infinite_margin_equals_trl(any_engine):
    """TRL's sigmoid loss is ``-log sig(beta Delta)``: 0 at Delta = +inf, with a finite gradient."""
    backend, device = any_engine
    full, weight, bias, ids, completion_mask, labels, refs = _infinite_margin_batch()
    trl_loss, _ = trl_dpo(full, weight, completion_mask, ids, *refs, bias=bias)
    assert trl_loss.item() == 0.0
    hidden = full[:, :-1].clone().to(device).requires_grad_()
    w = weight.clone().to(device).requires_grad_()
    loss = fusedloss.dpo_loss(hidden, w, labels.to(device), *(r.to(device) for r in refs), bias=bias.to(device),
                              backend=backend)
    loss.backward()
    assert loss.item() == trl_loss.item()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(w.grad).all()
    assert reference.dpo_loss(full[:, :-1], weight, labels, *refs, bias=bias).item() == trl_loss.item()


def test_dpo_sigmoid_with_smoothing_keeps_the_cdpo_form():
    """With label smoothing the conservative form stays: +inf for an infinite margin of the wrong sign."""
    full, weight, bias, _, _, labels, refs = _infinite_margin_batch()
    swapped = labels.flip(0), refs[1], refs[0]  # the unreachable completion is now the chosen one
    assert fusedloss.dpo_loss(full[:, :-1].flip(0), weight, *swapped, bias=bias, label_smoothing=0.1).item() \
        == math.inf


def _kto_call(kl, loss_type="kto", backend="torch", device="cpu"):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 3, 5, dtype=F64, generator=g).to(device)
    weight = torch.randn(11, 5, dtype=F64, generator=g).to(device)
    labels = torch.randint(0, 11, (4, 3), generator=g).to(device)
    return fusedloss.kto_loss(hidden, weight, labels, torch.tensor([1, 0, 1, 0], device=device),
                              torch.zeros(4, dtype=F64, device=device), kl=kl, loss_type=loss_type, backend=backend)


@pytest.mark.parametrize("kl, error, match", [
    (torch.tensor([0.1, 0.2]), ValueError, r"kl must be a number or a 0-d tensor, got a tensor of shape \(2,\)"),
    (torch.zeros(0), ValueError, r"kl must be a number or a 0-d tensor"),
    (torch.tensor(0.3 + 1j), TypeError, r"kl must be a real .*complex"),
    (torch.tensor(True), TypeError, r"kl must be a real .*bool"),
    (torch.tensor(math.nan), ValueError, r"kl must be finite"),
    (torch.tensor(-math.inf), ValueError, r"kl must be finite"),
], ids=["two-values", "empty", "complex", "bool", "nan", "inf"])
def test_kto_kl_tensor_is_validated(kl, error, match):
    with pytest.raises(error, match=match):
        _kto_call(kl)


def test_kto_kl_tensor_equals_the_number(any_engine):
    """A valid 0-d (or one-element) tensor is the number it holds, on every backend; where the loss does not
    use it (``apo_zero_unpaired``) its value is not read."""
    backend, device = any_engine
    expected = _kto_call(0.3, backend=backend, device=device)
    for kl in (torch.tensor(0.3, dtype=F64), torch.tensor([0.3], dtype=F64), torch.tensor(0.3, dtype=F64).to(device)):
        assert _kto_call(kl, backend=backend, device=device).item() == expected.item()
    unpaired = _kto_call(None, "apo_zero_unpaired", backend=backend, device=device)
    assert _kto_call(torch.tensor(math.nan), "apo_zero_unpaired", backend=backend, device=device).item() \
        == unpaired.item()


@pytest.mark.parametrize("loss_type", ["cispo", "grpo"])
def test_reference_clip_metrics_at_one_token_equal_trl(loss_type):
    """With one-token completions and per-token advantages [B, 1], TRL's clip metrics are a plain mean over
    the B advantages as given, masked entries included; the reference and grpo_loss log the same."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 1, 4, dtype=F64), torch.randn(5, 4, dtype=F64)
    ids = torch.randint(0, 5, (3, 1))
    advantages = torch.tensor([[0.193], [0.995], [0.686]], dtype=F64)
    mask = torch.tensor([[1], [1], [0]])
    old = torch.tensor([[-12.0], [-13.0], [0.0]], dtype=F64)
    _, trl_metrics, _ = trl_grpo(hidden, weight, ids, advantages, mask, old_logprobs=old, loss_type=loss_type)
    _, fused = fusedloss.grpo_loss(hidden, weight, ids, advantages, mask, old_logprobs=old, loss_type=loss_type,
                                   return_details=True)
    _, ref = reference.grpo_loss(hidden, weight, ids, advantages, mask, old_logprobs=old, loss_type=loss_type,
                                 return_details=True)
    key = "cispo_clip_ratio" if loss_type == "cispo" else "clip_ratio/high_mean"
    assert trl_metrics[key] == pytest.approx(2 / 3 if loss_type == "grpo" else 1.0)
    assert ref.clip_ratio_high.item() == pytest.approx(trl_metrics[key], abs=1e-12)
    assert fused.clip_ratio_high.item() == pytest.approx(trl_metrics[key], abs=1e-12)
