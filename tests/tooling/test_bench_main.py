"""The main job's contract on a tiny shape: progress while it runs, one line for what cannot run here, a
table with median / min / spread, and always a JSON file and a PNG (or, without matplotlib, a sentence
saying how to get one). Speed is measured by the benchmark itself, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs it
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench.py", "--shapes", "tiny", "--N", "64", "--ops", "cross_entropy",
         "token_logprobs", "--impls", "reference", "fusedloss:torch", "fusedloss:cuda", "torch-lce", "liger",
         "--out", str(out), "--tag", "t"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, out


def test_progress_and_one_line_for_what_cannot_run(run):
    stdout, _ = run
    progress = [ln for ln in stdout.splitlines() if "| measuring " in ln]
    assert len(progress) == 5  # reference and torch for two ops, torch-lce for cross_entropy
    # an op's implementations all start (first calls), then their timed calls alternate: the second op's
    # first start comes after the three cross_entropy records
    assert "0/5" in progress[2] and "3/5" in progress[3] and "s left" in progress[-1]
    assert stdout.index("building the inputs and the float64 reference") < stdout.index("| measuring ")
    unavailable = [ln for ln in stdout.splitlines() if ln.startswith("not run here:")]
    assert unavailable and "fusedloss:cuda" in unavailable[0] and "liger (GPU only" in unavailable[0]
    assert "UNAVAILABLE" not in stdout


def test_table_json_and_png(run):
    stdout, out = run
    assert "median ms" in stdout and "min ms" in stdout and "spread" in stdout and "time/ref" in stdout
    records = json.loads((out / "t.json").read_text())
    ok = [r for r in records if r["status"] == "ok"]
    assert {(r["op"], r["impl"]) for r in ok} == {
        ("cross_entropy", "reference"), ("cross_entropy", "fusedloss:torch"), ("cross_entropy", "torch-lce"),
        ("token_logprobs", "reference"), ("token_logprobs", "fusedloss:torch")}
    for r in ok:
        assert r["fwd_bwd_ms_min"] <= r["fwd_bwd_ms"] <= r["fwd_bwd_ms_max"]
        assert r["max_rel_err"] < 1e-4  # fp32 against the float64 reference
    assert {r["impl"] for r in records if r["status"] == "unavailable"} == {"fusedloss:cuda", "liger"}
    png = (out / "t.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_it_says_how_to_get_the_plot(run, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import bench

    _, out = run
    records = json.loads((out / "t.json").read_text())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    why = bench.plot(records, tmp_path / "x.png", "title")
    assert "pip install 'fusedloss[bench]'" in why and "--merge" in why
    assert not (tmp_path / "x.png").exists()
