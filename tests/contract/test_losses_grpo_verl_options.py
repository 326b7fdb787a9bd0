"""grpo_loss's verl options (``loss_agg_mode``, ``kl_loss_type``, ``global_batch_size``) on every backend,
against ``fusedloss.reference.grpo_loss`` (float64, fp32), on the grad-in-forward path and the composable one.

verl's own ``ppo_loss`` is the oracle in tests/frameworks/test_verl_policy_loss.py (run where verl is
installed); here the reference twin stands for it, and the data hold a fully masked completion, ratios on
both sides of the clips and reference log-probs far enough for verl's k3 clamps.
"""

from __future__ import annotations

import pytest
import torch
from _errors import rel_err
from _harness import compare
from conftest import BACKENDS, FP32_TOL, device_for, fp64_tol

import fusedloss
from fusedloss import reference
from fusedloss.backends.cuda import backend as cuda_backend
from fusedloss.core import registry

pytest.importorskip("trl")
from test_losses_grpo import grpo_data  # noqa: E402

F64 = torch.float64
CASES = {
    "token-mean-k3": dict(loss_agg_mode="token-mean", kl_loss_type="low_var_kl", beta=0.05, entropy_coef=0.01,
                          use_bias_correction_kl=False, loss_type="bnpo", delta=3.0),
    "token-sum-k1+": dict(loss_agg_mode="token-sum", kl_loss_type="k1+", beta=0.1, num_processes=2),
    "seq-sum-abs": dict(loss_agg_mode="seq-mean-token-sum", kl_loss_type="abs", beta=0.1, global_batch_size=5,
                        entropy_coef=0.02),
    "seq-mean-k2": dict(loss_agg_mode="seq-mean-token-mean", kl_loss_type="k2", beta=0.2, entropy_coef=0.05),
    "seq-norm-k3+": dict(loss_agg_mode="seq-mean-token-sum-norm", kl_loss_type="k3+", beta=0.1,
                         max_completion_length=9, loss_type="grpo"),
    "token-mean-items": dict(loss_agg_mode="token-mean", num_items_in_batch=11, num_processes=2, loss_type="cispo",
                             epsilon_high=1.3),
    "seq-mean-gspo": dict(loss_agg_mode="seq-mean-token-mean", importance_sampling_level="sequence", beta=0.05,
                          kl_loss_type="kl"),
    "cispo-two-sided": dict(loss_type="cispo", cispo_two_sided=True, epsilon_high=0.28, loss_agg_mode="token-mean",
                            entropy_coef=0.01),
    "vanilla": dict(loss_type="vanilla", epsilon_high=0.28, beta=0.05, kl_loss_type="k3", entropy_coef=0.01,
                    use_bias_correction_kl=False),
    "vanilla-seq-mean": dict(loss_type="vanilla", delta=2.0, loss_agg_mode="seq-mean-token-mean"),
    "dppo_tv": dict(loss_type="dppo_tv", epsilon_high=0.28, beta=0.05, kl_loss_type="k3"),
    "dppo_kl": dict(loss_type="dppo_kl", epsilon_low=0.05, epsilon_high=0.1, delta=1.5,
                    loss_agg_mode="seq-mean-token-mean"),
    "dro": dict(loss_type="dro", dro_beta=0.3, entropy_coef=0.02, loss_agg_mode="seq-mean-token-sum"),
    "geo_mean": dict(loss_type="geo_mean", epsilon_low=0.3, epsilon_high=0.4, beta=0.05, kl_loss_type="k3",
                     entropy_coef=0.01),
}


def case(name):
    data = grpo_data(lengths=(5, 0, 2))  # a fully masked completion: out of verl's sequence means
    data["ref_logprobs"][0, :2] = data["ref_logprobs"][0, :2] + torch.tensor([25.0, -25.0], dtype=F64)
    inputs = {k: data[k] for k in ("hidden", "weight", "completion_ids", "advantages", "completion_mask",
                                   "old_logprobs", "ref_logprobs")}
    return inputs, dict(CASES[name])


ALL_BACKENDS = BACKENDS + ([] if "cuda" in BACKENDS else ["cuda-host"])


def _backend(which, monkeypatch):
    if which != "cuda-host":
        return which, device_for(which)
    if not cuda_backend.extension_built():
        pytest.skip(f"CUDA extension not built: {cuda_backend.availability()}")
    original = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))
    return "cuda", torch.device("cpu")


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("which,name", [(b, n) for b in ALL_BACKENDS for n in CASES
                                        if b != "triton" or n in ("token-mean-k3", "seq-mean-k2")])
def test_verl_options_against_reference(which, name, dtype, monkeypatch):
    backend, device = _backend(which, monkeypatch)
    inputs, options = case(name)
    tol = fp64_tol(backend) if dtype == F64 else FP32_TOL
    compare("grpo_loss", inputs, options, backend, dtype, device, tol)
    compare("grpo_loss", inputs, dict(options, return_details=True), backend, dtype, device, tol)


def test_the_options_change_the_loss():
    """Each option is live: the verl aggregation and estimator differ from the loss type's own."""
    inputs, _ = case("seq-mean-k2")
    args = [inputs[k] for k in ("hidden", "weight", "completion_ids", "advantages", "completion_mask")]
    kw = dict(old_logprobs=inputs["old_logprobs"], ref_logprobs=inputs["ref_logprobs"], beta=0.1,
              use_bias_correction_kl=False, backend="torch")
    trl_default = fusedloss.grpo_loss(*args, loss_type="bnpo", **kw)
    as_bnpo = fusedloss.grpo_loss(*args, loss_type="bnpo", loss_agg_mode="token-mean", kl_loss_type="k3", **kw)
    clamped = fusedloss.grpo_loss(*args, loss_type="bnpo", loss_agg_mode="token-mean", kl_loss_type="k3+", **kw)
    seq = fusedloss.grpo_loss(*args, loss_type="bnpo", loss_agg_mode="seq-mean-token-mean", kl_loss_type="k3", **kw)
    # token-mean is bnpo's aggregation; verl's k3 clamps what TRL's k3 leaves at e^25
    assert abs(as_bnpo.item() - trl_default.item()) > 1.0 and abs(clamped.item() - as_bnpo.item()) < 1e-12
    assert abs(seq.item() - as_bnpo.item()) > 1e-3
    want = reference.grpo_loss(*args, loss_type="bnpo", loss_agg_mode="seq-mean-token-mean", kl_loss_type="k3",
                               **{k: v for k, v in kw.items() if k != "backend"})
    assert abs(seq.item() - want.item()) <= 1e-12 * abs(want.item())


@pytest.mark.parametrize("options,match", [
    (dict(loss_agg_mode="mean"), "loss_agg_mode must be one of"),
    (dict(kl_loss_type="k4"), "kl_loss_type must be one of"),
    (dict(loss_agg_mode="seq-mean-token-sum", global_batch_size=0), "global_batch_size"),
    (dict(loss_type="dro"), "dro_beta"),
    (dict(loss_type="dro", dro_beta=-1.0), "dro_beta"),
    (dict(loss_type="dppo_tv", importance_sampling_level="sequence"), "importance_sampling_level"),
    (dict(loss_type="cispo", cispo_two_sided=True, importance_sampling_level="sequence"), "importance_sampling_level"),
    (dict(loss_type="clip_cov", clip_cov_ratio=0.0), "clip_cov_ratio"),
    (dict(loss_type="kl_cov", kl_cov_ratio=-0.1), "kl_cov_ratio"),
    (dict(loss_type="vanilla", delta=1.0), "delta must be > 1"),
    (dict(loss_type="vanilla", importance_sampling_level="sequence"), "importance_sampling_level"),
])
def test_bad_verl_options(options, match):
    inputs, _ = case("seq-mean-k2")
    args = [inputs[k] for k in ("hidden", "weight", "completion_ids", "advantages", "completion_mask")]
    with pytest.raises(ValueError, match=match):
        fusedloss.grpo_loss(*args, **options)


@pytest.mark.parametrize("which", [b for b in ALL_BACKENDS if b != "triton"])
@pytest.mark.parametrize("name", ["token-mean-k3", "seq-sum-abs", "seq-mean-k2", "cispo-two-sided", "dppo_kl", "dro",
                                  "vanilla"])
def test_grad_in_forward_path(which, name, monkeypatch):
    """Token-level verl options are row-local: the grad-in-forward 3-product path takes them (forced), entropy bonus
    aggregated by the same weights, and equals the reference."""
    from fusedloss.core import grad_in_forward

    backend, device = _backend(which, monkeypatch)
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")
    taken = []
    original = grad_in_forward.grad_in_forward_loss
    monkeypatch.setattr(grad_in_forward, "grad_in_forward_loss", lambda *a: taken.append(1) or original(*a))
    inputs, options = case(name)
    compare("grpo_loss", inputs, options, backend, F64, device, fp64_tol(backend))
    assert taken, "the grad-in-forward path was not taken"


COVARIANCE_CASES = {
    "clip_cov": dict(loss_type="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0, beta=0.05,
                     kl_loss_type="k3", entropy_coef=0.01),
    "kl_cov": dict(loss_type="kl_cov", kl_cov_ratio=0.3, ppo_kl_coef=0.7, loss_agg_mode="seq-mean-token-mean"),
}


@pytest.mark.parametrize("which", ALL_BACKENDS)
@pytest.mark.parametrize("name", list(COVARIANCE_CASES))
def test_covariance_losses_against_reference(which, name, monkeypatch):
    """clip_cov (tokens drawn from torch's global generator: seeded alike) and kl_cov (the tokens of largest
    covariance) need the whole batch: the composable path, float64, loss and gradients."""
    backend, device = _backend(which, monkeypatch)
    inputs, _ = case("seq-mean-k2")
    options = COVARIANCE_CASES[name]
    positional = ("hidden", "weight", "completion_ids", "advantages", "completion_mask")
    results = []
    for fn, where, run in ((fusedloss.grpo_loss, device, dict(backend=backend)), (reference.grpo_loss, "cpu", {})):
        leaves = {k: inputs[k].detach().to(where).requires_grad_() for k in ("hidden", "weight")}
        args = [leaves.get(k, inputs[k].to(where)) for k in positional]
        torch.manual_seed(7)
        loss = fn(*args, old_logprobs=inputs["old_logprobs"].to(where), ref_logprobs=inputs["ref_logprobs"].to(where),
                  **options, **run)
        results.append((loss, torch.autograd.grad(loss, list(leaves.values()))))
    (got, got_grads), (want, want_grads) = results
    tol = fp64_tol(backend)
    assert rel_err(got, want) <= tol
    for g, r in zip(got_grads, want_grads):
        assert r.norm() > 0 and rel_err(g, r) <= tol


# --------------------------------------------------------------------------------------------------
# Data-parallel means need the global count


MEAN_MODES = {"token-mean": "num_items_in_batch", "seq-mean-token-sum": "global_batch_size",
              "seq-mean-token-mean": "global_batch_size", "seq-mean-token-sum-norm": "global_batch_size"}


@pytest.mark.parametrize("loss_type", ["bnpo", "vanilla"])
@pytest.mark.parametrize("mode", list(MEAN_MODES))
def test_mean_over_processes_needs_the_global_count(mode, loss_type):
    """With num_processes > 1, this rank's own count times the world size would scale the loss by the world
    size: refused naming the missing count, as verl's agg_loss raises; with the count, verl's rule."""
    inputs, _ = case("seq-mean-k2")
    args = [inputs[k] for k in ("hidden", "weight", "completion_ids", "advantages", "completion_mask")]
    kw = dict(old_logprobs=inputs["old_logprobs"], loss_type=loss_type, loss_agg_mode=mode, entropy_coef=0.01)
    with pytest.raises(ValueError, match=f"{MEAN_MODES[mode]} is required with loss_agg_mode='{mode}' and "
                                         "num_processes=4"):
        fusedloss.grpo_loss(*args, num_processes=4, backend="torch", **kw)
    count = {MEAN_MODES[mode]: 12 if mode == "token-mean" else 9}
    got = fusedloss.grpo_loss(*args, num_processes=4, backend="torch", **count, **kw)
    want = reference.grpo_loss(*args, num_processes=4, **count, **kw)
    one = fusedloss.grpo_loss(*args, backend="torch", **count, **kw)
    assert rel_err(got, want) <= 1e-12 and rel_err(got, 4 * one) <= 1e-12 and abs(got.item()) > 1e-3


def test_sums_and_single_processes_need_no_global_count():
    inputs, _ = case("seq-mean-k2")
    args = [inputs[k] for k in ("hidden", "weight", "completion_ids", "advantages", "completion_mask")]
    kw = dict(old_logprobs=inputs["old_logprobs"], backend="torch")
    local = fusedloss.grpo_loss(*args, loss_agg_mode="token-sum", **kw)
    assert rel_err(fusedloss.grpo_loss(*args, loss_agg_mode="token-sum", num_processes=3, **kw), 3 * local) <= 1e-14
    for mode in MEAN_MODES:
        fusedloss.grpo_loss(*args, loss_agg_mode=mode, num_processes=1, **kw)
    # geo_mean's policy term is its own mean over completions: with no KL or entropy term nothing is aggregated
    fusedloss.grpo_loss(*args, loss_type="geo_mean", num_processes=2, **kw)
    with pytest.raises(ValueError, match="num_items_in_batch is required"):
        fusedloss.grpo_loss(*args, loss_type="geo_mean", num_processes=2, entropy_coef=0.1, **kw)


# --------------------------------------------------------------------------------------------------
# verl's defaults and its default loss, vanilla


def test_verl_loss_defaults():
    """verl's PolicyLossConfig / ActorConfig defaults for the options that carry verl's names (verl's own
    classes are the oracle in tests/frameworks/test_verl_policy_loss.py): kl_cov's weight is 0.1, not the
    1.0 compute_policy_loss_kl_cov falls back to when the config has none."""
    import inspect

    for fn in (fusedloss.grpo_loss, reference.grpo_loss):
        defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}
        assert defaults["ppo_kl_coef"] == 0.1 and defaults["kl_cov_ratio"] == 0.0002
        assert (defaults["clip_cov_ratio"], defaults["clip_cov_lb"], defaults["clip_cov_ub"]) == (0.0002, 1.0, 5.0)
        assert defaults["epsilon_low"] == 0.2 and defaults["epsilon_high"] is None


def _verl_vanilla(logp, old, adv, mask, clip_low, clip_high, clip_ratio_c):
    """verl 0.9's compute_policy_loss_vanilla, transcribed, then agg_loss's token-mean."""
    negative_approx_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -adv * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    return (pg_losses * mask).sum() / mask.sum()


@pytest.mark.parametrize("which", ALL_BACKENDS)
def test_vanilla_is_verls_dual_clip(which, monkeypatch):
    """loss_type="vanilla" against verl's formula on materialised float64 logits, loss and gradients, with
    tokens past the dual clip and log-ratios of +-25 (verl clamps them at 20); TRL's dapo with delta=3.0
    equals it on the same data but for that clamp."""
    backend, device = _backend(which, monkeypatch)
    inputs = grpo_data(lengths=(5, 3, 2))
    old = inputs["old_logprobs"].clone()
    logp = reference.token_logprobs(inputs["hidden"], inputs["weight"], inputs["completion_ids"]).detach()
    old[0, 1] = logp[0, 1] + 25.0  # advantage 1.3 > 0: a ratio of e^-25, clamped to e^-20 by verl
    old[1, 0] = logp[1, 0] - 25.0  # advantage -0.4 < 0: past the dual clip
    old[1, 1] = logp[1, 1] - 1.5  # e^1.5 = 4.5: past the dual clip at 3
    adv, mask = inputs["advantages"], inputs["completion_mask"]
    assert adv[0] > 0 and adv[1] < 0 and bool(mask[0, 1] and mask[1, 0] and mask[1, 1])
    positional = ("hidden", "weight", "completion_ids", "advantages", "completion_mask")
    results = {}
    for name, fn, where, options in (
            ("verl", None, "cpu", {}), ("vanilla", fusedloss.grpo_loss, device, dict(loss_type="vanilla")),
            ("dapo", fusedloss.grpo_loss, device, dict(loss_type="dapo", delta=3.0, loss_agg_mode="token-mean"))):
        leaves = {k: inputs[k].detach().to(where).requires_grad_() for k in ("hidden", "weight")}
        if fn is None:
            z = leaves["hidden"] @ leaves["weight"].T
            lp = torch.log_softmax(z, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
            loss = _verl_vanilla(lp, old, adv.unsqueeze(-1), mask.to(F64), 0.2, 0.28, 3.0)
        else:
            args = [leaves.get(k, inputs[k].to(where)) for k in positional]
            loss = fn(*args, old_logprobs=old.to(where), epsilon_high=0.28, backend=backend, **options)
        results[name] = (loss, torch.autograd.grad(loss, list(leaves.values())))
    (want, want_grads), (got, got_grads) = results["verl"], results["vanilla"]
    tol = max(fp64_tol(backend), 1e-12)
    assert rel_err(got, want) <= tol
    for g, r in zip(got_grads, want_grads):
        assert r.norm() > 0 and rel_err(g, r) <= tol
    # the clamp: verl's -A e^-20 where TRL's surrogate has -A e^-25 (1.3 (e^-20 - e^-25) / tokens)
    dapo = results["dapo"][0]
    assert 1e-10 < abs(dapo.item() - want.item()) < 1e-9
    ref = reference.grpo_loss(*[inputs[k] for k in positional], old_logprobs=old, loss_type="vanilla",
                              epsilon_high=0.28)
    assert rel_err(ref, want) <= 1e-13
