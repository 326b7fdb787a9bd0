"""dpo_loss: the 15 loss types of TRL 1.16, MPO combinations, f-divergences, LD-DPO and WPO, against TRL's own
``DPOTrainer._compute_loss`` (tests/_trl_oracle.py), then on every backend against the reference.

TRL's batch is built once (``dpo_batch``): unshifted ``[2B, L]`` input ids and completion mask (prompt, then
completion, then padding; chosen and rejected completions of different lengths), hidden states
``[2B, L, D]``; fusedloss gets the shifted view (``hidden[:, :-1]``, ``labels[:, 1:]``). float64 throughout,
loss and gradients within 1e-10, rewards and log-probs as TRL logs them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from _errors import rel_err  # noqa: E402
from _harness import compare  # noqa: E402
from _trl_oracle import trl_dpo  # noqa: E402
from conftest import FP32_TOL, fp64_tol, make_head  # noqa: E402
from test_losses_grpo import ALL_BACKENDS, _backend  # noqa: E402

import fusedloss  # noqa: E402
from fusedloss import reference  # noqa: E402
from fusedloss.losses.dpo import LOSS_TYPES  # noqa: E402

F64 = torch.float64
PAIRS, L, D, V = 3, 8, 11, 37


def dpo_batch(seed=0, *, pairs=PAIRS, bias=False, shift_ref=0.0):
    """TRL's DPO batch and its fusedloss view. Prompts of 2-3 tokens; completions of different lengths per
    pair (LD-DPO has a shared part and a tail); a padded tail on some rows."""
    rows = 2 * pairs
    h, w, b, _ = make_head(0, D, V, leading=(rows, L), bias=bias, seed=seed)
    g = torch.Generator().manual_seed(seed + 3)
    input_ids = torch.randint(0, V, (rows, L), generator=g)
    prompt = torch.randint(2, 4, (rows,), generator=g)
    prompt[pairs:] = prompt[:pairs]  # a pair shares its prompt
    length = torch.randint(1, L - 3, (rows,), generator=g)
    pos = torch.arange(L)[None, :]
    completion_mask = ((pos >= prompt[:, None]) & (pos < (prompt + length)[:, None])).long()
    labels = input_ids.masked_fill(completion_mask == 0, -100)
    ref_seq = reference.token_logprobs(h[:, :-1], w, labels[:, 1:], bias=b).sum(-1).detach()
    ref_seq = ref_seq + shift_ref + 0.8 * torch.randn(rows, generator=g, dtype=F64)
    data = dict(full_hidden=h, weight=w, input_ids=input_ids, completion_mask=completion_mask,
                ref_chosen_logps=ref_seq[:pairs], ref_rejected_logps=ref_seq[pairs:])
    if bias:
        data["bias"] = b
    return data


def fused_view(data):
    """The same batch as fusedloss's arguments (hidden / labels shifted)."""
    labels = data["input_ids"].masked_fill(data["completion_mask"] == 0, -100)
    out = dict(hidden=data["full_hidden"][:, :-1], weight=data["weight"], labels=labels[:, 1:],
               ref_chosen_logps=data["ref_chosen_logps"], ref_rejected_logps=data["ref_rejected_logps"])
    if "bias" in data:
        out["bias"] = data["bias"]
    return out


SMOOTHING = {"robust": 0.2, "exo_pair": 1e-3, "aot": 0.1, "aot_unpaired": 0.1}
CASES = {
    **{lt: dict(loss_type=lt, beta=0.5, label_smoothing=SMOOTHING.get(lt, 0.0)) for lt in LOSS_TYPES},
    "sigmoid-beta-small": dict(loss_type="sigmoid", beta=0.05),
    "ipo-beta": dict(loss_type="ipo", beta=0.3),
    "discopop-tau": dict(loss_type="discopop", beta=0.4, discopop_tau=0.2),
    "mpo-2": dict(loss_type=["sigmoid", "bco_pair"], loss_weights=[0.8, 0.2], beta=0.5),
    "mpo-3": dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0], beta=0.5),
    "mpo-default-weights": dict(loss_type=["hinge", "apo_zero"], beta=0.5),
    **{f"sigmoid-{f}": dict(loss_type="sigmoid", beta=0.5, f_divergence_type=f)
       for f in ("forward_kl", "js_divergence")},
    **{f"{lt}-js": dict(loss_type=lt, beta=0.5, f_divergence_type="js_divergence",
                        label_smoothing=SMOOTHING.get(lt, 0.0))
       for lt in ("sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")},
    "alpha-coef-1": dict(loss_type="sigmoid", beta=0.5, f_divergence_type="alpha_divergence",
                         f_alpha_divergence_coef=1.0),
    "ld-alpha": dict(loss_type="sigmoid", beta=0.5, ld_alpha=0.3),
    "ld-alpha-ipo-0": dict(loss_type="ipo", beta=0.5, ld_alpha=0.0),
    "wpo": dict(loss_type="sigmoid", beta=0.5, use_weighting=True),
    # (TRL 1.16 itself fails on sft with use_weighting: it multiplies sft's expanded scalar in place.)
    "wpo-mpo": dict(loss_type=["sigmoid", "bco_pair"], loss_weights=[1.0, 0.5], beta=0.5, use_weighting=True),
    "transforms": dict(loss_type="sigmoid", beta=0.5, temperature=0.8, logit_scale=1.2, softcap=20.0),
}


def _leaves(d, keys):
    out = dict(d)
    leaves = {}
    for k in keys:
        if k in out:
            out[k] = leaves[k] = out[k].detach().clone().requires_grad_(True)
    return out, leaves


def _fused_call(fn, view, options, **extra):
    return fn(view["hidden"], view["weight"], view["labels"], view["ref_chosen_logps"], view["ref_rejected_logps"],
              bias=view.get("bias"), **options, **extra)


def _check_against_trl(data, options, trl_loss, metrics, trl_leaves, *, tol_loss, tol_grad, implementations):
    for impl, fn in implementations.items():
        for details in (False, True):
            view, leaves = _leaves(fused_view(data), ("weight", "bias"))
            full = data["full_hidden"].detach().clone().requires_grad_(True)
            view["hidden"] = full[:, :-1]
            out = fn(view, options, return_details=details)
            loss, det = out if details else (out, None)
            label = (impl, details, options)
            assert rel_err(loss, trl_loss) <= tol_loss, (label, loss.item(), trl_loss.item())
            loss.backward()
            assert rel_err(full.grad, trl_leaves["full_hidden"].grad) <= tol_grad, label
            for key in leaves:
                assert rel_err(leaves[key].grad, trl_leaves[key].grad) <= tol_grad, (label, key)
            if det is None:
                continue
            for field, key in (("chosen_rewards", "rewards/chosen"), ("rejected_rewards", "rewards/rejected"),
                               ("chosen_logps", "logps/chosen"), ("rejected_logps", "logps/rejected")):
                assert abs(getattr(det, field).mean().item() - metrics[key]) <= tol_loss * max(1, abs(metrics[key])), (
                    label, field)
            margins = (det.chosen_rewards - det.rejected_rewards)
            scale = max(1.0, abs(metrics["rewards/chosen"]), abs(metrics["rewards/rejected"]))
            assert abs(margins.mean().item() - metrics["rewards/margins"]) <= tol_loss * scale, label
            accuracy = (det.chosen_rewards > det.rejected_rewards).to(F64).mean().item()
            assert abs(accuracy - metrics["rewards/accuracies"]) <= tol_loss, label


IMPLEMENTATIONS = {
    "fused": lambda view, options, **kw: _fused_call(fusedloss.dpo_loss, view, options, backend="torch", **kw),
    "reference": lambda view, options, **kw: _fused_call(reference.dpo_loss, view, options, **kw),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_trl(name):
    options = dict(CASES[name])
    data = dpo_batch(bias="transforms" in name)
    head = {k: options[k] for k in ("temperature", "logit_scale", "softcap") if k in options}
    trl_data, trl_leaves = _leaves(data, ("full_hidden", "weight", "bias"))
    trl_options = {k: v for k, v in options.items() if k not in head}
    loss, metrics = trl_dpo(trl_data["full_hidden"], trl_data["weight"], data["completion_mask"], data["input_ids"],
                            data["ref_chosen_logps"], data["ref_rejected_logps"], bias=trl_data.get("bias"),
                            **head, **trl_options)
    loss.backward()
    _check_against_trl(data, options, loss, metrics, trl_leaves, tol_loss=1e-12, tol_grad=1e-10,
                       implementations=IMPLEMENTATIONS)


@pytest.mark.parametrize("coef", [0.5, 0.3, 1.7])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_alpha_divergence_matches_trl_in_fp32(loss_type, coef):
    """TRL's alpha-divergence picks its exponent cap from a dict of fp16/bf16/fp32 only, so its code runs in
    fp32 here: fusedloss in fp32 within 1e-5 of it, and the float64 reference (its transcription) within 1e-5."""
    options = dict(loss_type=loss_type, beta=0.5, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=coef)
    data64 = dpo_batch(seed=4)
    data = {k: (v.float() if torch.is_floating_point(v) else v) for k, v in data64.items()}
    trl_data, trl_leaves = _leaves(data, ("full_hidden", "weight"))
    loss, metrics = trl_dpo(trl_data["full_hidden"], trl_data["weight"], data["completion_mask"], data["input_ids"],
                            data["ref_chosen_logps"], data["ref_rejected_logps"], **options)
    assert loss.dtype == torch.float32
    loss.backward()
    for dtype, impls in ((torch.float32, {"fused": IMPLEMENTATIONS["fused"]}), (F64, IMPLEMENTATIONS)):
        cast = {k: (v.to(dtype) if torch.is_floating_point(v) else v) for k, v in data.items()}
        grads = {k: _cast_grad(t, dtype) for k, t in trl_leaves.items()}
        _check_against_trl(cast, options, loss.to(dtype), metrics, grads, tol_loss=1e-5, tol_grad=1e-5,
                           implementations=impls)


def _cast_grad(t, dtype):
    return type("Leaf", (), {"grad": t.grad.to(dtype)})()


def test_alpha_divergence_exponent_is_capped_like_trl():
    """A log-ratio far above the reference: TRL caps (a - 1) u at 80 before exp; so does fusedloss."""
    data = fused_view(dpo_batch(seed=5, shift_ref=-400.0))
    options = dict(loss_type="hinge", beta=0.1, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.5)
    got = _fused_call(fusedloss.dpo_loss, data, options, backend="torch")
    want = _fused_call(reference.dpo_loss, data, options)
    assert torch.isfinite(got) and rel_err(got, want) < 1e-12


def test_sigmoid_label_smoothing_keeps_cdpo():
    """TRL 1.16's sigmoid ignores label_smoothing; fusedloss keeps the cDPO meaning it always had:
    -(1 - e) log sig(b Delta) - e log sig(-b Delta), which is TRL 1.16 exactly at e = 0."""
    view = fused_view(dpo_batch(seed=6))
    e, beta = 0.2, 0.5
    _, det = _fused_call(fusedloss.dpo_loss, view, dict(beta=beta), backend="torch", return_details=True)
    delta = (det.chosen_rewards - det.rejected_rewards) / beta
    want = (-(1 - e) * torch.nn.functional.logsigmoid(beta * delta)
            - e * torch.nn.functional.logsigmoid(-beta * delta)).mean()
    got = _fused_call(fusedloss.dpo_loss, view, dict(beta=beta, label_smoothing=e), backend="torch")
    assert rel_err(got, want) < 1e-12


# --------------------------------------------------------------------------------------------------
# Every backend against the reference


BACKEND_CASES = ["exo_pair", "nca_pair", "bco_pair", "aot", "apo_down", "discopop", "sft", "sigmoid_norm",
                 "mpo-3", "ld-alpha", "wpo", "sigmoid-forward_kl"]
TRITON_CASES = ["aot", "mpo-3", "ld-alpha", "wpo"]


def _backend_inputs(name):
    data = dpo_batch(seed=11, bias=True)
    view = fused_view(data)
    options = dict(CASES[name], return_details=True)
    return view, options


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("which, name", [(b, n) for b in ALL_BACKENDS for n in BACKEND_CASES
                                         if b != "triton" or n in TRITON_CASES])
def test_backends(which, name, dtype, monkeypatch):
    backend, device = _backend(which, monkeypatch)
    inputs, options = _backend_inputs(name)
    compare("dpo_loss", inputs, options, backend, dtype, device, fp64_tol(backend) if dtype == F64 else FP32_TOL)


@pytest.mark.parametrize("name", ["bco_pair", "discopop", "mpo-3", "ld-alpha", "wpo"])
@pytest.mark.parametrize("which", ALL_BACKENDS)
def test_backends_half(which, name, monkeypatch):
    backend, device = _backend(which, monkeypatch)
    inputs, options = _backend_inputs(name)
    for dtype in [torch.float16] + ([torch.bfloat16] if backend == "torch" or torch.cuda.is_available() else []):
        compare("dpo_loss", inputs, options, backend, dtype, device)


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("options, match", [
    (dict(loss_type="kto"), "loss_type"),
    (dict(loss_type=[]), "loss_type"),
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0]), "loss_weights"),
    (dict(loss_type="sigmoid", loss_weights=[1.0, 2.0]), "loss_weights"),
    (dict(loss_type="exo_pair"), "label_smoothing"),
    (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing"),
    (dict(f_divergence_type="kl"), "f_divergence_type"),
    (dict(loss_type="bco_pair", f_divergence_type="forward_kl"), "f_divergence_type"),
    (dict(ld_alpha=1.5), "ld_alpha"),
    (dict(discopop_tau=0.0), "discopop_tau"),
    (dict(loss_type="aot", use_weighting=True), "use_weighting"),
    (dict(use_weighting=1), "use_weighting"),
])
def test_bad_options(options, match):
    view = fused_view(dpo_batch(seed=1))
    with pytest.raises((ValueError, TypeError), match=match):
        _fused_call(fusedloss.dpo_loss, view, options, backend="torch")
