"""The prepared device scripts stay runnable: their CPU dry runs (the kernels' host twins on tiny shapes).

A device run is rare and short (one call of a few minutes); a script that broke since the last one would
waste it. These run the dry-run modes of benchmarks/device_check_cuda.py and benchmarks/sanitize_smoke.py
and check what they report, not GPU results.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fusedloss.backends.cuda import backend as cuda

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: {cuda.availability()}")


def test_device_check_dry_run_reaches_every_path(tmp_path):
    out = tmp_path / "cuda_check.json"
    proc = subprocess.run([sys.executable, "benchmarks/device_check_cuda.py", "--out", str(out), "--cpu-smoke",
                           "--only", "paths", "racecheck"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    paths = next(c for c in report["cases"] if c["name"] == "paths")
    names = [c["what"] for c in paths["checks"]]
    # several grad-in-forward chunks
    assert any(n.startswith("grad-in-forward.small_workspace[9 chunks]") for n in names)
    assert any(n.startswith("composable.row_chunks[3]") for n in names)  # row offsets > 0
    assert any(n.startswith("fp32_with_tf32_on") for n in names)
    assert sum(n.startswith("fp16_loss_scale_2^16") for n in names) == 4  # both paths, both gradients
    assert all(c["ok"] for c in paths["checks"])
    race = next(c for c in report["cases"] if c["name"] == "racecheck")
    assert race["skipped"] == "cpu smoke run"


def test_sanitize_tiles_dry_run():
    proc = subprocess.run([sys.executable, "benchmarks/sanitize_smoke.py", "--tiles", "--device", "cpu"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok", "FAIL"))]
    assert len(lines) == 13 and all(ln.startswith("ok") for ln in lines)
