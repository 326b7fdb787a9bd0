"""The portable backend's time against the products it needs, on this machine's CPU.

For each op, forward + backward of ``backend="torch"`` over the op's product-count bound
(``cost.product_bound``: 3 products for a loss known in the forward, 4 for a composable log-prob, +1 teacher
product for distillation), where one product is ``torch.mm(hidden, weight.T)`` timed in the same process,
between the runs of the op. Both are the fastest of ``--repeat`` runs after a warm-up: on a shared machine the
minimum is the time the work takes, the median also holds the waits. torch's own ``F.linear_cross_entropy`` is
timed beside cross-entropy.

    python -m benchmarks.portable_ratio --N 2048 --V 32768 --D 512 [--ops cross_entropy grpo_loss ...]

``ratios(...)`` returns the records, for callers that print their own table.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks import cases
from fusedloss.core import workload as cost

# The ops and their cost-model workloads (distillation: the benchmark's case, beta = 1, reverse KL).
MODEL_OPS = {"cross_entropy": "cross_entropy", "grpo_loss": "grpo", "token_logprobs": "token_logprobs_entropy",
             "distillation_loss": "distill_reverse_kl"}


def _best_ms(fn, repeat: int, between=None) -> float:
    """The fastest of ``repeat`` runs of ``fn`` after one warm-up (``between`` runs before each)."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        if between is not None:
            between()
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def _fwd_bwd(call):
    def run():
        loss = call()
        loss.backward()
    return run


def ratios(n: int, v: int, d: int, ops=tuple(MODEL_OPS), repeat: int = 3, dtype=torch.float32, **options) -> list:
    """``[{op, impl, ms, product_ms, bound_products, ratio}]`` on the CPU; ``options`` go to the fused ops
    (``grad_in_forward=True`` / ``False`` forces a path)."""
    import fusedloss

    records = []
    for op in ops:
        p = cases.make_problem(op, n, v, d, dtype, "cpu")
        h2, w = p.t["hidden"].reshape(-1, d), p.t["weight"]
        products = []

        def product():
            t0 = time.perf_counter()
            torch.mm(h2, w.T)
            products.append((time.perf_counter() - t0) * 1e3)

        wl = cost.Workload(op=MODEL_OPS[op], n=p.N, d=d, v=v, dtype="float32",
                           teacher_d=d if op == "distillation_loss" else None)
        student, teacher = cost.product_bound(wl)
        impls = {"fusedloss:torch": lambda: cases.call_op(getattr(fusedloss, op), p, *leaves, backend="torch",
                                                                    **options)[0]}
        if op == "cross_entropy" and hasattr(torch.nn.functional, "linear_cross_entropy"):
            impls["torch.linear_cross_entropy"] = lambda: torch.nn.functional.linear_cross_entropy(
                leaves[0], leaves[1], p.t["targets"], ignore_index=cases.IGNORE)
        for name, call in impls.items():
            leaves = p.leaves()
            ms = _best_ms(_fwd_bwd(call), repeat, between=product)
            product()
            best = min(products)
            records.append(dict(op=op, impl=name, ms=round(ms, 1), product_ms=round(best, 1),
                                bound_products=student + teacher, ratio=round(ms / ((student + teacher) * best), 3)))
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--V", type=int, default=32768)
    ap.add_argument("--D", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ops", nargs="*", default=list(MODEL_OPS))
    ap.add_argument("--grad-in-forward", choices=("plan", "on", "off"), default="plan",
                    help="the fused ops' path: their plan's (default), or forced")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    options = {} if args.grad_in_forward == "plan" else {"grad_in_forward": args.grad_in_forward == "on"}
    recs = ratios(args.N, args.V, args.D, tuple(args.ops), args.repeat, **options)
    if args.json:
        print(json.dumps(recs, indent=1))
        return
    for r in recs:
        print(f"{r['op']:18s} {r['impl']:28s} {r['ms']:9.1f} ms  product {r['product_ms']:7.1f} ms  "
              f"x{r['bound_products']:.0f} -> ratio {r['ratio']:.2f}")


if __name__ == "__main__":
    main()
