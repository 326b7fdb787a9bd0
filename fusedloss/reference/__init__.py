"""The executable specification: every public loss of fusedloss, written the obvious way.

Each function here has the name and the arguments (minus ``backend``) of its public counterpart, and
computes the same thing on *materialised* logits with plain PyTorch: ``logits = hidden @ weight.T + bias``,
then logit_scale, soft-cap and temperature (docs/design.md, "The statistics problem"), then
``torch.log_softmax``. Nothing is tiled, fused or clever, so that it can be read against the formulas line
by line. Every backend is tested against it.

Precision. In float64 this is the ground truth. For fp32/bf16/fp16 inputs it is the *naive same-dtype
path* of a plain trainer: the product ``hidden @ weight.T + bias`` is computed in the input dtype (so half
inputs give logits rounded to half), then upcast to fp32 for the transform and the softmax. The fused
path's error is judged against the error of this path (docs/design.md, "Numerical doctrine"). Per-token
outputs and losses are fp32 (float64 for float64 inputs); gradients reach ``hidden``, ``weight`` and ``bias``
through autograd.

Ignored positions (``ignore_index`` targets, ``completion_mask == 0``) give 0 per-token outputs and no
gradient; they are selected with ``torch.where`` rather than multiplied by a mask, so that an inf or NaN
computed at an ignored position can never leak into the result. A mean over zero valid tokens is 0.
Validation is deliberately light: the public API validates, the reference only computes.
"""

from ._formulas import logits
from ._grpo import group_advantages, grpo_loss
from ._preference import cpo_loss, dpo_loss, kto_loss, orpo_loss
from ._token import cross_entropy, distillation_loss, sparse_distillation_loss, token_logprobs, topk_logprobs

__all__ = [
    "logits",
    "token_logprobs",
    "cross_entropy",
    "distillation_loss",
    "sparse_distillation_loss",
    "topk_logprobs",
    "grpo_loss",
    "dpo_loss",
    "kto_loss",
    "orpo_loss",
    "cpo_loss",
    "group_advantages",
]


def __dir__():
    # What the module offers (``__all__``), not the submodules it is written in.
    return sorted(__all__)
