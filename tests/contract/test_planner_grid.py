"""Every shape a user can pass gets a plan: the Triton and CUDA planners over a dense grid.

The backends take their run-time choices (grad-in-forward or composable path, chunk rows, grouped or deferred d weight)
from their plans (docs/design.md, "Plans and the performance model"), so a planner that raises fails the loss that
asked. The grid: every op of the cost model, rows from 1 to ~70k (every row up to 129, every row of
7168..7296, primes, powers of two and their neighbours), the vocabularies of Llama 3, Qwen 2.5/3, Gemma 2/3 and
Mistral and small primes, widths 896..8192, bf16, fp16 and fp32, and every GPU of the model, sampled so that
each value of each axis meets many of the others (a full product is ~5 million plans). The performance model
prices the same samples in tests/tooling/test_model_planner_grid.py.
"""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
from pathlib import Path

from fusedloss.backends import gpu as gpu_glue
from fusedloss.backends.cuda import plan as cuda
from fusedloss.backends.triton import plan as triton
from fusedloss.core import workload as cost

OPS = tuple(cost.OPS)
GPUS = tuple(cost.GPUS)
DTYPES = ("bfloat16", "float16", "float32")
# Llama 3, Qwen 2.5 / Qwen 3 (tokenizer and padded head), Gemma 2 / Gemma 3, Mistral v0.3 / Nemo; small primes
VOCABS = (128256, 151936, 152064, 256000, 262144, 32768, 131072, 2, 97, 1009, 32003, 65521)
WIDTHS = (896, 1536, 2048, 3584, 4096, 5120, 7168, 8192)
# None: sized from the device's free memory, as at run time; else workspace_mb
WORKSPACES = (None, None, None, 16, 600, 16384)


def _primes_near(points):
    def prime(k):
        return k > 1 and all(k % p for p in range(2, math.isqrt(k) + 1))

    return {next(k for k in itertools.count(x) if prime(k)) for x in points}


ROWS = sorted(set(range(1, 130)) | set(range(7168, 7168 + 129))
              | {m + e for k in range(17) for m in (2**k,) for e in (-1, 0, 1) if m + e >= 1}
              | _primes_near(range(0, 70001, 500)) | set(range(4096, 70001, 4096)) | {18000, 69997})


def _samples(per_row: int, seed: int):
    """``per_row`` (op, V, D, dtype, GPU, workspace) for each row count: a shuffled walk through the full product
    of the other axes, so that consecutive rows meet different combinations."""
    combos = list(itertools.product(OPS, VOCABS, WIDTHS, DTYPES, GPUS))
    random.Random(seed).shuffle(combos)
    walk = itertools.cycle(combos)
    workspaces = itertools.cycle(WORKSPACES)
    for n in ROWS:
        for _ in range(per_row):
            yield (n, *next(walk), next(workspaces))


def test_triton_plans_every_shape():
    """The Triton planner chooses a path for every sampled shape; grad-in-forward only for a row-local loss."""
    for n, op, v, d, dtype, name, workspace_mb in _samples(24, seed=1):
        w, gpu = cost.Workload(op=op, n=n, d=d, v=v, dtype=dtype), cost.GPUS[name]
        plan = triton.plan(w, gpu, gpu.memory_bytes - (2 << 30), workspace_mb=workspace_mb)
        where = (n, op, v, d, dtype, name, workspace_mb)
        assert plan.path in ("grad_in_forward", "composable"), where
        if plan.path == "grad_in_forward":
            assert w.row_local and plan.params["grad_in_forward_rows"] >= 1, where


def test_cuda_plans_every_shape():
    """The CUDA planner chooses a path for every sampled shape, and the chunks the run-time code cuts cover the rows,
    within the workspace, in the groups the plan reports."""
    for n, op, v, d, dtype, name, workspace_mb in _samples(24, seed=2):
        w, gpu = cost.Workload(op=op, n=n, d=d, v=v, dtype=dtype), cost.GPUS[name]
        workspace = None if workspace_mb is None else workspace_mb << 20
        plan = cuda.plan(w, gpu, gpu.memory_bytes - (2 << 30), workspace=workspace)
        where = (n, op, v, d, dtype, name, workspace_mb)
        assert plan.path in ("grad_in_forward", "composable"), where
        if plan.path == "grad_in_forward":
            assert w.row_local and plan.params["grad_in_forward_rows"] >= 1, where
            shape = cuda._grad_in_forward_shape(w, plan.params["workspace_bytes"], {}, gpu, True)
            assert (shape.rows == plan.params["grad_in_forward_rows"]
                    and shape.row_chunks == plan.params["chunks"]), where
            layout = cuda._grad_in_forward_layout(n, shape)
            assert layout[0][0] == 0 and layout[-1][1] == n and len(layout) == plan.params["groups"], where


def test_the_package_plans_without_the_model():
    """The backends' plans are rules over shapes: with ``benchmarks`` made unimportable, both planners still choose
    (and ``fusedloss.estimate`` leaves its modelled column out, saying how to get it)."""
    code = """
import sys
sys.modules["benchmarks"] = None  # import benchmarks -> ImportError
import fusedloss
from fusedloss.backends.cuda import plan as cuda
from fusedloss.backends.triton import plan as triton
from fusedloss.backends.triton import plan as triton
from fusedloss.core import workload
w = workload.Workload(op="cross_entropy", n=18000, d=3584, v=152064)
gpu = workload.GPUS["h200"]
print(cuda.plan(w, gpu, 139 << 30).path, triton.plan(w, gpu, 139 << 30).path)
est = fusedloss.estimate(tokens=18000, hidden_size=3584, vocab_size=152064)
assert est.modelled_ms is None and "pip install -e ." in str(est), str(est)
assert not any(name == "benchmarks" or name.startswith("benchmarks.") for name in sys.modules
               if sys.modules[name] is not None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["grad_in_forward", "grad_in_forward"]


# ------------------------------------------------------------------------------------------------
# The CUDA plan's cost and cache do not grow with N
# ------------------------------------------------------------------------------------------------
def test_the_layout_counts_are_the_layout():
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 50000)
        rows = rng.randint(1, 9000)
        group = rng.choice([0, rows, rng.randint(rows, 3 * rows + 1000)])
        shape = cuda._Shape(rows, 0, 7, 1, 64, False, group)
        layout = cuda._grad_in_forward_layout(n, shape)
        sizes = cuda._layout_sizes(n, shape)
        chunks = [r1 - r0 for _, _, cs in layout for r0, r1 in cs]
        assert sizes.chunk_rows == {m: chunks.count(m) for m in sorted(set(chunks))}
        assert sizes.group_rows == {m: [g1 - g0 for g0, g1, _ in layout].count(m)
                                    for m in sorted({g1 - g0 for g0, g1, _ in layout})}
        assert (sizes.chunks, sizes.groups) == (len(chunks), len(layout))
        assert sizes.multi_chunk_groups == sum(len(cs) > 1 for _, _, cs in layout)
        assert sizes.first_group == layout[0][1] - layout[0][0]
        assert cuda._chunk_count(n, group or rows, rows) == len(chunks)


def test_group_candidates_visit_the_sizes_one_at_a_time_would():
    """``_group_candidates`` jumps from one group size to the next; counting the groups up one at a time (the
    plain rule: every size that fits, sizes 1/64 apart above 64 x 128 rows) visits the same sizes."""
    rng = random.Random(1)
    for _ in range(400):
        v = rng.choice([97, 1009, 32768, 151936, 262144])
        w = cost.Workload(op=rng.choice(["cross_entropy", "distill_jsd"]), n=rng.randint(1, 3_000_000), d=4096, v=v)
        budget = rng.choice([64 << 20, 1 << 30, 4 << 30, 64 << 30])
        base = cuda._with_packing(w, budget, {}, cuda._grad_in_forward_shape_as, True)
        live = 4 + (4 if w.has_teacher else 0)
        largest = (budget // base.ld - live) // 2
        want, bar = [], None
        for groups in range(1, min(base.row_chunks, 20000)):
            size = min(w.n, math.ceil(math.ceil(w.n / groups) / 128) * 128)
            if bar is None or size <= bar:
                if size <= largest:
                    want.append((groups, size))
                gap = size // 64 if size > 64 * 128 else 1
                bar = min(largest, size - gap) // 128 * 128
        if base.row_chunks >= 20000:
            continue
        got = [(g, s.group_rows) for g, s in cuda._group_candidates(w, budget, {}, base)]
        assert got == want, (w, budget)


def test_decision_rows_round_n_up_by_at_most_a_32nd():
    previous = 0
    for n in range(1, 20000):
        rows = cuda.decision_rows(n)
        assert rows >= previous and rows % 128 == 0 and n <= rows < n + max(128, n / 32)
        previous = rows
    for n in (2**k + e for k in range(14, 40) for e in (-1, 0, 1)):
        rows = cuda.decision_rows(n)
        assert rows % 128 == 0 and n <= rows < n + n / 32
    assert [cuda.decision_rows(n) for n in (1, 4096, 4097, 16384, 16385)] == [128, 4096, 4224, 16384, 16896]


def test_the_plan_cache_hits_under_varying_sequence_lengths():
    """The run-time choices (the path, the grad-in-forward shape's kind) are cached per step of ``decision_rows``, not
    per N: 2000 calls of random lengths up to 65536 price the plans ~200 times, the rest are lookups; the
    chunks are cut for each N itself, as ``plan`` reports them."""
    cuda._path_choice.cache_clear()
    cuda._grad_in_forward_kind.cache_clear()
    gpu, budget, rng = cost.GPUS["h200"], gpu_glue.WORKSPACE_MAX_BYTES, random.Random(2)
    try:
        for i in range(2000):
            w = cost.Workload(op="cross_entropy", n=rng.randint(1, 65536), d=4096, v=152064)
            path = cuda._choose_path(w, gpu, budget, True).path
            shape = cuda._grad_in_forward_shape(w, budget, {}, gpu, True) if path == "grad_in_forward" else None
            if i % 100 == 0:
                plan = cuda.plan(w, gpu, workspace=budget)
                assert plan.path == path
                if shape is not None:
                    assert (plan.params["grad_in_forward_rows"], plan.params["chunks"]) == (shape.rows,
                                                                                            shape.row_chunks)
        info = cuda._path_choice.cache_info()
        assert info.hits + info.misses == 2000 + 20
        assert info.misses <= 200 and info.hits >= 1800, info
    finally:
        cuda._path_choice.cache_clear()
        cuda._grad_in_forward_kind.cache_clear()
