"""The cost model beside the benchmark's measurements (benchmarks/bench.py ``modelled``, benchmarks/cost_model.py
``phases`` / ``split_ms`` / ``bound``), and the bookkeeping that lets a time-boxed device run be finished by a
second call (``--skip-done``, ``--merge`` keeping one record per case). No timing is asserted: the figures
checked are the model's, computed from the backends' own plan functions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import bench, cost_model  # noqa: E402
from benchmarks.model import cost  # noqa: E402

H200 = cost.GPUS["h200"]
SHAPE = (16384, 4096, 151936)


def _paths(op):
    return (None, "composable", "grad_in_forward") if cost.OPS[op]["row_local"] else (None, "composable")


@pytest.mark.parametrize("plan_backend", ("cuda", "triton"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float16", "float32"))
def test_forward_and_backward_partition_the_plan(plan_backend, dtype):
    """Every pass of every plan is in exactly one phase, in the order the plan runs them, and the two
    phases add up to the whole: the composable path's backward holds the recompute and both gradient
    products; the grad-in-forward path's forward holds all three products and its backward only rounds, unless d weight
    is deferred to the backward (then it holds that product too)."""
    for op in cost.OPS:
        for n in (1, 4096, 16384):
            for path in _paths(op):
                e = cost_model.estimate(op, plan_backend, n, 4096, 151936, dtype=dtype, path=path)
                assert e["model_fwd_ms"] + e["model_bwd_ms"] == pytest.approx(e["model_ms"], rel=1e-12)
                assert e["model_fwd_ms"] > 0 and e["model_bwd_ms"] >= 0
                w = cost.Workload(op=op, n=n, d=4096, v=151936, dtype=dtype)
                plan = cost_model.backend_plan_function(plan_backend)(w, H200, H200.memory_bytes // 2,
                                                                  **({"path": path} if path else {}))
                kinds = cost_model.phases(plan)
                assert len(kinds) == len(plan.passes)
                fwd = [p.name for p, k in zip(plan.passes, kinds) if k == "forward"]
                bwd = [p.name for p, k in zip(plan.passes, kinds) if k == "backward"]
                assert fwd[0].startswith(("logits", "forward", "grad-in-forward logits"))
                if plan.path == "composable":
                    assert kinds == sorted(kinds, key=("forward", "backward").index)  # one boundary
                    assert bwd[0].startswith(("recompute", "backward"))
                    assert any(n.startswith("d hidden") for n in bwd) and any(n.startswith("d weight") for n in bwd)
                    assert not any(n.startswith(("d hidden", "d weight", "recompute")) for n in fwd)
                else:
                    # d weight in the forward, or deferred to the backward (bf16 CUDA where the kept dx is no
                    # larger than d weight): then the backward's product is that one alone, hidden scaled first.
                    deferred = [n for n in bwd if n.startswith("d weight")]
                    assert any(n.startswith("d hidden") for n in fwd)
                    assert any(n.startswith("d weight") for n in fwd) != bool(deferred)
                    assert all("round" in n or n.endswith("in the backward") for n in bwd)
                    assert len(deferred) <= 1
                    if deferred:
                        assert plan_backend == "cuda" and dtype == "bfloat16"
                        assert any(n.startswith("scale hidden") for n in bwd)


def test_composable_backward_costs_more_than_its_forward_at_the_h200_shape():
    """The statistics forward is one product; the backward three (recompute, d hidden, d weight)."""
    for name in ("cuda", "triton"):
        e = cost_model.estimate("token_logprobs_entropy", name, *SHAPE)
        assert e["path"] == "composable"
        assert 2.0 < e["model_bwd_ms"] / e["model_fwd_ms"] < 4.0


def test_bound_alone_is_the_product_count_at_the_dense_peak():
    n, d, v = SHAPE
    product_ms = 2.0 * n * v * d / 790e12 * 1e3
    assert cost_model.bound("cross_entropy", n, d, v)["bound_ms"] == pytest.approx(3 * product_ms)
    assert cost_model.bound("dpo", n, d, v)["bound_ms"] == pytest.approx(4 * product_ms)
    b = cost_model.bound("distill_reverse_kl", n, d, v)
    assert (b["bound_products"], b["bound_teacher_products"]) == (3.0, 1.0)
    assert b["bound_ms"] == pytest.approx(4 * product_ms)


@pytest.mark.parametrize("op", sorted(bench.MODEL_OP))
def test_modelled_fields_of_each_implementation(op):
    """fusedloss:cuda / fusedloss:triton carry their own plan's figures (what estimate() returns for the
    same free memory); the reference, the peers and the torch backend carry the bound only, saying why."""
    n, d, v = SHAPE
    mop = bench.MODEL_OP[op]
    teacher_d = d if op == "distillation_loss" else None
    free = 100 * 10**9
    for name in ("cuda", "triton"):
        m = bench.modelled(op, f"fusedloss:{name}", n, d, v, "bfloat16", "h200", "cuda", free)
        e = cost_model.estimate(mop, name, n, d, v, teacher_d=teacher_d, free_bytes=free)
        assert m["modelled_ms"] == pytest.approx(e["model_ms"], rel=1e-3)
        assert m["modelled_fwd_ms"] == pytest.approx(e["model_fwd_ms"], rel=1e-3)
        assert m["modelled_bwd_ms"] == pytest.approx(e["model_bwd_ms"], rel=1e-3)
        assert m["modelled_bound_ms"] == pytest.approx(e["bound_ms"], rel=1e-3)
        assert m["modelled_over_bound"] == pytest.approx(e["model_ms"] / e["bound_ms"], rel=1e-3)
        details = m["modelled_details"]
        assert details["source"] == f"{name}.plan" and details["path"] == e["path"]
        assert details["plan"] == json.loads(json.dumps(e["plan"])) and details["free_bytes"] == free
        assert all(k.startswith("modelled_") for k in m)  # every figure of the model says so in its name
        json.dumps(m)  # stored as JSON
    for impl in ("reference", "reference+compile", "fusedloss:torch", "trl", "liger", "cce", "torch-lce"):
        m = bench.modelled(op, impl, n, d, v, "bfloat16", "h200", "cuda", free)
        assert m["modelled_ms"] is None and m["modelled_over_bound"] is None
        assert m["modelled_details"]["source"] == "bound only"
        assert m["modelled_bound_ms"] == pytest.approx(
            cost_model.bound(mop, n, d, v, teacher_d=teacher_d)["bound_ms"], rel=1e-3)
        assert impl.split(":")[-1] in m["modelled_details"]["why"]


def test_auto_is_modelled_as_the_backend_it_resolves_to():
    m = bench.modelled("cross_entropy", "fusedloss:auto", 4096, 4096, 151936, "bfloat16", "h200", "cpu")
    assert m["modelled_details"]["auto_resolves_to"] == "torch" and m["modelled_details"]["source"] == "bound only"


def test_gpu_names_map_to_the_model():
    assert bench.gpu_model_key("NVIDIA H200") == "h200"
    assert bench.gpu_model_key("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.gpu_model_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert bench.gpu_model_key("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert bench.gpu_model_key("Tesla V100-SXM2-32GB") is None


def _rec(op, impl, n, status, **kw):
    return {"op": op, "impl": impl, "N": n, "N_requested": n, "V": 7, "D": 3, "dtype": "float32",
            "device": "cpu", "status": status, **kw}


def test_merge_keeps_one_record_per_case_preferring_a_measurement():
    first = [_rec("cross_entropy", "reference", 64, "ok", fwd_bwd_ms=1.0),
             _rec("cross_entropy", "trl", 64, "skipped"), _rec("dpo_loss", "trl", 64, "failed")]
    rerun = [_rec("cross_entropy", "trl", 64, "ok", fwd_bwd_ms=2.0), _rec("cross_entropy", "reference", 64, "skipped"),
             _rec("dpo_loss", "trl", 64, "skipped")]
    merged = bench.dedupe(first + rerun)
    got = {(r["op"], r["impl"]): r["status"] for r in merged}
    assert got == {("cross_entropy", "reference"): "ok", ("cross_entropy", "trl"): "ok", ("dpo_loss", "trl"): "skipped"}
    assert len(merged) == 3
    assert bench.done_cases(merged, 7, 3, "float32", "cpu") == {("cross_entropy", "reference", 64),
                                                                 ("cross_entropy", "trl", 64)}
    assert bench.done_cases(merged, 7, 3, "bfloat16", "cpu") == set()  # another dtype is another case


def test_a_rerun_measures_only_what_the_first_run_left(tmp_path):
    """Two runs of the main job on a tiny shape: the second, given the first's file with --skip-done, runs only
    the new case; --merge then holds both, each with forward, backward and the bound beside (--model-gpu)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    common = [sys.executable, "benchmarks/bench.py", "--shapes", "tiny", "--N", "64", "--ops", "cross_entropy",
              "--repeat", "1", "--model-gpu", "h200", "--out", str(tmp_path)]
    first = subprocess.run(common + ["--impls", "reference", "--tag", "a"], cwd=ROOT, capture_output=True,
                           text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    second = subprocess.run(common + ["--impls", "reference", "fusedloss:torch", "--tag", "b", "--skip-done",
                                      str(tmp_path / "a.json")], cwd=ROOT, capture_output=True, text=True, env=env,
                            timeout=600)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "--skip-done: 1 case(s) already measured ok" in second.stdout
    b = json.loads((tmp_path / "b.json").read_text())
    assert [r["impl"] for r in b if r["status"] == "ok"] == ["fusedloss:torch"]
    merge = subprocess.run([sys.executable, "benchmarks/bench.py", "--merge", str(tmp_path / "a.json"),
                            str(tmp_path / "b.json"), "--out", str(tmp_path), "--tag", "m"], cwd=ROOT,
                           capture_output=True, text=True, env=env, timeout=600)
    assert merge.returncode == 0, merge.stdout[-2000:] + merge.stderr[-2000:]
    assert "| modelled ms" in merge.stdout and "modelled bound ms" in merge.stdout and "fwd ms" in merge.stdout
    ok = [r for r in json.loads((tmp_path / "m.json").read_text()) if r["status"] == "ok"]
    assert sorted(r["impl"] for r in ok) == ["fusedloss:torch", "reference"]
    for r in ok:
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and math.isfinite(r["fwd_bwd_ms"])
        assert r["modelled_details"]["gpu"] == "H200" and r["modelled_details"]["source"] == "bound only"
        assert r["modelled_bound_ms"] == pytest.approx(cost_model.bound("cross_entropy", r["N"], r["D"], r["V"],
                                                                        dtype="float32")["bound_ms"], rel=1e-3)
        assert r["measured_over_bound"] is None  # a CPU measurement is never divided by an H200 figure
        assert r["product_ms"] > 0 and r["measured_floor_ms"] == pytest.approx(3 * r["product_ms"], rel=1e-3)


def test_profile_records_are_a_case_of_their_own():
    """A --profile record of the same op, implementation and shape neither replaces the timed one nor counts
    as measuring it, and the table leaves it out."""
    timed = _rec("cross_entropy", "fusedloss:cuda", 64, "ok", fwd_bwd_ms=3.0, fwd_bwd_ms_min=3.0, spread=None)
    prof = dict(timed, mode="profile", profile={"families": {"cuBLAS products": {"count": 3, "total_us": 2500.0}}})
    merged = bench.dedupe([timed, prof])
    assert len(merged) == 2
    assert bench.done_cases([prof], 7, 3, "float32", "cpu") == set()
    assert bench.done_cases([prof], 7, 3, "float32", "cpu", mode="profile") == {("cross_entropy", "fusedloss:cuda", 64)}
    table = bench.table(merged)
    assert table.count("fusedloss:cuda") == 1
    assert "cuBLAS products 2.50 (3)" in bench.profile_table(merged)


def test_interpreter_times_are_labelled_not_tabled():
    ref = _rec("cross_entropy", "reference", 64, "ok", fwd_bwd_ms=2.0, fwd_bwd_ms_min=2.0, spread=None,
               fwd_ms=1.0, bwd_ms=1.0, extra_peak_mib=1.0, max_rel_err=1e-7)
    tri = dict(ref, impl="fusedloss:triton", fwd_bwd_ms=900.0, timing="triton interpreter on a CPU")
    row = next(ln for ln in bench.table([ref, tri]).splitlines() if "fusedloss:triton" in ln)
    assert "interp." in row and "900" not in row and "not timed" in row


def test_groups_run_whole_ops_in_the_order_of_n_given():
    """The device run's order: N=16384 first (the acceptance shape), each op in one worker with every
    implementation, the reference first and the peers after fusedloss's backends; the compiled reference
    last, once everything else is measured."""
    runnable = [("reference", list(bench.OP_ORDER)), ("fusedloss:cuda", list(bench.OP_ORDER)),
                ("trl", ["token_logprobs", "grpo_loss"]), ("liger", ["cross_entropy"]),
                ("reference+compile", list(bench.OP_ORDER))]
    groups = bench.plan_groups(["token_logprobs", "cross_entropy"], runnable, [16384, 4096], "op", gpu=True)
    assert [(g["N"], g["tasks"]) for g in groups] == [
        (16384, [("token_logprobs", "reference"), ("token_logprobs", "fusedloss:cuda"), ("token_logprobs", "trl")]),
        (16384, [("cross_entropy", "reference"), ("cross_entropy", "fusedloss:cuda"), ("cross_entropy", "liger")]),
        (4096, [("token_logprobs", "reference"), ("token_logprobs", "fusedloss:cuda"), ("token_logprobs", "trl")]),
        (4096, [("cross_entropy", "reference"), ("cross_entropy", "fusedloss:cuda"), ("cross_entropy", "liger")]),
        (16384, [("token_logprobs", "reference+compile")]), (16384, [("cross_entropy", "reference+compile")]),
        (4096, [("token_logprobs", "reference+compile")]), (4096, [("cross_entropy", "reference+compile")])]
