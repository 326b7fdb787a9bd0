"""fusedloss benchmark: forward+backward time, peak extra memory and error of every implementation.

    python benchmarks/bench.py                   # CPU: every op at N=1024, V=32003, within 2 minutes
    python benchmarks/bench.py --shapes small    # CPU: N in {512, 2048}, a few minutes
    python benchmarks/bench.py --case headline   # the README's memory headline (N=4096, V=131072), 6-7 min
    python benchmarks/bench.py --device cuda     # GPU: bf16, D=4096, V=151936, N in {4096, 16384}
    python benchmarks/bench.py --list            # the plan and what can run here; runs nothing
    python benchmarks/bench.py --device cuda --profile         # per-kernel times of fusedloss's backends
    python benchmarks/bench.py --device cuda --product-rates   # the products the cost model assumes

For each op (token_logprobs with entropy, cross_entropy, grpo_loss (dapo, beta 0.04 with ref),
dpo_loss, distillation_loss (beta 1, reverse KL)), each implementation and each shape, it measures:

- ``fwd_bwd_ms``: median wall time of forward + backward (CUDA events on GPU) over the timed calls,
  after an untimed first call; ``fwd_bwd_ms_min`` / ``fwd_bwd_ms_max`` bound them, and ``spread`` is
  (max - min) / median. ``first_call_ms`` is the first call (compilation, autotuning). ``fwd_ms`` and
  ``bwd_ms``: the same calls split at the loss (the implementation's call; ``loss.backward()``). The timed
  calls of an op's implementations alternate in rounds; on a GPU after a short GEMM warm-up, with the SM
  clock sampled during each (``sm_clock_mhz``).
- ``extra_peak_mib``: peak memory during one forward + backward, minus what was allocated before it
  (the inputs) and minus the gradients it returns. GPU: ``torch.cuda.max_memory_allocated``, and
  ``peak_reserved_mib`` what the caching allocator held (``max_memory_reserved``). CPU:
  the process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs before each
  run) minus the RSS before the run, in a worker process started with ``MALLOC_MMAP_THRESHOLD_`` fixed
  so that every large tensor is its own mapping and freed memory really leaves the process.
- ``max_rel_err``: the largest norm-wise relative error, over the outputs and the gradients with
  respect to hidden and weight, against ``fusedloss.reference`` in float64 on the same data
  (``errors`` has each one).

On a GPU (or with ``--model-gpu``) each record also carries the cost model's figures for the same call
(benchmarks/cost_model.py; docs/design.md, "Plans and the performance model"): ``modelled_ms`` /
``modelled_fwd_ms`` / ``modelled_bwd_ms`` from fusedloss's CUDA and Triton backends' own plans, the
product-count bound ``modelled_bound_ms`` for every implementation, one GEMM-sized product measured in the
same process (``product_ms``), and the measured time over each (benchmarks/NOTES.md, "The model beside the
measurement"). Every figure of the model is named ``modelled_*``.

Which implementations can run here is decided before any problem is built (one line says what cannot
and why). Each group of cases runs in a worker process: a crash or a hang in one implementation is
recorded with its reason, and the group restarts for the implementations left. The JSON file is rewritten
after every record; the table and a PNG (matplotlib, in the ``bench`` extra) are written at the end, into
``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple, Optional

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

ROOT = Path(__file__).resolve().parents[1]
# A folder of peer packages installed with `pip install --target` (git-ignored), used when present.
for _site in (os.environ.get("FUSEDLOSS_PEER_SITE"), str(ROOT / ".carry" / "peers-cpu")):
    if _site and os.path.isdir(_site) and _site not in sys.path:
        sys.path.append(_site)

FUSED_BACKENDS = ("torch", "triton", "cuda", "auto")
ALL_IMPLS = ("reference", "reference+compile") + tuple(f"fusedloss:{b}" for b in FUSED_BACKENDS) + (
    "torch-lce", "trl", "liger", "cce")
OP_ORDER = ("token_logprobs", "cross_entropy", "grpo_loss", "dpo_loss", "distillation_loss", "topk_logprobs",
            "multi_teacher_distillation")
# relative cost of one call of an op (a teacher doubles the products): the progress estimate's weights
OP_WEIGHT = {"distillation_loss": 2.0}
# seconds past --budget-s after which a worker is stopped (its case in flight recorded as skipped)
STOP_GRACE_S = 12.0
MIB = float(1 << 20)


# ============================================================================ environment
def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return ""


def environment(device: str) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    commit = os.environ.get("FUSEDLOSS_COMMIT") or _git("rev-parse", "--short=12", "HEAD") or "uncommitted"
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    env["commit"] = commit + ("+dirty" if dirty and commit != "uncommitted" else "")
    env["gpu"] = None
    env["driver"] = None
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip() or None
        except Exception:
            pass
        env["cuda"] = torch.version.cuda
    for dist in ("trl", "liger-kernel", "cut-cross-entropy", "transformers"):
        from .peers import version

        env[f"v_{dist}"] = version(dist)
    return env


# ============================================================================ memory probes
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else 0


class CpuMem:
    """Peak RSS over a region: reset VmHWM to the current RSS, then read it back."""

    method = "rss"

    def __init__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.ok = True
        except OSError:
            self.ok = False
            self.method = "none"

    def start(self):
        if self.ok:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        self.base = _status_kib("VmRSS") * 1024

    def peak_extra(self) -> float:
        if not self.ok:
            return float("nan")
        return _status_kib("VmHWM") * 1024 - self.base


class CudaMem:
    """Peak device memory over a region: what torch's tensors held (``max_memory_allocated``) and what its
    caching allocator held from the driver (``max_memory_reserved``: the tensors plus cached blocks, the
    figure an out-of-memory error is about), each minus its value at the start."""

    method = "cuda_max_memory_allocated"

    def __init__(self):
        import torch

        self.torch = torch

    def start(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self.base = self.torch.cuda.memory_allocated()
        self.base_reserved = self.torch.cuda.memory_reserved()

    def peak_extra(self) -> float:
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated() - self.base

    def peaks(self) -> dict:
        """Absolute peaks and the reserved peak over the start (MiB), read after ``peak_extra``."""
        cuda = self.torch.cuda
        return {"peak_allocated_mib": round(cuda.max_memory_allocated() / MIB, 1),
                "peak_reserved_mib": round(cuda.max_memory_reserved() / MIB, 1),
                "extra_reserved_mib": round((cuda.max_memory_reserved() - self.base_reserved) / MIB, 1)}


# ============================================================================ implementations
def make_impl(name: str, op: str, device, compile_mode: str = "default"):
    """(callable(problem, h, w) -> (loss, outputs), None) or (None, reason)."""
    from . import cases, peers

    if name == "reference" or name == "reference+compile":
        try:
            fn = cases.reference_function(op)
        except Exception as exc:
            return None, f"fusedloss.reference not importable: {exc}"
        if name == "reference+compile":
            import torch

            fn = torch.compile(fn, mode=None if compile_mode == "default" else compile_mode, dynamic=False)
        return (lambda p, h, w: cases.call_op(fn, p, h, w)), None
    if name.startswith("fusedloss:"):
        backend = name.split(":", 1)[1]
        try:
            import fusedloss

            fn = getattr(fusedloss, cases.FUNCTION.get(op, op))
            status = fusedloss.backend_status()
        except Exception as exc:
            return None, f"fusedloss public API not importable: {type(exc).__name__}: {exc}"
        if backend != "auto" and status.get(backend) != "available":
            return None, f"backend {backend}: {status.get(backend)}"
        if backend == "cuda" and device.type != "cuda":
            return None, "backend cuda needs a CUDA device"
        return (lambda p, h, w: cases.call_op(fn, p, h, w, backend=backend)), None
    if name in peers.PEERS:
        return peers.peer(name, op, device)
    return None, f"unknown implementation {name!r}"


# ============================================================================ worker
def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


class Run(NamedTuple):
    ms: float         # forward + backward
    fwd: float        # the implementation's call
    bwd: float        # loss.backward()
    outs: dict
    grads: dict
    extra: Optional[float]      # peak bytes over the start, minus the gradients returned (with a probe)
    clock_mhz: Optional[int]    # the SM clock sampled while the call ran (GPU)


_CLOCK = {"ok": True}


def sm_clock_mhz(device) -> Optional[int]:
    """The SM clock now (NVML through ``torch.cuda.clock_rate``), None where it cannot be read."""
    import torch

    if device.type != "cuda" or not _CLOCK["ok"]:
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # no NVML here: say nothing rather than fail the timing
        _CLOCK["ok"] = False
        return None


def _one_run(impl, p, device, mem=None) -> Run:
    """One forward+backward: the forward is the implementation's call (whatever it does there: a grad-in-forward path
    finishes its gradients in it), the backward is ``loss.backward()``. On a GPU the SM clock is sampled
    after the work is queued and before the wait, i.e. while it runs."""
    import torch

    h, w = p.leaves()
    _sync(device)
    if mem is not None:
        mem.start()
    clock = None
    if device.type == "cuda":
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        loss, outs = impl(p, h, w)
        e1.record()
        if loss.requires_grad:  # the teacher top-k has no backward
            loss.backward()
        e2.record()
        clock = sm_clock_mhz(device)
        torch.cuda.synchronize()
        fwd, bwd = e0.elapsed_time(e1), e1.elapsed_time(e2)
    else:
        t0 = time.perf_counter()
        loss, outs = impl(p, h, w)
        t1 = time.perf_counter()
        if loss.requires_grad:
            loss.backward()
        fwd, bwd = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    extra = None
    grads = {"hidden": h.grad, "weight": w.grad}
    if mem is not None:
        extra = mem.peak_extra() - sum(g.numel() * g.element_size() for g in grads.values() if g is not None)
    return Run(fwd + bwd, fwd, bwd, outs, grads, extra, clock)


def _median(xs):
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else 0.5 * (xs[k - 1] + xs[k])


# ============================================================================ the cost model beside the measurement
# The benchmark's ops as the cost model names them (benchmarks/cost_model.py, fusedloss/core/workload.py OPS):
# token_logprobs is timed with its entropy; distillation_loss with beta 1 is the reverse KL.
MODEL_OP = {"token_logprobs": "token_logprobs_entropy", "cross_entropy": "cross_entropy", "grpo_loss": "grpo",
            "dpo_loss": "dpo", "distillation_loss": "distill_reverse_kl"}
# Every figure that comes from the cost model is named modelled_*; measured_* are quotients or sums of
# measurements (measured_over_modelled divides a measurement by a modelled figure).
MODEL_FIELDS = ("modelled_ms", "modelled_fwd_ms", "modelled_bwd_ms", "modelled_bound_ms", "modelled_over_bound",
                "measured_over_modelled", "measured_over_bound", "measured_floor_ms", "measured_over_floor")



def gpu_model_key(name: Optional[str]) -> Optional[str]:
    """The cost model's GPU (``benchmarks.model.cost.GPUS`` key) for a device name, or None."""
    from .model import cost

    upper = (name or "").upper()
    for key, spec in cost.GPUS.items():
        if spec.name.upper() in upper or key.upper() in upper:
            return key
    return None


def free_bytes_now(device) -> Optional[int]:
    """Memory free for torch on the device: the driver's free memory plus what torch's allocator caches
    unused (what the CUDA backend sizes its workspace from, fusedloss/backends/gpu.py ``free_bytes``)."""
    import torch

    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def modelled(op: str, impl: str, n: int, d: int, v: int, dtype: str, gpu: str, device_type: str,
             free_bytes: Optional[int] = None) -> dict:
    """The cost model's figures for one record: for a fusedloss backend with a ``plan`` (cuda, triton; auto
    as the backend it resolves to here) that plan's modelled forward, backward and total beside the
    product-count bound; for everything else (the reference, the peers, the torch backend) the bound only.
    ``model`` holds the details (path, products, HBM bytes, the plan's params, per-pass ms)."""
    from . import cost_model

    mop = MODEL_OP[op]
    teacher_d = d if op == "distillation_loss" else None
    b = cost_model.bound(mop, n, d, v, dtype=dtype, gpu=gpu, teacher_d=teacher_d)
    info = {"gpu": b["gpu"], "op": mop, "N": n, "D": d, "V": v, "dtype": dtype,
            "bound_products": b["bound_products"], "bound_teacher_products": b["bound_teacher_products"]}
    out = {"modelled_bound_ms": _sig(b["bound_ms"]), "modelled_ms": None, "modelled_fwd_ms": None,
           "modelled_bwd_ms": None, "modelled_over_bound": None}
    backend = impl.split(":", 1)[1] if impl.startswith("fusedloss:") else None
    if backend == "auto":
        import torch

        from fusedloss.core import registry

        backend = registry.resolve("auto", torch.device(device_type))
        info["auto_resolves_to"] = backend
    why = None
    if backend in ("cuda", "triton"):
        try:
            e = cost_model.estimate(mop, backend, n, d, v, dtype=dtype, gpu=gpu, teacher_d=teacher_d,
                                    free_bytes=free_bytes)
        except Exception as exc:  # a plan that cannot be modelled is recorded, never fatal to the run
            why = f"{backend}'s plan could not be modelled: {type(exc).__name__}: {exc}"
        else:
            out.update(modelled_ms=_sig(e["model_ms"]), modelled_fwd_ms=_sig(e["model_fwd_ms"]),
                       modelled_bwd_ms=_sig(e["model_bwd_ms"]), modelled_over_bound=_sig(e["ratio"]))
            info.update(source=f"{backend}.plan", backend=backend, path=e["path"], products=e["products"],
                        teacher_products=e["teacher_products"], flops=e["flops"], hbm_bytes=e["hbm_bytes"],
                        free_bytes=e["free_bytes"], plan=e["plan"], passes=e["passes"],
                        backward_passes=e["backward_passes"])
    elif backend is not None:
        why = f"the {backend} backend has no plan() in the cost model"
    else:
        why = f"{impl} has no plan in the cost model (its path is not modelled)"
    if why is not None:
        info.update(source="bound only", why=why)
    out["modelled_details"] = info
    return out


def _base_record(op, name, spec, shape, device, mem) -> dict:
    rec = {"kind": "result", "op": op, "impl": name, "N": spec["N"], "V": spec["V"], "D": spec["D"], **shape,
           "N_requested": spec["N"], "dtype": spec["dtype"], "device": device.type, "mem_method": mem.method}
    if spec.get("profile"):
        rec["mode"] = "profile"
    return rec


def _interpreted(name: str, device) -> bool:
    """Triton kernels on a CPU run through Triton's interpreter: correct results, times that say nothing."""
    return device.type == "cpu" and name == "fusedloss:triton"


def _build_problem(op, spec, device, dtype, emit):
    """The op's inputs, one product timed (with a model), and the float64 ground truth, saying as it goes
    what it builds (the float64 reference of a large case takes minutes on a CPU)."""
    from . import cases

    t0 = time.perf_counter()
    what = "the inputs" + ("" if spec.get("no_error") else " and the float64 reference")
    emit({"kind": "status", "op": op, "msg": f"building {what}"})
    p = cases.make_problem(op, spec["N"], spec["V"], spec["D"], dtype, device, seed=spec.get("seed", 0))
    shape = {"N": p.N, "V": p.V, "D": p.D, "input_mib": round(p.input_bytes() / MIB, 1)}
    if spec.get("model_gpu"):
        try:
            shape["product_ms"] = _sig(product_ms(p, device))
            shape["product_tflops"] = _sig(2.0 * p.N * p.V * p.D / shape["product_ms"] * 1e-9)
        except Exception as exc:
            emit({"kind": "status", "op": op, "msg": f"product timing failed: {type(exc).__name__}: {exc}"})
    ref = (None, None)
    if not spec.get("no_error"):
        last = [time.perf_counter()]

        def said(done, total):  # at most one line per 5 s
            if time.perf_counter() - last[0] >= 5.0:
                last[0] = time.perf_counter()
                emit({"kind": "status", "op": op, "msg": f"float64 reference: {done}/{total} chunks, "
                                                           f"{last[0] - t0:.0f} s"})
        try:
            ref = cases.reference64(p, progress=said)
        except Exception as exc:
            emit({"kind": "status", "op": op, "msg": f"float64 reference failed: {type(exc).__name__}: {exc}"})
    emit({"kind": "note", "op": op, "msg": f"problem ready in {time.perf_counter() - t0:.1f}s", **shape})
    return p, shape, ref


def _errors(run: Run, ref) -> dict:
    from . import cases

    ref_out, ref_grads = ref
    if ref_out is None:
        return {"max_rel_err": None}
    errs = {k: cases.rel_err(run.outs.get(k), r) for k, r in ref_out.items()}
    errs.update({"grad_" + k: cases.rel_err(run.grads.get(k), r) for k, r in ref_grads.items()})
    return {"errors": {k: float(f"{v:.3e}") for k, v in errs.items()},
            "max_rel_err": float(f"{max(errs.values()):.3e}")}


def _prepare(name, impl, p, ref, spec, device, mem, rec) -> dict:
    """An implementation's first call (compilation, autotuning; its outputs give the errors), then on a GPU
    one memory run on an emptied cache (the reserved peak), then any further warm-up. Returns its state for
    the timed rounds."""
    import torch

    free_at_start = free_bytes_now(device)
    t1 = time.perf_counter()
    first = _one_run(impl, p, device, mem)
    rec["first_call_ms"] = round((time.perf_counter() - t1) * 1e3, 2)
    rec.update(_errors(first, ref))
    first = first._replace(outs=None, grads=None)
    runs, extras = [], [first.extra]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        memory_run = _one_run(impl, p, device, mem)
        extras.append(memory_run.extra)
        rec.update(mem.peaks())
    budget_ms = spec.get("impl_budget_s", 60) * 1e3
    reps = max(spec.get("min_repeat", 1), min(spec["repeat"], int(budget_ms / max(first.ms, 1e-3))))
    if _interpreted(name, device):
        rec["timing"] = "triton interpreter on a CPU: checks the results, the times are not benchmark numbers"
        reps = 1
    elif spec.get("count_slow_first") and first.ms * (1 + reps) > budget_ms:
        # a time-boxed CPU run and a slow call: the first call is one of the timed ones (nothing here compiles
        # on a CPU; its extra cost is the first allocation of its buffers)
        runs, reps = [first], reps - 1
    else:
        for _ in range(max(0, spec["warmup"] - (2 if device.type == "cuda" else 1))):
            if first.ms * reps > budget_ms:
                break
            _one_run(impl, p, device)
    return {"name": name, "impl": impl, "rec": rec, "reps": len(runs) + reps, "runs": runs, "extras": extras,
            "free": free_at_start, "first_ms": first.ms}


def _finish_record(st, op, p, spec, device) -> dict:
    rec, runs = st["rec"], st["runs"]
    times = sorted(r.ms for r in runs)
    median = _median(times)
    fwds, bwds = [r.fwd for r in runs], [r.bwd for r in runs]
    extras = [x for x in st["extras"] + [r.extra for r in runs] if x is not None]
    clocks = [r.clock_mhz for r in runs if r.clock_mhz is not None]
    rec.update(status="ok", fwd_bwd_ms=round(median, 3), fwd_bwd_ms_min=round(times[0], 3),
               fwd_bwd_ms_max=round(times[-1], 3),
               spread=round((times[-1] - times[0]) / median, 4) if len(times) > 1 else None,
               fwd_ms=round(_median(fwds), 3), bwd_ms=round(_median(bwds), 3),
               fwd_ms_min=round(min(fwds), 3), bwd_ms_min=round(min(bwds), 3), repeats=len(times),
               extra_peak_mib=round(max(extras) / MIB, 2) if extras else None)
    if device.type == "cuda":
        rec["sm_clock_mhz"] = [r.clock_mhz for r in runs]  # per timed call, in the order they ran
        rec["sm_clock_mhz_min"] = min(clocks) if clocks else None
    if spec.get("model_gpu"):
        rec.update(model_fields(rec, op, st["name"], p, spec, device, st["free"]))
    return rec


def run_group(spec: dict, emit) -> None:
    """Worker: the tasks ``spec['tasks']`` ([op, impl] pairs) at one N, op by op. Each op's problem (inputs and
    float64 reference) is built once and freed before the next one. Every implementation of the op makes its
    first call and memory run; then its timed calls alternate with the others' in rounds (A B C A B C ...),
    after a short GEMM warm-up, so that a drift of the clocks or of the card's temperature falls on all of them
    alike; then one record per implementation."""
    import torch

    torch.manual_seed(0)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    mem = CudaMem() if device.type == "cuda" else CpuMem()
    deadline = spec.get("deadline")
    budget_rec = {"status": "skipped", "reason": "time budget of the run exhausted"}
    warm = not spec.get("gemm_warmup_s")
    for op in dict.fromkeys(op for op, _ in spec["tasks"]):
        names = [name for o, name in spec["tasks"] if o == op]
        if deadline and time.time() > deadline:  # no problem is built for cases that will not run
            for name in names:
                emit({**_base_record(op, name, spec, {}, device, mem), **budget_rec})
            continue
        p, shape, ref = _build_problem(op, spec, device, dtype, emit)
        live = []
        for name in names:
            rec = _base_record(op, name, spec, shape, device, mem)
            if deadline and time.time() > deadline:
                emit({**rec, **budget_rec})
                continue
            impl, why = make_impl(name, op, device, spec.get("compile_mode", "default"))
            if impl is None:
                emit({**rec, "status": "unavailable", "reason": why})
                continue
            emit({"kind": "start", "op": op, "impl": name})
            if os.environ.get("FUSEDLOSS_BENCH_CRASH") == name:  # self-test of the crash recovery
                os._exit(3)
            try:
                live.append(_prepare(name, impl, p, ref, spec, device, mem, rec))
            except Exception as exc:
                emit(_failure(rec, exc))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if live and not warm:
            emit({"kind": "status", "op": op, "msg": "GEMM warm-up: " + json.dumps(gemm_warmup(device,
                                                                                              spec["gemm_warmup_s"]))})
            warm = True
        for r in range(max((st["reps"] for st in live), default=0)):
            for st in live:
                if "failed" in st or r < len(st["runs"]) or r >= st["reps"]:
                    continue
                if st["runs"] and deadline and time.time() + st["runs"][-1].ms / 1e3 > deadline:
                    st["reps"] = len(st["runs"])  # the run's budget: fewer repeats rather than a case cut off
                    continue
                emit({"kind": "inflight", "op": op, "impl": st["name"]})
                try:
                    st["runs"].append(_one_run(st["impl"], p, device, mem)._replace(outs=None, grads=None))
                except Exception as exc:
                    st["failed"] = _failure(st["rec"], exc)
        for st in live:
            if "failed" in st:
                emit(st["failed"])
                continue
            rec = _finish_record(st, op, p, spec, device)
            if spec.get("profile"):
                try:
                    rec["profile"] = profile_once(st["impl"], p, device)
                except Exception as exc:
                    rec["profile"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            emit(rec)
        live = p = ref = None
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _failure(rec, exc) -> dict:
    return {**rec, "status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[:400]}",
            "traceback": traceback.format_exc()[-2000:]}


def gemm_warmup(device, seconds: float) -> dict:
    """bf16 products of 8192^3 for about ``seconds``, so that the first timed call meets the clocks and the
    temperature a loaded card settles at, not an idle card's."""
    import torch

    if device.type != "cuda" or seconds <= 0:
        return {"seconds": 0.0}
    g = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16, generator=g)  # random data, never zeros
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16, generator=g)
    t0, products = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            torch.mm(a, b)
        products += 8
        clock = sm_clock_mhz(device)
        torch.cuda.synchronize()
    return {"seconds": round(time.perf_counter() - t0, 2), "products": products, "sm_clock_mhz": clock}


# kernel name -> the family of the cost model's passes it belongs to (first match wins)
KERNEL_FAMILIES = (
    ("fusedloss cuda fold", ("fold_kernel", "jsd_kernel")),
    ("fusedloss cuda dx", ("dx_kernel",)),
    ("fusedloss triton forward", ("statistics_forward", "jsd_forward")),
    ("fusedloss triton gradient", ("logits_gradient",)),
    ("cuBLAS products", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "sm80_", "cublas")),
    ("copies and fills", ("memcpy", "memset", "copy_kernel", "fill_kernel")),
    ("torch elementwise and reductions", ("elementwise", "reduce_kernel", "vectorized", "at::native")),
    # CPU runs: torch's ops by name
    ("matrix products (CPU)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul")),
    ("other torch ops (CPU)", ("aten::",)),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, keys in KERNEL_FAMILIES:
        if any(k.lower() in low for k in keys):
            return family
    return "other"


def profile_once(impl, p, device, top: int = 40) -> dict:
    """One more forward+backward under ``torch.profiler``: each GPU kernel's launch count and total time (on
    a CPU: each op's self time), the largest ``top`` by time, and the totals per family of passes (the cost
    model's ``model.passes`` name the same families)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        run = _one_run(impl, p, device)
    rows = []
    for e in prof.key_averages():
        if cuda:
            if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(e, "device_time_total", None)
            us = e.cuda_time_total if us is None else us
        else:
            us = e.self_cpu_time_total
        if us and us > 0:
            rows.append({"name": e.key[:200], "count": int(e.count), "total_us": round(float(us), 1)})
    rows.sort(key=lambda r: -r["total_us"])
    families = {}
    for r in rows:
        f = families.setdefault(kernel_family(r["name"]), {"count": 0, "total_us": 0.0})
        f["count"] += r["count"]
        f["total_us"] = round(f["total_us"] + r["total_us"], 1)
    return {"what": "GPU kernels" if cuda else "CPU ops, self time", "fwd_bwd_ms": round(run.ms, 3),
            "total_us": round(sum(r["total_us"] for r in rows), 1), "families": families,
            "kernels": rows[:top], "kernels_left_out": max(0, len(rows) - top)}


def product_ms(p, device, repeat: int = 5) -> float:
    """One GEMM-sized product of this problem, ``hidden [N, D] @ weight.T`` in its dtype (TF32 off), timed
    in this process: median of ``repeat`` after two warm-ups. The bound's unit measured, not taken from a
    datasheet (``floor_ms`` = the bound's products at this time)."""
    import torch

    h2, w = p.t["hidden"].reshape(-1, p.D), p.t["weight"]
    times = []
    for i in range(2 + repeat):
        _sync(device)
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = torch.mm(h2, w.t())
            e1.record()
            torch.cuda.synchronize()
            ms = e0.elapsed_time(e1)
        else:
            t0 = time.perf_counter()
            out = torch.mm(h2, w.t())
            ms = (time.perf_counter() - t0) * 1e3
        del out
        if i >= 2:
            times.append(ms)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return _median(times)


# The products the plans assume, as (name, what, M, N, K, output dtype, accumulate into the output). GPU: the
# shapes of docs/design.md's H200 plans (a logits chunk of 8192 rows, V = 151936, D = 4096; one row chunk's
# d weight accumulation with K = 2304 rows); CPU: a tiny stand-in that checks the code.
PRODUCT_RATES = {
    "gpu": (("bf16_output", "logits product, bf16 output", 8192, 151936, 4096, "bfloat16", False),
            ("fp32_output", "logits product, fp32 output (half operands)", 8192, 151936, 4096, "float32", False),
            ("fp32_accumulate_short_k", "beta=1 accumulation into fp32 [V, D], K = 2304", 151936, 4096, 2304,
             "float32", True)),
    "cpu": (("bf16_output", "tiny stand-in", 64, 1009, 64, "bfloat16", False),
            ("fp32_output", "tiny stand-in", 64, 1009, 64, "float32", False),
            ("fp32_accumulate_short_k", "tiny stand-in", 1009, 64, 48, "float32", True)),
}


def _product_call(a, b, c, accumulate):
    """(callable, method) for one product into ``c``: torch's out_dtype products where this torch has them,
    the way the backends call them; an unfused product-then-add is reported as such, never as the same
    thing."""
    import torch

    if c.dtype == a.dtype:
        return (lambda: torch.mm(a, b, out=c)) if not accumulate else (lambda: c.addmm_(a, b)), "mm"
    tries = [("torch.addmm(out_dtype, out=c)", lambda: torch.addmm(c, a, b, out_dtype=c.dtype, out=c)),
             ("torch.baddbmm(out_dtype, out=c)", lambda: torch.baddbmm(c[None], a[None], b[None],
                                                                       out_dtype=c.dtype, out=c[None]))]
    if not accumulate:
        tries = [("torch.mm(out_dtype, out=c)", lambda: torch.mm(a, b, out_dtype=c.dtype, out=c))]
    if accumulate:
        tries.append(("c += torch.mm(out_dtype) (not fused)", lambda: c.add_(torch.mm(a, b, out_dtype=c.dtype))))
    for method, fn in tries:
        try:
            fn()
            return fn, method
        except (TypeError, RuntimeError, NotImplementedError):
            continue
    raise Unsupported(f"torch {torch.__version__} has no {c.dtype} output of {a.dtype} operands on {a.device.type}")


class Unsupported(Exception):
    """A product this torch cannot do on this device (recorded as such, not as a failure)."""


def product_rates(device, repeat: int = 5) -> list:
    """Each product of ``PRODUCT_RATES`` timed on random data (CUDA events, median of ``repeat`` after two
    warm-ups, the SM clock sampled during each): the rates behind the cost model's product terms."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device=device).manual_seed(3)
    out = []
    for name, what, m, n, k, out_dtype, accumulate in PRODUCT_RATES["gpu" if cuda else "cpu"]:
        rec = {"kind": "product_rate", "name": name, "what": what, "M": m, "N": n, "K": k, "operands": "bfloat16",
               "output": out_dtype, "beta": 1 if accumulate else 0, "device": device.type,
               "flops": 2.0 * m * n * k}
        a = b = c = None
        try:
            a = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
            b = torch.randn(k, n, device=device, generator=g).to(torch.bfloat16) / math.sqrt(k)
            c = torch.randn(m, n, device=device, generator=g).to(getattr(torch, out_dtype))
            fn, rec["method"] = _product_call(a, b, c, accumulate)
            times, clocks = [], []
            for i in range(2 + repeat):
                _sync(device)
                if cuda:
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    fn()
                    e1.record()
                    clocks.append(sm_clock_mhz(device))
                    torch.cuda.synchronize()
                    ms = e0.elapsed_time(e1)
                else:
                    t0 = time.perf_counter()
                    fn()
                    ms = (time.perf_counter() - t0) * 1e3
                if i >= 2:
                    times.append(ms)
            rec.update(status="ok", ms=_sig(_median(times)), ms_min=_sig(min(times)),
                       tflops=_sig(rec["flops"] / _median(times) * 1e-9), repeats=len(times))
            if cuda:
                rec["sm_clock_mhz"] = clocks[2:]
        except Unsupported as exc:
            rec.update(status="unsupported", reason=str(exc))
        except Exception as exc:
            rec.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        a = b = c = None
        if cuda:
            torch.cuda.empty_cache()
        out.append(rec)
    return out


def rates_table(rates: list) -> str:
    lines = ["product rates (measured):"]
    for r in rates:
        shape = f"[{r['M']}x{r['N']}x{r['K']}] {r['operands']} -> {r['output']}, beta={r['beta']}"
        if r["status"] == "ok":
            lines.append(f"  {r['name']:<24} {shape:<58} {r['ms']:>9.3f} ms  {r['tflops']:>8.3g} TFLOP/s  "
                         f"({r['method']})")
        else:
            lines.append(f"  {r['name']:<24} {shape:<58} {r['status']}: {r['reason'][:100]}")
    return "\n".join(lines)


def model_fields(rec: dict, op: str, impl: str, p, spec: dict, device, free_bytes) -> dict:
    """``modelled`` for a measured record, with the measured time over the modelled one and over the bound
    where the measurement was made on a GPU (on a CPU those quotients would compare a CPU with an H200)."""
    try:
        m = modelled(op, impl, p.N, p.D, p.V, spec["dtype"], spec["model_gpu"], device.type, free_bytes)
    except Exception as exc:
        return {"modelled_details": {"source": "none", "why": f"{type(exc).__name__}: {exc}"}}
    m["measured_over_modelled"] = m["measured_over_bound"] = m["measured_floor_ms"] = None
    m["measured_over_floor"] = None
    if rec.get("product_ms"):
        info = m["modelled_details"]
        m["measured_floor_ms"] = _sig((info["bound_products"] + info["bound_teacher_products"]) * rec["product_ms"])
    if device.type == "cuda":
        if m["modelled_ms"]:
            m["measured_over_modelled"] = _sig(rec["fwd_bwd_ms"] / m["modelled_ms"])
        m["measured_over_bound"] = _sig(rec["fwd_bwd_ms"] / m["modelled_bound_ms"])
        if m["measured_floor_ms"]:
            m["measured_over_floor"] = _sig(rec["fwd_bwd_ms"] / m["measured_floor_ms"])
    else:
        m["modelled_details"]["note"] = ("measured on a CPU: the model describes the GPU named in `gpu` at this "
                                         "shape, not what ran here")
    return m


def worker_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    with open(out_path, "a", buffering=1) as f:
        def emit(obj):
            f.write(json.dumps(obj) + "\n")
            f.flush()
        try:
            run_group(spec, emit)
        except Exception as exc:
            emit({"kind": "group_failed", "reason": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-2000:]})


# ============================================================================ orchestration
def _worker_env(device: str) -> dict:
    env = dict(os.environ)
    if device == "cpu":
        # every allocation >= 64 KiB is its own mmap, returned to the OS on free: RSS tracks live tensors
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        env["MALLOC_TRIM_THRESHOLD_"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
    return env


def _failed(spec, op, impl, reason, status="failed"):
    return {"kind": "result", "op": op, "impl": impl, "N": spec["N"], "V": spec["V"], "D": spec["D"],
            "dtype": spec["dtype"], "device": spec["device"], "status": status, "reason": reason,
            **({"mode": "profile"} if spec.get("profile") else {})}


def run_group_isolated(spec: dict, timeout_s: float, log, progress=None, budget_stop: bool = False,
                       on_record=None) -> list:
    """Run a group's tasks in worker processes; on a crash or a timeout, record the task in flight as
    failed and restart the worker with the tasks left. ``progress(event, op, impl)`` hears each task
    start ("start") and end ("done"); ``on_record(record)`` each record as soon as it exists."""
    progress = progress or (lambda *a: None)
    results = []

    def keep(rec):
        results.append(rec)
        if on_record is not None:
            on_record(rec)

    tasks = [tuple(t) for t in spec["tasks"]]
    tmp = Path(tempfile.mkdtemp(prefix="flbench-"))
    attempt = 0
    t_group = time.time()
    while tasks:
        attempt += 1
        sp, op_ = tmp / f"spec{attempt}.json", tmp / f"out{attempt}.jsonl"
        sp.write_text(json.dumps(dict(spec, tasks=tasks)))
        op_.write_text("")
        cmd = [sys.executable, "-m", "benchmarks.bench", "--worker", str(sp), str(op_)]
        left_s = max(10.0, timeout_s - (time.time() - t_group))
        errf = tmp / f"stderr{attempt}.txt"
        in_flight, done, pos, failed_all = None, set(), 0, None
        with open(errf, "w") as ef:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_worker_env(spec["device"]), stdout=ef, stderr=ef)
            t_att = time.time()
            while True:
                finished = proc.poll() is not None
                with open(op_) as f:  # stream the worker's records as they come
                    f.seek(pos)
                    chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                pos += len(complete)
                for line in complete.splitlines():
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if obj["kind"] == "start":
                        in_flight = (obj["op"], obj["impl"])
                        progress("start", obj["op"], obj["impl"])
                    elif obj["kind"] == "inflight":  # a timed call of the rounds: a crash now is this one's
                        in_flight = (obj["op"], obj["impl"])
                    elif obj["kind"] == "result":
                        done.add((obj["op"], obj["impl"]))
                        in_flight = None
                        keep(obj)
                        progress("done", obj["op"], obj["impl"])
                        log(_progress_line(obj))
                    elif obj["kind"] == "note":
                        progress("note", obj.get("op"), None)
                        log(f"    [{obj.get('op')} N={spec['N']}] {obj['msg']}")
                    elif obj["kind"] == "status":
                        log(f"    [{obj.get('op')} N={spec['N']}, {time.time() - t_group:.0f} s] {obj['msg']}")
                    elif obj["kind"] == "group_failed":
                        log(f"    [N={spec['N']}] worker failed: {obj['reason']}")
                        failed_all = obj["reason"]
                if finished:
                    rc = proc.returncode
                    break
                if time.time() - t_att > left_s:
                    proc.kill()
                    proc.wait()
                    rc = "timeout"
                    break
                time.sleep(0.25)
        tail = errf.read_text(errors="replace")[-1500:]
        if failed_all is not None:
            for t in tasks:
                if t not in done:
                    keep(_failed(spec, *t, "worker failed: " + failed_all))
                    progress("done", *t)
            return results
        left = [t for t in tasks if t not in done]
        if not left:
            break
        if rc == "timeout":
            # the group's time is spent: the task in flight timed out, the rest are skipped
            why = f"worker timed out after {timeout_s:.0f}s"
            hung = in_flight or left[0]
            for t in left:
                if budget_stop:
                    rec = _failed(spec, *t, "time budget of the run exhausted"
                                  + (" (stopped mid-case)" if t == hung else ""), "skipped")
                else:
                    rec = _failed(spec, *t, why) if t == hung else _failed(spec, *t, "not run: " + why, "skipped")
                keep(rec)
                progress("done", *t)
                log(_progress_line(rec))
            break
        crashed = in_flight or left[0]
        rec = _failed(spec, *crashed, f"worker died (rc={rc}): " + tail.strip()[-600:])
        keep(rec)
        progress("done", *crashed)
        log(_progress_line(rec))
        tasks = [t for t in left if t != crashed]
    return results


def _progress_line(r: dict) -> str:
    head = f"  {r['op']:<18} N={r['N']:<6} {r['impl']:<18}"
    if r.get("status") != "ok":
        return f"{head} {r.get('status', '?').upper()}: {str(r.get('reason'))[:160]}"
    err = r.get("max_rel_err")
    spread = "-" if r.get("spread") is None else f"{100 * r['spread']:.0f}%"
    measured = (f"{r['fwd_bwd_ms']:>9.1f} ms (fwd {r.get('fwd_ms', 0):.1f} + bwd {r.get('bwd_ms', 0):.1f}; "
                f"min {r['fwd_bwd_ms_min']:.1f}, spread {spread}, {r.get('repeats')} runs)")
    if r.get("timing"):
        measured = "timing not a benchmark number (Triton interpreter)"
    if r.get("sm_clock_mhz_min") is not None:
        measured += f" SM >= {r['sm_clock_mhz_min']} MHz"
    memory = f"{_f(r.get('extra_peak_mib'), '>8.1f')} MiB extra"
    if r.get("peak_reserved_mib") is not None:
        memory += f" ({r['peak_reserved_mib'] / 1024:.1f} GiB reserved at peak)"
    model = ""
    if r.get("modelled_ms") is not None:
        model = f"  | modelled {_ms(r['modelled_ms'])} ms"
        if r.get("measured_over_modelled") is not None:
            model += f", measured x{r['measured_over_modelled']:.2f} of it"
    if r.get("measured_over_bound") is not None:
        model += f"; measured x{r['measured_over_bound']:.2f} the modelled bound"
    if r.get("profile", {}).get("families"):
        fam = sorted(r["profile"]["families"].items(), key=lambda kv: -kv[1]["total_us"])[:3]
        model += "  | profile: " + ", ".join(f"{k} {v['total_us'] / 1e3:.1f} ms" for k, v in fam)
    return f"{head} {measured}  {memory}  err {err if err is None else f'{err:.1e}'}{model}"


class Progress:
    """A text progress bar: which case runs, how many are done, and an estimate of the time left.

    Each task (op, impl) weighs its op's relative cost (``OP_WEIGHT``); building an op's problem (inputs and
    the float64 ground truth) weighs one task. The time left is the time per unit of weight so far times
    the weight left, once something has finished."""

    def __init__(self, groups, log, t_start):
        self.log, self.t_start = log, t_start
        self.left = {}
        for g in groups:
            for op, impl in g["tasks"]:
                key = (g["N"], op, impl)
                self.left[key] = OP_WEIGHT.get(op, 1.0)
            for op in dict.fromkeys(op for op, _ in g["tasks"]):
                self.left[(g["N"], op, None)] = OP_WEIGHT.get(op, 1.0)
        self.total_weight = sum(self.left.values())
        self.total_tasks = sum(1 for k in self.left if k[2] is not None)
        self.done_weight = 0.0
        self.done_tasks = 0
        self.n = None

    def _finish(self, key):
        w = self.left.pop(key, None)
        if w is not None:
            self.done_weight += w
            self.done_tasks += key[2] is not None

    def __call__(self, event, op, impl):
        if event == "note":  # a problem was built
            self._finish((self.n, op, None))
            return
        if event == "done":
            self._finish((self.n, op, impl))
            return
        elapsed = time.time() - self.t_start
        if self.done_weight > 0:
            eta = f"~{elapsed / self.done_weight * (self.total_weight - self.done_weight):.0f} s left"
        else:
            eta = "estimating time left"
        width = 20
        filled = int(round(width * self.done_weight / max(self.total_weight, 1e-9)))
        self.log(f"[{'#' * filled}{'-' * (width - filled)}] {self.done_tasks}/{self.total_tasks}  "
                 f"{elapsed:.0f} s, {eta} | measuring {op} N={self.n} {impl}")

    def skip_group(self, n, tasks):
        for op, impl in tasks:
            self._finish((n, op, impl))
            self._finish((n, op, None))


def _ok(r):
    return r.get("status") == "ok"


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def _ms(x):
    """A modelled or bound time: one decimal from 1 ms up, three significant digits below (tiny shapes)."""
    return "-" if x is None else f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def _sig(x, digits=4):
    return None if x is None else float(f"{x:.{digits}g}")


def _timed(r) -> bool:
    """A record whose time is a benchmark number: measured, not in the profile mode, not interpreted."""
    return _ok(r) and not r.get("timing") and r.get("mode") != "profile"


def _abs_ms(x):
    return f"{x / 1e3:.2f} s" if x >= 1e4 else f"{x:.1f} ms" if x >= 1 else f"{x:.3g} ms"


def _abs_mib(x):
    return f"{x / 1024:.2f} GiB" if abs(x) >= 1024 else f"{x:.1f} MiB"


def table(records: list) -> str:
    """One row per measured case (what could not run here is summarised, not tabled). Measured: median time,
    fastest run, spread, the forward and backward medians, extra memory (and on a GPU the allocator's peak
    reservation), each beside its ratio to the reference where one was measured, and the error. Then, after
    a '|', what the cost model says where the records carry it (modelled time, modelled bound) and the
    measured time over each. Times of the Triton interpreter on a CPU are shown as 'interp.', not numbers."""
    records = [r for r in records if r.get("mode") != "profile"]
    if not records:
        return ""
    with_model = any(r.get("modelled_bound_ms") is not None for r in records)
    with_reserved = any(r.get("peak_reserved_mib") is not None for r in records)
    head = ["op", "N", "impl", "median ms", "min ms", "spread", "fwd ms", "bwd ms", "time/ref", "extra MiB",
            "mem/ref"] + (["reserved GiB"] if with_reserved else []) + ["max rel err"]
    if with_model:
        head += ["| modelled ms", "modelled bound ms", "measured/modelled", "measured/bound"]
    rows = [tuple(head + ["status"])]
    key = lambda r: (r["op"], r["N"])
    refs = {key(r): r for r in records if r["impl"] == "reference" and _ok(r)}
    order = {op: i for i, op in enumerate(OP_ORDER)}
    rank = {impl: i for i, impl in enumerate(ALL_IMPLS)}
    shown = [r for r in records if r.get("status") != "unavailable"]
    shown.sort(key=lambda r: (r["N"], order.get(r["op"], 99), rank.get(r["impl"], 99)))
    for r in shown:
        ref = refs.get(key(r))
        if _ok(r):
            mr = (f"{r['extra_peak_mib'] / ref['extra_peak_mib']:.3f}"
                  if ref and ref.get("extra_peak_mib") and r.get("extra_peak_mib") is not None else "-")
            if r.get("timing"):
                times = ["interp."] * 5 + ["-"]
            else:
                spread = r.get("spread")
                times = [f"{r['fwd_bwd_ms']:.1f}", f"{r.get('fwd_bwd_ms_min', r['fwd_bwd_ms']):.1f}",
                         "-" if spread is None else f"{100 * spread:.0f}%", _f(r.get("fwd_ms"), ".1f"),
                         _f(r.get("bwd_ms"), ".1f"),
                         f"{r['fwd_bwd_ms'] / ref['fwd_bwd_ms']:.2f}" if ref and _timed(ref) else "-"]
            row = [r["op"], str(r["N"]), r["impl"]] + times + [_f(r.get("extra_peak_mib"), ".1f"), mr]
            if with_reserved:
                row.append("-" if r.get("peak_reserved_mib") is None else f"{r['peak_reserved_mib'] / 1024:.1f}")
            row.append(_f(r.get("max_rel_err"), ".2e"))
            if with_model:
                row += ["| " + _ms(r.get("modelled_ms")), _ms(r.get("modelled_bound_ms")),
                        _f(r.get("measured_over_modelled"), ".2f"), _f(r.get("measured_over_bound"), ".2f")]
            rows.append(tuple(row + ["ok" + (" (Triton interpreter: not timed)" if r.get("timing") else "")]))
        else:
            rows.append(tuple([r["op"], str(r["N"]), r["impl"]] + [""] * (len(head) - 3)
                              + [f"{r.get('status')}: {str(r.get('reason'))[:70]}"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for row in rows:
        out.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                   + "  " + row[-1])
    if with_model:
        out.append("left of '|': measured here; right of it: the cost model's figures for the GPU in "
                   "modelled_details.gpu, and the measured time over them (on a GPU only)")
    return "\n".join(out)


def profile_table(records: list) -> str:
    """The profile mode's records: per (op, N, implementation), the measured time of each kernel family
    beside the cost model's passes."""
    rows = [r for r in records if r.get("mode") == "profile" and _ok(r) and r.get("profile", {}).get("families")]
    if not rows:
        return ""
    out = ["per-kernel profile (one forward+backward under torch.profiler; measured ms per family of kernels, "
           "launch counts in brackets; then the modelled passes):"]
    for r in rows:
        fam = sorted(r["profile"]["families"].items(), key=lambda kv: -kv[1]["total_us"])
        out.append(f"  {r['op']:<18} N={r['N']:<6} {r['impl']:<16} measured: "
                   + ", ".join(f"{k} {v['total_us'] / 1e3:.2f} ({v['count']})" for k, v in fam))
        passes = (r.get("modelled_details") or {}).get("passes")
        if passes:
            out.append(" " * 44 + "modelled: " + ", ".join(f"{k} {v:.2f}" for k, v in passes.items()))
    return "\n".join(out)


def unavailable_summary(records: list) -> str:
    """One line: each implementation that could not run here, with its reason (once, not per op)."""
    why = {}
    for r in records:
        if r.get("status") == "unavailable":
            why.setdefault(r["impl"], str(r.get("reason")))
    if not why:
        return ""
    return "not run here: " + "; ".join(f"{impl} ({reason})" for impl, reason in why.items())


def plot(records: list, path: Path, title: str) -> Optional[str]:
    """Panels per op: time and extra memory as ratios to the materialised reference (linear axes, 1 = the
    reference, lower is better; each bar labelled with the ratio and the absolute figure), the error against
    float64 (log axis, lower is better), and, where the records carry the cost model, the measured time
    (bars) and the modelled time (black ticks) over the modelled bound. Times of the Triton interpreter on
    a CPU are left out of the time panels. Returns None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return (f"matplotlib is not importable ({type(exc).__name__}: {exc}); install it with "
                "`pip install 'fusedloss[bench]'` (or `pip install matplotlib`), then redraw this run with "
                f"`python benchmarks/bench.py --merge {path.with_suffix('.json')}`")
    import textwrap

    ok = [r for r in records if _ok(r) and r.get("mode") != "profile"]
    if not ok:
        return "no implementation ran successfully: nothing to plot"
    refs = {(r["op"], r["N"]): r for r in ok if r["impl"] == "reference" and _timed(r)}
    ops = [op for op in OP_ORDER if any(r["op"] == op for r in ok)]
    ops += [op for op in dict.fromkeys(r["op"] for r in ok) if op not in ops]
    rank = {impl: i for i, impl in enumerate(ALL_IMPLS)}
    impls = sorted(dict.fromkeys(r["impl"] for r in ok), key=lambda i: rank.get(i, 99))
    colors = {impl: plt.get_cmap("tab10")(k % 10) for k, impl in enumerate(impls)}
    panels = [("time", "time / reference\n(lower is better)"),
              ("mem", "extra memory / reference\n(lower is better)"),
              ("err", "max rel. error vs float64\n(lower is better)")]
    if any(r.get("measured_over_bound") is not None or r.get("modelled_ms") is not None for r in ok):
        panels.append(("bound", "time / modelled bound\nbars: measured (GPU)\nblack ticks: modelled"))
    width_in = max(6.5, 3.8 * len(ops) + 1)
    fig, axes = plt.subplots(len(panels), len(ops), figsize=(width_in, 3.1 * len(panels)), squeeze=False)
    for j, op in enumerate(ops):
        ns = sorted(set(r["N"] for r in ok if r["op"] == op))  # GRPO/DPO round N to whole sequences
        op_impls = [i for i in impls if any(r["op"] == op and r["impl"] == i for r in ok)]
        width = 0.8 / max(1, len(op_impls))
        upright = len(op_impls) * len(ns) <= 4  # room for horizontal labels
        for row, (field, label) in enumerate(panels):
            ax = axes[row][j]
            baseline = None  # the dashed line at 1: the reference (time, memory) or the modelled bound
            for k, impl in enumerate(op_impls):
                xs, ys, texts = [], [], []
                for i, n in enumerate(ns):
                    r = next((r for r in ok if r["op"] == op and r["impl"] == impl and r["N"] == n), None)
                    ref = refs.get((op, n))
                    if r is None:
                        continue
                    x = i + (k - (len(op_impls) - 1) / 2) * width
                    y = text = None
                    if field == "bound":
                        if r.get("modelled_ms") is not None and r.get("modelled_bound_ms"):
                            ax.plot([x], [r["modelled_ms"] / r["modelled_bound_ms"]], marker="_", color="black",
                                    markersize=12, mew=2)
                            baseline = "the modelled bound"
                        y = r.get("measured_over_bound")
                        text = None if y is None else f"{y:.2f}x\n{_abs_ms(r['fwd_bwd_ms'])}"
                    elif field == "err":
                        y = r.get("max_rel_err")
                        text = None if y is None else f"{y:.1e}"
                    elif ref is None or not _timed(r):
                        y = None
                    elif field == "time":
                        y = r["fwd_bwd_ms"] / ref["fwd_bwd_ms"]
                        text = f"{y:.2f}x\n{_abs_ms(r['fwd_bwd_ms'])}"
                    elif ref.get("extra_peak_mib") and r.get("extra_peak_mib") is not None:
                        y = r["extra_peak_mib"] / ref["extra_peak_mib"]
                        text = f"{y:.2f}x\n{_abs_mib(r['extra_peak_mib'])}"
                    if y is not None and y > 0:
                        xs.append(x)
                        ys.append(y)
                        texts.append(text)
                        if field in ("time", "mem"):
                            baseline = "the reference"
                        elif field == "bound":
                            baseline = "the modelled bound"
                if xs:
                    bars = ax.bar(xs, ys, width, color=colors[impl], label=impl)
                    ax.bar_label(bars, labels=texts, fontsize=7, rotation=0 if upright else 90, padding=2)
            if field == "err":
                ax.set_yscale("log")
                heights = [b.get_height() for b in ax.patches if b.get_height() > 0]
                if heights:  # whole decades, so that bars a few percent apart look a few percent apart
                    lo, hi = math.floor(math.log10(min(heights))), math.ceil(math.log10(max(heights)))
                    ax.set_ylim(10.0 ** (lo - 2), 10.0 ** (hi + 1))
            else:
                if baseline is not None:
                    ax.axhline(1.0, color="black", lw=0.8, ls="--")
                    ax.text(0.01, 0.99, f"dashed: {baseline} (= 1)", transform=ax.transAxes, fontsize=7,
                            va="top")
                elif not ax.patches:
                    ax.text(0.5, 0.5, "not measured" if field != "bound" else "no GPU measurement",
                            transform=ax.transAxes, ha="center", va="center", fontsize=8, color="gray")
                ticks = [y for line in ax.get_lines() for y in line.get_ydata()]
                # headroom for the two-line labels above the tallest bar
                ax.set_ylim(0, max([1.35] + [b.get_height() * 1.45 for b in ax.patches] + [t * 1.3 for t in ticks]))
            ax.set_xticks(range(len(ns)))
            ax.set_xticklabels([f"N={n}" for n in ns])
            if row == 0:
                ax.set_title(op)
            if j == 0:
                ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3, which="both")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[i]) for i in impls]
    fig.legend(handles, impls, loc="lower center", ncol=min(len(impls), 5), fontsize=8)
    interp = any(r.get("timing") for r in ok)
    note = "lower is better in every panel" + ("; Triton interpreter times (CPU) are not plotted" if interp else "")
    wrapped = textwrap.fill(f"{title}. {note}", width=int(width_in * 13))
    fig.suptitle(wrapped, fontsize=9)
    legend_rows = math.ceil(len(impls) / 5)
    fig.tight_layout(rect=(0, 0.025 + 0.02 * legend_rows, 1, 1 - 0.012 * (wrapped.count("\n") + 2)))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Presets (--shapes): " + "; ".join(
                                     f"{k}: N={v['N']}, V={v['V']}, D={v['D']}"
                                     for k, v in _presets().items() if k != "acceptance"))
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--ops", nargs="+", default=None,
                    help=f"default: all of {', '.join(OP_ORDER[:5])}; also {', '.join(OP_ORDER[5:])}")
    ap.add_argument("--impls", nargs="+", default=None,
                    help=f"subset of {', '.join(ALL_IMPLS)} (default: every one that can run here, with "
                         "fusedloss:auto folded into the backend it picks; reference+compile with --compile)")
    ap.add_argument("--shapes", choices=("tiny", "quick", "small", "llm", "headline", "acceptance"), default=None,
                    help="default: quick on cpu (time-boxed to 90 s of cases), llm on cuda")
    ap.add_argument("--N", nargs="+", type=int, default=None, help="override the preset's token counts")
    ap.add_argument("--V", type=int, default=None)
    ap.add_argument("--D", type=int, default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--case", choices=("headline", "acceptance"), default=None,
                    help="headline: the memory case of the README (CPU, fp32, token_logprobs with entropy, "
                         "N=4096, V=131072, D=256; the materialised reference against fusedloss's torch "
                         "backend and TRL's chunked kernel); 'acceptance' is its older name")
    ap.add_argument("--compile", action="store_true", help="also time the reference under torch.compile")
    ap.add_argument("--compile-mode", default="default")
    ap.add_argument("--warmup", type=int, default=None, help="calls before timing (the first call included)")
    ap.add_argument("--repeat", type=int, default=None, help="timed calls (median, min and spread reported)")
    ap.add_argument("--impl-budget-s", type=float, default=None, help="fewer repeats when a call is slow")
    ap.add_argument("--group-timeout", type=float, default=None, help="seconds per worker group")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="whole run: cases that would start past it are recorded as skipped "
                         "(default: 90 for the quick preset, none otherwise; a case in flight is stopped 12 s past it)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in the workers")
    ap.add_argument("--no-error", action="store_true", help="skip the float64 reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"), help="folder for JSON, PNG, log")
    ap.add_argument("--tag", default=None, help="file name stem (default bench-<device>-<dtype>-<time>)")
    ap.add_argument("--list", "--dry-run", dest="list", action="store_true",
                    help="print the plan and which implementations can run here; run nothing")
    ap.add_argument("--group-by", choices=("op", "n"), default=None,
                    help="one worker per (op, N) ['op': one failure or leak cannot touch another op; the default "
                         "on a GPU] or per N for all ops ['n': fewer process starts; the default on a CPU]")
    ap.add_argument("--model-gpu", default=None,
                    help="store the cost model's figures for this GPU (h200, h100, a100, b200) beside each "
                         "measurement (benchmarks/cost_model.py); default: the device's GPU on cuda, none on "
                         "cpu; 'none' turns it off")
    ap.add_argument("--skip-done", nargs="+", metavar="JSON", default=None,
                    help="do not run the cases these earlier result files hold as ok (same op, implementation, "
                         "requested N, V, D, dtype, device): a rerun finishes what a time-boxed run left; "
                         "combine the files afterwards with --merge")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="combine earlier result files into one table, JSON and plot; run nothing")
    ap.add_argument("--profile", action="store_true",
                    help="profile mode: per (op, fusedloss backend) one first call, one timed call and one more "
                         "forward+backward under torch.profiler, whose kernels (launch count, total time, and "
                         "per family of passes) are stored in the record (mode 'profile'); without the float64 "
                         "reference unless --impls or --no-error say otherwise")
    ap.add_argument("--product-rates", action="store_true",
                    help="time the three products the plans assume (bf16 output; fp32 output of half operands; "
                         "a beta=1 accumulation into fp32 with a short K) and write them to <out>/<tag>.json; "
                         "runs nothing else")
    ap.add_argument("--gemm-warmup-s", type=float, default=None,
                    help="seconds of bf16 products before a worker's first timed round (GPU; default 2 for the "
                         "first worker of the run, 0.5 for the others)")
    ap.add_argument("--live-json", default=None, metavar="JSON",
                    help="also rewrite this file after every record: the --skip-done files' records and this run's, "
                         "one per case (a caller that is cut short keeps everything measured so far)")
    ap.add_argument("--no-plot", action="store_true", help="write no PNG (a caller that merges and plots later)")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _presets():
    from . import cases

    return cases.PRESETS


def availability(name: str, op: str, device: str, compile_mode: str = "default") -> Optional[str]:
    """None when ``name`` can be tried for ``op`` here, else why not. Decided without building a problem
    or importing a peer, so that what cannot run costs nothing."""
    from . import peers

    if name in ("reference", "reference+compile"):
        return None
    if name.startswith("fusedloss:"):
        import fusedloss

        backend = name.split(":", 1)[1]
        if backend == "auto":
            return None
        state = fusedloss.backend_status().get(backend)
        if state != "available":
            return f"{state}"
        if backend == "cuda" and device != "cuda":
            return "needs a CUDA device"
        if backend == "triton" and device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "needs a CUDA device"
        return None
    if name in peers.PEERS:
        if op not in peers.PEER_OPS.get(name, ()):
            return f"has no {op}"
        return peers.availability(name, device)
    return f"unknown implementation {name!r}"


def resolve_auto(device: str) -> str:
    import torch

    from fusedloss.core import registry

    return "fusedloss:" + registry.resolve("auto", torch.device(device))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(*args.worker)
        return 0
    import torch

    from . import cases

    if args.merge:
        records = dedupe(load_records(args.merge))
        if not records:
            print("no records in " + " ".join(args.merge), file=sys.stderr)
            return 2
        r0 = records[0]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        lines = []

        def mlog(msg):
            print(msg, flush=True)
            lines.append(msg)
        return finish(records, r0.get("env") or {k: r0.get(k) for k in ("gpu", "driver", "torch", "triton", "commit")},
                      out, args.tag or "bench-merged", r0.get("device", "cpu"), r0.get("dtype"), r0.get("V"),
                      r0.get("D"), mlog, lines, time.time())

    if args.product_rates:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        print(f"product rates on {device} ...", flush=True)
        rates = product_rates(device)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{args.tag or 'product-rates'}.json"
        path.write_text(json.dumps({"env": environment(device.type), "product_rates": rates}, indent=1))
        print(rates_table(rates) + f"\nwrote {path}", flush=True)
        return 1 if any(r["status"] == "failed" for r in rates) else 0

    if args.case in ("headline", "acceptance"):
        args.device = args.device or "cpu"
        args.shapes = "headline"
        args.ops = args.ops or ["token_logprobs"]
        args.impls = args.impls or ["reference", "fusedloss:torch", "trl"]
        args.dtype = args.dtype or "float32"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible", file=sys.stderr)
        return 2
    gpu = device == "cuda"
    shapes = args.shapes or ("llm" if gpu else "quick")
    preset = cases.PRESETS[shapes]
    ns = args.N or list(preset["N"])
    V, D = args.V or preset["V"], args.D or preset["D"]
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    ops = args.ops or list(cases.OPS)
    for op in ops:
        if op not in cases.ALL_OPS:
            print(f"unknown op {op!r}; expected some of {cases.ALL_OPS}", file=sys.stderr)
            return 2
    explicit = args.impls is not None
    impls = list(args.impls) if explicit else [i for i in ALL_IMPLS if i != "reference+compile"]
    if args.profile:  # fusedloss's backends, one timed call each, no float64 reference
        impls = impls if explicit else ["fusedloss:cuda", "fusedloss:triton"]
        args.no_error = True
        args.repeat = 1 if args.repeat is None else args.repeat
    if args.compile and "reference+compile" not in impls:
        impls.append("reference+compile")  # last in each group: it is the slowest to warm up
    for i in impls:
        if i not in ALL_IMPLS:
            print(f"unknown implementation {i!r}; expected some of {ALL_IMPLS}", file=sys.stderr)
            return 2
    quick = shapes == "quick" and not args.N
    warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    repeat = args.repeat if args.repeat is not None else (5 if gpu else 3)
    impl_budget = args.impl_budget_s if args.impl_budget_s is not None else (20.0 if gpu else 4.0 if quick else 15.0)
    group_timeout = args.group_timeout or (420.0 if gpu else 900.0)
    budget_s = args.budget_s if args.budget_s is not None else (90.0 if quick else None)

    model_gpu = args.model_gpu
    if model_gpu is None and gpu:
        model_gpu = gpu_model_key(torch.cuda.get_device_name(0))
        if model_gpu is None:
            print(f"the cost model has no figures for {torch.cuda.get_device_name(0)}: records carry no model "
                  "(--model-gpu h200 to compare with the H200's anyway)", file=sys.stderr)
    if model_gpu in ("none", ""):
        model_gpu = None
    if model_gpu is not None:
        from .model import cost

        if model_gpu not in cost.GPUS:
            print(f"--model-gpu must be one of {', '.join(cost.GPUS)} or none, got {model_gpu!r}", file=sys.stderr)
            return 2

    env = environment(device)
    if args.threads:
        env["threads"] = args.threads  # what the workers run with, not this process's default
    env["model_gpu"] = model_gpu
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = args.tag or f"bench-{device}-{dtype}-{stamp}"
    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    t_start = time.time()
    log(f"fusedloss bench: device={device} dtype={dtype} V={V} D={D} N={ns} ops={ops} (preset {shapes})"
        + (f"; cost model: {model_gpu}" if model_gpu else ""))
    log("env: " + json.dumps(env))

    # What can run here, decided before any problem is built.
    notes, unavailable, runnable = [], [], []
    if not explicit and "fusedloss:auto" in impls:
        picked = resolve_auto(device)
        if picked in impls and availability(picked, ops[0], device) is None:
            impls.remove("fusedloss:auto")
            notes.append(f"fusedloss:auto picks {picked.split(':')[1]} here (measured once, as {picked})")
    for name in impls:
        reasons = {op: availability(name, op, device, args.compile_mode) for op in ops}
        if all(r is not None for r in reasons.values()):
            reasons = {op: r for op, r in reasons.items() if not r.startswith("has no")} or reasons
            unavailable.append((name, next(iter(reasons.values()))))
            continue
        runnable.append((name, [op for op, r in reasons.items() if r is None]))
    if notes:
        log("; ".join(notes))
    records = []
    if unavailable:
        log("not run here: " + "; ".join(f"{n} ({r})" for n, r in unavailable))
        records += [{"kind": "result", "op": op, "impl": n, "N": ns[0], "V": V, "D": D, "dtype": dtype,
                     "device": device, "status": "unavailable", "reason": r}
                    for n, r in unavailable for op in ops]
    if args.list:
        for name, its_ops in runnable:
            log(f"  runs: {name:<18} {', '.join(its_ops)}")
        return 0

    deadline = t_start + budget_s if budget_s else None
    group_by = args.group_by or ("op" if gpu else "n")
    groups = plan_groups(ops, runnable, ns, group_by, gpu)
    if args.skip_done:
        done = done_cases(load_records([f for f in args.skip_done if Path(f).is_file()]), V, D, dtype, device,
                          mode="profile" if args.profile else None)
        before = sum(len(g["tasks"]) for g in groups)
        groups = [dict(g, tasks=[t for t in g["tasks"] if (t[0], t[1], g["N"]) not in done]) for g in groups]
        groups = [g for g in groups if g["tasks"]]
        log(f"--skip-done: {before - sum(len(g['tasks']) for g in groups)} case(s) already measured ok, not rerun")
    progress = Progress(groups, log, t_start)
    log(f"{progress.total_tasks} cases in {len(groups)} worker group(s)"
        + (f"; cases that would start after {budget_s:.0f} s are skipped" if deadline else ""))
    earlier = load_records([f for f in args.skip_done or () if Path(f).is_file()]) if args.live_json else []

    def on_record(rec):  # every record on disk as soon as it exists
        records.append(rec)
        mine = finalize(records, env, device, dtype)
        (out / f"{stem}.json").write_text(json.dumps(mine, indent=1))
        if args.live_json:
            Path(args.live_json).write_text(json.dumps(dedupe(earlier + mine), indent=1))

    for k, group in enumerate(groups):
        n, tasks = group["N"], group["tasks"]
        progress.n = n
        log(f"[{time.time() - t_start:.0f} s] starting a worker for N={n}: "
            + ", ".join(dict.fromkeys(op for op, _ in tasks)))
        warm_s = args.gemm_warmup_s if args.gemm_warmup_s is not None else (2.0 if k == 0 else 0.5)
        spec = {"N": n, "V": V, "D": D, "dtype": dtype, "device": device, "tasks": tasks,
                "warmup": warmup, "repeat": repeat, "impl_budget_s": impl_budget, "seed": args.seed,
                "no_error": args.no_error, "deadline": deadline, "threads": args.threads,
                "compile_mode": args.compile_mode, "min_repeat": 2 if quick else 1, "model_gpu": model_gpu,
                "count_slow_first": bool(quick and not gpu), "profile": args.profile,
                "gemm_warmup_s": warm_s if gpu else 0.0}
        if deadline and time.time() > deadline:
            records.extend(_failed(spec, op, i, "time budget of the run exhausted", "skipped") for op, i in tasks)
            progress.skip_group(n, tasks)
            continue
        # A group stops at most STOP_GRACE_S after the deadline; the case in flight then is recorded as
        # stopped by the budget (a time-boxed caller keeps a margin).
        budget_stop = bool(deadline) and deadline + STOP_GRACE_S - time.time() < group_timeout
        tmo = group_timeout if not budget_stop else max(10.0, deadline + STOP_GRACE_S - time.time())
        run_group_isolated(spec, tmo, log, progress, budget_stop=budget_stop, on_record=on_record)

    code = finish(records, env, out, stem, device, dtype, V, D, log, log_lines, t_start, draw=not args.no_plot)
    if quick and not args.case:
        log("The README's memory headline (N=4096, V=131072): python benchmarks/bench.py --case headline "
            "(6-7 minutes on 2 cores, most of it the float64 reference); more token counts: --shapes small")
    return code


def plan_groups(ops, runnable, ns, group_by, gpu=False):
    """Worker groups, in the order they run: for each N in the order given, every implementation of one op
    after the other (the reference first, then fusedloss's backends, then the peers, as ``runnable`` lists
    them), so that a time-boxed run gets whole ops, peers included; then the compiled reference (the slowest
    to warm up) for every N. ``runnable`` is ``[(impl, ops it can run)]``. ``group_by='op'``: one worker per
    (op, N), which builds that op's problem once for all its implementations and keeps a crash or a leak
    inside it (the default on a GPU); ``'n'``: one worker per N for all ops (fewer process starts). ``gpu``
    is kept for callers; both devices order the same way."""
    can = {name: set(its_ops) for name, its_ops in runnable}
    impls = [name for name, _ in runnable]
    groups = []
    phases = ([i for i in impls if i != "reference+compile"], [i for i in impls if i == "reference+compile"])
    for phase in phases:
        if not phase:
            continue
        for n in ns:
            per_op = [[(op, i) for i in phase if op in can[i]] for op in ops]
            per_op = [t for t in per_op if t]
            if not per_op:
                continue
            if group_by == "n":
                groups.append({"N": n, "tasks": [t for ts in per_op for t in ts]})
            else:
                groups.extend({"N": n, "tasks": ts} for ts in per_op)
    return groups


def done_cases(records, V, D, dtype, device, mode=None) -> set:
    """{(op, impl, requested N)} of the records measured ok at this V, D, dtype and device, in this mode
    (None: the benchmark; 'profile': the profile mode)."""
    return {(r["op"], r["impl"], r.get("N_requested", r["N"])) for r in records
            if r.get("status") == "ok" and r.get("V") == V and r.get("D") == D and r.get("dtype") == dtype
            and r.get("device") == device and r.get("mode") == mode}


def dedupe(records: list) -> list:
    """One record per (op, implementation, requested N, V, D, dtype, device, mode), in first-seen order: a
    measured one (ok) over any other, else the last one seen (a rerun's over a time-boxed run's skip)."""
    best, order = {}, []
    for r in records:
        k = (r.get("op"), r.get("impl"), r.get("N_requested", r.get("N")), r.get("V"), r.get("D"), r.get("dtype"),
             r.get("device"), r.get("mode"))
        if k not in best:
            order.append(k)
            best[k] = r
        elif r.get("status") == "ok" or best[k].get("status") != "ok":
            best[k] = r
    return [best[k] for k in order]


def load_records(paths):
    """The records of earlier result files."""
    records = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data if isinstance(data, list) else data.get("records", []):
            records.append(dict(r))
    return records


def finalize(records, env, device, dtype):
    """Records as written to JSON: every one carries the fields of the contract and the environment."""
    meta = {k: env.get(k) for k in ("gpu", "driver", "torch", "triton", "commit")}
    final = []
    for r in records:
        r = {k: v for k, v in r.items() if k != "kind"}
        r.setdefault("dtype", dtype)
        for k in ("fwd_bwd_ms", "fwd_ms", "bwd_ms", "extra_peak_mib", "max_rel_err") + MODEL_FIELDS:
            r.setdefault(k, None)
        final.append({**r, **{k: r.get(k, v) for k, v in meta.items()}, "device": r.get("device", device),
                      "env": r.get("env", env)})
    return final


def finish(records, env, out, stem, device, dtype, V, D, log, log_lines, t_start, draw=True):
    final = finalize(records, env, device, dtype)
    log("")
    line = unavailable_summary(final)
    if line:
        log(line)
    main_table = table(final)
    if main_table:
        log(main_table)
    prof = profile_table(final)
    if prof:
        log(prof)
    jpath = out / f"{stem}.json"
    jpath.write_text(json.dumps(final, indent=1))
    log(f"\nwrote {jpath}")
    shapes = sorted({(r.get("N_requested") or r["N"], r.get("V")) for r in final if _ok(r)}, reverse=True)
    vocab = (f"V={V}" if len({v for _, v in shapes}) <= 1
             else "V=" + ", ".join(f"{v} (N={n})" for n, v in shapes))
    title = f"fusedloss fwd+bwd, {dtype}, {vocab}, D={D}, {env.get('gpu') or env.get('cpu')} ({env.get('commit')})"
    why_not = plot(final, out / f"{stem}.png", title) if draw else "--no-plot"
    if why_not is None:
        log(f"wrote {out / (stem + '.png')}")
    else:
        log(f"no plot: {why_not}")
    log(f"total {time.time() - t_start:.0f}s")
    (out / f"{stem}.log").write_text("\n".join(log_lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
