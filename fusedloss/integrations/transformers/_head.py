"""The LM head as fusedloss reads it: the layer (through PEFT's adapters and wrappers) and its weight and bias,
refused unless it is one linear layer; the config fields that propose its logit processing (``post``), and
``post`` itself as fusedloss applies it (``_Transform``)."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from fusedloss.losses.implicit_logits import remember_head_options


class LMHead(NamedTuple):
    """The LM head as fusedloss consumes it: ``z = softcap(logit_scale * (h @ weight.T + bias))[..., :vocab_size]``
    for ``h`` the head's input (``last_hidden_state``)."""

    weight: torch.Tensor  # [V, D], the parameter itself (an FSDP2 DTensor shard stays one), differentiable
    bias: Optional[torch.Tensor]  # [V] or None
    logit_scale: float
    softcap: Optional[float]
    vocab_size: Optional[int] = None  # the logits the model keeps (its first rows); None: all V

    @property
    def options(self) -> dict:
        """``bias``, ``logit_scale``, ``softcap`` and ``vocab_size`` as keyword arguments of any fusedloss
        function: ``fusedloss.cross_entropy(hidden, head.weight, labels, **head.options)``."""
        return {"bias": self.bias, "logit_scale": self.logit_scale, "softcap": self.softcap,
                "vocab_size": self.vocab_size}


# The config fields that name a soft-cap or a logit multiplier in transformers' models. They only propose
# candidates: what the model's forward does on the probe rows decides (a field can be declared and not applied,
# MPT's logit_scale, or applied to the head's input, MiniCPM3's logits_scaling, which the head input then holds).
_SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
_MULTIPLIER_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling",
                      "logits_mup_width_multiplier")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _real_field(config, name) -> Optional[float]:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        return None
    return float(value)


def logit_postprocessing(config) -> tuple[float, Optional[float]]:
    """``(logit_scale, softcap)`` a model config declares, in the spellings TRL 1.16 reads (``add_fused_lm_head``):

    - ``final_logit_softcapping``: Gemma 2 / Gemma 3 ``softcap * tanh(logits / softcap)``;
    - ``logit_scale``: Cohere / Cohere 2 multiply the logits by it (``None`` means unscaled);
    - ``output_multiplier`` (Muse Glimmer) and ``lm_head_multiplier`` (Falcon-H1): multipliers;
    - ``logits_scaling``: Granite *divides* by it, HyperCLOVA X multiplies by it.

    Multimodal models keep these on their text config, so it is read through ``get_text_config()``. This is a
    prediction from field names; ``lm_head`` and ``patch`` use it only as the first candidate and check it
    against the model's own forward."""
    config = _text_config(config)
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(config, name, None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scaling = config.logits_scaling
        scale = scaling if getattr(config, "model_type", None) == "hyperclovax" else 1.0 / scaling
    return (1.0 if scale is None else float(scale)), (None if softcap is None else float(softcap))


class _Transform(NamedTuple):
    """``post``: ``softcap(logit_scale * z)[..., :vocab_size]`` of the head's output ``z``."""

    logit_scale: float
    softcap: Optional[float]
    vocab_size: Optional[int]

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.vocab_size is not None:
            z = z[..., :self.vocab_size]
        z = z * self.logit_scale
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)

    def vjp(self, z: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
        """``cotangent`` (over the kept logits) pulled back to the head's output ``z``."""
        kept = z[..., :cotangent.shape[-1]] * self.logit_scale
        d = torch.full_like(kept, self.logit_scale)
        if self.softcap is not None:
            d = d * (1 - torch.tanh(kept / self.softcap) ** 2)
        grad = torch.zeros_like(z)
        grad[..., :cotangent.shape[-1]] = cotangent * d
        return grad


def _candidate_transforms(config, head_vocab: int, kept_vocab: int) -> list:
    """Every ``post`` the config's fields allow, the documented reading first."""
    text = _text_config(config)
    try:
        predicted = [logit_postprocessing(config)]
    except (TypeError, ValueError):  # a non-numeric field (MPT's "inv_sqrt_d_model"): no prediction
        predicted = []
    scales = [1.0]
    for name in _MULTIPLIER_FIELDS:
        value = _real_field(text, name)
        if value is not None:
            scales += [value, 1.0 / value]
    softcaps = [None] + [v for v in (_real_field(text, name) for name in _SOFTCAP_FIELDS) if v is not None and v > 0]
    vocab = None if kept_vocab == head_vocab else kept_vocab
    pairs = predicted + [(s, c) for c in softcaps for s in scales]
    seen, out = set(), []
    for scale, softcap in pairs:
        if (scale, softcap) not in seen:
            seen.add((scale, softcap))
            out.append(_Transform(scale, softcap, vocab))
    return out


def _is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _is_peft_layer(head) -> bool:
    return hasattr(head, "get_base_layer") and hasattr(head, "active_adapters")


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


def _peft_class(module: str, name: str):
    """A PEFT class, or None where PEFT is not imported (no model can hold one then) or does not have it."""
    import importlib
    import sys

    if "peft" not in sys.modules:
        return None
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _is_peft_instance(head, module: str, name: str) -> bool:
    cls = _peft_class(module, name)
    return cls is not None and isinstance(head, cls)


def _is_trainable_tokens(layer) -> bool:
    return _is_peft_instance(layer, "peft.tuners.trainable_tokens.layer", "TrainableTokensLayer")


def _head_layer(head):
    """The layer that computes a head's output. PEFT's recipes for training added tokens wrap the head: a
    ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``) runs its active adapter's trained copy of the head
    (the original when adapters are off), a ``TrainableTokensWrapper`` (``trainable_token_indices`` on a tied
    model) runs its ``TrainableTokensLayer``; both as their ``forward`` decides. Any other head is its own layer."""
    if _is_peft_instance(head, "peft.utils.other", "ModulesToSaveWrapper"):
        active = head.active_adapters
        if head.disable_adapters or not active or any(a not in head._adapters for a in active):
            return head.original_module
        return head.modules_to_save[active[0]]
    if _is_peft_instance(head, "peft.utils.other", "TrainableTokensWrapper"):
        return head.token_adapter
    return head


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


def _trainable_tokens_head(layer) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Weight and bias of PEFT's ``TrainableTokensLayer`` on a linear head, as its forward computes them: the
    base weight with the trained token rows swapped in (differentiably in both) and no bias, or the base layer
    itself when the adapters are off or merged."""
    base = layer.get_base_layer()
    active = layer.active_adapters
    if layer.disable_adapters or not active or layer.merged:
        return base.weight, getattr(base, "bias", None)
    return layer.get_merged_weights(active), None


def _weight_shape(weight: torch.Tensor) -> torch.Size:
    """The shape of the whole parameter: a DeepSpeed ZeRO-3 parameter holds an empty partition outside its
    module's forward."""
    from ...distributed import zero3

    return zero3.full_shape(weight) if zero3.is_partitioned(weight) else weight.shape


def _output_head(lm):
    """``lm.get_output_embeddings()``, refused unless it is one linear layer fusedloss can stand in for: a
    module whose ``weight`` is its ``[V, D]`` matrix, with ``nn.Linear``'s forward and no parameter beyond
    ``weight`` and ``bias`` (a learned scale inside the head would otherwise get no gradient). A LoRA layer on
    it, or PEFT's wrappers for training added tokens (``_head_layer``), are read through."""
    if not hasattr(lm, "get_output_embeddings"):
        raise ValueError(f"{type(lm).__name__} is not a transformers causal LM with an LM head "
                         "(get_output_embeddings() is needed)")
    head = lm.get_output_embeddings()
    name = type(lm).__name__
    if head is None:
        raise ValueError(f"{name} has no LM head (get_output_embeddings() returned None)")
    layer = _head_layer(head)
    base = layer.get_base_layer() if _is_peft_layer(layer) else layer
    weight = getattr(base, "weight", None)
    if not isinstance(base, torch.nn.Module) or not isinstance(weight, torch.Tensor) or len(_weight_shape(weight)) != 2:
        raise ValueError(f"fusedloss: {name}'s LM head is a {type(base).__name__}, not one module with a "
                         "[vocab, hidden] weight (e.g. one head per codebook): fusedloss.integrations.transformers "
                         "does not support this architecture")
    if type(base).forward is not torch.nn.Linear.forward:
        raise ValueError(f"fusedloss: {name}'s LM head class {type(base).__name__} has a forward of its own, not "
                         "nn.Linear's: fusedloss computes h @ weight.T + bias and would skip what it adds; "
                         "fusedloss.integrations.transformers does not support this architecture")
    extra = [n for n, _ in base.named_parameters() if n not in ("weight", "bias")]
    if extra:
        raise ValueError(f"fusedloss: {name}'s LM head has parameters beyond weight and bias ({', '.join(extra)}): "
                         "they would get no gradient from fusedloss; fusedloss.integrations.transformers does not "
                         "support this architecture")
    return head


def _head_tensors(head) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The weight and bias the head's forward applies (adapters folded in), differentiable in its parameters."""
    layer = _head_layer(head)
    if _is_trainable_tokens(layer):
        return _trainable_tokens_head(layer)
    if _is_peft_layer(layer):
        return _peft_head(layer)
    return layer.weight, getattr(layer, "bias", None)


def _as_lm_head(head, transform: _Transform) -> LMHead:
    weight, bias = _head_tensors(head)
    remember_head_options(weight, bias=bias, logit_scale=transform.logit_scale, softcap=transform.softcap,
                          vocab_size=transform.vocab_size)  # a call passing the weight bare is warned about
    return LMHead(weight, bias, transform.logit_scale, transform.softcap, transform.vocab_size)
