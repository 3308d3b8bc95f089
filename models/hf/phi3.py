"""Phi-3: Phi3ForCausalLM <-> GPTModel.

The network is Mistral's (pre-norm RMSNorm, SwiGLU, rotate-half RoPE, grouped-query
attention, no biases, a sliding window on every layer when `sliding_window` is set); the files
differ: q/k/v are one `qkv_proj` (rows: all query heads, then all K heads, then all V heads;
the named transform `fused_qkv` regroups them into our per-group layout) and the MLP's gate and
up are one `gate_up_proj` (`[gate; up]`, which is our `linear_fc1` as it is).

Since a Llama (or Mistral) model is the same network, the import records
`extra["hf_model_type"] = "phi3"` in the config, so the export writes Phi-3 again.

Refused, naming the field: `rope_scaling` / `rope_parameters` of type longrope (or its old
names su / yarn: Phi-3's 128k-context LongRoPE, per-frequency short/long factors; not built)
and a `partial_rotary_factor` other than 1.0 (RoPE on part of each head; not built).
"""
from __future__ import annotations

import dataclasses

from models.config import ModelConfig

from . import llama
from .rules import HFConversionError, Rule, fused_qkv, same

MODEL_TYPES = ("phi3",)
ARCHITECTURES = {"phi3": "Phi3ForCausalLM"}
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES
HINT = {"hf_model_type": "phi3"}  # ModelConfig.extra of an imported Phi-3


def normalize(name: str) -> str:
    return name


def config_from_hf(d: dict) -> ModelConfig:
    """`ModelConfig` of a Phi-3 `config.json` dict; `HFConversionError` for what we lack."""
    _, scaling = llama._rope(d)
    if scaling is not None:
        raise HFConversionError(
            f"config.json rope_scaling type {scaling['rope_type']!r} (Phi-3's long-context "
            f"LongRoPE, 'su') is not supported; convert a short-context Phi-3 (no rope_scaling)")
    for where in (d, d.get("rope_parameters") or {}, d.get("rope_scaling") or {}):
        factor = where.get("partial_rotary_factor")
        if factor is not None and factor != 1.0:
            raise HFConversionError(
                f"config.json partial_rotary_factor {factor!r} is not supported (RoPE on part "
                f"of each head); only 1.0 is")
    base = llama.config_from_hf({**d, "model_type": "mistral"})
    return dataclasses.replace(base, extra={**base.extra, **HINT})


def conditions(c: ModelConfig) -> list[str]:
    """Why `c` cannot be exported as a Phi-3 model (empty: it can)."""
    out = llama.conditions(c)
    if c.add_bias_linear or c.add_qkv_bias:
        out.append("biases (Phi-3 has none)")
    if c.qk_layernorm:
        out.append("qk_layernorm (Phi-3 has no q/k norms)")
    if c.window_size is not None and c.window_attn_skip_freq is not None:
        out.append("window_attn_skip_freq (Phi-3 slides every layer or none)")
    return out


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (model_type included) for `c`."""
    d = llama.config_to_hf(c)
    for key in ("attention_bias", "mlp_bias"):
        d.pop(key, None)
    d.setdefault("sliding_window", None)  # Phi3Config's default is a window; none: None
    # token ids: the tokenizer's and generation_config.json's (checkpoint/hf.py export_hf),
    # not Phi3Config's defaults (ids of the original vocabulary, past a small one)
    return {**d, "model_type": "phi3", "architectures": [ARCHITECTURES["phi3"]],
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def rules(c: ModelConfig) -> list[Rule]:
    """The conversion table of `c` (see models/hf/rules.py)."""
    out = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    for i in range(c.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        out += [same(ours + "input_layernorm.weight", hf + "input_layernorm.weight"),
                fused_qkv(ours + "self_attention.linear_qkv.weight",
                          hf + "self_attn.qkv_proj.weight", c.num_query_groups,
                          c.query_projection_size, c.kv_projection_size),
                same(ours + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight"),
                same(ours + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
                same(ours + "mlp.linear_fc1.weight", hf + "mlp.gate_up_proj.weight"),
                same(ours + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight")]
    out.append(same("decoder.final_layernorm.weight", "model.norm.weight"))
    if c.untie_embeddings_and_output_weights:
        out.append(same("output_layer.weight", "lm_head.weight"))
    return out
