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

With log-probs the returned output has no ``logits``. Refused with ``NotImplementedError``: vision-language
actors (their multimodal inputs) and MoE models with ``output_router_logits`` (the router's auxiliary loss comes
from the full model's forward). Log-probs are fp32 (float64 for a float64 model).

OpenRLHF has no plugin mechanism: call ``enable()`` in every process that builds an ``Actor`` (the launch script
and the Ray actors' code), before training. Supported: ``openrlhf>=0.11,<0.12``; ``enable()`` raises
``RuntimeError`` naming the version otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch

import fusedloss

from ..core import registry as _backends
from . import _switch
from .transformers._head import _causal_lm
from .transformers._helpers import _hidden_and_head

__all__ = ["SUPPORTED_OPENRLHF", "disable", "enable", "enabled", "fused_actor_forward", "is_enabled"]

SUPPORTED_OPENRLHF = ">=0.11,<0.12"

_originals: dict = {}  # "forward" -> OpenRLHF's Actor.forward, recorded by the first enable()
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


def disable() -> None:
    """Put OpenRLHF's own ``Actor.forward`` back, the exact function."""
    if "forward" in _originals:
        from openrlhf.models.actor import Actor

        Actor.forward = _originals["forward"]
    _state["enabled"] = False


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
    if getattr(lm.config, "output_router_logits", False):
        raise NotImplementedError("fusedloss.integrations.openrlhf: MoE models with output_router_logits need the "
                                  "full forward for their auxiliary loss; disable() the integration for them")
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
    # few probe rows (docs/design.md, "Configuration"); no logits are formed.
    hidden, head = _hidden_and_head(lm, sequences, forward_attention_mask,
                                    {"position_ids": position_ids, "use_cache": False})
    scored = fusedloss.token_logprobs(hidden.to(head.weight.device), head.weight,
                                      rolled_sequences.to(head.weight.device), temperature=self.temperature,
                                      return_entropy=return_entropy, backend=_state["backend"], **head.options)
    log_probs, entropy = scored if return_entropy else (scored, None)
    output = CausalLMOutputWithPast()
    if return_entropy:
        assert return_output  # as OpenRLHF asserts
        output.entropy = unpack(entropy)[:, :-1]
    log_probs = unpack(log_probs)[:, :-1]
    if action_mask is None:
        return (log_probs, output) if return_output else log_probs
    action_log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
    return (action_log_probs, output) if return_output else action_log_probs
