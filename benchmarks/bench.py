"""fusedloss benchmark: forward+backward time, peak extra memory and error of every implementation.

    python -m benchmarks.bench                              # CPU: fp32, the 'small' shapes, a few minutes
    python -m benchmarks.bench --device cuda                # GPU: bf16, D=4096, V=151936, N in {4096, 16384}
    python -m benchmarks.bench --case acceptance            # issue 2: CPU fp32 N=4096 V=131072 D=256
    python -m benchmarks.bench --list                       # the plan and what is available, nothing run

For each op (token_logprobs with entropy, cross_entropy, grpo_loss (dapo, beta 0.04 with ref),
dpo_loss, distillation_loss (beta 1)), each implementation and each shape, it measures:

- ``fwd_bwd_ms``: median wall time of forward + backward (CUDA events on GPU), after a warm-up call;
  ``first_call_ms`` is the first call (compilation, autotuning) and is not in the median.
- ``extra_peak_mib``: peak memory during one forward + backward, minus what was allocated before it
  (the inputs) and minus the gradients it returns. GPU: ``torch.cuda.max_memory_allocated``. CPU:
  the process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs before each
  run) minus the RSS before the run, in a worker process started with ``MALLOC_MMAP_THRESHOLD_`` fixed
  so that every large tensor is its own mapping and freed memory really leaves the process.
- ``max_rel_err``: the largest norm-wise relative error, over the outputs and the gradients with
  respect to hidden and weight, against ``fusedloss.reference`` in float64 on the same data
  (``errors`` has each one).

Each (op, N) group runs in its own worker process (``--isolate group``): a crash or a hang in one
implementation is recorded with its reason, and the group restarts for the implementations left.
Implementations that are unavailable are recorded with the reason; nothing stops the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

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
    "trl", "liger", "cce")
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
    method = "cuda_max_memory_allocated"

    def __init__(self):
        import torch

        self.torch = torch

    def start(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self.base = self.torch.cuda.memory_allocated()

    def peak_extra(self) -> float:
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated() - self.base


# ============================================================================ implementations
def make_impl(name: str, op: str, device, compile_mode: str = "default"):
    """(callable(problem, h, w) -> (loss, outputs), None) or (None, reason)."""
    from . import cases, peers

    if name == "reference" or name == "reference+compile":
        try:
            from fusedloss import reference as R
        except Exception as exc:
            return None, f"fusedloss.reference not importable: {exc}"
        fn = getattr(R, op)
        if name == "reference+compile":
            import torch

            fn = torch.compile(fn, mode=None if compile_mode == "default" else compile_mode, dynamic=False)
        return (lambda p, h, w: cases.call_op(fn, p, h, w)), None
    if name.startswith("fusedloss:"):
        backend = name.split(":", 1)[1]
        try:
            import fusedloss

            fn = getattr(fusedloss, op)
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


def _one_run(impl, p, device, mem=None):
    """One forward+backward. Returns (ms, outputs, grads, extra_bytes)."""
    import torch

    h, w = p.leaves()
    _sync(device)
    if mem is not None:
        mem.start()
    if device.type == "cuda":
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        loss, outs = impl(p, h, w)
        loss.backward()
        e1.record()
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1)
    else:
        t0 = time.perf_counter()
        loss, outs = impl(p, h, w)
        loss.backward()
        ms = (time.perf_counter() - t0) * 1e3
    extra = None
    grads = {"hidden": h.grad, "weight": w.grad}
    if mem is not None:
        extra = mem.peak_extra() - sum(g.numel() * g.element_size() for g in grads.values() if g is not None)
    return ms, outs, grads, extra


def run_group(spec: dict, emit) -> None:
    """Worker: the tasks ``spec['tasks']`` ([op, impl] pairs) at one N. Each op's problem (inputs and
    float64 reference) is built when the op changes, and freed before the next one is built."""
    import torch

    from . import cases

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
    p = ref_out = ref_grads = None
    shape = {}
    for op, name in spec["tasks"]:
        if p is None or p.op != op:
            p = ref_out = ref_grads = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            p = cases.make_problem(op, spec["N"], spec["V"], spec["D"], dtype, device, seed=spec.get("seed", 0))
            shape = {"N": p.N, "V": p.V, "D": p.D, "input_mib": round(p.input_bytes() / MIB, 1)}
            if not spec.get("no_error"):
                try:
                    ref_out, ref_grads = cases.reference64(p)
                except Exception as exc:
                    emit({"kind": "note", "op": op, "msg": f"float64 reference failed: {type(exc).__name__}: {exc}"})
            emit({"kind": "note", "op": op, "msg": f"problem ready in {time.perf_counter() - t0:.1f}s", **shape})
        rec = {"kind": "result", "op": op, "impl": name, **shape, "N_requested": spec["N"], "dtype": spec["dtype"],
               "device": device.type, "mem_method": mem.method}
        if deadline and time.time() > deadline:
            emit({**rec, "status": "skipped", "reason": "time budget of the run exhausted"})
            continue
        impl, why = make_impl(name, op, device, spec.get("compile_mode", "default"))
        if impl is None:
            emit({**rec, "status": "unavailable", "reason": why})
            continue
        emit({"kind": "start", "op": op, "impl": name})
        if os.environ.get("FUSEDLOSS_BENCH_CRASH") == name:  # self-test of the crash recovery
            os._exit(3)
        try:
            t1 = time.perf_counter()
            first_ms, _, _, _ = _one_run(impl, p, device)
            rec["first_call_ms"] = round((time.perf_counter() - t1) * 1e3, 2)
            # repeats: as many as fit in the per-implementation time budget, at least one
            budget_ms = spec.get("impl_budget_s", 60) * 1e3
            reps = max(1, min(spec["repeat"], int(budget_ms / max(first_ms, 1e-3))))
            for _ in range(max(0, spec["warmup"] - 1)):
                if first_ms * reps > budget_ms:
                    break
                _one_run(impl, p, device)
            times, extras = [], []
            outs = grads = None
            for _ in range(reps):
                outs = grads = None
                ms, outs, grads, extra = _one_run(impl, p, device, mem)
                times.append(ms)
                extras.append(extra)
            times.sort()
            rec.update(status="ok", fwd_bwd_ms=round(times[len(times) // 2], 3),
                       fwd_bwd_ms_min=round(times[0], 3), repeats=len(times),
                       extra_peak_mib=round(max(extras) / MIB, 2) if extras else None)
            if ref_out is not None:
                errs = {}
                for k, ref in ref_out.items():
                    errs[k] = cases.rel_err(outs.get(k), ref)
                for k, ref in ref_grads.items():
                    errs["grad_" + k] = cases.rel_err(grads.get(k), ref)
                rec["errors"] = {k: float(f"{v:.3e}") for k, v in errs.items()}
                rec["max_rel_err"] = float(f"{max(errs.values()):.3e}")
            else:
                rec["max_rel_err"] = None
            del outs, grads
        except Exception as exc:
            rec.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:400]}",
                       traceback=traceback.format_exc()[-2000:])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        emit(rec)


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
            "dtype": spec["dtype"], "device": spec["device"], "status": status, "reason": reason}


def run_group_isolated(spec: dict, timeout_s: float, log) -> list:
    """Run a group's tasks in worker processes; on a crash or a timeout, record the task in flight as
    failed and restart the worker with the tasks left."""
    results = []
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
                    elif obj["kind"] == "result":
                        done.add((obj["op"], obj["impl"]))
                        in_flight = None
                        results.append(obj)
                        log(_progress_line(obj))
                    elif obj["kind"] == "note":
                        log(f"    [{obj.get('op')} N={spec['N']}] {obj['msg']}")
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
                    results.append(_failed(spec, *t, "worker failed: " + failed_all))
            return results
        left = [t for t in tasks if t not in done]
        if not left:
            break
        if rc == "timeout":
            # the group's time is spent: the task in flight timed out, the rest are skipped
            why = f"worker timed out after {timeout_s:.0f}s"
            hung = in_flight or left[0]
            for t in left:
                rec = _failed(spec, *t, why) if t == hung else _failed(spec, *t, "not run: " + why, "skipped")
                results.append(rec)
                log(_progress_line(rec))
            break
        crashed = in_flight or left[0]
        rec = _failed(spec, *crashed, f"worker died (rc={rc}): " + tail.strip()[-600:])
        results.append(rec)
        log(_progress_line(rec))
        tasks = [t for t in left if t != crashed]
    return results


def _progress_line(r: dict) -> str:
    head = f"  {r['op']:<18} N={r['N']:<6} {r['impl']:<18}"
    if r.get("status") != "ok":
        return f"{head} {r.get('status', '?').upper()}: {str(r.get('reason'))[:160]}"
    err = r.get("max_rel_err")
    return (f"{head} {r['fwd_bwd_ms']:>10.1f} ms  {r['extra_peak_mib']:>9.1f} MiB extra  "
            f"err {err if err is None else f'{err:.1e}'}  (first call {r.get('first_call_ms', 0):.0f} ms)")


def table(records: list) -> str:
    rows = [("op", "N", "impl", "ms", "x ref", "extra MiB", "x ref", "max rel err", "status")]
    key = lambda r: (r["op"], r["N"])
    refs = {key(r): r for r in records if r["impl"] == "reference" and r.get("status") == "ok"}
    order = {op: i for i, op in enumerate(("token_logprobs", "cross_entropy", "grpo_loss", "dpo_loss",
                                           "distillation_loss"))}
    rank = {impl: i for i, impl in enumerate(ALL_IMPLS)}
    records = sorted(records, key=lambda r: (order.get(r["op"], 99), r["N"], rank.get(r["impl"], 99)))
    for r in records:
        ref = refs.get(key(r))
        if r.get("status") == "ok":
            tr = f"{r['fwd_bwd_ms'] / ref['fwd_bwd_ms']:.2f}" if ref else "-"
            mr = (f"{r['extra_peak_mib'] / ref['extra_peak_mib']:.3f}"
                  if ref and ref.get("extra_peak_mib") else "-")
            err = r.get("max_rel_err")
            rows.append((r["op"], str(r["N"]), r["impl"], f"{r['fwd_bwd_ms']:.1f}", tr,
                         f"{r['extra_peak_mib']:.1f}", mr, "-" if err is None else f"{err:.2e}", "ok"))
        else:
            rows.append((r["op"], str(r["N"]), r["impl"], "", "", "", "", "",
                         f"{r.get('status')}: {str(r.get('reason'))[:70]}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for row in rows:
        out.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                   + "  " + row[-1])
    return "\n".join(out)


def plot(records: list, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    ok = [r for r in records if r.get("status") == "ok"]
    if not ok:
        return False
    ops = [o for o in dict.fromkeys(r["op"] for r in ok)]
    rank = {impl: i for i, impl in enumerate(ALL_IMPLS)}
    impls = sorted(dict.fromkeys(r["impl"] for r in ok), key=lambda i: rank.get(i, 99))
    colors = {impl: plt.get_cmap("tab10")(k % 10) for k, impl in enumerate(impls)}
    fig, axes = plt.subplots(2, len(ops), figsize=(4.2 * len(ops), 7.5), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for j, op in enumerate(ops):
        ns = sorted(set(r["N"] for r in ok if r["op"] == op))  # GRPO/DPO round N to whole sequences
        for row, (field, label) in enumerate((("fwd_bwd_ms", "fwd+bwd ms"), ("extra_peak_mib", "extra peak MiB"))):
            ax = axes[row][j]
            for k, impl in enumerate(impls):
                xs, ys = [], []
                for i, n in enumerate(ns):
                    r = next((r for r in ok if r["op"] == op and r["impl"] == impl and r["N"] == n), None)
                    if r is not None and r.get(field) is not None and r[field] > 0:
                        xs.append(i + (k - (len(impls) - 1) / 2) * width)
                        ys.append(r[field])
                if xs:
                    ax.bar(xs, ys, width, color=colors[impl], label=impl)
            ax.set_yscale("log")
            ax.set_xticks(range(len(ns)))
            ax.set_xticklabels([f"N={n}" for n in ns])
            ax.set_title(f"{op}" if row == 0 else "")
            if j == 0:
                ax.set_ylabel(label)
            ax.grid(axis="y", alpha=0.3, which="both")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[i]) for i in impls]
    fig.legend(handles, impls, loc="lower center", ncol=min(len(impls), 9), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--ops", nargs="+", default=None, help="default: all five ops")
    ap.add_argument("--impls", nargs="+", default=None,
                    help=f"subset of {', '.join(ALL_IMPLS)} (default: all but reference+compile; "
                         "add it with --compile)")
    ap.add_argument("--shapes", choices=("tiny", "small", "llm", "acceptance"), default=None,
                    help="default: small on cpu, llm on cuda")
    ap.add_argument("--N", nargs="+", type=int, default=None, help="override the preset's token counts")
    ap.add_argument("--V", type=int, default=None)
    ap.add_argument("--D", type=int, default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--case", choices=("acceptance",), default=None,
                    help="acceptance: issue 2 (cpu, fp32, N=4096, V=131072, D=256, token_logprobs+entropy, "
                         "reference vs fusedloss:torch)")
    ap.add_argument("--compile", action="store_true", help="also time the reference under torch.compile")
    ap.add_argument("--compile-mode", default="default")
    ap.add_argument("--warmup", type=int, default=None, help="calls before timing (the first call included)")
    ap.add_argument("--repeat", type=int, default=None, help="timed calls (median reported)")
    ap.add_argument("--impl-budget-s", type=float, default=None, help="fewer repeats when a call is slow")
    ap.add_argument("--group-timeout", type=float, default=None, help="seconds per (op, N) worker")
    ap.add_argument("--budget-s", type=float, default=None, help="whole run: later cases skipped past it")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in the workers")
    ap.add_argument("--no-error", action="store_true", help="skip the float64 reference")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"), help="folder for JSON, PNG, log")
    ap.add_argument("--tag", default=None, help="file name stem (default bench-<device>-<dtype>-<time>)")
    ap.add_argument("--list", "--dry-run", dest="list", action="store_true",
                    help="print the plan and which implementations can run here; run nothing")
    ap.add_argument("--group-by", choices=("op", "n"), default=None,
                    help="one worker per (op, N) ['op', cpu default] or per N ['n', cuda default]")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="combine earlier result files into one table, JSON and plot; run nothing")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(*args.worker)
        return 0
    import torch

    from . import cases

    if args.merge:
        records = load_records(args.merge)
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

    if args.case == "acceptance":
        args.device = args.device or "cpu"
        args.shapes = "acceptance"
        args.ops = args.ops or ["token_logprobs"]
        args.impls = args.impls or ["reference", "fusedloss:torch"]
        args.dtype = args.dtype or "float32"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible", file=sys.stderr)
        return 2
    gpu = device == "cuda"
    preset = cases.PRESETS[args.shapes or ("llm" if gpu else "small")]
    ns = args.N or list(preset["N"])
    V, D = args.V or preset["V"], args.D or preset["D"]
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    ops = args.ops or list(cases.OPS)
    for op in ops:
        if op not in cases.OPS:
            print(f"unknown op {op!r}; expected some of {cases.OPS}", file=sys.stderr)
            return 2
    impls = args.impls or [i for i in ALL_IMPLS if i != "reference+compile"]
    if args.compile and "reference+compile" not in impls:
        impls.append("reference+compile")  # last in each group: it is the slowest to warm up
    for i in impls:
        if i not in ALL_IMPLS:
            print(f"unknown implementation {i!r}; expected some of {ALL_IMPLS}", file=sys.stderr)
            return 2
    warmup = args.warmup if args.warmup is not None else (2 if gpu else 1)
    repeat = args.repeat if args.repeat is not None else (5 if gpu else 3)
    impl_budget = args.impl_budget_s if args.impl_budget_s is not None else (20.0 if gpu else 15.0)
    group_timeout = args.group_timeout or (420.0 if gpu else 900.0)

    env = environment(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem = args.tag or f"bench-{device}-{dtype}-{stamp}"
    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    log(f"fusedloss bench: device={device} dtype={dtype} V={V} D={D} N={ns} ops={ops}")
    log("env: " + json.dumps(env))
    if args.list:
        from . import peers

        dev = torch.device(device)
        for op in ops:
            for name in impls:
                impl, why = make_impl(name, op, dev, args.compile_mode)
                log(f"  {op:<18} {name:<18} {'runs' if impl is not None else 'unavailable: ' + str(why)}")
        return 0

    deadline = time.time() + args.budget_s if args.budget_s else None
    records = []
    t_start = time.time()
    group_by = args.group_by or ("n" if gpu else "op")
    for group in plan_groups(ops, impls, ns, group_by):
        n, tasks = group["N"], group["tasks"]
        spec = {"N": n, "V": V, "D": D, "dtype": dtype, "device": device, "tasks": tasks,
                "warmup": warmup, "repeat": repeat, "impl_budget_s": impl_budget, "seed": args.seed,
                "no_error": args.no_error, "deadline": deadline, "threads": args.threads,
                "compile_mode": args.compile_mode}
        log(f"[{time.time() - t_start:7.1f}s] N={n}: " + ", ".join(sorted(set(op for op, _ in tasks)))
            + f" ({len(tasks)} runs)")
        if deadline and time.time() > deadline:
            records.extend(_failed(spec, op, i, "time budget of the run exhausted", "skipped") for op, i in tasks)
            continue
        # a group may overrun the deadline by one task, not more (a time-boxed caller keeps a margin)
        tmo = group_timeout if not deadline else max(20.0, min(group_timeout, deadline - time.time() + 30))
        records.extend(run_group_isolated(spec, tmo, log))
        # checkpoint: a caller that kills this run still finds every finished record
        (out / f"{stem}.json").write_text(json.dumps(finalize(records, env, device, dtype), indent=1))

    return finish(records, env, out, stem, device, dtype, V, D, log, log_lines, t_start)


def plan_groups(ops, impls, ns, group_by):
    """Worker groups, in the order they run: the reference and fusedloss's backends for every op and N
    (smallest N first), then the peers (Liger's first call compiles), then the compiled reference (the
    slowest to warm up), so a time-boxed run gets the core numbers first. ``group_by='op'``: one worker per (op, N) (cleanest memory
    numbers); ``'n'``: one worker per N for all ops (fewer process starts; the GPU default)."""
    from .peers import PEER_OPS

    def runs(op, impl):
        return impl not in PEER_OPS or op in PEER_OPS[impl]

    groups = []
    phases = ([i for i in impls if i != "reference+compile" and i not in PEER_OPS],  # ours and the reference
              [i for i in impls if i in PEER_OPS],                                  # peers (Liger compiles)
              [i for i in impls if i == "reference+compile"])
    for phase in phases:
        if not phase:
            continue
        for n in ns:
            per_op = [[(op, i) for i in phase if runs(op, i)] for op in ops]
            per_op = [t for t in per_op if t]
            if group_by == "n":
                groups.append({"N": n, "tasks": [t for ts in per_op for t in ts]})
            else:
                groups.extend({"N": n, "tasks": ts} for ts in per_op)
    return groups


def load_records(paths):
    records = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        records.extend(data if isinstance(data, list) else data.get("records", []))
    return records


def finalize(records, env, device, dtype):
    """Records as written to JSON: every one carries the fields of the contract and the environment."""
    meta = {k: env.get(k) for k in ("gpu", "driver", "torch", "triton", "commit")}
    final = []
    for r in records:
        r = {k: v for k, v in r.items() if k != "kind"}
        r.setdefault("dtype", dtype)
        for k in ("fwd_bwd_ms", "extra_peak_mib", "max_rel_err"):
            r.setdefault(k, None)
        final.append({**r, **{k: r.get(k, v) for k, v in meta.items()}, "device": r.get("device", device),
                      "env": r.get("env", env)})
    return final


def finish(records, env, out, stem, device, dtype, V, D, log, log_lines, t_start):
    final = finalize(records, env, device, dtype)
    log("")
    log(table(final))
    jpath = out / f"{stem}.json"
    jpath.write_text(json.dumps(final, indent=1))
    log(f"\nwrote {jpath}")
    title = f"fusedloss fwd+bwd, {dtype}, V={V}, D={D}, {env.get('gpu') or env.get('cpu')} ({env['commit']})"
    if plot(final, out / f"{stem}.png", title):
        log(f"wrote {out / (stem + '.png')}")
    (out / f"{stem}.log").write_text("\n".join(log_lines) + "\n")
    log(f"total {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
