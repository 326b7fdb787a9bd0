"""Run one public function and its reference on the same inputs and compare every output and gradient.

A *case* is a dict of named inputs (float64 masters on the CPU, from conftest's data helpers) plus the
options. ``run_pair`` casts the masters to the dtype under test, runs the public function there and the
reference in float64 on the *same rounded values*, then builds one scalar objective from every
differentiable output (weighted by fixed random cotangents) and back-propagates it on both sides.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from _errors import rel_err
from conftest import cotangent_like

import fusedloss
from fusedloss import reference

# The LM-head tensors take the dtype under test; other float inputs (advantages, old log-probs, ...)
# take the accumulation dtype (fp32, or float64 for float64 runs), as a trainer would pass them.
HEAD = ("hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias", "kl_hidden")
DIFFERENTIABLE = ("hidden", "weight", "bias")

POSITIONAL = {
    "token_logprobs": ("hidden", "weight", "targets"),
    "cross_entropy": ("hidden", "weight", "targets"),
    "distillation_loss": ("hidden", "weight", "teacher_hidden", "teacher_weight", "targets"),
    "grpo_loss": ("hidden", "weight", "completion_ids", "advantages", "completion_mask"),
    "dpo_loss": ("hidden", "weight", "labels", "ref_chosen_logps", "ref_rejected_logps"),
    "kto_loss": ("hidden", "weight", "labels", "preference_labels", "ref_logps"),
    "orpo_loss": ("hidden", "weight", "labels"),
    "cpo_loss": ("hidden", "weight", "labels"),
}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def round_inputs(inputs: dict, dtype: torch.dtype) -> dict:
    """Float64 copies of ``inputs`` holding exactly the values the run in ``dtype`` will see."""
    out = {}
    for k, x in inputs.items():
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            dt = dtype if k in HEAD else acc_dtype(dtype)
            x = x.to(dt).to(torch.float64)
        out[k] = x
    return out


def prepare(inputs: dict, dtype: torch.dtype, device, grad: bool = True):
    """Inputs in ``dtype`` on ``device``; the differentiable ones as fresh leaves (returned separately)."""
    out, leaves = {}, {}
    for k, x in inputs.items():
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                x = x.to(device=device, dtype=dtype if k in HEAD else acc_dtype(dtype))
                if grad and k in DIFFERENTIABLE:
                    x = x.detach().requires_grad_(True)
                    leaves[k] = x
            else:
                x = x.to(device)
        out[k] = x
    return out, leaves


def call(fn_name: str, inputs: dict, options: dict, backend: Optional[str]):
    """``backend=None`` calls the reference."""
    names = POSITIONAL[fn_name]
    args = [inputs[n] for n in names if n in inputs]
    kwargs = {k: v for k, v in inputs.items() if k not in names}
    kwargs.update(options)
    if backend is None:
        return getattr(reference, fn_name)(*args, **kwargs)
    return getattr(fusedloss, fn_name)(*args, backend=backend, **kwargs)


def flatten(result) -> list:
    """[(name, tensor or None)] for a tensor, a tuple of tensors, or (loss, details NamedTuple)."""
    if isinstance(result, torch.Tensor):
        return [("out", result)]
    if isinstance(result, tuple) and hasattr(result, "_fields"):
        return list(zip(result._fields, result))
    items = []
    for i, part in enumerate(result):
        if isinstance(part, tuple) and hasattr(part, "_fields"):
            items.extend(zip(part._fields, part))
        else:
            items.append((f"out{i}", part))
    return items


class Run(NamedTuple):
    outputs: list  # [(name, tensor or None)]
    grads: dict  # name -> gradient (or None)


def run(fn_name, inputs, options, backend, dtype, device, cotangent_seed=1234) -> Run:
    prepared, leaves = prepare(inputs, dtype, device)
    result = call(fn_name, prepared, options, backend)
    outputs = flatten(result)
    objective = None
    for i, (_name, out) in enumerate(outputs):
        if out is None or not out.requires_grad:
            continue
        cot = cotangent_like(out, cotangent_seed + i).to(device=out.device, dtype=out.dtype)
        term = (out * cot).sum()
        objective = term if objective is None else objective + term
    if objective is not None and leaves:
        objective.backward()
    return Run(outputs, {k: v.grad for k, v in leaves.items()})


# fp32 criterion (docs/design.md, "Numerical doctrine"): 1e-5 norm-wise relative. Peaked logits near 30 carry an
# absolute rounding error of ~2e-6 in any fp32 computation (the ulp of 30), so an output that is small against the
# terms it is made of (a loss whose per-token terms cancel, the log-prob of a near-certain token) is
# ill-conditioned in fp32 whatever the algorithm. There the naive fp32 path (fusedloss.reference run in fp32)
# measures what fp32 can do, and the fused path must stay within NAIVE_FACTOR of it.
NAIVE_FACTOR = 4.0
# Half precision: error no larger than the naive same-dtype path's, plus a slack of about one rounding of
# the output dtype (the fused gradients are rounded to half once; the naive ones are too, and more).
HALF_SLACK = {torch.float16: 1e-4, torch.bfloat16: 1e-3}


def compare(fn_name, inputs, options, backend, dtype, device, tol=None, *, check_grads=True, skip_outputs=()):
    """Public (``dtype`` on ``device``) vs reference (float64, CPU, same rounded values): every output and
    the gradients of hidden, weight and bias.

    float64: within ``tol``. float32: within max(``tol``, NAIVE_FACTOR x the naive fp32 path's error).
    float16/bfloat16: within the naive same-dtype path's error + HALF_SLACK (``tol`` unused)."""
    rounded = round_inputs(inputs, dtype)
    got = run(fn_name, rounded, options, backend, dtype, device)
    want = run(fn_name, rounded, options, None, torch.float64, "cpu")
    naive = None
    if dtype != torch.float64:
        naive = run(fn_name, rounded, options, None, dtype, "cpu")

    def allowed(naive_value, expected):
        if dtype == torch.float64:
            return tol, ""
        naive_err = rel_err(naive_value, expected)
        if dtype == torch.float32:
            return max(tol, NAIVE_FACTOR * naive_err), f" (naive fp32 error {naive_err:.3e})"
        return naive_err + HALF_SLACK[dtype], f" (naive {dtype} error {naive_err:.3e})"

    label = f"{fn_name}[{backend}, {dtype}] {options}"
    want_names = [n for n, _ in want.outputs]
    got_names = [n for n, _ in got.outputs]
    assert got_names == want_names, f"{label}: outputs {got_names} != reference {want_names}"
    for i, ((name, g), (_, w)) in enumerate(zip(got.outputs, want.outputs)):
        if w is None:
            assert g is None, f"{label}: output {name} should be None"
            continue
        assert g is not None, f"{label}: output {name} is None"
        assert g.dtype == acc_dtype(dtype), f"{label}: output {name} has dtype {g.dtype}"
        assert tuple(g.shape) == tuple(w.shape), f"{label}: output {name} shape {tuple(g.shape)} != {tuple(w.shape)}"
        if w.requires_grad:
            assert g.requires_grad, f"{label}: output {name} should be differentiable"
        if name in skip_outputs:
            continue
        bound, note = allowed(None if naive is None else naive.outputs[i][1], w)
        err = rel_err(g, w)
        assert err <= bound, f"{label}: output {name} relative error {err:.3e} > {bound:.1e}{note}"
    if not check_grads:
        return
    for name, w in want.grads.items():
        g = got.grads.get(name)
        if w is None:
            assert g is None or float(g.abs().max()) == 0.0, f"{label}: {name} should get no gradient"
            continue
        assert g is not None, f"{label}: no gradient reached {name}"
        assert g.dtype == dtype, f"{label}: grad of {name} has dtype {g.dtype}, expected {dtype}"
        bound, note = allowed(None if naive is None else naive.grads[name], w)
        err = rel_err(g, w)
        assert err <= bound, f"{label}: gradient of {name} relative error {err:.3e} > {bound:.1e}{note}"
