"""A small, fast forward+backward of every op on awkward shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck python -m benchmarks.device.sanitize_smoke --device cuda
    compute-sanitizer --tool racecheck python -m benchmarks.device.sanitize_smoke --tiles --device cuda
    python -m benchmarks.device.sanitize_smoke --device cpu --backends torch          # the dry run
    python -m benchmarks.device.sanitize_smoke --tiles --device cpu                   # the tiles' dry run (host twins)

Shapes: N = 1 and odd N, prime V (never a multiple of a tile), rows whose target is ignored, fp32 and
bf16. Each result is compared loosely with benchmarks/cases.py's float64 reference and must be finite; the
point is that memcheck sees every kernel path once, not the precision (tests/ judges that).

``--tiles``: the CUDA backend's own kernels only, on tiny multi-tile problems, so that racecheck (slow:
it instruments every shared-memory access) covers each variant of the fold kernel's and the JSD kernel's
block reductions (with and without entropy, with and without a teacher; fp32 and bf16 tiles) and the dx
kernel's outputs (fp32 in place, bf16, fp16) in seconds, next to a handful of tiny cuBLAS products.
Exit status 1 when any case fails.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

from benchmarks import cases

SHAPES = ((1, 1009, 64), (37, 4099, 96), (130, 32003, 64))


def tiles(device: str) -> int:
    """Every kernel variant of the CUDA backend once, through the backend on tiles of 8 rows x 512 columns
    (several vocabulary tiles: the running-state merges; several row chunks: row offsets), against the
    torch backend. Returns the number of failures."""
    import math

    from fusedloss.backends import torch as torch_backend
    from fusedloss.backends.cuda import backend as cuda
    from fusedloss.core.grad_in_forward import formed
    from fusedloss.core.problem import GradientNeeds, LogitTransform, StatsProblem

    failures = 0
    g = torch.Generator().manual_seed(0)
    n, v, d = 19, 1031, 32
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for entropy, teacher, jsd in ((False, False, False), (True, False, False), (False, True, False),
                                      (True, True, True)):
            h = torch.randn(n, d, generator=g)
            w = torch.randn(v, d, generator=g) / math.sqrt(d)
            y = torch.randint(0, v, (n,), generator=g)
            y[::5] = -1
            kw = {}
            if teacher:
                kw = dict(teacher_hidden=torch.randn(n, d, generator=g).to(device, dtype),
                          teacher_weight=(torch.randn(v, d, generator=g) / math.sqrt(d)).to(device, dtype),
                          want_kl_rev=True, want_kl_fwd=True, jsd_beta=0.3 if jsd else None)
            p = StatsProblem(hidden=h.to(device, dtype), weight=w.to(device, dtype),
                             bias=torch.randn(v, generator=g).to(device, dtype), targets=y.to(device),
                             transform=LogitTransform(0.9, 1.1, 30.0), want_entropy=entropy, want_mean_logit=True,
                             want_extras=True, **kw)
            coeffs = torch.randn(7, n, generator=g).to(device)
            coeffs[:, y < 0] = 0
            needs = GradientNeeds(True, True, True)
            tag = f"tiles {str(dtype)[6:]:<9} entropy={entropy:d} teacher={teacher:d} jsd={jsd:d}"
            try:
                with cuda.override_plan(tile_rows=8, tile_cols=512, grad_in_forward_rows=8):
                    stats = cuda.forward_statistics(p)
                    grads = cuda.backward_gradients(p, stats, coeffs, needs)
                    _, grad_in_forward = cuda.grad_in_forward_gradients(p, lambda st, rows: (st.lse.sum(),
                                                                                             coeffs[:, rows]), needs)
                    grad_in_forward = formed(grad_in_forward)  # a deferred d weight formed at grad 1
                if device == "cuda":
                    torch.cuda.synchronize()
                want = torch_backend.forward_statistics(p)
                errs = [cases.rel_err(stats.lse, want.lse.double())]
                errs += [cases.rel_err(a.float(), b.float().double()) for a, b in zip(grads, grad_in_forward)]
                ok = all(e <= (1e-4 if dtype == torch.float32 else 3e-2) for e in errs)
            except Exception as exc:
                ok, errs = False, []
                print(f"FAIL {tag} {type(exc).__name__}: {exc}", flush=True)
            failures += not ok
            errors = " ".join(f"{e:.1e}" for e in errs)
            print(f"{'ok  ' if ok else 'FAIL'} {tag} lse / backward-vs-grad-in-forward errors {errors}", flush=True)
    # half-precision tiles (the backend forms fp32 tiles; the kernels accept bf16 ones too)
    from fusedloss import _C

    x = torch.randn(8, 1031, generator=g).to(device, torch.bfloat16)
    out = torch.zeros(len(want), 8, device=device)
    a = _C.TileArgs()
    a.x, a.dtype, a.ld, a.rows, a.cols, a.vocab = x.data_ptr(), 1, 1031, 8, 1031, 1031
    a.out, a.out_stride, a.want_entropy, a.device = out.data_ptr(), 8, True, 0
    if device == "cuda":
        _C.fold_tile(a, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
    else:
        _C.host_fold_tile(a)
    lse = torch.logsumexp(x.double(), 1)
    ok = cases.rel_err(out[0], lse) <= 1e-6
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} tiles bf16 tile fold: lse error {cases.rel_err(out[0], lse):.1e}", flush=True)
    print(f"{failures} failure(s)", flush=True)
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backends", nargs="+", default=None, help="default: triton and cuda where available")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--ops", nargs="+", default=list(cases.OPS))
    ap.add_argument("--tiles", action="store_true", help="the CUDA backend's kernels only (for racecheck)")
    args = ap.parse_args(argv)
    if args.tiles:
        return 1 if tiles(args.device) else 0

    import fusedloss
    from benchmarks.device import check_cases

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
                        loss, outs = cases.call_op(getattr(fusedloss, op), p, h, w, backend=backend)
                        loss.backward()
                        if args.device == "cuda":
                            torch.cuda.synchronize()
                        errs = list(check_cases.errors(outs, {"hidden": h.grad, "weight": w.grad},
                                                       cases.reference64(p))["errors"].values())
                        tol = 1e-3 if dtype == torch.float32 else 5e-2
                        ok = all(e <= tol for e in errs)
                        failures += not ok
                        print(f"{'ok  ' if ok else 'FAIL'} {tag} err outputs/dh/dw = "
                              + " ".join(f"{e:.1e}" for e in errs), flush=True)
                    except Exception as exc:
                        failures += 1
                        print(f"FAIL {tag} {type(exc).__name__}: {exc}", flush=True)
                        traceback.print_exc(limit=3)
    print(f"{failures} failure(s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
