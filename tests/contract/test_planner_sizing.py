"""``fusedloss.estimate`` and ``python -m fusedloss estimate``: the sizes follow from the shapes by the formulas of
``fusedloss/sizing.py`` (checked here against numbers worked out by hand), the products from the cost model."""

from __future__ import annotations

import json

import pytest

import fusedloss
from fusedloss.__main__ import main
from fusedloss.backends.cuda import backend as cuda_backend
from fusedloss.core import workload as cost

GiB, MiB = 2**30, 2**20
QWEN_7B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "vocab_size": 152064}


def test_a_qwen_7b_sized_sft_batch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    est = fusedloss.estimate(tmp_path, tokens=16384, dtype="bf16")
    assert (est.hidden_size, est.vocab_size, est.dtype, est.op) == (3584, 152064, "bfloat16", "cross_entropy")
    assert est.logits_fp32_bytes == 16384 * 152064 * 4 == 9965666304  # the README's "10 GB in fp32"
    naive = est.path("materialised logits (naive)")
    # bf16 logits (2 B) and the fp32 log-softmax (4 B) held; d log-softmax (4 B) and d logits (2 B) in the backward
    assert naive.held_bytes == naive.transient_bytes == 16384 * 152064 * 6 == 14948499456
    assert naive.products == 3
    trl = est.path("TRL 1.16 chunked kernel")
    assert (trl.held_bytes, trl.transient_bytes, trl.products) == (0, 256 * MiB, 4)  # [4096, 32768] bf16
    fused = next(p for p in est.paths if p.name.startswith("fusedloss, GPU"))
    spec = cost.GPUS["h200"]
    assert fused.transient_bytes == cuda_backend.workspace_bytes(spec.memory_bytes // 2) and fused.held_bytes == 0
    assert fused.products == 3 and "grad-in-forward" in fused.name  # cross-entropy is known in the forward
    torch_path = est.path("fusedloss, torch backend (CPU)")
    assert torch_path.transient_bytes == 1024 * 4096 * 4 == 16 * MiB
    assert est.bound_products == 3
    text = str(est)
    assert "9.28 GiB" in text and "13.92 GiB" in text and "256 MiB" in text


def test_log_probs_need_four_products_and_the_workspace_is_what_is_asked():
    est = fusedloss.estimate(hidden_size=4096, vocab_size=128256, tokens=4096, op="token_logprobs_entropy",
                             dtype="float32", workspace_mb=512)
    assert est.bound_products == 4
    fused = next(p for p in est.paths if p.name.startswith("fusedloss, GPU"))
    assert fused.products == 4 and fused.transient_bytes == 512 * MiB
    naive = est.path("materialised logits (naive)")
    assert naive.held_bytes == 4096 * 128256 * 8  # fp32 logits and fp32 log-softmax
    assert est.path("TRL 1.16 chunked kernel").transient_bytes == 4096 * 32768 * 4


def test_small_batches_never_exceed_their_own_logits():
    est = fusedloss.estimate({"hidden_size": 64, "vocab_size": 1000}, tokens=8)
    assert est.path("TRL 1.16 chunked kernel").transient_bytes == 8 * 1000 * 2
    assert next(p for p in est.paths if p.name.startswith("fusedloss, GPU")).transient_bytes == 8 * 1000 * 4
    assert est.path("fusedloss, torch backend (CPU)").transient_bytes == 8 * 1000 * 4


def test_config_forms():
    nested = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"hidden_size": 2560,
                                                                                    "vocab_size": 262208}}
    assert (fusedloss.estimate(nested, tokens=1).hidden_size, fusedloss.estimate(nested, tokens=1).vocab_size) == (
        2560, 262208)
    assert fusedloss.estimate(QWEN_7B, tokens=1, vocab_size=151936).vocab_size == 151936  # the override wins
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(hidden_size=64, vocab_size=1009, num_attention_heads=4)
    assert fusedloss.estimate(config, tokens=2).hidden_size == 64


@pytest.mark.parametrize("kwargs,name", [
    (dict(tokens=16), "hidden_size"),
    (dict(hidden_size=64, tokens=16), "vocab_size"),
    (dict(hidden_size=64, vocab_size=100, tokens=0), "tokens"),
    (dict(hidden_size=64, vocab_size=100, tokens=4, dtype="int8"), "dtype"),
    (dict(hidden_size=64, vocab_size=100, tokens=4, op="distill_jsd"), "op"),
    (dict(hidden_size=64, vocab_size=100, tokens=4, gpu="tpu"), "gpu"),
    (dict(hidden_size=64, vocab_size=100, tokens=4, workspace_mb=0), "workspace_mb"),
    (dict(hidden_size=64, vocab_size=100, tokens=4, workspace_mb=float("inf")), "workspace_mb"),
    (dict(hidden_size=64, vocab_size=100, tokens=4, workspace_mb=float("nan")), "workspace_mb"),
    (dict(hidden_size=64, vocab_size=100, tokens=4, workspace_mb=1e-300), "workspace_mb"),
    (dict(hidden_size=64, vocab_size=100, tokens=4, workspace_mb=True), "workspace_mb"),
])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        fusedloss.estimate(**kwargs)


def test_configs_that_name_the_width_d_model(tmp_path):
    """MPT and XGLM call the hidden size ``d_model``: their config objects answer ``hidden_size`` through an
    attribute map, but their dicts and config.json hold ``d_model`` only."""
    transformers = pytest.importorskip("transformers")
    for config in (transformers.MptConfig(d_model=1024, vocab_size=5003, n_heads=8),
                   transformers.XGLMConfig(d_model=768, vocab_size=5003)):
        want = (config.d_model, 5003)
        as_dict = config.to_dict()
        assert "hidden_size" not in as_dict
        config.save_pretrained(tmp_path / config.model_type)
        for form in (config, as_dict, tmp_path / config.model_type):
            est = fusedloss.estimate(form, tokens=100)
            assert (est.hidden_size, est.vocab_size) == want, form
    assert main(["estimate", "--model-config", str(tmp_path / "mpt" / "config.json"), "--tokens", "8"]) == 0


@pytest.mark.parametrize("tokens", [4 * 10**6, 10**9, 10**12])
def test_a_huge_token_count_takes_milliseconds(tokens):
    """Planning cost does not grow with N (the grad-in-forward layout is counted, not listed; the grouped candidates are
    bounded by the workspace): the estimate of a billion-token batch returns at once, with sizes that follow
    the formulas."""
    import time

    start = time.perf_counter()
    est = fusedloss.estimate(hidden_size=8192, vocab_size=256000, tokens=tokens)
    assert time.perf_counter() - start < 1.0
    assert est.logits_fp32_bytes == 4 * tokens * 256000
    fused = next(p for p in est.paths if p.name.startswith("fusedloss, GPU"))
    assert fused.products == 3 and fused.transient_bytes == 4 * GiB


def test_the_modelled_time_is_the_models_and_marked_so():
    """From a checkout the performance model is importable: the table adds its time of the GPU backend's plan, marked
    as modelled (without it, tests/contract/test_planner_grid.py: the line says how to get it)."""
    model_cost = pytest.importorskip("benchmarks.model.cost")
    model_cuda = pytest.importorskip("benchmarks.model.cuda")
    est = fusedloss.estimate(hidden_size=4096, vocab_size=151936, tokens=16384, gpu="H200")
    spec = model_cost.GPUS["h200"]
    w = cost.Workload(op="cross_entropy", n=16384, d=4096, v=151936)
    want = model_cost.evaluate(model_cuda.plan(w, spec, spec.memory_bytes // 2), w, spec)
    assert est.modelled_ms == pytest.approx(want.model_ms) and est.modelled_bound_ms == pytest.approx(want.bound_ms)
    assert "modelled (not measured) on H200" in str(est)


def test_a_missing_config_says_what_it_wants():
    with pytest.raises(ValueError, match="config.json"):
        fusedloss.estimate("/nonexistent/model", tokens=4)


def test_the_command_prints_the_table(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    assert main(["estimate", "--model-config", str(tmp_path / "config.json"), "--tokens", "16384",
                 "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == str(fusedloss.estimate(tmp_path, tokens=16384)).strip()
    with pytest.raises(SystemExit):
        main(["estimate", "--tokens", "16"])
    assert "--model-config" in capsys.readouterr().err
    assert main(["status"]) == 0 and json.loads(capsys.readouterr().out)["torch"] == "available"
