"""The sm_90 epilogue path's math, checked on the CPU: the host twins of csrc/epilogue_host.cpp run the very
epilogue_math.h functions the kernels of csrc/sm90_epilogue.cuh run (the per-logit step and lane merge of the
forward partials, their merge over vocabulary tiles by math.h's state_merge and finalize_row, the d logits of
math.h's dz formula rounded to bf16/fp16), against float64 brute force on materialised logits. Then the Python
glue of backends/cuda/epilogue.py end to end with the twins standing in for the kernels: FUSEDLOSS_CUDA_EPILOGUE=1
through the CUDA backend's host mode, for cross_entropy, token_logprobs (with entropy, temperature, ignored
rows), GRPO and named columns, forward and backward against float64 and against today's path."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import fusedloss
from benchmarks.device.epilogue_stand_in import HostTwins, _ptr
from fusedloss.backends.cuda import backend as cuda
from fusedloss.backends.cuda import epilogue
from fusedloss.core.problem import LogitTransform, StatsProblem

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64
CXX = shutil.which("c++") or shutil.which("g++")
TN = epilogue.TILE_N


@pytest.fixture(scope="module")
def host_twins(tmp_path_factory):
    """The device check's stand-in for the kernels (benchmarks/device/check_epilogue.py): the twins compiled from
    csrc/epilogue_host.cpp, driven as backends/cuda/epilogue.py drives the kernels."""
    if CXX is None:
        pytest.skip("no host C++ compiler")
    twins = HostTwins(HostTwins.compile(tmp_path_factory.mktemp("epilogue-twins")))
    assert twins.so.fl_epilogue_num_outputs() == len(fusedloss.core.problem.Statistics._fields)
    return twins


@pytest.fixture(scope="module")
def twins(host_twins):
    """The twins' library itself, for the checks that call one entry point at a time."""
    return host_twins.so


# ---------------------------------------------------------------------------------------------------------------
# The twins against float64
# ---------------------------------------------------------------------------------------------------------------
def _logits(n, v, *, seed=0, peaked=False, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g, dtype=F64) * spread
    if peaked:  # a confident row: one logit 40 above the rest
        z[0, v // 3] += 40.0
        z[1, :] = 0.0  # a flat row: every column ties
    return z


def _fold(so, acc: torch.Tensor, targets, entropy: bool, scale=(1.0, 1.0)):
    """The forward path of the twins on an fp32 accumulator [n, v]: per-tile partials, then the merge
    (``targets`` None: no target, as a teacher's fold)."""
    n, v = acc.shape
    given = targets
    targets = torch.full((n,), -1) if targets is None else targets
    tiles, padded = -(-v // TN), -(-n // 128) * 128
    part = torch.zeros((3, tiles, padded), dtype=torch.float32)
    zy = torch.zeros(n, dtype=torch.float32)
    for j in range(tiles):
        v0, v1 = j * TN, min(v, (j + 1) * TN)
        tile = torch.zeros((n, TN), dtype=torch.float32)
        tile[:, : v1 - v0] = acc[:, v0:v1]
        tile[:, v1 - v0:] = 1e30  # the kernel's zero fill is skipped by the residue predicate: so are these
        rel = torch.where((targets >= v0) & (targets < v1), targets - v0, torch.full_like(targets, -1))
        outs = [torch.empty(n, dtype=torch.float32) for _ in range(3)]
        so.fl_epilogue_fold_tile(_ptr(tile), n, TN, v1 - v0, *scale, int(entropy), _ptr(rel), *map(_ptr, outs),
                                 _ptr(zy))
        for k in range(3):
            part[k, j, :n] = outs[k]
    out = torch.zeros((len(fusedloss.core.problem.Statistics._fields), n), dtype=torch.float32)
    so.fl_epilogue_finalize(_ptr(part[0]), _ptr(part[1]), _ptr(part[2]), n, tiles, padded, _ptr(zy),
                            None if given is None else _ptr(given),
                            int(entropy), _ptr(out))
    return fusedloss.core.problem.Statistics(*out.unbind(0)), zy


@pytest.mark.parametrize("v", [1, 7, 256, 257, 1031, 3 * 256])
@pytest.mark.parametrize("entropy", [False, True])
def test_forward_partials_merge_to_float64_statistics(twins, v, entropy):
    """lse, log p_y and the entropy from per-(row, 256-column tile) partials merged by math.h, against float64
    on the same logits: prime vocabularies, one column, a partial last tile, a confident row, a flat row, an
    ignored target."""
    n = 5
    z = _logits(n, v, seed=v, peaked=v > 2)
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
    y[4] = -1
    stats, zy = _fold(twins, z.float(), y, entropy)
    z32 = z.float().to(F64)  # the fp32 logits the kernel sees
    lse = torch.logsumexp(z32, 1)
    logq = z32 - lse[:, None]
    valid = y >= 0
    assert torch.allclose(stats.lse.to(F64)[valid], lse[valid], rtol=0, atol=2e-6 * (1 + lse.abs().max()))
    want_logp = logq.gather(1, y.clamp(min=0)[:, None])[:, 0]
    assert torch.allclose(stats.logp.to(F64)[valid], want_logp[valid], rtol=0, atol=3e-6)
    assert zy[4] == 0.0 and torch.equal(zy[valid], z.float()[valid].gather(1, y[valid][:, None])[:, 0])
    assert all(torch.count_nonzero(s[4]) == 0 for s in stats)  # the ignored row: zeros, as the fold kernels write
    if entropy:
        want_h = -(logq.exp() * logq).sum(1)
        assert torch.allclose(stats.entropy.to(F64)[valid], want_h[valid], rtol=1e-5, atol=3e-6)
        if v > 2:
            # the confident row keeps the leading digits of its tiny entropy (t, not s = 1 + t, carries them;
            # log1p(t) - e / s cancels to a few ulp of t)
            assert 0 < float(want_h[0]) < 1e-6
            assert math.isclose(float(stats.entropy[0]), float(want_h[0]), rel_tol=5e-2)
            assert math.isclose(float(stats.entropy[1]), math.log(v), rel_tol=1e-6)  # the flat row
    else:
        assert torch.count_nonzero(stats.entropy) == 0


def test_forward_transform_scale_and_temperature(twins):
    """z = (acc * logit_scale) / temperature in the kernel's operation order."""
    n, v = 3, 600
    acc = _logits(n, v, seed=3).float()
    y = torch.tensor([0, 599, 300])
    scale, temp = 0.7, 1.3
    stats, zy = _fold(twins, acc, y, True, scale=(scale, 1.0 / temp))
    z = (acc.to(F64) * scale) / temp
    lse = torch.logsumexp(z, 1)
    logq = z - lse[:, None]
    assert torch.allclose(stats.lse.to(F64), lse, rtol=0, atol=1e-5)
    assert torch.allclose(stats.entropy.to(F64), -(logq.exp() * logq).sum(1), rtol=1e-5, atol=1e-6)
    assert torch.allclose(zy.to(F64), z.gather(1, y[:, None])[:, 0], rtol=1e-6, atol=0)


def test_teacher_normaliser_from_the_same_partials(twins):
    """A teacher's lse_t is the same fold over its own logits (the KLs, which need both logits of a column in
    one fold, are outside the epilogue path and stay on today's path)."""
    zt = _logits(4, 900, seed=5, spread=6.0)
    stats, _ = _fold(twins, zt.float(), None, False)
    assert torch.allclose(stats.lse.to(F64), torch.logsumexp(zt.float().to(F64), 1), rtol=0, atol=5e-6)


def _dz64(z, y, lse, a, c0, c1):
    """math.h's dz formula in float64 on materialised logits: a ([j = y] - q) + q (c0 + c1 log q)."""
    logq = z - lse[:, None]
    q = logq.exp()
    onehot = torch.zeros_like(z)
    valid = y >= 0
    onehot[valid, y[valid]] = 1.0
    return a[:, None] * (onehot - q) + q * (c0[:, None] + c1[:, None] * logq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("entropy", [False, True])
def test_dlogits_node_against_float64(twins, dtype, entropy):
    """The d logits of the backward node, fp32 inside and rounded once to the operands' dtype: within one
    rounding of the float64 formula (bf16: 2^-8 relative of the row's largest entry), at an offset tile
    (col0 != 0), with a confident row and a target in the tile."""
    n, v, v0, cols = 4, 1031, 512, 300
    z = _logits(n, v, seed=11, peaked=True)
    y = torch.tensor([v // 3, 600, 100, -1])
    lse = torch.logsumexp(z.float().to(F64), 1)
    a = torch.tensor([0.25, -0.5, 1.0, 0.0], dtype=F64)
    c0 = torch.tensor([0.0, 0.1, -0.2, 0.0], dtype=F64) if entropy else torch.zeros(n, dtype=F64)
    c1 = torch.tensor([0.3, -0.7, 0.05, 0.0], dtype=F64) if entropy else torch.zeros(n, dtype=F64)
    lse32 = lse.float()
    lse_lo = (lse32.to(F64) - lse).float()  # the saved (hi, lo) pair: log q = (z - lse) - lse_lo
    rows = torch.stack((lse32, lse_lo, a.float(), c0.float(), c1.float())).contiguous()
    rows[0, 3] = float("inf")  # an inactive row as coefficient_rows writes it
    acc = z.float()[:, v0:v0 + cols].contiguous()
    out = torch.empty((n, cols), dtype=dtype)
    twins.fl_epilogue_dlogits(_ptr(acc), n, cols, v0, _ptr(y), _ptr(rows), 1.0, 1.0, 1.0, int(entropy),
                              {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype], _ptr(out))
    want = _dz64(z.float().to(F64), y, lse, a, c0, c1)[:, v0:v0 + cols]
    want[3] = 0.0
    got = out.to(F64)
    ulp = {torch.float32: 2e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    tiny = {torch.float32: 0.0, torch.bfloat16: 0.0, torch.float16: 2.0**-24}[dtype]  # fp16's subnormal step
    for r in range(n):
        scale = float(want[r].abs().max())
        assert float((got[r] - want[r]).abs().max()) <= 2 * ulp * scale + tiny, (r, got[r], want[r])
    assert torch.count_nonzero(got[3]) == 0 and not got.isnan().any()
    # the target column of row 1 (600 - 512 = 88) carries a (1 - q_y), not only -a q
    assert float(got[1, 88]) < 0 and float(want[1, 88]) < 0


# ---------------------------------------------------------------------------------------------------------------
# The glue of fusedloss/backends/cuda/epilogue.py end to end, the twins standing in for the kernels
# ---------------------------------------------------------------------------------------------------------------
needs_extension = pytest.mark.skipif(not cuda.extension_built(), reason=f"CUDA extension not built: "
                                     f"{cuda.availability()}")


@pytest.fixture
def epilogue_on(host_twins, monkeypatch):
    """FUSEDLOSS_CUDA_EPILOGUE=1, the twins as kernels, backend="cuda" routed to the CUDA backend's host mode for
    CPU tensors; counts the epilogue path's forward and backward calls."""
    from fusedloss.core import registry

    original = registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))
    monkeypatch.setenv(epilogue.ENV, "1")
    monkeypatch.setattr(epilogue, "_KERNELS_OVERRIDE", host_twins)
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = epilogue.forward_statistics, epilogue.backward_gradients

    def count(name, fn):
        def run(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return run

    monkeypatch.setattr(epilogue, "forward_statistics", count("forward", fwd))
    monkeypatch.setattr(epilogue, "backward_gradients", count("backward", bwd))
    return calls


def _inputs(n, v, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) / math.sqrt(d)).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[1] = -100
    return h, w, y


def _grads(fn, h, w):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = fn(h, w)
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(out if isinstance(out, tuple) else (out,)))
    loss.backward()
    return [o.detach() for o in (out if isinstance(out, tuple) else (out,))], h.grad, w.grad


def _rel(a, b):
    a, b = a.to(F64), b.to(F64)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


OPS = {
    "cross_entropy": lambda h, w, y, **k: fusedloss.cross_entropy(h, w, y, **k),
    "cross_entropy_z_loss_sum": lambda h, w, y, **k: fusedloss.cross_entropy(h, w, y, z_loss=1e-3, reduction="sum",
                                                                            **k),
    "token_logprobs": lambda h, w, y, **k: fusedloss.token_logprobs(h, w, y, **k),
    "token_logprobs_entropy": lambda h, w, y, **k: fusedloss.token_logprobs(h, w, y, return_entropy=True, **k),
    "token_logprobs_entropy_temperature": lambda h, w, y, **k: fusedloss.token_logprobs(
        h, w, y, return_entropy=True, temperature=0.7, logit_scale=1.25, **k),
}


@needs_extension
def test_fp32_problems_keep_todays_path(epilogue_on):
    """The kernels take bf16/fp16 operands: an fp32 problem runs today's path even when asked."""
    h, w, y = _inputs(5, 301, 16, torch.float32)
    _grads(lambda a, b: fusedloss.token_logprobs(a, b, y, return_entropy=True, backend="cuda"), h, w)
    assert epilogue_on == {"forward": 0, "backward": 0}


@needs_extension
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_epilogue_path_end_to_end_against_float64(epilogue_on, monkeypatch, op, dtype):
    """FUSEDLOSS_CUDA_EPILOGUE=1 through the CUDA backend (host mode, twins as kernels): outputs and gradients
    against float64, no worse than today's path; the epilogue path really ran, forward and backward. The
    vocabulary (601, prime) spans three 256-column tiles and several d logits tiles (a 3 KiB budget)."""
    n, v, d = 9, 601, 24
    h, w, y = _inputs(n, v, d, dtype)
    fn = OPS[op]
    got = _grads(lambda a, b: fn(a, b, y, backend="cuda", workspace_mb=0.003), h, w)
    assert epilogue_on["forward"] >= 1 and epilogue_on["backward"] >= 1, epilogue_on
    ref = _grads(lambda a, b: fn(a, b, y, backend="torch"), h.to(F64), w.to(F64))
    monkeypatch.setenv(epilogue.ENV, "0")
    today = _grads(lambda a, b: fn(a, b, y, backend="cuda"), h, w)
    for g, r, t in zip([*got[0], got[1], got[2]], [*ref[0], ref[1], ref[2]], [*today[0], today[1], today[2]]):
        err, err_today = _rel(g, r), _rel(t, r)
        assert err <= max(2 * err_today, 1e-5), (op, err, err_today)
        assert err < 2e-2


@needs_extension
def test_named_columns_through_the_epilogue_path(epilogue_on):
    """Named columns (core/columns.py, K targets per row): their logits from the gathered dot product, their
    given dz written over the d logits tile; token log-probs at K columns and their gradients against float64."""
    n, v, d, k = 6, 523, 16, 3
    h, w, _ = _inputs(n, v, d, torch.bfloat16, seed=4)
    cols = torch.randint(0, v, (n, k), generator=torch.Generator().manual_seed(2))
    cols[2, 1] = -1
    from fusedloss.core import columns as named_columns

    p = StatsProblem(hidden=h, weight=w, bias=None, targets=None, transform=LogitTransform(), columns=cols)
    stats, logits = cuda.forward_statistics(p)
    assert epilogue_on["forward"] == 1
    z = h.to(F64) @ w.to(F64).T
    want = torch.where(cols >= 0, z.gather(1, cols.clamp(min=0)), torch.zeros((), dtype=F64))
    assert torch.allclose(logits.to(F64), want, rtol=1e-5, atol=1e-5)
    lp = named_columns.log_probs(stats, logits, cols)
    want_lp = torch.where(cols >= 0, (z - torch.logsumexp(z, 1, keepdim=True)).gather(1, cols.clamp(min=0)),
                          torch.zeros((), dtype=F64))
    assert torch.allclose(lp.to(F64), want_lp, rtol=0, atol=1e-5)


@needs_extension
def test_grpo_through_the_epilogue_path(epilogue_on):
    """GRPO's token log-probs (and its entropy-free backward) on the epilogue path, against float64."""
    b, t, d, v = 2, 5, 16, 331
    g = torch.Generator().manual_seed(7)
    h = torch.randn(b, t, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, d, generator=g) / 4).to(torch.bfloat16)
    ids = torch.randint(0, v, (b, t), generator=g)
    adv = torch.randn(b, generator=g)
    mask = torch.ones(b, t)
    mask[1, 3:] = 0

    def run(hh, ww, backend):
        hh = hh.detach().clone().requires_grad_()
        ww = ww.detach().clone().requires_grad_()
        loss = fusedloss.grpo_loss(hh, ww, ids, adv, completion_mask=mask, backend=backend)
        loss = loss[0] if isinstance(loss, tuple) else loss
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    got = run(h, w, "cuda")
    assert epilogue_on["forward"] >= 1
    ref = run(h.to(F64), w.to(F64), "torch")
    for a_, r_ in zip(got, ref):
        assert _rel(a_, r_) < 2e-2, (_rel(a_, r_))


def test_switch_parsing_and_the_message_without_a_gpu(monkeypatch):
    """auto / 0 keep today's path; 1 on a CPU tensor (or a build without the kernels) says what it needs;
    anything else is a ValueError naming the variable."""
    h = torch.randn(3, 8, dtype=torch.bfloat16)
    w = torch.randn(5, 8, dtype=torch.bfloat16)
    p = StatsProblem(hidden=h, weight=w, bias=None, targets=torch.tensor([0, 1, 2]), transform=LogitTransform())
    for value in ("", "auto", "0", "AUTO"):
        monkeypatch.setenv(epilogue.ENV, value)
        assert epilogue.wanted(p) is False
    monkeypatch.setenv(epilogue.ENV, "yes")
    with pytest.raises(ValueError, match=epilogue.ENV):
        epilogue.mode()
    monkeypatch.setenv(epilogue.ENV, "1")
    with pytest.raises(RuntimeError, match="FUSEDLOSS_CUDA_EPILOGUE=1 asks for the sm_90 epilogue kernels, but "
                                           "they need an NVIDIA sm_90 GPU"):
        epilogue.wanted(p)
    if cuda.extension_built():  # through the public op, the CUDA backend's host mode
        from fusedloss.core import registry

        original = registry.resolve
        monkeypatch.setattr(registry, "resolve", lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest))
        with pytest.raises(RuntimeError, match="sm_90 GPU"):
            fusedloss.token_logprobs(h, w, torch.tensor([0, 1, 2]), backend="cuda")


def test_problems_the_epilogue_does_not_serve():
    """A teacher, a bias, a soft-cap, the mean logit, fp32 operands, D % 8: today's path, said why."""
    h = torch.randn(3, 8, dtype=torch.bfloat16)
    w = torch.randn(5, 8, dtype=torch.bfloat16)
    base = dict(hidden=h, weight=w, bias=None, targets=None, transform=LogitTransform())
    assert epilogue.unserved(StatsProblem(**base)) is None
    assert epilogue.unserved(StatsProblem(**{**base, "want_entropy": True})) is None
    cases = {
        "teacher": dict(teacher_hidden=h, teacher_weight=w, want_kl_rev=True),
        "bias": dict(bias=torch.zeros(5, dtype=torch.bfloat16)),
        "soft-cap": dict(transform=LogitTransform(softcap=30.0)),
        "mean logit": dict(want_mean_logit=True),
        "operands": dict(hidden=h.float(), weight=w.float()),
        "16-byte": dict(hidden=h[:, :6], weight=w[:, :6]),
    }
    for word, change in cases.items():
        why = epilogue.unserved(StatsProblem(**{**base, **change}))
        assert why is not None and word in why, (word, why)


def test_coefficient_rows_make_inactive_rows_exactly_zero(twins):
    """coefficient_rows: lse = +inf and zero coefficients outside the loss, so the node writes exact zeros
    whatever the row's logits (huge, NaN-free) are."""
    from fusedloss.core.problem import Statistics

    n = 3
    stats = Statistics(*torch.zeros(len(Statistics._fields), n).unbind(0))
    coeffs = torch.zeros(7, n)
    coeffs[0] = torch.tensor([1.0, 0.0, 2.0])
    active = torch.tensor([True, False, True])
    p = StatsProblem(hidden=torch.zeros(n, 8), weight=torch.zeros(4, 8), bias=None, targets=None,
                     transform=LogitTransform())
    rows = epilogue.coefficient_rows(p, stats, coeffs, active)
    assert rows.shape == (5, n) and rows[0, 1] == float("inf") and torch.count_nonzero(rows[1:, 1]) == 0
    acc = torch.tensor([[1.0, 2.0], [1e30, -1e30], [0.0, 0.0]])
    out = torch.empty(n, 2, dtype=torch.bfloat16)
    twins.fl_epilogue_dlogits(_ptr(acc), n, 2, 0, _ptr(torch.tensor([0, 1, -1])), _ptr(rows), 1.0, 1.0, 1.0, 1, 1,
                              _ptr(out))
    assert torch.count_nonzero(out[1]) == 0 and not out.isnan().any()


@pytest.mark.skipif(not getattr(cuda._C, "EPILOGUE_KERNELS", False), reason="extension built without the epilogue "
                    "kernels")
def test_glue_fills_every_field_of_the_extensions_launch_structs(monkeypatch):
    """What backends/cuda/epilogue.py hands the extension (its launch structs, the binding's names) on a CPU: the
    launchers are replaced by recorders, so every field the glue sets must exist in the extension it was built
    with, and the values are the problem's."""
    seen = {}
    for name in ("epilogue_statistics", "epilogue_merge", "epilogue_dlogits"):
        monkeypatch.setattr(cuda._C, name, lambda a, _n=name: seen.__setitem__(_n, a))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 7})())
    assert list(cuda._C.EPILOGUE_TILE) == [epilogue.TILE_M, epilogue.TILE_N] and cuda._C.EPILOGUE_COEFF_ROWS == 5
    h = torch.randn(300, 16, dtype=torch.bfloat16)
    w = torch.randn(700, 16, dtype=torch.bfloat16)
    y = torch.randint(0, 700, (300,))
    p = StatsProblem(hidden=h, weight=w, bias=None, targets=y, transform=LogitTransform(temperature=0.5),
                     want_entropy=True)
    k = epilogue._Kernels()
    part = torch.zeros(3, 3, 384)
    k.statistics(p, part, y, torch.zeros(300), epilogue._scale(p))
    a = seen["epilogue_statistics"]
    assert (a.n, a.v, a.d, a.dtype, a.entropy, a.stream) == (300, 700, 16, 1, True, 7)
    assert (a.hidden, a.part_e, a.target) == (h.data_ptr(), part[2].data_ptr(), y.data_ptr())
    assert a.inv_temperature == 2.0
    out = torch.zeros(len(fusedloss.core.problem.Statistics._fields), 300)
    k.merge(part, torch.zeros(300), out, True, y)
    m = seen["epilogue_merge"]
    assert (m.n, m.tiles, m.stride, m.target, m.entropy) == (300, 3, 384, y.data_ptr(), True)
    dz = torch.empty(300, 264, dtype=torch.bfloat16)[:, :257]
    rows = torch.zeros(5, 300)
    k.dlogits(h, w[256:513], dz, y, 256, rows, (1.0, 2.0), 2.0, True)
    d = seen["epilogue_dlogits"]
    assert (d.n, d.v, d.ld_out, d.target_offset, d.coeff_stride, d.chain, d.log_q) == (300, 257, 264, 256, 300, 2.0,
                                                                                         True)


@needs_extension
def test_k_targets_forward_and_backward_through_the_epilogue_path(epilogue_on):
    """token_logprobs with K ids per position (named columns): the log-probs at the K columns and the gradients,
    whose dz at the named columns is given and written over the d logits tile, against float64 and no worse
    than today's path."""
    n, v, d, k = 7, 389, 16, 3
    h, w, _ = _inputs(n, v, d, torch.bfloat16, seed=9)
    ids = torch.randint(0, v, (n, k), generator=torch.Generator().manual_seed(3))
    ids[2, 1] = -100
    fn = lambda a, b, backend: fusedloss.token_logprobs(a, b, ids, return_entropy=True, backend=backend)
    got = _grads(lambda a, b: fn(a, b, "cuda"), h, w)
    assert epilogue_on["forward"] >= 1 and epilogue_on["backward"] >= 1, epilogue_on
    ref = _grads(lambda a, b: fn(a, b, "torch"), h.to(F64), w.to(F64))
    for g, r in zip([*got[0], got[1], got[2]], [*ref[0], ref[1], ref[2]]):
        assert _rel(g, r) < 1e-2, _rel(g, r)
