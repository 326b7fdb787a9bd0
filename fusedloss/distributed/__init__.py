"""Heads spread over ranks (docs/design.md, "Distributed").

Every loss takes ``process_group``, ``reduce_hidden_grad``, ``vocab_start``, ``vocab_size`` and
``fsdp_vocab_parallel``; ``head.prepare_head`` reads them (and DTensor or ZeRO-3 weights) and picks one of:

* ``vocab_parallel``: this rank's contiguous rows of the head (tensor parallelism); each rank's backend
  computes its rows' statistics, one all-gather merges them exactly (``merge``), the backward needs only
  the all-reduce of d hidden. The layout of the rows comes from ``layout`` (one cached collective).
* ``fsdp``: an FSDP2 ``Shard(0)`` head with per-rank tokens, gathered once per forward and once per
  backward, or vocabulary-parallel over the data-parallel group (``fsdp_vocab_parallel=True``);
  ``call_in_forward`` runs a loss inside the head module's FSDP forward instead.
* ``zero3``: a DeepSpeed ZeRO-3 head, gathered for the forward and again for the backward.

Every collective lives in ``_comm``.
"""

from .fsdp import call_in_forward
from .layout import VocabLayout, forget

__all__ = ["VocabLayout", "call_in_forward", "forget"]
