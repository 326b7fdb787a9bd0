"""The benchmark's teacher top-k and multi-teacher ops (benchmarks/cases.py): every implementation the
benchmark times (the materialised pipelines and fusedloss) against the benchmark's float64 ground truth, on a
tiny shape, through the benchmark's own run harness; and the whole job on them, JSON record included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench, cases

ROOT = Path(__file__).resolve().parents[2]
N, V, D = 96, 211, 24


@pytest.mark.parametrize("op", cases.EXTRA_OPS)
@pytest.mark.parametrize("impl", ["reference", "fusedloss:torch"])
def test_each_implementation_against_the_float64_truth(op, impl):
    p = cases.make_problem(op, N, V, D, torch.float32, "cpu", seed=2)
    ref_out, ref_grads = cases.reference64(p)
    fn, why = bench.make_impl(impl, op, torch.device("cpu"))
    assert why is None
    run = bench._one_run(fn, p, torch.device("cpu"))
    for name, want in ref_out.items():
        assert cases.rel_err(run.outs[name], want) < 1e-5, (op, impl, name)
    if op == "topk_logprobs":
        assert ref_grads == {} and run.grads["hidden"] is None and run.outs["logprobs"].shape == (N, cases.TOPK_K)
    else:
        for name, want in ref_grads.items():
            assert cases.rel_err(run.grads[name], want) < 1e-5, (op, impl, name)


def test_the_multi_teacher_problem_has_three_teachers_of_their_own_widths():
    p = cases.make_problem("multi_teacher_distillation", N, V, D, torch.float32, "cpu")
    widths = [p.t[f"teacher{i}_hidden"].shape[1] for i in range(3)]
    assert widths == [D, D // 2, D + D // 2]
    assert [p.t[f"teacher{i}_hidden"].shape[0] for i in range(3)] == [int((p.t["teacher_index"] == i).sum())
                                                                      for i in range(3)]


def test_the_multi_teacher_ground_truth_counts_its_chunks_per_teacher(monkeypatch):
    # 7 rows per chunk: the teachers' 32 rows each end in a short chunk, 5 chunks per teacher
    monkeypatch.setattr(cases, "_chunk_rows", lambda v, device: 7)
    p = cases.make_problem("multi_teacher_distillation", N, V, D, torch.float32, "cpu")
    ticks = []
    cases.reference64(p, progress=lambda done, total: ticks.append((done, total)))
    assert ticks == [(k, 15) for k in range(1, 16)]


def test_the_job_runs_the_two_ops_when_named(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench.py", "--shapes", "tiny", "--N", "64", "--ops", "topk_logprobs",
         "multi_teacher_distillation", "--impls", "reference", "fusedloss:torch", "--out", str(tmp_path),
         "--tag", "t", "--threads", "1"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads((tmp_path / "t.json").read_text())
    seen = {(r["op"], r["impl"]): r for r in records if r.get("status") == "ok"}
    assert set(seen) == {(op, impl) for op in cases.EXTRA_OPS for impl in ("reference", "fusedloss:torch")}
    for r in seen.values():
        assert r["max_rel_err"] < 1e-5 and r["extra_peak_mib"] is not None
        assert r["env"]["threads"] == 1  # the workers' thread count, which --threads set
