"""Every backend on the benchmark's cases against its float64 reference, beside the naive same-dtype path.

    python -m benchmarks.device.check_cases --out cases.json                       # a CUDA GPU, bf16
    python -m benchmarks.device.check_cases --out cases.json --dry-run             # the CPU, fp16, tiny shapes

For each op of ``benchmarks/cases.py`` (its inputs, ``make_problem``) the float64 truth is ``cases.reference64``,
computed once, and the naive path is ``fusedloss.reference`` in the inputs' dtype (what a plain trainer computes).
Each implementation's outputs and gradients of ``hidden`` and ``weight`` are measured against the truth
(``cases.rel_err``, the largest over outputs and gradients): ``fusedloss:torch``, ``fusedloss:triton``,
``fusedloss:cuda`` and ``fusedloss:cuda+epilogue`` (``FUSEDLOSS_CUDA_EPILOGUE=1``: the sm_90a kernels, where the
extension carries them). The verdict: bf16/fp16 no worse than the naive path + 2e-3, fp32 within max(1e-5, 4x the
naive error). A backend that cannot run here is recorded with its reason and ``ok`` None, neither passed nor
failed. ``--dry-run``: the CUDA backend's kernels through their host twins (csrc/host.cpp; the epilogue's,
csrc/epilogue_host.cpp, compiled here) on CPU tensors, Triton through its interpreter, in fp16 by default (half
operands, as the GPU's bf16: the epilogue path serves only those, and the interpreter cannot multiply bf16). The
JSON is rewritten after every record, so a run stopped at its box keeps what it checked; exit status 1 when a check
failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # before the first use of the Triton kernels
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from benchmarks import cases  # noqa: E402
from benchmarks.device import epilogue_stand_in  # noqa: E402

IMPLS = ("fusedloss:torch", "fusedloss:triton", "fusedloss:cuda", "fusedloss:cuda+epilogue")
EPILOGUE_ENV = "FUSEDLOSS_CUDA_EPILOGUE"
HALF_SLACK = 2e-3


def limit(naive: float, dtype: torch.dtype) -> float:
    """The verdict's bound: bf16/fp16 no worse than the naive path plus 2e-3; fp32 within max(1e-5, 4x naive)."""
    return max(1e-5, 4 * naive) if dtype == torch.float32 else naive + HALF_SLACK


def errors(outs: dict, grads: dict, ref) -> dict:
    """Each output's and gradient's error against the float64 truth, and the largest (bench.py's record fields)."""
    ref_out, ref_grads = ref
    errs = {k: cases.rel_err(outs.get(k), r) for k, r in ref_out.items()}
    errs.update({"grad_" + k: cases.rel_err(grads.get(k), r) for k, r in ref_grads.items()})
    return {"errors": {k: float(f"{v:.3e}") for k, v in errs.items()}, "max_rel_err": max(errs.values())}


def run(fn, p: cases.Problem, **extra):
    """One forward (and backward, where the op has a gradient) of ``fn`` on the problem: (outputs, gradients)."""
    h, w = p.leaves()
    loss, outs = cases.call_op(fn, p, h, w, **extra)
    if p.op != "topk_logprobs":
        loss.backward()
    if p.device.type == "cuda":
        torch.cuda.synchronize()
    return outs, {"hidden": h.grad, "weight": w.grad}


# The epilogue path's entry points, counted: the record says which path ran.
EPILOGUE_CALLS = epilogue_stand_in.CALLS


class Backends:
    """What each implementation needs to run here, and why it cannot. On the CPU (dry run) the CUDA backend runs its
    host twins: the public API's refusal of backend='cuda' on CPU tensors is routed to them, and the epilogue's
    launches go to the twins of csrc/epilogue_host.cpp."""

    def __init__(self, device: torch.device, dry: bool):
        self.device, self.dry, self.twins = device, dry, None

    def unavailable(self, impl: str) -> str | None:
        from fusedloss.backends.cuda import backend as cuda
        from fusedloss.backends.cuda import epilogue
        from fusedloss.core import registry

        name = impl.split(":")[1].split("+")[0]
        if name != "cuda":
            state = registry.availability(name)
            return None if state == "available" else state
        if self.dry:
            if not cuda.extension_built():
                return f"the CUDA extension is not built: {cuda.availability()}"
            if impl.endswith("+epilogue") and self.twins is None:
                try:
                    twins = epilogue_stand_in.HostTwins
                    self.twins = twins(twins.compile(Path(tempfile.mkdtemp(prefix="epilogue-twins-"))))
                except Exception as exc:  # no host compiler
                    return f"the epilogue's host twins: {type(exc).__name__}: {exc}"
            return None
        if cuda.availability() != "available":
            return cuda.availability()
        return epilogue.unavailable(self.device) if impl.endswith("+epilogue") else None

    @contextlib.contextmanager
    def use(self, impl: str):
        from fusedloss.backends.cuda import epilogue
        from fusedloss.core import registry

        old_env, old_resolve, old_kernels = os.environ.get(EPILOGUE_ENV), registry.resolve, epilogue._KERNELS_OVERRIDE
        if impl.startswith("fusedloss:cuda"):
            os.environ[EPILOGUE_ENV] = "1" if impl.endswith("+epilogue") else "0"
            if self.dry:
                registry.resolve = lambda b, *rest: "cuda" if b == "cuda" else old_resolve(b, *rest)
                if impl.endswith("+epilogue"):
                    epilogue._KERNELS_OVERRIDE = self.twins
        try:
            yield impl.split(":")[1].split("+")[0]
        finally:
            registry.resolve, epilogue._KERNELS_OVERRIDE = old_resolve, old_kernels
            if old_env is None:
                os.environ.pop(EPILOGUE_ENV, None)
            else:
                os.environ[EPILOGUE_ENV] = old_env


def check_op(op: str, n: int, v: int, d: int, dtype: torch.dtype, device: torch.device, impls, backends: Backends,
             deadline: float, add) -> None:
    """One op: its problem, its float64 truth and naive path once, then every implementation against them."""
    import fusedloss

    shape = {"op": op, "N": n, "V": v, "D": d, "dtype": str(dtype).replace("torch.", "")}
    t0 = time.monotonic()
    p = cases.make_problem(op, n, v, d, dtype, device, seed=0)
    shape["N"] = p.N  # the sequence ops round N to whole sequences
    ref = cases.reference64(p)
    naive = errors(*run(cases.reference_function(op), p), ref)
    add({**shape, "impl": "reference", "status": "ok", **naive, "seconds": round(time.monotonic() - t0, 2)})
    fn = getattr(fusedloss, cases.FUNCTION.get(op, op))
    for impl in impls:
        rec = {**shape, "impl": impl}
        why = backends.unavailable(impl)
        if why:
            add({**rec, "status": "unavailable", "reason": why, "ok": None})
            continue
        if time.monotonic() > deadline:
            add({**rec, "status": "skipped", "reason": "the budget", "ok": False})
            continue
        t0 = time.monotonic()
        before = dict(EPILOGUE_CALLS)
        try:
            with backends.use(impl) as backend:
                got = errors(*run(fn, p, backend=backend), ref)
        except Exception as exc:  # record and go on: one failure must not hide the others
            add({**rec, "status": "failed", "error": f"{type(exc).__name__}: {str(exc)[:500]}", "ok": False})
            continue
        bound = limit(naive["max_rel_err"], dtype)
        if impl.startswith("fusedloss:cuda"):  # which path ran: the epilogue's entry points, counted
            rec["epilogue_calls"] = {k: EPILOGUE_CALLS[k] - before[k] for k in EPILOGUE_CALLS}
        add({**rec, "status": "ok", **got, "err_vs_float64": got["max_rel_err"],
             "naive_err_vs_float64": naive["max_rel_err"], "limit": bound, "ok": got["max_rel_err"] <= bound,
             "seconds": round(time.monotonic() - t0, 2)})
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON report (rewritten after every record)")
    ap.add_argument("--dry-run", action="store_true", help="the CPU: tiny shapes, fp16, the kernels' host twins")
    ap.add_argument("--ops", nargs="+", default=list(cases.OPS), choices=cases.ALL_OPS)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--N", type=int, default=None, help="tokens (default 1024; dry run 24)")
    ap.add_argument("--V", type=int, default=None, help="vocabulary (default 151936; dry run 509)")
    ap.add_argument("--D", type=int, default=None, help="hidden size (default 1024; dry run 16)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (dry run float16)")
    ap.add_argument("--budget-s", type=float, default=60.0, help="start no implementation after this many seconds")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: --dry-run is the CPU mode", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    n, v, d = args.N or (24 if dry else 1024), args.V or (509 if dry else 151936), args.D or (16 if dry else 1024)
    dtype = getattr(torch, args.dtype or ("float16" if dry else "bfloat16"))
    torch.backends.cuda.matmul.allow_tf32 = False
    deadline = time.monotonic() + args.budget_s
    report = {"device": torch.cuda.get_device_name() if not dry else "cpu (host twins, triton interpreter)",
              "dry_run": dry, "records": [], "complete": False}

    def write():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))

    def add(rec):
        report["records"].append(rec)
        write()
        what = rec.get("error") or rec.get("reason") or (
            f"err {rec['max_rel_err']:.2e}" + (f" <= {rec['limit']:.2e}" if "limit" in rec else ""))
        verdict = {True: "ok  ", False: "FAIL", None: "--  "}[rec.get("ok", True)]
        print(f"{verdict} {rec['op']:<18} {rec['impl']:<24} N={rec['N']} V={rec['V']} {rec['dtype']}: {what}",
              flush=True)

    backends = Backends(device, dry)
    from fusedloss.backends.cuda import epilogue

    epilogue_stand_in.count_calls(epilogue)
    for op in args.ops:
        if time.monotonic() > deadline:
            for impl in ("reference", *args.impls):
                add({"op": op, "impl": impl, "N": n, "V": v, "D": d, "dtype": str(dtype)[6:], "status": "skipped",
                     "reason": "the budget", "ok": False})
            continue
        try:
            check_op(op, n, v, d, dtype, device, args.impls, backends, deadline, add)
        except Exception as exc:  # the problem or its reference failed
            add({"op": op, "impl": "reference", "N": n, "V": v, "D": d, "dtype": str(dtype)[6:], "status": "failed",
                 "error": f"{type(exc).__name__}: {str(exc)[:500]}", "ok": False})
    report["complete"] = True
    report["ok"] = all(r.get("ok") is not False for r in report["records"])
    write()
    checked = [r for r in report["records"] if r.get("ok") is not None and r["impl"] != "reference"]
    print(f"cases: {sum(r['ok'] is True for r in checked)} ok, {sum(r['ok'] is False for r in checked)} not ok"
          + "".join(f"; unavailable: {r['impl']}" for r in report["records"][: len(args.impls) + 1]
                    if r.get("status") == "unavailable"), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
