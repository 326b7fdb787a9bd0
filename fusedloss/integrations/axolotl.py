"""An Axolotl plugin: the model's causal-LM loss from the hidden states, through fusedloss.

In the Axolotl config::

    plugins:
      - fusedloss.integrations.axolotl.FusedLossPlugin
    fusedloss: true
    fusedloss_backend: auto        # or torch / triton / cuda

After Axolotl has loaded the model (and its LoRA adapters), the plugin calls
``fusedloss.integrations.transformers.patch(model)``: the model's own ``labels=`` loss is computed by
``fusedloss.cross_entropy`` from the final hidden states and the head (tied embeddings, a LoRA on the head,
soft-caps and logit scales included), and the ``[tokens, vocab]`` logits are never formed; Axolotl's trainer is
unchanged. This is the role of Axolotl's Cut Cross-Entropy plugin, which replaces the model class's forward
instead; ``patch`` changes only the loaded model instance.

Refused with a clear error: together with ``cut_cross_entropy``, ``liger_fused_linear_cross_entropy`` or
``chunked_cross_entropy`` (each replaces the same loss), and RL configs (``rl:``): Axolotl's RL trainers are
TRL's, whose fused paths ``fusedloss.integrations.trl`` replaces from TRL 1.16 on, newer than Axolotl pins.
Supported: ``axolotl>=0.19,<0.20``.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, model_validator

from ..core import registry as _backends
from . import _switch
from . import transformers as _hf

try:
    from axolotl.integrations.base import BasePlugin
except ImportError as exc:
    raise ImportError("fusedloss.integrations.axolotl needs axolotl (pip install 'axolotl>=0.19,<0.20')") from exc

__all__ = ["SUPPORTED_AXOLOTL", "FusedLossArgs", "FusedLossPlugin"]

SUPPORTED_AXOLOTL = ">=0.19,<0.20"
_CONFLICTS = ("cut_cross_entropy", "liger_fused_linear_cross_entropy", "chunked_cross_entropy")


class FusedLossArgs(BaseModel):
    """The plugin's keys in the Axolotl config."""

    fusedloss: Optional[bool] = None
    fusedloss_backend: str = "auto"

    @model_validator(mode="before")
    @classmethod
    def _check(cls, data):
        if not isinstance(data, dict) or not data.get("fusedloss"):
            return data
        backend = data.get("fusedloss_backend", "auto")
        if backend not in _backends.BACKEND_NAMES:
            raise ValueError(f"fusedloss_backend must be one of {_backends.BACKEND_NAMES}, got {backend!r}")
        for key in _CONFLICTS:
            if data.get(key):
                raise ValueError(f"fusedloss: true and {key}: true both replace the causal-LM loss; keep one")
        if data.get("rl"):
            raise ValueError("fusedloss: true applies to SFT / pretraining configs; for TRL's RL trainers use "
                             "fusedloss.integrations.trl.enable() (trl >= 1.16)")
        return data


class FusedLossPlugin(BasePlugin):
    """``plugins: [fusedloss.integrations.axolotl.FusedLossPlugin]``; see the module docstring."""

    def register(self, cfg):
        from importlib.metadata import version

        _switch.check_version("fusedloss.integrations.axolotl", "axolotl", version("axolotl"), SUPPORTED_AXOLOTL,
                              "Axolotl's own loss")

    def get_input_args(self) -> str:
        return "fusedloss.integrations.axolotl.FusedLossArgs"

    def post_model_load(self, cfg, model):
        if cfg.fusedloss:
            _hf.patch(model, backend=cfg.fusedloss_backend or "auto")
