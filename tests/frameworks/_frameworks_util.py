"""Tiny causal LMs and the float64 materialised-logits oracle the framework tests compare against."""

from __future__ import annotations

import _stand_ins  # noqa: F401  (before any framework is imported)
import torch

TEMPERATURE = 0.75  # not 0.7: 0.75 is exact in float32, so a framework's fp32 temperature tensor hides nothing
VOCAB = 211  # prime: never a multiple of a tile


def tiny_causal_lm(head: str = "untied", dtype: torch.dtype = torch.float64, seed: int = 0):
    """A 2-layer Qwen2 (``head`` "untied" / "tied") or Gemma 2 with ``final_logit_softcapping=30``
    (``"softcap"``), in ``dtype``, with a head scaled up so that some rows are peaked (entropy near 0) and the
    soft-cap bends the largest logits."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if head == "softcap":
        config = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=30.0,
                                           attn_logit_softcapping=None, query_pre_attn_scalar=8, sliding_window=64,
                                           tie_word_embeddings=True)
        config._attn_implementation = "sdpa"
        model = transformers.Gemma2ForCausalLM(config)
        scale = 20.0
    elif head in ("untied", "tied"):
        config = transformers.Qwen2Config(**common, tie_word_embeddings=head == "tied")
        config._attn_implementation = "sdpa"
        model = transformers.Qwen2ForCausalLM(config)
        scale = 8.0
    else:
        raise ValueError(f"head must be 'untied', 'tied' or 'softcap', got {head!r}")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    return model.to(dtype).eval()


def oracle_logprobs_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """Log-probs of ``labels`` and entropies from materialised logits, in float64."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-300))


def param_grads(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def max_grad_err(grads: dict, reference: dict) -> float:
    assert grads.keys() == reference.keys(), sorted(set(grads) ^ set(reference))
    return max(rel_err(grads[k], reference[k]) for k in reference)
