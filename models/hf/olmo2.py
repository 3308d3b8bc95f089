"""OLMo 2: Olmo2ForCausalLM <-> GPTModel.

A Llama-family decoder (SwiGLU, rotate-half RoPE, grouped-query attention, RMSNorm, no biases)
with its norms moved: none before attention and MLP (our `pre_layernorm` False), an RMSNorm on
each sublayer's output before the residual add (`post_self_attn_layernorm`,
`post_mlp_layernorm`), and an RMSNorm over the whole q and the whole k projection before RoPE
(`qk_layernorm` + `qk_norm_over_heads`: one weight `[heads * head_dim]` for q and
`[kv_heads * head_dim]` for k, split over TP with the heads; the sum of squares is all-reduced
over TP, layers/norm.py `ProjectionRMSNorm`).

The table is the Llama table renamed: HF's `post_attention_layernorm` is our
`post_self_attn_layernorm` (in Llama, our `pre_mlp_layernorm`), `post_feedforward_layernorm`
our `post_mlp_layernorm`; there is no `input_layernorm`. Config fields are Llama's (RoPE
scaling linear / llama3 included); `attention_bias` (biases on q/k/v/o but not the MLP) is
refused.
"""
from __future__ import annotations

import dataclasses

from models.config import ModelConfig

from . import llama
from .rules import HFConversionError, Rule, same

MODEL_TYPES = ("olmo2",)
ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM"}
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES
_NORMS = dict(qk_layernorm=True, qk_norm_over_heads=True, pre_layernorm=False,
              post_self_attn_layernorm=True, post_mlp_layernorm=True)


def normalize(name: str) -> str:
    return name


def config_from_hf(d: dict) -> ModelConfig:
    """`ModelConfig` of an OLMo 2 `config.json` dict; `HFConversionError` for what we lack."""
    if d.get("attention_bias", False) is not False:
        raise HFConversionError(
            f"config.json attention_bias={d['attention_bias']!r} is not supported for olmo2 "
            f"(biases on q/k/v and o_proj but not the MLP); convert a model without them")
    base = llama.config_from_hf({**d, "model_type": "llama", "attention_bias": False,
                                 "mlp_bias": False})
    return dataclasses.replace(base, **_NORMS)


def conditions(c: ModelConfig) -> list[str]:
    """Why `c` cannot be exported as an OLMo 2 model (empty: it can)."""
    out = [f"{k}={getattr(c, k)!r} (OLMo 2 has {v!r})" for k, v in _NORMS.items()
           if getattr(c, k) != v]
    if out:
        return out
    out = llama.conditions(_as_llama(c))
    if c.add_bias_linear or c.add_qkv_bias:
        out.append("biases (OLMo 2 has none)")
    if c.window_size is not None:
        out.append(f"window_size={c.window_size} (OLMo 2 has no sliding window)")
    return out


def _as_llama(c: ModelConfig) -> ModelConfig:
    """`c` with Llama's norms: what the shared Llama code reads."""
    return dataclasses.replace(c, qk_layernorm=False, qk_norm_over_heads=False,
                               pre_layernorm=True, post_self_attn_layernorm=False,
                               post_mlp_layernorm=False)


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (model_type included) for `c`."""
    d = llama.config_to_hf(_as_llama(c))
    d.pop("mlp_bias")
    # token ids: the tokenizer's and generation_config.json's (checkpoint/hf.py export_hf),
    # not Olmo2Config's defaults (ids of the original vocabulary, past a small one)
    return {**d, "model_type": "olmo2", "architectures": [ARCHITECTURES["olmo2"]],
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def rules(c: ModelConfig) -> list[Rule]:
    """Llama's table (models/hf/llama.py) with OLMo 2's norm names."""
    renamed = {"pre_mlp_layernorm.weight": "post_self_attn_layernorm.weight"}
    out = []
    for rule in llama.rules(c):  # q_norm / k_norm as Qwen3's, whole-projection shapes
        layer, _, tail = rule.native.rpartition("decoder.layers.")[2].partition(".")
        if tail == "input_layernorm.weight":
            continue
        if tail in renamed:
            rule = dataclasses.replace(rule, native=rule.native.replace(tail, renamed[tail]))
        out.append(rule)
        if tail == "mlp.linear_fc2.weight":
            out.append(same(f"decoder.layers.{layer}.post_mlp_layernorm.weight",
                            f"model.layers.{layer}.post_feedforward_layernorm.weight"))
    return out
