"""What would fusedloss save? The logits-sized memory and the products of one loss call, for a model and a batch.

``fusedloss.estimate(config, tokens=...)`` (and ``python -m fusedloss estimate``) compares three ways of
computing a loss over ``N`` tokens with hidden size ``D`` and vocabulary ``V`` (``b`` bytes per operand):

* the naive path, materialised logits (a model's ``labels=`` loss, ``log_softmax(hidden @ W.T)``): it holds
  the logits ``N V b`` and the fp32 log-softmax the loss keeps for its backward ``N V 4`` from the forward to the
  backward, which forms d log-softmax in fp32 ``N V 4`` and d logits in the operand dtype ``N V b``. 3 products.
* TRL 1.16's chunked kernel (``trl.kernels.ChunkedLogProbFunction``, behind its trainers' fused LM head): a few
  ``[N]`` statistics held; one ``[min(N, 4096), min(V, 32768)]`` tile in the operand dtype per pass; the backward
  recomputes the logits: 4 products.
* fusedloss: ``[N]`` statistics held (and, on the grad-in-forward path, the gradients themselves); the logits workspace
  of the GPU backend's plan (``fusedloss.backends.cuda.plan.plan``, the function the backend runs by) and its
  products (3 on the grad-in-forward path of a loss known in the
  forward, 4 for log-probs whose loss comes later); on a CPU, the torch backend's ``[1024, 4096]`` fp32 tiles
  (a few live at a time) and its 4 products (without a teacher it takes the recomputing path there).

Products are GEMM-sized (``2 N V D`` flops each, ``fusedloss.core.workload.Workload.product_flops``); the fewest
any exact method needs is ``fusedloss.core.workload.product_bound``: sizes of buffers, not measured peaks. The
weight gradient ``[V, D]`` and the per-token statistics (a few ``[N]`` vectors) are left out: every path has them.

A modelled time of the GPU backend's plan is added where the performance model is importable (``benchmarks.model``,
which ships with the source tree, not with the wheel: run from a checkout, e.g. ``pip install -e .`` or with the
checkout on ``PYTHONPATH``); it is the model's figure, not a measurement (docs/design.md, "Plans and the
performance model"). Without it the column is left out and the table says how to get it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import config as _config
from .backends import torch as _torch_backend
from .backends.cuda import plan as cuda_plan
from .core import workload as _workload

__all__ = ["SizingEstimate", "estimate"]

# TRL 1.16's chunked log-prob kernel: TOKEN_CHUNK_SIZE rows per tile and the vocabulary width its trainers pass
# (trl/kernels/chunked_logprob.py, trl/trainer/utils.py's _CHUNKED_LOGPROB_CHUNK_SIZE).
TRL_TOKEN_CHUNK = 4096
TRL_VOCAB_CHUNK = 32768
# The ops without a teacher head (a distillation loss also materialises the teacher's logits on the naive path).
OPS = tuple(op for op, spec in _workload.OPS.items() if not spec["teacher"])
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
          "float32": "float32", "fp32": "float32", "float": "float32"}


@dataclass(frozen=True)
class PathCost:
    """One way of computing the loss: the ``[N, V]``-sized memory it holds from the forward to the backward, the
    largest ``[N, V]``-sized buffers a pass adds while it runs (transient), and the GEMM-sized products."""

    name: str
    held_bytes: int
    transient_bytes: int
    products: float
    note: str = ""


@dataclass(frozen=True)
class SizingEstimate:
    """The answer of ``estimate``: the problem, one ``PathCost`` per path (naive, TRL's chunked kernel, fusedloss
    on the GPU, fusedloss's torch backend) and the product-count bound. ``str()`` is the printed table."""

    tokens: int
    hidden_size: int
    vocab_size: int
    dtype: str
    op: str
    gpu: str
    paths: tuple
    bound_products: float
    # the performance model's time of the GPU backend's plan and of the bound (ms), None where benchmarks.model is
    # not importable; ``modelled_note`` says which (``_modelled``)
    modelled_ms: Optional[float] = None
    modelled_bound_ms: Optional[float] = None
    modelled_note: str = ""

    @property
    def logits_fp32_bytes(self) -> int:
        return 4 * self.tokens * self.vocab_size

    def path(self, name: str) -> PathCost:
        return next(p for p in self.paths if p.name == name)

    def __str__(self) -> str:
        lines = [f"{self.op}: N={self.tokens} tokens, D={self.hidden_size}, V={self.vocab_size}, {self.dtype}; "
                 f"the fp32 logits alone: {_size(self.logits_fp32_bytes)}",
                 "[N, V]-sized buffers by their sizes, not measured peaks ([V, D] gradients left out)",
                 "",
                 f"{'path':<34} {'held fwd->bwd':>14} {'transient':>14} {'products':>9}"]
        for p in self.paths:
            lines.append(f"{p.name:<34} {_size(p.held_bytes):>14} {_size(p.transient_bytes):>14} "
                         f"{p.products:>9g}" + (f"  {p.note}" if p.note else ""))
        lines.append(f"{'fewest any exact method needs':<34} {'':>14} {'':>14} {self.bound_products:>9g}  "
                     f"(2 N V D = {2.0 * self.tokens * self.vocab_size * self.hidden_size:.3g} flops each)")
        if self.modelled_ms is not None:
            lines.append(f"modelled (not measured) on {self.gpu}: fusedloss, GPU {self.modelled_ms:.3g} ms, the bound "
                         f"{self.modelled_bound_ms:.3g} ms ({self.modelled_note})")
        else:
            lines.append(f"modelled time: {self.modelled_note}")
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.0f} {unit}"
    return f"{n} B"


def _read_config(config) -> tuple[Optional[int], Optional[int]]:
    """(hidden_size, vocab_size) of a Hugging Face config: a path to ``config.json`` or its folder, a dict, or a
    config object (``model.config``); a multimodal config's ``text_config`` when the top level has none."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"config must be a model's config.json or the folder holding it; {path} does not exist")
        config = json.loads(path.read_text())
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    if _width(config) is None and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    return _width(config), config.get("vocab_size")


# The names configs give the hidden size: most ``hidden_size``, GPT-2 ``n_embd``, MPT and XGLM ``d_model`` (a config
# object answers ``hidden_size`` for them through its attribute map, but its dict and config.json hold the own name).
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")


def _width(config: dict):
    return next((config[key] for key in _WIDTH_KEYS if config.get(key) is not None), None)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def estimate(config=None, *, tokens: int, hidden_size: Optional[int] = None, vocab_size: Optional[int] = None,
             dtype: str = "bfloat16", op: str = "cross_entropy", gpu: str = "h200",
             workspace_mb: Optional[float] = None) -> SizingEstimate:
    """The ``[tokens x vocab]``-sized memory and the products of one forward+backward of ``op``, for the naive path
    (materialised logits), TRL 1.16's chunked kernel and fusedloss, from their buffers' sizes
    (module docstring: ``help(fusedloss.sizing)``). Nothing is allocated or run.

    Args:
        config: a Hugging Face model config: the path of its ``config.json`` (or of the folder holding it), a dict,
            or a config object (``model.config``). Its ``hidden_size`` (``n_embd``, ``d_model``) and
            ``vocab_size`` are read.
        tokens: N, the tokens of one loss call (batch x sequence length, or the completion tokens of an RL batch).
        hidden_size, vocab_size: D and V, instead of (or overriding) ``config``'s.
        dtype: the operands' dtype: ``"bfloat16"`` (``"bf16"``), ``"float16"`` (``"fp16"``) or ``"float32"``.
        op: the loss as ``fusedloss.core.workload.OPS`` names it: ``"cross_entropy"`` (SFT), ``"grpo"``
            (token-level GRPO), ``"token_logprobs"``, ``"token_logprobs_entropy"``, ``"grpo_sequence"`` (GSPO) or
            ``"dpo"``.
        gpu: whose memory sizes fusedloss's default workspace (an eighth of the free memory, bounded; half the
            GPU's memory is taken as free): one of ``fusedloss.core.workload.GPUS``, in any case, or a name that
            contains one ("A100 40GB", "a100-80gb", "NVIDIA H100 80GB HBM3", "L40S", "RTX 4090", "MI300X").
        workspace_mb: fusedloss's workspace, as ``workspace_mb=`` or ``FUSEDLOSS_WORKSPACE_MB`` set it: a finite
            number of MiB, at least 1/1024 (a large number for an unbounded workspace).

    Returns:
        A ``SizingEstimate``; ``print()`` it for the table.

    Example::

        print(fusedloss.estimate("Qwen2.5-7B/config.json", tokens=16384))
        print(fusedloss.estimate(hidden_size=3584, vocab_size=152064, tokens=16384, dtype="bf16", op="grpo"))
    """
    given_d, given_v = _read_config(config) if config is not None else (None, None)
    d = _positive_int("hidden_size", hidden_size if hidden_size is not None else given_d)
    v = _positive_int("vocab_size", vocab_size if vocab_size is not None else given_v)
    n = _positive_int("tokens", tokens)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    gpu = _workload.gpu_key(gpu)  # ValueError naming the known GPUs
    if workspace_mb is not None:
        workspace_mb = _config.workspace_megabytes(workspace_mb, "workspace_mb")

    w = _workload.Workload(op=op, n=n, d=d, v=v, dtype=DTYPES[dtype])
    b, logits = w.operand_bytes, n * v
    spec = _workload.GPUS[gpu]
    workspace = int(workspace_mb * 2**20) if workspace_mb is not None else None
    plan = cuda_plan.plan(w, spec, spec.memory_bytes // 2, workspace=workspace)
    # The workspace never needs more than the fp32 logits of the whole call.
    fused = min(int(plan.params["workspace_bytes"]), 4 * logits)
    trl_tile = min(n, TRL_TOKEN_CHUNK) * min(v, TRL_VOCAB_CHUNK) * b
    torch_tile = min(n, _torch_backend.ROW_CHUNK) * min(v, _torch_backend.VOCAB_TILE) * 4
    composable, _ = _workload.product_bound(_workload.Workload(op="token_logprobs", n=n, d=d, v=v))
    row_local, _ = _workload.product_bound(_workload.Workload(op="cross_entropy", n=n, d=d, v=v))
    bound, _ = _workload.product_bound(w)
    paths = (
        PathCost("materialised logits (naive)", logits * (b + 4), logits * (4 + b), row_local,
                 "logits, fp32 log-softmax; their grads"),
        PathCost("TRL 1.16 chunked kernel", 0, trl_tile, composable,
                 f"one [{min(n, TRL_TOKEN_CHUNK)}, {min(v, TRL_VOCAB_CHUNK)}] tile"),
        PathCost(f"fusedloss, GPU ({plan.path.replace('_', '-')})", 0, fused, plan.products,
                 "workspace (workspace_mb=)" if workspace_mb is not None else f"workspace, {spec.name} default"),
        PathCost("fusedloss, torch backend (CPU)", 0, torch_tile, composable,
                 f"per [{min(n, _torch_backend.ROW_CHUNK)}, {min(v, _torch_backend.VOCAB_TILE)}] fp32 tile"),
    )
    modelled, modelled_bound, note = _modelled(w, gpu, spec.memory_bytes // 2, workspace)
    return SizingEstimate(tokens=n, hidden_size=d, vocab_size=v, dtype=DTYPES[dtype], op=op, gpu=spec.name,
                          paths=paths, bound_products=bound, modelled_ms=modelled, modelled_bound_ms=modelled_bound,
                          modelled_note=note)


# How to get the modelled column where the performance model is not importable.
MODEL_HINT = ("not available: the performance model (benchmarks/model/) ships with the source tree; run from a "
              "checkout (pip install -e ., or the checkout on PYTHONPATH) to add it")


def _modelled(w, gpu: str, free_bytes: int, workspace: Optional[int]) -> tuple:
    """(modelled ms, bound ms, note) of the CUDA backend's plan from the performance model, where it is
    importable; (None, None, how to get it) otherwise. The package never needs the model: only this optional
    column asks for it, at the call."""
    import importlib

    try:
        model_cost = importlib.import_module("benchmarks.model.cost")
        model_cuda = importlib.import_module("benchmarks.model.cuda")
    except ImportError:
        return None, None, MODEL_HINT
    spec = model_cost.GPUS[gpu]
    est = model_cost.evaluate(model_cuda.plan(w, spec, free_bytes, workspace=workspace), w, spec)
    return est.model_ms, est.bound_ms, f"{est.ratio:.2f}x the bound; benchmarks/model/, rates not yet measured"

