"""The head tap: one forward of the model with its head recording its input and returning its own output on a
few probe rows only, and the check of what the model made of those rows against fusedloss's formula
(``_observe``); a model none of the formula's candidates reproduces is refused (``UnsupportedModelError``)."""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple, Optional

import torch

from ...errors import UnsupportedModelError
from ._head import _candidate_transforms, _head_tensors, _output_head, _Transform

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

# The post-processing each head was last seen to apply (keyed by the head module: a copy.deepcopy of a model
# has new head modules and is observed afresh).
_OBSERVED: "weakref.WeakKeyDictionary[torch.nn.Module, _Transform]" = weakref.WeakKeyDictionary()


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
        raise UnsupportedModelError(f"fusedloss: {type(call.lm).__name__} runs its LM head twice in one forward; "
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
    raise UnsupportedModelError(f"fusedloss: {type(lm).__name__} {why}; fusedloss.integrations.transformers does "
                                "not support this architecture (it gives no number it cannot reproduce exactly)")


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


def _observed_forward(lm, kwargs: dict, outputs: Optional[list] = None) -> tuple[torch.Tensor, _Transform]:
    """The model's own forward on ``kwargs`` (no labels) with its head tapped: the head's input ``[..., D]``
    and the observed post-processing. ``outputs``: a list the model's own output is appended to (what it
    returns besides its logits: an MoE router's ``aux_loss``)."""
    head = _output_head(lm)
    if _forward_accepts(lm, "use_cache"):
        kwargs.setdefault("use_cache", False)
    with _Tapped(lm, head) as call:
        try:
            out = lm(**kwargs)
        except UnsupportedModelError:
            raise
        except Exception as error:
            if call.head_calls and not _raised_in(head, error):  # the head's own errors and its hooks' are not ours
                raise UnsupportedModelError(f"fusedloss: {type(lm).__name__} could not post-process its head's output "
                                            "on the probe rows (it raised); fusedloss.integrations.transformers does "
                                            "not support this architecture") from error
            raise
        hidden = call.hidden
        if hidden is None:
            _refuse(lm, "did not call its LM head in its forward")
        logits = getattr(out, "logits", None) if not isinstance(out, tuple) else out[0]
        # FSDP2 hooks its pre-backward on the root's outputs: a backward through them here, mid-step, would
        # run it. Such a model's gradient check is the patch's (inside the forward, before the hooks).
        transform = _observe(call, logits, gradient=not _is_fsdp(lm))
    if outputs is not None:
        outputs.append(out)
    return hidden, transform
