"""GPU check of the CUDA backend: every path once against float64, then timings beside the cost model.

    python -m benchmarks.device.check_cuda --out results/cuda_check.json [--quick] [--budget-s 150]
    python -m benchmarks.device.check_cuda --out /tmp/cuda_check.json --cpu-smoke     # the dry run, no GPU

Sections, each recorded in the JSON with its checks (``ok`` false on any failure, never a skipped check
silently passing):

* ``environment``: versions, the extension's runtime and driver, the device, the out_dtype / GEMM
  accumulation probe, the plan at the H200 shape (N=16384, D=4096, V=151936);
* ``cases``: statistics and gradients (recompute backward and grad-in-forward path) for V in {128256, 151936} and
  a prime V (131071), peaked rows, one token and odd token counts, fp32 / bf16 / fp16, with and without a
  teacher (KL, JSD), ``lse_lo`` and ``is_top1``'s first-argmax rule: fp32 within 1e-5 of float64 (TF32 off),
  bf16/fp16 no worse than the naive materialised same-dtype computation plus 1e-3;
* ``paths``: the multi-chunk grad-in-forward path (N=2500, V=151936 bf16, a 256 MiB workspace: 9 chunks) beside the
  default workspace (one chunk); the composable path with row offsets > 0 (several row chunks); fp32 with
  torch's TF32 switched on (the backend must ignore it); fp16 with a GradScaler-sized loss scale (2^16) on
  both paths; the caller's current device unchanged after every call;
* ``confident``: fp32 rows with lse ~ 30 and 1 - q_y down to ~1e-4 within 1e-5 (backward and grad-in-forward);
* ``timings``: cross_entropy, token_logprobs (+entropy) and reverse-KL distillation at N=16384, D=4096,
  V=151936 bf16, forward and backward timed separately (CUDA events, median of 3 after a warm-up), for
  workspaces of 1 GiB, 2 GiB and the default, each with the cost model's figure beside it (a row whose own
  expected time, three times its modelled calls, no longer fits the budget is recorded as skipped);
* ``racecheck``: ``compute-sanitizer --tool racecheck`` over ``benchmarks/device/sanitize_smoke.py --tiles`` (the
  fold and JSD kernels' shared-memory block reductions), when compute-sanitizer is on the PATH.

``--cpu-smoke`` runs every section on tiny shapes on CPU tensors through the kernels' host twins (the
timings are then CPU times of tiny shapes, labelled so; the sanitizer is skipped): it checks the script,
not the GPU. The JSON is rewritten after every section, so a run cut short by its time box keeps what it
measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rel(a, b) -> float:
    a, b = a.double(), b.double().to(a.device)
    nb = float(b.norm())
    return float((a - b).norm()) / max(nb, 1e-30) if nb > 0 else float((a - b).norm())


class Context:
    """Shapes and device of the run: the GPU's, or tiny ones on the CPU (--cpu-smoke)."""

    def __init__(self, smoke: bool, quick: bool, budget_s: float):
        import torch

        self.smoke, self.quick = smoke, quick
        self.device = torch.device("cpu" if smoke else "cuda")
        self.start, self.budget = time.monotonic(), budget_s
        big = not smoke
        self.V = (128256, 151936) if big else (1031, 2053)
        self.V_prime = 131071 if big else 1021
        self.D = 1024 if big else 64
        self.N_case = 257 if big else 17
        self.N_path = 2500 if big else 250
        self.fp16_shape = (4096, 32003, 256) if big else (512, 1031, 32)
        self.timing_shape = (16384, 4096, 151936) if big else (64, 64, 1031)
        self.workspaces = (1024, 2048, None) if big else (1, 4, None)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()


@contextlib.contextmanager
def _host_public_api(ctx: Context):
    """On CPU tensors the public API refuses backend='cuda': route it to the host twins (smoke only)."""
    if not ctx.smoke:
        yield
        return
    from fusedloss.core import registry

    original = registry.resolve
    registry.resolve = lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest)
    try:
        yield
    finally:
        registry.resolve = original


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _check(checks, what, err, limit, finite=True):
    ok = bool(finite) and math.isfinite(err) and err <= limit
    checks.append({"what": what, "err": err, "limit": limit, "ok": ok})
    return ok


# ------------------------------------------------------------------------------------------------
# Statistics and gradients against float64
# ------------------------------------------------------------------------------------------------
def _coeffs(stats, g_logp, g_ent, g_klrev, targets):
    """Per-row dz coefficients (a, c0..c5) of sum(g_logp logp + g_ent entropy + g_klrev kl_rev), from the one
    definition of their layout (fusedloss.core.statistics.dz_coefficients; problem.py)."""
    import torch

    from fusedloss.core.statistics import dz_coefficients

    weights = {"logp": g_logp, "entropy": g_ent, "kl_rev": g_klrev}
    grad = torch.stack([torch.full_like(stats.lse, float(weights.get(name, 0.0))) for name in type(stats)._fields])
    return dz_coefficients(grad, torch.stack(tuple(stats)), None, targets, 1)


def _reference(h, w, b, y, ht, wt, temperature, g_logp, g_ent, g_klrev, dtype):
    """Statistics (benchmarks/cases.py's ``statistics_of``) and gradients on materialised logits in ``dtype``
    (float64: ground truth; else the naive same-dtype computation)."""
    import torch

    from benchmarks import cases

    h = h.to(dtype).detach().requires_grad_(True)
    w = w.to(dtype).detach().requires_grad_(True)
    b = b.to(dtype).detach().requires_grad_(True)
    z = (h @ w.T + b) / temperature
    zt = None if ht is None else (ht.to(dtype) @ wt.to(dtype).T) / temperature
    out = cases.statistics_of(z, y, zt, 0.5)
    loss = g_logp * out["logp"].sum() + g_ent * out["entropy"].sum()
    if ht is not None:
        loss = loss + g_klrev * out["kl_rev"].sum()
    dh, dw, db = torch.autograd.grad(loss, [h, w, b])
    return {k: v.detach() for k, v in out.items()}, (dh, dw, db)


def _make(ctx, name, n, v, d, dtype, peaked, teacher):
    import torch

    from fusedloss.core.problem import LogitTransform, StatsProblem

    dev = ctx.device
    g = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()))
    h = torch.randn(n, d, device=dev, generator=g)
    w = torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)
    b = torch.randn(v, device=dev, generator=g) * 0.1
    if peaked:
        hot = torch.randint(0, v, (4,), device=dev, generator=g)
        w[hot] += 30.0 * h.mean(0) / h.mean(0).norm() ** 2
        w[(hot[0] + 7) % v] = w[hot[0]]  # an exact duplicate of a hot row: tied maxima (first-argmax rule)
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    if n > 2:
        y[1] = -1  # an ignored row
    ht = wt = None
    if teacher:
        ht = torch.randn(n, d, device=dev, generator=g)
        wt = torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)  # every path sees the same rounded values
    if teacher:
        ht, wt = ht.to(dtype), wt.to(dtype)
    temperature = 0.9
    p = StatsProblem(hidden=h, weight=w, bias=b, targets=y, transform=LogitTransform(temperature),
                     teacher_hidden=ht, teacher_weight=wt, teacher_transform=LogitTransform(temperature),
                     want_entropy=True, want_kl_rev=teacher, want_kl_fwd=teacher, jsd_beta=0.5 if teacher else None,
                     want_mean_logit=True, want_extras=True)
    return p, (h, w, b, y, ht, wt, temperature)


def _judge_gradients(checks, label, grads, truth, naive):
    for gname, gv, gw, gn in zip(("d_hidden", "d_weight", "d_bias"), grads, truth, naive or (None, None, None)):
        limit = 1e-5 if gn is None else _rel(gn, gw) + 1e-3
        _check(checks, f"{label}.{gname}", _rel(gv.float(), gw), limit, bool(gv.isfinite().all()))


def run_case(ctx, results, name, n, v, d, dtype_name, peaked, teacher):
    import torch

    from fusedloss.backends.cuda import backend as cuda
    from fusedloss.core.grad_in_forward import formed
    from fusedloss.core.problem import GradientNeeds

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    p, raw = _make(ctx, name, n, v, d, dtype, peaked, teacher)
    y = raw[3]
    g_logp, g_ent, g_klrev = 1.0, 0.5, 0.3 if teacher else 0.0
    truth, grads64 = _reference(*raw, g_logp, g_ent, g_klrev, torch.float64)
    naive, grads_naive = (None, None) if dtype == torch.float32 else _reference(*raw, g_logp, g_ent, g_klrev, dtype)
    stats = cuda.forward_statistics(p)
    coeffs = _coeffs(stats, g_logp, g_ent, g_klrev, y)
    needs = GradientNeeds(True, True, True)
    grads = cuda.backward_gradients(p, stats, coeffs, needs)

    def chunk_fn(st, rows):
        c = _coeffs(st, g_logp, g_ent, g_klrev, y[rows])
        return (g_logp * st.logp + g_ent * st.entropy + g_klrev * st.kl_rev).sum(), c

    _, grad_in_forward = cuda.grad_in_forward_gradients(p, chunk_fn, needs)
    grad_in_forward = formed(grad_in_forward)  # a deferred d weight formed at grad 1
    ctx.sync()
    checks = []
    for key, ref in truth.items():
        if key == "is_top1":  # exact: near-ties may flip under fp32 rounding, allow one row
            bad = int((stats.is_top1.double() != ref).sum())
            checks.append({"what": "stat.is_top1", "err": bad, "limit": 1, "ok": bad <= 1})
            continue
        limit = 1e-5 if naive is None else _rel(naive[key], ref) + 1e-3
        got = getattr(stats, key)
        _check(checks, f"stat.{key}", _rel(got, ref), limit, bool(got.isfinite().all()))
    hilo = stats.lse.double() + stats.lse_lo.double()  # the unrounded normaliser: no worse than lse alone
    err_hi = _rel(stats.lse, truth["lse"])
    _check(checks, "stat.lse+lse_lo", _rel(hilo, truth["lse"]), 2.0 * max(err_hi, 1e-7),
           bool(stats.lse_lo.isfinite().all()))
    _judge_gradients(checks, "backward", grads, grads64, grads_naive)
    _judge_gradients(checks, "grad_in_forward", grad_in_forward, grads64, grads_naive)
    results.append({"name": name, "checks": checks, "ok": all(c["ok"] for c in checks)})


# ------------------------------------------------------------------------------------------------
# Paths the small cases do not reach
# ------------------------------------------------------------------------------------------------
def path_checks(ctx, results):
    import torch

    from fusedloss.backends.cuda import backend as cuda
    from fusedloss.core.grad_in_forward import formed
    from fusedloss.core.problem import GradientNeeds

    checks, info = [], {}
    n, v, d = ctx.N_path, ctx.V[1], ctx.D
    p, raw = _make(ctx, "paths", n, v, d, torch.bfloat16, True, False)
    y = raw[3]
    truth, grads64 = _reference(*raw, 1.0, 0.5, 0.0, torch.float64)
    _, grads_naive = _reference(*raw, 1.0, 0.5, 0.0, torch.bfloat16)
    needs = GradientNeeds(True, True, True)

    def chunk_fn(st, rows):
        return (st.logp + 0.5 * st.entropy).sum(), _coeffs(st, 1.0, 0.5, 0.0, y[rows])

    # the grad-in-forward path at two workspaces: many chunks (the fp32 [V, D] accumulated inside the GEMM) and one
    small = {"workspace_mb": 256} if not ctx.smoke else {"grad_in_forward_rows": n // 9 + 1}
    for label, override in (("grad-in-forward.small_workspace", small), ("grad-in-forward.default_workspace", {})):
        with cuda.override_plan(**override):
            chunks = math.ceil(n / cuda.grad_in_forward_rows(p))
            t0 = time.perf_counter()
            _, grad_in_forward = cuda.grad_in_forward_gradients(p, chunk_fn, needs)
            grad_in_forward = formed(grad_in_forward)  # a deferred d weight formed at grad 1
            ctx.sync()
            info[label] = {"chunks": chunks, "seconds": time.perf_counter() - t0}
        _judge_gradients(checks, f"{label}[{chunks} chunks]", grad_in_forward, grads64, grads_naive)
    # the composable path over several row chunks: tiles start at row offsets > 0
    rows = 1000 if not ctx.smoke else 100
    with cuda.override_plan(tile_rows=rows):
        stats = cuda.forward_statistics(p)
        grads = cuda.backward_gradients(p, stats, _coeffs(stats, 1.0, 0.5, 0.0, y), needs)
    ctx.sync()
    _check(checks, f"composable.row_chunks[{math.ceil(n / rows)}].logp", _rel(stats.logp, truth["logp"]),
           _rel(_reference(*raw, 1.0, 0.5, 0.0, torch.bfloat16)[0]["logp"], truth["logp"]) + 1e-3)
    _judge_gradients(checks, "composable.row_chunks", grads, grads64, grads_naive)
    # fp32 with torch's TF32 switched on: the backend's products stay full fp32
    matmul = torch.backends.cuda.matmul
    pf, rawf = _make(ctx, "tf32", ctx.N_case, v, d, torch.float32, False, False)
    previous = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        statsf = cuda.forward_statistics(pf)
        gradsf = cuda.backward_gradients(pf, statsf, _coeffs(statsf, 1.0, 0.5, 0.0, rawf[3]), needs)
        ctx.sync()
        info["tf32_flag_after_call"] = matmul.allow_tf32
    finally:
        matmul.allow_tf32 = previous
    truthf, gradsf64 = _reference(*rawf, 1.0, 0.5, 0.0, torch.float64)
    _check(checks, "fp32_with_tf32_on.logp", _rel(statsf.logp, truthf["logp"]), 1e-5)
    _judge_gradients(checks, "fp32_with_tf32_on", gradsf, gradsf64, None)
    checks.append({"what": "fp32_with_tf32_on.flag_restored", "err": 0, "limit": 0,
                   "ok": info["tf32_flag_after_call"] is True})
    fp16_checks(ctx, checks)
    device_restore_checks(ctx, checks)
    results.append({"name": "paths", "checks": checks, "info": info, "ok": all(c["ok"] for c in checks)})


def fp16_checks(ctx, checks):
    """cross_entropy (mean) in fp16 with a GradScaler-sized scale (2^16), grad-in-forward and composable: the
    gradients no worse than the naive fp16 AMP computation (materialised fp16 logits, fp32 loss)."""
    import torch

    import fusedloss
    from fusedloss import reference

    n, v, d = ctx.fp16_shape
    g = torch.Generator(device=ctx.device).manual_seed(16)
    h = torch.randn(n, d, device=ctx.device, generator=g)
    w = torch.randn(v, d, device=ctx.device, generator=g) * 0.3
    hot = torch.randint(0, v, (4,), device=ctx.device, generator=g)
    w[hot] += 3.0 * h.mean(0) / h.mean(0).norm()
    y = torch.randint(0, v, (n,), device=ctx.device, generator=g)
    h16, w16 = h.half(), w.half()
    scale = 2.0**16

    def grads(fn, dtype):
        hh, ww = h16.detach().to(dtype, copy=True).requires_grad_(), w16.detach().to(dtype, copy=True).requires_grad_()
        fn(hh, ww).backward()
        return hh.grad.double() / scale, ww.grad.double() / scale

    truth = grads(lambda a, b: reference.cross_entropy(a, b, y) * scale, torch.float64)
    naive = grads(lambda a, b: torch.nn.functional.cross_entropy((a @ b.T).float(), y) * scale, torch.float16)
    with _host_public_api(ctx):
        for path in ("grad_in_forward", "composable"):
            with _env("FUSEDLOSS_GRAD_IN_FORWARD", "1" if path == "grad_in_forward" else "0"):
                got = grads(lambda a, b: fusedloss.cross_entropy(a, b, y, backend="cuda") * scale, torch.float16)
            for name, gv, gt, gn in zip(("d_hidden", "d_weight"), got, truth, naive):
                _check(checks, f"fp16_loss_scale_2^16.{path}.{name}", _rel(gv, gt), _rel(gn, gt) + 1e-4,
                       bool(gv.isfinite().all()))


def device_restore_checks(ctx, checks):
    """The caller's current device is unchanged by a launch (and, with two GPUs, a call on cuda:1 from
    cuda:0 leaves cuda:0 current)."""
    import torch

    import fusedloss

    if ctx.smoke:
        return
    before = torch.cuda.current_device()
    targets = [0] + ([1] if torch.cuda.device_count() > 1 else [])
    for index in targets:
        dev = torch.device("cuda", index)
        h = torch.randn(5, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(1031, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
        fusedloss.cross_entropy(h, w, torch.randint(0, 1031, (5,), device=dev), backend="cuda").backward()
        torch.cuda.synchronize(dev)
        after = torch.cuda.current_device()
        checks.append({"what": f"current_device_after_call_on_cuda:{index}", "err": after, "limit": before,
                       "ok": after == before})


def confident_checks(ctx, results):
    """fp32 rows with lse ~ 30 and 1 - q_y from ~0.1 to ~1e-4: logp and d sum(logp) within 1e-5 of float64."""
    import torch

    from fusedloss.backends.cuda import backend as cuda
    from fusedloss.core.grad_in_forward import formed
    from fusedloss.core.problem import GradientNeeds, LogitTransform, StatsProblem

    dev = ctx.device
    checks = []
    for n in (1, 5):
        for gap in (6.0, 10.0, 13.0):
            g = torch.Generator(device=dev).manual_seed(int(gap) * 10 + n)
            v, d = ctx.V[1], ctx.D
            h = torch.randn(n, d, device=dev, generator=g)
            w = torch.randn(v, d, device=dev, generator=g) / math.sqrt(d) * 0.5
            y = torch.randint(0, v, (n,), device=dev, generator=g)
            b = torch.full((v,), 30.0 - gap, device=dev) + torch.randn(v, device=dev, generator=g) * 0.5
            b[y] = 30.0
            p = StatsProblem(hidden=h, weight=w, bias=b, targets=y, transform=LogitTransform())
            h64, w64, b64 = (t.double().requires_grad_(True) for t in (h, w, b))
            logp64 = torch.log_softmax(h64 @ w64.T + b64, -1).gather(1, y[:, None]).squeeze(1)
            grads64 = torch.autograd.grad(logp64.sum(), (h64, w64, b64))
            stats = cuda.forward_statistics(p)
            coeffs = torch.zeros(7, n, device=dev)
            coeffs[0] = 1.0  # d sum(logp) / dz = onehot(y) - q (problem.py)
            needs = GradientNeeds(True, True, True)
            back = cuda.backward_gradients(p, stats, coeffs, needs)
            _, grad_in_forward = cuda.grad_in_forward_gradients(p, lambda st, rows: (st.logp.sum(), coeffs[:, rows]),
                                                                needs)
            grad_in_forward = formed(grad_in_forward)  # a deferred d weight formed at grad 1
            tag = f"N{n}-gap{gap:g}"
            items = [("logp", stats.logp, logp64.detach())]
            for label, gs in (("backward", back), ("grad_in_forward", grad_in_forward)):
                names = ("d_hidden", "d_weight", "d_bias")
                items += [(f"{label}.{k}", gv, gw) for k, gv, gw in zip(names, gs, grads64)]
            for what, got, want in items:
                _check(checks, f"{tag}.{what}", _rel(got, want), 1e-5, bool(got.isfinite().all()))
    results.append({"name": "fp32_confident_rows", "checks": checks, "ok": all(c["ok"] for c in checks)})


# ------------------------------------------------------------------------------------------------
# Timings beside the cost model
# ------------------------------------------------------------------------------------------------
TIMED_OPS = (("cross_entropy", "cross_entropy"), ("token_logprobs", "token_logprobs_entropy"),
             ("distillation_loss", "distill_reverse_kl"))


TIMED_REPS = 3


def _time_call(ctx, fn, reps=TIMED_REPS):
    """(forward ms, backward ms) medians, with CUDA events (host clock on the CPU)."""
    import torch

    fwd, bwd = [], []
    for i in range(reps + 1):
        if ctx.device.type == "cuda":
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            loss = fn()
            e[1].record()
            loss.backward()
            e[2].record()
            torch.cuda.synchronize()
            f, b = e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2])
        else:
            t0 = time.perf_counter()
            loss = fn()
            t1 = time.perf_counter()
            loss.backward()
            f, b = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
        if i:  # the first call warms up (probe, allocator, cuBLAS heuristics)
            fwd.append(f)
            bwd.append(b)
    return sorted(fwd)[len(fwd) // 2], sorted(bwd)[len(bwd) // 2]


def timing_checks(ctx, results):
    import torch

    import fusedloss
    from benchmarks import cases, cost_model
    from fusedloss.backends import gpu as gpu_glue
    from fusedloss.backends.cuda import backend as cuda

    n, d, v = ctx.timing_shape
    rows = []
    gpu = "h200"
    if ctx.device.type == "cuda":
        name = torch.cuda.get_device_name().upper()
        gpu = next((k for k in ("h200", "h100", "a100", "b200") if k.upper() in name), "h200")
    with _host_public_api(ctx):
        for op, model_op in TIMED_OPS:
            if ctx.quick and op == "distillation_loss":
                continue
            prob = cases.make_problem(op, n, v, d, torch.bfloat16 if not ctx.smoke else torch.float32, ctx.device,
                                      seed=1)
            for ws in ctx.workspaces:
                override = {} if ws is None else {"workspace_mb": ws}
                with cuda.override_plan(**override):
                    budget = cuda.workspace_bytes(gpu_glue.free_bytes(ctx.device))
                model = cost_model.estimate(model_op, "cuda", n, d, v, dtype="bfloat16", gpu=gpu,
                                            workspace_mb=budget / 2**20)
                # the row's own expected time: a warm-up and TIMED_REPS calls at three times the modelled time
                # (the model has not been checked against this GPU yet), and 2 s for the first call's probes
                expected_s = (1 + TIMED_REPS) * 3 * model["model_ms"] / 1e3 + 2.0
                if ctx.device.type == "cuda" and ctx.left() < expected_s:
                    rows.append({"op": op, "workspace_mb": ws, "expected_s": round(expected_s, 1),
                                 "skipped": f"budget: {ctx.left():.0f} s left, the row needs ~{expected_s:.0f} s"})
                    continue
                with cuda.override_plan(**override):
                    def call():
                        h, w = prob.leaves()
                        return cases.call_op(getattr(fusedloss, op), prob, h, w, backend="cuda")[0]

                    fwd, bwd = _time_call(ctx, call, TIMED_REPS)
                rows.append({"op": op, "workspace_mb": ws or round(budget / 2**20), "default": ws is None,
                             "path": model["path"], "forward_ms": fwd, "backward_ms": bwd, "measured_ms": fwd + bwd,
                             "modelled_ms": model["model_ms"], "modelled_bound_ms": model["bound_ms"],
                             "measured_over_modelled": (fwd + bwd) / model["model_ms"],
                             "modelled_plan": model["plan"], "modelled_passes_ms": model["passes"]})
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
    results.append({"name": "timings", "shape": {"N": n, "D": d, "V": v},
                    "device": "cpu host twins (tiny shape)" if ctx.smoke else "cuda", "rows": rows, "ok": True,
                    "checks": []})


# ------------------------------------------------------------------------------------------------
# racecheck over the shared-memory reductions
# ------------------------------------------------------------------------------------------------
def racecheck(ctx, results):
    sanitizer = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    entry = {"name": "racecheck", "checks": []}
    if ctx.smoke:  # the dry run checks the script; there is no device to sanitise
        entry.update(ok=True, skipped="cpu smoke run")
        results.append(entry)
        return
    if sanitizer is None:
        entry.update(ok=False, error="compute-sanitizer not found (PATH, /usr/local/cuda/bin): racecheck not run")
        results.append(entry)
        return
    cmd = [sanitizer, "--tool", "racecheck", "--racecheck-report", "all", "--error-exitcode", "86",
           sys.executable, "-m", "benchmarks.device.sanitize_smoke", "--tiles", "--device", "cuda"]
    timeout = max(30, min(120, int(ctx.left()) - 5))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        tail = (proc.stdout + proc.stderr)[-3000:]
        summary = [ln for ln in tail.splitlines() if "SUMMARY" in ln or "hazard" in ln.lower()]
        entry.update(rc=proc.returncode, summary=summary[-5:], tail=tail[-1500:])
        entry["checks"].append({"what": "racecheck exit status (86: hazards)", "err": proc.returncode, "limit": 0,
                                "ok": proc.returncode == 0})
    except subprocess.TimeoutExpired:
        entry["checks"].append({"what": f"racecheck finished within {timeout} s", "err": timeout, "limit": timeout,
                                "ok": False})
    entry["ok"] = all(c["ok"] for c in entry["checks"])
    results.append(entry)


# ------------------------------------------------------------------------------------------------
def environment(ctx):
    import torch

    import fusedloss
    from benchmarks import cost_model
    from fusedloss.backends import gpu
    from fusedloss.backends.cuda import backend as cuda

    env = {"status": fusedloss.backend_status(), "torch": torch.__version__, "runtime": cuda.runtime_info(),
           "smoke": ctx.smoke}
    if not ctx.smoke:
        env["device"] = torch.cuda.get_device_name()
        env["capabilities"] = gpu.capabilities(ctx.device)._asdict()
        env["free_bytes_at_first_call"] = gpu.free_bytes(ctx.device)
    env["model_h200_cross_entropy"] = cost_model.estimate("cross_entropy", "cuda", 16384, 4096, 151936)
    return env


SECTIONS = ("cases", "paths", "confident", "timings", "racecheck")


def _write(path, report):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="fewer cases (fp32 + bf16 at V=151936 only)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU host twins (dry run)")
    parser.add_argument("--budget-s", type=float, default=140.0,
                        help="start no section after this many seconds (the whole check: ~90 s on an H200)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS)
    args = parser.parse_args(argv)

    import torch

    from fusedloss.backends.cuda import backend as cuda

    ctx = Context(args.cpu_smoke, args.quick, args.budget_s)
    report = {"sections": list(args.only), "cases": []}
    ready = cuda.extension_built() if ctx.smoke else cuda.availability() == "available"
    if not ready:
        report.update(ok=False, error=f"cuda backend not available: {cuda.availability()}")
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        report["environment"] = environment(ctx)
        cases = []
        if "cases" in args.only:
            for dt in ("fp32", "bf16", "fp16"):
                for v in ctx.V:
                    cases.append((f"{dt}-V{v}-N{ctx.N_case}", ctx.N_case, v, ctx.D, dt, False, False))
                cases.append((f"{dt}-V{ctx.V[1]}-peaked-N64", 64, ctx.V[1], ctx.D, dt, True, False))
                cases.append((f"{dt}-V{ctx.V_prime}prime-N1", 1, ctx.V_prime, ctx.D, dt, True, False))
                cases.append((f"{dt}-V{ctx.V_prime}prime-teacher-N33", 33, ctx.V_prime, ctx.D // 2, dt, False, True))
            if args.quick:
                cases = [c for c in cases if c[4] in ("fp32", "bf16") and c[2] == ctx.V[1]]
        steps = [(c[0], lambda c=c: run_case(ctx, report["cases"], *c)) for c in cases]
        for section, fn in (("paths", path_checks), ("confident", confident_checks), ("timings", timing_checks),
                            ("racecheck", racecheck)):
            if section in args.only:
                steps.append((section, lambda fn=fn: fn(ctx, report["cases"])))
        for name, step in steps:
            if ctx.left() <= 0:
                why = f"not run: the {args.budget_s:.0f} s budget"
                report["cases"].append({"name": name, "ok": False, "error": why})
                continue
            t0 = time.monotonic()
            try:
                step()
            except Exception as exc:  # keep going: one failure should not hide the others
                report["cases"].append({"name": name, "ok": False, "error": repr(exc),
                                        "traceback": traceback.format_exc()})
            last = report["cases"][-1]
            last.setdefault("seconds", time.monotonic() - t0)
            bad = [c for c in last.get("checks", []) if not c["ok"]]
            print(f"[{'ok' if last.get('ok') else 'FAIL'}] {name} ({last['seconds']:.1f} s)"
                  + (f": {last['error']}" if "error" in last else "")
                  + "".join(f"\n    {c['what']} = {c['err']:.3g} > {c['limit']:.3g}" for c in bad[:8]), flush=True)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
            _write(args.out, dict(report, ok=False, partial=f"written after {name}"))  # survives a kill
        report["ok"] = all(c.get("ok") for c in report["cases"])
        timing = next((c for c in report["cases"] if c["name"] == "timings"), None)
        if timing:
            print(f"{'op':<18} {'workspace':>10} {'path':<10} {'fwd ms':>8} {'bwd ms':>8} "
                  f"{'modelled ms':>9} {'measured/modelled':>8}")
            for r in timing["rows"]:
                if "skipped" in r:
                    print(f"{r['op']:<18} {str(r['workspace_mb']):>10} skipped: {r['skipped']}")
                    continue
                print(f"{r['op']:<18} {r['workspace_mb']:>8}{'*' if r['default'] else ' '} MB {r['path']:<10} "
                      f"{r['forward_ms']:8.2f} {r['backward_ms']:8.2f} {r['modelled_ms']:9.2f} "
                      f"{r['measured_over_modelled']:8.2f}")
    _write(args.out, report)
    print(f"wrote {args.out}: ok={report['ok']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
