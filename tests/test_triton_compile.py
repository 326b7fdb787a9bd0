"""The Triton kernels as a GPU would compile them, without a GPU: the launches the backend really makes.

A subprocess (without ``TRITON_INTERPRET``) installs a stub Triton driver for an H100/H200 target (sm_90) and
a ``jit_cache_hook`` that records every launch's specialisation (signature, constexprs, the alignment and
divisibility attributes Triton derives from the arguments, warps, stages) and skips it. The backend then runs
on ``meta`` tensors of real shapes, so what is recorded is exactly what a GPU run would compile:

* ``count``: problems at N in {1, 7, 300, 4096} (same dtype and D) must share one compiled variant per
  kernel (N, V, D and the grid sizes are not specialised; the tiles depend on dtype, D bucket and teacher);
* ``compile`` (``test_triton_backend.py::test_kernels_compile_for_sm90``): every recorded launch for
  bf16, fp16 and fp32 and every autotuning candidate is compiled for sm_90a; ptxas must report no spills,
  shared memory must fit the 227 KB of a Hopper block, and the products must run on wgmma.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_LIMIT = 227 * 1024


def run_harness(mode: str, timeout: int = 1500, extra_path: tuple = (), args: tuple = ()) -> dict:
    """Run this file as a script in a subprocess without the interpreter; returns its JSON report.
    ``extra_path``: folders put first on the path (another Triton version, tools/triton_versions.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join((*extra_path, ROOT, env.get("PYTHONPATH", "")))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, os.path.abspath(__file__), mode, *args], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_one_compiled_variant_across_sequence_lengths():
    report = run_harness("count")
    assert report["launches"] > 0
    for scenario, kernels in report["variants"].items():
        assert kernels, scenario
        for kernel, variants in kernels.items():
            assert variants == 1, f"{scenario}: {kernel} compiled {variants} variants across N in {report['ns']}"


# ----------------------------------------------------------------------------------------------------------
# The harness (runs in the subprocess)


def _install_stub_driver():
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    target = GPUTarget("cuda", 90, 32)

    class Stub:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return target

        def get_active_torch_device(self):
            return torch.device("meta")

    driver.set_active(Stub())
    launches = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        launches.append(dict(kernel=fn.jit_function.__name__ if hasattr(fn.jit_function, "__name__")
                             else fn.name, fn=fn.jit_function, key=str(key), signature=compile["signature"],
                             constants=compile["constants"], attrs=compile["configs"][0],
                             num_warps=compile["num_warps"], num_stages=compile["num_stages"]))
        return True  # skip the compile and the launch

    knobs.runtime.jit_cache_hook = hook
    return target, launches


def _problem(dtype, n, d, v, scenario):
    import torch

    from fusedloss.core.problem import LogitTransform, StatsProblem

    meta = dict(device="meta", dtype=dtype)
    h, w = torch.empty(n, d, **meta), torch.empty(v, d, **meta)
    targets = torch.empty(n, device="meta", dtype=torch.int64)
    if scenario == "teacher":
        return StatsProblem(hidden=h, weight=w, bias=None, targets=targets, transform=LogitTransform(),
                            teacher_hidden=torch.empty(n, d, **meta), teacher_weight=torch.empty(v, d, **meta),
                            teacher_bias=torch.empty(v, **meta), teacher_transform=LogitTransform(1.5),
                            want_entropy=True, want_kl_rev=True, want_kl_fwd=True, jsd_beta=0.5)
    if scenario == "distill":  # the lean student of a distillation (eager: the 128 x 128 forward reading ztm)
        return StatsProblem(hidden=h, weight=w, bias=None, targets=targets, transform=LogitTransform(),
                            teacher_hidden=torch.empty(n, d, **meta), teacher_weight=torch.empty(v, d, **meta),
                            teacher_bias=torch.empty(v, **meta), teacher_transform=LogitTransform(1.5, 1.0, 30.0),
                            want_kl_rev=True, want_kl_fwd=True, jsd_beta=0.5)
    if scenario == "columns":  # token_logprobs with K targets: named columns (core/columns.py) and the entropy
        return StatsProblem(hidden=h, weight=w, bias=None, targets=targets, transform=LogitTransform(),
                            columns=torch.empty(n, 5, device="meta", dtype=torch.int64), want_entropy=True)
    if scenario == "rich":  # every student-side feature at once: the most registers without a teacher
        return StatsProblem(hidden=h, weight=w, bias=torch.empty(v, **meta), targets=targets,
                            transform=LogitTransform(0.7, 1.0, 30.0), want_entropy=True, want_extras=True,
                            want_mean_logit=True)
    return StatsProblem(hidden=h, weight=w, bias=None, targets=targets, transform=LogitTransform())


def _run_paths(p, cfg, paths):
    import torch

    from fusedloss.core.problem import GradientNeeds
    from fusedloss.triton import backend

    needs = GradientNeeds(True, True, p.bias is not None)
    if "composable" in paths:
        stats = backend.forward_statistics(p, tiles=cfg)
        coeffs = torch.empty(7, p.hidden.shape[0], device="meta", dtype=p.acc_dtype)
        named = {}
        if p.columns is not None:  # (statistics, the named columns' logits); their given dz back
            stats = stats[0]
            named = dict(column_dz=torch.empty(p.columns.shape, device="meta", dtype=p.acc_dtype))
        backend.backward_gradients(p, stats, coeffs, needs, tiles=cfg, **named)
    if "eager" in paths:  # the eager path has its own tiles (tiles_for(p, "eager"))
        def chunk_fn(stats, rows):
            m = rows.stop - rows.start
            return stats.lse.sum(), torch.empty(7, m, device="meta", dtype=p.acc_dtype)

        backend.eager_gradients(p, chunk_fn, needs)


def _count():
    import torch

    from fusedloss.triton import backend

    _, launches = _install_stub_driver()
    ns = (1, 7, 300, 4096)
    variants = {}
    for scenario, paths in (("cross_entropy", ("composable", "eager")), ("rich", ("composable",)),
                            ("teacher", ("composable", "eager")), ("distill", ("eager",)),
                            ("columns", ("composable",))):
        for path in paths:
            start = len(launches)
            for n in ns:
                p = _problem(torch.bfloat16, n, 4096, 151936, scenario)
                _run_paths(p, backend.tiles_for(p), (path,))
            keys = {}
            for rec in launches[start:]:
                keys.setdefault(rec["kernel"], set()).add(rec["key"])
            variants[f"{scenario}/{path}"] = {k: len(v) for k, v in keys.items()}
    return dict(ns=ns, launches=len(launches), variants=variants)


def _ptxas_report(ptx: str) -> dict:
    import re
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        try:
            ptxas = get_ptxas(90)  # Triton >= 3.5 picks the ptxas per architecture
        except TypeError:
            ptxas = get_ptxas()
        out = subprocess.run([ptxas.path, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    return dict(spill_stores=int(spill.group(1)) if spill else -1, spill_loads=int(spill.group(2)) if spill else -1,
                registers=int(regs.group(1)) if regs else -1, stack=int(stack.group(1)) if stack else -1,
                ok=out.returncode == 0, log=text[-600:])


_JOBS: list = []


def _launched_tiles(rec) -> str:
    """The tile configuration a recorded launch ran with (its ``Tiles`` constexpr, warps and stages): the
    eager path's kernels run with tiles of their own, not the candidate the composable path was given."""
    from fusedloss.triton.backend import TileConfig

    tiles = next(v for v in rec["constants"].values() if type(v).__name__ == "Tiles")
    return repr(TileConfig(int(tiles.BLOCK_M), int(tiles.BLOCK_V), int(tiles.BLOCK_K), rec["num_warps"],
                           rec["num_stages"]))


def _compile_one(i: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rec = _JOBS[i]
    kernel = triton.compile(ASTSource(rec["fn"], rec["signature"], rec["constants"], rec["attrs"]),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=rec["num_warps"], num_stages=rec["num_stages"]))
    ptx = kernel.asm["ptx"]
    flags = next((v for v in rec["constants"].values() if type(v).__name__ == "Flags"), None)
    return dict(kernel=rec["kernel"], dtype=rec["dtype"], config=rec["config"],
                flags=None if flags is None else [k for k, v in flags._asdict().items() if v],
                shared=kernel.metadata.shared, wgmma="wgmma.mma_async" in ptx,
                vector_loads=("cp.async" in ptx) or ("ld.global.v4" in ptx) or ("ld.global.v2" in ptx),
                barrier=("bar.sync" in ptx) or ("barrier.sync" in ptx),
                **_ptxas_report(ptx))


def _compile(dtypes=("bfloat16", "float16", "float32")):
    import multiprocessing

    import torch

    from fusedloss.triton import backend

    _, launches = _install_stub_driver()
    seen = set()
    for dtype in (getattr(torch, name) for name in dtypes):
        for kind, scenario in (("lean", "cross_entropy"), ("heavy", "rich"), ("teacher", "teacher"),
                               ("teacher", "distill"), ("heavy", "columns")):
            for i, cfg in enumerate(backend.candidates(dtype, kind)):
                start = len(launches)
                # the lean distillation's composable launches are the teacher scenario's, with fewer flags; the
                # named columns take the composable path only
                paths = ("eager",) if scenario == "distill" else ("composable",) if scenario == "columns" else (
                    "composable", "eager")
                if scenario in ("distill", "columns") and i > 0:
                    continue
                _run_paths(_problem(dtype, 300, 4096, 151936, scenario), cfg, paths)
                if kind == "lean" and i == 0:  # a hidden size that is not a multiple of 16 keeps the fast path
                    _run_paths(_problem(dtype, 300, 1000, 151936, scenario), cfg, ("composable",))
                for rec in launches[start:]:
                    if (rec["kernel"], rec["key"]) not in seen:
                        seen.add((rec["kernel"], rec["key"]))
                        _JOBS.append(dict(rec, dtype=str(dtype).replace("torch.", ""), config=_launched_tiles(rec)))
    # Compiles are independent: two processes (forked, so they share the recorded launches).
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_compile_one, range(len(_JOBS)))
    import triton

    return dict(triton=triton.__version__, compiled=len(results), results=results)


if __name__ == "__main__":
    mode, dtypes = sys.argv[1], sys.argv[2:]  # compile [dtype ...]: a subset of bfloat16 float16 float32
    print(json.dumps(_count() if mode == "count" else _compile(*([dtypes] if dtypes else []))))
