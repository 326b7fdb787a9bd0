"""GPU correctness check of the CUDA backend (run on the device machine; builds nothing itself).

For V in {128256, 151936} plus a prime V (131071), peaked rows (a few logits ~30 above the rest), one
token and an odd token count, and each dtype in {fp32, bf16, fp16}, compares against float64 ground
truth on materialised logits:

* forward statistics (lse, logp, entropy, mean_logit, log_sum_sq_probs; with a teacher kl_rev, kl_fwd,
  jsd) from ``forward_statistics``;
* gradients (d hidden, d weight, d bias) of ``sum(logp) + 0.5 sum(entropy) [+ 0.3 sum(kl_rev)]`` through
  ``backward_gradients`` (recompute, 3 products) and ``eager_gradients`` (3 products, no recompute);
* the GRPO / DPO per-token kernels against their host twins.

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
           "mean_logit": z.mean(-1) * valid, "log_sum_sq_probs": torch.log((q * q).sum(-1)) * valid}
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
        judge(f"stat.{key}", getattr(stats, key), ref, None if naive is None else naive[key])
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
        try:
            per_token_checks(report["cases"])
        except Exception as exc:
            report["cases"].append({"name": "per_token_math", "ok": False, "error": repr(exc)})
        report["ok"] = all(c.get("ok") for c in report["cases"])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}: ok={report['ok']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
