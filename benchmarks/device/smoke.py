"""The first seconds of a device run: what the machine is, and one tiny forward+backward per backend.

    python -m benchmarks.device.smoke --out smoke.json                 # GPU: torch and triton backends
    python -m benchmarks.device.smoke --out cuda.json --backends cuda  # after the extension is built
    python -m benchmarks.device.smoke --out smoke.json --cpu           # no GPU: torch, Triton interpreter

Records the GPU (name, memory, SMs, compute capability), the driver and the clocks, power and throttle reasons
(``nvidia-smi``), the runtime the caller detected (``RUNTIME``, ``SANITIZER`` in the environment: under gVisor
compute-sanitizer cannot use the GPU), Python, torch, Triton and CUDA versions, ``fusedloss.backend_status()``,
and for each backend ``token_logprobs`` with entropy and its backward on N=64, V=1031, D=64 (CPU: N=16, V=257,
D=32) against benchmarks/cases.py's float64 reference. Fails loudly: a ``SMOKE FAILED`` line per failure; exit
status 2 when no GPU is usable (nothing else is worth running), 1 when a backend's call failed, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

QUERY = ("name", "driver_version", "memory.total", "clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw",
         "power.limit", "temperature.gpu", "pstate")


def nvidia_smi() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if out.returncode != 0:
        return {"error": (out.stdout + out.stderr).strip()[-300:]}
    first = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    return dict(zip(QUERY, (x.strip() for x in first.split(","))))


def tiny_call(backend: str, device, dtype, n: int = 64, v: int = 1031, d: int = 64) -> dict:
    """``token_logprobs`` with entropy and its backward, as benchmarks/cases.py poses it, against its float64
    reference (``cases.reference64``)."""
    import torch

    import fusedloss
    from benchmarks import cases
    from benchmarks.device import check_cases

    p = cases.make_problem("token_logprobs", n, v, d, dtype, device, seed=0)
    t0 = time.perf_counter()
    outs, grads = check_cases.run(fusedloss.token_logprobs, p, backend=backend)
    seconds = time.perf_counter() - t0
    errs = check_cases.errors(outs, grads, cases.reference64(p))["errors"]
    limit = 1e-4 if dtype == torch.float32 else 2e-2
    return {"ok": all(e <= limit for e in errs.values()), "errors": errs, "limit": limit,
            "seconds_with_compilation": round(seconds, 2), "dtype": str(dtype).replace("torch.", "")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="no GPU: the torch backend and the Triton interpreter")
    ap.add_argument("--backends", nargs="+", default=["torch", "triton"])
    ap.add_argument("--add", action="store_true", help="add these backends' calls to an existing --out report")
    args = ap.parse_args(argv)
    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    report = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "uname": platform.uname()._asdict(),
              "runtime": os.environ.get("RUNTIME"), "sanitizer_can_run": os.environ.get("SANITIZER") == "1",
              "python": platform.python_version(), "nvidia_smi": nvidia_smi(), "failures": []}
    path = Path(args.out)
    if args.add and path.is_file():  # e.g. the CUDA backend's call, once the extension is built
        earlier = json.loads(path.read_text())
        report = {**earlier, "failures": earlier.get("failures", []),
                  "nvidia_smi_after": report["nvidia_smi"], "tiny_calls": earlier.get("tiny_calls", {})}

    def fail(msg):
        report["failures"].append(msg)
        print(f"SMOKE FAILED: {msg}", flush=True)

    def write():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str))

    try:
        import torch
    except Exception as exc:
        fail(f"torch does not import: {exc}")
        write()
        return 2
    report.update(torch=torch.__version__, cuda=torch.version.cuda,
                  torch_has_linear_cross_entropy=hasattr(torch.nn.functional, "linear_cross_entropy"))
    try:
        import triton

        report["triton"] = triton.__version__
    except Exception as exc:
        report["triton"] = f"not importable: {exc}"
    gpu = torch.cuda.is_available() and not args.cpu
    if not args.cpu and not gpu:
        fail("torch sees no CUDA device")
        write()
        return 2
    if gpu:
        p = torch.cuda.get_device_properties(0)
        report.update(gpu=p.name, sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                      compute_capability=f"{p.major}.{p.minor}")
    try:
        import fusedloss

        report["backend_status"] = fusedloss.backend_status()
    except Exception as exc:
        fail(f"fusedloss does not import: {type(exc).__name__}: {exc}")
        write()
        return 1
    write()
    device = torch.device("cuda" if gpu else "cpu")
    report.setdefault("tiny_calls", {})
    for backend in args.backends:
        dtype = torch.bfloat16 if gpu else torch.float32
        try:
            rec = tiny_call(backend, device, dtype, *((64, 1031, 64) if gpu else (16, 257, 32)))
        except Exception as exc:
            rec = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        report["tiny_calls"][backend] = rec
        if not rec["ok"]:
            fail(f"backend {backend}: {rec.get('error') or rec['errors']}")
        else:
            print(f"smoke ok: backend {backend} ({rec['seconds_with_compilation']} s with its compilation, errors "
                  + ", ".join(f"{k} {e:.1e}" for k, e in rec["errors"].items()) + ")", flush=True)
        write()
    print(json.dumps({k: report.get(k) for k in ("gpu", "nvidia_smi", "runtime", "sanitizer_can_run", "torch",
                                                   "triton", "python")}, default=str), flush=True)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
