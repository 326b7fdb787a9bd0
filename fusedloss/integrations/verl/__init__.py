"""Run verl's fused log-prob and entropy sites through fusedloss.

verl computes the per-token log-probs and entropy of its actor and reference model in one of three
functions when ``actor_rollout_ref.model.use_fused_kernels=True``; its policy losses then work on those
``[tokens]`` tensors. ``enable()`` swaps the functions, at the module attributes verl looks them up from:

- ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (``impl_backend`` ``torch`` and ``liger``),
  built by the forward that verl installs on Hugging Face models (FSDP / FSDP2 engines);
- ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (``impl_backend=triton``);
- the same function as bound by ``verl.models.mcore.model_forward_fused`` and
  ``verl.models.mcore.model_forward_1f1b_overlap`` (Megatron engine), which passes the tensor-parallel
  group and this rank's rows of the head: fusedloss runs it vocabulary-parallel and leaves the hidden
  gradient as this rank's partial sum (``reduce_hidden_grad=False``), the contract of verl's kernel, since
  Megatron's sequence-parallel gather reduces it (reducing it here too would double it). With sequence
  parallelism off, verl calls the kernel outside ``ColumnParallelLinear`` and nothing reduces it, with
  verl's kernel as with this one.

Better than a one-to-one swap: verl's Hugging Face forwards hand the kernel ``self.lm_head.weight`` only, so a
soft-capped (Gemma 2/3), scaled (Cohere, Granite, ...), biased or LoRA-adapted head would be scored without
its logit processing. ``enable()`` also wraps ``verl.models.transformers.monkey_patch.patch_forward_with_backends``
to remember the models verl patches; the swapped sites then read such a model's head with
``integrations.transformers.lm_head`` (bias, logit scale, soft-cap, LoRA folded in), and a model whose head
they cannot read is refused when verl patches it (an adapter added afterwards: at the first call). The entropy
is fp32 (verl's torch path returns it in the hidden dtype); float64 inputs stay float64. ``vocab_size``
leaves the head rows at or past it out of every softmax (Megatron pads the vocabulary to a multiple of the TP
size): off by default, for parity with verl.

verl trains in Ray worker processes, so ``enable()`` has to run there, before the model is built:
``actor_rollout_ref.model.external_lib=fusedloss.integrations.verl.auto`` imports
``fusedloss.integrations.verl.auto`` in every worker, which calls ``enable()`` (backend and vocab_size from the
environment variables ``FUSEDLOSS_VERL_BACKEND`` and ``FUSEDLOSS_VERL_VOCAB_SIZE`` when set).

Distillation is not routed: verl 0.9's distillation losses (``verl/trainer/distillation/``, forward KL on the
teacher's top-k) take the student's logits, which the actor has already formed when they are called, so there
is no hidden-state site to swap. A custom loss can call ``fusedloss.topk_logprobs`` (teacher side) and
``fusedloss.sparse_distillation_loss`` or ``fusedloss.distillation_loss`` (student side, vocabulary-parallel
with the tensor-parallel group) instead; ``examples/onpolicy_distillation.py`` shows both.

Supported: ``verl>=0.9,<0.10``; ``enable()`` raises ``RuntimeError`` naming the version otherwise.
"""

from __future__ import annotations

import importlib
import weakref
from typing import Optional

import torch

import fusedloss

from ...core import registry as _backends
from .. import _switch
from .. import transformers as _hf

__all__ = ["SUPPORTED_VERL", "FusedLinearForPPO", "disable", "enable", "enabled", "is_enabled",
           "linear_cross_entropy"]

SUPPORTED_VERL = ">=0.9,<0.10"

_FSDP_SITES = (
    ("verl.utils.experimental.torch_functional", "FusedLinearForPPO"),
    ("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy"),
    ("verl.models.transformers.monkey_patch", "patch_forward_with_backends"),
)
# Megatron's modules bind linear_cross_entropy at their import: patched when megatron-core imports.
_MEGATRON_SITES = (
    ("verl.models.mcore.model_forward_fused", "linear_cross_entropy"),
    ("verl.models.mcore.model_forward_1f1b_overlap", "linear_cross_entropy"),
)

_originals: dict = {}  # (module, attribute) -> verl's object, recorded before anything is patched
_state = {"backend": "auto", "vocab_size": None, "enabled": False}
_models: "weakref.WeakSet" = weakref.WeakSet()  # the Hugging Face models verl gave a fused forward


def _check_verl_version():
    try:
        import verl
    except ImportError as exc:
        raise ImportError("fusedloss.integrations.verl needs verl (pip install 'verl>=0.9,<0.10')") from exc
    _switch.check_version("fusedloss.integrations.verl", "verl", verl.__version__, SUPPORTED_VERL,
                          "verl's own fused kernels")


def _megatron_available() -> bool:
    try:
        importlib.import_module("megatron.core")
    except ImportError:
        return False
    return True


def _sites():
    names = _FSDP_SITES + (_MEGATRON_SITES if _megatron_available() else ())
    # Import every module before patching any: a Megatron module imported after the kernel's own module
    # was patched would bind (and a later record would keep) the replacement instead of verl's function.
    modules = [(importlib.import_module(module_name), module_name, attr) for module_name, attr in names]
    for module, module_name, attr in modules:
        if not hasattr(module, attr):
            raise RuntimeError(f"{module_name}.{attr} not found: this verl version moved its fused kernels, and "
                               f"fusedloss.integrations.verl does not know where to hook in")
    return modules


_REPLACEMENTS = {
    "FusedLinearForPPO": lambda: FusedLinearForPPO,
    "linear_cross_entropy": lambda: linear_cross_entropy,
    "patch_forward_with_backends": lambda: _patch_forward_with_backends,
}


def enable(backend: str = "auto", *, vocab_size: Optional[int] = None) -> None:
    """Route verl's fused log-prob / entropy kernels through fusedloss.

    Idempotent: a second call only changes the options. ``backend`` is fusedloss's (``"auto"``, ``"torch"``,
    ``"triton"``, ``"cuda"``), resolved per call for the tensors at hand. ``vocab_size``: head rows at or past
    it are padding, outside every softmax (Megatron's padded vocabulary); ``None`` (default) scores every row,
    as verl does. Call it before verl builds the model, so that the model's head is read with its logit
    processing (``external_lib`` does)."""
    if backend not in _backends.BACKEND_NAMES:
        raise ValueError(f"backend must be one of {_backends.BACKEND_NAMES}, got {backend!r}")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    _check_verl_version()
    sites = _sites()
    for module, module_name, attr in sites:
        _originals.setdefault((module_name, attr), getattr(module, attr))
    for module, _, attr in sites:
        setattr(module, attr, _REPLACEMENTS[attr]())
    _state.update(backend=backend, vocab_size=vocab_size, enabled=True)


def disable() -> None:
    """Put verl's own objects back, exactly the ones that were there before ``enable()``."""
    _switch.restore_originals(_originals, _state)


def is_enabled() -> bool:
    return _state["enabled"]


enabled = _switch.scoped(enable, disable, _state)


# ------------------------------------------------------------------------------------------------ the head


def _patch_forward_with_backends(model, use_fused_kernels: bool = False, fused_kernels_backend: str = None):
    """verl's ``patch_forward_with_backends``, after observing the model's head with the model's own forward
    (``integrations.transformers.lm_head``: its logit processing, seen on probe rows, which the swapped kernels
    then read; verl's fused forward, once in place, returns no logits to observe). A head fusedloss cannot read
    is refused here, before training starts."""
    fused = use_fused_kernels and fused_kernels_backend in ("triton", "torch", "liger")
    if fused:
        head_module = getattr(model, "lm_head", None)
        if head_module is None or model.get_output_embeddings() is not head_module:
            raise ValueError(f"fusedloss.integrations.verl: verl's fused forward scores {type(model).__name__}'s "
                             "`lm_head`, which is not its output embedding; this model is not supported with "
                             "use_fused_kernels")
        _hf.lm_head(model)
    _originals[("verl.models.transformers.monkey_patch", "patch_forward_with_backends")](
        model, use_fused_kernels=use_fused_kernels, fused_kernels_backend=fused_kernels_backend)
    if fused:
        _models.add(model)


def _head_of(weight: torch.Tensor) -> Optional[_hf.LMHead]:
    """The head, with its logit processing, of the registered model whose ``lm_head`` weight is ``weight``
    (verl reads ``self.lm_head.weight`` just before calling the kernel); None for any other weight."""
    for model in list(_models):
        head_module = model.get_output_embeddings()
        if head_module is not None and getattr(head_module, "weight", None) is weight:
            return _hf.lm_head(model)
    return None


def _logprobs_and_entropy(hidden, weight, labels, temperature, **sharding):
    head = _head_of(weight)
    options = {} if head is None else head.options
    if head is not None:
        weight = head.weight  # a LoRA on the head folded in
    if _state["vocab_size"] is not None:
        sharding["vocab_size"] = _state["vocab_size"]
    return fusedloss.token_logprobs(hidden, weight, labels.long(), temperature=float(temperature),
                                    return_entropy=True, ignore_index=-100, backend=_state["backend"],
                                    **options, **sharding)


class FusedLinearForPPO(torch.nn.Module):
    """Drop-in for ``verl.utils.experimental.torch_functional.FusedLinearForPPO``: the same constructor and
    ``forward(hidden_states [..., D], vocab_weights [V, D], input_ids [...], temperature)`` returning
    ``(log_probs, entropy)`` of the shape of ``input_ids``, fp32 (float64 for float64 inputs), both
    differentiable. ``chunk_size`` is accepted and ignored (fusedloss picks its own tiles); ``impl_backend``
    is checked as verl checks it and otherwise ignored: every backend runs through fusedloss."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return _logprobs_and_entropy(hidden_states, vocab_weights, input_ids, temperature)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none", dist_process_group=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``: flattened ``[N]``
    log-probs and entropy (log-probs summed or averaged with ``reduction`` ``"sum"`` / ``"mean"``, as verl's
    kernel does; the entropy stays per token). With ``dist_process_group`` (Megatron's tensor-parallel group)
    ``weight`` is this rank's contiguous block of rows, in rank order, and ``labels`` are global ids; the
    hidden gradient is this rank's partial sum, which Megatron reduces."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    sharding = {}
    if dist_process_group is not None:
        sharding = {"process_group": dist_process_group, "reduce_hidden_grad": False}
    logprobs, entropy = _logprobs_and_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                              temperature, **sharding)
    if reduction == "sum":
        logprobs = logprobs.sum()
    elif reduction == "mean":
        logprobs = logprobs.mean()
    return logprobs, entropy
