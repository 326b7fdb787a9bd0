"""The arguments every public loss shares, written once: their documentation and, for the trailing options
(how to run, where the head's rows live), their names, defaults and types.

A loss's docstring lists its own arguments and ends its ``Args:`` section with a line ``{shared}``;
``shared_arguments(*names)`` replaces that line with the entries below, so that an option means the same
thing, in the same words, everywhere (``help(fusedloss.grpo_loss)`` shows the whole list).

``shared_options(*names)`` also adds the trailing keyword-only options (``RUN``, ``SHARDING``, ``grad_in_forward``) to
a loss that collects them in ``**head``: its signature (``inspect.signature``, ``help``, the generated
``fusedloss.nn`` modules) lists each with its default, a call with an unknown keyword raises ``TypeError`` as
Python would, and the loss passes ``**head`` on to ``implicit_logits`` untouched.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
from typing import Optional

SHARED = {
    "bias": "``[V]`` lm_head bias, or None.",
    "temperature": "divides the logits (after logit_scale and softcap): ``z = softcap(logit_scale * (h @ W.T + "
                   "b)) / temperature``, the order TRL's fused path uses.",
    "logit_scale": "multiplies the raw logits first (Cohere's ``logit_scale``, Granite's ``logits_scaling``).",
    "softcap": "``s * tanh(x / s)`` soft-capping of the scaled logits (Gemma 2/3 ``final_logit_softcapping``); "
               "None: none.",
    "ignore_index": "the target value of tokens that are not scored: they give 0 and no gradient.",
    "backend": '``"auto"`` (the fastest available here: ``cuda``, else ``triton`` on a GPU; ``torch`` elsewhere), '
               '``"torch"``, ``"triton"`` or ``"cuda"``; ``fusedloss.backend_status()`` says which run here.',
    "grad_in_forward": "True: finish each row chunk in the forward (3 GEMM-sized products, gradients held until the "
             "backward); False: the composable 4-product path; None: the backend's plan decides "
             "(``FUSEDLOSS_GRAD_IN_FORWARD`` overrides the default).",
    "workspace_mb": "logits workspace of the GPU backends in MiB; None: sized from the free device memory "
                    "(``FUSEDLOSS_WORKSPACE_MB`` overrides the default).",
    "allow_tf32": "True lets fp32 inputs use TF32 products (faster, ~1e-4 relative error); None/False: fp32 stays "
                  "fp32 whatever PyTorch's global TF32 flags say (``FUSEDLOSS_ALLOW_TF32`` overrides the default).",
    "process_group": "a ``torch.distributed`` group the vocabulary is sharded over: ``weight`` (and ``bias``, "
                     "and a teacher's head) hold this rank's contiguous rows of the full head, in rank order; "
                     "``hidden`` is the same on every rank, targets are global ids, every output is the same on "
                     "every rank and ``hidden.grad`` is complete on every rank. A DTensor weight sharded "
                     "``Shard(0)`` is vocabulary-parallel without it. None: one device.",
    "reduce_hidden_grad": "False leaves this rank's partial ``hidden.grad`` (for callers that reduce it "
                          "themselves, e.g. sequence parallelism).",
    "vocab_start": "global id of this rank's first row; None: derived from the shard sizes in rank order.",
    "vocab_size": "the logical vocabulary: global rows at or past it are padding (outside every softmax, "
                  "entropy, KL, mean logit and argmax, zero gradient); a target at or past it is an error. "
                  "Works on one device too.",
    "fsdp_vocab_parallel": "treat an FSDP2-sharded head as vocabulary-parallel over the data-parallel group "
                           "(hidden states gathered, the head never), for when tokens per group are fewer than V; "
                           "False: the head is gathered once per forward and once per backward.",
}

HEAD = ("bias", "temperature", "logit_scale", "softcap")
RUN = ("workspace_mb", "allow_tf32")
SHARDING = ("process_group", "reduce_hidden_grad", "vocab_start", "vocab_size", "fsdp_vocab_parallel")

# The trailing keyword-only options: (default, annotation).
DEFAULTS = {
    "grad_in_forward": (None, Optional[bool]),
    "workspace_mb": (None, Optional[float]),
    "allow_tf32": (None, Optional[bool]),
    "process_group": (None, None),
    "reduce_hidden_grad": (True, bool),
    "vocab_start": (None, Optional[int]),
    "vocab_size": (None, Optional[int]),
    "fsdp_vocab_parallel": (False, bool),
}


def shared_options(*names: str):
    """Add the keyword-only options ``names`` (keys of ``DEFAULTS``) to a function that takes ``**head``, and
    document them with the function's other shared arguments (``{shared}``: "backend" and ``names``)."""

    def attach(fn):
        signature = inspect.signature(fn)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[name][0],
                                   annotation=DEFAULTS[name][1] or inspect.Parameter.empty) for name in names]
        full = signature.replace(parameters=own + extra)
        accepted = set(full.parameters)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            unknown = sorted(set(kwargs) - accepted)
            if unknown:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {unknown[0]!r}")
            head = {name: kwargs.pop(name, DEFAULTS[name][0]) for name in names}
            return fn(*args, **kwargs, **head)

        call.__signature__ = full
        return call

    return attach


def shared_arguments(*names: str):
    """Replace the ``{shared}`` line of the decorated function's docstring by the entries of ``names``."""

    def attach(fn):
        entries = []
        for name in names:
            body = textwrap.wrap(SHARED[name], width=104, initial_indent=f"        {name}: ",
                                 subsequent_indent="            ")
            entries.append("\n".join(body))
        doc = fn.__doc__
        if "    {shared}" not in doc:
            raise RuntimeError(f"{fn.__name__}'s docstring has no {{shared}} line")
        fn.__doc__ = doc.replace("        {shared}", "\n".join(entries))
        return fn

    return attach
