"""``fusedloss.topk_logprobs``: a teacher's top-k log-probs from hidden states, against
``fusedloss.reference.topk_logprobs`` (materialised ``log_softmax``, a stable sort) in float64.

The tile sizes are shrunk (``small_tiles``) so that a vocabulary of tens of rows spans many tiles and row
chunks, and the running top-k is merged many times; the default tiles run too. Ties are built from
integer-valued heads, whose products are exact whatever the summation order, so that equal logits are equal
to the last bit on every backend and shard layout.
"""

from __future__ import annotations

import math

import _distributed_harness as harness
import pytest
import torch
import torch.distributed as dist

import fusedloss
from fusedloss import reference
from fusedloss.losses import topk as topk_module

F64 = torch.float64
MODULE = __name__


@pytest.fixture(params=["small", "default"])
def tiles(request, monkeypatch):
    if request.param == "small":
        monkeypatch.setattr(topk_module, "VOCAB_TILE", 7)
        monkeypatch.setattr(topk_module, "ROW_CHUNK", 3)
    return request.param


def head(n, d, v, *, seed=0, dtype=F64, leading=None, peaked=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*(leading or (n,)), d, generator=g, dtype=F64)
    w = torch.randn(v, d, generator=g, dtype=F64)
    b = torch.randn(v, generator=g, dtype=F64)
    if peaked:  # a few rows whose top logit stands ~40 above the rest
        flat = h.reshape(-1, d)
        for r in range(0, flat.shape[0], 2):
            flat[r] += 40.0 * w[(7 * r) % v] / w[(7 * r) % v].norm() ** 2
    return h.to(dtype), w.to(dtype), b.to(dtype)


def check_against_reference(got, ref, tol=1e-10):
    assert got.ids.dtype == torch.int64 and got.ids.shape == ref.ids.shape
    assert torch.equal(got.ids, ref.ids)
    finite = torch.isfinite(ref.logprobs)
    assert torch.equal(torch.isfinite(got.logprobs), finite)
    assert torch.equal(got.logprobs[~finite], ref.logprobs[~finite])
    assert (got.logprobs[finite] - ref.logprobs[finite]).abs().max().item() <= tol
    for name in ("lse", "entropy"):
        a, b = getattr(got, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert (a - b).abs().max().item() <= tol, name


TRANSFORMS = [dict(), dict(temperature=0.7), dict(softcap=3.0, logit_scale=1.3), dict(temperature=1.9, softcap=5.0)]


@pytest.mark.parametrize("k", [1, 5, 101])
@pytest.mark.parametrize("options", TRANSFORMS)
def test_float64_matches_the_reference(tiles, k, options):
    h, w, b = head(None, 12, 101, leading=(3, 5), peaked=True)  # a prime vocabulary, 3-D hidden
    got = fusedloss.topk_logprobs(h, w, k, bias=b, return_lse=True, return_entropy=True, **options)
    ref = reference.topk_logprobs(h, w, k, bias=b, return_lse=True, return_entropy=True, **options)
    assert got.logprobs.dtype == F64 and got.logprobs.shape == (3, 5, k) and got.lse.shape == (3, 5)
    check_against_reference(got, ref)


def test_confident_rows_keep_their_tail():
    """Rows whose top logit stands ~200 above the rest: the top-1 log-prob is ~0 and the others ~-200, each
    to float64 rounding (a log-prob formed as log(softmax) would be -inf or 0)."""
    h, w, b = head(6, 9, 37)
    w[:, :6] = 0.0
    for r in range(6):  # z_{5r} = 200 + the same random part as every other logit of row r
        w[5 * r, r] = 1.0
        h[r, r] = 200.0
    got = fusedloss.topk_logprobs(h, w, 4, return_lse=True, return_entropy=True)
    ref = reference.topk_logprobs(h, w, 4, return_lse=True, return_entropy=True)
    check_against_reference(got, ref)
    assert torch.equal(got.ids[:, 0], torch.arange(6) * 5)
    assert (got.logprobs[:, 1] < -100).all() and (got.logprobs[:, 0] > -1e-30).all()


def test_minus_inf_bias_entries_come_last_in_id_order(tiles):
    h, w, b = head(4, 8, 23)
    b[[2, 9, 10, 17]] = -math.inf
    got = fusedloss.topk_logprobs(h, w, 23, bias=b, return_entropy=True)
    ref = reference.topk_logprobs(h, w, 23, bias=b, return_entropy=True)
    check_against_reference(got, ref)
    assert torch.equal(got.ids[:, -4:], torch.tensor([2, 9, 10, 17]).expand(4, 4))
    assert torch.isneginf(got.logprobs[:, -4:]).all() and torch.isfinite(got.logprobs[:, :-4]).all()


def test_single_row_and_k_equal_to_the_vocabulary(tiles):
    h, w, b = head(1, 5, 13)
    got = fusedloss.topk_logprobs(h, w, 13, bias=b, return_lse=True)
    ref = reference.topk_logprobs(h, w, 13, bias=b, return_lse=True)
    check_against_reference(got, ref)
    assert sorted(got.ids[0].tolist()) == list(range(13))
    assert abs(got.logprobs.exp().sum().item() - 1.0) < 1e-12


def test_masked_rows(tiles):
    h, w, b = head(None, 6, 19, leading=(2, 4))
    mask = torch.tensor([[True, False, True, True], [False, False, False, True]])
    got = fusedloss.topk_logprobs(h, w, 3, bias=b, mask=mask, return_lse=True, return_entropy=True)
    ref = reference.topk_logprobs(h, w, 3, bias=b, mask=mask, return_lse=True, return_entropy=True)
    check_against_reference(got, ref)
    assert (got.ids[~mask] == -1).all() and torch.isneginf(got.logprobs[~mask]).all()
    assert (got.lse[~mask] == 0).all() and (got.entropy[~mask] == 0).all()
    none = fusedloss.topk_logprobs(h, w, 3, mask=torch.zeros(2, 4, dtype=torch.bool))
    assert (none.ids == -1).all() and torch.isneginf(none.logprobs).all()


def tied_head(dtype=F64):
    """Integer-valued hidden states and weight rows with duplicates: rows 3, 8, 14, 20 equal row 1, rows 11
    and 12 equal row 0, so their logits are equal exactly."""
    g = torch.Generator().manual_seed(3)
    h = torch.randint(-3, 4, (5, 6), generator=g).to(dtype)
    w = torch.randint(-3, 4, (23, 6), generator=g).to(dtype)
    w[1] = torch.tensor([3.0, -3.0, 3.0, -3.0, 3.0, -3.0])
    for r in (3, 8, 14, 20):
        w[r] = w[1]
    w[11] = w[0]
    w[12] = w[0]
    h[0] = 0.0  # every logit ties
    h[1] = w[1].sign()  # z_1 = 18 (and its copies') the row's maximum: other rows have entries below 3
    return h, w


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 23])
def test_ties_take_the_smaller_id_first(tiles, k):
    h, w = tied_head()
    got = fusedloss.topk_logprobs(h, w, k)
    ref = reference.topk_logprobs(h, w, k)
    check_against_reference(got, ref)
    assert torch.equal(got.ids[0], torch.arange(k))
    assert got.ids[1].tolist() == [1, 3, 8, 14, 20, *got.ids[1, 5:].tolist()][:k]
    # The rule itself, checked on the output: values non-increasing, ids increasing within a run of equal values.
    for row_v, row_i in zip(got.logprobs, got.ids):
        for j in range(k - 1):
            assert row_v[j] > row_v[j + 1] or (row_v[j] == row_v[j + 1] and row_i[j] < row_i[j + 1])


def test_every_backend_gives_the_same_result(backend, device):
    """Ties resolve alike on every backend. On the CPU the backends share their arithmetic to the bit; on a GPU
    the values come from different exponentials and sums (cuBLAS and torch vs Triton), so they agree to fp32
    rounding while the ids, integer logits with ties, stay identical."""
    h, w = (t.to(device) for t in tied_head(torch.float32))
    b = torch.linspace(-1, 1, 23, device=device)
    ref = fusedloss.topk_logprobs(h, w, 6, bias=b, return_lse=True, backend="torch")
    got = fusedloss.topk_logprobs(h, w, 6, bias=b, return_lse=True, backend=backend)
    assert torch.equal(got.ids, ref.ids)
    if device.type == "cpu":
        assert torch.equal(got.logprobs, ref.logprobs) and torch.equal(got.lse, ref.lse)
    else:
        torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(got.lse, ref.lse, rtol=2e-6, atol=2e-6)


def test_float32_within_the_naive_error(tiles):
    h, w, b = head(17, 32, 257, peaked=True, dtype=torch.float32)
    got = fusedloss.topk_logprobs(h, w, 8, bias=b, return_lse=True)
    exact = reference.topk_logprobs(h.double(), w.double(), 8, bias=b.double(), return_lse=True)
    assert got.logprobs.dtype == torch.float32
    assert torch.equal(got.ids, exact.ids)  # random data: no two logits within fp32 rounding of each other here
    assert (got.logprobs.double() - exact.logprobs).abs().max().item() < 1e-4
    assert (got.lse.double() - exact.lse).abs().max().item() < 1e-4


def test_bfloat16_no_worse_than_the_naive_path():
    """bf16 inputs: products in fp32 here, in bf16 on the naive path; both judged against float64 log-probs of
    the same (bf16) inputs, at the ids each returned."""
    h, w, b = head(33, 64, 131, peaked=True, dtype=torch.bfloat16)
    got = fusedloss.topk_logprobs(h, w, 10, bias=b)
    naive = reference.topk_logprobs(h, w, 10, bias=b)
    exact = torch.log_softmax(reference.logits(h.double(), w.double(), b.double()), dim=-1)
    assert got.logprobs.dtype == torch.float32
    err = (got.logprobs.double() - exact.gather(-1, got.ids)).abs().max().item()
    naive_err = (naive.logprobs.double() - exact.gather(-1, naive.ids)).abs().max().item()
    assert err <= naive_err and err < 1e-5
    top = exact.topk(10).values
    assert (exact.gather(-1, got.ids) - top).abs().max().item() <= naive_err  # the right ids, up to near-ties


def test_padding_rows_are_never_selected(tiles):
    h, w, b = head(4, 6, 17)
    w[13:] *= 50.0  # rows 13..16 would win every row were they counted
    got = fusedloss.topk_logprobs(h, w, 13, bias=b, vocab_size=13, return_lse=True)
    ref = reference.topk_logprobs(h, w[:13], 13, bias=b[:13], return_lse=True)
    check_against_reference(got, ref)
    with pytest.raises(ValueError, match="k must be"):
        fusedloss.topk_logprobs(h, w, 14, vocab_size=13)


@pytest.mark.parametrize("k", [0, -1, 18, 2.0, True, "3", None])
def test_bad_k_is_refused(k):
    h, w, _ = head(2, 3, 17)
    with pytest.raises(ValueError, match=r"^k must be"):
        fusedloss.topk_logprobs(h, w, k)


def test_bad_arguments_are_refused():
    h, w, _ = head(2, 3, 17)
    with pytest.raises(ValueError, match="backend"):
        fusedloss.topk_logprobs(h, w, 2, backend="nope")
    with pytest.raises(ValueError, match="backend='cuda'"):
        fusedloss.topk_logprobs(h, w, 2, backend="cuda")
    with pytest.raises(ValueError, match="mask"):
        fusedloss.topk_logprobs(h, w, 2, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="return_lse"):
        fusedloss.topk_logprobs(h, w, 2, return_lse=1)


def test_no_gradient_flows():
    h, w, b = head(3, 4, 11)
    h.requires_grad_()
    w.requires_grad_()
    out = fusedloss.topk_logprobs(h, w, 3, bias=b, return_lse=True, return_entropy=True)
    assert not any(t.requires_grad for t in out)


@pytest.mark.parametrize("k", [1, 5])
def test_round_trip_into_sparse_distillation(tiles, k):
    """Teacher top-k from its hidden states, fed to the student's sparse distillation, equals the pipeline on
    the teacher's materialised logits (log_softmax + topk)."""
    h_t, w_t, b_t = head(None, 10, 53, leading=(2, 6), seed=1, peaked=True)
    h_s, w_s, _ = head(None, 7, 53, leading=(2, 6), seed=2)
    top = fusedloss.topk_logprobs(h_t, w_t, k, bias=b_t, temperature=0.8)
    logq = torch.log_softmax(reference.logits(h_t, w_t, b_t, temperature=0.8), dim=-1)
    ref_lp, ref_ids = logq.topk(k, dim=-1)
    assert torch.equal(top.ids, ref_ids)
    targets = torch.randint(0, 53, (2, 6), generator=torch.Generator().manual_seed(4))
    kw = dict(beta=0.0, temperature=0.8, reduction="none")
    got = fusedloss.sparse_distillation_loss(h_s, w_s, top.ids, top.logprobs, targets, **kw)
    ref = fusedloss.sparse_distillation_loss(h_s, w_s, ref_ids, ref_lp, targets, **kw)
    assert (got - ref).abs().max().item() <= 1e-12
    assert got.abs().sum().item() > 0


# ---------------------------------------------------------------------------------------------------
# Vocabulary-parallel (gloo ranks on the CPU)

V_DIST, PAD_DIST = 23, 4


def sizes_for(layout, total, world):
    if layout == "uneven":
        base = [1, 10, 16][:world]
        base[-1] = total - sum(base[:-1])
        return base
    if layout == "empty_first":
        return [0] + [total // (world - 1) + (r < total % (world - 1)) for r in range(world - 1)]
    if layout == "padding_rank":  # the last rank holds only padding rows
        real = [V_DIST // (world - 1) + (r < V_DIST % (world - 1)) for r in range(world - 1)]
        return real + [total - V_DIST]
    raise ValueError(layout)


def check_sharded(rank, world, *, layout, k, dtype=F64, small=False):
    if small:
        topk_module.VOCAB_TILE, topk_module.ROW_CHUNK = 5, 2
    h, w = tied_head(dtype)
    b = torch.linspace(-0.5, 0.5, V_DIST).to(dtype)
    b[[4, 15]] = -math.inf
    g = torch.Generator().manual_seed(9)
    w = torch.cat((w, 40.0 * torch.randn(PAD_DIST, w.shape[1], generator=g).to(dtype)))
    b = torch.cat((b, torch.full((PAD_DIST,), 30.0, dtype=dtype)))
    mask = torch.tensor([True, True, False, True, True])
    sizes = sizes_for(layout, V_DIST + PAD_DIST, world)
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    kw = dict(mask=mask, return_lse=True, return_entropy=True, temperature=0.9)
    got = fusedloss.topk_logprobs(h, w[rows], k, bias=b[rows], process_group=dist.group.WORLD,
                                  vocab_size=V_DIST, **kw)
    single = fusedloss.topk_logprobs(h, w[:V_DIST], k, bias=b[:V_DIST], **kw)
    ref = reference.topk_logprobs(h.double(), w[:V_DIST].double(), k, bias=b[:V_DIST].double(), **kw)
    return {"got": got, "single": single, "ref": ref}


DIST_CASES = [(2, "uneven", 3, F64, False), (2, "uneven", 23, F64, True), (3, "uneven", 6, F64, True),
              (3, "empty_first", 1, torch.float32, False), (3, "padding_rank", 5, F64, True),
              (3, "uneven", 4, torch.float32, True)]


@pytest.fixture(scope="module", params=[2, 3])
def sharded_run(request, tmp_path_factory):
    world = request.param
    checks = [(f"{layout}-{k}-{dtype}-{small}", MODULE, "check_sharded",
               dict(layout=layout, k=k, dtype=dtype, small=small))
              for w_, layout, k, dtype, small in DIST_CASES if w_ == world]
    checks.append(("bad_k", MODULE, "check_sharded", dict(layout="uneven", k=V_DIST + 1)))
    return world, checks, harness.run(world, checks, tmp_path_factory.mktemp(f"topk{world}"))


def test_vocabulary_parallel_equals_the_single_device_call(sharded_run):
    world, checks, results = sharded_run
    for name, *_ in checks[:-1]:
        first = harness.value(results, name, 0)["got"]
        for rank in range(world):
            out = harness.value(results, name, rank)
            got, single, ref = out["got"], out["single"], out["ref"]
            for field in ("ids", "logprobs", "lse", "entropy"):  # the same on every rank, bit for bit
                assert torch.equal(getattr(got, field), getattr(first, field)), (name, rank, field)
            assert torch.equal(got.ids, single.ids) and torch.equal(got.ids, ref.ids), (name, rank)
            tol = 1e-12 if got.logprobs.dtype == F64 else 1e-5
            finite = torch.isfinite(ref.logprobs)
            assert torch.equal(torch.isfinite(got.logprobs), finite), name
            assert (got.logprobs.double() - ref.logprobs)[finite].abs().max().item() <= tol, name
            assert (got.lse.double() - ref.lse).abs().max().item() <= tol, name
            assert (got.entropy.double() - ref.entropy).abs().max().item() <= tol, name
            assert (got.ids[2] == -1).all() and got.ids.max() < V_DIST


def test_vocabulary_parallel_refuses_k_above_the_global_vocabulary(sharded_run):
    world, checks, results = sharded_run
    for rank in range(world):
        kind, message = results[rank]["bad_k"]["error"]
        assert kind == "ValueError" and message.startswith("k must be") and "[1, 23]" in message
