"""What ``dir()`` and ``help()`` show a user: the public names only, and the documentation of the real call."""

from __future__ import annotations

import pydoc

import fusedloss
import fusedloss.nn
import fusedloss.reference


def test_dir_lists_the_public_names_only():
    names = set(dir(fusedloss))
    assert set(fusedloss.__all__) <= names and {"reference", "nn", "integrations", "__version__"} <= names
    assert not names & {"annotations", "core", "losses", "types", "config", "distributed", "torch"}
    assert set(dir(fusedloss.reference)) == set(fusedloss.reference.__all__)
    assert not set(dir(fusedloss.reference)) & {"F", "Number", "Optional", "Union", "math", "torch"}
    assert set(dir(fusedloss.nn)) == set(fusedloss.nn.__all__)
    for module in (fusedloss, fusedloss.reference, fusedloss.nn):
        for name in module.__all__:
            assert getattr(module, name) is not None, name


def test_a_modules_forward_shows_its_functions_documentation():
    for cls in (getattr(fusedloss.nn, name) for name in fusedloss.nn.__all__):
        text = pydoc.render_doc(cls.forward, renderer=pydoc.plaintext)
        assert "Should be overridden by all subclasses" not in text, cls.__name__
        assert cls.function.__doc__.splitlines()[0] in text, cls.__name__
    grpo = pydoc.render_doc(fusedloss.nn.GRPOLoss.forward, renderer=pydoc.plaintext)
    assert "completion_mask" in grpo and "Loss types" in grpo


def test_help_of_grpo_loss_holds_the_formulas_it_refers_to():
    text = pydoc.render_doc(fusedloss.grpo_loss, renderer=pydoc.plaintext)
    assert "module docstring" not in text
    assert "Loss types" in text and "cispo : l = -sg(min(r, eps_high)) A logp" in text
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"):
        assert loss_type in text
    for fn in (fusedloss.dpo_loss, fusedloss.cpo_loss, fusedloss.kto_loss):
        assert "module docstring" not in pydoc.render_doc(fn, renderer=pydoc.plaintext), fn.__name__


def test_help_starts_with_the_three_ways_in():
    """``help(fusedloss)`` names the patch, the trainer switches and the functional API before anything else."""
    import fusedloss

    head = "\n".join(fusedloss.__doc__.splitlines()[:20])
    for way in ("integrations.transformers.patch(model)", "integrations.trl.enable()", "token_logprobs",
                "cross_entropy", "grpo_loss"):
        assert way in head, way


def test_a_refused_model_raises_one_public_runtime_error():
    """``UnsupportedModelError`` is the same class at the top level and in the integration, and a RuntimeError,
    so that ``except RuntimeError`` still catches a refusal."""
    from fusedloss.integrations import transformers as fl_hf

    assert fl_hf.UnsupportedModelError is fusedloss.UnsupportedModelError
    assert issubclass(fusedloss.UnsupportedModelError, RuntimeError)
    assert "UnsupportedModelError" in fusedloss.__all__ and "UnsupportedModelError" in fl_hf.__all__
