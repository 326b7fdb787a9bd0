"""fusedloss.integrations.llamafactory against a stand-in for LLaMA-Factory 0.9.5 (it is in neither test
environment: it pins transformers <= 5.6 and datasets <= 4.0). The stand-in is written to a folder below and
mirrors what the integration touches, by LLaMA-Factory's own names: ``llamafactory.cli.main`` ->
``launcher.launch()``, which pops the command from ``sys.argv`` and, with ``FORCE_TORCHRUN`` (or more than one
device), relaunches ``torchrun ... {launcher.__file__} {args}`` with a copy of ``os.environ``; the launcher run as a
script calls ``train.tuner.run_exp()``; ``run_exp`` picks ``_ray_training_function`` for ``use_ray``, else the
stage's workflow, whose module imported ``load_model`` by name; SFT evaluation hands the logits after the loss to
``eval_logit_processor``, which takes ``logits[0]`` (train/sft/metric.py). The models are tiny float64 Llamas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = {
    "llamafactory/__init__.py": "",
    "llamafactory/cli.py": """
        def main():
            from . import launcher
            launcher.launch()
    """,
    "llamafactory/launcher.py": """
        import os, subprocess, sys
        from copy import deepcopy

        def launch():
            command = sys.argv.pop(1) if len(sys.argv) > 1 else "help"
            if command == "train" and os.environ.get("FORCE_TORCHRUN", "0").lower() in ("true", "y", "1"):
                process = subprocess.run(
                    ("torchrun --nnodes 1 --node_rank 0 --nproc_per_node {nproc} --master_addr 127.0.0.1 "
                     "--master_port {port} {file_name} {args}").format(
                        nproc=os.environ["NPROC_PER_NODE"], port=os.environ["MASTER_PORT"], file_name=__file__,
                        args=" ".join(sys.argv[1:])).split(),
                    env=deepcopy(os.environ), check=True)
                sys.exit(process.returncode)
            elif command == "train":
                from .train.tuner import run_exp
                run_exp()

        if __name__ == "__main__":
            from llamafactory.train.tuner import run_exp  # use absolute import
            run_exp()
    """,
    "llamafactory/model/__init__.py": """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        def load_model(tokenizer, model_args, finetuning_args, is_trainable=False):
            torch.manual_seed(0)
            config = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)
            return LlamaForCausalLM(config).double()
    """,
    "llamafactory/train/__init__.py": "",
    "llamafactory/train/sft/__init__.py": "",
    "llamafactory/train/pt/__init__.py": "",
    "llamafactory/train/sft/workflow.py": """
        import json, os, types
        import torch
        from ...model import load_model

        def run_sft(args):
            finetuning_args = types.SimpleNamespace(**args.get("finetuning", {}))
            model = load_model(None, None, finetuning_args, True)
            ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
            out = model(input_ids=ids, labels=ids)  # the Trainer's training step
            with torch.no_grad():  # the Trainer's prediction_step: the outputs after the loss are the logits
                logits = tuple(v for k, v in model(input_ids=ids, labels=ids).items() if k != "loss")
                accuracy = (logits[0].argmax(-1)[:, :-1] == ids[:, 1:]).double().mean().item()  # logits[0]
            report = {"logits_none": out.logits is None, "loss": out.loss.item(), "accuracy": accuracy,
                      "rank": os.environ.get("RANK", "none")}
            with open(os.path.join(args["output_dir"], f"report-{report['rank']}.json"), "w") as f:
                json.dump(report, f)

        run_pt = run_sft
    """,
    "llamafactory/train/pt/workflow.py": "from ..sft.workflow import load_model, run_pt  # noqa\n",
    "llamafactory/train/tuner.py": """
        import json, sys
        from .sft.workflow import run_sft
        from .pt import workflow as pt_workflow

        def _ray_training_function(args):
            raise AssertionError("not reached")

        def run_exp(args=None):
            args = args or json.load(open(sys.argv[1]))
            if args.get("use_ray"):
                return _ray_training_function(args)
            (run_sft if args.get("stage", "sft") == "sft" else pt_workflow.run_pt)(args)
    """,
    "llamafactory-0.9.5.dist-info/METADATA": "Metadata-Version: 2.1\nName: llamafactory\nVersion: 0.9.5\n",
}


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The stand-in package in ``tmp_path/site``, importable here; an output folder; a config file."""
    site = tmp_path / "site"
    for name, text in STAND_IN.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(textwrap.dedent(text))
    (site / "llamafactory/train/pt/__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m == "llamafactory" or m.startswith("llamafactory.")]:
        monkeypatch.delitem(sys.modules, name)
    out = tmp_path / "out"
    out.mkdir()
    return site, out


def _reference(out_dir=None):
    """The loss and accuracy of the same model and batch without fusedloss."""
    from llamafactory.model import load_model

    model = load_model(None, None, None)
    ids = torch.randint(3, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 101), ids[:, 1:].reshape(-1))
    return loss.item(), (logits.argmax(-1)[:, :-1] == ids[:, 1:]).double().mean().item()


def readme_command() -> list:
    """The README's LLaMA-Factory command, as written (its bash block after the LLaMA-Factory heading)."""
    import re
    import shlex

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**LLaMA-Factory**"):]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1)
    return shlex.split(command)


def _check(report, reference):
    loss, accuracy = reference
    assert report["logits_none"] is True  # training: the loss from the hidden states
    assert report["loss"] == pytest.approx(loss, rel=1e-12)
    assert report["accuracy"] == accuracy  # evaluation: the model's own logits (compute_accuracy)


@pytest.mark.parametrize("torchrun", [False, True], ids=["one-process", "torchrun"])
def test_the_cli_reaches_every_training_process(stand_in, torchrun):
    """The README's ``python -m fusedloss.integrations.llamafactory train config.yaml`` in place of
    ``llamafactory-cli train config.yaml``: patched in the process itself, and in the 2 processes LLaMA-Factory
    relaunches under torchrun, with the backend from the environment."""
    site, out = stand_in
    command = readme_command()
    assert command[:4] == ["python", "-m", "fusedloss.integrations.llamafactory", "train"] and len(command) == 5
    config = out / command[4]  # the stand-in's run_exp reads JSON, which is YAML
    config.write_text(json.dumps({"stage": "sft", "output_dir": str(out)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
           "FUSEDLOSS_LLAMAFACTORY_BACKEND": "torch"}
    if torchrun:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE="2", MASTER_PORT="29517", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, *command[1:]], cwd=out, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    reports = {p.name: json.loads(p.read_text()) for p in out.glob("report-*.json")}
    assert sorted(reports) == (["report-0.json", "report-1.json"] if torchrun else ["report-none.json"])
    reference = _reference()
    for report in reports.values():
        _check(report, reference)


def test_plain_llamafactory_cli_is_not_patched(stand_in):
    """What the README's recipe replaces: LLaMA-Factory's own CLI runs no fusedloss code."""
    site, out = stand_in
    config = out / "cfg.json"
    config.write_text(json.dumps({"stage": "pt", "output_dir": str(out)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", "import sys; from llamafactory.cli import main; main()", "train",
                          str(config)], cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((out / "report-none.json").read_text())["logits_none"] is False


def test_enable_in_a_script_and_the_refusals(stand_in, monkeypatch):
    """``enable()`` then ``run_exp(...)`` in one process (pretraining stage); Ray training, the v1 launcher and
    the SFT losses on logits are refused; ``disable()`` restores LLaMA-Factory's objects exactly."""
    site, out = stand_in
    import llamafactory.launcher as launcher
    import llamafactory.train.pt.workflow as pt_workflow
    import llamafactory.train.sft.workflow as sft_workflow
    import llamafactory.train.tuner as tuner

    from fusedloss.integrations import llamafactory as fl_llamafactory

    own = (sft_workflow.load_model, pt_workflow.load_model, tuner._ray_training_function, launcher.__file__)
    fl_llamafactory.enable(backend="torch")
    try:
        assert os.environ["FUSEDLOSS_LLAMAFACTORY_BACKEND"] == "torch"
        assert launcher.__file__.endswith(os.path.join("fusedloss", "integrations", "llamafactory", "_launcher.py"))
        tuner.run_exp({"stage": "pt", "output_dir": str(out)})
        _check(json.loads((out / "report-none.json").read_text()), _reference())
        with pytest.raises(NotImplementedError, match="Ray training"):
            tuner.run_exp({"use_ray": True, "output_dir": str(out)})
        with pytest.raises(ValueError, match="use_asft_loss computes the SFT loss from the model's logits"):
            tuner.run_exp({"stage": "sft", "output_dir": str(out), "finetuning": {"use_asft_loss": True}})
    finally:
        fl_llamafactory.disable()
    assert (sft_workflow.load_model, pt_workflow.load_model, tuner._ray_training_function, launcher.__file__) == own
    assert "FUSEDLOSS_LLAMAFACTORY_BACKEND" not in os.environ
    monkeypatch.setenv("USE_V1", "1")
    with pytest.raises(NotImplementedError, match="USE_V1"):
        fl_llamafactory.enable()
    monkeypatch.delenv("USE_V1")
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.10.0")
    with pytest.raises(RuntimeError, match="supports llamafactory>=0.9.5,<0.10, found llamafactory 0.10.0"):
        fl_llamafactory.enable()
