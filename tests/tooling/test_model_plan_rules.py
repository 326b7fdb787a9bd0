"""The package's plan rules (fusedloss/backends/rules.py) against the performance model (benchmarks/model/).

The backends choose their path (grad-in-forward or composable) and the CUDA backend its d weight layout (per chunk,
grouped, deferred) by named rules over shapes, with no rates (docs/design.md, "Plans and the performance model").
Here, over a grid of shapes (rows from 1 to 262144 with primes, real vocabularies and primes, hidden sizes), the
three dtypes, every GPU the model lists and workspaces from 1 GiB to 16 GiB and the free-memory default, the plan
the rules choose is priced against every plan the backend could run (``candidates``), and the gap to the cheapest
is measured: ``GRID_GAPS`` records how often and how far the rules miss it.
"""

from __future__ import annotations

import random

import pytest

from benchmarks.model import cost, cuda, triton
from fusedloss.backends import gpu as gpu_glue
from fusedloss.backends.cuda import plan as cuda_plan
from fusedloss.backends.triton import plan as triton_plan
from fusedloss.core import workload

OPS = ("cross_entropy", "grpo", "distill_reverse_kl", "distill_forward_kl", "distill_jsd")
ROWS = (1, 7, 100, 128, 500, 1000, 2048, 3001, 4096, 4099, 8192, 12007, 16384, 32768, 65536, 131071, 262144)
# Llama 2 / Mistral v0.1, a prime, GPT-2, Mistral v0.3, a prime, Llama 3, Qwen 2.5 (tokenizer, padded), Gemma 2, 3
VOCABS = (32000, 32003, 50257, 32768, 65521, 128256, 151936, 152064, 256000, 262144)
WIDTHS = (896, 2048, 3584, 4096, 5120, 8192)
DTYPES = ("bfloat16", "float16", "float32")
WORKSPACES = (None, 1024, 2048, 4096, 16384)  # MiB; None: the policy's default from half the GPU's memory free
GRADS = ((True, True), (True, False), (False, True))
POINTS = 4000  # per backend, sampled from the full product (3,213,000 combinations)

# What the grid shows today, per backend: (share of points whose rule's plan is more than 2% above the cheapest
# at most, the worst gap at most).
GRID_GAPS = {"cuda": (0.0035, 1.11), "triton": (0.02, 1.27)}


def _grid(seed: int):
    rng = random.Random(seed)
    axes = (OPS, ROWS, VOCABS, WIDTHS, DTYPES, tuple(cost.GPUS), WORKSPACES, GRADS)
    for _ in range(POINTS):
        yield tuple(rng.choice(axis) for axis in axes)


def _gaps(backend: str) -> list:
    gaps = []
    for op, n, v, d, dtype, name, workspace_mb, (hidden, weight) in _grid(seed=7 if backend == "cuda" else 8):
        w = cost.Workload(op=op, n=n, d=d, v=v, dtype=dtype, hidden_grad=hidden, weight_grad=weight)
        spec = cost.GPUS[name]
        free = spec.memory_bytes // 2
        if backend == "cuda":
            budget = gpu_glue.workspace_bytes(workspace_mb, free, cuda_plan.WORKSPACE_MIN_BYTES)
            chosen, plans = cuda.plan(w, spec, workspace=budget), cuda.candidates(w, spec, budget)
        else:
            budget = triton_plan.workspace_budget(workspace_mb, free, spec)
            chosen, plans = triton.plan(w, spec, workspace=budget), triton.candidates(w, spec, budget)
        best = min(cost.evaluate(p, w, spec).model_ms for _, p in plans)
        gaps.append((cost.evaluate(chosen, w, spec).model_ms / best, (op, n, v, d, dtype, name, workspace_mb)))
    return gaps


@pytest.mark.parametrize("planner", ["cuda", "triton"])
def test_the_rules_take_the_cheapest_plan_or_one_close_to_it(planner):
    gaps = _gaps(planner)
    share, worst = GRID_GAPS[planner]
    above = [g for g in gaps if g[0] > 1.02]
    top = max(gaps)
    assert len(gaps) == POINTS
    assert min(g for g, _ in gaps) >= 1.0 - 1e-9  # the cheapest is among the candidates
    print(f"{planner}: {len(gaps)} points, {len(above)} more than 2% above the cheapest, worst {top}")
    assert len(above) <= share * POINTS, (len(above), sorted(above, reverse=True)[:10])
    assert top[0] <= worst, top


def test_the_package_gpus_are_the_models():
    """The hardware the plans know a GPU by (fusedloss/core/workload.py) is the model's: same names, SMs, memory,
    and the balances its rates give."""
    assert set(workload.GPUS) == set(cost.GPUS)
    for key, spec in cost.GPUS.items():
        hw = workload.GPUS[key]
        assert (hw.name, hw.sm_count, hw.memory_bytes) == (spec.name, spec.sm_count, spec.memory_bytes), key
        assert hw.half_flops_per_byte == pytest.approx(spec.half_flops_per_byte), key
        assert hw.fp32_flops_per_byte == pytest.approx(spec.fp32_flops_per_byte), key
        assert hw.tf32_flops_per_byte == pytest.approx(spec.tf32_flops_per_byte), key
        assert cost.hardware_of(spec) == hw, key


def test_every_gpu_entry_has_the_rates_the_model_reads():
    for key, spec in cost.GPUS.items():
        assert set(spec.tflops) == {"bfloat16", "float16", "tf32", "float32", "float64"}, key
        assert spec.tflops["bfloat16"] > spec.tflops["float32"] > 0 and spec.hbm_tbps > 0, key
        assert spec.sm_count > 0 and spec.memory_bytes > 2**30 and spec.l2_bytes > 0, key
        assert cost.gpu_key(spec.name) == key  # its own name finds it
