"""Hugging Face ``transformers`` causal LMs as fusedloss inputs: the last hidden states and the LM head,
never the ``[batch, seq, vocab]`` logits.

A causal LM computes ``logits = post(hidden @ lm_head.weight.T + lm_head.bias)``, where ``post`` is the
model family's own logit processing. Every fusedloss op takes the same three pieces: ``hidden`` from the
backbone, ``weight``/``bias`` from ``model.get_output_embeddings()``, and ``post`` as ``logit_scale`` and
``softcap`` (SPEC section 2: scale, then soft-cap). ``lm_head(model)`` reads them the way the models apply
them; ``last_hidden_state(model, ...)`` runs only the backbone; ``causal_lm_logprobs`` puts both together.

Handled: tied embeddings (the head weight *is* the embedding parameter; its gradient collects both uses),
PEFT-wrapped models (the backbone runs with its adapters; a LoRA on the head itself is folded into the head
weight), FSDP2 (a DTensor head is gathered once with ``full_tensor()``, whose backward reduce-scatters the
gradient), ``device_map`` splits (hidden states move to the head's device). Not handled: DeepSpeed ZeRO-3
partitioned heads (gather them around the call), prompt-learning PEFT (virtual tokens live in the PEFT
forward), models whose head multiplies by something other than the config fields below.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

import fusedloss

__all__ = ["LMHead", "causal_lm_logprobs", "last_hidden_state", "lm_head", "logit_postprocessing"]


class LMHead(NamedTuple):
    """The LM head as fusedloss consumes it: ``z = softcap(logit_scale * (h @ weight.T + bias))``."""

    weight: torch.Tensor  # [V, D], a plain tensor (DTensors gathered), differentiable
    bias: Optional[torch.Tensor]  # [V] or None
    logit_scale: float
    softcap: Optional[float]


def logit_postprocessing(config) -> tuple[float, Optional[float]]:
    """``(logit_scale, softcap)`` of a model config, in the spellings TRL 1.16 reads (``add_fused_lm_head``):

    - ``final_logit_softcapping``: Gemma 2 / Gemma 3 ``softcap * tanh(logits / softcap)``;
    - ``logit_scale``: Cohere / Cohere 2 multiply the logits by it (``None`` means unscaled, e.g. MPT);
    - ``output_multiplier`` (Muse Glimmer) and ``lm_head_multiplier`` (Falcon-H1): multipliers;
    - ``logits_scaling``: Granite and MiniCPM3 *divide* by it, HyperCLOVA X multiplies by it.

    Multimodal models keep these on their text config, so it is read through ``get_text_config()``."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(config, name, None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scaling = config.logits_scaling
        scale = scaling if getattr(config, "model_type", None) == "hyperclovax" else 1.0 / scaling
    return (1.0 if scale is None else float(scale)), (None if softcap is None else float(softcap))


def _is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _causal_lm(model):
    """The ``*ForCausalLM`` module under a PEFT wrapper (adapters stay injected in its layers)."""
    if _is_peft_model(model):
        config = model.peft_config.get(getattr(model, "active_adapter", "default"))
        if config is not None and getattr(config, "is_prompt_learning", False):
            raise NotImplementedError(
                "prompt-learning PEFT models (prefix/prompt tuning) add virtual tokens inside the PEFT forward; "
                "fusedloss.integrations.transformers only supports adapter methods such as LoRA"
            )
        model = model.get_base_model()
    return model


def _gather(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A DTensor (FSDP2 shard) as a full plain tensor; ``full_tensor()`` is differentiable, so the head
    gradient flows back to the shards. Gathered once per call, not once per vocabulary tile."""
    if t is None or not torch.distributed.is_available():
        return t
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _peft_head(head) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Weight and bias of a PEFT-wrapped head, with unmerged LoRA deltas folded in (differentiably)."""
    base = head.get_base_layer()
    weight, bias = base.weight, getattr(base, "bias", None)
    if getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        return weight, bias
    for name in head.active_adapters:
        if name not in getattr(head, "lora_A", {}):
            continue
        dropout = head.lora_dropout[name] if hasattr(head, "lora_dropout") else None
        if name in getattr(head, "lora_variant", {}) or getattr(head, "lora_bias", {}).get(name, False):
            raise NotImplementedError(f"LoRA adapter {name!r} on the LM head uses a variant (DoRA, ...) or a "
                                      "LoRA bias; fusedloss only folds plain LoRA deltas into the head weight")
        if head.training and dropout is not None and not isinstance(dropout, torch.nn.Identity):
            raise NotImplementedError(f"LoRA adapter {name!r} on the LM head has lora_dropout > 0; the dropout "
                                      "acts on the head input and cannot be folded into the weight")
        weight = weight + head.get_delta_weight(name).to(weight.dtype)
    return weight, bias


def lm_head(model) -> LMHead:
    """The head of a causal LM (or a PEFT model wrapping one), read from ``get_output_embeddings()``."""
    lm = _causal_lm(model)
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings (get_output_embeddings() returned None)")
    if hasattr(head, "get_base_layer") and hasattr(head, "active_adapters"):
        weight, bias = _peft_head(head)
    else:
        weight, bias = head.weight, getattr(head, "bias", None)
    scale, softcap = logit_postprocessing(lm.config)
    return LMHead(_gather(weight), _gather(bias), scale, softcap)


def _backbone(lm):
    # Before transformers 5, vision-language models expose their language backbone as `model` rather than
    # through `base_model_prefix` (the same rule TRL's add_fused_lm_head follows).
    import transformers
    from packaging.version import Version

    if lm.config.get_text_config() is not lm.config and Version(transformers.__version__) < Version("5.0.0"):
        return lm.model
    return lm.base_model


def last_hidden_state(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                      **model_kwargs) -> torch.Tensor:
    """``[B, T, D]`` output of the model's backbone (the input of the LM head); no logits are formed."""
    model_kwargs.setdefault("use_cache", False)
    out = _backbone(_causal_lm(model))(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    return out.last_hidden_state


def causal_lm_logprobs(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                       labels: Optional[torch.Tensor] = None, temperature: float = 1.0,
                       return_entropy: bool = False, backend: str = "auto", **model_kwargs
                       ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Per-token log-probabilities ``[B, T-1]`` of the next tokens ``input_ids[:, 1:]`` under ``model``,
    computed from the last hidden states and the head with ``fusedloss.token_logprobs``.

    Position ``t`` scores ``input_ids[:, t + 1]`` given the prefix, with the model's own logit processing
    (``logit_scale``, ``final_logit_softcapping``) and then ``temperature``. Positions whose target is
    padding (``attention_mask[:, t + 1] == 0``) or, when ``labels`` (``[B, T]``, unshifted, as for the
    model's own loss) is given, whose label is -100, are 0 in the outputs and carry no gradient.
    With ``return_entropy`` also returns the entropy of each next-token distribution (same shape, 0 at
    those positions). Differentiable with respect to the model's parameters. Extra keyword arguments go
    to the backbone (``position_ids``, ``pixel_values``, ...).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    hidden = last_hidden_state(model, input_ids, attention_mask, **model_kwargs)[:, :-1]
    head = lm_head(model)
    targets = (input_ids if labels is None else labels)[:, 1:]
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, 1:] == 0, -100)
    # With a `device_map` split, the backbone can end on another device than the head.
    hidden = hidden.to(head.weight.device)
    targets = targets.to(head.weight.device)
    return fusedloss.token_logprobs(
        hidden, head.weight, targets, bias=head.bias, temperature=temperature, logit_scale=head.logit_scale,
        softcap=head.softcap, ignore_index=-100, return_entropy=return_entropy, backend=backend,
    )
