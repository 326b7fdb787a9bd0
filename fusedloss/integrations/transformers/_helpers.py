"""The helpers: ``lm_head``, ``last_hidden_state``, ``causal_lm_logprobs`` and ``completion_logprobs``, each
from one tapped forward of the model (``_tap``)."""

from __future__ import annotations

from typing import Optional, Union

import torch

import fusedloss

from ...errors import UnsupportedModelError
from ._head import LMHead, _as_lm_head, _causal_lm, _head_tensors, _output_head, _text_config, _Transform
from ._tap import _OBSERVED, _observed_forward, _refuse


def lm_head(model) -> LMHead:
    """The head of a causal LM (or a PEFT model wrapping one) and the logit processing its forward applies.

    Pass its fields to any fusedloss function, with the rows ``last_hidden_state`` returns, so that soft-capped
    (Gemma 2/3, RecurrentGemma, xLSTM), scaled (Cohere, Granite, ...) and vocabulary-cut (Inkling) heads give
    the model's own logits::

        head = lm_head(model)
        loss = fusedloss.cross_entropy(hidden, head.weight, labels, **head.options)

    The processing is the one observed on the model's forward: the last ``last_hidden_state`` /
    ``causal_lm_logprobs`` / ``completion_logprobs`` / patched labelled call on this model, or, before any, a
    one-sequence probe forward run here (under ``torch.no_grad``, the random state restored). A model whose
    processing fusedloss cannot reproduce is refused with the reason.

    ``weight`` and ``bias`` are the head's parameters themselves, never gathered copies: under FSDP2, a head
    that is its own FSDP unit is read here as its sharded DTensor, and fusedloss gathers it and averages its
    gradient across ranks itself (docs/design.md, "Distributed"). Gathering it here with ``full_tensor()``
    would give each rank's shard only its own tokens' gradient, not the average FSDP takes."""
    lm = _causal_lm(model)
    head = _output_head(lm)
    transform = _OBSERVED.get(head)
    if transform is None:
        _head_tensors(head)  # a head whose weight fusedloss cannot read (DoRA, ...) is refused with that reason
        transform = _probe_forward(lm)
    return _as_lm_head(head, transform)


def _probe_forward(lm) -> _Transform:
    """Run the model once on a two-token sequence to observe its logit processing (``lm_head`` before any
    other call)."""
    device = next((p.device for p in lm.parameters()), torch.device("cpu"))
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            _, transform = _observed_forward(lm, dict(input_ids=ids))
    except UnsupportedModelError:
        raise
    except Exception as error:
        raise RuntimeError(f"fusedloss: could not run {type(lm).__name__} on a probe sequence to observe its logit "
                           "processing; call last_hidden_state(model, input_ids, ...) first (lm_head then "
                           "reads what that call observed)") from error
    return transform


def _hidden_and_head(model, input_ids, attention_mask, model_kwargs,
                     outputs: Optional[list] = None) -> tuple[torch.Tensor, LMHead]:
    lm = _causal_lm(model)
    kwargs = dict(model_kwargs, input_ids=input_ids)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    hidden, transform = _observed_forward(lm, kwargs, outputs)
    if tuple(hidden.shape[:-1]) != tuple(input_ids.shape):
        _refuse(lm, f"feeds its LM head hidden states of shape {tuple(hidden.shape)}, not one row per input "
                    f"position ({tuple(input_ids.shape)})")
    return hidden, _as_lm_head(lm.get_output_embeddings(), transform)


def last_hidden_state(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                      **model_kwargs) -> torch.Tensor:
    """``[B, T, D]``: the input of the LM head, from the model's own forward (whatever the model does between its
    backbone and the head's weight, a BERT-style transform, a scaled input, is included). No logits are formed:
    the head runs on a few probe rows only, which check ``lm_head(model)``'s logit processing against the
    model's. Extra keyword arguments go to the model's forward (``position_ids``, ``pixel_values``, ...)."""
    return _hidden_and_head(model, input_ids, attention_mask, model_kwargs)[0]


def causal_lm_logprobs(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                       labels: Optional[torch.Tensor] = None, temperature: float = 1.0,
                       return_entropy: bool = False, backend: str = "auto", **model_kwargs
                       ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Per-token log-probabilities ``[B, T-1]`` of the next tokens ``input_ids[:, 1:]`` under ``model``,
    computed from the head's input and the head with ``fusedloss.token_logprobs``.

    Position ``t`` scores ``input_ids[:, t + 1]`` given the prefix, with the model's own logit processing
    (observed on its forward: scales, soft-caps, a vocabulary cut) and then ``temperature``. Positions whose
    target is padding (``attention_mask[:, t + 1] == 0``) or, when ``labels`` (``[B, T]``, unshifted, as for the
    model's own loss) is given, whose label is -100, are 0 in the outputs and carry no gradient.
    With ``return_entropy`` also returns the entropy of each next-token distribution (same shape, 0 at
    those positions). Differentiable with respect to the model's parameters. Extra keyword arguments go
    to the model's forward (``position_ids``, ``pixel_values``, ...).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}")
    hidden, head = _hidden_and_head(model, input_ids, attention_mask, model_kwargs)
    targets = (input_ids if labels is None else labels)[:, 1:]
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, 1:] == 0, -100)
    return _token_logprobs(hidden[:, :-1], head, targets, temperature, return_entropy, backend)


def _token_logprobs(hidden, head: LMHead, targets, temperature, return_entropy, backend):
    # With a `device_map` split, the last layers can run on another device than the head.
    device = head.weight.device
    return fusedloss.token_logprobs(hidden.to(device), head.weight, targets.to(device), temperature=temperature,
                                    ignore_index=-100, return_entropy=return_entropy, backend=backend,
                                    **head.options)


def _require_left_padding_masked(model, prompt_ids: torch.Tensor) -> None:
    """Without ``prompt_mask``, a prompt that starts with the model's pad token is left padding the model would
    attend to: refuse it rather than score the completion under a different context."""
    config = _text_config(_causal_lm(model).config)
    pad, bos = getattr(config, "pad_token_id", None), getattr(config, "bos_token_id", None)
    if not isinstance(pad, int) or pad == bos or prompt_ids.shape[1] < 2:
        return
    padded = (prompt_ids[:, 0] == pad).nonzero().flatten()
    if padded.numel():
        raise ValueError(f"prompt_ids row {padded[0].item()} starts with the pad token ({pad}): left-padded prompts "
                         "need prompt_mask (1 = real token), else the model attends to the padding and the "
                         "log-probs are those of another context")


def completion_logprobs(model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, *,
                        prompt_mask: Optional[torch.Tensor] = None, completion_mask: Optional[torch.Tensor] = None,
                        temperature: float = 1.0, return_entropy: bool = False, backend: str = "auto",
                        **model_kwargs) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Log-probabilities ``[B, C]`` of ``completion_ids`` ``[B, C]`` given ``prompt_ids`` ``[B, P]``, aligned
    for you: the head input at position ``P + t - 1`` scores completion token ``t``, so the first
    completion token is scored by the prompt's last position and the completion's last position is
    not used (it predicts a token that was not sampled).

    ``prompt_mask`` / ``completion_mask`` (``[B, P]`` / ``[B, C]``, 1 = real token; e.g. left-padded
    prompts and right-padded completions, as TRL pads them) become the attention mask; completion
    positions with mask 0 give 0 and no gradient. Left-padded prompts need ``prompt_mask``: a prompt that
    starts with the model's pad token without it is refused. With ``return_entropy`` also returns the
    entropy of each scored next-token distribution. This is what RL trainers call "per-token log-probs of the
    completion"; ``fusedloss.grpo_loss(hidden, ...)`` wants the same rows, which are
    ``last_hidden_state(model, cat(prompt, completion))[:, P - 1:-1]`` with ``**lm_head(model).options``."""
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
    if prompt_mask is None:
        _require_left_padding_masked(model, prompt_ids)
    p = prompt_ids.shape[1]
    input_ids = torch.cat((prompt_ids, completion_ids), dim=1)
    attention_mask = None
    if prompt_mask is not None or completion_mask is not None:
        pm = torch.ones_like(prompt_ids) if prompt_mask is None else prompt_mask.to(prompt_ids.dtype)
        cm = torch.ones_like(completion_ids) if completion_mask is None else completion_mask.to(prompt_ids.dtype)
        attention_mask = torch.cat((pm, cm), dim=1)
    hidden, head = _hidden_and_head(model, input_ids, attention_mask, model_kwargs)
    targets = completion_ids
    if completion_mask is not None:
        targets = targets.masked_fill(completion_mask == 0, -100)
    return _token_logprobs(hidden[:, p - 1:-1], head, targets, temperature, return_entropy, backend)
