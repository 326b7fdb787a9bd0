"""A small, fast forward+backward of every op on awkward shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck python benchmarks/sanitize_smoke.py --device cuda
    python benchmarks/sanitize_smoke.py --device cpu --backends torch          # the dry run

Shapes: N = 1 and odd N, prime V (never a multiple of a tile), rows whose target is ignored, fp32 and
bf16. Each result is compared loosely with ``fusedloss.reference`` (in float64) and must be finite; the
point is that memcheck sees every kernel path once, not the precision (tests/ judges that).
Exit status 1 when any case fails.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import cases  # noqa: E402

SHAPES = ((1, 1009, 64), (37, 4099, 96), (130, 32003, 64))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", nargs="+", default=None, help="default: triton and cuda where available")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--ops", nargs="+", default=list(cases.OPS))
    args = ap.parse_args(argv)

    import fusedloss
    from fusedloss import reference

    status = fusedloss.backend_status()
    backends = args.backends or [b for b in ("triton", "cuda") if status.get(b) == "available"]
    print("backend_status:", status, "-> running", backends, flush=True)
    if not backends:
        print("no backend to check", flush=True)
        return 0
    failures = 0
    for backend in backends:
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            for n, v, d in SHAPES:
                for op in args.ops:
                    tag = f"{backend:<7} {dt:<9} {op:<18} N={n:<4} V={v:<6} D={d:<3}"
                    try:
                        p = cases.make_problem(op, n, v, d, dtype, args.device, seed=3)
                        if op == "cross_entropy":
                            p.t["targets"][::3] = cases.IGNORE  # ignored rows, incl. row 0
                        h, w = p.leaves()
                        loss, _ = cases.call_op(getattr(fusedloss, op), p, h, w, backend=backend)
                        loss.backward()
                        if args.device == "cuda":
                            torch.cuda.synchronize()
                        p64 = cases.Problem(p.op, p.N, p.V, p.D, torch.float64, p.device,
                                            {k: (x.double() if x.is_floating_point() else x) for k, x in p.t.items()})
                        h64, w64 = p64.leaves()
                        ref, _ = cases.call_op(getattr(reference, op), p64, h64, w64)
                        ref.backward()
                        errs = [cases.rel_err(loss, ref.detach()), cases.rel_err(h.grad, h64.grad),
                                cases.rel_err(w.grad, w64.grad)]
                        tol = 1e-3 if dtype == torch.float32 else 5e-2
                        ok = all(e <= tol for e in errs)
                        failures += not ok
                        print(f"{'ok  ' if ok else 'FAIL'} {tag} err loss/dh/dw = "
                              + " ".join(f"{e:.1e}" for e in errs), flush=True)
                    except Exception as exc:
                        failures += 1
                        print(f"FAIL {tag} {type(exc).__name__}: {exc}", flush=True)
                        traceback.print_exc(limit=3)
    print(f"{failures} failure(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
