"""torch.compile: a loss step through the fusedloss custom ops compiles as one graph, matches eager, and
the number of tokens is a dynamic dimension (no recompile per sequence length).

What runs here (CPU): Dynamo with ``fullgraph=True`` (a graph break is an error), AOTAutograd (the
custom op's registered autograd and fake implementations) through the ``aot_eager`` backend, for the
torch backend and for the Triton backend under the interpreter (the op is opaque to the compiler, so
the interpreter inside it is no obstacle). Inductor is exercised once with the torch backend when a C++
compiler is present (it generates C++ for the surrounding elementwise math); it is skipped otherwise,
and it is slow, so the Triton variants stay on ``aot_eager``. Compiles are counted with a custom Dynamo
backend that wraps ``aot_eager``.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from _errors import rel_err
from conftest import make_head

import fusedloss


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def counting_backend(inner: str = "aot_eager"):
    compiles = []
    delegate = torch._dynamo.lookup_backend(inner)

    def backend(gm, example_inputs):
        compiles.append(gm)
        return delegate(gm, example_inputs)

    return backend, compiles


def inputs(n: int, seed: int = 0, dtype=torch.float32, device="cpu"):
    h, w, b, t = make_head(n, 19, 37, seed=seed, bias=True, ignore_fraction=0.3)
    return tuple(x.to(device, dtype).requires_grad_(True) for x in (h, w, b)) + (t.to(device),)


def step(backend):
    def loss_fn(h, w, b, t):
        logp, entropy = fusedloss.token_logprobs(h, w, t, bias=b, temperature=0.9, softcap=20.0,
                                                 return_entropy=True, backend=backend)
        valid = (t != -100).to(logp.dtype)
        return -(logp * valid).sum() / valid.sum().clamp(min=1) - 0.01 * (entropy * valid).sum()

    return loss_fn


def run(fn, args):
    h, w, b, t = args
    for x in (h, w, b):
        x.grad = None
    loss = fn(h, w, b, t)
    loss.backward()
    return loss.detach(), h.grad.clone(), w.grad.clone(), b.grad.clone()


def test_fullgraph_matches_eager(backend, device):
    compiler, compiles = counting_backend()
    compiled = torch.compile(step(backend), backend=compiler, fullgraph=True)
    args = inputs(7, device=device)
    eager = run(step(backend), args)
    got = run(compiled, args)
    assert len(compiles) == 1
    for a, e in zip(got, eager):
        assert rel_err(a, e) < 1e-6


def test_new_token_count_does_not_recompile(backend, device):
    """Marked dynamic: one compile for every N. Unmarked: Dynamo's automatic dynamic shapes recompile
    once, on the first new N, and never again."""
    compiler, compiles = counting_backend()
    compiled = torch.compile(step(backend), backend=compiler, fullgraph=True)
    for i, n in enumerate((7, 9, 13)):
        args = inputs(n, seed=i, device=device)
        for x in (args[0], args[3]):
            torch._dynamo.mark_dynamic(x, 0)
        got = run(compiled, args)
        eager = run(step(backend), args)
        for a, e in zip(got, eager):
            assert rel_err(a, e) < 1e-6
    assert len(compiles) == 1

    torch._dynamo.reset()
    compiler, compiles = counting_backend()
    compiled = torch.compile(step(backend), backend=compiler, fullgraph=True)
    for i, n in enumerate((7, 9, 13, 5)):
        run(compiled, inputs(n, seed=i, device=device))
    assert len(compiles) <= 2


def test_core_op_fullgraph(backend, device):
    """The statistics op itself (``fusedloss.core.token_statistics``, below the public API's backend
    resolution), with a teacher: forward and backward under fullgraph, dynamic N, against eager."""
    from fusedloss.core import LogitTransform, TeacherHead, token_statistics

    def loss_fn(h, w, b, t, th, tw):
        s = token_statistics(h, w, bias=b, targets=t, transform=LogitTransform(0.9, 1.1, 20.0),
                             teacher=TeacherHead(th, tw, None, 1.5), want_entropy=True, want_kl_rev=True,
                             jsd_beta=0.4, backend=backend)
        return s.logp.sum() + 0.1 * s.entropy.sum() + s.kl_rev.sum() + s.jsd.sum()

    compiler, compiles = counting_backend()
    compiled = torch.compile(loss_fn, backend=compiler, fullgraph=True)
    for i, n in enumerate((7, 10)):
        h, w, b, t = inputs(n, seed=i, device=device)
        t = torch.where(t < 0, torch.full_like(t, -1), t)
        th, tw, _, _ = make_head(n, 11, 37, seed=i + 5)
        th, tw = th.to(device, torch.float32), tw.to(device, torch.float32)
        torch._dynamo.mark_dynamic(h, 0)
        torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(th, 0)
        got = run(lambda h, w, b, t: compiled(h, w, b, t, th, tw), (h, w, b, t))
        eager = run(lambda h, w, b, t: loss_fn(h, w, b, t, th, tw), (h, w, b, t))
        for a, e in zip(got, eager):
            assert rel_err(a, e) < 1e-6
    assert len(compiles) == 1


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_inductor_torch_backend():
    compiled = torch.compile(step("torch"), fullgraph=True, dynamic=True)
    for i, n in enumerate((7, 11)):
        args = inputs(n, seed=i)
        got = run(compiled, args)
        eager = run(step("torch"), args)
        for a, e in zip(got, eager):
            assert rel_err(a, e) < 1e-5
