"""``grpo_loss`` with verl's options against verl 0.9's own actor loss: ``loss_agg_mode``, ``kl_loss_type``,
the policy losses ``dppo_tv``, ``dppo_kl``, ``dro`` and verl's two-sided ``cispo``, and ``token_logprobs``'
sum of squared probabilities.

The oracle is ``verl.workers.utils.losses.ppo_loss`` in float64 with verl's own ``ActorConfig``: the policy
loss of ``policy_loss.loss_mode`` (``vanilla``: PPO clip with the dual clip ``clip_ratio_c``), the entropy
bonus and the KL loss, each aggregated by ``agg_loss``, fed with log-probs and entropies of materialised
float64 logits in verl's packed layout. fusedloss's counterpart: ``loss_type="bnpo"`` and
``delta=clip_ratio_c`` for vanilla (the clipped surrogate), verl's name otherwise (``cispo_two_sided=True``),
``epsilon_low/high=clip_ratio_low/high``, ``beta=kl_loss_coef``, ``use_bias_correction_kl=False``,
``num_items_in_batch=batch_num_tokens``, ``num_processes=dp_size``, ``max_completion_length=loss_scale_factor``.
Gradients of hidden, weight and bias through both.
"""

from __future__ import annotations

import pytest
import torch
from _main_suite import make_head, rel_err
from _trl_oracle import float64_default, head_logits

import fusedloss

verl_worker_losses = pytest.importorskip("verl.workers.utils.losses")
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

B, C, D, V = 4, 6, 19, 37
PROMPT = 2
RATIOS = torch.tensor([0.5, 0.7, 0.9, 1.0, 1.1, 1.37, 1.7, 4.2], dtype=torch.float64)
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0


def batch(seed=0, far_reference=False, trust_region=False):
    """Peaked heads, completions of lengths 6, 3, 0 (fully masked) and 1, old log-probs that put the ratios on
    RATIOS (4.2: past the dual clip), reference log-probs near the policy (``far_reference``: some 12 and 25
    nats away, where verl's k3 clamps its exponent and its value), per-token advantages. ``trust_region``:
    the tokens are each row's most likely one and the old probabilities differ from the new by -0.5 .. 0.4,
    so that DPPO's trust-region masks drop some tokens on either sign of the advantage."""
    h, w, b, _ = make_head(0, D, V, leading=(B, C), bias=True, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (B, C), generator=g)
    mask = torch.arange(C)[None, :] < torch.tensor([6, 3, 0, 1])[:, None]
    z = head_logits(h, w, b)
    if trust_region:
        ids = z.argmax(-1)
    logp = torch.log_softmax(z, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    pick = RATIOS[torch.randint(0, len(RATIOS), (B, C), generator=g)]
    old = logp - pick.log()
    if trust_region:
        shift = torch.tensor([-0.5, -0.3, -0.1, 0.05, 0.2, 0.4], dtype=torch.float64)
        shift = shift[torch.randint(0, len(shift), (B, C), generator=g)]
        old = torch.clamp(logp.exp() - shift, 1e-3, 0.999).log()
    ref = logp + 0.4 * torch.randn(B, C, generator=g, dtype=torch.float64)
    adv = torch.randn(B, C, generator=g, dtype=torch.float64)
    if far_reference:
        ref[0, :4] = logp[0, :4] + torch.tensor([12.0, -12.0, 25.0, -25.0], dtype=torch.float64)
    return (h, w, b), ids, mask, old, ref, adv


def packed(per_response: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` response values in verl's packed layout ``[B * (PROMPT + C)]`` (output t predicts t + 1)."""
    out = torch.zeros(B, PROMPT + C, dtype=per_response.dtype)
    out[:, PROMPT - 1:PROMPT + C - 1] = per_response
    return out.reshape(-1)


def verl_loss(head, ids, mask, old, ref, adv, *, loss_agg_mode, kl_loss_type, kl_coef, entropy_coeff,
              batch_num_tokens=None, dp_size=1, global_batch_size=None, loss_scale_factor=None, loss_mode="vanilla",
              clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dro_beta=None, importance_weights=None, **covariance):
    logq = torch.log_softmax(head_logits(*head), -1)
    logp = logq.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logq.exp() * logq).sum(-1)
    data = tu.get_tensordict({
        "prompts": torch.ones(B, PROMPT, dtype=torch.long), "responses": ids,
        "attention_mask": torch.ones(B, PROMPT + C, dtype=torch.long), "response_mask": mask.long(),
        "old_log_probs": old, "advantages": adv, "ref_log_prob": ref,
        **({} if importance_weights is None else {"rollout_is_weights": importance_weights}),
    }, non_tensor_dict=dict(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size))
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=1024,
        loss_scale_factor=loss_scale_factor, loss_agg_mode=loss_agg_mode,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=dro_beta, **covariance), clip_ratio=clip_low,
        clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=CLIP_C, entropy_coeff=entropy_coeff,
        use_kl_loss=kl_coef != 0, kl_loss_type=kl_loss_type, kl_loss_coef=kl_coef)
    with float64_default():
        loss, _ = verl_worker_losses.ppo_loss(config, {"log_probs": packed(logp), "entropy": packed(entropy)}, data)
    return loss


def fused_loss(fn, head, ids, mask, old, ref, adv, *, loss_agg_mode, kl_loss_type, kl_coef, entropy_coeff,
               batch_num_tokens=None, dp_size=1, global_batch_size=None, loss_scale_factor=None, loss_mode="vanilla",
               clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dro_beta=None, loss_type=None, **run):
    """``run``: the backend, and clip_cov's / kl_cov's options (verl's names). ``loss_type``: fusedloss's
    name for ``loss_mode`` (None: bnpo with the dual clip for vanilla, verl's name otherwise)."""
    h, w, b = head
    loss_type = loss_type or {"vanilla": "bnpo"}.get(loss_mode, loss_mode)
    return fn(h, w, ids, adv, mask, old_logprobs=old, ref_logprobs=ref, bias=b, loss_type=loss_type,
              cispo_two_sided=loss_mode == "cispo", dro_beta=dro_beta,
              epsilon_low=clip_low, epsilon_high=clip_high, delta=CLIP_C, beta=kl_coef, use_bias_correction_kl=False,
              kl_loss_type=kl_loss_type, loss_agg_mode=loss_agg_mode, entropy_coef=entropy_coeff,
              num_items_in_batch=batch_num_tokens, num_processes=dp_size, global_batch_size=global_batch_size,
              max_completion_length=loss_scale_factor, **run)


AGG_CASES = [
    ("token-mean", {}), ("token-mean", dict(batch_num_tokens=23, dp_size=2)),
    ("token-sum", {}), ("token-sum", dict(dp_size=3)),
    ("seq-mean-token-sum", {}), ("seq-mean-token-sum", dict(global_batch_size=8, dp_size=2)),
    ("seq-mean-token-mean", {}), ("seq-mean-token-mean", dict(global_batch_size=5)),
    ("seq-mean-token-sum-norm", {}), ("seq-mean-token-sum-norm", dict(loss_scale_factor=9, global_batch_size=6)),
]
KL_TYPES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+", "k2+", "k3+", "low_var_kl+"]


def check(options, with_weights=False, **data):
    """verl's loss and gradients against fusedloss's and the reference's; the global generator is seeded
    alike before each (clip_cov draws its tokens from it)."""
    head, ids, mask, old, ref, adv = batch(**data)
    if with_weights:  # verl's rollout importance-sampling weights, per token
        options = dict(options, importance_weights=0.5 + torch.rand(B, C, generator=torch.Generator().manual_seed(5),
                                                                     dtype=torch.float64))
    leaves = [t.detach().clone().requires_grad_() for t in head]
    torch.manual_seed(1234)
    want = verl_loss(leaves, ids, mask, old, ref, adv, **options)
    want_grads = torch.autograd.grad(want, leaves)
    for fn in (fusedloss.grpo_loss, fusedloss.reference.grpo_loss):
        mine = [t.detach().clone().requires_grad_() for t in head]
        run = dict(backend="torch") if fn is fusedloss.grpo_loss else {}
        torch.manual_seed(1234)
        got = fused_loss(fn, mine, ids, mask, old, ref, adv, **options, **run)
        assert rel_err(got, want) <= 1e-12, (fn.__module__, got.item(), want.item())
        for name, g, r in zip("hwb", torch.autograd.grad(got, mine), want_grads):
            assert r.norm() > 0 and rel_err(g, r) <= 1e-12, (fn.__module__, name, rel_err(g, r))


@pytest.mark.parametrize("mode,batch_info", AGG_CASES)
def test_loss_agg_mode_matches_verl(mode, batch_info):
    check(dict(loss_agg_mode=mode, kl_loss_type="low_var_kl", kl_coef=0.05, entropy_coeff=0.01, **batch_info))


@pytest.mark.parametrize("kind", KL_TYPES)
def test_kl_loss_type_matches_verl(kind):
    check(dict(loss_agg_mode="token-mean", kl_loss_type=kind, kl_coef=0.3, entropy_coeff=0.0))


POLICY_CASES = [
    ("cispo", dict(clip_low=0.2, clip_high=0.28)),
    ("dppo_tv", dict(clip_low=0.2, clip_high=0.28)),
    ("dppo_kl", dict(clip_low=0.05, clip_high=0.1)),
    ("dro", dict(dro_beta=0.3)),
    ("clip_cov", dict(clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0)),
    ("kl_cov", dict(kl_cov_ratio=0.3, ppo_kl_coef=0.7)),
    ("geo_mean", dict(clip_low=0.3, clip_high=0.4)),
]


@pytest.mark.parametrize("kind", ["low_var_kl", "k3+", "k1", "abs+"])
def test_kl_clamps_match_verl(kind):
    check(dict(loss_agg_mode="seq-mean-token-mean", kl_loss_type=kind, kl_coef=0.3, entropy_coeff=0.0),
          far_reference=True)


@pytest.mark.parametrize("loss_mode,options", POLICY_CASES[:3], ids=[c[0] for c in POLICY_CASES[:3]])
def test_trust_regions_match_verl(loss_mode, options):
    check(dict(loss_agg_mode="token-mean", loss_mode=loss_mode, kl_loss_type="k1", kl_coef=0.05, entropy_coeff=0.0,
               **options), trust_region=True)


def test_sum_sq_probs_matches_verl_sum_pi_squared():
    """``token_logprobs(..., return_sum_sq_probs=True)`` is verl's ``calculate_sum_pi_squared_from_logits`` of
    the logits after the temperature (its optimal token baseline's input), which verl's fused kernels refuse."""
    from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits

    (h, w, b), ids, mask, *_ = batch()
    transforms = dict(temperature=0.7, logit_scale=1.3, softcap=20.0)
    want = calculate_sum_pi_squared_from_logits(head_logits(h, w, b, **transforms))
    _, got = fusedloss.token_logprobs(h, w, ids, bias=b, return_sum_sq_probs=True, backend="torch", **transforms)
    assert rel_err(got, want) <= 1e-13


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_mode,options", POLICY_CASES, ids=[c[0] for c in POLICY_CASES])
def test_policy_loss_matches_verl(loss_mode, options, mode):
    check(dict(loss_agg_mode=mode, loss_mode=loss_mode, kl_loss_type="k3", kl_coef=0.05, entropy_coeff=0.01,
               **options))


def test_clip_cov_draw_follows_the_seed():
    """The data leave clip_cov more candidates than it draws: the seed decides which, for verl and for
    fusedloss alike (so the equality above is not an accident of a forced choice)."""
    head, ids, mask, old, ref, adv = batch()
    options = dict(loss_agg_mode="token-mean", loss_mode="clip_cov", kl_loss_type="k3", kl_coef=0.0,
                   entropy_coeff=0.0, **dict(POLICY_CASES)["clip_cov"])
    losses = set()
    for seed in range(6):
        torch.manual_seed(seed)
        want = verl_loss(head, ids, mask, old, ref, adv, **options)
        torch.manual_seed(seed)
        got = fused_loss(fusedloss.grpo_loss, head, ids, mask, old, ref, adv, backend="torch", **options)
        assert rel_err(got, want) <= 1e-12
        losses.add(round(want.item(), 12))
    assert len(losses) > 1


@pytest.mark.parametrize("loss_mode,options", [POLICY_CASES[0], POLICY_CASES[3], POLICY_CASES[-1]],
                         ids=["cispo", "dro", "geo_mean"])
def test_rollout_importance_weights_match_verl(loss_mode, options):
    check(dict(loss_agg_mode="token-mean", loss_mode=loss_mode, kl_loss_type="k3", kl_coef=0.05, entropy_coeff=0.0,
               **options), with_weights=True)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_vanilla_loss_type_matches_verl(mode):
    """``loss_type="vanilla"`` is verl's default policy loss under its own name (its log-ratio clamp
    included), with rollout importance weights."""
    head, ids, mask, old, ref, adv = batch()
    weights = 0.5 + torch.rand(B, C, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    options = dict(loss_agg_mode=mode, kl_loss_type="k3", kl_coef=0.05, entropy_coeff=0.01)
    leaves = [t.detach().clone().requires_grad_() for t in head]
    want = verl_loss(leaves, ids, mask, old, ref, adv, importance_weights=weights, **options)
    want_grads = torch.autograd.grad(want, leaves)
    mine = [t.detach().clone().requires_grad_() for t in head]
    got = fused_loss(fusedloss.grpo_loss, mine, ids, mask, old, ref, adv, loss_type="vanilla",
                     importance_weights=weights, backend="torch", **options)
    assert rel_err(got, want) <= 1e-12
    for g, r in zip(torch.autograd.grad(got, mine), want_grads):
        assert r.norm() > 0 and rel_err(g, r) <= 1e-12


def test_verl_option_defaults():
    """The options that carry verl's names default to verl's values (kl_cov's ppo_kl_coef is 0.1 in
    PolicyLossConfig, not the 1.0 compute_policy_loss_kl_cov falls back to without a config), and DPPO's
    truncation / vanilla's dual clip (``delta=None``) to ActorConfig's clip_ratio_c."""
    import inspect

    policy = PolicyLossConfig()
    actor = ActorConfig(strategy="fsdp", rollout_n=1, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=1024)
    for fn in (fusedloss.grpo_loss, fusedloss.reference.grpo_loss):
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}
        for name in ("ppo_kl_coef", "kl_cov_ratio", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"):
            assert defaults[name] == getattr(policy, name), (fn.__module__, name)
        assert defaults["epsilon_low"] == actor.clip_ratio
    assert policy.loss_mode == "vanilla"
    assert fusedloss.losses.grpo._VERL_CLIP_RATIO_C == actor.clip_ratio_c
