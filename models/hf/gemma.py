"""Gemma family: Gemma3ForCausalLM (gemma3_text), Gemma2ForCausalLM (gemma2) <-> GPTModel.

Both are RMSNorm decoders with rotate-half RoPE and grouped-query attention, and differ from
Llama in ways that are ModelConfig fields here:
- every norm scales by `(1 + weight)` in float32 (`layernorm_zero_centered_gamma`; HF stores
  the zero-centred weight, so the tensors map unchanged);
- word embeddings times sqrt(hidden_size) in the embedding's dtype (`apply_embedding_scaling`);
- GeGLU with the tanh GeLU (`hidden_activation` gelu_pytorch_tanh: our "geglu");
- "sandwich" norms: input_layernorm before attention and post_attention_layernorm on its
  output, pre_feedforward_layernorm before the MLP and post_feedforward_layernorm on its output
  (`post_self_attn_layernorm`, `post_mlp_layernorm`; HF's post_attention_layernorm is NOT
  Llama's pre-MLP norm);
- scores scaled by `query_pre_attn_scalar ** -0.5` (`softmax_scale`);
- interleaved sliding-window and global layers (`layer_types`, or the older
  `sliding_window_pattern`: every Nth layer global), HF's `sliding_window` W = our
  `window_size` (W - 1, 0) on the layers `window_attn_skip_freq` marks 1;
- Gemma 2: attention and final logits soft-capped (`attn_logit_softcapping`,
  `final_logit_softcapping`), one RoPE base;
- Gemma 3: q/k RMSNorms per head before RoPE (`qk_layernorm`, zero-centred too), the sliding
  layers' own RoPE base `rope_local_base_freq` (unscaled) while `rope_theta` and any
  linear / llama3 scaling belong to the global layers (transformers' per-layer-type
  `rope_parameters`).

Not built, refused naming the field: `use_bidirectional_attention` (EmbeddingGemma),
`attention_bias`, Gemma 3's `attn_logit_softcapping` (transformers' Gemma 3 ignores it; its
`final_logit_softcapping` is applied and supported), other activations, RoPE types other than default / linear / llama3 on the
global layers or any scaling on the sliding ones; the multimodal Gemma3ForConditionalGeneration
(model_type gemma3) is not a text family here.
"""
from __future__ import annotations

from layers.attention import LAYER_TYPES
from models.config import ModelConfig

from .llama import _sliding_layers, attention_rules, rope_scaling_fields, rope_scaling_to_hf, \
    window_fields
from .rules import HFConversionError, Rule, concat, same

MODEL_TYPES = ("gemma3_text", "gemma2")
ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")  # transformers' tanh GeLUs
_PATTERN_DEFAULT = {"gemma3_text": 6, "gemma2": 2}  # transformers' sliding_window_pattern


def _rope(d: dict, mt: str) -> tuple[float, dict | None, float | None]:
    """(global theta, global scaling dict or None, local theta or None) of a config dict of
    transformers 4 (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) or 5
    (`rope_parameters`, per layer type for Gemma 3)."""
    params = d.get("rope_parameters") or {}
    if mt == "gemma3_text" and (LAYER_TYPES[0] in params or LAYER_TYPES[1] in params):
        full, local = params.get(LAYER_TYPES[0]) or {}, params.get(LAYER_TYPES[1]) or {}
        for name, p in ((LAYER_TYPES[0], full), (LAYER_TYPES[1], local)):
            if type(p) is not dict:
                raise HFConversionError(f"config.json rope_parameters.{name} is {p!r}, not an "
                                        f"object")
    else:
        full, local = dict(params), {}
        if d.get("rope_scaling"):
            full.update(d["rope_scaling"])
    theta = full.get("rope_theta", d.get("rope_theta", 1e6 if mt == "gemma3_text" else 1e4))
    local_theta = local.get("rope_theta", d.get("rope_local_base_freq", 1e4))
    for what, v in (("rope_theta", theta), ("rope_local_base_freq", local_theta)):
        if type(v) not in (int, float) or not v > 0:
            raise HFConversionError(f"config.json {what} {v!r} must be a positive number")
    kind = local.get("rope_type", local.get("type", "default"))
    if kind not in (None, "default"):
        raise HFConversionError(f"config.json rope_parameters.sliding_attention rope_type "
                                f"{kind!r} is not supported (the sliding layers' RoPE is "
                                f"unscaled here)")
    kind = full.get("rope_type", full.get("type", "default"))
    scaling = None if kind in (None, "default") else {**full, "rope_type": kind}
    return float(theta), scaling, (float(local_theta) if mt == "gemma3_text" else None)


def _layer_types(d: dict, mt: str, num_layers: int) -> list[int]:
    """1 (sliding) or 0 (global) per layer, as transformers reads `layer_types` or, without
    it, `sliding_window_pattern` N (layer i slides unless (i + 1) % N == 0)."""
    types = d.get("layer_types")
    if types is None:
        n = d.get("sliding_window_pattern", _PATTERN_DEFAULT[mt])
        if type(n) is not int or n < 1:
            raise HFConversionError(f"config.json sliding_window_pattern {n!r} must be an "
                                    f"integer >= 1")
        return [int((i + 1) % n != 0) for i in range(num_layers)]
    if type(types) is not list or len(types) != num_layers or \
            any(t not in LAYER_TYPES for t in types):
        raise HFConversionError(f"config.json layer_types must list {num_layers} entries "
                                f"(num_hidden_layers), each one of {LAYER_TYPES}")
    return [LAYER_TYPES.index(t) for t in types]


def _refusals(d: dict, mt: str) -> None:
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise HFConversionError(f"config.json hidden_activation {act!r} is not supported for "
                                f"{mt} (only the tanh GeLU, gelu_pytorch_tanh: GeGLU)")
    if d.get("use_bidirectional_attention"):
        raise HFConversionError(f"config.json use_bidirectional_attention=true (an encoder, "
                                f"EmbeddingGemma) is not supported; only causal {mt} models")
    if d.get("attention_bias"):
        raise HFConversionError(f"config.json attention_bias=true is not supported for {mt} "
                                f"(biases on q/k/v/o without MLP biases)")
    if mt == "gemma3_text" and d.get("attn_logit_softcapping") is not None:
        raise HFConversionError(
            f"config.json attn_logit_softcapping={d['attn_logit_softcapping']} is not supported "
            f"for gemma3_text: transformers' Gemma 3 attention does not apply it (only Gemma 2 "
            f"does), so no model was trained with it; set it to null")
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        v = d.get(key)
        if v is not None and not (type(v) in (int, float) and v > 0):
            raise HFConversionError(f"config.json {key} {v!r} must be a positive number "
                                    f"(or null)")


def config_from_hf(d: dict) -> ModelConfig:
    """`ModelConfig` of a Gemma 3 text / Gemma 2 `config.json` dict; `HFConversionError` for
    any field this model cannot represent."""
    mt = d["model_type"]
    _refusals(d, mt)
    heads, hidden, layers = d["num_attention_heads"], d["hidden_size"], d["num_hidden_layers"]
    head_dim = d.get("head_dim") or hidden // heads
    theta, scaling, local_theta = _rope(d, mt)
    if mt == "gemma2" and scaling is not None:
        raise HFConversionError(f"config.json rope type {scaling['rope_type']!r} is not "
                                f"supported for gemma2 (Gemma 2 has no RoPE scaling)")
    slides = _layer_types(d, mt, layers)
    window = window_fields(d.get("sliding_window", 4096), slides)
    if window:
        window["rope_local_base_freq"] = local_theta
    max_pos = int(d.get("max_position_embeddings", 8192))
    qpas = d.get("query_pre_attn_scalar", 256)
    return ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=d.get("num_key_value_heads") or heads, ffn_hidden_size=d[
            "intermediate_size"], kv_channels=head_dim, seq_length=min(max_pos, 4096),
        max_position_embeddings=max_pos, vocab_size=d["vocab_size"],
        position_embedding_type="rope", rotary_base=theta, normalization="RMSNorm",
        layernorm_epsilon=float(d.get("rms_norm_eps", 1e-6)), activation="geglu",
        add_bias_linear=False, add_qkv_bias=False, layernorm_zero_centered_gamma=True,
        post_self_attn_layernorm=True, post_mlp_layernorm=True, apply_embedding_scaling=True,
        softmax_scale=float(qpas) ** -0.5, qk_layernorm=mt == "gemma3_text",
        attn_logit_softcapping=_float_or_none(d.get("attn_logit_softcapping")),
        final_logit_softcapping=_float_or_none(d.get("final_logit_softcapping")),
        untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", True),
        init_method_std=float(d.get("initializer_range", 0.02)),
        attention_dropout=float(d.get("attention_dropout") or 0.0),
        **rope_scaling_fields(scaling), **window)


def _float_or_none(v):
    return None if v is None else float(v)


def normalize(name: str) -> str:
    return name


def model_type_for(c: ModelConfig) -> str:
    return "gemma3_text" if c.qk_layernorm else "gemma2"


def _query_pre_attn_scalar(c: ModelConfig):
    """HF's query_pre_attn_scalar q with q ** -0.5 == softmax_scale (an int when one is)."""
    q = c.softmax_scale ** -2
    return round(q) if round(q) ** -0.5 == c.softmax_scale else q


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (model_type included) for `c`."""
    mt = model_type_for(c)
    slides = _sliding_layers(c)
    d = dict(model_type=mt, architectures=[ARCHITECTURES[mt]], vocab_size=c.vocab_size,
             hidden_size=c.hidden_size, intermediate_size=c.ffn_hidden_size,
             num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
             num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels,
             hidden_activation="gelu_pytorch_tanh",
             max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon,
             initializer_range=c.init_method_std, attention_bias=False,
             tie_word_embeddings=not c.untie_embeddings_and_output_weights,
             attention_dropout=c.attention_dropout,
             query_pre_attn_scalar=_query_pre_attn_scalar(c),
             attn_logit_softcapping=c.attn_logit_softcapping,
             final_logit_softcapping=c.final_logit_softcapping,
             layer_types=[LAYER_TYPES[x] for x in slides],
             sliding_window=c.window_size[0] + 1 if c.window_size is not None else 4096)
    full = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rope_scaling_type is not None:
        full.update(rope_scaling_to_hf(c))
    if mt == "gemma2":
        d["rope_parameters"] = full
    else:
        local = c.rope_local_base_freq if c.rope_local_base_freq is not None else c.rotary_base
        d["rope_parameters"] = {LAYER_TYPES[1]: {"rope_type": "default", "rope_theta": local},
                                LAYER_TYPES[0]: full}
    return d


def conditions(c: ModelConfig) -> list[str]:
    """Why `c` cannot be exported as a Gemma-family model (empty: it can)."""
    want = dict(position_embedding_type="rope", normalization="RMSNorm", activation="geglu",
                layernorm_zero_centered_gamma=True, post_self_attn_layernorm=True,
                post_mlp_layernorm=True, apply_embedding_scaling=True, add_bias_linear=False,
                add_qkv_bias=False, qk_norm_over_heads=False, pre_layernorm=True)
    out = [f"{k}={getattr(c, k)!r} (Gemma has {v!r})" for k, v in want.items()
           if getattr(c, k) != v]
    if c.softmax_scale is None:
        out.append("softmax_scale unset (Gemma gives query_pre_attn_scalar)")
    if c.qk_layernorm and c.attn_logit_softcapping is not None:
        out.append("attn_logit_softcapping with qk_layernorm (Gemma 3 has no soft-capping; "
                   "Gemma 2 no q/k norms)")
    if not c.qk_layernorm and c.rope_local_base_freq is not None:
        out.append("rope_local_base_freq without qk_layernorm (Gemma 2 has one RoPE base)")
    if not c.qk_layernorm and c.rope_scaling_type is not None:
        out.append("RoPE scaling without qk_layernorm (Gemma 2 has none)")
    return out


def rules(c: ModelConfig) -> list[Rule]:
    """The conversion table of `c` (see models/hf/rules.py)."""
    out = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(c.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        out += [same(ours + "input_layernorm.weight", hf + "input_layernorm.weight"),
                *attention_rules(c, ours, hf + "self_attn."),
                same(ours + "post_self_attn_layernorm.weight",
                     hf + "post_attention_layernorm.weight"),
                same(ours + "pre_mlp_layernorm.weight", hf + "pre_feedforward_layernorm.weight"),
                concat(ours + "mlp.linear_fc1.weight",
                       (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")),
                same(ours + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight"),
                same(ours + "post_mlp_layernorm.weight",
                     hf + "post_feedforward_layernorm.weight")]
    out.append(same("decoder.final_layernorm.weight", "model.norm.weight"))
    if c.untie_embeddings_and_output_weights:
        out.append(same("output_layer.weight", "lm_head.weight"))
    return out
