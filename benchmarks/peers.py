"""Peer implementations, called the way their own trainers call them.

Each factory returns ``(callable, None)`` or ``(None, reason)``. The callable takes
``(problem, hidden_leaf, weight_leaf)`` and returns ``(scalar_loss, {name: output})`` with the same
output names as ``cases.call_op``, so errors are measured against the same float64 reference.

- ``trl``: TRL 1.16 ``trl.kernels.ChunkedLogProbFunction`` (the fused head behind ``fused_lm_head=True``),
  called with the trainer's arguments (``chunk_size=32768``, outputs ``("entropy",)``). For GRPO, the
  per-token DAPO loss with KL penalty is then formed in plain torch exactly as GRPOTrainer does after
  the head (on-policy: old log-probs = logp.detach()). On CUDA the trainer scores only the positions of
  the completion mask (``compact``); so do we. On CPU it scores every position (its torch fallback).
- ``liger``: Liger-Kernel's fused linear cross-entropy (Triton) and its chunked GRPO/DPO/JSD losses
  (GPU only; Triton). Its DPO API cannot take precomputed reference log-probs: it is given the reference
  model's inputs (the policy itself, step 0) and recomputes them, a cost it pays in real use as well. Its
  GRPO is ``LigerFusedLinearGRPOLoss`` with ``use_bias_correction_kl=True`` (TRL's trainer default; Liger's
  is False), so that it computes the same loss as the others.
- ``cce``: Apple's Cut Cross-Entropy ``linear_cross_entropy`` with its defaults (gradient filtering on).
- ``torch-lce``: PyTorch's own ``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13) with
  ``options=torch.nn.LinearCrossEntropyOptions()``, its chunked path (the default ``options=None`` is the
  materialised reference). Cross-entropy only; on the CPU and on GPUs.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional, Tuple

import torch

from . import cases

Impl = Tuple[Optional[Callable], Optional[str]]

PEERS = ("torch-lce", "trl", "liger", "cce")
# which ops each peer implements
PEER_OPS = {
    "trl": ("token_logprobs", "grpo_loss"),
    "liger": ("cross_entropy", "grpo_loss", "dpo_loss", "distillation_loss"),
    "cce": ("cross_entropy",),
    "torch-lce": ("cross_entropy",),
}
# peers whose kernels need a CUDA device
GPU_ONLY = ("liger", "cce")
# the module whose presence makes a peer worth a worker (checked without importing it)
PEER_MODULE = {"trl": "trl", "liger": "liger_kernel", "cce": "cut_cross_entropy"}


def availability(name: str, device_type: str) -> Optional[str]:
    """None when the peer can be tried here, else why not; cheap (no import of the peer)."""
    import importlib.util

    if name in GPU_ONLY and device_type != "cuda":
        return "GPU only (Triton kernels)"
    if name == "torch-lce":
        ok = hasattr(torch.nn.functional, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
        return None if ok else f"torch {torch.__version__} has no linear_cross_entropy (torch >= 2.13)"
    try:
        found = importlib.util.find_spec(PEER_MODULE[name]) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "not installed"


def _import(name: str):
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # ImportError, or a dependency failing at import time
        return None, f"not importable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def version(dist: str) -> Optional[str]:
    try:
        from importlib.metadata import version as v

        return v(dist)
    except Exception:
        return None


def peer(name: str, op: str, device: torch.device) -> Impl:
    if op not in PEER_OPS.get(name, ()):
        return None, f"{name} has no {op}"
    if name == "trl":
        return _trl(op, device)
    if name == "liger":
        return _liger(op, device)
    if name == "cce":
        return _cce(op, device)
    if name == "torch-lce":
        return _torch_lce(op, device)
    return None, f"unknown peer {name!r}"


# ------------------------------------------------------------------------------------ torch-lce
def _torch_lce(op: str, device: torch.device) -> Impl:
    why = availability("torch-lce", device.type)
    if why is not None:
        return None, why
    fn = torch.nn.functional.linear_cross_entropy
    options = torch.nn.LinearCrossEntropyOptions()  # "auto" chunking and accumulation for the device

    def run(p, h, w):
        loss = fn(h, w, p.t["targets"], ignore_index=cases.IGNORE, options=options)
        return loss, {"loss": loss}
    return run, None


# ------------------------------------------------------------------------------------------ TRL
def _trl(op: str, device: torch.device) -> Impl:
    mod, why = _import("trl.kernels.chunked_logprob")
    if mod is None:
        return None, f"trl {why}"
    # The backward imports trl.trainer.utils for one thing: the ZeRO-3 gather context, a null context
    # without DeepSpeed. That module imports the whole trainer stack (datasets, accelerate, ...); when one
    # of those cannot import here, stand in a module with only that null context: the computation is
    # TRL's own, unchanged (NOTES.md says so).
    utils, why = _import("trl.trainer.utils")
    if utils is None:
        import contextlib
        import sys
        import types

        stub = types.ModuleType("trl.trainer.utils")
        stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        stub._CHUNKED_LOGPROB_CHUNK_SIZE = 32768
        stub.__fusedloss_stub__ = why
        sys.modules["trl.trainer.utils"] = stub
        utils = stub
    fn = mod.ChunkedLogProbFunction
    chunk = getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)
    compact = device.type == "cuda" and bool(getattr(mod, "_use_triton", lambda d: False)(device))

    def head(h2, w, targets):
        logp, ent, *_ = fn.apply(h2, w, None, targets, 1.0, chunk, None, 1.0, ("entropy",))
        return logp, ent

    if op == "token_logprobs":
        def run(p, h, w):
            logp, ent = head(h, w, p.t["targets"])
            loss = (logp * p.t["g_logp"]).sum() + (ent * p.t["g_ent"]).sum()
            return loss, {"logp": logp, "entropy": ent}
        return run, None

    def run_grpo(p, h, w):
        t = p.t
        mask = t["completion_mask"].bool()
        ids = t["completion_ids"]
        d = h.shape[-1]
        if compact:  # the trainer scores only the valid positions on Triton devices
            lp, _ = head(h[mask], w, ids[mask])
            logp = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
        else:
            lp, _ = head(h.reshape(-1, d), w, ids.reshape(-1))
            logp = lp.view(mask.shape).masked_fill(~mask, 0)
        # GRPOTrainer._compute_loss, loss_type="dapo", on-policy (old = logp.detach()), beta > 0, and its default
        # use_bias_correction_kl=True: the KL term times the ratio, which is 1 in value but not in gradient
        adv = t["advantages"][:, None]
        coef_1 = torch.exp(logp - logp.detach())
        coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        ref = t["ref_logprobs"]
        kl = (torch.exp(ref - logp) - (ref - logp) - 1) * coef_1
        per_token = per_token + cases.GRPO_BETA * kl
        m = mask.float()
        loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
        return loss, {"loss": loss}

    return run_grpo, None


# ---------------------------------------------------------------------------------------- Liger
def _liger(op: str, device: torch.device) -> Impl:
    if device.type != "cuda":
        return None, "liger: GPU only (Triton kernels)"
    if op == "cross_entropy":
        mod, why = _import("liger_kernel.ops.fused_linear_cross_entropy")
        if mod is None:
            return None, f"liger {why}"
        fn = mod.LigerFusedLinearCrossEntropyFunction

        def run(p, h, w):
            out = fn.apply(h, w, p.t["targets"])
            loss = out[0] if isinstance(out, tuple) else out
            return loss, {"loss": loss}
        return run, None
    mod, why = _import("liger_kernel.chunked_loss.functional")
    if mod is None:
        return None, f"liger {why}"
    if op == "grpo_loss":
        grpo, why = _import("liger_kernel.chunked_loss")
        if grpo is None or not hasattr(grpo, "LigerFusedLinearGRPOLoss"):
            return None, f"liger {why or 'has no LigerFusedLinearGRPOLoss'}"
        # Liger's module with its defaults (compiled chunks of one sequence), except what makes it the loss
        # the others compute: TRL's GRPOTrainer default use_bias_correction_kl=True (Liger defaults to False)
        loss_fn = grpo.LigerFusedLinearGRPOLoss(beta=cases.GRPO_BETA, loss_type="dapo", epsilon_low=0.2,
                                                epsilon_high=0.2, use_bias_correction_kl=True)

        def run(p, h, w):
            t = p.t
            out = loss_fn(h, w, t["completion_ids"], t["completion_mask"].to(torch.int64), t["advantages"],
                          ref_per_token_logps=t["ref_logprobs"])
            loss = out[0] if isinstance(out, tuple) else out
            return loss, {"loss": loss}
        return run, None
    if op == "dpo_loss":
        fn = mod.liger_fused_linear_dpo

        def run(p, h, w):
            # (input, weight, target, bias, ref_input, ref_weight, ref_bias, ignore_index, beta)
            out = fn(h, w, p.t["labels"], None, h.detach(), w.detach(), None, cases.IGNORE, cases.DPO_BETA)
            loss = out[0] if isinstance(out, tuple) else out
            return loss, {"loss": loss}
        return run, None
    if op == "distillation_loss":
        fn = mod.liger_fused_linear_jsd

        def run(p, h, w):
            t = p.t
            n = h.shape[0]
            labels = torch.zeros(n, dtype=torch.long, device=h.device)  # all valid; hard loss weighted 0
            out = fn(h, w, t["teacher_hidden"], t["teacher_weight"], labels, None, None, 0.0, 1.0,
                     cases.DISTILL_BETA)
            loss = out[0] if isinstance(out, tuple) else out
            return loss, {"loss": loss}
        return run, None
    return None, f"liger has no {op}"


# ------------------------------------------------------------------------------------------ CCE
def _cce(op: str, device: torch.device) -> Impl:
    if device.type != "cuda":
        return None, "cce: GPU only (Triton kernels)"
    mod, why = _import("cut_cross_entropy")
    if mod is None:
        return None, f"cut_cross_entropy {why}"
    fn = mod.linear_cross_entropy

    def run(p, h, w):
        loss = fn(h, w, p.t["targets"])  # its defaults: mean over non-ignored, filter_eps="high"
        return loss, {"loss": loss}
    return run, None
