"""fusedloss.integrations.verl against a float64 materialised-logits oracle and against verl's own paths.

Head level: verl's fused forward (``patch_forward_with_backends``, every ``impl_backend``) on untied, tied and
soft-capped heads, log-probs, entropies and every parameter gradient of ``sum(c1 * logp + c2 * entropy)``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import transformers
from _frameworks_util import (
    TEMPERATURE,
    VOCAB,
    max_grad_err,
    oracle_logprobs_entropy,
    param_grads,
    rel_err,
    tiny_causal_lm,
)

import verl.models.transformers.monkey_patch as verl_monkey_patch
from fusedloss.integrations import verl as fl_verl

EXACT = 1e-12
PATCHED_CLASSES = (transformers.Qwen2ForCausalLM, transformers.Gemma2ForCausalLM)


@pytest.fixture(autouse=True)
def restore_verl():
    """verl's patch replaces the class's forward for every instance; put it back, and disable fusedloss."""
    saved = {cls: cls.__dict__["forward"] for cls in PATCHED_CLASSES}
    yield
    fl_verl.disable()
    for cls, forward in saved.items():
        cls.forward = forward


def _batch(seed=1, batch=3, length=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (batch, length), generator=g)
    coefficients = torch.randn(2, batch, length, generator=g, dtype=torch.float64)
    return ids, coefficients


def _oracle(model, ids, coefficients):
    """Log-probs, entropies and gradients of the model's own logits (its soft-cap included), in float64."""
    model.zero_grad()
    logp, entropy = oracle_logprobs_entropy(model(input_ids=ids).logits, torch.roll(ids, -1, -1), TEMPERATURE)
    (coefficients[0] * logp + coefficients[1] * entropy).sum().backward()
    grads = param_grads(model)
    model.zero_grad()
    return logp.detach(), entropy.detach(), grads


def _verl_fused(model, ids, coefficients, kernel):
    """verl's own fused forward, as its FSDP engine calls it, and the same loss; the model's own forward is put
    back afterwards (verl replaces it on the class)."""
    cls = type(model)
    own_forward = cls.__dict__["forward"]
    verl_monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=kernel)
    model.zero_grad()
    try:
        out = model(input_ids=ids, temperature=TEMPERATURE, return_dict=True)
    finally:
        cls.forward = own_forward
    logp, entropy = out.log_probs.reshape(ids.shape), out.entropy.reshape(ids.shape)
    (coefficients[0] * logp + coefficients[1] * entropy).sum().backward()
    grads = param_grads(model)
    model.zero_grad()
    return logp, entropy, grads


@pytest.mark.parametrize("kernel", ["torch", "liger", "triton"])
@pytest.mark.parametrize("head", ["untied", "tied", "softcap"])
def test_fused_forward_matches_float64_oracle(head, kernel):
    model = tiny_causal_lm(head)
    ids, coefficients = _batch()
    ref_logp, ref_entropy, ref_grads = _oracle(model, ids, coefficients)
    fl_verl.enable()
    logp, entropy, grads = _verl_fused(model, ids, coefficients, kernel)
    assert logp.dtype == entropy.dtype == torch.float64  # float64 stays float64
    assert rel_err(logp, ref_logp) <= EXACT
    assert rel_err(entropy, ref_entropy) <= EXACT
    assert max_grad_err(grads, ref_grads) <= EXACT


def test_verl_own_torch_path_is_float32_limited_and_misses_the_softcap():
    """What the swap fixes: verl's torch kernel rounds through float32 even for float64 inputs, and scores a
    soft-capped head without its soft-cap."""
    ids, coefficients = _batch()
    for head in ("untied", "tied"):
        model = tiny_causal_lm(head)
        ref_logp, ref_entropy, ref_grads = _oracle(model, ids, coefficients)
        logp, entropy, grads = _verl_fused(model, ids, coefficients, "torch")
        assert logp.dtype == torch.float32
        assert 1e-12 < rel_err(logp, ref_logp) < 1e-5
        assert 1e-12 < max_grad_err(grads, ref_grads) < 1e-3
    model = tiny_causal_lm("softcap")
    ref_logp, _, _ = _oracle(model, ids, coefficients)
    logp, _, _ = _verl_fused(model, ids, coefficients, "torch")
    assert (logp.double() - ref_logp).abs().max() > 1.0  # nats


def test_lora_on_the_head_is_folded_in():
    """verl hands the kernel ``lm_head.weight``, the base weight under a LoRA; fusedloss reads the adapted head."""
    import peft

    lm = peft.get_peft_model(tiny_causal_lm("untied"),
                             peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    model = lm.get_base_model()
    ids, coefficients = _batch()
    ref_logp, ref_entropy, ref_grads = _oracle(model, ids, coefficients)
    fl_verl.enable()
    logp, entropy, grads = _verl_fused(model, ids, coefficients, "torch")
    assert rel_err(logp, ref_logp) <= EXACT
    assert rel_err(entropy, ref_entropy) <= EXACT
    assert max_grad_err(grads, ref_grads) <= EXACT
