"""The losses: each a short module of per-token math on top of the statistics core (SPEC sections 4-5)."""

from .advantages import group_advantages
from .cross_entropy import cross_entropy
from .distillation import distillation_loss
from .dpo import dpo_loss
from .grpo import grpo_loss
from .token_logprobs import token_logprobs

__all__ = ["cross_entropy", "distillation_loss", "dpo_loss", "grpo_loss", "group_advantages", "token_logprobs"]
