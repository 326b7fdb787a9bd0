"""The exceptions fusedloss raises under a name of its own."""

from __future__ import annotations


class UnsupportedModelError(RuntimeError):
    """A model ``fusedloss.integrations.transformers`` refuses: its loss or log-probs cannot be computed exactly
    from its head's input (it runs its head twice, post-processes its logits in a way fusedloss's scale /
    soft-cap / vocabulary cut does not reproduce, computes its loss itself, ...). The message says why. A
    ``RuntimeError``, so ``except RuntimeError`` catches it too."""
