"""DTensor heads: tensor parallelism or FSDP2, told apart by ``hidden``.

A ``Shard(0)`` weight looks the same under FSDP2 (each rank holds other tokens) and under tensor parallelism
(every rank holds the same tokens), so the weight alone cannot say which it is. ``hidden`` does:

* ``hidden`` a DTensor replicated on the mesh dimension where the weight is ``Shard(0)`` (every other mesh
  dimension ``Replicate`` for the weight): vocabulary-parallel over that dimension's group, starting at the
  DTensor's global offset. Both are used through their local tensors (``to_local`` is differentiable: the
  gradients come back as DTensors of the same placements).
* ``hidden`` a plain tensor: FSDP2's sharded parameter, read outside its module's forward (``fsdp.py``;
  ``head.py`` sends it there, and ``fsdp.py`` reads its rows with this module's helpers).

Anything else (``_StridedShard`` from FSDP + TP read outside the forward, a weight sharded on its hidden
dimension, a hidden state sharded on the vocabulary's mesh dimension) is a ValueError that says which.
"""

from __future__ import annotations

from .laid_out import vocab_parallel_head


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def describe(t) -> str:
    return f"a DTensor with placements {tuple(t.placements)} on {t.device_mesh}"


def vocab_mesh_dim(weight, weight_name: str) -> int:
    """The one mesh dimension on which ``weight`` is ``Shard(0)`` (every other one ``Replicate``)."""
    from torch.distributed.tensor import Replicate, Shard

    dims = [i for i, pl in enumerate(weight.placements) if type(pl) is Shard and pl.dim == 0]
    others_ok = all(type(pl) is Replicate for i, pl in enumerate(weight.placements) if i not in dims)
    if len(dims) != 1 or not others_ok:
        raise ValueError(f"{weight_name} is {describe(weight)}: a sharded head must be Shard(0) on exactly one mesh "
                         "dimension and Replicate on the others (a _StridedShard is FSDP + TP read outside the "
                         "module's forward: call the loss inside it)")
    return dims[0]


def global_offset(weight, dim: int) -> int:
    """The global id of this rank's first row of a ``Shard(0)`` DTensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return int(offset[0])


def layout_of(weight, dim: int, vocab_size, weight_name: str):
    """Every rank's rows of a ``Shard(0)`` DTensor head (torch.chunk's split of its global rows), with no
    collective; checked against this rank's own shard."""
    from . import layout as layouts

    layout = layouts.from_chunks(weight.device_mesh.get_group(dim), weight.shape[0], vocab_size)
    mine = (global_offset(weight, dim), weight.to_local().shape[0])
    if mine != (layout.start, layout.rows[layout.rank]):
        raise ValueError(f"{weight_name} is {describe(weight)} holding rows [{mine[0]}, {mine[0] + mine[1]}) on this "
                         "rank, not torch.chunk's split of its rows: pass its local tensor with process_group= and "
                         "vocab_start= instead")
    return layout


def local_bias(bias, weight, bias_name: str = "bias"):
    if bias is None or not is_dtensor(bias):
        if bias is not None:
            raise ValueError(f"{bias_name} must be sharded like the weight (a DTensor with its placements), got a "
                             "plain tensor")
        return None
    if bias.device_mesh != weight.device_mesh or tuple(bias.placements) != tuple(weight.placements):
        raise ValueError(f"{bias_name} is {describe(bias)} but the weight is {describe(weight)}: shard them alike")
    return bias.to_local()


def prepare(hidden, weight, bias, *, process_group, reduce_hidden_grad, vocab_start, vocab_size, fsdp_vocab_parallel,
            weight_name):
    if not is_dtensor(weight):
        raise ValueError(f"hidden is {describe(hidden)} but {weight_name} is a plain tensor: pass DTensors for both "
                         "(tensor parallelism) or plain tensors with process_group=")
    dim = vocab_mesh_dim(weight, weight_name)
    mesh = weight.device_mesh
    if fsdp_vocab_parallel:
        raise ValueError("fsdp_vocab_parallel=True is for an FSDP2 head with plain per-rank hidden states; hidden is "
                         f"{describe(hidden)}")
    from torch.distributed.tensor import Replicate

    if hidden.device_mesh != mesh or type(hidden.placements[dim]) is not Replicate:
        raise ValueError(f"{weight_name} is {describe(weight)} but hidden is {describe(hidden)}: for a "
                         f"vocabulary-parallel head hidden must be Replicate on mesh dimension {dim}")
    group = mesh.get_group(dim)
    if process_group is not None and process_group.group_name != group.group_name:
        raise ValueError(f"process_group is not the group of mesh dimension {dim} that {weight_name} is sharded on")
    layout = layout_of(weight, dim, vocab_size, weight_name)
    if vocab_start is not None and vocab_start != layout.start:
        raise ValueError(f"vocab_start={vocab_start} but {weight_name}'s DTensor places this rank's rows at "
                         f"{layout.start}")
    return vocab_parallel_head(hidden.to_local(), weight.to_local(), local_bias(bias, weight), layout,
                               reduce_hidden_grad)
