"""FSDP2 training steps of a tiny Hugging Face model (gloo, CPU, 2 ranks) through the transformers integration,
equal to the same steps without fusedloss.

The decoder layers and the LM head are FSDP units of their own, the root holds the embeddings and the final
norm; each rank holds other tokens, and FSDP averages the gradients over the ranks. One SGD step, float64,
then every parameter of every rank must agree with the step without fusedloss to 1e-10:

* ``patch(model)`` + ``model(input_ids, labels=labels).loss`` against the model's own loss (its logits'
  cross-entropy with the labels shifted, in float64: transformers' ForCausalLMLoss would round to fp32);
* ``causal_lm_logprobs(model, ...)`` (a masked mean of the log-probs as the loss) against the same loss from
  the model's own logits; the backbone runs inside the root's FSDP forward (its embeddings are sharded);
* the head in the root's unit (not its own): ``lm_head`` then reads the root's unsharded parameter.

And the reason the integration hands the DTensor to the core: gathering the head with ``full_tensor()``
before the loss (what ``lm_head`` did) leaves each rank's shard with its own tokens' gradient, not the
average FSDP takes, so its step differs (checked, so that this test can tell the two apart).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("torch.distributed.fsdp")

import _distributed_harness as harness  # noqa: E402
from _errors import max_rel_err, plain_rel_err  # noqa: E402

MODULE = __name__
F64 = torch.float64
V = 53  # prime: the head's shards are uneven over 2 ranks
SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=V, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)


def _model(world, *, patched: bool, head_unit: bool = True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fusedloss.integrations import transformers as fl_hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL), dtype=F64, attn_implementation="eager")
    with torch.no_grad():  # a peaked head, so that its gradient is far from uniform
        model.lm_head.weight[:3].mul_(6.0)
    if patched:
        fl_hf.patch(model, backend="torch")  # before wrapping, as its documentation says
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if head_unit:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank):
    g = torch.Generator().manual_seed(10 + rank)
    input_ids = torch.randint(3, V, (2, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -(2 + rank):] = 0  # ranks hold different numbers of real tokens
    input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return input_ids, attention_mask, labels


def _masked_mean_logp(logp, attention_mask):
    valid = attention_mask[:, 1:].to(logp.dtype)
    return -(logp * valid).sum() / valid.sum()


def check_step(rank, world, *, mode, head_unit=True):
    """Loss and parameters after one SGD step of ``mode``; the head's gradient before the step."""
    import fusedloss
    from fusedloss.integrations import transformers as fl_hf

    model = _model(world, patched=mode == "patch", head_unit=head_unit)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    input_ids, attention_mask, labels = _batch(rank)
    if mode == "patch":
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
    elif mode == "reference":  # the model's own causal-LM loss, in float64 (ForCausalLMLoss casts to fp32)
        logits = model(input_ids, attention_mask=attention_mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100)
    elif mode == "logprobs_reference":
        logits = model(input_ids, attention_mask=attention_mask).logits[:, :-1]
        logq = torch.log_softmax(logits, dim=-1)
        logp = logq.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        loss = _masked_mean_logp(logp, attention_mask)
    elif mode == "logprobs":
        logp = fl_hf.causal_lm_logprobs(model, input_ids, attention_mask, backend="torch")
        loss = _masked_mean_logp(logp, attention_mask)
    elif mode == "full_tensor":  # the gather lm_head used to do: a plain copy of the head
        hidden = fl_hf.last_hidden_state(model, input_ids, attention_mask)[:, :-1]
        weight = model.lm_head.weight.full_tensor()
        targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
        logp = fusedloss.token_logprobs(hidden, weight, targets, backend="torch")
        loss = _masked_mean_logp(logp, attention_mask)
    else:
        raise ValueError(mode)
    head_is_dtensor = type(fl_hf.lm_head(model).weight).__name__ == "DTensor"
    return dict(_step(model, opt, loss), head_is_dtensor=head_is_dtensor)


def _step(model, opt, loss) -> dict:
    """Backward and one optimizer step: the loss, the head's gradient and every parameter after the step,
    gathered where FSDP2 shards them."""
    loss.backward()
    head_grad = model.lm_head.weight.grad
    head_grad = head_grad.full_tensor() if hasattr(head_grad, "full_tensor") else head_grad
    opt.step()
    params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
              for name, p in model.named_parameters()}
    return {"loss": loss.detach(), "params": params, "head_grad": head_grad.detach()}


def check_trl_step(rank, world, *, fused: bool, head_unit: bool):
    """One step of TRL's fused-head forward (``add_fused_lm_head``, the loss its trainers take) with TRL's own
    kernel or, under ``integrations.trl.enable()``, fusedloss's."""
    from trl.trainer.utils import add_fused_lm_head

    from fusedloss.integrations import trl as fl_trl

    model = _model(world, patched=False, head_unit=head_unit)
    add_fused_lm_head(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    input_ids, attention_mask, labels = _batch(rank)
    was = fl_trl.is_enabled()
    fl_trl.enable("torch") if fused else fl_trl.disable()
    try:
        loss = model(input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True).loss
    finally:
        fl_trl.enable() if was else fl_trl.disable()
    return _step(model, opt, loss)


MODES = ("reference", "patch", "logprobs_reference", "logprobs", "full_tensor")


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    checks = [(mode, MODULE, "check_step", dict(mode=mode)) for mode in MODES]
    checks += [(f"root/{mode}", MODULE, "check_step", dict(mode=mode, head_unit=False))
               for mode in ("reference", "patch", "logprobs_reference", "logprobs")]
    if _has_trl():
        checks += [(f"trl/{'fused' if fused else 'own'}/{'head' if unit else 'root'}", MODULE, "check_trl_step",
                    dict(fused=fused, head_unit=unit)) for fused in (False, True) for unit in (False, True)]
    return harness.run(2, checks, tmp_path_factory.mktemp("fsdp2_hf"), timeout=120.0)


def _has_trl() -> bool:
    try:
        import trl.trainer.utils  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.parametrize("mode,reference", [("patch", "reference"), ("logprobs", "logprobs_reference"),
                                            ("root/patch", "root/reference"),
                                            ("root/logprobs", "root/logprobs_reference")])
def test_fused_fsdp2_step_equals_the_plain_one(steps, mode, reference):
    for rank in range(2):
        ref = harness.value(steps, reference, rank)
        got = harness.value(steps, mode, rank)
        assert float((got["loss"] - ref["loss"]).abs()) <= 1e-12 * float(ref["loss"].abs())
        assert plain_rel_err(got["head_grad"], ref["head_grad"]) <= 1e-10
        assert max_rel_err(got["params"], ref["params"]) <= 1e-10
        # the head went to fusedloss as the sharded DTensor when it is its own unit, as the root's
        # unsharded parameter otherwise
        assert got["head_is_dtensor"] == (not mode.startswith("root/"))
    # the ranks' losses differ (their own tokens) while their parameters agree (FSDP's averaged step)
    r0, r1 = harness.value(steps, mode, 0), harness.value(steps, mode, 1)
    assert float((r0["loss"] - r1["loss"]).abs()) > 1e-3
    assert max_rel_err(r0["params"], r1["params"]) == 0.0


def test_a_head_gathered_before_the_loss_gets_the_wrong_gradient(steps):
    """The failure the integration avoids, measured: full_tensor()'s backward keeps each rank's own gradient
    on its shard, so the head's gradient (and the step) is not FSDP's average."""
    for rank in range(2):
        ref = harness.value(steps, "logprobs_reference", rank)
        bad = harness.value(steps, "full_tensor", rank)
        assert float((bad["loss"] - ref["loss"]).abs()) <= 1e-12 * float(ref["loss"].abs())  # same forward
        assert plain_rel_err(bad["head_grad"], ref["head_grad"]) > 1e-3


@pytest.mark.skipif(not _has_trl(), reason="trl (with its trainer utilities) is not installed")
def test_trl_fused_head_under_fsdp2(steps):
    """TRL's fused-head forward with fusedloss's kernel takes TRL's own step: with the head in the root's unit
    (accelerate's FSDP2 default: the head's parameter is the root's unsharded one), both equal the step
    without any fused head (to the fp32 rounding of TRL's per-token outputs); with the head its own unit, TRL's
    forward gathers it with full_tensor() before calling the kernel (trl/trainer/utils.py, add_fused_lm_head), so
    with either kernel the head's gradient is each rank's own, not FSDP's average (TRL's behaviour, not the
    kernel's)."""
    for rank in range(2):
        ref = harness.value(steps, "root/logprobs_reference", rank)
        fused = harness.value(steps, "trl/fused/root", rank)
        own = harness.value(steps, "trl/own/root", rank)
        # TRL's kernels return fp32 per-token log-probs whatever the model's dtype (the drop-in keeps that
        # contract), so a float64 model's step agrees to fp32 rounding: 5e-8 (fused), 1e-7 (TRL's) here
        assert max_rel_err(fused["params"], ref["params"]) <= 1e-6
        assert max_rel_err(own["params"], ref["params"]) <= 1e-6
        for kernel in ("own", "fused"):
            head = harness.value(steps, f"trl/{kernel}/head", rank)
            assert plain_rel_err(head["head_grad"], ref["head_grad"]) > 1e-3
        assert max_rel_err(harness.value(steps, "trl/fused/head", rank)["params"],
                    harness.value(steps, "trl/own/head", rank)["params"]) <= 1e-6
