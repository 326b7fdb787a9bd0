"""The logits of a batch as every loss sees them: described, validated, never materialised.

``implicit_logits(hidden, weight, bias, ...)`` checks the inputs, flattens the rows, picks the backend and
returns an ``ImplicitLogits``: the ``[N, V]`` logits ``softcap(logit_scale * (hidden @ weight.T + bias)) /
temperature`` in the only form fusedloss ever holds them. A loss module builds one, asks it for per-token
statistics (``statistics``, or ``row_local_loss`` for a loss known in the forward), and does the rest with
ordinary tensor operations on ``[tokens]`` vectors (docs/design.md, "Losses as per-token math").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _validation as v
from ..config import RunOptions
from ..core import (
    LogitTransform,
    Statistics,
    TeacherHead,
    column_statistics,
    grad_in_forward,
    registry,
    token_statistics,
)
from ..core.statistics import autocast_dtype, build_problem
from ..distributed.head import prepare_head


@dataclass
class ImplicitLogits:
    hidden: torch.Tensor  # [N, D]
    weight: torch.Tensor  # [V, D]
    bias: Optional[torch.Tensor]
    transform: LogitTransform
    lead_shape: tuple
    backend: str  # concrete: "torch", "triton" or "cuda"
    # Rows spread over ranks (fusedloss/distributed/head.py): it computes the statistics; None on one device.
    distributed: Optional[object] = None
    # How to run (fusedloss/config.py): the caller's grad_in_forward=, workspace_mb=, allow_tf32= (None: the default).
    run: RunOptions = RunOptions()

    @property
    def vocab_size(self) -> int:
        """The logical vocabulary (every rank's rows, padding excluded)."""
        return self.weight.shape[0] if self.distributed is None else self.distributed.vocab_size

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]

    def targets(self, name: str, targets, ignore_index: Optional[int], *, hint: str = "") -> torch.Tensor:
        """Validate ``targets`` (shape = leading shape of hidden) and map them to the core's convention.
        ``ignore_index=None``: no value is ignored (the caller masks); ``hint``: the fix for an id out of range."""
        v.require_tensor(name, targets, floating=False)
        require_aligned(name, targets, self.lead_shape)
        v.require_same_device(hidden=self.hidden, **{name: targets})
        if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        return v.map_targets(name, targets, self.vocab_size, ignore_index, hint=hint)

    def statistics(self, *, targets=None, teacher: Optional[TeacherHead] = None, transform=None,
                   **wants) -> Statistics:
        wants.update(self.run.problem_fields())
        if self.distributed is not None:
            return self.distributed.statistics(self, targets=targets, teacher=teacher,
                                               transform=transform or self.transform, **wants)
        return token_statistics(self.hidden, self.weight, bias=self.bias, targets=targets,
                                transform=transform or self.transform, teacher=teacher, backend=self.backend,
                                **wants)

    def column_statistics(self, columns: torch.Tensor, *, targets=None, **wants) -> tuple:
        """``(statistics, [N, K] log-probabilities at columns)`` (core/columns.py): ``columns`` validated ids
        ``[N, K]``, -1 for none; ``targets`` one of each row's columns (-1: the row is ignored). Needs the head
        whole on this device."""
        wants.update(self.run.problem_fields())
        return column_statistics(self.hidden, self.weight, columns, bias=self.bias, targets=targets,
                                 transform=self.transform, backend=self.backend, **wants)

    def row_local_loss(self, row_loss: grad_in_forward.RowLoss, *, targets=None, teacher: Optional[TeacherHead] = None,
                       **wants) -> torch.Tensor:
        """``row_loss(stats[rows], rows)`` summed over all rows, for a loss that is a weighted sum of
        per-row terms. On the grad-in-forward 3-product path when it applies (core/grad_in_forward.py), else on the
        composable statistics op; both evaluate the same ``row_loss``."""
        # A head spread over ranks takes the composable op: a grad-in-forward chunk would need its merged statistics.
        if self.distributed is None and grad_in_forward.want_grad_in_forward(self.backend, self.hidden, self.weight,
                                                                             self.bias,
                                                         self.run.grad_in_forward):
            problem = build_problem(self.hidden, self.weight, bias=self.bias, targets=targets,
                                    transform=self.transform, teacher=teacher, **wants, **self.run.problem_fields())
            if grad_in_forward.pays(self.backend, problem, self.run.grad_in_forward):
                return grad_in_forward.grad_in_forward_loss(problem, self.backend, row_loss)
        return row_loss(self.statistics(targets=targets, teacher=teacher, **wants), slice(None))

    def unflatten(self, per_row: torch.Tensor) -> torch.Tensor:
        return per_row.reshape(self.lead_shape)


def implicit_logits(hidden, weight, bias=None, *, temperature=1.0, logit_scale=1.0, softcap=None, backend="auto",
            hidden_name="hidden", weight_name="weight", bias_name="bias", min_dims=1, process_group=None,
            reduce_hidden_grad=True, vocab_start=None, vocab_size=None, fsdp_vocab_parallel=False, grad_in_forward=None,
            workspace_mb=None, allow_tf32=None) -> ImplicitLogits:
    """Check ``hidden [..., D]``, ``weight [V, D]``, ``bias [V]`` and the logit transform; pick the backend.
    ``process_group``, ..., ``fsdp_vocab_parallel``: where the rows of the head live (fusedloss/distributed);
    ``grad_in_forward``, ``workspace_mb``, ``allow_tf32``: how to run (fusedloss/config.py)."""
    run = RunOptions.checked(grad_in_forward=grad_in_forward, workspace_mb=workspace_mb, allow_tf32=allow_tf32)
    v.require_tensor(hidden_name, hidden, floating=True)
    v.require_tensor(weight_name, weight, floating=True)
    _warn_if_head_options_dropped(weight_name, weight, bias, logit_scale, softcap, vocab_size)
    hidden, weight, bias, spread = prepare_head(
        hidden, weight, bias, process_group=process_group, reduce_hidden_grad=reduce_hidden_grad,
        vocab_start=vocab_start, vocab_size=vocab_size, fsdp_vocab_parallel=fsdp_vocab_parallel,
        weight_name=weight_name)
    if hidden.dim() < min_dims + 1:
        raise ValueError(f"{hidden_name} must have at least {min_dims + 1} dimensions ([..., D]), "
                         f"got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{weight_name} must be 2-D [V, D], got shape {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        hint = ""
        if weight.shape[0] == hidden.shape[-1]:
            hint = (f"; {weight_name} looks transposed ([D, V]): pass lm_head.weight, which is [V, D]"
                    if weight.shape[0] < weight.shape[1] else
                    f"; {hidden_name}'s last dimension equals the vocabulary size {weight.shape[0]}: these look "
                    f"like logits, pass the hidden states (the input of the LM head) instead")
        raise ValueError(f"{weight_name} has hidden size {weight.shape[1]} but {hidden_name} has "
                         f"{hidden.shape[-1]} (last dimension): they must match{hint}")
    if hidden.shape[-1] == 0:
        raise ValueError(f"{hidden_name} must have a hidden size of at least 1, got shape {tuple(hidden.shape)}")
    if weight.shape[0] == 0 and spread is None:  # a rank of a sharded head may hold no rows
        raise ValueError(f"{weight_name} must have at least one vocabulary row, got shape {tuple(weight.shape)}")
    if bias is not None:
        v.require_tensor(bias_name, bias, floating=True)
    cast = autocast_dtype(hidden.device)
    if cast is not None:
        # Under autocast the head is a linear layer like any other: hidden, weight and bias are cast to the
        # autocast dtype as F.linear would cast them (a bf16 hidden state meets fp32 head parameters), and the
        # op itself runs with autocast off, so that the logits are formed in fp32 from those values in the
        # forward and again in the backward (which runs outside the autocast region). One behaviour for every
        # backend and device.
        hidden, weight, bias = (_autocast(t, cast) for t in (hidden, weight, bias))
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{weight_name} has dtype {weight.dtype} but {hidden_name} has {hidden.dtype}: "
                        f"cast them to one dtype")
    if bias is not None:
        v.require_shape(bias_name, bias, (weight.shape[0],), f"one entry per row of {weight_name}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"{bias_name} has dtype {bias.dtype} but {weight_name} has {weight.dtype}")
    device = v.require_same_device(**{hidden_name: hidden, weight_name: weight, bias_name: bias})
    v.require_real("temperature", temperature, positive=True)
    v.require_real("logit_scale", logit_scale)
    v.require_real("softcap", softcap, positive=True, allow_none=True)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {registry.BACKEND_NAMES}, got {backend!r}")
    name = registry.resolve(backend, device, hidden.dtype)
    lead = tuple(hidden.shape[:-1])
    return ImplicitLogits(hidden=_rows_contiguous(hidden.reshape(-1, hidden.shape[-1])),
                          weight=_rows_contiguous(weight), bias=None if bias is None else bias.contiguous(),
                          transform=LogitTransform(float(temperature), float(logit_scale),
                                                   None if softcap is None else float(softcap)),
                  lead_shape=lead, backend=name, distributed=spread, run=run)


# The attribute ``lm_head(model)`` (fusedloss.integrations.transformers) sets on the head's weight: the logit
# processing the model applies on top of ``hidden @ weight.T``. A call that passes that weight without it computes
# the loss of logits the model never produces (a soft-capped Gemma 2 without its cap: a loss 3.5x too large),
# with no error to say so; the attribute lets that call say so.
HEAD_OPTIONS_ATTR = "_fusedloss_head_options"


def remember_head_options(weight: torch.Tensor, *, bias: Optional[torch.Tensor], logit_scale: float,
                          softcap: Optional[float], vocab_size: Optional[int]) -> None:
    """Mark ``weight`` (a model's LM head) with the processing its model applies to the logits, where any."""
    expected = {"softcap": softcap, "logit_scale": float(logit_scale), "bias": bias is not None,
                "vocab_size": vocab_size}
    if softcap is None and float(logit_scale) == 1.0 and bias is None and vocab_size is None:
        return
    try:
        setattr(weight, HEAD_OPTIONS_ATTR, expected)
    except (AttributeError, TypeError, RuntimeError):  # a tensor type that takes no attributes: nothing to mark
        pass


def _warn_if_head_options_dropped(weight_name, weight, bias, logit_scale, softcap, vocab_size) -> None:
    if torch.compiler.is_compiling():
        return
    expected = getattr(weight, HEAD_OPTIONS_ATTR, None)
    if not expected:
        return
    dropped = []
    if expected["softcap"] is not None and softcap is None:
        dropped.append(f"softcap={expected['softcap']:g}")
    if expected["logit_scale"] != 1.0 and isinstance(logit_scale, (int, float)) and float(logit_scale) == 1.0:
        dropped.append(f"logit_scale={expected['logit_scale']:g}")
    if expected["bias"] and bias is None:
        dropped.append("bias")
    if expected["vocab_size"] is not None and vocab_size is None:
        dropped.append(f"vocab_size={expected['vocab_size']}")
    if dropped:
        warnings.warn(f"{weight_name} is the LM head of a model whose logits have {', '.join(dropped)}, and this "
                      "call passes none of it: pass **lm_head(model).options (bias, logit_scale, softcap, "
                      "vocab_size) with lm_head(model).weight, else the loss is that of logits the model never "
                      "produces", UserWarning, stacklevel=4)


def _autocast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Autocast's own rule: floating tensors other than float64 take the autocast dtype."""
    if t is None or t.dtype == dtype or t.dtype == torch.float64:
        return t
    return t.to(dtype)


def require_aligned(name: str, targets: torch.Tensor, lead_shape: tuple) -> None:
    """``targets`` must have the leading shape of hidden; the near misses of next-token scoring get their fix."""
    if tuple(targets.shape) != tuple(lead_shape):
        raise ValueError(f"{name} must have shape {tuple(lead_shape)} (the leading dimensions of hidden), got "
                         f"{tuple(targets.shape)}{alignment_hint(name, tuple(targets.shape), tuple(lead_shape))}")


def alignment_hint(name: str, shape: tuple, lead: tuple) -> str:
    """A sentence for the two shape near misses of next-token scoring (empty when neither applies):
    ``targets`` one position longer than ``hidden`` (labels of the whole sequence), or shorter (a
    completion scored with the hidden states of prompt and completion)."""
    if len(shape) != len(lead) or len(shape) < 1 or shape[:-1] != lead[:-1]:
        return ""
    if shape[-1] == lead[-1] + 1:
        return (f": next-token labels? position t of hidden predicts token t + 1, so pass hidden[:, :-1] with "
                f"{name}[:, 1:]")
    if 0 < shape[-1] < lead[-1]:
        return (f": scoring a completion of {shape[-1]} tokens after a prompt of P tokens? pass hidden[:, P - 1:-1], "
                f"the rows that predict it (not hidden[:, -{shape[-1]}:] nor hidden[:, P:]); "
                f"fusedloss.integrations.transformers.completion_logprobs(model, prompt_ids, completion_ids) "
                f"aligns them for you")
    return ""


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels read rows with a unit inner stride; copy only the (rare) transposed or strided inputs."""
    return t if t.stride(-1) == 1 else t.contiguous()


def count_or_one(count: torch.Tensor) -> torch.Tensor:
    """max(1, count): a mean over zero valid tokens is 0, never NaN (docs/design.md, "Losses as per-token math")."""
    return count.clamp(min=1)


def items_divisor(num_items_in_batch, like: torch.Tensor, *, positive: bool = False) -> torch.Tensor:
    """``num_items_in_batch`` (int or tensor, as trainers pass it) as a tensor on ``like``'s device.

    ``positive``: the loss is ``sum / num_items_in_batch`` itself (cross-entropy, distillation: what
    transformers computes), so a value that is not > 0 is refused with a ValueError, a tensor's too, rather
    than silently clamped (0.5 must give 2 * sum, as the reference does) or turned into inf / NaN. A tensor's
    value is checked without a host synchronisation (``_validation.refuse_values``)."""
    if isinstance(num_items_in_batch, torch.Tensor):
        if (num_items_in_batch.numel() != 1 or num_items_in_batch.is_complex()
                or num_items_in_batch.dtype == torch.bool):
            raise ValueError("num_items_in_batch must be a number or a one-element real tensor, got "
                             f"shape {tuple(num_items_in_batch.shape)} ({num_items_in_batch.dtype})")
        value = num_items_in_batch.reshape(())
        if positive:  # no host synchronisation on a GPU (a device-side assertion there)
            why = "num_items_in_batch must be > 0 (the loss is sum / num_items_in_batch)"
            v.refuse_values(~(value > 0), lambda: f"{why}, got {value.item()!r}", why)
        return value.to(device=like.device, dtype=like.dtype)
    v.require_real("num_items_in_batch", num_items_in_batch, nonnegative=True, positive=positive)
    return torch.tensor(float(num_items_in_batch), device=like.device, dtype=like.dtype)
