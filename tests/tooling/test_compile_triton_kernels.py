"""The Triton kernels as a GPU would compile them, without a GPU: the launches the backend really makes.

A subprocess (without ``TRITON_INTERPRET``) installs a stub Triton driver for a GPU target (``--arch``: sm_90a,
the H100/H200, unless another is named; sm_100a, sm_120, gfx942, gfx950, any ``sm_<cc>`` or ``gfx<name>``) and
a ``jit_cache_hook`` that records every launch's specialisation (signature, constexprs, the alignment and
divisibility attributes Triton derives from the arguments, warps, stages) and skips it. The backend then runs
on ``meta`` tensors of real shapes, so what is recorded is exactly what a GPU run would compile:

* ``count``: problems at N in {1, 7, 300, 4096} (same dtype and D) must share one compiled variant per
  kernel (N, V, D and the grid sizes are not specialised; the tiles depend on dtype, D bucket and teacher);
* ``compile`` (``test_kernels_compile_for_sm90`` below): every recorded launch for
  bf16, fp16 and fp32 and every autotuning candidate is compiled for sm_90a; ptxas must report no spills,
  shared memory must fit the 227 KB of a Hopper block, and the products must run on wgmma.
  ``compile --arch TARGET`` compiles the same launches as the backend makes them on that target (its tiles and
  fp32 precision) and marks ``"default": true`` on the variants the planner picks by default there;
  ``--defaults`` compiles only those. NVIDIA targets are checked with the ptxas of the Triton wheel, AMD
  targets parse the AMDGCN assembly (VGPR/SGPR spills, scratch, LDS) that the wheel itself produces: no GPU,
  no CUDA toolkit, no ROCm (``test_default_tiles_compile_per_architecture``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_LIMIT = 227 * 1024
_spec = importlib.util.spec_from_file_location(
    "triton_versions", Path(__file__).resolve().parents[2] / "tools" / "triton_versions.py")
triton_versions = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(triton_versions)
ARCHS = ("sm_90a", "sm_100a", "sm_120", "gfx942", "gfx950")


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


# The instructions the products of each target must compile to (a legacy or scalar fallback would be slow).
MMA = {"sm_100a": "tcgen05.mma", "sm_120": "mma.sync", "gfx942": "v_mfma", "gfx950": "v_mfma"}


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "sm_90a"])
def test_default_tiles_compile_per_architecture(arch):
    """The variants the planner runs by default on B200/GB200 (sm_100a), RTX 50 / RTX PRO 6000 (sm_120),
    MI300X/MI325X (gfx942) and MI355X (gfx950), for bf16, fp16 and fp32, compiled with this environment's
    Triton: no spills (ptxas; on AMD no VGPR spill and no scratch), shared memory (LDS) within the target's
    block limit, the products on the target's matrix instructions. sm_90a compiles every variant, not only
    the defaults, in test_kernels_compile_for_sm90 below."""
    report = run_harness("compile", args=("--arch", arch, "--defaults"))
    results = report["results"]
    assert report["arch"] == arch and all(r["default"] for r in results)
    assert {r["dtype"] for r in results} == {"bfloat16", "float16", "float32"}
    assert {r["kernel"] for r in results} == {"statistics_forward_kernel", "jsd_forward_kernel",
                                              "logits_gradient_kernel", "packed_gradient_kernel",
                                              "teacher_fold_kernel"}
    for r in results:
        what = f"{arch} {r['dtype']} {r['kernel']} {r['config']} {r['flags']}: {r['log']}"
        assert r["ok"], what
        assert max(r["spill_stores"], r["spill_loads"], r["stack"]) == 0, what
        assert r.get("vgpr_spills", 0) == 0, what
        assert 0 <= r["shared"] <= report["shared_limit"], what
        assert r["registers"] > 0, what
        if "LOAD_LOGITS" not in (r["flags"] or []):
            assert r["mma"] == MMA[arch], what


# ----------------------------------------------------------------------------------------------------------
# The harness (runs in the subprocess)


def _gpu_target(arch: str):
    """Triton's target for "sm_100a", "sm_120", "gfx942", ... (an "a" suffix is Triton's own for sm_90 on)."""
    from triton.backends.compiler import GPUTarget

    if arch.startswith("gfx"):
        return GPUTarget("hip", arch, 64)
    return GPUTarget("cuda", int(arch[3:].rstrip("af")), 32)


def _backend_target(arch: str) -> str:
    """The backend's name of the target (``device_target``): "sm_100", "gfx942"."""
    return arch if arch.startswith("gfx") else arch.rstrip("af")


def _install_stub_driver(arch: str = "sm_90a"):
    import torch
    from triton import knobs
    from triton.runtime import driver

    from fusedloss.backends.triton import backend

    target = _gpu_target(arch)
    # meta tensors launch as the backend would on the target: its tiles and its fp32 precision
    backend.device_target = lambda device: _backend_target(arch)

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
    if scenario == "distill":  # the lean student of a distillation (grad-in-forward: the 128 x 128 forward reading ztm)
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

    from fusedloss.backends.triton import backend
    from fusedloss.core.problem import GradientNeeds

    needs = GradientNeeds(True, True, p.bias is not None)
    if "composable" in paths:
        stats = backend.forward_statistics(p, tiles=cfg)
        coeffs = torch.empty(7, p.hidden.shape[0], device="meta", dtype=p.acc_dtype)
        named = {}
        if p.columns is not None:  # (statistics, the named columns' logits); their given dz back
            stats = stats[0]
            named = dict(column_dz=torch.empty(p.columns.shape, device="meta", dtype=p.acc_dtype))
        backend.backward_gradients(p, stats, coeffs, needs, tiles=cfg, **named)
    if "grad_in_forward" in paths:  # the grad-in-forward path has its own tiles (tiles_for(p, "grad_in_forward"))
        def chunk_fn(stats, rows):
            m = rows.stop - rows.start
            return stats.lse.sum(), torch.empty(7, m, device="meta", dtype=p.acc_dtype)

        backend.grad_in_forward_gradients(p, chunk_fn, needs)


def _count():
    import torch

    from fusedloss.backends.triton import backend

    _, launches = _install_stub_driver()
    ns = (1, 7, 300, 4096)
    variants = {}
    for scenario, paths in (("cross_entropy", ("composable", "grad_in_forward")), ("rich", ("composable",)),
                            ("teacher", ("composable", "grad_in_forward")), ("distill", ("grad_in_forward",)),
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


def _ptxas_report(ptx: str, capability: int = 90) -> dict:
    import re
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    gpu_name = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M).group(1)  # Triton's own: sm_90a, sm_100a, sm_120a
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        try:
            ptxas = get_ptxas(capability)  # Triton >= 3.5 picks the ptxas per architecture
        except TypeError:
            ptxas = get_ptxas()
        out = subprocess.run([ptxas.path, "-v", "--gpu-name", gpu_name, src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    return dict(spill_stores=int(spill.group(1)) if spill else -1, spill_loads=int(spill.group(2)) if spill else -1,
                registers=int(regs.group(1)) if regs else -1, stack=int(stack.group(1)) if stack else -1,
                ok=out.returncode == 0, log=text[-600:])


def _amdgcn_report(asm: str) -> dict:
    """ptxas's figures from the AMDGCN assembly: VGPRs (with AGPRs), spill stores as scratch bytes (VGPR spills
    go to scratch memory; SGPR spills to VGPR lanes, counted apart), the stack as the scratch size."""
    import re

    def most(pattern):
        values = [int(x) for x in re.findall(pattern, asm)]
        return max(values) if values else -1

    scratch = most(r"; ScratchSize: (\d+)")
    vgpr_spill = most(r"\.vgpr_spill_count:\s+(\d+)")
    return dict(spill_stores=scratch if vgpr_spill > 0 else 0, spill_loads=scratch if vgpr_spill > 0 else 0,
                registers=most(r"\.vgpr_count:\s+(\d+)"), agprs=most(r"; NumAgprs: (\d+)"), vgpr_spills=vgpr_spill,
                sgpr_spills=most(r"\.sgpr_spill_count:\s+(\d+)"), stack=scratch,
                occupancy=most(r"; Occupancy: (\d+)"), ok=True, log="")


_JOBS: list = []


def _launched_tiles(rec) -> str:
    """The tile configuration a recorded launch ran with (its ``Tiles`` constexpr, warps and stages): the
    grad-in-forward path's kernels run with tiles of their own, not the candidate the composable path was given."""
    from fusedloss.backends.triton.backend import TileConfig

    tiles = next(v for v in rec["constants"].values() if type(v).__name__ == "Tiles")
    return repr(TileConfig(int(tiles.BLOCK_M), int(tiles.BLOCK_V), int(tiles.BLOCK_K), rec["num_warps"],
                           rec["num_stages"]))


def _compile_one(i: int) -> dict:
    import triton
    from triton.compiler import ASTSource

    rec = _JOBS[i]
    target = _gpu_target(rec["arch"])
    flags = next((v for v in rec["constants"].values() if type(v).__name__ == "Flags"), None)
    head = dict(kernel=rec["kernel"], dtype=rec["dtype"], config=rec["config"], default=rec["default"],
                flags=None if flags is None else [k for k, v in flags._asdict().items() if v])
    try:
        kernel = triton.compile(ASTSource(rec["fn"], rec["signature"], rec["constants"], rec["attrs"]),
                                target=target, options=dict(num_warps=rec["num_warps"], num_stages=rec["num_stages"]))
    except Exception as e:  # reported, not raised: one variant's failure must not hide the others'
        return dict(head, ok=False, log=f"{type(e).__name__}: {e}"[-600:], shared=-1, mma=None, wgmma=False,
                    vector_loads=False, barrier=False, spill_stores=-1, spill_loads=-1, registers=-1, stack=-1)
    if target.backend == "hip":
        asm = kernel.asm["amdgcn"]
        mma = next((m for m in ("v_mfma", "v_smfmac") if m in asm), None)
        return dict(head, shared=kernel.metadata.shared, mma=mma, wgmma=False,
                    vector_loads=("buffer_load_dwordx4" in asm) or ("global_load_dwordx4" in asm)
                    or ("buffer_load_dwordx2" in asm) or ("global_load_dwordx2" in asm),
                    barrier="s_barrier" in asm, **_amdgcn_report(asm))
    ptx = kernel.asm["ptx"]
    mma = next((m for m in ("tcgen05.mma", "wgmma.mma_async", "mma.sync") if m in ptx), None)
    return dict(head, shared=kernel.metadata.shared, mma=mma, wgmma="wgmma.mma_async" in ptx,
                vector_loads=("cp.async" in ptx) or ("ld.global.v4" in ptx) or ("ld.global.v2" in ptx)
                or ("cp.async.bulk" in ptx),
                barrier=("bar.sync" in ptx) or ("barrier.sync" in ptx),
                **_ptxas_report(ptx, target.arch))


def _compile(dtypes=("bfloat16", "float16", "float32"), arch: str = "sm_90a", defaults_only: bool = False):
    """Every launch variant for ``arch`` (``defaults_only``: the ones the planner picks by default there)."""
    import multiprocessing

    import torch

    from fusedloss.backends.triton import backend, plan

    _, launches = _install_stub_driver(arch)
    seen = set()
    for dtype in (getattr(torch, name) for name in dtypes):
        for kind, scenario in (("lean", "cross_entropy"), ("heavy", "rich"), ("teacher", "teacher"),
                               ("teacher", "distill"), ("heavy", "columns")):
            for i, cfg in enumerate(backend.candidates(dtype, kind, target=_backend_target(arch))):
                if defaults_only and i > 0:
                    continue
                start = len(launches)
                # the lean distillation's composable launches are the teacher scenario's, with fewer flags; the
                # named columns take the composable path only
                paths = (("grad_in_forward",) if scenario == "distill" else ("composable",) if scenario == "columns"
                         else ("composable", "grad_in_forward"))
                if scenario in ("distill", "columns") and i > 0:
                    continue
                _run_paths(_problem(dtype, 300, 4096, 151936, scenario), cfg, paths)
                if kind == "lean" and i == 0:  # a hidden size that is not a multiple of 16 keeps the fast path
                    _run_paths(_problem(dtype, 300, 1000, 151936, scenario), cfg, ("composable",))
                for rec in launches[start:]:
                    if (rec["kernel"], rec["key"]) not in seen:
                        seen.add((rec["kernel"], rec["key"]))
                        # the first candidate and the grad-in-forward tiles are what the planner runs without tuning
                        _JOBS.append(dict(rec, dtype=str(dtype).replace("torch.", ""), config=_launched_tiles(rec),
                                          arch=arch, default=i == 0))
    # Compiles are independent: two processes (forked, so they share the recorded launches).
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_compile_one, range(len(_JOBS)))
    import triton

    return dict(triton=triton.__version__, arch=arch, shared_limit=plan.SHARED_LIMITS[
        backend.tile_family(_backend_target(arch))], compiled=len(results), results=results)


def _main(argv: list) -> dict:
    """``count`` | ``compile [--arch TARGET] [--defaults] [dtype ...]`` (dtypes: a subset of bfloat16 float16
    float32)."""
    import argparse

    parser = argparse.ArgumentParser(prog="test_compile_triton_kernels.py")
    parser.add_argument("mode", choices=("count", "compile"))
    parser.add_argument("--arch", default="sm_90a", help="sm_90a (default), sm_100a, sm_120, gfx942, gfx950, ...")
    parser.add_argument("--defaults", action="store_true", help="only the variants the planner picks by default")
    parser.add_argument("dtypes", nargs="*", help="a subset of bfloat16 float16 float32 (default: all three)")
    args = parser.parse_intermixed_args(argv)
    if set(args.dtypes) - {"bfloat16", "float16", "float32"}:
        parser.error(f"dtypes must be bfloat16, float16 or float32, got {args.dtypes}")
    if args.mode == "count":
        return _count()
    return _compile(*([tuple(args.dtypes)] if args.dtypes else []), arch=args.arch, defaults_only=args.defaults)


if __name__ == "__main__":
    print(json.dumps(_main(sys.argv[1:])))


@pytest.mark.parametrize("version", ["installed", *triton_versions.PINNED])
def test_kernels_compile_for_sm90(version):
    """Every launch the backend makes for bf16, fp16 and fp32 (composable and grad-in-forward paths, every autotuning
    candidate, a lean, a heavy and a teacher epilogue, a lean distillation's grad-in-forward student, D = 4096 and
    D = 1000), recorded on meta tensors and
    compiled for an H100/H200 (sm_90a) without a GPU: no spills, at most 227 KB of shared memory, the products
    on wgmma, the operands loaded 16 bytes at a time (tests/tooling/test_compile_triton_kernels.py). Once with this
    environment's Triton, once with each pinned one of the supported range (tools/triton_versions.py: the
    oldest, and the version of the H200 images)."""
    from test_compile_triton_kernels import SHARED_LIMIT

    if version != "installed":
        assert triton_versions.installed(version), (
            f"Triton {version} is not installed for the compile check: run `python tools/triton_versions.py "
            "install` (CI does)")
    report = triton_versions.compile_report(None if version == "installed" else version)
    if version != "installed":
        assert report["triton"] == version  # the pinned Triton, not this environment's, compiled the kernels
    results = report["results"]
    assert {r["dtype"] for r in results} == {"bfloat16", "float16", "float32"}
    assert {r["kernel"] for r in results} == {"statistics_forward_kernel", "jsd_forward_kernel",
                                              "logits_gradient_kernel", "packed_gradient_kernel",
                                              "teacher_fold_kernel"}
    for r in results:
        what = f"{r['dtype']} {r['kernel']} {r['config']} {r['flags']}"
        assert r["ok"], what + r["log"]
        allowed = triton_versions.spill_allowed(report["triton"], r["kernel"], r["config"])
        assert max(r["spill_stores"], r["spill_loads"], r["stack"]) <= allowed, what + r["log"]
        assert r["shared"] <= SHARED_LIMIT, what
        assert r["vector_loads"], what
        if "LOAD_LOGITS" not in (r["flags"] or []):
            assert r["wgmma"], what
        if r["kernel"] == "packed_gradient_kernel":  # its block barrier orders a tile's loads before its stores
            assert r["barrier"], what
