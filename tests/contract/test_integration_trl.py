"""TRL trainers with fusedloss enabled match TRL's own fused path step by step.

Each case trains a tiny random model (built from a config, float32, CPU) for 3 optimizer steps twice, once
with ``fusedloss.integrations.trl.enable()`` and once with TRL's ``trl/kernels`` functions, from the same
seed, and compares every logged number (losses, rewards, KL, entropy, clip ratios, logits metrics, accuracy,
gradient norms), the whole gradient before every optimizer step and every parameter after it.
The optimizer is plain SGD: Adam divides each gradient entry by its own running magnitude, so entries that
are zero in exact arithmetic (the gradient of an attention key bias, by softmax shift invariance) would
turn rounding noise into full-size, sign-random updates, and a parameter comparison would measure that
noise rather than the loss. Generation happens once per run
(``steps_per_generation=3``) so that both runs train on identical completions.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch
from _errors import plain_rel_err

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config, TrainerCallback  # noqa: E402

import fusedloss  # noqa: E402
from fusedloss.integrations import trl as fl_trl  # noqa: E402

# Timing numbers and counters that legitimately differ between two runs.
_UNCOMPARED = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
RTOL, ATOL = 1e-5, 1e-6


def tiny_tokenizer():
    """The example's one-token-per-character tokenizer (examples/grpo_trl.py): the test trains what it shows."""
    path = Path(__file__).resolve().parents[2] / "examples" / "grpo_trl.py"
    spec = importlib.util.spec_from_file_location("fusedloss_example_grpo_trl", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.char_tokenizer()


def tiny_model(vocab_size, seed=0, hidden=32, **config):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=128, pad_token_id=0,
                      eos_token_id=1, bos_token_id=None, tie_word_embeddings=False, **config)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _reward(completions, **kwargs):
    # Varied, deterministic rewards so that few groups are silent.
    return [float(sum(ord(ch) for ch in c) % 7) / 3.0 for c in completions]


class _Recorder(TrainerCallback):
    def __init__(self):
        self.params, self.grads = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})


class _CallCounter:
    def __init__(self, monkeypatch):
        self.logprob = self.divergence = 0
        for cls, attr in ((fl_trl.FusedChunkedLogProbFunction, "logprob"),
                          (fl_trl.FusedChunkedDivergenceFunction, "divergence")):
            original = cls.apply

            def counted(*args, _original=original, _attr=attr, **kwargs):
                setattr(self, _attr, getattr(self, _attr) + 1)
                return _original(*args, **kwargs)

            monkeypatch.setattr(cls, "apply", staticmethod(counted))


def _run(make_trainer, fused):
    if fused:
        fl_trl.enable(backend="torch")
    else:
        fl_trl.disable()
    try:
        recorder = _Recorder()
        trainer = make_trainer()
        trainer.add_callback(recorder)
        trainer.train()
    finally:
        fl_trl.disable()
    logs = [{k: v for k, v in entry.items() if k not in _UNCOMPARED} for entry in trainer.state.log_history]
    return logs, recorder.grads, recorder.params


def _assert_runs_match(make_trainer, monkeypatch):
    counter = _CallCounter(monkeypatch)
    fused_logs, fused_grads, fused_params = _run(make_trainer, fused=True)
    assert counter.logprob + counter.divergence > 0, "fusedloss was never called"
    calls = (counter.logprob, counter.divergence)
    trl_logs, trl_grads, trl_params = _run(make_trainer, fused=False)
    assert (counter.logprob, counter.divergence) == calls, "fusedloss was called while disabled"
    assert len(fused_logs) == len(trl_logs) == 4  # 3 steps + the summary
    for step, (a, b) in enumerate(zip(fused_logs, trl_logs)):
        assert a.keys() == b.keys(), step
        for key in a:
            if isinstance(a[key], float) and math.isfinite(a[key]):
                assert a[key] == pytest.approx(b[key], rel=RTOL, abs=ATOL), (step, key, a[key], b[key])
            else:
                assert a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]), (step, key)
    assert any(entry.get("grad_norm", 0.0) > 0 for entry in fused_logs), "no step produced a gradient"
    assert len(fused_grads) == len(trl_grads) == 3
    for step, (ga, gb) in enumerate(zip(fused_grads, trl_grads)):
        assert ga.keys() == gb.keys()
        total = torch.cat([g.flatten() for g in gb.values()]).norm().clamp(min=1e-12)
        diff = torch.cat([(ga[n] - gb[n]).flatten() for n in gb]).norm()
        assert diff / total < RTOL, (step, (diff / total).item())
        for name in gb:  # per tensor, on the scale of the whole gradient
            assert (ga[name] - gb[name]).norm() / total < RTOL, (step, name)
    assert len(fused_params) == len(trl_params) == 3
    for step, (pa, pb) in enumerate(zip(fused_params, trl_params)):
        for name in pa:
            err = plain_rel_err(pa[name], pb[name], 1e-12)
            assert err < RTOL, (step, name, err)
    return fused_logs


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tokenizer):
    # GRPO builds its reference model from the policy's path, so the tiny model lives in a folder.
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tiny_model(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _common_args(tmp_path):
    return dict(output_dir=str(tmp_path), max_steps=3, logging_steps=1, report_to="none", bf16=False, use_cpu=True,
                seed=0, save_strategy="no", disable_tqdm=True, learning_rate=0.05, optim="sgd",
                gradient_checkpointing=False)


@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.0), ("grpo", 0.0), ("dapo", 0.05), ("grpo", 0.1),
                                            ("sapo", 0.05)])
def test_grpo_matches_trl(loss_type, beta, saved_model, tokenizer, tmp_path, monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    prompts = [f"{a}+{b}=" for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1))]
    dataset = Dataset.from_dict({"prompt": prompts})
    args = GRPOConfig(**_common_args(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, steps_per_generation=3, loss_type=loss_type, beta=beta,
                      temperature=0.9, model_init_kwargs={"dtype": torch.float32})

    def make():
        return GRPOTrainer(model=saved_model, reward_funcs=_reward, args=args, train_dataset=dataset,
                           processing_class=tokenizer)

    logs = _assert_runs_match(make, monkeypatch)
    assert ("kl" in logs[0]) == (beta > 0)
    assert "entropy" in logs[0]


MPO = dict(loss_type=["sigmoid", "bco_pair"], loss_weights=[0.8, 0.2])


@pytest.mark.parametrize("use_weighting, loss", [(False, {}), (True, {}), (False, MPO)],
                         ids=["sigmoid", "sigmoid-wpo", "mpo"])
def test_dpo_matches_trl(use_weighting, loss, tokenizer, tmp_path, monkeypatch):
    from trl import DPOConfig, DPOTrainer

    rows = [("1+2=", "3", "4"), ("3+4=", "7", "1"), ("5+1=", "6", "9"), ("2+2=", "4", "5"),
            ("8+1=", "9", "0"), ("0+3=", "3", "2"), ("4+4=", "8", "6"), ("6+3=", "9", "7")]
    dataset = Dataset.from_dict({"prompt": [r[0] for r in rows], "chosen": [r[1] + " ok" for r in rows],
                                 "rejected": [r[2] + " no!" for r in rows]})
    args = DPOConfig(**_common_args(tmp_path), per_device_train_batch_size=4, beta=0.5,
                     use_weighting=use_weighting, **loss)

    def make():
        return DPOTrainer(model=tiny_model(len(tokenizer)), ref_model=tiny_model(len(tokenizer)), args=args,
                          train_dataset=dataset, processing_class=tokenizer)

    logs = _assert_runs_match(make, monkeypatch)
    assert "mean_token_accuracy" in logs[0] or any("accuracy" in k for k in logs[0])


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_distillation_matches_trl(beta, tokenizer, tmp_path, monkeypatch):
    from trl import DistillationConfig, DistillationTrainer

    dataset = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))]})
    args = DistillationConfig(**_common_args(tmp_path), per_device_train_batch_size=4, max_completion_length=6,
                              beta=beta, temperature=0.8)

    def make():
        return DistillationTrainer(model=tiny_model(len(tokenizer)), teacher_model=tiny_model(len(tokenizer), 1, 48),
                                   args=args, train_dataset=dataset, processing_class=tokenizer)

    _assert_runs_match(make, monkeypatch)



def _gkd_collator(rows):
    """Prompt and completion token ids, right-padded: GKD's collated fields, labels -100 on prompt and padding."""
    width = max(len(r["prompt"]) + len(r["completion"]) for r in rows)
    prompt_width = max(len(r["prompt"]) for r in rows)
    batch = {k: [] for k in ("input_ids", "attention_mask", "labels", "prompts", "prompt_attention_mask")}
    for r in rows:
        ids = r["prompt"] + r["completion"]
        pad = width - len(ids)
        batch["input_ids"].append(ids + [0] * pad)
        batch["attention_mask"].append([1] * len(ids) + [0] * pad)
        batch["labels"].append([-100] * len(r["prompt"]) + r["completion"] + [-100] * pad)
        ppad = prompt_width - len(r["prompt"])
        batch["prompts"].append([0] * ppad + r["prompt"])
        batch["prompt_attention_mask"].append([0] * ppad + [1] * len(r["prompt"]))
    return {k: torch.tensor(v) for k, v in batch.items()}


def tiny_gemma2(vocab_size, seed=1, hidden=40):
    """A soft-capped teacher (Gemma 2's final_logit_softcapping) of another width than the student."""
    from transformers import Gemma2Config

    torch.manual_seed(seed)
    cfg = Gemma2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=vocab_size, max_position_embeddings=128,
                       pad_token_id=0, eos_token_id=1, bos_token_id=None, final_logit_softcapping=2.0,
                       tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.parametrize("beta, teacher", [(0.0, "qwen2"), (0.5, "gemma2"), (1.0, "qwen2")])
@pytest.mark.parametrize("num_items", [False, True])
def test_gkd_matches_trl(beta, teacher, num_items, tokenizer, tmp_path, monkeypatch):
    """GKDTrainer (off-policy, lmbda=0): fusedloss's compute_loss against TRL's on materialised logits, 3 steps:
    logs, gradients and parameters; with ``average_tokens_across_devices`` the loss is sum / num_items_in_batch.
    The teacher is wider than the student, and soft-capped (Gemma 2) in one case."""
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    calls = []
    original = fl_trl._gkd_fused_loss
    monkeypatch.setattr(fl_trl, "_gkd_fused_loss", lambda *a: calls.append(1) or original(*a))
    g = torch.Generator().manual_seed(5)
    rows = [{"prompt": torch.randint(3, len(tokenizer), (int(p),), generator=g).tolist(),
             "completion": torch.randint(3, len(tokenizer), (int(c),), generator=g).tolist()}
            for p, c in ((3, 5), (5, 2), (2, 6), (4, 4), (6, 3), (3, 3), (2, 5), (4, 2))]
    dataset = Dataset.from_list(rows)
    args = GKDConfig(**_common_args(tmp_path), per_device_train_batch_size=4, lmbda=0.0, beta=beta,
                     seq_kd=False, max_length=32, average_tokens_across_devices=num_items)

    def make():
        teacher_model = tiny_model(len(tokenizer), 1, 48) if teacher == "qwen2" else tiny_gemma2(len(tokenizer))
        return GKDTrainer(model=tiny_model(len(tokenizer)), teacher_model=teacher_model,
                          args=args, train_dataset=dataset, processing_class=tokenizer, data_collator=_gkd_collator)

    fused_logs, fused_grads, fused_params = _run(make, fused=True)
    assert len(calls) == 3, "fusedloss was not called once per step"
    trl_logs, trl_grads, trl_params = _run(make, fused=False)
    assert len(calls) == 3, "fusedloss was called while disabled"
    assert len(fused_logs) == len(trl_logs) == 4
    for step, (a, b) in enumerate(zip(fused_logs, trl_logs)):
        assert a.keys() == b.keys(), step
        for key in a:
            if isinstance(a[key], float):
                assert a[key] == pytest.approx(b[key], rel=RTOL, abs=ATOL), (step, key, a[key], b[key])
    assert fused_logs[0]["loss"] > 0 and fused_logs[0]["grad_norm"] > 0
    for ga, gb in zip(fused_grads, trl_grads):
        assert ga.keys() == gb.keys()
        total = torch.cat([x.flatten() for x in gb.values()]).norm()
        assert torch.cat([(ga[n] - gb[n]).flatten() for n in gb]).norm() / total < RTOL
    for pa, pb in zip(fused_params, trl_params):
        for name in pa:
            if name.endswith("k_proj.bias"):
                # Its gradient is 0 in exact arithmetic (softmax shift invariance): from its zero start the
                # parameter holds rounding noise only, in both runs; checked to stay noise.
                assert pa[name].norm() < 1e-5 and pb[name].norm() < 1e-5, name
                continue
            assert plain_rel_err(pa[name], pb[name], 1e-12) < RTOL, name


def test_gkd_keeps_trls_method_where_its_logits_are_needed(tokenizer, tmp_path):
    """return_outputs=True (evaluation) returns TRL's (loss, outputs with logits), and disable() restores the
    very function TRL defined."""
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    before = GKDTrainer.__dict__["compute_loss"]
    rows = [{"prompt": [5, 6, 7], "completion": [8, 9]}] * 2
    args = GKDConfig(**_common_args(tmp_path), per_device_train_batch_size=2, lmbda=0.0, seq_kd=False)
    with fl_trl.enabled(backend="torch"):
        assert GKDTrainer.__dict__["compute_loss"] is fl_trl._gkd_compute_loss
        trainer = GKDTrainer(model=tiny_model(len(tokenizer)), teacher_model=tiny_model(len(tokenizer), 1),
                             args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                             data_collator=_gkd_collator)
        inputs = _gkd_collator(rows)
        loss, outputs = trainer.compute_loss(trainer.model, inputs, return_outputs=True)
        assert outputs.logits.shape[-1] == len(tokenizer)
        fused = trainer.compute_loss(trainer.model, inputs)
        assert fused.item() == pytest.approx(loss.item(), rel=1e-5)
    assert GKDTrainer.__dict__["compute_loss"] is before

def test_enable_is_idempotent_and_disable_restores_trl():
    import trl.kernels
    import trl.kernels.chunked_divergence
    import trl.kernels.chunked_logprob
    import trl.trainer.distillation_trainer
    import trl.trainer.utils

    sites = [(trl.trainer.utils, "_ChunkedLogProbFunction"), (trl.kernels, "ChunkedLogProbFunction"),
             (trl.kernels.chunked_logprob, "ChunkedLogProbFunction"),
             (trl.trainer.distillation_trainer, "ChunkedDivergenceFunction"),
             (trl.kernels.chunked_divergence, "ChunkedDivergenceFunction")]
    before = [getattr(m, a) for m, a in sites]
    fl_trl.enable()
    fl_trl.enable(backend="torch")
    assert fl_trl.is_enabled()
    assert [getattr(m, a) for m, a in sites] == [fl_trl.FusedChunkedLogProbFunction] * 3 + [
        fl_trl.FusedChunkedDivergenceFunction] * 2
    fl_trl.disable()
    fl_trl.disable()
    assert not fl_trl.is_enabled()
    assert all(getattr(m, a) is b for (m, a), b in zip(sites, before))
    with fl_trl.enabled():
        assert trl.trainer.utils._ChunkedLogProbFunction is fl_trl.FusedChunkedLogProbFunction
    assert trl.trainer.utils._ChunkedLogProbFunction is before[0]
    with pytest.raises(ValueError, match="backend"):
        fl_trl.enable(backend="tpu")
    assert not fl_trl.is_enabled()


def test_a_backend_that_cannot_run_here_is_refused_at_enable():
    unavailable = {name: state for name, state in fusedloss.backend_status().items()
                   if name != "gpu" and state != "available"}
    for name, state in unavailable.items():  # on a CPU machine: cuda (and triton without the interpreter)
        with pytest.raises(ValueError, match=rf"backend='{name}' cannot run here \({re.escape(state)}\).*'auto'"):
            fl_trl.enable(backend=name)
        assert not fl_trl.is_enabled()
    available = [name for name in ("torch", "triton", "cuda") if name not in unavailable]
    for name in available:
        with fl_trl.enabled(backend=name):
            assert fl_trl.is_enabled()
    assert "torch" in available and (torch.cuda.is_available() or "cuda" in unavailable)


def test_unsupported_trl_version_is_refused(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "2.0.0")
    with pytest.raises(RuntimeError, match=r"trl>=1.16,<2.*2\.0\.0"):
        fl_trl.enable()
    monkeypatch.setattr(trl, "__version__", "1.15.2")
    with pytest.raises(RuntimeError, match="1.15.2"):
        fl_trl.enable()
    assert not fl_trl.is_enabled()


OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.mark.parametrize("softcap,logit_scale,temperature,with_bias", [
    (None, 1.0, 1.0, False), (None, 1.0, 0.7, True), (2.5, 0.5, 1.3, True), (None, 4.0, 1.0, False)])
def test_logprob_function_matches_trl_kernel(softcap, logit_scale, temperature, with_bias):
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    g = torch.Generator().manual_seed(0)
    n, d, v = 29, 16, 211  # prime vocabulary, odd token count
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (torch.randn(v, d, generator=g) * 0.5).requires_grad_()
    weight.data[:3] *= 8.0  # a few peaked logits
    bias = torch.randn(v, generator=g).requires_grad_() if with_bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[:4] = 1  # often the top token
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    for outputs in (OUTPUTS, ("entropy",), ()):
        ref = ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, 64, softcap, logit_scale,
                                           outputs)
        got = fl_trl.FusedChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, 64, softcap,
                                                       logit_scale, outputs)
        for name, r, o in zip(("log_probs",) + OUTPUTS, ref, got):
            if r is None:
                assert o is None, name
                continue
            assert o.dtype == r.dtype and o.shape == r.shape, name
            if r.dtype == torch.bool:
                assert torch.equal(o, r), name
            else:
                torch.testing.assert_close(o, r, rtol=1e-5, atol=2e-5, msg=name)
                assert o.requires_grad == r.requires_grad, name
        loss_ref = ref[0].square().sum() + (ref[1].sum() if ref[1] is not None else 0)
        loss_got = got[0].square().sum() + (got[1].sum() if got[1] is not None else 0)
        for r, o in zip(torch.autograd.grad(loss_ref, inputs), torch.autograd.grad(loss_got, inputs)):
            assert plain_rel_err(o, r) < 1e-5



@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_divergence_function_matches_trl_kernel(beta):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    g = torch.Generator().manual_seed(1)
    n, d, dt, v = 23, 16, 24, 197
    hs = torch.randn(n, d, generator=g).requires_grad_()
    ws = torch.randn(v, d, generator=g).requires_grad_()
    bs = torch.randn(v, generator=g).requires_grad_()
    ht, wt, bt = torch.randn(n, dt, generator=g), torch.randn(v, dt, generator=g), torch.randn(v, generator=g)
    args = (hs, ws, bs, ht, wt, bt, beta, 0.9, 0.8, 4.0, 1.5, None)
    ref = ChunkedDivergenceFunction.apply(*args)
    got = fl_trl.FusedChunkedDivergenceFunction.apply(*args)
    for r, o in zip(ref, got):
        assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    assert got[0].requires_grad and not got[1].requires_grad
    w = torch.rand(n, generator=g)
    for r, o in zip(torch.autograd.grad((ref[0] * w).sum(), (hs, ws, bs)),
                    torch.autograd.grad((got[0] * w).sum(), (hs, ws, bs))):
        assert plain_rel_err(o, r) < 1e-5


@pytest.mark.parametrize("teacher_scale,teacher_softcap", [(1.0, 3.0), (0.7, 2.5), (-1.3, None)])
def test_divergence_with_teacher_scale_and_softcap_matches_trl(recwarn, teacher_scale, teacher_softcap):
    """The teacher's own logit_scale and soft-cap are applied by the core (no fallback to TRL, no warning)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    g = torch.Generator().manual_seed(2)
    hs = torch.randn(5, 8, generator=g).requires_grad_()
    ws = torch.randn(31, 8, generator=g).requires_grad_()
    ht, wt, bt = torch.randn(5, 8, generator=g), torch.randn(31, 8, generator=g), torch.randn(31, generator=g)
    args = (hs, ws, None, ht, wt, bt, 0.5, 1.3, 1.0, None, teacher_scale, teacher_softcap)
    got = fl_trl.FusedChunkedDivergenceFunction.apply(*args)
    ref = ChunkedDivergenceFunction.apply(*args)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    for r, o in zip(torch.autograd.grad(ref[0].sum(), (hs, ws)), torch.autograd.grad(got[0].sum(), (hs, ws))):
        assert plain_rel_err(o, r) < 1e-5
    assert not any("fusedloss" in str(w.message) for w in recwarn)


@pytest.mark.slow
def test_grpo_example_runs():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "grpo_trl.py"), "--fusedloss", "on",
                          "--steps", "2", "--beta", "0.04"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fusedloss on" in out.stdout


def test_is_top1_breaks_ties_like_trl():
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    hidden, weight = torch.ones(2, 4), torch.zeros(11, 4)
    weight[3] = weight[7] = 1.0  # tokens 3 and 7 tie for the maximum
    targets = torch.tensor([3, 7])
    ref = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 64, None, 1.0, ("is_top1",))[4]
    got = fl_trl.FusedChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 64, None, 1.0, ("is_top1",))[4]
    assert torch.equal(got, ref)
