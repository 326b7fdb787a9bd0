"""Every loss on a vocabulary-parallel head, over gloo on the CPU, against the single-process result.

Each spawn (``_distributed_harness``) starts P ranks that run many checks; the tests below judge what each
rank returned. A check builds the same global problem on every rank (peaked rows, a prime vocabulary,
ignored rows, a bias, a teacher with another hidden size), gives each rank its contiguous rows of the
(possibly padded) head, runs the loss with ``process_group=`` and compares with the single-process call on
the unpadded head: every output, ``hidden.grad`` (complete on every rank), and this rank's rows of
``weight.grad`` / ``bias.grad`` (zero on padding rows). float64 within 1e-11 relative, float32 within 1e-5
of the float64 single-process result, and every output bitwise identical on every rank.

The fast subset (P = 2 and 3, a handful of layouts, every loss) runs by default; the full matrix (P = 2,
3, 4 x every layout x padded or not x float64 and float32) runs with ``-m slow``.
"""

from __future__ import annotations

import _distributed_harness as harness
import pytest
import torch
import torch.distributed as dist
from _errors import rel_err
from conftest import make_head, make_teacher

import fusedloss

F64 = torch.float64
MODULE = __name__
V, PAD, D, DT = 13, 3, 6, 5  # a prime vocabulary, 3 padding rows, student and teacher hidden sizes
LEADING = (4, 3)  # [B, T]: even B for DPO's chosen / rejected halves
LOSSES = ("token_logprobs", "cross_entropy", "cross_entropy_mean", "distill_forward", "distill_reverse",
          "distill_jsd", "grpo", "grpo_sequence", "dpo")
TOL = {F64: 1e-11, torch.float32: 1e-5}


# ---------------------------------------------------------------------------------------------------
# The global problem and its shards


def shard_sizes(kind: str, rows: int, world: int, vocab: int = V) -> list:
    """Rows of each rank, in rank order, for the layout conventions in the wild (and edge cases)."""
    def balanced(n, p):
        return [n // p + (r < n % p) for r in range(p)]

    if kind == "ceil":  # torch.chunk / DTensor Shard(0): the last ranks short or empty
        c = -(-rows // world)
        return [max(0, min(c, rows - r * c)) for r in range(world)]
    if kind == "balanced":
        return balanced(rows, world)
    if kind == "empty_first":
        return [0] + balanced(rows, world - 1)
    if kind == "padding_rank":  # the last rank holds only padding rows (its real rows: none)
        return balanced(vocab, world - 1) + [rows - vocab]
    if kind == "one_row":
        return [1] * (world - 1) + [rows - world + 1]
    raise ValueError(kind)


def problem(seed: int = 0) -> dict:
    """The global problem in float64 (every rank builds the same one). The weight has PAD rows past V with
    large random values: were they counted anywhere, the results would be far off."""
    g = torch.Generator().manual_seed(seed + 1000)
    h, w, b, y = make_head(None, D, V, seed=seed, leading=LEADING, bias=True, ignore_fraction=0.2)
    th, tw, tb = make_teacher(None, DT, V, seed=seed + 1, leading=LEADING, bias=True)
    pad = lambda t, k: torch.cat((t, 5.0 * torch.randn((PAD, *t.shape[1:]), generator=g, dtype=F64)))  # noqa: E731
    b_, c = LEADING
    mask = (torch.rand(LEADING, generator=g) > 0.25).to(torch.int64)
    mask[0] = 0  # a completion with no token
    ids = torch.randint(0, V, LEADING, generator=g)
    labels = torch.where(torch.rand(LEADING, generator=g) < 0.3, torch.full_like(ids, -100), ids)
    return dict(h=h, w=pad(w, 0), b=pad(b, 0), th=th, tw=pad(tw, 0), tb=pad(tb, 0), y=y, ids=ids, mask=mask,
                adv=torch.randn(b_, generator=g, dtype=F64), old=-torch.rand(LEADING, generator=g, dtype=F64) * 3,
                ref=-torch.rand(LEADING, generator=g, dtype=F64) * 3, labels=labels,
                ref_c=-torch.rand(b_ // 2, generator=g, dtype=F64) * 5,
                ref_r=-torch.rand(b_ // 2, generator=g, dtype=F64) * 5)


def call(loss: str, h, w, b, tw, tb, data: dict, **sharding) -> tuple:
    """The loss's outputs as a tuple of tensors (details included)."""
    y = data["y"]
    if loss == "token_logprobs":
        return fusedloss.token_logprobs(h, w, y, bias=b, temperature=0.7, return_entropy=True, **sharding)
    if loss == "cross_entropy":
        return (fusedloss.cross_entropy(h, w, y, bias=b, label_smoothing=0.1, z_loss=1e-3, softcap=20.0,
                                        logit_scale=1.3, reduction="none", **sharding),)
    if loss == "cross_entropy_mean":
        return (fusedloss.cross_entropy(h, w, y, bias=b, label_smoothing=0.2, temperature=1.7, **sharding),)
    th = data["th"]
    if loss == "distill_forward":
        return (fusedloss.distillation_loss(h, w, th, tw, y, beta=0.0, hard_weight=0.3, bias=b, teacher_bias=tb,
                                            reduction="none", **sharding),)
    if loss == "distill_reverse":
        return (fusedloss.distillation_loss(h, w, th, tw, y, beta=1.0, temperature=1.5, t_squared=True, bias=b,
                                            teacher_bias=tb, **sharding),)
    if loss == "distill_jsd":  # T != 1 with a hard term: a second statistics pass at T = 1
        return (fusedloss.distillation_loss(h, w, th, tw, y, beta=0.4, temperature=2.0, hard_weight=0.5, bias=b,
                                            teacher_bias=tb, reduction="none", **sharding),)
    if loss in ("grpo", "grpo_sequence"):
        kind = dict(loss_type="grpo", beta=0.04) if loss == "grpo" else dict(
            loss_type="dapo", importance_sampling_level="sequence")
        out, det = fusedloss.grpo_loss(h, w, data["ids"], data["adv"], data["mask"], old_logprobs=data["old"],
                                       ref_logprobs=data["ref"], bias=b, return_details=True, **kind, **sharding)
        return out, det.logprobs, det.entropy
    if loss == "dpo":
        out, det = fusedloss.dpo_loss(h, w, data["labels"], data["ref_c"], data["ref_r"], bias=b,
                                      return_details=True, **sharding)
        return out, det.chosen_logps, det.rejected_logps
    raise ValueError(loss)


def run_case(loss: str, data: dict, dtype, rows: slice, *, full: bool, backend: str = "torch", **sharding):
    """Outputs and gradients of ``loss`` on ``rows`` of the padded head (``full``: the single-process call on
    the real rows, no sharding). The objective weights every differentiable output with a fixed cotangent."""
    w_rows = slice(0, V) if full else rows
    leaves = {k: data[k][w_rows].to(dtype).clone().requires_grad_() for k in ("w", "b")}
    h = data["h"].to(dtype).clone().requires_grad_()
    frozen = {k: data[k][w_rows].to(dtype) for k in ("tw", "tb")}
    local = dict(data, th=data["th"].to(dtype), old=data["old"].to(dtype), ref=data["ref"].to(dtype),
                 adv=data["adv"].to(dtype), ref_c=data["ref_c"].to(dtype), ref_r=data["ref_r"].to(dtype))
    outs = call(loss, h, leaves["w"], leaves["b"], frozen["tw"], frozen["tb"], local, backend=backend, **sharding)
    g = torch.Generator().manual_seed(7)
    objective = sum((o * torch.randn(o.shape, generator=g, dtype=F64).to(o.dtype)).sum()
                    for o in outs if o.requires_grad)
    objective.backward()
    return [o.detach() for o in outs], (h.grad, leaves["w"].grad, leaves["b"].grad)


def padded_rows(grad: torch.Tensor, rows: slice) -> torch.Tensor:
    """The reference gradient of the real rows, zero-extended over the padding, cut to ``rows``."""
    full = torch.cat((grad, grad.new_zeros((PAD, *grad.shape[1:]))))
    return full[rows]


# ---------------------------------------------------------------------------------------------------
# Checks (run in every rank)


def check_loss(rank, world, *, loss, layout, dtype=F64, padded=True, explicit_start=False, reduce=True,
               backend="torch", seed=0):
    """One loss on one layout: relative errors against the single-process float64 result, and the outputs."""
    data = problem(seed)
    total = V + PAD
    sizes = shard_sizes(layout, total, world)
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    group = dist.group.WORLD
    sharding = dict(process_group=group, vocab_size=V if padded or total != V else None,
                    vocab_start=start if explicit_start else None, reduce_hidden_grad=reduce)
    if not padded:  # no padding rows: the head holds exactly V rows
        data = {k: (t[:V] if k in ("w", "b", "tw", "tb") else t) for k, t in data.items()}
        sizes = shard_sizes(layout, V, world)
        start = sum(sizes[:rank])
        rows = slice(start, start + sizes[rank])
        sharding["vocab_start"] = start if explicit_start else None
    outs, (dh, dw, db) = run_case(loss, data, dtype, rows, full=False, backend=backend, **sharding)
    ref_outs, (rdh, rdw, rdb) = run_case(loss, data, F64, rows, full=True)
    if not reduce:
        dist.all_reduce(dh, group=group)
    err = {f"out{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(outs, ref_outs))}
    err["hidden.grad"] = rel_err(dh, rdh)
    err["weight.grad"] = rel_err(dw, padded_rows(rdw, rows))
    err["bias.grad"] = rel_err(db, padded_rows(rdb, rows))
    result = {"err": err, "outs": outs, "rows": sizes[rank]}
    if dtype != F64:
        # The single-process run in the same dtype: its own error bounds what sharding may be held to.
        same_outs, (sdh, sdw, sdb) = run_case(loss, data, dtype, rows, full=True)
        single = {f"out{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(same_outs, ref_outs))}
        single["hidden.grad"] = rel_err(sdh, rdh)
        single["weight.grad"] = rel_err(padded_rows(sdw, rows), padded_rows(rdw, rows))
        single["bias.grad"] = rel_err(padded_rows(sdb, rows), padded_rows(rdb, rows))
        result["single_process_err"] = single
    return result


def check_metrics(rank, world, *, layout, dtype=F64):
    """The statistics no public loss returns whole (is_top1, log_sum_sq_probs, mean_logit over the logical
    vocabulary, row_max) from the vocabulary-parallel op, against the single-device op. Exact argmax ties
    sit across shard boundaries: weight row 11 copies row 2 and row 7 copies row 5, so their logits are
    equal to the last bit; an all-zero hidden row ties every column (argmax 0). No bias, so that it does."""
    from fusedloss.core import token_statistics
    from fusedloss.distributed import layout as layouts
    from fusedloss.distributed import vocab_parallel

    h, w, _, _ = make_head(9, D, V, seed=3)
    w[11] = w[2]
    w[7] = w[5]
    h[0] = 0.0
    h[1, :3] = 0.0
    h[1] = h[1] + 40.0 * w[2] / w[2].norm() ** 2  # z_2 = z_11 the clear maximum of this row
    y = torch.tensor([0, 2, 11, 5, 7, -1, 2, 11, 1])
    w = torch.cat((w, torch.randn(PAD, D, dtype=F64)))
    sizes = shard_sizes(layout, V + PAD, world)
    start = sum(sizes[:rank])
    lay = layouts.resolve(dist.group.WORLD, sizes[rank], None, V, torch.device("cpu"))
    real = lay.local_real_rows
    wants = dict(targets=y, want_entropy=True, want_extras=True, want_mean_logit=True)
    got = vocab_parallel.token_statistics(lay, h.to(dtype), w[start:start + real].to(dtype), backend="torch", **wants)
    ref = token_statistics(h, w[:V], backend="torch", **wants)
    names = ("lse", "logp", "entropy", "log_sum_sq_probs", "mean_logit", "row_max", "lse_lo")
    err = {n: rel_err(getattr(got, n), getattr(ref, n)) for n in names if n != "lse_lo"}
    return {"err": err, "is_top1": got.is_top1, "ref_is_top1": ref.is_top1,
            "lse_hi_lo": (got.lse.to(F64) + got.lse_lo.to(F64)) - (ref.lse + ref.lse_lo),
            "outs": [getattr(got, n) for n in names] + [got.is_top1]}


def check_backend(rank, world, *, backend, dtype, layout="ceil"):
    """Another backend on each rank's shard (Triton under its interpreter; the CUDA kernels' host twins on CPU
    tensors): rows whose target another rank holds reach the kernels with the NOT_HERE sentinel. Every
    statistic and gradient against the single-device float64 torch result."""
    from fusedloss.core import TeacherHead, token_statistics
    from fusedloss.core.problem import LogitTransform, Statistics
    from fusedloss.distributed import layout as layouts
    from fusedloss.distributed import vocab_parallel

    data = problem(5)
    n = LEADING[0] * LEADING[1]
    h, th, y = data["h"].reshape(n, D), data["th"].reshape(n, DT), data["y"].reshape(n)
    y = torch.where(y < 0, -1, y)
    sizes = shard_sizes(layout, V + PAD, world)
    start = sum(sizes[:rank])
    lay = layouts.resolve(dist.group.WORLD, sizes[rank], None, V, torch.device("cpu"))
    rows = slice(start, start + lay.local_real_rows)
    tf = LogitTransform(1.3, 0.9, 15.0)
    wants = dict(targets=y, transform=tf, want_entropy=True, want_kl_rev=True, want_extras=True)

    def run(hidden, weight, bias, teacher, stats_fn):
        hidden = hidden.clone().requires_grad_()
        weight = weight.clone().requires_grad_()
        bias = bias.clone().requires_grad_()
        stats = stats_fn(hidden, weight, bias=bias, teacher=teacher, **wants)
        g = torch.Generator().manual_seed(11)
        objective = sum((getattr(stats, k) * torch.randn(n, generator=g, dtype=F64).to(stats.lse.dtype)).sum()
                        for k in ("lse", "logp", "entropy", "kl_rev"))
        objective.backward()
        return stats, (hidden.grad, weight.grad, bias.grad)

    teacher = TeacherHead(th.to(dtype), data["tw"][rows].to(dtype), data["tb"][rows].to(dtype), 1.3, 1.1, 12.0)
    got, grads = run(h.to(dtype), data["w"][rows].to(dtype), data["b"][rows].to(dtype), teacher,
                     lambda *a, **k: vocab_parallel.token_statistics(lay, *a, backend=backend, **k))
    ref_teacher = TeacherHead(th, data["tw"][:V], data["tb"][:V], 1.3, 1.1, 12.0)
    ref, ref_grads = run(h, data["w"][:V], data["b"][:V], ref_teacher,
                         lambda *a, **k: token_statistics(*a, backend="torch", **k))
    names = ("lse", "logp", "entropy", "kl_rev", "log_sum_sq_probs", "is_top1", "lse_t", "row_max")
    err = {k: rel_err(getattr(got, k), getattr(ref, k)) for k in names}
    err.update({k: rel_err(g, r) for k, g, r in zip(("hidden.grad", "weight.grad", "bias.grad"), grads,
                                                      (ref_grads[0], ref_grads[1][rows], ref_grads[2][rows]))})
    return {"err": err, "outs": [getattr(got, k) for k in Statistics._fields]}


def check_misuse(rank, world, *, case):
    """A misuse must raise the same ValueError on every rank (never leave a rank waiting in a collective)."""
    data = problem(0)
    sizes = shard_sizes("balanced", V + PAD, world)
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    group = dist.group.WORLD
    h, w, y = data["h"], data["w"][rows], data["y"]
    if case == "target_in_padding":
        y = y.clone()
        y[1, 1] = V + 1
        fusedloss.cross_entropy(h, w, y, process_group=group, vocab_size=V)
    elif case == "shards_do_not_add_up":
        fusedloss.cross_entropy(h, w, y, process_group=group, vocab_start=start + (rank == world - 1))
    elif case == "vocab_size_too_large":
        fusedloss.cross_entropy(h, w, y, process_group=group, vocab_size=V + PAD + 1)
    elif case == "start_on_some_ranks":
        fusedloss.cross_entropy(h, w, y, process_group=group, vocab_start=start if rank == 0 else None)
    elif case == "teacher_sharded_differently":
        other = shard_sizes("one_row", V + PAD, world)
        t0 = sum(other[:rank])
        fusedloss.distillation_loss(h, w, data["th"], data["tw"][t0:t0 + other[rank]], y, process_group=group,
                                    vocab_size=V)
    else:
        raise AssertionError(case)
    return "no error"


def check_after_misuse(rank, world):
    """The group still works after every rank raised: a plain call goes through."""
    data = problem(1)
    sizes = shard_sizes("balanced", V, world)
    start = sum(sizes[:rank])
    w = data["w"][start:start + sizes[rank]]
    out = fusedloss.cross_entropy(data["h"], w, data["y"], process_group=dist.group.WORLD)
    return rel_err(out, fusedloss.cross_entropy(data["h"], data["w"][:V], data["y"]))


def check_dtensor(rank, world, *, padded=True):
    """A DTensor weight Shard(0) with a DTensor hidden Replicate is vocabulary-parallel by itself (offsets from
    the DTensor, torch.chunk's uneven and empty shards); gradients come back as DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    data = problem(2)
    mesh = init_device_mesh("cpu", (world,))
    rows = V + PAD if padded else V
    w = distribute_tensor(data["w"][:rows], mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(data["b"][:rows], mesh, [Shard(0)]).requires_grad_()
    h = distribute_tensor(data["h"], mesh, [Replicate()]).requires_grad_()
    out = fusedloss.cross_entropy(h, w, data["y"], bias=b, label_smoothing=0.1, reduction="none",
                                  vocab_size=V if padded else None)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    (out * cot).sum().backward()
    hr, wr, br = (data[k].clone().requires_grad_() for k in ("h", "w", "b"))
    ref = fusedloss.cross_entropy(hr, wr[:V], data["y"], bias=br[:V], label_smoothing=0.1, reduction="none")
    (ref * cot).sum().backward()
    chunk = -(-rows // world)
    local = slice(min(rows, rank * chunk), min(rows, (rank + 1) * chunk))
    return {"err": {"out": rel_err(out, ref), "hidden.grad": rel_err(h.grad.to_local(), hr.grad),
                    "weight.grad": rel_err(w.grad.to_local(), wr.grad[local]),
                    "bias.grad": rel_err(b.grad.to_local(), br.grad[local])},
            "plain_output": type(out) is torch.Tensor, "outs": [out.detach()]}


def check_compiled(rank, world):
    """torch.compile(fullgraph=True) of a step with a vocabulary-parallel loss: one graph, the eager result."""
    data = problem(4)
    sizes = shard_sizes("ceil", V + PAD, world)
    start = sum(sizes[:rank])
    group = dist.group.WORLD

    def step(h, w, y):
        return fusedloss.cross_entropy(h, w, y, process_group=group, vocab_size=V, label_smoothing=0.1)

    def grads(fn):
        h = data["h"].clone().requires_grad_()
        w = data["w"][start:start + sizes[rank]].clone().requires_grad_()
        loss = fn(h, w, data["y"])
        loss.backward()
        return loss.detach(), h.grad, w.grad

    eager = grads(step)
    compiled = grads(torch.compile(step, fullgraph=True, backend="aot_eager"))
    return {"err": {k: rel_err(a, e) for k, a, e in zip(("loss", "hidden.grad", "weight.grad"), compiled, eager)}}


def check_module(rank, world):
    """The nn modules take the same keywords and give the function's result."""
    import fusedloss.nn

    data = problem(6)
    sizes = shard_sizes("balanced", V + PAD, world)
    start = sum(sizes[:rank])
    w = data["w"][start:start + sizes[rank]]
    module = fusedloss.nn.LinearCrossEntropy(label_smoothing=0.1, process_group=dist.group.WORLD, vocab_size=V)
    got = module(data["h"], w, data["y"])
    return {"err": {"module": rel_err(got, fusedloss.cross_entropy(data["h"], data["w"][:V], data["y"],
                                                                   label_smoothing=0.1))}}


# ---------------------------------------------------------------------------------------------------
# Spawns (one per configuration) and the tests that judge them

FAST = {
    2: [("balanced", True, False), ("ceil", False, True)],
    3: [("empty_first", True, True), ("padding_rank", True, False)],
}
FAST_FP32 = ("cross_entropy", "distill_jsd", "grpo")
BACKEND_CHECKS = {2: [("triton", torch.float32), ("cuda", torch.float32)],
                  3: [("triton", F64), ("cuda", torch.float32)]}
MISUSE = ("target_in_padding", "shards_do_not_add_up", "vocab_size_too_large", "start_on_some_ranks",
          "teacher_sharded_differently")


def fast_checks(world: int) -> list:
    checks = []
    for layout, padded, explicit in FAST[world]:
        for loss in LOSSES:
            checks.append((f"{loss}/{layout}/{padded}/{explicit}", MODULE, "check_loss",
                           dict(loss=loss, layout=layout, padded=padded, explicit_start=explicit)))
    layout = FAST[world][0][0]
    for loss in FAST_FP32:
        checks.append((f"fp32/{loss}", MODULE, "check_loss", dict(loss=loss, layout=layout, dtype=torch.float32)))
    checks.append(("no_reduce", MODULE, "check_loss", dict(loss="grpo", layout=layout, reduce=False)))
    checks.append(("metrics", MODULE, "check_metrics", dict(layout="ceil" if world == 2 else "empty_first")))
    checks.append(("dtensor", MODULE, "check_dtensor", dict(padded=world == 3)))
    for case in MISUSE:
        checks.append((f"misuse/{case}", MODULE, "check_misuse", dict(case=case)))
    checks.append(("after_misuse", MODULE, "check_after_misuse", {}))
    checks.append(("compiled", MODULE, "check_compiled", {}))
    checks.append(("module", MODULE, "check_module", {}))
    for backend, dtype in BACKEND_CHECKS[world]:
        if fusedloss.backend_status()[backend] == "available" or backend == "cuda" and _cuda_host_twins():
            checks.append((f"backend/{backend}/{dtype}", MODULE, "check_backend", dict(backend=backend, dtype=dtype)))
    return checks


def _cuda_host_twins() -> bool:
    from fusedloss.backends.cuda import backend as cuda

    return cuda.extension_built()


@pytest.fixture(scope="module", params=sorted(FAST))
def fast_run(request, tmp_path_factory):
    world = request.param
    checks = fast_checks(world)
    return world, checks, harness.run(world, checks, tmp_path_factory.mktemp(f"dist{world}"), debug=world == 3)


def assert_equal_on_every_rank(results, name, world):
    first = harness.value(results, name, 0)["outs"]
    for r in range(1, world):
        other = harness.value(results, name, r)["outs"]
        for i, (a, b) in enumerate(zip(first, other)):
            assert torch.equal(a, b), f"{name}: output {i} differs between rank 0 and rank {r}"


def judge(results, name, world, tol):
    """Every relative error within ``tol``; in fp32, within twice the single-process fp32 run's own error on the
    same rows where even that exceeds ``tol`` (sharding must not lose what the run it replaces keeps)."""
    for r in range(world):
        got = harness.value(results, name, r)
        single = got.get("single_process_err", {})
        bad = {k: (e, single.get(k)) for k, e in got["err"].items() if not e <= max(tol, 2.0 * single.get(k, 0.0))}
        assert not bad, f"{name} rank {r}: relative errors (sharded, single-process) above {tol:.0e}: {bad}"


def test_every_loss_matches_the_single_process_result(fast_run):
    world, checks, results = fast_run
    names = [c[0] for c in checks if c[2] == "check_loss"]
    for name in names:
        judge(results, name, world, TOL[torch.float32] if name.startswith("fp32/") else TOL[F64])
        assert_equal_on_every_rank(results, name, world)


def test_layouts_exercise_empty_and_padding_only_shards(fast_run):
    world, checks, results = fast_run
    rows = {harness.value(results, f"token_logprobs/{layout}/{padded}/{explicit}", r)["rows"]
            for layout, padded, explicit in FAST[world] for r in range(world)}
    if world == 3:
        assert 0 in rows  # empty_first
        assert PAD in rows  # padding_rank: a rank holding padding rows only


def test_first_argmax_ties_across_shards_and_merged_metrics(fast_run):
    world, _, results = fast_run
    judge(results, "metrics", world, 1e-12)
    got = harness.value(results, "metrics", 0)
    assert torch.equal(got["is_top1"], got["ref_is_top1"])
    # the tie cases really are ties that argmax resolves by the first index
    assert got["ref_is_top1"].tolist() == [1.0, 1.0, 0.0, *got["ref_is_top1"].tolist()[3:]]
    assert float(got["lse_hi_lo"].abs().max()) < 1e-13
    assert_equal_on_every_rank(results, "metrics", world)


def test_hidden_grad_partial_sums_without_reduction(fast_run):
    world, _, results = fast_run
    judge(results, "no_reduce", world, TOL[F64])


def test_dtensor_weight_with_replicated_hidden_is_vocabulary_parallel(fast_run):
    world, _, results = fast_run
    judge(results, "dtensor", world, TOL[F64])
    assert harness.value(results, "dtensor", 0)["plain_output"]
    assert_equal_on_every_rank(results, "dtensor", world)


@pytest.mark.parametrize("case", MISUSE)
def test_misuse_raises_the_same_error_on_every_rank(fast_run, case):
    world, _, results = fast_run
    errors = [results[r][f"misuse/{case}"].get("error") for r in range(world)]
    assert all(e is not None and e[0] == "ValueError" for e in errors), errors
    assert len({e[1] for e in errors}) == 1, errors
    assert harness.value(results, "after_misuse", 0) < 1e-12


def test_compiled_step_matches_eager(fast_run):
    world, _, results = fast_run
    judge(results, "compiled", world, 1e-13)


def test_nn_module_takes_the_sharding_keywords(fast_run):
    world, _, results = fast_run
    judge(results, "module", world, 1e-12)


@pytest.mark.parametrize("kernels", ["triton", "cuda"])
def test_gpu_backends_on_shards(fast_run, kernels):
    world, checks, results = fast_run
    names = [c[0] for c in checks if c[0].startswith(f"backend/{kernels}/")]
    if not names:
        pytest.skip(f"{kernels}: {fusedloss.backend_status()[kernels]}")
    for name in names:
        judge(results, name, world, TOL[F64 if name.endswith("float64") else torch.float32])
        assert_equal_on_every_rank(results, name, world)


# ---------------------------------------------------------------------------------------------------
# One device: vocab_size without a process group (the weight's prefix; padding rows get zero gradient)


@pytest.mark.parametrize("loss", LOSSES)
def test_padded_vocabulary_on_one_device(loss):
    data = problem(8)
    rows = slice(0, V + PAD)
    outs, (dh, dw, db) = run_case(loss, data, F64, rows, full=False, vocab_size=V)
    ref, (rdh, rdw, rdb) = run_case(loss, data, F64, rows, full=True)
    for o, r in zip(outs, ref):
        assert torch.equal(o, r)
    assert torch.equal(dh, rdh) and torch.equal(dw[:V], rdw) and torch.equal(db[:V], rdb)
    assert not dw[V:].any() and not db[V:].any()


def test_padded_vocabulary_errors_on_one_device():
    data = problem(8)
    h, w, y = data["h"], data["w"], data["y"].clone()
    with pytest.raises(ValueError, match="vocab_size=17 but weight has only 16 rows"):
        fusedloss.cross_entropy(h, w, y, vocab_size=V + PAD + 1)
    with pytest.raises(ValueError, match="vocab_start=2 needs a process_group"):
        fusedloss.cross_entropy(h, w, y, vocab_start=2)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1"):
        fusedloss.cross_entropy(h, w, y, vocab_size=0)
    with pytest.raises(TypeError, match="reduce_hidden_grad must be a bool"):
        fusedloss.cross_entropy(h, w, y, reduce_hidden_grad=1)
    with pytest.raises(ValueError, match="fsdp_vocab_parallel=True needs weight to be an FSDP2-sharded DTensor"):
        fusedloss.cross_entropy(h, w, y, fsdp_vocab_parallel=True)
    y[0, 0] = V
    with pytest.raises(ValueError, match=rf"targets contains {V}, outside \[0, {V}\)"):
        fusedloss.cross_entropy(h, w, y, vocab_size=V)


# ---------------------------------------------------------------------------------------------------
# The full matrix (-m slow): P = 2, 3, 4 x every layout x padded or not x float64 and float32

SLOW_LAYOUTS = ("ceil", "balanced", "empty_first", "padding_rank", "one_row")


def slow_checks(world: int) -> list:
    checks = []
    for layout in SLOW_LAYOUTS:
        for padded in (True, False):
            if layout == "padding_rank" and not padded:
                continue
            for loss in LOSSES:
                for dtype in (F64, torch.float32):
                    explicit = (hash((layout, loss)) + world) % 2 == 1
                    checks.append((f"{loss}/{layout}/{padded}/{dtype}", MODULE, "check_loss",
                                   dict(loss=loss, layout=layout, padded=padded, dtype=dtype,
                                        explicit_start=explicit, seed=world)))
        checks.append((f"metrics/{layout}", MODULE, "check_metrics", dict(layout=layout)))
    checks.append(("dtensor/padded", MODULE, "check_dtensor", dict(padded=True)))
    checks.append(("dtensor/unpadded", MODULE, "check_dtensor", dict(padded=False)))
    return checks


@pytest.fixture(scope="module", params=(2, 3, 4))
def slow_run(request, tmp_path_factory):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full distributed matrix runs with -m slow (the fast subset above runs by default)")
    world = request.param
    checks = slow_checks(world)
    return world, checks, harness.run(world, checks, tmp_path_factory.mktemp(f"slow{world}"))


@pytest.mark.slow
def test_full_matrix(slow_run):
    world, checks, results = slow_run
    for name, _module, function, kwargs in checks:
        tol = TOL[kwargs.get("dtype", F64)] if function == "check_loss" else (1e-12 if function == "check_metrics"
                                                                             else TOL[F64])
        judge(results, name, world, tol)
        assert_equal_on_every_rank(results, name, world)
        if function == "check_metrics":
            got = harness.value(results, name, 0)
            assert torch.equal(got["is_top1"], got["ref_is_top1"])
