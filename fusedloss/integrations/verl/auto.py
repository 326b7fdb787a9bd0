"""``import fusedloss.integrations.verl.auto`` enables the verl integration in the importing process.

For verl's ``actor_rollout_ref.model.external_lib``, which every Ray worker imports before it builds its model::

    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.external_lib=fusedloss.integrations.verl.auto

``FUSEDLOSS_VERL_BACKEND`` (default ``auto``) and ``FUSEDLOSS_VERL_VOCAB_SIZE`` (default: every head row
scored) set ``enable()``'s options; give them to the workers through Ray's ``runtime_env``.
"""

import os

from . import enable

_vocab_size = os.environ.get("FUSEDLOSS_VERL_VOCAB_SIZE")
try:
    _vocab_size = None if not _vocab_size else int(_vocab_size)
except ValueError:
    raise ValueError(f"FUSEDLOSS_VERL_VOCAB_SIZE must be an int, got {_vocab_size!r}") from None

enable(os.environ.get("FUSEDLOSS_VERL_BACKEND", "auto"), vocab_size=_vocab_size)
