"""GPU correctness check of the Triton backend (issue 3): bf16 / fp16 / fp32 against a float64 reference.

    python benchmarks/device_check_triton.py --out results.json          # on a CUDA machine (H200)
    python benchmarks/device_check_triton.py --cpu-smoke --out smoke.json # tiny shapes, Triton interpreter

For every case (real vocabulary sizes 128256 and 151936, a prime vocabulary, peaked rows, ignored rows,
soft-cap + temperature, a teacher with its own hidden size, a frozen head) and dtype, it runs the
per-token statistics op (``fusedloss.core.token_statistics``, backend "triton") forward and backward on
one scalar objective (random weights on every requested statistic) and compares every statistic and
the gradients of hidden, weight and bias with:

- the float64 reference: the same math on materialised float64 logits (same rounded inputs);
- the naive same-dtype computation (materialised logits in that dtype, log_softmax, autograd).

Criterion (SPEC section 6): fp32 within 1e-5 of float64 (TF32 is disabled here); bf16/fp16 no worse
than the naive same-dtype error plus ``HALF_SLACK``. It also records the peak extra device memory of
the fused forward + backward (against its bound: no N x V buffer), the wall time, and whether the
deterministic mode (``FUSEDLOSS_DETERMINISTIC=1``) is bit-identical run to run. The interpreter cannot
run bf16 ``tl.dot``, so ``--cpu-smoke`` checks fp32 and fp16 only. Exit status 0 when every check holds.

Two more groups of records:

- ``top1_ties``: TRL's is_top1 on exact ties (identical weight rows, integer-valued data so every logit is
  exact): only the first argmax counts, with the tied tokens in one tile, in different tiles and in
  different vocabulary splits, for fp32, bf16 and float64, against torch.argmax of the float64 logits.
- ``token_math``: the fused per-token GRPO and per-pair DPO launches (``fusedloss/triton/token_math``) on
  the GPU against the loss modules' math run on the CPU in the same dtype (``grpo_terms``/``dpo_terms`` of
  tests/test_fused_token_math_triton.py), values and gradients, every loss type, sizes that are not a
  multiple of the block: 1e-6 (fp32) / 1e-12 (float64), norm-wise and element-wise |a - e| / max(|e|, 1).
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

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fusedloss.core import LogitTransform, TeacherHead, token_statistics  # noqa: E402

HALF_SLACK = 2e-3
FP32_TOL = 1e-5
DIFFERENTIABLE = ("lse", "logp", "entropy", "kl_rev", "kl_fwd", "jsd")

GPU_CASES = [
    dict(name="llama3_vocab", n=256, d=1024, v=128256, ignore=0.25, entropy=True),
    dict(name="qwen_vocab_softcap", n=256, d=896, v=151936, ignore=0.25, entropy=True, bias=True,
         transform=(0.7, 1.0, 30.0)),
    dict(name="prime_vocab", n=97, d=1000, v=131071, ignore=0.0, entropy=True),
    dict(name="teacher", n=128, d=1024, v=128256, dt=768, ignore=0.1, entropy=True, kl_rev=True, kl_fwd=True,
         jsd=0.5, teacher_temperature=1.3),
    dict(name="frozen_head", n=256, d=1024, v=151936, ignore=0.25, entropy=True, frozen=True),
]
CPU_CASES = [
    dict(name="prime_131", n=7, d=19, v=131, ignore=0.25, entropy=True, bias=True, transform=(0.7, 1.3, 5.0)),
    dict(name="teacher_257", n=5, d=24, v=257, dt=19, ignore=0.0, entropy=True, kl_rev=True, kl_fwd=True, jsd=0.3),
    dict(name="frozen_head", n=7, d=19, v=131, ignore=0.25, entropy=True, frozen=True),
]


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
    x = h.to(dtype) @ w.to(dtype).T
    if b is not None:
        x = x + b.to(dtype)
    u = x * tf.logit_scale
    c = tf.softcap * torch.tanh(u / tf.softcap) if tf.softcap is not None else u
    return c / tf.temperature


def materialised(c, h, w, b, y, teacher, tf, dtype):
    """The statistics from materialised logits in ``dtype`` (float64: the reference; half: naive)."""
    z = logits(h, w, b, tf, dtype)
    logq = torch.log_softmax(z, dim=1)
    q = logq.exp()
    out = {"lse": torch.logsumexp(z, dim=1), "logp": logq.gather(1, y.clamp(min=0)[:, None]).squeeze(1)}
    if c.get("entropy"):
        out["entropy"] = -(q * logq).sum(1)
    if teacher is not None:
        zt = logits(teacher[0], teacher[1], None, LogitTransform(c.get("teacher_temperature", 1.0)), dtype)
        logpt = torch.log_softmax(zt, dim=1)
        pt = logpt.exp()
        if c.get("kl_rev"):
            out["kl_rev"] = (q * (logq - logpt)).sum(1)
        if c.get("kl_fwd"):
            out["kl_fwd"] = (pt * (logpt - logq)).sum(1)
        if c.get("jsd"):
            beta = c["jsd"]
            logm = torch.logaddexp(logq + math.log1p(-beta), logpt + math.log(beta))
            kl_qm = (q * (logq - logm)).sum(1)
            kl_pm = (pt * (logpt - logm)).sum(1)
            out["jsd"] = beta * kl_pm + (1 - beta) * kl_qm
    valid = y >= 0
    return {k: torch.where(valid, x, torch.zeros_like(x)) for k, x in out.items()}


def objective(stats: dict, weights: dict):
    return sum((weights[k].to(stats[k].dtype) * stats[k]).sum() for k in weights if k in stats)


def rel_err(a, e):
    a, e = a.detach().double(), e.detach().double()
    den = torch.linalg.vector_norm(e).item()
    num = torch.linalg.vector_norm(a - e).item()
    if not math.isfinite(num):
        return float("inf")
    return num / den if den > 0 else num


def run_case(c: dict, dtype: torch.dtype, device) -> dict:
    h64, w64, b64, y, teacher64 = make_case(c, device)
    # The run in dtype sees rounded values; the references use exactly those values.
    rnd = (lambda t: None if t is None else t.to(dtype).to(torch.float64).to(device))
    h64, w64, b64 = rnd(h64), rnd(w64), rnd(b64)
    teacher64 = None if teacher64 is None else (rnd(teacher64[0]), rnd(teacher64[1]))
    tf = LogitTransform(*c.get("transform", (1.0, 1.0, None)))
    g = torch.Generator().manual_seed(1)
    weights = {k: torch.randn(c["n"], generator=g, dtype=torch.float64).to(device) for k in DIFFERENTIABLE}
    names = ["lse", "logp"] + [k for k in ("entropy", "kl_rev", "kl_fwd", "jsd") if c.get(k)]
    weights = {k: weights[k] for k in names}
    train_w = not c.get("frozen")

    def leaves(dt):
        return [h64.to(dt).requires_grad_(True), w64.to(dt).requires_grad_(train_w),
                None if b64 is None else b64.to(dt).requires_grad_(True)]

    def grads_of(ls, obj):
        want = [t for t in ls if t is not None and t.requires_grad]
        got = torch.autograd.grad(obj, want)
        it = iter(got)
        return {n: (next(it) if t is not None and t.requires_grad else None)
                for n, t in zip(("hidden", "weight", "bias"), ls)}

    # float64 reference and naive same-dtype
    ref_l = leaves(torch.float64)
    ref_stats = materialised(c, *ref_l, y, teacher64, tf, torch.float64)
    ref_grads = grads_of(ref_l, objective(ref_stats, weights))
    naive_l = leaves(dtype)
    naive_teacher = None if teacher64 is None else tuple(t.to(dtype) for t in teacher64)
    naive_stats = materialised(c, *naive_l, y, naive_teacher, tf, dtype)
    naive_grads = grads_of(naive_l, objective(naive_stats, weights))
    del naive_l

    # fused
    f_l = leaves(dtype)
    teacher = None
    if teacher64 is not None:
        teacher = TeacherHead(teacher64[0].to(dtype), teacher64[1].to(dtype), None, c.get("teacher_temperature", 1.0))

    def fused():
        s = token_statistics(f_l[0], f_l[1], bias=f_l[2], targets=y, transform=tf, teacher=teacher,
                             want_entropy=bool(c.get("entropy")), want_kl_rev=bool(c.get("kl_rev")),
                             want_kl_fwd=bool(c.get("kl_fwd")), jsd_beta=c.get("jsd"), backend="triton")
        st = {k: getattr(s, k) for k in names}
        return st, grads_of(f_l, objective(st, weights))

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    f_stats, f_grads = fused()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    record = dict(case=c["name"], dtype=str(dtype).replace("torch.", ""), n=c["n"], d=c["d"], v=c["v"],
                  first_call_s=round(elapsed, 4), checks=[])
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
        grads_bytes = sum(t.numel() * t.element_size() for t in f_grads.values() if t is not None)
        extra = peak - grads_bytes
        acc = 4
        # d hidden fp32 accumulator + one fp32 d weight chunk (256 MiB cap) + [V] + small per-row buffers
        bound = c["n"] * c["d"] * acc + min(c["v"], (256 << 20) // (c["d"] * acc)) * c["d"] * acc \
            + 4 * c["v"] * acc + 64 * c["n"] * acc + (64 << 20)
        record.update(extra_peak_mib=round(extra / 2**20, 1), bound_mib=round(bound / 2**20, 1),
                      nv_fp32_mib=round(c["n"] * c["v"] * 4 / 2**20, 1), memory_ok=extra <= bound)
        t0 = time.perf_counter()
        for _ in range(3):
            fused()
        torch.cuda.synchronize()
        record["fwd_bwd_ms"] = round((time.perf_counter() - t0) / 3 * 1e3, 2)

    ok = record.get("memory_ok", True)
    for kind, fused_d, naive_d, ref_d in (("stat", f_stats, naive_stats, ref_stats),
                                          ("grad", f_grads, naive_grads, ref_grads)):
        for k, e in ref_d.items():
            if e is None:
                assert fused_d[k] is None, f"{k} gradient should be None"
                continue
            ef, en = rel_err(fused_d[k], e), rel_err(naive_d[k], e)
            bound = FP32_TOL if dtype == torch.float32 else en + HALF_SLACK
            good = ef <= bound
            ok &= good
            record["checks"].append(dict(what=f"{kind}:{k}", fused=ef, naive=en, bound=bound, ok=good))
    record["ok"] = bool(ok)
    return record


def determinism(c: dict, dtype, device) -> dict:
    h, w, b, y, _ = make_case(c, device)
    h, w = h.to(device, dtype).requires_grad_(True), w.to(device, dtype).requires_grad_(True)

    def once():
        s = token_statistics(h, w, targets=y, want_entropy=True, backend="triton")
        gh, gw = torch.autograd.grad((s.logp + 0.1 * s.entropy).sum(), (h, w))
        return gh, gw

    fast = once()
    os.environ["FUSEDLOSS_DETERMINISTIC"] = "1"
    try:
        a, b_ = once(), once()
    finally:
        del os.environ["FUSEDLOSS_DETERMINISTIC"]
    identical = all(torch.equal(x, z) for x, z in zip(a, b_))
    close = max(rel_err(x, f) for x, f in zip(a, fast))
    return dict(case=c["name"] + "_deterministic", dtype=str(dtype).replace("torch.", ""), bit_identical=identical,
                rel_diff_vs_fast=close, ok=bool(identical and close < 1e-2))


def top1_ties(device, dtypes) -> list:
    """is_top1 = first argmax on exact ties, through the backend protocol (forward_statistics)."""
    from fusedloss.core.problem import StatsProblem
    from fusedloss.triton import backend as tb

    g = torch.Generator().manual_seed(0)
    n, d, v = 64, 64, 5003
    tied = (3, 7, 200, 4099)  # one tile; the next tiles; another vocabulary split
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
        for cfg in (dict(), dict(target_programs=1), dict(target_programs=4096)):
            p = StatsProblem(hidden=h.to(device, dt), weight=w.to(device, dt), bias=None, targets=y.to(device),
                             transform=LogitTransform(), want_extras=True)
            try:
                with tb.override_config(**cfg):
                    got = tb.forward_statistics(p).is_top1.double().cpu()
                ok = bool(torch.equal(got, expected))
                rec = dict(case="top1_ties", dtype=str(dt).replace("torch.", ""), config=cfg, ok=ok,
                           mismatches=int((got != expected).sum()))
            except Exception as exc:
                rec = dict(case="top1_ties", dtype=str(dt).replace("torch.", ""), config=cfg, ok=False,
                           error=repr(exc)[:2000])
            records.append(rec)
    return records


def token_math(device, smoke: bool) -> list:
    """The fused GRPO / DPO launches on ``device`` against the modules' math on the CPU (same dtype)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import test_fused_token_math_triton as tm  # noqa: E402  (the reference math and data of the unit tests)
    from fusedloss.triton import backend as tb

    def errors(a, e):
        a, e = a.detach().double().cpu(), e.detach().double().cpu()
        if not bool(torch.isfinite(a).all()):
            return math.inf, math.inf
        elem = ((a - e).abs() / e.abs().clamp(min=1.0)).max().item() if a.numel() else 0.0
        return rel_err(a, e), elem

    def record(name, dt, outs_dev, outs_cpu, labels, wall):
        tol = 1e-12 if dt == torch.float64 else 1e-6
        checks, ok = [], True
        for label, a, e in zip(labels, outs_dev, outs_cpu):
            nw, el = errors(a, e)
            good = nw <= tol and el <= tol
            ok &= good
            checks.append(dict(what=label, norm=nw, elem=el, bound=tol, ok=good))
        return dict(case=name, dtype=str(dt).replace("torch.", ""), ok=bool(ok), checks=checks,
                    first_call_s=round(wall, 4))

    records = []
    t_tokens, b_pairs = (101, 77) if smoke else (100003, 4099)
    for dt in (torch.float32, torch.float64):
        data = tm.grpo_data(t_tokens, dt)
        cpu = {k: x.cpu() for k, x in data.items()}
        dev = {k: x.to(device) for k, x in data.items()}
        for loss_type in tm.GRPO_TYPES:
            for option, opts in tm.GRPO_OPTIONS.items():
                kw = dict(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, delta=opts["delta"],
                          beta=opts["beta"])
                outs = {}
                t0 = time.perf_counter()
                for where, dd, fn in (("dev", dev, tb.grpo_token_loss), ("cpu", cpu, tm.grpo_terms)):
                    logp = dd["logp"].clone().requires_grad_(True)
                    loss, kl, ratio = fn(logp, dd["old"] if opts["old"] else None, dd["adv"],
                                         dd["ref"] if opts["ref"] else None, dd["w"] if opts["w"] else None,
                                         dd["valid"], **kw)
                    (grad,) = torch.autograd.grad((loss * dd["cot"]).sum(), logp)
                    outs[where] = (loss, kl, ratio, grad)
                    if where == "dev" and device.type == "cuda":
                        torch.cuda.synchronize()
                        wall = time.perf_counter() - t0
                records.append(record(f"grpo_token_{loss_type}_{option}", dt, outs["dev"], outs["cpu"],
                                      ("loss", "kl", "ratio", "dloss/dlogp"),
                                      wall if device.type == "cuda" else time.perf_counter() - t0))
        data = tm.dpo_data(b_pairs, dt)
        cpu = {k: x.cpu() for k, x in data.items()}
        dev = {k: x.to(device) for k, x in data.items()}
        for loss_type, smoothing in (("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0), ("hinge", 0.0),
                                     ("robust", 0.2)):
            kw = dict(loss_type=loss_type, beta=0.1, label_smoothing=smoothing)
            outs = {}
            t0 = time.perf_counter()
            for where, dd, fn in (("dev", dev, tb.dpo_pair_loss), ("cpu", cpu, tm.dpo_terms)):
                c = dd["chosen"].clone().requires_grad_(True)
                r = dd["rejected"].clone().requires_grad_(True)
                loss = fn(c, r, dd["ref_c"], dd["ref_r"], dd["n_c"], dd["n_r"], **kw)
                gc, gr = torch.autograd.grad((loss * dd["cot"]).sum(), (c, r))
                outs[where] = (loss, gc, gr)
            records.append(record(f"dpo_pair_{loss_type}_{smoothing}", dt, outs["dev"], outs["cpu"],
                                  ("loss", "d chosen", "d rejected"), time.perf_counter() - t0))
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="where to write the JSON results")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--skip-extra", action="store_true", help="skip the is_top1 ties and fused GRPO/DPO checks")
    args = ap.parse_args(argv)

    if args.cpu_smoke:
        device, cases, dtypes = torch.device("cpu"), CPU_CASES, (torch.float32, torch.float16)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --cpu-smoke", file=sys.stderr)
            return 2
        device, cases, dtypes = torch.device("cuda"), GPU_CASES, (torch.bfloat16, torch.float16, torch.float32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.cases:
        keep = set(args.cases.split(","))
        cases = [c for c in cases if c["name"] in keep]

    results = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)",
                   torch=torch.__version__, records=[])
    try:
        import triton

        results["triton"] = triton.__version__
    except ImportError:
        pass
    all_ok = True
    for c in cases:
        for dt in dtypes:
            try:
                rec = run_case(c, dt, device)
            except Exception as exc:  # record and go on: one failure must not hide the others
                rec = dict(case=c["name"], dtype=str(dt).replace("torch.", ""), ok=False, error=repr(exc)[:2000])
            all_ok &= rec["ok"]
            results["records"].append(rec)
            worst = max((x for x in rec.get("checks", [])), key=lambda x: x["fused"] / max(x["bound"], 1e-30),
                        default=None)
            print(f"{rec['case']:>20} {rec['dtype']:>9} ok={rec['ok']} "
                  + (f"worst {worst['what']} fused {worst['fused']:.2e} naive {worst['naive']:.2e} "
                     f"bound {worst['bound']:.2e}" if worst else rec.get("error", ""))
                  + (f" extra {rec['extra_peak_mib']} MiB (bound {rec['bound_mib']}, NxV fp32 "
                     f"{rec['nv_fp32_mib']}) {rec['fwd_bwd_ms']} ms" if "extra_peak_mib" in rec else ""),
                  flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    det_dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    try:
        rec = determinism(cases[0], det_dtype, device)
    except Exception as exc:
        rec = dict(case="deterministic", ok=False, error=repr(exc)[:2000])
    all_ok &= rec["ok"]
    results["records"].append(rec)
    print(rec, flush=True)
    extra = []
    for label, fn in (("top1_ties", lambda: top1_ties(device, (torch.float32, torch.float64) if args.cpu_smoke
                                                      else (torch.float32, torch.bfloat16, torch.float64))),
                      ("token_math", lambda: token_math(device, args.cpu_smoke))):
        if args.skip_extra:
            break
        try:
            extra += fn()
        except Exception as exc:  # record and go on
            extra.append(dict(case=label, ok=False, error=repr(exc)[:2000]))
    for rec in extra:
        all_ok &= rec["ok"]
        results["records"].append(rec)
        worst = max(rec.get("checks", []), key=lambda x: max(x["norm"], x["elem"]) / x["bound"], default=None)
        print(f"{rec['case']:>32} {rec.get('dtype', ''):>8} ok={rec['ok']} "
              + (f"worst {worst['what']} norm {worst['norm']:.2e} elem {worst['elem']:.2e} bound {worst['bound']:.0e}"
                 if worst else str({k: rec[k] for k in ("config", "mismatches", "error") if k in rec})), flush=True)
    results["ok"] = bool(all_ok)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("ALL OK" if all_ok else "SOME CHECKS FAILED", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
