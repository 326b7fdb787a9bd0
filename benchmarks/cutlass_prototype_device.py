"""The CUTLASS 3 prototype on a GPU: its softmax partials checked against torch, its time beside cuBLAS.

    python benchmarks/cutlass_prototype_device.py --out proto.json                    # build it, then run it
    python benchmarks/cutlass_prototype_device.py --prebuilt .carry/prebuilt --out proto.json --budget-s 25
    python benchmarks/cutlass_prototype_device.py --lib fusedloss_proto_sm90a.so --out proto.json
    python benchmarks/cutlass_prototype_device.py --dry-run --out proto.json          # CPU: everything but the kernel

csrc/prototypes/sm90_softmax_partials.cu (docs/design.md, "The CUTLASS 3 prototype (compile-only)") is the logits
GEMM hidden @ W^T whose epilogue writes, per (row, vocabulary tile of 256), the tile's maximum m and t = sum
e^(z - m) without the maximum's own 1, and the target logit. This script loads its shared object with ctypes (a
prebuilt one whose source hash matches, else one built with tools/cutlass_prototype.py's flags into a temporary
folder when the budget leaves time for nvcc, else it stops and says why), and for each shape (D = 4096, N in
{4096, 16384}, V in {128256, 151936}, bf16, small shapes first):

* check: every written (row, tile) pair against the same partials from cuBLAS's fp32 logits (torch.mm with
  out_dtype=float32, row chunks, reduced in float64), the exact merge of a row's pairs into lse against
  torch.logsumexp of those logits and, on a sample of rows, against float64 logits; the target logit against
  the fp32 logit at the target column, and the rows whose target is ignored (-100) left unwritten;
* time: CUDA events around each call, warm-up calls then timed rounds alternating the prototype with cuBLAS's
  product of the same shape in bf16 output and in fp32 output (torch.mm(out_dtype=torch.float32)); the median,
  its TFLOP/s, and its ratio to the bound: one GEMM-sized product, 2 N V D flops at 790 TFLOP/s (the H200's
  bf16 rate in fusedloss/core/cost.py).

The JSON is rewritten after every step, so a stage stopped at its box keeps what it measured. Exit status: 0 when
every shape ran and passed its check, 1 when a check failed or a launch or a product failed, 2 when there is no
usable GPU (this script needs one; --dry-run is the CPU mode), 3 when there is no shared object to run, 4 when
the budget left shapes unrun (a second call runs them all again). The prototype's times include its host launcher
(CUTLASS's initialize, which encodes the TMA descriptors, on every call: microseconds against milliseconds).

--dry-run (no GPU): the argument checks; the library's resolution (whether a prebuilt one matches these sources;
it never compiles; a matching one is loaded and its host entry points asked for the tile and the workspace); the
whole check and timing path at tiny shapes with a torch stand-in for the kernel that writes the same buffers in the
same layout; the same stand-in with each of three faults (FAULTS), which the check must reject; the JSON as a GPU
run writes it.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_cutlass_prototype_tool", ROOT / "tools" / "cutlass_prototype.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

BOUND_TFLOPS = 790.0  # H200 bf16 dense on random data (fusedloss/core/cost.py, GPUS["h200"]); the bound's rate
TILE_M, TILE_N = 128, 256  # the kernel's CTA tile; a GPU run reads them from fusedloss_proto_kernel_info
IGNORE = -100
# What a compile takes (tools/cutlass_prototype.py's report: 40-60 s on 2 cores; nvcc has one target and one
# translation unit here, so more cores do not shorten it) and the least a run of the smallest shape needs.
EXPECTED_BUILD_S = 60.0
MIN_RUN_S = 15.0
# Tolerances of the check. cuBLAS and the prototype both accumulate the same bf16 products in fp32, in different
# orders (~1e-5 apart at these logit sizes); a coordinate or layout error is off by O(1).
TOL = {"m_abs": 1e-3, "s_rel": 1e-3, "lse_abs": 1e-3, "target_abs": 1e-3}
GPU_SHAPES = {"N": [4096, 16384], "V": [128256, 151936], "D": 4096}
DRY_SHAPES = {"N": [37, 300], "V": [1000, 515], "D": 64}


# ------------------------------------------------------------------------------------------ the partials' math
def tile_partials(z, tile_n: int):
    """Per (tile, row) the kernel's pair from logits z [rows, V]: m = the tile's maximum, t = sum e^(z - m) over
    the tile's columns but the (first) maximum's own 1; in float64. Returns (m, t), each [ceil(V / tile_n), rows]."""
    import torch

    rows, v = z.shape
    tiles = -(-v // tile_n)
    zz = torch.full((rows, tiles * tile_n), -math.inf, dtype=torch.float64, device=z.device)
    zz[:, :v] = z
    zz = zz.view(rows, tiles, tile_n)
    m, first = zz.max(dim=2, keepdim=True)
    e = torch.exp(zz - m)
    e.scatter_(2, first, 0.0)  # t leaves out the maximum's own e^0 (a tie's twin still adds its 1)
    return m.squeeze(2).T.contiguous(), e.sum(dim=2).T.contiguous()


def merge_partials(m, t):
    """The exact merge of a row's tile pairs (each [tiles, rows]) into lse [rows], in float64: the tile holding
    the maximum keeps its t, every other tile adds all of its columns (1 + t) rescaled, lse = M + log1p(T)
    (csrc/prototypes/softmax_partials.h's merge_partial over all tiles at once)."""
    import torch

    m, t = m.double(), t.double()
    big, first = m.max(dim=0)
    scaled = (1.0 + t) * torch.exp(m - big)
    scaled.scatter_(0, first[None], t.gather(0, first[None]))
    return big + torch.log1p(scaled.sum(dim=0))


def _max(x) -> float:
    """The largest |x|, a NaN counted as infinite (Python's max() would pass over it)."""
    return float(x.abs().nan_to_num(nan=math.inf).max()) if x.numel() else 0.0


def check_shape(h, w, y, part_m, part_t, target_logit, tile_n: int, fp32_logits, sample_rows: int,
                chunk_rows: int) -> dict:
    """The kernel's outputs for (h, w, y) against the reference partials of ``fp32_logits(rows)`` (cuBLAS's
    fp32 logits of those rows), in row chunks; ``sample_rows`` rows also against float64 logits."""
    import torch

    n, v = h.shape[0], w.shape[0]
    tiles = -(-v // tile_n)
    err = {"m_abs": 0.0, "s_rel": 0.0, "lse_abs": 0.0, "lse_vs_logsumexp_abs": 0.0, "target_abs": 0.0,
           "logp_abs": 0.0}
    unwritten = {"partials": 0, "target_logit": 0, "target_logit_written_for_ignored": 0}
    for r0 in range(0, n, chunk_rows):
        rows = slice(r0, min(n, r0 + chunk_rows))
        z = fp32_logits(rows).double()
        km, kt = part_m[:, rows].double(), part_t[:, rows].double()
        unwritten["partials"] += int((~torch.isfinite(km)).sum() + torch.isnan(kt).sum())
        rm, rt = tile_partials(z, tile_n)
        err["m_abs"] = max(err["m_abs"], _max(km - rm))
        err["s_rel"] = max(err["s_rel"], _max((kt - rt) / (1.0 + rt)))
        lse = merge_partials(km, kt)
        err["lse_abs"] = max(err["lse_abs"], _max(lse - merge_partials(rm, rt)))
        ref_lse = torch.logsumexp(z, dim=1)
        err["lse_vs_logsumexp_abs"] = max(err["lse_vs_logsumexp_abs"], _max(lse - ref_lse))
        yy = y[rows]
        valid = (yy >= 0) & (yy < v)
        tl = target_logit[rows].double()
        zy = z[valid].gather(1, yy[valid][:, None]).squeeze(1)
        unwritten["target_logit"] += int(torch.isnan(tl[valid]).sum())
        unwritten["target_logit_written_for_ignored"] += int((~torch.isnan(tl[~valid])).sum())
        err["target_abs"] = max(err["target_abs"], _max(tl[valid] - zy))
        err["logp_abs"] = max(err["logp_abs"], _max((tl[valid] - lse[valid]) - (zy - ref_lse[valid])))
    # float64 logits on a sample of rows (first, last, spread): the prototype's lse and cuBLAS fp32's beside them
    idx = torch.unique(torch.linspace(0, n - 1, min(n, sample_rows), device=h.device).round().long())
    z64 = torch.cat([h[idx].double() @ w[c0:c0 + 16384].double().T for c0 in range(0, v, 16384)], dim=1)
    lse64 = torch.logsumexp(z64, dim=1)
    z32 = fp32_logits(idx).double()
    float64 = {"rows": int(idx.numel()),
               "prototype_lse_abs": _max(merge_partials(part_m[:, idx], part_t[:, idx]) - lse64),
               "cublas_fp32_lse_abs": _max(torch.logsumexp(z32, dim=1) - lse64)}
    err = {k: float(f"{x:.3g}") for k, x in err.items()}
    ok = (all(err[k] <= TOL[k] for k in TOL) and err["lse_vs_logsumexp_abs"] <= TOL["lse_abs"]
          and float64["prototype_lse_abs"] <= TOL["lse_abs"] and not any(unwritten.values()))
    return {"ok": bool(ok), "errors": err, "tolerances": TOL, "unwritten": unwritten, "float64": float64,
            "tiles": tiles, "rows_checked": n, "valid_targets": int(((y >= 0) & (y < v)).sum())}


def inputs(n: int, v: int, d: int, device, seed: int = 0):
    """bf16 hidden [n, d] and W [v, d] with logits of a few units (std ~4), every 97th row confident (its hidden
    state x6), targets with 5% ignored and the tiles' edge columns (0, 255, 256, the last tile's first, V - 1)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they are used: W is 2.5 GB in fp32
    h = torch.randn(n, d, generator=g, device=device)
    h[::97] *= 6.0
    w = torch.randn(v, d, generator=g, device=device).mul_(4.0 / math.sqrt(d)).to(torch.bfloat16)
    y = torch.randint(0, v, (n,), generator=g, device=device)
    y[torch.rand(n, generator=g, device=device) < 0.05] = IGNORE
    edges = torch.tensor([0, TILE_N - 1, TILE_N, (v - 1) // TILE_N * TILE_N, v - 1], device=device).clamp(max=v - 1)
    y[: min(n, len(edges))] = edges[: min(n, len(edges))]
    y[-1] = v - 1  # the last row (in the padded row block) at the last column
    return h.to(torch.bfloat16), w, y


# ------------------------------------------------------------------------------------------ the library
class Prototype:
    """The shared object's extern "C" entry points (sm90_softmax_partials.cu, the end of the file)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path))
        self.run = lib.fusedloss_proto_softmax_partials
        self.run.restype = ctypes.c_int
        self.run.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 5
                             + [ctypes.c_size_t, ctypes.c_void_p])
        self.workspace_bytes = lib.fusedloss_proto_workspace_bytes
        self.workspace_bytes.restype = ctypes.c_size_t
        self.workspace_bytes.argtypes = [ctypes.c_int] * 3
        self.last_error = lib.fusedloss_proto_last_error
        self.last_error.restype = ctypes.c_char_p
        info = (ctypes.c_int * len(tool.INFO_FIELDS))()
        lib.fusedloss_proto_kernel_info(info)
        self.info = dict(zip(tool.INFO_FIELDS, list(info)))

    def launcher(self, workspace, stream: int):
        def launch(h, w, y, part_m, part_t, target_logit):
            rc = self.run(h.data_ptr(), w.data_ptr(), h.shape[0], w.shape[0], h.shape[1], part_m.data_ptr(),
                          part_t.data_ptr(), y.data_ptr(), target_logit.data_ptr(),
                          workspace.data_ptr() if workspace is not None else None,
                          workspace.numel() if workspace is not None else 0, stream)
            if rc != 0:
                raise RuntimeError(f"fusedloss_proto_softmax_partials returned {rc}: "
                                   f"{self.last_error().decode(errors='replace')}")
        return launch


FAULTS = ("tile_index", "target_column", "padding_row")


def stand_in(fault: str | None = None):
    """A torch stand-in for the kernel (the dry run's): the same buffers written in the same layout from the fp32
    logits. ``fault``, an error the check must catch: each tile's pair one tile over ("tile_index"), the logit
    next to the target ("target_column"), the partials written one row late, as if the padded row count were
    the row count ("padding_row")."""
    def launch(h, w, y, part_m, part_t, target_logit):
        n, v = h.shape[0], w.shape[0]
        z = h.float() @ w.float().T
        m, t = tile_partials(z, TILE_N)
        shift, late = (1 if fault == "tile_index" else 0), (1 if fault == "padding_row" else 0)
        part_m[:, late:n + late] = m.float().roll(shift, 0)
        part_t[:, late:n + late] = t.float().roll(shift, 0)
        valid = (y >= 0) & (y < v)
        col = (y[valid] + (1 if fault == "target_column" else 0)) % v
        target_logit[valid] = z[valid].gather(1, col[:, None]).squeeze(1)
    return launch


def resolve_library(lib: Path | None, prebuilt: Path | None, seconds_left: float, build_dir: Path,
                    dry_run: bool) -> tuple:
    """(path or None, what happened): the given library, else a prebuilt one built from these sources, else a
    build when nvcc, the CUTLASS wheel and the time are there (never in a dry run), else None and why not."""
    if lib is not None:
        return lib, {"how": "given", "path": str(lib)}
    want = tool.source_hash()
    note = {"source_hash": want}
    if prebuilt is not None:
        cand, stamp = prebuilt / tool.LIB_NAME, prebuilt / tool.HASH_FILE
        have = stamp.read_text().strip() if stamp.is_file() else None
        if cand.is_file() and have == want:
            return cand, {**note, "how": "prebuilt", "path": str(cand)}
        note["prebuilt"] = (f"none in {prebuilt}" if not cand.is_file() else
                            f"{cand} was built from other sources ({have}), these are {want}")
    else:
        note["prebuilt"] = "no --prebuilt folder given"
    missing = tool.toolchain_missing(read_back=False)
    if missing:
        return None, {**note, "how": "none", "reason": f"{note['prebuilt']}; cannot build here: {missing}"}
    if dry_run:
        return None, {**note, "how": "none", "reason": f"{note['prebuilt']}; a dry run never compiles"}
    if seconds_left < EXPECTED_BUILD_S + MIN_RUN_S:
        return None, {**note, "how": "none", "reason": f"{note['prebuilt']}; a build (~{EXPECTED_BUILD_S:.0f} s of "
                      f"nvcc) and the smallest shape ({MIN_RUN_S:.0f} s) do not fit the {seconds_left:.0f} s left"}
    path = build_dir / tool.LIB_NAME
    seconds, _ = tool.compile_library(path)
    return path, {**note, "how": f"built here in {seconds:.1f} s", "path": str(path)}


# ------------------------------------------------------------------------------------------ timing
def _products(h, w, device):
    """cuBLAS's logits product of the same shape: bf16 output, and fp32 output of the bf16 operands."""
    import torch

    n, v = h.shape[0], w.shape[0]
    out16 = torch.empty(n, v, dtype=torch.bfloat16, device=device)
    out32 = torch.empty(n, v, dtype=torch.float32, device=device)
    calls = {"cublas_bf16_out": (lambda: torch.mm(h, w.T, out=out16), "torch.mm(out=bf16)"),
             "cublas_fp32_out": (lambda: torch.mm(h, w.T, out_dtype=torch.float32, out=out32),
                                 "torch.mm(out_dtype=torch.float32, out=fp32)")}
    return calls


def time_calls(calls: dict, device, warmup: int, repeat: int, deadline: float) -> dict:
    """``warmup`` untimed rounds, then up to ``repeat`` timed rounds, each round every call once in turn (a drift
    of the clocks falls on all alike), stopping early at ``deadline`` (time.monotonic()). On a GPU a round's
    calls are queued back to back between CUDA events and synchronised once, so a call's host work (the
    prototype's CUTLASS initialize) overlaps the kernel before it; on a CPU, perf_counter around each call."""
    import torch

    cuda = device.type == "cuda"
    times = {name: [] for name in calls}
    failed = {}

    def one_round(live: dict) -> dict:
        marks = {}
        for name, fn in live.items():
            try:
                if cuda:
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    fn()
                    e1.record()
                    marks[name] = (e0, e1)
                else:
                    t0 = time.perf_counter()
                    fn()
                    marks[name] = (time.perf_counter() - t0) * 1e3
            except (RuntimeError, TypeError, NotImplementedError) as exc:  # this call only: the round goes on
                failed[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        if cuda:
            torch.cuda.synchronize()  # a device fault raises here: the context is lost, the caller stops
            return {name: e0.elapsed_time(e1) for name, (e0, e1) in marks.items()}
        return marks

    for _ in range(warmup):
        one_round({k: f for k, f in calls.items() if k not in failed})
    for _ in range(repeat):
        live = {k: f for k, f in calls.items() if k not in failed}
        last_round_s = sum(times[k][-1] if times[k] else 0.0 for k in live) / 1e3
        if not live or (last_round_s and time.monotonic() + last_round_s > deadline):
            break
        for name, ms in one_round(live).items():
            times[name].append(ms)
    out = {}
    for name in calls:
        if name in failed:
            out[name] = {"status": "failed", "reason": failed[name]}
        elif not times[name]:
            out[name] = {"status": "skipped", "reason": "no time left for a timed round"}
        else:
            t = times[name]
            out[name] = {"status": "ok", "ms": statistics.median(t), "ms_min": min(t), "ms_max": max(t),
                         "repeats": len(t)}
    return out


def rates(timing: dict, flops: float) -> dict:
    """TFLOP/s of each median and its ratio to the bound's time (one product at BOUND_TFLOPS); the prototype's
    time over each cuBLAS product's."""
    bound_ms = flops / (BOUND_TFLOPS * 1e9)
    for rec in timing.values():
        if rec.get("status") == "ok":
            rec["tflops"] = float(f"{flops / rec['ms'] * 1e-9:.4g}")
            rec["over_bound"] = float(f"{rec['ms'] / bound_ms:.4g}")
            for k in ("ms", "ms_min", "ms_max"):
                rec[k] = float(f"{rec[k]:.4g}")
    proto = timing.get("prototype", {})
    ratios = {}
    for name in ("cublas_bf16_out", "cublas_fp32_out"):
        if proto.get("status") == "ok" and timing.get(name, {}).get("status") == "ok":
            ratios[f"prototype_over_{name}"] = float(f"{proto['ms'] / timing[name]['ms']:.4g}")
    return {"bound_ms": float(f"{bound_ms:.4g}"), **ratios}


# ------------------------------------------------------------------------------------------ one shape
def run_shape(n: int, v: int, d: int, device, launch_for, args, deadline: float, report: dict) -> dict:
    """Inputs, one launch, the check, the timing; the record is in ``report`` (and on disk) as it grows."""
    import torch

    rec = {"N": n, "V": v, "D": d, "flops": 2.0 * n * v * d,
           "status": "started (a report left so was stopped here, at its box: a hang or no time)"}
    report["shapes"].append(rec)
    report["status"] = f"running N={n} V={v}"
    write(report, args.out)
    h, w, y = inputs(n, v, d, device, seed=args.seed)
    tiles, rows_padded = -(-v // TILE_N), -(-n // TILE_M) * TILE_M
    part_m = torch.full((tiles, rows_padded), math.nan, dtype=torch.float32, device=device)
    part_t = torch.full_like(part_m, math.nan)
    target_logit = torch.full((n,), math.nan, dtype=torch.float32, device=device)
    launch, rec["workspace_bytes"] = launch_for(n, v, d)
    t0 = time.perf_counter()
    launch(h, w, y, part_m, part_t, target_logit)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rec["first_call_s"] = round(time.perf_counter() - t0, 3)

    def fp32_logits(rows):  # cuBLAS's fp32 output where this torch has it, else an fp32 product (TF32 off)
        try:
            return torch.mm(h[rows], w.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            return h[rows].float() @ w.float().T  # the same values: bf16 products are exact in fp32

    rec["check"] = check_shape(h, w, y, part_m[:, :n], part_t[:, :n], target_logit, TILE_N, fp32_logits,
                               args.sample_rows, args.chunk_rows)
    rec["status"] = "checked"
    write(report, args.out)
    calls = {"prototype": (lambda: launch(h, w, y, part_m, part_t, target_logit), "fusedloss_proto_softmax_partials")}
    calls.update(_products(h, w, device))
    rec["methods"] = {k: m for k, (_, m) in calls.items()}
    rec["timing"] = time_calls({k: f for k, (f, _) in calls.items()}, device, args.warmup, args.repeat, deadline)
    rec.update(rates(rec["timing"], rec["flops"]))
    failed = [k for k, r in rec["timing"].items() if r["status"] == "failed"]
    # the prototype's own launch decides; a cuBLAS product this torch lacks is recorded beside it
    rec["status"] = "ok" if rec["check"]["ok"] and "prototype" not in failed else "failed"
    write(report, args.out)
    return rec


def write(report: dict, out: Path | None) -> None:
    if out is None:
        return
    report["elapsed_s"] = round(time.monotonic() - report["_t0"], 1)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps({k: x for k, x in report.items() if not k.startswith("_")}, indent=1, default=str))
    os.replace(tmp, out)


def table(report: dict) -> str:
    lines = [f"{'N':>6} {'V':>7} {'check':<6} {'m err':>8} {'lse err':>8} {'proto ms':>9} {'TFLOP/s':>8} "
             f"{'/bound':>7} {'bf16 ms':>8} {'fp32 ms':>8} {'/bf16':>6} {'/fp32':>6}"]
    for r in report["shapes"]:
        if "check" not in r:
            lines.append(f"{r['N']:>6} {r['V']:>7} {r['status']}: {r.get('reason', '')}")
            continue
        c, t = r["check"], r.get("timing", {})

        def ms(k):
            return f"{t[k]['ms']:.3f}" if t.get(k, {}).get("status") == "ok" else t.get(k, {}).get("status", "-")
        p = t.get("prototype", {})
        lines.append(f"{r['N']:>6} {r['V']:>7} {'ok' if c['ok'] else 'FAIL':<6} {c['errors']['m_abs']:>8.2g} "
                     f"{c['errors']['lse_abs']:>8.2g} {ms('prototype'):>9} {p.get('tflops', '-'):>8} "
                     f"{p.get('over_bound', '-'):>7} {ms('cublas_bf16_out'):>8} {ms('cublas_fp32_out'):>8} "
                     f"{r.get('prototype_over_cublas_bf16_out', '-'):>6} "
                     f"{r.get('prototype_over_cublas_fp32_out', '-'):>6}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="the JSON report (rewritten after every step)")
    ap.add_argument("--lib", type=Path, help="a shared object to run as it is (no hash check)")
    ap.add_argument("--prebuilt", type=Path, help=f"a folder with {tool.LIB_NAME} and {tool.HASH_FILE}: used when "
                    "the hash is these sources'")
    ap.add_argument("--N", type=int, nargs="+", help=f"rows (default {GPU_SHAPES['N']}; dry {DRY_SHAPES['N']})")
    ap.add_argument("--V", type=int, nargs="+", help=f"vocabulary (default {GPU_SHAPES['V']}; dry {DRY_SHAPES['V']})")
    ap.add_argument("--D", type=int, help=f"hidden size, a multiple of 8 (default {GPU_SHAPES['D']}; dry "
                    f"{DRY_SHAPES['D']})")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls of each before the rounds (default 2)")
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds (default 5)")
    ap.add_argument("--budget-s", type=float, default=25.0, help="seconds for everything, the build included: "
                    "shapes that would start past it are recorded skipped (default 25)")
    ap.add_argument("--sample-rows", type=int, default=64, help="rows checked against float64 logits (default 64)")
    ap.add_argument("--chunk-rows", type=int, default=1024, help="rows per reference chunk (default 1024)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU: everything but the kernel (see the docstring)")
    args = ap.parse_args(argv)
    if args.lib is not None and not args.lib.is_file():
        ap.error(f"--lib: {args.lib} is not a file")
    shapes = DRY_SHAPES if args.dry_run else GPU_SHAPES
    args.N, args.V, args.D = args.N or shapes["N"], args.V or shapes["V"], args.D or shapes["D"]
    for name in ("N", "V"):
        bad = [x for x in getattr(args, name) if not 0 < x < 2 ** 31]
        if bad:
            ap.error(f"--{name}: {bad} outside [1, 2^31)")
    if not 0 < args.D < 2 ** 31 or args.D % 8:
        ap.error(f"--D: {args.D} must be a positive multiple of 8 (the kernel's TMA rows are 16-byte aligned)")
    for name in ("warmup", "repeat", "sample_rows", "chunk_rows"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is too small")
    if args.budget_s <= 0:
        ap.error(f"--budget-s: {args.budget_s} must be positive")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    report = {"_t0": t0, "what": "CUTLASS 3 prototype: softmax partials in the logits GEMM's epilogue, against "
              "torch and beside cuBLAS", "dry_run": args.dry_run, "bound_tflops": BOUND_TFLOPS,
              "warmup": args.warmup, "repeat": args.repeat, "budget_s": args.budget_s, "status": "started",
              "ok": None, "shapes": []}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    report["torch"] = torch.__version__
    cuda = torch.cuda.is_available()
    if not args.dry_run:
        why = ""
        if not cuda:
            why = "needs a CUDA GPU: torch.cuda.is_available() is False here (--dry-run is the CPU mode)"
        elif torch.cuda.get_device_capability() != (9, 0):
            why = (f"needs an sm_90 GPU (H100 / H200: the kernel is sm_90a code); this is "
                   f"{torch.cuda.get_device_name()} sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
        if why:
            report.update(status="no usable GPU", reason=why)
            write(report, args.out)
            print(f"cutlass_prototype_device: {why}", file=sys.stderr)
            return 2
        props = torch.cuda.get_device_properties(0)
        report["device"] = {"name": props.name, "sms": props.multi_processor_count,
                            "memory_gib": round(props.total_memory / 2 ** 30, 1), "cuda": torch.version.cuda}
        torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda" if not args.dry_run else "cpu")

    with tempfile.TemporaryDirectory(prefix="fl-proto-") as tmp:
        path, report["library"] = resolve_library(args.lib, args.prebuilt, deadline - time.monotonic(), Path(tmp),
                                                  args.dry_run)
        write(report, args.out)
        if args.dry_run:
            return dry_run(args, report, device, deadline, path)
        if path is None:
            report.update(status="skipped", reason=report["library"]["reason"])
            write(report, args.out)
            print(f"cutlass_prototype_device: skipped: {report['library']['reason']}", file=sys.stderr)
            return 3
        proto = Prototype(path)
        report["library"]["kernel_info"] = proto.info
        if (proto.info["tile_m"], proto.info["tile_n"]) != (TILE_M, TILE_N):
            raise SystemExit(f"{path}: tile {proto.info['tile_m']} x {proto.info['tile_n']}, this script reads the "
                             f"buffers of {TILE_M} x {TILE_N} tiles")
        stream = torch.cuda.current_stream().cuda_stream

        def launch_for(n, v, d):
            nbytes = proto.workspace_bytes(n, v, d)
            ws = torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None
            return proto.launcher(ws, stream), nbytes

        return run_shapes(args, report, device, launch_for, deadline)


def run_shapes(args, report, device, launch_for, deadline) -> int:
    import torch

    shapes = sorted(((n, v) for n in args.N for v in args.V), key=lambda s: s[0] * s[1])
    rc = 0
    for n, v in shapes:
        # what the shape needs at a pessimistic 300 TFLOP/s: the timed calls of three products, the reference's
        # product and float64 reductions (~3 more), and a second of set-up
        need = (3 * (args.warmup + args.repeat) + 4) * 2.0 * n * v * args.D / 300e12 + 1.0
        if device.type == "cuda" and time.monotonic() + need > deadline:
            report["shapes"].append({"N": n, "V": v, "D": args.D, "status": "skipped",
                                     "reason": f"needs ~{need:.0f} s, {deadline - time.monotonic():.0f} s left"})
            write(report, args.out)
            continue
        try:
            rec = run_shape(n, v, args.D, device, launch_for, args, deadline, report)
            rc = rc or (0 if rec["status"] == "ok" else 1)
        except RuntimeError as exc:  # a failed launch, or an error the device reported
            rec = report["shapes"][-1]
            rec.update(status="failed", reason=f"{type(exc).__name__}: {str(exc)[:1000]}")
            write(report, args.out)
            rc = 1
        if device.type == "cuda":
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except RuntimeError as exc:  # a sticky device error: every later call in this context repeats it
                report["device_error"] = f"{type(exc).__name__}: {str(exc)[:1000]}"
                write(report, args.out)
                break
    done = [s for s in report["shapes"] if s["status"] in ("ok", "failed")]
    report["ok"] = bool(done) and all(s["status"] == "ok" for s in done)
    report["status"] = "ok" if report["ok"] and len(done) == len(shapes) else ("failed" if rc else "partial")
    write(report, args.out)
    print(table(report))
    print(f"cutlass_prototype_device: {report['status']}; {len(done)} of {len(shapes)} shapes run "
          f"({report['elapsed_s'] if args.out else round(time.monotonic() - report['_t0'], 1)} s)")
    if report["status"] == "partial" and rc == 0:
        rc = 4  # shapes left for a rerun
    return rc


def dry_run(args, report, device, deadline, path) -> int:
    """The check and timing path with the torch stand-in, then the same with a layout error, which must fail."""
    report["library"]["would_run"] = str(path) if path else None
    if path:  # its host entry points answer without a device: the ctypes bindings, the tile, the workspace
        proto = Prototype(path)
        report["library"]["kernel_info"] = proto.info
        report["library"]["workspace_bytes"] = {f"{n}x{v}": proto.workspace_bytes(n, v, GPU_SHAPES["D"])
                                                for n in GPU_SHAPES["N"] for v in GPU_SHAPES["V"]}
        if (proto.info["tile_m"], proto.info["tile_n"]) != (TILE_M, TILE_N):
            report.update(ok=False, status="dry run FAILED", reason=f"{path}: tile {proto.info['tile_m']} x "
                          f"{proto.info['tile_n']}, this script reads the buffers of {TILE_M} x {TILE_N} tiles")
            write(report, args.out)
            return 1

    def launch_for(n, v, d):
        return stand_in(), 0

    rc = run_shapes(args, report, device, launch_for, deadline)
    # the check is able to fail: the smallest shape again with each of the stand-in's faults
    n, v = min(args.N), max(args.V)
    quick = argparse.Namespace(**{**vars(args), "out": None, "repeat": 1, "warmup": 0})
    report["self_test"] = {}
    for fault in FAULTS:
        rec = run_shape(n, v, args.D, device, lambda *_, f=fault: (stand_in(f), 0), quick, deadline,
                        {"_t0": report["_t0"], "shapes": []})
        report["self_test"][fault] = {"caught": not rec["check"]["ok"], "errors": rec["check"]["errors"],
                                      "unwritten": rec["check"]["unwritten"]}
    caught = all(x["caught"] for x in report["self_test"].values())
    report["ok"] = report["ok"] and caught
    report["status"] = "dry run ok" if report["ok"] else "dry run FAILED"
    write(report, args.out)
    faults = ", ".join(f"{k} {x['caught']}" for k, x in report["self_test"].items())
    print(f"cutlass_prototype_device: {report['status']} (the stand-in's faults caught: {faults}; library: "
          f"{report['library'].get('how')}, {report['library'].get('reason') or report['library'].get('path')})")
    return 0 if report["ok"] and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
