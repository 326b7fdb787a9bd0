"""GPU correctness check of the CUDA backend (run on the device machine; builds nothing itself).

For V in {128256, 151936} plus a prime V (131071), peaked rows (a few logits ~30 above the rest), one
token and an odd token count, and each dtype in {fp32, bf16, fp16}, compares against float64 ground
truth on materialised logits:

* forward statistics (lse, logp, entropy, mean_logit, log_sum_sq_probs; with a teacher kl_rev, kl_fwd,
  jsd) from ``forward_statistics``;
* gradients (d hidden, d weight, d bias) of ``sum(logp) + 0.5 sum(entropy) [+ 0.3 sum(kl_rev)]`` through
  ``backward_gradients`` (recompute, 3 products) and ``eager_gradients`` (3 products, no recompute);
* ``lse_lo`` (hi + lo against the float64 lse) and ``is_top1`` (the FIRST argmax, with exact ties from
  duplicate weight rows);
* fp32 confident rows (lse ~ 30, 1 - q_y down to ~1e-4, one token and five): logp and the gradients of
  sum(logp) within 1e-5 of float64 (backward and eager);
* the GRPO / DPO per-token kernels (``grpo_token_math``, and the autograd functions ``grpo_token_loss`` /
  ``dpo_pair_loss`` used by the losses: values and gradients, fp32 and float64) against their host twins.

Criteria (SPEC section 6): fp32 within 1e-5 norm-wise relative (TF32 disabled); bf16/fp16 error no larger
than the naive same-dtype materialised computation's error plus 1e-3 relative.

    python benchmarks/device_check_cuda.py --out results/cuda_check.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
import zlib


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    nb = float(b.norm())
    return float((a - b).norm()) / max(nb, 1e-30) if nb > 0 else float((a - b).norm())


def _coeffs(stats, g_logp, g_ent, g_klrev, targets):
    """Per-row dz coefficients (a, c0..c5) of sum(g_logp logp + g_ent entropy + g_klrev kl_rev)
    (problem.py: d logp = [j=y] - q, d H = -q (log q + H), d KL(q||p) = q (log q - log p - KL))."""
    import torch

    n = stats.lse.shape[0]
    one = torch.ones(n, device=stats.lse.device, dtype=torch.float32)
    a = g_logp * one
    c0 = -g_logp * one - g_ent * stats.entropy - g_klrev * stats.kl_rev
    c1 = (g_klrev - g_ent) * one
    c2 = -g_klrev * one
    zero = torch.zeros_like(one)
    c = torch.stack((a, c0, c1, c2, zero, zero, zero))
    return torch.where(targets >= 0, c, torch.zeros_like(c))


def _reference(h, w, b, y, ht, wt, temperature, g_logp, g_ent, g_klrev, dtype):
    """Statistics and gradients on materialised logits in ``dtype`` (float64: ground truth; else the
    naive same-dtype computation)."""
    import torch

    h = h.to(dtype).detach().requires_grad_(True)
    w = w.to(dtype).detach().requires_grad_(True)
    b = b.to(dtype).detach().requires_grad_(True)
    z = (h @ w.T + b) / temperature
    logq = torch.log_softmax(z, -1)
    q = logq.exp()
    valid = y >= 0
    logp = logq.gather(1, y.clamp_min(0)[:, None]).squeeze(1) * valid
    ent = -(q * logq).sum(-1) * valid
    out = {"lse": torch.logsumexp(z, -1) * valid, "logp": logp, "entropy": ent,
           "mean_logit": z.mean(-1) * valid, "log_sum_sq_probs": torch.log((q * q).sum(-1)) * valid,
           "is_top1": (z.argmax(-1) == y).to(z.dtype) * valid}
    loss = g_logp * logp.sum() + g_ent * ent.sum()
    if ht is not None:
        zt = (ht.to(dtype) @ wt.to(dtype).T) / temperature
        logpt = torch.log_softmax(zt, -1)
        pt = logpt.exp()
        kl_rev = (q * (logq - logpt)).sum(-1) * valid
        out["kl_rev"] = kl_rev
        out["kl_fwd"] = (pt * (logpt - logq)).sum(-1) * valid
        logm = torch.logaddexp(logq + math.log(0.5), logpt + math.log(0.5))
        out["jsd"] = (0.5 * (pt * (logpt - logm)).sum(-1) + 0.5 * (q * (logq - logm)).sum(-1)) * valid
        loss = loss + g_klrev * kl_rev.sum()
    dh, dw, db = torch.autograd.grad(loss, [h, w, b])
    return {k: v.detach() for k, v in out.items()}, (dh, dw, db)


def run_case(name, n, v, d, dtype_name, peaked, teacher, quick, results):
    import torch

    from fusedloss.core.problem import GradientNeeds, LogitTransform, StatsProblem
    from fusedloss.cuda import backend as cuda

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()))
    h = torch.randn(n, d, device=dev, generator=g)
    w = torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)
    b = torch.randn(v, device=dev, generator=g) * 0.1
    if peaked:
        hot = torch.randint(0, v, (4,), device=dev, generator=g)
        w[hot] += 30.0 * h.mean(0) / h.mean(0).norm() ** 2
        w[(hot[0] + 7) % v] = w[hot[0]]  # an exact duplicate of a hot row: tied maxima (is_top1's first-argmax rule)
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    if n > 2:
        y[1] = -1  # an ignored row
    ht = wt = None
    if teacher:
        ht = torch.randn(n, d, device=dev, generator=g)
        wt = torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)
    temperature = 0.9
    # Round the inputs to the test dtype once: every path then sees the same values.
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    if teacher:
        ht, wt = ht.to(dtype), wt.to(dtype)
    g_logp, g_ent, g_klrev = 1.0, 0.5, 0.3 if teacher else 0.0

    truth, grads64 = _reference(h, w, b, y, ht, wt, temperature, g_logp, g_ent, g_klrev, torch.float64)
    if dtype != torch.float32:
        naive, grads_naive = _reference(h, w, b, y, ht, wt, temperature, g_logp, g_ent, g_klrev, dtype)
    else:
        naive, grads_naive = None, None

    p = StatsProblem(hidden=h, weight=w, bias=b, targets=y, transform=LogitTransform(temperature),
                     teacher_hidden=ht, teacher_weight=wt, teacher_transform=LogitTransform(temperature),
                     want_entropy=True, want_kl_rev=teacher, want_kl_fwd=teacher, jsd_beta=0.5 if teacher else None,
                     want_mean_logit=True, want_extras=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stats = cuda.forward_statistics(p)
    torch.cuda.synchronize()
    t_fwd = time.perf_counter() - t0
    coeffs = _coeffs(stats, g_logp, g_ent, g_klrev, y)
    needs = GradientNeeds(True, True, True)
    t0 = time.perf_counter()
    grads = cuda.backward_gradients(p, stats, coeffs, needs)
    torch.cuda.synchronize()
    t_bwd = time.perf_counter() - t0

    def chunk_fn(st, r0, r1):
        c = _coeffs(st, g_logp, g_ent, g_klrev, y[r0:r1])
        return (g_logp * st.logp + g_ent * st.entropy + g_klrev * st.kl_rev).sum(), c

    t0 = time.perf_counter()
    _, eager = cuda.eager_gradients(p, chunk_fn, needs)
    torch.cuda.synchronize()
    t_eager = time.perf_counter() - t0

    tol_fp32 = 1e-5
    checks = []

    def judge(label, got, want, naive_val):
        err = _rel(got, want)
        if naive_val is None:
            limit = tol_fp32
        else:
            limit = _rel(naive_val, want) + 1e-3
        ok = bool(torch.isfinite(got).all()) and err <= limit
        checks.append({"what": label, "err": err, "limit": limit, "ok": ok})

    for key, ref in truth.items():
        if key == "is_top1":  # exact: count mismatching rows (near-ties may flip under fp32 rounding: allow 1)
            bad = int((stats.is_top1.double() != ref).sum())
            checks.append({"what": "stat.is_top1", "err": bad, "limit": 1, "ok": bad <= 1})
            continue
        judge(f"stat.{key}", getattr(stats, key), ref, None if naive is None else naive[key])
    # lse + lse_lo is the unrounded normaliser: at least as close to float64 as lse alone
    hilo = stats.lse.double() + stats.lse_lo.double()
    err_hilo, err_hi = _rel(hilo, truth["lse"]), _rel(stats.lse, truth["lse"])
    limit_hilo = 2.0 * max(err_hi, 1e-7)  # garbage in lse_lo would be far larger
    checks.append({"what": "stat.lse+lse_lo", "err": err_hilo, "limit": limit_hilo,
                   "ok": bool(torch.isfinite(stats.lse_lo).all()) and err_hilo <= limit_hilo})
    if teacher:
        ok_t = bool(torch.isfinite(stats.lse_t_lo).all()) and float(stats.lse_t_lo.abs().max()) <= 1e-5 * max(
            1.0, float(stats.lse_t.abs().max()))
        checks.append({"what": "stat.lse_t_lo", "err": float(stats.lse_t_lo.abs().max()), "limit": 1e-5, "ok": ok_t})
    for label, gs in (("backward", grads), ("eager", eager)):
        for gname, gv, gw, gn in zip(("d_hidden", "d_weight", "d_bias"), gs, grads64,
                                     grads_naive or (None, None, None)):
            judge(f"{label}.{gname}", gv.float(), gw, gn)
    case = {"name": name, "n": n, "v": v, "d": d, "dtype": dtype_name, "peaked": peaked, "teacher": teacher,
            "seconds": {"forward": t_fwd, "backward": t_bwd, "eager": t_eager}, "checks": checks,
            "ok": all(c["ok"] for c in checks)}
    results.append(case)
    print(f"[{'ok' if case['ok'] else 'FAIL'}] {name}: " + ", ".join(
        f"{c['what']}={c['err']:.2e}" + ("" if c["ok"] else f"(>{c['limit']:.2e})") for c in checks), flush=True)


def confident_checks(results):
    """fp32 rows with lse ~ 30 and 1 - q_y from ~0.1 to ~1e-4: logp and d sum(logp) within 1e-5 of float64."""
    import torch

    from fusedloss.core.problem import GradientNeeds, LogitTransform, StatsProblem
    from fusedloss.cuda import backend as cuda

    dev = torch.device("cuda")
    checks = []
    for n in (1, 5):
        for gap in (6.0, 10.0, 13.0):
            g = torch.Generator(device=dev).manual_seed(int(gap) * 10 + n)
            v, d = 151936, 1024
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
            coeffs[0], coeffs[1] = 1.0, -1.0
            needs = GradientNeeds(True, True, True)
            back = cuda.backward_gradients(p, stats, coeffs, needs)
            _, eager = cuda.eager_gradients(p, lambda st, r0, r1: (st.logp.sum(), coeffs[:, r0:r1]), needs)
            tag = f"N{n}-gap{gap:g}"
            items = [("logp", stats.logp, logp64.detach())]
            for label, gs in (("backward", back), ("eager", eager)):
                items += [(f"{label}.{k}", gv, gw) for k, gv, gw in zip(("d_hidden", "d_weight", "d_bias"), gs, grads64)]
            for what, got, want in items:
                err = _rel(got, want)
                checks.append({"what": f"{tag}.{what}", "err": err, "limit": 1e-5,
                               "ok": bool(torch.isfinite(got).all()) and err <= 1e-5})
            del h64, w64, b64, grads64
            torch.cuda.empty_cache()
    results.append({"name": "fp32_confident_rows", "checks": checks, "ok": all(c["ok"] for c in checks)})
    print(f"[{'ok' if results[-1]['ok'] else 'FAIL'}] fp32_confident_rows: "
          + ", ".join(f"{c['what']}={c['err']:.1e}" for c in checks if not c["ok"] or "logp" in c["what"]),
          flush=True)


def fused_loss_checks(results):
    """grpo_token_loss / dpo_pair_loss (the autograd functions the losses call): GPU launch against the host
    twin, values and gradients, fp32 (1e-6: device and host expf differ by an ulp) and float64 (1e-12)."""
    import torch

    from fusedloss.cuda import backend as cuda

    checks = []
    for dtype, limit in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        g = torch.Generator().manual_seed(1)
        t = 8191
        logp = (-torch.rand(t, generator=g, dtype=torch.float64) * 3).to(dtype)
        old = logp + (torch.randn(t, generator=g, dtype=torch.float64) * 0.4).to(dtype)
        old[:4] = logp[:4] - torch.tensor([30.0, -30.0, 30.0, -30.0], dtype=dtype)  # extreme log-ratios
        ref = logp + (torch.randn(t, generator=g, dtype=torch.float64) * 0.4).to(dtype)
        adv = torch.randn(t, generator=g, dtype=torch.float64).to(dtype)
        iw = (torch.rand(t, generator=g, dtype=torch.float64) + 0.5).to(dtype)
        valid = torch.rand(t, generator=g) > 0.2
        valid[:4] = True
        old[~valid] = -math.inf  # garbage where masked
        up = (torch.rand(t, generator=g, dtype=torch.float64) + 0.5).to(dtype)
        for loss_type in cuda.GRPO_LOSS_TYPES:
            for with_old in (False, True):
                outs = []
                for device in ("cpu", "cuda"):
                    x = logp.to(device).requires_grad_(True)
                    mv = lambda z: None if z is None else z.to(device)  # noqa: E731
                    res = cuda.grpo_token_loss(x, mv(old) if with_old else None, mv(adv), mv(ref), mv(iw), mv(valid),
                                               loss_type=loss_type, epsilon_low=0.2,
                                               epsilon_high=0.28 if loss_type != "cispo" else 5.0, delta=1.8,
                                               beta=0.04)
                    (gx,) = torch.autograd.grad(res[0], x, up.to(device))
                    outs.append([r.detach().cpu() for r in res] + [gx.cpu()])
                err = max(_rel(a, b) for a, b in zip(outs[1], outs[0]))
                ok = err <= limit and all(bool(torch.isfinite(o).all()) for o in outs[1])
                checks.append({"what": f"grpo_token_loss.{loss_type}.{'off' if with_old else 'on'}.{str(dtype)[6:]}",
                               "err": err, "limit": limit, "ok": ok})
        b = 1031
        c, r = (-torch.rand(b, generator=g, dtype=torch.float64) * 40).to(dtype), (
            -torch.rand(b, generator=g, dtype=torch.float64) * 40).to(dtype)
        rc, rr = c + torch.randn(b, generator=g, dtype=torch.float64).to(dtype), r + torch.randn(
            b, generator=g, dtype=torch.float64).to(dtype)
        nc, nr = torch.randint(0, 40, (b,), generator=g), torch.randint(0, 40, (b,), generator=g)
        for loss_type in cuda.DPO_LOSS_TYPES:
            outs = []
            for device in ("cpu", "cuda"):
                x, z = c.to(device).requires_grad_(True), r.to(device).requires_grad_(True)
                loss = cuda.dpo_pair_loss(x, z, rc.to(device), rr.to(device), nc.to(device), nr.to(device),
                                          loss_type=loss_type, beta=0.1,
                                          label_smoothing=0.1 if loss_type != "hinge" else 0.0)
                gx, gz = torch.autograd.grad(loss, (x, z), up[:b].to(device))
                outs.append([loss.detach().cpu(), gx.cpu(), gz.cpu()])
            err = max(_rel(a, b_) for a, b_ in zip(outs[1], outs[0]))
            checks.append({"what": f"dpo_pair_loss.{loss_type}.{str(dtype)[6:]}", "err": err, "limit": limit,
                           "ok": err <= limit})
    results.append({"name": "fused_loss_math", "checks": checks, "ok": all(c["ok"] for c in checks)})
    print(f"[{'ok' if results[-1]['ok'] else 'FAIL'}] fused_loss_math: "
          + ", ".join(f"{c['what']}={c['err']:.1e}" for c in checks), flush=True)


def per_token_checks(results):
    import torch

    from fusedloss.cuda import backend as cuda

    g = torch.Generator().manual_seed(0)
    n = 4099
    logp = -torch.rand(n, generator=g) * 3
    old = logp + torch.randn(n, generator=g) * 0.3
    ref = logp + torch.randn(n, generator=g) * 0.3
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.1).float()
    checks = []
    for loss_type in cuda.GRPO_LOSS_TYPES:
        kw = dict(old_logprobs=old, ref_logprobs=ref, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
                  delta=1.5, beta=0.04)
        host = cuda.grpo_token_math(logp, adv, mask, **kw)
        dev = cuda.grpo_token_math(logp.cuda(), adv.cuda(), mask.cuda(),
                                   **{k: (t.cuda() if isinstance(t, torch.Tensor) else t) for k, t in kw.items()})
        err = max(_rel(dv.cpu(), hv) for dv, hv in zip(dev, host))
        checks.append({"what": f"grpo.{loss_type}", "err": err, "limit": 1e-6, "ok": err <= 1e-6})
    c, r = -torch.rand(513, generator=g) * 40, -torch.rand(513, generator=g) * 40
    rc, rr = c + torch.randn(513, generator=g), r + torch.randn(513, generator=g)
    for loss_type in cuda.DPO_LOSS_TYPES:
        host = cuda.dpo_pair_math(c, r, rc, rr, loss_type=loss_type, label_smoothing=0.1)
        dev = cuda.dpo_pair_math(c.cuda(), r.cuda(), rc.cuda(), rr.cuda(), loss_type=loss_type, label_smoothing=0.1)
        err = max(_rel(dv.cpu(), hv) for dv, hv in zip(dev, host))
        checks.append({"what": f"dpo.{loss_type}", "err": err, "limit": 1e-6, "ok": err <= 1e-6})
    results.append({"name": "per_token_math", "checks": checks, "ok": all(c["ok"] for c in checks)})
    print(f"[{'ok' if results[-1]['ok'] else 'FAIL'}] per_token_math: "
          + ", ".join(f"{c['what']}={c['err']:.1e}" for c in checks), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="fewer cases (fp32 + bf16 at V=151936 only)")
    args = parser.parse_args(argv)

    import torch

    import fusedloss
    from fusedloss.cuda import backend as cuda

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report = {"status": fusedloss.backend_status(), "torch": torch.__version__, "cases": []}
    if cuda.availability() != "available":
        report["ok"] = False
        report["error"] = f"cuda backend not available: {cuda.availability()}"
    else:
        report["device"] = torch.cuda.get_device_name()
        cases = []
        for dt in ("fp32", "bf16", "fp16"):
            for v in (128256, 151936):
                cases.append((f"{dt}-V{v}-N257", 257, v, 1024, dt, False, False))
            cases.append((f"{dt}-V151936-peaked-N64", 64, 151936, 1024, dt, True, False))
            cases.append((f"{dt}-V131071prime-N1", 1, 131071, 1024, dt, True, False))
            cases.append((f"{dt}-V131071prime-teacher-N33", 33, 131071, 512, dt, False, True))
        if args.quick:
            cases = [c for c in cases if c[4] in ("fp32", "bf16") and c[2] == 151936]
        for case in cases:
            try:
                run_case(*case, args.quick, report["cases"])
            except Exception as exc:  # keep going: one failure should not hide the others
                report["cases"].append({"name": case[0], "ok": False, "error": repr(exc),
                                        "traceback": traceback.format_exc()})
                print(f"[ERROR] {case[0]}: {exc!r}", flush=True)
            torch.cuda.empty_cache()
        for fn in (per_token_checks, fused_loss_checks, confident_checks):
            try:
                fn(report["cases"])
            except Exception as exc:
                report["cases"].append({"name": fn.__name__, "ok": False, "error": repr(exc),
                                        "traceback": traceback.format_exc()})
                print(f"[ERROR] {fn.__name__}: {exc!r}", flush=True)
        report["ok"] = all(c.get("ok") for c in report["cases"])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}: ok={report['ok']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
