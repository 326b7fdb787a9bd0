"""FSDP2 training steps of a tiny model (gloo, CPU) with fusedloss equal to the same step without it.

The model's head is its own FSDP2 unit; each rank holds other tokens. The reference step computes the
logits in the model's forward and ``F.cross_entropy``; the fused steps take the hidden states and the head
three ways: the sharded DTensor weight gathered by fusedloss (once in the forward, once in the backward),
``fsdp_vocab_parallel=True`` (the head never gathered), and ``call_in_forward`` (inside the head's FSDP
forward, FSDP gathers). After one SGD step every parameter of every model must agree to 1e-11 (float64).
The head has padding rows past ``vocab_size`` and an odd vocabulary, so the shards are uneven.
"""

from __future__ import annotations

import _distributed_harness as harness
import pytest
import torch
import torch.nn.functional as F
from _errors import max_rel_err

import fusedloss

F64 = torch.float64
MODULE = __name__
V, PAD, D, TOKENS = 13, 3, 8, (3, 5)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.body = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V + PAD)

    def forward(self, x, hidden_only=False):
        h = torch.tanh(self.body(self.emb(x)))
        return h if hidden_only else self.head(h)


def _model(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny().to(F64)
    with torch.no_grad():
        model.head.weight.mul_(4.0)  # peaked rows; padding rows that would matter if counted
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank, seed=0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    x = torch.randint(0, V, TOKENS, generator=g)
    y = torch.randint(0, V, TOKENS, generator=g)
    y[0, : rank + 1] = -100  # ranks hold different numbers of valid tokens
    return x, y


def check_step(rank, world, *, mode, loss="cross_entropy"):
    """Parameters after one SGD step, and the number of head gathers of the fused loss."""
    from fusedloss.distributed import fsdp

    model = _model(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _batch(rank)
    gathers = []
    original = fsdp._gather_head
    fsdp._gather_head = lambda *a: gathers.append(1) or original(*a)
    try:
        if mode == "reference":
            out = F.cross_entropy(model(x)[..., :V].reshape(-1, V), y.reshape(-1))
        else:
            h = model(x, hidden_only=True)

            def fused(hidden, weight, bias, **kw):
                if loss == "grpo":
                    mask = (y >= 0).to(torch.int64)
                    adv = torch.linspace(-1.0, 1.0, TOKENS[0], dtype=F64) * (rank + 1)
                    return fusedloss.grpo_loss(hidden, weight, y.clamp(min=0), adv, mask, bias=bias, vocab_size=V,
                                               loss_type="bnpo", beta=0.0, **kw)
                return fusedloss.cross_entropy(hidden, weight, y, bias=bias, vocab_size=V, **kw)

            if mode == "call_in_forward":
                out = fsdp.call_in_forward(model.head, lambda hh: fused(hh, model.head.weight, model.head.bias), h)
            else:
                out = fused(h, model.head.weight, model.head.bias, fsdp_vocab_parallel=mode == "vocab_parallel")
        out.backward()
    finally:
        fsdp._gather_head = original
    opt.step()
    params = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    return {"loss": out.detach(), "params": params, "gathers": len(gathers)}


MODES = ("gathered", "vocab_parallel", "call_in_forward")


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    checks = [("reference", MODULE, "check_step", dict(mode="reference"))]
    checks += [(mode, MODULE, "check_step", dict(mode=mode)) for mode in MODES]
    checks += [(f"grpo/{mode}", MODULE, "check_step", dict(mode=mode, loss="grpo")) for mode in MODES]
    return harness.run(2, checks, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("mode", MODES)
def test_fused_step_equals_the_plain_fsdp_step(steps, mode):
    for rank in range(2):
        ref = harness.value(steps, "reference", rank)
        got = harness.value(steps, mode, rank)
        assert float((got["loss"] - ref["loss"]).abs()) <= 1e-12 * float(ref["loss"].abs())
        assert max_rel_err(got["params"], ref["params"]) <= 1e-11
    # the step changed the head, including its uneven shards
    before = _model_params_before()
    assert max_rel_err(before, ref["params"]) > 1e-3


def _model_params_before():
    torch.manual_seed(0)
    model = Tiny().to(F64)
    with torch.no_grad():
        model.head.weight.mul_(4.0)
    return {k: v.detach() for k, v in model.named_parameters()}


def test_gathered_head_is_gathered_once_per_forward_and_once_per_backward(steps):
    assert harness.value(steps, "gathered", 0)["gathers"] == 2
    assert harness.value(steps, "vocab_parallel", 0)["gathers"] == 0


@pytest.mark.parametrize("mode", ("vocab_parallel", "call_in_forward"))
def test_grpo_step_agrees_across_fsdp_modes(steps, mode):
    for rank in range(2):
        ref = harness.value(steps, "grpo/gathered", rank)
        got = harness.value(steps, f"grpo/{mode}", rank)
        assert float((got["loss"] - ref["loss"]).abs()) <= 1e-12 * max(1.0, float(ref["loss"].abs()))
        assert max_rel_err(got["params"], ref["params"]) <= 1e-11
