"""Supervised fine-tuning with the Hugging Face ``Trainer``, with and without fusedloss: one line.

A tiny random Gemma 2 (its logits are soft-capped) built from a config (nothing is downloaded) learns to
copy: each example is a random prompt followed by the same tokens again, and only the copy is scored
(labels -100 on the prompt), with gradient accumulation so that the Trainer passes ``num_items_in_batch``.

``--fusedloss on`` calls ``fusedloss.integrations.transformers.patch(model)``: the model's own ``labels=``
loss is then computed from the hidden states, and the ``[batch, seq, vocab]`` logits are never formed.
``--fusedloss off`` is the plain model. Both print the same losses (to float32 rounding).

    python examples/sft_trainer.py --fusedloss on
    python examples/sft_trainer.py --fusedloss off
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Trainer, TrainingArguments

from fusedloss.integrations.transformers import patch

VOCAB, PROMPT = 257, 8


def dataset(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        prompt = torch.randint(3, VOCAB, (PROMPT,), generator=g)
        ids = torch.cat((prompt, prompt))
        labels = ids.clone()
        labels[:PROMPT] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fusedloss", choices=("on", "off"), default="on")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=30.0,
                          max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if args.fusedloss == "on":
        patch(model)  # the only change

    training = TrainingArguments(output_dir="/tmp/fusedloss-sft-example", per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=3e-3,
                                 logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                                 disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=dataset(8 * args.steps))
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']} loss {entry['loss']:.6f}")


if __name__ == "__main__":
    main()
