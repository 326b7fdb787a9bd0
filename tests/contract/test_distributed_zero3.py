"""DeepSpeed ZeRO-3 heads (gloo, CPU): a training step with fusedloss equals the same step without it.

The head is a ZeRO-3 parameter: outside its module's forward its data is an empty partition. fusedloss
gathers it for the forward and again for the backward (which recomputes the logits), keeps it gathered until
autograd has accumulated its gradient, and ZeRO-3's own hook reduces that gradient into the partitions.
Checked: the loss called with the partitioned parameter, and TRL's way (the integration's function called
inside ``GatheredParameters``, the backward outside it). Skipped, saying so, where DeepSpeed is not installed.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: the ZeRO-3 head path cannot be exercised here")

import _distributed_harness as harness  # noqa: E402
from _errors import max_rel_err  # noqa: E402
from test_distributed_fsdp import PAD, Tiny, V, _batch  # noqa: E402

MODULE = __name__


def check_step(rank, world, *, mode):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    import fusedloss
    from fusedloss.integrations import trl as trl_integration

    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.head.weight.mul_(4.0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                      config=config)
    head = engine.module.head
    x, y = _batch(rank)
    if mode == "reference":
        loss = F.cross_entropy(engine(x)[..., :V].reshape(-1, V), y.reshape(-1))
    elif mode == "fused":
        h = engine(x, hidden_only=True)
        partitioned = head.weight.numel() == 0  # ZeRO-3 really holds the head as an empty partition here
        loss = fusedloss.cross_entropy(h, head.weight, y, bias=head.bias, vocab_size=V)
    else:  # TRL: its function inside the gather, the backward after it (full head: no padding mask)
        h = engine(x, hidden_only=True).reshape(-1, Tiny().head.in_features)
        with deepspeed.zero.GatheredParameters([head.weight, head.bias]):
            logp = trl_integration.FusedChunkedLogProbFunction.apply(h, head.weight, head.bias,
                                                                     y.reshape(-1).clamp(min=0), 1.0)[0]
        loss = -(logp * (y.reshape(-1) >= 0)).sum() / (y >= 0).sum()
    if mode == "trl_reference":
        logits = engine(x).reshape(-1, V + PAD)
        logp = torch.log_softmax(logits, -1).gather(1, y.reshape(-1, 1).clamp(min=0)).squeeze(1)
        loss = -(logp * (y.reshape(-1) >= 0)).sum() / (y >= 0).sum()
    engine.backward(loss)
    engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"loss": loss.detach(), "params": params, "partitioned": mode != "fused" or partitioned}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    checks = [(mode, MODULE, "check_step", dict(mode=mode)) for mode in ("reference", "fused", "trl", "trl_reference")]
    return harness.run(2, checks, tmp_path_factory.mktemp("zero3"))


@pytest.mark.parametrize("mode,reference", [("fused", "reference"), ("trl", "trl_reference")])
def test_zero3_step_equals_the_plain_step(steps, mode, reference):
    for rank in range(2):
        ref = harness.value(steps, reference, rank)
        got = harness.value(steps, mode, rank)
        assert got["partitioned"]
        assert float((got["loss"] - ref["loss"]).abs()) <= 1e-6 * float(ref["loss"].abs())
        err = max_rel_err(got["params"], ref["params"])
        assert err <= 1e-6, err  # fp32: DeepSpeed trains in the parameters' dtype
