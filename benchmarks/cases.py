"""Benchmark problems: shapes per device, deterministic inputs, the chunked float64 reference and the statistics.

A *problem* is one op at one shape: the inputs (in the benchmark dtype, on the benchmark device), the
fixed keyword arguments every implementation gets, and how its outputs become one scalar to
differentiate. Every implementation of the op (the materialised reference, each fusedloss backend,
each peer) is called on the same ``Problem`` and must produce the same outputs and gradients with
respect to ``hidden`` and ``weight``.

The ground truth is ``fusedloss.reference`` in float64 on the same (already dtype-rounded) data. It
is computed in chunks of rows (or whole sequences / preference pairs), each chunk's loss weighted so
the chunks add up to the full loss exactly, so that its memory is bounded by ``chunk x V`` whatever
N is: the float64 reference of N=16384, V=151936 would otherwise need ~100 GB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

OPS = ("token_logprobs", "cross_entropy", "grpo_loss", "dpo_loss", "distillation_loss")
# Run when named (--ops): a teacher's top-k log-probs from its hidden states (no gradient), and distillation from
# three teachers of different widths, one per block of rows. Not in the default run.
EXTRA_OPS = ("topk_logprobs", "multi_teacher_distillation")
ALL_OPS = OPS + EXTRA_OPS
FUNCTION = {"multi_teacher_distillation": "distillation_loss"}  # the public function of an op, where named otherwise

# (N list, V, D) per preset. V values are deliberately not multiples of any tile size on CPU.
PRESETS = {
    "tiny": {"N": (64, 256), "V": 1009, "D": 64},            # dry runs, pytest-benchmark
    # The default CPU run: every op once, time-boxed to 90 s of cases. N x V large enough that the
    # materialised logits dominate memory (the reference holds several [N, V] fp32 tensors).
    "quick": {"N": (1024,), "V": 32003, "D": 256},
    "small": {"N": (512, 2048), "V": 32003, "D": 256},       # two token counts, a few minutes on a CPU
    "llm": {"N": (4096, 16384), "V": 151936, "D": 4096},     # a Qwen-sized head on a GPU (bf16)
    # The README's memory headline: a Llama-3-sized vocabulary, 4096 tokens, fp32 on a CPU, where the
    # reference needs ~12 GiB beyond its inputs.
    "headline": {"N": (4096,), "V": 131072, "D": 256},
}
PRESETS["acceptance"] = PRESETS["headline"]  # the name earlier result files and scripts use

GRPO_BETA = 0.04
DPO_BETA = 0.1
DISTILL_BETA = 1.0
TOPK_K = 20
# (width as a fraction of D, logit transforms) of the multi-teacher op's three teachers
TEACHERS = ((1.0, {}), (0.5, {"softcap": 30.0}), (1.5, {"temperature": 2.0}))
IGNORE = -100
LOGIT_STD = 2.0  # std of the logits: moderately peaked softmax, like a trained head


def seq_len(n: int) -> int:
    """Sequence length for the sequence-shaped ops (GRPO completions, DPO answers)."""
    if n >= 16384:
        return 1024
    if n >= 2048:
        return 512
    return min(n, 128)


@dataclass
class Problem:
    op: str
    N: int
    V: int
    D: int
    dtype: torch.dtype
    device: torch.device
    t: Dict[str, torch.Tensor] = field(default_factory=dict)  # every input tensor (hidden, weight, ...)

    # leaves: fresh requires_grad views of hidden and weight for one run
    def leaves(self):
        h = self.t["hidden"].detach().requires_grad_(True)
        w = self.t["weight"].detach().requires_grad_(True)
        return h, w

    def input_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in self.t.values())


def _gen(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def make_problem(op: str, n: int, v: int, d: int, dtype: torch.dtype, device, seed: int = 0) -> Problem:
    """Deterministic inputs: generated in fp32 on ``device`` from ``seed`` (so values differ between a CPU
    and a GPU run, never between two runs on one device), then rounded to ``dtype``."""
    if op not in ALL_OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {ALL_OPS}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    g = _gen(seed * 7919 + ALL_OPS.index(op), device)
    p = Problem(op, n, v, d, dtype, device)
    _randn, _randint, _rand = torch.randn, torch.randint, torch.rand

    def randn(*shape, generator):
        return _randn(*shape, generator=generator, device=device)

    def randint(lo, hi, shape, generator):
        return _randint(lo, hi, shape, generator=generator, device=device)

    def rand(*shape, generator):
        return _rand(*shape, generator=generator, device=device)

    def arange(k):
        return torch.arange(k, device=device)

    def put(name, x):
        p.t[name] = x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype).contiguous()

    hidden = randn(n, d, generator=g)
    weight = randn(v, d, generator=g) * (LOGIT_STD / math.sqrt(d))
    if op in ("token_logprobs", "cross_entropy"):
        put("hidden", hidden)
        put("weight", weight)
        targets = randint(0, v, (n,), generator=g)
        if op == "cross_entropy":
            targets[rand(n, generator=g) < 0.05] = IGNORE
        else:
            # random cotangents for the two per-token outputs, so both gradients are exercised
            p.t["g_logp"] = (randn(n, generator=g) / n).to(device)
            p.t["g_ent"] = (randn(n, generator=g) / n).to(device)
        p.t["targets"] = targets.to(device)
    elif op == "distillation_loss":
        put("hidden", hidden)
        put("weight", weight)
        put("teacher_hidden", 0.8 * hidden + 0.6 * randn(n, d, generator=g))
        put("teacher_weight", weight + 0.5 * (LOGIT_STD / math.sqrt(d)) * randn(v, d, generator=g))
    elif op == "topk_logprobs":
        put("hidden", hidden)
        put("weight", weight)
    elif op == "multi_teacher_distillation":
        put("hidden", hidden)
        put("weight", weight)
        # contiguous blocks of rows (prompts routed to their expert); each teacher ships only its rows
        index = (arange(n) * len(TEACHERS)) // n
        p.t["teacher_index"] = index
        for i, (frac, _) in enumerate(TEACHERS):
            d_t, rows = max(1, int(frac * d)), int((index == i).sum())
            put(f"teacher{i}_hidden", randn(rows, d_t, generator=g))
            put(f"teacher{i}_weight", (LOGIT_STD / math.sqrt(d_t)) * randn(v, d_t, generator=g))
    elif op == "grpo_loss":
        c = seq_len(n)
        b = max(1, n // c)
        put("hidden", hidden[: b * c].reshape(b, c, d))
        put("weight", weight)
        p.t["completion_ids"] = randint(0, v, (b, c), generator=g).to(device)
        lengths = randint(c // 2, c + 1, (b,), generator=g)
        p.t["completion_mask"] = (arange(c)[None, :] < lengths[:, None]).to(device)
        p.t["advantages"] = randn(b, generator=g).to(device)
        # ref log-probs near the policy's own (the KL penalty is then small and well-conditioned)
        logp = _chunked_logp64(p.t["hidden"].reshape(-1, d), p.t["weight"], p.t["completion_ids"].reshape(-1))
        noise = 0.05 * randn(b * c, generator=g).to(device)
        p.t["ref_logprobs"] = (logp.float() + noise).reshape(b, c)
        p.N = b * c
    elif op == "dpo_loss":
        t = seq_len(n)
        rows = max(2, (n // t) // 2 * 2)  # 2B rows: chosen then rejected
        put("hidden", hidden.repeat(math.ceil(rows * t / n), 1)[: rows * t].reshape(rows, t, d))
        put("weight", weight)
        labels = randint(0, v, (rows, t), generator=g)
        prompt = t // 4
        labels[:, :prompt] = IGNORE
        lengths = randint(prompt + t // 4, t + 1, (rows,), generator=g)
        labels[arange(t)[None, :] >= lengths[:, None]] = IGNORE
        p.t["labels"] = labels.to(device)
        # step 0 of DPO: the reference model is the policy, so ref log-probs are the policy's own
        lab = p.t["labels"].reshape(-1)
        logp = _chunked_logp64(p.t["hidden"].reshape(-1, d), p.t["weight"], lab).reshape(rows, t)
        seq = logp.sum(1)
        p.t["ref_chosen_logps"] = seq[: rows // 2].float()
        p.t["ref_rejected_logps"] = seq[rows // 2:].float()
        p.N = rows * t
    return p


def _chunk_rows(v: int, device: torch.device) -> int:
    budget = (1 << 30) if device.type == "cuda" else (1 << 28)  # bytes of one fp64 [rows, V] tensor
    return max(1, budget // (8 * v))


@torch.no_grad()
def _chunked_logp64(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from fusedloss import reference

    w64 = w.double()
    out = []
    step = _chunk_rows(w.shape[0], h.device)
    for r0 in range(0, h.shape[0], step):
        out.append(reference.token_logprobs(h[r0:r0 + step].double(), w64, targets[r0:r0 + step]))
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------
# Calling one implementation: every implementation is a callable taking the module-like object
# that holds the op functions (``fusedloss``, ``fusedloss.reference`` or a compiled wrapper),
# and returning (scalar loss, {name: output}).
# ---------------------------------------------------------------------------------------------

def call_op(fn: Callable, p: Problem, h: torch.Tensor, w: torch.Tensor, **extra):
    """Call an op function with its public signature (``fn`` is e.g. ``fusedloss.grpo_loss``)."""
    t = p.t
    if p.op == "token_logprobs":
        logp, ent = fn(h, w, t["targets"], return_entropy=True, **extra)
        loss = (logp * t["g_logp"]).sum() + (ent * t["g_ent"]).sum()
        return loss, {"logp": logp, "entropy": ent}
    if p.op == "cross_entropy":
        loss = fn(h, w, t["targets"], **extra)
        return loss, {"loss": loss}
    if p.op == "grpo_loss":
        loss = fn(h, w, t["completion_ids"], t["advantages"], t["completion_mask"], ref_logprobs=t["ref_logprobs"],
                  beta=GRPO_BETA, loss_type="dapo", **extra)
        return loss, {"loss": loss}
    if p.op == "dpo_loss":
        loss = fn(h, w, t["labels"], t["ref_chosen_logps"], t["ref_rejected_logps"], beta=DPO_BETA, **extra)
        return loss, {"loss": loss}
    if p.op == "distillation_loss":
        loss = fn(h, w, t["teacher_hidden"], t["teacher_weight"], beta=DISTILL_BETA, **extra)
        return loss, {"loss": loss}
    if p.op == "topk_logprobs":
        top = fn(h, w, TOPK_K, **extra)
        # no gradient: the "loss" is a constant (the harness skips its backward)
        return top.logprobs.sum(), {"logprobs": top.logprobs}
    if p.op == "multi_teacher_distillation":
        loss = fn(h, w, teachers=teachers(p), teacher_index=t["teacher_index"], beta=DISTILL_BETA, **extra)
        return loss, {"loss": loss}
    raise ValueError(p.op)


def teachers(p: Problem, dtype=None) -> list:
    from fusedloss import Teacher

    def cast(x):
        return x if dtype is None else x.to(dtype)

    return [Teacher(cast(p.t[f"teacher{i}_hidden"]), cast(p.t[f"teacher{i}_weight"]), **kw)
            for i, (_, kw) in enumerate(TEACHERS)]


def naive_topk_logprobs(h, w, k, **_):
    """The materialised pipeline a teacher server runs without fusedloss: log_softmax of the logits, then
    ``torch.topk``."""
    from fusedloss.types import TopK

    with torch.no_grad():
        lp = torch.log_softmax((h @ w.T).float(), dim=-1)
        values, ids = lp.topk(k, dim=-1)
    return TopK(ids=ids, logprobs=values)


def loop_over_teachers(h, w, *, teachers, teacher_index, beta, **_):
    """Multi-teacher distillation without fusedloss: per teacher, its rows' student and teacher logits
    materialised (``fusedloss.reference.distillation_loss``), the per-teacher sums added."""
    from fusedloss import reference

    flat = teacher_index.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32 if h.dtype != torch.float64 else h.dtype)
    for i, t in enumerate(teachers):
        rows = (flat == i).nonzero().squeeze(1)
        total = total + reference.distillation_loss(
            h.index_select(0, rows), w, t.hidden, t.weight, beta=beta, teacher_bias=t.bias,
            teacher_logit_scale=t.logit_scale, teacher_softcap=t.softcap,
            temperature=1.0 if t.temperature is None else t.temperature, reduction="sum")
    return total / flat.numel()


def reference_function(op: str) -> Callable:
    """What the benchmark's "reference" implementation calls for ``op``: ``fusedloss.reference``'s function,
    except the materialised pipelines users run for the teacher top-k and for several teachers."""
    from fusedloss import reference

    return {"topk_logprobs": naive_topk_logprobs,
            "multi_teacher_distillation": loop_over_teachers}.get(op) or getattr(reference, op)


def reference64(p: Problem, progress: Optional[Callable[[int, int], None]] = None):
    """Float64 ground truth on the same data, chunked so memory stays bounded: (outputs, grads).
    ``progress(done, total)`` hears each finished chunk (a large case takes minutes on a CPU)."""
    from fusedloss import reference as R

    t = p.t
    dev = p.device
    w64 = t["weight"].double().requires_grad_(True)
    h_all = t["hidden"].double()
    dh = torch.zeros_like(h_all)
    rows = _chunk_rows(p.V, dev)
    outs: Dict[str, list] = {}
    total = torch.zeros((), dtype=torch.float64, device=dev)
    count = {"done": 0, "total": 1}

    def tick():
        count["done"] += 1
        if progress is not None:
            progress(count["done"], count["total"])

    def run(sl, loss_fn):
        nonlocal total
        hc = h_all[sl].detach().requires_grad_(True)
        loss, parts = loss_fn(hc, sl)
        loss.backward()
        dh[sl] = hc.grad
        total = total + loss.detach()
        for k, x in parts.items():
            outs.setdefault(k, []).append(x.detach())
        tick()

    count["total"] = math.ceil(p.N / rows)
    if p.op == "token_logprobs":
        for r0 in range(0, p.N, rows):
            def f(hc, sl):
                logp, ent = R.token_logprobs(hc, w64, t["targets"][sl], return_entropy=True)
                return (logp * t["g_logp"][sl]).sum() + (ent * t["g_ent"][sl]).sum(), {"logp": logp, "entropy": ent}
            run(slice(r0, r0 + rows), f)
        outputs = {k: torch.cat(v) for k, v in outs.items()}
    elif p.op == "cross_entropy":
        n_valid = max(1, int((t["targets"] != IGNORE).sum()))
        for r0 in range(0, p.N, rows):
            run(slice(r0, r0 + rows),
                lambda hc, sl: (R.cross_entropy(hc, w64, t["targets"][sl], reduction="sum") / n_valid, {}))
        outputs = {"loss": total}
    elif p.op == "distillation_loss":
        th64, tw64 = t["teacher_hidden"].double(), t["teacher_weight"].double()
        for r0 in range(0, p.N, rows):
            run(slice(r0, r0 + rows),
                lambda hc, sl: (R.distillation_loss(hc, w64, th64[sl], tw64, beta=DISTILL_BETA, reduction="sum")
                                / p.N, {}))
        outputs = {"loss": total}
    elif p.op == "topk_logprobs":
        w64.requires_grad_(False)
        lps = []
        for r0 in range(0, p.N, rows):
            lps.append(R.topk_logprobs(h_all[r0:r0 + rows], w64, TOPK_K).logprobs)
            tick()
        return {"logprobs": torch.cat(lps)}, {}
    elif p.op == "multi_teacher_distillation":
        flat = t["teacher_index"]
        # chunks are cut per teacher, so a teacher's last chunk may be short
        count["total"] = sum(math.ceil(int((flat == i).sum()) / rows) for i in range(len(TEACHERS)))
        for i, teacher in enumerate(teachers(p, torch.float64)):
            ids = (flat == i).nonzero().squeeze(1)
            for r0 in range(0, ids.numel(), rows):
                sl = ids[r0:r0 + rows]
                hc = h_all.index_select(0, sl).detach().requires_grad_(True)
                loss = R.distillation_loss(hc, w64, teacher.hidden[r0:r0 + rows], teacher.weight,
                                           teacher_softcap=teacher.softcap, beta=DISTILL_BETA, reduction="sum",
                                           temperature=1.0 if teacher.temperature is None else teacher.temperature
                                           ) / p.N
                loss.backward()
                dh.index_copy_(0, sl, hc.grad)
                total = total + loss.detach()
                tick()
        outputs = {"loss": total}
    elif p.op == "grpo_loss":
        b, c = t["completion_ids"].shape
        items = int(t["completion_mask"].sum())
        per = max(1, rows // c)
        count["total"] = math.ceil(b / per)
        for s0 in range(0, b, per):
            def f(hc, sl):
                loss = R.grpo_loss(hc, w64, t["completion_ids"][sl], t["advantages"][sl].double(),
                                   t["completion_mask"][sl], ref_logprobs=t["ref_logprobs"][sl].double(),
                                   beta=GRPO_BETA, loss_type="dapo", num_items_in_batch=items)
                return loss, {}
            run(slice(s0, s0 + per), f)
        outputs = {"loss": total}
    elif p.op == "dpo_loss":
        rows2, tlen = t["labels"].shape
        pairs = rows2 // 2
        per = max(1, rows // (2 * tlen))
        count["total"] = math.ceil(pairs / per)
        for q0 in range(0, pairs, per):
            q1 = min(pairs, q0 + per)
            idx = torch.cat((torch.arange(q0, q1), torch.arange(pairs + q0, pairs + q1))).to(dev)
            hc = h_all.index_select(0, idx).detach().requires_grad_(True)
            loss = R.dpo_loss(hc, w64, t["labels"].index_select(0, idx), t["ref_chosen_logps"][q0:q1].double(),
                              t["ref_rejected_logps"][q0:q1].double(), beta=DPO_BETA) * ((q1 - q0) / pairs)
            loss.backward()
            dh.index_copy_(0, idx, hc.grad)
            total = total + loss.detach()
            tick()
        outputs = {"loss": total}
    else:
        raise ValueError(p.op)
    return outputs, {"hidden": dh, "weight": w64.grad}


def statistics_of(z: torch.Tensor, targets: torch.Tensor, teacher_z: Optional[torch.Tensor] = None,
                  jsd_beta: Optional[float] = None) -> Dict[str, torch.Tensor]:
    """Every per-row statistic of docs/design.md, "The statistics problem", on materialised logits ``z`` [N, V]
    (and a teacher's ``teacher_z``), differentiable: on float64 logits the ground truth the device checks measure
    the backends' statistics against, on logits in the inputs' dtype the naive path beside it. Ignored rows
    (targets < 0) give 0, selected with ``torch.where``. ``jsd_beta`` None: the JSD at beta 0.5."""
    valid = targets >= 0
    logq = torch.log_softmax(z, -1)
    q = logq.exp()
    out = {"lse": torch.logsumexp(z, -1), "logp": logq.gather(1, targets.clamp_min(0)[:, None]).squeeze(1),
           "entropy": -(q * logq).sum(-1), "mean_logit": z.mean(-1), "log_sum_sq_probs": torch.log((q * q).sum(-1)),
           "is_top1": (z.argmax(-1) == targets).to(z.dtype)}
    if teacher_z is not None:
        beta = 0.5 if jsd_beta is None else jsd_beta
        logpt = torch.log_softmax(teacher_z, -1)
        pt = logpt.exp()
        out["kl_rev"] = (q * (logq - logpt)).sum(-1)
        out["kl_fwd"] = (pt * (logpt - logq)).sum(-1)
        logm = torch.logaddexp(logq + math.log1p(-beta), logpt + math.log(beta))
        out["jsd"] = beta * (pt * (logpt - logm)).sum(-1) + (1 - beta) * (q * (logq - logm)).sum(-1)
    return {k: torch.where(valid, x, torch.zeros_like(x)) for k, x in out.items()}


def rel_err(x: Optional[torch.Tensor], ref: torch.Tensor) -> float:
    """Norm-wise relative error ||x - ref|| / ||ref|| in float64 (docs/design.md, "Numerical doctrine").
    NaN/inf give inf."""
    if x is None:
        return float("inf")
    x = x.detach().to(ref.device, torch.float64).reshape(ref.shape)
    num = torch.linalg.vector_norm(x - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if not math.isfinite(num):
        return float("inf")
    return num / den if den > 0 else num
