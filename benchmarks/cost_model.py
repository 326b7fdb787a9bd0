"""The performance model on the command line: what a backend's own plan for one call costs on a GPU, no GPU needed.

    python benchmarks/cost_model.py --op cross_entropy --backend cuda --N 16384 --D 4096 --V 151936 \\
        --dtype bfloat16 --gpu h200 --json
    python benchmarks/cost_model.py --table            # the plans' table (markdown)

It asks the model's ``plan(workload, gpu, free_bytes)`` of the backend (``benchmarks/model/cuda.py``,
``benchmarks/model/triton.py``: the passes of the choice the backend's own plan makes at run time) and evaluates
it with ``benchmarks.model.cost.evaluate``: GEMM flops, the bytes each pass moves through HBM, the modelled
time (a roofline per pass, with the GEMM-shape efficiency and launch costs of ``benchmarks/model/cost.py``) and
its ratio to the product-count bound (the fewest GEMM-sized products any exact method needs, at the
GPU's dense peak). docs/design.md, "Plans and the performance model".

Importable: ``estimate(op, backend, n, d, v, ...) -> dict`` is what the JSON prints, for the benchmark to
store beside its measurements, with the modelled time split into the forward and the backward
(``model_fwd_ms``, ``model_bwd_ms``: see ``phases``); ``bound(op, n, d, v, ...)`` is the product-count
bound alone, for implementations the model has no plan of (the materialised reference, the peers, the
torch backend).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):  # run as a script: make `fusedloss` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model import cost  # noqa: E402

GIB = 2**30
# the shapes of the table: the H200 target and the peers' published shape (QuACK 17.3 ms, Liger Triton 141 ms)
TABLE_SHAPES = ((16384, 4096, 151936), (4096, 4096, 128256))
TABLE_OPS = ("cross_entropy", "grpo", "token_logprobs", "token_logprobs_entropy", "distill_reverse_kl")


class NoPlan(RuntimeError):
    """The backend has no ``plan`` function to evaluate."""


def backend_plan_function(backend: str):
    """The model's ``plan(workload, gpu, free_bytes=None)`` of the backend, or NoPlan saying why there is none."""
    module_name = {"cuda": "benchmarks.model.cuda",
                   "triton": "benchmarks.model.triton"}.get(backend)
    if module_name is None:
        raise NoPlan(f"--backend must be 'cuda' or 'triton' (the GPU backends), got {backend!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise NoPlan(f"{module_name} cannot be imported here ({exc}), so its plan cannot be modelled") from None
    fn = getattr(module, "plan", None)
    if fn is None:
        raise NoPlan(f"{module_name} has no plan(workload, gpu, free_bytes=None) yet: the {backend} backend's "
                     "choices cannot be modelled until it exposes one")
    return fn


# A plan lists its passes in the order they run. The composable path's backward starts where the logits are
# formed again (cuda: "recompute", triton: "backward: logits again and dx"); everything before is the forward
# (the statistics op). The grad-in-forward path finishes the gradients in the forward (core/grad_in_forward.py) and its
# backward
# only scales the stored fp32 gradients by the incoming gradient and rounds them ("scale and round
# gradients", "... round to the input dtype").
_BACKWARD_FROM = re.compile(r"^(recompute|teacher recompute|backward\b)")
_GRAD_IN_FORWARD_BACKWARD = re.compile(r"\bround\b|\bin the backward$")


def phases(plan: cost.Plan) -> list:
    """"forward" or "backward" for each pass of ``plan``, in order: which of the two timed calls (the loss
    function, then ``loss.backward()``) runs it."""
    if plan.path == "grad_in_forward":
        return ["backward" if _GRAD_IN_FORWARD_BACKWARD.search(p.name) else "forward" for p in plan.passes]
    start = next((i for i, p in enumerate(plan.passes) if _BACKWARD_FROM.match(p.name)), len(plan.passes))
    return ["forward" if i < start else "backward" for i in range(len(plan.passes))]


def split_ms(plan: cost.Plan, w: cost.Workload, spec: cost.GPUSpec) -> tuple:
    """(forward ms, backward ms) of ``plan``: each phase's passes evaluated as a plan of their own (no pass
    overlaps across the two)."""
    kinds = phases(plan)
    out = []
    for kind in ("forward", "backward"):
        part = [p for p, k in zip(plan.passes, kinds) if k == kind]
        out.append(cost.evaluate(dataclasses.replace(plan, passes=part), w, spec).model_ms if part else 0.0)
    return tuple(out)


def bound(op: str, n: int, d: int, v: int, *, dtype: str = "bfloat16", gpu: str = "h200",
          teacher_d: Optional[int] = None, hidden_grad: bool = True, weight_grad: bool = True) -> dict:
    """The product-count bound of a workload alone (no plan): the fewest GEMM-sized products an exact
    method needs (``cost.product_bound``) at the GPU's dense peak."""
    spec = cost.GPUS[gpu]
    w = cost.Workload(op=op, n=n, d=d, v=v, dtype=dtype, teacher_d=teacher_d, hidden_grad=hidden_grad,
                      weight_grad=weight_grad)
    student, teacher = cost.product_bound(w)
    return {"op": op, "N": n, "D": d, "V": v, "dtype": dtype, "gpu": spec.name, "bound_products": student,
            "bound_teacher_products": teacher, "bound_ms": cost.bound_ms(w, spec)}


def estimate(op: str, backend: str, n: int, d: int, v: int, *, dtype: str = "bfloat16", gpu: str = "h200",
             teacher_d: Optional[int] = None, hidden_grad: bool = True, weight_grad: bool = True,
             free_bytes: Optional[int] = None, workspace_mb: Optional[float] = None, path: Optional[str] = None,
             what_if_fused: bool = False, plain: bool = True) -> dict:
    """The modelled cost of ``backend``'s plan for one call (the fields of the CLI's JSON).
    ``free_bytes`` defaults to half the GPU's memory (a training step's state holds the rest); ``plain=False``:
    logits with a bias, scale, soft-cap or temperature (the CUDA kernels' general instantiation)."""
    spec = cost.GPUS[gpu]
    w = cost.Workload(op=op, n=n, d=d, v=v, dtype=dtype, teacher_d=teacher_d, hidden_grad=hidden_grad,
                      weight_grad=weight_grad, plain=plain)
    if free_bytes is None:
        free_bytes = spec.memory_bytes // 2
    fn = backend_plan_function(backend)
    kwargs = {}
    if path is not None:
        kwargs["path"] = path
    if workspace_mb is not None:
        kwargs["workspace"] = int(workspace_mb * 2**20)
    plan = fn(w, spec, free_bytes, **kwargs)
    if what_if_fused:
        if backend != "cuda":
            raise NoPlan("--what-if-fused-epilogue rewrites the CUDA plan only")
        plan = fused_epilogue(plan)
    est = cost.evaluate(plan, w, spec)
    fwd_ms, bwd_ms = split_ms(plan, w, spec)
    student, teacher = cost.product_bound(w)
    return {
        "op": op, "backend": backend, "N": n, "D": d, "V": v, "dtype": dtype, "gpu": spec.name,
        "path": plan.path, "products": plan.products, "plain": plain,
        "teacher_products": plan.params.get("teacher_products", 0.0),
        "bound_products": student, "bound_teacher_products": teacher,
        "flops": est.flops, "hbm_bytes": est.hbm_bytes, "model_ms": est.model_ms, "bound_ms": est.bound_ms,
        "ratio": est.ratio, "free_bytes": free_bytes, "model_fwd_ms": fwd_ms, "model_bwd_ms": bwd_ms,
        "backward_passes": [p.name for p, k in zip(plan.passes, phases(plan)) if k == "backward"],
        "plan": _jsonable(plan.params),
        "passes": {name: round(ms, 4) for name, ms in est.pass_ms.items()},
        # each pass: its time, what bounds it (math, memory, issue, mufu, launches) and the rates it assumed
        "pass_detail": _jsonable({name: {**d, "ms": round(d["ms"], 4)} for name, d in est.pass_detail.items()}),
    }


def fused_epilogue(plan: cost.Plan) -> cost.Plan:
    """What-if (no backend runs it): the CUDA plan with the fold and dx moved into the products that form the
    logits (a GEMM epilogue computing the row statistics of each output tile, and dx written in the input dtype
    by the recompute's epilogue), overlapped with the main loop as a warp-specialised kernel overlaps them. The
    fp32 logits still make their round trip where the 3-product grad-in-forward path keeps them between the statistics
    and dx (a loss's coefficients need the whole row); the separate elementwise passes are gone. See
    docs/design.md, "Beyond the bound of this design"."""
    passes = []
    composable = plan.path == "composable"
    for p in plan.passes:
        if p.name in ("fold", "jsd"):
            continue
        if p.name == "dx" and composable:
            continue  # dx in the recompute's epilogue
        if composable and p.name in ("logits", "teacher logits"):
            p = dataclasses.replace(p, hbm_bytes=p.hbm_bytes - p.epilogue_bytes, epilogue_bytes=0.0)
        if composable and p.name in ("recompute", "teacher recompute"):
            dx_bytes = p.epilogue_bytes / 2 if plan.params.get("dx", "").startswith("bf16") else p.epilogue_bytes
            p = dataclasses.replace(p, hbm_bytes=p.hbm_bytes - p.epilogue_bytes + dx_bytes, epilogue_bytes=dx_bytes)
        passes.append(p)
    return dataclasses.replace(plan, passes=passes, params={**plan.params, "what_if": "fold and dx in the epilogue"})


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


# ------------------------------------------------------------------------------------------------
# The table of the plans
# ------------------------------------------------------------------------------------------------
def table(gpu: str = "h200", dtype: str = "bfloat16", free_bytes: Optional[int] = None) -> str:
    """Markdown: op x the CUDA backend's plan at the table's shapes, plus the plan's rejected path."""
    lines = [f"GPU {cost.GPUS[gpu].name}, {dtype}; free memory for the workspace: "
             f"{(free_bytes or cost.GPUS[gpu].memory_bytes // 2) / 1e9:.0f} GB",
             "", "| N, D, V | op | plan | path | products | HBM GB | model ms | bound ms | ratio |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for n, d, v in TABLE_SHAPES:
        for op in TABLE_OPS:
            rows = [("plan", estimate(op, "cuda", n, d, v, dtype=dtype, gpu=gpu, free_bytes=free_bytes))]
            if cost.OPS[op]["row_local"]:
                rows.append(("composable", estimate(op, "cuda", n, d, v, dtype=dtype, gpu=gpu,
                                                           free_bytes=free_bytes, path="composable")))
            for label, e in rows:
                lines.append(f"| {n}, {d}, {v} | {op} | {label} | {e['path']} | {e['products']:g} | "
                             f"{e['hbm_bytes'] / 1e9:.1f} | {e['model_ms']:.1f} | {e['bound_ms']:.1f} | "
                             f"{e['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=tuple(cost.OPS), default="cross_entropy")
    ap.add_argument("--backend", default="cuda", help="cuda or triton: whose plan() to evaluate")
    ap.add_argument("--N", type=int, default=16384, help="tokens")
    ap.add_argument("--D", type=int, default=4096, help="hidden size")
    ap.add_argument("--V", type=int, default=151936, help="vocabulary size")
    ap.add_argument("--teacher-D", type=int, default=None, help="teacher hidden size (distillation; default D)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--gpu", choices=tuple(cost.GPUS), default="h200")
    ap.add_argument("--free-gb", type=float, default=None,
                    help="memory free for torch when the backend first runs (default: half the GPU's)")
    ap.add_argument("--workspace-mb", type=float, default=None, help="the workspace, instead of the free memory")
    ap.add_argument("--path", choices=("grad_in_forward", "composable"), default=None, help="force a path")
    ap.add_argument("--frozen-weight", action="store_true", help="no d weight (LoRA, frozen head)")
    ap.add_argument("--transformed", action="store_true",
                    help="logits with a bias, logit scale, soft-cap or temperature (default: the raw products)")
    ap.add_argument("--what-if-fused-epilogue", action="store_true",
                    help="the CUDA plan with fold and dx inside the products' epilogues (no backend runs it)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    ap.add_argument("--table", action="store_true", help="the plans' table (markdown)")
    args = ap.parse_args(argv)
    free = None if args.free_gb is None else int(args.free_gb * 1e9)
    if args.table:
        print(table(args.gpu, args.dtype, free))
        return 0
    try:
        e = estimate(args.op, args.backend, args.N, args.D, args.V, dtype=args.dtype, gpu=args.gpu,
                     teacher_d=args.teacher_D, weight_grad=not args.frozen_weight, free_bytes=free,
                     workspace_mb=args.workspace_mb, path=args.path,
                     what_if_fused=args.what_if_fused_epilogue, plain=not args.transformed)
    except NoPlan as exc:
        if args.json:
            print(json.dumps({"op": args.op, "backend": args.backend, "error": str(exc)}))
        else:
            print(f"cost_model: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(e, indent=None))
        return 0
    print(f"{e['op']} on {e['backend']} ({e['path']}), N={e['N']} D={e['D']} V={e['V']} {e['dtype']} on {e['gpu']}")
    print(f"  products {e['products']:g} (bound {e['bound_products']:g}), {e['flops'] / 1e12:.1f} TFLOP, "
          f"HBM {e['hbm_bytes'] / 1e9:.1f} GB")
    print(f"  modelled {e['model_ms']:.1f} ms, bound {e['bound_ms']:.1f} ms, ratio {e['ratio']:.2f}")
    for name, ms in e["passes"].items():
        print(f"    {name:<28} {ms:9.3f} ms")
    print("  plan: " + json.dumps(e["plan"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
