"""pytest-benchmark suite on the CPU, tiny shapes: forward+backward of every op, the materialised
reference against the fusedloss torch backend (and "auto").

    pytest benchmarks/test_bench_cpu.py --benchmark-only
    pytest benchmarks/test_bench_cpu.py --benchmark-only --benchmark-compare   # against a saved run

Not part of the default test run (``testpaths = ["tests"]``). Each benchmark also checks once that the
implementation agrees with the reference, so a fast wrong answer cannot pass unnoticed.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytest_benchmark")

from benchmarks import cases  # noqa: E402

fusedloss = pytest.importorskip("fusedloss")
if not hasattr(fusedloss, "token_logprobs"):  # pragma: no cover - before the public API exists
    pytest.skip("fusedloss public API not available", allow_module_level=True)
from fusedloss import reference  # noqa: E402

N, V, D = 256, 1009, 64  # V prime: never a multiple of a tile
IMPLS = ("reference", "torch", "auto")


def _impl(name, op):
    if name == "reference":
        return lambda p, h, w: cases.call_op(getattr(reference, op), p, h, w)
    return lambda p, h, w: cases.call_op(getattr(fusedloss, op), p, h, w, backend=name)


@pytest.fixture(scope="module", params=cases.OPS)
def problem(request):
    return cases.make_problem(request.param, N, V, D, torch.float32, "cpu", seed=1)


@pytest.mark.parametrize("impl", IMPLS)
def test_fwd_bwd(benchmark, problem, impl):
    fn = _impl(impl, problem.op)
    benchmark.group = f"{problem.op} N={problem.N} V={V} D={D} fp32"
    benchmark.extra_info.update(op=problem.op, impl=impl, N=problem.N, V=V, D=D)

    def step():
        h, w = problem.leaves()
        loss, _ = fn(problem, h, w)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    loss, gh, gw = benchmark(step)
    h, w = problem.leaves()
    ref_loss, _ = _impl("reference", problem.op)(problem, h, w)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-6)
