"""T5 family: T5ForConditionalGeneration (v1.0: ReLU, tied and rescaled head; v1.1 / Flan:
gated-GeLU, untied head) <-> T5Model.

HF keeps q, k, v and o of every attention separately, the relative position table in the
first block of each stack (`block.0.layer.0.SelfAttention.relative_attention_bias`), and the
MLP as `wi` (ReLU) or `wi_0` (gate) and `wi_1` (up). Ours: fused QKV (per head `[q, k, v]`,
rules.fuse_qkv with one head per group), cross-attention `linear_q` and fused `[K; V]`,
fused `[gate; up]`, one table per stack beside the block.

transformers 5 ties `lm_head` to `shared` in memory whatever the config says and records the
v1.0 rescaling as `scale_decoder_outputs`; a file with its own, different `lm_head.weight`
loads untied. We read "rescaled" from `scale_decoder_outputs` (else from
`tie_word_embeddings`, as transformers does) and map rescaled <-> tied, unscaled <-> untied,
the two combinations every released T5 uses; the other two are refused.
"""
from __future__ import annotations

from models.config import ModelConfig

from .rules import HFConversionError, Rule, concat, qkv, same

MODEL_TYPES = ("t5",)
ARCHITECTURES = {"t5": "T5ForConditionalGeneration"}
# copies of `shared.weight` some files carry, and a table old checkpoints hold but never use
IGNORED_SUFFIXES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                    "EncDecAttention.relative_attention_bias.weight")
_ACTIVATIONS = {"relu": "relu", "gated-gelu": "geglu"}


def _rescaled(d: dict) -> bool:
    if "scale_decoder_outputs" in d:
        return bool(d["scale_decoder_outputs"])
    return d.get("tie_word_embeddings", True) is not False


def config_from_hf(d: dict) -> ModelConfig:
    """`ModelConfig` of a T5 `config.json` dict; `HFConversionError` for what T5Model cannot
    represent (another feed_forward_proj, a decoder start other than the pad id 0, a head
    both tied and unscaled or untied and rescaled)."""
    proj = d.get("feed_forward_proj", "relu")
    if proj not in _ACTIVATIONS:
        raise HFConversionError(f"config.json feed_forward_proj {proj!r} is not supported "
                                f"(supported: {sorted(_ACTIVATIONS)}: T5 v1.0 and v1.1)")
    for key in ("decoder_start_token_id", "pad_token_id"):
        if d.get(key, 0) not in (0, None):
            raise HFConversionError(f"config.json {key}={d[key]}: T5Model starts the decoder "
                                    f"with id 0 (T5's pad); convert a model that does")
    rescaled = _rescaled(d)
    explicit_tie = d.get("tie_word_embeddings")
    if "scale_decoder_outputs" in d and explicit_tie is False and rescaled:
        raise HFConversionError("config.json scale_decoder_outputs=true with "
                                "tie_word_embeddings=false: T5Model rescales only a tied head")
    layers = d.get("num_layers", 6)
    heads, seq = d.get("num_heads", 8), int(d.get("n_positions") or 512)
    dropout = float(d.get("dropout_rate", 0.1))
    return ModelConfig(
        model_type="t5", num_layers=layers, encoder_num_layers=layers,
        decoder_num_layers=d.get("num_decoder_layers") or layers, hidden_size=d.get("d_model", 512),
        num_attention_heads=heads, kv_channels=d.get("d_kv", 64),
        ffn_hidden_size=d.get("d_ff", 2048),
        seq_length=seq, decoder_seq_length=seq, max_position_embeddings=seq,
        vocab_size=d.get("vocab_size", 32128), position_embedding_type="relative",
        relative_attention_num_buckets=d.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=d.get("relative_attention_max_distance", 128),
        normalization="RMSNorm", layernorm_epsilon=float(d.get("layer_norm_epsilon", 1e-6)),
        activation=_ACTIVATIONS[proj], add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not rescaled, hidden_dropout=dropout,
        attention_dropout=dropout, init_method_std=float(d.get("initializer_factor", 1.0)) * 0.02)


def normalize(name: str) -> str:
    return name


def conditions(c: ModelConfig) -> list[str]:
    """Why `c` cannot be exported as T5ForConditionalGeneration (empty: it can)."""
    if c.model_type != "t5":
        return [f"model_type={c.model_type!r} (T5 is an encoder-decoder)"]
    out = []
    if c.normalization != "RMSNorm":
        out.append(f"normalization={c.normalization!r} (T5 has RMSNorm)")
    if c.activation not in ("relu", "geglu"):
        out.append(f"activation={c.activation!r} (T5 has relu or geglu)")
    if c.add_bias_linear or c.add_qkv_bias:
        out.append("linear biases (T5 has none)")
    if c.num_query_groups != c.num_attention_heads:
        out.append("grouped-query attention (T5 has one KV head per query head)")
    return out


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (model_type included) for `c`."""
    tied = not c.untie_embeddings_and_output_weights
    return dict(model_type="t5", architectures=[ARCHITECTURES["t5"]], vocab_size=c.vocab_size,
                d_model=c.hidden_size, d_kv=c.kv_channels, d_ff=c.ffn_hidden_size,
                num_layers=c.encoder_num_layers, num_decoder_layers=c.decoder_num_layers,
                num_heads=c.num_attention_heads,
                relative_attention_num_buckets=c.relative_attention_num_buckets,
                relative_attention_max_distance=c.relative_attention_max_distance,
                dropout_rate=c.hidden_dropout, layer_norm_epsilon=c.layernorm_epsilon,
                initializer_factor=c.init_method_std / 0.02,
                feed_forward_proj="relu" if c.activation == "relu" else "gated-gelu",
                tie_word_embeddings=tied, scale_decoder_outputs=tied, n_positions=c.seq_length,
                is_encoder_decoder=True, decoder_start_token_id=0, pad_token_id=0,
                eos_token_id=1)


def _attention(ours: str, hf: str, c: ModelConfig) -> list[Rule]:
    rows = c.query_projection_size
    return [qkv(ours + "linear_qkv.weight", (hf + "q.weight", hf + "k.weight", hf + "v.weight"),
                c.num_attention_heads, rows, rows),
            same(ours + "linear_proj.weight", hf + "o.weight")]


def _mlp(ours: str, hf: str, c: ModelConfig) -> list[Rule]:
    fc1 = same(ours + "linear_fc1.weight", hf + "wi.weight") if c.activation == "relu" else \
        concat(ours + "linear_fc1.weight", (hf + "wi_0.weight", hf + "wi_1.weight"))
    return [fc1, same(ours + "linear_fc2.weight", hf + "wo.weight")]


def rules(c: ModelConfig) -> list[Rule]:
    """The conversion table of `c` (see models/hf/rules.py)."""
    table = "layer.0.SelfAttention.relative_attention_bias.weight"
    out = [same("embedding.word_embeddings.weight", "shared.weight"),
           same("encoder_position_bias.weight", "encoder.block.0." + table)]
    for i in range(c.encoder_num_layers):
        ours, hf = f"encoder.layers.{i}.", f"encoder.block.{i}.layer."
        out += [same(ours + "input_layernorm.weight", hf + "0.layer_norm.weight"),
                *_attention(ours + "self_attention.", hf + "0.SelfAttention.", c),
                same(ours + "pre_mlp_layernorm.weight", hf + "1.layer_norm.weight"),
                *_mlp(ours + "mlp.", hf + "1.DenseReluDense.", c)]
    out.append(same("encoder.final_layernorm.weight", "encoder.final_layer_norm.weight"))
    out.append(same("decoder_position_bias.weight", "decoder.block.0." + table))
    for i in range(c.decoder_num_layers):
        ours, hf = f"decoder.layers.{i}.", f"decoder.block.{i}.layer."
        cross, enc_dec = ours + "cross_attention.", hf + "1.EncDecAttention."
        out += [same(ours + "input_layernorm.weight", hf + "0.layer_norm.weight"),
                *_attention(ours + "self_attention.", hf + "0.SelfAttention.", c),
                same(ours + "pre_cross_attn_layernorm.weight", hf + "1.layer_norm.weight"),
                same(cross + "linear_q.weight", enc_dec + "q.weight"),
                concat(cross + "linear_kv.weight", (enc_dec + "k.weight", enc_dec + "v.weight")),
                same(cross + "linear_proj.weight", enc_dec + "o.weight"),
                same(ours + "pre_mlp_layernorm.weight", hf + "2.layer_norm.weight"),
                *_mlp(ours + "mlp.", hf + "2.DenseReluDense.", c)]
    out.append(same("decoder.final_layernorm.weight", "decoder.final_layer_norm.weight"))
    if c.untie_embeddings_and_output_weights:
        out.append(same("output_layer.weight", "lm_head.weight"))
    return out
