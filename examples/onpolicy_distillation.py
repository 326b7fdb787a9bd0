"""On-policy distillation from two expert teachers into one student, from hidden states, with and without fusedloss.

Tiny random models built from configs (nothing is downloaded), on the CPU: a Llama student (width 32) and two
teachers of other widths, a Llama "expert A" (width 48) and a soft-capped Gemma 2 "expert B" (width 40). Each
step the student writes its own continuations of random prompts (on-policy, greedy); the first half of the batch
is routed to expert A, the second half to expert B (``teacher_index``). The teachers ship hidden states, not
logits, and the student minimises

    full-vocabulary reverse KL(student || its row's teacher)  +  0.5 * top-k forward KL (teacher's top 8 + tail)

``--fusedloss on``: the teachers' top-8 ids and log-probs come from ``fusedloss.multi_teacher_topk_logprobs``
(their hidden states and heads, never their logits), the sparse loss from ``fusedloss.sparse_distillation_loss``
and the full-vocabulary one from ``fusedloss.distillation_loss(..., teachers=[...], teacher_index=...)``; no
``[batch, seq, vocab]`` tensor is formed. ``--fusedloss off`` materialises every model's logits and writes the
same losses in plain PyTorch (``log_softmax`` + ``torch.topk``). Both print the same numbers (to float32
rounding); run both and compare.

    python examples/onpolicy_distillation.py --fusedloss on
    python examples/onpolicy_distillation.py --fusedloss off
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

import fusedloss
from fusedloss.integrations import transformers as fl_hf

VOCAB = 251
PROMPT, ANSWER, BATCH, TOP_K = 5, 7, 6, 8
SPARSE_WEIGHT = 0.5


def tiny(config_cls, hidden, seed, **extra):
    torch.manual_seed(seed)
    config = config_cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, **extra)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def rollout(student, g):
    """The student's own greedy continuations; labels -100 on the prompt (only its answers are scored)."""
    prompts = torch.randint(3, VOCAB, (BATCH, PROMPT), generator=g)
    with torch.no_grad():
        ids = student.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=ANSWER,
                               min_new_tokens=ANSWER, do_sample=False, pad_token_id=0)
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    return ids, labels[:, 1:]


def routing(shape):
    """Which teacher scores each position: expert A for the first half of the batch, expert B for the rest."""
    index = torch.zeros(shape, dtype=torch.long)
    index[BATCH // 2:] = 1
    return index


# ---- on materialised logits (what a training loop does without fusedloss) -----------------------------

def losses_logits(student, teachers, ids, labels):
    index = routing(labels.shape)
    z_s = student(input_ids=ids, use_cache=False).logits[:, :-1].float()
    with torch.no_grad():  # each teacher's logits on its own rows
        z_t = torch.zeros_like(z_s)
        for i, teacher in enumerate(teachers):
            rows = index[:, 0] == i
            z_t[rows] = teacher(input_ids=ids[rows], use_cache=False).logits[:, :-1].float()
        log_p = torch.log_softmax(z_t, -1)
        top_lp, top_ids = log_p.topk(TOP_K, dim=-1)
    log_q = torch.log_softmax(z_s, -1)
    scored = labels != -100
    reverse_kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    full = (reverse_kl * scored).sum() / scored.sum()
    # top-k forward KL with the tail bucket log(1 - mass) on both sides
    q_top = log_q.gather(-1, top_ids)

    def with_tail(lp):
        mass = torch.logsumexp(lp, -1, keepdim=True).clamp(max=-1e-7)
        return torch.cat((lp, torch.log(-torch.expm1(mass))), -1)

    p, q = with_tail(top_lp), with_tail(q_top)
    forward_kl = (p.exp() * (p - q)).sum(-1)
    sparse = (forward_kl * scored).sum() / scored.sum()
    return full, sparse


# ---- the same losses with fusedloss, from hidden states ------------------------------------------------

def losses_fused(student, teachers, ids, labels):
    index = routing(labels.shape)
    hidden = fl_hf.last_hidden_state(student, ids)[:, :-1]
    head = fl_hf.lm_head(student)
    experts = []
    with torch.no_grad():  # what a teacher server ships: its rows' hidden states, and its head once
        for i, teacher in enumerate(teachers):
            rows = index[:, 0] == i
            t_head = fl_hf.lm_head(teacher)
            t_hidden = fl_hf.last_hidden_state(teacher, ids[rows])[:, :-1]  # only this teacher's rows
            experts.append(fusedloss.Teacher(t_hidden.reshape(-1, t_hidden.shape[-1]), t_head.weight,
                                             bias=t_head.bias, logit_scale=t_head.logit_scale, softcap=t_head.softcap))
        top = fusedloss.multi_teacher_topk_logprobs(experts, index, TOP_K)
    full = fusedloss.distillation_loss(hidden, head.weight, targets=labels, teachers=experts, teacher_index=index,
                                       beta=1.0)
    sparse = fusedloss.sparse_distillation_loss(hidden, head.weight, top.ids, top.logprobs, labels, beta=0.0)
    return full, sparse


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fusedloss", choices=("on", "off"), default="on")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    step_losses = losses_fused if args.fusedloss == "on" else losses_logits
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    student = tiny(LlamaConfig, 32, seed=0)
    teachers = [tiny(LlamaConfig, 48, seed=1, initializer_range=0.2).eval().requires_grad_(False),
                tiny(Gemma2Config, 40, seed=2, head_dim=8, final_logit_softcapping=3.0,
                     initializer_range=0.2).eval().requires_grad_(False)]
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    print(f"On-policy distillation, two teachers (fusedloss {args.fusedloss})")
    for step in range(args.steps):
        ids, labels = rollout(student, g)
        full, sparse = step_losses(student, teachers, ids, labels)
        loss = full + SPARSE_WEIGHT * sparse
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"  step {step:2d}  reverse KL {full.item():.6f}  top-{TOP_K} forward KL {sparse.item():.6f}")
    print(f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
