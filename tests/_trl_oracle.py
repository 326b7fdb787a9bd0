"""TRL 1.16's own loss code, run on materialised float64 logits: the oracle of the loss catalogue.

Each ``trl_*`` function calls the trainer method that computes the loss in TRL 1.16
(``GRPOTrainer._compute_loss``, ``DPOTrainer._compute_loss``, ``KTOTrainer._compute_loss``, and the
experimental ``ORPOTrainer.get_batch_loss_metrics`` / ``CPOTrainer.get_batch_loss_metrics``) unbound, with
a stand-in for ``self`` that carries the config values and a one-process accelerator, and a stand-in
model whose outputs are computed here from the logits of tests/oracle.py the obvious way (float64,
``torch.log_softmax``).
So the loss, every metric TRL logs and, through autograd, the gradients come from TRL's code itself.
Only where TRL's code cannot run in float64 (the alpha-divergence of DPO picks its exponent cap from a
dict keyed by fp16/bf16/fp32) do the tests fall back to TRL in fp32 and to the float64 reference.

The layouts are TRL's: the model sees ``[rows, L]`` sequences and TRL shifts (row t's logits predict token
t + 1); fusedloss takes the shifted hidden states and labels, ``hidden[:, :-1]`` and ``labels[:, 1:]``. The
helpers below build both from one set of tensors. While TRL's code runs, torch's default dtype is float64,
so the constants it creates with ``torch.tensor(...)`` are float64 too, and its ``.float()`` casts keep
float64 tensors (``float64_default``).
"""

from __future__ import annotations

import contextlib
import types
from collections import defaultdict
from typing import Optional

import oracle
import torch


@contextlib.contextmanager
def float64_default(enabled: bool = True):
    """Run TRL's code in float64: constants from ``torch.tensor(...)`` take the default dtype, and TRL's
    ``.float()`` casts (its upcast of half-precision log-probs, its 0/1 indicators and counts) give float64."""
    if not enabled:  # fp32 inputs: TRL as it runs in training
        yield
        return
    old_dtype, old_float = torch.get_default_dtype(), torch.Tensor.float

    def keep_float64(self, *args, **kwargs):
        return self.to(torch.float64)

    torch.set_default_dtype(torch.float64)
    torch.Tensor.float = keep_float64
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)
        torch.Tensor.float = old_float


class _Accelerator:
    """One process: gathers and reductions are the identity."""

    num_processes = 1
    device = torch.device("cpu")
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def pad_across_processes(x, dim=0, pad_index=0):
        return x


def head_logits(hidden, weight, bias=None, *, temperature=1.0, logit_scale=1.0, softcap=None):
    """The logits of the stand-in model: tests/oracle.py's, in the dtype of ``hidden`` (float64, or fp32 where
    TRL runs as in training)."""
    return oracle.logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                         cfg=oracle.Config(dtype=hidden.dtype))


def _token_stats(z, labels):
    """Per-token log-probs of ``labels`` (0 at -100) and the entropy, from logits ``z``."""
    logq = torch.log_softmax(z, dim=-1)
    safe = labels.clamp(min=0)
    logp = logq.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(labels != -100, logp, torch.zeros_like(logp))
    entropy = -(logq.exp() * logq).sum(-1)
    return logq, logp, entropy


def _self(**attrs):
    return types.SimpleNamespace(accelerator=_Accelerator(), _metrics={"train": defaultdict(list)},
                                 model=types.SimpleNamespace(training=True), **attrs)


def _metrics(fake):
    return {k: (v[-1] if len(v) else None) for k, v in fake._metrics["train"].items()}


# --------------------------------------------------------------------------------------------------
# GRPO


def trl_grpo(hidden, weight, completion_ids, advantages, completion_mask, *, bias=None, temperature=1.0,
             logit_scale=1.0, softcap=None, old_logprobs=None, ref_logprobs=None, sampling_logprobs=None,
             importance_weights=None, num_items_in_batch=None, max_completion_length=None, loss_type="dapo",
             epsilon_low=0.2, epsilon_high=None, delta=None, beta=0.0, use_bias_correction_kl=True,
             importance_sampling_level="token", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
             vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
             off_policy_mask_threshold=None, top_entropy_quantile=1.0, entropy_coef=0.0, num_processes=1):
    """``GRPOTrainer._compute_loss`` on ``hidden [B, C, D]`` (row t predicts completion_ids[:, t]).
    Returns (loss, metrics dict as TRL logs them, per-token log-probs)."""
    from trl import GRPOTrainer

    b, c = completion_ids.shape
    z = head_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    _, logp, entropy = _token_stats(z, completion_ids)
    args = types.SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=delta,
                                 sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                                 vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                                 vespo_lambda_neg=vespo_lambda_neg, steps_per_generation=1, entropy_target=0.2)
    accelerator = _Accelerator()
    accelerator.num_processes = num_processes
    fake = _self(args=args, loss_type=loss_type, epsilon_low=epsilon_low,
                 epsilon_high=epsilon_low if epsilon_high is None else epsilon_high, beta=beta,
                 importance_sampling_level=importance_sampling_level, top_entropy_quantile=top_entropy_quantile,
                 off_policy_mask_threshold=off_policy_mask_threshold, aux_loss_enabled=False,
                 use_vllm=importance_weights is not None, vllm_importance_sampling_correction=True,
                 current_gradient_accumulation_steps=1, max_completion_length=c if max_completion_length is None
                 else max_completion_length, entropy_coef=entropy_coef, use_adaptive_entropy=False,
                 _entropy_bonus_enabled=entropy_coef != 0.0,
                 get_off_policy_mask=GRPOTrainer.get_off_policy_mask, get_gamma_weights=GRPOTrainer.get_gamma_weights,
                 _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None))
    fake.accelerator = accelerator
    fake.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, fake)
    mask = completion_mask
    inputs = dict(prompt_ids=completion_ids[:, :0], prompt_mask=mask[:, :0], completion_ids=completion_ids,
                  completion_mask=mask, advantages=advantages,
                  num_items_in_batch=torch.as_tensor(float(mask.sum()) if num_items_in_batch is None
                                                     else float(num_items_in_batch), dtype=torch.float64))
    for key, value in (("old_per_token_logps", old_logprobs), ("ref_per_token_logps", ref_logprobs),
                       ("sampling_per_token_logps", sampling_logprobs)):
        if value is not None:
            inputs[key] = value
    if importance_weights is not None:
        inputs["importance_sampling_ratio"] = (importance_weights.unsqueeze(1) if importance_weights.dim() == 1
                                               else importance_weights)
    with float64_default():
        loss = GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, _metrics(fake), logp


# --------------------------------------------------------------------------------------------------
# Preference batches


def _fused_outputs(z, labels):
    """What ``model(..., labels=labels, fused_lm_head=True)`` returns for TRL's preference trainers:
    shifted per-token outputs (position t scores labels[:, t + 1])."""
    shifted = labels[:, 1:]
    logq, logp, entropy = _token_stats(z[:, :-1], shifted)
    return types.SimpleNamespace(log_probs=logp, entropy=entropy, mean_logits=z[:, :-1].mean(-1),
                                 is_top1=z[:, :-1].argmax(-1) == shifted.clamp(min=0),
                                 log_sum_sq_probs=torch.logsumexp(2 * logq, dim=-1))


def trl_dpo(full_hidden, weight, completion_mask, input_ids, ref_chosen_logps, ref_rejected_logps, *, bias=None,
            temperature=1.0, logit_scale=1.0, softcap=None, beta=0.1, loss_type="sigmoid", loss_weights=None,
            label_smoothing=0.0, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, ld_alpha=None,
            discopop_tau=0.05, use_weighting=False):
    """``DPOTrainer._compute_loss`` on unshifted ``full_hidden [2B, L, D]``, ``input_ids`` and
    ``completion_mask [2B, L]`` (precomputed reference log-probs). Returns (loss, metrics)."""
    from trl import DPOTrainer

    z = head_logits(full_hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    types_ = [loss_type] if isinstance(loss_type, str) else list(loss_type)

    def model(**kwargs):
        return _fused_outputs(z, kwargs["labels"])

    fake = _self(beta=beta, ld_alpha=ld_alpha, precompute_ref_logps=True, f_divergence_type=f_divergence_type,
                 f_alpha_divergence_coef=f_alpha_divergence_coef, loss_types=types_,
                 loss_weights=[1.0] * len(types_) if loss_weights is None else list(loss_weights),
                 label_smoothing=label_smoothing, use_weighting=use_weighting,
                 args=types.SimpleNamespace(discopop_tau=discopop_tau), aux_loss_enabled=False,
                 _total_train_tokens=0, _tp_size=1)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), completion_mask=completion_mask,
                  ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    with float64_default(full_hidden.dtype == torch.float64):
        loss = DPOTrainer._compute_loss(fake, model, inputs, return_outputs=False)
    return loss, _metrics(fake)


def trl_kto(full_hidden, weight, completion_mask, input_ids, label, ref_logps, *, kl_full_hidden=None,
            kl_completion_mask=None, kl_input_ids=None, ref_kl_logps=None, bias=None, temperature=1.0,
            logit_scale=1.0, softcap=None, beta=0.1, loss_type="kto", desirable_weight=1.0, undesirable_weight=1.0):
    """``KTOTrainer._compute_loss`` (precomputed reference log-probs); the KL pairs are scored by the same
    head on ``kl_full_hidden``. Returns (loss, metrics)."""
    from trl import KTOTrainer

    z = head_logits(full_hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    z_kl = None if kl_full_hidden is None else head_logits(kl_full_hidden, weight, bias, temperature=temperature,
                                                            logit_scale=logit_scale, softcap=softcap)

    def model(**kwargs):
        ids = kwargs["input_ids"]
        return _fused_outputs(z_kl if (z_kl is not None and ids is kl_input_ids) else z, kwargs["labels"])

    fake = _self(beta=beta, loss_type=loss_type, desirable_weight=desirable_weight,
                 undesirable_weight=undesirable_weight, calculate_KL=loss_type != "apo_zero_unpaired",
                 precompute_ref_logps=True, aux_loss_enabled=False, _total_train_tokens=0, _tp_size=1,
                 args=types.SimpleNamespace())
    fake._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, fake)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), completion_mask=completion_mask,
                  label=label, ref_logps=ref_logps)
    if fake.calculate_KL:
        inputs.update(KL_input_ids=kl_input_ids, KL_attention_mask=torch.ones_like(kl_input_ids),
                      KL_completion_mask=kl_completion_mask, ref_KL_logps=ref_kl_logps)
    with float64_default():
        loss = KTOTrainer._compute_loss(fake, model, inputs, return_outputs=False)
    return loss, _metrics(fake)


def _paired_batch_metrics(trainer_cls, fake, full_hidden, weight, input_ids, labels, attention_mask, head):
    z = head_logits(full_hidden, weight, head.get("bias"), temperature=head.get("temperature", 1.0),
                    logit_scale=head.get("logit_scale", 1.0), softcap=head.get("softcap"))
    b = input_ids.shape[0] // 2

    def model(input_ids, attention_mask=None, use_cache=False, **kwargs):
        return types.SimpleNamespace(logits=z)

    batch = dict(chosen_input_ids=input_ids[:b], rejected_input_ids=input_ids[b:],
                 chosen_attention_mask=attention_mask[:b], rejected_attention_mask=attention_mask[b:],
                 chosen_labels=labels[:b], rejected_labels=labels[b:])
    fake.concatenated_forward = types.MethodType(trainer_cls.concatenated_forward, fake)
    fake.concatenated_inputs = trainer_cls.concatenated_inputs
    fake.get_batch_logps = trainer_cls.get_batch_logps
    with float64_default():
        return trainer_cls.get_batch_loss_metrics(fake, model, batch)


def trl_orpo(full_hidden, weight, input_ids, labels, attention_mask, *, beta=0.1, **head):
    """Experimental ``ORPOTrainer.get_batch_loss_metrics`` on ``full_hidden [2B, L, D]`` (chosen rows, then
    rejected), TRL's unshifted ``input_ids``, ``labels`` (-100 outside the completions) and
    ``attention_mask``. Returns (loss, metrics)."""
    from trl.experimental.orpo import ORPOTrainer

    fake = _self(beta=beta, is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False)
    fake.odds_ratio_loss = types.MethodType(ORPOTrainer.odds_ratio_loss, fake)
    return _paired_batch_metrics(ORPOTrainer, fake, full_hidden, weight, input_ids, labels, attention_mask, head)


def trl_cpo(full_hidden, weight, input_ids, labels, attention_mask, *, beta=0.1, loss_type="sigmoid",
            label_smoothing=0.0, cpo_alpha=1.0, simpo_gamma=0.5, alpha=0.0, **head):
    """Experimental ``CPOTrainer.get_batch_loss_metrics`` (same layout as ``trl_orpo``)."""
    from trl.experimental.cpo import CPOTrainer

    fake = _self(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, cpo_alpha=cpo_alpha,
                 simpo_gamma=simpo_gamma, alpha=alpha, is_encoder_decoder=False, pad_token_id=0,
                 aux_loss_enabled=False)
    fake.cpo_loss = types.MethodType(CPOTrainer.cpo_loss, fake)
    return _paired_batch_metrics(CPOTrainer, fake, full_hidden, weight, input_ids, labels, attention_mask, head)


def shifted(full_hidden: torch.Tensor, labels: torch.Tensor, leaf: Optional[torch.Tensor] = None):
    """The fusedloss view of a TRL batch: hidden rows that predict the next token, and the next tokens."""
    return (full_hidden if leaf is None else leaf)[:, :-1], labels[:, 1:]
