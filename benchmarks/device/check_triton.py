"""GPU check of the Triton backend: correctness of both gradient paths, and forward / backward / grad-in-forward
timings.

    python -m benchmarks.device.check_triton --out results.json            # on a CUDA machine (H200)
    python -m benchmarks.device.check_triton --cpu-smoke --out smoke.json  # tiny shapes, Triton interpreter
    python -m benchmarks.device.check_triton --cost-table                  # the cost model's table (no device)

Correctness records (``checks``), for every case (real vocabulary sizes 128256 and 151936, a prime vocabulary
with D = 1000, peaked rows, ignored rows, soft-cap + temperature, a teacher with its own hidden size, a frozen
head) and dtype (bf16, fp16, fp32, and fp32 with PyTorch's TF32 switched on globally, which must change
nothing), on the composable path (the statistics op, then the gradient kernel and cuBLAS) and on the grad-in-forward
path (``grad_in_forward_gradients``), each in one workspace chunk and in several (a small ``workspace_mb``):

- every statistic and the gradients of hidden, weight and bias of one random objective against the float64
  computation on materialised logits (same rounded inputs) and against the naive same-dtype one;
- criterion: fp32 within 1e-5 of float64 (or 4x the naive fp32 error where even that misses 1e-5), bf16/fp16
  no worse than the naive same-dtype error plus ``HALF_SLACK``;
- the peak extra device memory of forward + backward against its bound (the workspace, no N x V buffer).

Further records: ``row_independence`` (the d hidden rows of confident rows are the same bits whether or not
the other rows carry gradient: the backward forms the forward's logits bit for bit), ``determinism`` (two runs,
same bits), ``top1_ties`` (TRL's is_top1 on exact ties across tiles and splits), and ``timing``: at N = 16384,
D = 4096, V = 151936 (bf16; fp32 at N = 4096) the forward, the composable backward and the grad-in-forward path timed
separately with CUDA events (median), next to one cuBLAS product of the same size and the cost model's
figures for the same plan. On ``--cpu-smoke`` the same code runs on tiny shapes in the interpreter (timings
there say nothing about a GPU and are labelled so). Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if "--cpu-smoke" in sys.argv:  # must precede the first use of the Triton kernels
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from benchmarks import cases
from benchmarks.model import cost
from benchmarks.model import triton as triton_model
from fusedloss import reference
from fusedloss.core import LogitTransform, TeacherHead, token_statistics
from fusedloss.core.problem import GradientNeeds, Statistics, StatsProblem
from fusedloss.core.statistics import build_problem, dz_coefficients

HALF_SLACK = 2e-3
FP32_TOL = 1e-5
DIFFERENTIABLE = ("lse", "logp", "entropy", "kl_rev", "kl_fwd", "jsd")

GPU_CASES = [
    dict(name="llama3_vocab", n=256, d=1024, v=128256, ignore=0.25, entropy=True),
    dict(name="qwen_vocab_softcap", n=256, d=896, v=151936, ignore=0.25, entropy=True, bias=True,
         transform=(0.7, 1.0, 30.0)),
    dict(name="prime_vocab_d1000", n=97, d=1000, v=131071, ignore=0.0, entropy=True),
    dict(name="teacher", n=128, d=1024, v=128256, dt=768, ignore=0.1, entropy=True, kl_rev=True, kl_fwd=True,
         jsd=0.5, teacher_temperature=1.3),
    dict(name="frozen_head", n=256, d=1024, v=151936, ignore=0.25, entropy=True, frozen=True),
]
CPU_CASES = [
    dict(name="prime_131", n=7, d=19, v=131, ignore=0.25, entropy=True, bias=True, transform=(0.7, 1.3, 5.0)),
    dict(name="teacher_257", n=5, d=24, v=257, dt=19, ignore=0.0, entropy=True, kl_rev=True, kl_fwd=True, jsd=0.3),
    dict(name="frozen_head", n=7, d=19, v=131, ignore=0.25, entropy=True, frozen=True),
]
# A workspace small enough to split the cases above into several vocabulary chunks and several grad-in-forward row
# chunks, in MiB (GPU cases, CPU cases).
SMALL_WORKSPACE_MB = {True: 0.02, False: 24.0}


def make_case(c: dict, device, seed=0):
    """Float64 masters: peaked rows (one to three vocabulary entries ~30 above the rest on every other
    row), targets on and off the peak, ignored rows as -1."""
    g = torch.Generator().manual_seed(seed)
    n, d, v = c["n"], c["d"], c["v"]
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    peaks = torch.randperm(v, generator=g)[:3]
    h[:, :3] = 0.0
    w[:, :3] = 0.0
    for j in range(3):
        w[peaks[j], j] = 30.0 - 3.0 * j
    h[0::2, 0] = 1.0
    h[0::4, 1] = 1.0
    h[0::3, 2] = 1.0
    b = torch.randn(v, generator=g, dtype=torch.float64) if c.get("bias") else None
    y = torch.randint(0, v, (n,), generator=g)
    y[0::4] = peaks[0]
    if c.get("ignore", 0) > 0:
        y[torch.rand(n, generator=g) < c["ignore"]] = -1
    teacher = None
    if c.get("dt"):
        th = torch.randn(n, c["dt"], generator=g, dtype=torch.float64)
        tw = torch.randn(v, c["dt"], generator=g, dtype=torch.float64) / math.sqrt(c["dt"])
        teacher = (th, tw)
    return h, w, b, y.to(device), teacher


def logits(h, w, b, tf, dtype):
    """The logits materialised in ``dtype`` (product and bias in it, as the naive path computes them)."""
    return reference.logits(h.to(dtype), w.to(dtype), None if b is None else b.to(dtype), temperature=tf.temperature,
                            logit_scale=tf.logit_scale, softcap=tf.softcap).to(dtype)


def materialised(c, h, w, b, y, teacher, tf, dtype):
    """The statistics from materialised logits in ``dtype`` (float64: the reference; half: naive), by
    benchmarks/cases.py's ``statistics_of``: those the case asks for."""
    z = logits(h, w, b, tf, dtype)
    zt = None
    if teacher is not None:
        zt = logits(teacher[0], teacher[1], None, LogitTransform(c.get("teacher_temperature", 1.0)), dtype)
    out = cases.statistics_of(z, y, zt, c.get("jsd"))
    asked = ["lse", "logp"] + [k for k in ("entropy", "kl_rev", "kl_fwd", "jsd") if c.get(k)]
    return {k: out[k] for k in asked}


def objective(stats: dict, weights: dict):
    return sum((weights[k].to(stats[k].dtype) * stats[k]).sum() for k in weights if k in stats)


def rel_err(a, e):
    a, e = a.detach().double(), e.detach().double()
    den = torch.linalg.vector_norm(e).item()
    num = torch.linalg.vector_norm(a - e).item()
    if not math.isfinite(num):
        return float("inf")
    return num / den if den > 0 else num


def _problem_kwargs(c, tf, teacher, y, workspace_mb):
    return dict(targets=y, transform=tf, teacher=teacher, want_entropy=bool(c.get("entropy")),
                want_kl_rev=bool(c.get("kl_rev")), want_kl_fwd=bool(c.get("kl_fwd")), jsd_beta=c.get("jsd"),
                workspace_mb=workspace_mb)


def run_case(c: dict, dtype: torch.dtype, device, path: str, workspace_mb, global_tf32: bool = False) -> dict:
    """One case on one path: statistics (composable path) and gradients against float64 and naive."""
    from fusedloss.backends.triton import backend as tb

    h64, w64, b64, y, teacher64 = make_case(c, device)
    # The run in dtype sees rounded values; the references use exactly those values.
    rnd = (lambda t: None if t is None else t.to(dtype).to(torch.float64).to(device))
    h64, w64, b64 = rnd(h64), rnd(w64), rnd(b64)
    teacher64 = None if teacher64 is None else (rnd(teacher64[0]), rnd(teacher64[1]))
    tf = LogitTransform(*c.get("transform", (1.0, 1.0, None)))
    g = torch.Generator().manual_seed(1)
    names = ["lse", "logp"] + [k for k in ("entropy", "kl_rev", "kl_fwd", "jsd") if c.get(k)]
    weights = {k: torch.randn(c["n"], generator=g, dtype=torch.float64).to(device) for k in names}
    train_w = not c.get("frozen")

    def leaves(dt):
        return [h64.to(dt).requires_grad_(True), w64.to(dt).requires_grad_(train_w),
                None if b64 is None else b64.to(dt).requires_grad_(True)]

    def grads_of(ls, obj):
        want = [t for t in ls if t is not None and t.requires_grad]
        it = iter(torch.autograd.grad(obj, want))
        return {n: (next(it) if t is not None and t.requires_grad else None)
                for n, t in zip(("hidden", "weight", "bias"), ls)}

    ref_l = leaves(torch.float64)
    ref_stats = materialised(c, *ref_l, y, teacher64, tf, torch.float64)
    ref_grads = grads_of(ref_l, objective(ref_stats, weights))
    naive_l = leaves(dtype)
    naive_teacher = None if teacher64 is None else tuple(t.to(dtype) for t in teacher64)
    naive_stats = materialised(c, *naive_l, y, naive_teacher, tf, dtype)
    naive_grads = grads_of(naive_l, objective(naive_stats, weights))
    del naive_l

    f_l = leaves(dtype)
    teacher = None
    if teacher64 is not None:
        teacher = TeacherHead(teacher64[0].to(dtype), teacher64[1].to(dtype), None, c.get("teacher_temperature", 1.0))
    kwargs = _problem_kwargs(c, tf, teacher, y, workspace_mb)

    def composable():
        s = token_statistics(f_l[0], f_l[1], bias=f_l[2], backend="triton", **kwargs)
        st = {k: getattr(s, k) for k in names}
        return st, grads_of(f_l, objective(st, weights))

    def grad_in_forward():
        p = build_problem(f_l[0].detach(), f_l[1].detach(), bias=None if f_l[2] is None else f_l[2].detach(),
                          **kwargs)
        stacked_w = torch.stack([weights[k] if k in weights else torch.zeros_like(weights["lse"])
                                 for k in Statistics._fields])

        def chunk_fn(stats, rows):
            st = torch.stack(tuple(stats))
            wts = stacked_w[:, rows].to(st.dtype)
            return (wts * st).sum(), dz_coefficients(wts, st, p.jsd_beta, y[rows], p.weight.shape[0])

        needs = GradientNeeds(True, train_w, f_l[2] is not None)
        loss, grads = tb.grad_in_forward_gradients(p, chunk_fn, needs)
        return {"objective": loss}, {n: (g if t is not None and t.requires_grad else None)
                                     for n, g, t in zip(("hidden", "weight", "bias"), grads, f_l)}

    run = composable if path == "composable" else grad_in_forward
    cuda = device.type == "cuda"
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = global_tf32
    try:
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        f_stats, f_grads = run()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    record = dict(case=c["name"], dtype=str(dtype).replace("torch.", "") + ("+global_tf32" if global_tf32 else ""),
                  path=path, workspace_mb=workspace_mb, n=c["n"], d=c["d"], v=c["v"],
                  first_call_s=round(elapsed, 4), checks=[])
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
        grads_bytes = sum(t.numel() * t.element_size() for t in f_grads.values() if t is not None)
        gpu = tb.gpu_of(device)
        budget = tb.workspace_budget(workspace_mb, torch.cuda.mem_get_info(device)[0], gpu)
        # the workspace; d hidden's fp32 accumulator and the copy of hidden with gradient-free rows zeroed; the
        # grad-in-forward path's fp32 d weight; the split partials (at most one split per 64 columns); [V] vectors;
        # slack
        n, d, v = c["n"], c["d"], c["v"]
        bound = (budget + n * d * (4 + 4) + (v * d * 4 if path == "grad_in_forward" else 0) + 12 * 4 * n * -(-v // 64)
                 + 8 * v * 4 + (64 << 20))
        record.update(extra_peak_mib=round((peak - grads_bytes) / 2**20, 1), bound_mib=round(bound / 2**20, 1),
                      nv_fp32_mib=round(c["n"] * c["v"] * 4 / 2**20, 1), memory_ok=peak - grads_bytes <= bound)

    ok = record.get("memory_ok", True)
    if path == "grad_in_forward":
        ref_stats = {"objective": objective(ref_stats, weights)}
        naive_stats = {"objective": objective(naive_stats, weights)}
    for kind, fused_d, naive_d, ref_d in (("stat", f_stats, naive_stats, ref_stats),
                                          ("grad", f_grads, naive_grads, ref_grads)):
        for k, e in ref_d.items():
            if e is None:
                good = fused_d[k] is None
                ok &= good
                record["checks"].append(dict(what=f"{kind}:{k}", none=True, ok=good))
                continue
            ef, en = rel_err(fused_d[k], e), rel_err(naive_d[k], e)
            bound = max(FP32_TOL, 4 * en) if dtype == torch.float32 else en + HALF_SLACK
            good = ef <= bound
            ok &= good
            record["checks"].append(dict(what=f"{kind}:{k}", fused=ef, naive=en, bound=bound, ok=good))
    record["ok"] = bool(ok)
    return record


def row_independence(device, dtype, smoke: bool) -> dict:
    """Confident rows beside rows without gradient: d hidden of the confident rows must be the same bits as
    when every row carries (a tiny) gradient. Differing bits mean the gradient kernel's logits are not the
    forward's (log q = (z - lse) - lse_lo takes the forward's lse)."""
    g = torch.Generator().manual_seed(284)
    n, d, v = (40, 8, 37) if smoke else (512, 1024, 32003)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    w[:, 0] = 0.0
    w[0, 0] = 1.0
    h[:, 0] = 0.0
    h[1::2, 0] = torch.linspace(10.0, 16.0, n // 2, dtype=torch.float64)
    y = torch.zeros(n, dtype=torch.int64, device=device)
    grads = {}
    for name, other in (("sparse", 0.0), ("dense", 1e-30)):
        cot = torch.where(torch.arange(n) % 2 == 1, 1.0, other).to(device)
        hh, ww = h.to(device, dtype).requires_grad_(True), w.to(device, dtype).requires_grad_(True)
        s = token_statistics(hh, ww, targets=y, backend="triton")
        (s.logp * cot.to(s.logp.dtype)).sum().backward()
        grads[name] = hh.grad[1::2]
    same = bool(torch.equal(grads["sparse"], grads["dense"]))
    return dict(case="row_independence", dtype=str(dtype).replace("torch.", ""), ok=same,
                max_abs_diff=float((grads["sparse"].double() - grads["dense"].double()).abs().max()))


def determinism(c: dict, dtype, device) -> dict:
    h, w, b, y, _ = make_case(c, device)
    h, w = h.to(device, dtype).requires_grad_(True), w.to(device, dtype).requires_grad_(True)

    def once():
        s = token_statistics(h, w, targets=y, want_entropy=True, backend="triton")
        return torch.autograd.grad((s.logp + 0.1 * s.entropy).sum(), (h, w))

    a, b_ = once(), once()
    identical = all(torch.equal(x, z) for x, z in zip(a, b_))
    return dict(case=c["name"] + "_determinism", dtype=str(dtype).replace("torch.", ""), bit_identical=identical,
                ok=identical)


def top1_ties(device, dtypes) -> list:
    """is_top1 = first argmax on exact ties, through the backend protocol (forward_statistics), with the tied
    tokens in one tile, in different tiles and in different vocabulary splits."""
    from fusedloss.backends.triton import backend as tb

    g = torch.Generator().manual_seed(0)
    n, d, v = 64, 64, 5003
    tied = (3, 7, 200, 4099)
    h = torch.randint(-2, 3, (n, d), generator=g).to(torch.float64)
    w = torch.randint(-2, 3, (v, d), generator=g).to(torch.float64) / 8
    h[:, 0] = 1.0
    h[1::2, 0] = 0.0  # odd rows: no peak, the ties do not matter there
    w[:, 0] = 0.0
    w[tied[0], 0] = 64.0
    for j in tied[1:]:
        w[j] = w[tied[0]]
    y = torch.randint(0, v, (n,), generator=g)
    y[0::8], y[2::8], y[4::8], y[6::8] = tied
    y[5] = -1
    z = h @ w.T
    expected = ((z.argmax(1) == y) & (y >= 0)).to(torch.float64)
    records = []
    for dt in dtypes:
        p = StatsProblem(hidden=h.to(device, dt), weight=w.to(device, dt), bias=None, targets=y.to(device),
                         transform=LogitTransform(), want_extras=True)
        base = tb.tiles_for(p)
        for tiles in (base, tb.TileConfig(base.block_m, base.block_v, base.block_k, base.num_warps, base.num_stages,
                                          slots=1),
                      tb.TileConfig(base.block_m, base.block_v, base.block_k, base.num_warps, base.num_stages,
                                    slots=4096)):
            try:
                got = tb.forward_statistics(p, tiles=tiles).is_top1.double().cpu()
                rec = dict(case="top1_ties", dtype=str(dt).replace("torch.", ""), tiles=repr(tiles),
                           ok=bool(torch.equal(got, expected)), mismatches=int((got != expected).sum()))
            except Exception as exc:
                rec = dict(case="top1_ties", dtype=str(dt).replace("torch.", ""), tiles=repr(tiles), ok=False,
                           error=repr(exc)[:2000])
            records.append(rec)
    return records


# ----------------------------------------------------------------------------------------------------------
# Timing


def _median_ms(fn, device, repeat: int) -> float:
    if device.type != "cuda":
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    fn()  # warm-up: compilation, tuning, cuBLAS handles
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def timing(device, smoke: bool) -> list:
    """Forward, composable backward and grad-in-forward path of cross-entropy-like problems timed separately, beside
    one cuBLAS product of the same size and the cost model's passes for the plan the backend ran."""
    from fusedloss.backends.triton import backend as tb

    shapes = ([("bfloat16", 64, 64, 1031), ("float32", 32, 64, 1031)] if smoke else
              [("bfloat16", 16384, 4096, 151936), ("float32", 4096, 4096, 151936)])
    records = []
    for dtype_name, n, d, v in shapes:
        dtype = getattr(torch, dtype_name)
        if smoke and dtype == torch.bfloat16:
            dtype, dtype_name = torch.float16, "float16"  # the interpreter mis-multiplies bf16 tl.dot
        g = torch.Generator(device="cpu").manual_seed(7)
        # random data, not zeros: zeros can run faster than real data
        h = (torch.randn(n, d, generator=g) / 2).to(device, dtype)
        w = (torch.randn(v, d, generator=g) / math.sqrt(d)).to(device, dtype)
        y = torch.randint(0, v, (n,), generator=g).to(device)
        repeat = 2 if smoke else 5
        for label, wants in (("cross_entropy", {}), ("token_logprobs_entropy", {"want_entropy": True})):
            p = StatsProblem(hidden=h, weight=w, bias=None, targets=y, transform=LogitTransform(), **wants)
            needs = GradientNeeds(True, True, False)
            rec = dict(case=f"timing_{label}", dtype=dtype_name, n=n, d=d, v=v, device=str(device),
                       meaningful=device.type == "cuda")
            try:
                cfg = tb.tiles_for(p)
                rec["tiles"] = repr(cfg)
                stats = tb.forward_statistics(p)
                coeffs = dz_coefficients(torch.stack([torch.ones(n, device=device) if f == "logp" else
                                                      torch.zeros(n, device=device) for f in Statistics._fields]),
                                         torch.stack(tuple(stats)), None, y, v)
                rec["forward_ms"] = _median_ms(lambda: tb.forward_statistics(p), device, repeat)
                rec["backward_ms"] = _median_ms(lambda: tb.backward_gradients(p, stats, coeffs, needs), device, repeat)
                rec["frozen_head_backward_ms"] = _median_ms(
                    lambda: tb.backward_gradients(p, stats, coeffs, GradientNeeds(True, False, False)), device, repeat)

                def chunk_fn(st, rows):
                    return st.logp.sum(), coeffs[:, rows]

                rec["grad_in_forward_ms"] = _median_ms(lambda: tb.grad_in_forward_gradients(p, chunk_fn, needs),
                                                       device, repeat)
                rec["cublas_product_ms"] = _median_ms(
                    lambda: torch.mm(h, w.T, out_dtype=torch.float32)
                    if device.type == "cuda" and dtype != torch.float32
                    else torch.mm(h.float(), w.float().T), device, repeat)
                w_model = tb.workload_of(p, needs, row_local=label == "cross_entropy")
                gpu = tb.gpu_of(device)
                rec["grad_in_forward_tiles"] = repr(tb.tiles_for(p, "grad_in_forward"))
                for path in ("composable", "grad_in_forward"):
                    pl = triton_model.plan(w_model, gpu, tiles=cfg,
                                           grad_in_forward_tiles=tb.tiles_for(p, "grad_in_forward"), path=path)
                    est = cost.evaluate(pl, w_model, gpu)
                    rec[f"model_{path}_ms"] = round(est.model_ms, 2)
                    rec[f"model_{path}_passes_ms"] = {k: round(x, 2) for k, x in est.pass_ms.items()}
                rec["bound_ms"] = round(cost.bound_ms(w_model, gpu), 2)
                rec["ok"] = True
            except Exception as exc:  # record and go on
                rec.update(ok=False, error=repr(exc)[:2000])
            records.append(rec)
        h = w = None  # free them before the next shape
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return records


# ----------------------------------------------------------------------------------------------------------
# The cost model's figures for the backend's plans (no device)


def cost_table() -> list:

    gpu = cost.GPUS["h200"]
    rows = []
    for op in ("cross_entropy", "token_logprobs", "token_logprobs_entropy", "grpo", "distill_reverse_kl"):
        w = cost.Workload(op=op, n=16384, d=4096, v=151936, dtype="bfloat16",
                          teacher_d=4096 if op.startswith("distill") else None)
        plan = triton_model.plan(w, gpu)
        after = cost.evaluate(plan, w, gpu)
        rows.append(dict(op=op, bound_ms=round(after.bound_ms, 1), model_ms=round(after.model_ms, 1),
                         ratio=round(after.ratio, 3), path=plan.path))
    return rows


# ----------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="where to write the JSON results")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--skip-timing", action="store_true", help="skip the timings")
    ap.add_argument("--dtypes", default="", help="comma-separated dtypes of the cases (default: every one; "
                                                 "float32+tf32 is float32 with TF32 switched on globally)")
    ap.add_argument("--cost-table", action="store_true", help="print the cost model's table of the plans and exit")
    args = ap.parse_args(argv)

    if args.cost_table:
        for row in cost_table():
            print(json.dumps(row))
        return 0
    if not args.out:
        ap.error("--out is required")
    if args.cpu_smoke:
        device, cases = torch.device("cpu"), CPU_CASES
        variants = [(torch.float32, False), (torch.float16, False)]
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --cpu-smoke", file=sys.stderr)
            return 2
        device, cases = torch.device("cuda"), GPU_CASES
        variants = [(torch.bfloat16, False), (torch.float16, False), (torch.float32, False), (torch.float32, True)]
        torch.backends.cudnn.allow_tf32 = False
    if args.cases:
        keep = set(args.cases.split(","))
        cases = [c for c in cases if c["name"] in keep]
    if args.dtypes:
        keep = set(args.dtypes.split(","))
        variants = [(dt, tf) for dt, tf in variants if str(dt).replace("torch.", "") + ("+tf32" if tf else "") in keep]

    results = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)",
                   torch=torch.__version__, records=[])
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    all_ok = True

    def write(final=False):  # after every record: a run stopped at its time box keeps what it checked
        results["ok"] = bool(all_ok) if final else False
        results["complete"] = final
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)

    def add(rec):
        nonlocal all_ok
        all_ok &= bool(rec.get("ok"))
        results["records"].append(rec)
        write()
        checks = [x for x in rec.get("checks", []) if "fused" in x]
        worst = max(checks, key=lambda x: x["fused"] / max(x["bound"], 1e-30), default=None)
        label = f"{rec['case']:>22} {rec.get('dtype', ''):>18} {rec.get('path', ''):>10} ws={rec.get('workspace_mb')}"
        brief = ("error", "max_abs_diff", "bit_identical", "mismatches", "tiles", "forward_ms", "backward_ms",
                 "frozen_head_backward_ms", "grad_in_forward_ms", "cublas_product_ms", "model_composable_ms",
                 "model_grad_in_forward_ms",
                 "bound_ms", "meaningful", "extra_peak_mib", "bound_mib")
        detail = (f"worst {worst['what']} fused {worst['fused']:.2e} naive {worst['naive']:.2e} "
                  f"bound {worst['bound']:.2e}"
                  if worst else {k: (round(rec[k], 2) if isinstance(rec[k], float) else rec[k])
                                 for k in brief if k in rec})
        print(f"{label} ok={rec.get('ok')} {detail}", flush=True)

    for c in cases:
        for dt, global_tf32 in variants:
            for path in ("composable", "grad_in_forward"):
                for ws in (None, SMALL_WORKSPACE_MB[args.cpu_smoke]):
                    try:
                        rec = run_case(c, dt, device, path, ws, global_tf32)
                    except Exception as exc:  # record and go on: one failure must not hide the others
                        rec = dict(case=c["name"], dtype=str(dt).replace("torch.", ""), path=path, workspace_mb=ws,
                                   ok=False, error=repr(exc)[:2000])
                    add(rec)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    dtypes = (torch.float32, torch.float64) if args.cpu_smoke else (torch.bfloat16, torch.float32)
    if args.dtypes:  # the extra records in the dtypes asked for (float64 stays: it is the exact-tie reference)
        dtypes = tuple(dt for dt in dtypes if str(dt).replace("torch.", "") in args.dtypes.split(",")) or dtypes[:1]
    for fn in (lambda: [row_independence(device, dt, args.cpu_smoke) for dt in dtypes],
               lambda: [determinism(cases[0], torch.float32 if args.cpu_smoke else torch.bfloat16, device)],
               lambda: top1_ties(device, (torch.float32, torch.float64) if args.cpu_smoke
                                 else (torch.float32, torch.bfloat16, torch.float64)),
               lambda: [] if args.skip_timing else timing(device, args.cpu_smoke)):
        try:
            recs = fn()
        except Exception as exc:  # record and go on
            recs = [dict(case="extra", ok=False, error=repr(exc)[:2000])]
        for rec in recs:
            add(rec)
    results["cost_table"] = cost_table()
    write(final=True)
    print("ALL OK" if all_ok else "SOME CHECKS FAILED", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
