"""benchmarks/device_check.sh stays runnable without a GPU: its plan fits the 540 s call, and its dry run
(DRY_RUN=1, CPU, tiny shapes) runs the stages as the GPU run would: the benchmark stages with a second call on
the same machine (RERUN=1) that measures only what the first left and returns one merged benchmark, and the
check stages. What comes back fits the eight files the run may return."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["smoke", "build", "core", "peers", "profile", "correctness", "workspace", "sanitize", "prototype"]


def _call(tmp_path, out, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SKIP", "RERUN", "OUT", "PLAN")}
    env.update(DRY_RUN="1", OUT=str(out), PYTHON=sys.executable, DEVICE_CHECK_STATE=str(tmp_path / "state"),
               BENCH_OPS="cross_entropy", PEER_WHEELS=str(tmp_path / "no-wheels"), **env_extra)
    proc = subprocess.run(["bash", "benchmarks/device_check.sh"], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout[proc.stdout.index("device check summary"):].splitlines()
    return proc.stdout, {line.split()[0]: " ".join(line.split()[1:]) for line in summary[1:] if line.startswith("  ")}


def _files(out):
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(f.count("/") <= 2 for f in files)
    return set(files)


def test_plan_boxes_every_stage_within_540_s():
    env = {k: v for k, v in os.environ.items() if k != "DRY_RUN"}
    proc = subprocess.run(["bash", "benchmarks/device_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "PLAN": "1"}, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln.split() for ln in proc.stdout.splitlines()[1:] if re.match(r"^\w+ +\d+s", ln)]
    assert [r[0] for r in rows] == STAGES + ["reserve"]
    boxes = [int(r[1].rstrip("s")) for r in rows]
    ends = [int(r[2].rstrip("s")) for r in rows]
    assert ends == [sum(boxes[: i + 1]) for i in range(len(boxes))]  # each stage ends where the next begins
    assert boxes[0] <= 20 and all(b > 0 for b in boxes)
    assert 20 <= boxes[STAGES.index("prototype")] <= 30  # the CUTLASS prototype's short box, after every check
    assert sum(boxes) <= 540 and f"sum {sum(boxes)} s (limit 540 s): ok" in proc.stdout
    # the header's stage list says the same boxes
    header = (ROOT / "benchmarks" / "device_check.sh").read_text().split("set -u")[0]
    for name, box in zip(STAGES, boxes):
        assert re.search(rf"^#     {name} +{box} s ", header, re.M), name


def test_dry_run_then_rerun_finishes_the_benchmark(tmp_path):
    skip = "build,peers,profile,correctness,workspace,sanitize,prototype"
    out1 = tmp_path / "out1"
    stdout, summary = _call(tmp_path, out1, SKIP=skip, BENCH_IMPLS="reference fusedloss:torch")
    assert summary["smoke"].startswith("rc=0") and summary["core"].startswith("rc=0"), summary
    for stage in skip.split(","):
        assert summary[stage] == "skipped (SKIP)"
    smoke = json.loads((out1 / "smoke.json").read_text())
    assert smoke["tiny_calls"]["torch"]["ok"] and smoke["tiny_calls"]["triton"]["ok"] and not smoke["failures"]
    assert _files(out1) == {"device_check.log", "dmon.txt", "smoke.json", "bench.json", "bench.png", "checks.json"}
    first = json.loads((out1 / "bench.json").read_text())
    ok = [r for r in first if r["status"] == "ok"]
    # both shapes of the core stage (N=64, V=257, then N=32, V=263 on the CPU), each implementation once
    assert sorted((r["impl"], r["N"], r["V"]) for r in ok) == [
        ("fusedloss:torch", 32, 263), ("fusedloss:torch", 64, 257), ("reference", 32, 263), ("reference", 64, 257)]
    for r in ok:  # forward and backward apart, the H200 model's figures under modelled_* names
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["repeats"] == 5
        assert r["modelled_bound_ms"] > 0 and r["modelled_details"]["gpu"] == "H200" and "bound_ms" not in r

    out2 = tmp_path / "out2"
    stdout, summary = _call(tmp_path, out2, RERUN="1", SKIP="build,profile,correctness,workspace,sanitize,prototype",
                            BENCH_IMPLS="reference fusedloss:torch", BENCH_PEER_IMPLS="torch-lce")
    assert summary["smoke"] == summary["core"] == "done in the first call", summary
    assert summary["peers"].startswith("rc=0"), summary
    merged = json.loads((out2 / "bench.json").read_text())
    got = sorted((r["impl"], r["N"]) for r in merged if r["status"] == "ok")
    assert got == [("fusedloss:torch", 32), ("fusedloss:torch", 64), ("reference", 32), ("reference", 64),
                   ("torch-lce", 32), ("torch-lce", 64)]
    assert len(merged) == 6  # one record per case across the two calls
    assert "torch-lce" in stdout[stdout.index("---------------- benchmark"):]


def test_dry_run_of_the_check_stages(tmp_path):
    """The stages after the benchmark, dry: every op (here one) of every backend against float64 and the naive
    path, the CUDA check's correctness sections (host twins), the workspace sweep, the sanitizer's scripts, the
    CUTLASS prototype's driver (its torch stand-in); each reports rc=0 and lands in checks.json, as does the
    profile stage's products.json."""
    from fusedloss.backends.cuda import backend as cuda

    if not cuda.extension_built():
        pytest.skip(f"CUDA extension not built: {cuda.availability()}")
    out = tmp_path / "out"
    _, summary = _call(tmp_path, out, SKIP="build,core,peers", CHECK_OPS="cross_entropy",
                       TRITON_CHECK_ARGS="--cost-table")
    for stage in ("smoke", "profile", "correctness", "workspace", "sanitize", "prototype"):
        assert summary[stage].startswith("rc=0"), (stage, summary)
    checks = json.loads((out / "checks.json").read_text())
    verdicts = {v["impl"]: v for v in checks["ops_vs_float64_and_naive"]}
    assert set(verdicts) == {"fusedloss:torch", "fusedloss:triton", "fusedloss:cuda"}
    assert verdicts.pop("fusedloss:cuda")["ok"] is None  # no device here: unavailable, neither ok nor failed
    for v in verdicts.values():
        assert v["ok"] is True and v["err_vs_float64"] <= v["limit"] and v["naive_err_vs_float64"] > 0
    assert checks["cuda_check"]["ok"] is True and checks["cuda_check"]["environment"]["smoke"] is True
    timing = next(c for c in checks["workspace_sweep"]["cases"] if c["name"] == "timings")
    assert timing["rows"] and all("modelled_ms" in r for r in timing["rows"])
    assert checks["sanitizers"]["memcheck"]["rc"] == 0 and checks["sanitizers"]["racecheck"]["rc"] == 0
    proto = checks["cutlass_prototype"]
    assert proto["dry_run"] and proto["status"] == "dry run ok" and len(proto["shapes"]) == 4
    assert all(s["check"]["ok"] for s in proto["shapes"]) and all(x["caught"] for x in proto["self_test"].values())
    rates = json.loads((out / "products.json").read_text())["product_rates"]
    assert [r["name"] for r in rates] == ["bf16_output", "fp32_output", "fp32_accumulate_short_k"]
    assert rates[0]["status"] == "ok" and rates[0]["tflops"] > 0
    profiled = [r for r in json.loads((out / "bench.json").read_text()) if r.get("mode") == "profile"]
    assert profiled and all(r["profile"]["kernels"] for r in profiled if r["status"] == "ok")
