"""fusedloss.integrations.openrlhf: ``Actor.forward``'s action log-probs, entropies and gradients against a
float64 materialised-logits oracle (1e-12) and against OpenRLHF's own method (which rounds its logits to fp32,
so to fp32 precision), with and without sample packing, for untied, tied and soft-capped heads."""

from __future__ import annotations

import pytest
import torch
from _frameworks_util import (
    TEMPERATURE,
    VOCAB,
    max_grad_err,
    oracle_logprobs_entropy,
    param_grads,
    rel_err,
    tiny_causal_lm,
)
from openrlhf.models.actor import Actor

from fusedloss.integrations import openrlhf as fl_openrlhf

EXACT = 1e-12


@pytest.fixture(autouse=True)
def restore_openrlhf():
    yield
    fl_openrlhf.disable()


def _rollout(seed=0, prompt_len=5, response_len=6):
    """Left-padded prompts and right-padded responses, as OpenRLHF's experience maker pads them."""
    g = torch.Generator().manual_seed(seed)
    pads = [(0, 0), (2, 1), (1, 3)]
    sequences = torch.randint(VOCAB, (len(pads), prompt_len + response_len), generator=g)
    attention_mask = torch.ones_like(sequences)
    for i, (prompt_pad, response_pad) in enumerate(pads):
        attention_mask[i, :prompt_pad] = 0
        attention_mask[i, prompt_len + response_len - response_pad:] = 0
    sequences = sequences.masked_fill(attention_mask == 0, 0)
    action_mask = attention_mask[:, prompt_len:].clone()
    coefficients = torch.randn(2, len(pads), response_len, generator=g, dtype=torch.float64)
    return sequences, attention_mask, action_mask, coefficients


def _actor(model, packing):
    model.config.use_cache = False  # as Actor's path-loading branch sets it (with a cache, packed sequences
    actor = Actor(model, temperature=TEMPERATURE)  # would attend across their boundaries on a CPU)
    actor.packing_samples = packing  # only that branch sets it
    return actor


def _step(actor, sequences, attention_mask, action_mask, coefficients):
    """Action log-probs and entropies as the PPO actor asks for them, and the gradients of a loss on both."""
    actor.zero_grad()
    logp, output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True,
                         return_entropy=True)
    entropy = output.entropy[:, -action_mask.shape[1]:] * action_mask
    (coefficients[0] * logp + coefficients[1] * entropy).sum().backward()
    grads = param_grads(actor)
    actor.zero_grad()
    return logp.detach(), entropy.detach(), grads


def _oracle(actor, sequences, attention_mask, action_mask, coefficients):
    """The model's own float64 logits, log_softmax at the actor's temperature; with packing the model sees the
    same packed row as the actor (Gemma 2's float32 RMSNorm makes the layout show in the gradients)."""
    actor.zero_grad()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    if actor.packing_samples:
        kept = attention_mask.flatten().nonzero().squeeze(-1)
        packed = actor.model(sequences.flatten()[kept][None], position_ids=position_ids.flatten()[kept][None]).logits
        logits = packed.new_zeros(sequences.numel(), packed.shape[-1]).index_copy(0, kept, packed[0])
        logits = logits.view(*sequences.shape, -1)
    else:
        logits = actor.model(sequences, attention_mask=attention_mask, position_ids=position_ids).logits
    logp, entropy = oracle_logprobs_entropy(logits[:, :-1], sequences[:, 1:], TEMPERATURE)
    actions = action_mask.shape[1]
    logp, entropy = logp[:, -actions:] * action_mask, entropy[:, -actions:] * action_mask
    (coefficients[0] * logp + coefficients[1] * entropy).sum().backward()
    grads = param_grads(actor)
    actor.zero_grad()
    return logp.detach(), entropy.detach(), grads


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("head", ["untied", "tied", "softcap"])
def test_actor_forward_matches_float64_oracle_and_openrlhf(head, packing):
    actor = _actor(tiny_causal_lm(head), packing)
    batch = _rollout()
    ref = _oracle(actor, *batch)
    own = _step(actor, *batch)  # OpenRLHF's method: fp32 logits
    fl_openrlhf.enable()
    got = _step(actor, *batch)
    assert got[0].dtype == torch.float64
    for actual, expected in zip(got[:2], ref[:2]):
        assert rel_err(actual, expected) <= EXACT
    assert max_grad_err(got[2], ref[2]) <= EXACT
    # OpenRLHF's own method agrees with the oracle to its fp32 logits' precision (the soft-cap is in the model's
    # logits, so nothing is missed); its entropy loses more on peaked rows (logsumexp - sum p z cancels)
    assert rel_err(own[0], ref[0]) <= 1e-6
    assert rel_err(own[1], ref[1]) <= 1e-4
    assert max_grad_err(own[2], ref[2]) <= 1e-4


def test_return_logprobs_and_logits_calls():
    """``return_logprobs`` (SFT, DPO) gives all ``[B, T-1]`` log-probs; a call without log-probs still gets the
    logits from OpenRLHF's own method."""
    actor = _actor(tiny_causal_lm("untied"), False)
    sequences, attention_mask, _, _ = _rollout()
    with torch.no_grad():
        own = actor(sequences, attention_mask=attention_mask, return_logprobs=True)
        fl_openrlhf.enable()
        got, output = actor(sequences, attention_mask=attention_mask, return_logprobs=True, return_output=True)
        assert output.logits is None
        assert got.shape == own.shape == (sequences.shape[0], sequences.shape[1] - 1)
        assert rel_err(got, own) <= 1e-6
        logits_output = actor(sequences, attention_mask=attention_mask, return_output=True)
        assert logits_output["logits"].shape == (*sequences.shape, VOCAB)


def test_enable_disable_exact_and_version_gate(monkeypatch):
    own = Actor.__dict__["forward"]
    fl_openrlhf.enable()
    fl_openrlhf.enable()
    assert Actor.forward is fl_openrlhf.fused_actor_forward
    fl_openrlhf.disable()
    assert Actor.__dict__["forward"] is own
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.12.0" if name == "openrlhf" else "0")
    with pytest.raises(RuntimeError, match="supports openrlhf>=0.11,<0.12, found openrlhf 0.12.0"):
        fl_openrlhf.enable()
    assert Actor.__dict__["forward"] is own
    with pytest.raises(ValueError, match="backend must be one of"):
        fl_openrlhf.enable(backend="gpu")


def run_readme_block(key: str) -> dict:
    """Runs the README's python block whose first line holds ``key``, as written, in a fresh namespace."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if key in b]
    assert len(blocks) == 1, key
    namespace: dict = {}
    exec(compile(blocks[0], f"README.md:{key}", "exec"), namespace)
    return namespace


def test_the_readme_block():
    """The README's OpenRLHF block, as written: Actor.forward is fusedloss's afterwards, and the float64 actor's
    log-probs through it are the oracle's."""
    own = Actor.__dict__["forward"]
    done = run_readme_block("fusedloss_openrlhf.enable()")
    assert Actor.forward is fl_openrlhf.fused_actor_forward
    actor = _actor(tiny_causal_lm("softcap"), False)
    batch = _rollout()
    got = _step(actor, *batch)
    fl_openrlhf.disable()
    ref = _oracle(actor, *batch)
    assert rel_err(got[0], ref[0]) <= EXACT
    done["fusedloss_openrlhf"].disable()
    assert Actor.__dict__["forward"] is own
