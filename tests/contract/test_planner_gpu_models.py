"""Which GPU the backends model and compile for: one device-to-GPU mapping for the Triton and CUDA backends
(``workload.gpu_for_device``), GPU names in ``estimate``, and the tiles and fp32 precision per architecture."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import fusedloss
from fusedloss.backends.cuda import backend as cuda_backend
from fusedloss.backends.triton import backend as tb
from fusedloss.backends.triton import plan as tb_plan
from fusedloss.core import registry
from fusedloss.core import workload as cost
from fusedloss.core.problem import LogitTransform, StatsProblem

# (torch's device name, capability, SMs, memory, gfx name on ROCm) -> the table entry both backends price it as
DEVICES = [
    ("NVIDIA H100 80GB HBM3", (9, 0), 132, 80 * 10**9, "", "h100"),
    ("NVIDIA H200", (9, 0), 132, 141 * 10**9, "", "h200"),
    ("NVIDIA B200", (10, 0), 148, 180 * 10**9, "", "b200"),
    ("NVIDIA GB200", (10, 0), 152, 186 * 10**9, "", "gb200"),
    ("NVIDIA B300 SXM6 AC", (10, 3), 148, 288 * 10**9, "", "b300"),
    ("NVIDIA GeForce RTX 5090", (12, 0), 170, 32 * 10**9, "", "rtx5090"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188, 96 * 10**9, "", "rtx-pro-6000"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 80 * 10**9, "", "a100"),
    ("AMD Instinct MI300X", (9, 4), 304, 192 * 10**9, "gfx942", "mi300x"),
    ("AMD Instinct MI325X", (9, 4), 304, 256 * 10**9, "gfx942", "mi325x"),
    ("AMD Instinct MI355X", (9, 5), 256, 288 * 10**9, "gfx950", "mi355x"),
    # names the table does not know: the architecture decides
    ("NVIDIA Graphics Device", (10, 0), 148, 180 * 10**9, "", "b200"),
    ("NVIDIA Graphics Device", (10, 3), 160, 288 * 10**9, "", "b300"),
    ("NVIDIA Graphics Device", (12, 0), 84, 16 * 10**9, "", "rtx-pro-6000"),
    ("NVIDIA Graphics Device", (9, 0), 132, 96 * 10**9, "", "h200"),
    ("NVIDIA Graphics Device", (8, 6), 84, 24 * 10**9, "", "a100"),
    ("AMD Instinct MI308X", (9, 4), 80, 192 * 10**9, "gfx942", "mi300x"),
    ("AMD Radeon Graphics", (9, 5), 256, 288 * 10**9, "gfx950", "mi355x"),
]


@pytest.mark.parametrize("name, capability, sms, memory, arch, key", DEVICES)
def test_both_backends_price_a_device_as_the_same_gpu(monkeypatch, name, capability, sms, memory, arch, key):
    props = SimpleNamespace(name=name, major=capability[0], minor=capability[1], multi_processor_count=sms,
                            total_memory=memory, gcnArchName=f"{arch}:sramecc+:xnack-" if arch else "")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.version, "hip", "6.4" if arch else None)
    registry._device_gpu.cache_clear()
    tb_plan._cuda_target.cache_clear()
    try:
        device = torch.device("cuda", 0)
        spec = cost.gpu_for_device(name, capability, sms, memory, arch)
        assert spec.name == cost.GPUS[key].name and spec.half_flops_per_byte == cost.GPUS[key].half_flops_per_byte
        assert (spec.sm_count, spec.memory_bytes) == (sms, memory)  # the device's own
        assert tb.gpu_of(device) == cuda_backend.gpu_of(device) == spec
        assert tb.device_target(device) == (arch or f"sm_{capability[0]}{capability[1]}")
    finally:
        registry._device_gpu.cache_clear()
        tb_plan._cuda_target.cache_clear()


def test_host_tensors_price_an_h200():
    assert tb.gpu_of(torch.device("cpu")) == cuda_backend.gpu_of(torch.device("cpu")) == cost.GPUS["h200"]
    assert tb.device_target(torch.device("meta")) == "sm_90"


def test_backend_status_names_the_gpu_model():
    status = fusedloss.backend_status()
    assert set(status) == {"torch", "triton", "cuda", "gpu"}
    if not torch.cuda.is_available():
        assert status["gpu"] == "no GPU visible (plans price an H200)"


@pytest.mark.parametrize("given, key", [("H100", "h100"), ("a100-80gb", "a100"), ("B200", "b200"), ("gb200", "gb200"),
                                        ("RTX 5090", "rtx5090"), ("rtx-pro-6000", "rtx-pro-6000"),
                                        ("NVIDIA H200", "h200"), ("MI300X", "mi300x"), ("mi355x", "mi355x"),
                                        ("A100 40GB", "a100-40gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
                                        ("A100 80GB", "a100"), ("h100", "h100"), ("H200", "h200"), ("b200", "b200"),
                                        ("L40S", "l40s"), ("NVIDIA L40S", "l40s"), ("RTX 4090", "rtx4090"),
                                        ("NVIDIA GeForce RTX 4090", "rtx4090")])
def test_estimate_takes_gpu_names_in_any_case(given, key):
    est = fusedloss.estimate(tokens=4096, hidden_size=4096, vocab_size=151936, gpu=given)
    assert est.gpu == cost.GPUS[key].name
    assert cost.gpu_key(given) == key


@pytest.mark.parametrize("given", ["tpu", "", "H", "RTX 6000 Ada", 200])
def test_estimate_refuses_an_unknown_gpu_with_the_known_ones(given):
    with pytest.raises(ValueError, match="gpu must be one of") as info:
        fusedloss.estimate(tokens=4096, hidden_size=4096, vocab_size=151936, gpu=given)
    for key in cost.GPUS:
        assert repr(key) in str(info.value)



def _problem(dtype, teacher=False):
    h = SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(4096, 4096), requires_grad=True)
    w = SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(151936, 4096), requires_grad=True)
    extra = dict(teacher_hidden=h, teacher_weight=w, want_kl_fwd=True) if teacher else {}
    return StatsProblem(hidden=h, weight=w, bias=None, targets=None, transform=LogitTransform(), **extra)


@pytest.mark.parametrize("target, family", [("sm_80", "sm_90"), ("sm_86", "sm_90"), ("sm_90", "sm_90"),
                                            ("sm_100", "sm_100"), ("sm_103", "sm_100"), ("sm_120", "sm_120"),
                                            ("sm_121", "sm_120"), ("gfx942", "gfx942"), ("gfx90a", "gfx942"),
                                            ("gfx950", "gfx950")])
def test_tile_family(target, family):
    assert tb.tile_family(target) == family


@pytest.mark.parametrize("target", ["sm_90", "sm_100", "sm_120", "gfx942", "gfx950"])
def test_default_tiles_fit_the_targets_shared_memory(target):
    """A cheap bound beside the compile test: (stages - 1) buffers of both operand tiles (what Triton keeps in
    shared memory / LDS for a pipelined K loop), at most the target's block limit, for every default tile."""
    limit = tb_plan.SHARED_LIMITS[tb.tile_family(target)]
    for dtype, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        for kind in ("lean", "heavy", "teacher"):
            paths = ("composable", "grad_in_forward") if kind != "teacher" else ("composable",)
            for path in paths:
                cfg = tb.candidates(dtype, kind, path, target)[0]
                operands = 2 if kind == "teacher" else 1
                buffers = max(1, cfg.num_stages - 1)
                need = buffers * operands * (cfg.block_m + cfg.block_v) * cfg.block_k * size
                assert need <= limit, (target, dtype, kind, path, cfg, need, limit)


def test_tiles_follow_the_device(monkeypatch):
    """The launch tiles are the target's (the compile test checks those): the lean half tiles are 64 x 128 on
    Blackwell, 128 x 128 on Hopper; gfx942's half tiles take 3 stages."""
    monkeypatch.setattr(tb, "deterministic", lambda: True)
    p = _problem(torch.bfloat16)
    for target, grad_in_forward, composable in (("sm_90", (128, 128, 4), (128, 128, 4)), ("sm_100", (64, 128, 4),
                                                                                          (64, 128, 4)),
                                      ("sm_120", (64, 128, 4), (64, 128, 4)), ("gfx942", (128, 128, 3), (128, 128, 3)),
                                      ("gfx950", (128, 128, 4), (128, 128, 4))):
        monkeypatch.setattr(tb, "device_target", lambda device, t=target: t)
        for path, want in (("grad_in_forward", grad_in_forward), ("composable", composable)):
            cfg = tb.tiles_for(p, path)
            assert (cfg.block_m, cfg.block_v, cfg.num_stages) == want, (target, path, cfg)


@pytest.mark.parametrize("target, allow_tf32, want", [("sm_90", False, "tf32x3"), ("sm_100", False, "tf32x3"),
                                                      ("sm_120", True, "tf32"), ("gfx942", False, "ieee"),
                                                      ("gfx942", True, "tf32"), ("gfx950", False, "ieee"),
                                                      ("gfx950", True, "ieee")])
def test_fp32_precision_per_target(monkeypatch, target, allow_tf32, want):
    monkeypatch.delenv("FUSEDLOSS_TRITON_FP32_PRECISION", raising=False)
    monkeypatch.delenv("FUSEDLOSS_ALLOW_TF32", raising=False)
    p = dataclasses.replace(_problem(torch.float32), allow_tf32=allow_tf32)
    major = int(target[3:]) // 10 if target.startswith("sm_") else 9
    assert tb.fp32_precision(p, (major, 0), target) == want


def test_amd_never_gets_tf32x3_even_when_asked(monkeypatch):
    """tf32x3 does not exist on AMD (Triton refuses the kernel): the override maps to ieee, fp32's accuracy."""
    monkeypatch.setenv("FUSEDLOSS_TRITON_FP32_PRECISION", "tf32x3")
    p = _problem(torch.float32)
    assert tb.fp32_precision(p, (9, 4), "gfx942") == "ieee"
    assert tb.fp32_precision(p, (9, 0), "sm_90") == "tf32x3"


@pytest.mark.parametrize("name, capability, arch, want", [
    ("AMD Instinct MI300X", (9, 4), "gfx942", "MI300X figures for AMD Instinct MI300X (gfx942, 304 CUs, 192 GB)"),
    ("NVIDIA GeForce RTX 5090", (12, 0), "", "RTX 5090 figures for NVIDIA GeForce RTX 5090 (sm_120, 170 SMs, 32 GB)"),
])
def test_backend_status_says_which_gpu_the_plans_price(monkeypatch, name, capability, arch, want):
    sms = 304 if arch else 170
    props = SimpleNamespace(name=name, major=capability[0], minor=capability[1], multi_processor_count=sms,
                            total_memory=(192 if arch else 32) * 10**9, gcnArchName=f"{arch}:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.version, "hip", "6.4" if arch else None)
    registry._device_gpu.cache_clear()
    try:
        assert registry.gpu_model() == want
    finally:
        registry._device_gpu.cache_clear()
