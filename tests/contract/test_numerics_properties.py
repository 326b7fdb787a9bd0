"""Property-based differential tests: every public function, option and reduction against the float64 oracle
of ``tests/oracle.py`` (written from the formulas; not ``fusedloss.reference``), outputs and gradients.

Hypothesis draws the structure of a case (shapes, regime, options, layout, tiles, paths) and a seed; the
tensors come from that seed. Derandomized (a fixed seed per test), no example database: the same examples
run everywhere. The default profile runs on the torch backend in CI in well under the 3 minutes it is
allowed; ``-m slow`` runs the long profile (``FUSEDLOSS_PROPERTY_EXAMPLES`` sets the count per test). The
Triton (interpreter) and CUDA (host twins on CPU tensors) variants run a few examples each.

What the cases cover: leading shapes ``[N]`` and ``[B, T]`` with N = 1..9; vocabularies of 1 and primes to 37;
hidden sizes 1..6; regimes normal, peaked (some rows x25: confident rows next to others), large (logits in
the thousands), tiny, zero hidden states, exact ties (duplicated vocabulary rows); biases with -inf entries
(masked vocabulary) in student and teacher; every transform; ignored rows, all-ignored batches, rows that
carry no gradient (zero cotangents) next to confident rows; non-contiguous hidden / weight / bias;
gradients for any subset of hidden, weight, bias; no_grad and inference_mode; ``FUSEDLOSS_GRAD_IN_FORWARD`` forced on
and off; torch-backend tiles shrunk to 1..5 rows and columns so that tiny shapes cross tile borders (forward
and backward inside the same configuration).

Bounds (``check``): float64 within 1e-10 (1e-9 for Triton); fp32 within max(1e-5, 4x the naive fp32 path's
error), the naive error being the worse of two naive runs (plain fp32 and the logits rounded on a shifted
grid). Errors are norm-wise relative, except that an error below one rounding of the logit scale (times
the square root of the tensor's size, the loss's own weights and, for gradients, the chain-rule factor and
the scale of the other operand) always passes: no algorithm that rounds the logits once can do better.
Non-finite expected values must be matched exactly (+inf for +inf); the gradients of an objective whose
value is not finite are not compared (they have no meaning). Exact properties (a row's gradient does not
depend on the other rows) compare bits.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import NamedTuple, Optional

import oracle
import pytest
import torch
from _errors import distance, rel_err_floored
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import fusedloss
from fusedloss.backends import torch as torch_backend
from fusedloss.core import registry

F64 = torch.float64
PRIMES = (1, 2, 3, 5, 7, 11, 13, 17, 31, 37)
REGIMES = ("normal", "peaked", "large", "tiny", "zero", "ties")
FP64_TOL = {"torch": 1e-10, "triton": 1e-9, "cuda": 1e-10}
FP32_TOL = 1e-5
NAIVE_FACTOR = 4.0


# --------------------------------------------------------------------------------------------------
# Profiles and backends


def _examples(backend: str, slow: bool) -> int:
    if slow:
        return int(os.environ.get("FUSEDLOSS_PROPERTY_EXAMPLES", "1500"))
    return {"torch": 200, "triton": 8, "cuda": 25}[backend]


def _backend_params(slow: bool = False):
    status = fusedloss.backend_status()
    params = [pytest.param("torch", id="torch")]
    params.append(pytest.param("triton", id="triton", marks=pytest.mark.skipif(
        status["triton"] != "available", reason=f"triton: {status['triton']}")))
    cuda_ok = status["cuda"] == "available" or status["cuda"].startswith("built")
    params.append(pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
        not cuda_ok, reason=f"cuda: {status['cuda']}")))
    return params


def _settings(backend: str, slow: bool):
    # The Triton interpreter and the host twins are slow: report their first failure without shrinking it.
    phases = tuple(Phase) if backend == "torch" else (Phase.explicit, Phase.generate)
    return settings(max_examples=_examples(backend, slow), derandomize=True, database=None, deadline=None,
                    print_blob=True, suppress_health_check=list(HealthCheck), phases=phases)


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.slow, id="slow")], ids=["default", "slow"])
def slow(request):
    """The long profile runs only when asked for with ``-m slow``."""
    if request.param and "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the long property profile runs with -m slow")
    return request.param


def _device(backend: str) -> torch.device:
    if backend != "torch" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


@contextlib.contextmanager
def configured(backend: str, grad_in_forward: Optional[str], tiles: Optional[tuple]):
    """FUSEDLOSS_GRAD_IN_FORWARD, the torch backend's tile sizes and (for the CUDA host twins) the backend resolution,
    for the forward and the backward of one run alike."""
    saved_env = os.environ.get("FUSEDLOSS_GRAD_IN_FORWARD")
    saved = (torch_backend.ROW_CHUNK, torch_backend.VOCAB_TILE, torch_backend.grad_in_forward_rows, registry.resolve)
    try:
        if grad_in_forward is None:
            os.environ.pop("FUSEDLOSS_GRAD_IN_FORWARD", None)
        else:
            os.environ["FUSEDLOSS_GRAD_IN_FORWARD"] = grad_in_forward
        if tiles is not None:
            rows, cols = tiles
            torch_backend.ROW_CHUNK, torch_backend.VOCAB_TILE = rows, cols
            torch_backend.grad_in_forward_rows = lambda p: rows
        if backend == "cuda" and not torch.cuda.is_available():
            original = saved[3]
            registry.resolve = lambda b, *rest: "cuda" if b == "cuda" else original(b, *rest)
        yield
    finally:
        if saved_env is None:
            os.environ.pop("FUSEDLOSS_GRAD_IN_FORWARD", None)
        else:
            os.environ["FUSEDLOSS_GRAD_IN_FORWARD"] = saved_env
        torch_backend.ROW_CHUNK, torch_backend.VOCAB_TILE, torch_backend.grad_in_forward_rows, registry.resolve = saved


# --------------------------------------------------------------------------------------------------
# Data


class Head(NamedTuple):
    hidden: torch.Tensor  # float64 masters, values exactly representable in the dtype under test
    weight: torch.Tensor
    bias: Optional[torch.Tensor]


def _round(t, dtype):
    return None if t is None else t.to(dtype).to(F64)


def make_head(g: torch.Generator, lead: tuple, v: int, d: int, regime: str, bias_kind: str, dtype) -> Head:
    n = math.prod(lead)
    h = torch.randn(n, d, generator=g, dtype=F64)
    w = torch.randn(v, d, generator=g, dtype=F64) / math.sqrt(d)
    b = torch.randn(v, generator=g, dtype=F64) * 0.5
    if regime == "peaked":  # every other row confident: a vocabulary row aligned with it, scaled up
        for i in range(0, n, 2):
            j = int(torch.randint(0, v, (1,), generator=g))
            h[i] = w[j] / w[j].norm().clamp_min(1e-3) * 25.0 / math.sqrt(d) + 0.01 * h[i]
    elif regime == "large":
        w = w * 300.0
    elif regime == "tiny":
        w = w * 1e-3
    elif regime == "zero":
        h = torch.zeros_like(h)
    elif regime == "ties" and v > 1:
        src = torch.randint(0, v, (v,), generator=g)
        dup = torch.rand(v, generator=g) < 0.5
        w = torch.where(dup[:, None], w[src], w)
        b = torch.where(dup, b[src], b)
    if bias_kind == "none":
        b = None
    elif bias_kind == "masked" and v > 1:
        masked = torch.rand(v, generator=g) < 0.3
        masked[int(torch.randint(0, v, (1,), generator=g))] = False  # at least one entry stays
        b = torch.where(masked, torch.full_like(b, -math.inf), b)
    return Head(_round(h.reshape(*lead, d), dtype), _round(w, dtype), _round(b, dtype))


IGNORE_KINDS = ("none", "some", "some", "all")


def make_targets(g, head: Head, lead, v, ignore: str, ignore_index: int = -100, on_masked: bool = False):
    """Targets: half on the row's maximum (confident targets on peaked rows), the rest anywhere; with
    ``on_masked``, a third of them on masked (-inf bias) entries, as labels that only mark valid tokens."""
    n = math.prod(lead)
    y = torch.randint(0, v, (n,), generator=g)
    z = head.hidden.reshape(n, -1) @ head.weight.T
    if head.bias is not None:
        z = z + head.bias
    y = torch.where(torch.rand(n, generator=g) < 0.5, z.argmax(-1), y)
    if on_masked and head.bias is not None and bool(torch.isneginf(head.bias).any()):
        masked = torch.nonzero(torch.isneginf(head.bias)).squeeze(1)
        pick = masked[torch.randint(0, masked.numel(), (n,), generator=g)]
        y = torch.where(torch.rand(n, generator=g) < 0.35, pick, y)
    if ignore == "some":
        y = torch.where(torch.rand(n, generator=g) < 0.4, torch.full_like(y, ignore_index), y)
    elif ignore == "all":
        y = torch.full_like(y, ignore_index)
    return y.reshape(lead)


@st.composite
def structures(draw, *, lead2_only=False, even_rows=False):
    if lead2_only or draw(st.booleans()):
        b = draw(st.integers(1, 3)) * (2 if even_rows else 1)
        lead = (b, draw(st.integers(1, 4)))
    else:
        lead = (draw(st.integers(1, 9)),)
    return dict(lead=lead, v=draw(st.sampled_from(PRIMES)), d=draw(st.integers(1, 6)),
                regime=draw(st.sampled_from(REGIMES)), seed=draw(st.integers(0, 2**31 - 1)))


def transforms(draw, masked: bool):
    temperature = draw(st.sampled_from((1.0, 1.0, 0.7, 2.5, 0.05)))
    scale = draw(st.sampled_from((1.0, 1.0, 0.5, 1.7) if masked else (1.0, 0.5, -1.3, 0.0)))
    softcap = draw(st.sampled_from((None, None, 2.0, 30.0)))
    return dict(temperature=temperature, logit_scale=scale, softcap=softcap)


@st.composite
def run_configs(draw, backend: str, *, grad_in_forward_applies: bool = True):
    """How to run: dtype, grad mode, which leaves need gradients, layout, grad-in-forward switch, tiles."""
    dtypes = (F64, torch.float32) if backend != "cuda" else (torch.float32,)
    cfg = dict(dtype=draw(st.sampled_from(dtypes)),
               grad_mode=draw(st.sampled_from(("grad", "grad", "grad", "no_grad", "inference_mode"))),
               needs=draw(st.sampled_from(("hwb", "hwb", "h", "w", "b", "hw"))),
               strided=draw(st.booleans()),
               grad_in_forward=draw(st.sampled_from((None, "1", "0"))) if grad_in_forward_applies else None,
               tiles=None)
    if backend == "torch" and draw(st.booleans()):
        cfg["tiles"] = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    return cfg


# --------------------------------------------------------------------------------------------------
# Running both sides and comparing


HEAD_NAMES = ("hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias")
LEAVES = {"h": "hidden", "w": "weight", "b": "bias"}


def _strided(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values in a non-contiguous layout: every other element of a wider tensor (hidden, bias), or
    a transposed view (weight)."""
    if kind == "weight":
        return t.T.contiguous().T
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _prepare(inputs: dict, dtype, device, cfg) -> tuple:
    acc = F64 if dtype == F64 else torch.float32
    out, leaves = {}, {}
    wanted = {LEAVES[c] for c in cfg["needs"]} if cfg["grad_mode"] == "grad" else set()
    for k, x in inputs.items():
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.to(dtype if k in HEAD_NAMES else acc)
            if cfg["strided"] and k in ("hidden", "weight", "bias"):
                x = _strided(x, k)
            x = x.to(device)
            if k in wanted:
                x = x.detach().requires_grad_(True)
                leaves[k] = x
        elif isinstance(x, torch.Tensor):
            x = x.to(device)
        out[k] = x
    return out, leaves


def _outputs(result) -> list:
    if isinstance(result, torch.Tensor):
        return [("out", result)]
    items = []
    for i, part in enumerate(result):
        if isinstance(part, tuple):
            names = getattr(part, "_fields", [f"detail{j}" for j in range(len(part))])
            items.extend(zip(names, part))
        else:
            items.append((f"out{i}", part))
    return items


class Side(NamedTuple):
    outputs: list  # [(name, tensor or None)]
    grads: dict  # objective index -> {leaf name: gradient or None}
    objective_finite: dict  # objective index -> bool


def _cotangent(shape, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(shape, generator=g, dtype=F64) * 2.0 - 1.0
    zero = torch.rand(shape, generator=g) < 0.3  # rows that carry no gradient
    return torch.where(zero, torch.zeros_like(c), c)


def run_side(fn, inputs: dict, leaves: dict, differentiable: tuple, cot_seed: int) -> Side:
    result = fn(inputs)
    outputs = _outputs(result)
    grads, finite = {}, {}
    if leaves:
        for i, (name, out) in enumerate(outputs):
            if name not in differentiable or out is None:
                continue
            objective = (out.to(F64) * _cotangent(out.shape, cot_seed + i).to(out.device)).sum()
            finite[i] = bool(torch.isfinite(objective))
            if not out.requires_grad:
                grads[i] = {k: None for k in leaves}
                continue
            got = torch.autograd.grad(objective, list(leaves.values()), retain_graph=True, allow_unused=True)
            grads[i] = dict(zip(leaves, got))
    return Side(outputs, grads, finite)


class Scales(NamedTuple):
    logits: float  # max |z| over the rows that count (student and teacher), at least 1
    hidden: float  # max |hidden|, |weight|: the factors of d weight and d hidden
    weight: float
    chain: float  # |logit_scale| / temperature
    loss: float  # the magnitude of the loss's own weights (advantages, hard / soft weights, 1 / num_items)


def _floor(scales: Scales, eps: float, what: str, numel: int) -> float:
    base = eps * scales.logits * scales.loss * math.sqrt(max(1, numel))
    if what == "hidden":
        return base * scales.chain * scales.weight
    if what == "weight":
        return base * scales.chain * scales.hidden
    if what == "bias":
        return base * scales.chain
    return base


def check(fn_name: str, call, inputs: dict, *, backend: str, cfg: dict, scales: Scales,
          differentiable: tuple, oracle_call, cot_seed: int = 99):
    """Run ``call(inputs)`` (the public function, on ``backend``) in ``cfg`` and ``oracle_call`` in float64
    (and, for fp32, twice as the naive fp32 path) on the same values; compare every output and the gradients
    of every differentiable output."""
    dtype = cfg["dtype"]
    device = _device(backend)
    label = f"{fn_name}[{backend}, {dtype}, {cfg}]"
    prepared, leaves = _prepare(inputs, dtype, device, cfg)
    mode = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    with configured(backend, cfg["grad_in_forward"], cfg["tiles"]), mode[cfg["grad_mode"]]():
        got = run_side(call, prepared, leaves, differentiable, cot_seed)

    def oracle_side(ocfg):
        o_inputs, o_leaves = _prepare(inputs, F64, "cpu", dict(cfg, strided=False))
        return run_side(lambda x: oracle_call(x, ocfg), o_inputs, o_leaves, differentiable, cot_seed)

    want = oracle_side(oracle.EXACT)
    naive = []
    if dtype != F64:
        naive = [oracle_side(oracle.Config(torch.float32, False)),
                 oracle_side(oracle.Config(torch.float32, False, 0.375))]
    eps = torch.finfo(dtype).eps

    def judge(what, a, e, floor, naive_values):
        """Pass iff ||a - e|| <= max(tol ||e||, floor, NAIVE_FACTOR x the worse naive fp32 distance)."""
        diff, norm = distance(a, e)
        tol = FP64_TOL[backend] if dtype == F64 else FP32_TOL
        allowed, note = max(tol * norm, floor), ""
        if dtype != F64:
            worst = max(distance(nv, e)[0] for nv in naive_values)
            allowed = max(allowed, NAIVE_FACTOR * worst)
            note = f", naive fp32 {worst / max(norm, 1e-300):.2e}"
        assert diff <= allowed, (f"{label}: {what}: relative error {diff / max(norm, 1e-300):.3e} (absolute "
                                 f"{diff:.2e}, allowed {allowed:.2e}: tol {tol:.0e}, floor {floor:.1e}{note})"
                                 f"\n got {a}\nwant {e}")

    assert [n for n, _ in got.outputs] == [n for n, _ in want.outputs], label
    for i, ((name, a), (_, e)) in enumerate(zip(got.outputs, want.outputs)):
        if e is None:
            assert a is None, f"{label}: output {name} should be None"
            continue
        assert a is not None and tuple(a.shape) == tuple(e.shape), f"{label}: output {name} shape"
        assert a.dtype == (F64 if dtype == F64 else torch.float32), f"{label}: output {name} dtype {a.dtype}"
        judge(f"output {name}", a, e, _floor(scales, eps, "output", e.numel()), [nv.outputs[i][1] for nv in naive])
    for i, wgrads in want.grads.items():
        if not want.objective_finite[i]:
            continue  # an infinite loss has no meaningful gradient
        name = want.outputs[i][0]
        for leaf, e in wgrads.items():
            a = got.grads[i][leaf]
            if e is None:
                assert a is None or float(a.abs().max()) == 0.0, f"{label}: d {leaf} of {name} should be zero"
                continue
            if a is None:
                assert float(e.abs().max()) == 0.0, f"{label}: no gradient reached {leaf} through {name}"
                continue
            assert a.dtype == dtype, f"{label}: d {leaf} has dtype {a.dtype}"
            judge(f"d {leaf} of output {name}", a, e, _floor(scales, eps, leaf, e.numel()),
                  [nv.grads[i][leaf] for nv in naive])


def logit_scale_of(inputs: dict, transform: dict, teacher_transform: Optional[dict] = None, rows=None) -> float:
    """max |z| over the rows that count (finite entries), at least 1."""
    def side(h, w, b, tf):
        z = oracle.logits(h.reshape(-1, h.shape[-1]), w, b, **tf)
        if rows is not None:
            z = z[rows.reshape(-1)]
        z = z[torch.isfinite(z)]
        return float(z.abs().max()) if z.numel() else 0.0

    s = side(inputs["hidden"], inputs["weight"], inputs.get("bias"), transform)
    if teacher_transform is not None:
        s = max(s, side(inputs["teacher_hidden"], inputs["teacher_weight"], inputs.get("teacher_bias"),
                        teacher_transform))
    return max(1.0, s)


def scales_of(inputs, transform, loss=1.0, teacher_transform=None, rows=None) -> Scales:
    h, w = inputs["hidden"], inputs["weight"]
    return Scales(logit_scale_of(inputs, transform, teacher_transform, rows),
                  max(1e-300, float(h.abs().max()) if h.numel() else 1.0), max(1e-300, float(w.abs().max())),
                  abs(transform.get("logit_scale", 1.0)) / transform.get("temperature", 1.0) or 1.0, loss)


def _events(head: Head, y: torch.Tensor, ignore_index: int = -100) -> None:
    """Coverage of the cases the defects hid in (shown by pytest --hypothesis-show-statistics)."""
    if head.bias is not None and bool(torch.isneginf(head.bias).any()):
        event("masked vocabulary")
        valid = y.reshape(-1) != ignore_index
        if bool(torch.isneginf(head.bias[y.reshape(-1)[valid].clamp(min=0)]).any()):
            event("label on a masked entry")
    if not bool((y != ignore_index).any()):
        event("all rows ignored")


def _bias_kind(draw, v):
    return draw(st.sampled_from(("none", "random", "masked") if v > 1 else ("none", "random")))


# --------------------------------------------------------------------------------------------------
# The properties


def _head_case(draw, backend, *, lead2_only=False, even_rows=False, ignore_index=-100, grad_in_forward_applies=True):
    s = draw(structures(lead2_only=lead2_only, even_rows=even_rows))
    cfg = draw(run_configs(backend, grad_in_forward_applies=grad_in_forward_applies))
    g = torch.Generator().manual_seed(s["seed"])
    bias_kind = _bias_kind(draw, s["v"])
    head = make_head(g, s["lead"], s["v"], s["d"], s["regime"], bias_kind, cfg["dtype"])
    tf = transforms(draw, masked=bias_kind == "masked")
    return s, cfg, g, head, tf


@pytest.mark.parametrize("engine", _backend_params())
def test_token_logprobs(engine, slow):
    backend = engine
    @_settings(backend, slow)
    @given(data=st.data())
    def prop(data):
        s, cfg, g, head, tf = _head_case(data.draw, backend)
        ignore_index = data.draw(st.sampled_from((-100, 0, 3)))
        y = make_targets(g, head, s["lead"], s["v"], data.draw(st.sampled_from(IGNORE_KINDS)),
                         on_masked=data.draw(st.booleans()),
                         ignore_index=ignore_index if ignore_index < 0 else -100)
        if ignore_index >= 0:  # a real token id as ignore_index
            y = torch.where(y == -100, torch.full_like(y, ignore_index), y)
        ent = data.draw(st.booleans())
        inputs = dict(hidden=head.hidden, weight=head.weight, bias=head.bias, targets=y)
        _events(head, y, ignore_index)
        opts = dict(tf, ignore_index=ignore_index, return_entropy=ent)

        def call(x):
            return fusedloss.token_logprobs(x["hidden"], x["weight"], x["targets"], bias=x["bias"], backend=backend,
                                            **opts)

        def ref(x, ocfg):
            return oracle.token_logprobs(x["hidden"], x["weight"], x["targets"], bias=x["bias"], cfg=ocfg, **opts)

        check("token_logprobs", call, inputs, backend=backend, cfg=cfg, scales=scales_of(inputs, tf),
              differentiable=("out", "out0", "out1"), oracle_call=ref)

    prop()


@pytest.mark.parametrize("engine", _backend_params())
def test_cross_entropy(engine, slow):
    backend = engine
    @_settings(backend, slow)
    @given(data=st.data())
    def prop(data):
        s, cfg, g, head, tf = _head_case(data.draw, backend)
        y = make_targets(g, head, s["lead"], s["v"], data.draw(st.sampled_from(IGNORE_KINDS)),
                         on_masked=data.draw(st.booleans()))
        reduction = data.draw(st.sampled_from(("mean", "sum", "none")))
        items = data.draw(st.sampled_from((None, None, 7, 0.5, "tensor")))
        if items == "tensor":
            items = torch.tensor(3)
        opts = dict(tf, reduction=reduction, label_smoothing=data.draw(st.sampled_from((0.0, 0.0, 0.1, 1.0))),
                    z_loss=data.draw(st.sampled_from((0.0, 0.0, 1e-3))), num_items_in_batch=items)
        inputs = dict(hidden=head.hidden, weight=head.weight, bias=head.bias, targets=y)

        def call(x):
            return fusedloss.cross_entropy(x["hidden"], x["weight"], x["targets"], bias=x["bias"], backend=backend,
                                           **opts)

        def ref(x, ocfg):
            return oracle.cross_entropy(x["hidden"], x["weight"], x["targets"], bias=x["bias"], cfg=ocfg, **opts)

        loss_scale = 2.0 if items == 0.5 else 1.0
        check("cross_entropy", call, inputs, backend=backend, cfg=cfg, scales=scales_of(inputs, tf, loss_scale),
              differentiable=("out",), oracle_call=ref)

    prop()


@pytest.mark.parametrize("engine", _backend_params())
def test_distillation_loss(engine, slow):
    backend = engine
    @_settings(backend, slow)
    @given(data=st.data())
    def prop(data):
        s, cfg, g, head, _ = _head_case(data.draw, backend)
        d_t = data.draw(st.integers(1, 6))
        teacher = make_head(g, s["lead"], s["v"], d_t, data.draw(st.sampled_from(REGIMES)),
                            _bias_kind(data.draw, s["v"]), cfg["dtype"])
        with_targets = data.draw(st.booleans())
        y = make_targets(g, head, s["lead"], s["v"], data.draw(st.sampled_from(IGNORE_KINDS)),
                         on_masked=data.draw(st.booleans()))
        _events(head, y)
        beta = data.draw(st.sampled_from((0.0, 1.0, 0.5, 0.1, 0.9)))
        temperature = data.draw(st.sampled_from((1.0, 1.0, 2.0, 0.5)))
        hard = data.draw(st.sampled_from((0.0, 0.0, 0.7))) if with_targets else 0.0
        soft = data.draw(st.sampled_from((1.0, 1.0, 0.3)))
        items = data.draw(st.sampled_from((None, None, 5, "tensor")))
        if items == "tensor":
            items = torch.tensor(2.0)
        opts = dict(beta=beta, temperature=temperature, hard_weight=hard, soft_weight=soft,
                    t_squared=data.draw(st.booleans()),
                    reduction=data.draw(st.sampled_from(("batchmean", "sum", "none"))), num_items_in_batch=items)
        inputs = dict(hidden=head.hidden, weight=head.weight, bias=head.bias, teacher_hidden=teacher.hidden,
                      teacher_weight=teacher.weight, teacher_bias=teacher.bias)
        if with_targets:
            inputs["targets"] = y

        def call(x):
            return fusedloss.distillation_loss(x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"],
                                               x.get("targets"), bias=x["bias"], teacher_bias=x["teacher_bias"],
                                               backend=backend, **opts)

        def ref(x, ocfg):
            return oracle.distillation_loss(x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"],
                                            x.get("targets"), bias=x["bias"], teacher_bias=x["teacher_bias"],
                                            cfg=ocfg, **opts)

        tf = dict(temperature=temperature)
        loss_scale = max(1.0, hard, soft * temperature ** 2)
        check("distillation_loss", call, inputs, backend=backend, cfg=cfg,
              scales=scales_of(inputs, tf, loss_scale, teacher_transform=tf),
              differentiable=("out",), oracle_call=ref)

    prop()


@pytest.mark.parametrize("engine", _backend_params())
def test_grpo_loss(engine, slow):
    backend = engine
    @_settings(backend, slow)
    @given(data=st.data())
    def prop(data):
        s, cfg, g, head, tf = _head_case(data.draw, backend, lead2_only=True)
        b, c = s["lead"]
        ids = make_targets(g, head, s["lead"], s["v"], "none")
        mask_kind = data.draw(st.sampled_from(("bool", "int", "float", "fractional", "none_masked", "all_masked")))
        keep = torch.rand(b, c, generator=g) < 0.7
        if mask_kind == "none_masked":
            keep[:] = True
        elif mask_kind == "all_masked":
            keep[:] = False
        mask = {"bool": keep, "int": keep.long(), "float": keep.double(),
                "fractional": keep.double() * torch.tensor([1.0, 0.5, 0.25])[torch.randint(0, 3, (b, c), generator=g)]
                }.get(mask_kind, keep)
        ids = torch.where(keep, ids, torch.full_like(ids, -1))  # padding ids outside the mask are never read
        garbage = data.draw(st.booleans())  # NaN / inf in per-token inputs outside the mask

        def per_token(t):
            return torch.where(keep, t, torch.full_like(t, math.nan)) if garbage else t

        adv = torch.randn(b, generator=g, dtype=F64) if data.draw(st.booleans()) else \
            per_token(torch.randn(b, c, generator=g, dtype=F64))
        if data.draw(st.booleans()):
            adv[0] = 0.0  # a silent group: no gradient for its rows
        inputs = dict(hidden=head.hidden, weight=head.weight, bias=head.bias, completion_ids=ids, advantages=adv,
                      completion_mask=mask)
        lp_scale = -0.5 * torch.rand(b, c, generator=g, dtype=F64)
        if data.draw(st.booleans()):
            inputs["old_logprobs"] = per_token(lp_scale - 1.0)
        beta = data.draw(st.sampled_from((0.0, 0.0, 0.04, -0.1)))
        if beta != 0.0:
            inputs["ref_logprobs"] = per_token(lp_scale - 0.8)
        weights = data.draw(st.sampled_from((None, "b", "b1", "bc")))
        if weights is not None:
            w = torch.rand(b, generator=g, dtype=F64) + 0.5
            inputs["importance_weights"] = {"b": w, "b1": w[:, None],
                                            "bc": per_token(torch.rand(b, c, generator=g, dtype=F64) + 0.5)}[weights]
        loss_type = data.draw(st.sampled_from(("grpo", "bnpo", "dr_grpo", "dapo", "cispo")))
        level = data.draw(st.sampled_from(("token", "sequence")))
        items = data.draw(st.sampled_from((None, None, 0, 7, "tensor")))
        opts = dict(tf, loss_type=loss_type, epsilon_low=data.draw(st.sampled_from((0.2, 0.0, 5.0))),
                    epsilon_high=data.draw(st.sampled_from((None, 0.28, 3.0))),
                    delta=data.draw(st.sampled_from((None, None, 1.5))), beta=beta,
                    importance_sampling_level=level,
                    max_completion_length=data.draw(st.sampled_from((None, c + 2))),
                    num_items_in_batch=torch.tensor(5) if items == "tensor" else items,
                    num_processes=data.draw(st.sampled_from((1, 2))),
                    return_details=data.draw(st.booleans()))
        optional = ("old_logprobs", "ref_logprobs", "importance_weights")

        def call(x):
            return fusedloss.grpo_loss(x["hidden"], x["weight"], x["completion_ids"], x["advantages"],
                                       x["completion_mask"], bias=x["bias"], backend=backend,
                                       **{k: x[k] for k in optional if k in x}, **opts)

        def ref(x, ocfg):
            return oracle.grpo_loss(x["hidden"], x["weight"], x["completion_ids"], x["advantages"],
                                    x["completion_mask"], bias=x["bias"], cfg=ocfg,
                                    **{k: x[k] for k in optional if k in x}, **opts)

        finite_adv = adv[torch.isfinite(adv)]
        largest = float(finite_adv.abs().max()) if finite_adv.numel() else 1.0
        loss_scale = 2.0 * opts["num_processes"] * max(1.0, largest)
        check("grpo_loss", call, inputs, backend=backend, cfg=cfg, scales=scales_of(inputs, tf, loss_scale, rows=keep),
              differentiable=("out", "out0", "loss", "logprobs"), oracle_call=ref)

    prop()


@pytest.mark.parametrize("engine", _backend_params())
def test_dpo_loss(engine, slow):
    backend = engine
    @_settings(backend, slow)
    @given(data=st.data())
    def prop(data):
        s, cfg, g, head, tf = _head_case(data.draw, backend, lead2_only=True, even_rows=True)
        two_b, t = s["lead"]
        labels = make_targets(g, head, s["lead"], s["v"], "none")
        padding = data.draw(st.sampled_from(("left", "right", "random", "none", "empty_row")))
        pos = torch.arange(t)[None, :].expand(two_b, t)
        length = torch.randint(0, t + 1, (two_b, 1), generator=g)
        pad = {"left": pos < t - length, "right": pos >= length, "random": torch.rand(two_b, t, generator=g) < 0.3,
               "none": torch.zeros(two_b, t, dtype=torch.bool), "empty_row": pos >= 0}[padding]
        if padding == "empty_row":
            pad = pad & (torch.arange(two_b)[:, None] == 0)
        labels = torch.where(pad, torch.full_like(labels, -100), labels)
        pairs = two_b // 2
        loss_type = data.draw(st.sampled_from(("sigmoid", "ipo", "hinge", "robust")))
        smoothing = data.draw(st.sampled_from((0.0, 0.1, 0.3))) if loss_type in ("sigmoid", "robust") else 0.0
        beta = data.draw(st.sampled_from((0.1, 1.0, 1e-3)))
        inputs = dict(hidden=head.hidden, weight=head.weight, bias=head.bias, labels=labels,
                      ref_chosen_logps=-torch.rand(pairs, generator=g, dtype=F64) * 5,
                      ref_rejected_logps=-torch.rand(pairs, generator=g, dtype=F64) * 5)
        opts = dict(tf, beta=beta, loss_type=loss_type, label_smoothing=smoothing,
                    return_details=data.draw(st.booleans()))

        def call(x):
            return fusedloss.dpo_loss(x["hidden"], x["weight"], x["labels"], x["ref_chosen_logps"],
                                      x["ref_rejected_logps"], bias=x["bias"], backend=backend, **opts)

        def ref(x, ocfg):
            return oracle.dpo_loss(x["hidden"], x["weight"], x["labels"], x["ref_chosen_logps"],
                                   x["ref_rejected_logps"], bias=x["bias"], cfg=ocfg, **opts)

        check("dpo_loss", call, inputs, backend=backend, cfg=cfg,
              scales=scales_of(inputs, tf, max(1.0, t * (beta + 1.0 / beta if loss_type == "ipo" else 1.0))),
              differentiable=("out", "out0", "chosen_logps", "rejected_logps"),
              oracle_call=ref)

    prop()


@given(data=st.data())
@settings(max_examples=200, derandomize=True, database=None, deadline=None)
def test_group_advantages(data):
    group = data.draw(st.integers(1, 5))
    groups = data.draw(st.integers(0, 4))
    kind = data.draw(st.sampled_from(("binary", "normal", "int", "bool", "fp32", "silent")))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    n = group * groups
    r = {"binary": lambda: (torch.rand(n, generator=g) < 0.5).double(),
         "normal": lambda: torch.randn(n, generator=g, dtype=F64),
         "int": lambda: torch.randint(-3, 4, (n,), generator=g),
         "bool": lambda: torch.rand(n, generator=g) < 0.5,
         "fp32": lambda: torch.randn(n, generator=g),
         "silent": lambda: torch.ones(n, dtype=F64)}[kind]()
    opts = dict(scale=data.draw(st.sampled_from(("group", "batch", "none"))),
                drop_silent_groups=data.draw(st.booleans()), eps=data.draw(st.sampled_from((1e-4, 0.0, 0.5))),
                unbiased=data.draw(st.booleans()))
    got = fusedloss.group_advantages(r, group, **opts)
    want = oracle.group_advantages(r, group, **opts)
    tol = 1e-12 if r.dtype == F64 or kind in ("int", "bool", "binary") else 1e-6
    for name, a, e in zip(("advantages", "std", "keep"), got, want):
        if name == "keep":
            assert torch.equal(a, e), name
            continue
        if kind in ("int", "bool"):
            tol = 1e-6  # summed in fp32 (integer rewards are converted to fp32, as a trainer would)
        err = rel_err_floored(a, e, 1e-300)
        if e.numel() and not bool(torch.isfinite(e).all()):
            assert err == 0.0 or err <= tol, (name, opts, a, e)
        assert err <= tol, f"group_advantages {kind} {opts}: {name} error {err:.2e}\n got {a}\nwant {e}"


@pytest.mark.parametrize("engine", _backend_params())
def test_a_rows_gradient_does_not_depend_on_the_other_rows(engine, slow):
    backend = engine
    """The gradient reaching the hidden state of a row, and that row's share of d weight, is the same whether
    or not the other rows carry gradient (the backward must recompute the forward's logits to the bit)."""
    @_settings(backend, slow)
    @given(data=st.data())
    def prop(data):
        dtype = data.draw(st.sampled_from((F64, torch.float32) if backend != "cuda" else (torch.float32,)))
        n, v, d = data.draw(st.integers(2, 9)), data.draw(st.sampled_from((5, 13, 37))), data.draw(st.integers(2, 8))
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
        head = make_head(g, (n,), v, d, "peaked", "none", dtype)
        y = make_targets(g, head, (n,), v, "some")
        y[0] = int((head.hidden[0] @ head.weight.T).argmax())
        tiles = data.draw(st.sampled_from((None, (2, 3), (1, 4)))) if backend == "torch" else None
        grad_in_forward = data.draw(st.sampled_from(("0", None)))
        h = head.hidden.to(dtype).to(_device(backend)).requires_grad_(True)
        w = head.weight.to(dtype).to(_device(backend))
        with configured(backend, grad_in_forward, tiles):
            logp, ent = fusedloss.token_logprobs(h, w, y.to(h.device), return_entropy=True, backend=backend)
            alone = torch.autograd.grad(logp[0] + 0.5 * ent[0], h, retain_graph=True)[0][0]
            weights = torch.rand(n, generator=g, dtype=F64).to(logp.dtype).to(h.device)
            weights[0] = 1.0
            together = torch.autograd.grad((weights * (logp + 0.5 * ent)).sum(), h)[0][0]
        assert torch.equal(alone, together), f"row 0's gradient changed: {alone} vs {together}"

    prop()


# --------------------------------------------------------------------------------------------------
# Autocast, compile


def _autocast_case(fn: str):
    g = torch.Generator().manual_seed(11)
    h = torch.randn(4, 4, 32, generator=g) * 2
    w = torch.randn(53, 32, generator=g)
    b = torch.randn(53, generator=g)
    ids = torch.randint(0, 53, (4, 4), generator=g)
    mask = torch.rand(4, 4, generator=g) < 0.8
    adv = torch.randn(4, generator=g)
    old = -torch.rand(4, 4, generator=g) - 1.0
    if fn == "cross_entropy":
        return (h, w, b), lambda m, h, w, b, **kw: m.cross_entropy(h, w, torch.where(mask, ids, -100), bias=b, **kw)
    return (h, w, b), lambda m, h, w, b, **kw: m.grpo_loss(h, w, ids, adv, mask, old_logprobs=old, bias=b, **kw)


@pytest.mark.parametrize("grad_in_forward", ["1", "0"])
@pytest.mark.parametrize("fn", ["cross_entropy", "grpo_loss"])
def test_autocast_bf16_is_no_worse_than_the_naive_autocast_path(fn, grad_in_forward, monkeypatch):
    """Under CPU bf16 autocast the loss and every gradient are no further from float64 than the naive path
    (materialised logits under the same autocast), plus one bf16 rounding."""
    monkeypatch.setenv("FUSEDLOSS_GRAD_IN_FORWARD", grad_in_forward)
    tensors, run = _autocast_case(fn)
    leaves64 = [t.double().requires_grad_() for t in tensors]
    want = run(oracle, *leaves64)
    want_grads = torch.autograd.grad(want, leaves64)
    results = {}
    for name in ("fused", "naive"):
        leaves = [t.clone().requires_grad_() for t in tensors]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(fusedloss, *leaves, backend="torch") if name == "fused" else run(oracle_naive, *leaves)
        grads = torch.autograd.grad(loss, leaves)
        results[name] = [rel_err_floored(a, e, 1e-30) for a, e in zip((loss, *grads), (want, *want_grads))]
    for what, f, n in zip(("loss", "d hidden", "d weight", "d bias"), results["fused"], results["naive"]):
        assert f <= n + 1e-3, f"{fn} under bf16 autocast: {what} error {f:.2e} > naive {n:.2e}"


class _NaiveModule:
    """The plain trainer's way: materialised logits (F.linear, which autocast casts), then the loss."""

    @staticmethod
    def cross_entropy(h, w, y, *, bias=None):
        z = torch.nn.functional.linear(h, w, bias).float() if h.dtype != F64 else h @ w.T + bias
        return torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100)

    @staticmethod
    def grpo_loss(h, w, ids, adv, mask, *, old_logprobs, bias=None):
        z = torch.nn.functional.linear(h, w, bias)
        z = z.float() if h.dtype != F64 else z
        logp = torch.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)
        acc = logp.dtype
        ratio = torch.exp(logp - old_logprobs.to(acc))
        a = adv.to(acc)[:, None]
        per_token = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a)
        m = mask.to(acc)
        return (per_token * m).sum() / m.sum().clamp(min=1.0)


oracle_naive = _NaiveModule()


def test_compiled_training_step_matches_the_oracle():
    """torch.compile(fullgraph=True) of a training step mixing three losses (graph breaks are errors)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    head = make_head(g, (2, 3), 13, 4, "peaked", "masked", torch.float32)
    teacher = make_head(g, (2, 3), 13, 3, "normal", "random", torch.float32)
    y = make_targets(g, head, (2, 3), 13, "some")
    adv = torch.randn(2, generator=g, dtype=F64)

    def step(m, h, w, b, **kw):
        ce = m.cross_entropy(h, w, y, bias=b, label_smoothing=0.1, **kw)
        kd = m.distillation_loss(h, w, teacher.hidden.to(h.dtype), teacher.weight.to(h.dtype), y, beta=0.5, bias=b,
                                 teacher_bias=teacher.bias.to(h.dtype), **kw)
        pg = m.grpo_loss(h, w, y.clamp(min=0), adv.to(h.dtype), y >= 0, bias=b, **kw)
        return ce + kd + pg

    compiled = torch.compile(lambda h, w, b: step(fusedloss, h, w, b, backend="torch"), fullgraph=True,
                             backend="aot_eager")
    leaves = [t.float().requires_grad_() for t in head]
    loss = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    ref_leaves = [t.requires_grad_() for t in (head.hidden.clone(), head.weight.clone(), head.bias.clone())]
    want = step(oracle, *ref_leaves)
    want_grads = torch.autograd.grad(want, ref_leaves)
    assert rel_err_floored(loss, want, 1e-30) <= 1e-5
    for name, a, e in zip(("hidden", "weight", "bias"), grads, want_grads):
        assert rel_err_floored(a, e, 1e-30) <= 1e-5, name
    torch._dynamo.reset()
