"""Hugging Face ``transformers`` causal LMs as fusedloss inputs: the last hidden states and the LM head,
never the ``[batch, seq, vocab]`` logits.

A causal LM computes ``logits = post(hidden @ lm_head.weight.T + lm_head.bias)``, where ``post`` is the
model family's own logit processing. Every fusedloss op takes the same three pieces: ``hidden`` from the
backbone, ``weight``/``bias`` from ``model.get_output_embeddings()``, and ``post`` as ``logit_scale`` and
``softcap`` (scale, then soft-cap: docs/design.md, "The statistics problem"). ``lm_head(model)`` reads them
the way the models apply them; ``last_hidden_state(model, ...)`` runs only the backbone;
``causal_lm_logprobs`` and ``completion_logprobs`` put both together; ``patch(model)`` makes the model's own
``model(input_ids, labels=labels).loss`` come from the hidden states (its logits are never formed).

Handled: tied embeddings (the head weight *is* the embedding parameter; its gradient collects both uses),
PEFT-wrapped models (the backbone runs with its adapters; a LoRA on the head itself is folded into the head
weight), FSDP2 (the head goes to fusedloss as the parameter it is: a sharded DTensor when the head is its
own FSDP unit, which the core gathers once per forward and once per backward and whose gradient it
reduce-scatters and averages as FSDP does, docs/design.md "Distributed"; the backbone runs inside the
root's FSDP forward), ``device_map`` splits (hidden states move to the head's device). Not handled:
DeepSpeed ZeRO-3 partitioned heads (gather them around the call), prompt-learning PEFT (virtual tokens live
in the PEFT forward), a LoRA on an FSDP2-sharded head, models whose head multiplies by something other than
the config fields below.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

import fusedloss

__all__ = ["LMHead", "causal_lm_logprobs", "completion_logprobs", "last_hidden_state", "lm_head",
           "logit_postprocessing", "patch", "unpatch"]


class LMHead(NamedTuple):
    """The LM head as fusedloss consumes it: ``z = softcap(logit_scale * (h @ weight.T + bias))``."""

    weight: torch.Tensor  # [V, D], the parameter itself (an FSDP2 DTensor shard stays one), differentiable
    bias: Optional[torch.Tensor]  # [V] or None
    logit_scale: float
    softcap: Optional[float]

    @property
    def options(self) -> dict:
        """``bias``, ``logit_scale`` and ``softcap`` as keyword arguments of any fusedloss function:
        ``fusedloss.cross_entropy(hidden, head.weight, labels, **head.options)``."""
        return {"bias": self.bias, "logit_scale": self.logit_scale, "softcap": self.softcap}


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
    """The head of a causal LM (or a PEFT model wrapping one), read from ``get_output_embeddings()``.

    Pass its four fields to any fusedloss function, so that soft-capped (Gemma 2/3) and scaled (Cohere,
    Granite, ...) heads give the model's own logits::

        head = lm_head(model)
        loss = fusedloss.cross_entropy(hidden, head.weight, labels, bias=head.bias,
                                       logit_scale=head.logit_scale, softcap=head.softcap)

    ``weight`` and ``bias`` are the head's parameters themselves, never gathered copies: under FSDP2, a head
    that is its own FSDP unit is read here as its sharded DTensor, and fusedloss gathers it and averages its
    gradient across ranks itself (docs/design.md, "Distributed"). Gathering it here with ``full_tensor()``
    would give each rank's shard only its own tokens' gradient, not the average FSDP takes."""
    return _read_head(_causal_lm(model))


def _read_head(lm) -> LMHead:
    head = lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings (get_output_embeddings() returned None)")
    if hasattr(head, "get_base_layer") and hasattr(head, "active_adapters"):
        weight, bias = _peft_head(head)
    else:
        weight, bias = head.weight, getattr(head, "bias", None)
    scale, softcap = logit_postprocessing(lm.config)
    return LMHead(weight, bias, scale, softcap)


def _backbone(lm):
    # Before transformers 5, vision-language models expose their language backbone as `model` rather than
    # through `base_model_prefix` (the same rule TRL's add_fused_lm_head follows).
    import transformers
    from packaging.version import Version

    if lm.config.get_text_config() is not lm.config and Version(transformers.__version__) < Version("5.0.0"):
        return lm.model
    return lm.base_model


_BACKBONE_METHOD = "_fusedloss_backbone_forward"


def _backbone_forward(lm, **kwargs):
    return _backbone(lm)(**kwargs)


def _run_backbone(lm, **kwargs):
    """The backbone, called so that an FSDP2 root (``fully_shard(model)``) gathers its own parameters
    (embeddings, final norm, ...) around it, as it does around ``model.forward``: the call goes through a
    method registered with ``register_fsdp_forward_method`` (once per model; a no-op without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    except ImportError:  # torch without FSDP2
        return _backbone(lm)(**kwargs)
    if not isinstance(lm, FSDPModule):
        return _backbone(lm)(**kwargs)
    if _BACKBONE_METHOD not in lm.__dict__:
        import types

        lm.__dict__[_BACKBONE_METHOD] = types.MethodType(_backbone_forward, lm)
        register_fsdp_forward_method(lm, _BACKBONE_METHOD)
    return getattr(lm, _BACKBONE_METHOD)(**kwargs)


def last_hidden_state(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                      **model_kwargs) -> torch.Tensor:
    """``[B, T, D]`` output of the model's backbone (the input of the LM head); no logits are formed."""
    model_kwargs.setdefault("use_cache", False)
    out = _run_backbone(_causal_lm(model), input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
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


def completion_logprobs(model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, *,
                        prompt_mask: Optional[torch.Tensor] = None, completion_mask: Optional[torch.Tensor] = None,
                        temperature: float = 1.0, return_entropy: bool = False, backend: str = "auto",
                        **model_kwargs) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Log-probabilities ``[B, C]`` of ``completion_ids`` ``[B, C]`` given ``prompt_ids`` ``[B, P]``, aligned
    for you: the hidden state at position ``P + t - 1`` scores completion token ``t``, so the first
    completion token is scored by the prompt's last position and the completion's last hidden state is
    not used (it predicts a token that was not sampled).

    ``prompt_mask`` / ``completion_mask`` (``[B, P]`` / ``[B, C]``, 1 = real token; e.g. left-padded
    prompts and right-padded completions, as TRL pads them) become the attention mask; completion
    positions with mask 0 give 0 and no gradient. With ``return_entropy`` also returns the entropy of
    each scored next-token distribution. This is what RL trainers call "per-token log-probs of the
    completion"; ``fusedloss.grpo_loss(hidden, ...)`` wants the same rows, which are
    ``last_hidden_state(model, cat(prompt, completion))[:, P - 1:-1]``."""
    for name, t in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a [batch, length] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(f"prompt_ids has {prompt_ids.shape[0]} rows but completion_ids has "
                         f"{completion_ids.shape[0]}: one prompt per completion")
    if prompt_ids.shape[1] < 1:
        raise ValueError("prompt_ids must hold at least one token: the first completion token is scored by "
                         "the last prompt position")
    p = prompt_ids.shape[1]
    input_ids = torch.cat((prompt_ids, completion_ids), dim=1)
    attention_mask = None
    if prompt_mask is not None or completion_mask is not None:
        pm = torch.ones_like(prompt_ids) if prompt_mask is None else prompt_mask.to(prompt_ids.dtype)
        cm = torch.ones_like(completion_ids) if completion_mask is None else completion_mask.to(prompt_ids.dtype)
        attention_mask = torch.cat((pm, cm), dim=1)
    hidden = last_hidden_state(model, input_ids, attention_mask, **model_kwargs)[:, p - 1:-1]
    head = lm_head(model)
    targets = completion_ids
    if completion_mask is not None:
        targets = targets.masked_fill(completion_mask == 0, -100)
    return fusedloss.token_logprobs(
        hidden.to(head.weight.device), head.weight, targets.to(head.weight.device), bias=head.bias,
        temperature=temperature, logit_scale=head.logit_scale, softcap=head.softcap, ignore_index=-100,
        return_entropy=return_entropy, backend=backend,
    )


# ------------------------------------------------------------------------------------------------ patch
#
# How the patch works (docs/design.md, "Configuration"): the model keeps its own forward. Three instance
# attributes are set, and ``unpatch`` removes them:
#
#   * ``lm.forward``: with ``labels`` it arms a capture, calls the model's own forward, and returns its
#     output with ``logits=None``; without labels it is the model's own forward, untouched.
#   * ``head.forward``: while armed it records its input (the final hidden states, already sliced by
#     ``logits_to_keep``) and returns an empty ``[..., 0]`` placeholder, so no ``[tokens, vocab]`` product
#     runs; otherwise it is the head's own forward (generation, evaluation).
#   * ``lm.loss_function`` (transformers' setter): the model calls it with ``labels``,
#     ``num_items_in_batch``, ``shift_labels``, ``ignore_index`` exactly as it would call
#     ``ForCausalLMLoss``; it computes that same loss from the recorded hidden states with
#     ``fusedloss.cross_entropy``. Whatever the model does around its loss (an MoE router loss added to it,
#     gradient checkpointing of its layers, accelerate's output casting) stays the model's own.
#
# The three are methods bound to their module, and the patch state lives in the modules' ``__dict__``: a
# ``copy.deepcopy`` of a patched model (TRL's reference models are made that way) is a patched copy that
# runs its own parameters. Per-architecture code is not needed: every ``*ForCausalLM`` of transformers 5
# calls ``self.lm_head`` once and ``self.loss_function`` once. A model that does not is refused at the
# first labelled call, loudly.

_PATCH_ATTR = "_fusedloss_patch"


class _Patch:
    """What ``patch`` changed on one model, the capture of one labelled forward, and how to undo it."""

    def __init__(self, lm, head, backend: str):
        import inspect

        self.lm, self.head, self.backend = lm, head, backend
        self.saved = {"lm.forward": lm.__dict__.get("forward"), "head.forward": head.__dict__.get("forward"),
                      "lm._loss_function": lm.__dict__.get("_loss_function")}
        self.had_loss_function = "_loss_function" in lm.__dict__
        names = [q.name for q in inspect.signature(type(lm).forward).parameters.values()
                 if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)][1:]  # without self
        self.labels_at = names.index("labels") if "labels" in names else None
        self.keep_at = names.index("logits_to_keep") if "logits_to_keep" in names else None
        self.armed = False
        self.hidden = None
        self.logits_to_keep = 0
        self.loss_calls = 0

    def model_forward(self):
        """The forward the patch wraps: an earlier instance attribute (e.g. accelerate's), else the class's."""
        saved = self.saved["lm.forward"]
        return saved if saved is not None else type(self.lm).forward.__get__(self.lm)

    def head_forward(self):
        saved = self.saved["head.forward"]
        return saved if saved is not None else type(self.head).forward.__get__(self.head)


def _keep_positions(labels: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The labels of the positions the model kept before its head (transformers' ``logits_to_keep``)."""
    if isinstance(logits_to_keep, int):
        return labels if logits_to_keep == 0 else labels[:, -logits_to_keep:]
    if logits_to_keep.dim() == 2:
        if logits_to_keep.dtype == torch.bool:
            return labels[logits_to_keep.to(labels.device)]
        return torch.take_along_dim(labels, logits_to_keep.to(labels.device), dim=1)
    return labels[:, logits_to_keep.to(labels.device)]


def _patched_forward(lm, *args, **kwargs):
    """``lm.forward`` of a patched model (bound to ``lm``)."""
    state = lm.__dict__[_PATCH_ATTR]
    forward = state.model_forward()
    labels = kwargs.get("labels")
    if labels is None and state.labels_at is not None and len(args) > state.labels_at:
        labels = args[state.labels_at]
    if labels is None:
        return forward(*args, **kwargs)
    keep = kwargs.get("logits_to_keep",
                      args[state.keep_at] if state.keep_at is not None and len(args) > state.keep_at else 0)
    return_dict = kwargs.pop("return_dict", None)
    want_tuple = return_dict is False or (return_dict is None and getattr(lm.config, "return_dict", True) is False)
    if want_tuple or return_dict is not None:
        kwargs["return_dict"] = True  # the placeholder logits must not reach a tuple
    state.armed, state.hidden, state.logits_to_keep, state.loss_calls = True, None, keep, 0
    try:
        out = forward(*args, **kwargs)
    finally:
        state.armed, state.hidden = False, None
    if state.loss_calls != 1:
        raise RuntimeError(f"fusedloss patch: {type(lm).__name__} did not compute its loss through "
                           "self.loss_function; this architecture is not supported by "
                           "integrations.transformers.patch")
    # A new output without the field: a ModelOutput keeps a key once set, even when set to None.
    out = type(out)(**{k: v for k, v in out.items() if k != "logits"})
    return out.to_tuple() if want_tuple else out


def _patched_head_forward(head, hidden, *args, **kwargs):
    """``head.forward`` of a patched model's LM head (bound to the head)."""
    state = head.__dict__[_PATCH_ATTR]
    if not state.armed:
        return state.head_forward()(hidden, *args, **kwargs)
    if state.hidden is not None:
        raise RuntimeError("fusedloss patch: the LM head ran twice in one forward; this architecture is not "
                           "supported by integrations.transformers.patch")
    state.hidden = hidden
    return hidden.new_empty(*hidden.shape[:-1], 0)


def _fused_causal_lm_loss(lm, logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                          shift_labels=None, **kwargs):
    """transformers' ``ForCausalLMLoss`` computed from the hidden states the head received: the labels
    shifted left by one (or ``shift_labels`` as given), ``ignore_index`` skipped, the mean over valid
    tokens, or the sum / ``num_items_in_batch`` under gradient accumulation (bound to ``lm``)."""
    state = lm.__dict__[_PATCH_ATTR]
    hidden, state.hidden = state.hidden, None
    if hidden is None:
        raise RuntimeError("fusedloss patch: the model computed its loss without calling its patched LM head "
                           "first; if the head was replaced after patch() (resize_token_embeddings, ...), call "
                           "patch(model) again, else this architecture is not supported by "
                           "integrations.transformers.patch")
    state.loss_calls += 1
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = _keep_positions(shift_labels, state.logits_to_keep)
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"fusedloss patch: the head scored positions of shape {tuple(hidden.shape[:-1])} "
                         f"but the labels give {tuple(targets.shape)}")
    head = _read_head(lm)  # a DTensor head goes to the core as it is
    hidden = hidden.to(head.weight.device)
    loss = fusedloss.cross_entropy(
        hidden, head.weight, targets.to(hidden.device), bias=head.bias, ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum", logit_scale=head.logit_scale,
        softcap=head.softcap, backend=state.backend)
    if num_items_in_batch is not None:
        # transformers divides the sum by num_items_in_batch as given (int or tensor) and never checks it:
        # cross_entropy(num_items_in_batch=) would refuse n <= 0 with a host sync, in a trainer's hot loop
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def patch(model, *, backend: str = "auto"):
    """Make ``model(..., labels=labels).loss`` come from the hidden states, without the logits.

    ``model`` is a transformers causal LM (``*ForCausalLM``, or a PEFT model wrapping one). After
    ``patch(model)``, a forward with ``labels`` returns the model's own causal-LM loss (labels shifted by
    one, ``-100`` ignored, the mean over valid tokens; with ``num_items_in_batch``, as the ``Trainer``
    passes it under gradient accumulation, the sum divided by it; ``shift_labels`` used as given) computed by
    ``fusedloss.cross_entropy`` from the final hidden states and the head (tied embeddings, a LoRA on the
    head, ``final_logit_softcapping`` and logit scales included), and ``out.logits is None``. With
    ``logits_to_keep``, the loss covers the positions kept. A forward without labels (generation, evaluation
    that needs logits) is the model's own. Works with gradient checkpointing, ``torch.compile``, accelerate
    and the HF ``Trainer``; a ``copy.deepcopy`` of a patched model is patched too. Patch before wrapping the
    model (``torch.compile``, DDP, FSDP). Returns ``model``; ``unpatch(model)`` restores it exactly.
    ``backend`` is passed to ``fusedloss.cross_entropy``.

    Example::

        model = fusedloss.integrations.transformers.patch(AutoModelForCausalLM.from_pretrained(name))
        loss = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
    """
    import functools
    import types

    from ..core import backends as _backends

    if backend not in _backends.BACKEND_NAMES:
        raise ValueError(f"backend must be one of {_backends.BACKEND_NAMES}, got {backend!r}")
    lm = _causal_lm(model)
    if not (hasattr(lm, "get_output_embeddings") and hasattr(lm, "loss_function")):
        raise ValueError(f"{type(lm).__name__} is not a transformers causal LM with an LM head "
                         "(get_output_embeddings() and loss_function are needed)")
    head = lm.get_output_embeddings()
    if _PATCH_ATTR in lm.__dict__:
        if lm.__dict__[_PATCH_ATTR].head is head:
            lm.__dict__[_PATCH_ATTR].backend = backend  # idempotent: a second patch only changes the backend
            return model
        unpatch(model)  # the head was replaced since (resize_token_embeddings, ...): patch the new one
    if head is None:
        raise ValueError(f"{type(lm).__name__} has no LM head (get_output_embeddings() returned None)")
    from transformers.loss.loss_utils import ForCausalLMLoss

    if lm.loss_function is not ForCausalLMLoss:
        raise ValueError(f"{type(lm).__name__} computes its loss with {getattr(lm.loss_function, '__name__', '?')}, "
                         "not transformers' ForCausalLMLoss: fusedloss only replaces the causal-LM loss")
    _read_head(lm)  # unsupported heads (LoRA variants, ...) are refused now, not mid-training

    state = _Patch(lm, head, backend)
    lm.__dict__[_PATCH_ATTR] = state
    head.__dict__[_PATCH_ATTR] = state
    def forward(self, *args, **kwargs):
        return _patched_forward(self, *args, **kwargs)

    # The signature users and the Trainer see is the model's own (the Trainer keeps the dataset columns
    # the forward names, and passes num_items_in_batch when it takes **kwargs).
    functools.update_wrapper(forward, type(lm).forward)
    lm.forward = types.MethodType(forward, lm)
    head.forward = types.MethodType(_patched_head_forward, head)
    lm.loss_function = types.MethodType(_fused_causal_lm_loss, lm)
    return model


def unpatch(model):
    """Undo ``patch(model)``: the model's forward, its head's forward and its loss function are the ones it
    had before (instance attributes that were not there are removed). Returns ``model``; a model that is
    not patched is returned unchanged."""
    lm = _causal_lm(model)
    state = lm.__dict__.pop(_PATCH_ATTR, None)
    if state is None:
        return model
    state.head.__dict__.pop(_PATCH_ATTR, None)
    for obj, attr, key in ((lm, "forward", "lm.forward"), (state.head, "forward", "head.forward")):
        if state.saved[key] is None:
            obj.__dict__.pop(attr, None)
        else:
            obj.__dict__[attr] = state.saved[key]
    if state.had_loss_function:
        lm.__dict__["_loss_function"] = state.saved["lm._loss_function"]
    else:
        lm.__dict__.pop("_loss_function", None)
    return model
