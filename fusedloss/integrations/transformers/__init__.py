"""Hugging Face ``transformers`` causal LMs as fusedloss inputs: the hidden states the LM head receives and the
head, never the ``[batch, seq, vocab]`` logits.

A causal LM computes ``logits = post(head_input @ lm_head.weight.T + lm_head.bias)``, where ``post`` is the
model family's own logit processing. fusedloss reproduces ``post`` when it is a scale, a soft-cap and a cut of
the vocabulary (``logit_scale``, ``softcap``, ``vocab_size``: docs/design.md, "The statistics problem"). No
table of architectures says what ``post`` is: the model's own forward shows it. Every call runs the model's
forward with its head tapped: the head records its input (the rows fusedloss scores) and returns its own output
on a few probe rows only, the model post-processes those rows as it always does, and the integration compares
what comes out with fusedloss's formula on the same rows, values and (once, with autograd on) the gradient with
respect to the head's output and the parameters the post-processing reaches. A model whose ``post`` is not one
the formula reproduces, or whose head is not a plain linear layer, is refused with the reason, never given a
silent wrong number: ``UnsupportedModelError`` (a ``RuntimeError``, also ``fusedloss.UnsupportedModelError``)
when the model's forward shows it, ``ValueError`` when the head's module does.

``patch(model)`` makes the model's own ``model(input_ids, labels=labels).loss`` come from the head input (its
logits are never formed); ``last_hidden_state``, ``causal_lm_logprobs`` and ``completion_logprobs`` run the
model's forward the same way; ``lm_head(model)`` gives the head and the observed ``post``.

Handled: tied embeddings (the head weight *is* the embedding parameter; its gradient collects both uses),
PEFT-wrapped models (adapters run in the model's forward; a LoRA on the head itself is folded into the head
weight; PEFT's heads for added tokens, ``modules_to_save=["lm_head"]`` and ``trainable_token_indices``, are read
as the weight they apply), FSDP2 (the head goes to fusedloss as the parameter it is: a sharded DTensor when the
head is its own FSDP unit, which the core gathers once per forward and once per backward and whose gradient it
reduce-scatters and averages as FSDP does, docs/design.md "Distributed"), ``device_map`` splits (hidden states
move to the head's device), DeepSpeed ZeRO-3 heads (checked inside the head's forward, where ZeRO-3 has
gathered them; fusedloss's loss gathers them again), several threads calling one model, ``nn.DataParallel``
replicas, ``torch.save`` / pickle / ``copy.deepcopy`` of a patched model (it stays patched). Not handled:
prompt-learning PEFT (virtual tokens live in the PEFT forward), a LoRA on an FSDP2-sharded or ZeRO-3 head.
"""

from ...errors import UnsupportedModelError
from ._head import LMHead, logit_postprocessing
from ._helpers import causal_lm_logprobs, completion_logprobs, last_hidden_state, lm_head
from ._patch import patch, unpatch

__all__ = ["LMHead", "UnsupportedModelError", "causal_lm_logprobs", "completion_logprobs", "last_hidden_state",
           "lm_head", "logit_postprocessing", "patch", "unpatch"]
