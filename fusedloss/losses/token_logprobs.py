"""Per-token log-probabilities of the targets, and optionally the entropy: the composable building block
(RL trainers gather these and apply their own loss)."""

from __future__ import annotations

from .implicit_logits import implicit_logits


def token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
                   ignore_index=-100, return_entropy=False, backend="auto", process_group=None,
                   reduce_hidden_grad=True, vocab_start=None, vocab_size=None, fsdp_vocab_parallel=False):
    """log p(targets) per token (``[...]``, fp32; float64 for float64 inputs), and the entropy
    ``-sum_v p log p`` when ``return_entropy``. Ignored positions give 0 and no gradient."""
    logits = implicit_logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                   backend=backend, process_group=process_group, reduce_hidden_grad=reduce_hidden_grad,
                   vocab_start=vocab_start, vocab_size=vocab_size, fsdp_vocab_parallel=fsdp_vocab_parallel)
    tgt = logits.targets("targets", targets, ignore_index)
    stats = logits.statistics(targets=tgt, want_entropy=bool(return_entropy))
    logp = logits.unflatten(stats.logp)
    if return_entropy:
        return logp, logits.unflatten(stats.entropy)
    return logp
