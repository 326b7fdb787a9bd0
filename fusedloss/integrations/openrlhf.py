"""Run OpenRLHF's log-probs and entropy through fusedloss.

OpenRLHF has one method that turns sequences into per-token log-probs: ``openrlhf.models.actor.Actor.forward``,
used by the PPO / GRPO actor, the reference and old-policy log-probs, SFT and DPO. It forms the model's full
``[batch, seq, vocab]`` logits and copies them to fp32. ``enable()`` replaces that method on the class: when
log-probs are asked for (``action_mask`` or ``return_logprobs``), the backbone runs alone and
``fusedloss.token_logprobs`` scores the same targets from its last hidden states and the head (read with the
model's logit processing: bias, logit scale, soft-cap, a LoRA on the head), at the actor's temperature, with the
entropy when ``return_entropy`` is set; everything around it (sample packing, ring attention slicing and
gathering, the ``[:, :-1]`` shift, the action slice and mask) is OpenRLHF's own code path, as in the method it
replaces. Calls that want the logits (neither ``action_mask`` nor ``return_logprobs``) run OpenRLHF's method.

With log-probs the returned output has no ``logits``; what else the model returns stays: an MoE model with
``output_router_logits`` (OpenRLHF sets it on every MoE model it loads) keeps its ``aux_loss`` and
``router_logits``, from the same forward of the model (its router does not read the head's logits). Refused with
``NotImplementedError``: vision-language actors (their multimodal inputs). Log-probs are fp32 (float64 for a
float64 model).

Ray: OpenRLHF's PPO actors are its own Ray actors, in processes of their own. ``enable()`` in the launch script,
before ``ray.init`` (OpenRLHF's ``train_ppo_ray`` calls it), makes that ``ray.init`` give every worker process
Ray's ``worker_process_setup_hook`` ``fusedloss.integrations.openrlhf.worker_setup``, which enables the
integration there with the same backend (``FUSEDLOSS_OPENRLHF_BACKEND`` in the workers' environment). A Ray
session already started in the driver is not changed: ``enable()`` then warns, unless its runtime environment
already names that hook (``ray.init(runtime_env={"worker_process_setup_hook":
"fusedloss.integrations.openrlhf.worker_setup"})``, or ``ray job submit --runtime-env-json``). Supported:
``openrlhf>=0.11,<0.12``; ``enable()`` raises ``RuntimeError`` naming the version otherwise.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch

import fusedloss

from ..core import registry as _backends
from . import _switch
from .transformers._head import _causal_lm
from .transformers._helpers import _hidden_and_head

__all__ = ["SUPPORTED_OPENRLHF", "WORKER_SETUP_HOOK", "disable", "enable", "enabled", "fused_actor_forward",
           "is_enabled", "worker_setup"]

SUPPORTED_OPENRLHF = ">=0.11,<0.12"
WORKER_SETUP_HOOK = "fusedloss.integrations.openrlhf.worker_setup"  # Ray's worker_process_setup_hook
BACKEND_VARIABLE = "FUSEDLOSS_OPENRLHF_BACKEND"  # the backend worker_setup enables, in the workers' environment

_originals: dict = {}  # "forward" -> OpenRLHF's Actor.forward, "ray.init" -> Ray's, recorded when replaced
_state = {"backend": "auto", "enabled": False}


def _actor_class():
    try:
        from importlib.metadata import version

        from openrlhf.models.actor import Actor
    except ImportError as exc:
        raise ImportError("fusedloss.integrations.openrlhf needs openrlhf (pip install 'openrlhf>=0.11,<0.12')") \
            from exc
    _switch.check_version("fusedloss.integrations.openrlhf", "openrlhf", version("openrlhf"), SUPPORTED_OPENRLHF,
                          "OpenRLHF's Actor.forward")
    return Actor


def enable(backend: str = "auto") -> None:
    """Replace ``openrlhf.models.actor.Actor.forward`` (for every actor, existing or future) with
    ``fused_actor_forward``. Idempotent: a second call only changes ``backend`` (fusedloss's)."""
    if backend not in _backends.BACKEND_NAMES:
        raise ValueError(f"backend must be one of {_backends.BACKEND_NAMES}, got {backend!r}")
    actor = _actor_class()
    _originals.setdefault("forward", actor.__dict__["forward"])
    actor.forward = fused_actor_forward
    _state.update(backend=backend, enabled=True)
    _reach_ray_workers(backend)


def disable() -> None:
    """Put OpenRLHF's own ``Actor.forward`` back, the exact function (and Ray's own ``ray.init``)."""
    if "forward" in _originals:
        from openrlhf.models.actor import Actor

        Actor.forward = _originals["forward"]
    if "ray.init" in _originals:
        import ray

        ray.init = _originals.pop("ray.init")
    _state["enabled"] = False


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: ``enable()`` in a Ray worker process, with the backend of
    ``FUSEDLOSS_OPENRLHF_BACKEND`` (``auto`` when unset)."""
    enable(os.environ.get(BACKEND_VARIABLE, "auto"))


def _with_worker_hook(runtime_env, backend: str) -> dict:
    """``runtime_env`` (a dict, a ``ray.runtime_env.RuntimeEnv`` or None) with fusedloss's setup hook and backend."""
    runtime_env = dict(runtime_env or {})
    hook = runtime_env.get("worker_process_setup_hook")
    if hook is not None and hook != WORKER_SETUP_HOOK:
        raise RuntimeError(f"fusedloss.integrations.openrlhf: ray.init got worker_process_setup_hook={hook!r}; Ray "
                           "takes one hook, and fusedloss needs its own in every worker: call "
                           "fusedloss.integrations.openrlhf.enable() from that hook and pass it alone")
    runtime_env["worker_process_setup_hook"] = WORKER_SETUP_HOOK
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), BACKEND_VARIABLE: backend}
    return runtime_env


def _session_has_hook() -> bool:
    """Whether the Ray session this driver joined gives its workers fusedloss's setup hook."""
    import ray

    try:
        runtime_env = ray.get_runtime_context().runtime_env
    except Exception:  # pragma: no cover - a Ray without a runtime context
        return False
    return runtime_env.get("worker_process_setup_hook") == WORKER_SETUP_HOOK \
        or WORKER_SETUP_HOOK in runtime_env.get("env_vars", {}).values()


def _reach_ray_workers(backend: str) -> None:
    """In a driver, make OpenRLHF's Ray workers enable the integration too (the module docstring)."""
    try:
        import ray
    except ImportError:  # no Ray: every Actor is built in this process
        return
    if ray.is_initialized():
        if ray.get_runtime_context().worker.mode != ray.SCRIPT_MODE or _session_has_hook():
            return  # a Ray worker (its own enable()), or a session whose workers run the hook
        warnings.warn("fusedloss.integrations.openrlhf.enable(): Ray was initialised before it, so OpenRLHF's "
                      "Ray actors run OpenRLHF's own Actor.forward; call enable() before ray.init (OpenRLHF's "
                      "train_ppo_ray calls it), or pass ray.init(runtime_env={\"worker_process_setup_hook\": "
                      f"\"{WORKER_SETUP_HOOK}\"}})", RuntimeWarning, stacklevel=3)
        return
    init = _originals.setdefault("ray.init", ray.init)

    @functools.wraps(init)
    def init_with_fusedloss(*args, runtime_env=None, **kwargs):
        return init(*args, runtime_env=_with_worker_hook(runtime_env, _state["backend"]), **kwargs)

    ray.init = init_with_fusedloss


def is_enabled() -> bool:
    return _state["enabled"]


enabled = _switch.scoped(enable, disable, _state)


def fused_actor_forward(self, sequences: torch.LongTensor, action_mask: Optional[torch.Tensor] = None,
                        attention_mask: Optional[torch.Tensor] = None, return_output=False, allgather_logits=False,
                        return_logprobs=False, ring_attn_group=None, packed_seq_lens=None, return_entropy=False,
                        **mm_inputs):
    """``Actor.forward`` with the log-probs (and entropy) from the hidden states; the same arguments and returns."""
    if action_mask is None and not return_logprobs:  # the caller wants the logits
        return _originals["forward"](self, sequences, action_mask, attention_mask, return_output, allgather_logits,
                                     return_logprobs, ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs)
    lm = _causal_lm(self.model)
    if getattr(self, "is_vlm", False) or mm_inputs:
        raise NotImplementedError("fusedloss.integrations.openrlhf: vision-language actors are not supported; "
                                  "disable() the integration for them")
    from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor
    from transformers.modeling_outputs import CausalLMOutputWithPast

    batch, seqlen = sequences.size()
    packing = getattr(self, "packing_samples", False)
    if packing:
        sequences, position_ids, rolled_sequences, ring_attn_pad_len, indices = unpad_and_slice_tensor(
            sequences, attention_mask, ring_attn_group)
        forward_attention_mask = None
    else:
        rolled_sequences = torch.roll(sequences, shifts=-1, dims=1)
        forward_attention_mask = attention_mask
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)

    def unpack(t):
        return gather_and_pad_tensor(t, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen) if packing else t

    # The model's own forward with its head tapped: the head's input, and the logit processing observed on a
    # few probe rows (docs/design.md, "Configuration"); no logits are formed. What the model returns besides
    # its logits (an MoE router's aux_loss and router_logits) is kept.
    model_outputs: list = []
    hidden, head = _hidden_and_head(lm, sequences, forward_attention_mask,
                                    {"position_ids": position_ids, "use_cache": False}, model_outputs)
    scored = fusedloss.token_logprobs(hidden.to(head.weight.device), head.weight,
                                      rolled_sequences.to(head.weight.device), temperature=self.temperature,
                                      return_entropy=return_entropy, backend=_state["backend"], **head.options)
    log_probs, entropy = scored if return_entropy else (scored, None)
    output = type(model_outputs[0])(**{k: v for k, v in model_outputs[0].items() if k != "logits"}) \
        if model_outputs and not isinstance(model_outputs[0], tuple) else CausalLMOutputWithPast()
    if return_entropy:
        assert return_output  # as OpenRLHF asserts
        output.entropy = unpack(entropy)[:, :-1]
    log_probs = unpack(log_probs)[:, :-1]
    if action_mask is None:
        return (log_probs, output) if return_output else log_probs
    action_log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
    return (action_log_probs, output) if return_output else action_log_probs
