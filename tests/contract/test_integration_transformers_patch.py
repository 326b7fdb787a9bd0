"""``fusedloss.integrations.transformers.patch``: a causal LM's own ``labels=`` loss from the hidden states.

Ground truth: the same model's logits (a forward without labels, which the patch leaves alone) in float64,
put through transformers' causal-LM loss formula in float64 (its own ``ForCausalLMLoss`` upcasts logits to
float32, so it cannot serve as a 1e-10 reference). Tiny random models on the CPU; V prime; a peaked head.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from _errors import assert_each_close, plain_rel_err  # noqa: E402
from conftest import param_grads  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    Qwen2Config,
)
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from fusedloss.integrations import transformers as fl_hf  # noqa: E402

V = 101
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=V, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False),
    "qwen2-tied": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),
    "gemma2-softcap": lambda: Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=3.0),
}


def make_model(name, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype)
    with torch.no_grad():  # a peaked head: a few logits far above the rest
        model.get_output_embeddings().weight[:3].mul_(6.0)
    return model


def batch(seed=0, b=3, t=11):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (b, t), generator=g)
    attention_mask = torch.ones(b, t, dtype=torch.long)
    attention_mask[1, -4:] = 0
    input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[0, :3] = -100  # a prompt that is not scored
    return input_ids, attention_mask, labels


def hf_formula(logits, labels, num_items_in_batch=None, shift_labels=None):
    """transformers' ForCausalLMLoss in the logits' own dtype (float64 here): shift, ignore -100,
    mean, or sum / num_items_in_batch."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100,
                           reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "gemma2-softcap"])
@pytest.mark.parametrize("num_items", [None, 17, "tensor"])
def test_loss_and_every_gradient_match_float64(name, num_items):
    model = make_model(name)
    input_ids, attention_mask, labels = batch()
    if num_items == "tensor":  # what the Trainer passes under gradient accumulation
        num_items = torch.tensor(23)
    ref_loss = hf_formula(model(input_ids, attention_mask=attention_mask).logits, labels, num_items)
    ref = param_grads(model, ref_loss)

    fl_hf.patch(model, backend="torch")
    kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
    out = model(input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
    assert out.logits is None and "logits" not in out.keys()
    assert out.loss.dtype == torch.float64
    assert plain_rel_err(out.loss, ref_loss) < 1e-10
    got = param_grads(model, out.loss)
    assert_each_close(got, ref, 1e-10)
    if name == "qwen2-tied":  # the head is the embedding: one parameter collects both gradients
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_the_head_never_runs_with_labels_and_runs_without():
    model = fl_hf.patch(make_model("qwen2-tied"), backend="torch")
    input_ids, attention_mask, labels = batch(1)
    products = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: products.append(tuple(o.shape)))
    try:
        model(input_ids, attention_mask=attention_mask, labels=labels)
        assert products == [(1, 4, V)], "the head formed logits beyond its 4 probe rows"
        products.clear()
        out = model(input_ids, attention_mask=attention_mask)
        assert products == [(3, 11, V)] and out.logits.shape == (3, 11, V) and out.loss is None
    finally:
        hook.remove()


def test_shift_labels_positional_labels_and_tuple_output():
    model = make_model("llama")
    input_ids, attention_mask, labels = batch(2)
    logits = model(input_ids, attention_mask=attention_mask).logits
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    shift[2, 4] = -100  # not derivable from labels: shift_labels must be used as given
    fl_hf.patch(model, backend="torch")
    out = model(input_ids, attention_mask=attention_mask, labels=labels, shift_labels=shift)
    assert plain_rel_err(out.loss, hf_formula(logits, labels, shift_labels=shift)) < 1e-10
    # labels passed positionally: LlamaForCausalLM.forward(input_ids, attention_mask, position_ids, cache,
    # inputs_embeds, labels, ...)
    out = model(input_ids, attention_mask, None, None, None, labels)
    assert out.logits is None and plain_rel_err(out.loss, hf_formula(logits, labels)) < 1e-10
    tup = model(input_ids, attention_mask=attention_mask, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and tup[0].dim() == 0 and all(t is None or t.shape[-1] != 0 for t in tup[1:]
                                                                if isinstance(t, torch.Tensor))
    assert plain_rel_err(tup[0], hf_formula(logits, labels)) < 1e-10


def test_logits_to_keep_scores_the_kept_positions():
    model = make_model("llama")
    input_ids, attention_mask, labels = batch(3)
    logits = model(input_ids, attention_mask=attention_mask).logits
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    fl_hf.patch(model, backend="torch")
    out = model(input_ids, attention_mask=attention_mask, labels=labels, logits_to_keep=5)
    assert plain_rel_err(out.loss, hf_formula(logits[:, -5:], None, shift_labels=shift[:, -5:])) < 1e-10
    keep = torch.tensor([0, 2, 3, 7])
    out = model(input_ids, attention_mask=attention_mask, labels=labels, logits_to_keep=keep)
    assert plain_rel_err(out.loss, hf_formula(logits[:, keep], None, shift_labels=shift[:, keep])) < 1e-10


def test_generation_is_unchanged_and_unpatch_restores():
    model = make_model("qwen2-tied").eval()
    prompt = batch(4)[0][:1, :5]
    before = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    fl_hf.patch(model, backend="torch")
    assert {"forward", "_loss_function"} <= set(vars(model))
    import inspect  # the Trainer keeps the dataset columns the forward's signature names

    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0), before)
    input_ids, attention_mask, labels = batch(4)
    logits = model(input_ids, attention_mask=attention_mask).logits
    fl_hf.unpatch(model)
    assert "forward" not in vars(model) and "_loss_function" not in vars(model)
    assert "forward" not in vars(model.get_output_embeddings())
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits is not None and torch.equal(out.logits, logits)
    assert out.loss.dtype == torch.float32  # transformers' own loss is back (it upcasts logits to float32)
    assert plain_rel_err(out.loss.double(), hf_formula(logits, labels)) < 1e-6
    assert fl_hf.unpatch(model) is model  # unpatching twice is harmless


def test_patch_twice_is_idempotent_and_keeps_an_existing_loss_function():
    model = make_model("llama")
    custom = model.loss_function
    model.loss_function = custom  # a user-set loss function lives in the instance dict
    fl_hf.patch(model, backend="torch")
    fl_hf.patch(model, backend="torch")
    fl_hf.unpatch(model)
    assert vars(model)["_loss_function"] is custom and "forward" not in vars(model)


@pytest.mark.parametrize("lora_on_head", [False, True])
def test_peft_lora_including_the_head(lora_on_head):
    peft = pytest.importorskip("peft")
    model = make_model("llama")
    targets = ["q_proj", "v_proj"] + (["lm_head"] if lora_on_head else [])
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg)
    input_ids, attention_mask, labels = batch(5)
    ref_loss = hf_formula(pm(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
    ref = param_grads(pm, ref_loss)
    assert fl_hf.patch(pm, backend="torch") is pm
    out = pm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits is None and plain_rel_err(out.loss, ref_loss) < 1e-10
    got = param_grads(pm, out.loss)
    assert any("lora" in n for n in got) and (not lora_on_head or any("lm_head.lora" in n for n in got))
    assert_each_close(got, ref, 1e-10)


def test_gradient_checkpointing():
    model = make_model("llama")
    input_ids, attention_mask, labels = batch(6)
    ref_loss = hf_formula(model(input_ids, attention_mask=attention_mask).logits, labels)
    ref = param_grads(model, ref_loss)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model.config.attention_dropout = 0.0
    fl_hf.patch(model, backend="torch")
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert plain_rel_err(out.loss, ref_loss) < 1e-10
    assert_each_close(param_grads(model, out.loss), ref, 1e-10)


def test_torch_compile():
    model = make_model("qwen2-tied")
    input_ids, attention_mask, labels = batch(7)
    ref_loss = hf_formula(model(input_ids, attention_mask=attention_mask).logits, labels, 19)
    ref = param_grads(model, ref_loss)
    fl_hf.patch(model, backend="torch")
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(input_ids, attention_mask=attention_mask, labels=labels, num_items_in_batch=19)
    assert out.logits is None and plain_rel_err(out.loss, ref_loss) < 1e-10
    assert_each_close(param_grads(model, out.loss), ref, 1e-10)


def test_moe_router_loss_is_still_added_by_the_model():
    """What the model adds to its loss (Mixtral's router load-balancing term) stays the model's own."""
    torch.manual_seed(0)
    cfg = MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                        router_aux_loss_coef=0.1, experts_implementation="eager")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
    input_ids, attention_mask, labels = batch(8)
    plain = model(input_ids, attention_mask=attention_mask)
    ref_loss = hf_formula(plain.logits, labels) + 0.1 * plain.aux_loss
    fl_hf.patch(model, backend="torch")
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.aux_loss is not None and plain_rel_err(out.loss, ref_loss) < 1e-10


def test_refuses_what_it_cannot_patch():
    model = make_model("llama")
    with pytest.raises(ValueError, match="backend"):
        fl_hf.patch(model, backend="fast")
    model.loss_function = lambda **kw: None
    with pytest.raises(ValueError, match="ForCausalLMLoss"):
        fl_hf.patch(model)
    with pytest.raises(ValueError, match="causal LM"):
        fl_hf.patch(torch.nn.Linear(3, 3).__class__.__new__(type("Plain", (torch.nn.Module,), {
            "get_output_embeddings": lambda self: None})))


def _train(patched, steps=3, accumulation=2):
    """A few optimizer steps of the HF Trainer on a tiny Llama; returns (logged losses, parameters, initial
    parameters). Plain SGD: Adam's m / sqrt(v) would turn fp32 rounding of near-zero gradients into
    visible parameter differences, which says nothing about the loss."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"](), dtype=torch.float32)
    if patched:
        fl_hf.patch(model, backend="torch")
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(steps * accumulation * 2):
        ids = torch.randint(3, V, (9,), generator=g)
        lab = ids.clone()
        lab[: 2 + i % 4] = -100  # unequal numbers of valid tokens: num_items_in_batch matters
        rows.append({"input_ids": ids, "attention_mask": torch.ones(9, dtype=torch.long), "labels": lab})

    args = TrainingArguments(output_dir="/tmp/fl-trainer-test", per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=0.5, optim="sgd",
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    assert trainer.model_accepts_loss_kwargs  # num_items_in_batch reaches the patched forward
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, initial


def test_trainer_run_matches_unpatched():
    pytest.importorskip("accelerate")
    losses, params, initial = _train(True)
    ref_losses, ref_params, _ = _train(False)
    assert len(losses) == len(ref_losses) == 3
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_each_close(params, ref_params, 1e-5)
    moved = {n: params[n] - initial[n] for n in params}
    assert all(m.norm() > 1e-3 * initial[n].norm() for n, m in moved.items() if "norm" not in n), \
        "the run did not train: the comparison would be empty"


def test_evaluation_without_autograd_gets_the_models_logits():
    """Under ``torch.no_grad`` (the Trainer's evaluation) a labelled call is the model's own: its logits, which
    ``compute_metrics`` reads, and its loss from them; ``eval_logits=False`` keeps those calls fused."""
    model = make_model("gemma2-softcap")
    input_ids, attention_mask, labels = batch(3)
    with torch.no_grad():
        ref = model(input_ids, attention_mask=attention_mask, labels=labels)
    fl_hf.patch(model, backend="torch")
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
    assert model(input_ids, attention_mask=attention_mask, labels=labels).logits is None  # training: fused
    fl_hf.patch(model, backend="torch", eval_logits=False)
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits is None and plain_rel_err(out.loss, hf_formula(ref.logits, labels)) < 1e-10


def test_trainer_evaluation_with_compute_metrics_on_the_logits():
    """LLaMA-Factory's ``compute_accuracy``: the Trainer's evaluation hands the logits to
    ``preprocess_logits_for_metrics`` (its ``eval_logit_processor`` takes ``logits[0]``, the argmax) and the
    accuracy to ``compute_metrics``. Patched, training stays fused and evaluation gives the unpatched model's
    accuracy and loss."""
    pytest.importorskip("accelerate")
    import numpy as np
    from transformers import Trainer, TrainingArguments

    def eval_logit_processor(logits, labels):  # LLaMA-Factory's (train/sft/metric.py), as it indexes
        if isinstance(logits, (list, tuple)):
            logits = logits[0] if logits[0].dim() == 3 else logits[1]
        return torch.argmax(logits, dim=-1)

    def accuracy(eval_preds):
        preds, label_ids = eval_preds.predictions[:, :-1], eval_preds.label_ids[:, 1:]
        mask = label_ids != -100
        return {"accuracy": float((preds[mask] == label_ids[mask]).mean())}

    g = torch.Generator().manual_seed(5)
    rows = [{"input_ids": ids, "attention_mask": torch.ones(9, dtype=torch.long), "labels": ids}
            for ids in torch.randint(3, V, (8, 9), generator=g)]

    def run(patched):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(CONFIGS["llama"](), dtype=torch.float32)
        heads = []
        if patched:
            fl_hf.patch(model, backend="torch")
        model.get_output_embeddings().register_forward_hook(lambda m, i, o: heads.append(tuple(o.shape)))
        args = TrainingArguments(output_dir="/tmp/fl-trainer-eval-test", per_device_train_batch_size=2,
                                 per_device_eval_batch_size=4, max_steps=2, learning_rate=0.5, optim="sgd",
                                 report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
                                 disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows,
                          compute_metrics=accuracy, preprocess_logits_for_metrics=eval_logit_processor)
        trainer.train()
        train_heads = list(heads)
        metrics = trainer.evaluate()
        return metrics, train_heads

    (metrics, train_heads), (ref, _) = run(True), run(False)
    assert train_heads and all(shape == (1, 4, V) for shape in train_heads)  # training formed no logits
    assert metrics["eval_accuracy"] == ref["eval_accuracy"] and np.isfinite(metrics["eval_accuracy"])
    assert metrics["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_sft_trainer_example_on_matches_off():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def losses(flag):
        out = subprocess.run([sys.executable, str(root / "examples" / "sft_trainer.py"), "--fusedloss", flag,
                              "--steps", "3"], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("step")]

    on, off = losses("on"), losses("off")
    assert len(on) == len(off) == 3
    assert on == pytest.approx(off, rel=1e-5)


def test_a_deepcopy_of_a_patched_model_is_patched_and_runs_its_own_parameters():
    """TRL makes reference models with copy.deepcopy: the copy must not call back into the original."""
    import copy

    model = fl_hf.patch(make_model("llama"), backend="torch")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(0.5)
        twin.model.layers[0].mlp.down_proj.weight.add_(0.1)
    input_ids, attention_mask, labels = batch(9)
    for m in (model, twin):
        ref = hf_formula(m(input_ids, attention_mask=attention_mask).logits, labels)
        out = m(input_ids, attention_mask=attention_mask, labels=labels)
        assert out.logits is None and plain_rel_err(out.loss, ref) < 1e-10
    fl_hf.unpatch(twin)
    assert "forward" not in vars(twin) and "forward" in vars(model)


def test_a_replaced_head_is_refused_until_patched_again():
    model = fl_hf.patch(make_model("llama"), backend="torch")
    input_ids, attention_mask, labels = batch(10)
    model.resize_token_embeddings(V + 6)  # a new head module, not patched
    with pytest.raises(RuntimeError, match="patch\\(model\\) again"):
        model(input_ids, attention_mask=attention_mask, labels=labels)
    fl_hf.patch(model, backend="torch")
    logits = model(input_ids, attention_mask=attention_mask).logits
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits is None and plain_rel_err(out.loss, hf_formula(logits, labels)) < 1e-10


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerate_loop(mixed_precision):
    """accelerate wraps the forward on the instance (output casting, autocast); patch before or after it."""
    accelerate = pytest.importorskip("accelerate")

    def step(patched):
        model = make_model("llama", dtype=torch.float32)
        if patched == "before":
            fl_hf.patch(model, backend="torch")
        AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton
        acc = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        if patched == "after":
            fl_hf.patch(model, backend="torch")
        input_ids, attention_mask, labels = batch(11)
        out = model(input_ids, attention_mask=attention_mask, labels=labels)
        acc.backward(out.loss)
        assert (out.logits is None) == (patched is not None)
        return out.loss.detach().double(), {n: p.grad.clone() for n, p in model.named_parameters()}

    from accelerate.state import AcceleratorState

    try:
        ref_loss, ref_grads = step(None)
        for when in ("before", "after"):
            loss, grads = step(when)
            tol = 1e-5 if mixed_precision == "no" else 1e-3  # bf16 autocast: the reference rounds its logits to bf16
            assert plain_rel_err(loss, ref_loss) < tol, plain_rel_err(loss, ref_loss)
            assert_each_close(grads, ref_grads, 10 * tol)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_the_head_weight_reaches_fusedloss_unchanged(monkeypatch, tmp_path):
    """The parameter itself, not a gathered or cast copy: an FSDP2 (DTensor) head is the core's to handle
    (docs/design.md, "Distributed")."""
    import torch.distributed as dist

    import fusedloss

    seen = []

    def spy(hidden, weight, targets, **kwargs):
        seen.append(weight)
        return hidden.sum() * 0

    monkeypatch.setattr(fusedloss, "cross_entropy", spy)
    model = fl_hf.patch(make_model("qwen2-tied"), backend="torch")
    input_ids, attention_mask, labels = batch(12)
    model(input_ids, attention_mask=attention_mask, labels=labels)
    assert seen[-1] is model.get_input_embeddings().weight

    if not dist.is_available():
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        untied = fl_hf.patch(make_model("llama"), backend="torch")
        mesh = init_device_mesh("cpu", (1,))
        untied.lm_head.weight = torch.nn.Parameter(distribute_tensor(untied.lm_head.weight.detach(), mesh, [Shard(0)]))
        untied(input_ids, attention_mask=attention_mask, labels=labels)
        assert isinstance(seen[-1], DTensor) and seen[-1] is untied.lm_head.weight
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# What the patch observes, and what it refuses (every transformers architecture:
# tests/tooling/test_env_transformers_zoo.py)


class _TransformedLlama(LlamaForCausalLM):
    """A causal LM that post-processes its logits with ``transform(self, logits)`` before ``self.loss_function``."""

    transform = staticmethod(lambda model, logits: logits)

    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        logits = self.transform(self, self.lm_head(hidden))
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def transformed_llama(transform, seed=0):
    torch.manual_seed(seed)
    model = type("Model", (_TransformedLlama,), {"transform": staticmethod(transform)})(
        CONFIGS["llama"]()).to(torch.float64)
    return model


@pytest.mark.parametrize("transform, expected", [
    (lambda m, z: z * 0.37, (0.37, None)),  # no config field says so: refused below, not guessed
    (lambda m, z: 5.0 * torch.tanh(z / 5.0), (1.0, 5.0)),
])
def test_a_transform_no_config_field_declares_is_refused(transform, expected):
    model = fl_hf.patch(transformed_llama(transform), backend="torch")
    input_ids, attention_mask, labels = batch(13)
    with pytest.raises(fl_hf.UnsupportedModelError, match="Model post-processes its head's output .* not reproduce"):
        model(input_ids, attention_mask=attention_mask, labels=labels)


@pytest.mark.parametrize("field, value, transform", [
    ("logit_scale", 0.37, lambda m, z: z * 0.37),
    ("logits_soft_cap", 5.0, lambda m, z: 5.0 * torch.tanh(z / 5.0)),  # RecurrentGemma's spelling
    ("output_logit_soft_cap", 5.0, lambda m, z: 5.0 * torch.tanh(z / 5.0)),  # xLSTM's
    ("logit_scale", 0.37, lambda m, z: z),  # declared but not applied (MPT): the model's own number
    ("logits_scaling", 4.0, lambda m, z: z),  # applied to the head's input (MiniCPM3): already in it
])
def test_the_transform_the_model_applies_is_the_one_used(field, value, transform):
    model = transformed_llama(transform)
    setattr(model.config, field, value)
    input_ids, attention_mask, labels = batch(14)
    ref_loss = hf_formula(model(input_ids, attention_mask=attention_mask).logits, labels)
    ref = param_grads(model, ref_loss)
    fl_hf.patch(model, backend="torch")
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits is None and plain_rel_err(out.loss, ref_loss) < 1e-10
    assert_each_close(param_grads(model, out.loss), ref, 1e-10)


def test_a_vocabulary_cut_becomes_vocab_size():
    """Inkling keeps the first ``unpadded_vocab_size`` logits: the padded rows leave the softmax."""
    model = transformed_llama(lambda m, z: z[..., :V - 7])
    with torch.no_grad():
        model.lm_head.weight[V - 7:].mul_(20.0)  # padded rows that would dominate the softmax
    input_ids, attention_mask, labels = (t.remainder(V - 7) if t.dtype == torch.long and t is not None else t
                                         for t in batch(15))
    labels = labels.masked_fill(attention_mask == 0, -100)
    ref_loss = hf_formula(model(input_ids, attention_mask=attention_mask).logits, labels)
    fl_hf.patch(model, backend="torch")
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert plain_rel_err(out.loss, ref_loss) < 1e-10
    assert fl_hf.lm_head(model).vocab_size == V - 7


def test_a_learned_parameter_on_the_logits_is_refused_even_at_one():
    """A learned scale of exactly 1 leaves the values alone, but fusedloss would give it no gradient."""
    model = transformed_llama(lambda m, z: z * m.logit_gain)
    model.logit_gain = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    fl_hf.patch(model, backend="torch")
    input_ids, attention_mask, labels = batch(16)
    with pytest.raises(fl_hf.UnsupportedModelError, match=r"applies learned parameters to its logits \(logit_gain\)"):
        model(input_ids, attention_mask=attention_mask, labels=labels)
    with torch.no_grad():  # without autograd nothing can miss a gradient: the values decide
        assert model(input_ids, attention_mask=attention_mask, labels=labels).loss is not None


def test_a_transform_with_the_right_values_and_the_wrong_slope_is_refused():
    """The identity in value with slope 1.5 (a straight-through estimator): caught by the gradient check."""
    model = fl_hf.patch(transformed_llama(lambda m, z: z + 0.5 * (z - z.detach())), backend="torch")
    input_ids, attention_mask, labels = batch(17)
    with pytest.raises(fl_hf.UnsupportedModelError, match="the values agree on the probe rows, the slopes do not"):
        model(input_ids, attention_mask=attention_mask, labels=labels)


class _OwnLossLlama(LlamaForCausalLM):
    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # BartForCausalLM's way: its own cross-entropy, labels not shifted
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_model_computing_its_own_loss_is_refused_with_the_cause_chained():
    torch.manual_seed(0)
    model = fl_hf.patch(_OwnLossLlama(CONFIGS["llama"]()).to(torch.float64), backend="torch")
    input_ids, attention_mask, labels = batch(18)
    with pytest.raises(fl_hf.UnsupportedModelError, match="_OwnLossLlama computes its loss itself, not through "
                                                        "self.loss_function") as info:
        model(input_ids, attention_mask=attention_mask, labels=labels)
    assert isinstance(info.value.__cause__, (ValueError, RuntimeError))  # the model's own error, chained


class _ScaledHead(torch.nn.Linear):
    """Dory's head: nn.Linear with a learned per-token scale of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logit_scale = torch.nn.Parameter(torch.ones(self.out_features))

    def forward(self, x):
        return super().forward(x) * self.logit_scale


class _PlainSubclassHead(torch.nn.Linear):
    pass


def test_heads_that_are_not_one_linear_layer_are_refused_at_patch():
    model = make_model("llama")
    model.lm_head = _ScaledHead(32, V, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match="LM head class _ScaledHead has a forward of its own"):
        fl_hf.patch(model)
    model.lm_head = _PlainSubclassHead(32, V, bias=False, dtype=torch.float64)
    model.lm_head.register_parameter("gain", torch.nn.Parameter(torch.ones(V, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"parameters beyond weight and bias \(gain\)"):
        fl_hf.patch(model)
    model.lm_head = torch.nn.ModuleList([torch.nn.Linear(32, V), torch.nn.Linear(32, V)])  # MusicGen's codebooks
    with pytest.raises(ValueError, match="LM head is a ModuleList, not one module with a"):
        fl_hf.patch(model)
    with pytest.raises(ValueError, match="LM head is a ModuleList"):
        fl_hf.completion_logprobs(model, *batch(0)[0].split([5, 6], dim=1))


def test_a_wrapped_model_is_refused_with_patch_before():
    model = make_model("llama")
    with pytest.raises(ValueError, match="patch before torch.compile"):
        fl_hf.patch(torch.compile(model, backend="aot_eager"))
    with pytest.raises(ValueError, match="patch before DataParallel"):
        fl_hf.patch(torch.nn.DataParallel(model))
    assert "forward" not in vars(model)


def test_pre_shifted_labels_get_the_answer():
    model = fl_hf.patch(make_model("llama"), backend="torch")
    input_ids, attention_mask, labels = batch(19)
    with pytest.raises(ValueError, match="labels are shifted for you: pass labels the length of input_ids"):
        model(input_ids, attention_mask=attention_mask, labels=labels[:, 1:])


# --------------------------------------------------------------------------------------------------
# Training conditions: saved whole, several threads, DataParallel replicas, PEFT's heads for added tokens,
# adapters added after patch, the user's own errors, sharded heads, sparse label masks


def test_a_patched_model_saved_whole_loads_patched_and_exact(tmp_path):
    """``torch.save(model)`` / pickle keep the patch: the loaded model's loss is its own model's, without logits."""
    import copy
    import pickle

    model = fl_hf.patch(make_model("qwen2-tied"), backend="torch")
    input_ids, attention_mask, labels = batch(20)
    model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()  # a call observed before saving
    torch.save(model, tmp_path / "model.pt")
    for loaded in (torch.load(tmp_path / "model.pt", weights_only=False), pickle.loads(pickle.dumps(model)),
                   copy.deepcopy(model)):
        with torch.no_grad():  # its own parameters, not the original's
            loaded.model.layers[0].mlp.down_proj.weight.add_(0.1)
        ref_loss = hf_formula(loaded(input_ids, attention_mask=attention_mask).logits, labels)
        ref = param_grads(loaded, ref_loss)
        out = loaded(input_ids, attention_mask=attention_mask, labels=labels)
        assert out.logits is None and plain_rel_err(out.loss, ref_loss) < 1e-10
        assert_each_close(param_grads(loaded, out.loss), ref, 1e-10)
        fl_hf.unpatch(loaded)
        assert not {"forward", "_loss_function", "_fusedloss_patch"} & set(vars(loaded))
        assert not loaded._forward_pre_hooks and not loaded.get_output_embeddings()._forward_pre_hooks
        assert loaded(input_ids, attention_mask=attention_mask, labels=labels).logits is not None
    assert "forward" in vars(model)  # the original stays patched


def _in_step(threads):
    """A forward pre-hook for the final norm that holds each call until ``threads`` calls are inside the model's
    forward at once: the calls interleave between their head taps and their losses."""
    import threading

    barrier = threading.Barrier(threads)

    def hook(module, args):
        barrier.wait(timeout=30)

    return hook


def _run_threads(work, n):
    import threading

    results, errors = [None] * n, []

    def run(i):
        try:
            results[i] = work(i)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("name", ["llama", "gemma2-softcap"])
def test_threads_calling_one_patched_model_get_the_single_thread_results(name):
    """What a call records is its thread's: N threads x M labelled calls on one model, interleaved inside the
    forward, give exactly the losses and gradients of the same calls made one at a time."""
    n, m = 3, 3
    model = fl_hf.patch(make_model(name), backend="torch")
    params = [p for p in model.parameters() if p.requires_grad]
    batches = [[batch(30 + i * m + j, b=2 + (i + j) % 2, t=7 + 2 * j) for j in range(m)] for i in range(n)]

    def step(input_ids, attention_mask, labels):
        loss = model(input_ids, attention_mask=attention_mask, labels=labels).loss
        return loss.detach(), torch.autograd.grad(loss, params)

    alone = [[step(*b) for b in row] for row in batches]
    hook = model.model.norm.register_forward_pre_hook(_in_step(n))
    try:
        together = _run_threads(lambda i: [step(*b) for b in batches[i]], n)
    finally:
        hook.remove()
    for i in range(n):
        for j in range(m):
            (loss, grads), (ref_loss, ref_grads) = together[i][j], alone[i][j]
            assert torch.equal(loss, ref_loss), (i, j, loss, ref_loss)
            assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads)), (i, j)
    with torch.no_grad():  # and against the model's own loss
        logits = model(*batches[0][0][:1], attention_mask=batches[0][0][1]).logits
        assert plain_rel_err(alone[0][0][0], hf_formula(logits, batches[0][0][2])) < 1e-10


def test_threads_calling_the_helpers_on_one_model_get_the_single_thread_results():
    model = make_model("llama")
    ids = [batch(40 + i)[0] for i in range(3)]
    alone = [fl_hf.causal_lm_logprobs(model, x, backend="torch").detach() for x in ids]
    hook = model.model.norm.register_forward_pre_hook(_in_step(3))
    try:
        together = _run_threads(lambda i: fl_hf.causal_lm_logprobs(model, ids[i], backend="torch").detach(), 3)
    finally:
        hook.remove()
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    assert "forward" not in vars(model.lm_head) and "_fusedloss_patch" not in vars(model.lm_head)


def _replicate(model, scales):
    """What ``nn.DataParallel``'s ``replicate`` makes of a module tree, on the CPU: per replica, a shallow copy of
    every module (``_replicate_for_data_parallel``: its ``__dict__`` copied, so the replica shares the original's
    instance attributes) holding its own copies of the parameters (here ``scale * p``, differentiable, so that
    a replica running the original's parameters gives another number)."""
    replicas = []
    for scale in scales:
        copies, modules = {}, {}
        for module in model.modules():
            modules[module] = module._replicate_for_data_parallel()
        for module, replica in modules.items():
            for key, child in module._modules.items():
                replica._modules[key] = None if child is None else modules[child]
            for key, param in module._parameters.items():
                if param is None:
                    replica._parameters[key] = None
                else:  # non-leaf copies, set as plain attributes, as replicate() does
                    setattr(replica, key, copies.setdefault(param, param * scale))
        replicas.append(modules[model])
    return replicas


@pytest.mark.parametrize("name", ["llama", "qwen2-tied"])
def test_data_parallel_replicas_run_their_own_modules(name):
    """DataParallel runs shallow copies of the patched model in one thread each: every replica's loss is the one
    its own parameters give, and the gradients reach the original parameters as without the patch."""
    scales = (1.0, 1.25, 0.75)
    inputs = [batch(50 + i) for i in range(len(scales))]

    def run(patched):
        model = make_model(name)
        if patched:
            fl_hf.patch(model, backend="torch")
        replicas = _replicate(model, scales)

        def loss(i):
            input_ids, attention_mask, labels = inputs[i]
            if not patched:
                return hf_formula(replicas[i](input_ids, attention_mask=attention_mask).logits, labels)
            out = replicas[i](input_ids, attention_mask=attention_mask, labels=labels)
            assert out.logits is None
            return out.loss

        hook = model.model.norm.register_forward_pre_hook(_in_step(len(scales)))
        try:
            losses = torch.stack(_run_threads(loss, len(scales)))
        finally:
            hook.remove()
        return losses.detach(), param_grads(model, losses.sum())

    losses, grads = run(True)
    ref_losses, ref_grads = run(False)
    assert len(set(ref_losses.tolist())) == len(scales)
    assert ((losses - ref_losses).abs() / ref_losses).max() < 1e-10
    assert_each_close(grads, ref_grads, 1e-10)


def _peft_added_tokens(name, recipe):
    peft = pytest.importorskip("peft")
    model = make_model(name)
    extra = ({"modules_to_save": ["lm_head"]} if recipe == "modules_to_save"
             else {"trainable_token_indices": {"embed_tokens": [3, 5, 7, 11]}})
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                          init_lora_weights=False, **extra)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # trained rows that differ from the base head's
        for n, p in pm.named_parameters():
            if "modules_to_save" in n or "trainable_tokens_delta" in n:
                p.mul_(1.5).add_(0.05)
    return pm


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # PEFT on a tied head
@pytest.mark.parametrize("name, recipe", [("llama", "modules_to_save"), ("qwen2-tied", "modules_to_save"),
                                          ("qwen2-tied", "trainable_token_indices")])
def test_peft_heads_for_added_tokens(name, recipe):
    """PEFT's recipes for training added tokens wrap the head (ModulesToSaveWrapper, TrainableTokensWrapper):
    the loss and every gradient, the trained head rows' included, are the PEFT model's own; with the adapters
    off too."""
    pm = _peft_added_tokens(name, recipe)
    input_ids, attention_mask, labels = batch(21)
    ref_loss = hf_formula(pm(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
    ref = param_grads(pm, ref_loss)
    trained = [n for n in ref if "modules_to_save" in n or "trainable_tokens_delta" in n]
    assert trained and all(ref[n].norm() > 0 for n in trained)
    fl_hf.patch(pm, backend="torch")
    out = pm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits is None and plain_rel_err(out.loss, ref_loss) < 1e-10
    assert_each_close(param_grads(pm, out.loss), ref, 1e-10)
    with pm.disable_adapter():
        fl_hf.unpatch(pm)
        off = hf_formula(pm(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
        fl_hf.patch(pm, backend="torch")
        got = pm(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    assert plain_rel_err(got, off) < 1e-10 and plain_rel_err(off, ref_loss) > 1e-6


def test_a_lora_on_the_head_added_after_patch_names_the_fix():
    peft = pytest.importorskip("peft")
    model = fl_hf.patch(make_model("llama"), backend="torch")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0,
                          init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg)
    input_ids, attention_mask, labels = batch(22)
    with pytest.raises(RuntimeError, match=r"wrapped or replaced after patch\(\) .* call "
                                           r"fusedloss.integrations.transformers.patch\(model\) again after adding "
                                           "adapters"):
        pm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    ref_loss = hf_formula(pm(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
    ref = param_grads(pm, ref_loss)
    fl_hf.patch(pm, backend="torch")
    out = pm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert out.logits is None and plain_rel_err(out.loss, ref_loss) < 1e-10
    assert_each_close(param_grads(pm, out.loss), ref, 1e-10)


class _UsersError(Exception):
    pass


@pytest.mark.parametrize("where", ["forward hook", "forward pre-hook"])
@pytest.mark.parametrize("model_class", ["llama", "own loss"])
def test_an_error_raised_in_the_head_reaches_the_caller_as_it_is(where, model_class):
    """The user's exception from the LM head (a hook on it) is not re-labelled as an unsupported architecture,
    whether or not the model computes its loss through self.loss_function; the next call is exact."""
    if model_class == "llama":
        model = make_model("llama")
    else:
        torch.manual_seed(0)
        model = _OwnLossLlama(CONFIGS["llama"]()).to(torch.float64)
    fl_hf.patch(model, backend="torch")
    raised = []

    def hook(*args):
        raised.append(_UsersError("from the user's hook"))
        raise raised[-1]

    register = model.lm_head.register_forward_hook if where == "forward hook" else \
        model.lm_head.register_forward_pre_hook
    handle = register(hook)
    input_ids, attention_mask, labels = batch(23)
    with pytest.raises(_UsersError) as info:
        model(input_ids, attention_mask=attention_mask, labels=labels)
    assert info.value is raised[-1]
    with pytest.raises(_UsersError) as info:  # the helpers too
        fl_hf.causal_lm_logprobs(model, input_ids, attention_mask, backend="torch")
    assert info.value is raised[-1]
    handle.remove()
    if model_class == "llama":
        ref = hf_formula(model(input_ids, attention_mask=attention_mask).logits, labels)
        assert plain_rel_err(model(input_ids, attention_mask=attention_mask, labels=labels).loss, ref) < 1e-10


class _FakeZero3:
    """DeepSpeed ZeRO-3 as the LM head sees it, without DeepSpeed: the head's parameters hold an empty partition
    except inside its own forward (a pre-hook gathers them, a hook releases them) and inside
    ``deepspeed.zero.GatheredParameters``; ``ds_id`` / ``ds_status`` / ``ds_shape`` as DeepSpeed sets them."""

    class Status:
        AVAILABLE, NOT_AVAILABLE = "AVAILABLE", "NOT_AVAILABLE"

    def __init__(self, module):
        self.full = {}
        for param in module.parameters(recurse=False):
            self.full[param] = param.data
            param.ds_id, param.ds_shape = len(self.full), tuple(param.shape)
            self.release([param])
        module.register_forward_pre_hook(lambda m, args: self.gather(list(self.full)))
        module.register_forward_hook(lambda m, args, out: self.release(list(self.full)))

    def gather(self, params):
        for p in params:
            p.data, p.ds_status = self.full[p], self.Status.AVAILABLE

    def release(self, params):
        for p in params:
            p.data, p.ds_status = torch.empty(0, dtype=p.dtype), self.Status.NOT_AVAILABLE

    def module(self):
        import contextlib
        import types

        zero3 = self

        @contextlib.contextmanager
        def gathered_parameters(params, modifier_rank=None):
            zero3.gather(params)
            try:
                yield
            finally:
                zero3.release(params)

        ds = types.ModuleType("deepspeed")
        ds.zero = types.SimpleNamespace(GatheredParameters=gathered_parameters)
        status = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
        status.ZeroParamStatus = self.Status
        return {"deepspeed": ds, "deepspeed.runtime": types.ModuleType("deepspeed.runtime"),
                "deepspeed.runtime.zero": types.ModuleType("deepspeed.runtime.zero"),
                "deepspeed.runtime.zero.partition_parameters": status}


def test_a_zero3_partitioned_head_is_read_gathered(monkeypatch):
    """A ZeRO-3 head holds an empty partition outside its forward: the patch takes it, checks the head's output
    against the gathered weight (inside the head's forward), and the loss gathers it again; the loss and every
    gradient are the model's own."""
    import sys

    model = make_model("llama")
    input_ids, attention_mask, labels = batch(24)
    ref_loss = hf_formula(model(input_ids, attention_mask=attention_mask).logits, labels)
    ref = param_grads(model, ref_loss)
    zero3 = _FakeZero3(model.lm_head)
    for name, module in zero3.module().items():
        monkeypatch.setitem(sys.modules, name, module)
    assert model.lm_head.weight.numel() == 0
    fl_hf.patch(model, backend="torch")
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    assert model.lm_head.weight.numel() == 0  # released after the head's forward: the loss gathered it itself
    assert out.logits is None and plain_rel_err(out.loss, ref_loss) < 1e-10
    got = param_grads(model, out.loss)
    assert_each_close(got, ref, 1e-10)
    checked = []  # the head check reads the gathered weight, not the empty partition
    check = fl_hf._tap._check_head_product
    monkeypatch.setattr(fl_hf._tap, "_check_head_product",
                        lambda call, w, b: (checked.append(w.shape), check(call, w, b)))
    fl_hf.patch(fl_hf.unpatch(model), backend="torch")
    model(input_ids, attention_mask=attention_mask, labels=labels)
    assert checked == [(V, 32)]
    fl_hf.unpatch(model)  # the helpers: the same log-probs and head gradient
    plain = make_model("llama")
    ref_logp = fl_hf.causal_lm_logprobs(plain, input_ids, attention_mask, backend="torch")
    logp = fl_hf.causal_lm_logprobs(model, input_ids, attention_mask, backend="torch")
    assert ((logp - ref_logp).abs().max() / ref_logp.abs().max()) < 1e-10
    cotangent = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).reshape(logp.shape)
    (head_grad,) = torch.autograd.grad((cotangent * logp).sum(), model.lm_head.weight)
    (ref_head_grad,) = torch.autograd.grad((cotangent * ref_logp).sum(), plain.lm_head.weight)
    assert head_grad.shape == (V, 32)
    assert_each_close({"lm_head.weight": head_grad}, {"lm_head.weight": ref_head_grad}, 1e-10)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # PEFT on a tied head
def test_a_last_turn_only_label_mask_gets_the_models_own_gradients():
    """Labels -100 everywhere but the last turn (no probe row of the head lands on a scored position): with
    LoRA, the loss and every gradient are the model's own, and the adapters' gradients are not zero."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0,
                          init_lora_weights=False)
    pm = peft.get_peft_model(make_model("gemma2-softcap"), cfg)
    g = torch.Generator().manual_seed(25)
    input_ids = torch.randint(3, V, (2, 40), generator=g)
    labels = torch.full_like(input_ids, -100)
    labels[0, 31:36] = input_ids[0, 31:36]  # the last assistant turn, then padding
    labels[1, 37:] = input_ids[1, 37:]
    ref_loss = hf_formula(pm(input_ids=input_ids).logits, labels)
    ref = param_grads(pm, ref_loss)
    fl_hf.patch(pm, backend="torch")
    out = pm(input_ids=input_ids, labels=labels)
    assert out.logits is None and plain_rel_err(out.loss, ref_loss) < 1e-10
    got = param_grads(pm, out.loss)
    assert_each_close(got, ref, 1e-10)
    lora = [n for n in got if "lora" in n]
    assert len(lora) == 2 * 2 * 2 + 2 and all(got[n].norm() > 0 for n in lora)
