"""The policy-gradient objectives of TRL 1.16's ``GRPOTrainer._compute_loss``, gradient accumulation 1.

The per-token formulas of every ``loss_type``, the KL penalty and the masks are in ``grpo_loss``'s docstring
(``help(fusedloss.grpo_loss)``, "Loss types"). Tokens outside the mask produce nothing, gradient included: their
per-token inputs are replaced by neutral values before any arithmetic, so garbage there (NaN, inf) never meets
a ``0 *`` on any branch.

The per-token and per-sequence math is a few elementwise operations and masked sums on ``[B, C]``
vectors: negligible beside the GEMM-sized products, so it is written once, here, in Python for every
backend (docs/design.md, "Losses as per-token math"). Token-level losses whose terms depend on their own
token only take the grad-in-forward 3-product path (``ImplicitLogits.row_local_loss``); GSPO, VESPO, the
off-policy and entropy masks, and ``return_details`` need the whole batch's statistics first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional, Union

import torch

from .. import _validation as v
from ..types import GRPODetails
from .implicit_logits import ImplicitLogits, count_or_one, implicit_logits, items_divisor, require_aligned
from .options import RUN, SHARDING, shared_arguments, shared_options
from .verl_terms import (
    COVARIANCE_LOSS_TYPES,
    KL_LOSS_TYPES,
    LOSS_AGG_MODES,
    VERL_LOSS_TYPES,
    aggregation_weights,
    covariance_term,
    geo_mean_policy,
    kl_estimate,
    policy_term,
    two_sided_cispo,
)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the loss types of the clipped surrogate
# Completion ids have no ignore value: the mask says which tokens count. The fix for -100 labels given as ids:
_MASK_NOT_LABELS = (" inside completion_mask, where every id must be a token: grpo_loss has no ignore_index, so "
                    "instead of -100 labels use completion_mask, 0 at the tokens outside the loss (padding)")
_VESPO_LOG_W_MIN = math.log(1e-8)  # TRL's clamp range of VESPO's log sequence weight

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "vanilla", "dppo_tv",
                   "dppo_kl", "dro", "clip_cov", "kl_cov", "geo_mean"]
# verl's ActorConfig.clip_ratio_c: the dual clip of vanilla and DPPO's ratio truncation when delta is None
_VERL_CLIP_RATIO_C = 3.0


@shared_options(*RUN, "grad_in_forward", *SHARDING)
@shared_arguments("backend", *RUN, "grad_in_forward", *SHARDING)
def grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor, advantages: torch.Tensor,
              completion_mask: torch.Tensor, *, old_logprobs: Optional[torch.Tensor] = None,
              ref_logprobs: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
              temperature: float = 1.0, logit_scale: float = 1.0, softcap: Optional[float] = None,
              loss_type: LossType = "dapo", epsilon_low: float = 0.2, epsilon_high: Optional[float] = None,
              delta: Optional[float] = None, beta: float = 0.0, use_bias_correction_kl: bool = True,
              importance_sampling_level: Literal["token", "sequence"] = "token",
              sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, vespo_k_pos: float = 2.0,
              vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0,
              off_policy_mask_threshold: Optional[float] = None, sampling_logprobs: Optional[torch.Tensor] = None,
              top_entropy_quantile: float = 1.0, entropy_coef: float = 0.0, kl_loss_type: Optional[str] = None,
              loss_agg_mode: Optional[str] = None, global_batch_size: Optional[int] = None,
              cispo_two_sided: bool = False, dro_beta: Optional[float] = None, clip_cov_ratio: float = 0.0002,
              clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, kl_cov_ratio: float = 0.0002,
              ppo_kl_coef: float = 0.1, max_completion_length: Optional[int] = None, num_items_in_batch=None,
              num_processes: int = 1,
              importance_weights: Optional[torch.Tensor] = None, return_details: bool = False,
              backend: str = "auto", **head) -> Union[torch.Tensor, tuple[torch.Tensor, GRPODetails]]:
    """TRL 1.16 GRPOTrainer's loss (``_compute_loss``, gradient accumulation 1) from the hidden states.

    Option names and defaults are GRPOConfig's (``epsilon_low`` is its ``epsilon``).

    Args:
        hidden: ``[B, C, D]`` hidden states; row t predicts ``completion_ids[:, t]``.
        weight: ``[V, D]`` lm_head weight (same dtype as hidden). bias: ``[V]`` or None.
        completion_ids: ``[B, C]`` integer token ids; read only inside the mask.
        advantages: ``[B]`` or ``[B, C]`` real tensor.
        completion_mask: ``[B, C]`` bool or 0/1 (a fractional mask weights its tokens, as TRL multiplies by it).
        old_logprobs: ``[B, C]`` log-probs of the policy that sampled (None: on-policy, ``sg(logp)``).
        ref_logprobs: ``[B, C]`` reference-model log-probs; required when ``beta != 0``.
        temperature, logit_scale, softcap: the logits ``softcap(logit_scale * (h @ W.T + b)) / temperature``.
        loss_type: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo or vespo (formulas under "Loss types"
            below), or verl's ``"vanilla"`` (its default: PPO's clip with the dual clip ``delta``),
            ``"dppo_tv"``, ``"dppo_kl"``, ``"dro"``, ``"clip_cov"``, ``"kl_cov"``, ``"geo_mean"``
            (``losses/verl_terms.py``; aggregated by ``loss_agg_mode``, None: ``"token-mean"``;
            geo_mean's policy term is a mean over completions, its KL and entropy terms follow
            ``loss_agg_mode``). epsilon_low, epsilon_high: clip range (``epsilon_high`` None: ``epsilon_low``;
            cispo's cap is ``epsilon_high``; DPPO's divergence thresholds). delta: two-sided clipping cap of
            the grpo-family ratio (INTELLECT-2), None for none; vanilla's dual-clip bound (> 1) and DPPO's
            ratio truncation, verl's ``clip_ratio_c`` (None: verl's 3.0); other loss types ignore it.
        beta: KL coefficient. use_bias_correction_kl: multiply the k3 KL term by the differentiable ratio
            (DeepSeek-V3.2; TRL 1.16's default True).
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures (A > 0, A <= 0).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weighting (A >= 0, A < 0).
        off_policy_mask_threshold: drop completions with A < 0 whose mean ``sampling - logp`` exceeds it
            (DeepSeek-V3.2's off-policy sequence mask); None: off.
        sampling_logprobs: ``[B, C]`` log-probs of the sampling engine for that mask (None: ``old_logprobs``,
            as TRL falls back; NaN inside the mask counts as 0, as TRL's ``nan_to_num``).
        top_entropy_quantile: keep in the policy term only tokens whose entropy reaches this top quantile of
            the batch's masked entropies (1.0: all tokens).
        entropy_coef: subtract ``entropy_coef`` times the masked mean entropy (over the kept tokens).
        kl_loss_type: verl's KL estimator for the penalty (``"kl"``/``"k1"``, ``"abs"``, ``"mse"``/``"k2"``,
            ``"low_var_kl"``/``"k3"`` with verl's clamps, each with a ``"+"`` straight-through variant: its
            value, k2's gradient), times the ratio with ``use_bias_correction_kl`` (verl: False); None: TRL's
            k3 above, unclamped.
        loss_agg_mode: verl's aggregation, independent of ``loss_type``: ``"token-mean"`` (by
            ``num_items_in_batch`` tokens, None: the mask's sum), ``"token-sum"``, ``"seq-mean-token-sum"``,
            ``"seq-mean-token-mean"``, ``"seq-mean-token-sum-norm"`` (by ``max_completion_length``, None: C);
            sequence means over ``global_batch_size`` completions (None: those with a token), times
            ``num_processes`` (verl's dp_size); the entropy bonus is aggregated the same way, over the mask.
            With ``num_processes > 1`` the means need the global count (``num_items_in_batch`` for
            token-mean, ``global_batch_size`` for the sequence means): without it a ValueError, as verl
            raises. None: the aggregation of ``loss_type`` below.
        global_batch_size: the completions a sequence-mean ``loss_agg_mode`` divides by (all ranks).
        cispo_two_sided: verl's cispo: the ratio clamped to ``[1 - epsilon_low, 1 + epsilon_high]``, its
            log clamped to +-20, instead of TRL's cap at ``epsilon_high``.
        dro_beta: the quadratic log-ratio penalty of ``loss_type="dro"`` (required there, > 0).
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: ``clip_cov``'s share of tokens drawn (torch's global
            generator, as verl) among those whose covariance lies in ``(clip_cov_lb, clip_cov_ub)``.
        kl_cov_ratio, ppo_kl_coef: ``kl_cov``'s share of tokens of largest covariance, and their
            ``|logp - old|`` penalty's weight (verl's ``PolicyLossConfig`` defaults, 0.0002 and 0.1).
        max_completion_length: dr_grpo's constant (None: C).
        num_items_in_batch: dapo/cispo/vespo normaliser (int or tensor; None: the mask's sum).
        num_processes: the dapo/cispo/vespo normaliser is ``max(1, num_items_in_batch) / num_processes``.
        importance_weights: ``[B]``, ``[B, 1]`` or ``[B, C]`` weights (TRL's vLLM importance-sampling ratio);
            vespo takes ``[B, C]`` and folds them into its sequence weight instead.
        return_details: also return a ``GRPODetails``.
        {shared}

    Returns:
        The scalar loss (fp32; float64 for float64 inputs), or ``(loss, GRPODetails)`` with the per-token
        log-probs (differentiable) and entropy (detached), and TRL's logged metrics: ``kl`` (masked mean of
        the KL term as it enters the loss), the clip ratios (grpo family; cispo: its ``cispo_clip_ratio`` as
        ``clip_ratio_high``; None for sapo and vespo), ``vespo_phi_seq_mean``, and ``policy_loss`` (the loss
        before the entropy bonus).

    Loss types:
    Per token t of completion i (mask m, advantage A, log-probability logp; sg = stop-gradient), with the
    importance ratio r = exp(logp - old) per token, or at ``importance_sampling_level="sequence"`` (GSPO)
    r_i = exp(sum_t m (logp - old) / max(1, sum_t m)), one per completion::

        grpo, bnpo, dr_grpo, dapo, luspo : l = -min(r A, clamp(r, 1 - eps_low, 1 + eps_high) A)
                                           (delta set: r <- min(r, delta) in the first term only)
        cispo : l = -sg(min(r, eps_high)) A logp
        sapo  : l = -(4 / tau) sigmoid(tau (r - 1)) A,    tau = sapo_temperature_pos if A > 0 else _neg
        vespo : l = -sg(phi) A logp,    phi = exp(lam + k log w - lam w)  (k, lam: _pos if A >= 0 else _neg)
                log w = clamp(sum_t m clamp(logp - old, -20, 20) + sum_t m log IS, log 1e-8, 20)
        off-policy mask (off_policy_mask_threshold) : l <- l * [A >= 0  or  mean_t m (sampling - sg(logp)) <= threshold]
        entropy mask (top_entropy_quantile = q < 1) : l <- l * [H m >= quantile(H over the mask, 1 - q)]
        importance_weights IS (not vespo)           : l <- l * IS
        KL penalty (beta != 0)                      : l <- l + beta (exp(ref - logp) - (ref - logp) - 1) * r^c
                                                      (c = 1 with use_bias_correction_kl, else 0)

    aggregated over the mask (``_aggregation_weights``), then ``- entropy_coef * (masked mean entropy)``. The
    ratio in the KL term is TRL's differentiable ``coef_1``, before the delta cap: on-policy its value is 1 but
    its gradient is not zero.

    For verl users: verl's option names are ``epsilon_low/high`` = ``clip_ratio_low/high``, ``delta`` =
    ``clip_ratio_c``, ``beta`` = ``kl_loss_coef`` (no ``use_kl_loss``: ``beta=0`` is off),
    ``num_items_in_batch`` = ``batch_num_tokens``, ``num_processes`` = ``dp_size``,
    ``max_completion_length`` = ``loss_scale_factor``, ``importance_weights`` = ``rollout_is_weights``;
    ``entropy_coef``, ``global_batch_size`` and the options of verl's own losses keep verl's names and
    defaults. The defaults that follow TRL and differ from verl's, to set explicitly for verl's loss:

    * ``use_bias_correction_kl=True`` (TRL) multiplies the KL term by the ratio; verl has no such factor:
      pass ``False``.
    * ``kl_loss_type=None`` is TRL's unclamped k3; verl's default is ``"low_var_kl"`` (k3 with its clamps).
    * ``loss_type="cispo"`` is TRL's one-sided cap at ``epsilon_high``; verl's cispo is
      ``cispo_two_sided=True``.
    * ``loss_type="dapo"`` (TRL's default) has no dual clip. verl's default ``"vanilla"`` (PPO's clip, and the
      dual clip at ``delta``, None: 3.0, where A < 0) is a loss type of its own here; ``loss_type="dapo",
      delta=3.0, loss_agg_mode="token-mean"`` equals it but where ``|logp - old| > 20``, which verl clamps.
    * ``loss_agg_mode=None`` aggregates TRL's way for TRL's loss types; verl's own loss types, vanilla
      included, default to verl's ``"token-mean"``.
    * seq-mean-token-mean and geo_mean divide a completion's sum by ``count + 1e-8`` as verl writes it; verl's
      trainer passes a bool mask, whose integer count turns the 1e-8 into nothing in float32 (a 1e-8 / count
      relative difference).

    Example::

        loss = fusedloss.grpo_loss(h, model.lm_head.weight, ids, adv, mask, old_logprobs=old,
                                   loss_type="dapo", epsilon_high=0.28, beta=0.04, ref_logprobs=ref)
    """
    opts = _Options.of(loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                       beta=beta, use_bias_correction_kl=use_bias_correction_kl,
                       importance_sampling_level=importance_sampling_level,
                       sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                       vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                       vespo_lambda_neg=vespo_lambda_neg, off_policy_mask_threshold=off_policy_mask_threshold,
                       top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef,
                       kl_loss_type=kl_loss_type, loss_agg_mode=loss_agg_mode, cispo_two_sided=cispo_two_sided,
                       dro_beta=dro_beta, clip_cov_ratio=clip_cov_ratio, clip_cov_lb=clip_cov_lb,
                       clip_cov_ub=clip_cov_ub, kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef)
    v.require_positive_int("global_batch_size", global_batch_size, allow_none=True)
    v.require_positive_int("num_processes", num_processes)
    v.require_positive_int("max_completion_length", max_completion_length, allow_none=True)
    _require_global_count(opts, num_processes, num_items_in_batch, global_batch_size)
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale,
                             softcap=softcap, backend=backend, **head)
    batch = _Completions.of(logits, opts, completion_ids, advantages, completion_mask, old_logprobs=old_logprobs,
                            ref_logprobs=ref_logprobs, sampling_logprobs=sampling_logprobs,
                            importance_weights=importance_weights)
    if opts.loss_agg_mode is None:
        token_weight = _aggregation_weights(batch.m, opts.loss_type, max_completion_length, num_items_in_batch,
                                            num_processes)  # loss = sum_t token_weight_t * l_t
    else:
        token_weight = aggregation_weights(batch.m, opts.loss_agg_mode, batch_num_tokens=num_items_in_batch,
                                           dp_size=num_processes, global_batch_size=global_batch_size,
                                           loss_scale_factor=max_completion_length)
    want_entropy = return_details or opts.needs_entropy
    if opts.row_local and not return_details:
        return logits.row_local_loss(_row_loss(batch, token_weight, _entropy_weights(batch, token_weight, None, opts),
                                               opts), targets=batch.ids,
                                     want_entropy=want_entropy)

    stats = logits.statistics(targets=batch.ids, want_entropy=want_entropy)
    logp, entropy = logits.unflatten(stats.logp), logits.unflatten(stats.entropy)
    token_log_ratio = logp - batch.old_or(logp)
    log_ratio = token_log_ratio
    if opts.importance_sampling_level == "sequence":  # GSPO: one ratio per completion
        log_ratio = ((token_log_ratio * batch.m).sum(-1) / count_or_one(batch.m.sum(-1))).unsqueeze(-1)
    phi = _vespo_weights(token_log_ratio, batch, opts) if opts.loss_type == "vespo" else None
    keep = _kept_tokens(logp, entropy, batch, opts)
    per_token, kl, ratio = _token_loss(logp, log_ratio, batch, opts, keep=keep, phi=phi)
    policy_loss = (token_weight * per_token).sum()
    if opts.loss_type == "geo_mean":  # a per-completion objective: its own aggregation (the KL term is per token)
        policy_loss = policy_loss + geo_mean_policy(logp, batch.old_or(logp), batch.adv, batch.m, batch.weights,
                                                    epsilon_low=opts.epsilon_low, epsilon_high=opts.epsilon_high)
    loss = policy_loss
    if opts.entropy_coef != 0:  # the entropy bonus
        loss = loss - opts.entropy_coef * (_entropy_weights(batch, token_weight, keep.entropy, opts) * entropy).sum()
    if not return_details:
        return loss
    return loss, _details(logp, entropy, kl, ratio, phi, policy_loss, batch, opts)


def _require_global_count(opts: "_Options", num_processes: int, num_items_in_batch, global_batch_size) -> None:
    """verl's ``agg_loss`` refuses a mean over one rank's tokens or completions scaled by ``dp_size``: this
    rank's count times the world size is the world size times the loss after the data-parallel average, a
    learning rate silently scaled by ``num_processes``. The global count must be given."""
    if num_processes == 1 or opts.loss_agg_mode in (None, "token-sum"):
        return
    if opts.loss_type == "geo_mean" and opts.beta == 0 and opts.entropy_coef == 0:
        return  # its policy term has its own mean; nothing is aggregated by loss_agg_mode
    if opts.loss_agg_mode == "token-mean":
        missing, what = num_items_in_batch, "num_items_in_batch (verl's batch_num_tokens: the tokens of all ranks)"
        name = "num_items_in_batch"
    else:
        missing, what = global_batch_size, "global_batch_size (the completions of all ranks)"
        name = "global_batch_size"
    if missing is None:
        raise ValueError(f"{name} is required with loss_agg_mode={opts.loss_agg_mode!r} and num_processes="
                         f"{num_processes}: the mean is over {what}, and this rank's own count times "
                         f"num_processes would scale the loss by {num_processes} (verl's agg_loss refuses it too)")


def _row_loss(batch: "_Completions", token_weight: torch.Tensor, entropy_weight: torch.Tensor, opts: "_Options"):
    """The same loss as a sum of row terms, for the grad-in-forward path (``ImplicitLogits.row_local_loss``): the
    token-level ratio, no sequence-level mask."""

    def row_loss(stats, rows):
        tokens = batch.rows(rows)
        per_token, _, _ = _token_loss(stats.logp, stats.logp - tokens.old_or(stats.logp), tokens, opts)
        loss = (token_weight.reshape(-1)[rows] * per_token).sum()
        if opts.entropy_coef != 0:
            loss = loss - opts.entropy_coef * (entropy_weight.reshape(-1)[rows] * stats.entropy).sum()
        return loss

    return row_loss


def _entropy_weights(batch: "_Completions", token_weight: torch.Tensor, high_entropy: Optional[torch.Tensor],
                     opts: "_Options") -> torch.Tensor:
    """The entropy bonus is a mean over the tokens the policy term keeps (TRL's effective mask), whatever
    the loss type's normalisation; with a ``loss_agg_mode`` it is aggregated as the policy term (verl)."""
    if opts.loss_agg_mode is not None:
        return token_weight
    m = batch.m
    kept = m if high_entropy is None else m * high_entropy
    return kept / count_or_one(kept.sum())


@dataclass(frozen=True)
class _Options:
    """The scalar options, validated."""

    loss_type: str
    epsilon_low: float
    epsilon_high: float
    delta: Optional[float]
    beta: float
    use_bias_correction_kl: bool
    importance_sampling_level: str
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    off_policy_mask_threshold: Optional[float]
    top_entropy_quantile: float
    entropy_coef: float
    kl_loss_type: Optional[str] = None
    loss_agg_mode: Optional[str] = None
    cispo_two_sided: bool = False
    dro_beta: Optional[float] = None
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    @classmethod
    def of(cls, *, epsilon_high, **options) -> "_Options":
        v.require_choice("loss_type", options["loss_type"], LOSS_TYPES + VERL_LOSS_TYPES)
        v.require_bool("cispo_two_sided", options["cispo_two_sided"])
        v.require_real("dro_beta", options["dro_beta"], positive=True, allow_none=True)
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            v.require_real(name, options[name], positive=True)
        for name in ("clip_cov_lb", "clip_cov_ub", "ppo_kl_coef"):
            v.require_real(name, options[name])
        if options["loss_type"] == "dro" and options["dro_beta"] is None:
            raise ValueError("dro_beta (> 0) is required with loss_type='dro': the weight of its quadratic "
                             "log-ratio penalty")
        verl_token_loss = options["loss_type"] in VERL_LOSS_TYPES or (
            options["loss_type"] == "cispo" and options["cispo_two_sided"])
        if verl_token_loss and options["importance_sampling_level"] != "token":
            raise ValueError(f"importance_sampling_level must be 'token' with verl's per-token loss "
                             f"{options['loss_type']!r}{' (cispo_two_sided)' if options['cispo_two_sided'] else ''}, "
                             f"got {options['importance_sampling_level']!r}")
        if options["loss_type"] in VERL_LOSS_TYPES and options["loss_agg_mode"] is None:
            options["loss_agg_mode"] = "token-mean"  # verl's default aggregation
        v.require_choice("importance_sampling_level", options["importance_sampling_level"],
                         IMPORTANCE_SAMPLING_LEVELS)
        v.require_real("epsilon_low", options["epsilon_low"], nonnegative=True)
        v.require_real("epsilon_high", epsilon_high, nonnegative=True, allow_none=True)
        v.require_real("delta", options["delta"], positive=True, allow_none=True)
        if options["loss_type"] == "vanilla" and options["delta"] is not None and not options["delta"] > 1:
            raise ValueError(f"delta must be > 1 with loss_type='vanilla' (its dual-clip bound, verl's clip_ratio_c, "
                             f"which verl requires > 1), got {options['delta']!r}")
        v.require_bool("use_bias_correction_kl", options["use_bias_correction_kl"])
        for name in ("beta", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef"):
            v.require_real(name, options[name])
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            v.require_real(name, options[name], positive=True)  # SAPO divides by its temperature
        v.require_real("off_policy_mask_threshold", options["off_policy_mask_threshold"], allow_none=True)
        v.require_real("top_entropy_quantile", options["top_entropy_quantile"], nonnegative=True)
        if options["kl_loss_type"] is not None:
            v.require_choice("kl_loss_type", options["kl_loss_type"], KL_LOSS_TYPES)
        if options["loss_agg_mode"] is not None:
            v.require_choice("loss_agg_mode", options["loss_agg_mode"], LOSS_AGG_MODES)
        if options["top_entropy_quantile"] > 1:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {options['top_entropy_quantile']!r}")
        eps_high = options["epsilon_low"] if epsilon_high is None else epsilon_high
        return cls(epsilon_high=eps_high, **options)

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0 or self.top_entropy_quantile < 1

    @property
    def row_local(self) -> bool:
        """Every per-token term depends on its own token's statistics only (grad-in-forward path eligible)."""
        return (self.importance_sampling_level == "token"
                and self.loss_type not in ("vespo", "geo_mean") + COVARIANCE_LOSS_TYPES
                and self.off_policy_mask_threshold is None and self.top_entropy_quantile == 1)


class _Completions(NamedTuple):
    """The per-token inputs, validated, ``[B, C]`` in the accumulation dtype, and neutral outside the mask
    (advantage 0, log-probs 0, weight 1): a token outside the mask then contributes exactly 0 to every term
    and to every gradient, whatever was there."""

    ids: torch.Tensor  # [B * C] int64, -1 outside the mask (an ignored row of the core)
    valid: torch.Tensor  # [B, C] bool
    m: torch.Tensor  # [B, C] the mask as TRL multiplies by it
    adv: torch.Tensor
    adv_seq: Optional[torch.Tensor]  # [B, 1] as given, when TRL's advantages are [B, 1] (see ``of``)
    old: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]
    sampling: Optional[torch.Tensor]
    weights: Optional[torch.Tensor]

    @classmethod
    def of(cls, logits: ImplicitLogits, opts: _Options, completion_ids, advantages, completion_mask, *,
           old_logprobs, ref_logprobs, sampling_logprobs, importance_weights) -> "_Completions":
        mask = _check_inputs(logits, opts, completion_ids, advantages, completion_mask, old_logprobs=old_logprobs,
                             ref_logprobs=ref_logprobs, sampling_logprobs=sampling_logprobs,
                             importance_weights=importance_weights)
        b, c = logits.lead_shape
        valid = mask != 0
        # Ids outside the mask (padding) are never read; every id inside it must be a real token.
        ids = logits.targets("completion_ids", torch.where(valid, completion_ids, torch.zeros_like(completion_ids)),
                             ignore_index=None, hint=_MASK_NOT_LABELS)
        ids = torch.where(valid.reshape(-1), ids, torch.full_like(ids, -1))
        acc = torch.float64 if logits.hidden.dtype == torch.float64 else torch.float32

        def neutral(t, value=0.0):
            if t is None:
                return None
            t = t.to(acc)
            t = (t.unsqueeze(1) if t.dim() == 1 else t).expand(b, c)
            return torch.where(valid, t, torch.full_like(t, value))

        # TRL's [B, 1] advantages (given per completion, or per token with C == 1) are read as given by its
        # plain-mean clip metrics, masked entries included.
        adv_seq = advantages.to(acc).reshape(b, 1) if advantages.dim() == 1 or c == 1 else None
        return cls(ids=ids, valid=valid, m=mask.to(acc), adv=neutral(advantages), adv_seq=adv_seq,
                   old=neutral(old_logprobs), ref=neutral(ref_logprobs), sampling=neutral(sampling_logprobs),
                   weights=neutral(importance_weights, 1.0))

    def old_or(self, logp: torch.Tensor) -> torch.Tensor:
        """The sampling policy's log-probs; on-policy ``sg(logp)``, so the ratio is 1 with gradient d logp."""
        return logp.detach() if self.old is None else self.old

    def rows(self, rows) -> "_Completions":
        """The per-token inputs of ``rows`` of the flattened batch (for the grad-in-forward path's row chunks)."""
        return _Completions(*(t if t is None or name in ("ids", "adv_seq") else t.reshape(-1)[rows]
                              for name, t in zip(self._fields, self)))


def _check_inputs(logits: ImplicitLogits, opts: _Options, completion_ids, advantages, completion_mask,
                  **per_token) -> torch.Tensor:
    """Shapes, dtypes and devices of the batch; returns the completion mask."""
    if len(logits.lead_shape) != 2:
        raise ValueError(f"hidden must be [B, C, D] (row t predicts completion_ids[:, t]), got shape "
                         f"{tuple(logits.lead_shape) + (logits.hidden.shape[-1],)}")
    b, c = logits.lead_shape
    v.require_tensor("completion_ids", completion_ids, floating=False)
    require_aligned("completion_ids", completion_ids, (b, c))
    mask = v.require_mask("completion_mask", completion_mask, (b, c))
    v.require_tensor("advantages", advantages)
    if advantages.is_complex() or advantages.dtype == torch.bool:
        raise TypeError(f"advantages must be a real (floating-point or integer) tensor, got {advantages.dtype}")
    if tuple(advantages.shape) not in ((b,), (b, c)):
        raise ValueError(f"advantages must have shape ({b},) or ({b}, {c}), got {tuple(advantages.shape)}")
    if opts.beta != 0 and per_token["ref_logprobs"] is None:
        raise ValueError(f"ref_logprobs is required when beta != 0 (beta={opts.beta!r}): the KL penalty needs "
                         "the reference model's per-token log-probs")
    weights = per_token.pop("importance_weights")
    for name, t in per_token.items():
        if t is not None:
            v.require_tensor(name, t, floating=True)
            v.require_shape(name, t, (b, c))
    if weights is not None:
        v.require_tensor("importance_weights", weights, floating=True)
        shapes = ((b, c),) if opts.loss_type == "vespo" else ((b,), (b, 1), (b, c))
        if tuple(weights.shape) not in shapes:
            why = (" (vespo folds per-token weights into its sequence weight, as TRL requires a token-level "
                   "importance-sampling mode)") if opts.loss_type == "vespo" else ""
            raise ValueError(f"importance_weights must have shape {' or '.join(map(str, shapes))}{why}, "
                             f"got {tuple(weights.shape)}")
    v.require_same_device(hidden=logits.hidden, completion_ids=completion_ids, advantages=advantages,
                          completion_mask=completion_mask, importance_weights=weights, **per_token)
    return mask


class _Kept(NamedTuple):
    """TRL's multiplicative masks of the policy term (None where off): both ``[B, C]`` (or ``[B, 1]``)."""

    off_policy: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]


def _token_loss(logp, log_ratio, t: _Completions, opts: _Options, *, keep: Optional[_Kept] = None, phi=None):
    """Per-token loss l (0 outside the mask), the KL term as it enters l (None when beta == 0), and the ratio
    TRL's clip metrics read (after the delta cap). Elementwise: ``log_ratio`` is per token or ``[B, 1]``."""
    ratio = torch.exp(log_ratio)  # TRL's coef_1
    kl = None
    if opts.beta != 0:
        if opts.kl_loss_type is None:
            ref_gap = t.ref - logp
            kl = torch.exp(ref_gap) - ref_gap - 1
        else:
            kl = kl_estimate(logp, t.ref, opts.kl_loss_type)
        if opts.use_bias_correction_kl:
            kl = kl * ratio
    if opts.loss_type == "cispo" and opts.cispo_two_sided:
        loss = two_sided_cispo(logp, t.old_or(logp), t.adv, opts.epsilon_low, opts.epsilon_high)
    elif opts.loss_type == "cispo":
        loss = -torch.clamp(ratio, max=opts.epsilon_high).detach() * t.adv * logp
    elif opts.loss_type == "geo_mean":
        loss = torch.zeros_like(logp)  # its per-completion policy term is added by grpo_loss
    elif opts.loss_type in COVARIANCE_LOSS_TYPES:
        loss = covariance_term(opts.loss_type, logp, t.old_or(logp), t.adv, t.valid, epsilon_low=opts.epsilon_low,
                               epsilon_high=opts.epsilon_high, clip_cov_ratio=opts.clip_cov_ratio,
                               clip_cov_lb=opts.clip_cov_lb, clip_cov_ub=opts.clip_cov_ub,
                               kl_cov_ratio=opts.kl_cov_ratio, ppo_kl_coef=opts.ppo_kl_coef)
    elif opts.loss_type in VERL_LOSS_TYPES:
        loss = policy_term(opts.loss_type, logp, t.old_or(logp), t.adv, epsilon_low=opts.epsilon_low,
                           epsilon_high=opts.epsilon_high, dro_beta=opts.dro_beta,
                           clip_ratio_c=_VERL_CLIP_RATIO_C if opts.delta is None else opts.delta)
    elif opts.loss_type == "sapo":
        tau = _by_sign(t.adv > 0, opts.sapo_temperature_pos, opts.sapo_temperature_neg, t.adv.dtype)
        loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * t.adv
    elif opts.loss_type == "vespo":
        loss = -phi * t.adv * logp
    else:
        clipped = torch.clamp(ratio, 1 - opts.epsilon_low, 1 + opts.epsilon_high)
        if opts.delta is not None:
            ratio = torch.clamp(ratio, max=opts.delta)  # after the clamp is formed: the first term only
        loss = -torch.min(ratio * t.adv, clipped * t.adv)
    for factor in (() if keep is None else keep):
        if factor is not None:
            loss = loss * factor
    if t.weights is not None and opts.loss_type != "vespo":
        loss = loss * t.weights
    if kl is not None:
        loss = loss + opts.beta * kl
    return loss, kl, ratio


def _by_sign(condition: torch.Tensor, if_true: float, if_false: float, dtype: torch.dtype) -> torch.Tensor:
    """``torch.where`` of two options, in the accumulation dtype (Python floats would round to the default
    dtype first: 1.05 in fp32 is off by 5e-8 in a float64 loss)."""
    return torch.where(condition, torch.tensor(if_true, dtype=dtype, device=condition.device),
                       torch.tensor(if_false, dtype=dtype, device=condition.device))


def _kept_tokens(logp, entropy, t: _Completions, opts: _Options) -> _Kept:
    """TRL's off-policy sequence mask (``get_off_policy_mask``) and high-entropy token mask
    (``get_high_entropy_mask``), on detached statistics."""
    off_policy = None
    if opts.off_policy_mask_threshold is not None:
        sampling = t.old_or(logp) if t.sampling is None else t.sampling
        gap = torch.nan_to_num(sampling - logp.detach(), nan=0.0)
        seq_gap = (gap * t.m).sum(-1, keepdim=True) / count_or_one(t.m.sum(-1, keepdim=True))
        off_policy = ((t.adv >= 0) | (seq_gap <= opts.off_policy_mask_threshold)).to(t.m.dtype)
    high_entropy = None
    if opts.top_entropy_quantile < 1:
        entropy = entropy.detach()
        threshold = _masked_quantile(entropy, t.valid, 1 - opts.top_entropy_quantile)
        high_entropy = ((entropy * t.m >= threshold) & t.valid).to(t.m.dtype)
    return _Kept(off_policy, high_entropy)


def _masked_quantile(x: torch.Tensor, valid: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(x[valid], q)`` (linear interpolation, as TRL takes it), without the data-dependent
    shape of ``x[valid]``, so that it traces under torch.compile; +inf when nothing is valid (no token
    reaches it, as TRL keeps none)."""
    values = torch.sort(torch.where(valid, x, torch.full_like(x, torch.inf)).reshape(-1)).values
    if values.numel() == 0:  # an empty batch (B or C = 0): nothing to gather from
        return x.new_full((), torch.inf)
    count = valid.sum()
    position = q * (count - 1).clamp(min=0).to(x.dtype)
    below = position.floor()
    low = values.gather(0, below.long().reshape(1)).squeeze(0)
    high = values.gather(0, position.ceil().long().reshape(1)).squeeze(0)
    threshold = torch.lerp(low, high, position - below)
    return torch.where(count > 0, threshold, torch.full_like(threshold, torch.inf))


def _vespo_weights(log_ratio, t: _Completions, opts: _Options) -> torch.Tensor:
    """VESPO's detached gamma weight phi(w) of each completion (TRL's ``get_gamma_weights``): ``[B, 1]``, or
    ``[B, C]`` with per-token advantages (k and lambda follow the sign of each token's advantage)."""
    with torch.no_grad():
        log_w = (torch.clamp(log_ratio, -20.0, 20.0) * t.m).sum(-1, keepdim=True)
        if t.weights is not None:
            # Outside the mask the weights are 1 (log 0): the sum runs over the completion's own tokens.
            log_w = log_w + torch.clamp(torch.log(t.weights), _VESPO_LOG_W_MIN, 20.0).sum(-1, keepdim=True)
        log_w = torch.clamp(log_w, _VESPO_LOG_W_MIN, 20.0)
        nonneg = _advantages_as_trl(t) >= 0
        k = _by_sign(nonneg, opts.vespo_k_pos, opts.vespo_k_neg, log_w.dtype)
        lam = _by_sign(nonneg, opts.vespo_lambda_pos, opts.vespo_lambda_neg, log_w.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def _aggregation_weights(m, loss_type, max_completion_length, num_items_in_batch, num_processes):
    """Weights w with loss = sum_t w_t l_t for each aggregation of TRL 1.16 (m: the completion mask)::

        grpo, sapo           mean_i( sum_t m l / max(1, sum_t m) )
        bnpo                 sum m l / max(1, sum m)
        dr_grpo              sum m l / (B * max_completion_length)
        dapo, cispo, vespo   sum m l / (max(1, num_items_in_batch) / num_processes)
        luspo                mean_i( sum_t m l )
    """
    b, c = m.shape
    if loss_type in ("grpo", "sapo"):
        return m / (b * count_or_one(m.sum(-1, keepdim=True)))
    if loss_type == "bnpo":
        return m / count_or_one(m.sum())
    if loss_type == "dr_grpo":
        return m / (b * (c if max_completion_length is None else max_completion_length))
    if loss_type == "luspo":
        return m / max(b, 1)
    items = m.sum() if num_items_in_batch is None else items_divisor(num_items_in_batch, m)
    return m * (num_processes / count_or_one(items))


def _details(logp, entropy, kl, ratio, phi, policy_loss, t: _Completions, opts: _Options) -> GRPODetails:
    with torch.no_grad():
        clip = _clip_metrics(ratio.detach(), t, opts)
        return GRPODetails(
            logprobs=logp,
            entropy=entropy.detach(),
            # A per-token value: always a masked mean (TRL's plain-mean branch for [B, 1] tensors would count
            # masked tokens when C == 1).
            kl=None if kl is None else (kl.detach() * t.m).sum() / count_or_one(t.m.sum()),
            clip_ratio_low=clip[0], clip_ratio_high=clip[1], clip_ratio_region=clip[2],
            clip_ratio_low_min=clip[3], clip_ratio_high_max=clip[4],
            vespo_phi_seq_mean=None if phi is None else _batch_mean(phi, t),
            policy_loss=policy_loss.detach(),
        )


def _clip_metrics(ratio, t: _Completions, opts: _Options):
    """TRL's clip_ratio/{low_mean, high_mean, region_mean, low_min, high_max} for the grpo family; cispo's
    cispo_clip_ratio as the high (and region) ratio; nothing for sapo and vespo, which do not clip, nor for
    verl's losses (dppo, dro, two-sided cispo), whose metrics are verl's own."""
    if opts.loss_type in ("sapo", "vespo") + VERL_LOSS_TYPES or opts.cispo_two_sided:
        return None, None, None, None, None
    adv = _advantages_as_trl(t) if ratio.shape[1] == 1 else t.adv
    if opts.loss_type == "cispo":
        high = _batch_mean(((ratio > opts.epsilon_high) & (adv > 0)).to(t.m.dtype), t)
        return torch.zeros_like(high), high, high, None, None
    low = ((ratio < 1 - opts.epsilon_low) & (adv < 0)).to(t.m.dtype)
    high = ((ratio > 1 + opts.epsilon_high) & (adv > 0)).to(t.m.dtype)
    region = torch.maximum(low, high)
    return (_batch_mean(low, t), _batch_mean(high, t), _batch_mean(region, t),
            _sequence_extreme(low, t, torch.amin), _sequence_extreme(high, t, torch.amax))


def _advantages_as_trl(t: _Completions) -> torch.Tensor:
    """The advantages in TRL's shape: ``[B, 1]`` when given per completion, so that a per-completion ratio
    or weight compared with them stays one value per completion (TRL then takes a plain mean over them)."""
    return t.adv if t.adv_seq is None else t.adv_seq


def _batch_mean(x, t: _Completions):
    """TRL's global_masked_mean: a masked mean over tokens, or a plain mean of one value per completion."""
    if x.shape[1] == 1:
        return x.sum() / max(x.shape[0], 1)
    return (x * t.m).sum() / count_or_one(t.m.sum())


def _sequence_extreme(x, t: _Completions, reduce):
    """TRL's nanmin/nanmax over completions of the per-completion masked mean (empty completions skipped;
    0 when every completion is empty, where TRL would log NaN)."""
    if x.shape[1] == 1:
        per_seq, present = x[:, 0], torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    else:
        count = t.m.sum(-1)
        present = count != 0  # TRL divides by the mask sum itself (a fractional mask may sum below 1)
        per_seq = (x * t.m).sum(-1) / torch.where(present, count, torch.ones_like(count))
    skip = torch.inf if reduce is torch.amin else -torch.inf
    extreme = reduce(torch.where(present, per_seq, torch.full_like(per_seq, skip)), dim=0) if x.numel() else None
    if extreme is None:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(present.any(), extreme, torch.zeros_like(extreme))
