"""examples/onpolicy_distillation.py: with and without fusedloss it prints the same losses, and one step's
losses and student gradients agree between its two paths."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _errors import plain_rel_err

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "onpolicy_distillation.py"


def load_example():
    spec = importlib.util.spec_from_file_location("fusedloss_example_onpolicy_distillation", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args):
    root = str(EXAMPLE.parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # "  step  0  reverse KL 0.723792  top-8 forward KL 0.287382"
    return [[float(line.split()[4]), float(line.split()[8])] for line in out.stdout.splitlines()
            if line.strip().startswith("step")]


def test_on_and_off_print_the_same_losses():
    on = run("--fusedloss", "on", "--steps", "2")
    off = run("--fusedloss", "off", "--steps", "2")
    assert len(on) == len(off) == 2
    for a, b in zip(on, off):
        assert a == pytest.approx(b, rel=1e-5)
        assert a[0] > 0.1 and a[1] > 0.01  # confident teachers: the losses are not rounding noise


def test_one_step_losses_and_gradients_agree():
    ex = load_example()
    student = ex.tiny(ex.LlamaConfig, 32, seed=0)
    teachers = [ex.tiny(ex.LlamaConfig, 48, seed=1, initializer_range=0.2),
                ex.tiny(ex.Gemma2Config, 40, seed=2, head_dim=8, final_logit_softcapping=3.0, initializer_range=0.2)]
    ids, labels = ex.rollout(student, torch.Generator().manual_seed(3))
    grads = []
    values = []
    for fn in (ex.losses_fused, ex.losses_logits):
        student.zero_grad()
        full, sparse = fn(student, teachers, ids, labels)
        (full + ex.SPARSE_WEIGHT * sparse).backward()
        values.append((full.item(), sparse.item()))
        grads.append(torch.cat([p.grad.flatten() for p in student.parameters()]))
    assert values[0] == pytest.approx(values[1], rel=1e-5)
    assert plain_rel_err(grads[0], grads[1]) < 1e-4
    assert grads[1].norm() > 0
