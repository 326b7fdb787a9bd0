"""fusedloss.integrations.transformers against the models' own logits (tiny random models, CPU)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")

from _errors import assert_each_close  # noqa: E402
from conftest import param_grads  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    LlamaConfig,
    Qwen2Config,
)

from fusedloss.integrations import transformers as fl_hf  # noqa: E402

V = 101  # prime: no tile size divides it
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=V, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

CONFIGS = {
    "llama-untied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False),
    "qwen2-tied": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),
    "gemma2-softcap": lambda: Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=3.0),
    "cohere-logit-scale": lambda: CohereConfig(**SMALL, logit_scale=0.25),
}


def make_model(name, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=dtype)
    with torch.no_grad():  # a peaked head: a few logits far above the rest
        model.get_output_embeddings().weight[:3].mul_(6.0)
    return model.eval()


def batch(seed=0, b=3, t=11):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (b, t), generator=g)
    attention_mask = torch.ones(b, t, dtype=torch.long)
    attention_mask[1, -4:] = 0  # right padding
    attention_mask[2, -1:] = 0
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask


def model_logprobs(model, input_ids, attention_mask, temperature=1.0, labels=None):
    """Per-token log-probs and entropy from the model's own materialised logits."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logq = torch.log_softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
                             / temperature, dim=-1)
    targets = (input_ids if labels is None else labels)[:, 1:]
    valid = (attention_mask[:, 1:] != 0) & (targets != -100)
    logp = logq.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logq.exp() * logq).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(valid, logp, zero), torch.where(valid, entropy, zero)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_logprobs_match_model_logits(name, dtype, rtol):
    model = make_model(name, dtype)
    input_ids, attention_mask = batch()
    temperature = 0.7
    w = torch.rand(input_ids.shape[0], input_ids.shape[1] - 1, dtype=dtype)

    logp, entropy = fl_hf.causal_lm_logprobs(model, input_ids, attention_mask, temperature=temperature,
                                             return_entropy=True, backend="torch")
    ref_logp, ref_entropy = model_logprobs(model, input_ids, attention_mask, temperature)
    assert logp.shape == (3, 10) and logp.dtype == ref_logp.dtype
    torch.testing.assert_close(logp, ref_logp, rtol=rtol, atol=rtol)
    torch.testing.assert_close(entropy, ref_entropy, rtol=rtol, atol=rtol)
    assert (logp[attention_mask[:, 1:] == 0] == 0).all() and (entropy[attention_mask[:, 1:] == 0] == 0).all()

    got = param_grads(model, (w * logp).sum() + 0.1 * entropy.sum())
    ref = param_grads(model, (w * ref_logp).sum() + 0.1 * ref_entropy.sum())
    assert_each_close(got, ref, 10 * rtol)


def test_labels_mask_and_no_entropy():
    model = make_model("llama-untied")
    input_ids, attention_mask = batch(1)
    labels = input_ids.clone()
    labels[:, :5] = -100  # the prompt is not scored
    logp = fl_hf.causal_lm_logprobs(model, input_ids, attention_mask, labels=labels, backend="torch")
    ref, _ = model_logprobs(model, input_ids, attention_mask, labels=labels)
    assert isinstance(logp, torch.Tensor)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    assert (logp[:, :4] == 0).all()


def test_no_logits_are_materialised():
    model = make_model("qwen2-tied")
    input_ids, attention_mask = batch(2)
    products = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: products.append(tuple(o.shape)))
    try:
        fl_hf.causal_lm_logprobs(model, input_ids, attention_mask, backend="torch")
    finally:
        hook.remove()
    assert products == [(1, 4, V)], "the LM head formed logits beyond its 4 probe rows"


def test_tied_head_gradient_reaches_the_embedding():
    model = make_model("qwen2-tied")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    input_ids, attention_mask = batch(3)
    got = param_grads(model, fl_hf.causal_lm_logprobs(model, input_ids, attention_mask, backend="torch").sum())
    ref = param_grads(model, model_logprobs(model, input_ids, attention_mask)[0].sum())
    assert_each_close(got, ref, 1e-5)


@pytest.mark.parametrize("lora_on_head", [False, True])
def test_peft_model(lora_on_head):
    peft = pytest.importorskip("peft")
    model = make_model("llama-untied")
    targets = ["q_proj", "v_proj"] + (["lm_head"] if lora_on_head else [])
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    peft_model = peft.get_peft_model(model, cfg)
    input_ids, attention_mask = batch(4)
    logp = fl_hf.causal_lm_logprobs(peft_model, input_ids, attention_mask, backend="torch")
    ref, _ = model_logprobs(peft_model, input_ids, attention_mask)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    got = param_grads(peft_model, logp.sum())
    want = param_grads(peft_model, model_logprobs(peft_model, input_ids, attention_mask)[0].sum())
    assert any("lora" in n for n in got)
    assert_each_close(got, want, 1e-5)
    with peft_model.disable_adapter():  # the adapters are off in the backbone and in the head
        logp = fl_hf.causal_lm_logprobs(peft_model, input_ids, attention_mask, backend="torch")
        ref, _ = model_logprobs(peft_model, input_ids, attention_mask)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture
def single_process_group(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_head_goes_to_the_core_unchanged(single_process_group):
    """FSDP2 exposes parameters as DTensors: lm_head hands the sharded parameter itself to fusedloss, which
    gathers it (docs/design.md, "Distributed"), and the gradient goes back to the sharded parameter. (Over
    several ranks, with FSDP's averaging: tests/contract/test_integration_fsdp2.py.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    model = make_model("llama-untied")
    input_ids, attention_mask = batch(5)
    ref = model_logprobs(model, input_ids, attention_mask)[0]
    ref_grad = torch.autograd.grad(ref.sum(), model.lm_head.weight)[0]

    mesh = init_device_mesh("cpu", (1,))
    model.lm_head.weight = torch.nn.Parameter(distribute_tensor(model.lm_head.weight.detach(), mesh, [Shard(0)]))
    head = fl_hf.lm_head(model)
    assert isinstance(head.weight, DTensor) and head.weight is model.lm_head.weight
    logp = fl_hf.causal_lm_logprobs(model, input_ids, attention_mask, backend="torch")
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    logp.sum().backward()
    assert isinstance(model.lm_head.weight.grad, DTensor)
    torch.testing.assert_close(model.lm_head.weight.grad.full_tensor(), ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attrs,expected", [
    (dict(), (1.0, None)),
    (dict(logit_scale=None), (1.0, None)),  # MPT: None means unscaled
    (dict(logit_scale=0.0625, final_logit_softcapping=30.0), (0.0625, 30.0)),
    (dict(output_multiplier=2.0), (2.0, None)),
    (dict(lm_head_multiplier=0.5), (0.5, None)),
    (dict(logits_scaling=8.0, model_type="granite"), (0.125, None)),
    (dict(logits_scaling=8.0, model_type="hyperclovax"), (8.0, None)),
])
def test_logit_postprocessing_spellings(attrs, expected):
    assert fl_hf.logit_postprocessing(types.SimpleNamespace(**attrs)) == expected


def test_logit_postprocessing_reads_the_text_config():
    text = types.SimpleNamespace(final_logit_softcapping=30.0, logit_scale=None)
    outer = types.SimpleNamespace(get_text_config=lambda: text, final_logit_softcapping=None)
    assert fl_hf.logit_postprocessing(outer) == (1.0, 30.0)


def test_bad_input_ids_shape():
    model = make_model("llama-untied")
    with pytest.raises(ValueError, match="input_ids"):
        fl_hf.causal_lm_logprobs(model, torch.zeros(5, dtype=torch.long))


def _run_example(*args):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", args[0]), *args[1:]], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_plain_loop_example_on_matches_off():
    def losses(text):
        return [float(line.split()[-1]) for line in text.splitlines() if line.strip().startswith("step")]

    on = losses(_run_example("plain_loop.py", "--fusedloss", "on", "--steps", "2"))
    off = losses(_run_example("plain_loop.py", "--fusedloss", "off", "--steps", "2"))
    assert len(on) == len(off) == 4
    assert on == pytest.approx(off, rel=1e-5)


def test_left_padded_prompts_need_prompt_mask():
    model = make_model("llama-untied")  # pad_token_id 0, bos 1
    prompt, completion = batch(6)[0][:, :5], batch(6)[0][:, 5:]
    prompt[1, :2] = 0  # left padding
    with pytest.raises(ValueError, match="prompt_ids row 1 starts with the pad token .* need prompt_mask"):
        fl_hf.completion_logprobs(model, prompt, completion, backend="torch")
    fl_hf.completion_logprobs(model, prompt, completion, prompt_mask=(prompt != 0).long(), backend="torch")


def test_a_soft_capped_head_passed_without_its_options_is_warned_about():
    import warnings

    import fusedloss

    model = make_model("gemma2-softcap", dtype=torch.float64)
    input_ids, _ = batch(7)
    head = fl_hf.lm_head(model)
    assert head.softcap == 3.0
    hidden = fl_hf.last_hidden_state(model, input_ids)[:, :-1]
    targets = input_ids[:, 1:]
    with pytest.warns(UserWarning, match=r"weight is the LM head of a model whose logits have softcap=3.*"
                                         r"\*\*lm_head\(model\)\.options"):
        bare = fusedloss.cross_entropy(hidden, head.weight, targets, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right call, the patched model and a plain head: no warning
        right = fusedloss.cross_entropy(hidden, head.weight, targets, backend="torch", **head.options)
        fl_hf.patch(model)
        patched = model(input_ids, labels=input_ids).loss
        fl_hf.unpatch(model)
        plain = make_model("llama-untied", dtype=torch.float64)
        plain_head = fl_hf.lm_head(plain)
        fusedloss.cross_entropy(fl_hf.last_hidden_state(plain, input_ids)[:, :-1], plain_head.weight, targets,
                                backend="torch")
    # what the warning is about: the bare call is another model's loss, the right one is the model's own
    assert torch.allclose(right, patched, rtol=1e-10)
    assert not torch.allclose(bare, right, rtol=1e-8)  # tiny random logits: the cap bends them only a little
    # a teacher's head is checked under its own name
    with pytest.warns(UserWarning, match="teacher_weight is the LM head"):
        fusedloss.distillation_loss(hidden, head.weight, hidden, head.weight, beta=1.0, backend="torch",
                                    **head.options)
