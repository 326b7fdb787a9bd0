"""LLaMA-Factory: its SFT and pretraining models' causal-LM loss from the hidden states, through fusedloss.

LLaMA-Factory has no plugin mechanism. ``enable()`` wraps the ``load_model`` its SFT and pretraining workflows
call (``llamafactory.train.sft.workflow`` and ``.pt.workflow``) so that the model they train is
``fusedloss.integrations.transformers.patch``-ed: its loss comes from the hidden states, the
``[tokens, vocab]`` logits are never formed in training, and evaluation keeps the model's logits (LLaMA-Factory's
``compute_accuracy`` reads them). The other stages (rm, ppo, dpo, kto) are LLaMA-Factory's own.

Where it must run: in every process that trains. ``python -m fusedloss.integrations.llamafactory train cfg.yaml``
is ``llamafactory-cli train cfg.yaml`` with the integration enabled; when LLaMA-Factory relaunches itself under
``torchrun`` (more than one device, ``FORCE_TORCHRUN=1``), the processes it starts run this package's launcher,
which enables the integration (with the same backend: ``FUSEDLOSS_LLAMAFACTORY_BACKEND`` in their environment)
before LLaMA-Factory's ``run_exp``. A script of your own calls ``enable()`` before ``run_exp(...)`` or
``llamafactory.launcher.launch()``, with the same effect. Plain ``llamafactory-cli`` runs no code of fusedloss's.

Refused with the reason: Ray training (``use_ray``: the Ray workers would not be patched), LLaMA-Factory's v1
launcher (``USE_V1``), and the SFT losses that read the logits (``use_dft_loss``, ``use_eaft_loss``,
``use_asft_loss``). Supported: ``llamafactory>=0.9.5,<0.10``.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import _switch
from ..transformers import patch as _patch

__all__ = ["BACKEND_VARIABLE", "SUPPORTED_LLAMAFACTORY", "disable", "enable", "enabled", "is_enabled"]

SUPPORTED_LLAMAFACTORY = ">=0.9.5,<0.10"
BACKEND_VARIABLE = "FUSEDLOSS_LLAMAFACTORY_BACKEND"  # the backend of the processes LLaMA-Factory relaunches
_LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
_WORKFLOWS = ("llamafactory.train.sft.workflow", "llamafactory.train.pt.workflow")
_LOGITS_LOSSES = ("use_dft_loss", "use_eaft_loss", "use_asft_loss")

_originals: dict = {}  # (module name, attribute) -> LLaMA-Factory's object, recorded by the first enable()
_state = {"backend": "auto", "enabled": False}


def _refuse_ray(*args, **kwargs):
    raise NotImplementedError("fusedloss.integrations.llamafactory: Ray training (use_ray) runs LLaMA-Factory in "
                              "Ray workers, which this integration does not reach; train with torchrun (the default "
                              "launch) or disable() it")


def _patched_loader(load_model):
    def load_model_with_fusedloss(tokenizer, model_args, finetuning_args, *args, **kwargs):
        asked = [name for name in _LOGITS_LOSSES if getattr(finetuning_args, name, False)]
        if asked:
            raise ValueError(f"fusedloss.integrations.llamafactory: {', '.join(asked)} computes the SFT loss from "
                             "the model's logits, which the fused loss never forms; remove it from the config or "
                             "train without fusedloss")
        return _patch(load_model(tokenizer, model_args, finetuning_args, *args, **kwargs), backend=_state["backend"])

    load_model_with_fusedloss.__wrapped__ = load_model
    return load_model_with_fusedloss


def enable(backend: str = "auto") -> None:
    """Patch the models LLaMA-Factory's SFT and pretraining workflows load, in this process and in the processes
    its launcher relaunches under ``torchrun``. Idempotent: a second call only changes ``backend``."""
    import importlib
    from importlib.metadata import version

    from ...core import registry as _backends

    if backend not in _backends.BACKEND_NAMES:
        raise ValueError(f"backend must be one of {_backends.BACKEND_NAMES}, got {backend!r}")
    try:
        found = version("llamafactory")
    except Exception as exc:
        raise ImportError("fusedloss.integrations.llamafactory needs llamafactory (pip install "
                          f"'llamafactory{SUPPORTED_LLAMAFACTORY}')") from exc
    _switch.check_version("fusedloss.integrations.llamafactory", "llamafactory", found, SUPPORTED_LLAMAFACTORY,
                          "LLaMA-Factory's own loss")
    if os.environ.get("USE_V1", "0").lower() in ("true", "y", "1"):
        raise NotImplementedError("fusedloss.integrations.llamafactory: USE_V1 runs LLaMA-Factory's v1 trainers, "
                                  "which this integration does not patch; unset USE_V1")
    _state["backend"] = backend
    os.environ[BACKEND_VARIABLE] = backend  # inherited by the processes the launcher relaunches
    replacements = [(name, "load_model", None) for name in _WORKFLOWS]
    replacements += [("llamafactory.train.tuner", "_ray_training_function", _refuse_ray),
                     ("llamafactory.launcher", "__file__", _LAUNCHER)]  # the script torchrun relaunches
    for module_name, attr, new in replacements:
        module = importlib.import_module(module_name)
        original = _originals.setdefault((module_name, attr), getattr(module, attr))
        setattr(module, attr, _patched_loader(original) if new is None else new)
    _state["enabled"] = True


def disable() -> None:
    """Put LLaMA-Factory's own functions back, the exact objects."""
    _switch.restore_originals(_originals, _state)
    os.environ.pop(BACKEND_VARIABLE, None)


def is_enabled() -> bool:
    return _state["enabled"]


enabled = _switch.scoped(enable, disable, _state)
