"""The losses: each a short module of per-token math on top of the statistics core (docs/design.md,
"Losses as per-token math")."""

from .advantages import group_advantages
from .cpo import cpo_loss
from .cross_entropy import cross_entropy
from .distillation import distillation_loss
from .dpo import dpo_loss
from .grpo import grpo_loss
from .kto import kto_loss
from .orpo import orpo_loss
from .sparse_distillation import sparse_distillation_loss
from .token_logprobs import token_logprobs
from .topk import multi_teacher_topk_logprobs, topk_logprobs

__all__ = ["cpo_loss", "cross_entropy", "distillation_loss", "dpo_loss", "grpo_loss", "group_advantages",
           "kto_loss", "multi_teacher_topk_logprobs", "orpo_loss", "sparse_distillation_loss", "token_logprobs",
           "topk_logprobs"]
