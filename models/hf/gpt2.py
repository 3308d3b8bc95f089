"""GPT-2 (GPT2LMHeadModel) <-> GPTModel.

GPT-2 stores its linears as Conv1D (`[in, out]`, transposed against ours), fuses q/k/v in one
`c_attn` whose output columns are `[q; k; v]` (each h wide, heads in order), uses learned
positions, LayerNorm with biases everywhere, the tanh GeLU ("gelu_new") and always ties the
output layer to the word embedding.
"""
from __future__ import annotations

import torch

from models.config import ModelConfig

from .rules import HFConversionError, Rule, fuse_qkv, same, split_qkv, transposed

MODEL_TYPES = ("gpt2",)
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel"}
# causal-mask buffers some GPT-2 files carry (not weights)
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def config_from_hf(d: dict) -> ModelConfig:
    """`ModelConfig` of a GPT-2 `config.json` dict; `HFConversionError` for what we lack."""
    act = d.get("activation_function", "gelu_new")
    if act not in _TANH_GELU:
        raise HFConversionError(f"config.json activation_function {act!r} is not supported for "
                                f"gpt2 (only the tanh GeLU: {', '.join(_TANH_GELU)})")
    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if bool(d.get(field, ok)) != ok:
            raise HFConversionError(f"config.json {field}={d[field]} is not supported for gpt2 "
                                    f"(attention is scaled by 1/sqrt(d) only)")
    if d.get("add_cross_attention"):
        raise HFConversionError("config.json add_cross_attention=true is not supported for gpt2 "
                                "(a decoder-only model has no encoder to attend to)")
    if d.get("tie_word_embeddings", True) is False:
        raise HFConversionError("config.json tie_word_embeddings=false is not supported for "
                                "gpt2 (GPT2LMHeadModel always ties lm_head to wte)")
    h, n_pos = d["n_embd"], d["n_positions"]
    return ModelConfig(
        num_layers=d["n_layer"], hidden_size=h, num_attention_heads=d["n_head"],
        ffn_hidden_size=d.get("n_inner") or 4 * h, seq_length=n_pos,
        max_position_embeddings=n_pos, vocab_size=d["vocab_size"],
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        layernorm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)), activation="gelu",
        add_bias_linear=True, add_qkv_bias=True, untie_embeddings_and_output_weights=False,
        init_method_std=float(d.get("initializer_range", 0.02)))


def normalize(name: str) -> str:
    """HF name with the `transformer.` prefix that files of a bare GPT2Model omit."""
    return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name


def model_type_for(c: ModelConfig) -> str:
    return "gpt2"


def config_to_hf(c: ModelConfig) -> dict:
    return dict(model_type="gpt2", architectures=[ARCHITECTURES["gpt2"]], vocab_size=c.vocab_size,
                n_positions=c.max_position_embeddings, n_embd=c.hidden_size, n_layer=c.num_layers,
                n_head=c.num_attention_heads, n_inner=c.ffn_hidden_size,
                activation_function="gelu_new", layer_norm_epsilon=c.layernorm_epsilon,
                initializer_range=c.init_method_std, resid_pdrop=c.hidden_dropout,
                embd_pdrop=c.hidden_dropout, attn_pdrop=c.attention_dropout,
                tie_word_embeddings=True)


def _c_attn(native: str, hf: str, heads: int, h: int, weight: bool) -> Rule:
    """Conv1D `c_attn` (`[h, 3h]`, or bias `[3h]`) <-> our per-head `[q_i, k_i, v_i]` rows."""
    def to_native(ts):
        t = ts[0].t() if weight else ts[0]
        return fuse_qkv(*t.split(h, 0), heads)

    def to_hf(t):
        full = torch.cat(split_qkv(t, heads, h, h), 0)
        return [full.t().contiguous() if weight else full]
    return Rule(native, (hf,), to_native, to_hf)


def conditions(c: ModelConfig) -> list[str]:
    """Why `c` cannot be exported as GPT-2 (empty: it can)."""
    want = dict(position_embedding_type="learned_absolute", normalization="LayerNorm",
                activation="gelu", add_bias_linear=True, add_qkv_bias=True,
                untie_embeddings_and_output_weights=False)
    out = [f"{k}={getattr(c, k)!r} (GPT-2 has {v!r})" for k, v in want.items()
           if getattr(c, k) != v]
    if c.num_query_groups != c.num_attention_heads:
        out.append(f"num_query_groups={c.num_query_groups} (GPT-2 has multi-head attention)")
    if c.kv_channels * c.num_attention_heads != c.hidden_size:
        out.append(f"kv_channels={c.kv_channels} (GPT-2 has hidden_size / heads)")
    if c.window_size is not None:
        out.append(f"window_size={c.window_size} (GPT-2 has no sliding window)")
    return out


def rules(c: ModelConfig) -> list[Rule]:
    h, heads = c.hidden_size, c.num_attention_heads
    out = [same("embedding.word_embeddings.weight", "transformer.wte.weight"),
           same("embedding.position_embeddings.weight", "transformer.wpe.weight")]
    for i in range(c.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
        out += [same(ours + "input_layernorm.weight", hf + "ln_1.weight"),
                same(ours + "input_layernorm.bias", hf + "ln_1.bias"),
                _c_attn(ours + "self_attention.linear_qkv.weight", hf + "attn.c_attn.weight",
                        heads, h, weight=True),
                _c_attn(ours + "self_attention.linear_qkv.bias", hf + "attn.c_attn.bias",
                        heads, h, weight=False),
                transposed(ours + "self_attention.linear_proj.weight", hf + "attn.c_proj.weight"),
                same(ours + "self_attention.linear_proj.bias", hf + "attn.c_proj.bias"),
                same(ours + "pre_mlp_layernorm.weight", hf + "ln_2.weight"),
                same(ours + "pre_mlp_layernorm.bias", hf + "ln_2.bias"),
                transposed(ours + "mlp.linear_fc1.weight", hf + "mlp.c_fc.weight"),
                same(ours + "mlp.linear_fc1.bias", hf + "mlp.c_fc.bias"),
                transposed(ours + "mlp.linear_fc2.weight", hf + "mlp.c_proj.weight"),
                same(ours + "mlp.linear_fc2.bias", hf + "mlp.c_proj.bias")]
    out += [same("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
            same("decoder.final_layernorm.bias", "transformer.ln_f.bias")]
    return out
