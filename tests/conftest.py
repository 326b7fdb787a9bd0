"""Shared fixtures and data for the fusedloss test suite.

* ``backend``: every backend that ``fusedloss.backend_status()`` reports "available" joins the
  parametrisation by itself. Without a CUDA device the Triton backend runs under the Triton
  interpreter (``TRITON_INTERPRET=1``, set below before anything imports triton).
* Data helpers build the inputs that catch the bugs peers shipped (docs/design.md, "Numerical doctrine"):
  peaked rows (a few logits ~30 above the rest), prime vocabulary sizes, token counts of 1 and odd, all-ignored rows,
  extreme logits. Shapes stay tiny because the Triton interpreter is slow.
* The relative errors every comparison uses (``rel_err`` and its named variants) are in tests/_errors.py,
  the float64 oracle in tests/oracle.py; import them from there.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/frameworks needs verl, OpenRLHF and Axolotl: it runs in .venv-frameworks (tools/frameworks_env.sh), which
# tests/tooling/test_env_frameworks.py calls; anywhere else it is not collected.
collect_ignore = [] if os.path.basename(sys.prefix) == ".venv-frameworks" else ["frameworks"]

from typing import Optional  # noqa: E402

import pytest  # noqa: E402
from _errors import rel_err  # noqa: E402,F401  (tests/frameworks/_main_suite.py reads it from this file)

# Prime vocabulary sizes: never a multiple of a block size, so padded tiles are always exercised.
PRIME_VOCABS = (37, 131, 257)
# Token counts: 1, odd, not a multiple of 16.
TOKEN_COUNTS = (1, 7, 13)
# Hidden sizes not a multiple of 16.
HIDDEN_SIZES = (19, 24)

FP64_TOL = {"torch": 1e-10}
FP64_TOL_DEFAULT = 1e-9
FP32_TOL = 1e-5


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "tooling: a check of the project's instruments (tests/tooling), run by CI")


# tests/tooling holds the project's instruments rather than the library: the wheels and the extension's device
# code, the benchmark and its device check, the cost model and its instruction counts, the compile harnesses, the
# CUTLASS prototype, the frameworks' virtualenv and the transformers architecture sweep; tests/contract holds what a
# user relies on. The README's test command runs tests/contract in minutes; CI runs both. Marked ``tooling`` by
# their folder, so that ``-m tooling`` / ``-m "not tooling"`` select the same tests as the folders.


def pytest_collection_modifyitems(config, items):
    tooling = pytest.mark.tooling
    for item in items:
        if item.path.parent.name == "tooling":
            item.add_marker(tooling)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _same_random_state():
    """Every test starts from the same global random state (torch, NumPy, random), whatever ran before it in its
    process: CI runs the suite on two processes (pytest-xdist), which share the modules out differently each run."""
    import random

    import numpy

    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Triton < 3.5 has no float64 tl.dot: the Triton backend refuses float64 there with a TypeError
    (tests/contract/test_api_versions.py checks it), and a float64 test of that backend is skipped, by that reason."""
    try:
        return (yield)
    except TypeError as e:
        if "float64 hidden needs triton>=" in str(e):
            pytest.skip(f"{str(e).split('; use')[0].removeprefix('triton backend: ')}")
        raise


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line per reason something was skipped, with how many tests and which modules, so that a run that
    silently lost a whole group (every TRL check, say, for want of an extra) says so at its end."""
    groups: dict = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        tests, modules = groups.setdefault(reason, [0, set()])
        module = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
        if isinstance(report, pytest.CollectReport):  # a whole module (pytest.importorskip at its top)
            modules.add(f"{module} (all)")
        else:
            groups[reason][0] = tests + 1
            modules.add(module)
    if not groups:
        return
    terminalreporter.section("skipped, by reason")
    for reason, (tests, modules) in sorted(groups.items(), key=lambda item: -len(item[1][1])):
        count = f"{tests} test{'s' * (tests != 1)}, " if tests else ""
        listed = ", ".join(sorted(modules)[:6]) + (f" and {len(modules) - 6} more" if len(modules) > 6 else "")
        terminalreporter.write_line(f"{reason}: {count}{len(modules)} module{'s' * (len(modules) != 1)} ({listed})")


def available_backends() -> list[str]:
    """Concrete backends that can run here, per ``fusedloss.backend_status()``.

    If the package or ``backend_status`` is missing, the tests still run with "torch" and fail loudly on
    the missing API, rather than silently collecting nothing."""
    try:
        import fusedloss

        status = fusedloss.backend_status()
    except Exception:  # pragma: no cover - only while the API is being written
        return ["torch"]
    return [name for name, state in status.items() if state == "available"]


BACKENDS = available_backends()


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", BACKENDS)


def device_for(backend: str) -> torch.device:
    """Where the inputs of ``backend`` live: the GPU backends take CUDA tensors when a GPU is present;
    under the Triton interpreter (no GPU) everything is on the CPU."""
    if backend in ("triton", "cuda") and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture
def device(backend) -> torch.device:
    return device_for(backend)


def fp64_tol(backend: str) -> float:
    return FP64_TOL.get(backend, FP64_TOL_DEFAULT)


# --------------------------------------------------------------------------------------------------
# Models


def param_grads(model: torch.nn.Module, loss: torch.Tensor) -> dict:
    """The gradients ``loss`` gives a model's parameters, by name (those that get one)."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------------------------------
# Data


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_head(n, d, v, *, seed=0, peaked=True, bias=False, extreme=False, leading=None,
              dtype=torch.float64, ignore_fraction=0.0, all_ignored_rows=(), ignore_index=-100, peak_ids=None):
    """A tiny LM head: hidden ``[*leading or n, d]``, weight ``[v, d]``, bias ``[v]`` or None, int64 targets.

    peaked: every other row puts one or two vocabulary entries ~30 above the rest (columns 0..2 of hidden
    select a peak; weight has +30 in those columns for a few vocabulary rows), and some targets sit on
    the peak (logp ~ 0) while others sit far below it (logp ~ -30).
    peak_ids: the three peaked vocabulary entries (default: drawn from the seed); a teacher given the
    student's peak_ids agrees with it where it is confident.
    extreme: the logits are scaled to magnitudes in the thousands (docs/design.md, "Numerical doctrine").
    Values are exactly representable in ``dtype`` (generated in float64 and rounded), returned in float64
    on the CPU; cast with ``.to(dtype)`` for the run under test."""
    g = generator(seed)
    shape = tuple(leading) if leading is not None else (n,)
    rows = 1
    for s in shape:
        rows *= s
    h = torch.randn(rows, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / d ** 0.5
    peaks = peak_ids_of(v, seed) if peak_ids is None else torch.as_tensor(peak_ids)
    if peaked and d >= 4:
        h[:, :3] = 0.0
        w[:, :3] = 0.0
        for j in range(3):
            w[peaks[j], j] = 30.0 - 3.0 * j  # a second and third peak below the first
        for i in range(rows):
            if i % 2 == 0:
                h[i, 0] = 1.0
                if i % 4 == 0:
                    h[i, 1] = 1.0
                if i % 3 == 0:
                    h[i, 2] = 1.0
    if extreme:
        w = w * 150.0
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    targets = torch.randint(0, v, (rows,), generator=g)
    if peaked:
        on_peak = torch.arange(rows) % 4 == 0
        targets = torch.where(on_peak, peaks[0].expand(rows), targets)
    if ignore_fraction > 0:
        ignored = torch.rand(rows, generator=g) < ignore_fraction
        ignored[0] = False if rows > 1 else ignored[0]
        targets = torch.where(ignored, torch.full_like(targets, ignore_index), targets)
    targets = targets.reshape(shape)
    for r in all_ignored_rows:  # whole sequences ignored ([B, T] leading shapes)
        targets[r] = ignore_index
    rnd = (lambda t: None if t is None else t.to(dtype).to(torch.float64))
    return rnd(h).reshape(*shape, d), rnd(w), rnd(b), targets


def peak_ids_of(v, seed):
    """The peaked vocabulary entries make_head(..., v, seed=seed) uses by default."""
    return torch.randperm(v, generator=generator(seed + 7919))[:3]


def make_teacher(n, d_t, v, *, seed=1, leading=None, bias=False, dtype=torch.float64, peak_ids=None):
    """A frozen teacher head with its own hidden size, peaked as well (on ``peak_ids`` when given:
    a teacher that agrees with the student where the student is confident)."""
    h, w, b, _ = make_head(n, d_t, v, seed=seed, leading=leading, bias=bias, dtype=dtype, peak_ids=peak_ids)
    return h, w, b


def leaf(t: Optional[torch.Tensor], dtype: torch.dtype, device, requires_grad: bool = True):
    """A fresh leaf of ``t`` in ``dtype`` on ``device`` (None stays None)."""
    if t is None:
        return None
    return t.detach().to(device=device, dtype=dtype).requires_grad_(requires_grad)


def cotangent_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    """A fixed random cotangent in float64 on the CPU, to weight a tensor output in a scalar objective."""
    return torch.randn(t.shape, generator=generator(seed), dtype=torch.float64)


# --------------------------------------------------------------------------------------------------
# Every backend's kernel math on this machine


def engine_params() -> list:
    """torch; triton (its interpreter without a GPU); cuda (its host twins on CPU tensors when the extension
    is built but no GPU is visible). Each is skipped, with the reason, where it cannot run."""
    import fusedloss

    status = fusedloss.backend_status()
    cuda_ok = status["cuda"] == "available" or status["cuda"].startswith("built")
    return [
        pytest.param("torch", id="torch"),
        pytest.param("triton", id="triton", marks=pytest.mark.skipif(
            status["triton"] != "available", reason=f"triton: {status['triton']}")),
        pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not cuda_ok, reason=f"cuda: {status['cuda']}")),
    ]


@pytest.fixture(params=engine_params())
def any_engine(request, monkeypatch):
    """(backend name, device) for each backend whose kernel math can run here. Without a GPU the CUDA backend
    runs its host twins on CPU tensors: the public API refuses backend='cuda' for CPU tensors, so its
    resolution is patched for the test."""
    from fusedloss.core import registry

    name = request.param
    if name != "torch" and torch.cuda.is_available():
        return name, torch.device("cuda")
    if name == "cuda":
        original = registry.resolve
        monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))
    return name, torch.device("cpu")
