"""verl's Megatron fused site (``verl.models.mcore.model_forward_fused.fused_output_processor``) through
fusedloss on 2 gloo ranks: Megatron's tensor-parallel group from ``parallel_state.initialize_model_parallel``,
each rank holding its rows of the head, sequence parallelism on (hidden states sharded along the sequence and
all-gathered by verl) and off, equal and uneven shards, tied and untied heads, and Megatron's padded vocabulary
rows left out with ``vocab_size``. Float64, against one process with the whole head and materialised logits.

One stand-in: Megatron's ``gather_from_sequence_parallel_region`` allocates on the current CUDA device; the test
gives verl's module the same collective on gloo (forward: all-gather along the sequence; backward: sum over the
ranks and keep this rank's slice, a reduce-scatter).
"""

from __future__ import annotations

import types

import _distributed_harness as harness
import pytest
import torch
import torch.distributed as dist

from fusedloss.integrations import verl as fl_verl

TEMPERATURE = 0.75
SEQ, HIDDEN = 6, 8
EXACT = 1e-12


def _problem(vocab_rows):
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(SEQ, 1, HIDDEN, generator=g, dtype=torch.float64)
    weight = 3 * torch.randn(vocab_rows, HIDDEN, generator=g, dtype=torch.float64)
    coefficients = torch.randn(2, SEQ, generator=g, dtype=torch.float64)
    return hidden, weight, coefficients


def _reference(vocab_rows, vocab_size, labels):
    """One process, whole head, materialised logits (padded rows, if any, outside the softmax)."""
    hidden, weight, coefficients = _problem(vocab_rows)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    logits = (hidden.squeeze(1) @ weight[:vocab_size].T) / TEMPERATURE
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, labels[0].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (coefficients[0] * logp + coefficients[1] * entropy).sum().backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


class _GatherFromSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard):
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard.contiguous())
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        rows = grad.shape[0] // dist.get_world_size()
        return grad[dist.get_rank() * rows:(dist.get_rank() + 1) * rows]


def megatron_check(rank, world, *, sequence_parallel, shard_rows, tied, vocab_size):
    import verl.models.mcore.model_forward_fused as fused_forward
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    fused_forward.gather_from_sequence_parallel_region = _GatherFromSequenceParallel.apply
    fl_verl.enable(vocab_size=vocab_size)
    rows = sum(shard_rows)
    hidden, weight, coefficients = _problem(rows)
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(vocab_size or rows, (1, SEQ), generator=g)
    start = sum(shard_rows[:rank])
    shard = weight[start:start + shard_rows[rank]].clone().requires_grad_(True)
    if sequence_parallel:
        hidden = hidden[rank * SEQ // world:(rank + 1) * SEQ // world]
    hidden = hidden.clone().requires_grad_(True)
    output_layer = types.SimpleNamespace(weight=None if tied else shard)
    config = types.SimpleNamespace(sequence_parallel=sequence_parallel, config_logger_dir="")
    out = fused_forward.fused_output_processor(
        hidden_states=hidden, output_layer=output_layer, output_weight=shard if tied else None, labels=labels,
        context=fused_forward.FusedOutputProcessorContext(temperature=TEMPERATURE), config=config)
    (coefficients[0] * out.log_probs + coefficients[1] * out.entropy).sum().backward()
    hidden_grad = hidden.grad.clone()
    if not sequence_parallel:
        dist.all_reduce(hidden_grad)  # the partial sums Megatron's own backward would reduce
    ref_logp, ref_entropy, ref_hidden_grad, ref_weight_grad = _reference(rows, vocab_size or rows, labels)
    if sequence_parallel:
        ref_hidden_grad = ref_hidden_grad[rank * SEQ // world:(rank + 1) * SEQ // world]
    ref_shard_grad = ref_weight_grad[start:start + shard_rows[rank]]
    fl_verl.disable()

    def err(a, b):
        return float((a - b).norm() / b.norm())

    return {"logp": err(out.log_probs, ref_logp), "entropy": err(out.entropy, ref_entropy),
            "hidden_grad": err(hidden_grad, ref_hidden_grad),
            "weight_grad": float((shard.grad - ref_shard_grad).norm() / ref_weight_grad.norm())}


CASES = {
    "sp-equal-untied": dict(sequence_parallel=True, shard_rows=(105, 105), tied=False, vocab_size=None),
    "sp-uneven-tied": dict(sequence_parallel=True, shard_rows=(106, 105), tied=True, vocab_size=None),
    "no-sp-equal-tied": dict(sequence_parallel=False, shard_rows=(105, 105), tied=True, vocab_size=None),
    "no-sp-uneven-untied": dict(sequence_parallel=False, shard_rows=(106, 105), tied=False, vocab_size=None),
    "sp-padded-vocab": dict(sequence_parallel=True, shard_rows=(106, 106), tied=False, vocab_size=209),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    checks = [(name, __name__, "megatron_check", kwargs) for name, kwargs in CASES.items()]
    return harness.run(2, checks, tmp_path_factory.mktemp("megatron"), timeout=120.0)


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_site_matches_the_whole_head(results, case):
    for rank in range(2):
        errors = harness.value(results, case, rank)
        assert max(errors.values()) <= EXACT, (rank, errors)
