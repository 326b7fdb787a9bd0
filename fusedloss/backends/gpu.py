"""What the two GPU backends share: the workspace policy, the probe of what torch's products can do on a
device, and the products themselves (fp32 outputs of half operands, accumulation inside the GEMM).

Neither GPU backend imports the other; both import this module (docs/design.md, "The backends wing").
"""

from __future__ import annotations

import contextlib
import warnings
from typing import NamedTuple, Optional

import torch

# ------------------------------------------------------------------------------------------------
# The workspace policy (docs/design.md, "The logits workspace")
# ------------------------------------------------------------------------------------------------
# A call's logits workspace, in this order: the call's own ``workspace_mb`` (or ``FUSEDLOSS_WORKSPACE_MB``);
# a fixed size where the chunking must not follow the free memory (deterministic mode: the order of fp32 sums
# is part of the result); else a share of the memory free for torch when a backend first runs on the device,
# between the backend's floor and a cap. The floor is the backend's smallest useful workspace (the CUDA
# backend's tiles take all rows of at least 4096 columns; Triton's chunks are cut to any size), so it is the
# one figure each backend passes. The cap: beside a training step's own state, and one persistent buffer per
# device and stream; fewer, larger chunks mean fewer beta = 1 accumulations of the fp32 d weight, whose C
# traffic a cuBLAS product does not hide.
WORKSPACE_SHARE = 8  # of the memory free for torch when a backend first runs on a device
WORKSPACE_MAX_BYTES = 4 << 30
WORKSPACE_FIXED_BYTES = 1 << 30  # deterministic mode


def workspace_bytes(override_mb: Optional[float], free: Optional[int], floor: int, *, fixed: bool = False) -> int:
    """Bytes of logits workspace for one call, by the policy above. ``free``: the memory free for torch
    (``free_bytes``), or None when nothing is known (then the floor)."""
    if override_mb is not None:
        return max(1, int(override_mb * 2**20))
    if fixed:
        return WORKSPACE_FIXED_BYTES
    if free is None:
        return floor
    return int(min(WORKSPACE_MAX_BYTES, max(floor, free // WORKSPACE_SHARE)))


# The memory a GPU backend sizes its workspace from, fixed for the process once a backend first runs on a
# device, so that a backward recomputes in the chunks its forward used whatever the allocator does in between.
_DEVICE_FREE: dict = {}


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory free for torch on a CUDA device (the driver's free memory plus what torch's caching allocator
    holds unused) the first time a backend runs there; None for other devices, and during a CUDA graph capture
    before any (the plan then takes its default workspace)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICE_FREE:
        if torch.cuda.is_current_stream_capturing():
            return None
        free, _ = torch.cuda.mem_get_info(index)
        _DEVICE_FREE[index] = free + torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    return _DEVICE_FREE[index]


# ------------------------------------------------------------------------------------------------
# Products: what torch can do on the device (probed once), fp32 precision, accumulation
# ------------------------------------------------------------------------------------------------
class Capabilities(NamedTuple):
    out_dtype: bool   # torch.mm(a16, b16, out_dtype=torch.float32, out=c32): half operands, fp32 output
    accumulate: bool  # torch.baddbmm(c32, a16, b16, out_dtype=torch.float32, out=c32): beta = 1 into fp32


_CAPS: dict = {}
_WARNED: set = set()


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _device_failure(exc: BaseException) -> bool:
    """Errors a probe must never swallow: out of memory, and a broken device (not an unsupported call)."""
    accelerator = getattr(torch, "AcceleratorError", None)
    return isinstance(exc, torch.OutOfMemoryError) or (accelerator is not None and isinstance(exc, accelerator)) \
        or "CUDA error" in str(exc)


def _probe(device: torch.device) -> Capabilities:
    """One tiny product of each kind on the device, checked against its known result. Only this probe
    catches errors (an unsupported signature raises TypeError, NotImplementedError or a RuntimeError from a
    dtype check); the real products never do."""
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, dtype=torch.bfloat16)
    b = torch.tensor([[1.0, 0.5], [0.25, 2.0]], device=device, dtype=torch.bfloat16)
    want = a.float() @ b.float()

    def fp32_output():
        return torch.mm(a, b, out_dtype=torch.float32, out=torch.full((2, 2), 7.0, device=device))

    def accumulation():
        acc = torch.ones(1, 2, 2, device=device)
        torch.baddbmm(acc, a[None], b[None], out_dtype=torch.float32, out=acc)
        return acc[0] - 1.0

    supported = []
    for attempt in (fp32_output, accumulation):
        try:
            supported.append(bool(torch.equal(attempt(), want)))
        except (TypeError, NotImplementedError, RuntimeError) as exc:
            if _device_failure(exc):
                raise
            supported.append(False)
    caps = Capabilities(out_dtype=supported[0], accumulate=supported[0] and supported[1])
    if not caps.out_dtype:
        warn_once("out_dtype", f"fusedloss CUDA backend: torch {torch.__version__} cannot multiply half-precision "
                   "operands into fp32 outputs on this device (torch.mm(..., out_dtype=torch.float32), torch >= "
                   "2.8); each product converts its operands to fp32 instead: correct, but several times slower")
    elif not caps.accumulate:
        warn_once("accumulate", f"fusedloss CUDA backend: torch {torch.__version__} cannot accumulate half "
                   "products into an fp32 tensor inside the GEMM on this device (torch.baddbmm(..., "
                   "out_dtype=torch.float32, out=acc)); gradients are summed with a separate add (slower)")
    return caps


def capabilities(device: torch.device) -> Capabilities:
    """Per device, probed once per process. CPU tensors (host mode): fp32 products and ``addmm_``."""
    if device.type != "cuda":
        return Capabilities(out_dtype=False, accumulate=True)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPS:
        _CAPS[index] = _probe(torch.device("cuda", index))
    return _CAPS[index]


def torch_fp32_precision() -> str:
    """What torch's matmul would use for fp32 operands now: "tf32" or "ieee"."""
    matmul = torch.backends.cuda.matmul
    value = getattr(matmul, "fp32_precision", None)  # torch >= 2.9; readable whichever API set it
    if value is None:
        return "tf32" if matmul.allow_tf32 else "ieee"
    if value == "none":
        value = getattr(torch.backends, "fp32_precision", "none")
    return "tf32" if value == "tf32" else "ieee"


@contextlib.contextmanager
def fp32_products(device: torch.device, dtype: torch.dtype, want: str):
    """Run the block's fp32 CUDA products at ``want`` ("ieee" or "tf32"), restoring torch's setting after it.
    torch refuses to read its TF32 flag through one API once the other API set it, so the flag is changed
    through the API the caller used (the legacy ``allow_tf32`` when it is readable, else
    ``fp32_precision``), and only when it differs from what is wanted."""
    if device.type != "cuda" or dtype != torch.float32 or torch_fp32_precision() == want:
        yield
        return
    matmul = torch.backends.cuda.matmul
    try:
        previous = matmul.allow_tf32  # raises when the new API set the flag
        legacy = True
    except RuntimeError:
        legacy = False
    if legacy:
        matmul.allow_tf32 = want == "tf32"
    else:
        previous = matmul.fp32_precision
        matmul.fp32_precision = want
    try:
        yield
    finally:
        if legacy:
            matmul.allow_tf32 = previous
        else:
            matmul.fp32_precision = previous


class Products:
    """The products of one call: fp32 outputs from the operands' dtype, accumulation into fp32 inside the
    GEMM where the device's torch can, one product straight into a gradient's own dtype."""

    def __init__(self, device: torch.device):
        self.host = device.type != "cuda"
        self.caps = capabilities(device)

    def _fp32_operands(self, a: torch.Tensor) -> bool:
        return self.host or a.dtype == torch.float32 or not self.caps.out_dtype

    def into(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``out = a @ b`` (out fp32, possibly a row-padded view)."""
        if self._fp32_operands(a):
            return torch.mm(a.float(), b.float(), out=out)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)

    def accumulate(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``acc += a @ b`` for an fp32 accumulator: beta = 1 inside the GEMM where possible."""
        if self._fp32_operands(a):
            return acc.addmm_(a.float(), b.float())
        if self.caps.accumulate:
            torch.baddbmm(acc[None], a[None], b[None], out_dtype=torch.float32, out=acc[None])
            return acc
        return acc.add_(torch.mm(a, b, out_dtype=torch.float32))

    def direct(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``out = a @ b`` in out's own dtype (the operands'), accumulated in fp32 and rounded once."""
        if self.host:
            return out.copy_(torch.mm(a.float(), b.float()))
        return torch.mm(a, b, out=out)


def product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out = a @ b`` (``out += a @ b`` when ``accumulate``), summed in ``out``'s dtype (fp32 or float64)
    whatever the operands' (cuBLAS's fp32-output GEMM for bf16/fp16 operands, accumulating with beta = 1)."""
    caps = capabilities(a.device)
    if a.dtype != out.dtype and not caps.out_dtype:
        # host products (no mixed-dtype GEMM on the CPU), or a torch without them (warned)
        a, b = a.to(out.dtype), b.to(out.dtype)
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif not accumulate:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif caps.accumulate:
        torch.baddbmm(out[None], a[None], b[None], out_dtype=out.dtype, out=out[None])
    else:
        out.add_(torch.mm(a, b, out_dtype=out.dtype))


def direct_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> None:
    """``out = a @ b`` in ``out``'s own (half) dtype: summed in ``acc`` and rounded once, with no fp32 block
    and copy (cuBLAS's half GEMM accumulates in fp32; on the CPU, an ``acc`` product)."""
    if a.device.type == "cuda":
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a.to(acc), b.to(acc)))


# ------------------------------------------------------------------------------------------------
# Rows that carry no gradient
# ------------------------------------------------------------------------------------------------

def active_rows(coeffs: torch.Tensor, targets: Optional[torch.Tensor],
                 column_dz: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[rows] bool: the rows whose gradient is not identically zero (the dx kernel's row_inactive, or a
    given dz at a named column)."""
    active = (coeffs != 0).any(dim=0)
    if column_dz is not None:
        active = active | (column_dz != 0).any(dim=1)
    return active if targets is None else active & (targets >= 0)


def zero_rows_outside(h: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """hidden with the rows outside the loss set to 0: their dx is 0, but 0 * NaN is not, and NaN padding
    rows (fully masked attention) must stay out of d weight. No host synchronisation. Both GPU backends use it."""
    return torch.where(active[:, None], h, torch.zeros((), dtype=h.dtype, device=h.device))
