"""The CUDA backend's first contact with a GPU, checked on the CPU: what it probes, what it refuses, what it
restores, and the numerics a GPU would otherwise be the first to show.

* the out_dtype / GEMM-accumulation probe: falls back with one warning, never swallows out-of-memory;
* availability(): the extension built and no usable device, a driver older than the built runtime;
* the device guard of every launch (the C++ template, through the extension);
* TileArgs validated at the C++ boundary (ValueError with a sentence);
* fp16 gradients that survive a GradScaler-sized loss scale on the grad-in-forward path (host twins vs float64);
* fp32 products whatever torch's TF32 flags say (the flag handling, in a subprocess).
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _errors import plain_rel_err

import fusedloss
from fusedloss import reference
from fusedloss.backends import gpu
from fusedloss.backends.cuda import backend as cuda
from fusedloss.backends.cuda import extension
from fusedloss.core import registry

built = pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: {cuda.availability()}")
F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# The capability probe
# ------------------------------------------------------------------------------------------------
def test_probe_falls_back_once_with_a_warning(monkeypatch):
    """On a device whose torch cannot multiply half operands into fp32 (here: the CPU, where torch.mm has no
    out_dtype kernel) the probe says so and warns once; the products then take fp32 operands."""
    monkeypatch.setattr(gpu, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="out_dtype=torch.float32"):
        caps = gpu._probe(torch.device("cpu"))
    assert caps == gpu.Capabilities(out_dtype=False, accumulate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gpu._probe(torch.device("cpu")) == caps  # no second warning


def test_probe_never_swallows_out_of_memory(monkeypatch):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "mm", oom)
    with pytest.raises(torch.OutOfMemoryError):
        gpu._probe(torch.device("cpu"))


def test_products_with_the_fallback_are_exact_fp32_products():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g).bfloat16(), torch.randn(7, 3, generator=g).bfloat16()
    products = gpu.Products(torch.device("cpu"))
    products.host, products.caps = False, gpu.Capabilities(out_dtype=False, accumulate=False)
    out = torch.empty(5, 3)
    products.into(out, a, b)
    assert torch.equal(out, a.float() @ b.float())
    products.accumulate(out, a, b)
    assert torch.allclose(out, 2 * (a.float() @ b.float()), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# availability()
# ------------------------------------------------------------------------------------------------
@built
def test_availability_with_the_extension_and_no_device(monkeypatch):
    """This machine: the extension is built, no driver and no GPU. "auto" must not pick cuda."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert cuda.availability() == "built; no CUDA device visible"
    assert fusedloss.backend_status()["cuda"] == "built; no CUDA device visible"
    monkeypatch.setattr(registry, "_CUDA_SKIP_WARNED", [])
    with pytest.warns(UserWarning, match="because the CUDA backend cannot run: built; no CUDA device visible"):
        assert registry.resolve("auto", torch.device("cuda")) != "cuda"
    info = cuda.runtime_info()
    assert info["devices"] == 0 and info["driver"] is None and info["runtime"].count(".") == 1


def _fake_extension(devices, runtime, driver, error=""):
    real = cuda._C
    return SimpleNamespace(device_count=lambda: devices, runtime_version=lambda: runtime,
                           driver_version=lambda: driver, device_error=lambda: error,
                           **{k: getattr(real, k) for k in ("TileArgs", "Transform", "JsdConsts", "STATE_FIELDS")})


@built
def test_availability_names_a_driver_older_than_the_runtime(monkeypatch):
    monkeypatch.setattr(cuda, "_C", _fake_extension(0, 13000, 12040, "CUDA driver version is insufficient"))
    msg = cuda.availability()
    assert msg.startswith("built with the CUDA 13.0 runtime, which needs an NVIDIA driver >= 580.65.06; this driver "
                          "supports CUDA 12.4 (R550); fix: install a fusedloss wheel built with CUDA 12")
    assert "rebuild against a CUDA 12.x toolkit: CUDA_HOME=" in msg and "upgrade the driver to >= 580.65.06" in msg
    assert cuda.runtime_info() == {"runtime": "13.0", "driver": "12.4", "needs_driver": "580.65.06", "devices": 0}
    # a driver too old for any CUDA 12 build: only a newer driver helps
    monkeypatch.setattr(cuda, "_C", _fake_extension(0, 13000, 11080, "CUDA driver version is insufficient"))
    assert cuda.availability().endswith("supports CUDA 11.8 (R520); fix: upgrade the driver to >= 525.60.13 and "
                                        "use a CUDA 12 build, or to >= 580.65.06")
    monkeypatch.setattr(cuda, "_C", _fake_extension(0, 12040, 11080, "CUDA driver version is insufficient"))
    assert cuda.availability() == ("built with the CUDA 12.4 runtime, which needs an NVIDIA driver >= 525.60.13; "
                                   "this driver supports CUDA 11.8 (R520); fix: upgrade the driver to >= 525.60.13")


@built
def test_availability_when_the_runtimes_disagree(monkeypatch):
    monkeypatch.setattr(cuda, "_C", _fake_extension(0, 12040, 12080, "all CUDA-capable devices are busy"))
    assert cuda.availability() == ("built; the extension's CUDA 12.4 runtime sees no device "
                                   "(all CUDA-capable devices are busy)")
    monkeypatch.setattr(cuda, "_C", _fake_extension(1, 12040, 12080))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda.availability().startswith("built; torch ") and "sees no CUDA device" in cuda.availability()


@built
def test_stale_extension_is_refused(monkeypatch):
    import fusedloss._C as real

    monkeypatch.setattr(real, "OUTPUT_NAMES", list(real.OUTPUT_NAMES)[:-1])
    ext, why = extension._load_extension()
    assert ext is None and "stale" in str(why) and "OUTPUT_NAMES" in str(why)


# ------------------------------------------------------------------------------------------------
# The device guard and the argument checks of the extension
# ------------------------------------------------------------------------------------------------
@built
@pytest.mark.parametrize("throw", [False, True])
def test_device_guard_restores_the_callers_device(throw):
    from fusedloss import _C

    # [device inside, device after, devices set]: switch to 1, then back to 0, also when the launch throws
    assert _C._device_guard_trace(0, 1, throw) == [1, 0, 1, 0]
    assert _C._device_guard_trace(2, 2, throw) == [2, 2]  # already current: nothing set


@built
def test_tile_arguments_are_checked_with_sentences():
    from fusedloss import _C

    x = torch.zeros(3, 8)
    out = torch.zeros(len(fusedloss.core.Statistics._fields), 3)
    a = _C.TileArgs()
    a.x, a.ld, a.rows, a.cols, a.vocab = x.data_ptr(), 8, 3, 8, 8
    a.out, a.out_stride = out.data_ptr(), 3
    _C.host_fold_tile(a)  # valid
    cases = [
        (dict(ld=4), "leading dimension ld = 4 is smaller than the tile's cols = 8"),
        (dict(vocab=6), "must lie inside the vocabulary [0, vocab = 6)"),
        (dict(out_stride=2), "`out_stride` = 2 is smaller than the tile's rows = 3"),
        (dict(dtype=7), "`dtype` = 7 is not a dtype code"),
        (dict(first=False), "the pointer `state` is null"),
        (dict(want_kl_rev=True), "the pointer `xt` is null"),
        (dict(x=0), "the pointer `x` is null"),
    ]
    for change, sentence in cases:
        b = _C.TileArgs()
        for field in ("x", "ld", "rows", "cols", "vocab", "out", "out_stride"):
            setattr(b, field, getattr(a, field))
        for k, v in change.items():
            setattr(b, k, v)
        with pytest.raises(ValueError, match="fusedloss fold_tile: ") as info:
            _C.host_fold_tile(b)
        assert sentence in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="the pointer `coeffs` is null"):
        _C.host_dx_tile(a)


# ------------------------------------------------------------------------------------------------
# fp16 on the grad-in-forward path: dx is formed before the GradScaler's scale exists
# ------------------------------------------------------------------------------------------------
def _fp16_case(n=1024, v=1031, d=32, seed=0):
    """A long mean over peaked rows: d loss / dz = q / n is mostly far below fp16's smallest subnormal."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.3
    hot = torch.randint(0, v, (4,), generator=g)
    w[hot] += 3.0 * h.mean(0) / h.mean(0).norm()
    y = torch.randint(0, v, (n,), generator=g)
    return h.half(), w.half(), y


def _grads(h16, w16, y, run):
    h, w = h16.clone().requires_grad_(), w16.clone().requires_grad_()
    run(h, w, y)
    return h.grad.to(F64), w.grad.to(F64)


@built
@pytest.mark.parametrize("path", ["grad_in_forward", "composable"])
def test_fp16_gradients_survive_a_gradscaler_sized_scale(path, monkeypatch):
    original = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", "1" if path == "grad_in_forward" else "0")
    h16, w16, y = _fp16_case()
    scale = 2.0**16

    def fused(h, w, y):
        (fusedloss.cross_entropy(h, w, y, backend="cuda") * scale).backward()
        h.grad /= scale
        w.grad /= scale

    def naive_amp(h, w, y):  # materialised fp16 logits, fp32 loss, the GradScaler's scale, fp16 backward
        (torch.nn.functional.cross_entropy((h @ w.T).float(), y) * scale).backward()
        h.grad /= scale
        w.grad /= scale

    truth = _grads(h16.double(), w16.double(), y, lambda h, w, y: reference.cross_entropy(h, w, y).backward())
    got = _grads(h16, w16, y, fused)
    naive = _grads(h16, w16, y, naive_amp)
    for name, g, t, nv in zip(("d hidden", "d weight"), got, truth, naive):
        err, err_naive = plain_rel_err(g, t), plain_rel_err(nv, t)
        assert err <= err_naive + 1e-4, f"{path} {name}: {err:.2e} vs naive fp16 AMP {err_naive:.2e}"


@built
def test_fp16_pre_scale_is_exact_and_keeps_tiny_values():
    x = torch.tensor([[3e-9, -7e-10, 0.0, 1e-6]])
    dx16 = torch.empty(1, 4, dtype=torch.float16)
    unscale = cuda._scaled_half_dx(x.clone(), dx16)
    assert float(unscale) == 2.0 ** -float(torch.floor(torch.log2(2.0**15 / x.abs().max())))
    assert 2.0**14 <= float(dx16.float().abs().max()) <= 2.0**15
    assert bool((dx16 != 0).sum() == 3)  # nothing flushed (the unscaled values are all below fp16's range)
    assert torch.allclose(dx16.double() * float(unscale), x.double(), rtol=1e-3, atol=0)
    zeros = torch.zeros(1, 4)
    assert float(cuda._scaled_half_dx(zeros, dx16)) == 1.0 and bool((dx16 == 0).all())


# ------------------------------------------------------------------------------------------------
# fp32 products and torch's TF32 flags (a subprocess: the flags are process-wide)
# ------------------------------------------------------------------------------------------------
TF32_SCRIPT = r"""
import os, torch
from fusedloss.backends import gpu
from fusedloss.backends.cuda import backend as cuda
m = torch.backends.cuda.matmul
dev = torch.device("cuda")
inside = []
def check(expected_inside):
    with cuda._fp32_products(dev, torch.float32):
        inside.append(gpu.torch_fp32_precision())
    assert inside[-1] == expected_inside, (inside, expected_inside)
# legacy API in use (HF Trainer's tf32=True): switched off inside, back on after, still readable
m.allow_tf32 = True
check("ieee")
assert m.allow_tf32 is True
# the new API in use
m.allow_tf32 = False
m.fp32_precision = "tf32"
check("ieee")
assert m.fp32_precision == "tf32"
# nothing to change: the flag is not touched
m.fp32_precision = "ieee"
check("ieee")
# bf16 products and CPU tensors are left alone
m.fp32_precision = "tf32"
with cuda._fp32_products(dev, torch.bfloat16):
    assert gpu.torch_fp32_precision() == "tf32"
with cuda._fp32_products(torch.device("cpu"), torch.float32):
    assert gpu.torch_fp32_precision() == "tf32"
# the documented opt-in
os.environ["FUSEDLOSS_ALLOW_TF32"] = "1"
m.fp32_precision = "ieee"
check("tf32")
assert m.fp32_precision == "ieee"
print("ok")
"""


def test_fp32_products_ignore_torchs_tf32_flags_unless_opted_in():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", TF32_SCRIPT], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_fp32_precision_opt_in_is_validated(monkeypatch):
    monkeypatch.setenv("FUSEDLOSS_ALLOW_TF32", "yes")
    with pytest.raises(ValueError, match="FUSEDLOSS_ALLOW_TF32 must be 0 or 1"):
        cuda._fp32_precision()
