"""Triton backend of the statistics core (``core/problem.py``'s protocol).

Forward (``statistics_forward``; ``jsd_forward`` for the JSD mixture)
    Grid (row blocks x vocabulary splits). Each program computes logits tiles
    ``[BLOCK_M, BLOCK_V] = h_blk @ W_blk.T`` with ``tl.dot`` in registers (fp32 accumulation, K-loop
    over D), applies bias, logit_scale, soft-cap and temperature, folds the tile into online
    statistics relative to the running maxima and drops it. Partial statistics of each split go to
    a small ``[12, splits, N]`` buffer that is merged exactly by ``core/partials.py`` (the merge every backend shares).
    The number of splits is chosen so that a few tokens still fill the GPU. One GEMM-sized product
    (plus one for the JSD's second pass; a teacher adds its own products of size N x V x D_t).

Backward, fast path (``logits_backward``)
    Grid (row blocks x vocabulary blocks): each program recomputes its tile, forms dx from the six
    per-row coefficients and adds ``dx @ W`` into d hidden and ``dx.T @ h`` into d weight with fp32
    atomics. Three GEMM-sized products (recompute, d hidden, d weight); the d weight product is not
    launched at all when the weight is frozen (``needs.weight`` False), nor d hidden when
    ``needs.hidden`` is False.

Backward, deterministic mode (``hidden_backward`` + ``weight_backward``)
    Selected by ``torch.are_deterministic_algorithms_enabled()`` or the environment variable
    ``FUSEDLOSS_DETERMINISTIC=1``. No atomics: one kernel owns row blocks of d hidden, the other owns
    vocabulary blocks of d weight / d bias, each summing in a fixed order, so results are
    bit-identical from run to run. Each kernel recomputes the logits: four GEMM-sized products when
    both gradients are needed, two for a frozen weight.

Memory (device allocations of this module, all through ``_alloc``)
    forward: the ``[12, splits, N]`` and ``[2, splits, N]`` partials and the ``[13, N]`` outputs;
    backward: the gradients themselves, an fp32 ``[N, D]`` accumulator for d hidden when hidden is
    not fp32/float64, an fp32 ``[chunk, D]`` scratch for d weight when the weight is not fp32/float64,
    with ``chunk`` bounded by ``TileConfig.scratch_bytes`` (independent of V: the vocabulary is
    processed chunk by chunk), and an fp32 ``[V]`` accumulator for d bias. Nothing of size N x V, and
    no fp32 ``[V, D]`` buffer. Scalars (temperature, ...) travel in a small cached tensor.

Precision
    Products of fp32 inputs use ``input_precision="ieee"`` unless PyTorch allows TF32
    (``torch.backends.cuda.matmul.allow_tf32``); ``FUSEDLOSS_TRITON_FP32_PRECISION`` (ieee, tf32,
    tf32x3) overrides. Float64 inputs accumulate in float64. Confident rows (1 - q_y down to 1e-4 in
    fp32) keep their digits as in the CUDA kernels: the forward carries t = s - 1 and takes
    log s = log1p(t), and the backward forms the target column's a + q_y inner as
    (a + inner) + inner expm1(log q_y) (``tile_math.logits_gradient``). bf16/fp16 inputs: logits and all sums
    in fp32, dx rounded to the input dtype only as an operand of the two backward products.

No sequence length is a compile-time constant: N, V and D are runtime arguments, only the block
sizes and feature flags specialise a kernel. With ``TRITON_INTERPRET=1`` (set before this module's
kernels are first used) the kernels run on CPU tensors in Triton's interpreter: slow, for tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from functools import lru_cache
from types import SimpleNamespace
from typing import Optional

import torch

from .. import config
from ..core import partials
from ..core.problem import GradientNeeds, Statistics, StatsProblem

_INTERPRET_HINT = ("no CUDA device visible; set TRITON_INTERPRET=1 to run the Triton kernels on the CPU "
                   "interpreter (slow)")


def _interpret_requested() -> bool:
    return config.interpreting_triton()


def availability() -> str:
    """"available", or why the Triton kernels cannot run here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton not installed"
    if _KERNELS is not None and _KERNELS.interpreted != _interpret_requested():
        return ("TRITON_INTERPRET changed after the Triton kernels were first used in this process; "
                "set it before using fusedloss")
    if _interpret_requested() or torch.cuda.is_available():
        return "available"
    return _INTERPRET_HINT


_KERNELS: Optional[SimpleNamespace] = None


def _kernels() -> SimpleNamespace:
    """Import the kernel modules on first use: ``triton.jit`` reads TRITON_INTERPRET when a kernel is
    defined, so importing this module early must not freeze the choice."""
    global _KERNELS
    if _KERNELS is None:
        if _interpret_requested():
            _interpreter_numpy_compat()
        from .hidden_backward import hidden_backward_kernel
        from .jsd_forward import jsd_forward_kernel
        from .logits_backward import logits_backward_kernel
        from .statistics_forward import SLOTS, statistics_forward_kernel
        from .weight_backward import weight_backward_kernel

        _KERNELS = SimpleNamespace(
            forward=statistics_forward_kernel, jsd=jsd_forward_kernel, backward=logits_backward_kernel,
            hidden=hidden_backward_kernel, weight=weight_backward_kernel, slots=SLOTS,
            interpreted=_interpret_requested(),
        )
    return _KERNELS


def _interpreter_numpy_compat() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into a Python int with ``int(array)``, which
    NumPy >= 2.4 rejects for its 1-element arrays, so every loop with a runtime bound (``range(0, D,
    BLOCK_K)``) fails there. Wrap the interpreter's tensor patch to convert with ``.item()``."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_fusedloss_compat", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._fusedloss_compat = True
    interpreter._patch_lang_tensor = patched


# ----------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_v: int
    block_k: int
    block_d: int
    num_warps: int
    num_stages: int
    target_programs: int  # the forward splits the vocabulary until about this many programs run
    scratch_bytes: int  # bound of the fp32 d weight scratch of one vocabulary chunk


_OVERRIDE: Optional[dict] = None


@contextlib.contextmanager
def override_config(**fields):
    """Replace fields of the tile configuration (tests use tiny blocks to exercise many tiles)."""
    global _OVERRIDE
    previous = _OVERRIDE
    _OVERRIDE = dict(previous or {}, **fields)
    try:
        yield
    finally:
        _OVERRIDE = previous


def _config(dtype: torch.dtype, device: torch.device) -> TileConfig:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if dtype == torch.float64:
            cfg = TileConfig(32, 32, 32, 32, 4, 1, 2 * sms, 256 << 20)
        elif dtype == torch.float32:
            cfg = TileConfig(64, 64, 32, 64, 8, 2, 2 * sms, 256 << 20)
        else:
            cfg = TileConfig(64, 128, 64, 64, 8, 3, 2 * sms, 256 << 20)
    else:  # the interpreter: small tiles, a few splits, so tiny test shapes still cross tile borders
        cfg = TileConfig(16, 32, 16, 16, 4, 1, 4, 256 << 20)
    return dataclasses.replace(cfg, **_OVERRIDE) if _OVERRIDE else cfg


def _fp32_precision() -> str:
    choice = config.from_environment().triton_fp32_precision
    if choice:
        if choice not in ("ieee", "tf32", "tf32x3"):
            raise ValueError(f"FUSEDLOSS_TRITON_FP32_PRECISION must be ieee, tf32 or tf32x3, got {choice!r}")
        return choice
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def deterministic() -> bool:
    """Whether the backward runs the atomic-free, bit-reproducible kernels."""
    return torch.are_deterministic_algorithms_enabled() or bool(config.from_environment().deterministic)


def _alloc(shape, dtype: torch.dtype, device: torch.device, zero: bool = True) -> torch.Tensor:
    """Every device buffer of this backend is made here (tests wrap it to check the memory bounds)."""
    return torch.zeros(shape, dtype=dtype, device=device) if zero else torch.empty(shape, dtype=dtype, device=device)


@lru_cache(maxsize=64)
def _params_tensor(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Cached: building it copies from the host, which must not happen (and synchronise) every step.
    return torch.tensor(values, dtype=dtype, device=device)


def _params(p: StatsProblem, acc: torch.dtype) -> torch.Tensor:
    """Scalars in the accumulation dtype, in tile_math's P_* order."""
    tf, tt = p.transform, p.teacher_transform
    beta = p.jsd_beta
    values = (
        float(tf.logit_scale), float(tf.softcap or 1.0), float(tf.temperature),
        float(tt.logit_scale), float(tt.softcap or 1.0), float(tt.temperature),
        math.log1p(-beta) if beta is not None else 0.0, math.log(beta) if beta is not None else 0.0,
        float(tf.logit_scale) / float(tf.temperature),
    )
    return _params_tensor(values, acc, p.hidden.device)


# ----------------------------------------------------------------------------------------------
# Launch arguments shared by every kernel


def _teacher_tensors(p: StatsProblem, acc: torch.dtype):
    """Teacher hidden/weight/bias in one dtype the kernels can multiply with ``acc`` accumulation."""
    th, tw, tb = p.teacher_hidden, p.teacher_weight, p.teacher_bias
    want = th.dtype
    if (acc == torch.float64) != (want == torch.float64):
        want = torch.float64 if acc == torch.float64 else torch.float32
    return th.to(want), tw.to(want), tb


def _common(p: StatsProblem, acc: torch.dtype):
    """(pointer args, integer args, flag kwargs) common to all kernels."""
    h, w = p.hidden, p.weight
    if p.has_teacher:
        th, tw, tb = _teacher_tensors(p, acc)
    else:
        th, tw, tb = h, w, None
    tgt = p.targets if p.targets is not None else h
    pointers = (h, w, p.bias if p.bias is not None else h, th, tw, tb if tb is not None else h, tgt)
    ints = (h.shape[0], w.shape[0], h.shape[1], th.shape[1], h.stride(0), w.stride(0), th.stride(0), tw.stride(0))
    flags = dict(
        HAS_BIAS=p.bias is not None, HAS_SOFTCAP=p.transform.softcap is not None,
        HAS_TEACHER_BIAS=p.has_teacher and tb is not None,
        HAS_TEACHER_SOFTCAP=p.has_teacher and p.teacher_transform.softcap is not None,
        HAS_TARGETS=p.targets is not None,
    )
    return pointers, ints, flags


def _tl_acc(acc: torch.dtype):
    import triton.language as tl

    return tl.float64 if acc == torch.float64 else tl.float32


def _launch_options(cfg: TileConfig, acc: torch.dtype, with_d: bool) -> dict:
    opts = dict(BLOCK_M=cfg.block_m, BLOCK_V=cfg.block_v, BLOCK_K=cfg.block_k, ACC=_tl_acc(acc),
                PRECISION="ieee" if acc == torch.float64 else _fp32_precision(),
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if with_d:
        opts["BLOCK_D"] = cfg.block_d
    return opts


def _check_inputs(p: StatsProblem) -> None:
    for name in ("hidden", "weight", "teacher_hidden", "teacher_weight"):
        t = getattr(p, name)
        if t is not None and t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"triton backend: {name} must be contiguous in its last dimension")


# ----------------------------------------------------------------------------------------------
# Forward


def _split_plan(n: int, v: int, cfg: TileConfig):
    """(row blocks, vocabulary tiles per split, splits): split the vocabulary until about
    ``target_programs`` programs run; every split holds at least one real tile."""
    row_blocks = triton_cdiv(n, cfg.block_m)
    vtiles = triton_cdiv(v, cfg.block_v)
    splits = max(1, min(vtiles, triton_cdiv(cfg.target_programs, row_blocks)))
    per_split = triton_cdiv(vtiles, splits)
    return row_blocks, per_split, triton_cdiv(vtiles, per_split)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def forward_statistics(p: StatsProblem) -> Statistics:
    _check_inputs(p)
    acc = p.acc_dtype
    n, v = p.hidden.shape[0], p.weight.shape[0]
    dev = p.hidden.device
    out = _alloc((len(Statistics._fields), n), acc, dev)
    if n == 0:
        return Statistics(*out.unbind(0))
    k = _kernels()
    cfg = _config(p.hidden.dtype, dev)
    row_blocks, per_split, splits = _split_plan(n, v, cfg)
    pointers, ints, flags = _common(p, acc)
    params = _params(p, acc)
    opts = _launch_options(cfg, acc, with_d=False)

    part = _alloc((len(k.slots), splits, n), acc, dev, zero=False)
    k.forward[(row_blocks, splits)](
        *pointers, params, part, *ints, per_split, splits, HAS_TEACHER=p.has_teacher, WANT_E=p.want_entropy,
        WANT_S2=p.want_extras, WANT_SZ=p.want_mean_logit, WANT_TOP1=p.want_extras and p.targets is not None,
        **flags, **opts,
    )
    stats = partials.finalize(partials.merge(dict(zip(k.slots, part.unbind(0)))), p, v)
    o = Statistics(*out.unbind(0))
    for name, value in stats.items():
        getattr(o, name).copy_(value)
    if p.jsd_beta is not None:
        norm = torch.stack((o.lse, o.lse_lo))
        norm_t = torch.stack((o.lse_t, o.lse_t_lo))
        part2 = _alloc((2, splits, n), acc, dev, zero=False)
        k.jsd[(row_blocks, splits)](*pointers, params, norm, norm_t, part2, *ints, per_split, splits,
                                    **flags, **opts)
        qm, pm = part2.sum(1).unbind(0)
        o.kl_qm.copy_(qm)
        o.jsd.copy_(p.jsd_beta * pm + (1.0 - p.jsd_beta) * qm)
    if p.targets is not None:
        out = torch.where((p.targets >= 0)[None, :], out, torch.zeros((), dtype=acc, device=dev))
    return Statistics(*out.unbind(0))


def _saved_normaliser(saved: Statistics, name: str) -> torch.Tensor:
    """The (hi, lo) normaliser of a saved statistic (``lse``/``lse_lo`` or ``lse_t``/``lse_t_lo``)."""
    hi = getattr(saved, name)
    return torch.stack((hi, getattr(saved, name + "_lo").to(hi.dtype)))


# ----------------------------------------------------------------------------------------------
# Backward


def backward_gradients(p: StatsProblem, saved: Statistics, coeffs: torch.Tensor, needs: GradientNeeds):
    """(d hidden, d weight, d bias), each None when not needed; see the module docstring."""
    _check_inputs(p)
    acc = p.acc_dtype
    h, w, b = p.hidden, p.weight, p.bias
    n, v, d = h.shape[0], w.shape[0], h.shape[1]
    dev = h.device
    need_h, need_w, need_b = needs.hidden, needs.weight, needs.bias and b is not None
    # The gradients themselves. Same-dtype-as-acc gradients are accumulated in place.
    dh = _alloc(h.shape, h.dtype, dev) if need_h else None
    dw = _alloc(w.shape, w.dtype, dev) if need_w else None
    db = _alloc(b.shape, b.dtype, dev) if need_b else None
    if n == 0 or not (need_h or need_w or need_b):
        return dh, dw, db

    k = _kernels()
    cfg = _config(h.dtype, dev)
    pointers, ints, flags = _common(p, acc)
    flags.update(HAS_TEACHER=p.has_teacher, HAS_JSD=p.has_teacher and p.jsd_beta is not None,
                 HAS_KL_FWD=p.has_teacher and p.want_kl_fwd, HAS_MEAN_LOGIT=p.want_mean_logit)
    params = _params(p, acc)
    opts = _launch_options(cfg, acc, with_d=True)
    coeffs = coeffs.to(acc).contiguous()
    norm = _saved_normaliser(saved, "lse").to(acc).contiguous()
    norm_t = _saved_normaliser(saved, "lse_t").to(acc).contiguous() if p.has_teacher else norm
    common = (*pointers, params, coeffs, norm, norm_t)

    dh_acc = (dh if dh.dtype == acc else _alloc((n, d), acc, dev)) if need_h else None
    db_acc = (db if db.dtype == acc else _alloc((v,), acc, dev)) if need_b else None
    chunk = v
    if need_w and w.dtype != acc:
        chunk = max(cfg.block_v, (cfg.scratch_bytes // (d * acc.itemsize)) // cfg.block_v * cfg.block_v)
        chunk = min(chunk, v)
    dw_scratch = _alloc((chunk, d), acc, dev, zero=False) if need_w and w.dtype != acc else None
    dummy = h
    row_blocks = triton_cdiv(n, cfg.block_m)
    determ = deterministic()

    if determ and need_h:
        k.hidden[(row_blocks,)](*common, dh_acc, *ints, dh_acc.stride(0), **flags, **opts)
    # The vocabulary is walked in chunks so that the fp32 d weight scratch stays bounded; the fast
    # path also adds d hidden in these launches, the deterministic path only d weight and d bias.
    vocab_pass = need_w or need_b or (need_h and not determ)
    for v0 in range(0, v, chunk) if vocab_pass else ():
        v1 = min(v, v0 + chunk)
        dw_out = db_out = dummy
        if need_w:
            dw_out = dw[v0:v1] if dw_scratch is None else dw_scratch[: v1 - v0].zero_()
        if need_b:
            db_out = db_acc[v0:v1]
        stride_dw = dw_out.stride(0) if need_w else 0
        vblocks = triton_cdiv(v1 - v0, cfg.block_v)
        if determ:
            k.weight[(vblocks,)](*common, dw_out, db_out, *ints, stride_dw, v0, v1,
                                 NEED_WEIGHT=need_w, NEED_BIAS=need_b, **flags, **opts)
        else:
            k.backward[(row_blocks, vblocks)](
                *common, dh_acc if need_h else dummy, dw_out, db_out, *ints,
                dh_acc.stride(0) if need_h else 0, stride_dw, v0, v1,
                NEED_HIDDEN=need_h, NEED_WEIGHT=need_w, NEED_BIAS=need_b, **flags, **opts)
        if dw_scratch is not None:
            dw[v0:v1].copy_(dw_out)
    if need_h and dh_acc is not dh:
        dh.copy_(dh_acc)
    if need_b and db_acc is not db:
        db.copy_(db_acc)
    return dh, dw, db
