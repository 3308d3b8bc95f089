"""gpt-oss family: GptOssForCausalLM (gpt_oss; OpenAI's gpt-oss-20b / -120b) <-> GPTModel
with attention sinks, alternating sliding-window and full layers, and a biased MoE.

- Attention: q/k/v/o projections with biases (our fused QKV and linear_proj, as Qwen2's),
  `self_attn.sinks [heads]` our `self_attention.sinks` (`softmax_type` "learnable");
  `layer_types` (default: even layers "sliding_attention") with `sliding_window` W are our
  `window_size` (W - 1, 0) on the layers `window_attn_skip_freq` marks 1.
- RoPE: `rope_parameters` of type yarn with `truncate` (gpt-oss: false, our
  `rope_yarn_truncate`), factor, original length, beta_fast / beta_slow.
- MoE on every layer: `mlp.router.weight [E, h]` / `mlp.router.bias [E]` (our router, logit
  bias from `add_bias_linear`), top-k softmax over the chosen logits; the experts stacked,
  `gate_up_proj [E, h, 2f]` with gate and up interleaved in its columns (gate at even, up at
  odd: transformers' `GptOssExperts._apply_gate`), `gate_up_proj_bias [E, 2f]` likewise,
  `down_proj [E, f, h]`, `down_proj_bias [E, h]`. Ours: per expert `linear_fc1 [2f, h]` as
  `[gate; up]` rows and `linear_fc2 [h, f]`, so import transposes and de-interleaves
  (exact; export re-interleaves). The gated unit is `quick_geglu` with
  `activation_func_clamp_value` swiglu_limit and `glu_linear_offset` 1 (swiglu_alpha must be
  1.702, quick GeLU's constant).
- MXFP4 checkpoints (`quantization_config` quant_method "mxfp4", the experts as
  `*_blocks` / `*_scales`): models/hf/mxfp4.py reads them as the float tensors above.

Each stacked HF expert tensor makes one rule per expert (`_stacked`); import reads the
stacked tensor once for all of them (`STACKED`: models/hf `to_native` keeps the last one),
export writes the experts' slices back as one tensor (`to_hf` joins consecutive parts).

Refused: `hidden_act` other than silu, `swiglu_alpha` other than 1.702, `attention_bias`
false, a `num_experts_per_tok` of 1 (a softmax over one chosen logit: every weight 1).
"""
from __future__ import annotations

import math

import torch

from layers.attention import LAYER_TYPES
from layers.mlp import QUICK_GELU_ALPHA
from models.config import ModelConfig

from . import llama
from .deepseek import _yarn_fields, rope_parameters_to_hf
from .rules import HFConversionError, Rule, same

MODEL_TYPES = ("gpt_oss",)
ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES
STACKED = (".experts.gate_up_proj", ".experts.gate_up_proj_bias", ".experts.down_proj",
           ".experts.down_proj_bias")
_OFFSET = 1.0  # transformers' (up + 1)


def _layer_types(d: dict, num_layers: int) -> list[int]:
    """1 (sliding) or 0 (full) per layer, as GptOssConfig reads `layer_types` (default: layer
    i slides when i is even)."""
    types = d.get("layer_types")
    if types is None:
        return [int(i % 2 == 0) for i in range(num_layers)]
    if type(types) is not list or len(types) != num_layers or \
            any(t not in LAYER_TYPES for t in types):
        raise HFConversionError(f"config.json layer_types must list {num_layers} entries "
                                f"(num_hidden_layers), each one of {LAYER_TYPES}")
    return [LAYER_TYPES.index(t) for t in types]


def config_from_hf(d: dict) -> ModelConfig:
    """`ModelConfig` of a gpt-oss `config.json` dict; `HFConversionError` for a field this
    model cannot represent."""
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        raise HFConversionError(f"config.json hidden_act {d['hidden_act']!r} is not supported "
                                f"for gpt_oss (its experts' gated unit is fixed)")
    alpha = d.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise HFConversionError(f"config.json swiglu_alpha {alpha!r} is not supported: the "
                                f"gated unit's sigmoid gain is quick GeLU's {QUICK_GELU_ALPHA}")
    limit = d.get("swiglu_limit", 7.0)
    if type(limit) not in (int, float) or not (math.isfinite(limit) and limit > 0):
        raise HFConversionError(f"config.json swiglu_limit {limit!r} must be a positive number")
    if d.get("attention_bias", True) is not True:
        raise HFConversionError("config.json attention_bias false is not supported for "
                                "gpt_oss (its projections, router and experts all have biases)")
    topk = d.get("num_experts_per_tok", 4)
    if topk == 1:
        raise HFConversionError("config.json num_experts_per_tok 1 is not supported: a softmax "
                                "over the one chosen logit gives every token the weight 1")
    theta, scaling = llama._rope(d)
    rope = {}
    if scaling is not None and scaling["rope_type"] == "yarn":
        truncate = scaling.get("truncate", True)
        if type(truncate) is not bool:
            raise HFConversionError(f"config.json rope_parameters truncate {truncate!r} must "
                                    f"be true or false")
        rope = _yarn_fields({**scaling, "truncate": True})
        rope["rope_yarn_truncate"] = truncate
    elif scaling is not None:
        rope = llama.rope_scaling_fields(scaling)
    layers, heads = d["num_hidden_layers"], d["num_attention_heads"]
    window = llama.window_fields(d.get("sliding_window", 128), _layer_types(d, layers))
    max_pos = int(d.get("max_position_embeddings", 131072))
    ffn = d["intermediate_size"]
    return ModelConfig(
        num_layers=layers, hidden_size=d["hidden_size"], num_attention_heads=heads,
        num_query_groups=d.get("num_key_value_heads") or heads, ffn_hidden_size=ffn,
        kv_channels=d.get("head_dim") or d["hidden_size"] // heads,
        seq_length=min(max_pos, 4096), max_position_embeddings=max_pos,
        vocab_size=d["vocab_size"], position_embedding_type="rope", rotary_base=theta,
        normalization="RMSNorm", layernorm_epsilon=float(d.get("rms_norm_eps", 1e-5)),
        activation="quick_geglu", activation_func_clamp_value=float(limit),
        glu_linear_offset=_OFFSET, add_bias_linear=True, add_qkv_bias=True,
        softmax_type="learnable",
        untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
        init_method_std=float(d.get("initializer_range", 0.02)),
        attention_dropout=float(d.get("attention_dropout", 0.0)),
        num_moe_experts=d["num_local_experts"], moe_router_topk=topk,
        moe_ffn_hidden_size=ffn,
        moe_aux_loss_coeff=float(d.get("router_aux_loss_coef", 0.0))
        if d.get("output_router_logits", False) else 0.0,
        **rope, **window)


def conditions(c: ModelConfig) -> list[str]:
    """Why `c` cannot be exported as gpt-oss (empty: it can)."""
    out = []
    want = dict(position_embedding_type="rope", normalization="RMSNorm",
                activation="quick_geglu", softmax_type="learnable", glu_linear_offset=_OFFSET,
                add_bias_linear=True, add_qkv_bias=True, moe_router_score_function="softmax",
                moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
                moe_expert_capacity_factor=None, moe_router_topk_scaling_factor=None,
                moe_router_enable_expert_bias=False, qk_layernorm=False, pre_layernorm=True,
                rope_local_base_freq=None, softmax_scale=None, attn_logit_softcapping=None,
                final_logit_softcapping=None)
    out += [f"{k}={getattr(c, k)!r} (gpt-oss has {v!r})" for k, v in want.items()
            if getattr(c, k) != v]
    if c.activation_func_clamp_value is None:
        out.append("no activation_func_clamp_value (gpt-oss clamps at swiglu_limit)")
    if not c.num_moe_experts or c.num_moe_layers() != c.num_layers:
        out.append("dense-MLP layers (every gpt-oss layer is MoE)")
    elif c.moe_ffn_hidden_size != c.ffn_hidden_size:
        out.append(f"moe_ffn_hidden_size {c.moe_ffn_hidden_size} != ffn_hidden_size "
                   f"{c.ffn_hidden_size} (gpt-oss has one intermediate_size)")
    if c.rope_scaling_type == "yarn" and (c.rope_mscale or c.rope_mscale_all_dim):
        out.append("YaRN mscale / mscale_all_dim (gpt-oss has neither)")
    for k in ("post_self_attn_layernorm", "post_mlp_layernorm", "layernorm_zero_centered_gamma",
              "apply_embedding_scaling", "multi_latent_attention"):
        if getattr(c, k):
            out.append(f"{k}=True (not in gpt-oss)")
    return out


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (model_type included) for `c`."""
    rope = rope_parameters_to_hf(c)
    if c.rope_scaling_type == "yarn":
        rope["truncate"] = c.rope_yarn_truncate
    slides = llama._sliding_layers(c)
    return dict(model_type="gpt_oss", architectures=[ARCHITECTURES["gpt_oss"]],
                vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                intermediate_size=c.moe_ffn_hidden_size, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_query_groups, head_dim=c.kv_channels,
                hidden_act="silu", max_position_embeddings=c.max_position_embeddings,
                rms_norm_eps=c.layernorm_epsilon, initializer_range=c.init_method_std,
                attention_bias=True, attention_dropout=c.attention_dropout,
                tie_word_embeddings=not c.untie_embeddings_and_output_weights,
                rope_parameters=rope, num_local_experts=c.num_moe_experts,
                num_experts_per_tok=c.moe_router_topk,
                swiglu_alpha=QUICK_GELU_ALPHA, swiglu_limit=c.activation_func_clamp_value,
                layer_types=[LAYER_TYPES[x] for x in slides],
                sliding_window=c.window_size[0] + 1 if c.window_size is not None else 128,
                output_router_logits=c.moe_aux_loss_coeff > 0,
                router_aux_loss_coef=c.moe_aux_loss_coeff or 0.001)


def normalize(name: str) -> str:
    return name


def _interleaved_to_halves(t: torch.Tensor) -> torch.Tensor:
    """Rows `[g0, u0, g1, u1, ...]` (dim 0) -> `[g0, g1, ...; u0, u1, ...]`."""
    return torch.cat([t[0::2], t[1::2]]).contiguous()


def _halves_to_interleaved(t: torch.Tensor) -> torch.Tensor:
    gate, up = t.chunk(2, 0)
    return torch.stack([gate, up], 1).reshape(t.shape).contiguous()


def _stacked(native: str, hf: str, e: int, to_ours, to_theirs) -> Rule:
    """Expert `e`'s `native` tensor from slice e of the stacked HF tensor `hf` (`to_ours` on
    the slice); export gives that slice as a `[1, ...]` part, joined with the other experts'
    by models/hf `to_hf`."""
    return Rule(native, (hf,), lambda ts: to_ours(ts[0][e]),
                lambda t: [to_theirs(t).unsqueeze(0)])


def _expert_rules(ours: str, hf: str, num_experts: int) -> list[Rule]:
    """One MoE layer's stacked experts (module docstring) as per-expert rules, grouped by HF
    tensor so that each stacked tensor is read and written in one piece."""
    def fc1_weight(x):  # [h, 2f] interleaved columns -> [2f, h] as [gate; up]
        return _interleaved_to_halves(x.t())

    def fc1_weight_back(t):
        return _halves_to_interleaved(t).t().contiguous()

    def plain_t(x):
        return x.t().contiguous()

    table = [("linear_fc1.weight", "gate_up_proj", fc1_weight, fc1_weight_back),
             ("linear_fc1.bias", "gate_up_proj_bias", _interleaved_to_halves,
              _halves_to_interleaved),
             ("linear_fc2.weight", "down_proj", plain_t, plain_t),
             ("linear_fc2.bias", "down_proj_bias", lambda x: x.clone(), lambda t: t)]
    return [_stacked(f"{ours}experts.{e}.{mine}", hf + "experts." + theirs, e, fwd, back)
            for mine, theirs, fwd, back in table for e in range(num_experts)]


def rules(c: ModelConfig) -> list[Rule]:
    """The conversion table of `c` (see models/hf/rules.py)."""
    out = [same("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    dense = llama.rules(llama_view(c))
    for rule in dense:
        if ".mlp." in rule.native or rule.native.startswith(("embedding.", "output_layer",
                                                             "decoder.final")):
            continue
        out.append(rule)
        if rule.native.endswith("self_attention.linear_proj.bias"):
            layer = rule.native.split(".")[2]
            ours, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
            out += [same(ours + "self_attention.sinks", hf + "self_attn.sinks"),
                    same(ours + "mlp.router.weight", hf + "mlp.router.weight"),
                    same(ours + "mlp.router.bias", hf + "mlp.router.bias"),
                    *_expert_rules(ours + "mlp.", hf + "mlp.", c.num_moe_experts)]
    out.append(same("decoder.final_layernorm.weight", "model.norm.weight"))
    if c.untie_embeddings_and_output_weights:
        out.append(same("output_layer.weight", "lm_head.weight"))
    return out


def llama_view(c: ModelConfig) -> ModelConfig:
    """`c` as the dense Llama-style model whose attention and norm rules gpt-oss shares."""
    import dataclasses

    return dataclasses.replace(c, num_moe_experts=None, activation="swiglu",
                               activation_func_clamp_value=None, glu_linear_offset=0.0,
                               softmax_type="vanilla")
