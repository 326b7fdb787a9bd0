"""The shape math of a call, no rates: what a workload is (``Workload``: rows, widths, vocabulary, dtype, which
gradients), how many GEMM-sized products it needs at the least (``product_bound``), and the GPUs the plans know by
their hardware (``GPU``: SMs, memory, the balance of their products and HBM). The backends' plans size their
tiles, chunks and grids from these, and ``fusedloss.estimate`` its buffers and products. What a plan costs in
time is the performance model's business (``benchmarks/model/``, docs/design.md, "Plans and the performance
model"): the package never prices a plan.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

# What each op asks of the core, for the bound: whether the loss is known in the forward (row-local:
# a chunk can be finished in the forward, 3 products) and whether it has a teacher head.
OPS = {
    "token_logprobs": dict(row_local=False, teacher=False),
    "token_logprobs_entropy": dict(row_local=False, teacher=False),
    "cross_entropy": dict(row_local=True, teacher=False),
    "grpo": dict(row_local=True, teacher=False),  # token-level importance sampling
    "grpo_sequence": dict(row_local=False, teacher=False),  # GSPO: the ratio needs the whole sequence
    "dpo": dict(row_local=False, teacher=False),
    "distill_reverse_kl": dict(row_local=True, teacher=True),
    "distill_forward_kl": dict(row_local=True, teacher=True),
    "distill_jsd": dict(row_local=True, teacher=True),
}

OPERAND_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class Workload:
    """One call: ``n`` tokens, hidden size ``d`` (teacher hidden size ``teacher_d``), vocabulary ``v``,
    operand dtype, and which gradients are wanted (a frozen head: ``weight_grad=False``). ``plain``: the
    logits are the raw products (no bias, no logit scale, soft-cap or temperature), which the CUDA kernels
    fold through an instantiation of their own."""

    op: str
    n: int
    d: int
    v: int
    dtype: str = "bfloat16"
    teacher_d: Optional[int] = None
    hidden_grad: bool = True
    weight_grad: bool = True
    plain: bool = True

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {tuple(OPS)}, got {self.op!r}")
        for name in ("n", "d", "v", "teacher_d"):
            value = getattr(self, name)
            if not (value is None and name == "teacher_d") and (
                    isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
                raise ValueError(f"Workload.{name} must be a positive int, got {value!r}")
        if self.dtype not in OPERAND_BYTES:
            raise ValueError(f"Workload.dtype must be one of {tuple(OPERAND_BYTES)}, got {self.dtype!r}")

    @property
    def row_local(self) -> bool:
        return OPS[self.op]["row_local"]

    @property
    def has_teacher(self) -> bool:
        return OPS[self.op]["teacher"]

    @property
    def product_flops(self) -> float:
        """One GEMM-sized student product: 2 N V D."""
        return 2.0 * self.n * self.v * self.d

    @property
    def teacher_product_flops(self) -> float:
        return 2.0 * self.n * self.v * (self.teacher_d or self.d) if self.has_teacher else 0.0

    @property
    def operand_bytes(self) -> int:
        return OPERAND_BYTES[self.dtype]

    @classmethod
    def of(cls, p, *, row_local: bool, hidden_grad: bool = True, weight_grad: bool = True) -> "Workload":
        """The workload of a statistics problem (``core/problem.py::StatsProblem``; every backend's plan
        describes its calls this way). Only what the plan depends on matters: the shapes (at least one row),
        the dtype, a teacher and a JSD (its second sweep), and whether the loss is known in the forward."""
        if p.has_teacher:
            op = ("distill_jsd" if p.jsd_beta is not None else
                  "distill_forward_kl" if p.want_kl_fwd and not p.want_kl_rev else "distill_reverse_kl")
        else:
            op = "cross_entropy" if row_local else "token_logprobs_entropy" if p.want_entropy else "token_logprobs"

        def identity(t) -> bool:
            return t is None or (t.logit_scale == 1.0 and t.softcap is None and t.temperature == 1.0)

        plain = p.bias is None and identity(p.transform) and not (
            p.has_teacher and (p.teacher_bias is not None or not identity(p.teacher_transform)))
        return cls(op=op, n=max(1, p.hidden.shape[0]), d=max(1, p.hidden.shape[1]), v=max(1, p.weight.shape[0]),
                   dtype=str(p.hidden.dtype).replace("torch.", ""),
                   teacher_d=max(1, p.teacher_hidden.shape[1]) if p.has_teacher else None,
                   hidden_grad=hidden_grad, weight_grad=weight_grad, plain=bool(plain))


def product_bound(w: Workload) -> tuple[float, float]:
    """(student products, teacher products) the fewest an exact method needs: the logits once, then d hidden
    and d weight from them. A loss known in the forward can use each chunk's logits right away (1 + 2); a
    composable one (log-probs whose loss comes later) must recompute them in the backward (1 + 1 + 2). The
    teacher's logits are needed once per student logits formation."""
    grads = int(w.hidden_grad) + int(w.weight_grad)
    forms = 1 if w.row_local or grads == 0 else 2
    teacher = forms * (2 if w.op == "distill_jsd" and not w.row_local else 1) if w.has_teacher else 0
    return float(forms + grads), float(teacher)


@dataclass
class PlanChoice:
    """What a backend's plan decides for one workload: the path ("grad_in_forward": 3 products for a loss known in
    the forward; "composable": the statistics op, then a recompute), the GEMM-sized products it runs, and the
    parameters it runs with (chunk rows, tiles, workspace bytes, accumulators, the rule that chose the path ...).
    The performance model (``benchmarks/model/``) lists the passes of the same choice and prices them."""

    backend: str
    path: str
    products: float
    params: dict


# ------------------------------------------------------------------------------------------------
# GPUs, by their hardware
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    """What a plan needs to know of a GPU: its name, its SMs (the waves a grid fills), its memory (the
    workspace policy's default), and ``half_flops_per_byte`` / ``fp32_flops_per_byte`` / ``tf32_flops_per_byte``:
    its dense bf16/fp16, fp32 and TF32 product rates over the bandwidth a streaming kernel reaches, the balance
    points that say how many flops of products one byte of HBM traffic is worth (how many tile steps streaming
    the weight once costs, the Triton forward's grid, ``triton/plan.py::weight_stream_steps``; what a
    grad-in-forward chunk's extra traffic costs against the product it saves, ``backends/rules.py``). The
    performance model's rates (``benchmarks/model/cost.py::GPUS``) are the sources of these figures;
    ``tests/tooling/test_model_plan_rules.py`` checks that the two tables agree."""

    name: str
    sm_count: int
    memory_bytes: int
    half_flops_per_byte: float
    fp32_flops_per_byte: float
    tf32_flops_per_byte: float

    def flops_per_byte(self, dtype: str) -> float:
        """The balance of products of ``dtype`` operands (fp32 and float64 at the fp32 figure)."""
        return self.half_flops_per_byte if dtype in ("bfloat16", "float16") else self.fp32_flops_per_byte


# Datasheet figures (SMs or compute units, memory) and the balances of the model's rates: bf16, fp32 and TF32
# TFLOP/s over the effective TB/s (benchmarks/model/cost.py, where each rate's source is given).
GPUS = {
    "h200": GPU("H200", 132, 141 * 10**9, 790.0 / 4.0, 60.0 / 4.0, 395.0 / 4.0),
    "h100": GPU("H100", 132, 80 * 10**9, 760.0 / 3.0, 60.0 / 3.0, 380.0 / 3.0),
    "a100": GPU("A100", 108, 80 * 10**9, 280.0 / 1.7, 19.5 / 1.7, 140.0 / 1.7),
    "a100-40gb": GPU("A100 40GB", 108, 40 * 10**9, 280.0 / 1.32, 19.5 / 1.32, 140.0 / 1.32),
    "l40s": GPU("L40S", 142, 48 * 10**9, 362.0 / 0.73, 91.6 / 0.73, 183.0 / 0.73),
    "rtx4090": GPU("RTX 4090", 128, 24 * 10**9, 165.2 / 0.86, 82.6 / 0.86, 82.6 / 0.86),
    "b200": GPU("B200", 148, 180 * 10**9, 2000.0 / 7.0, 75.0 / 7.0, 1000.0 / 7.0),
    "gb200": GPU("GB200", 148, 186 * 10**9, 2500.0 / 6.8, 80.0 / 6.8, 1250.0 / 6.8),
    "b300": GPU("B300", 160, 288 * 10**9, 2250.0 / 6.8, 75.0 / 6.8, 1125.0 / 6.8),
    "rtx5090": GPU("RTX 5090", 170, 32 * 10**9, 209.5 / 1.52, 104.8 / 1.52, 104.8 / 1.52),
    "rtx-pro-6000": GPU("RTX PRO 6000 Blackwell", 188, 96 * 10**9, 503.8 / 1.52, 126.0 / 1.52, 251.9 / 1.52),
    "mi300x": GPU("MI300X", 304, 192 * 10**9, 1307.4 / 4.5, 163.4 / 4.5, 653.7 / 4.5),
    "mi325x": GPU("MI325X", 304, 256 * 10**9, 1307.4 / 5.1, 163.4 / 5.1, 653.7 / 5.1),
    "mi355x": GPU("MI355X", 256, 288 * 10**9, 2516.6 / 6.8, 157.3 / 6.8, 157.3 / 6.8),
}


def gpu_key(name: str) -> str:
    """The ``GPUS`` key of a GPU named by the user ("H100", "a100-80gb", "A100 40GB", "B200", "L40S", "RTX 4090",
    "MI300X", a device name as torch reports it), in any case; ValueError naming the known ones when none
    matches."""
    key = _key_by_name(name) if isinstance(name, str) else None
    if key is None:
        raise ValueError(f"gpu must be one of {tuple(GPUS)} (any case; a device name such as 'NVIDIA H100 80GB HBM3' "
                         f"works too), got {name!r}")
    return key


def _key_by_name(name: str) -> Optional[str]:
    squashed = "".join(ch for ch in name.upper() if ch.isalnum())
    if name.lower() in GPUS:
        return name.lower()
    # the most specific names first: GB200 before B200, GH200 (an H100 or H200 die beside a Grace CPU) before H200,
    # an A100's 40 GB part before the A100 (80 GB)
    for key, markers in (("rtx-pro-6000", ("RTXPRO6000",)), ("rtx5090", ("RTX5090", "5090")),
                         ("rtx4090", ("RTX4090", "4090")), ("l40s", ("L40S",)),
                         ("gb200", ("GB200",)), ("b300", ("GB300", "B300")), ("b200", ("B200", "B100")),
                         ("h100", ("GH200", "H100", "H800")), ("h200", ("H200",)),
                         ("a100-40gb", ("A10040GB", "A100PCIE40GB", "A100SXM440GB")), ("a100", ("A100", "A800")),
                         ("mi355x", ("MI355", "MI350")), ("mi325x", ("MI325",)), ("mi300x", ("MI300",))):
        if any(m in squashed for m in markers):
            return key
    return None


def gpu_for_device(name: str, capability: tuple, sm_count: int, memory_bytes: int, arch: str = "") -> GPU:
    """The plans' GPU for a device: the ``GPUS`` entry its name names, else the closest by architecture
    (``capability`` (major, minor) on NVIDIA; ``arch``, the gfx name, on AMD): sm_100 a B200, sm_103 a B300,
    sm_12x an RTX PRO 6000, sm_90 an H200, older an A100, gfx950 an MI355X, other gfx an MI300X. The entry keeps
    its name (which ``backend_status()`` reports); the SM count and memory are the device's own (a partitioned
    or cut-down part)."""
    key = _key_by_name(name or "")
    if key is None:
        if arch.startswith("gfx"):
            key = "mi355x" if arch.startswith("gfx95") else "mi300x"
        else:
            major, minor = capability
            key = ({10: "b300" if minor >= 3 else "b200", 11: "b200", 12: "rtx-pro-6000", 9: "h200"}.get(major)
                   or ("a100" if major < 9 else "b200"))
    spec = GPUS[key]
    return GPU(spec.name, int(sm_count) or spec.sm_count, int(memory_bytes) or spec.memory_bytes,
               spec.half_flops_per_byte, spec.fp32_flops_per_byte, spec.tf32_flops_per_byte)
