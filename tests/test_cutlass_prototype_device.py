"""benchmarks/cutlass_prototype_device.py, the GPU run of the CUTLASS prototype, without a GPU: its dry run (the
check and timing path with a torch stand-in for the kernel, and faults the check must catch), the merge of the
tile partials against float64, how it finds the shared object, and its refusals (no GPU, bad arguments)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "cutlass_prototype_device.py"
spec = importlib.util.spec_from_file_location("cutlass_prototype_device", SCRIPT)
dev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dev)


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_checks_the_stand_in_and_catches_its_faults(tmp_path):
    out = tmp_path / "proto.json"
    proc = _run("--dry-run", "--out", out, "--prebuilt", tmp_path / "none")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["dry_run"] is True and rep["status"] == "dry run ok" and rep["ok"] is True
    # every shape of the cross product, small first, checked and timed
    assert [(s["N"], s["V"]) for s in rep["shapes"]] == [(37, 515), (37, 1000), (300, 515), (300, 1000)]
    for s in rep["shapes"]:
        c = s["check"]
        assert s["status"] == "ok" and c["ok"] and c["tiles"] == -(-s["V"] // 256) and c["rows_checked"] == s["N"]
        assert all(c["errors"][k] <= c["tolerances"][k] for k in c["tolerances"]) and not any(c["unwritten"].values())
        assert 0 < c["valid_targets"] < s["N"]  # some targets ignored (-100), the rest checked
        assert c["float64"]["rows"] == min(s["N"], 64) and c["float64"]["prototype_lse_abs"] < 1e-4
        t = s["timing"]
        assert t["prototype"]["status"] == "ok" and t["prototype"]["repeats"] == 5 and t["prototype"]["tflops"] > 0
        assert t["cublas_bf16_out"]["status"] == "ok"
        assert s["bound_ms"] == pytest.approx(2 * s["N"] * s["V"] * 64 / 790e9, rel=1e-3)
        assert s["prototype_over_cublas_bf16_out"] == pytest.approx(
            t["prototype"]["ms"] / t["cublas_bf16_out"]["ms"], rel=2e-3)
    # each fault of the stand-in fails the check, through the metric that sees it
    st = rep["self_test"]
    assert set(st) == set(dev.FAULTS) and all(x["caught"] for x in st.values())
    assert st["tile_index"]["errors"]["m_abs"] > 1 and st["target_column"]["errors"]["target_abs"] > 1
    assert st["padding_row"]["unwritten"]["partials"] > 0
    # it never compiles in a dry run, and says why it has nothing to run
    assert rep["library"]["how"] == "none" and "a dry run never compiles" in rep["library"]["reason"]
    assert "dry run ok" in proc.stdout


def test_without_a_gpu_the_real_run_says_it_needs_one(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    out = tmp_path / "proto.json"
    proc = _run("--out", out)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    rep = json.loads(out.read_text())
    assert rep["status"] == "no usable GPU" and rep["shapes"] == [] and rep["ok"] is None


@pytest.mark.parametrize("args, named", [(["--D", "4100"], "--D"), (["--N", "0"], "--N"), (["--V", "-5"], "--V"),
                                         (["--lib", "/nonexistent/x.so"], "--lib"), (["--repeat", "0"], "--repeat")])
def test_bad_arguments_are_named(args, named):
    proc = _run(*args, "--dry-run", timeout=60)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


def test_merge_of_tile_partials_is_logsumexp_in_float64():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(9, 1000, generator=g, dtype=torch.float64) * 5
    z[1] += 1e4  # extreme logits
    z[2, 700] = 60.0  # a confident row: its other tiles add ~e^-60 each, which lse keeps
    z[3] = -1e3
    z[3, [3, 900]] = 2.0  # a tie across tiles
    m, t = dev.tile_partials(z, 256)
    assert m.shape == t.shape == (4, 9)  # [tiles, rows]: the kernel's buffer layout
    ref = torch.logsumexp(z, dim=1)
    lse = dev.merge_partials(m, t)
    assert torch.allclose(lse, ref, rtol=0, atol=1e-12)
    # the pair of one tile: its maximum, and the sum of its other exponentials; the last tile (columns 768-999)
    # counts no padding
    for j, cols in ((0, slice(0, 256)), (3, slice(768, 1000))):
        tile = z[0, cols]
        assert m[j, 0] == tile.max()
        assert t[j, 0] == pytest.approx(float(torch.exp(tile - tile.max()).sum() - 1.0), rel=1e-12)
    # a tie across tiles: each tile holds one half (t = 0 there), the merge adds the other's 1: lse = 2 + log 2
    assert (m[0, 3], t[0, 3], m[3, 3], t[3, 3]) == (2.0, 0.0, 2.0, 0.0) and lse[3] == pytest.approx(2 + math.log(2))
    # a confident row: t is kept relative to its maximum, far below what 1 + t could hold in fp32 or float64
    assert 0 < t[2, 2] < 1e-15
    # merging in any tile order is the same lse (the exact merge does not depend on the order)
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.allclose(dev.merge_partials(m[perm], t[perm]), lse, rtol=0, atol=1e-12)


def test_library_resolution(tmp_path, monkeypatch):
    """A prebuilt object is used only with these sources' hash; otherwise a build happens only where nvcc, the
    CUTLASS wheel and the time allow it, and each refusal says why."""
    pre = tmp_path / "prebuilt"
    pre.mkdir()
    (pre / dev.tool.LIB_NAME).write_bytes(b"not loaded by the resolution")
    (pre / dev.tool.HASH_FILE).write_text(dev.tool.source_hash() + "\n")
    path, how = dev.resolve_library(None, pre, 5.0, tmp_path, dry_run=False)
    assert path == pre / dev.tool.LIB_NAME and how["how"] == "prebuilt"
    (pre / dev.tool.HASH_FILE).write_text("0123456789abcdef\n")
    path, how = dev.resolve_library(None, pre, 5.0, tmp_path, dry_run=True)
    assert path is None and "built from other sources (0123456789abcdef)" in how["reason"]
    monkeypatch.setattr(dev.tool, "toolchain_missing", lambda read_back=True: "")
    path, how = dev.resolve_library(None, tmp_path / "empty", 30.0, tmp_path, dry_run=False)
    assert path is None and "none in" in how["reason"] and "do not fit the 30 s left" in how["reason"]
    monkeypatch.setattr(dev.tool, "toolchain_missing", lambda read_back=True: "nvidia-cutlass is not installed")
    path, how = dev.resolve_library(None, None, 1e4, tmp_path, dry_run=False)
    assert path is None and "cannot build here: nvidia-cutlass is not installed" in how["reason"]
    given = tmp_path / "x.so"
    assert dev.resolve_library(given, pre, 0.0, tmp_path, dry_run=False)[0] == given


def test_timing_stops_at_the_deadline_and_records_a_failed_call():
    calls = {"fast": lambda: None, "broken": lambda: (_ for _ in ()).throw(RuntimeError("launch failed\nmore"))}
    out = dev.time_calls(calls, torch.device("cpu"), warmup=1, repeat=5, deadline=math.inf)
    assert out["fast"]["status"] == "ok" and out["fast"]["repeats"] == 5
    assert out["broken"] == {"status": "failed", "reason": "RuntimeError: launch failed"}
    slow = {"slow": lambda: __import__("time").sleep(0.05)}
    import time

    out = dev.time_calls(slow, torch.device("cpu"), warmup=0, repeat=50, deadline=time.monotonic() + 0.2)
    assert 1 <= out["slow"]["repeats"] < 10
