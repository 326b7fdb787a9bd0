"""The supported version range at run time: what an older torch or Triton than the newest needs.

torch 2.8-2.12: ``torch.compiler.is_compiling()`` is False while AOTAutograd traces the custom op's registered
backward, so the statistics' gradient coefficients ask the fake mode as well (an ``out=`` buffer there would
fix the token count of the graph; tests/contract/test_api_torch_compile.py counts the compiles). Triton: older than the
supported range it is reported unavailable, with why; float64 needs Triton 3.5's float64 ``tl.dot``; the
interpreter's index patch takes both signatures Triton has had (3.4-3.5: ``(tensor)``, 3.6+: ``(tensor,
scope)``). The CI's compatibility jobs run the oldest supported torch and Triton (tools/compat_job.sh).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fusedloss
from fusedloss.core import registry, statistics


def test_fake_tensor_trace_counts_as_compiling():
    assert not statistics._traced([torch.zeros(3)])
    with FakeTensorMode():
        fake = torch.zeros(3)
        assert statistics._traced([fake])
        assert statistics._traced([])  # the active mode alone


@pytest.fixture
def triton_version(monkeypatch):
    triton = pytest.importorskip("triton")

    def set_version(version: str):
        monkeypatch.setattr(triton, "__version__", version)

    return set_version


def test_old_triton_is_unavailable_with_the_reason(triton_version):
    from fusedloss.backends.triton import backend

    triton_version("3.1.0")
    state = fusedloss.backend_status()["triton"]
    assert state == "triton 3.1.0 is too old: fusedloss's Triton kernels need triton>=3.4,<3.10"
    assert backend.availability() == state
    with pytest.raises(ValueError, match="triton 3.1.0 is too old"):
        registry.resolve("triton", torch.device("cpu"))
    assert registry.resolve("auto", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("version", ["3.4.0", "3.6.0", "3.9.0+git1234", "3.10.0"])
def test_supported_triton_versions_are_not_refused_for_their_age(triton_version, version):
    from fusedloss.backends.triton import backend

    triton_version(version)
    assert backend._unsupported_triton() is None


def test_double_precision_needs_triton_3_5(triton_version, monkeypatch):
    from fusedloss.backends.triton import backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if backend.availability() != "available":
        pytest.skip(backend.availability())
    h = torch.randn(4, 8, dtype=torch.float64)
    w = torch.randn(13, 8, dtype=torch.float64)
    t = torch.tensor([1, 2, 3, 4])
    real = backend._triton_version()[1]
    triton_version("3.4.0")
    with pytest.raises(TypeError, match=r"float64 hidden needs triton>=3.5 \(its float64 tl.dot\), installed 3.4.0"):
        fusedloss.cross_entropy(h, w, t, backend="triton")
    if real < backend.TRITON_FLOAT64:
        return  # the refusal is all this Triton can show
    triton_version("3.5.0")
    got = fusedloss.cross_entropy(h, w, t, backend="triton")
    want = torch.nn.functional.cross_entropy(h @ w.T, t)
    assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())


@pytest.mark.parametrize("version, float64", [("3.4.0", "torch"), ("3.5.0", "triton"), ("3.9.0", "triton")])
def test_auto_passes_over_a_triton_that_refuses_float64(triton_version, monkeypatch, version, float64):
    """On a CUDA device without the CUDA backend, ``auto`` takes Triton, but not for float64 before Triton 3.5
    (no float64 tl.dot): the torch backend computes it instead of the call raising."""
    pytest.importorskip("triton")
    states = {"cuda": "not built: FUSEDLOSS_CUDA=0", "triton": "available", "torch": "available"}
    monkeypatch.setattr(registry, "availability", states.__getitem__)
    monkeypatch.setattr(registry, "_warn_cuda_skipped", lambda chosen: None)  # the process's one warning stays
    triton_version(version)
    cuda = torch.device("cuda")
    assert registry.resolve("auto", cuda, torch.float64) == float64
    for dtype in (torch.float32, torch.bfloat16, torch.float16, None):
        assert registry.resolve("auto", cuda, dtype) == "triton"
    assert registry.resolve("auto", torch.device("cpu"), torch.float64) == "torch"
    refusal = registry.get("triton").dtype_refusal(torch.float64)
    if float64 == "torch":
        assert refusal == (f"triton backend: float64 hidden needs triton>=3.5 (its float64 tl.dot), installed "
                           f"{version}; use backend='torch' for float64")
    else:
        assert refusal is None


class _Tensor:
    pass


class _Handle:
    def __init__(self, data):
        self.data = data


@pytest.mark.parametrize("with_scope", [False, True], ids=["triton<3.6", "triton>=3.6"])
def test_interpreter_index_patch_takes_both_signatures(monkeypatch, with_scope):
    np = pytest.importorskip("numpy")
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    from fusedloss.backends.triton import backend

    seen = []

    class Scope:
        def set_attr(self, obj, name, value):
            seen.append(name)
            setattr(obj, name, value)

    def original_new(tensor, scope):
        seen.append("original")

    def original_old(tensor):
        seen.append("original")

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", original_new if with_scope else original_old)
    backend._interpreter_numpy_compat()
    cls = type("T", (_Tensor,), {})
    interpreter._patch_lang_tensor(cls, *((Scope(),) if with_scope else ()))
    assert seen == (["original", "__index__"] if with_scope else ["original"])
    item = cls()
    item.handle = _Handle(np.array([7]))  # a 1-element array: int(array) is an error from NumPy 2.4 on
    assert [0, 1, 2, 3, 4, 5, 6, 7, 8][item] == 7
