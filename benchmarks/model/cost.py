"""The performance model: what a backend's plan for one call costs on a given GPU, without a GPU.

Every GPU backend's plan (``fusedloss/backends/*/plan.py::plan``) decides a call by named rules and describes
it as a ``fusedloss.core.workload.PlanChoice``; the model's plan functions (``benchmarks/model/cuda.py``,
``benchmarks/model/triton.py``) list that choice's ``Pass``es (a GEMM-sized product, an elementwise sweep over a
workspace, a reduction ...) each with the flops it performs and the bytes it moves through HBM, and for
elementwise kernels the instructions they issue (counted in their compiled SASS). ``evaluate`` turns a plan
into a modelled time per pass (``max(flops / rate, bytes / bandwidth, instructions / issue rate)``, plus a
product's exposed epilogue and its small launches; passes summed unless a pass says it overlaps the previous
one; ``pass_breakdown`` says which limit bounds each) and compares it with the *product-count bound* of the
workload: the time of the fewest GEMM-sized products any exact method needs for that op at the GPU's dense
peak (``product_bound``). ``tests/tooling/test_model_plan_rules.py`` checks that the package's rules pick the plan this
model prices cheapest, or one within 2% of it. ``benchmarks/cost_model.py`` is the command line over this
module. See docs/design.md, "Plans and the performance model".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fusedloss.core.workload import GPU as Hardware
from fusedloss.core.workload import (  # noqa: F401 - the model's workloads are the package's
    OPERAND_BYTES,
    OPS,
    PlanChoice,
    Workload,
    gpu_key,
    product_bound,
)

# ------------------------------------------------------------------------------------------------
# GPUs
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPUSpec:
    """Dense (non-sparse) throughput and memory figures. ``tflops`` maps the product's operand dtype
    ("bfloat16", "float16", "tf32", "float32") to TFLOP/s; ``hbm_tbps`` is the *effective* bandwidth a
    streaming kernel reaches (not the datasheet peak); ``sm_clock_ghz`` the SM clock under load (the issue
    rate of the elementwise kernels: ``issue_rate``)."""

    name: str
    tflops: dict
    hbm_tbps: float
    l2_bytes: int
    sm_count: int
    memory_bytes: int
    sm_clock_ghz: float = 1.98

    @property
    def half_flops_per_byte(self) -> float:
        """The balance the package's plans know the GPU by (``fusedloss.core.workload.GPU``)."""
        return self.tflops["bfloat16"] / self.hbm_tbps

    @property
    def fp32_flops_per_byte(self) -> float:
        return self.tflops["float32"] / self.hbm_tbps

    @property
    def tf32_flops_per_byte(self) -> float:
        return self.tflops["tf32"] / self.hbm_tbps

    def flops_per_byte(self, dtype: str) -> float:
        return self.half_flops_per_byte if dtype in ("bfloat16", "float16") else self.fp32_flops_per_byte


# Every rate below is a named figure with its source. The first device run's per-kernel times (the benchmark's
# profile of one call) replace them: each is what one kind of kernel is assumed to reach until then.
GPUS = {
    # H200 SXM: bf16 dense ~790 TFLOP/s on random data (the best cuBLAS rate, 8192^3, bf16 output) and a 4.3 TB/s
    # device copy, as measured on an H200; 4.0 TB/s is what a streaming kernel should expect. fp64: 67 TFLOP/s
    # (datasheet, tensor cores). SM clock: 1.98 GHz, the datasheet's boost clock.
    "h200": GPUSpec("H200", {"bfloat16": 790.0, "float16": 790.0, "tf32": 395.0, "float32": 60.0, "float64": 60.0},
                    hbm_tbps=4.0, l2_bytes=50 * 2**20, sm_count=132, memory_bytes=141 * 10**9, sm_clock_ghz=1.98),
    # H100 SXM 80 GB: the H200's SMs with 3.35 TB/s HBM3 (datasheet), ~3.0 effective.
    "h100": GPUSpec("H100", {"bfloat16": 760.0, "float16": 760.0, "tf32": 380.0, "float32": 60.0, "float64": 60.0},
                    hbm_tbps=3.0, l2_bytes=50 * 2**20, sm_count=132, memory_bytes=80 * 10**9, sm_clock_ghz=1.98),
    # A100 SXM 80 GB: 312 TFLOP/s bf16 dense (datasheet; ~280 reached), 2.0 TB/s datasheet, ~1.7 effective;
    # 1.41 GHz boost.
    "a100": GPUSpec("A100", {"bfloat16": 280.0, "float16": 280.0, "tf32": 140.0, "float32": 19.5, "float64": 19.5},
                    hbm_tbps=1.7, l2_bytes=40 * 2**20, sm_count=108, memory_bytes=80 * 10**9, sm_clock_ghz=1.41),
    # A100 40 GB: the 80 GB part's SMs with 1.555 TB/s HBM2 (datasheet), 0.85 of it effective.
    "a100-40gb": GPUSpec("A100 40GB", {"bfloat16": 280.0, "float16": 280.0, "tf32": 140.0, "float32": 19.5,
                                       "float64": 19.5},
                         hbm_tbps=1.32, l2_bytes=40 * 2**20, sm_count=108, memory_bytes=40 * 10**9, sm_clock_ghz=1.41),
    # B200: ~2250 TFLOP/s bf16 dense (datasheet), 8 TB/s datasheet, ~7 effective; ~1.9 GHz boost.
    "b200": GPUSpec("B200", {"bfloat16": 2000.0, "float16": 2000.0, "tf32": 1000.0, "float32": 75.0, "float64": 37.0},
                    hbm_tbps=7.0, l2_bytes=126 * 2**20, sm_count=148, memory_bytes=180 * 10**9, sm_clock_ghz=1.9),
    # The entries below are datasheet figures, none measured: the dense bf16/fp16 tensor rate (half the sparse
    # one), and the datasheet memory bandwidth times 0.85 as the effective rate (the H200's measured copy reaches
    # 0.9 of its 4.8 TB/s, a streaming kernel ~0.83). Until a device run replaces them.
    # GB200 (NVL72, per GPU): 2500 TFLOP/s bf16 dense, 8 TB/s HBM3e, 186 GB, 148 SMs.
    "gb200": GPUSpec("GB200", {"bfloat16": 2500.0, "float16": 2500.0, "tf32": 1250.0, "float32": 80.0,
                               "float64": 40.0},
                     hbm_tbps=6.8, l2_bytes=126 * 2**20, sm_count=148, memory_bytes=186 * 10**9, sm_clock_ghz=1.9),
    # B300 (HGX B300, Blackwell Ultra, sm_103): 2250 TFLOP/s bf16 dense, 8 TB/s HBM3e, 288 GB, 160 SMs; fp64
    # 1.25 TFLOP/s per GPU (the datasheet's 10 TFLOP/s for eight).
    "b300": GPUSpec("B300", {"bfloat16": 2250.0, "float16": 2250.0, "tf32": 1125.0, "float32": 75.0, "float64": 1.25},
                    hbm_tbps=6.8, l2_bytes=126 * 2**20, sm_count=160, memory_bytes=288 * 10**9, sm_clock_ghz=1.9),
    # GeForce RTX 5090 (sm_120): 209.5 TFLOP/s bf16 dense with fp32 accumulation, 1.79 TB/s GDDR7, 32 GB, 170 SMs,
    # 96 MB L2, 2.41 GHz boost; fp32 104.8 TFLOP/s (CUDA cores), fp64 1/64 of it.
    "rtx5090": GPUSpec("RTX 5090", {"bfloat16": 209.5, "float16": 209.5, "tf32": 104.8, "float32": 104.8,
                                    "float64": 1.6},
                       hbm_tbps=1.52, l2_bytes=96 * 2**20, sm_count=170, memory_bytes=32 * 10**9, sm_clock_ghz=2.41),
    # RTX PRO 6000 Blackwell (sm_120): 503.8 TFLOP/s bf16 dense, 1.79 TB/s GDDR7, 96 GB, 188 SMs, 128 MB L2,
    # 2.62 GHz boost; fp32 126 TFLOP/s (CUDA cores), fp64 1/64 of it.
    "rtx-pro-6000": GPUSpec("RTX PRO 6000 Blackwell", {"bfloat16": 503.8, "float16": 503.8, "tf32": 251.9,
                                                        "float32": 126.0, "float64": 2.0},
                            hbm_tbps=1.52, l2_bytes=128 * 2**20, sm_count=188, memory_bytes=96 * 10**9,
                            sm_clock_ghz=2.62),
    # L40S (sm_89): 362 TFLOP/s bf16 dense with fp32 accumulation, 864 GB/s GDDR6, 48 GB, 142 SMs, 96 MB L2,
    # 2.52 GHz boost; fp32 91.6 TFLOP/s, tf32 183 dense, fp64 1/64 of fp32.
    "l40s": GPUSpec("L40S", {"bfloat16": 362.0, "float16": 362.0, "tf32": 183.0, "float32": 91.6, "float64": 1.4},
                    hbm_tbps=0.73, l2_bytes=96 * 2**20, sm_count=142, memory_bytes=48 * 10**9, sm_clock_ghz=2.52),
    # GeForce RTX 4090 (sm_89): 165.2 TFLOP/s bf16 dense with fp32 accumulation, 1.01 TB/s GDDR6X, 24 GB, 128 SMs,
    # 72 MB L2, 2.52 GHz boost; fp32 82.6 TFLOP/s, tf32 82.6 dense, fp64 1/64 of fp32.
    "rtx4090": GPUSpec("RTX 4090", {"bfloat16": 165.2, "float16": 165.2, "tf32": 82.6, "float32": 82.6,
                                    "float64": 1.3},
                       hbm_tbps=0.86, l2_bytes=72 * 2**20, sm_count=128, memory_bytes=24 * 10**9, sm_clock_ghz=2.52),
    # AMD Instinct (CDNA3 gfx942, CDNA4 gfx950): sm_count is the compute units, l2 the L2 caches of all XCDs (the
    # 256 MB Infinity Cache behind them is not counted). MI300X: 1307.4 TFLOP/s bf16 dense, 5.3 TB/s HBM3,
    # 192 GB, 304 CUs, 2.1 GHz; fp32 and fp64 matrix 163.4 TFLOP/s.
    "mi300x": GPUSpec("MI300X", {"bfloat16": 1307.4, "float16": 1307.4, "tf32": 653.7, "float32": 163.4,
                                 "float64": 163.4},
                      hbm_tbps=4.5, l2_bytes=32 * 2**20, sm_count=304, memory_bytes=192 * 10**9, sm_clock_ghz=2.1),
    # MI325X: the MI300X's compute with 6.0 TB/s HBM3e and 256 GB.
    "mi325x": GPUSpec("MI325X", {"bfloat16": 1307.4, "float16": 1307.4, "tf32": 653.7, "float32": 163.4,
                                 "float64": 163.4},
                      hbm_tbps=5.1, l2_bytes=32 * 2**20, sm_count=304, memory_bytes=256 * 10**9, sm_clock_ghz=2.1),
    # MI355X: 2516.6 TFLOP/s bf16 dense, 8 TB/s HBM3e, 288 GB, 256 CUs, 2.4 GHz; fp32 157.3 TFLOP/s (vector), fp64
    # matrix 78.6; no TF32 (CDNA4), so its "tf32" is the fp32 rate.
    "mi355x": GPUSpec("MI355X", {"bfloat16": 2516.6, "float16": 2516.6, "tf32": 157.3, "float32": 157.3,
                                 "float64": 78.6},
                      hbm_tbps=6.8, l2_bytes=32 * 2**20, sm_count=256, memory_bytes=288 * 10**9, sm_clock_ghz=2.4),
}


def hardware_of(spec: "GPUSpec") -> Hardware:
    """The package's description of a GPU the model lists (what its plans take)."""
    return Hardware(spec.name, spec.sm_count, spec.memory_bytes, spec.half_flops_per_byte,
                    spec.fp32_flops_per_byte, spec.tf32_flops_per_byte)


def spec_of(gpu) -> "GPUSpec":
    """The model's figures for a GPU the package describes by its hardware (``fusedloss.core.workload.GPU``, what
    ``registry.device_gpu`` gives): the entry of its name, with the device's own SM count and memory."""
    if isinstance(gpu, GPUSpec):
        return gpu
    key = gpu_key(gpu.name)
    spec = GPUS[key]
    return GPUSpec(spec.name, spec.tflops, spec.hbm_tbps, spec.l2_bytes, gpu.sm_count, gpu.memory_bytes,
                   spec.sm_clock_ghz)


# What one small kernel launch costs on the device when the host keeps ahead of it (the gap between
# back-to-back kernels, plus the kernel's own minimum): many launches of tiny kernels (the per-token loss
# math, the per-tile state merges) cost this, not their bytes. Assumed (a few microseconds is the usual
# back-to-back gap on Hopper); the backends count the launches themselves (tests trace them).
LAUNCH_US = 3.0

# Elementwise kernels: one warp-instruction per clock per scheduler, 4 schedulers per SM (the Ampere, Hopper
# and Blackwell SMs), of which a streaming loop sustains ISSUE_EFFICIENCY (assumed: dependency stalls at
# 4-8 resident blocks per SM; not measured yet). The special-function pipe (MUFU: exponentials, reciprocals)
# has 16 lanes per SM (4 per scheduler), a quarter of the issue rate in warp-instructions.
SCHEDULERS_PER_SM = 4
ISSUE_EFFICIENCY = 0.85
MUFU_LANES_PER_SM = 16

# cuBLAS's Hopper GEMMs (the cooperative and ping-pong sm90 kernels) write a tile's C, and for beta = 1 read
# it first, after the tile's main loop: that traffic is not hidden behind the math. Assumed fully exposed
# (1.0): an fp32-output logits product [8192 x 151936 x 4096] then runs at ~720 TFLOP/s and a beta = 1
# accumulation with K = 2304 at ~590, where the bf16 8192^3 product that gives the 790 has 2% of C traffic.
GEMM_EPILOGUE_EXPOSED = 1.0
# The product behind GPUSpec.tflops (8192^3, bf16 operands and output) paid its own C write inside that rate: a
# product whose C traffic is priced apart (Pass.epilogue_bytes) runs its main loop at the rate with that
# share taken out (~2.4% on an H200: 810 TFLOP/s), so the C traffic is not counted twice.
MEASURED_PRODUCT = (8192, 8192, 8192, 2)  # m, n, k, bytes per output element


def mainloop_factor(gpu: "GPUSpec", math: str) -> float:
    """GPUSpec.tflops[math] times this is the main-loop rate of a product whose epilogue is priced apart."""
    m, n, k, c = MEASURED_PRODUCT
    total = 2.0 * m * n * k / (gpu.tflops[math] * 1e12)
    epilogue = m * n * c / (gpu.hbm_tbps * 1e12) * GEMM_EPILOGUE_EXPOSED
    return total / (total - epilogue)

# Triton's fused logits-and-statistics kernels (no TMA, no warp specialisation, one CTA per SM, the tile's
# softmax epilogue not overlapped with the next tile's loads) reach a fraction of the bf16 rate that depends on
# the wgmma shape the tile compiles to (m64n128k16 for 128 x 128, m64n64k16 for 64 x 128, m64n32k16 for
# 64 x 64) through the shared-memory operand traffic per k16 step: first estimates, keyed by
# (BLOCK_M, BLOCK_V); 64 x 64 is the teacher's tile (two products per tile).
TRITON_TILE_EFFICIENCY = {(128, 128): 0.80, (64, 128): 0.70, (128, 64): 0.70, (64, 64): 0.58}


def triton_tile_efficiency(block_m: int, block_v: int) -> float:
    """The fraction of ``GPUSpec.tflops`` a Triton fused product with this tile reaches
    (``TRITON_TILE_EFFICIENCY``; other tiles by their area: >= 128 x 128, >= 64 x 128, else 64 x 64's)."""
    if (block_m, block_v) in TRITON_TILE_EFFICIENCY:
        return TRITON_TILE_EFFICIENCY[(block_m, block_v)]
    area = block_m * block_v
    return TRITON_TILE_EFFICIENCY[(128, 128) if area >= 128 * 128 else (64, 128) if area >= 64 * 128 else (64, 64)]


def issue_rate(gpu: "GPUSpec") -> float:
    """Warp-instructions per second an elementwise kernel sustains on the whole GPU."""
    return gpu.sm_count * SCHEDULERS_PER_SM * gpu.sm_clock_ghz * 1e9 * ISSUE_EFFICIENCY


def mufu_rate(gpu: "GPUSpec") -> float:
    """Warp-instructions per second of the special-function pipe (32 lanes per warp-instruction)."""
    return gpu.sm_count * MUFU_LANES_PER_SM / 32 * gpu.sm_clock_ghz * 1e9


def gemm_efficiency(m: int, n: int, k: int, gpu: GPUSpec) -> float:
    """The fraction of the dense peak (``GPUSpec.tflops``, itself what a large product reaches) that a
    cuBLAS product with an ``[m, n]`` output and inner dimension ``k`` reaches: output tiles of 128 x 256
    (tile quantisation), the last partial wave over the SMs (cuBLAS's split-K / stream-K kernels recover
    most of it: at least 85%, and 97% for long main loops, k >= 8192, where they split k), and the per-tile
    prologue and epilogue against a short main loop over k. A lead, not a measurement: the benchmark stores
    the measured time beside it."""
    if m <= 0 or n <= 0 or k <= 0:
        return 1.0
    tiles_m, tiles_n = math.ceil(m / 128), math.ceil(n / 256)
    quantisation = (m * n) / (tiles_m * 128 * tiles_n * 256)
    waves = tiles_m * tiles_n / gpu.sm_count
    wave = max(waves / math.ceil(waves), 0.97 if k >= 8192 else 0.85)
    main_loop = k / (k + 64)
    return quantisation * wave * main_loop

# ------------------------------------------------------------------------------------------------
# Workloads
# ------------------------------------------------------------------------------------------------

# ``Workload``, ``OPS`` and ``product_bound`` are the package's shape math (fusedloss/core/workload.py).


# ------------------------------------------------------------------------------------------------
# Plans
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pass:
    """One step of a plan. ``flops`` at ``math`` throughput ("bfloat16", "tf32", "float32", ... or
    "cuda_core" for elementwise work, counted at the fp32 rate), ``hbm_bytes`` read plus written.
    ``overlaps_previous``: runs concurrently with the previous pass (second stream), so the pair costs the
    longer of the two. ``efficiency``: the fraction of the peak the pass's arithmetic reaches (a skinny
    product: ``gemm_efficiency``; a Triton tile: ``triton_tile_efficiency``). ``fixed_us``: time that neither
    flops nor bytes explain (kernel launches of small kernels: ``launches * LAUNCH_US``), per execution.
    ``instructions`` / ``mufu``: warp-instructions an elementwise kernel issues (of them on the
    special-function pipe), from its compiled SASS (``issue_rate``, ``mufu_rate``). ``epilogue_bytes``: the
    part of ``hbm_bytes`` a product moves after its main loop (C written, and read for beta = 1), which costs
    ``GEMM_EPILOGUE_EXPOSED`` of its time at the bandwidth on top of the roofline."""

    name: str
    flops: float = 0.0
    hbm_bytes: float = 0.0
    math: str = "bfloat16"
    count: int = 1
    overlaps_previous: bool = False
    efficiency: float = 1.0
    fixed_us: float = 0.0
    instructions: float = 0.0
    mufu: float = 0.0
    epilogue_bytes: float = 0.0


@dataclass
class Plan:
    """How a backend executes one workload: its passes, the GEMM-sized products they add up to, and the
    parameters the backend chose (chunk rows, vocabulary tile, workspace bytes, accumulators ...)."""

    backend: str
    path: str  # "grad_in_forward" (3 products for a row-local loss) or "composable" (statistics op + recompute)
    products: float
    passes: list = field(default_factory=list)
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Estimate:
    flops: float
    hbm_bytes: float
    model_ms: float
    bound_ms: float
    ratio: float
    pass_ms: dict
    pass_detail: dict = field(default_factory=dict)


def _math_rate(p: Pass, gpu: GPUSpec) -> float:
    """FLOP/s the pass's arithmetic is assumed to reach (a product with its epilogue priced apart: the
    main-loop rate, ``mainloop_factor``)."""
    math = "float32" if p.math == "cuda_core" else p.math
    factor = mainloop_factor(gpu, math) if p.epilogue_bytes and p.flops else 1.0
    return gpu.tflops[math] * 1e12 * p.efficiency * factor


def pass_breakdown(p: Pass, gpu: GPUSpec) -> dict:
    """One execution of a pass: the time of each limit (ms) and which one bounds it, with the rates assumed."""
    bandwidth = gpu.hbm_tbps * 1e12
    limits = {
        "math": p.flops / _math_rate(p, gpu) * 1e3,
        "memory": max(0.0, p.hbm_bytes - p.epilogue_bytes) / bandwidth * 1e3,
        "issue": p.instructions / issue_rate(gpu) * 1e3,
        "mufu": p.mufu / mufu_rate(gpu) * 1e3,
    }
    bound_by = max(limits, key=limits.get)
    epilogue = p.epilogue_bytes / bandwidth * 1e3 * GEMM_EPILOGUE_EXPOSED
    ms = limits[bound_by] + epilogue + p.fixed_us * 1e-3
    if ms > 0 and p.fixed_us * 1e-3 > limits[bound_by] + epilogue:
        bound_by = "launches"
    return {"ms": ms, "bound_by": bound_by, "limits_ms": limits, "epilogue_ms": epilogue,
            "launch_ms": p.fixed_us * 1e-3}


def _pass_ms(p: Pass, gpu: GPUSpec) -> float:
    return p.count * pass_breakdown(p, gpu)["ms"]


def assumed_rates(p: Pass, gpu: GPUSpec) -> dict:
    """The rates a pass is priced at (for the JSON beside its time)."""
    rates = {"hbm_tbps": gpu.hbm_tbps}
    if p.flops:
        rates["math"] = p.math
        rates["tflops"] = round(_math_rate(p, gpu) / 1e12, 2)
        rates["efficiency"] = round(p.efficiency, 4)
    if p.instructions:
        rates["warp_instructions"] = p.instructions
        rates["issue_per_s"] = issue_rate(gpu)
        rates["mufu_instructions"] = p.mufu
    if p.epilogue_bytes:
        rates["epilogue_bytes"] = p.epilogue_bytes
        rates["epilogue_exposed"] = GEMM_EPILOGUE_EXPOSED
    if p.fixed_us:
        rates["launch_us"] = LAUNCH_US
        rates["launches"] = round(p.fixed_us / LAUNCH_US, 2)
    return rates


_SUMMED_RATES = ("epilogue_bytes", "launches", "warp_instructions", "mufu_instructions")
_WEIGHTED_RATES = ("tflops", "efficiency")


def _total_rates(p: Pass, gpu: GPUSpec) -> dict:
    """``assumed_rates`` with the summed figures (``_SUMMED_RATES``) over all ``p.count`` executions."""
    rates = assumed_rates(p, gpu)
    if p.count != 1:
        for key in _SUMMED_RATES:
            if key in rates:
                rates[key] = round(rates[key] * p.count, 2)
    return rates


def _merge_rates(entry: dict, rates: dict, flops: float) -> None:
    """Fold another pass of the same name into ``entry``: its totals summed, its rates weighted by flops. Either
    may lack a figure the other has (a pass without flops has no math rate: the full chunks' idle wave is empty
    where the last, shorter chunk's is not): a missing figure counts as absent, never as an error."""
    into = entry["rates"]
    for key, value in rates.items():
        if key in _SUMMED_RATES:
            into[key] = round(into.get(key, 0.0) + value, 2)
        elif key not in _WEIGHTED_RATES:
            into.setdefault(key, value)
    total = entry["_flops"] + flops
    if total and "tflops" in rates:
        for key in _WEIGHTED_RATES:
            into[key] = round((into.get(key, 0.0) * entry["_flops"] + rates[key] * flops) / total, 4)
    entry["_flops"] = total


def bound_ms(w: Workload, gpu: GPUSpec) -> float:
    gpu = spec_of(gpu)
    student, teacher = product_bound(w)
    math = w.dtype
    rate = gpu.tflops[math] * 1e12
    return (student * w.product_flops + teacher * w.teacher_product_flops) / rate * 1e3


def evaluate(plan: Plan, w: Workload, gpu: GPUSpec) -> Estimate:
    gpu = spec_of(gpu)
    total = 0.0
    prev = 0.0
    per_pass, detail = {}, {}
    for p in plan.passes:
        ms = _pass_ms(p, gpu)
        per_pass[p.name] = per_pass.get(p.name, 0.0) + ms
        if p.name in detail:  # the same pass at another shape (e.g. the last, shorter chunk): one entry
            entry = detail[p.name]
            entry["ms"] += ms
            entry["count"] += p.count
            _merge_rates(entry, _total_rates(p, gpu), p.flops * p.count)
        else:
            b = pass_breakdown(p, gpu)
            detail[p.name] = {"ms": ms, "count": p.count, "bound_by": b["bound_by"], "rates": _total_rates(p, gpu),
                              "_flops": p.flops * p.count}
        if p.overlaps_previous:
            total += max(0.0, ms - prev)
            prev = max(ms, prev)
        else:
            total += ms
            prev = ms
    for entry in detail.values():
        del entry["_flops"]
    b = bound_ms(w, gpu)
    return Estimate(flops=sum(p.flops * p.count for p in plan.passes),
                    hbm_bytes=sum(p.hbm_bytes * p.count for p in plan.passes),
                    model_ms=total, bound_ms=b, ratio=total / b if b else float("inf"), pass_ms=per_pass,
                    pass_detail=detail)
