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
import verl.models.transformers.monkey_patch as verl_monkey_patch
from _frameworks_util import (
    TEMPERATURE,
    VOCAB,
    max_grad_err,
    oracle_logprobs_entropy,
    param_grads,
    rel_err,
    tiny_causal_lm,
)

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



def test_a_head_fusedloss_cannot_read_is_refused_when_verl_patches_the_model():
    import peft

    lm = peft.get_peft_model(tiny_causal_lm("untied"),
                             peft.LoraConfig(r=4, target_modules=["lm_head"], use_dora=True))
    fl_verl.enable()
    with pytest.raises(NotImplementedError, match="DoRA"):
        verl_monkey_patch.patch_forward_with_backends(lm.get_base_model(), use_fused_kernels=True,
                                                      fused_kernels_backend="torch")


def test_under_bf16_autocast_the_outputs_are_fp32():
    """verl's engine runs the forward under bf16 autocast with fp32 parameters: fusedloss returns fp32 log-probs and
    entropies, within the bf16 rounding of its inputs of the float64 oracle (measured: 6.5e-4 / 2.0e-3; verl's own
    torch path 1.8e-3 / 7.7e-3)."""
    model = tiny_causal_lm("tied")
    ids, coefficients = _batch()
    ref_logp, ref_entropy, _ = _oracle(model, ids, coefficients)
    model.float()
    fl_verl.enable()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy, grads = _verl_fused(model, ids, coefficients.float(), "torch")
    assert logp.dtype == entropy.dtype == torch.float32
    assert rel_err(logp, ref_logp) < 2e-3 and rel_err(entropy, ref_entropy) < 5e-3
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())

# ------------------------------------------------------------------------------------------ engine level
#
# verl's own code from the batch to the loss: ``left_right_2_no_padding``, the FSDP engine's
# ``prepare_model_inputs`` / ``prepare_model_outputs`` (a stand-in engine object: no FSDP, no Ray; its
# ``forward_step`` only adds autocast and the FSDP module around them), the model, and ``ppo_loss`` with an
# entropy bonus and a low_var_kl loss. The unfused path (the model's logits, verl's log_softmax and entropy) is
# the reference: the fused path through fusedloss must give its loss, log-probs and every gradient to 1e-12.

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _policy_losses():
    from verl.trainer.ppo import core_algos

    return sorted(core_algos.POLICY_LOSS_REGISTRY)


def _rl_batch(seed=0, prompt_len=5, response_len=6):
    """Four sequences: left-padded prompts, right-padded responses, as verl's rollout hands them over."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    pads = [(0, 0), (2, 1), (1, 3), (3, 2)]  # (prompt padding, response padding) per sequence
    batch = len(pads)
    prompts = torch.randint(VOCAB, (batch, prompt_len), generator=g)
    responses = torch.randint(VOCAB, (batch, response_len), generator=g)
    prompt_mask = torch.ones(batch, prompt_len, dtype=torch.long)
    response_mask = torch.ones(batch, response_len, dtype=torch.long)
    for i, (prompt_pad, response_pad) in enumerate(pads):
        prompt_mask[i, :prompt_pad] = 0
        response_mask[i, response_len - response_pad:] = 0
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return TensorDict({
        "input_ids": torch.cat([prompts, responses], 1).masked_fill(attention_mask == 0, 0),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp_min(0),
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "old_log_probs": -3 * torch.rand(batch, response_len, generator=g, dtype=torch.float64),
        "ref_log_prob": -3 * torch.rand(batch, response_len, generator=g, dtype=torch.float64),
        "advantages": torch.randn(batch, response_len, generator=g, dtype=torch.float64),
    }, batch_size=[batch])


def _engine_stand_in():
    import verl.utils.torch_functional as verl_F
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)  # what __init__ sets that these methods read
    engine.engine_config = FSDPEngineConfig(use_torch_compile=False)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    engine.pad_to_length, engine.pad_to_length_bucket, engine.use_ulysses_sp = False, 1, False
    return engine


def _engine_step(model, *, fused, loss_mode, loss_agg_mode, remove_padding=True):
    """verl's glue and ``ppo_loss``, forward and backward: (loss, log-probs, entropies, gradients)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(_rl_batch())
    tu.assign_non_tensor(data, use_remove_padding=remove_padding, use_fused_kernels=fused, calculate_entropy=True,
                         temperature=TEMPERATURE, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                             loss_agg_mode=loss_agg_mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05,
                             policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.1))
    engine = _engine_stand_in()
    cls = type(model)
    own_forward = cls.__dict__["forward"]
    if fused:
        verl_monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    try:
        model.zero_grad()
        inputs, output_args = engine.prepare_model_inputs(data)
        outputs = engine.prepare_model_outputs(model(**inputs, use_cache=False), output_args, data, None)
        torch.manual_seed(0)  # clip_cov / kl_cov pick tokens at random
        loss, _ = ppo_loss(config, outputs, data)
        loss.backward()
    finally:
        cls.forward = own_forward
    grads = param_grads(model)
    model.zero_grad()
    return loss.detach(), outputs["log_probs"].values().detach(), outputs["entropy"].values().detach(), grads


@pytest.mark.parametrize("loss_mode", _policy_losses())
def test_engine_ppo_loss_matches_verl_unfused_path(loss_mode):
    model = tiny_causal_lm("untied")
    for loss_agg_mode in AGG_MODES:
        ref = _engine_step(model, fused=False, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode)
        fl_verl.enable()
        got = _engine_step(model, fused=True, loss_mode=loss_mode, loss_agg_mode=loss_agg_mode)
        fl_verl.disable()
        for name, actual, expected in zip(("loss", "log-probs", "entropy"), got[:3], ref[:3]):
            assert rel_err(actual, expected) <= EXACT, (loss_agg_mode, name)
        assert max_grad_err(got[3], ref[3]) <= EXACT, loss_agg_mode


@pytest.mark.parametrize("head", ["tied", "softcap"])
def test_engine_without_remove_padding(head):
    """``use_remove_padding=False``: padded [batch, seq] inputs with an attention mask, fused outputs unpacked
    by verl; a soft-capped head matches verl's unfused path, which applies the soft-cap in the model's logits."""
    model = tiny_causal_lm(head)
    kwargs = dict(loss_mode="vanilla", loss_agg_mode="token-mean", remove_padding=False)
    ref = _engine_step(model, fused=False, **kwargs)
    fl_verl.enable()
    got = _engine_step(model, fused=True, **kwargs)
    # Each sequence's last position scores the token after it, which no loss reads: verl's fused forward rolls
    # each padded row there, its unfused path the packed batch, so the two differ at those positions only.
    lengths = _rl_batch()["attention_mask"].sum(-1)
    scored = torch.ones(int(lengths.sum()), dtype=torch.bool)
    scored[lengths.cumsum(0) - 1] = False
    assert rel_err(got[0], ref[0]) <= EXACT
    assert rel_err(got[1][scored], ref[1][scored]) <= EXACT
    assert rel_err(got[2], ref[2]) <= EXACT
    assert max_grad_err(got[3], ref[3]) <= EXACT


# ------------------------------------------------------------------------------------ enable / disable

SITES = (
    ("verl.utils.experimental.torch_functional", "FusedLinearForPPO"),
    ("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy"),
    ("verl.models.transformers.monkey_patch", "patch_forward_with_backends"),
    ("verl.models.mcore.model_forward_fused", "linear_cross_entropy"),
    ("verl.models.mcore.model_forward_1f1b_overlap", "linear_cross_entropy"),
)


def _site_objects():
    return {(m, a): getattr(importlib.import_module(m), a) for m, a in SITES}


def test_enable_is_idempotent_and_disable_restores_the_exact_objects():
    before = _site_objects()
    fl_verl.enable()
    fl_verl.enable(backend="torch")
    during = _site_objects()
    assert all(during[site] is not before[site] for site in SITES)
    assert during[SITES[0]] is fl_verl.FusedLinearForPPO
    assert all(during[site] is fl_verl.linear_cross_entropy for site in (SITES[1], SITES[3], SITES[4]))
    fl_verl.disable()
    after = _site_objects()
    assert all(after[site] is before[site] for site in SITES)
    with fl_verl.enabled():
        assert fl_verl.is_enabled() and _site_objects()[SITES[0]] is fl_verl.FusedLinearForPPO
    assert not fl_verl.is_enabled() and all(_site_objects()[site] is before[site] for site in SITES)


@pytest.mark.parametrize("version", ["0.8.2", "0.10.0"])
def test_versions_outside_the_tested_range_are_refused(monkeypatch, version):
    import verl

    before = _site_objects()
    monkeypatch.setattr(verl, "__version__", version)
    with pytest.raises(RuntimeError, match=f"supports verl>=0.9,<0.10, found verl {version}"):
        fl_verl.enable()
    assert _site_objects() == before and not fl_verl.is_enabled()


def test_bad_options_are_refused_by_name():
    with pytest.raises(ValueError, match="backend must be one of"):
        fl_verl.enable(backend="cuda-graph")
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        fl_verl.enable(vocab_size=0)
    with pytest.raises(ValueError, match="reduction must be"):
        fl_verl.linear_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long),
                                     0.75, "avg")


EXTERNAL_LIB = """
import importlib, sys
from verl.utils.import_utils import import_external_libs  # what HFModelConfig.__post_init__ calls
sites = {sites!r}
import_external_libs("fusedloss.integrations.verl.auto")  # before any site module is imported
import fusedloss.integrations.verl as fl_verl
objects = lambda: [getattr(importlib.import_module(m), a) for m, a in sites]
assert fl_verl.is_enabled()
assert objects()[0] is fl_verl.FusedLinearForPPO
assert all(o is fl_verl.linear_cross_entropy for o in [objects()[i] for i in (1, 3, 4)])
fl_verl.disable()
restored = objects()
from verl.utils.kernel.linear_cross_entropy import LinearCrossEntropy
# verl's own function everywhere, the Megatron modules' binding included
assert all(restored[i] == LinearCrossEntropy.apply for i in (1, 3, 4)), restored
assert restored[0].__module__ == "verl.utils.experimental.torch_functional"
print("external_lib ok")
"""


def test_external_lib_enables_in_a_fresh_process():
    run = subprocess.run([sys.executable, "-c", EXTERNAL_LIB.format(sites=SITES)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "external_lib ok" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]


def test_the_readme_config_lines():
    """The README's three verl overrides, as written: each key is in verl's own PPO trainer config, and
    ``external_lib`` names the module the fresh-process test above imports through verl's own importer."""
    import re
    from pathlib import Path

    import verl
    from omegaconf import OmegaConf

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("**verl**"):]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    overrides = dict(line.split("#")[0].strip().split("=", 1) for line in block.strip().splitlines())
    config = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    for key in overrides:
        assert OmegaConf.select(config, key, default="missing") != "missing", key
    assert overrides["actor_rollout_ref.model.use_fused_kernels"] == "True"
    assert overrides["actor_rollout_ref.model.fused_kernel_options.impl_backend"] in ("torch", "liger", "triton")
    assert overrides["actor_rollout_ref.model.external_lib"] == "fusedloss.integrations.verl.auto"
    assert 'import_external_libs("fusedloss.integrations.verl.auto")' in EXTERNAL_LIB
