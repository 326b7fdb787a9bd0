"""Run TRL's fused LM-head paths through fusedloss.

TRL 1.16 already avoids the ``[tokens, vocab]`` logits in its trainers, through two autograd functions in
``trl/kernels/``; ``enable()`` swaps both for fusedloss, at the module attributes TRL looks them up from
at call time:

- ``ChunkedLogProbFunction`` (per-token log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1), called
  by the forward that ``trl.add_fused_lm_head`` installs, which GRPO, RLOO, DPO, KTO, SFT and AsyncGRPO use.
  Patched at ``trl.trainer.utils._ChunkedLogProbFunction`` (where that forward finds it) and at its public
  names ``trl.kernels.ChunkedLogProbFunction`` and ``trl.kernels.chunked_logprob.ChunkedLogProbFunction``.
- ``ChunkedDivergenceFunction`` (the DistillationTrainer's per-token forward KL / reverse KL / generalized
  JSD and student entropy), patched at ``trl.trainer.distillation_trainer.ChunkedDivergenceFunction`` and
  ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``.

- ``GKDTrainer.compute_loss`` (``trl.experimental.gkd``), which has no fused path of its own: it runs both
  models to their full ``[B, T, V]`` logits and calls its ``generalized_jsd_loss``. ``enable()`` replaces the
  method (on the class) with one that runs both models' forwards up to their LM heads
  (``integrations.transformers``: each head's bias, logit scale and soft-cap observed on its forward) and
  calls ``fusedloss.distillation_loss`` with GKD's ``beta``, its temperature 1 (GKD's ``self.temperature``
  only sets the sampling), its shifted ``labels != -100`` mask, its ``batchmean`` and ``num_items_in_batch``.
  TRL's method is kept where its logits are needed or the models are not plain modules: ``return_outputs=True``
  (evaluation), a subclass that overrides ``generalized_jsd_loss`` or ``compute_loss``, DeepSpeed or FSDP.

Not routed, for want of a hook: the GOLD, IW-OPD and server-distillation trainers of ``trl.experimental``
(their losses are written on logits inside the trainer), and verl 0.9's distillation loss
(``trainer/distillation/fsdp/losses.py``: top-k forward KL on logits the actor already materialised); use
``fusedloss.distillation_loss`` / ``topk_logprobs`` + ``sparse_distillation_loss`` in a custom loss there.

Everything around them stays TRL's: the backbone call, label shifting and masking, losses, metrics, the
FSDP2 ``full_tensor()`` gather. Models patched by ``add_fused_lm_head`` before ``enable()`` switch too.
Under FSDP2 with the head in the root's unit (accelerate's default) the head reaches these functions as the
root's unsharded parameter and the step is FSDP's own (tests/contract/test_integration_fsdp2.py). With the head its
own FSDP unit, TRL's forward gathers it with ``full_tensor()`` before calling them, whose backward leaves
each rank's shard with that rank's gradient instead of the average: that is TRL's forward, whichever kernel
it calls; ``fusedloss.integrations.transformers`` passes the sharded head to fusedloss, which averages.
The replacements take TRL's positional arguments and return TRL's tuples, with the same dtypes (fp32
per-token outputs, bool ``is_top1``) and the same differentiability (log_probs and entropy carry
gradients to hidden, weight and bias; the others are detached). ``chunk_size`` is accepted and ignored:
fusedloss picks its own tiles.

DeepSpeed ZeRO-3 heads (TRL gathers them only around the forward call) are gathered again for fusedloss's
backward, which recomputes the logits (``fusedloss.distributed.zero3``); a frozen ZeRO-3 teacher head is
gathered once.

Supported: ``trl>=1.16,<2``; ``enable()`` raises ``RuntimeError`` naming the version otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Optional

import torch

import fusedloss

from ..core import LogitTransform, TeacherHead, token_statistics
from ..core import registry as _backends
from ..core.statistics import autocast_dtype
from ..distributed import zero3
from . import _switch

__all__ = ["SUPPORTED_TRL", "FusedChunkedDivergenceFunction", "FusedChunkedLogProbFunction", "disable", "enable",
           "enabled", "is_enabled"]

SUPPORTED_TRL = ">=1.16,<2"
_OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

# (module, attribute) pairs where TRL binds each function; patched and restored together.
_LOGPROB_SITES = (
    ("trl.trainer.utils", "_ChunkedLogProbFunction"),
    ("trl.kernels", "ChunkedLogProbFunction"),
    ("trl.kernels.chunked_logprob", "ChunkedLogProbFunction"),
)
_DIVERGENCE_SITES = (
    ("trl.trainer.distillation_trainer", "ChunkedDivergenceFunction"),
    ("trl.kernels.chunked_divergence", "ChunkedDivergenceFunction"),
)

_originals: dict = {}  # (module, attribute) -> TRL's object, filled by the first enable()
_method_originals: dict = {}  # (class, method name) -> TRL's function, filled by the first enable()
_state = {"backend": "auto", "enabled": False}


def _check_trl_version():
    try:
        import trl
    except ImportError as exc:
        raise ImportError("fusedloss.integrations.trl needs trl (pip install 'fusedloss[integrations]')") from exc
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = Version(trl.__version__)
    if version.release is None or Version(version.base_version) not in SpecifierSet(SUPPORTED_TRL):
        raise RuntimeError(f"fusedloss.integrations.trl supports trl{SUPPORTED_TRL}, found trl {trl.__version__}; "
                           f"install a supported version or leave TRL's own kernels in place")


def _sites():
    for module_name, attr in _LOGPROB_SITES + _DIVERGENCE_SITES:
        module = importlib.import_module(module_name)
        if not hasattr(module, attr):
            raise RuntimeError(f"{module_name}.{attr} not found: this trl version moved its fused LM-head kernels, "
                               f"and fusedloss.integrations.trl does not know where to hook in")
        yield module, module_name, attr


def enable(backend: str = "auto") -> None:
    """Route TRL's fused LM-head log-probs and the distillation divergence through fusedloss.

    Idempotent: a second call only changes ``backend``. ``backend`` is fusedloss's (``"auto"``,
    ``"torch"``, ``"triton"``, ``"cuda"``), resolved per call for the tensors at hand. A backend that cannot
    run in this process (``fusedloss.backend_status()``) is refused here, before a trainer loads its models."""
    if backend not in _backends.BACKEND_NAMES:
        raise ValueError(f"backend must be one of {_backends.BACKEND_NAMES}, got {backend!r}")
    state = "available" if backend == "auto" else _backends.availability(backend)
    if state != "available":
        raise ValueError(f"backend={backend!r} cannot run here ({state}); use backend='auto', which picks the "
                         "CUDA or Triton backend on a GPU and the torch backend elsewhere")
    _check_trl_version()
    sites = list(_sites())
    for module, module_name, attr in sites:
        _originals.setdefault((module_name, attr), getattr(module, attr))
    for module, module_name, attr in sites:
        replacement = (FusedChunkedLogProbFunction if (module_name, attr) in _LOGPROB_SITES
                       else FusedChunkedDivergenceFunction)
        setattr(module, attr, replacement)
    gkd = _gkd_trainer()
    if gkd is not None:
        _method_originals.setdefault((gkd, "compute_loss"), gkd.__dict__["compute_loss"])
        gkd.compute_loss = _gkd_compute_loss
    _state.update(backend=backend, enabled=True)


def disable() -> None:
    """Put TRL's own functions back, exactly the objects that were there before ``enable()``."""
    for (owner, attr), original in _method_originals.items():
        setattr(owner, attr, original)
    _switch.restore_originals(_originals, _state)


def is_enabled() -> bool:
    return _state["enabled"]


@contextlib.contextmanager
def enabled(backend: str = "auto"):
    """``with enabled(): trainer.train()``; restores the previous state on exit."""
    was, previous = _state["enabled"], _state["backend"]
    enable(backend)
    try:
        yield
    finally:
        if was:
            enable(previous)
        else:
            disable()


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    # TRL projects in the autocast dtype when autocast is on, else in the hidden states' dtype.
    return autocast_dtype(hidden.device) or hidden.dtype


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    # A ZeRO-3 parameter stays itself: fusedloss gathers it (and casts) wherever it is used.
    return None if t is None or zero3.is_partitioned(t) else t.to(dtype)


def _statistics(hidden, weight, *, bias, backend, **problem):
    """``token_statistics`` in the dtype of ``hidden``; a ZeRO-3 head is gathered for the forward and again for
    the backward."""
    if zero3.is_partitioned(weight):
        return zero3.token_statistics(hidden, weight, bias=bias, backend=backend, **problem)
    return token_statistics(hidden, weight.to(hidden.dtype), bias=_cast(bias, hidden.dtype), backend=backend,
                            **problem)


class FusedChunkedLogProbFunction:
    """Drop-in for ``trl.kernels.ChunkedLogProbFunction``: same ``apply`` arguments, same outputs
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each ``[N]`` (None when not in
    ``outputs``), computed by one pass of ``fusedloss.core.token_statistics``:

    - log_probs  = z_y - lse                   (fp32, differentiable)
    - entropy    = -sum_v p_v log p_v          (fp32, differentiable)
    - log_sum_sq_probs = log sum_v p_v^2       (fp32, detached)
    - mean_logits = (1/V) sum_v z_v            (fp32, detached)
    - is_top1    = the target is the argmax    (bool)

    with ``z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature``. Rows with a negative
    target are 0 (TRL never passes them: it clamps or compacts the rows first)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size=None, final_logit_softcapping=None,
              logit_scale=1.0, outputs=_OPTIONAL_OUTPUTS):
        dtype = _compute_dtype(hidden)
        want = set(outputs)
        backend = _backends.resolve(_state["backend"], hidden.device, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            stats = _statistics(
                hidden.to(dtype), weight, bias=bias,
                targets=torch.where(targets >= 0, targets, -1).long(),
                transform=LogitTransform(float(temperature), float(logit_scale),
                                         None if final_logit_softcapping is None else float(final_logit_softcapping)),
                want_entropy="entropy" in want, want_mean_logit="mean_logits" in want,
                want_extras=bool(want & {"log_sum_sq_probs", "is_top1"}), backend=backend,
            )
        log_probs = stats.logp.float()
        entropy = stats.entropy.float() if "entropy" in want else None
        log_sum_sq = stats.log_sum_sq_probs.detach().float() if "log_sum_sq_probs" in want else None
        mean_logits = stats.mean_logit.detach().float() if "mean_logits" in want else None
        is_top1 = stats.is_top1.detach() > 0.5 if "is_top1" in want else None
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1


class FusedChunkedDivergenceFunction:
    """Drop-in for ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``: per-token divergence
    between student ``q`` and teacher ``p`` (both at ``temperature``) and the student entropy, ``[N]``
    each, from ``token_statistics`` with the teacher head:

    - beta == 0: KL(p || q) (forward);  beta == 1: KL(q || p) (reverse);
    - else beta KL(p || m) + (1 - beta) KL(q || m), m = (1 - beta) q + beta p.

    The divergence carries gradients to the student's hidden, weight and bias; the entropy is detached.
    Both heads apply their own logit_scale and soft-cap, then the shared temperature."""

    @staticmethod
    def apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
              temperature=1.0, student_logit_scale=1.0, student_final_logit_softcapping=None,
              teacher_logit_scale=1.0, teacher_final_logit_softcapping=None):
        s_dtype, t_dtype = _compute_dtype(student_hidden), _compute_dtype(teacher_hidden)
        beta = float(beta)
        backend = _backends.resolve(_state["backend"], student_hidden.device, s_dtype)
        teacher = TeacherHead(teacher_hidden.to(t_dtype), _cast(teacher_weight, t_dtype), _cast(teacher_bias, t_dtype),
                              float(temperature), float(teacher_logit_scale),
                              None if teacher_final_logit_softcapping is None
                              else float(teacher_final_logit_softcapping))
        with torch.autocast(student_hidden.device.type, enabled=False):
            stats = _statistics(
                student_hidden.to(s_dtype), student_weight, bias=student_bias,
                transform=LogitTransform(float(temperature), float(student_logit_scale),
                                         None if student_final_logit_softcapping is None
                                         else float(student_final_logit_softcapping)),
                teacher=teacher, want_entropy=True, want_kl_fwd=beta == 0.0, want_kl_rev=beta == 1.0,
                jsd_beta=beta if 0.0 < beta < 1.0 else None, backend=backend,
            )
        divergence = stats.kl_fwd if beta == 0.0 else stats.kl_rev if beta == 1.0 else stats.jsd
        return divergence.float(), stats.entropy.detach().float()


def _gkd_trainer():
    """TRL's GKDTrainer class, or None where this TRL has none (it lives in ``trl.experimental``)."""
    try:
        module = importlib.import_module("trl.experimental.gkd.gkd_trainer")
    except ImportError:
        return None
    return getattr(module, "GKDTrainer", None)


def _gkd_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """GKDTrainer.compute_loss through ``fusedloss.distillation_loss``: the same loss (GKD's generalized JSD of
    the shifted student and teacher next-token distributions at temperature 1 on the ``labels != -100``
    positions, ``batchmean`` or ``sum / num_items_in_batch``), without either model's ``[B, T, V]`` logits."""
    gkd = _gkd_trainer()
    original = _method_originals[(gkd, "compute_loss")]
    cls = type(self)
    overridden = (cls.generalized_jsd_loss is not gkd.__dict__["generalized_jsd_loss"].__func__
                  or any("compute_loss" in k.__dict__ for k in cls.__mro__[:cls.__mro__.index(gkd)]))
    if (return_outputs or overridden or getattr(self, "is_deepspeed_enabled", False)
            or getattr(self, "is_fsdp_enabled", False)):
        return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
    from trl.models.utils import _ForwardRedirection

    unwrapped = self.accelerator.unwrap_model(model)
    # Through the wrapper's forward (as TRL's DistillationTrainer does), so that DDP prepares its backward.
    return _ForwardRedirection()(model, unwrapped, _gkd_fused_loss, self, unwrapped, inputs, num_items_in_batch)


def _gkd_fused_loss(trainer, student, inputs, num_items_in_batch):
    from .transformers._helpers import _hidden_and_head

    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    h_s, head_s = _hidden_and_head(student, input_ids, attention_mask, {})
    trainer.teacher_model.eval()
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    with torch.no_grad():
        h_t, head_t = _hidden_and_head(teacher, input_ids, attention_mask, {})
    dtype = _compute_dtype(h_s)
    device = head_s.weight.device
    backend = _backends.resolve(_state["backend"], device)
    labels = inputs["labels"][:, 1:].to(device)
    with torch.autocast(device.type, enabled=False):
        # GKD's compute_loss calls generalized_jsd_loss at its default temperature, 1.
        return fusedloss.distillation_loss(
            h_s[:, :-1].to(device=device, dtype=dtype), head_s.weight.to(dtype), h_t[:, :-1].to(device=device,
                                                                                               dtype=dtype),
            head_t.weight.to(device=device, dtype=dtype), labels, beta=float(trainer.beta), temperature=1.0,
            bias=_cast(head_s.bias, dtype),
            teacher_bias=None if head_t.bias is None else head_t.bias.to(device=device, dtype=dtype),
            logit_scale=head_s.logit_scale, softcap=head_s.softcap, teacher_logit_scale=head_t.logit_scale,
            teacher_softcap=head_t.softcap, vocab_size=head_s.vocab_size, ignore_index=-100,
            reduction="batchmean", num_items_in_batch=num_items_in_batch, backend=backend)
