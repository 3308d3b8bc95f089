"""Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM <->
GPTModel.

All four are pre-norm RMSNorm decoders with rotate-half RoPE (the layout our RotaryEmbedding
uses, so q/k need no permutation), SwiGLU MLPs and grouped-query attention. They differ in:
Qwen2 has q/k/v biases only; Mistral may have a sliding window on every layer, Qwen2 on the
layers from `max_window_layers` on (or those its `layer_types` call "sliding_attention"); Llama
may have biases on all attention projections (`attention_bias`) and MLP (`mlp_bias`), and
llama3/linear RoPE scaling. Qwen3 is Qwen2 without biases and with an RMSNorm on each query
and key head before RoPE (`q_norm` / `k_norm`, one `[head_dim]` weight each: our
`qk_layernorm`); its head_dim defaults to 128, not hidden / heads.

Sliding windows: HF's `sliding_window` W (a query sees itself and the W - 1 keys before it) is
our `window_size` (W - 1, 0); which layers slide is `window_attn_skip_freq` (None: all of
them; else one 1 (sliding) or 0 (full) per layer, HF's `layer_types`).
"""
from __future__ import annotations

from layers.attention import LAYER_TYPES
from models.config import ModelConfig

from .rules import HFConversionError, Rule, concat, qkv, same

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_QWEN = ("qwen2", "qwen3")  # sliding windows from use_sliding_window and layer_types
# tensors some HF files carry that are buffers, not weights
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _rope(d: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from a config dict of transformers 4 (`rope_theta`,
    `rope_scaling`) or 5 (`rope_parameters`)."""
    params = d.get("rope_parameters") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return float(theta), (None if kind in (None, "default") else {**scaling, "rope_type": kind})


def config_from_hf(d: dict) -> ModelConfig:
    """`ModelConfig` of a Llama/Mistral/Qwen2 `config.json` dict; `HFConversionError` for any
    field this model cannot represent."""
    mt = d["model_type"]
    heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    kv_heads = d.get("num_key_value_heads") or heads
    head_dim = d.get("head_dim") or (128 if mt == "qwen3" else hidden // heads)
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        raise HFConversionError(f"config.json hidden_act {d['hidden_act']!r} is not supported "
                                f"for {mt} (only silu, i.e. SwiGLU)")
    theta, scaling = _rope(d)
    rope = rope_scaling_fields(scaling)
    qkv_bias, linear_bias = False, False
    if mt == "qwen2":
        qkv_bias = True
    elif mt == "qwen3" and d.get("attention_bias", False) is not False:
        raise HFConversionError(
            f"config.json attention_bias={d['attention_bias']!r} is not supported for qwen3 "
            f"(biases on q/k/v and o_proj but not the MLP); convert a model without them")
    elif mt == "llama":
        attn, mlp = bool(d.get("attention_bias", False)), bool(d.get("mlp_bias", False))
        if attn != mlp:
            raise HFConversionError(
                f"config.json attention_bias={attn} with mlp_bias={mlp} is not supported: "
                f"biases are either on every linear layer or on none (add_bias_linear)")
        qkv_bias = linear_bias = attn
    max_pos = int(d.get("max_position_embeddings", 2048))
    seq = min(max_pos, 4096)
    return ModelConfig(
        num_layers=d["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=kv_heads, ffn_hidden_size=d["intermediate_size"], kv_channels=head_dim,
        seq_length=seq, max_position_embeddings=max_pos, vocab_size=d["vocab_size"],
        position_embedding_type="rope", rotary_base=theta, normalization="RMSNorm",
        layernorm_epsilon=float(d.get("rms_norm_eps", 1e-6)), activation="swiglu",
        add_bias_linear=linear_bias, add_qkv_bias=qkv_bias,
        untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
        init_method_std=float(d.get("initializer_range", 0.02)), qk_layernorm=mt == "qwen3",
        **rope,
        **_window_from_hf(d, mt, d["num_hidden_layers"]))


def _window_from_hf(d: dict, mt: str, num_layers: int) -> dict:
    """`window_size` / `window_attn_skip_freq` of a config dict, as transformers reads it:
    Mistral slides every layer when `sliding_window` is set; Qwen2 only with
    `use_sliding_window`, the layers its `layer_types` name "sliding_attention" (by default
    those from `max_window_layers` on). Llama has no window."""
    w, use = d.get("sliding_window"), d.get("use_sliding_window", False)
    if mt in _QWEN and type(use) is not bool:
        raise HFConversionError(f"config.json use_sliding_window {use!r} must be true or false")
    if mt == "llama" or w is None or (mt in _QWEN and not use):
        return {}
    if type(w) is not int or w < 1:
        raise HFConversionError(f"config.json sliding_window {w!r} must be a positive integer "
                                f"(tokens a query sees, itself included)")
    if mt == "mistral":  # MistralConfig ignores layer_types: every layer slides
        return dict(window_size=(w - 1, 0))
    types = d.get("layer_types")
    if types is None:
        first = d.get("max_window_layers", 28)  # transformers' default
        if type(first) is not int or first < 0:
            raise HFConversionError(f"config.json max_window_layers {first!r} must be an "
                                    f"integer >= 0")
        types = [LAYER_TYPES[i >= first] for i in range(num_layers)]
    if type(types) is not list or len(types) != num_layers or \
            any(t not in LAYER_TYPES for t in types):
        raise HFConversionError(f"config.json layer_types must list {num_layers} entries "
                                f"(num_hidden_layers), each one of {LAYER_TYPES}")
    return window_fields(w, [LAYER_TYPES.index(t) for t in types])


def window_fields(w, slides: list[int]) -> dict:
    """`window_size` / `window_attn_skip_freq` of HF's `sliding_window` `w` on the layers
    `slides` marks 1 (0: full attention); {} when none slides. `HFConversionError` for a `w`
    that is not a positive integer."""
    if not any(slides):
        return {}
    if type(w) is not int or w < 1:
        raise HFConversionError(f"config.json sliding_window {w!r} must be a positive integer "
                                f"(tokens a query sees, itself included)")
    return dict(window_size=(w - 1, 0), window_attn_skip_freq=None if all(slides) else slides)


def _sliding_layers(c: ModelConfig) -> list[int]:
    """1 for each layer with a sliding window, 0 for each with full attention."""
    return [int(c.layer_window_size(i) is not None) for i in range(c.num_layers)]


def normalize(name: str) -> str:
    return name


def model_type_for(c: ModelConfig) -> str:
    """The HF architecture that represents `c` exactly."""
    if c.qk_layernorm:
        return "qwen3"
    if c.add_qkv_bias and not c.add_bias_linear:
        return "qwen2"
    if c.window_size is not None:
        return "mistral"
    return "llama"


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (model_type included) for `c`."""
    mt = model_type_for(c)
    d = dict(model_type=mt, architectures=[ARCHITECTURES[mt]], vocab_size=c.vocab_size,
             hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
             num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
             num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels, hidden_act="silu",
             max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon,
             rope_theta=c.rotary_base, initializer_range=c.init_method_std,
             tie_word_embeddings=not c.untie_embeddings_and_output_weights,
             attention_dropout=c.attention_dropout)
    if c.rope_scaling_type is not None:
        d["rope_scaling"] = rope_scaling_to_hf(c)
    if mt == "llama":
        d.update(attention_bias=c.add_bias_linear, mlp_bias=c.add_bias_linear)
    elif mt == "mistral":
        d["sliding_window"] = c.window_size[0] + 1
    else:
        if mt == "qwen3":
            d["attention_bias"] = False  # conditions(): Qwen3 exports have no biases
        slides = _sliding_layers(c)
        d.update(use_sliding_window=c.window_size is not None, sliding_window=None,
                 layer_types=[LAYER_TYPES[x] for x in slides])
        if c.window_size is not None:  # layer_types rules (transformers >= 4.53); older
            # versions read max_window_layers: the first ones full, which is exact for that form
            d.update(sliding_window=c.window_size[0] + 1,
                     max_window_layers=next((i for i, x in enumerate(slides) if x), len(slides)))
    return d


def conditions(c: ModelConfig) -> list[str]:
    """Why `c` cannot be exported as a Llama-family model (empty: it can)."""
    want = dict(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu")
    out = [f"{k}={getattr(c, k)!r} (the Llama family has {v!r})" for k, v in want.items()
           if getattr(c, k) != v]
    if c.add_bias_linear and not c.add_qkv_bias:
        out.append("add_bias_linear without add_qkv_bias (no Llama-family model has that)")
    if c.qk_layernorm and (c.add_qkv_bias or c.qk_norm_over_heads):
        out.append("qk_layernorm with biases or over whole projections (Qwen3 has per-head q/k "
                   "norms and no biases)")
    if not c.pre_layernorm:
        out.append("pre_layernorm=False (the Llama family normalizes each sublayer's input)")
    out += [f"{k}=True (not in the Llama family)" for k in (
        "post_self_attn_layernorm", "post_mlp_layernorm", "layernorm_zero_centered_gamma",
        "apply_embedding_scaling") if getattr(c, k)]
    out += [f"{k}={getattr(c, k)!r} (not in the Llama family)" for k in (
        "softmax_scale", "attn_logit_softcapping", "final_logit_softcapping",
        "rope_local_base_freq") if getattr(c, k) is not None]
    if c.window_size is not None and c.add_bias_linear:
        out.append("window_size with biases on every linear layer (Llama has biases but no "
                   "sliding window)")
    elif c.window_size is not None and model_type_for(c) == "mistral" and \
            not all(_sliding_layers(c)):
        out.append(f"window_attn_skip_freq={c.window_attn_skip_freq!r} without q/k/v biases "
                   f"(Mistral slides every layer; only Qwen2, with q/k/v biases, has full ones)")
    return out


def rope_scaling_fields(scaling: dict | None) -> dict:
    """ModelConfig's rope_scaling_* fields of an HF RoPE scaling dict (`rope_type` linear or
    llama3; None: none); `HFConversionError` for another type."""
    if scaling is None:
        return {}
    kind = scaling["rope_type"]
    if kind == "linear":
        return dict(rope_scaling_type="linear", rope_scaling_factor=float(scaling["factor"]))
    if kind == "llama3":
        return dict(rope_scaling_type="llama3", rope_scaling_factor=float(scaling["factor"]),
                    rope_low_freq_factor=float(scaling["low_freq_factor"]),
                    rope_high_freq_factor=float(scaling["high_freq_factor"]),
                    rope_original_max_position_embeddings=int(
                        scaling["original_max_position_embeddings"]))
    raise HFConversionError(
        f"config.json rope_scaling type {kind!r} is not supported (supported: linear, "
        f"llama3); convert a model without it or with one of those")


def rope_scaling_to_hf(c: ModelConfig) -> dict:
    """The HF RoPE scaling dict (`rope_type`, `factor`, ...) of `c`'s rope_scaling_type."""
    if c.rope_scaling_type == "linear":
        return {"rope_type": "linear", "factor": c.rope_scaling_factor}
    return {"rope_type": "llama3", "factor": c.rope_scaling_factor,
            "low_freq_factor": c.rope_low_freq_factor,
            "high_freq_factor": c.rope_high_freq_factor,
            "original_max_position_embeddings": c.rope_original_max_position_embeddings}


def attention_rules(c: ModelConfig, ours: str, attn: str) -> list[Rule]:
    """q/k/v <-> our fused QKV, o_proj, and the per-head q/k norms (`qk_layernorm`) of one
    layer: `ours` our layer prefix, `attn` HF's `model.layers.<i>.self_attn.`."""
    out = [qkv(ours + "self_attention.linear_qkv.weight",
               (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
               c.num_query_groups, c.query_projection_size, c.kv_projection_size),
           same(ours + "self_attention.linear_proj.weight", attn + "o_proj.weight")]
    if c.qk_layernorm:
        out += [same(ours + "self_attention.q_layernorm.weight", attn + "q_norm.weight"),
                same(ours + "self_attention.k_layernorm.weight", attn + "k_norm.weight")]
    return out


def rules(c: ModelConfig) -> list[Rule]:
    """The conversion table of `c` (see models/hf/rules.py)."""
    out = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    q_rows, kv_rows = c.query_projection_size, c.kv_projection_size
    for i in range(c.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn = hf + "self_attn."
        out += [same(ours + "input_layernorm.weight", hf + "input_layernorm.weight"),
                *attention_rules(c, ours, attn),
                same(ours + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
                concat(ours + "mlp.linear_fc1.weight",
                       (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")),
                same(ours + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight")]
        if c.add_qkv_bias:
            out.append(qkv(ours + "self_attention.linear_qkv.bias",
                           (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                           c.num_query_groups, q_rows, kv_rows))
        if c.add_bias_linear:
            out += [same(ours + "self_attention.linear_proj.bias", attn + "o_proj.bias"),
                    concat(ours + "mlp.linear_fc1.bias",
                           (hf + "mlp.gate_proj.bias", hf + "mlp.up_proj.bias")),
                    same(ours + "mlp.linear_fc2.bias", hf + "mlp.down_proj.bias")]
    out.append(same("decoder.final_layernorm.weight", "model.norm.weight"))
    if c.untie_embeddings_and_output_weights:
        out.append(same("output_layer.weight", "lm_head.weight"))
    return out
