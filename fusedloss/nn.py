"""``torch.nn.Module`` wrappers of the functional API, for code that composes losses as modules.

Each module takes the keyword options of its function in ``__init__`` and the tensors in ``forward``, and
calls the function: no math lives here, so a module and its function can never disagree. ``__init__`` is
generated from the function's signature (every keyword-only option that is not a ``forward`` argument, with
the function's defaults), so a new option of a loss is an option of its module too. Options that change from
batch to batch (``num_items_in_batch``, the reference and sampling log-probs, GRPO's ``importance_weights``,
KTO's KL pairs, ORPO's ``nll_labels``) are ``forward`` arguments. The modules hold no parameters: pass the
head's ``weight`` (and ``bias``) to ``forward``, e.g. ``loss_fn(hidden, model.lm_head.weight, labels)``.

========================== ======================================
module                     function
========================== ======================================
``TokenLogProbs``          ``fusedloss.token_logprobs``
``LinearCrossEntropy``     ``fusedloss.cross_entropy``
``DistillationLoss``       ``fusedloss.distillation_loss``
``SparseDistillationLoss`` ``fusedloss.sparse_distillation_loss``
``GRPOLoss``               ``fusedloss.grpo_loss``
``DPOLoss``                ``fusedloss.dpo_loss``
``KTOLoss``                ``fusedloss.kto_loss``
``ORPOLoss``               ``fusedloss.orpo_loss``
``CPOLoss``                ``fusedloss.cpo_loss``
========================== ======================================
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from . import losses

__all__ = ["CPOLoss", "DPOLoss", "DistillationLoss", "GRPOLoss", "KTOLoss", "LinearCrossEntropy", "ORPOLoss",
           "SparseDistillationLoss", "TokenLogProbs"]


class _FunctionalModule(torch.nn.Module):
    """A module that calls ``function(*tensors, **forward_options, **self.options)``. Subclasses name the
    function and write ``forward``; ``__init__`` is generated from the function's keyword-only options."""

    function: Callable

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        fn = cls.function  # a staticmethod: the plain function, on a subclass of a subclass too
        per_call = set(inspect.signature(cls.forward).parameters) - {"self"}
        options = [p for name, p in inspect.signature(fn).parameters.items()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in per_call]
        names = tuple(p.name for p in options)

        def __init__(self, **given):
            unknown = sorted(set(given) - set(names))
            if unknown:
                raise TypeError(f"{cls.__name__} got unexpected option(s) {unknown}; its options are {names} "
                                f"(tensors and per-batch arguments go to forward)")
            torch.nn.Module.__init__(self)
            self.options = given

        __init__.__signature__ = inspect.Signature(
            [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + options)
        __init__.__doc__ = f"Options of ``fusedloss.{fn.__name__}`` (see its documentation): {', '.join(names)}."
        cls.__init__ = __init__
        if cls.__dict__.get("forward") is not None and not cls.forward.__doc__:
            # help(Module.forward) shows the function's own documentation, not torch.nn.Module's generic text.
            cls.forward.__doc__ = (f"{inspect.cleandoc(cls.__doc__ or '')}\n\nThe options given to ``__init__`` "
                                   f"are passed on. ``fusedloss.{fn.__name__}``:\n\n{inspect.getdoc(fn)}")

    def call(self, *tensors, **per_call):
        return self.function(*tensors, **per_call, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class TokenLogProbs(_FunctionalModule):
    """``forward(hidden, weight, targets, bias=None)`` -> ``fusedloss.token_logprobs(...)``: per-token
    log p(targets) ``[...]``, or ``(logp, entropy)`` with ``return_entropy=True``."""

    function = staticmethod(losses.token_logprobs)

    def forward(self, hidden, weight, targets, bias=None):
        return self.call(hidden, weight, targets, bias=bias)


class LinearCrossEntropy(_FunctionalModule):
    """``forward(hidden, weight, targets, bias=None, num_items_in_batch=None)`` ->
    ``fusedloss.cross_entropy(...)``: ``F.cross_entropy(hidden @ weight.T + bias, targets)`` without the logits."""

    function = staticmethod(losses.cross_entropy)

    def forward(self, hidden, weight, targets, bias=None, num_items_in_batch=None):
        return self.call(hidden, weight, targets, bias=bias, num_items_in_batch=num_items_in_batch)


class DistillationLoss(_FunctionalModule):
    """``forward(hidden, weight, teacher_hidden, teacher_weight, targets=None, bias=None, teacher_bias=None,
    num_items_in_batch=None)`` -> ``fusedloss.distillation_loss(...)``."""

    function = staticmethod(losses.distillation_loss)

    def forward(self, hidden, weight, teacher_hidden, teacher_weight, targets=None, bias=None, teacher_bias=None,
                num_items_in_batch=None):
        return self.call(hidden, weight, teacher_hidden, teacher_weight, targets, bias=bias,
                         teacher_bias=teacher_bias, num_items_in_batch=num_items_in_batch)


class SparseDistillationLoss(_FunctionalModule):
    """``forward(hidden, weight, teacher_ids, teacher_logprobs, targets=None, teacher_target_logprobs=None,
    bias=None, num_items_in_batch=None)`` -> ``fusedloss.sparse_distillation_loss(...)``: TRL 1.16
    ServerDistillationTrainer's loss on a teacher's top-k log-probs."""

    function = staticmethod(losses.sparse_distillation_loss)

    def forward(self, hidden, weight, teacher_ids, teacher_logprobs, targets=None, teacher_target_logprobs=None,
                bias=None, num_items_in_batch=None):
        return self.call(hidden, weight, teacher_ids, teacher_logprobs, targets,
                         teacher_target_logprobs=teacher_target_logprobs, bias=bias,
                         num_items_in_batch=num_items_in_batch)


class GRPOLoss(_FunctionalModule):
    """``forward(hidden, weight, completion_ids, advantages, completion_mask, old_logprobs=None,
    ref_logprobs=None, bias=None, num_items_in_batch=None, importance_weights=None, sampling_logprobs=None)``
    -> ``fusedloss.grpo_loss(...)``: TRL 1.16 GRPOTrainer's loss (every ``loss_type`` of GRPOConfig)."""

    function = staticmethod(losses.grpo_loss)

    def forward(self, hidden, weight, completion_ids, advantages, completion_mask, old_logprobs=None,
                ref_logprobs=None, bias=None, num_items_in_batch=None, importance_weights=None,
                sampling_logprobs=None):
        return self.call(hidden, weight, completion_ids, advantages, completion_mask, old_logprobs=old_logprobs,
                         ref_logprobs=ref_logprobs, bias=bias, num_items_in_batch=num_items_in_batch,
                         importance_weights=importance_weights, sampling_logprobs=sampling_logprobs)


class DPOLoss(_FunctionalModule):
    """``forward(hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, bias=None)`` ->
    ``fusedloss.dpo_loss(...)``; ``hidden`` is ``[2B, T, D]``, chosen rows first (TRL's concatenation)."""

    function = staticmethod(losses.dpo_loss)

    def forward(self, hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, bias=None):
        return self.call(hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, bias=bias)


class KTOLoss(_FunctionalModule):
    """``forward(hidden, weight, labels, preference_labels, ref_logps, kl_hidden=None, kl_labels=None,
    ref_kl_logps=None, kl=None, bias=None)`` -> ``fusedloss.kto_loss(...)``: one completion per row."""

    function = staticmethod(losses.kto_loss)

    def forward(self, hidden, weight, labels, preference_labels, ref_logps, kl_hidden=None, kl_labels=None,
                ref_kl_logps=None, kl=None, bias=None):
        return self.call(hidden, weight, labels, preference_labels, ref_logps, kl_hidden=kl_hidden,
                         kl_labels=kl_labels, ref_kl_logps=ref_kl_logps, kl=kl, bias=bias)


class ORPOLoss(_FunctionalModule):
    """``forward(hidden, weight, labels, nll_labels=None, bias=None)`` -> ``fusedloss.orpo_loss(...)``;
    ``hidden`` is ``[2B, T, D]``, chosen rows first."""

    function = staticmethod(losses.orpo_loss)

    def forward(self, hidden, weight, labels, nll_labels=None, bias=None):
        return self.call(hidden, weight, labels, nll_labels=nll_labels, bias=bias)


class CPOLoss(_FunctionalModule):
    """``forward(hidden, weight, labels, bias=None)`` -> ``fusedloss.cpo_loss(...)``; ``hidden`` is
    ``[2B, T, D]``, chosen rows first. SimPO: ``CPOLoss(loss_type="simpo", cpo_alpha=0.0)``."""

    function = staticmethod(losses.cpo_loss)

    def forward(self, hidden, weight, labels, bias=None):
        return self.call(hidden, weight, labels, bias=bias)


def __dir__():
    # What the module offers (``__all__``), not the names it imports for its own use (torch, typing, ...).
    return sorted(__all__)
