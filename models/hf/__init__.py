"""Hugging Face conversion maps: config fields and tensor names of each supported HF
architecture, both directions, beside our model families (`GPTModel`, `T5Model`).

- `config_from_hf(config_dict) -> ModelConfig`, refusing (with `HFConversionError`) every
  field we cannot represent: another model_type, MoE, unknown RoPE scaling, a quantization
  config other than GGUF, 4-bit GPTQ / AWQ (models/hf/quantized.py) and FP8
  (models/hf/fp8.py), ...; and, config.json being untrusted, a missing field or a value
  of the wrong JSON type (`_field_problem`), before any family reads the dict.
- `open_checked(path) -> (HFSource, ModelConfig)`: the above, plus `check_weights`: the
  model the config describes against the tensors the files hold (their number bounds the
  layers; names; shapes from the headers), so a config claiming 10^5 layers or a hidden size
  of 10^9 is refused before anything is allocated.
- `config_to_hf(model_config) -> dict` of transformers config kwargs (model_type included).
- `to_native(config, get, names)` / `to_hf(config, get)`: stream `(name, tensor)` pairs one
  parameter at a time through the architecture's `Rule` table (models/hf/rules.py).

Supported: GPT2LMHeadModel (gpt2), LlamaForCausalLM (llama), MistralForCausalLM (mistral),
Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM (qwen3), Olmo2ForCausalLM (olmo2),
Phi3ForCausalLM (phi3), T5ForConditionalGeneration (t5, v1.0 and v1.1), Gemma3ForCausalLM
(gemma3_text), Gemma2ForCausalLM (gemma2), and the mixture-of-experts MixtralForCausalLM
(mixtral), Qwen2MoeForCausalLM (qwen2_moe), Qwen3MoeForCausalLM (qwen3_moe) and
OlmoeForCausalLM (olmoe), and DeepseekV3ForCausalLM (deepseek_v3: multi-head latent attention
and sigmoid-routed MoE, models/hf/deepseek.py), GptOssForCausalLM (gpt_oss: attention sinks,
biased MoE, MXFP4 experts: models/hf/gpt_oss.py, models/hf/mxfp4.py). File formats
(safetensors, .bin, GGUF) are in models/hf/files.py.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import math
import os

import torch

from models.config import MAX_COUNT, MAX_POSITIONS, ConfigError, ModelConfig

from . import deepseek, gemma, gpt2, gpt_oss, llama, moe, olmo2, phi3, t5
from .quantized import quant_scheme
from .rules import HFConversionError, Rule  # noqa: F401

FAMILIES = {mt: fam for fam in (gpt2, llama, t5, moe, gemma) for mt in fam.MODEL_TYPES}
FAMILIES.update({mt: fam for fam in (olmo2, phi3, deepseek, gpt_oss) for mt in fam.MODEL_TYPES})
# config.json fields that mean mixture-of-experts (refused for the dense families' types)
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")

# Every config.json field a family reads, by JSON type; `null` counts as absent. Counts are
# integers >= 1; numbers are finite (an int or a float); flags true/false; names strings.
_COUNTS = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner",
           "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
           "head_dim", "intermediate_size", "max_position_embeddings", "d_model", "d_kv", "d_ff",
           "num_layers", "num_decoder_layers", "num_heads", "relative_attention_num_buckets",
           "relative_attention_max_distance", "original_max_position_embeddings",
           "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
           "shared_expert_intermediate_size", "decoder_sparse_step", "sliding_window_pattern",
           "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
           "n_routed_experts", "n_shared_experts", "n_group", "topk_group")
_POSITIONS = ("n_positions", "max_position_embeddings", "original_max_position_embeddings")
_LAYER_COUNTS = ("n_layer", "num_hidden_layers", "num_layers", "num_decoder_layers")
_NUMBERS = ("layer_norm_epsilon", "rms_norm_eps", "initializer_range", "initializer_factor",
            "rope_theta", "dropout_rate", "attention_dropout", "resid_pdrop", "embd_pdrop",
            "attn_pdrop", "factor", "low_freq_factor", "high_freq_factor",
            "router_jitter_noise", "router_aux_loss_coef", "query_pre_attn_scalar",
            "rope_local_base_freq", "attn_logit_softcapping", "final_logit_softcapping",
            "routed_scaling_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
            "swiglu_alpha", "swiglu_limit")
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "scale_attn_weights",
          "scale_attn_by_inverse_layer_idx", "add_cross_attention", "scale_decoder_outputs",
          "norm_topk_prob", "output_router_logits", "qkv_bias", "use_bidirectional_attention",
          "rope_interleave", "truncate")
_NAMES = ("model_type", "hidden_act", "activation_function", "feed_forward_proj",
          "hidden_activation")
_ROPE_DICTS = ("rope_scaling", "rope_parameters")
# fields without a default (transformers' would not describe the weights: refuse instead)
_REQUIRED = {gpt2: ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"),
             llama: ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size"),
             t5: (),
             gemma: ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size"),
             moe: ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "intermediate_size")}
_REQUIRED[olmo2] = _REQUIRED[deepseek] = _REQUIRED[llama]
_REQUIRED[gpt_oss] = _REQUIRED[llama] + ("num_local_experts",)
_REQUIRED[phi3] = _REQUIRED[llama]


def _value_problem(key: str, v) -> str | None:
    """What is wrong with value `v` of config field `key` (None: its type and range are right
    or the field is not one the families read)."""
    if key in _POSITIONS and type(v) is int and v > MAX_POSITIONS:
        return f"at most {MAX_POSITIONS:,} positions (2**24, past any real model's context)"
    if key in _COUNTS and not (type(v) is int and 1 <= v <= MAX_COUNT):
        return "an integer >= 1 (below 2**31)"
    if key in _NUMBERS:
        try:
            ok = type(v) in (int, float) and math.isfinite(v)
        except OverflowError:  # an int past float range
            ok = False
        return None if ok else "a finite number"
    if key in _FLAGS and type(v) is not bool:
        return "true or false"
    if key in _NAMES and type(v) is not str:
        return "a string"
    return None


def _field_problem(d: dict, tensor_count: int | None) -> str | None:
    """The first field of config.json dict `d` a family would misread: missing (`_REQUIRED`),
    the wrong JSON type or range, a RoPE scaling that is not an object, a layer count above
    `tensor_count` (the tensors the weight files hold: each layer has some), as a message
    naming the field; None when there is none."""
    fam = FAMILIES[d["model_type"]]
    for key in _REQUIRED[fam]:
        if d.get(key) is None:
            return f"has no {key}, which a {d['model_type']} model needs"
    nested = [(k, d[k]) for k in _ROPE_DICTS if d.get(k) is not None]
    for key, v in nested:
        if type(v) is not dict:
            return f"{key} is {v!r}, not an object"
    for where, fields in [("", d)] + [(f"{k}.", v) for k, v in nested]:
        for key, v in fields.items():
            want = None if v is None else _value_problem(key, v)
            if want:
                shown = repr(v) if len(repr(v)) < 80 else repr(v)[:80] + "..."
                return f"{where}{key} is {shown} ({type(v).__name__}), not {want}"
    if tensor_count is not None:
        for key in _LAYER_COUNTS:
            if d.get(key, 0) > tensor_count:
                return (f"{key} is {d[key]:,}, but the weight files hold {tensor_count:,} "
                        f"tensors in all; the config does not describe these weights")
    return None


def config_from_hf(d: dict, tensor_count: int | None = None) -> ModelConfig:
    """Our `ModelConfig` for an HF `config.json` dict. Raises `HFConversionError` naming the
    unsupported, missing or mistyped field (`_field_problem`; with `tensor_count`, the
    number of tensors in the weight files, also a layer count above it)."""
    mt = d.get("model_type")
    if type(mt) is not str or mt not in FAMILIES:
        raise HFConversionError(
            f"config.json model_type {mt!r} is not supported; supported: {sorted(FAMILIES)}")
    problem = _field_problem(d, tensor_count)
    if problem:
        raise HFConversionError(f"config.json {problem}; correct it, or use the model's own "
                                f"config.json")
    d = {k: v for k, v in d.items() if v is not None}
    archs = d.get("architectures") or []
    if type(archs) is not list or not all(type(a) is str for a in archs):
        raise HFConversionError(f"config.json architectures {archs!r} is not a list of names")
    known = set(FAMILIES[mt].ARCHITECTURES.values())
    bad = [a for a in archs if a not in known]
    if bad:
        raise HFConversionError(f"config.json architectures {bad} is not supported for "
                                f"model_type {mt!r} (supported: {sorted(known)})")
    for field in _MOE_FIELDS if FAMILIES[mt] not in (moe, deepseek, gpt_oss) else ():
        if d.get(field):
            raise HFConversionError(f"config.json {field}={d[field]}: mixture-of-experts models "
                                    f"are not supported")
    quant_scheme(d)  # GPTQ / AWQ 4-bit and FP8 read (models/hf/quantized.py), others refused
    try:
        config = FAMILIES[mt].config_from_hf(d)
    except HFConversionError:
        raise
    except KeyError as e:  # a field inside an object (rope_scaling's factor, ...)
        raise HFConversionError(f"config.json has no {e.args[0]!r} field, which this {mt} "
                                f"config needs; use the model's own config.json") from None
    except (TypeError, ValueError) as e:
        raise HFConversionError(f"config.json cannot be read as a {mt} config "
                                f"({type(e).__name__}: {e}); use the model's own config.json"
                                ) from None
    try:
        config.validate()
    except ConfigError as e:
        raise HFConversionError(f"config.json of this {mt} model: {e}") from None
    return config


def open_checked(path: str, check_config: Callable[[ModelConfig], None] | None = None,
                 log: Callable[[str], None] | None = None, quantization: str = "none"):
    """`(HFSource, ModelConfig)` of the HF folder or `.gguf` file `path` (models/hf/files.py
    `open_hf`; or an `HFSource` already opened, e.g. a loader's dict of low-bit tensors),
    the config checked (`config_from_hf`, then `check_config(config)` if given:
    infer.py's "does it split over this tp") and held against the weight files
    (`check_weights`) before anything is allocated. `log`, if given, is told what is being
    read, with the model's size (`ModelConfig.describe`) once the config is checked (rank 0 of
    infer.py, tools/convert_hf.py; see `open_hf`). `path` may be an `HFSource` already
    opened. `quantization`: "keep" reads a GGUF file's low-bit blocks and a GPTQ/AWQ folder's
    int4 layers as `QuantizedWeight` values, "none" de-quantizes them (`open_hf`). Raises
    `FileNotFoundError` or `HFConversionError` naming the file, the field and the fix (and
    what `check_config` raises)."""
    from .files import HFSource, open_hf

    src = path if isinstance(path, HFSource) else open_hf(path, log, quantization)
    try:
        config = config_from_hf(src.config, None if src.kind == "gguf" else len(src.names))
    except HFConversionError as e:
        raise HFConversionError(f"{src.path}: {e}") from None
    if FAMILIES[src.config["model_type"]] is deepseek:  # an MTP layer only if the files hold one
        config = deepseek.settle_mtp(config, src.names)
    if check_config is not None:
        check_config(config)
    if log is not None:
        scheme = quant_scheme(src.config)
        log(f"loading {src.config['model_type']} from {path} ({src.kind}"
            f"{', ' + scheme.describe() if scheme else ''}): {config.describe()}")
    check_weights(config, src)
    return src, config


def hf_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """`{HF tensor name: dense shape}` of every HF weight of `c`, in write order, computed on
    the meta device (no memory; on any grid whose tp the model splits over: the dense shapes
    are rebuilt from the shards', replicated KV heads included)."""
    from layers.sharding import full_shape, persistent_buffers

    from models import model_class

    kw = {} if c.is_encoder_decoder else {"kv_replication": True}
    with torch.device("meta"):
        model = model_class(c)(c, **kw)
        params = dict(model.named_parameters())
    dense = {name: torch.empty(b.shape, device="meta")  # the router's expert_bias
             for name, b in persistent_buffers(model)}
    for name, p in params.items():
        shape = list(full_shape(p))
        if getattr(p, "full_rows", None):  # the real vocabulary, not the padded one
            shape[0] = p.full_rows
        if getattr(p, "expert_parallel", False):  # one tensor per expert (checkpoint/keys.py)
            head, _, tail = name.rpartition(".experts.")
            for e in range(shape[0]):
                dense[f"{head}.experts.{e}.{tail}"] = torch.empty(shape[1:], device="meta")
            continue
        dense[name] = torch.empty(shape, device="meta")
    return {n: tuple(t.shape) for n, t in to_hf(c, dense.__getitem__)}


def check_weights(c: ModelConfig, src) -> None:
    """Refuse (`HFConversionError`) config `c` when the weight files of `src` (an `HFSource`)
    cannot back it, before any model or tensor is allocated: a tensor missing or unused
    (`to_native`), or a shape in a file's header other than the one `c` needs (`hf_shapes`).
    A GGUF file's tensors are dequantized by transformers into the shapes of this same config;
    there the parameters are held against the file's size at 1.5 bits a weight (below the
    smallest GGUF quantization), as transformers would build them all in float32."""
    model_type = src.config["model_type"]
    fix = "the config does not describe these weights; use the model's own config.json"
    if src.kind == "gguf":
        size, params = os.path.getsize(src.path), c.num_parameters()
        if params > size * 8 * 2 // 3:
            raise HFConversionError(
                f"{src.path}: its config ({c.num_layers} layers, hidden {c.hidden_size}, ffn "
                f"{c.ffn_hidden_size}, vocab {c.vocab_size}) has {params:,} parameters, more "
                f"than {size:,} bytes hold at 1.5 bits each (nothing was allocated); {fix}")
    to_native(c, model_type, src.get, src.names)  # names: missing or unused tensors
    if src.kind == "gguf":
        return
    spelled = {FAMILIES[model_type].normalize(n): n for n in src.names}
    for name, want in hf_shapes(c).items():  # every name is there (to_native checked)
        have = src.shape(spelled[name])
        if have != want:
            raise HFConversionError(
                f"{src.path}: tensor {spelled[name]!r} has shape {list(have)} in the weight "
                f"files, config.json needs {list(want)} (nothing was allocated); {fix}")


def family_for(c: ModelConfig):
    """The family module that can represent `c` in HF form; `HFConversionError` if none."""
    if c.multi_latent_attention:
        why = deepseek.conditions(c)
        if why:
            raise HFConversionError(f"this multi-latent attention model has no Hugging Face "
                                    f"equivalent (DeepSeek-V3): {'; '.join(why)}")
        return deepseek
    if c.softmax_type == "learnable":
        why = gpt_oss.conditions(c)
        if why:
            raise HFConversionError(f"this model with attention sinks has no Hugging Face "
                                    f"equivalent (gpt-oss): {'; '.join(why)}")
        return gpt_oss
    if c.num_moe_experts:
        why = moe.conditions(c)
        if why:
            raise HFConversionError(
                f"this mixture-of-experts model has no Hugging Face equivalent (Mixtral, "
                f"Qwen2-MoE, Qwen3-MoE, OLMoE): {'; '.join(why)}")
        return moe
    # the family the model was imported from, when another could also represent it (a
    # Phi-3 is a Llama with fused files: models/hf/phi3.py)
    hint = c.extra.get("hf_model_type") if type(c.extra) is dict else None  # untrusted
    hinted = FAMILIES.get(hint) if type(hint) is str else None
    if hinted is not None and not hinted.conditions(c):
        return hinted
    reasons = {}
    for fam in (gpt2, llama, phi3, olmo2, t5, gemma):
        why = fam.conditions(c)
        if not why:
            return fam
        reasons[fam.__name__.rsplit(".", 1)[-1]] = why
    raise HFConversionError("this model has no Hugging Face equivalent: " + "; ".join(
        f"not {name}: {', '.join(why)}" for name, why in reasons.items()))


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (with `model_type`, `architectures`) for `c`."""
    return family_for(c).config_to_hf(c)


def rules_for(c: ModelConfig, model_type: str | None = None) -> list[Rule]:
    fam = FAMILIES[model_type] if model_type else family_for(c)
    return fam.rules(c)


def to_native(c: ModelConfig, model_type: str, get: Callable[[str], torch.Tensor],
              names: Iterable[str]) -> dict[str, Callable[[], torch.Tensor]]:
    """`{our name: function -> dense tensor}` for every parameter of `c`, reading HF tensors
    with `get` only when called (streaming). `names` are the tensor names of the HF files.

    Checked before anything is read: raises `HFConversionError` for a missing tensor (e.g.
    an untied model without lm_head.weight) and for tensors the model would not use.
    """
    fam = FAMILIES[model_type]
    spelled = {fam.normalize(n): n for n in names}
    out, used = {}, set()
    get = _last_kept(get, getattr(fam, "STACKED", ()))
    for rule in fam.rules(c):
        missing = [n for n in rule.hf if n not in spelled]
        if missing:
            raise HFConversionError(
                f"the checkpoint has no tensor {missing[0]!r}, which this {model_type} config "
                f"needs (for our {rule.native}); the weights do not match config.json")
        used.update(rule.hf)
        out[rule.native] = (lambda rule=rule: rule.to_native([get(spelled[n]) for n in rule.hf]))
    tied = {"lm_head.weight"} if not c.untie_embeddings_and_output_weights else set()
    extra = sorted(n for n in set(spelled) - used - tied if not n.endswith(fam.IGNORED_SUFFIXES))
    if extra:
        raise HFConversionError(
            f"the checkpoint holds {len(extra)} tensor(s) this {model_type} config does not "
            f"use, e.g. {extra[:3]}; refusing to drop weights silently (is config.json the "
            f"right one?)")
    return out


def _last_kept(get: Callable[[str], torch.Tensor], suffixes: tuple[str, ...]):
    """`get`, keeping the last tensor read whose name ends with one of `suffixes` (a family's
    stacked experts, which one rule per expert slices: read once for all of them)."""
    if not suffixes:
        return get
    last: dict = {}

    def read(name: str):
        if not name.endswith(suffixes):
            return get(name)
        if name not in last:
            last.clear()
            last[name] = get(name)
        return last[name]
    return read


def to_hf(c: ModelConfig, get: Callable[[str], torch.Tensor]
          ) -> Iterator[tuple[str, torch.Tensor]]:
    """`(HF name, tensor)` for every HF weight of `c`, reading our dense tensors with `get`.
    Consecutive rules giving parts of one HF tensor (the slices of stacked experts, each
    `[1, ...]`: models/hf/gpt_oss.py) are joined on dim 0 into it."""
    name, parts = None, []
    for rule in family_for(c).rules(c):
        for hf, t in zip(rule.hf, rule.to_hf(get(rule.native))):
            if hf == name:
                parts.append(t)
                continue
            if parts:
                yield name, parts[0] if len(parts) == 1 else torch.cat(parts)
            name, parts = hf, [t]
    if parts:
        yield name, parts[0] if len(parts) == 1 else torch.cat(parts)
