"""The benchmark's worker in this process on a tiny CPU shape: the timed calls of an op's implementations
alternate in rounds after every first call; the profile mode stores what ran with its count and time; the
product rates are measured or said unsupported, never faked. No timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import bench  # noqa: E402


def _spec(tasks, **kw):
    spec = {"N": 32, "V": 257, "D": 16, "dtype": "float32", "device": "cpu", "tasks": tasks, "warmup": 1,
            "repeat": 3, "impl_budget_s": 60, "seed": 0, "no_error": False, "deadline": None, "threads": 1,
            "compile_mode": "default", "min_repeat": 1, "model_gpu": None, "count_slow_first": False,
            "profile": False, "gemm_warmup_s": 0.0}
    spec.update(kw)
    return spec


def _run(spec):
    events = []
    bench.run_group(spec, events.append)
    return events


def test_timed_calls_alternate_between_implementations_in_rounds():
    tasks = [["cross_entropy", "reference"], ["cross_entropy", "fusedloss:torch"]]
    events = _run(_spec(tasks))
    kinds = [(e["kind"], e.get("impl")) for e in events if e["kind"] in ("start", "inflight", "result")]
    assert kinds == [("start", "reference"), ("start", "fusedloss:torch")] \
        + [("inflight", "reference"), ("inflight", "fusedloss:torch")] * 3 \
        + [("result", "reference"), ("result", "fusedloss:torch")]
    results = [e for e in events if e["kind"] == "result"]
    for r in results:
        assert r["status"] == "ok" and r["repeats"] == 3 and r["max_rel_err"] < 1e-5
        assert r["fwd_bwd_ms_min"] <= r["fwd_bwd_ms"] <= r["fwd_bwd_ms_max"]
        assert "sm_clock_mhz" not in r  # a CPU has no SM clock to record
    # what the worker says while it builds the float64 reference comes before any measurement
    first_status = next(i for i, e in enumerate(events) if e["kind"] == "status")
    assert first_status < next(i for i, e in enumerate(events) if e["kind"] == "start")


def test_profile_mode_stores_what_ran_with_its_count_and_time():
    events = _run(_spec([["token_logprobs", "fusedloss:torch"]], profile=True, repeat=1, no_error=True))
    (rec,) = [e for e in events if e["kind"] == "result"]
    assert rec["status"] == "ok" and rec["mode"] == "profile" and rec["max_rel_err"] is None
    prof = rec["profile"]
    assert prof["what"] == "CPU ops, self time" and prof["kernels"]
    assert all(k["count"] >= 1 and k["total_us"] > 0 for k in prof["kernels"])
    assert any("mm" in k["name"] for k in prof["kernels"])  # the products ran and were seen
    assert sum(f["total_us"] for f in prof["families"].values()) == pytest.approx(prof["total_us"], rel=1e-3, abs=1.0)


def test_kernel_families():
    assert bench.kernel_family("void fold_kernel<float, false, false>(...)") == "fusedloss cuda fold"
    assert bench.kernel_family("statistics_forward_kernel") == "fusedloss triton forward"
    assert bench.kernel_family("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNT") == "cuBLAS products"
    assert bench.kernel_family("void at::native::vectorized_elementwise_kernel<4, ...>") \
        == "torch elementwise and reductions"


def test_product_rates_are_measured_or_said_unsupported():
    rates = bench.product_rates(torch.device("cpu"), repeat=1)
    assert [r["name"] for r in rates] == ["bf16_output", "fp32_output", "fp32_accumulate_short_k"]
    assert rates[0]["status"] == "ok" and rates[0]["tflops"] > 0 and rates[0]["flops"] == 2.0 * 64 * 1009 * 64
    for r in rates[1:]:  # fp32 output of bf16 operands: torch's out_dtype products, where this torch has them
        assert r["status"] in ("ok", "unsupported"), r
        assert (r["status"] == "ok") == ("tflops" in r)
    assert rates[2]["beta"] == 1 and rates[2]["output"] == "float32"
