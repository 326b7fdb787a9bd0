"""kto_loss, orpo_loss and cpo_loss against TRL 1.16's own code (tests/_trl_oracle.py): ``KTOTrainer._compute_loss``
and the experimental ``ORPOTrainer`` / ``CPOTrainer.get_batch_loss_metrics``, in float64, loss, gradients and
every logged quantity; then on every backend against the reference; the nn modules; bad input.

TRL's batches are built unshifted (``[rows, L]`` ids, masks, ``[rows, L, D]`` hidden states); fusedloss gets
``hidden[:, :-1]`` and ``labels[:, 1:]``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from _errors import rel_err  # noqa: E402
from _harness import compare  # noqa: E402
from _trl_oracle import trl_cpo, trl_kto, trl_orpo  # noqa: E402
from conftest import FP32_TOL, fp64_tol, make_head  # noqa: E402
from test_losses_grpo import ALL_BACKENDS, _backend  # noqa: E402

import fusedloss  # noqa: E402
import fusedloss.nn  # noqa: E402
from fusedloss import reference  # noqa: E402

F64 = torch.float64
L, D, V = 8, 11, 37


def sequences(rows, seed, *, bias=False, min_len=1):
    """``[rows, L]`` ids, prompt (2-3 tokens) / completion / padding masks, ``[rows, L, D]`` hidden states."""
    h, w, b, _ = make_head(0, D, V, leading=(rows, L), bias=bias, seed=seed)
    g = torch.Generator().manual_seed(seed + 5)
    ids = torch.randint(0, V, (rows, L), generator=g)
    prompt = torch.randint(2, 4, (rows,), generator=g)
    length = torch.randint(min_len, L - 3, (rows,), generator=g)
    pos = torch.arange(L)[None, :]
    completion = ((pos >= prompt[:, None]) & (pos < (prompt + length)[:, None])).long()
    attention = (pos < (prompt + length)[:, None]).long()
    return h, w, b, ids, completion, attention


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def _details_matching_trl(name, fused, ref, d, call, loss, trl_leaves):
    """Call the fused (torch backend) and the reference loss, with and without details, on fresh leaves of
    ``d``'s hidden, weight and bias (``call(fn, full, weight, bias, **options)``); assert each loss equals TRL's
    ``loss`` to 1e-12 and its gradients TRL's ``trl_leaves``' to 1e-10; yield ``(label, details)`` for the
    caller's checks of the logged quantities."""
    for impl, fn, extra in (("fused", fused, dict(backend="torch")), ("reference", ref, {})):
        for details in (False, True):
            full, w, b = _leaf(d["h"]), _leaf(d["w"]), _leaf(d["b"])
            out = call(fn, full, w, b, **extra, return_details=details)
            got, det = out if details else (out, None)
            label = (name, impl, details)
            assert rel_err(got, loss) < 1e-12, (label, got.item(), loss.item())
            got.backward()
            _assert_grads(full, w, b, *trl_leaves, label)
            if det is not None:
                yield label, det


def _assert_grads(full, weight, bias, trl_full, trl_weight, trl_bias, label, tol=1e-10):
    assert rel_err(full.grad, trl_full.grad) <= tol, (label, "hidden")
    assert rel_err(weight.grad, trl_weight.grad) <= tol, (label, "weight")
    if bias is not None:
        assert rel_err(bias.grad, trl_bias.grad) <= tol, (label, "bias")


# --------------------------------------------------------------------------------------------------
# KTO

ROWS = 6


def kto_batch(seed=0, bias=False):
    h, w, b, ids, completion, _ = sequences(ROWS, seed, bias=bias)
    # TRL's KL pairs: each prompt with the previous row's completion (its rotation by one), scored by the
    # same model: other hidden states of the same shape here.
    h_kl, _, _, ids_kl, completion_kl, _ = sequences(ROWS, seed + 100)
    g = torch.Generator().manual_seed(seed + 9)
    label = torch.tensor([True, False, True, True, False, False])
    labels = ids.masked_fill(completion == 0, -100)
    policy = reference.token_logprobs(h[:, :-1], w, labels[:, 1:], bias=b).sum(-1).detach()
    ref_logps = policy + 0.8 * torch.randn(ROWS, generator=g, dtype=F64)
    labels_kl = ids_kl.masked_fill(completion_kl == 0, -100)
    kl_policy = reference.token_logprobs(h_kl[:, :-1], w, labels_kl[:, 1:], bias=b).sum(-1).detach()
    ref_kl_logps = kl_policy - 0.5 + 0.3 * torch.randn(ROWS, generator=g, dtype=F64)  # mean gap > 0: z0 > 0
    return dict(h=h, w=w, b=b, ids=ids, completion=completion, label=label, ref_logps=ref_logps, h_kl=h_kl,
                ids_kl=ids_kl, completion_kl=completion_kl, ref_kl_logps=ref_kl_logps)


def _kto_fused_args(d, full, weight, bias, with_pairs=True):
    labels = d["ids"].masked_fill(d["completion"] == 0, -100)
    kw = dict(bias=bias)
    if with_pairs:
        kw.update(kl_hidden=d["h_kl"][:, :-1], kl_labels=d["ids_kl"].masked_fill(d["completion_kl"] == 0, -100)[:, 1:],
                  ref_kl_logps=d["ref_kl_logps"])
    return (full[:, :-1], weight, labels[:, 1:], d["label"], d["ref_logps"]), kw


KTO_CASES = {
    "kto": dict(beta=0.1),
    "kto-weights": dict(beta=0.5, desirable_weight=1.33, undesirable_weight=0.7),
    "apo_zero_unpaired": dict(beta=0.3, loss_type="apo_zero_unpaired"),
    "kto-transforms": dict(beta=0.2, temperature=0.7, logit_scale=1.2, softcap=20.0),
}


@pytest.mark.parametrize("name", list(KTO_CASES))
def test_kto_matches_trl(name):
    options = dict(KTO_CASES[name])
    d = kto_batch(bias=name == "kto-transforms")
    head = {k: options.pop(k) for k in ("temperature", "logit_scale", "softcap") if k in options}
    trl_full, trl_w, trl_b = _leaf(d["h"]), _leaf(d["w"]), _leaf(d["b"])
    loss, metrics = trl_kto(trl_full, trl_w, d["completion"], d["ids"], d["label"], d["ref_logps"],
                            kl_full_hidden=d["h_kl"], kl_completion_mask=d["completion_kl"], kl_input_ids=d["ids_kl"],
                            ref_kl_logps=d["ref_kl_logps"], bias=trl_b, **head, **options)
    loss.backward()
    pairs = options.get("loss_type", "kto") == "kto"
    if pairs:
        assert metrics["kl"] > 0  # the reference point is active in this data

    def call(fn, full, w, b, **extra):
        args, kw = _kto_fused_args(d, full, w, b, with_pairs=pairs)
        return fn(*args, **kw, **head, **options, **extra)

    trl_leaves = (trl_full, trl_w, trl_b)
    for label, det in _details_matching_trl(name, fusedloss.kto_loss, reference.kto_loss, d, call, loss, trl_leaves):
        assert abs(det.kl.item() - metrics["kl"]) < 1e-12, label
        for key, mask in (("chosen", d["label"]), ("rejected", ~d["label"])):
            assert abs(det.rewards[mask].mean().item() - metrics[f"rewards/{key}"]) < 1e-10, (label, key)
            assert abs(det.logps[mask].mean().item() - metrics[f"logps/{key}"]) < 1e-10, (label, key)
            assert det.logps.requires_grad and not det.rewards.requires_grad


def test_kto_kl_passed_in_equals_the_pairs():
    """``kl=`` (e.g. after a cross-process mean) gives the same loss as the pairs that produce it."""
    d = kto_batch(seed=2)
    args, kw = _kto_fused_args(d, d["h"], d["w"], None)
    loss, det = fusedloss.kto_loss(*args, **kw, backend="torch", return_details=True)
    args, _ = _kto_fused_args(d, d["h"], d["w"], None, with_pairs=False)
    again = fusedloss.kto_loss(*args, kl=det.kl.item(), backend="torch")
    assert rel_err(again, loss) < 1e-14
    assert rel_err(fusedloss.kto_loss(*args, kl=det.kl, backend="torch"), loss) < 1e-14


def test_kto_pairs_carry_no_gradient():
    d = kto_batch(seed=3)
    h_kl = d["h_kl"].clone().requires_grad_(True)
    args, kw = _kto_fused_args(d, d["h"].clone().requires_grad_(True), d["w"], None)
    kw["kl_hidden"] = h_kl[:, :-1]
    fusedloss.kto_loss(*args, **kw, backend="torch").backward()
    assert h_kl.grad is None


# --------------------------------------------------------------------------------------------------
# ORPO and CPO: chosen rows, then rejected, of one length L


PAIRS = 3


def paired_batch(seed=0, bias=False):
    h, w, b, ids, completion, attention = sequences(2 * PAIRS, seed, bias=bias, min_len=2)
    labels = ids.masked_fill(completion == 0, -100)
    return dict(h=h, w=w, b=b, ids=ids, labels=labels, attention=attention)


def _paired_fused_args(d, full, weight, bias):
    return (full[:, :-1], weight, d["labels"][:, 1:]), dict(bias=bias)


# The paired losses' per-pair details and the TRL metric that logs their mean.
_PAIRED_MEANS = (("chosen_rewards", "rewards/chosen"), ("rejected_rewards", "rewards/rejected"),
                 ("chosen_logps", "logps/chosen"), ("rejected_logps", "logps/rejected"))

ORPO_CASES = {"orpo": dict(beta=0.1), "orpo-beta": dict(beta=0.7),
              "orpo-transforms": dict(beta=0.2, temperature=0.8, logit_scale=0.9, softcap=15.0)}


@pytest.mark.parametrize("name", list(ORPO_CASES))
def test_orpo_matches_trl(name):
    """TRL's NLL scores prompt and completion of the chosen rows (its labels are the input ids under the
    attention mask): fusedloss's ``nll_labels``."""
    options = dict(ORPO_CASES[name])
    d = paired_batch(bias=name == "orpo-transforms")
    head = {k: options.pop(k) for k in ("temperature", "logit_scale", "softcap") if k in options}
    trl_full, trl_w, trl_b = _leaf(d["h"]), _leaf(d["w"]), _leaf(d["b"])
    loss, metrics = trl_orpo(trl_full, trl_w, d["ids"], d["labels"], d["attention"], bias=trl_b, **head, **options)
    loss.backward()
    nll_labels = d["ids"].masked_fill(d["attention"] == 0, -100)[:, 1:]

    def call(fn, full, w, b, **extra):
        args, kw = _paired_fused_args(d, full, w, b)
        return fn(*args, **kw, nll_labels=nll_labels, **head, **options, **extra)

    trl_leaves = (trl_full, trl_w, trl_b)
    for label, det in _details_matching_trl(name, fusedloss.orpo_loss, reference.orpo_loss, d, call, loss,
                                            trl_leaves):
        for field, key in _PAIRED_MEANS:
            assert abs(getattr(det, field).mean().item() - metrics[key]) < 1e-12, (label, field)
        for field, key in (("log_odds_ratio", "log_odds_ratio"), ("log_odds_chosen", "log_odds_chosen"),
                           ("nll_loss", "nll_loss")):
            assert abs(getattr(det, field).item() - metrics[key]) < 1e-12, (label, field)


def test_orpo_without_nll_labels_scores_the_completion():
    """Liger's default (no nll_target): the NLL runs over the same labels as the odds."""
    d = paired_batch(seed=4)
    args, kw = _paired_fused_args(d, d["h"], d["w"], None)
    loss, det = fusedloss.orpo_loss(*args, **kw, backend="torch", return_details=True)
    labels = args[2]
    logp = reference.token_logprobs(args[0], args[1], labels)
    chosen = labels[:PAIRS] != -100
    assert abs(det.nll_loss.item() - (-logp[:PAIRS][chosen].mean().item())) < 1e-12
    want = reference.orpo_loss(*args, **kw)
    assert rel_err(loss, want) < 1e-12


@pytest.mark.parametrize("which", ALL_BACKENDS)
def test_orpo_pair_with_an_empty_completion_is_left_out(which, monkeypatch):
    """A pair whose chosen or rejected completion has no scored token has no odds (log(1 - e^0) = -inf, NaN in
    TRL): the mean log-sigmoid runs over the other pairs, finite with finite gradients; none left gives 0."""
    backend, device = _backend(which, monkeypatch)
    torch.manual_seed(7)
    v, d = 13, 8
    h = torch.randn(4, 3, d, dtype=F64, device=device)
    w = torch.randn(v, d, dtype=F64, device=device)
    labels = torch.tensor([[1, 2, 3], [-100, -100, -100], [4, 5, 6], [7, 8, -100]], device=device)  # pair 1 empty
    hh = h.clone().requires_grad_(True)
    loss, det = fusedloss.orpo_loss(hh, w, labels, beta=0.3, backend=backend, return_details=True)
    hidden_grad, = torch.autograd.grad(loss, hh)
    assert torch.isfinite(loss) and torch.isfinite(hidden_grad).all()
    _, kept = fusedloss.orpo_loss(h[[0, 2]], w, labels[[0, 2]], beta=0.3, backend=backend, return_details=True)
    assert abs(det.log_odds_ratio.item() - kept.log_odds_ratio.item()) < 1e-12
    assert abs(loss.item() - (det.nll_loss.item() - 0.3 * kept.log_odds_ratio.item())) < 1e-12
    assert rel_err(loss, reference.orpo_loss(h, w, labels, beta=0.3)) < 1e-12
    empty = torch.full_like(labels, -100)
    nothing = fusedloss.orpo_loss(hh, w, empty, beta=0.3, backend=backend)
    assert nothing.item() == 0.0 and torch.isfinite(torch.autograd.grad(nothing, hh)[0]).all()


def test_orpo_nll_labels_must_agree_with_labels():
    d = paired_batch(seed=5)
    args, kw = _paired_fused_args(d, d["h"], d["w"], None)
    nll = args[2].clone()
    i = int((nll[0] != -100).nonzero()[0])
    nll[0, i] = (nll[0, i] + 1) % V
    with pytest.raises(ValueError, match="nll_labels"):
        fusedloss.orpo_loss(*args, nll_labels=nll, backend="torch")


CPO_CASES = {
    **{lt: dict(loss_type=lt, beta=0.2) for lt in ("sigmoid", "hinge", "ipo", "simpo")},
    "sigmoid-smoothing": dict(loss_type="sigmoid", beta=0.2, label_smoothing=0.1),
    "simpo-smoothing-gamma": dict(loss_type="simpo", beta=2.0, simpo_gamma=0.8, label_smoothing=0.05),
    "simpo-no-bc": dict(loss_type="simpo", beta=2.0, cpo_alpha=0.0),
    "alphapo": dict(loss_type="simpo", beta=2.0, cpo_alpha=0.0, alpha=0.25),
    "alpha-sigmoid": dict(loss_type="sigmoid", beta=0.1, alpha=-0.05),
    "hinge-cpo-alpha": dict(loss_type="hinge", beta=0.1, cpo_alpha=0.3),
    "ipo-transforms": dict(loss_type="ipo", beta=0.5, temperature=1.3, logit_scale=0.8, softcap=12.0),
}


@pytest.mark.parametrize("name", list(CPO_CASES))
def test_cpo_matches_trl(name):
    options = dict(CPO_CASES[name])
    d = paired_batch(seed=7, bias=name == "ipo-transforms")
    head = {k: options.pop(k) for k in ("temperature", "logit_scale", "softcap") if k in options}
    trl_full, trl_w, trl_b = _leaf(d["h"]), _leaf(d["w"]), _leaf(d["b"])
    loss, metrics = trl_cpo(trl_full, trl_w, d["ids"], d["labels"], d["attention"], bias=trl_b, **head, **options)
    loss.backward()

    def call(fn, full, w, b, **extra):
        args, kw = _paired_fused_args(d, full, w, b)
        return fn(*args, **kw, **head, **options, **extra)

    trl_leaves = (trl_full, trl_w, trl_b)
    for label, det in _details_matching_trl(name, fusedloss.cpo_loss, reference.cpo_loss, d, call, loss, trl_leaves):
        for field, key in _PAIRED_MEANS:
            assert abs(getattr(det, field).mean().item() - metrics[key]) < 1e-11, (label, field)
        assert abs(det.nll_loss.item() - metrics["nll_loss"]) < 1e-12, label


# --------------------------------------------------------------------------------------------------
# Every backend against the reference

_harness_inputs = {
    "kto_loss": lambda: _kto_harness(kto_batch(seed=21, bias=True)),
    "orpo_loss": lambda: _paired_harness(paired_batch(seed=22, bias=True), nll=True),
    "cpo_loss": lambda: _paired_harness(paired_batch(seed=23, bias=True)),
}


def _kto_harness(d):
    labels = d["ids"].masked_fill(d["completion"] == 0, -100)
    return dict(hidden=d["h"][:, :-1], weight=d["w"], labels=labels[:, 1:], preference_labels=d["label"],
                ref_logps=d["ref_logps"], bias=d["b"], kl_hidden=d["h_kl"][:, :-1],
                kl_labels=d["ids_kl"].masked_fill(d["completion_kl"] == 0, -100)[:, 1:], ref_kl_logps=d["ref_kl_logps"])


def _paired_harness(d, nll=False):
    out = dict(hidden=d["h"][:, :-1], weight=d["w"], labels=d["labels"][:, 1:], bias=d["b"])
    if nll:
        out["nll_labels"] = d["ids"].masked_fill(d["attention"] == 0, -100)[:, 1:]
    return out


BACKEND_CASES = [("kto_loss", dict(beta=0.3)), ("kto_loss", dict(beta=0.2, loss_type="apo_zero_unpaired")),
                 ("orpo_loss", dict(beta=0.2)), ("cpo_loss", dict(loss_type="sigmoid", beta=0.1)),
                 ("cpo_loss", dict(loss_type="simpo", beta=2.0, alpha=0.25)),
                 ("cpo_loss", dict(loss_type="ipo", beta=0.5, cpo_alpha=0.5))]


def _case_id(case):
    fn, opt = case
    return f"{fn}-{opt.get('loss_type', '')}"


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", BACKEND_CASES, ids=_case_id)
@pytest.mark.parametrize("which", ALL_BACKENDS)
def test_backends(which, case, dtype, monkeypatch):
    backend, device = _backend(which, monkeypatch)
    fn, options = case
    compare(fn, _harness_inputs[fn](), dict(options, return_details=True), backend, dtype, device,
            fp64_tol(backend) if dtype == F64 else FP32_TOL)


@pytest.mark.parametrize("case", BACKEND_CASES[::2] + BACKEND_CASES[3:4], ids=_case_id)
@pytest.mark.parametrize("which", ALL_BACKENDS)
def test_backends_half(which, case, monkeypatch):
    backend, device = _backend(which, monkeypatch)
    fn, options = case
    for dtype in [torch.float16] + ([torch.bfloat16] if backend == "torch" or torch.cuda.is_available() else []):
        compare(fn, _harness_inputs[fn](), options, backend, dtype, device)


# --------------------------------------------------------------------------------------------------
# nn modules and bad input


def test_nn_modules_call_their_functions():
    d = paired_batch(seed=31)
    args, kw = _paired_fused_args(d, d["h"], d["w"], None)
    assert torch.equal(fusedloss.nn.CPOLoss(loss_type="simpo", cpo_alpha=0.0, backend="torch")(*args),
                       fusedloss.cpo_loss(*args, loss_type="simpo", cpo_alpha=0.0, backend="torch"))
    assert torch.equal(fusedloss.nn.ORPOLoss(beta=0.3, backend="torch")(*args),
                       fusedloss.orpo_loss(*args, beta=0.3, backend="torch"))
    k = kto_batch(seed=32)
    kargs, kkw = _kto_fused_args(k, k["h"], k["w"], None)
    assert torch.equal(fusedloss.nn.KTOLoss(beta=0.4, backend="torch")(*kargs, **kkw),
                       fusedloss.kto_loss(*kargs, **kkw, beta=0.4, backend="torch"))


@pytest.mark.parametrize("fn, options, match", [
    ("kto", dict(), "KL reference point"),
    ("kto", dict(kl=0.1, ref_kl_logps=torch.zeros(ROWS)), "either kl"),
    ("kto", dict(kl_labels=torch.zeros(ROWS, L - 1, dtype=torch.long)), "go together"),
    ("kto", dict(kl=0.0, loss_type="bco"), "loss_type"),
    ("kto", dict(kl=0.0, preference_labels=torch.ones(ROWS + 1, dtype=torch.bool)), "preference_labels"),
    ("kto", dict(kl=0.0, ref_logps=torch.zeros(ROWS, 2)), "ref_logps"),
    ("kto", dict(kl="0"), "kl"),
    ("orpo", dict(beta=float("inf")), "beta"),
    ("orpo", dict(hidden_rows=5), "2B"),
    ("cpo", dict(loss_type="alphapo"), "loss_type"),
    ("cpo", dict(beta=0.0), "beta"),
    ("cpo", dict(label_smoothing=1.0), "label_smoothing"),
])
def test_bad_input(fn, options, match):
    options = dict(options)
    if fn == "kto":
        d = kto_batch(seed=41)
        (h, w, labels, pl, ref), _ = _kto_fused_args(d, d["h"], d["w"], None, with_pairs=False)
        pl = options.pop("preference_labels", pl)
        ref = options.pop("ref_logps", ref)
        call = lambda: fusedloss.kto_loss(h, w, labels, pl, ref, backend="torch", **options)  # noqa: E731
    else:
        d = paired_batch(seed=42)
        (h, w, labels), _ = _paired_fused_args(d, d["h"], d["w"], None)
        rows = options.pop("hidden_rows", None)
        if rows is not None:
            h, labels = h[:rows], labels[:rows]
        func = fusedloss.orpo_loss if fn == "orpo" else fusedloss.cpo_loss
        call = lambda: func(h, w, labels, backend="torch", **options)  # noqa: E731
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# --------------------------------------------------------------------------------------------------
# torch.compile: one graph (fullgraph) for every catalogue loss, gradients as eager


def _compiled_matches_eager(fn, leaves):
    torch._dynamo.reset()
    try:
        want = fn(*leaves)
        want_grads = torch.autograd.grad(want, leaves)
        got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*leaves)
        got_grads = torch.autograd.grad(got, leaves)
    finally:
        torch._dynamo.reset()
    assert rel_err(got, want) < 1e-6
    for a, b in zip(got_grads, want_grads):
        assert rel_err(a, b) < 1e-6


def _f32(t):
    return t.detach().float().requires_grad_(True)


@pytest.mark.parametrize("options", [dict(loss_type="sapo", beta=0.04), dict(loss_type="vespo"),
                                     dict(loss_type="luspo", importance_sampling_level="sequence",
                                          off_policy_mask_threshold=0.1, top_entropy_quantile=0.4,
                                          entropy_coef=0.1, return_details=True)],
                         ids=["sapo", "vespo", "luspo-masks-details"])
def test_grpo_compiles_as_one_graph(options):
    from test_losses_grpo import grpo_data

    d = grpo_data()
    old, ref = d["old_logprobs"].float(), d["ref_logprobs"].float()

    def step(h, w):
        out = fusedloss.grpo_loss(h, w, d["completion_ids"], d["advantages"].float(), d["completion_mask"],
                                  old_logprobs=old, ref_logprobs=ref, backend="torch", **options)
        return out[0] + out[1].clip_ratio_low_min if isinstance(out, tuple) else out

    _compiled_matches_eager(step, (_f32(d["hidden"]), _f32(d["weight"])))


def test_preference_losses_compile_as_one_graph():
    d = paired_batch(seed=51)
    labels = d["labels"][:, 1:]
    nll = d["ids"].masked_fill(d["attention"] == 0, -100)[:, 1:]
    ref = torch.randn(PAIRS, generator=torch.Generator().manual_seed(0)) - 10
    k = kto_batch(seed=52)
    (_, _, k_labels, k_pref, k_ref), k_kw = _kto_fused_args(k, k["h"], k["w"], None)
    k_kw = {name: (t.float() if torch.is_floating_point(t) else t) for name, t in k_kw.items() if t is not None}
    steps = {
        "dpo": lambda h, w: fusedloss.dpo_loss(h, w, labels, ref, ref - 1, loss_type=["sigmoid", "aot", "sft"],
                                               ld_alpha=0.5, use_weighting=False, backend="torch"),
        "dpo-wpo": lambda h, w: fusedloss.dpo_loss(h, w, labels, ref, ref - 1, use_weighting=True, backend="torch"),
        "orpo": lambda h, w: fusedloss.orpo_loss(h, w, labels, nll_labels=nll, backend="torch"),
        "cpo": lambda h, w: fusedloss.cpo_loss(h, w, labels, loss_type="simpo", alpha=0.2, backend="torch"),
    }
    for fn in steps.values():
        _compiled_matches_eager(fn, (_f32(d["h"][:, :-1]), _f32(d["w"])))

    def kto(h, w):
        return fusedloss.kto_loss(h, w, k_labels, k_pref, k_ref.float(), backend="torch", **k_kw)

    _compiled_matches_eager(kto, (_f32(k["h"][:, :-1]), _f32(k["w"])))
