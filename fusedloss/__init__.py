"""fusedloss: log-probs, entropy, KL, GRPO, DPO and cross-entropy straight from hidden states and the
lm_head weight, never materialising the [tokens x vocab] logits.

Public API (SPEC section 3): ``token_logprobs``, ``cross_entropy``, ``distillation_loss``, ``grpo_loss``,
``dpo_loss``, ``group_advantages``, ``backend_status``. ``fusedloss.reference`` holds the same functions on
materialised logits: the executable specification every backend is tested against.
"""

from __future__ import annotations

from .core import backends as _backends
from .losses import cross_entropy, distillation_loss, dpo_loss, group_advantages, grpo_loss, token_logprobs
from .types import DPODetails, GroupAdvantages, GRPODetails

__version__ = "0.1.0"


def backend_status() -> dict:
    """``{"torch": ..., "triton": ..., "cuda": ...}``: "available", or why that backend cannot run here."""
    return _backends.status()


__all__ = [
    "DPODetails",
    "GRPODetails",
    "GroupAdvantages",
    "backend_status",
    "cross_entropy",
    "distillation_loss",
    "dpo_loss",
    "group_advantages",
    "grpo_loss",
    "token_logprobs",
]
