"""What the framework tests need from their environment, set up on import (``_frameworks_util`` imports this
before any framework).

One stand-in: ``flash_attn`` only ships CUDA builds, and OpenRLHF imports ``flash_attn.bert_padding`` and
``flash_attn.utils.distributed`` at module level. The stand-in's padding functions are verl's pure-torch
equivalents (``verl.utils.attention_utils``), ``all_gather`` is ``torch.distributed``'s; nothing under test is
stubbed, and ``flash_attn.ops`` (the Triton cross-entropy both frameworks use when present) stays absent, so
their own CPU paths run.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

# OpenRLHF's entropy is a torch.compile'd function; compiling it takes a minute on a CPU, and eager runs the
# same formula. fusedloss compiles nothing itself.
torch._dynamo.config.disable = True

def _install_flash_attn_stand_in():
    if "flash_attn" in sys.modules:
        return
    from verl.utils import attention_utils as padding

    def all_gather(tensor, group=None):
        world = torch.distributed.get_world_size(group)
        out = [torch.empty_like(tensor) for _ in range(world)]
        torch.distributed.all_gather(out, tensor.contiguous(), group=group)
        return torch.cat(out, dim=0)

    bert_padding = types.ModuleType("flash_attn.bert_padding")
    bert_padding.index_first_axis = padding._fallback_index_first_axis
    bert_padding.pad_input = padding._fallback_pad_input
    bert_padding.unpad_input = padding._fallback_unpad_input
    bert_padding.rearrange = padding._fallback_rearrange
    utils = types.ModuleType("flash_attn.utils")
    distributed = types.ModuleType("flash_attn.utils.distributed")
    distributed.all_gather = all_gather
    utils.distributed = distributed
    root = types.ModuleType("flash_attn")
    root.bert_padding, root.utils = bert_padding, utils
    for module in (root, bert_padding, utils, distributed):
        # transformers asks find_spec; without a version or a file it reports the package as absent
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    sys.modules.update({"flash_attn": root, "flash_attn.bert_padding": bert_padding, "flash_attn.utils": utils,
                        "flash_attn.utils.distributed": distributed})

_install_flash_attn_stand_in()

