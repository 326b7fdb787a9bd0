"""CUDA backend of the statistics core (``core/problem.py``'s protocol): cuBLAS products, CUDA kernels
(``csrc/``, built into ``fusedloss._C``) for everything between them.

Design
    Products ``x = h @ W.T`` go through cuBLAS (``torch.mm``; bf16/fp16 inputs with
    ``out_dtype=torch.float32``, so the logits are never rounded to half precision before the softmax)
    into a workspace tile ``[rows, cols]``. The kernels of ``fusedloss._C`` then work on that tile:

    ``fold_tile``   one block per row folds the tile (bias, logit_scale, soft-cap, temperature applied
                    per element) into the running partial statistics (m, s, e, mt, st, a, b, s2, sz and
                    the target logit) with the associative merge of ``core/torch_backend.py``, and
                    writes the per-row outputs on the last vocabulary tile;
    ``jsd_tile``    the generalized JSD's second sweep;
    ``dx_tile``     turns the tile into d loss / d x from the seven per-row coefficients (problem.py's
                    dz formula and the chain rule through temperature, soft-cap and scale), in place
                    for fp32 or into a bf16/fp16 copy that feeds the two gradient products; rows whose
                    target is ignored or whose coefficients are all zero get 0.

    ``grpo_token_loss`` and ``dpo_pair_loss`` (autograd Functions used by the loss modules) and the
    lower-level ``grpo_token_math`` / ``dpo_pair_math`` run the per-token GRPO and per-pair DPO math of
    SPEC section 5 in one launch each (fp32, or float64 for float64 inputs), writing the loss and its
    derivative with respect to the log-probs in the same launch.

Products per op (one product = 2 N V D flops; a teacher adds its own N V D_t product wherever a
student product is formed):
    forward_statistics   1 (plus 1 for the JSD's second sweep)
    backward_gradients   3: recompute, d hidden, d weight (2 with a frozen weight: d weight is skipped)
    eager_gradients      3: logits, d hidden, d weight, no recompute (the JSD reuses the chunk's logits)

Workspace budget
    ``FUSEDLOSS_CUDA_WORKSPACE_MB`` (default 256) bounds the logits workspace of one call, whatever N is:
    forward and backward tiles are ``[rows, cols]`` with ``rows * cols * bytes_per_element <= budget``
    (4 bytes per fp32 logit, 4 more with a teacher, 2 more for the bf16/fp16 dx copy in the backward);
    the eager path holds ``rows_chunk = budget // (V * bytes_per_element)`` full rows (at least 1 row).
    Besides the gradients themselves and O(N) per-row vectors, the products add fp32 blocks of
    ``[rows, D]`` (d hidden) and ``[cols, D]`` (d weight); d hidden is accumulated in an fp32
    ``[N, D]`` buffer. d weight is accumulated in fp32 one vocabulary tile at a time over all rows in
    ``backward_gradients`` (no fp32 ``[V, D]`` buffer at all); in ``eager_gradients`` it is written
    tile by tile straight in the weight's dtype when one row chunk covers all tokens, and only when
    several chunks must be summed is an fp32 ``[V, D]`` accumulator allocated.

Eager (3-product) API, for ``core/eager.py``
    ``eager_gradients(problem, chunk_fn, needs) -> (loss, (d_hidden, d_weight, d_bias))``: for each row
    chunk the full ``[rows_chunk, V]`` logits are formed in the workspace, folded into the chunk's
    statistics, and ``chunk_fn(stats, slice(r0, r1)) -> (chunk_loss, coeffs [7, r1 - r0])`` is asked for the
    loss and the per-row coefficients (``core.statistics.dz_coefficients``); dx is formed in place and
    the gradients accumulated right away. Returns the summed loss and the gradients: d hidden and
    d bias in fp32; d weight in fp32, except for a bf16/fp16 weight whose rows all fit one chunk, which
    is returned in the weight's dtype (each vocabulary tile rounded once from its fp32 product).
    ``eager_rows(problem)`` says how many rows a chunk holds.

Host mode (tests without a GPU)
    When the extension is built, every entry point also accepts CPU tensors: the products run in fp32
    on the CPU and the kernels' host twins (``_C.host_*``, the same ``__host__ __device__`` math of
    ``csrc/fusedloss/*.h``) do the rest. ``tests/test_cuda_host.py`` checks the kernel math this way.

Float64 statistics problems are delegated to the torch backend (the tile kernels compute in fp32); the
GRPO/DPO math kernels have float64 instantiations.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import config
from ..core import torch_backend
from ..core.problem import COEF_TEACHER_PROB, COEF_UNIFORM, NUM_COEFFS, GradientNeeds, Statistics, StatsProblem

_NUM_OUTPUTS = len(Statistics._fields)

try:
    from .. import _C
except ImportError as exc:  # not built (no nvcc, FUSEDLOSS_CUDA=0) or a plain source checkout
    _C = None
    _IMPORT_ERROR: Optional[ImportError] = exc
else:
    _IMPORT_ERROR = None
    if getattr(_C, "NUM_OUTPUTS", None) != _NUM_OUTPUTS or not hasattr(_C, "GRPO_OUTPUTS"):
        # An extension built from older sources (the Statistics protocol grew): refuse it rather than
        # read or write past its output rows. Rebuild with `python setup.py build_ext --inplace`.
        _IMPORT_ERROR = ImportError(f"fusedloss._C is stale: it writes {getattr(_C, 'NUM_OUTPUTS', '?')} per-row "
                                    f"outputs, the protocol has {_NUM_OUTPUTS}; rebuild the extension")
        _C = None

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FLOAT64_CODE = 3  # GRPO / DPO math only

# Testing knobs: cap the tile shape (None: from the workspace budget) to exercise multi-tile merging.
MAX_TILE_ROWS: Optional[int] = None
MAX_TILE_COLS: Optional[int] = None


# ------------------------------------------------------------------------------------------------
# Availability
# ------------------------------------------------------------------------------------------------
def _build_status() -> str:
    try:
        from .. import _build_info
    except ImportError:
        return ("not built: fusedloss._C is missing (install the package with pip so that setup.py builds "
                "the CUDA extension)")
    return _build_info.CUDA_EXTENSION


def extension_built() -> bool:
    """Whether ``fusedloss._C`` imports (kernels and their host twins)."""
    return _C is not None


def availability() -> str:
    if _C is None:
        status = _build_status()
        if status == "built" and _IMPORT_ERROR is not None and "stale" in str(_IMPORT_ERROR):
            return f"built but stale: {_IMPORT_ERROR}"
        if status == "built":
            return f"built but not importable: {_IMPORT_ERROR}"
        return status
    if not torch.cuda.is_available():
        return "built; no CUDA device visible"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"built for sm_80 and newer; this GPU is sm_{major}{minor}"
    return "available"


# ------------------------------------------------------------------------------------------------
# Launch helpers
# ------------------------------------------------------------------------------------------------
class _Exec:
    """Runs the kernels on the tensors' device: CUDA kernels on the current stream, or the host twins
    for CPU tensors."""

    def __init__(self, device: torch.device):
        if _C is None:
            raise RuntimeError(f"fusedloss CUDA backend: {availability()}")
        self.host = device.type == "cpu"
        if not self.host and device.type != "cuda":
            raise ValueError(f"the CUDA backend runs on CUDA tensors (or CPU tensors in host mode), got {device}")
        self.device = device
        self.index = 0 if self.host else (device.index if device.index is not None else torch.cuda.current_device())

    def _run(self, name: str, args) -> None:
        args.device = self.index
        if self.host:
            getattr(_C, "host_" + name)(args)
        else:
            getattr(_C, name)(args, torch.cuda.current_stream(self.device).cuda_stream)

    def fold(self, args):
        self._run("fold_tile", args)

    def jsd(self, args):
        self._run("jsd_tile", args)

    def dx(self, args):
        self._run("dx_tile", args)

    def grpo(self, args):
        self._run("grpo_tokens", args)

    def dpo(self, args):
        self._run("dpo_pairs", args)


def _code(t: torch.Tensor) -> int:
    try:
        return _DTYPE_CODES[t.dtype]
    except KeyError:
        raise TypeError(f"the CUDA backend handles float32, bfloat16 and float16 tensors, got {t.dtype}") from None


def _ptr(t: Optional[torch.Tensor], offset: int = 0) -> int:
    """Address of element ``offset`` of a contiguous tensor (0 for None)."""
    return 0 if t is None else t.data_ptr() + offset * t.element_size()


def _transform(tf) -> "_C.Transform":
    return _C.Transform(logit_scale=float(tf.logit_scale), softcap=float(tf.softcap or 0.0),
                        temperature=float(tf.temperature), chain=float(tf.logit_scale) / float(tf.temperature))


_OUT_DTYPE_OK = True  # torch.mm(..., out_dtype=float32) on CUDA (PyTorch >= 2.8)


def _mm32(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` accumulated and returned in fp32 (into ``out`` when given)."""
    global _OUT_DTYPE_OK
    if a.dtype == b.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda and a.dtype == b.dtype and _OUT_DTYPE_OK:
        try:
            if out is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        except (RuntimeError, TypeError):
            _OUT_DTYPE_OK = False
    return torch.mm(a.float(), b.float(), out=out)


def _budget_bytes() -> int:
    mb = config.from_environment().workspace_mb
    return max(1, int((256.0 if mb is None else mb) * 2**20))


def _tile_shape(n: int, v: int, bytes_per_element: int) -> tuple[int, int]:
    """[rows, cols] of a workspace tile within the budget: up to 2048 rows, at least 4096 columns when
    the budget allows, columns a multiple of 128 (16-byte aligned rows for every dtype)."""
    budget = _budget_bytes() // bytes_per_element
    rows = max(1, min(n, 2048))
    if budget // rows < 4096:
        rows = max(1, min(rows, budget // 4096))
    cols = max(128, budget // rows // 128 * 128)
    cols = min(v, cols)
    if MAX_TILE_ROWS is not None:
        rows = max(1, min(rows, MAX_TILE_ROWS))
    if MAX_TILE_COLS is not None:
        cols = max(1, min(cols, MAX_TILE_COLS))
    return rows, cols


def _dx_bytes(p: StatsProblem) -> int:
    return 0 if p.hidden.dtype == torch.float32 else p.hidden.element_size()


def eager_rows(p: StatsProblem) -> int:
    """Rows of one eager chunk: ``budget // (V * bytes per element)``, at least 1."""
    per_row = p.weight.shape[0] * (4 + (4 if p.has_teacher else 0) + _dx_bytes(p))
    rows = max(1, min(p.hidden.shape[0], _budget_bytes() // per_row))
    if MAX_TILE_ROWS is not None:
        rows = max(1, min(rows, MAX_TILE_ROWS))
    return rows


def _tile_args(p: StatsProblem, targets: Optional[torch.Tensor], r0: int, out: torch.Tensor) -> "_C.TileArgs":
    """The arguments shared by every tile of a call; per-tile fields are set by the caller."""
    a = _C.TileArgs()
    a.bias = _ptr(p.bias)
    a.bias_dtype = _code(p.bias) if p.bias is not None else 0
    a.tf = _transform(p.transform)
    if p.has_teacher:
        a.teacher_bias = _ptr(p.teacher_bias)
        a.teacher_bias_dtype = _code(p.teacher_bias) if p.teacher_bias is not None else 0
        a.teacher_tf = _transform(p.teacher_transform)
    a.targets = _ptr(targets, r0)
    a.want_entropy = bool(p.want_entropy)
    a.want_kl_rev = bool(p.want_kl_rev and p.has_teacher)
    a.want_kl_fwd = bool(p.want_kl_fwd and p.has_teacher)
    a.want_mean_logit = bool(p.want_mean_logit)
    a.want_extras = bool(p.want_extras)
    a.vocab = p.weight.shape[0]
    a.out = _ptr(out, r0)
    a.out_stride = out.shape[1]
    if p.jsd_beta is not None:
        beta = float(p.jsd_beta)
        a.jsd = _C.JsdConsts(beta=beta, log_1m_beta=math.log1p(-beta), log_beta=math.log(beta))
        a.has_jsd = True
    return a


def _set_tile(a, x: torch.Tensor, xt: Optional[torch.Tensor], v0: int) -> None:
    a.x = _ptr(x)
    a.xt = _ptr(xt)
    a.dtype = _code(x)
    a.ld = x.stride(0)
    a.rows, a.cols = x.shape
    a.v0 = v0


def _prepare(p: StatsProblem):
    targets = None if p.targets is None else p.targets.to(torch.int64).contiguous()
    bias = None if p.bias is None else p.bias.contiguous()
    tbias = None if p.teacher_bias is None else p.teacher_bias.contiguous()
    return targets, bias, tbias


def _contiguous_problem(p: StatsProblem) -> StatsProblem:
    targets, bias, tbias = _prepare(p)
    if targets is p.targets and bias is p.bias and tbias is p.teacher_bias:
        return p
    import dataclasses

    return dataclasses.replace(p, targets=targets, bias=bias, teacher_bias=tbias)


class _Workspace:
    """The logits tiles of one call (student, teacher), allocated once at the largest tile shape."""

    def __init__(self, rows: int, cols: int, p: StatsProblem, dx_copy: bool):
        dev = p.hidden.device
        self.x = torch.empty(rows * cols, device=dev, dtype=torch.float32)
        self.xt = torch.empty(rows * cols, device=dev, dtype=torch.float32) if p.has_teacher else None
        self.dx = torch.empty(rows * cols, device=dev, dtype=p.hidden.dtype) if dx_copy else None

    @staticmethod
    def view(buf: Optional[torch.Tensor], rows: int, cols: int) -> Optional[torch.Tensor]:
        return None if buf is None else buf[: rows * cols].view(rows, cols)

    def logits(self, p: StatsProblem, rows: slice, v0: int, v1: int, h=None, ht=None):
        n = rows.stop - rows.start
        x = self.view(self.x, n, v1 - v0)
        _mm32(p.hidden[rows] if h is None else h, p.weight[v0:v1].T, out=x)
        xt = None
        if p.has_teacher:
            xt = self.view(self.xt, n, v1 - v0)
            _mm32(p.teacher_hidden[rows] if ht is None else ht, p.teacher_weight[v0:v1].T, out=xt)
        return x, xt


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------
def forward_statistics(p: StatsProblem) -> Statistics:
    if p.acc_dtype == torch.float64:
        return torch_backend.forward_statistics(p)
    p = _contiguous_problem(p)
    ex = _Exec(p.hidden.device)
    n, v = p.hidden.shape[0], p.weight.shape[0]
    out = torch.zeros((_NUM_OUTPUTS, n), device=p.hidden.device, dtype=torch.float32)
    if n == 0:
        return Statistics(*out.unbind(0))
    rows_max, cols_max = _tile_shape(n, v, 8 if p.has_teacher else 4)
    ws = _Workspace(rows_max, cols_max, p, dx_copy=False)
    multi = cols_max < v
    state = torch.empty((_C.STATE_FIELDS, rows_max), device=p.hidden.device, dtype=torch.float32) if multi else None
    jsd_acc = torch.empty((2, rows_max), device=p.hidden.device, dtype=torch.float32) if multi else None

    def sweep(launch, attach):
        """One pass over all (row chunk, vocabulary tile) pairs: the fold, then (JSD) the mixture pass."""
        for r0 in range(0, n, rows_max):
            rows = slice(r0, min(n, r0 + rows_max))
            a = _tile_args(p, p.targets, r0, out)
            attach(a)
            for v0 in range(0, v, cols_max):
                v1 = min(v, v0 + cols_max)
                x, xt = ws.logits(p, rows, v0, v1)
                _set_tile(a, x, xt, v0)
                a.first, a.last = v0 == 0, v1 == v
                launch(a)

    def with_state(a):
        a.state, a.state_stride = _ptr(state), rows_max

    def with_jsd_acc(a):
        a.jsd_acc, a.jsd_acc_stride = _ptr(jsd_acc), rows_max

    sweep(ex.fold, with_state)
    if p.jsd_beta is not None and p.has_teacher:
        sweep(ex.jsd, with_jsd_acc)
    return Statistics(*out.unbind(0))


# ------------------------------------------------------------------------------------------------
# Backward (recompute): 3 products
# ------------------------------------------------------------------------------------------------
def _gate_coeffs(p: StatsProblem, coeffs: torch.Tensor) -> torch.Tensor:
    """fp32 contiguous coefficients, with the terms the problem does not have set to 0 (as the torch
    backend ignores them): c3 (teacher probability) without want_kl_fwd, c5 (uniform) without
    want_mean_logit."""
    coeffs = coeffs.to(torch.float32)
    drop = [i for i, off in ((COEF_TEACHER_PROB, not (p.want_kl_fwd and p.has_teacher)),
                             (COEF_UNIFORM, not p.want_mean_logit)) if off]
    if drop:
        coeffs = coeffs.clone()
        coeffs[drop] = 0.0
    return coeffs.contiguous()


def _dx_into(ex: _Exec, a, x: torch.Tensor, dx_buf: Optional[torch.Tensor]) -> torch.Tensor:
    """Runs dx_tile on the tile in ``a``; returns dx (the tile itself for fp32, else the half copy)."""
    dx = x if dx_buf is None else dx_buf
    a.dx, a.dx_dtype, a.dx_ld = _ptr(dx), _code(dx), dx.stride(0)
    ex.dx(a)
    return dx


def backward_gradients(p: StatsProblem, saved: Statistics, coeffs: torch.Tensor, needs: GradientNeeds):
    """(d hidden, d weight, d bias) in the dtypes of their tensors, each None when not needed.
    Vocabulary tiles outside, row chunks inside: d weight of a tile is summed in fp32 over all rows
    and rounded once; d hidden is summed in an fp32 [N_active, D] buffer."""
    if p.acc_dtype == torch.float64:
        return torch_backend.backward_gradients(p, saved, coeffs, needs)
    p = _contiguous_problem(p)
    ex = _Exec(p.hidden.device)
    h_all, w = p.hidden, p.weight
    n, v = h_all.shape[0], w.shape[0]
    dev = h_all.device
    dh = torch.zeros(h_all.shape, device=dev, dtype=h_all.dtype) if needs.hidden else None
    dw = torch.zeros_like(w) if needs.weight else None
    db = torch.zeros_like(p.bias) if needs.bias else None
    if n == 0 or not (needs.hidden or needs.weight or needs.bias):
        return dh, dw, db
    coeffs = _gate_coeffs(p, coeffs)
    # Rows with all-zero coefficients (ignored targets, masked tokens) contribute nothing: skip them.
    active = (coeffs != 0).any(dim=0)
    if p.targets is not None:
        active &= p.targets >= 0
    rows_idx = None if bool(active.all()) else torch.nonzero(active).squeeze(1)
    if rows_idx is not None and rows_idx.numel() == 0:
        return dh, dw, db

    def pick(t):
        return t if rows_idx is None or t is None else t.index_select(0, rows_idx)

    h_act, ht_act, tgt_act = pick(h_all), pick(p.teacher_hidden), pick(p.targets)
    stats = torch.stack(tuple(saved)).to(torch.float32)
    stats_act = (stats if rows_idx is None else stats.index_select(1, rows_idx)).contiguous()
    coeffs_act = (coeffs if rows_idx is None else coeffs.index_select(1, rows_idx)).contiguous()
    n_act = h_act.shape[0]
    dh_act = torch.zeros((n_act, h_all.shape[1]), device=dev, dtype=torch.float32) if needs.hidden else None

    dx_copy = h_all.dtype != torch.float32
    rows_max, cols_max = _tile_shape(n_act, v, 4 + (4 if p.has_teacher else 0) + _dx_bytes(p))
    ws = _Workspace(rows_max, cols_max, p, dx_copy)
    for v0 in range(0, v, cols_max):
        v1 = min(v, v0 + cols_max)
        dw_tile = torch.zeros((v1 - v0, w.shape[1]), device=dev, dtype=torch.float32) if needs.weight else None
        db_tile = torch.zeros(v1 - v0, device=dev, dtype=torch.float32) if needs.bias else None
        for r0 in range(0, n_act, rows_max):
            rows = slice(r0, min(n_act, r0 + rows_max))
            h = h_act[rows]
            x, xt = ws.logits(p, rows, v0, v1, h=h, ht=None if ht_act is None else ht_act[rows])
            a = _tile_args(p, tgt_act, r0, stats_act)
            a.coeffs, a.coeff_stride = _ptr(coeffs_act, r0), n_act
            _set_tile(a, x, xt, v0)
            dx = _dx_into(ex, a, x, ws.view(ws.dx, x.shape[0], x.shape[1]))
            if dh_act is not None:
                dh_act[rows] += _mm32(dx, w[v0:v1])
            if dw_tile is not None:
                dw_tile += _mm32(dx.T, h)
            if db_tile is not None:
                db_tile += dx.sum(0, dtype=torch.float32)
        if dw is not None:
            dw[v0:v1] = dw_tile.to(w.dtype)
        if db is not None:
            db[v0:v1] = db_tile.to(p.bias.dtype)
    if dh is not None:
        if rows_idx is None:
            dh.copy_(dh_act)
        else:
            dh.index_copy_(0, rows_idx, dh_act.to(h_all.dtype))
    return dh, dw, db


# ------------------------------------------------------------------------------------------------
# Eager: 3 products, no recompute (core/eager.py)
# ------------------------------------------------------------------------------------------------
def eager_gradients(p: StatsProblem, chunk_fn, needs: GradientNeeds):
    """See the module docstring. ``chunk_fn(stats, slice(r0, r1)) -> (loss, coeffs [7, r1 - r0])``."""
    if p.acc_dtype == torch.float64:
        return torch_backend.eager_gradients(p, chunk_fn, needs)
    p = _contiguous_problem(p)
    ex = _Exec(p.hidden.device)
    h_all, w = p.hidden, p.weight
    n, v = h_all.shape[0], w.shape[0]
    dev = h_all.device
    step = eager_rows(p)
    single = step >= n
    dh = torch.zeros(h_all.shape, device=dev, dtype=torch.float32) if needs.hidden else None
    db = torch.zeros(v, device=dev, dtype=torch.float32) if needs.bias else None
    dw = None
    if needs.weight:
        # One chunk: each vocabulary tile of d weight is complete after one product; write it in the
        # weight's dtype. Several chunks: sum in fp32.
        dw_dtype = w.dtype if single else torch.float32
        dw = (torch.empty if single else torch.zeros)(w.shape, device=dev, dtype=dw_dtype)
    loss = torch.zeros((), device=dev, dtype=torch.float32)
    # d weight is formed one vocabulary slice at a time, so its fp32 product block stays [slice, D].
    w_slice = max(128, min(v, _budget_bytes() // 4 // max(1, w.shape[1]) // 128 * 128))
    dx_copy = h_all.dtype != torch.float32
    ws = _Workspace(step, v, p, dx_copy)
    out_chunk = torch.zeros((_NUM_OUTPUTS, step), device=dev, dtype=torch.float32)
    for r0 in range(0, n, step):
        rows = slice(r0, min(n, r0 + step))
        m = rows.stop - r0
        out = out_chunk[:, :m].contiguous() if m != step else out_chunk
        out.zero_()
        x, xt = ws.logits(p, rows, 0, v)
        tgt = None if p.targets is None else p.targets[rows]
        a = _tile_args(p, tgt, 0, out)
        _set_tile(a, x, xt, 0)
        a.first = a.last = True
        ex.fold(a)
        if p.jsd_beta is not None and p.has_teacher:
            ex.jsd(a)
        chunk_loss, coeffs = chunk_fn(Statistics(*out.clone().unbind(0)), slice(r0, rows.stop))
        loss = loss + chunk_loss.to(torch.float32)
        coeffs = _gate_coeffs(p, coeffs)
        if coeffs.shape != (NUM_COEFFS, m):
            raise ValueError(f"chunk_fn must return coefficients of shape [{NUM_COEFFS}, {m}], got {tuple(coeffs.shape)}")
        a.coeffs, a.coeff_stride = _ptr(coeffs), m
        dx = _dx_into(ex, a, x, ws.view(ws.dx, m, v))
        h = h_all[rows]
        if dw is not None:
            # dx is 0 on rows outside the loss, but 0 * NaN is not: NaN padding rows (fully masked attention)
            # must stay out of d weight. [rows, D] of work next to the [rows, V, D] products.
            h = torch.where((coeffs != 0).any(dim=0)[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))
        if dh is not None:
            dh[rows] = _mm32(dx, w)
        if dw is not None:
            for s0 in range(0, v, w_slice):
                s1 = min(v, s0 + w_slice)
                block = _mm32(dx[:, s0:s1].T, h)
                if single:
                    dw[s0:s1] = block.to(dw.dtype)
                else:
                    dw[s0:s1] += block
        if db is not None:
            db += dx.sum(0, dtype=torch.float32)
    return loss, (dh, dw, db)


# ------------------------------------------------------------------------------------------------
# GRPO / DPO per-token math (SPEC section 5)
# ------------------------------------------------------------------------------------------------
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


class GrpoTokenMath(NamedTuple):
    """Per-token outputs of ``grpo_token_math``, each with the shape of ``logp`` (float64 for float64 ``logp``,
    else fp32)."""

    loss: torch.Tensor        # m_t * l_t (importance weight and KL penalty included)
    dlogp: torch.Tensor       # weight_t * m_t * d l_t / d logp_t (ratio derivative included at token level)
    dlogratio: torch.Tensor   # weight_t * m_t * d l_t / d log r (only when ``logratio`` is given)
    kl: torch.Tensor          # m_t * (exp(ref - logp) - (ref - logp) - 1)
    is_low: torch.Tensor      # m_t * [ratio < 1 - eps_low and A < 0]        (0 for cispo)
    is_high: torch.Tensor     # m_t * [ratio > 1 + eps_high and A > 0]       (cispo: ratio > eps_high)
    is_region: torch.Tensor   # m_t * (is_low or is_high)
    ratio: torch.Tensor       # min(r, delta) (non-cispo with delta), else r; r = 1 on masked tokens (token level)


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _flat(t: Optional[torch.Tensor], like: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    if t is None:
        return None
    return t.detach().to(device=like.device, dtype=dtype).expand(like.shape).contiguous().reshape(-1)


def _grpo_launch(ex: "_Exec", shape, dtype, lp, old, lr, adv, msk, iw, ref, wgt, *, loss_type, epsilon_low,
                 epsilon_high, delta, beta) -> torch.Tensor:
    """One grpo_tokens launch over flat contiguous ``dtype`` vectors -> the [GRPO_OUTPUTS, n] outputs."""
    n = lp.numel()
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    args = _C.GrpoArgs()
    out = torch.empty((_C.GRPO_OUTPUTS, n), device=lp.device, dtype=dtype)
    args.n = n
    args.dtype = _FLOAT64_CODE if dtype == torch.float64 else 0
    args.logp, args.old_logp, args.logratio = _ptr(lp), _ptr(old), _ptr(lr)
    args.adv, args.mask, args.iw, args.ref, args.weight = _ptr(adv), _ptr(msk), _ptr(iw), _ptr(ref), _ptr(wgt)
    args.params = _C.GrpoParams(kind=1 if loss_type == "cispo" else 0, eps_low=float(epsilon_low),
                                eps_high=float(eps_high), has_delta=delta is not None,
                                delta=float(delta or 0.0), beta=float(beta))
    args.out = _ptr(out)
    if n:
        ex.grpo(args)
    return out


def grpo_token_math(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                    old_logprobs: Optional[torch.Tensor] = None, logratio: Optional[torch.Tensor] = None,
                    ref_logprobs: Optional[torch.Tensor] = None, importance_weights: Optional[torch.Tensor] = None,
                    weight: Optional[torch.Tensor] = None, loss_type: str = "dapo", epsilon_low: float = 0.2,
                    epsilon_high: Optional[float] = None, delta: Optional[float] = None,
                    beta: float = 0.0) -> GrpoTokenMath:
    """Per-token GRPO loss and its derivative, one launch (CUDA tensors) or the host twin (CPU).

    Every tensor argument broadcasts to ``logp``'s shape. ``r = exp(logp - old_logprobs)`` where ``mask``
    is nonzero, 1 elsewhere (ratio 1 everywhere when ``old_logprobs`` is None), or ``r = exp(logratio)`` when
    the sequence-level log-ratio is given per token (GSPO): its derivative is then returned in ``dlogratio``
    for the caller to spread over the sequence (d log r_i / d logp_t = m_t / max(1, sum m)). ``weight`` is
    the per-token aggregation weight (e.g. 1 / max(1, sum m) for bnpo), so that ``(weight * loss).sum()`` is
    the loss and ``dlogp`` its gradient. ``logp`` is treated as detached (the caller chains dlogp into the
    statistics). Computes in float64 for float64 ``logp``, else fp32. The differentiable form used by the
    losses is ``grpo_token_loss``.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    ex = _Exec(logp.device)
    dtype = _math_dtype(logp)
    lp = logp.detach().to(dtype).contiguous().reshape(-1)
    rest = [_flat(t, logp, dtype) for t in (old_logprobs, logratio, advantages, mask, importance_weights,
                                            ref_logprobs, weight)]
    out = _grpo_launch(ex, logp.shape, dtype, lp, *rest, loss_type=loss_type, epsilon_low=epsilon_low,
                       epsilon_high=epsilon_high, delta=delta, beta=beta)
    return GrpoTokenMath(*(o.view(logp.shape) for o in out.unbind(0)))


class _GrpoTokenLoss(torch.autograd.Function):
    """per-token GRPO loss, KL term and ratio in one launch; the launch also writes d loss / d logp."""

    @staticmethod
    def forward(ctx, logp, old_logprobs, advantages, ref_logprobs, importance_weights, valid, loss_type,
                epsilon_low, epsilon_high, delta, beta):
        ex = _Exec(logp.device)
        dtype = _math_dtype(logp)
        lp = logp.detach().to(dtype).contiguous().reshape(-1)
        old, adv, ref, iw = (_flat(t, logp, dtype) for t in (old_logprobs, advantages, ref_logprobs,
                                                             importance_weights))
        msk = _flat(valid, logp, dtype)
        if beta == 0:
            ref = None  # no KL term: the kernel then writes kl = 0
        out = _grpo_launch(ex, logp.shape, dtype, lp, old, None, adv, msk, iw, ref, None, loss_type=loss_type,
                           epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta)
        # Separate tensors (not views of one buffer), so that callers may modify them in place.
        loss, kl, ratio = (out[k].clone().view(logp.shape) for k in (0, 3, 7))
        ctx.save_for_backward(out[1].clone())
        ctx.logp_dtype = logp.dtype
        ctx.mark_non_differentiable(kl, ratio)
        return loss, kl, ratio

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, grad_kl, grad_ratio):
        (dlogp,) = ctx.saved_tensors
        grad = None
        if ctx.needs_input_grad[0] and grad_loss is not None:
            grad = (grad_loss.reshape(-1).to(dlogp.dtype) * dlogp).view(grad_loss.shape).to(ctx.logp_dtype)
        return grad, None, None, None, None, None, None, None, None, None, None


def grpo_token_loss(logp: torch.Tensor, old_logprobs: Optional[torch.Tensor], advantages: torch.Tensor,
                    ref_logprobs: Optional[torch.Tensor], importance_weights: Optional[torch.Tensor],
                    valid: torch.Tensor, *, loss_type: str, epsilon_low: float, epsilon_high: Optional[float],
                    delta: Optional[float], beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-level GRPO math of fusedloss/losses/grpo.py (``token_terms``) in one launch.

    All tensors are 1-D ``[T]`` on one device (CUDA: the device kernel; CPU: its host twin); ``valid`` is
    bool; ``old_logprobs``, ``ref_logprobs`` and ``importance_weights`` may be None (``old_logprobs`` None:
    on-policy, ratio 1 with gradient ``-A``). Returns ``(per_token_loss, kl, ratio)``: the per-token loss
    (0 where not valid), the KL penalty term ``exp(ref - logp) - (ref - logp) - 1`` (0 where not valid, and
    everywhere when ``beta == 0``), and the ratio of the clip metrics (``min(r, delta)`` for non-cispo with
    ``delta``; ``r = 1`` on tokens that are not valid). Only ``per_token_loss`` is differentiable, and only
    with respect to ``logp``: the launch writes d per_token_loss / d logp, which the backward scales.
    Computes in float64 for float64 ``logp``, else in fp32 (other inputs are converted to that dtype).
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    if beta != 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when beta != 0")
    return _GrpoTokenLoss.apply(logp, old_logprobs, advantages, ref_logprobs, importance_weights, valid,
                                loss_type, float(epsilon_low), None if epsilon_high is None else float(epsilon_high),
                                None if delta is None else float(delta), float(beta))


class DpoPairMath(NamedTuple):
    loss: torch.Tensor        # [B] per-pair loss
    d_chosen: torch.Tensor    # d loss_i / d logp_chosen_i
    d_rejected: torch.Tensor  # d loss_i / d logp_rejected_i


def _dpo_launch(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_counts, rejected_counts,
                *, beta, loss_type, label_smoothing) -> torch.Tensor:
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    ex = _Exec(chosen_logps.device)
    like = chosen_logps
    dtype = _math_dtype(like)
    c, r, rc, rr, nc, nr = (_flat(t, like, dtype) for t in (chosen_logps, rejected_logps, ref_chosen_logps,
                                                             ref_rejected_logps, chosen_counts, rejected_counts))
    n = c.numel()
    out = torch.empty((3, n), device=like.device, dtype=dtype)
    args = _C.DpoArgs()
    args.n = n
    args.dtype = _FLOAT64_CODE if dtype == torch.float64 else 0
    args.logp_c, args.logp_r, args.ref_c, args.ref_r = _ptr(c), _ptr(r), _ptr(rc), _ptr(rr)
    args.n_c, args.n_r = _ptr(nc), _ptr(nr)
    args.params = _C.DpoParams(kind=DPO_LOSS_TYPES.index(loss_type), beta=float(beta),
                               label_smoothing=float(label_smoothing))
    args.out = _ptr(out)
    if n:
        ex.dpo(args)
    return out


def dpo_pair_math(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
                  ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, loss_type: str = "sigmoid",
                  label_smoothing: float = 0.0, chosen_counts: Optional[torch.Tensor] = None,
                  rejected_counts: Optional[torch.Tensor] = None) -> DpoPairMath:
    """Per-pair DPO loss (SPEC section 5) and its derivatives, one launch. ``*_counts`` are the
    completion token counts n of the ipo loss (used as given; 1 when None). float64 in, float64 math."""
    out = _dpo_launch(chosen_logps.detach(), rejected_logps.detach(), ref_chosen_logps, ref_rejected_logps,
                      chosen_counts, rejected_counts, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
    return DpoPairMath(*(o.view(chosen_logps.shape) for o in out.unbind(0)))


class _DpoPairLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_tokens,
                rejected_tokens, loss_type, beta, label_smoothing):
        counts = [None if t is None else t.detach().to(_math_dtype(chosen_logps)).clamp(min=1)
                  for t in (chosen_tokens, rejected_tokens)]
        out = _dpo_launch(chosen_logps.detach(), rejected_logps.detach(), ref_chosen_logps, ref_rejected_logps,
                          *counts, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
        ctx.save_for_backward(out[1].clone(), out[2].clone())
        ctx.dtypes = (chosen_logps.dtype, rejected_logps.dtype)
        return out[0].clone().view(chosen_logps.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        d_chosen, d_rejected = ctx.saved_tensors
        g = grad_loss.reshape(-1).to(d_chosen.dtype)
        gc = (g * d_chosen).view(grad_loss.shape).to(ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        gr = (g * d_rejected).view(grad_loss.shape).to(ctx.dtypes[1]) if ctx.needs_input_grad[1] else None
        return gc, gr, None, None, None, None, None, None, None


def dpo_pair_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
                  ref_rejected_logps: torch.Tensor, chosen_tokens: Optional[torch.Tensor],
                  rejected_tokens: Optional[torch.Tensor], *, loss_type: str, beta: float,
                  label_smoothing: float) -> torch.Tensor:
    """Per-pair DPO losses ``[B]`` exactly as fusedloss/losses/dpo.py, in one launch (CUDA kernel, or its
    host twin for CPU tensors). ``*_tokens`` are the completion token counts of the ipo loss (max(1, n) is
    applied; None counts as 1; unused by the other losses). Differentiable with respect to
    ``chosen_logps`` and ``rejected_logps``: the launch writes both derivatives, which the backward scales.
    Computes in float64 for float64 ``chosen_logps``, else in fp32."""
    return _DpoPairLoss.apply(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_tokens,
                              rejected_tokens, loss_type, float(beta), float(label_smoothing))
