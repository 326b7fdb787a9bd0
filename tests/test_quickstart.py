"""The README's Quick start, run as written, then checked against materialised logits.

The block is read from README.md (the first ```python block under "## Quick start"), so the README
cannot drift from what runs. Its results are compared with the same quantities computed the obvious way
from the model's own logits.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[1] / "README.md"


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
