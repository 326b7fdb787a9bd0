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


# Submodules reachable as attributes after `import fusedloss`, imported on first use: `reference` and `nn`
# cost little, but `integrations` needs transformers/TRL, which `import fusedloss` must never pull in.
_LAZY_SUBMODULES = ("reference", "nn", "integrations", "types")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


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
