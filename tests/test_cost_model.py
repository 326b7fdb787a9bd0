"""benchmarks/cost_model.py: the command line of issue 11 over fusedloss.core.cost and the backends' plans."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fusedloss.core import cost

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import cost_model  # noqa: E402

FIELDS = ("products", "flops", "hbm_bytes", "model_ms", "bound_ms", "ratio", "plan")


def cli(*args):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cost_model.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_the_issue_command_prints_one_json_object():
    rc, out, err = cli("--op", "cross_entropy", "--backend", "cuda", "--N", "16384", "--D", "4096", "--V", "151936",
                       "--dtype", "bfloat16", "--gpu", "h200", "--json")
    assert rc == 0, err
    e = json.loads(out)
    assert all(k in e for k in FIELDS)
    assert e["products"] == 3 and e["path"] == "eager"
    # 3 GEMM-sized products of 2 N V D flops are the bulk of the flops; 6 N V D at 790 TFLOP/s is the bound
    assert 3 * 2 * 16384 * 4096 * 151936 <= e["flops"] < 1.01 * 3 * 2 * 16384 * 4096 * 151936
    assert e["bound_ms"] == pytest.approx(6 * 16384 * 4096 * 151936 / 790e12 * 1e3)
    assert e["ratio"] == pytest.approx(e["model_ms"] / e["bound_ms"]) and e["ratio"] <= 1.2
    assert e["plan"]["eager_rows"] * e["plan"]["chunks"] >= 16384


def test_estimate_evaluates_the_backends_own_plan():
    """The model's figures are those of fusedloss.cuda.backend.plan, not of a copy of it."""
    from fusedloss.cuda import backend as cuda

    w = cost.Workload(op="token_logprobs", n=4096, d=4096, v=128256)
    free = cost.GPUS["h200"].memory_bytes // 2
    want = cost.evaluate(cuda.plan(w, cost.GPUS["h200"], free), w, cost.GPUS["h200"])
    got = cost_model.estimate("token_logprobs", "cuda", 4096, 4096, 128256)
    assert got["model_ms"] == pytest.approx(want.model_ms) and got["hbm_bytes"] == pytest.approx(want.hbm_bytes)


def test_triton_plan_is_used_when_the_backend_has_one_and_missing_said_clearly():
    import fusedloss.triton.backend as triton_backend

    rc, out, err = cli("--op", "token_logprobs", "--backend", "triton", "--json")
    e = json.loads(out)
    if hasattr(triton_backend, "plan"):
        assert rc == 0 and all(k in e for k in FIELDS)
    else:
        assert rc == 2 and "has no plan(workload, gpu, free_bytes=None)" in e["error"]
        rc, out, err = cli("--op", "token_logprobs", "--backend", "triton")
        assert rc == 2 and "has no plan" in err


def test_before_and_after_table():
    """The CUDA backend at db85361 against now, at issue 11's H200 shape: ~3x the bound before for the eager
    losses, within 1.2x after."""
    before = cost_model.estimate("cross_entropy", "cuda", 16384, 4096, 151936, before=True)
    after = cost_model.estimate("cross_entropy", "cuda", 16384, 4096, 151936)
    assert before["ratio"] > 2.5 and after["ratio"] <= 1.2
    assert before["hbm_bytes"] > 5 * after["hbm_bytes"]  # the 56 chunks re-adding an fp32 [V, D]
    text = cost_model.table()
    assert text.count("| before (db85361) |") == 10 and text.count("| after |") == 10


def test_bad_backend_is_refused():
    rc, out, err = cli("--backend", "torch", "--json")
    assert rc == 2 and "cuda' or 'triton" in json.loads(out)["error"]
