"""The CUDA backend's sm_90 epilogue path on a GPU: its forward beside cuBLAS's product, then two ops on both paths.

    python -m benchmarks.device.check_epilogue --out epilogue.json                 # an H200/H100, extension built
    python -m benchmarks.device.check_epilogue --prebuilt .carry/prebuilt --out epilogue.json --budget-s 500
    python -m benchmarks.device.check_epilogue --dry-run --out epilogue.json       # CPU: the host twins as kernels

What it measures (docs/design.md, "The statistics in the GEMM epilogue"), D = 4096, bf16, small shapes first:

1. ``forward``: for N in {4096, 16384} and V in {128256, 151936}, the epilogue forward (the statistics kernel and
   the merge, ``fusedloss.backends.cuda.epilogue.forward_statistics``; without and with the entropy) against cuBLAS's
   bf16-output product of the same shape (``torch.mm``), CUDA events, warm-up calls then rounds alternating the
   implementations; the median ms, TFLOP/s, the ratio to cuBLAS (the number that decides the route: <= 1.02x makes
   <= 1.05x of the bound credible) and to the bound (2 N V D flops at 790 TFLOP/s). Checked: lse, log p_y and the
   entropy of a sample of rows against float64 logits.
2. ``ops``: ``cross_entropy`` and ``token_logprobs(return_entropy=True)``, forward + backward, at (N, V) = (4096,
   128256) and (16384, 151936), with FUSEDLOSS_CUDA_EPILOGUE=0 (today's path) and =1; median ms of each path.
3. ``checks`` (run first): the same two ops, as benchmarks/cases.py poses them, on both paths at N = 1024,
   V = 151936 against its float64 reference (``cases.reference64``: outputs, d hidden, d weight), beside the error of
   today's path: the epilogue path must be no worse than twice it.

The extension must carry the epilogue kernels (built with the CUTLASS headers: ``fusedloss._C.EPILOGUE_KERNELS``);
``--prebuilt DIR`` puts DIR first on the import path (the folder of ``python -m benchmarks.device.build
--prebuild``, whose extension is built with them when the nvidia-cutlass wheel is installed there). The JSON is
rewritten after every step, so a run stopped at its box keeps what it measured. Exit status: 0 all ran and passed,
1 a check failed, 2 no usable GPU (sm_90), 3 the extension lacks the kernels, 4 the budget left steps unrun.

--dry-run (no GPU): every step at tiny shapes on the CPU, the kernels replaced by their host twins
(csrc/epilogue_host.cpp, compiled here with the host compiler) through the CUDA backend's host mode; the timing
path with wall-clock timers; the float64 checks as on the GPU; a planted fault (the twins' entropy partial
scaled) which the checks must reject; the JSON as a GPU run writes it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.device.epilogue_stand_in import CALLS, HostTwins, count_calls

ROOT = Path(__file__).resolve().parents[2]
BOUND_TFLOPS = 790.0  # H200 bf16 dense (benchmarks/model/cost.py), the bound's rate
GPU = {"D": 4096, "forward": [(4096, 128256), (4096, 151936), (16384, 128256), (16384, 151936)],
       "ops": [(4096, 128256), (16384, 151936)], "check": (1024, 151936), "warmup": 2, "repeat": 5}
DRY = {"D": 32, "forward": [(40, 601), (130, 1031)], "ops": [(40, 601)], "check": (24, 523), "warmup": 1,
       "repeat": 2}
ENV = "FUSEDLOSS_CUDA_EPILOGUE"


# ---------------------------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------------------------
def inputs(n, v, d, device, seed=0):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(v, d, generator=g) / math.sqrt(d)).to(device=device, dtype=torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=g)
    y[::17] = -100  # a few ignored rows
    return h, w, y.to(device)


class Timer:
    def __init__(self, device):
        import torch

        self.torch, self.gpu = torch, device.type == "cuda"

    def __call__(self, fn) -> float:
        """ms of one call."""
        if not self.gpu:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        a, b = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)


def alternate(calls: dict, timer: Timer, warmup: int, repeat: int) -> dict:
    """Median ms of each call, rounds alternating them after the warm-up."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in calls}
    for _ in range(repeat):
        for k, fn in calls.items():
            times[k].append(timer(fn))
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def forward_step(n, v, d, device, cfg) -> dict:
    import torch

    from benchmarks import cases
    from fusedloss.backends.cuda import epilogue
    from fusedloss.core.problem import LogitTransform, StatsProblem

    h, w, y = inputs(n, v, d, device)
    t = torch.where(y >= 0, y, torch.full_like(y, -1))
    problems = {ent: StatsProblem(hidden=h, weight=w, bias=None, targets=t, transform=LogitTransform(),
                                  want_entropy=ent) for ent in (False, True)}
    calls = {"epilogue": lambda: epilogue.forward_statistics(problems[False]),
             "epilogue_entropy": lambda: epilogue.forward_statistics(problems[True]),
             "cublas_bf16_out": lambda: torch.mm(h, w.T)}
    ms = alternate(calls, Timer(device), cfg["warmup"], cfg["repeat"])
    flops = 2.0 * n * v * d
    rec = {"N": n, "V": v, "D": d, "ms": ms,
           "tflops": {k: round(flops / (x * 1e-3) / 1e12, 1) for k, x in ms.items() if x > 0},
           "over_cublas": {k: round(ms[k] / ms["cublas_bf16_out"], 3) for k in ("epilogue", "epilogue_entropy")},
           "over_bound": {k: round(ms[k] / (flops / (BOUND_TFLOPS * 1e12) * 1e3), 3) for k in ms}}
    # check: a sample of rows against float64 logits (benchmarks/cases.py's statistics)
    stats = epilogue.forward_statistics(problems[True])
    rows = torch.arange(0, n, max(1, n // 64), device=device)
    truth = cases.statistics_of(h[rows].double() @ w.double().T, t[rows])
    lse, logp, ent = truth["lse"], truth["logp"], truth["entropy"]
    valid = t[rows] >= 0
    err = {"lse": float((stats.lse[rows].double() - lse)[valid].abs().max()),
           "logp": float((stats.logp[rows].double() - logp)[valid].abs().max()),
           "entropy": float((stats.entropy[rows].double() - ent)[valid].abs().max())}
    ok = err["lse"] < 1e-4 * (1 + float(lse.abs().max())) and err["logp"] < 1e-4 and err["entropy"] < 1e-4 * (
        1 + float(ent.abs().max()))
    ok = ok and all(float(s[rows][~valid].abs().max()) == 0 for s in (stats.lse, stats.logp) if (~valid).any())
    rec["check"] = {"max_abs_err": err, "ok": bool(ok)}
    return rec


OPS = {"cross_entropy": lambda fl, h, w, y, **k: (fl.cross_entropy(h, w, y, **k),),
       "token_logprobs_entropy": lambda fl, h, w, y, **k: fl.token_logprobs(h, w, y, return_entropy=True, **k)}


def _fwd_bwd(op, h, w, y, backend):
    import fusedloss

    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    outs = OPS[op](fusedloss, h, w, y, backend=backend)
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
    loss.backward()
    return [o.detach() for o in outs] + [h.grad, w.grad]


def _with_path(on: bool, fn):
    old = os.environ.get(ENV)
    os.environ[ENV] = "1" if on else "0"
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def ops_step(n, v, d, device, cfg) -> dict:
    h, w, y = inputs(n, v, d, device, seed=1)
    rec = {"N": n, "V": v, "D": d, "ms": {}}
    for op in OPS:
        calls = {path: (lambda op=op, on=(path == "epilogue"): _with_path(on, lambda: _fwd_bwd(op, h, w, y, "cuda")))
                 for path in ("today", "epilogue")}
        ms = alternate(calls, Timer(device), cfg["warmup"], cfg["repeat"])
        ms["epilogue_over_today"] = round(ms["epilogue"] / ms["today"], 3)
        rec["ms"][op] = ms
    return rec


def checks_step(n, v, d, device) -> dict:
    import torch

    import fusedloss
    from benchmarks import cases
    from benchmarks.device import check_cases

    rec = {"N": n, "V": v, "D": d, "ops": {}}
    ok = True
    for op, case in (("cross_entropy", "cross_entropy"), ("token_logprobs_entropy", "token_logprobs")):
        p = cases.make_problem(case, n, v, d, torch.bfloat16, device, seed=2)
        ref = cases.reference64(p)
        errs, ran = {}, {}
        for path in ("today", "epilogue"):
            before = dict(CALLS)
            errs[path] = _with_path(path == "epilogue", lambda: check_cases.errors(
                *check_cases.run(getattr(fusedloss, case), p, backend="cuda"), ref))["errors"]
            ran[path] = {k: CALLS[k] - before[k] for k in CALLS}
        names = list(errs["today"])
        passed = all(errs["epilogue"][nm] <= max(2 * errs["today"][nm], 1e-5) and errs["epilogue"][nm] < 2e-2
                     for nm in names)
        # each path is the one asked for: the epilogue's forward and backward ran once, today's never
        passed = passed and ran["today"] == {"forward": 0, "backward": 0} and ran["epilogue"] == {"forward": 1,
                                                                                                 "backward": 1}
        rec["ops"][op] = {"rel_err": errs, "epilogue_calls": ran, "ok": passed}
        ok = ok and passed
    rec["ok"] = ok
    return rec


# ---------------------------------------------------------------------------------------------------------------
def write(report: dict, out: Path | None) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")


def table(report: dict) -> str:
    lines = ["| N | V | epilogue ms | +entropy ms | cuBLAS bf16-out ms | epilogue / cuBLAS | / bound | check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report.get("forward", []):
        ms = r["ms"]
        lines.append(f"| {r['N']} | {r['V']} | {ms['epilogue']} | {ms['epilogue_entropy']} | {ms['cublas_bf16_out']}"
                     f" | {r['over_cublas']['epilogue']} | {r['over_bound']['epilogue']} | "
                     f"{'ok' if r['check']['ok'] else 'FAILED'} |")
    for r in report.get("ops", []):
        for op, ms in r["ms"].items():
            lines.append(f"- {op} N={r['N']} V={r['V']}: today {ms['today']} ms, epilogue {ms['epilogue']} ms "
                         f"({ms['epilogue_over_today']}x)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the JSON report (rewritten after every step)")
    ap.add_argument("--prebuilt", type=Path, help="a folder holding a prebuilt fusedloss/_C*.so with the kernels")
    ap.add_argument("--budget-s", type=float, default=500.0, help="stop starting steps after this (default 500)")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the host twins as kernels (see the docstring)")
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error("--budget-s must be positive")
    deadline = time.monotonic() + args.budget_s
    if args.prebuilt is not None:
        sys.path.insert(0, str(args.prebuilt))
    sys.path.insert(0, str(ROOT))
    import torch

    import fusedloss
    from fusedloss.backends.cuda import backend as cuda
    from fusedloss.backends.cuda import epilogue
    from fusedloss.core import registry

    count_calls(epilogue)
    cfg = DRY if args.dry_run else GPU
    report = {"what": "the CUDA backend's sm_90 epilogue path beside cuBLAS and today's path", "dry_run": args.dry_run,
              "bound_tflops": BOUND_TFLOPS, "torch": torch.__version__, "fusedloss": fusedloss.__file__,
              "forward": [], "ops": [], "checks": None, "status": "running"}
    if args.dry_run:
        device = torch.device("cpu")
        if not cuda.extension_built():
            report.update(status="no extension", reason=f"the dry run needs fusedloss._C's host mode: "
                                                        f"{cuda.availability()}")
            write(report, args.out)
            print(report["reason"], file=sys.stderr)
            return 3
        tmp = Path(tempfile.mkdtemp(prefix="epilogue-twins-"))
        lib = HostTwins.compile(tmp)
        epilogue._KERNELS_OVERRIDE = HostTwins(lib)
        original = registry.resolve
        registry.resolve = lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest)
    else:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            report.update(status="no GPU", reason="needs an sm_90 GPU (H100/H200); --dry-run is the CPU mode")
            write(report, args.out)
            print(report["reason"], file=sys.stderr)
            return 2
        device = torch.device("cuda")
        why = epilogue.unavailable(device)
        if why:
            report.update(status="no kernels", reason=why)
            write(report, args.out)
            print(why, file=sys.stderr)
            return 3
    report["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (host twins)"
    left = []
    # correctness first: a box too short for every step keeps the checks, then the small shapes' timings
    n, v = cfg["check"]
    report["checks"] = checks_step(n, v, cfg["D"], device)
    write(report, args.out)
    for n, v in cfg["forward"]:
        if time.monotonic() > deadline:
            left.append(f"forward {n}x{v}")
            continue
        report["forward"].append(forward_step(n, v, cfg["D"], device, cfg))
        write(report, args.out)
    for n, v in cfg["ops"]:
        if time.monotonic() > deadline:
            left.append(f"ops {n}x{v}")
            continue
        report["ops"].append(ops_step(n, v, cfg["D"], device, cfg))
        write(report, args.out)
    ok = all(r["check"]["ok"] for r in report["forward"]) and (report["checks"] or {}).get("ok", True)
    if args.dry_run:  # the planted fault: the checks must reject it
        epilogue._KERNELS_OVERRIDE = HostTwins(lib, fault=1.5)
        n, v = cfg["forward"][0]
        caught = not forward_step(n, v, cfg["D"], device, cfg)["check"]["ok"]
        report["planted_fault_caught"] = caught
        ok = ok and caught
    report["status"] = "ok" if ok and not left else ("failed" if not ok else "budget")
    report["left"] = left
    write(report, args.out)
    print(table(report))
    print(f"check_epilogue: {report['status']}" + (f"; not run: {', '.join(left)}" if left else ""))
    return 0 if report["status"] == "ok" else (1 if not ok else 4)


if __name__ == "__main__":
    sys.exit(main())
