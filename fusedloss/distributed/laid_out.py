"""The heads whose rows are spread over ranks (``LaidOutHead``: a vocabulary-parallel group, or FSDP2 shards)
and the cuts of a head's rows that ``head.py``, ``dtensor.py`` and ``fsdp.py`` all make. Below them all, so
that none of them imports another to reach these (docs/design.md, "Distributed")."""

from __future__ import annotations

from typing import Optional

import torch

from ..core.problem import Statistics
from . import layout as layouts
from . import vocab_parallel


class LaidOutHead:
    """A head whose rows are spread over ranks as ``layout`` says. ``ImplicitLogits.distributed`` holds one; it
    computes the statistics (``statistics(logits, targets=, teacher=, transform=, **wants)``), and two heads of
    one loss (student and teacher) must have the same kind and layout (``same_rows``)."""

    def __init__(self, layout: layouts.VocabLayout):
        self.layout = layout

    @property
    def vocab_size(self) -> int:
        return self.layout.vocab_size

    def same_rows(self, other) -> bool:
        return type(other) is type(self) and other.layout == self.layout


class VocabParallelHead(LaidOutHead):
    """This rank's rows of a head sharded over a process group (``layout``)."""

    def __init__(self, layout: layouts.VocabLayout, reduce_hidden_grad: bool):
        super().__init__(layout)
        self.reduce_hidden_grad = reduce_hidden_grad

    def statistics(self, logits, *, targets=None, teacher=None, transform=None, **wants) -> Statistics:
        return vocab_parallel.token_statistics(self.layout, logits.hidden, logits.weight, bias=logits.bias,
                                               targets=targets, transform=transform, teacher=teacher,
                                               backend=logits.backend, reduce_hidden_grad=self.reduce_hidden_grad,
                                               **wants)


def vocab_parallel_head(hidden, weight, bias, layout: layouts.VocabLayout, reduce_hidden_grad: bool):
    """This rank's real rows (its padded tail dropped) and the head that merges the ranks' statistics."""
    real = layout.local_real_rows
    weight = weight[:real]
    bias = None if bias is None else bias[:real]
    return hidden, weight, bias, VocabParallelHead(layout, reduce_hidden_grad)


def padded_prefix(weight, bias, vocab_size: Optional[int], weight_name: str = "weight"):
    """The rows below ``vocab_size`` of a head on one device."""
    if vocab_size is None:
        return weight, bias
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and vocab_size > weight.shape[0]:
        raise ValueError(f"vocab_size={vocab_size} but {weight_name} has only {weight.shape[0]} rows")
    return weight[:vocab_size], (None if bias is None else bias[:vocab_size])
