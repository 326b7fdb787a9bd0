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

from conftest import assert_each_close, param_grads  # noqa: E402
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


def rel(a, b):
    return ((a - b).abs() / b.abs()).item()


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
    assert rel(out.loss, ref_loss) < 1e-10
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
    assert rel(out.loss, hf_formula(logits, labels, shift_labels=shift)) < 1e-10
    # labels passed positionally: LlamaForCausalLM.forward(input_ids, attention_mask, position_ids, cache,
    # inputs_embeds, labels, ...)
    out = model(input_ids, attention_mask, None, None, None, labels)
    assert out.logits is None and rel(out.loss, hf_formula(logits, labels)) < 1e-10
    tup = model(input_ids, attention_mask=attention_mask, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and tup[0].dim() == 0 and all(t is None or t.shape[-1] != 0 for t in tup[1:]
                                                                if isinstance(t, torch.Tensor))
    assert rel(tup[0], hf_formula(logits, labels)) < 1e-10


def test_logits_to_keep_scores_the_kept_positions():
    model = make_model("llama")
    input_ids, attention_mask, labels = batch(3)
    logits = model(input_ids, attention_mask=attention_mask).logits
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    fl_hf.patch(model, backend="torch")
    out = model(input_ids, attention_mask=attention_mask, labels=labels, logits_to_keep=5)
    assert rel(out.loss, hf_formula(logits[:, -5:], None, shift_labels=shift[:, -5:])) < 1e-10
    keep = torch.tensor([0, 2, 3, 7])
    out = model(input_ids, attention_mask=attention_mask, labels=labels, logits_to_keep=keep)
    assert rel(out.loss, hf_formula(logits[:, keep], None, shift_labels=shift[:, keep])) < 1e-10


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
    assert rel(out.loss.double(), hf_formula(logits, labels)) < 1e-6
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
    assert out.logits is None and rel(out.loss, ref_loss) < 1e-10
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
    assert rel(out.loss, ref_loss) < 1e-10
    assert_each_close(param_grads(model, out.loss), ref, 1e-10)


def test_torch_compile():
    model = make_model("qwen2-tied")
    input_ids, attention_mask, labels = batch(7)
    ref_loss = hf_formula(model(input_ids, attention_mask=attention_mask).logits, labels, 19)
    ref = param_grads(model, ref_loss)
    fl_hf.patch(model, backend="torch")
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(input_ids, attention_mask=attention_mask, labels=labels, num_items_in_batch=19)
    assert out.logits is None and rel(out.loss, ref_loss) < 1e-10
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
    assert out.aux_loss is not None and rel(out.loss, ref_loss) < 1e-10


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


@pytest.mark.slow
def test_sft_trainer_example_on_matches_off():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
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
        assert out.logits is None and rel(out.loss, ref) < 1e-10
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
    assert out.logits is None and rel(out.loss, hf_formula(logits, labels)) < 1e-10


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
            assert rel(loss, ref_loss) < tol, rel(loss, ref_loss)
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
# What the patch observes, and what it refuses (every transformers architecture: tests/test_transformers_zoo.py)


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
    with pytest.raises(RuntimeError, match="Model post-processes its head's output .* not reproduce"):
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
    assert out.logits is None and rel(out.loss, ref_loss) < 1e-10
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
    assert rel(out.loss, ref_loss) < 1e-10
    assert fl_hf.lm_head(model).vocab_size == V - 7


def test_a_learned_parameter_on_the_logits_is_refused_even_at_one():
    """A learned scale of exactly 1 leaves the values alone, but fusedloss would give it no gradient."""
    model = transformed_llama(lambda m, z: z * m.logit_gain)
    model.logit_gain = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    fl_hf.patch(model, backend="torch")
    input_ids, attention_mask, labels = batch(16)
    with pytest.raises(RuntimeError, match=r"applies learned parameters to its logits \(logit_gain\)"):
        model(input_ids, attention_mask=attention_mask, labels=labels)
    with torch.no_grad():  # without autograd nothing can miss a gradient: the values decide
        assert model(input_ids, attention_mask=attention_mask, labels=labels).loss is not None


def test_a_transform_with_the_right_values_and_the_wrong_slope_is_refused():
    """The identity in value with slope 1.5 (a straight-through estimator): caught by the gradient check."""
    model = fl_hf.patch(transformed_llama(lambda m, z: z + 0.5 * (z - z.detach())), backend="torch")
    input_ids, attention_mask, labels = batch(17)
    with pytest.raises(RuntimeError, match="the values agree on the probe rows, the slopes do not"):
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
    with pytest.raises(RuntimeError, match="_OwnLossLlama computes its loss itself, not through "
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
