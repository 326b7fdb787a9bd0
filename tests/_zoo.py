"""Every causal-LM architecture transformers registers, built tiny from its config class in float64, through
``fusedloss.integrations.transformers``: ``patch`` / ``unpatch`` and ``completion_logprobs``, each either exact
against the model's own float64 computation or refused with a reason.

``python tests/_zoo.py [model_type ...]`` prints one line per architecture and the counts;
``tests/tooling/test_env_transformers_zoo.py`` runs it in CI.

How each architecture is checked:

- **Tiny, from the config class.** Every int field whose name says it is a size (hidden width, layers, heads,
  head dims, MLP widths, experts, LoRA ranks, positions, vocabulary) is set to ``min(default, tiny)``, sub-configs
  alike; per-layer lists are cut to the layer count keeping each distinct kind; token ids past the vocabulary
  are moved into it. ``OVERRIDES`` gives the values the generic shrink gets wrong for a few architectures.
- **Every logit transform active.** Each soft-cap / scale / vocabulary-cut field a config declares is set to a
  value that changes the logits, and every parameter is moved off its initial value (norm weights of 1, biases
  of 0 and learned scales of 1 hide transforms).
- **The reference is the model's own computation in float64.** ``ForCausalLMLoss`` (and many forwards) call
  ``logits.float()``, a downcast in a float64 model; while a check runs ``Tensor.float()`` leaves float64 as it
  is, so the model's own labelled loss is its formula in float64. fusedloss itself never calls ``.float()``.
- **Exact** means: the patched labelled loss within 1e-10 (relative) of the unpatched one, every parameter
  gradient within 1e-9 of its norm, the same parameters reached, ``out.logits is None``, and after ``unpatch``
  the labelled loss ``torch.equal`` to the one before ``patch`` with no instance attribute left. **Refused**
  means an error raised by a file of ``fusedloss/integrations/transformers/`` whose message says the
  architecture is not supported and why. Anything else is a failure (WRONG: a number that differs; CRASH:
  another error).
- ``completion_logprobs`` (prompt 4, completion 5 tokens) against ``log_softmax`` of the model's own float64
  logits, values and parameter gradients, or refused likewise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import time
import traceback
from pathlib import Path

import torch

INTEGRATION = Path(__file__).resolve().parents[1] / "fusedloss" / "integrations" / "transformers"  # its files

TINY_SIZES = [  # (name pattern, tiny value): a size field becomes min(default, tiny)
    (r"(hidden_size|n_embd|n_embed|d_model|dim|embed_dim|model_dim|embedding_size|emb_dim|hidden_dim|"
     r"word_embed_proj_dim|d_embed|embedding_dim|lru_width|block_size_hidden)", 32),
    (r"(num_hidden_layers|n_layers?|num_layers|decoder_layers|encoder_layers|num_decoder_layers|"
     r"num_encoder_layers|n_layer|num_text_layers)", 2),
    (r"(num_attention_heads|n_heads?|num_heads|decoder_attention_heads|encoder_attention_heads|"
     r"swa_num_attention_heads|num_attention_heads_per_layer)", 4),
    (r"(num_key_value_heads|n_kv_heads?|num_kv_heads|multi_query_group_num|swa_num_key_value_heads)", 2),
    (r"(.*head_dim|.*head_size|d_head|d_kv|kv_channels|attention_head_size|rotary_dim)", 8),
    (r"(moe_intermediate_size|shared_expert_intermediate_size|expert_intermediate_size|moe_ffn_hidden_size|"
     r"ffn_hidden_size_moe|.*expert.*_size)", 16),
    (r"(intermediate_size|ffn_dim|n_inner|d_ff|ffn_hidden_size|decoder_ffn_dim|encoder_ffn_dim|"
     r".*intermediate.*|d_inner|feed_forward_size|inner_hidden_size|mlp_dim)", 64),
    (r"(vocab_size|n_vocab|text_vocab_size)", 131),
    (r"(max_position_embeddings|n_positions|max_seq_len|n_ctx|max_sequence_length|seq_length|"
     r"max_target_positions|max_source_positions|max_length|context_length|rel_extent)", 64),
    (r"(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts|n_experts)", 4),
    (r"(num_experts_per_tok|moe_topk|top_k|num_selected_experts|n_activated_experts|moe_k)", 2),
    (r"(.*lora_rank|.*_rank)", 16),
    (r"(n_group|topk_group|num_shared_experts|n_shared_experts)", 1),
    (r"(state_size|ssm_state_size|mamba_d_state|d_state|conv_kernel|mamba_d_conv)", 4),
    (r"(mamba_n_heads|mamba_num_heads|linear_num_value_heads|linear_num_key_heads)", 4),
    (r"(mamba_head_dim|linear_key_head_dim|linear_value_head_dim|mamba_d_head)", 8),
    (r"(sliding_window|attention_window_size|sliding_window_size|window_size|local_window_size)", 8),
    (r"(chunk_size|attention_chunk_size)", 8),
]

# Fields that process the logits (or the head input): set so that they change the numbers.
ACTIVE = {"final_logit_softcapping": 5.0, "logits_soft_cap": 5.0, "output_logit_soft_cap": 5.0,
          "logit_scale": 0.37, "logits_scaling": 1.9, "lm_head_multiplier": 0.7, "output_multiplier": 0.6,
          "logits_mup_width_multiplier": 3.0}

OVERRIDES: dict = {  # model_type -> {field: value} the generic shrink gets wrong
    "bamba": dict(mamba_n_heads=8, mamba_d_head=8, mamba_expand=2),  # heads x head dim = expand x hidden
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1),
    # None by default and derived from nothing
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1),
    "deepseek_v2": dict(num_experts_per_tok=2),
    "hunyuan_v1_dense": dict(head_dim=8),
    "hunyuan_v1_moe": dict(head_dim=8),
    "ministral": dict(head_dim=8),
    # NVFP4 rounding of keys and values works on 16-wide blocks; the indexer heads share a key head's queries
    "kolibri1_1": dict(head_dim=16, index_num_heads=2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "gemma3n_text": dict(num_kv_shared_layers=0),  # KV sharing across the 2 tiny layers would share nothing
    # input_ids [sequences x codebooks, T]: one sequence of 2 codebooks
    "musicgen_decoder": dict(num_codebooks=2),
    "musicgen_melody_decoder": dict(num_codebooks=2),
}
INPUTS: dict = {}  # model_type -> extra model kwargs
LABELS = {  # model_type -> the labels of input_ids, where they are not input_ids' shape
    # MusicGen: input_ids [sequences x codebooks, T], labels [sequences, T, codebooks]
    "musicgen": lambda ids: ids.reshape(-1, 2, ids.shape[-1]).transpose(1, 2),
    "musicgen_melody": lambda ids: ids.reshape(-1, 2, ids.shape[-1]).transpose(1, 2),
}

# Architectures that cannot run from input_ids alone here, with the reason.
CANNOT_BUILD = {
    "gemma3n": "its vision tower is a timm model (the timm package)",
    "gemma4_assistant": "a draft model: its forward runs on the main model's inputs_embeds and shared KV states",
    "gemma4_unified_assistant": "a draft model: its forward runs on the main model's inputs_embeds and shared KV "
                                "states",
    "git": "its loss drops num_image_tokens leading positions: it needs pixel_values",
}

BATCH, PROMPT, COMPLETION = 2, 4, 5


@contextlib.contextmanager
def keep_float64():
    """``Tensor.float()`` leaves a float64 tensor as it is (the models' and ForCausalLMLoss's upcasts are
    downcasts in a float64 model)."""
    original = torch.Tensor.float

    def float_(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = float_
    try:
        yield
    finally:
        torch.Tensor.float = original


def _size(name: str, value):
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    for pattern, tiny in TINY_SIZES:
        if re.fullmatch(pattern, name):
            return min(value, tiny) if value > 0 else value
    return value


def _field(config, name):
    try:
        return getattr(config, name, None)
    except Exception:  # a per-layer attribute read globally: left to the per-layer configs
        return None


def tiny_config(cls, default=None):
    """A config of ``cls`` with every size field shrunk and every logit transform active (recursively)."""
    from transformers import PreTrainedConfig

    default = cls() if default is None else default
    kwargs = {}
    fields = [f.name for f in dataclasses.fields(default)] if dataclasses.is_dataclass(default) else []
    heads = {}
    for name in fields or list(default.to_dict()):
        value = _field(default, name)
        if isinstance(value, PreTrainedConfig):
            kwargs[name] = tiny_config(type(value), value)
        elif name in ACTIVE and (value is None or isinstance(value, (int, float))) and not isinstance(value, bool):
            kwargs[name] = ACTIVE[name]
        elif isinstance(value, list) and value and all(type(v) is int for v in value) \
                and _size(name, max(value)) != max(value):  # a size per layer: shrunk, cut below
            kwargs[name] = [_size(name, v) for v in value]
        else:
            new = _size(name, value)
            if new is not value:
                kwargs[name] = new
            if name in ("num_attention_heads", "num_key_value_heads") and isinstance(value, int):
                heads[name] = value
    if heads.get("num_key_value_heads") == heads.get("num_attention_heads") and "num_attention_heads" in kwargs:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # attention without grouped keys (MLA)
    kwargs.update(OVERRIDES.get(getattr(default, "model_type", None), {}))
    vocab = kwargs.get("vocab_size", getattr(default, "vocab_size", None))
    if isinstance(vocab, int):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id",
                     "mask_token_id", "unk_token_id", "cls_token_id"):
            value = getattr(default, name, None)
            if isinstance(value, int) and value >= vocab:
                kwargs[name] = vocab - 1 - (hash(name) % 4)
            elif isinstance(value, list):
                kwargs[name] = [v if v < vocab else vocab - 1 for v in value]
        if "unpadded_vocab_size" in fields:
            kwargs["unpadded_vocab_size"] = vocab - 8
    layers = next((kwargs[n] for n in ("num_hidden_layers", "n_layer", "n_layers", "num_layers") if n in kwargs), None)
    if layers is not None:
        for name in fields:
            value = kwargs.get(name, _field(default, name))
            if isinstance(value, list) and len(value) > layers and value \
                    and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
                kinds = list(dict.fromkeys(value))
                if name in kwargs and all(isinstance(v, int) for v in value):  # a size per layer
                    kwargs[name] = value[:layers]
                    continue
                if name.endswith("_ids") or all(isinstance(v, int) for v in value):
                    cut = [v for v in value if isinstance(v, int) and v < layers]
                    if len(cut) != len(value):  # a hybrid stack keeps one layer of the listed kind
                        kwargs[name] = cut or [layers - 1]
                    continue
                kwargs[name] = (kinds + [value[0]] * layers)[:max(layers, len(kinds))]
        lists = [len(kwargs[n]) for n in fields if isinstance(kwargs.get(n), list) and n.endswith("types")]
        if lists and max(lists) > layers:
            for n in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
                if n in kwargs:
                    kwargs[n] = max(lists)
    config = cls(**kwargs)
    with contextlib.suppress(Exception):  # grouped_mm has no float64
        config.experts_implementation = "eager"
    return config


def build(model_type: str):
    """The tiny float64 model AutoModelForCausalLM maps ``model_type`` to, parameters perturbed."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config_cls = CONFIG_MAPPING[model_type]
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config = tiny_config(config_cls)
    wanted = getattr(model_cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):  # a causal LM built on a sub-config
        sub = next((v for v in vars(config).values() if isinstance(v, wanted)), None)
        if sub is not None:
            config = sub
    with default_float64():
        torch.manual_seed(0)
        model = model_cls(config).to(torch.float64).eval()
    with contextlib.suppress(Exception):  # grouped_mm has no float64
        model.set_experts_implementation("eager")
    if hasattr(model, "set_default_language"):  # X-MOD's language adapters
        model.set_default_language(next(iter(model.config.languages)))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _vocab(model) -> int:
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None:
        weight = head[0].weight  # a list of heads (MusicGen's codebooks)
    return weight.shape[0]


def _ids(model, shape, seed):
    config = model.config.get_text_config()
    high = min(_vocab(model), getattr(config, "unpadded_vocab_size", None) or _vocab(model))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(5, high - 1), high, shape, generator=g)


def _grads(model, loss):
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return {n: g for (n, _), g in zip(params, grads) if g is not None}


def _compare_grads(got: dict, want: dict) -> float:
    if set(got) != set(want):
        raise _Wrong(f"gradients reach other parameters: missing {sorted(set(want) - set(got))[:3]}, "
                     f"extra {sorted(set(got) - set(want))[:3]}")
    # A gradient that is 0 in exact arithmetic (a key bias under softmax) is rounding noise: its error is
    # measured against a floor of 1e-6 of the largest gradient's norm.
    floor = 1e-6 * max((w.norm().item() for w in want.values()), default=0.0)
    worst = 0.0
    for name, w in want.items():
        err = (got[name] - w).norm().item() / max(w.norm().item(), floor, 1e-300)
        worst = max(worst, err)
    return worst


class _Wrong(Exception):
    pass


class _CannotRun(Exception):
    """The model's own forward fails on the tiny config: no comparison possible."""


def _refusal(error: BaseException) -> str | None:
    """The message of an error the integration raised to refuse the architecture, else None."""
    frames = traceback.extract_tb(error.__traceback__)
    if frames and Path(frames[-1].filename).parent == INTEGRATION and "not support" in str(error):
        return str(error)
    return None


@contextlib.contextmanager
def default_float64():
    """Some models build constants in the default dtype in their forward (XGLM's float64 minimum)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _forward(model, **kwargs):
    torch.manual_seed(2)
    with default_float64():
        return model(**kwargs)


def check_patch(model, model_type):
    """'exact' or 'refused: ...'; raises _Wrong for a wrong number."""
    from fusedloss.integrations import transformers as fl_hf

    ids = _ids(model, (BATCH, PROMPT + COMPLETION), 3)
    labels = ids.clone()
    labels[0, :2] = -100
    labels = LABELS.get(model_type, lambda x: x)(labels)
    extra = INPUTS.get(model_type, {})
    try:  # the model's own labelled forward and backward must run for the comparison to mean anything
        before = _forward(model, input_ids=ids, labels=labels, **extra).loss.detach()
        with keep_float64():
            own = _forward(model, input_ids=ids, labels=labels, **extra).loss
            want = _grads(model, own)
    except Exception as error:
        raise _CannotRun(f"own forward: {type(error).__name__}: {error}"[:300]) from error
    with keep_float64():
        try:
            fl_hf.patch(model, backend="torch")
            out = _forward(model, input_ids=ids, labels=labels, **extra)
        except Exception as error:
            fl_hf.unpatch(model)
            reason = _refusal(error)
            if reason is None:
                raise
            return "refused: " + reason
        if getattr(out, "logits", None) is not None:
            raise _Wrong("out.logits is not None")
        loss_err = abs(out.loss.item() - own.item()) / max(abs(own.item()), 1e-300)
        if not loss_err <= 1e-10:
            raise _Wrong(f"loss {out.loss.item():.12g} vs the model's {own.item():.12g}")
        grad_err = _compare_grads(_grads(model, out.loss), want)
        if not grad_err <= 1e-9:
            raise _Wrong(f"a parameter gradient off by {grad_err:.2e} of its norm")
    fl_hf.unpatch(model)
    left = [a for a in ("forward", "_loss_function", "_fusedloss_patch") if a in vars(model)]
    left += ["head." + a for a in ("forward", "_fusedloss_patch") if a in vars(model.get_output_embeddings())]
    if left:
        raise _Wrong(f"unpatch left {left}")
    after = _forward(model, input_ids=ids, labels=labels, **extra).loss.detach()
    if not torch.equal(after, before):
        raise _Wrong(f"after unpatch the loss is {after.item()!r}, not {before.item()!r}")
    return f"exact (loss {loss_err:.1e}, gradients {grad_err:.1e})"


def check_helpers(model, model_type):
    from fusedloss.integrations import transformers as fl_hf

    ids = _ids(model, (BATCH, PROMPT + COMPLETION), 4)
    extra = INPUTS.get(model_type, {})
    prompt, completion = ids[:, :PROMPT], ids[:, PROMPT:]
    with keep_float64():
        logits = _forward(model, input_ids=ids, use_cache=False, **extra).logits[:, PROMPT - 1:-1]
        want_logp = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        cotangent = torch.linspace(-1, 1, want_logp.numel(), dtype=torch.float64).reshape(want_logp.shape)
        want = _grads(model, (cotangent * want_logp).sum())
        try:
            torch.manual_seed(2)
            with default_float64():
                logp = fl_hf.completion_logprobs(model, prompt, completion, backend="torch", **extra)
        except Exception as error:
            reason = _refusal(error)
            if reason is None:
                raise
            return "refused: " + reason
        err = ((logp - want_logp).abs().max() / want_logp.abs().max()).item()
        if not err <= 1e-10:
            raise _Wrong(f"completion_logprobs off by {err:.2e}")
        grad_err = _compare_grads(_grads(model, (cotangent * logp).sum()), want)
        if not grad_err <= 1e-9:
            raise _Wrong(f"a completion_logprobs gradient off by {grad_err:.2e}")
        with default_float64():
            head = fl_hf.lm_head(model)
            hidden = fl_hf.last_hidden_state(model, ids, **extra)[:, PROMPT - 1:-1]
        again = fusedloss_token_logprobs(hidden, head, completion)
        if not ((again - want_logp).abs().max() / want_logp.abs().max()).item() <= 1e-10:
            raise _Wrong("last_hidden_state with lm_head differs from the model")
    return f"exact ({err:.1e}, gradients {grad_err:.1e})"


def fusedloss_token_logprobs(hidden, head, targets):
    import fusedloss

    return fusedloss.token_logprobs(hidden, head.weight, targets, backend="torch", **head.options)


def architectures():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run(model_type: str) -> dict:
    """One architecture: {'build': 'ok' | reason, 'patch': ..., 'helpers': ..., 'seconds': ...}."""
    start = time.perf_counter()
    result = {"model_type": model_type}
    try:
        model = build(model_type)
    except Exception as error:
        result["build"] = f"{type(error).__name__}: {error}"[:300]
        result["seconds"] = time.perf_counter() - start
        return result
    result["build"] = "ok"
    for key, check in (("patch", check_patch), ("helpers", check_helpers)):
        try:
            result[key] = check(model, model_type)
        except _CannotRun as error:
            result["build"] = str(error)
            break
        except _Wrong as error:
            result[key] = f"WRONG: {error}"
        except Exception as error:
            result[key] = f"CRASH: {type(error).__name__}: {error}"[:400]
    result["seconds"] = time.perf_counter() - start
    return result


def status(text: str) -> str:
    return text.split(":")[0].split(" ")[0]


def main(names) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    names = names or architectures()
    counts: dict = {}
    start = time.perf_counter()
    for name in names:
        r = run(name)
        if r["build"] != "ok":
            key = "unbuildable"
            print(f"{name:32s} UNBUILDABLE {r['build']}", flush=True)
        else:
            print(f"{name:32s} patch: {r['patch'][:150]} | helpers: {r['helpers'][:150]} ({r['seconds']:.1f}s)",
                  flush=True)
            key = f"patch {status(r['patch'])}"
            counts[f"helpers {status(r['helpers'])}"] = counts.get(f"helpers {status(r['helpers'])}", 0) + 1
        counts[key] = counts.get(key, 0) + 1
    print(counts, f"{time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))
