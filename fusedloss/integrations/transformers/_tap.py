"""Hugging Face ``transformers`` causal LMs as fusedloss inputs (the package docstring says how)."""

from __future__ import annotations

import math
import threading
import weakref
from typing import NamedTuple, Optional, Union

import torch

import fusedloss
from fusedloss.losses.implicit_logits import remember_head_options


class LMHead(NamedTuple):
    """The LM head as fusedloss consumes it: ``z = softcap(logit_scale * (h @ weight.T + bias))[..., :vocab_size]``
    for ``h`` the head's input (``last_hidden_state``)."""

    weight: torch.Tensor  # [V, D], the parameter itself (an FSDP2 DTensor shard stays one), differentiable
    bias: Optional[torch.Tensor]  # [V] or None
    logit_scale: float
    softcap: Optional[float]
    vocab_size: Optional[int] = None  # the logits the model keeps (its first rows); None: all V

    @property
    def options(self) -> dict:
        """``bias``, ``logit_scale``, ``softcap`` and ``vocab_size`` as keyword arguments of any fusedloss
        function: ``fusedloss.cross_entropy(hidden, head.weight, labels, **head.options)``."""
        return {"bias": self.bias, "logit_scale": self.logit_scale, "softcap": self.softcap,
                "vocab_size": self.vocab_size}


# The config fields that name a soft-cap or a logit multiplier in transformers' models. They only propose
# candidates: what the model's forward does on the probe rows decides (a field can be declared and not applied,
# MPT's logit_scale, or applied to the head's input, MiniCPM3's logits_scaling, which the head input then holds).
_SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
_MULTIPLIER_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling",
                      "logits_mup_width_multiplier")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _real_field(config, name) -> Optional[float]:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        return None
    return float(value)


def logit_postprocessing(config) -> tuple[float, Optional[float]]:
    """``(logit_scale, softcap)`` a model config declares, in the spellings TRL 1.16 reads (``add_fused_lm_head``):

    - ``final_logit_softcapping``: Gemma 2 / Gemma 3 ``softcap * tanh(logits / softcap)``;
    - ``logit_scale``: Cohere / Cohere 2 multiply the logits by it (``None`` means unscaled);
    - ``output_multiplier`` (Muse Glimmer) and ``lm_head_multiplier`` (Falcon-H1): multipliers;
    - ``logits_scaling``: Granite *divides* by it, HyperCLOVA X multiplies by it.

    Multimodal models keep these on their text config, so it is read through ``get_text_config()``. This is a
    prediction from field names; ``lm_head`` and ``patch`` use it only as the first candidate and check it
    against the model's own forward."""
    config = _text_config(config)
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        if scale is None:
            scale = getattr(config, name, None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scaling = config.logits_scaling
        scale = scaling if getattr(config, "model_type", None) == "hyperclovax" else 1.0 / scaling
    return (1.0 if scale is None else float(scale)), (None if softcap is None else float(softcap))


class _Transform(NamedTuple):
    """``post``: ``softcap(logit_scale * z)[..., :vocab_size]`` of the head's output ``z``."""

    logit_scale: float
    softcap: Optional[float]
    vocab_size: Optional[int]

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.vocab_size is not None:
            z = z[..., :self.vocab_size]
        z = z * self.logit_scale
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)

    def vjp(self, z: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
        """``cotangent`` (over the kept logits) pulled back to the head's output ``z``."""
        kept = z[..., :cotangent.shape[-1]] * self.logit_scale
        d = torch.full_like(kept, self.logit_scale)
        if self.softcap is not None:
            d = d * (1 - torch.tanh(kept / self.softcap) ** 2)
        grad = torch.zeros_like(z)
        grad[..., :cotangent.shape[-1]] = cotangent * d
        return grad


def _candidate_transforms(config, head_vocab: int, kept_vocab: int) -> list:
    """Every ``post`` the config's fields allow, the documented reading first."""
    text = _text_config(config)
    try:
        predicted = [logit_postprocessing(config)]
    except (TypeError, ValueError):  # a non-numeric field (MPT's "inv_sqrt_d_model"): no prediction
        predicted = []
    scales = [1.0]
    for name in _MULTIPLIER_FIELDS:
        value = _real_field(text, name)
        if value is not None:
            scales += [value, 1.0 / value]
    softcaps = [None] + [v for v in (_real_field(text, name) for name in _SOFTCAP_FIELDS) if v is not None and v > 0]
    vocab = None if kept_vocab == head_vocab else kept_vocab
    pairs = predicted + [(s, c) for c in softcaps for s in scales]
    seen, out = set(), []
    for scale, softcap in pairs:
        if (scale, softcap) not in seen:
            seen.add((scale, softcap))
            out.append(_Transform(scale, softcap, vocab))
    return out


def _is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _is_peft_layer(head) -> bool:
    return hasattr(head, "get_base_layer") and hasattr(head, "active_adapters")


def _causal_lm(model):
    """The ``*ForCausalLM`` module under a PEFT wrapper (adapters stay injected in its layers)."""
    if _is_peft_model(model):
        config = model.peft_config.get(getattr(model, "active_adapter", "default"))
        if config is not None and getattr(config, "is_prompt_learning", False):
            raise NotImplementedError(
                "prompt-learning PEFT models (prefix/prompt tuning) add virtual tokens inside the PEFT forward; "
                "fusedloss.integrations.transformers only supports adapter methods such as LoRA"
            )
        model = model.get_base_model()
    return model


def _peft_class(module: str, name: str):
    """A PEFT class, or None where PEFT is not imported (no model can hold one then) or does not have it."""
    import importlib
    import sys

    if "peft" not in sys.modules:
        return None
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _is_peft_instance(head, module: str, name: str) -> bool:
    cls = _peft_class(module, name)
    return cls is not None and isinstance(head, cls)


def _is_trainable_tokens(layer) -> bool:
    return _is_peft_instance(layer, "peft.tuners.trainable_tokens.layer", "TrainableTokensLayer")


def _head_layer(head):
    """The layer that computes a head's output. PEFT's recipes for training added tokens wrap the head: a
    ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``) runs its active adapter's trained copy of the head
    (the original when adapters are off), a ``TrainableTokensWrapper`` (``trainable_token_indices`` on a tied
    model) runs its ``TrainableTokensLayer``; both as their ``forward`` decides. Any other head is its own layer."""
    if _is_peft_instance(head, "peft.utils.other", "ModulesToSaveWrapper"):
        active = head.active_adapters
        if head.disable_adapters or not active or any(a not in head._adapters for a in active):
            return head.original_module
        return head.modules_to_save[active[0]]
    if _is_peft_instance(head, "peft.utils.other", "TrainableTokensWrapper"):
        return head.token_adapter
    return head


def _peft_head(head) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Weight and bias of a PEFT-wrapped head, with unmerged LoRA deltas folded in (differentiably)."""
    base = head.get_base_layer()
    weight, bias = base.weight, getattr(base, "bias", None)
    if getattr(head, "disable_adapters", False) or getattr(head, "merged", False):
        return weight, bias
    for name in head.active_adapters:
        if name not in getattr(head, "lora_A", {}):
            continue
        dropout = head.lora_dropout[name] if hasattr(head, "lora_dropout") else None
        if name in getattr(head, "lora_variant", {}) or getattr(head, "lora_bias", {}).get(name, False):
            raise NotImplementedError(f"LoRA adapter {name!r} on the LM head uses a variant (DoRA, ...) or a "
                                      "LoRA bias; fusedloss only folds plain LoRA deltas into the head weight")
        if head.training and dropout is not None and not isinstance(dropout, torch.nn.Identity):
            raise NotImplementedError(f"LoRA adapter {name!r} on the LM head has lora_dropout > 0; the dropout "
                                      "acts on the head input and cannot be folded into the weight")
        weight = weight + head.get_delta_weight(name).to(weight.dtype)
    return weight, bias


def _trainable_tokens_head(layer) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Weight and bias of PEFT's ``TrainableTokensLayer`` on a linear head, as its forward computes them: the
    base weight with the trained token rows swapped in (differentiably in both) and no bias, or the base layer
    itself when the adapters are off or merged."""
    base = layer.get_base_layer()
    active = layer.active_adapters
    if layer.disable_adapters or not active or layer.merged:
        return base.weight, getattr(base, "bias", None)
    return layer.get_merged_weights(active), None


def _weight_shape(weight: torch.Tensor) -> torch.Size:
    """The shape of the whole parameter: a DeepSpeed ZeRO-3 parameter holds an empty partition outside its
    module's forward."""
    from ...distributed import zero3

    return zero3.full_shape(weight) if zero3.is_partitioned(weight) else weight.shape


def _output_head(lm):
    """``lm.get_output_embeddings()``, refused unless it is one linear layer fusedloss can stand in for: a
    module whose ``weight`` is its ``[V, D]`` matrix, with ``nn.Linear``'s forward and no parameter beyond
    ``weight`` and ``bias`` (a learned scale inside the head would otherwise get no gradient). A LoRA layer on
    it, or PEFT's wrappers for training added tokens (``_head_layer``), are read through."""
    if not hasattr(lm, "get_output_embeddings"):
        raise ValueError(f"{type(lm).__name__} is not a transformers causal LM with an LM head "
                         "(get_output_embeddings() is needed)")
    head = lm.get_output_embeddings()
    name = type(lm).__name__
    if head is None:
        raise ValueError(f"{name} has no LM head (get_output_embeddings() returned None)")
    layer = _head_layer(head)
    base = layer.get_base_layer() if _is_peft_layer(layer) else layer
    weight = getattr(base, "weight", None)
    if not isinstance(base, torch.nn.Module) or not isinstance(weight, torch.Tensor) or len(_weight_shape(weight)) != 2:
        raise ValueError(f"fusedloss: {name}'s LM head is a {type(base).__name__}, not one module with a "
                         "[vocab, hidden] weight (e.g. one head per codebook): fusedloss.integrations.transformers "
                         "does not support this architecture")
    if type(base).forward is not torch.nn.Linear.forward:
        raise ValueError(f"fusedloss: {name}'s LM head class {type(base).__name__} has a forward of its own, not "
                         "nn.Linear's: fusedloss computes h @ weight.T + bias and would skip what it adds; "
                         "fusedloss.integrations.transformers does not support this architecture")
    extra = [n for n, _ in base.named_parameters() if n not in ("weight", "bias")]
    if extra:
        raise ValueError(f"fusedloss: {name}'s LM head has parameters beyond weight and bias ({', '.join(extra)}): "
                         "they would get no gradient from fusedloss; fusedloss.integrations.transformers does not "
                         "support this architecture")
    return head


def _head_tensors(head) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The weight and bias the head's forward applies (adapters folded in), differentiable in its parameters."""
    layer = _head_layer(head)
    if _is_trainable_tokens(layer):
        return _trainable_tokens_head(layer)
    if _is_peft_layer(layer):
        return _peft_head(layer)
    return layer.weight, getattr(layer, "bias", None)


# The post-processing each head was last seen to apply (keyed by the head module: a copy.deepcopy of a model
# has new head modules and is observed afresh).
_OBSERVED: "weakref.WeakKeyDictionary[torch.nn.Module, _Transform]" = weakref.WeakKeyDictionary()


def lm_head(model) -> LMHead:
    """The head of a causal LM (or a PEFT model wrapping one) and the logit processing its forward applies.

    Pass its fields to any fusedloss function, with the rows ``last_hidden_state`` returns, so that soft-capped
    (Gemma 2/3, RecurrentGemma, xLSTM), scaled (Cohere, Granite, ...) and vocabulary-cut (Inkling) heads give
    the model's own logits::

        head = lm_head(model)
        loss = fusedloss.cross_entropy(hidden, head.weight, labels, **head.options)

    The processing is the one observed on the model's forward: the last ``last_hidden_state`` /
    ``causal_lm_logprobs`` / ``completion_logprobs`` / patched labelled call on this model, or, before any, a
    one-sequence probe forward run here (under ``torch.no_grad``, the random state restored). A model whose
    processing fusedloss cannot reproduce is refused with the reason.

    ``weight`` and ``bias`` are the head's parameters themselves, never gathered copies: under FSDP2, a head
    that is its own FSDP unit is read here as its sharded DTensor, and fusedloss gathers it and averages its
    gradient across ranks itself (docs/design.md, "Distributed"). Gathering it here with ``full_tensor()``
    would give each rank's shard only its own tokens' gradient, not the average FSDP takes."""
    lm = _causal_lm(model)
    head = _output_head(lm)
    transform = _OBSERVED.get(head)
    if transform is None:
        _head_tensors(head)  # a head whose weight fusedloss cannot read (DoRA, ...) is refused with that reason
        transform = _probe_forward(lm)
    return _as_lm_head(head, transform)


def _as_lm_head(head, transform: _Transform) -> LMHead:
    weight, bias = _head_tensors(head)
    remember_head_options(weight, bias=bias, logit_scale=transform.logit_scale, softcap=transform.softcap,
                          vocab_size=transform.vocab_size)  # a call passing the weight bare is warned about
    return LMHead(weight, bias, transform.logit_scale, transform.softcap, transform.vocab_size)


def _probe_forward(lm) -> _Transform:
    """Run the model once on a two-token sequence to observe its logit processing (``lm_head`` before any
    other call)."""
    device = next((p.device for p in lm.parameters()), torch.device("cpu"))
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            _, transform = _observed_forward(lm, dict(input_ids=ids))
    except _Refusal:
        raise
    except Exception as error:
        raise RuntimeError(f"fusedloss: could not run {type(lm).__name__} on a probe sequence to observe its logit "
                           "processing; call last_hidden_state(model, input_ids, ...) first (lm_head then "
                           "reads what that call observed)") from error
    return transform


# ------------------------------------------------------------------------------------------------ the tap
#
# While armed, the head's forward records its input (the rows fusedloss scores, already sliced by
# ``logits_to_keep``) and returns its own output on ``_PROBE_ROWS`` of them, ``[1, k, V]``: no ``[tokens, vocab]``
# product runs. The model then does with those rows what it does with logits (scale, soft-cap, cut the
# vocabulary, cast), and hands them to ``self.loss_function`` (the patch) or returns them (the helpers), where
# ``_observe`` compares them with fusedloss's formula on the same rows.
#
# What one forward records is a ``_Call`` of the thread that runs it, never state of the model: one patched model
# serves several threads at once (an evaluation server; ``nn.DataParallel``, which runs each replica in a thread
# of its own). The forwards the tap installs are ``_ModuleForward`` objects, not bound methods: they pickle and
# deep-copy with their module, and run on the module actually entered (a DataParallel replica shares its
# original's instance attributes, ``_enter_hook`` names it).

_PATCH_ATTR = "_fusedloss_patch"
_PROBE_ROWS = 4


class _Refusal(RuntimeError):
    """A model the integration cannot give exact numbers for, with the reason."""


class _Observation(NamedTuple):
    hidden: torch.Tensor  # [k, D] the probe rows of the head's input (a leaf when autograd records)
    z: torch.Tensor  # [k, V] the head's own output on them


class _Call:
    """One tapped forward, on the thread that runs it: the modules it runs (a DataParallel replica's, not the
    original's), what the head recorded, and the counts that say how the model used them."""

    def __init__(self, tap: "_Tap", lm, head, logits_to_keep, outer: Optional["_Call"]):
        self.tap, self.lm, self.head, self.logits_to_keep, self.outer = tap, lm, head, logits_to_keep, outer
        self.hidden: Optional[torch.Tensor] = None
        self.observation: Optional[_Observation] = None
        self.head_calls = self.loss_calls = 0
        self.in_loss = False


class _Tap:
    """The head tap of one model: what every call shares (the head's own forward, the post-processing observed,
    the checks done) and, per thread, the call in progress (``call``)."""

    def __init__(self, lm, head):
        self.lm, self.head = lm, head
        self.saved_head_forward = head.__dict__.get("forward")
        self.transform: Optional[_Transform] = None  # the last observed post-processing
        self.head_checked = self.grad_checked = False
        self.users: Optional[int] = None  # a helper's temporary tap: the calls in flight (None: the patch's)
        self._threads = threading.local()

    def __getstate__(self):  # pickle, copy.deepcopy: a call in flight is no part of a copy
        state = dict(self.__dict__)
        del state["_threads"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._threads = threading.local()

    @property
    def call(self) -> Optional[_Call]:
        """The tapped forward this thread is running, if any."""
        return getattr(self._threads, "call", None)

    def arm(self, lm, head, logits_to_keep=0) -> _Call:
        call = _Call(self, lm, head, logits_to_keep, self.call)
        self._threads.call = call
        return call

    def disarm(self, call: _Call) -> None:
        self._threads.call = call.outer

    def head_forward(self, head):
        """The forward the tap wraps, run on ``head`` (the original head or a replica of it)."""
        saved = self.saved_head_forward
        return saved if saved is not None else type(head).forward.__get__(head)


class _Method:
    """``function(owner, *args, **kwargs)``, set on ``owner`` as an instance attribute. A bound method of a
    module-level function pickles as ``getattr(owner, function name)``, which fails at load; this object pickles
    (and deep-copies) with its owner."""

    def __init__(self, function, owner):
        self.function, self.owner = function, owner

    def __call__(self, *args, **kwargs):
        return self.function(self.owner, *args, **kwargs)


class _ModuleForward(_Method):
    """A tapped module's ``forward``: runs ``function`` on the module entered, its owner or a DataParallel replica
    of it (``_entered``), and shows the signature of the module class's forward (the Trainer keeps the dataset
    columns the forward names, and passes ``num_items_in_batch`` when it takes ``**kwargs``)."""

    def __call__(self, *args, **kwargs):
        return self.function(_entered(self), *args, **kwargs)

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(type(self.owner).forward.__get__(self.owner))

    @property
    def __wrapped__(self):  # what accelerate's unwrap_model walks back to
        return type(self.owner).forward

    @property
    def __name__(self):
        return "forward"


_ENTERING = threading.local()


def _enter_hook(module, args) -> None:
    """Forward pre-hook of the patched modules: names the module this thread enters. ``nn.DataParallel``'s
    replicas are shallow copies that share the original's ``forward`` attribute, whose owner is the original."""
    _ENTERING.module = module


def _entered(forward: _ModuleForward):
    """The module whose call is running ``forward``: the one ``_enter_hook`` named, when it holds this very
    forward (itself or a replica), else the owner (a direct ``module.forward(...)`` call)."""
    module = getattr(_ENTERING, "module", None)
    _ENTERING.module = None
    if module is not None and module.__dict__.get("forward") is forward:
        return module
    return forward.owner


def _raised_in(module, error: BaseException) -> bool:
    """Whether ``error`` was raised inside a call of ``module`` (its forward or its hooks): the head's own code
    or a user's hook on it, not the model's code around it."""
    impl = torch.nn.Module._call_impl.__code__
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is impl and frame.f_locals.get("self") is module:
            return True
        tb = tb.tb_next
    return False


def _tapped_head_forward(head, hidden, *args, **kwargs):
    """``head.forward`` of a tapped LM head (``head``: the one entered)."""
    state = head.__dict__[_PATCH_ATTR]
    call = state.call
    if call is None:
        return state.head_forward(head)(hidden, *args, **kwargs)
    call.head_calls += 1
    if call.hidden is not None:
        raise _Refusal(f"fusedloss: {type(call.lm).__name__} runs its LM head twice in one forward; "
                       "fusedloss.integrations.transformers does not support this architecture")
    call.hidden = hidden
    rows = hidden.reshape(-1, hidden.shape[-1])
    k = min(_PROBE_ROWS, rows.shape[0])
    index = torch.linspace(0, rows.shape[0] - 1, k).round().long().to(rows.device)
    probe = rows.detach()[index]
    if torch.is_grad_enabled():
        probe.requires_grad_()
    with torch.no_grad():  # read here, where the head's own forward runs: gathered (ZeRO-3, FSDP2) if sharded
        weight, bias = _head_tensors(head)
    if _is_dtensor(weight):  # a head sharded outside FSDP's forward: its own forward cannot run on plain rows
        z = torch.nn.functional.linear(probe, weight.full_tensor(), None if bias is None else bias.full_tensor())
    else:
        z = state.head_forward(head)(probe, *args, **kwargs)
    call.observation = _Observation(probe, z)
    if not state.head_checked:
        _check_head_product(call, weight, bias)
        state.head_checked = True
    return z.reshape((1,) * max(hidden.dim() - 2, 0) + tuple(z.shape))


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


_TAPPING = threading.Lock()  # installs and removes helpers' temporary taps


class _Tapped:
    """``with _Tapped(lm, head) as call``: one forward of the model with its head tapped, on this thread (the
    patch's tap when the model is patched, else a temporary one, installed while any thread's helper runs)."""

    def __init__(self, lm, head):
        self.lm, self.head = lm, head

    def __enter__(self) -> _Call:
        with _TAPPING:
            state = self.head.__dict__.get(_PATCH_ATTR)
            if state is not None and state.call is not None:
                raise RuntimeError("fusedloss: the LM head is already tapped (a helper called from inside another "
                                   "helper's forward?)")
            if state is None:
                state = _Tap(self.lm, self.head)
                state.users = 0
                self.head.__dict__[_PATCH_ATTR] = state
                self.head.forward = _ModuleForward(_tapped_head_forward, self.head)
            if state.users is not None:
                state.users += 1
        self.state = state
        self.call = state.arm(self.lm, self.head)
        return self.call

    def __exit__(self, *exc):
        self.state.disarm(self.call)
        with _TAPPING:
            if self.state.users is not None:
                self.state.users -= 1
                if self.state.users == 0:
                    self.head.__dict__.pop(_PATCH_ATTR, None)
                    _restore(self.head, "forward", self.state.saved_head_forward)
        return False


def _restore(obj, attr, saved):
    if saved is None:
        obj.__dict__.pop(attr, None)
    else:
        obj.__dict__[attr] = saved


def _close(expected: torch.Tensor, got: torch.Tensor, eps: float) -> bool:
    """Equal up to a few roundings of ``eps`` (NaN where both are NaN, the same infinity)."""
    same = (expected == got) | (expected.isnan() & got.isnan())
    finite = expected.isfinite() & got.isfinite()
    scale = expected[finite].abs().max() if finite.any() else expected.new_zeros(())
    tolerance = 4 * eps * (expected.abs() + got.abs()) + eps * scale
    return bool((same | (finite & ((expected - got).abs() <= tolerance))).all())


def _refuse(lm, why: str):
    raise _Refusal(f"fusedloss: {type(lm).__name__} {why}; fusedloss.integrations.transformers does not support "
                   "this architecture (it gives no number it cannot reproduce exactly)")


def _observe(call: _Call, logits, *, gradient: bool = True) -> _Transform:
    """The post-processing the model applied to the head's output on the probe rows (``logits``: what the
    model made of them), checked against fusedloss's formula; refused with the reason when none fits.
    ``gradient=False``: values only (the logits left the model's forward, where wrappers may have hooked a
    backward on them)."""
    state, lm, obs = call.tap, call.lm, call.observation
    if obs is None:
        _refuse(lm, "did not call its LM head before computing its loss")
    z = obs.z
    k, vocab = z.shape
    if k == 0:  # no rows: the loss does not depend on the processing
        return state.transform or _candidate_transforms(lm.config, vocab, vocab)[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() == 0 or logits.shape[-1] > vocab \
            or logits.numel() != k * logits.shape[-1]:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        _refuse(lm, f"does not turn its head's output rows into logits row by row (the head returned {k} rows "
                    f"of {vocab}; the logits it computed from them have shape {shape})")
    y = logits.reshape(k, -1)
    eps = max(torch.finfo(z.dtype).eps, torch.finfo(y.dtype).eps) if y.is_floating_point() else 1.0
    zd, yd = z.detach().double(), y.detach().double()
    candidates = _candidate_transforms(lm.config, vocab, y.shape[-1])
    if state.transform is not None and state.transform.vocab_size == candidates[0].vocab_size:
        candidates.insert(0, state.transform)  # the processing seen last time, checked first
    chosen = next((t for t in candidates if _close(t(zd), yd, eps)), None)
    if chosen is None:
        kept = zd[:, :y.shape[-1]]
        finite = kept.isfinite() & yd.isfinite()
        ratio = (yd[finite] * kept[finite]).sum() / (kept[finite] ** 2).sum().clamp(min=1e-300)
        cut = "" if y.shape[-1] == vocab else f" (its first {y.shape[-1]} of {vocab} entries)"
        _refuse(lm, f"post-processes its head's output in a way fusedloss's scale / soft-cap / vocabulary cut does "
                    f"not reproduce with any value its config declares: on {k} probe rows its logits are about "
                    f"{ratio.item():.4g} x the head's output{cut}, but not exactly any candidate "
                    f"({', '.join(_describe(t) for t in candidates)})")
    if gradient and torch.is_grad_enabled() and y.requires_grad and z.requires_grad and not state.grad_checked:
        _check_gradient(call, chosen, y, eps)
        state.grad_checked = True
    state.transform = chosen
    _OBSERVED[state.head] = chosen
    return chosen


def _describe(t: _Transform) -> str:
    return f"logit_scale={t.logit_scale:.6g}" + ("" if t.softcap is None else f" softcap={t.softcap:.6g}")


def _check_head_product(call: _Call, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """Once per tap, inside the head's forward (where a ZeRO-3 or FSDP2 head is gathered): the head's own output
    on the probe rows is ``h @ weight.T + bias`` of the weight and bias fusedloss receives (a LoRA on the head,
    PEFT's trained token rows folded in)."""
    obs = call.observation
    h, z = obs.hidden.detach().double(), obs.z.detach().double()
    with torch.no_grad():
        if _is_dtensor(weight):
            weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()
        if tuple(weight.shape) != (z.shape[-1], h.shape[-1]):
            _refuse(call.lm, f"has an LM head whose output ({z.shape[-1]} logits of {h.shape[-1]} inputs) does not "
                             f"match the weight it exposes ({tuple(weight.shape)})")
        eps = torch.finfo(obs.z.dtype).eps
        for start in range(0, weight.shape[0], 8192):  # the head in float64 a slice at a time
            w = weight[start:start + 8192].double()
            b = None if bias is None else bias[start:start + 8192].double()
            product = torch.nn.functional.linear(h, w, b)
            bound = torch.nn.functional.linear(h.abs(), w.abs(), None if b is None else b.abs())
            got = z[:, start:start + 8192]
            ok = (got - product).abs() <= 16 * eps * bound + 1e-300
            if not bool((ok | (got.isnan() & product.isnan())).all()):
                _refuse(call.lm, "has an LM head whose output is not h @ weight.T + bias of the weight and bias "
                                 "it exposes")


def _check_gradient(call: _Call, t: _Transform, y: torch.Tensor, eps: float) -> None:
    """Once, with autograd recording: the post-processing reaches no parameter beyond the head's (fusedloss
    would give it no gradient), and its gradient with respect to the head's output is the formula's (a
    transform can be the identity at one point and differ in its slope)."""
    obs = call.observation
    reached, stack, seen = [], [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node is obs.z.grad_fn or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and variable is not obs.hidden:
            reached.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    if reached:
        names = {id(p): n for n, p in call.lm.named_parameters()}
        what = ", ".join(names.get(id(p), f"a tensor of shape {tuple(p.shape)}") for p in reached)
        _refuse(call.lm, f"applies learned parameters to its logits ({what}): fusedloss would give them no "
                         "gradient")
    cotangent = torch.linspace(-1.0, 1.0, y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape)
    (got,) = torch.autograd.grad(y, obs.z, cotangent.reshape(y.shape), retain_graph=True)
    expected = t.vjp(obs.z.detach().double(), cotangent.double().reshape(obs.z.shape[0], -1))
    if not _close(expected, got.detach().double().reshape(expected.shape), eps):
        _refuse(call.lm, "post-processes its head's output with a gradient that is not the one of "
                         f"{_describe(t)} (the values agree on the probe rows, the slopes do not)")


def _is_fsdp(module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def _forward_accepts(lm, name: str) -> bool:
    import inspect

    parameters = inspect.signature(type(lm).forward).parameters
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _observed_forward(lm, kwargs: dict) -> tuple[torch.Tensor, _Transform]:
    """The model's own forward on ``kwargs`` (no labels) with its head tapped: the head's input ``[..., D]``
    and the observed post-processing."""
    head = _output_head(lm)
    if _forward_accepts(lm, "use_cache"):
        kwargs.setdefault("use_cache", False)
    with _Tapped(lm, head) as call:
        try:
            out = lm(**kwargs)
        except _Refusal:
            raise
        except Exception as error:
            if call.head_calls and not _raised_in(head, error):  # the head's own errors and its hooks' are not ours
                raise _Refusal(f"fusedloss: {type(lm).__name__} could not post-process its head's output on the "
                               "probe rows (it raised); fusedloss.integrations.transformers does not support this "
                               "architecture") from error
            raise
        hidden = call.hidden
        if hidden is None:
            _refuse(lm, "did not call its LM head in its forward")
        logits = getattr(out, "logits", None) if not isinstance(out, tuple) else out[0]
        # FSDP2 hooks its pre-backward on the root's outputs: a backward through them here, mid-step, would
        # run it. Such a model's gradient check is the patch's (inside the forward, before the hooks).
        transform = _observe(call, logits, gradient=not _is_fsdp(lm))
    return hidden, transform


def _hidden_and_head(model, input_ids, attention_mask, model_kwargs) -> tuple[torch.Tensor, LMHead]:
    lm = _causal_lm(model)
    kwargs = dict(model_kwargs, input_ids=input_ids)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    hidden, transform = _observed_forward(lm, kwargs)
    if tuple(hidden.shape[:-1]) != tuple(input_ids.shape):
        _refuse(lm, f"feeds its LM head hidden states of shape {tuple(hidden.shape)}, not one row per input "
                    f"position ({tuple(input_ids.shape)})")
    return hidden, _as_lm_head(lm.get_output_embeddings(), transform)


def last_hidden_state(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                      **model_kwargs) -> torch.Tensor:
    """``[B, T, D]``: the input of the LM head, from the model's own forward (whatever the model does between its
    backbone and the head's weight, a BERT-style transform, a scaled input, is included). No logits are formed:
    the head runs on a few probe rows only, which check ``lm_head(model)``'s logit processing against the
    model's. Extra keyword arguments go to the model's forward (``position_ids``, ``pixel_values``, ...)."""
    return _hidden_and_head(model, input_ids, attention_mask, model_kwargs)[0]


def causal_lm_logprobs(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                       labels: Optional[torch.Tensor] = None, temperature: float = 1.0,
                       return_entropy: bool = False, backend: str = "auto", **model_kwargs
                       ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Per-token log-probabilities ``[B, T-1]`` of the next tokens ``input_ids[:, 1:]`` under ``model``,
    computed from the head's input and the head with ``fusedloss.token_logprobs``.

    Position ``t`` scores ``input_ids[:, t + 1]`` given the prefix, with the model's own logit processing
    (observed on its forward: scales, soft-caps, a vocabulary cut) and then ``temperature``. Positions whose
    target is padding (``attention_mask[:, t + 1] == 0``) or, when ``labels`` (``[B, T]``, unshifted, as for the
    model's own loss) is given, whose label is -100, are 0 in the outputs and carry no gradient.
    With ``return_entropy`` also returns the entropy of each next-token distribution (same shape, 0 at
    those positions). Differentiable with respect to the model's parameters. Extra keyword arguments go
    to the model's forward (``position_ids``, ``pixel_values``, ...).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids)}")
    hidden, head = _hidden_and_head(model, input_ids, attention_mask, model_kwargs)
    targets = (input_ids if labels is None else labels)[:, 1:]
    if attention_mask is not None:
        targets = targets.masked_fill(attention_mask[:, 1:] == 0, -100)
    return _token_logprobs(hidden[:, :-1], head, targets, temperature, return_entropy, backend)


def _token_logprobs(hidden, head: LMHead, targets, temperature, return_entropy, backend):
    # With a `device_map` split, the last layers can run on another device than the head.
    device = head.weight.device
    return fusedloss.token_logprobs(hidden.to(device), head.weight, targets.to(device), temperature=temperature,
                                    ignore_index=-100, return_entropy=return_entropy, backend=backend,
                                    **head.options)


def _require_left_padding_masked(model, prompt_ids: torch.Tensor) -> None:
    """Without ``prompt_mask``, a prompt that starts with the model's pad token is left padding the model would
    attend to: refuse it rather than score the completion under a different context."""
    config = _text_config(_causal_lm(model).config)
    pad, bos = getattr(config, "pad_token_id", None), getattr(config, "bos_token_id", None)
    if not isinstance(pad, int) or pad == bos or prompt_ids.shape[1] < 2:
        return
    padded = (prompt_ids[:, 0] == pad).nonzero().flatten()
    if padded.numel():
        raise ValueError(f"prompt_ids row {padded[0].item()} starts with the pad token ({pad}): left-padded prompts "
                         "need prompt_mask (1 = real token), else the model attends to the padding and the "
                         "log-probs are those of another context")


def completion_logprobs(model, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, *,
                        prompt_mask: Optional[torch.Tensor] = None, completion_mask: Optional[torch.Tensor] = None,
                        temperature: float = 1.0, return_entropy: bool = False, backend: str = "auto",
                        **model_kwargs) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Log-probabilities ``[B, C]`` of ``completion_ids`` ``[B, C]`` given ``prompt_ids`` ``[B, P]``, aligned
    for you: the head input at position ``P + t - 1`` scores completion token ``t``, so the first
    completion token is scored by the prompt's last position and the completion's last position is
    not used (it predicts a token that was not sampled).

    ``prompt_mask`` / ``completion_mask`` (``[B, P]`` / ``[B, C]``, 1 = real token; e.g. left-padded
    prompts and right-padded completions, as TRL pads them) become the attention mask; completion
    positions with mask 0 give 0 and no gradient. Left-padded prompts need ``prompt_mask``: a prompt that
    starts with the model's pad token without it is refused. With ``return_entropy`` also returns the
    entropy of each scored next-token distribution. This is what RL trainers call "per-token log-probs of the
    completion"; ``fusedloss.grpo_loss(hidden, ...)`` wants the same rows, which are
    ``last_hidden_state(model, cat(prompt, completion))[:, P - 1:-1]`` with ``**lm_head(model).options``."""
    for name, t in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a [batch, length] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if prompt_ids.shape[0] != completion_ids.shape[0]:
        raise ValueError(f"prompt_ids has {prompt_ids.shape[0]} rows but completion_ids has "
                         f"{completion_ids.shape[0]}: one prompt per completion")
    if prompt_ids.shape[1] < 1:
        raise ValueError("prompt_ids must hold at least one token: the first completion token is scored by "
                         "the last prompt position")
    if prompt_mask is None:
        _require_left_padding_masked(model, prompt_ids)
    p = prompt_ids.shape[1]
    input_ids = torch.cat((prompt_ids, completion_ids), dim=1)
    attention_mask = None
    if prompt_mask is not None or completion_mask is not None:
        pm = torch.ones_like(prompt_ids) if prompt_mask is None else prompt_mask.to(prompt_ids.dtype)
        cm = torch.ones_like(completion_ids) if completion_mask is None else completion_mask.to(prompt_ids.dtype)
        attention_mask = torch.cat((pm, cm), dim=1)
    hidden, head = _hidden_and_head(model, input_ids, attention_mask, model_kwargs)
    targets = completion_ids
    if completion_mask is not None:
        targets = targets.masked_fill(completion_mask == 0, -100)
    return _token_logprobs(hidden[:, p - 1:-1], head, targets, temperature, return_entropy, backend)


# ------------------------------------------------------------------------------------------------ patch
#
# How the patch works (docs/design.md, "Configuration"): the model keeps its own forward. Three instance
# attributes and two forward pre-hooks are set, and ``unpatch`` removes them:
#
#   * ``lm.forward``: with ``labels`` it arms the tap, calls the model's own forward, and returns its output
#     with ``logits=None``; without labels it is the model's own forward, untouched.
#   * ``head.forward``: the tap (above); unarmed, the head's own forward (generation, evaluation).
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

    def __init__(self, lm, head, backend: str):
        import inspect

        super().__init__(lm, head)
        self.backend = backend
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
    except _Refusal:
        raise
    except Exception as error:
        # Between the head and the loss, a model that computes its loss itself fails on the probe rows. An error
        # of the head's own (its forward, a user's hook on it), or of a model that calls self.loss_function,
        # is the caller's to see as it is.
        if call.head_calls and not call.in_loss and not state.names_loss_function and not _raised_in(head, error):
            raise _Refusal(f"fusedloss patch: {type(lm).__name__} computes its loss itself, not through "
                           "self.loss_function (its own loss code raised on the head's probe rows); "
                           "integrations.transformers.patch does not support this architecture") from error
        raise
    finally:
        state.disarm(call)
    if call.loss_calls != 1:
        raise _Refusal(f"fusedloss patch: {type(lm).__name__} computes its loss itself, not through "
                       "self.loss_function; integrations.transformers.patch does not support this architecture")
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


def patch(model, *, backend: str = "auto"):
    """Make ``model(..., labels=labels).loss`` come from the head's input, without the logits.

    ``model`` is a transformers causal LM (``*ForCausalLM``, or a PEFT model wrapping one). After
    ``patch(model)``, a forward with ``labels`` returns the model's own causal-LM loss (labels shifted by
    one, ``-100`` ignored, the mean over valid tokens; with ``num_items_in_batch``, as the ``Trainer``
    passes it under gradient accumulation, the sum divided by it; ``shift_labels`` used as given) computed by
    ``fusedloss.cross_entropy`` from the head's input and weight (tied embeddings, a LoRA on the head, the
    model's logit scale, soft-cap and vocabulary cut included), and ``out.logits is None``. With
    ``logits_to_keep``, the loss covers the positions kept. A forward without labels (generation, evaluation
    that needs logits) is the model's own. Works with gradient checkpointing, ``torch.compile``, accelerate
    and the HF ``Trainer``; a ``copy.deepcopy`` of a patched model is patched too. Patch before wrapping the
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
            lm.__dict__[_PATCH_ATTR].backend = backend  # idempotent: a second patch only changes the backend
            return model
        unpatch(model)  # the head was replaced or wrapped since (resize_token_embeddings, a LoRA): tap the new one
    from transformers.loss.loss_utils import ForCausalLMLoss

    if lm.loss_function is not ForCausalLMLoss:
        raise ValueError(f"{type(lm).__name__} computes its loss with {getattr(lm.loss_function, '__name__', '?')}, "
                         "not transformers' ForCausalLMLoss: fusedloss only replaces the causal-LM loss")
    _head_tensors(head)  # unsupported heads (LoRA variants, ...) are refused now, not mid-training

    state = _Patch(lm, head, backend)
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
