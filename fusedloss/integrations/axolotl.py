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

Axolotl 0.19 logs a plugin whose module raises ``ImportError`` ("Failed to load plugin") and trains without it,
with exit code 0. So this module raises ``RuntimeError`` (which stops ``axolotl train``) when Axolotl is there but
what the plugin needs is not, naming the missing piece; the plugin logs "fusedloss: patched ..." when it patches
the model, and warns when it is listed without ``fusedloss: true``. A plugin path Axolotl cannot import at all
(fusedloss absent from Axolotl's environment, a typo in ``plugins:``) never reaches fusedloss's code: look for
Axolotl's "Plugin loaded successfully: fusedloss.integrations.axolotl.FusedLossPlugin" in the log.
"""

from __future__ import annotations

import logging
from typing import Optional

try:
    from axolotl.integrations.base import BasePlugin
except ImportError as exc:
    raise ImportError("fusedloss.integrations.axolotl needs axolotl (pip install 'axolotl>=0.19,<0.20')") from exc

try:
    from pydantic import BaseModel, model_validator

    from ..core import registry as _backends
    from . import _switch
    from . import transformers as _hf
except ImportError as exc:
    # Not an ImportError: Axolotl would log it and train without the plugin (module docstring)
    raise RuntimeError(f"fusedloss.integrations.axolotl.FusedLossPlugin cannot load in this environment ({exc}); "
                       "Axolotl would train without it: install what is missing, or remove the plugin from the "
                       "config") from exc

_LOG = logging.getLogger(__name__)

__all__ = ["SUPPORTED_AXOLOTL", "FusedLossArgs", "FusedLossPlugin"]

SUPPORTED_AXOLOTL = ">=0.19,<0.20"
_CONFLICTS = ("cut_cross_entropy", "liger_fused_linear_cross_entropy", "chunked_cross_entropy")


def _check_axolotl_trl() -> None:
    """Axolotl pins TRL exactly and imports TRL modules that later TRLs moved: fusedloss's ``integrations``
    extra (TRL >= 1.16, for the TRL drop-in) installed into Axolotl's environment breaks ``axolotl train`` later, in
    an import of Axolotl's. Say so here, with the fix."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    try:
        found = version("trl")
    except PackageNotFoundError:
        return
    for line in requires("axolotl") or []:
        requirement = Requirement(line)
        if requirement.name == "trl" and requirement.marker is None \
                and not requirement.specifier.contains(found, prereleases=True):
            raise RuntimeError(f"Axolotl {version('axolotl')} requires {requirement}, found trl {found} (fusedloss's "
                               "'integrations' extra installs TRL >= 1.16 for its TRL drop-in; the Axolotl plugin "
                               f"needs no extra): pip install '{requirement}'")


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
        _check_axolotl_trl()
        if not cfg.get("fusedloss"):
            _LOG.warning("fusedloss: the plugin is listed but the config does not set fusedloss: true; the model's "
                         "loss stays Axolotl's own (add fusedloss: true to fuse it)")

    def get_input_args(self) -> str:
        return "fusedloss.integrations.axolotl.FusedLossArgs"

    def post_model_load(self, cfg, model):
        if cfg.fusedloss:
            backend = cfg.fusedloss_backend or "auto"
            _hf.patch(model, backend=backend)
            _LOG.info("fusedloss: patched %s: its causal-LM loss comes from the hidden states (backend %s)",
                      type(model).__name__, backend)
