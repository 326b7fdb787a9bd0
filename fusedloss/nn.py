"""``torch.nn.Module`` wrappers of the functional API, for code that composes losses as modules.

Each module takes the keyword options of its function in ``__init__`` and the tensors in ``forward``, and
calls the function: no math lives here, so a module and its function can never disagree. Options that
change from batch to batch (``num_items_in_batch``, the reference and sampling log-probs, GRPO's
``importance_weights``, KTO's KL pairs, ORPO's ``nll_labels``) are ``forward`` arguments. The modules hold
no parameters: pass the head's ``weight`` (and ``bias``) to ``forward``, e.g.
``loss_fn(hidden, model.lm_head.weight, labels)``.

=====================  ==================================
module                 function
=====================  ==================================
``TokenLogProbs``      ``fusedloss.token_logprobs``
``LinearCrossEntropy`` ``fusedloss.cross_entropy``
``DistillationLoss``   ``fusedloss.distillation_loss``
``GRPOLoss``           ``fusedloss.grpo_loss``
``DPOLoss``            ``fusedloss.dpo_loss``
``KTOLoss``            ``fusedloss.kto_loss``
``ORPOLoss``           ``fusedloss.orpo_loss``
``CPOLoss``            ``fusedloss.cpo_loss``
=====================  ==================================
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

import fusedloss

__all__ = ["CPOLoss", "DPOLoss", "DistillationLoss", "GRPOLoss", "KTOLoss", "LinearCrossEntropy", "ORPOLoss",
           "TokenLogProbs"]


class _FunctionalModule(torch.nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.options = options

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


def _sharding(process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel) -> dict:
    """Where the head's rows live (fusedloss/distributed): the same keywords as every loss function."""
    return dict(process_group=process_group, reduce_hidden_grad=reduce_hidden_grad, vocab_start=vocab_start,
                vocab_size=vocab_size, fsdp_vocab_parallel=fsdp_vocab_parallel)


class TokenLogProbs(_FunctionalModule):
    """``forward(hidden, weight, targets, bias=None)`` -> ``fusedloss.token_logprobs(...)``: per-token
    log p(targets) ``[...]``, or ``(logp, entropy)`` with ``return_entropy=True``."""

    def __init__(self, *, temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None,
                 ignore_index: int = -100, return_entropy: bool = False, backend: str = "auto", process_group=None,
                 reduce_hidden_grad: bool = True, vocab_start: Optional[int] = None,
                 vocab_size: Optional[int] = None, fsdp_vocab_parallel: bool = False):
        super().__init__(temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                         ignore_index=ignore_index, return_entropy=return_entropy, backend=backend,
                         **_sharding(process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel))

    def forward(self, hidden, weight, targets, bias=None):
        return fusedloss.token_logprobs(hidden, weight, targets, bias=bias, **self.options)


class LinearCrossEntropy(_FunctionalModule):
    """``forward(hidden, weight, targets, bias=None, num_items_in_batch=None)`` ->
    ``fusedloss.cross_entropy(...)``: ``F.cross_entropy(hidden @ weight.T + bias, targets)`` without the logits."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, temperature: float = 1.0, logit_scale: float = 1.0,
                 softcap: Optional[float] = None, backend: str = "auto", process_group=None,
                 reduce_hidden_grad: bool = True, vocab_start: Optional[int] = None,
                 vocab_size: Optional[int] = None, fsdp_vocab_parallel: bool = False):
        super().__init__(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                         z_loss=z_loss, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                         backend=backend,
                         **_sharding(process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel))

    def forward(self, hidden, weight, targets, bias=None, num_items_in_batch=None):
        return fusedloss.cross_entropy(hidden, weight, targets, bias=bias, num_items_in_batch=num_items_in_batch,
                                       **self.options)


class DistillationLoss(_FunctionalModule):
    """``forward(hidden, weight, teacher_hidden, teacher_weight, targets=None, bias=None, teacher_bias=None,
    num_items_in_batch=None)`` -> ``fusedloss.distillation_loss(...)``. ``beta``: 0 forward KL (Hinton),
    1 reverse KL (on-policy), else the generalized JSD."""

    def __init__(self, *, beta: float = 1.0, temperature: float = 1.0, hard_weight: float = 0.0,
                 soft_weight: float = 1.0, t_squared: bool = False, ignore_index: int = -100,
                 reduction: str = "batchmean", backend: str = "auto", process_group=None,
                 reduce_hidden_grad: bool = True, vocab_start: Optional[int] = None,
                 vocab_size: Optional[int] = None, fsdp_vocab_parallel: bool = False):
        super().__init__(beta=beta, temperature=temperature, hard_weight=hard_weight, soft_weight=soft_weight,
                         t_squared=t_squared, ignore_index=ignore_index, reduction=reduction, backend=backend,
                         **_sharding(process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel))

    def forward(self, hidden, weight, teacher_hidden, teacher_weight, targets=None, bias=None, teacher_bias=None,
                num_items_in_batch=None):
        return fusedloss.distillation_loss(hidden, weight, teacher_hidden, teacher_weight, targets, bias=bias,
                                           teacher_bias=teacher_bias, num_items_in_batch=num_items_in_batch,
                                           **self.options)


class GRPOLoss(_FunctionalModule):
    """``forward(hidden, weight, completion_ids, advantages, completion_mask, old_logprobs=None,
    ref_logprobs=None, bias=None, num_items_in_batch=None, importance_weights=None, sampling_logprobs=None)``
    -> ``fusedloss.grpo_loss(...)``: TRL 1.16 GRPOTrainer's loss (every ``loss_type`` of GRPOConfig)."""

    def __init__(self, *, temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None,
                 loss_type: str = "dapo", epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
                 delta: Optional[float] = None, beta: float = 0.0, use_bias_correction_kl: bool = True,
                 importance_sampling_level: str = "token", sapo_temperature_pos: float = 1.0,
                 sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0,
                 vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
                 off_policy_mask_threshold: Optional[float] = None, top_entropy_quantile: float = 1.0,
                 entropy_coef: float = 0.0, max_completion_length: Optional[int] = None, num_processes: int = 1,
                 return_details: bool = False, backend: str = "auto", process_group=None, reduce_hidden_grad: bool = True,
                 vocab_start: Optional[int] = None, vocab_size: Optional[int] = None,
                 fsdp_vocab_parallel: bool = False):
        super().__init__(temperature=temperature, logit_scale=logit_scale, softcap=softcap, loss_type=loss_type,
                         epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta,
                         use_bias_correction_kl=use_bias_correction_kl,
                         importance_sampling_level=importance_sampling_level,
                         sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                         vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                         vespo_lambda_neg=vespo_lambda_neg, off_policy_mask_threshold=off_policy_mask_threshold,
                         top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef,
                         max_completion_length=max_completion_length, num_processes=num_processes,
                         return_details=return_details, backend=backend,
                         **_sharding(process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel))

    def forward(self, hidden, weight, completion_ids, advantages, completion_mask, old_logprobs=None,
                ref_logprobs=None, bias=None, num_items_in_batch=None, importance_weights=None,
                sampling_logprobs=None):
        return fusedloss.grpo_loss(hidden, weight, completion_ids, advantages, completion_mask,
                                   old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, bias=bias,
                                   num_items_in_batch=num_items_in_batch, importance_weights=importance_weights,
                                   sampling_logprobs=sampling_logprobs, **self.options)


class DPOLoss(_FunctionalModule):
    """``forward(hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, bias=None)`` ->
    ``fusedloss.dpo_loss(...)``; ``hidden`` is ``[2B, T, D]``, chosen rows first (TRL's concatenation)."""

    def __init__(self, *, beta: float = 0.1, loss_type: Union[str, Sequence[str]] = "sigmoid",
                 loss_weights: Optional[Sequence[float]] = None, label_smoothing: float = 0.0,
                 f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5,
                 ld_alpha: Optional[float] = None, discopop_tau: float = 0.05, use_weighting: bool = False,
                 temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None,
                 ignore_index: int = -100, return_details: bool = False, backend: str = "auto", process_group=None, reduce_hidden_grad: bool = True,
                 vocab_start: Optional[int] = None, vocab_size: Optional[int] = None,
                 fsdp_vocab_parallel: bool = False):
        super().__init__(beta=beta, loss_type=loss_type, loss_weights=loss_weights, label_smoothing=label_smoothing,
                         f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
                         ld_alpha=ld_alpha, discopop_tau=discopop_tau, use_weighting=use_weighting,
                         temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                         ignore_index=ignore_index, return_details=return_details, backend=backend,
                         **_sharding(process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel))

    def forward(self, hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, bias=None):
        return fusedloss.dpo_loss(hidden, weight, labels, ref_chosen_logps, ref_rejected_logps, bias=bias,
                                  **self.options)


class KTOLoss(_FunctionalModule):
    """``forward(hidden, weight, labels, preference_labels, ref_logps, kl_hidden=None, kl_labels=None,
    ref_kl_logps=None, kl=None, bias=None)`` -> ``fusedloss.kto_loss(...)``: one completion per row."""

    def __init__(self, *, beta: float = 0.1, loss_type: str = "kto", desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, temperature: float = 1.0, logit_scale: float = 1.0,
                 softcap: Optional[float] = None, ignore_index: int = -100, return_details: bool = False,
                 backend: str = "auto", process_group=None, reduce_hidden_grad: bool = True,
                 vocab_start: Optional[int] = None, vocab_size: Optional[int] = None,
                 fsdp_vocab_parallel: bool = False):
        super().__init__(beta=beta, loss_type=loss_type, desirable_weight=desirable_weight,
                         undesirable_weight=undesirable_weight, temperature=temperature, logit_scale=logit_scale,
                         softcap=softcap, ignore_index=ignore_index, return_details=return_details, backend=backend,
                         **_sharding(process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel))

    def forward(self, hidden, weight, labels, preference_labels, ref_logps, kl_hidden=None, kl_labels=None,
                ref_kl_logps=None, kl=None, bias=None):
        return fusedloss.kto_loss(hidden, weight, labels, preference_labels, ref_logps, kl_hidden=kl_hidden,
                                  kl_labels=kl_labels, ref_kl_logps=ref_kl_logps, kl=kl, bias=bias, **self.options)


class ORPOLoss(_FunctionalModule):
    """``forward(hidden, weight, labels, nll_labels=None, bias=None)`` -> ``fusedloss.orpo_loss(...)``;
    ``hidden`` is ``[2B, T, D]``, chosen rows first."""

    def __init__(self, *, beta: float = 0.1, temperature: float = 1.0, logit_scale: float = 1.0,
                 softcap: Optional[float] = None, ignore_index: int = -100, return_details: bool = False,
                 backend: str = "auto", process_group=None, reduce_hidden_grad: bool = True,
                 vocab_start: Optional[int] = None, vocab_size: Optional[int] = None,
                 fsdp_vocab_parallel: bool = False):
        super().__init__(beta=beta, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                         ignore_index=ignore_index, return_details=return_details, backend=backend,
                         **_sharding(process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel))

    def forward(self, hidden, weight, labels, nll_labels=None, bias=None):
        return fusedloss.orpo_loss(hidden, weight, labels, nll_labels=nll_labels, bias=bias, **self.options)


class CPOLoss(_FunctionalModule):
    """``forward(hidden, weight, labels, bias=None)`` -> ``fusedloss.cpo_loss(...)``; ``hidden`` is
    ``[2B, T, D]``, chosen rows first. SimPO: ``CPOLoss(loss_type="simpo", cpo_alpha=0.0)``."""

    def __init__(self, *, beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 cpo_alpha: float = 1.0, simpo_gamma: float = 0.5, alpha: float = 0.0, temperature: float = 1.0,
                 logit_scale: float = 1.0, softcap: Optional[float] = None, ignore_index: int = -100,
                 return_details: bool = False, backend: str = "auto", process_group=None, reduce_hidden_grad: bool = True,
                 vocab_start: Optional[int] = None, vocab_size: Optional[int] = None,
                 fsdp_vocab_parallel: bool = False):
        super().__init__(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, cpo_alpha=cpo_alpha,
                         simpo_gamma=simpo_gamma, alpha=alpha, temperature=temperature, logit_scale=logit_scale,
                         softcap=softcap, ignore_index=ignore_index, return_details=return_details, backend=backend,
                         **_sharding(process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel))

    def forward(self, hidden, weight, labels, bias=None):
        return fusedloss.cpo_loss(hidden, weight, labels, bias=bias, **self.options)
