"""fusedloss in two minutes: every op against the materialised logits, on this machine.

    python benchmarks/tour.py                 # about a minute on a 2-core CPU, under 1 GB
    python benchmarks/tour.py --budget-s 0    # no time box: every extra that can run here runs
    python benchmarks/tour.py --device cuda   # on a GPU (bf16 there; benchmarks/bench.py --device cuda for LLM shapes)

For each op (token log-probs with entropy, cross-entropy, GRPO, DPO, distillation) it times one forward +
backward of the materialised reference (``fusedloss.reference``: the logits, then the loss) and of fusedloss's
default path (``backend="auto"``), measures the extra peak memory of each and their error against the same
reference in float64. These come first, for every op, at a shape sized from a short calibration so that they
fit the time box at this machine's load; the shape is scaled down, never an op dropped. Then, in the time
left, the extras: the peers installed here (TRL's chunked log-prob kernel, PyTorch's
``F.linear_cross_entropy``, Liger-Kernel, Cut Cross-Entropy on a GPU) and, with ``TRITON_INTERPRET=1``, the
Triton kernels under the interpreter on a tiny shape (their error, not their time). Every extra that does
not run is listed with its reason, in the table, the JSON and the PNG, which also name the device and the load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "benchmarks"

ROOT = Path(__file__).resolve().parents[1]
OPS = ("token_logprobs", "cross_entropy", "grpo_loss", "dpo_loss", "distillation_loss")
# Shapes the CPU run picks from, largest first: N x V bounded so that the largest peer's extra memory (TRL's
# chunked kernel holds ~9 fp32 [N, V] tensors for log-probs with entropy) keeps the process under 1 GB.
CPU_NS = (512, 384, 256, 128)
CPU_VS = (16381, 8191, 4093)  # primes: no tile divides them
CPU_D = 256
GPU_SHAPE = {"N": 4096, "V": 151936, "D": 4096}
TINY = {"N": 64, "V": 1009, "D": 64}  # the Triton interpreter's shape
# a call of the op, in calls of token_logprobs' reference (its calibration): a teacher doubles the products
OP_COST = {"token_logprobs": 1.0, "cross_entropy": 0.6, "grpo_loss": 1.5, "dpo_loss": 1.5, "distillation_loss": 2.0}
# the essential pass per op, in reference calls: the float64 truth, the reference (3 calls), fusedloss (3), as
# measured on a loaded 2-core machine
ESSENTIAL_CALLS = 7.0
MIB = float(1 << 20)
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
START_ENV = "FUSEDLOSS_TOUR_START"
# the package index names of the peers (benchmarks/peers.py), for the hint of one not installed
PEER_PACKAGE = {"trl": "trl", "liger": "liger-kernel", "cce": "cut-cross-entropy"}
# an extra's time per call over the reference's, where it is far from 1, for its time-box estimate: PyTorch's
# chunked F.linear_cross_entropy took 15-19x the materialised reference on a 2-core CPU in this tour's table
CPU_SLOWDOWN = {"torch-lce": 20.0}
# the default time box, from the start: with the user install before it, the README's first block ends within
# two minutes on a 2-core CPU
BUDGET_S = 60.0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def device_line(device) -> str:
    import torch

    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}"
    return f"CPU {cpu_name()}, {os.cpu_count()} cores ({torch.get_num_threads()} threads)"


class Clock:
    """Seconds since the process started (before the re-exec and the imports: what the user waits)."""

    def __init__(self, budget_s: float):
        self.t0 = float(os.environ.get(START_ENV) or time.time())
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return math.inf if not self.budget_s else self.budget_s - self.elapsed()


def peak_rss_mib() -> float | None:
    """The process's peak resident set so far (getrusage: never reset, unlike VmHWM, which the probes reset)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except (ImportError, OSError):
        return None


def say(clock: Clock, text: str) -> None:
    rss = peak_rss_mib()
    print(f"[{clock.elapsed():5.0f} s{'' if rss is None else f', {rss:4.0f} MiB'}] {text}", flush=True)


def _measure(impl, p, device, calls: int, mem_probe) -> dict:
    """``calls`` forward+backward passes; the first is untimed when there are two or more. Median time of the
    rest, extra peak memory of the last, outputs and gradients of the last."""
    from .bench import _median, _one_run

    runs = [_one_run(impl, p, device, mem=mem_probe) for _ in range(calls)]
    timed = runs[1:] or runs
    last = runs[-1]
    extra = None if last.extra is None or not math.isfinite(last.extra) else max(0.0, last.extra) / MIB
    return {"ms": _median([r.ms for r in timed]), "extra_mib": extra, "outs": last.outs, "grads": last.grads,
            "calls": calls}


def _error(run: dict, truth) -> float:
    from .cases import rel_err

    outs, grads = truth
    errs = [rel_err(run["outs"].get(k), v) for k, v in outs.items()]
    errs += [rel_err(run["grads"].get(k), v) for k, v in grads.items() if v is not None]
    return max(errs)


def plan_shape(cost: tuple, budget_s: float, device) -> tuple:
    """(N, V, D): the largest CPU shape whose essential pass fits half the budget (the rest: start-up, the
    extras, the plot). ``cost``: (a, b) of token_logprobs' reference call, a + b N V milliseconds."""
    if device.type == "cuda":
        return GPU_SHAPE["N"], GPU_SHAPE["V"], GPU_SHAPE["D"]
    share = 0.5 * (budget_s or 240.0) * 1e3
    a, b = cost
    for v in CPU_VS:
        for n in CPU_NS:
            if sum(ESSENTIAL_CALLS * c * (a + b * n * v) for c in OP_COST.values()) <= share:
                return n, v, CPU_D
    return CPU_NS[-1], CPU_VS[-1], CPU_D


def calibrate(device, dtype) -> tuple:
    """(a, b): token_logprobs' materialised reference (forward + backward) takes a + b N V ms here at D=CPU_D,
    from two token counts at V=CPU_VS[0]: the machine's speed at its present load, and its per-call overhead."""
    from fusedloss import reference

    from .bench import _one_run
    from .cases import call_op, make_problem

    impl = lambda p, h, w: call_op(reference.token_logprobs, p, h, w)
    ms = {}
    for n in (CPU_NS[-1], CPU_NS[0]):
        p = make_problem("token_logprobs", n, CPU_VS[0], CPU_D, dtype, device, seed=1)
        runs = [_one_run(impl, p, device) for _ in range(2 if n == CPU_NS[-1] else 1)]
        ms[n] = runs[-1].ms
    n0, n1 = CPU_NS[-1], CPU_NS[0]
    b = max(0.0, (ms[n1] - ms[n0]) / ((n1 - n0) * CPU_VS[0]))
    a = max(0.0, ms[n0] - b * n0 * CPU_VS[0])
    return a, b


def extras_for(op: str, device) -> list:
    """[(implementation, None or why it cannot run here)] for the extras of one op."""
    from . import peers

    out = []
    for name in peers.PEERS:
        if op in peers.PEER_OPS.get(name, ()):
            why = peers.availability(name, device.type)
            if why == "not installed":
                why = f"not installed (pip install {PEER_PACKAGE[name]})"
            out.append((name, why))
    import fusedloss

    status = fusedloss.backend_status()
    for backend in ("triton", "cuda"):
        state = status.get(backend)
        if backend == "triton" and "not installed" in str(state):
            # the user install leaves Triton out on a CPU (about 1 GB; the torch backend is the default there)
            why = ("Triton not installed (pip install triton" + (")" if device.type == "cuda" else
                   "; then TRITON_INTERPRET=1 python benchmarks/tour.py runs its kernels under the interpreter)"))
        elif device.type == "cuda":
            why = None if state == "available" else str(state)
        elif backend == "triton" and state == "available" and os.environ.get("TRITON_INTERPRET") == "1":
            why = None
        elif backend == "triton":
            why = ("no CUDA device: TRITON_INTERPRET=1 python benchmarks/tour.py checks its kernels under the "
                   "interpreter on a tiny shape" if state == "available" or "TRITON_INTERPRET" in str(state)
                   else str(state))
        else:
            why = "needs a CUDA device" if state == "available" or "no CUDA device" in str(state) else str(state)
        out.append((f"fusedloss:{backend}", why))
    return out


def run(args) -> dict:
    import torch

    from fusedloss.core import registry

    from .bench import CpuMem, CudaMem, make_impl
    from .cases import make_problem, reference64

    clock = Clock(args.budget_s)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype or
                                                                   ("bfloat16" if device.type == "cuda" else "float32")]
    if args.threads:
        torch.set_num_threads(args.threads)
    mem_probe = CudaMem() if device.type == "cuda" else CpuMem()
    default = "fusedloss:" + registry.resolve("auto", device)
    env = {"device": device_line(device), "load_1min_start": load_average(), "cores": os.cpu_count(),
           "torch": torch.__version__, "python": platform.python_version(), "dtype": str(dtype).split(".")[1],
           "default_path": default}
    box = f"time box {args.budget_s:.0f} s" if args.budget_s else "no time box"
    say(clock, f"fusedloss tour on {env['device']}, load {env['load_1min_start']}, {env['dtype']}; {box}")
    if args.N:
        n, v, d = args.N, args.V or CPU_VS[0], CPU_D if device.type == "cpu" else GPU_SHAPE["D"]
    else:
        cost = calibrate(device, dtype) if device.type == "cpu" else (0.0, 0.0)
        n, v, d = plan_shape(cost, args.budget_s, device)
        if device.type == "cpu":
            per_call = cost[0] + cost[1] * CPU_NS[0] * CPU_VS[0]
            say(clock, f"calibrated: the reference takes {per_call:.0f} ms for N={CPU_NS[0]}, V={CPU_VS[0]} here; "
                       f"shape N={n}, V={v}, D={d}, so that every op fits the time box")
    env.update(N=n, V=v, D=d)
    records, skipped, problems = [], [], {}

    # 1. the reference and fusedloss's default path, for every op, before anything else
    for op in OPS:
        say(clock, f"{op}: inputs and the float64 truth")
        p = make_problem(op, n, v, d, dtype, device, seed=args.seed)
        truth = reference64(p)
        problems[op] = (p, truth)
        ref_ms = None
        for name in ("reference", default):
            impl, why = make_impl(name, op, device)
            if impl is None:  # the reference and the default path always exist; say so loudly if not
                raise RuntimeError(f"{op}: {name} cannot run here: {why}")
            calls = 3 if clock.left() > 20 else 2
            r = _measure(impl, p, device, calls, mem_probe)
            rec = {"op": op, "impl": name, "N": p.N, "V": v, "D": d, "ms": round(r["ms"], 2),
                   "extra_mib": None if r["extra_mib"] is None else round(r["extra_mib"], 1),
                   "max_rel_err": _error(r, truth), "status": "ok"}
            if name == "reference":
                ref_ms = r["ms"]
            records.append(rec)
            say(clock, f"  {op:<18} {name:<16} {r['ms']:8.1f} ms  {_fmt_mib(rec['extra_mib'])} extra  "
                       f"err {rec['max_rel_err']:.1e}")
        problems[op] = (p, truth, ref_ms)

    # 2. the extras, while time is left
    for op in OPS:
        p, truth, ref_ms = problems[op]
        for name, why in extras_for(op, device):
            if why is not None:
                skipped.append({"op": op, "impl": name, "reason": why})
                continue
            interp = name == "fusedloss:triton" and device.type == "cpu"
            if interp:
                need = 20.0 * OP_COST[op]  # the interpreter on the tiny shape: tens of seconds per op
            else:
                need = 3 * (ref_ms / 1e3) * 1.5 * (CPU_SLOWDOWN.get(name, 1.0) if device.type == "cpu" else 1.0)
            if need > clock.left() - 8:  # 8 s for the table and the plot
                skipped.append({"op": op, "impl": name, "reason": f"time box: needs ~{need:.0f} s, "
                                f"{max(0.0, clock.left()):.0f} s left (--budget-s 0 runs it)"})
                continue
            say(clock, f"{op}: {name}" + (f" under the Triton interpreter, N={TINY['N']}, V={TINY['V']}"
                                          if interp else ""))
            impl, why = make_impl(name, op, device)
            if impl is None:
                skipped.append({"op": op, "impl": name, "reason": why})
                continue
            try:
                if interp:
                    tp = make_problem(op, TINY["N"], TINY["V"], TINY["D"], dtype, device, seed=args.seed)
                    r = _measure(impl, tp, device, 1, None)
                    rec = {"op": op, "impl": name + " (interpreter)", "N": tp.N, "V": TINY["V"], "D": TINY["D"],
                           "ms": None, "extra_mib": None, "max_rel_err": _error(r, reference64(tp)),
                           "status": "ok", "note": "Triton interpreter: error only, not timed"}
                else:
                    r = _measure(impl, p, device, 2, mem_probe)
                    rec = {"op": op, "impl": name, "N": p.N, "V": v, "D": d, "ms": round(r["ms"], 2),
                           "extra_mib": None if r["extra_mib"] is None else round(r["extra_mib"], 1),
                           "max_rel_err": _error(r, truth), "status": "ok"}
            except Exception as exc:  # a peer failing is reported, never the end of the run
                skipped.append({"op": op, "impl": name, "reason": f"failed: {type(exc).__name__}: {exc}"[:160]})
                continue
            records.append(rec)
            say(clock, f"  {op:<18} {rec['impl']:<16} " + ("  interp." if rec["ms"] is None else
                       f"{rec['ms']:8.1f} ms  {_fmt_mib(rec['extra_mib'])} extra") + f"  err {rec['max_rel_err']:.1e}")
    env["load_1min_end"] = load_average()
    env["wall_s"] = round(clock.elapsed(), 1)
    env["peak_rss_mib"] = peak_rss_mib()
    return {"env": env, "records": records, "skipped": skipped}


def _fmt_mib(x) -> str:
    return "     - MiB" if x is None else f"{x:7.1f} MiB"


def table(result: dict) -> str:
    env, records = result["env"], result["records"]
    refs = {r["op"]: r for r in records if r["impl"] == "reference"}
    rows = [("op", "implementation", "N", "time ms", "time/ref", "extra MiB", "mem/ref", "max rel err")]
    for op in OPS:
        for r in (r for r in records if r["op"] == op):
            ref = refs[op]
            t = "interp." if r["ms"] is None else f"{r['ms']:.1f}"
            tr = "-" if r["ms"] is None or r["impl"] == "reference" else f"{r['ms'] / ref['ms']:.2f}"
            m = "-" if r["extra_mib"] is None else f"{r['extra_mib']:.1f}"
            mr = ("-" if r["extra_mib"] is None or not ref.get("extra_mib") or r["impl"] == "reference"
                  else f"{r['extra_mib'] / ref['extra_mib']:.2f}")
            rows.append((op, r["impl"], str(r["N"]), t, tr, m, mr, f"{r['max_rel_err']:.1e}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"{env['device']}, load {env['load_1min_start']} -> {env['load_1min_end']}, {env['dtype']}, "
             f"V={env['V']}, D={env['D']}; error: against the float64 reference; memory: extra peak "
             f"{'RSS' if 'CPU' in env['device'] else 'allocated'} beyond the inputs and the gradients"]
    lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines += skipped_lines(result["skipped"])
    return "\n".join(lines)


def skipped_lines(skipped: list) -> list:
    """One line per reason, naming the implementations and ops it covers."""
    by_reason = {}
    for s in skipped:
        by_reason.setdefault((s["impl"], s["reason"]), []).append(s["op"])
    return [f"not run: {impl} for {', '.join(ops) if len(ops) < len(OPS) else 'every op'}: {reason}"
            for (impl, reason), ops in by_reason.items()]


def plot(result: dict, path: Path):
    """Three rows (time / reference, extra memory / reference, error against float64), one column per op; the
    title names the device, the load and the shape; the footer, what did not run and why."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env, records = result["env"], result["records"]
    impls = list(dict.fromkeys(r["impl"] for r in records))
    colors = {impl: plt.get_cmap("tab10")(k % 10) for k, impl in enumerate(impls)}
    refs = {r["op"]: r for r in records if r["impl"] == "reference"}
    fig, axes = plt.subplots(3, len(OPS), figsize=(4.0 * len(OPS), 8.6), squeeze=False)
    labels = ("time / reference", "extra memory / reference", "max rel. error vs float64")
    for j, op in enumerate(OPS):
        rs = [r for r in records if r["op"] == op]
        ref = refs[op]
        for row in range(3):
            ax = axes[row][j]
            xs, ys, texts, cs = [], [], [], []
            for k, r in enumerate(rs):
                if row == 0:
                    y = None if r["ms"] is None else r["ms"] / ref["ms"]
                    text = None if y is None else f"{y:.2f}x\n{r['ms']:.0f} ms"
                elif row == 1:
                    known = r["extra_mib"] is not None and ref.get("extra_mib")
                    y = r["extra_mib"] / ref["extra_mib"] if known else None
                    text = None if y is None else f"{y:.2f}x\n{r['extra_mib']:.0f} MiB"
                else:
                    y = r["max_rel_err"]
                    text = f"{y:.0e}"
                if y is not None and y > 0:
                    xs.append(k)
                    ys.append(y)
                    texts.append(text)
                    cs.append(colors[r["impl"]])
            bars = ax.bar(xs, ys, color=cs)
            ax.bar_label(bars, labels=texts, fontsize=7, padding=2)
            ax.set_xticks(range(len(rs)))
            ax.set_xticklabels([r["impl"].replace("fusedloss:", "fl:") for r in rs], rotation=30, ha="right",
                               fontsize=7)
            if row == 2 and ys:  # whole decades: bars a few percent apart look a few percent apart
                ax.set_yscale("log")
                ax.set_ylim(10.0 ** (math.floor(math.log10(min(ys))) - 1), 10.0 ** (math.ceil(math.log10(max(ys))) + 1))
            else:
                ax.axhline(1.0, color="black", lw=0.8, ls="--")
                ax.set_ylim(0, max([1.4] + [y * 1.4 for y in ys]))
            if row == 0:
                ax.set_title(f"{op}\nN={rs[0]['N']}", fontsize=9)
            if j == 0:
                ax.set_ylabel(labels[row] + "\n(lower is better)", fontsize=8)
    title = (f"fusedloss vs the materialised logits on {env['device']}, load {env['load_1min_start']}, "
             f"{env['dtype']}, V={env['V']}, D={env['D']}; dashed: the reference (= 1)")
    footer = skipped_lines(result["skipped"]) or ["every implementation installed here ran"]
    fig.suptitle(textwrap.fill(title, 160), fontsize=9)
    fig.text(0.01, 0.005, "\n".join(textwrap.shorten(x, 230) for x in footer[:8]), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.02 + 0.014 * min(8, len(footer)), 1, 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def next_hint(device) -> str:
    if device == "cuda":
        return ("next: python benchmarks/bench.py --device cuda (LLM shapes, every peer), or "
                "python -m benchmarks.device (every kernel, with the cost model beside each figure)")
    return ("next, on a machine with an NVIDIA GPU: bash tools/install.sh && python benchmarks/tour.py "
            "(then python benchmarks/bench.py --device cuda for LLM shapes); here, the tests: bash tools/install.sh "
            "--tests && python -m pytest -q -n 2 --dist loadfile tests/contract")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python benchmarks/tour.py", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:5]))
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"time box from the start, in seconds (default {BUDGET_S:.0f}); 0: none, every extra runs")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    ap.add_argument("--N", type=int, default=None, help="tokens per op instead of the calibrated choice")
    ap.add_argument("--V", type=int, default=None, help="vocabulary size with --N")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"), help="folder for the JSON and the PNG")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if MMAP_ENV not in os.environ and argv is None:
        # every large tensor its own mapping, so that freed memory leaves the process and the peak RSS over a
        # call is the call's own (benchmarks/bench.py's workers do the same)
        os.environ[MMAP_ENV] = str(1 << 20)
        os.environ[START_ENV] = str(time.time())
        os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"tour-{'gpu' if 'GPU' in result['env']['device'] else 'cpu'}-{time.strftime('%Y%m%d-%H%M%S')}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    print()
    print(table(result))
    written = [str(out / f"{stem}.json")]
    if not args.no_plot:
        try:
            plot(result, out / f"{stem}.png")
            written.append(str(out / f"{stem}.png"))
        except ImportError as exc:
            print(f"no PNG: {exc} (pip install matplotlib)")
    print(f"written: {', '.join(written)} ({result['env']['wall_s']:.0f} s)")
    print(next_hint("cuda" if "GPU" in result["env"]["device"] else "cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
