"""GRPO with TRL's GRPOTrainer, its LM head running through fusedloss.

A tiny random Qwen2 (built from a config: nothing is downloaded) learns, on the CPU, to answer "a+b=" prompts
with digits: the reward function below scores each completion. ``--fusedloss on`` calls
``fusedloss.integrations.trl.enable()`` before training, so every per-token log-probability and entropy that
the trainer computes (policy, old policy, reference model) comes from fusedloss; ``--fusedloss off`` runs
TRL's own fused kernels. The two print the same numbers up to float32 rounding.

    pip install 'fusedloss[integrations]'
    python examples/grpo_trl.py --fusedloss on
    python examples/grpo_trl.py --fusedloss off --loss-type grpo --beta 0.04

Runs in well under two minutes on a laptop CPU.
"""

from __future__ import annotations

import argparse
import string
import tempfile
import time

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config
from trl import GRPOConfig, GRPOTrainer

from fusedloss.integrations import trl as fusedloss_trl


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; no files, no downloads."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in string.ascii_lowercase + string.digits + " +=?.,!":
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_model(vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=None, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def digit_reward(prompts, completions, **kwargs):
    """+1 per leading digit of the completion, +2 if it spells the right sum, -0.1 per other character."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        a, b = prompt.rstrip("=").split("+")
        digits = len(completion) - len(completion.lstrip(string.digits))
        correct = completion.startswith(str(int(a) + int(b)))
        rewards.append(digits + 2.0 * correct - 0.1 * (len(completion) - digits))
    return rewards


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fusedloss", choices=("on", "off"), default="on")
    parser.add_argument("--loss-type", default="dapo", choices=("grpo", "bnpo", "dr_grpo", "dapo", "cispo"))
    parser.add_argument("--beta", type=float, default=0.0, help="KL penalty to the reference model (0: none)")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    if args.fusedloss == "on":
        fusedloss_trl.enable()
    tokenizer = char_tokenizer()
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    dataset = Dataset.from_dict({"prompt": prompts})

    with tempfile.TemporaryDirectory() as out:
        # With beta > 0 GRPOTrainer builds its reference model from the policy's path: save the model first.
        tiny_model(len(tokenizer)).save_pretrained(out + "/model")
        config = GRPOConfig(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=16, num_generations=8,
            max_completion_length=8, steps_per_generation=2, learning_rate=3e-3, loss_type=args.loss_type,
            beta=args.beta, logging_steps=1, report_to="none", bf16=False, use_cpu=True, save_strategy="no",
            gradient_checkpointing=False, seed=0, disable_tqdm=True, model_init_kwargs={"dtype": torch.float32},
        )
        trainer = GRPOTrainer(model=out + "/model", reward_funcs=digit_reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer)
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start

    print(f"\nfusedloss {args.fusedloss}, loss_type={args.loss_type}, beta={args.beta}: {elapsed:.1f} s")
    print(f"{'step':>4} {'loss':>12} {'reward':>9} {'entropy':>9} {'grad_norm':>10}")
    for entry in trainer.state.log_history:
        if "loss" in entry:
            # Rewards are logged on the steps that generate (every steps_per_generation steps).
            reward = f"{entry['reward']:.4f}" if "reward" in entry else "-"
            print(f"{entry['step']:>4} {entry['loss']:>12.6f} {reward:>9} {entry['entropy']:>9.5f} "
                  f"{entry['grad_norm']:>10.6f}")
    fusedloss_trl.disable()


if __name__ == "__main__":
    main()
