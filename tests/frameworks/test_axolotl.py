"""fusedloss.integrations.axolotl: Axolotl loads the plugin from its config (``prepare_plugins``), merges its
keys into the config schema (``merge_input_args``) and calls its hooks in the order its model loader does; three
SFT steps of the Hugging Face ``Trainer`` (the base of Axolotl's) with gradient accumulation then give the losses
and parameters of three steps without the plugin. Axolotl is installed without its dependencies (it pins
transformers 5.16, verl < 5.11): its training entry point does not run in this environment, its plugin
machinery does."""

from __future__ import annotations

import pytest
import torch
from _frameworks_util import VOCAB, rel_err, tiny_causal_lm

PLUGIN = "fusedloss.integrations.axolotl.FusedLossPlugin"


def _load_with_plugins(cfg, head):
    """A model, loaded as Axolotl's ``ModelLoader.load`` runs the plugin hooks around it."""
    from axolotl.integrations.base import PluginManager

    manager = PluginManager.get_instance()
    manager.pre_model_load(cfg)
    model = tiny_causal_lm(head).train()
    manager.post_model_build(cfg, model)
    manager.pre_lora_load(cfg, model)
    manager.post_lora_load(cfg, model)
    manager.post_model_load(cfg, model)
    return model


def _sft_steps(model, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(12):
        ids = torch.randint(VOCAB, (10,), generator=g)
        labels = ids.clone()
        labels[:4] = -100  # the prompt, as Axolotl masks it
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "attention_mask": [1] * 10})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_three_sft_steps_with_the_plugin_match_three_without(tmp_path):
    head = "softcap"  # tied, soft-capped: what a plain weight would get wrong
    from axolotl.integrations.config import merge_input_args
    from axolotl.utils.config import prepare_plugins
    from axolotl.utils.dict import DictDefault

    from fusedloss.integrations.transformers._tap import _PATCH_ATTR

    cfg = DictDefault(plugins=[PLUGIN], fusedloss=True, fusedloss_backend="torch")
    prepare_plugins(cfg)
    _, input_config = merge_input_args()
    assert {"fusedloss", "fusedloss_backend"} <= set(input_config.model_fields)
    patched = _load_with_plugins(cfg, head)
    assert _PATCH_ATTR in patched.__dict__
    losses, params = _sft_steps(patched, tmp_path / "fused")
    plain = _load_with_plugins(DictDefault(plugins=[PLUGIN], fusedloss=False), head)
    assert _PATCH_ATTR not in plain.__dict__
    ref_losses, ref_params = _sft_steps(plain, tmp_path / "plain")
    assert len(losses) == 3
    # transformers' own loss casts the logits to float32 (and the Trainer logs a float32 sum), so the run
    # without the plugin is float32-limited even for a float64 model; Adam carries that into the parameters
    assert rel_err(torch.tensor(losses, dtype=torch.float64), torch.tensor(ref_losses, dtype=torch.float64)) <= 1e-6
    assert max(rel_err(params[k], ref_params[k]) for k in ref_params) <= 1e-5


def test_conflicting_keys_are_refused():
    from fusedloss.integrations.axolotl import FusedLossArgs

    assert FusedLossArgs(fusedloss=True).fusedloss_backend == "auto"
    for key in ("cut_cross_entropy", "liger_fused_linear_cross_entropy", "chunked_cross_entropy"):
        with pytest.raises(ValueError, match=f"{key}: true both replace"):
            FusedLossArgs.model_validate({"fusedloss": True, key: True})
    with pytest.raises(ValueError, match="fusedloss_backend must be one of"):
        FusedLossArgs.model_validate({"fusedloss": True, "fusedloss_backend": "gpu"})
    with pytest.raises(ValueError, match="for TRL's RL trainers"):
        FusedLossArgs.model_validate({"fusedloss": True, "rl": "grpo"})


def test_a_plugin_that_cannot_load_stops_axolotl(monkeypatch):
    """Axolotl logs an ImportError of a plugin module and trains without it (exit code 0): a missing dependency
    of the plugin reaches Axolotl as a RuntimeError that names it, which stops the run."""
    import sys

    from axolotl.integrations.base import PluginManager

    monkeypatch.delitem(sys.modules, "fusedloss.integrations.axolotl", raising=False)
    import fusedloss.integrations

    # what a broken install looks like: the plugin's own dependency does not import
    monkeypatch.setitem(sys.modules, "fusedloss.integrations.transformers", None)
    monkeypatch.delattr(fusedloss.integrations, "transformers", raising=False)
    manager = PluginManager.get_instance()
    monkeypatch.delitem(manager.plugins, PLUGIN, raising=False)  # an earlier test's registration
    with pytest.raises(RuntimeError, match=r"FusedLossPlugin cannot load in this environment \(.*"
                                           r"fusedloss.integrations.transformers.*Axolotl would train without it"):
        manager.register(PLUGIN)
    assert PLUGIN not in manager.plugins
    monkeypatch.undo()
    sys.modules.pop("fusedloss.integrations.axolotl", None)  # the next import is a whole one


def test_the_plugin_says_what_it_did(caplog, tmp_path):
    """Listed without ``fusedloss: true``: a warning that the loss stays Axolotl's; with it, a line naming the
    patched model."""
    import logging

    from axolotl.utils.config import prepare_plugins
    from axolotl.utils.dict import DictDefault

    with caplog.at_level(logging.INFO, logger="fusedloss.integrations.axolotl"):
        cfg = DictDefault(plugins=[PLUGIN])
        prepare_plugins(cfg)
        assert "the plugin is listed but the config does not set fusedloss: true" in caplog.text
        caplog.clear()
        cfg = DictDefault(plugins=[PLUGIN], fusedloss=True, fusedloss_backend="torch")
        prepare_plugins(cfg)
        assert "does not set fusedloss" not in caplog.text
        _load_with_plugins(cfg, "untied")
        assert "fusedloss: patched Qwen2ForCausalLM: its causal-LM loss comes from the hidden states (backend torch)" \
            in caplog.text


def test_a_trl_that_breaks_axolotl_is_named_at_config_load(monkeypatch):
    """fusedloss's ``integrations`` extra installs TRL >= 1.16, which breaks Axolotl 0.19 (it pins trl 1.9.0 and
    imports modules TRL moved since): the plugin says so when Axolotl loads the config, with the fix."""
    import importlib.metadata

    from axolotl.utils.config import prepare_plugins
    from axolotl.utils.dict import DictDefault

    versions = {"trl": "1.16.0", "axolotl": importlib.metadata.version("axolotl")}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    with pytest.raises(RuntimeError, match=r"Axolotl 0.19.0 requires trl==1.9.0, found trl 1.16.0 .* "
                                           r"pip install 'trl==1.9.0'"):
        prepare_plugins(DictDefault(plugins=[PLUGIN], fusedloss=True))
    versions["trl"] = "1.9.0"  # Axolotl's own pin: accepted
    prepare_plugins(DictDefault(plugins=[PLUGIN], fusedloss=True))


def test_the_readme_yaml_block(tmp_path):
    """The README's Axolotl block, as written, read as Axolotl reads a config: the plugin loads, its keys join the
    schema, and the loaded model is patched with the backend the block names."""
    import re
    from pathlib import Path

    import yaml
    from axolotl.integrations.config import merge_input_args
    from axolotl.utils.config import prepare_plugins
    from axolotl.utils.dict import DictDefault

    from fusedloss.integrations.transformers._tap import _PATCH_ATTR

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("**Axolotl**"):]
    block = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    assert block == {"plugins": [PLUGIN], "fusedloss": True, "fusedloss_backend": "auto"}
    cfg = DictDefault(block)
    prepare_plugins(cfg)
    _, input_config = merge_input_args()
    assert {"fusedloss", "fusedloss_backend"} <= set(input_config.model_fields)
    model = _load_with_plugins(cfg, "untied")
    assert model.__dict__[_PATCH_ATTR].backend == "auto"
