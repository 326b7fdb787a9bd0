"""The CUDA backend's opt-in Hopper path: the statistics and the d logits in the GEMM epilogue (the sm_90a kernels
of ``csrc/sm90_epilogue.cuh``; docs/design.md, "The statistics in the GEMM epilogue").

``FUSEDLOSS_CUDA_EPILOGUE``
    ``auto`` (the default, also when unset) and ``0``: today's path (cuBLAS products, the fp32 logits tile, the
    fold and dx kernels) until a measured GPU run shows the epilogue path faster. ``1``: the composable path's
    forward statistics, and its backward's recompute with the d logits, come from the epilogue kernels for every
    problem they serve (``unserved``) on an sm_90 GPU with bf16/fp16 operands; a problem they do not serve keeps
    today's path. Asked for where the kernels cannot run (a CPU tensor, a GPU other than sm_90, an extension built
    without them), the call raises a RuntimeError saying why (``unavailable``).

Forward: one launch over the whole problem writes per (row, 256-column tile) the partials (m, t, e) and the
target logit, no logits tensor; ``epilogue_merge_kernel`` merges a row's tiles with math.h's ``state_merge`` and
``finalize_row``. Named columns (core/columns.py) read their logits from a gathered fp32 dot product. Backward:
per vocabulary tile of all rows, one launch writes dx in the operands' dtype (math.h's dz formula, fp32 inside),
which the d hidden and d weight products read; named columns get their given dz written over it, rounded once.

``kernels`` is what launches: the extension's on a GPU, or (tests) an object with the same three methods over
CPU tensors, the host twins of ``csrc/epilogue_host.cpp``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import config
from ...core import columns
from ...core import problem as coef
from ...core.problem import GradientNeeds, Statistics, StatsProblem
from .. import gpu
from . import extension

ENV = "FUSEDLOSS_CUDA_EPILOGUE"
TILE_M, TILE_N = 128, 256  # the kernels' CTA tile (csrc/sm90_epilogue.h kTileM, kTileN)
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}
_DZ_BUDGET_BYTES = 1 << 30  # the d logits tile of all rows, when the call names no workspace
_NAMED_ELEMENTS = 1 << 24  # fp32 elements of one gathered block of named-column weights


def mode() -> str:
    """``"auto"``, ``"0"`` or ``"1"`` from FUSEDLOSS_CUDA_EPILOGUE (fusedloss/config.py reads it; a ValueError
    naming it for anything else)."""
    flag = config.from_environment().cuda_epilogue
    return "auto" if flag is None else ("1" if flag else "0")


def unserved(p: StatsProblem) -> Optional[str]:
    """Why the epilogue kernels do not serve this problem, or None: what they compute is lse, log-probs, the
    entropy and named columns of a student without bias or soft-cap, from bf16/fp16 operands."""
    h, w = p.hidden, p.weight
    if h.dtype not in _DTYPE_CODES or w.dtype != h.dtype:
        return f"operands {h.dtype}/{w.dtype} (the kernels take bf16 or fp16, both alike)"
    if p.has_teacher or p.want_kl_rev or p.want_kl_fwd or p.jsd_beta is not None:
        return "a teacher (its KL needs both logits of a column in one fold)"
    if p.bias is not None or p.transform.softcap is not None:
        return "a bias or soft-cap"
    if p.want_mean_logit or p.want_extras:
        return "mean logit or TRL's extras"
    if h.shape[1] % 8:
        return "rows not 16-byte aligned (D % 8 != 0)"
    if h.shape[0] == 0 or w.shape[0] == 0:
        return "an empty problem"
    return None


def unavailable(device: torch.device) -> Optional[str]:
    """Why the epilogue kernels cannot run on ``device``, or None."""
    if device.type != "cuda":
        return f"they need an NVIDIA sm_90 GPU (H100/H200); the tensors are on {device.type}"
    if extension._C is None:
        return f"the CUDA extension is not available ({extension._IMPORT_ERROR}; fusedloss.backend_status() says why)"
    if not getattr(extension._C, "EPILOGUE_KERNELS", False):
        try:
            from .. import _build_info

            why = getattr(_build_info, "CUDA_EPILOGUE", "not built")
        except ImportError:
            why = "not built"
        return f"the extension was built without them ({why}; reinstall with the build requirement nvidia-cutlass)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"they are built for sm_90a only; this GPU is sm_{major}{minor}"
    return None


# What launches: None for the extension's kernels; a test puts host twins here.
_KERNELS_OVERRIDE = None


def wanted(p: StatsProblem) -> bool:
    """Whether the backend takes the epilogue path for ``p`` (FUSEDLOSS_CUDA_EPILOGUE=1 and a problem it
    serves). RuntimeError when asked for where the kernels cannot run."""
    if mode() != "1" or p.acc_dtype == torch.float64 or unserved(p) is not None:
        return False
    if _KERNELS_OVERRIDE is None:
        why = unavailable(p.hidden.device)
        if why:
            raise RuntimeError(f"{ENV}=1 asks for the sm_90 epilogue kernels, but {why}")
    return True


class _Kernels:
    """The extension's launchers on the current stream."""

    def __init__(self):
        self._C = extension._C

    @staticmethod
    def _stream(t: torch.Tensor) -> int:
        return torch.cuda.current_stream(t.device).cuda_stream

    def statistics(self, p: StatsProblem, part: torch.Tensor, targets: torch.Tensor, target_logit: torch.Tensor,
                   scale: tuple) -> None:
        a = self._C.EpilogueStatistics()
        a.hidden, a.weight = p.hidden.data_ptr(), p.weight.data_ptr()
        a.n, a.v, a.d = p.hidden.shape[0], p.weight.shape[0], p.hidden.shape[1]
        a.dtype, a.entropy = _DTYPE_CODES[p.hidden.dtype], p.want_entropy
        a.part_m, a.part_t = part[0].data_ptr(), part[1].data_ptr()
        a.part_e = part[2].data_ptr() if p.want_entropy else 0
        a.target, a.target_logit = targets.data_ptr(), target_logit.data_ptr()
        a.logit_scale, a.inv_temperature = scale
        a.stream = self._stream(part)
        self._C.epilogue_statistics(a)

    def merge(self, part: torch.Tensor, target_logit: torch.Tensor, out: torch.Tensor, entropy: bool,
              targets: Optional[torch.Tensor]) -> None:
        a = self._C.EpilogueMerge()
        a.part_m, a.part_t = part[0].data_ptr(), part[1].data_ptr()
        a.part_e = part[2].data_ptr() if entropy else 0
        a.target_logit, a.out = target_logit.data_ptr(), out.data_ptr()
        a.n, a.tiles, a.stride = out.shape[1], part.shape[1], part.shape[2]
        a.entropy, a.target = entropy, 0 if targets is None else targets.data_ptr()
        a.stream = self._stream(out)
        self._C.epilogue_merge(a)

    def dlogits(self, h: torch.Tensor, w: torch.Tensor, out: torch.Tensor, targets: torch.Tensor, v0: int,
                rows: torch.Tensor, scale: tuple, chain: float, log_q: bool) -> None:
        a = self._C.EpilogueDlogits()
        a.hidden, a.weight = h.data_ptr(), w.data_ptr()
        a.n, a.v, a.d = h.shape[0], w.shape[0], h.shape[1]
        a.dtype = _DTYPE_CODES[h.dtype]
        a.out, a.ld_out = out.data_ptr(), out.stride(0)
        a.target, a.target_offset = targets.data_ptr(), v0
        a.coeffs, a.coeff_stride = rows.data_ptr(), rows.stride(0)
        a.logit_scale, a.inv_temperature = scale
        a.chain, a.log_q = chain, log_q
        a.stream = self._stream(out)
        self._C.epilogue_dlogits(a)


def _kernels():
    return _KERNELS_OVERRIDE if _KERNELS_OVERRIDE is not None else _Kernels()


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _scale(p: StatsProblem) -> tuple:
    """(logit_scale, 1 / temperature) as math.h's Transform holds them (the reciprocal formed in double)."""
    return float(p.transform.logit_scale), 1.0 / float(p.transform.temperature)


def _targets(p: StatsProblem) -> torch.Tensor:
    if p.targets is not None:
        return p.targets.contiguous()
    return torch.full((p.hidden.shape[0],), -1, device=p.hidden.device, dtype=torch.int64)


def _named_logits(p: StatsProblem) -> torch.Tensor:
    """``[N, K]`` fp32 logits at the named columns (0 where there is none): fp32 dot products of the rows with
    their gathered weight rows, transformed as the kernels transform the accumulator."""
    n, k = p.columns.shape
    d = p.hidden.shape[1]
    out = torch.zeros((n, k), device=p.hidden.device, dtype=torch.float32)
    step = max(1, _NAMED_ELEMENTS // max(1, k * d))
    logit_scale, inv_t = _scale(p)
    for r0 in range(0, n, step):
        cols = p.columns[r0:r0 + step]
        wk = p.weight[cols.clamp(min=0)].to(torch.float32)  # [rows, K, D]
        x = torch.bmm(wk, p.hidden[r0:r0 + step].to(torch.float32)[:, :, None])[:, :, 0]
        z = (x * logit_scale) * inv_t
        out[r0:r0 + step] = torch.where(cols >= 0, z, torch.zeros((), dtype=z.dtype, device=z.device))
    return out


def forward_statistics(p: StatsProblem):
    """backend.forward_statistics for a problem the kernels serve: ``Statistics``, with named columns
    ``(Statistics, [N, K] logits)``."""
    n, v = p.hidden.shape[0], p.weight.shape[0]
    dev = p.hidden.device
    tiles, rows_padded = -(-v // TILE_N), _round_up(n, TILE_M)
    part = torch.empty((3 if p.want_entropy else 2, tiles, rows_padded), device=dev, dtype=torch.float32)
    target_logit = torch.zeros(n, device=dev, dtype=torch.float32)
    k = _kernels()
    k.statistics(p, part, _targets(p), target_logit, _scale(p))
    out = torch.zeros((len(Statistics._fields), n), device=dev, dtype=torch.float32)
    k.merge(part, target_logit, out, p.want_entropy, None if p.targets is None else p.targets.contiguous())
    stats = Statistics(*out.unbind(0))
    return stats if p.columns is None else (stats, _named_logits(p))


def coefficient_rows(p: StatsProblem, saved: Statistics, coeffs: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """``[5, N]`` fp32 per-row inputs of the d logits node (lse, lse_lo, onehot, constant, logq): an inactive row
    gets lse = +inf and zero coefficients, so its q is 0 and its dx exactly 0 whatever its logits."""
    zero = torch.zeros((), device=coeffs.device, dtype=torch.float32)
    inf = torch.full((), float("inf"), device=coeffs.device, dtype=torch.float32)
    c = coeffs.to(torch.float32)
    rows = torch.stack((
        torch.where(active, saved.lse.to(torch.float32), inf),
        torch.where(active, saved.lse_lo.to(torch.float32), zero),
        torch.where(active, c[coef.COEF_ONEHOT], zero),
        torch.where(active, c[coef.COEF_CONST], zero),
        torch.where(active, c[coef.COEF_LOGQ], zero),
    ))
    return rows.contiguous()


def backward_gradients(p: StatsProblem, saved: Statistics, coeffs: torch.Tensor, needs: GradientNeeds, *,
                       column_dz: Optional[torch.Tensor] = None):
    """backend.backward_gradients for a problem the kernels serve: (d hidden, d weight, None). Per vocabulary
    tile of all rows, dx in the operands' dtype from the epilogue, then d hidden (fp32 over the tiles, or
    direct for one tile) and that tile's d weight rows (direct)."""
    h, w = p.hidden, p.weight
    n, v = h.shape[0], w.shape[0]
    dev = h.device
    if not (needs.hidden or needs.weight):
        return None, None, None
    targets = _targets(p)
    active = gpu.active_rows(coeffs, p.targets, column_dz)
    rows = coefficient_rows(p, saved, coeffs, active)
    h_dw = gpu.zero_rows_outside(h, active) if needs.weight else None
    budget = _DZ_BUDGET_BYTES if p.workspace_mb is None else max(1, int(p.workspace_mb * 2**20))
    cols = max(TILE_N, budget // max(1, n * h.element_size()) // TILE_N * TILE_N)
    cols = min(cols, _round_up(v, 8))
    ld = _round_up(cols, 8)
    buf = torch.empty(n * ld, device=dev, dtype=h.dtype)
    one_tile = cols >= v
    dh = torch.empty_like(h) if needs.hidden else None
    dh_acc = dh if (dh is None or one_tile) else torch.empty(h.shape, device=dev, dtype=torch.float32)
    dw = torch.empty_like(w) if needs.weight else None
    products = gpu.Products(dev)
    tf = p.transform
    chain = float(tf.logit_scale) / float(tf.temperature)  # formed in double, as math.h's Transform.chain
    k = _kernels()
    for v0 in range(0, v, cols):
        v1 = min(v, v0 + cols)
        dx = buf[: n * ld].view(n, ld)[:, : v1 - v0]
        k.dlogits(h, w[v0:v1], dx, targets, v0, rows, _scale(p), chain, p.want_entropy)
        if column_dz is not None and p.columns is not None:  # the given dz, through the chain rule
            columns.put(dx, p.columns, column_dz.to(torch.float32) * chain, v0)
        if dh is not None:
            if one_tile:
                products.direct(dh, dx, w)
            elif v0 == 0:
                products.into(dh_acc, dx, w[v0:v1])
            else:
                products.accumulate(dh_acc, dx, w[v0:v1])
        if dw is not None:
            products.direct(dw[v0:v1], dx.T, h_dw)
    if dh is not None and dh_acc is not dh:
        dh.copy_(dh_acc)
    return dh, dw, None
