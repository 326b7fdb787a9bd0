"""The per-token GRPO math and the per-pair DPO math, each as one fused Triton launch.

The loss modules (``fusedloss/losses/grpo.py``'s ``token_terms``, ``fusedloss/losses/dpo.py``) stay the
single readable definition; these kernels compute exactly the same numbers, on ``[tokens]`` / ``[pairs]``
vectors, in one elementwise launch instead of a dozen small torch ops, and write the derivative of the
loss with respect to the log-probabilities in the same launch (the autograd Functions' backward is one
multiplication). ``tests/test_fused_token_math_triton.py`` checks values and gradients against the
modules' math.

GRPO, per token (A advantage, r = exp(logp - old), m valid)::

    grpo, bnpo, dr_grpo, dapo : l = -min(r_d A, clamp(r, 1 - eps_low, 1 + eps_high) A),  r_d = min(r, delta)
    cispo                     : l = -sg(min(r, eps_high)) A logp
    weights, KL penalty       : l <- l * w + beta (exp(ref - logp) - (ref - logp) - 1)
    masked tokens             : l = 0, d l / d logp = 0 (whatever old/ref/A/w hold there: -inf, NaN)

The derivative follows autograd's conventions exactly: ``torch.min`` splits the gradient in halves on a
tie (which is every ratio inside the clip range, where the two arguments are equal), ``torch.clamp``
passes it on the closed interval, ``torch.relu`` only where its input is > 0.

DPO, per pair (u = logp - ref, Delta = u_chosen - u_rejected, e = label_smoothing)::

    sigmoid : -(1 - e) log sigmoid(beta Delta) - e log sigmoid(-beta Delta)
    robust  : (-(1 - e) log sigmoid(beta Delta) + e log sigmoid(-beta Delta)) / (1 - 2 e)
    hinge   : relu(1 - beta Delta)
    ipo     : (u_c / max(1, n_c) - u_r / max(1, n_r) - 1 / (2 beta))**2

Inputs are 1-D, any stride (stride 0 broadcasts), any floating dtype; everything is computed in the
accumulation dtype of the log-probabilities (float64 for float64, else fp32). Scalars travel in a small
cached tensor in that dtype (Triton passes Python floats as fp32). Importing this module imports Triton:
``backend`` imports it lazily (``TRITON_INTERPRET`` is read when the kernels are defined).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
import triton
import triton.language as tl

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")

# Parameter slots (the params tensor built by _params, in the accumulation dtype).
G_CLIP_LO = tl.constexpr(0)  # 1 - epsilon_low
G_CLIP_HI = tl.constexpr(1)  # 1 + epsilon_high
G_CAP = tl.constexpr(2)  # epsilon_high: CISPO's cap of the ratio
G_DELTA = tl.constexpr(3)
G_BETA = tl.constexpr(4)

D_BETA = tl.constexpr(0)
D_KEEP = tl.constexpr(1)  # 1 - label_smoothing
D_SMOOTH = tl.constexpr(2)  # label_smoothing
D_ROBUST_DIV = tl.constexpr(3)  # 1 - 2 label_smoothing
D_IPO_MARGIN = tl.constexpr(4)  # 1 / (2 beta)

_DPO_KIND = {"sigmoid": 0, "robust": 1, "hinge": 2, "ipo": 3}


@triton.jit
def _exp(x):
    """e^x to within an ulp of x's dtype: on NVIDIA GPUs Triton lowers an fp32 ``tl.exp`` to ex2.approx of
    the rounded x * log2(e), a relative error of ~1e-6 at |x| = 30 (extreme log ratios), so fp32 goes
    through float64 (elementwise on [tokens]: the cost is nil)."""
    return tl.exp(x.to(tl.float64)).to(x.dtype)


@triton.jit
def _log(x):
    """log x to within an ulp of x's dtype (through float64, as ``_exp``)."""
    return tl.log(x.to(tl.float64)).to(x.dtype)


@triton.jit
def _log1p(t):
    """log(1 + t) for t >= 0 to a few ulp, without libdevice (the CPU interpreter has none):
    log(u) * t / (u - 1) with u = 1 + t corrects the rounding of u (Goldberg); t itself when u == 1."""
    u = 1.0 + t
    um1 = u - 1.0
    safe = tl.where(um1 == 0.0, 1.0, um1)
    return tl.where(um1 == 0.0, t, _log(u) * (t / safe))


@triton.jit
def _log_sigmoid_and_sigmoid(x):
    """(log sigmoid(x), sigmoid(x)), both stable for any |x| (no overflow, no 1 - sigmoid cancellation)."""
    t = _exp(-tl.abs(x))
    log_sig = tl.minimum(x, 0.0) - _log1p(t)
    sig = tl.where(x >= 0, 1.0 / (1.0 + t), t / (1.0 + t))
    return log_sig, sig


@triton.jit
def grpo_token_kernel(
    logp_ptr, old_ptr, adv_ptr, ref_ptr, w_ptr, valid_ptr, params_ptr,
    loss_ptr, kl_ptr, ratio_ptr, dloss_ptr,
    T, s_logp, s_old, s_adv, s_ref, s_w, s_valid,
    HAS_OLD: tl.constexpr, HAS_KL: tl.constexpr, HAS_W: tl.constexpr, HAS_DELTA: tl.constexpr,
    CISPO: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < T
    ok = inb & (tl.load(valid_ptr + offs * s_valid, mask=inb, other=0) != 0)
    logp = tl.load(logp_ptr + offs * s_logp, mask=inb, other=0.0).to(ACC)
    a = tl.load(adv_ptr + offs * s_adv, mask=inb, other=0.0).to(ACC)
    log_ratio = tl.zeros((BLOCK,), ACC)
    if HAS_OLD:
        old = tl.load(old_ptr + offs * s_old, mask=inb, other=0.0).to(ACC)
        # masked tokens take log ratio 0: an old log-prob of -inf there must not make inf or NaN
        log_ratio = tl.where(ok, logp - old, 0.0)
    ratio = _exp(log_ratio)
    # d ratio / d logp = ratio (on-policy too: ratio = exp(logp - sg(logp)) is 1 with gradient 1)
    if CISPO:
        cap = tl.minimum(ratio, tl.load(params_ptr + G_CAP))
        loss = -cap * a * logp
        dloss = -cap * a
    else:
        lo = tl.load(params_ptr + G_CLIP_LO)
        hi = tl.load(params_ptr + G_CLIP_HI)
        clipped = tl.minimum(tl.maximum(ratio, lo), hi)
        d_clipped = tl.where((ratio >= lo) & (ratio <= hi), ratio, 0.0)
        d_capped = ratio
        if HAS_DELTA:
            delta = tl.load(params_ptr + G_DELTA)
            d_capped = tl.where(ratio <= delta, ratio, 0.0)
            ratio = tl.minimum(ratio, delta)  # TRL measures clipping on this capped ratio too
        x = ratio * a
        y = clipped * a
        # torch.min's gradient: all to the smaller argument, half to each on a tie
        gx = tl.where(x == y, 0.5, tl.where(x > y, 0.0, 1.0))
        gy = tl.where(x == y, 0.5, tl.where(x < y, 0.0, 1.0))
        loss = -tl.minimum(x, y)
        dloss = -(gx * (d_capped * a) + gy * (d_clipped * a))
    if HAS_W:
        w = tl.load(w_ptr + offs * s_w, mask=inb, other=0.0).to(ACC)
        loss = loss * w
        dloss = dloss * w
    kl = tl.zeros((BLOCK,), ACC)
    if HAS_KL:
        beta = tl.load(params_ptr + G_BETA)
        ref = tl.load(ref_ptr + offs * s_ref, mask=inb, other=0.0).to(ACC)
        gap = tl.where(ok, ref - logp, 0.0)
        e_gap = _exp(gap)
        kl = e_gap - gap - 1.0
        loss = loss + beta * kl
        dloss = dloss + beta * (1.0 - e_gap)
    tl.store(loss_ptr + offs, tl.where(ok, loss, 0.0), mask=inb)
    tl.store(dloss_ptr + offs, tl.where(ok, dloss, 0.0), mask=inb)
    tl.store(kl_ptr + offs, kl, mask=inb)
    tl.store(ratio_ptr + offs, ratio, mask=inb)


@triton.jit
def dpo_pair_kernel(
    c_ptr, r_ptr, rc_ptr, rr_ptr, nc_ptr, nr_ptr, params_ptr, loss_ptr, dc_ptr, dr_ptr,
    B, s_c, s_r, s_rc, s_rr, s_nc, s_nr,
    KIND: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < B
    u_c = tl.load(c_ptr + offs * s_c, mask=inb, other=0.0).to(ACC) - tl.load(rc_ptr + offs * s_rc, mask=inb,
                                                                              other=0.0).to(ACC)
    u_r = tl.load(r_ptr + offs * s_r, mask=inb, other=0.0).to(ACC) - tl.load(rr_ptr + offs * s_rr, mask=inb,
                                                                              other=0.0).to(ACC)
    beta = tl.load(params_ptr + D_BETA)
    if KIND == 3:  # ipo: length-normalised log-ratios
        n_c = tl.maximum(tl.load(nc_ptr + offs * s_nc, mask=inb, other=1).to(ACC), 1.0)
        n_r = tl.maximum(tl.load(nr_ptr + offs * s_nr, mask=inb, other=1).to(ACC), 1.0)
        g = u_c / n_c - u_r / n_r - tl.load(params_ptr + D_IPO_MARGIN)
        loss = g * g
        d_c = 2.0 * g / n_c
        d_r = -2.0 * g / n_r
    else:
        bd = beta * (u_c - u_r)
        if KIND == 2:  # hinge
            x = 1.0 - bd
            loss = tl.maximum(x, 0.0)
            d_delta = tl.where(x > 0, -beta, 0.0)
        else:
            keep = tl.load(params_ptr + D_KEEP)
            e = tl.load(params_ptr + D_SMOOTH)
            ls_pos, sig_pos = _log_sigmoid_and_sigmoid(bd)
            ls_neg, sig_neg = _log_sigmoid_and_sigmoid(-bd)
            if KIND == 0:  # sigmoid
                loss = -keep * ls_pos - e * ls_neg
                d_delta = beta * (e * sig_pos - keep * sig_neg)
            else:  # robust
                div = tl.load(params_ptr + D_ROBUST_DIV)
                loss = (-keep * ls_pos + e * ls_neg) / div
                d_delta = -beta * (keep * sig_neg + e * sig_pos) / div
        d_c = d_delta
        d_r = -d_delta
    tl.store(loss_ptr + offs, loss, mask=inb)
    tl.store(dc_ptr + offs, d_c, mask=inb)
    tl.store(dr_ptr + offs, d_r, mask=inb)


# ----------------------------------------------------------------------------------------------
# Host side


def block_size(device: torch.device) -> int:
    """Elements per program: large on a GPU (one launch of a few programs); small under the interpreter so
    that test sizes cross block borders."""
    return 1024 if device.type == "cuda" else 32


@lru_cache(maxsize=64)
def _params(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Cached: a host-to-device copy every step would synchronise.
    return torch.tensor(values, dtype=dtype, device=device)


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _tl(acc: torch.dtype):
    return tl.float64 if acc == torch.float64 else tl.float32


def _vector(name: str, t: Optional[torch.Tensor], size: int, device: torch.device, floating=True):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != size:
        raise ValueError(f"{name} must be a 1-D tensor of {size} elements, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if floating and not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    return t


def _launch_grpo(logp, old, adv, ref, weights, valid, loss_type, epsilon_low, epsilon_high, delta, beta):
    """(loss, kl, ratio, d loss / d logp), each [T] in the accumulation dtype."""
    t = logp.shape[0]
    dev = logp.device
    acc = _acc(logp)
    out = torch.empty((4, t), dtype=acc, device=dev)
    loss, kl, ratio, dloss = out.unbind(0)
    if t == 0:
        return loss, kl, ratio, dloss
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    params = _params((1.0 - float(epsilon_low), 1.0 + float(eps_high), float(eps_high),
                      float(delta) if delta is not None else 0.0, float(beta)), acc, dev)
    if valid.dtype == torch.bool:
        valid = valid.view(torch.uint8)
    has_kl = beta != 0
    if has_kl and ref is None:
        raise ValueError("ref_logprobs is required when beta != 0")
    dummy = logp
    block = block_size(dev)
    grpo_token_kernel[(triton.cdiv(t, block),)](
        logp, old if old is not None else dummy, adv, ref if has_kl else dummy,
        weights if weights is not None else dummy, valid, params, loss, kl, ratio, dloss,
        t, logp.stride(0), old.stride(0) if old is not None else 0, adv.stride(0), ref.stride(0) if has_kl else 0,
        weights.stride(0) if weights is not None else 0, valid.stride(0),
        HAS_OLD=old is not None, HAS_KL=has_kl, HAS_W=weights is not None,
        HAS_DELTA=delta is not None and loss_type != "cispo", CISPO=loss_type == "cispo", BLOCK=block,
        ACC=_tl(acc), num_warps=4,
    )
    return loss, kl, ratio, dloss


def _launch_dpo(chosen, rejected, ref_c, ref_r, n_c, n_r, loss_type, beta, label_smoothing):
    """(loss, d loss / d chosen, d loss / d rejected), each [B] in the accumulation dtype."""
    b = chosen.shape[0]
    dev = chosen.device
    acc = _acc(chosen)
    out = torch.empty((3, b), dtype=acc, device=dev)
    loss, d_c, d_r = out.unbind(0)
    if b == 0:
        return loss, d_c, d_r
    e = float(label_smoothing)
    params = _params((float(beta), 1.0 - e, e, 1.0 - 2.0 * e, 1.0 / (2.0 * float(beta))), acc, dev)
    if loss_type == "ipo" and (n_c is None or n_r is None):
        raise ValueError("loss_type='ipo' needs chosen_tokens and rejected_tokens (completion token counts)")
    dummy = chosen
    block = block_size(dev)
    dpo_pair_kernel[(triton.cdiv(b, block),)](
        chosen, rejected, ref_c, ref_r, n_c if n_c is not None else dummy, n_r if n_r is not None else dummy,
        params, loss, d_c, d_r,
        b, chosen.stride(0), rejected.stride(0), ref_c.stride(0), ref_r.stride(0),
        n_c.stride(0) if n_c is not None else 0, n_r.stride(0) if n_r is not None else 0,
        KIND=_DPO_KIND[loss_type], BLOCK=block, ACC=_tl(acc), num_warps=4,
    )
    return loss, d_c, d_r


class _GRPOTokenLoss(torch.autograd.Function):
    """(per-token loss, kl, ratio) of logp; ``inputs`` holds everything that is not differentiated (the other
    tensors and the options), so the backward returns one gradient. kl and ratio are metrics: not
    differentiable."""

    @staticmethod
    def forward(ctx, logp, inputs):
        loss, kl, ratio, dloss = _launch_grpo(logp, *inputs)
        ctx.save_for_backward(dloss)
        ctx.logp_dtype = logp.dtype
        ctx.mark_non_differentiable(kl, ratio)
        return loss, kl, ratio

    @staticmethod
    def backward(ctx, grad_loss, grad_kl, grad_ratio):
        (dloss,) = ctx.saved_tensors
        return (grad_loss.to(dloss.dtype) * dloss).to(ctx.logp_dtype), None


class _DPOPairLoss(torch.autograd.Function):
    """Per-pair losses of (chosen, rejected); ``inputs`` holds the references, counts and options."""

    @staticmethod
    def forward(ctx, chosen, rejected, inputs):
        loss, d_c, d_r = _launch_dpo(chosen, rejected, *inputs)
        ctx.save_for_backward(d_c, d_r)
        ctx.dtypes = (chosen.dtype, rejected.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        d_c, d_r = ctx.saved_tensors
        g = grad_loss.to(d_c.dtype)
        return (g * d_c).to(ctx.dtypes[0]), (g * d_r).to(ctx.dtypes[1]), None


def grpo_token_loss(logp, old_logprobs, advantages, ref_logprobs, importance_weights, valid, *, loss_type,
                    epsilon_low, epsilon_high, delta, beta):
    """Token-level GRPO terms in one launch; see ``backend.grpo_token_loss``."""
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if not isinstance(logp, torch.Tensor) or logp.dim() != 1 or not logp.is_floating_point():
        raise ValueError("logp must be a 1-D floating tensor")
    t, dev = logp.shape[0], logp.device
    old = _vector("old_logprobs", old_logprobs, t, dev)
    adv = _vector("advantages", advantages, t, dev, floating=False)
    ref = _vector("ref_logprobs", ref_logprobs, t, dev) if beta != 0 else None
    w = _vector("importance_weights", importance_weights, t, dev)
    valid = _vector("valid", valid, t, dev, floating=False)
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got {valid.dtype}")
    return _GRPOTokenLoss.apply(logp, (old, adv, ref, w, valid, loss_type, epsilon_low, epsilon_high, delta, beta))


def dpo_pair_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_tokens,
                  rejected_tokens, *, loss_type, beta, label_smoothing):
    """Per-pair DPO losses in one launch; see ``backend.dpo_pair_loss``."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not isinstance(chosen_logps, torch.Tensor) or chosen_logps.dim() != 1 or not chosen_logps.is_floating_point():
        raise ValueError("chosen_logps must be a 1-D floating tensor")
    b, dev = chosen_logps.shape[0], chosen_logps.device
    rejected = _vector("rejected_logps", rejected_logps, b, dev)
    ref_c = _vector("ref_chosen_logps", ref_chosen_logps, b, dev)
    ref_r = _vector("ref_rejected_logps", ref_rejected_logps, b, dev)
    n_c = _vector("chosen_tokens", chosen_tokens, b, dev, floating=False)
    n_r = _vector("rejected_tokens", rejected_tokens, b, dev, floating=False)
    if n_c is not None and n_c.dtype == torch.bool or n_r is not None and n_r.dtype == torch.bool:
        raise ValueError("chosen_tokens / rejected_tokens must be counts, not bool")
    return _DPOPairLoss.apply(chosen_logps, rejected, (ref_c, ref_r, n_c, n_r, loss_type, beta, label_smoothing))
