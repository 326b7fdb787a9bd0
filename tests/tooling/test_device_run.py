"""The device run (``python -m benchmarks.device``) stays runnable without a GPU: its plan fits the 540 s call, and
its dry run (CPU, tiny shapes, the kernels' host twins, the Triton interpreter) runs the stages as the GPU run would:
the benchmark stages with a second call on the same machine (--rerun) that measures only what the first left and
returns one merged benchmark, and the check stages, every backend against the float64 reference of
benchmarks/cases.py. What comes back fits the eight files the run may return. Then the checks one by one: the CUDA
check's paths, the sanitizer's tiles, the epilogue check (its planted fault caught), the cases check's verdicts.

A device run is rare and short (one call of a few minutes); a checker that broke since the last one would waste it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.device import __main__ as device
from benchmarks.device import check_cases
from benchmarks.device import check_epilogue as epilogue_check
from fusedloss.backends.cuda import backend as cuda

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["smoke", "build", "core", "peers", "profile", "cases", "backends", "workspace", "sanitize", "epilogue"]
needs_extension = pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: "
                                                                        f"{cuda.availability()}")


def _call(tmp_path, out, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "benchmarks.device", "--dry-run", "--out", str(out), "--state",
           str(tmp_path / "state"), "--wheels", str(tmp_path / "no-wheels"), "--bench-ops", "cross_entropy", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout[proc.stdout.index("device check summary"):].splitlines()
    return proc.stdout, {line.split()[0]: " ".join(line.split()[1:]) for line in summary[1:] if line.startswith("  ")}


def _files(out):
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and all(f.count("/") <= 2 for f in files)
    return set(files)


def test_plan_boxes_every_stage_within_540_s():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device", "--plan"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln.split() for ln in proc.stdout.splitlines()[1:] if re.match(r"^\w+ +\d+s", ln)]
    assert [r[0] for r in rows] == STAGES + ["reserve"] == list(device.STAGES) + ["reserve"]
    boxes = [int(r[1].rstrip("s")) for r in rows]
    ends = [int(r[2].rstrip("s")) for r in rows]
    assert ends == [sum(boxes[: i + 1]) for i in range(len(boxes))]  # each stage ends where the next begins
    assert boxes[0] <= 20 and all(b > 0 for b in boxes)
    assert 20 <= boxes[STAGES.index("epilogue")] <= 30  # the epilogue kernels' short box, after every other check
    assert sum(boxes) <= 540 and f"sum {sum(boxes)} s (limit 540 s): ok" in proc.stdout
    # the docstring's stage list says the same boxes
    for name, box in zip(STAGES, boxes):
        assert re.search(rf"^    {name} +{box} s ", device.__doc__, re.M), name


def test_dry_run_then_rerun_finishes_the_benchmark(tmp_path):
    skip = "build,peers,profile,cases,backends,workspace,sanitize,epilogue"
    out1 = tmp_path / "out1"
    stdout, summary = _call(tmp_path, out1, "--skip", skip, "--impls", "reference", "fusedloss:torch")
    assert summary["smoke"].startswith("rc=0") and summary["core"].startswith("rc=0"), summary
    for stage in skip.split(","):
        assert summary[stage] == "skipped (--skip)"
    smoke = json.loads((out1 / "smoke.json").read_text())
    assert smoke["tiny_calls"]["torch"]["ok"] and smoke["tiny_calls"]["triton"]["ok"] and not smoke["failures"]
    assert set(smoke["tiny_calls"]["torch"]["errors"]) == {"logp", "entropy", "grad_hidden", "grad_weight"}
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
    stdout, summary = _call(tmp_path, out2, "--rerun", "--skip", "build,profile,cases,backends,workspace,sanitize,"
                            "epilogue", "--impls", "reference", "fusedloss:torch", "--peer-impls", "torch-lce")
    assert summary["smoke"] == summary["core"] == "done in the first call", summary
    assert summary["peers"].startswith("rc=0"), summary
    merged = json.loads((out2 / "bench.json").read_text())
    got = sorted((r["impl"], r["N"]) for r in merged if r["status"] == "ok")
    assert got == [("fusedloss:torch", 32), ("fusedloss:torch", 64), ("reference", 32), ("reference", 64),
                   ("torch-lce", 32), ("torch-lce", 64)]
    assert len(merged) == 6  # one record per case across the two calls
    assert "torch-lce" in stdout[stdout.index("---------------- benchmark"):]


@needs_extension
def test_dry_run_of_the_check_stages(tmp_path):
    """The stages after the benchmark, dry: every op (here one) of every backend against float64 and the naive
    path (the CUDA backend and its epilogue path through their host twins), the CUDA check's correctness sections,
    the Triton check's driver, the workspace sweep, the sanitizer's scripts, the epilogue check; each reports rc=0
    and lands in checks.json, as does the profile stage's products.json."""
    out = tmp_path / "out"
    _, summary = _call(tmp_path, out, "--skip", "build,core,peers", "--check-ops", "cross_entropy",
                       "--triton-args=--cost-table")
    for stage in ("smoke", "profile", "cases", "backends", "workspace", "sanitize", "epilogue"):
        assert summary[stage].startswith("rc=0"), (stage, summary)
    # (no timed benchmark record here, so no plot)
    assert {"device_check.log", "dmon.txt", "smoke.json", "bench.json", "products.json", "checks.json"} <= _files(out)
    checks = json.loads((out / "checks.json").read_text())
    verdicts = {v["impl"]: v for v in checks["ops_vs_float64_and_naive"]}
    assert set(verdicts) == set(check_cases.IMPLS) and checks["cases_complete"] is True
    for v in verdicts.values():
        assert v["ok"] is True and v["err_vs_float64"] <= v["limit"] and v["naive_err_vs_float64"] > 0, v
        assert set(v["errors"]) == {"loss", "grad_hidden", "grad_weight"}
    # each CUDA path is the one asked for: the epilogue's forward and backward ran once on its path, never on today's
    assert verdicts["fusedloss:cuda+epilogue"]["epilogue_calls"] == {"forward": 1, "backward": 1}
    assert verdicts["fusedloss:cuda"]["epilogue_calls"] == {"forward": 0, "backward": 0}
    assert checks["cuda_check"]["ok"] is True and checks["cuda_check"]["environment"]["smoke"] is True
    timing = next(c for c in checks["workspace_sweep"]["cases"] if c["name"] == "timings")
    assert timing["rows"] and all("modelled_ms" in r for r in timing["rows"])
    assert checks["sanitizers"]["memcheck"]["rc"] == 0 and checks["sanitizers"]["racecheck"]["rc"] == 0
    e = checks["epilogue"]
    assert e["status"] == "ok" and e["dry_run"] and e["planted_fault_caught"] is True and e["checks"]["ok"]
    rates = json.loads((out / "products.json").read_text())["product_rates"]
    assert [r["name"] for r in rates] == ["bf16_output", "fp32_output", "fp32_accumulate_short_k"]
    assert rates[0]["status"] == "ok" and rates[0]["tflops"] > 0
    profiled = [r for r in json.loads((out / "bench.json").read_text()) if r.get("mode") == "profile"]
    assert profiled and all(r["profile"]["kernels"] for r in profiled if r["status"] == "ok")


# ---------------------------------------------------------------------------------------------------------------
# The checks one by one
# ---------------------------------------------------------------------------------------------------------------
def test_cases_verdict_bounds():
    """bf16/fp16: no worse than the naive path + 2e-3; fp32: within max(1e-5, 4x the naive error)."""
    assert check_cases.limit(1e-3, torch.bfloat16) == pytest.approx(3e-3)
    assert check_cases.limit(1e-3, torch.float16) == pytest.approx(3e-3)
    assert check_cases.limit(1e-7, torch.float32) == 1e-5
    assert check_cases.limit(1e-5, torch.float32) == pytest.approx(4e-5)


def test_cases_check_records_an_unavailable_backend_as_neither_passed_nor_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda, "extension_built", lambda: False)
    out = tmp_path / "cases.json"
    assert check_cases.main(["--dry-run", "--out", str(out), "--ops", "cross_entropy", "--impls", "fusedloss:torch",
                             "fusedloss:cuda"]) == 0
    r = json.loads(out.read_text())
    recs = {x["impl"]: x for x in r["records"]}
    assert r["complete"] and r["ok"] and set(recs) == {"reference", "fusedloss:torch", "fusedloss:cuda"}
    assert recs["fusedloss:cuda"]["status"] == "unavailable" and recs["fusedloss:cuda"]["ok"] is None
    assert recs["fusedloss:torch"]["ok"] is True and recs["reference"]["max_rel_err"] > 0


def test_cases_check_fails_a_wrong_gradient(tmp_path, monkeypatch):
    """A backend whose d hidden is 1% off is not ok: the verdict reads the gradients, not only the loss."""
    import fusedloss

    real = fusedloss.cross_entropy

    class Skew(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):
            return h.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.01

    monkeypatch.setattr(fusedloss, "cross_entropy", lambda h, *a, **k: real(Skew.apply(h), *a, **k))
    out = tmp_path / "cases.json"
    assert check_cases.main(["--dry-run", "--out", str(out), "--ops", "cross_entropy", "--dtype", "float32",
                             "--impls", "fusedloss:torch"]) == 1
    rec = [x for x in json.loads(out.read_text())["records"] if x["impl"] == "fusedloss:torch"][0]
    assert rec["ok"] is False and rec["errors"]["grad_hidden"] == pytest.approx(1e-2, rel=1e-3)


@needs_extension
def test_cuda_check_dry_run_reaches_every_path(tmp_path):
    out = tmp_path / "cuda_check.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device.check_cuda", "--out", str(out), "--cpu-smoke",
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


@needs_extension
def test_sanitize_tiles_dry_run():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device.sanitize_smoke", "--tiles", "--device", "cpu"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok", "FAIL"))]
    assert len(lines) == 13 and all(ln.startswith("ok") for ln in lines)


@pytest.fixture
def restore(monkeypatch):
    """The epilogue check patches the backend resolution and the epilogue's kernels for its process: undo it."""
    from fusedloss.backends.cuda import epilogue
    from fusedloss.core import registry

    monkeypatch.setattr(registry, "resolve", registry.resolve)
    for name in ("_KERNELS_OVERRIDE", "forward_statistics", "backward_gradients"):
        monkeypatch.setattr(epilogue, name, getattr(epilogue, name))
    monkeypatch.delenv(epilogue_check.ENV, raising=False)


@needs_extension
def test_epilogue_check_dry_run_passes_and_catches_the_planted_fault(tmp_path, restore):
    out = tmp_path / "epilogue.json"
    assert epilogue_check.main(["--dry-run", "--out", str(out), "--budget-s", "300"]) == 0
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and r["dry_run"] and r["planted_fault_caught"] is True and r["left"] == []
    assert [(f["N"], f["V"]) for f in r["forward"]] == epilogue_check.DRY["forward"]
    for f in r["forward"]:
        assert f["check"]["ok"] and set(f["ms"]) == {"epilogue", "epilogue_entropy", "cublas_bf16_out"}
    assert set(r["ops"][0]["ms"]) == set(epilogue_check.OPS)
    assert set(r["checks"]["ops"]) == set(epilogue_check.OPS)
    for op, c in r["checks"]["ops"].items():
        assert c["ok"] and c["epilogue_calls"]["epilogue"] == {"forward": 1, "backward": 1}, (op, c)
        assert c["epilogue_calls"]["today"] == {"forward": 0, "backward": 0}


def test_epilogue_check_refuses_without_an_sm90_gpu(tmp_path, restore):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    out = tmp_path / "epilogue.json"
    assert epilogue_check.main(["--out", str(out)]) == 2
    assert json.loads(out.read_text())["status"] == "no GPU"
