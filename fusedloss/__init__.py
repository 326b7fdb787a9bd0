"""fusedloss: log-probs, entropy, KL, cross-entropy, distillation, GRPO and the preference losses (DPO, KTO,
ORPO, CPO/SimPO) straight from hidden states and the lm_head weight, never materialising the
[tokens x vocab] logits.

Three ways in, from the least code to the most control:

1. A Hugging Face model: ``fusedloss.integrations.transformers.patch(model)`` makes
   ``model(input_ids, labels=...)`` return the model's own causal-LM loss without its logits
   (``unpatch(model)`` restores it).
2. A trainer: ``fusedloss.integrations.trl.enable()`` routes TRL's trainers
   through fusedloss (their fused LM-head paths: GRPO, RLOO, DPO, KTO, SFT, distillation);
   ``fusedloss.integrations.verl.enable()``, ``.openrlhf`` and ``.axolotl`` do the same for
   those frameworks.
3. The functional API, from the hidden states and the head's weight: ``token_logprobs``, ``cross_entropy``,
   ``distillation_loss``, ``sparse_distillation_loss``, ``grpo_loss``, ``dpo_loss``, ``kto_loss``,
   ``orpo_loss``, ``cpo_loss``; ``group_advantages`` for GRPO's advantages; ``topk_logprobs`` for a
   teacher's top-k log-probs (the input of ``sparse_distillation_loss``), ``multi_teacher_topk_logprobs`` and
   ``distillation_loss(..., teachers=[Teacher(...), ...], teacher_index=...)`` for several teachers.
   ``fusedloss.nn`` wraps each loss as a ``torch.nn.Module``.

``backend_status()`` says which backends (torch, Triton, CUDA) run here and why not; ``release_workspace()``
frees the workspace the CUDA backend keeps between calls; ``estimate`` says what
fusedloss would save for a model and a batch (``python -m fusedloss estimate``). ``fusedloss.reference`` holds
the same functions on materialised logits: the executable specification every backend is tested against.
"""

from .core import registry as _backends
from .errors import UnsupportedModelError
from .losses import (
    cpo_loss,
    cross_entropy,
    distillation_loss,
    dpo_loss,
    group_advantages,
    grpo_loss,
    kto_loss,
    multi_teacher_topk_logprobs,
    orpo_loss,
    sparse_distillation_loss,
    token_logprobs,
    topk_logprobs,
)
from .sizing import estimate
from .types import CPODetails, DPODetails, GroupAdvantages, GRPODetails, KTODetails, ORPODetails, Teacher, TopK

__version__ = "0.1.0"


# Submodules reachable as attributes after `import fusedloss`, imported on first use: `reference` and `nn`
# cost little, but `integrations` needs transformers/TRL, which `import fusedloss` must never pull in.
_LAZY_SUBMODULES = ("reference", "nn", "integrations")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    # The public names and the submodules a user reaches, not the modules the package imports internally.
    return sorted(set(__all__) | set(_LAZY_SUBMODULES) | {"__version__"})


def backend_status() -> dict:
    """``{"torch": ..., "triton": ..., "cuda": ..., "gpu": ...}``: "available", or why that backend cannot run
    here; ``"gpu"``: which GPU model's figures the plans use for the current device."""
    return {**_backends.status(), "gpu": _backends.gpu_model()}


def release_workspace(device=None) -> int:
    """Free the logits workspace the CUDA backend keeps between calls (one buffer per device and stream, up to
    ``workspace_mb``: 4 GiB by default), on every device or only on ``device``, and return the bytes released.
    The memory goes back to torch's caching allocator: call ``torch.cuda.empty_cache()`` after it to return it to
    the driver (``empty_cache`` alone does not free the kept buffers). The next call allocates its workspace
    again. Useful after training, between phases that use different models, or when a side stream's calls are
    done."""
    return _backends.release_workspace(device)


__all__ = [
    "CPODetails",
    "DPODetails",
    "GRPODetails",
    "GroupAdvantages",
    "KTODetails",
    "ORPODetails",
    "Teacher",
    "TopK",
    "UnsupportedModelError",
    "backend_status",
    "cpo_loss",
    "cross_entropy",
    "distillation_loss",
    "dpo_loss",
    "estimate",
    "group_advantages",
    "grpo_loss",
    "kto_loss",
    "multi_teacher_topk_logprobs",
    "orpo_loss",
    "release_workspace",
    "sparse_distillation_loss",
    "token_logprobs",
    "topk_logprobs",
]
