"""The README's Quick start, run as written, then checked against materialised logits.

The block is read from README.md (the first ```python block under "## Quick start"), so the README
cannot drift from what runs. Its results are compared with the same quantities computed the obvious way
from the model's own logits.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start_code() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    section = section[: section.index("\n## ", 4)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "the Quick start has no python block"
    return blocks[0]


@pytest.fixture(scope="module")
def ns():
    namespace = {"__name__": "quickstart"}
    exec(compile(quick_start_code(), str(README) + ":Quick start", "exec"), namespace)
    return namespace


def test_every_name_is_defined_and_it_runs(ns):
    for name in ("loss", "sft_loss", "logp", "entropy", "grpo", "details", "distill"):
        assert name in ns, name
        assert torch.isfinite(torch.as_tensor(ns[name] if name != "details" else ns[name].logprobs)).all()


def test_patched_loss_and_manual_loss_are_the_models_loss(ns):
    from fusedloss.integrations.transformers import unpatch

    model, input_ids = ns["model"], ns["input_ids"]
    assert model(input_ids, labels=input_ids).logits is None
    unpatch(model)
    with torch.no_grad():
        logits = model(input_ids).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))
    torch.testing.assert_close(ns["loss"].detach(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ns["sft_loss"].detach(), ref, rtol=1e-5, atol=1e-6)


def test_completion_logprobs_are_aligned(ns):
    model, input_ids, P = ns["model"], ns["input_ids"], ns["P"]
    with torch.no_grad():
        logits = model(input_ids).logits.float() / 0.7
    logq = torch.log_softmax(logits[:, P - 1:-1], dim=-1)
    ref = logq.gather(-1, ns["completion_ids"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ns["logp"].detach(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ns["entropy"].detach(), -(logq.exp() * logq).sum(-1), rtol=1e-5, atol=1e-5)
    # the GRPO rows score the same tokens: its log-probs equal completion_logprobs'
    torch.testing.assert_close(ns["details"].logprobs.detach(), ns["logp"].detach(), rtol=1e-5, atol=1e-5)


def test_the_near_misses_say_the_fix(ns):
    import fusedloss

    hidden, head, ids, P = ns["hidden"], ns["head"], ns["input_ids"], ns["P"]
    with pytest.raises(ValueError, match=r"next-token labels\? .*hidden\[:, :-1\]"):
        fusedloss.cross_entropy(hidden, head.weight, torch.cat((ids, ids[:, :1]), dim=1))
    with pytest.raises(ValueError, match=r"hidden\[:, P - 1:-1\].*completion_logprobs"):
        fusedloss.token_logprobs(hidden, head.weight, ns["completion_ids"])
    with pytest.raises(ValueError, match="look like logits"):
        fusedloss.token_logprobs(torch.randn(2, 3, head.weight.shape[0]), head.weight, ids[:2, :3])
    with pytest.raises(ValueError, match="transposed"):
        fusedloss.token_logprobs(hidden.detach(), head.weight.detach().T, ids)
    # the near misses that are not shape errors are what completion_logprobs prevents: both give other numbers
    for wrong in (hidden[:, -ns["completion_ids"].shape[1]:], hidden[:, P:]):
        lp = fusedloss.token_logprobs(wrong.detach(), head.weight.detach(), ns["completion_ids"], temperature=0.7)
        assert (lp - ns["logp"].detach()).abs().max() > 1e-3


def test_autocast_casts_a_mixed_head_as_the_trl_drop_in_does():
    import fusedloss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 16, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(31, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 31, (6,), generator=g)
    with pytest.raises(TypeError, match="dtype"):
        fusedloss.cross_entropy(hidden, weight, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fusedloss.cross_entropy(hidden, weight, targets)
    # bf16 inputs: the doctrine's bound is the naive same-dtype path (the autocast matmul, bf16 logits)
    exact = F.cross_entropy(hidden.double() @ weight.bfloat16().double().T, targets)
    naive = F.cross_entropy((hidden.detach() @ weight.detach().bfloat16().T).float(), targets)
    assert abs(loss.double() - exact) <= 2 * abs(naive.double() - exact) + 1e-6
    loss.backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------------
# Every other block of the README, run as written. The names a block takes from the reader's own code (a model
# name, a trainer's arguments, a tensor-parallel group, ...) are given real objects below; each block runs in a
# fresh namespace, and what it computes is checked against the unfused path where it computes something.


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def other_python_blocks() -> dict:
    """Every python block after the Quick start's, keyed by its first line that is not an import."""
    blocks = readme_blocks("python")
    assert blocks[0] == quick_start_code()
    keyed = {}
    for block in blocks[1:]:
        first = next(line for line in block.splitlines() if line and not line.startswith(("from ", "import ")))
        keyed[first] = block
    return keyed


def run_block(key: str, namespace: dict) -> dict:
    matches = [block for first, block in other_python_blocks().items() if key in first]
    assert len(matches) == 1, f"no single README python block starts with {key!r}"
    exec(compile(matches[0], f"{README}:{key}", "exec"), namespace)
    return namespace


# Blocks for frameworks the main environment cannot hold run in the frameworks environment instead
# (tests/frameworks, through tests/tooling/test_env_frameworks.py): block key -> the test module that runs it.
RUN_IN_FRAMEWORKS_ENV = {"fusedloss_openrlhf.enable()": "tests/frameworks/test_openrlhf.py"}


def test_every_python_block_is_run_here():
    run_here = ("fusedloss_trl.enable()", "model = patch(", "logp, entropy = fl_hf", "loss_fn = ",
                "# tensor parallel")
    blocks = other_python_blocks()
    elsewhere = [key for key in RUN_IN_FRAMEWORKS_ENV if any(key in first for first in blocks)]
    assert all(any(key in first for key in (*run_here, *elsewhere)) for first in blocks), list(blocks)
    assert len(blocks) == len(run_here) + len(elsewhere)
    for key, module in RUN_IN_FRAMEWORKS_ENV.items():
        assert f'run_readme_block("{key}")' in (ROOT / module).read_text(), (key, module)


@pytest.fixture
def reader(ns, tmp_path):
    """What the reader's own code would hold: a saved model, a left-padded batch and its labels."""
    from transformers import LlamaForCausalLM

    import fusedloss

    torch.manual_seed(1)
    model = LlamaForCausalLM(ns["config"]).eval()
    model.save_pretrained(tmp_path / "model")
    input_ids = ns["input_ids"]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # a left-padded row
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"fusedloss": fusedloss, "torch": torch, "model": model, "policy": model, "name": str(tmp_path / "model"),
            "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
            "prompt_ids": ns["prompt_ids"], "completion_ids": ns["completion_ids"], "tmp_path": tmp_path}


def test_the_hugging_face_block(reader):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    data = Dataset.from_dict({"input_ids": reader["input_ids"].tolist(), "labels": reader["labels"].tolist()})
    args = TrainingArguments(output_dir=str(reader["tmp_path"] / "out"), use_cpu=True, report_to=[])
    done = run_block("model = patch(", {**reader, "AutoModelForCausalLM": AutoModelForCausalLM, "Trainer": Trainer,
                                        "args": args, "data": data})
    model = done["model"]  # unpatched by the block's last line: the model's own loss, from its logits
    out = model(reader["input_ids"], attention_mask=reader["attention_mask"], labels=reader["labels"])
    assert out.logits is not None
    torch.testing.assert_close(done["loss"].detach(), out.loss.detach(), rtol=1e-5, atol=1e-6)


def test_the_hidden_states_block(reader):
    refs = {"ref_chosen": torch.tensor([-30.0, -31.0]), "ref_rejected": torch.tensor([-30.5, -29.0])}
    done = run_block("logp, entropy = fl_hf", {**reader, **refs})
    ids, mask = reader["input_ids"], reader["attention_mask"]
    with torch.no_grad():
        logits = reader["model"](ids, attention_mask=mask).logits.float()
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
    torch.testing.assert_close(done["logp"].detach(), expected, rtol=1e-5, atol=1e-5)
    from fusedloss import reference

    ref_loss = reference.dpo_loss(done["hidden"].detach(), done["head"].weight.detach(), reader["labels"][:, 1:],
                                  refs["ref_chosen"], refs["ref_rejected"], beta=0.1)
    torch.testing.assert_close(done["loss"].detach(), ref_loss, rtol=1e-5, atol=1e-6)


def test_the_modules_block(reader):
    from fusedloss.integrations.transformers import last_hidden_state

    with torch.no_grad():
        hidden = last_hidden_state(reader["model"], reader["input_ids"])
    done = run_block("loss_fn = ", {**reader, "hidden": hidden})
    logits = hidden @ reader["model"].lm_head.weight.detach().T
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), reader["labels"].reshape(-1),
                               label_smoothing=0.1)
    z = torch.logsumexp(logits, -1)[reader["labels"] != -100]
    torch.testing.assert_close(done["loss"].detach(), expected + 1e-4 * (z**2).mean(), rtol=1e-5, atol=1e-6)


def test_the_tensor_parallel_block(reader):
    import torch.distributed as dist

    from fusedloss.integrations.transformers import last_hidden_state

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.no_grad():
            hidden = last_hidden_state(reader["model"], reader["input_ids"])[:, :-1]
        weight = reader["model"].lm_head.weight.detach()
        padded = torch.cat((weight, torch.zeros(7, weight.shape[1])))  # a head padded past the tokenizer's size
        done = run_block("# tensor parallel", {**reader, "hidden": hidden, "lm_head_rows": padded,
                                               "labels": reader["labels"][:, 1:], "tp_group": dist.group.WORLD,
                                               "tokenizer": range(weight.shape[0])})
    finally:
        dist.destroy_process_group()
    import fusedloss

    torch.testing.assert_close(done["loss"], fusedloss.cross_entropy(hidden, weight, reader["labels"][:, 1:]),
                               rtol=1e-6, atol=1e-6)


def test_the_trl_block(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    import importlib.util

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from fusedloss.integrations import trl as fusedloss_trl

    path = README.parent / "examples" / "grpo_trl.py"
    spec = importlib.util.spec_from_file_location("fusedloss_readme_grpo_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokenizer = example.char_tokenizer()
    config = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                        max_completion_length=4, logging_steps=1, report_to="none", bf16=False, use_cpu=True,
                        save_strategy="no", seed=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=example.tiny_model(len(tokenizer)), reward_funcs=example.digit_reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": ["1+2=", "3+4="] * 2}),
                          processing_class=tokenizer)
    calls = []
    original = fusedloss_trl.FusedChunkedLogProbFunction.apply

    def counted(*args, **kwargs):  # a spy: counts the calls TRL makes and passes them on
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fusedloss_trl.FusedChunkedLogProbFunction, "apply", counted)
    run_block("fusedloss_trl.enable()", {"GRPOTrainer": lambda *_: trainer})
    assert calls, "TRL's log-probs did not go through fusedloss while enabled"
    assert not fusedloss_trl.is_enabled()
    assert math.isfinite(next(e["loss"] for e in trainer.state.log_history if "loss" in e))


# --------------------------------------------------------------------------------------------------
# Every shell line of the README names things that exist: extras of pyproject.toml, scripts and test files of
# the checkout; nothing is installed by a name no package index has.

ROOT = README.parent


def pyproject_extras() -> set:
    text = (ROOT / "pyproject.toml").read_text()
    section = text[text.index("[project.optional-dependencies]"):]
    section = section[: section.index("\n[", 1)]
    return set(re.findall(r"^([a-z0-9_-]+) = \[", section, re.M))


def shell_commands() -> list:
    """Each command of the README's bash blocks and of its inline `pip ...` spans, as a list of words."""
    lines = [line for block in readme_blocks("bash") for line in block.splitlines()]
    lines += re.findall(r"`((?:python -m )?pip (?:install|wheel)[^`]*)`", README.read_text())
    commands = []
    for line in lines:
        for part in line.split("#")[0].split("&&"):
            if part.strip():
                commands.append(shlex.split(part.strip().replace("then: ", "")))
    return commands


def check_pip_install(words: list, extras: set) -> None:
    for arg in words[2:]:
        if arg.startswith("-") or arg.startswith("https://"):
            continue
        match = re.fullmatch(r"\.(?:\[([a-z,_-]+)\])?", arg)
        if match:  # the checkout, with extras that pyproject.toml defines
            assert set(filter(None, (match.group(1) or "").split(","))) <= extras, (words, extras)
        elif arg.startswith("dist/"):
            assert arg.endswith(".whl"), words
        else:  # from a package index: never fusedloss itself, which no index has
            assert not arg.lower().startswith("fusedloss"), words
            assert re.fullmatch(r"[a-z0-9_.-]+(==[0-9.]+)?", arg), words


def test_every_shell_line_names_what_exists():
    extras = pyproject_extras()
    assert {"test", "bench", "integrations"} <= extras
    seen = set()
    for words in shell_commands():
        if words[:2] in (["pip", "install"], ["pip", "wheel"]):
            check_pip_install(words, extras)
        elif words[0] == "bash":
            assert (ROOT / words[1]).is_file(), words
        elif words[:3] == ["python", "-m", "pytest"]:
            valued = ("-m", "-n", "--dist")  # options whose value is the next word
            paths = [arg for i, arg in enumerate(words[3:], 3)
                     if not arg.startswith("-") and words[i - 1] not in valued]
            assert paths and all((ROOT / arg).exists() for arg in paths), words
        elif words[:3] == ["python", "-m", "fusedloss"]:
            assert words[3] in ("estimate", "status"), words
        elif words[:2] == ["python", "-m"] and words[2].startswith("fusedloss.integrations."):
            # a framework's launcher (tests/contract/test_integration_llamafactory.py runs it as written)
            assert (ROOT / words[2].replace(".", "/") / "__main__.py").is_file(), words
        elif words[0] == "python":
            assert (ROOT / words[1]).is_file(), words
        else:
            assert words[0] in ("FUSEDLOSS_CUDA=0",), words
        seen.add(" ".join(words[:2]))
    assert {"bash tools/install.sh", "python -m", "pip install"} <= seen
    # the first command installs the main job's extra, the test block the tests' extras; CI runs the README's test
    # block as written, after the contributor set-up (which runs the same install first)
    script = (ROOT / "tools" / "install.sh").read_text()
    assert "extras=bench\n" in script and "extras=$extras,test,integrations" in script
    assert 'pip_install --no-compile --no-build-isolation "$torch_pin" -e ".[$extras]"' in script
    ci = (ROOT / ".ci" / "run").read_text()
    command = 'bash tools/install.sh --tests && python -m pytest -q -n 2 --dist loadfile tests/contract'
    assert "bash tools/dev_setup.sh" in ci and readme_blocks("bash")[1].strip() == command
    assert "\nbash tools/install.sh --tests\n" in (ROOT / "tools" / "dev_setup.sh").read_text()
    assert f"\n{command}\n" in ci


def test_the_test_block_installs_every_package_a_test_module_needs():
    """No test module is skipped for a missing package after the README's test block: what the tests
    importorskip is in the extras `install.sh --tests` installs."""
    text = (ROOT / "pyproject.toml").read_text()
    installed = set()
    for extra in ("test", "integrations"):
        listed = re.search(rf"^{extra} = \[(.*?)\]\n", text, re.M | re.S).group(1)
        installed |= {re.split(r"[<>=;\s]", name, maxsplit=1)[0] for name in re.findall(r'"([^"]+)"', listed)}
    needed = set()
    for module in (ROOT / "tests" / "contract").glob("*.py"):
        needed |= set(re.findall(r"importorskip\(\s*\"([a-z_]+)", module.read_text()))
    assert {"transformers", "trl", "datasets", "peft", "deepspeed"} <= needed
    # fusedloss's Triton backend modules import triton; torch and numpy are the package's own dependencies;
    # benchmarks is the checkout's own folder (the performance model), there wherever the tests are
    needed = {"triton" if name == "fusedloss" else name for name in needed} - {"torch", "numpy", "benchmarks"}
    assert needed <= installed, needed - installed


def test_the_estimate_shown_is_what_the_command_prints(capsys):
    from fusedloss.__main__ import main

    text = (ROOT / "docs" / "benchmarks.md").read_text()  # the README has the command, this page its output
    command = next(words for words in shell_commands() if words[:4] == ["python", "-m", "fusedloss", "estimate"])
    shown = re.search(r"```bash\n" + re.escape(" ".join(command)) + r"\n```\n\n```text\n(.*?)```", text, re.S)
    assert shown, "the estimate command is not followed by its output"
    assert main(command[3:]) == 0
    assert capsys.readouterr().out.strip() == shown.group(1).strip()


# --------------------------------------------------------------------------------------------------
# The README stays a page a newcomer reads to the end; the rest lives in docs/, whose code blocks are the
# README's own (run above), and the versions it states are the ones the install and pyproject.toml use.

def test_the_readme_is_short_and_its_first_block_is_the_user_install():
    text = README.read_text()
    assert len(text.splitlines()) <= 280
    first, tests = readme_blocks("bash")[:2]
    assert first.strip() == "bash tools/install.sh && python benchmarks/tour.py"
    assert tests.strip() == ('bash tools/install.sh --tests && '
                             'python -m pytest -q -n 2 --dist loadfile tests/contract')
    install = (ROOT / "tools" / "install.sh").read_text()
    for heavy in ("triton_versions.py", "nvidia-cutlass", "frameworks_env.sh"):  # the contributor's, not a user's
        assert heavy not in install and heavy in (ROOT / "tools" / "dev_setup.sh").read_text()
    # no counts of tests typed into the README: they drift
    assert not re.search(r"\d+ passed", text)


def test_docs_code_blocks_are_the_readmes_which_run_here():
    readme = set(readme_blocks("python"))
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            assert block in readme, (page.name, block[:80])
    for link in re.findall(r"`(docs/[a-z_]+\.md)`", README.read_text()):
        assert (ROOT / link).is_file(), link


def test_the_versions_stated_are_the_ones_installed():
    text = " ".join(README.read_text().split())
    install = (ROOT / "tools" / "install.sh").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_version = re.search(r"^TORCH_VERSION=(\S+)$", install, re.M).group(1)
    assert f"CI runs torch {torch_version}, Triton below 3.10" in text
    assert 'triton = ["triton>=3.4,<3.10"]' in pyproject and '"torch>=2.8"' in pyproject
    assert '"transformers>=4.56.2"' in pyproject and '"trl>=1.16,<2"' in pyproject
    assert "the oldest supported are torch 2.8, Triton 3.4, transformers 4.56.2 and TRL 1.16" in text
    assert "Tested with" not in text  # one statement of the versions, not a second list that drifts
