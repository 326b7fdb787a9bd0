"""DPO and distillation in a plain PyTorch training loop, with and without fusedloss.

Two phases on tiny random models built from configs (nothing is downloaded), on the CPU:

1. DPO: a Gemma 2 policy (its logits are soft-capped) against a frozen copy of itself, on synthetic
   preference pairs where the chosen answer repeats the prompt and the rejected one is random.
2. Distillation (Hinton: forward KL at temperature T, mixed with cross-entropy on the data): a small
   Llama student learns from a wider Llama teacher.

``--fusedloss on`` computes both losses from the backbones' last hidden states and the LM heads with
``fusedloss.dpo_loss`` / ``fusedloss.distillation_loss`` (``fusedloss.integrations.transformers`` reads the
head and its soft-cap from the model); ``--fusedloss off`` materialises the ``[batch, seq, vocab]`` logits
through ``model(...).logits`` and writes the same losses in plain PyTorch. Both print the same losses (to
float32 rounding); run both and compare.

    python examples/plain_loop.py --fusedloss on
    python examples/plain_loop.py --fusedloss off
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

import fusedloss
from fusedloss.integrations import transformers as fl_hf

VOCAB = 257
PROMPT, ANSWER = 6, 6


def tiny(config_cls, hidden, seed, **extra):
    torch.manual_seed(seed)
    config = config_cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, **extra)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def preference_batch(g, pairs=4):
    """``[2 * pairs, T]`` ids (chosen rows first, as TRL concatenates them) and labels (-100 on the prompt)."""
    prompt = torch.randint(3, VOCAB, (pairs, PROMPT), generator=g)
    chosen = torch.cat([prompt, prompt[:, :ANSWER]], dim=1)
    rejected = torch.cat([prompt, torch.randint(3, VOCAB, (pairs, ANSWER), generator=g)], dim=1)
    ids = torch.cat([chosen, rejected])
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    return ids, labels


# ---- the losses on materialised logits (what a training loop does without fusedloss) -----------------

def sequence_logps(model, ids, labels):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    targets = labels[:, 1:]
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * (targets != -100)).sum(-1)


def dpo_step_logits(policy, reference, ids, labels, beta):
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logps(reference, ids, labels).chunk(2)
    chosen, rejected = sequence_logps(policy, ids, labels).chunk(2)
    margin = (chosen - ref_chosen) - (rejected - ref_rejected)
    return -F.logsigmoid(beta * margin).mean()


def distill_step_logits(student, teacher, ids, temperature, lam):
    targets = ids[:, 1:]
    zs = student(input_ids=ids, use_cache=False).logits[:, :-1].float()
    with torch.no_grad():
        zt = teacher(input_ids=ids, use_cache=False).logits[:, :-1].float()
    log_q, log_p = torch.log_softmax(zs / temperature, -1), torch.log_softmax(zt / temperature, -1)
    soft = (log_p.exp() * (log_p - log_q)).sum(-1) * temperature**2  # KL(teacher || student)
    hard = F.cross_entropy(zs.flatten(0, 1), targets.flatten(), reduction="none").view_as(soft)
    return (lam * soft + (1 - lam) * hard).mean()


# ---- the same losses with fusedloss (no logits anywhere) ----------------------------------------------

def dpo_step_fused(policy, reference, ids, labels, beta):
    with torch.no_grad():
        ref_chosen, ref_rejected = fl_hf.causal_lm_logprobs(reference, ids, labels=labels).sum(-1).chunk(2)
    hidden = fl_hf.last_hidden_state(policy, ids)[:, :-1]
    head = fl_hf.lm_head(policy)
    return fusedloss.dpo_loss(hidden, head.weight, labels[:, 1:], ref_chosen, ref_rejected, beta=beta,
                              bias=head.bias, logit_scale=head.logit_scale, softcap=head.softcap)


def distill_step_fused(student, teacher, ids, temperature, lam):
    hidden = fl_hf.last_hidden_state(student, ids)[:, :-1]
    with torch.no_grad():
        teacher_hidden = fl_hf.last_hidden_state(teacher, ids)[:, :-1]
    return fusedloss.distillation_loss(
        hidden, fl_hf.lm_head(student).weight, teacher_hidden, fl_hf.lm_head(teacher).weight, ids[:, 1:],
        beta=0.0, temperature=temperature, soft_weight=lam, hard_weight=1 - lam, t_squared=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fusedloss", choices=("on", "off"), default="on")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    fused = args.fusedloss == "on"
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()

    print(f"DPO (fusedloss {args.fusedloss})")
    policy = tiny(Gemma2Config, 32, seed=0, head_dim=8, final_logit_softcapping=30.0)
    reference = tiny(Gemma2Config, 32, seed=0, head_dim=8, final_logit_softcapping=30.0).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for step in range(args.steps):
        ids, labels = preference_batch(g)
        loss = (dpo_step_fused if fused else dpo_step_logits)(policy, reference, ids, labels, beta=0.5)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"  step {step:2d}  loss {loss.item():.6f}")

    print(f"Distillation (fusedloss {args.fusedloss})")
    student = tiny(LlamaConfig, 32, seed=1)
    teacher = tiny(LlamaConfig, 64, seed=2).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    for step in range(args.steps):
        with torch.no_grad():  # the teacher writes the data: its own greedy continuation of random prompts
            prompts = torch.randint(3, VOCAB, (8, PROMPT), generator=g)
            ids = teacher.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=ANSWER,
                                   do_sample=False, pad_token_id=0)
        loss = (distill_step_fused if fused else distill_step_logits)(student, teacher, ids, 2.0, 0.7)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"  step {step:2d}  loss {loss.item():.6f}")

    print(f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
