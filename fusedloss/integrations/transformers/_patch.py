"""``patch`` / ``unpatch``: the model's own ``labels=`` loss computed by ``fusedloss.cross_entropy`` from the
head's input recorded by the tap (``_tap``), never from logits."""

from __future__ import annotations

import torch

import fusedloss

from ...errors import UnsupportedModelError
from ._head import _as_lm_head, _causal_lm, _head_tensors, _output_head
from ._tap import (
    _PATCH_ATTR,
    _enter_hook,
    _Method,
    _ModuleForward,
    _observe,
    _raised_in,
    _restore,
    _Tap,
    _tapped_head_forward,
)

# How the patch works (docs/design.md, "Configuration"): the model keeps its own forward. Three instance
# attributes and two forward pre-hooks are set, and ``unpatch`` removes them:
#
#   * ``lm.forward``: with ``labels`` it arms the tap, calls the model's own forward, and returns its output
#     with ``logits=None``; without labels it is the model's own forward, untouched; with labels and autograd
#     off (evaluation, ``eval_logits``) it is the model's own forward and loss, logits included.
#   * ``head.forward``: the tap (``_tap``); unarmed, the head's own forward (generation, evaluation).
#   * ``lm.loss_function`` (transformers' setter): the model calls it with the post-processed probe rows,
#     ``labels``, ``num_items_in_batch``, ``shift_labels``, ``ignore_index`` exactly as it would call
#     ``ForCausalLMLoss``; it checks the probe rows (``_observe``) and computes that same loss from the recorded
#     head input with ``fusedloss.cross_entropy``. Whatever the model does around its loss (an MoE router loss
#     added to it, gradient checkpointing of its layers, accelerate's output casting) stays the model's own.
#   * ``_enter_hook`` on the model and its head: names the module a forward enters (a DataParallel replica).
#
# The attributes are ``_Method`` objects and the patch state lives in the modules' ``__dict__``: a
# ``copy.deepcopy`` of a patched model (TRL's reference models are made that way) is a patched copy that runs
# its own parameters, and a patched model saved whole (``torch.save(model)``, pickle) loads patched. The state of
# a call in flight is its thread's (``_Tap.call``). A model that computes its loss any other way (its own
# cross-entropy on the probe rows raises, or it never calls ``self.loss_function``) is refused at its first
# labelled call.


class _Patch(_Tap):
    """What ``patch`` changed on one model, on top of the tap, and how to undo it."""

    def __init__(self, lm, head, backend: str, eval_logits: bool = True):
        import inspect

        super().__init__(lm, head)
        self.backend = backend
        self.eval_logits = eval_logits
        self.saved = {"lm.forward": lm.__dict__.get("forward"), "lm._loss_function": lm.__dict__.get("_loss_function")}
        self.had_loss_function = "_loss_function" in lm.__dict__
        forward = inspect.unwrap(type(lm).forward)
        names = [q.name for q in inspect.signature(type(lm).forward).parameters.values()
                 if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)][1:]  # without self
        self.labels_at = names.index("labels") if "labels" in names else None
        self.keep_at = names.index("logits_to_keep") if "logits_to_keep" in names else None
        # transformers' causal LMs name self.loss_function in their forward: an error between their head and their
        # loss is not their own loss code failing on the probe rows
        self.names_loss_function = "loss_function" in getattr(getattr(forward, "__code__", None), "co_names", ())

    def model_forward(self, lm):
        """The forward the patch wraps, run on ``lm`` (the model or a replica of it): an earlier instance
        attribute (e.g. accelerate's), else the class's."""
        saved = self.saved["lm.forward"]
        return saved if saved is not None else type(lm).forward.__get__(lm)


def _keep_positions(labels: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The labels of the positions the model kept before its head (transformers' ``logits_to_keep``)."""
    if isinstance(logits_to_keep, int):
        return labels if logits_to_keep == 0 else labels[:, -logits_to_keep:]
    if logits_to_keep.dim() == 2:
        if logits_to_keep.dtype == torch.bool:
            return labels[logits_to_keep.to(labels.device)]
        return torch.take_along_dim(labels, logits_to_keep.to(labels.device), dim=1)
    return labels[:, logits_to_keep.to(labels.device)]


def _patched_forward(lm, *args, **kwargs):
    """``lm.forward`` of a patched model (``lm``: the one entered)."""
    state = lm.__dict__[_PATCH_ATTR]
    forward = state.model_forward(lm)
    labels = kwargs.get("labels")
    if labels is None and state.labels_at is not None and len(args) > state.labels_at:
        labels = args[state.labels_at]
    if labels is None:
        return forward(*args, **kwargs)
    if getattr(state, "eval_logits", True) and not torch.is_grad_enabled():
        # Evaluation: nothing is differentiated, and the caller may read the logits (a Trainer's compute_metrics,
        # LLaMA-Factory's compute_accuracy): the model's own forward, its logits and its own loss from them.
        state._threads.own_loss = True
        try:
            return forward(*args, **kwargs)
        finally:
            state._threads.own_loss = False
    head = lm.get_output_embeddings()
    if head is None or head.__dict__.get(_PATCH_ATTR) is not state:
        now = type(head)
        raise RuntimeError(f"fusedloss patch: the LM head of {type(lm).__name__} was wrapped or replaced after "
                           f"patch() (it is now a {now.__module__}.{now.__qualname__}: a PEFT adapter on the head, "
                           "resize_token_embeddings, ...); call fusedloss.integrations.transformers.patch(model) "
                           "again after adding adapters or resizing: it taps the new head")
    keep = kwargs.get("logits_to_keep",
                      args[state.keep_at] if state.keep_at is not None and len(args) > state.keep_at else 0)
    return_dict = kwargs.pop("return_dict", None)
    want_tuple = return_dict is False or (return_dict is None and getattr(lm.config, "return_dict", True) is False)
    if want_tuple or return_dict is not None:
        kwargs["return_dict"] = True  # the probe rows must not reach a tuple
    call = state.arm(lm, head, keep)
    try:
        out = forward(*args, **kwargs)
    except UnsupportedModelError:
        raise
    except Exception as error:
        # Between the head and the loss, a model that computes its loss itself fails on the probe rows. An error
        # of the head's own (its forward, a user's hook on it), or of a model that calls self.loss_function,
        # is the caller's to see as it is.
        if call.head_calls and not call.in_loss and not state.names_loss_function and not _raised_in(head, error):
            raise UnsupportedModelError(f"fusedloss patch: {type(lm).__name__} computes its loss itself, not "
                                        "through self.loss_function (its own loss code raised on the head's probe "
                                        "rows); integrations.transformers.patch does not support this "
                                        "architecture") from error
        raise
    finally:
        state.disarm(call)
    if call.loss_calls != 1:
        raise UnsupportedModelError(f"fusedloss patch: {type(lm).__name__} computes its loss itself, not through "
                                    "self.loss_function; integrations.transformers.patch does not support this "
                                    "architecture")
    # A new output without the field: a ModelOutput keeps a key once set, even when set to None.
    out = type(out)(**{k: v for k, v in out.items() if k != "logits"})
    return out.to_tuple() if want_tuple else out


def _fused_causal_lm_loss(lm, logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                          shift_labels=None, **kwargs):
    """transformers' ``ForCausalLMLoss`` computed from the head's recorded input: the labels shifted left by
    one (or ``shift_labels`` as given), ``ignore_index`` skipped, the mean over valid tokens, or the sum /
    ``num_items_in_batch`` under gradient accumulation (``lm``: the patched model; the call is this thread's).
    ``logits`` are the model's post-processing of the probe rows: they decide the logit processing (``_observe``)."""
    state = lm.__dict__[_PATCH_ATTR]
    if getattr(state._threads, "own_loss", False):  # an evaluation call with its logits (_patched_forward)
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                               ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    call = state.call
    hidden = None if call is None else call.hidden
    if hidden is None:
        raise RuntimeError("fusedloss patch: the model computed its loss without calling its patched LM head "
                           "first; if the head was replaced after patch() (resize_token_embeddings, ...), call "
                           "fusedloss.integrations.transformers.patch(model) again, else this architecture is not "
                           "supported by integrations.transformers.patch")
    call.in_loss = True
    call.hidden = None
    call.loss_calls += 1
    transform = _observe(call, logits)
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = _keep_positions(shift_labels, call.logits_to_keep)
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        hint = ""
        if labels is not None and labels.dim() == hidden.dim() - 1 and labels.shape[-1] == hidden.shape[-2] - 1:
            hint = ("; labels are shifted for you: pass labels the length of input_ids (unshifted), or labels "
                    "already shifted as shift_labels=")
        raise ValueError(f"fusedloss patch: the head scored positions of shape {tuple(hidden.shape[:-1])} "
                         f"but the labels give {tuple(targets.shape)}{hint}")
    head = _as_lm_head(call.head, transform)  # a DTensor or ZeRO-3 head goes to the core as it is
    hidden = hidden.to(head.weight.device)
    loss = fusedloss.cross_entropy(
        hidden, head.weight, targets.to(hidden.device), ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum", backend=state.backend, **head.options)
    if num_items_in_batch is not None:
        # transformers divides the sum by num_items_in_batch as given (int or tensor) and never checks it:
        # cross_entropy(num_items_in_batch=) would refuse n <= 0 with a host sync, in a trainer's hot loop
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _refuse_wrapped(model) -> None:
    """A wrapper around the model (torch.compile, DDP, FSDP1, DataParallel) hides the forward the patch wraps."""
    wrappers = []
    try:
        from torch._dynamo.eval_frame import OptimizedModule

        wrappers.append((OptimizedModule, "torch.compile"))
    except ImportError:  # pragma: no cover - torch without dynamo
        pass
    wrappers.append((torch.nn.DataParallel, "DataParallel"))
    wrappers.append((torch.nn.parallel.DistributedDataParallel, "DistributedDataParallel"))
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers.append((FullyShardedDataParallel, "FullyShardedDataParallel"))
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    for cls, name in wrappers:
        if isinstance(model, cls):
            raise ValueError(f"patch before {name}: the model is already wrapped ({type(model).__name__}); call "
                             f"patch(model) on the unwrapped model, then wrap it (fully_shard, FSDP2, is fine "
                             "either side)")


def patch(model, *, backend: str = "auto", eval_logits: bool = True):
    """Make ``model(..., labels=labels).loss`` come from the head's input, without the logits.

    ``model`` is a transformers causal LM (``*ForCausalLM``, or a PEFT model wrapping one). After
    ``patch(model)``, a forward with ``labels`` returns the model's own causal-LM loss (labels shifted by
    one, ``-100`` ignored, the mean over valid tokens; with ``num_items_in_batch``, as the ``Trainer``
    passes it under gradient accumulation, the sum divided by it; ``shift_labels`` used as given) computed by
    ``fusedloss.cross_entropy`` from the head's input and weight (tied embeddings, a LoRA on the head, the
    model's logit scale, soft-cap and vocabulary cut included), and ``out.logits is None``. With
    ``logits_to_keep``, the loss covers the positions kept. A forward without labels (generation) is the
    model's own. So is a forward with labels and autograd off (``torch.no_grad``: the ``Trainer``'s evaluation),
    logits and loss, since its caller may read the logits (``compute_metrics``, LLaMA-Factory's
    ``compute_accuracy``); ``eval_logits=False`` computes those losses from the hidden states too, without
    logits, for evaluation loops that read only the loss. Works with gradient checkpointing, ``torch.compile``,
    accelerate and the HF ``Trainer``; a ``copy.deepcopy`` of a patched model is patched too. Patch before wrapping the
    model (``torch.compile``, DDP, FSDP; a wrapped model is refused). Returns ``model``; ``unpatch(model)``
    restores it exactly. ``backend`` is passed to ``fusedloss.cross_entropy``.

    A patched model saved whole (``torch.save(model)``, pickle) loads patched. Each labelled call keeps what it
    records on its own thread: threads may share one patched model, and ``nn.DataParallel`` replicas run their
    own parameters. Adapters or a resize that wrap or replace the head after ``patch`` are refused at the next
    labelled call with the fix: call ``patch(model)`` again, which taps the new head.

    Every labelled call checks the model's own post-processing of its head's output on a few probe rows
    against fusedloss's formula (the first one, with autograd on, its gradient too): an architecture whose
    loss fusedloss cannot reproduce exactly is refused with the reason, at ``patch`` (a head that is not one
    linear layer) or at its first labelled call.

    Example::

        model = fusedloss.integrations.transformers.patch(AutoModelForCausalLM.from_pretrained(name))
        loss = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
    """
    from ...core import registry as _backends

    if backend not in _backends.BACKEND_NAMES:
        raise ValueError(f"backend must be one of {_backends.BACKEND_NAMES}, got {backend!r}")
    _refuse_wrapped(model)
    lm = _causal_lm(model)
    if not (hasattr(lm, "get_output_embeddings") and hasattr(lm, "loss_function")):
        raise ValueError(f"{type(lm).__name__} is not a transformers causal LM with an LM head "
                         "(get_output_embeddings() and loss_function are needed)")
    head = _output_head(lm)
    if _PATCH_ATTR in lm.__dict__:
        if lm.__dict__[_PATCH_ATTR].head is head:
            lm.__dict__[_PATCH_ATTR].backend = backend  # idempotent: a second patch only changes the options
            lm.__dict__[_PATCH_ATTR].eval_logits = eval_logits
            return model
        unpatch(model)  # the head was replaced or wrapped since (resize_token_embeddings, a LoRA): tap the new one
    from transformers.loss.loss_utils import ForCausalLMLoss

    if lm.loss_function is not ForCausalLMLoss:
        raise ValueError(f"{type(lm).__name__} computes its loss with {getattr(lm.loss_function, '__name__', '?')}, "
                         "not transformers' ForCausalLMLoss: fusedloss only replaces the causal-LM loss")
    _head_tensors(head)  # unsupported heads (LoRA variants, ...) are refused now, not mid-training

    state = _Patch(lm, head, backend, eval_logits)
    lm.__dict__[_PATCH_ATTR] = state
    head.__dict__[_PATCH_ATTR] = state
    lm.forward = _ModuleForward(_patched_forward, lm)
    head.forward = _ModuleForward(_tapped_head_forward, head)
    lm.loss_function = _Method(_fused_causal_lm_loss, lm)
    for module in (lm, head):
        module.register_forward_pre_hook(_enter_hook)
    return model


def unpatch(model):
    """Undo ``patch(model)``: the model's forward, its head's forward and its loss function are the ones it
    had before (instance attributes that were not there are removed, and so are the patch's hooks). Returns
    ``model``; a model that is not patched is returned unchanged."""
    lm = _causal_lm(model)
    state = lm.__dict__.pop(_PATCH_ATTR, None)
    if state is None:
        return model
    state.head.__dict__.pop(_PATCH_ATTR, None)
    _restore(lm, "forward", state.saved["lm.forward"])
    _restore(state.head, "forward", state.saved_head_forward)
    if state.had_loss_function:
        lm.__dict__["_loss_function"] = state.saved["lm._loss_function"]
    else:
        lm.__dict__.pop("_loss_function", None)
    for module in (lm, state.head):
        hooks = module._forward_pre_hooks
        for key in [key for key, hook in hooks.items() if hook is _enter_hook]:
            del hooks[key]
    return model
