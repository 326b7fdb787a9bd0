"""benchmarks/device_check.sh stays runnable between the rare device sessions: its dry run (DRY_RUN=1, CPU) on
the benchmark stages, then a second call as on a still-warm device (RERUN=1), which must measure only what the
first left and return one merged benchmark. The full dry run (every stage, ~5 minutes on this machine) is in
benchmarks/NOTES.md; this keeps the orchestration honest in the test suite: stage boxes, skips, the parts kept
for a rerun, the merge, the files that come back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _call(tmp_path, out, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SKIP", "RERUN", "OUT")}
    env.update(DRY_RUN="1", OUT=str(out), PYTHON=sys.executable, BENCH_PARTS=str(tmp_path / "parts"),
               BENCH_N="64", BENCH_OPS="cross_entropy", DEVICE_CHECK_BUDGET_S="400", **env_extra)
    proc = subprocess.run(["bash", "benchmarks/device_check.sh"], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_dry_run_then_rerun_finishes_the_benchmark(tmp_path):
    skip = "peers,build,triton,cuda,sanitize,racecheck,cuda_timing,compile"
    out1 = tmp_path / "out1"
    stdout = _call(tmp_path, out1, SKIP=skip, BENCH_IMPLS="reference fusedloss:torch")
    summary = stdout[stdout.index("device check summary"):]
    for stage in ("env", "bench"):
        assert any(line.split()[:2] == [stage, "rc=0"] for line in summary.splitlines()), summary
    for stage in skip.split(","):
        assert any(line.split()[:2] == [stage, "skipped"] for line in summary.splitlines()), (stage, summary)
    first = json.loads((out1 / "bench.json").read_text())
    assert sorted(r["impl"] for r in first if r["status"] == "ok") == ["fusedloss:torch", "reference"]
    for r in first:
        if r["status"] == "ok":  # forward and backward separately, the H200 model's bound beside
            assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["bound_ms"] > 0 and r["model"]["gpu"] == "H200"
    assert {p.name for p in out1.iterdir()} == {"device_check.log", "bench.json", "bench.png", "bench.log"}

    out2 = tmp_path / "out2"
    stdout = _call(tmp_path, out2, RERUN="1", SKIP=skip, BENCH_IMPLS="reference fusedloss:torch torch-lce")
    log = (out2 / "device_check.log").read_text()
    assert "--skip-done: 2 case(s) already measured ok, not rerun" in log
    merged = json.loads((out2 / "bench.json").read_text())
    ok = sorted(r["impl"] for r in merged if r["status"] == "ok")
    assert ok == ["fusedloss:torch", "reference", "torch-lce"]
    assert len(merged) == 3  # one record per case across the two calls
    assert "torch-lce" in stdout[stdout.index("---------------- benchmark"):]


def test_dry_run_of_the_check_stages(tmp_path):
    """The stages before the benchmark, dry: the Triton check in the background (here only its cost table, the
    full CPU smoke run takes minutes), the CUDA check's correctness sections and then its timings alone,
    the sanitizer's and racecheck's scripts on the host twins; each reports rc=0 and leaves its JSON."""
    from fusedloss.cuda import backend as cuda

    if not cuda.extension_built():
        import pytest

        pytest.skip(f"CUDA extension not built: {cuda.availability()}")
    out = tmp_path / "out"
    stdout = _call(tmp_path, out, SKIP="peers,build,bench,compile", TRITON_CHECK_ARGS="--cost-table")
    summary = stdout[stdout.index("device check summary"):].splitlines()
    for stage in ("env", "triton", "cuda", "sanitize", "racecheck", "cuda_timing"):
        assert any(line.split()[:2] == [stage, "rc=0"] for line in summary), (stage, summary)
    log = (out / "device_check.log").read_text()
    assert "---------------- triton (background) ----------------" in log and '"after_ratio"' in log
    # the Triton check ends before anything is timed
    assert log.index("waiting for triton") < log.index("cuda_timing (box")
    for name in ("cuda_check", "cuda_timing"):
        report = json.loads((out / f"{name}.json").read_text())
        assert report["ok"] is True and report["environment"]["smoke"] is True
    sections = {c["name"] for c in json.loads((out / "cuda_timing.json").read_text())["cases"]}
    assert sections == {"timings"}
