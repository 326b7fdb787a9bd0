"""benchmarks/cost_model.py: the command line over benchmarks/model/cost.py and the backends' plans."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.model import cost
from benchmarks.model import cuda as cuda_model

ROOT = Path(__file__).resolve().parents[2]
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
    assert e["products"] == 3 and e["path"] == "grad_in_forward"
    # 3 GEMM-sized products of 2 N V D flops are the bulk of the flops; 6 N V D at 790 TFLOP/s is the bound
    assert 3 * 2 * 16384 * 4096 * 151936 <= e["flops"] < 1.01 * 3 * 2 * 16384 * 4096 * 151936
    assert e["bound_ms"] == pytest.approx(6 * 16384 * 4096 * 151936 / 790e12 * 1e3)
    assert e["ratio"] == pytest.approx(e["model_ms"] / e["bound_ms"]) and e["ratio"] <= 1.2
    assert e["plan"]["grad_in_forward_rows"] * e["plan"]["chunks"] >= 16384


def test_estimate_evaluates_the_backends_own_plan():
    """The model's figures are those of fusedloss.backends.cuda.backend.plan, not of a copy of it."""

    w = cost.Workload(op="token_logprobs", n=4096, d=4096, v=128256)
    free = cost.GPUS["h200"].memory_bytes // 2
    want = cost.evaluate(cuda_model.plan(w, cost.GPUS["h200"], free), w, cost.GPUS["h200"])
    got = cost_model.estimate("token_logprobs", "cuda", 4096, 4096, 128256)
    assert got["model_ms"] == pytest.approx(want.model_ms) and got["hbm_bytes"] == pytest.approx(want.hbm_bytes)


def test_triton_plan_is_used_when_the_backend_has_one_and_missing_said_clearly():
    import fusedloss.backends.triton.backend as triton_backend

    rc, out, err = cli("--op", "token_logprobs", "--backend", "triton", "--json")
    e = json.loads(out)
    if hasattr(triton_backend, "plan"):
        assert rc == 0 and all(k in e for k in FIELDS)
    else:
        assert rc == 2 and "has no plan(workload, gpu, free_bytes=None)" in e["error"]
        rc, out, err = cli("--op", "token_logprobs", "--backend", "triton")
        assert rc == 2 and "has no plan" in err


def test_table_of_the_plans():
    """The CUDA backend's plan at the H200 acceptance shape: within 1.2x of the bound for the grad-in-forward losses."""
    after = cost_model.estimate("cross_entropy", "cuda", 16384, 4096, 151936)
    assert after["ratio"] <= 1.2
    text = cost_model.table()
    header, *rows = [line for line in text.splitlines() if "| plan |" in line]
    assert header.startswith("| N, D, V | op | plan |")
    assert len(rows) == len(cost_model.TABLE_SHAPES) * len(cost_model.TABLE_OPS) == 10  # the chosen plan of each


def test_bad_backend_is_refused():
    rc, out, err = cli("--backend", "torch", "--json")
    assert rc == 2 and "cuda' or 'triton" in json.loads(out)["error"]


def test_json_carries_each_pass_time_its_limit_and_rates():
    e = cost_model.estimate("cross_entropy", "cuda", 16384, 4096, 151936)
    detail = e["pass_detail"]
    assert set(detail) == set(e["passes"])
    assert sum(d["ms"] for d in detail.values()) == pytest.approx(e["model_ms"], rel=1e-3)
    # the logits product: its C (fp32 logits) priced apart, at the main-loop rate of the measured product
    logits = detail["logits"]
    assert logits["bound_by"] == "math" and logits["rates"]["epilogue_bytes"] == 16384 * 151936 * 4
    assert logits["rates"]["tflops"] < 790 * cost.mainloop_factor(cost.GPUS["h200"], "bfloat16")
    # the fold: HBM-bound now, with the warp-instructions of its compiled loop beside its bytes
    fold = detail["fold"]
    assert fold["bound_by"] == "memory" and fold["rates"]["warp_instructions"] > 0


def test_a_pass_is_bounded_by_its_slowest_limit():
    gpu = cost.GPUS["h200"]
    issue_bound = cost.Pass("k", hbm_bytes=1e9, math="cuda_core", instructions=1e12)
    b = cost.pass_breakdown(issue_bound, gpu)
    assert b["bound_by"] == "issue" and b["ms"] == pytest.approx(1e12 / cost.issue_rate(gpu) * 1e3)
    product = cost.Pass("p", flops=1e15, hbm_bytes=2e9, epilogue_bytes=1e9)
    b = cost.pass_breakdown(product, gpu)
    main = 1e15 / (790e12 * cost.mainloop_factor(gpu, "bfloat16")) * 1e3
    assert b["bound_by"] == "math" and b["ms"] == pytest.approx(main + 1e9 / 4e12 * 1e3)


def test_fused_epilogue_what_if_drops_the_elementwise_passes():
    now = cost_model.estimate("token_logprobs_entropy", "cuda", 16384, 4096, 151936)
    fused = cost_model.estimate("token_logprobs_entropy", "cuda", 16384, 4096, 151936, what_if_fused=True)
    assert "fold" in now["passes"] and "fold" not in fused["passes"] and "dx" not in fused["passes"]
    assert fused["model_ms"] < now["model_ms"] and fused["ratio"] < 1.05
    with pytest.raises(cost_model.NoPlan):
        cost_model.estimate("cross_entropy", "triton", 4096, 4096, 32000, what_if_fused=True)
