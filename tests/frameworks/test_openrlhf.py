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


# --------------------------------------------------------------------------------------------------
# Ray: OpenRLHF's PPO actors are Ray actors in worker processes of their own.

_RAY_SCRIPT = r'''
import json, sys, warnings
import ray
from fusedloss.integrations import openrlhf as fl_openrlhf

@ray.remote
class PolicyActor:
    """What OpenRLHF's PolicyModelActor does with the model: an Actor, and its action log-probs."""

    def run(self):
        import os
        import torch
        from _frameworks_util import TEMPERATURE, oracle_logprobs_entropy, rel_err, tiny_causal_lm
        from openrlhf.models.actor import Actor
        import fusedloss
        actor = Actor(tiny_causal_lm("untied"), temperature=TEMPERATURE)
        actor.packing_samples = False
        sequences = torch.randint(0, 211, (2, 9), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(sequences)
        logp, output = actor(sequences, mask[:, 4:], attention_mask=mask, return_output=True)
        logits = actor.model(sequences).logits
        ref, _ = oracle_logprobs_entropy(logits[:, :-1], sequences[:, 1:], TEMPERATURE)
        return {"fused": Actor.forward is fl_openrlhf.fused_actor_forward, "backend": fl_openrlhf._state["backend"],
                "logits": output.logits is None, "err": rel_err(logp, ref[:, -5:]),
                "fusedloss": fusedloss.__file__, "env": os.environ.get("TOKENIZERS_PARALLELISM")}

@ray.remote
def task():
    from openrlhf.models.actor import Actor
    return Actor.forward is fl_openrlhf.fused_actor_forward

paths = {"PYTHONPATH": sys.argv[1]}  # the checkout and the test's flash_attn stand-in (a real install has both)
warnings.filterwarnings("error", message="fusedloss")  # enable() would warn if the workers were missed
# the launch script: enable(), then OpenRLHF's train_ppo_ray, whose ray.init is this one
fl_openrlhf.enable(backend="torch")
ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true", **paths}})
report = {"task": ray.get(task.remote()), "actor": ray.get(PolicyActor.remote().run.remote())}
ray.shutdown()
print("REPORT" + json.dumps(report))
'''


def test_ray_workers_are_enabled_from_the_launch_script(tmp_path):
    """``enable()`` before ``ray.init`` (OpenRLHF's ``train_ppo_ray`` calls it with its own ``runtime_env``) reaches
    every Ray worker: a task and an actor that builds an ``Actor`` run fusedloss's forward with the launch
    script's backend, and their log-probs are the float64 oracle's. A real local Ray (one CPU), in a process of its
    own. (A session started with the hook by hand gives its workers the same hook string: the next tests.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # the workers import the stand-in for flash_attn as the tests do (a real install has flash_attn itself)
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.path.insert(0, {str(root / 'tests/frameworks')!r})\n"
                                               "import _stand_ins  # noqa: F401\n")
    paths = f"{tmp_path}{os.pathsep}{root}"
    # a loaded machine (CI runs two test processes) starts a raylet slower than Ray's default patience
    env = {**os.environ, "PYTHONPATH": paths, "RAY_DISABLE_USAGE_STATS": "1", "RAY_raylet_start_wait_time_s": "300"}
    for _ in range(3):  # another start when Ray's own start-up times out on a loaded machine (nothing ran yet)
        run = subprocess.run([sys.executable, "-c", _RAY_SCRIPT, paths], cwd=root, env=env,
                             capture_output=True, text=True, timeout=600)
        if "node timed out during startup" not in run.stderr:
            break
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    report = json.loads(run.stdout.split("REPORT", 1)[1])
    assert report["task"] is True
    actor = report["actor"]
    assert actor["fused"] and actor["logits"], actor
    assert actor["backend"] == "torch", actor  # the launch script's backend
    assert actor["err"] <= EXACT, actor
    assert actor["fusedloss"] == str(root / "fusedloss" / "__init__.py"), actor
    assert actor["env"] == "true"  # OpenRLHF's own runtime_env is kept


def test_enable_after_ray_init_warns_with_the_fix(monkeypatch):
    """A driver whose Ray session started without the hook: its workers would run OpenRLHF's method, so
    ``enable()`` says so and how to fix it (the session is a stand-in: starting Ray takes seconds)."""
    import types

    import ray

    context = types.SimpleNamespace(worker=types.SimpleNamespace(mode=ray.SCRIPT_MODE), runtime_env={"env_vars": {}})
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    with pytest.warns(RuntimeWarning, match="Ray was initialised before it.*worker_process_setup_hook.*"
                                            "fusedloss.integrations.openrlhf.worker_setup"):
        fl_openrlhf.enable()
    assert Actor.forward is fl_openrlhf.fused_actor_forward  # this process is enabled all the same
    fl_openrlhf.disable()
    context.runtime_env = {"worker_process_setup_hook": fl_openrlhf.WORKER_SETUP_HOOK}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl_openrlhf.enable()  # the session's workers run the hook: nothing to say
    context.worker.mode = ray.WORKER_MODE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fl_openrlhf.enable()  # in a worker: its own enable()


def test_ray_init_gets_the_hook_and_keeps_its_runtime_env(monkeypatch):
    """What ``enable()`` makes ``ray.init`` pass on (the started session is the test above's); the same hook
    given by hand is accepted as it is."""
    import ray

    seen = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: seen.append(kwargs))
    fl_openrlhf.enable(backend="torch")
    ray.init(num_cpus=1, runtime_env={"env_vars": {"NCCL_DEBUG": "WARN"}})
    ray.init(runtime_env={"worker_process_setup_hook": fl_openrlhf.WORKER_SETUP_HOOK})
    assert seen[0] == {"num_cpus": 1, "runtime_env": {
        "env_vars": {"NCCL_DEBUG": "WARN", "FUSEDLOSS_OPENRLHF_BACKEND": "torch"},
        "worker_process_setup_hook": "fusedloss.integrations.openrlhf.worker_setup"}}
    assert seen[1]["runtime_env"]["worker_process_setup_hook"] == fl_openrlhf.WORKER_SETUP_HOOK
    monkeypatch.setenv("FUSEDLOSS_OPENRLHF_BACKEND", "triton")
    fl_openrlhf.disable()
    fl_openrlhf.worker_setup()  # what a worker runs: the backend from its environment
    assert Actor.forward is fl_openrlhf.fused_actor_forward and fl_openrlhf._state["backend"] == "triton"


def test_a_second_setup_hook_is_refused():
    import ray

    own = ray.init
    fl_openrlhf.enable()
    assert ray.init is not own
    with pytest.raises(RuntimeError, match="Ray takes one hook"):
        ray.init(runtime_env={"worker_process_setup_hook": "my_project.setup"})
    fl_openrlhf.disable()
    assert ray.init is own


def _tiny_moe():
    """A 2-layer Mixtral, 4 experts (2 per token), float64, with ``output_router_logits`` set as OpenRLHF's Actor sets
    it on every MoE model it loads."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    config._attn_implementation = "sdpa"
    model = transformers.MixtralForCausalLM(config)
    model.set_experts_implementation("eager")  # torch's grouped_mm has no float64
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.double().eval()


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_moe_actor_keeps_its_router_aux_loss(packing):
    """OpenRLHF sets ``output_router_logits`` on every MoE actor and adds ``output.aux_loss`` (the router's
    load-balancing loss) to the PPO loss: through fusedloss the log-probs, entropies and every gradient of
    log-probs + entropy + aux_loss are the float64 oracle's, and the aux_loss is OpenRLHF's own."""
    actor = _actor(_tiny_moe(), packing)
    assert actor.model.config.output_router_logits
    batch = _rollout()
    sequences, attention_mask, action_mask, coefficients = batch

    def step():
        actor.zero_grad()
        logp, output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True,
                             return_entropy=True)
        entropy = output.entropy[:, -action_mask.shape[1]:] * action_mask
        assert output.aux_loss is not None and output.aux_loss.dim() == 0
        ((coefficients[0] * logp + coefficients[1] * entropy).sum() + 0.5 * output.aux_loss).backward()
        grads = param_grads(actor)
        actor.zero_grad()
        return logp.detach(), entropy.detach(), output.aux_loss.detach(), grads, output

    own = step()  # OpenRLHF's method
    fl_openrlhf.enable()
    got = step()
    assert got[4].logits is None and got[4].router_logits is not None
    assert rel_err(got[2], own[2]) <= EXACT  # the same forward of the model: its router's loss
    ref = _oracle(actor, *batch)  # log-probs and entropies of the model's own float64 logits
    for actual, expected in zip(got[:2], ref[:2]):
        assert rel_err(actual, expected) <= EXACT
    # every gradient of the whole loss: the oracle's logits path with the model's own aux_loss added
    actor.zero_grad()
    fl_openrlhf.disable()
    oracle_grads = _oracle_with_aux(actor, *batch)
    assert max_grad_err(got[3], oracle_grads) <= EXACT
    assert max_grad_err(own[3], oracle_grads) <= 1e-4  # OpenRLHF's fp32 logits


def _oracle_with_aux(actor, sequences, attention_mask, action_mask, coefficients):
    """``_oracle``'s gradients, with the router's aux_loss of the same forward (weight 0.5) added to the loss."""
    from _frameworks_util import oracle_logprobs_entropy

    actor.zero_grad()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    if actor.packing_samples:
        kept = attention_mask.flatten().nonzero().squeeze(-1)
        out = actor.model(sequences.flatten()[kept][None], position_ids=position_ids.flatten()[kept][None])
        logits = out.logits.new_zeros(sequences.numel(), out.logits.shape[-1]).index_copy(0, kept, out.logits[0])
        logits = logits.view(*sequences.shape, -1)
    else:
        out = actor.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        logits = out.logits
    logp, entropy = oracle_logprobs_entropy(logits[:, :-1], sequences[:, 1:], TEMPERATURE)
    actions = action_mask.shape[1]
    logp, entropy = logp[:, -actions:] * action_mask, entropy[:, -actions:] * action_mask
    ((coefficients[0] * logp + coefficients[1] * entropy).sum() + 0.5 * out.aux_loss).backward()
    grads = param_grads(actor)
    actor.zero_grad()
    return grads
