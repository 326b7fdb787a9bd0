"""grpo_loss: every TRL 1.16 loss type and option, against TRL's own ``GRPOTrainer._compute_loss``.

* ``test_matches_trl``: float64, TRL's loss code (tests/_trl_oracle.py) on materialised logits vs
  ``fusedloss.grpo_loss`` (torch backend, with and without ``return_details``: the grad-in-forward 3-product path and
  the composable one) and vs ``fusedloss.reference.grpo_loss``: the loss, the gradients of hidden, weight and
  bias, the per-token log-probs and every metric TRL logs (kl, entropy, clip ratios, cispo_clip_ratio,
  vespo/phi_seq_mean, policy_loss).
* ``test_backends``: the public function on every backend (torch, the Triton interpreter, the CUDA
  extension's host twins) against the reference: float64, fp32 (1e-5 or 4x the naive fp32 error) and half
  precision (no worse than the naive same-dtype path), through tests/_harness.py.
* Masked positions (GSPO): NaN/inf per-token inputs outside the mask change nothing, gradient
  included; complex advantages are refused.

Ratios of the data sit >= 5% away from every clip boundary used (0.8, 1.2, 1.28, 1.3, 1.5, 5), so fp32
rounding cannot flip a branch.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")

from _errors import rel_err  # noqa: E402
from _harness import compare  # noqa: E402
from _trl_oracle import trl_grpo  # noqa: E402
from conftest import BACKENDS, FP32_TOL, device_for, fp64_tol, make_head  # noqa: E402

import fusedloss  # noqa: E402
from fusedloss import reference  # noqa: E402
from fusedloss.backends.cuda import backend as cuda_backend  # noqa: E402
from fusedloss.core import registry  # noqa: E402

B, C, D, V = 3, 5, 11, 37
RATIOS = torch.tensor([0.5, 0.7, 0.9, 1.0, 1.1, 1.37, 1.7], dtype=torch.float64)
TRANSFORMS = dict(temperature=0.7, logit_scale=1.3, softcap=25.0)
F64 = torch.float64


def grpo_data(seed=0, *, bias=False, transforms=None, per_sequence_ratio=False, token_advantages=False,
              lengths=(5, 3, 1), fractional=False):
    """Peaked float64 inputs, one long, one short and one single-token completion by default; old log-probs
    put the ratios on RATIOS; positions outside the mask hold garbage a trainer could leave there."""
    h, w, b, _ = make_head(0, D, V, leading=(B, C), bias=bias, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (B, C), generator=g)
    ids[0, 0] = int(torch.argmax(h[0, 0] @ w.T))  # one token on its peak
    valid = torch.arange(C)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    logp = reference.token_logprobs(h, w, ids, bias=b, **(transforms or {})).detach()
    shape = (B, 1) if per_sequence_ratio else (B, C)
    pick = RATIOS[torch.randint(0, len(RATIOS), shape, generator=g)].expand(B, C)
    old = torch.where(valid, logp - pick.log(), torch.full_like(logp, -7.0))
    ref = torch.where(valid, logp + 0.3 * torch.randn(B, C, generator=g, dtype=F64), torch.full_like(logp, -3.0))
    sampling = torch.where(valid, old + 0.4 * torch.randn(B, C, generator=g, dtype=F64), torch.full_like(old, -5.0))
    adv = torch.randn(B, C, generator=g, dtype=F64) if token_advantages else torch.tensor([1.3, -0.4, 0.6], dtype=F64)
    mask = valid
    if fractional:
        mask = valid.to(F64) * (0.5 + torch.rand(B, C, generator=g, dtype=F64))
    data = dict(hidden=h, weight=w, completion_ids=ids, advantages=adv, completion_mask=mask, old_logprobs=old,
                ref_logprobs=ref, sampling_logprobs=sampling,
                # TRL's vLLM ratio is exp(0) = 1 outside the mask (it multiplies the log-ratio by the mask)
                token_weights=torch.where(valid, 0.5 + torch.rand(B, C, generator=g, dtype=F64), 1.0),
                sequence_weights=0.5 + torch.rand(B, generator=g, dtype=F64))
    if bias:
        data["bias"] = b
    return data


# name: (data kwargs, options, which optional tensors to pass)
CASES = {
    **{f"{lt}-{lvl}": (dict(per_sequence_ratio=lvl == "sequence"),
                       dict(loss_type=lt, importance_sampling_level=lvl, beta=0.05), ("old", "ref"))
       for lt in fusedloss.losses.grpo.LOSS_TYPES for lvl in ("token", "sequence")},
    **{f"{lt}-plain": (dict(), dict(loss_type=lt), ("old",)) for lt in fusedloss.losses.grpo.LOSS_TYPES},
    "grpo-no-bias-correction": (dict(), dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=False), ("old", "ref")),
    "dapo-on-policy-kl": (dict(), dict(loss_type="dapo", beta=0.1), ("ref",)),
    "sapo-on-policy": (dict(), dict(loss_type="sapo"), ()),
    "vespo-on-policy": (dict(), dict(loss_type="vespo"), ()),
    "grpo-delta": (dict(), dict(loss_type="grpo", epsilon_high=0.28, delta=1.5, beta=0.02), ("old", "ref")),
    "luspo-delta-seq": (dict(per_sequence_ratio=True), dict(loss_type="luspo", delta=1.5,
                                                           importance_sampling_level="sequence"), ("old",)),
    "dapo-eps-high": (dict(), dict(loss_type="dapo", epsilon_high=0.28), ("old",)),
    "cispo-eps-high": (dict(), dict(loss_type="cispo", epsilon_high=1.3), ("old",)),
    "sapo-temperatures": (dict(), dict(loss_type="sapo", sapo_temperature_pos=0.6, sapo_temperature_neg=2.5),
                          ("old",)),
    "vespo-shape": (dict(), dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=4.0,
                                 vespo_lambda_neg=1.0), ("old",)),
    "vespo-is-weights": (dict(), dict(loss_type="vespo"), ("old", "token_weights")),
    "vespo-token-adv": (dict(token_advantages=True), dict(loss_type="vespo"), ("old",)),
    "dapo-off-policy-mask": (dict(), dict(loss_type="dapo", off_policy_mask_threshold=0.05),
                             ("old", "sampling")),
    "grpo-off-policy-mask-old": (dict(), dict(loss_type="grpo", off_policy_mask_threshold=0.0), ("old",)),
    "sapo-off-policy-token-adv": (dict(token_advantages=True), dict(loss_type="sapo", off_policy_mask_threshold=0.1),
                                  ("old", "sampling")),
    "dapo-top-entropy": (dict(), dict(loss_type="dapo", top_entropy_quantile=0.5), ("old",)),  # on a data point
    "dapo-top-entropy-between": (dict(), dict(loss_type="dapo", top_entropy_quantile=0.45), ("old",)),
    "grpo-top-entropy-bonus": (dict(), dict(loss_type="grpo", top_entropy_quantile=0.3, entropy_coef=0.05),
                               ("old",)),
    "bnpo-entropy-bonus": (dict(), dict(loss_type="bnpo", entropy_coef=0.1, beta=0.04), ("old", "ref")),
    "cispo-entropy-bonus-seq": (dict(per_sequence_ratio=True), dict(loss_type="cispo", entropy_coef=0.02,
                                                                    importance_sampling_level="sequence"), ("old",)),
    "dapo-token-weights": (dict(), dict(loss_type="dapo", beta=0.03), ("old", "ref", "token_weights")),
    "grpo-sequence-weights": (dict(), dict(loss_type="grpo"), ("old", "sequence_weights")),
    "dr_grpo-max-length": (dict(), dict(loss_type="dr_grpo", max_completion_length=9), ("old",)),
    "dapo-items-processes": (dict(), dict(loss_type="dapo", num_items_in_batch=11, num_processes=2), ("old",)),
    "vespo-items": (dict(), dict(loss_type="vespo", num_items_in_batch=4), ("old",)),
    "bnpo-token-adv-seq": (dict(token_advantages=True, per_sequence_ratio=True),
                           dict(loss_type="bnpo", importance_sampling_level="sequence"), ("old",)),
    "cispo-token-adv-seq": (dict(token_advantages=True, per_sequence_ratio=True),
                            dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.3), ("old",)),
    "sapo-fractional-mask": (dict(fractional=True), dict(loss_type="sapo", beta=0.05), ("old", "ref")),
    "luspo-empty-row": (dict(lengths=(5, 0, 2)), dict(loss_type="luspo", beta=0.05, entropy_coef=0.1),
                        ("old", "ref")),
    "grpo-transforms": (dict(bias=True, transforms=TRANSFORMS), dict(loss_type="grpo", beta=0.05, **TRANSFORMS),
                        ("old", "ref")),
}
OPTIONAL = dict(old=("old_logprobs", "old_logprobs"), ref=("ref_logprobs", "ref_logprobs"),
                sampling=("sampling_logprobs", "sampling_logprobs"),
                token_weights=("token_weights", "importance_weights"),
                sequence_weights=("sequence_weights", "importance_weights"))


def case_inputs(name):
    kw, opt, present = CASES[name]
    data = grpo_data(**kw)
    inputs = {k: data[k] for k in ("hidden", "weight", "completion_ids", "advantages", "completion_mask")}
    if "bias" in data:
        inputs["bias"] = data["bias"]
    for key in present:
        source, name = OPTIONAL[key]
        inputs[name] = data[source]
    return inputs, dict(opt)


def _leaves(inputs):
    out = dict(inputs)
    leaves = {}
    for k in ("hidden", "weight", "bias"):
        if k in out:
            out[k] = leaves[k] = out[k].detach().clone().requires_grad_(True)
    return out, leaves


POSITIONAL = ("hidden", "weight", "completion_ids", "advantages", "completion_mask")


def _call(fn, inputs, options):
    return fn(*(inputs[k] for k in POSITIONAL), **{k: t for k, t in inputs.items() if k not in POSITIONAL},
              **options)


def _metric_pairs(det, metrics, mask, loss_type):
    """(name, fusedloss value, TRL's logged value) for every metric TRL logged."""
    m = mask.to(F64)
    pairs = [("entropy", (det.entropy * m).sum() / m.sum().clamp(min=1), metrics["entropy"])]
    if "kl" in metrics:
        pairs.append(("kl", det.kl, metrics["kl"]))
    if loss_type == "cispo":
        pairs.append(("cispo_clip_ratio", det.clip_ratio_high, metrics["cispo_clip_ratio"]))
    elif loss_type == "vespo":
        pairs.append(("vespo/phi_seq_mean", det.vespo_phi_seq_mean, metrics["vespo/phi_seq_mean"]))
    elif loss_type != "sapo":
        for field, key in (("clip_ratio_low", "low_mean"), ("clip_ratio_high", "high_mean"),
                           ("clip_ratio_region", "region_mean"), ("clip_ratio_low_min", "low_min"),
                           ("clip_ratio_high_max", "high_max")):
            value = metrics[f"clip_ratio/{key}"]
            pairs.append((field, getattr(det, field), 0.0 if math.isnan(value) else value))
    if "policy_loss" in metrics:
        pairs.append(("policy_loss", det.policy_loss, metrics["policy_loss"]))
    return pairs


@pytest.mark.parametrize("name", list(CASES))
def test_matches_trl(name):
    inputs, options = case_inputs(name)
    trl_inputs, trl_leaves = _leaves(inputs)
    trl_loss, metrics, trl_logp = _call(trl_grpo, trl_inputs, options)
    trl_loss.backward()
    valid = inputs["completion_mask"] != 0
    implementations = {
        "fused": lambda i, **o: _call(fusedloss.grpo_loss, i, dict(o, backend="torch")),
        "reference": lambda i, **o: _call(reference.grpo_loss, i, o),
    }
    for impl, fn in implementations.items():
        for details in (False, True):
            got_inputs, leaves = _leaves(inputs)
            out = fn(got_inputs, **options, return_details=details)
            loss, det = out if details else (out, None)
            label = f"{name} {impl} details={details}"
            assert loss.dtype == F64, label
            assert rel_err(loss, trl_loss) < 1e-12 or abs(loss.item() - trl_loss.item()) < 1e-14, (
                label, loss.item(), trl_loss.item())
            loss.backward()
            for key, leaf in leaves.items():
                assert rel_err(leaf.grad, trl_leaves[key].grad) < 1e-10, (label, key)
            if det is None:
                continue
            assert rel_err(det.logprobs[valid], trl_logp[valid]) < 1e-12, label
            assert bool((det.logprobs[~valid] == 0).all()), label
            for metric, value, want in _metric_pairs(det, metrics, inputs["completion_mask"], options["loss_type"]):
                assert value is not None, (label, metric)
                assert abs(float(value) - want) <= 1e-10 * max(1.0, abs(want)), (label, metric, float(value), want)


def test_trl_logs_what_the_details_hold():
    """The oracle really exercises the metrics: each family logs its own keys."""
    for name, keys in (("grpo-sequence", ("kl", "clip_ratio/low_min", "clip_ratio/high_max")),
                       ("cispo-token", ("cispo_clip_ratio",)), ("vespo-token", ("vespo/phi_seq_mean",)),
                       ("bnpo-entropy-bonus", ("policy_loss",))):
        inputs, options = case_inputs(name)
        _, metrics, _ = _call(trl_grpo, inputs, options)
        assert all(k in metrics for k in keys), (name, sorted(metrics))


def test_bias_correction_changes_only_the_gradient_on_policy():
    """TRL 1.16's default multiplies the KL term by the differentiable ratio: on-policy its value is 1, so
    the loss is unchanged, but the gradient gains kl * d logp."""
    inputs, _ = case_inputs("dapo-on-policy-kl")
    grads = {}
    for flag in (True, False):
        leaf_inputs, leaves = _leaves(inputs)
        loss = _call(fusedloss.grpo_loss, leaf_inputs, dict(loss_type="dapo", beta=0.1, backend="torch",
                                                             use_bias_correction_kl=flag))
        loss.backward()
        grads[flag] = (loss.item(), leaves["hidden"].grad)
    assert abs(grads[True][0] - grads[False][0]) < 1e-14
    assert rel_err(grads[True][1], grads[False][1]) > 1e-3


# --------------------------------------------------------------------------------------------------
# Every backend against the reference (float64, fp32, half precision)


def _cuda_host(monkeypatch):
    """Route backend="cuda" to the CUDA backend with CPU tensors: its host twins run the kernels' math."""
    if not cuda_backend.extension_built():
        pytest.skip(f"CUDA extension not built: {cuda_backend.availability()}")
    original = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))


ALL_BACKENDS = BACKENDS + ([] if "cuda" in BACKENDS else ["cuda-host"])
BACKEND_CASES = ["sapo-token", "sapo-sequence", "luspo-sequence", "vespo-token", "vespo-is-weights",
                 "dapo-off-policy-mask", "grpo-top-entropy-bonus", "bnpo-entropy-bonus", "cispo-plain",
                 "grpo-transforms"]
TRITON_CASES = ["sapo-token", "vespo-token", "grpo-top-entropy-bonus", "luspo-sequence"]  # the interpreter is slow


def _backend(name, monkeypatch):
    if name == "cuda-host":
        _cuda_host(monkeypatch)
        return "cuda", torch.device("cpu")
    return name, device_for(name)


def _backend_inputs(name):
    inputs, options = case_inputs(name)
    return inputs, dict(options, return_details=True)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("which, name", [(b, n) for b in ALL_BACKENDS for n in BACKEND_CASES
                                         if b != "triton" or n in TRITON_CASES])
def test_backends(which, name, dtype, monkeypatch):
    backend, device = _backend(which, monkeypatch)
    inputs, options = _backend_inputs(name)
    tol = fp64_tol(backend) if dtype == F64 else FP32_TOL
    compare("grpo_loss", inputs, options, backend, dtype, device, tol)
    options.pop("return_details")
    compare("grpo_loss", inputs, options, backend, dtype, device, tol)  # the grad-in-forward path where it applies


ROW_LOCAL_CASES = ["grpo-token", "sapo-token", "luspo-token", "cispo-eps-high", "dapo-on-policy-kl",
                   "bnpo-entropy-bonus", "dapo-token-weights", "grpo-transforms"]


# The backends with a grad-in-forward path (the Triton backend has none: it always runs the composable op).
@pytest.mark.parametrize("which, name", [(b, n) for b in ALL_BACKENDS for n in ROW_LOCAL_CASES if b != "triton"])
def test_grad_in_forward_path_matches_trl(which, name, monkeypatch):
    """Token-level loss types whose terms depend on their own token take the grad-in-forward 3-product path
    (``FUSEDLOSS_GRAD_IN_FORWARD=1`` forces it where the backend's policy would not pay on a CPU), and still equal
    TRL's loss and gradients."""
    from fusedloss.core import grad_in_forward

    backend, device = _backend(which, monkeypatch)
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1")
    taken = []
    original = grad_in_forward.grad_in_forward_loss
    monkeypatch.setattr(grad_in_forward, "grad_in_forward_loss", lambda *a: taken.append(1) or original(*a))
    inputs, options = case_inputs(name)
    trl_inputs, trl_leaves = _leaves(inputs)
    trl_loss, _, _ = _call(trl_grpo, trl_inputs, options)
    trl_loss.backward()
    got_inputs, leaves = _leaves({k: (t.to(device) if isinstance(t, torch.Tensor) else t) for k, t in inputs.items()})
    loss = _call(fusedloss.grpo_loss, got_inputs, dict(options, backend=backend))
    loss.backward()
    assert taken, "the grad-in-forward path was not taken"
    tol = fp64_tol(backend)
    assert rel_err(loss, trl_loss) < tol, (loss.item(), trl_loss.item())
    for key, leaf in leaves.items():
        assert rel_err(leaf.grad, trl_leaves[key].grad) < 10 * tol, key


@pytest.mark.parametrize("name", ["sapo-token", "vespo-token", "luspo-sequence", "dapo-off-policy-mask",
                                  "grpo-top-entropy-bonus"])
@pytest.mark.parametrize("which", ALL_BACKENDS)
def test_backends_half(which, name, monkeypatch):
    backend, device = _backend(which, monkeypatch)
    dtypes = [torch.float16] + ([torch.bfloat16] if backend == "torch" or torch.cuda.is_available() else [])
    inputs, options = _backend_inputs(name)
    if name == "grpo-top-entropy-bonus":
        # Which tokens reach the entropy quantile is a hard threshold on a rounded statistic; in half
        # precision the naive path may select other tokens. The bonus alone keeps the test meaningful.
        options.pop("top_entropy_quantile")
    for dtype in dtypes:
        compare("grpo_loss", inputs, options, backend, dtype, device)


# --------------------------------------------------------------------------------------------------
# Outside the mask nothing happens; bad input


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf])
def test_garbage_outside_the_mask_changes_nothing(loss_type, level, garbage):
    """Per-token advantages, importance weights, old/ref/sampling log-probs with NaN or inf outside the
    mask: the loss and every gradient equal those of the same batch with zeros there."""
    data = grpo_data(token_advantages=True, per_sequence_ratio=level == "sequence")
    mask = data["completion_mask"]
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.05, off_policy_mask_threshold=0.1,
                   backend="torch")
    results = []
    for fill in (0.0, garbage):
        inputs = {k: data[k] for k in POSITIONAL}
        for key, name in (("old_logprobs", "old_logprobs"), ("ref_logprobs", "ref_logprobs"),
                          ("sampling_logprobs", "sampling_logprobs"), ("token_weights", "importance_weights")):
            inputs[name] = torch.where(mask, data[key], torch.full_like(data[key], fill))
        inputs["advantages"] = torch.where(mask, data["advantages"], torch.full_like(data["advantages"], fill))
        for fn in (fusedloss.grpo_loss, reference.grpo_loss):
            leaf_inputs, leaves = _leaves(inputs)
            opts = options if fn is fusedloss.grpo_loss else {k: v for k, v in options.items() if k != "backend"}
            loss, det = _call(fn, leaf_inputs, dict(opts, return_details=True))
            loss.backward()
            results.append((fill, fn.__module__, loss, leaves["hidden"].grad, leaves["weight"].grad, det))
    clean = {mod: r for fill, mod, *r in results if fill == 0.0}
    for fill, mod, loss, dh, dw, det in results:
        want = clean[mod]
        assert torch.isfinite(loss) and torch.isfinite(dh).all() and torch.isfinite(dw).all(), (mod, fill)
        assert loss.item() == want[0].item(), (mod, fill)
        assert torch.equal(dh, want[1]) and torch.equal(dw, want[2]), (mod, fill)
        for field in ("kl", "clip_ratio_low", "clip_ratio_high", "vespo_phi_seq_mean"):
            a, b = getattr(det, field), getattr(want[3], field)
            assert (a is None and b is None) or torch.equal(a, b), (mod, fill, field)


def test_gspo_issue_reproduction():
    """A NaN per-token advantage at a masked position, GSPO."""
    for fn, kw in ((fusedloss.grpo_loss, dict(backend="torch")), (reference.grpo_loss, {})):
        h = torch.tensor([[[1.541], [-0.2934], [-2.1788]]], requires_grad=True)
        w = torch.tensor([[0.5684]], requires_grad=True)
        loss = fn(h, w, torch.zeros(1, 3, dtype=torch.long), torch.tensor([[1.0012, -0.0573, math.nan]]),
                  torch.tensor([[True, True, False]]), loss_type="grpo", importance_sampling_level="sequence", **kw)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
        assert h.grad[0, 2].item() == 0.0


def test_complex_advantages_are_refused():
    data = grpo_data()
    inputs = {k: data[k] for k in POSITIONAL}
    inputs["advantages"] = torch.complex(data["advantages"], torch.ones_like(data["advantages"]))
    with pytest.raises(TypeError, match="advantages"):
        _call(fusedloss.grpo_loss, inputs, dict(backend="torch"))
    inputs["advantages"] = data["advantages"] > 0
    with pytest.raises(TypeError, match="advantages"):
        _call(fusedloss.grpo_loss, inputs, dict(backend="torch"))


@pytest.mark.parametrize("options, match", [
    (dict(loss_type="ppo"), "loss_type"),
    (dict(sapo_temperature_pos=0.0), "sapo_temperature_pos"),
    (dict(sapo_temperature_neg=-1.0), "sapo_temperature_neg"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
    (dict(top_entropy_quantile=-0.1), "top_entropy_quantile"),
    (dict(use_bias_correction_kl=1), "use_bias_correction_kl"),
    (dict(vespo_k_pos=float("nan")), "vespo_k_pos"),
    (dict(off_policy_mask_threshold="0.5"), "off_policy_mask_threshold"),
    (dict(entropy_coef=None), "entropy_coef"),
    (dict(sampling_logprobs=torch.zeros(B, C + 1)), "sampling_logprobs"),
    (dict(sampling_logprobs=torch.zeros(B, C, dtype=torch.long)), "sampling_logprobs"),
    (dict(loss_type="vespo", importance_weights=torch.ones(B)), "importance_weights"),
])
def test_bad_options(options, match):
    data = grpo_data()
    inputs = {k: data[k] for k in POSITIONAL}
    with pytest.raises((ValueError, TypeError), match=match):
        _call(fusedloss.grpo_loss, inputs, dict(options, backend="torch"))


def test_entropy_is_computed_only_when_asked(monkeypatch):
    """The entropy comes from the same statistics pass, asked only when a term or the details read it."""
    from fusedloss.losses import implicit_logits as il

    asked = []
    original = il.ImplicitLogits.statistics

    def spy(self, **wants):
        asked.append(bool(wants.get("want_entropy")))
        return original(self, **wants)

    monkeypatch.setattr(il.ImplicitLogits, "statistics", spy)
    data = grpo_data()
    inputs = {k: data[k] for k in POSITIONAL}
    for options, want in ((dict(loss_type="vespo"), False), (dict(loss_type="vespo", entropy_coef=0.1), True),
                          (dict(loss_type="grpo", importance_sampling_level="sequence"), False),
                          (dict(loss_type="dapo", top_entropy_quantile=0.5), True),
                          (dict(loss_type="dapo", return_details=True), True)):
        asked.clear()
        _call(fusedloss.grpo_loss, inputs, dict(options, backend="torch"))
        assert asked == [want], (options, asked)
