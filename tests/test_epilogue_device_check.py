"""benchmarks/epilogue_device_check.py's dry run on the CPU: every step at tiny shapes with the host twins as the
epilogue kernels, the float64 checks passing on both paths, each path the one asked for, the planted fault caught,
the JSON as a GPU run writes it; and the GPU run's refusal where there is no sm_90 GPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fusedloss.backends.cuda import backend as cuda

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("epilogue_device_check", ROOT / "benchmarks" / "epilogue_device_check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


@pytest.fixture
def restore(monkeypatch):
    """The dry run patches the backend resolution and the epilogue's kernels for its process: undo it here."""
    from fusedloss.backends.cuda import epilogue
    from fusedloss.core import registry

    monkeypatch.setattr(registry, "resolve", registry.resolve)
    for name in ("_KERNELS_OVERRIDE", "forward_statistics", "backward_gradients"):
        monkeypatch.setattr(epilogue, name, getattr(epilogue, name))
    monkeypatch.delenv(check.ENV, raising=False)


@pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: {cuda.availability()}")
def test_dry_run_passes_and_catches_the_planted_fault(tmp_path, restore):
    out = tmp_path / "epilogue.json"
    assert check.main(["--dry-run", "--out", str(out), "--budget-s", "300"]) == 0
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and r["dry_run"] and r["planted_fault_caught"] is True and r["left"] == []
    assert [(f["N"], f["V"]) for f in r["forward"]] == check.DRY["forward"]
    for f in r["forward"]:
        assert f["check"]["ok"] and set(f["ms"]) == {"epilogue", "epilogue_entropy", "cublas_bf16_out"}
    assert set(r["ops"][0]["ms"]) == set(check.OPS)
    for op, c in r["checks"]["ops"].items():
        assert c["ok"] and c["epilogue_calls"]["epilogue"] == {"forward": 1, "backward": 1}, (op, c)
        assert c["epilogue_calls"]["today"] == {"forward": 0, "backward": 0}


def test_gpu_run_refuses_without_an_sm90_gpu(tmp_path, restore):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    out = tmp_path / "epilogue.json"
    assert check.main(["--out", str(out)]) == 2
    assert json.loads(out.read_text())["status"] == "no GPU"
