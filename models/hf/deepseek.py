"""DeepSeek-V3 family: DeepseekV3ForCausalLM (deepseek_v3; DeepSeek-V3, R1 and models built
on them) <-> GPTModel with multi-head latent attention (layers/mla.py) and a sigmoid-routed
MoE with shared experts.

Attention: `q_proj` (q_lora_rank null) or `q_a_proj` / `q_a_layernorm` / `q_b_proj`, and
`kv_a_proj_with_mqa` / `kv_a_layernorm` / `kv_b_proj`, `o_proj` are our `linear_q_proj` or
`linear_q_down_proj` / `q_layernorm` / `linear_q_up_proj`, `linear_kv_down_proj` /
`kv_layernorm` / `linear_kv_up_proj`, `linear_proj`, with the same row layouts (per head
`[nope, rope]` queries and `[k_nope, v]` keys-values; the latent then the RoPE key) except one:
with `rope_interleave` (DeepSeek's own checkpoints) the RoPE dimensions of the queries and of
the RoPE key are stored as interleaved pairs `(x0, x1), (x2, x3), ...`. Rotating interleaved
pairs is rotate-half RoPE on the de-interleaved vector `[x0, x2, ..., x1, x3, ...]`, so import
reorders those weight rows that way (an exact permutation; export undoes it) and our
rotate-half RoPE gives transformers' scores. `extra["hf_rope_interleave"]` remembers the
form, so the export writes it back bitwise; a natively trained model exports with
`rope_interleave` false. YaRN (`rope_parameters` of type yarn): our rope_scaling_type "yarn"
with its factor, original length, beta_fast / beta_slow, mscale / mscale_all_dim.

MoE: the first `first_k_dense_replace` layers have a dense MLP of `intermediate_size`, the
rest `n_routed_experts` experts of `moe_intermediate_size` (one tensor per expert) and one
shared expert of `n_shared_experts x moe_intermediate_size`, no gate (`moe_layer_freq` one 0/1
per layer); the router `gate.weight` with sigmoid scores, `gate.e_score_correction_bias` our
`expert_bias` (aux-loss-free balancing), top-k renormalised (`norm_topk_prob`) and multiplied
by `routed_scaling_factor` (`moe_router_topk_scaling_factor`), group-limited with `n_group` /
`topk_group` (`moe_router_num_groups` / `moe_router_group_topk`; n_group 1 is no limit).

Refused: `attention_bias`, `num_key_value_heads` other than the heads, `norm_topk_prob`
false or one expert per token (our sigmoid router renormalises a top-k of two or more),
`rms_norm_eps` other than 1e-6 (transformers' latent norms keep their default 1e-6 while
ours use the model's epsilon), YaRN's explicit `attention_factor` or `truncate` false.
A null `q_lora_rank` (or none) is the plain `q_proj`.

Multi-token prediction (`num_nextn_predict_layers` D: models/mtp.py): depth k's layer is
stored after the model's, `model.layers.{num_hidden_layers + k - 1}.`, a decoder layer's
tensors plus `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` (our `mtp.layers.{k-1}.`
enorm, hnorm, eh_proj, final_layernorm; the decoder layer is its `transformer_layer`), and
copies of the embedding (`embed_tokens`) and output head (`shared_head.head`), which import
checks equal to the model's (HFConversionError otherwise: we keep one of each) and export
writes again. transformers' config says 1 by default and its models hold no such layer:
`settle_mtp` sets D from the files. transformers' model itself ignores the layer (its
DeepSeek-V3 logits are those of the main model).
"""
from __future__ import annotations

import dataclasses

import torch

from layers.quant import QuantizedWeight
from models.config import ModelConfig

from . import llama
from .moe import _expert_rules
from .rules import HFConversionError, Rule, concat, same

MODEL_TYPES = ("deepseek_v3",)
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM"}
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES
HINT = "hf_rope_interleave"  # ModelConfig.extra key: the imported RoPE weight layout
_LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, used for q_a / kv_a norms


def _yarn_fields(scaling: dict) -> dict:
    """ModelConfig's YaRN fields of an HF `rope_parameters` dict of type yarn."""
    if scaling.get("attention_factor") is not None:
        raise HFConversionError("config.json rope_parameters attention_factor (YaRN's explicit "
                                "cos/sin factor) is not supported; convert a model without it")
    if scaling.get("truncate", True) is not True:
        raise HFConversionError("config.json rope_parameters truncate false is not supported "
                                "(YaRN's correction range is rounded outwards here)")
    if scaling.get("factor") is None:
        raise HFConversionError("config.json rope_parameters of type yarn has no factor")
    out = dict(rope_scaling_type="yarn", rope_scaling_factor=float(scaling["factor"]),
               rope_original_max_position_embeddings=scaling["original_max_position_embeddings"],
               rope_beta_fast=float(scaling.get("beta_fast") or 32),
               rope_beta_slow=float(scaling.get("beta_slow") or 1))
    for key in ("mscale", "mscale_all_dim"):
        if scaling.get(key) is not None:
            out[f"rope_{key}"] = float(scaling[key])
    return out


def rope_parameters_to_hf(c: ModelConfig) -> dict:
    """HF's `rope_parameters` of `c`: theta, and YaRN's fields (`truncate` false when set so)
    or another scaling's."""
    rope = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rope_scaling_type == "yarn":
        rope.update(rope_type="yarn", factor=c.rope_scaling_factor,
                    original_max_position_embeddings=c.rope_original_max_position_embeddings,
                    beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow)
        rope.update({k: getattr(c, f"rope_{k}") for k in ("mscale", "mscale_all_dim")
                     if getattr(c, f"rope_{k}") is not None})
        if c.rope_yarn_truncate is False:
            rope["truncate"] = False
    elif c.rope_scaling_type is not None:
        rope.update(llama.rope_scaling_to_hf(c))
    return rope


def _moe_fields(d: dict, num_layers: int) -> dict:
    """The MoE fields of a DeepSeek-V3 config dict (module docstring)."""
    k = d.get("first_k_dense_replace", 3)
    if type(k) is not int or not 0 <= k <= num_layers:
        raise HFConversionError(f"config.json first_k_dense_replace {k!r} must be an integer "
                                f"in [0, num_hidden_layers {num_layers}]")
    if k == num_layers:  # no MoE layer at all
        return {}
    topk = d.get("num_experts_per_tok", 8)
    if d.get("norm_topk_prob", True) is not True or topk == 1:
        raise HFConversionError("config.json norm_topk_prob false or num_experts_per_tok 1 is "
                                "not supported (the sigmoid router renormalises a top-k of two "
                                "or more)")
    groups, group_topk = d.get("n_group"), d.get("topk_group")
    out = dict(num_moe_experts=d.get("n_routed_experts", 256), moe_router_topk=topk,
               moe_ffn_hidden_size=d.get("moe_intermediate_size", 2048),
               moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
               moe_router_topk_scaling_factor=float(d.get("routed_scaling_factor", 2.5)),
               moe_layer_freq=1 if k == 0 else [0] * k + [1] * (num_layers - k))
    out["moe_shared_expert_intermediate_size"] = \
        d.get("n_shared_experts", 1) * out["moe_ffn_hidden_size"]
    if groups is not None and groups > 1:
        out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    return out


def config_from_hf(d: dict) -> ModelConfig:
    """`ModelConfig` of a DeepSeek-V3 `config.json` dict; `HFConversionError` for a field this
    model cannot represent."""
    heads = d["num_attention_heads"]
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if d.get(key) is None:
            raise HFConversionError(f"config.json has no {key}, which a deepseek_v3 model needs")
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        raise HFConversionError(f"config.json hidden_act {d['hidden_act']!r} is not supported "
                                f"for deepseek_v3 (only silu, i.e. SwiGLU)")
    if d.get("attention_bias", False) is not False:
        raise HFConversionError("config.json attention_bias true is not supported for "
                                "deepseek_v3 (biases on q_a / kv_a / o_proj not built)")
    if d.get("num_key_value_heads", heads) != heads:
        raise HFConversionError(f"config.json num_key_value_heads {d['num_key_value_heads']} "
                                f"!= num_attention_heads {heads}: multi-latent attention has one "
                                f"key per head; correct the config")
    eps = float(d.get("rms_norm_eps", 1e-6))
    if eps != _LATENT_NORM_EPS:
        raise HFConversionError(f"config.json rms_norm_eps {eps} is not supported: "
                                f"transformers' latent norms use {_LATENT_NORM_EPS} whatever "
                                f"it says, ours the model's epsilon")
    interleave = d.get("rope_interleave", True)
    if type(interleave) is not bool:
        raise HFConversionError(f"config.json rope_interleave {interleave!r} must be true or "
                                f"false")
    theta, scaling = llama._rope(d)
    if scaling is not None and scaling["rope_type"] == "yarn":
        rope = _yarn_fields(scaling)
    else:
        rope = llama.rope_scaling_fields(scaling)
    layers, max_pos = d["num_hidden_layers"], int(d.get("max_position_embeddings", 4096))
    return ModelConfig(
        num_layers=layers, hidden_size=d["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=d["intermediate_size"], seq_length=min(max_pos, 4096),
        max_position_embeddings=max_pos, vocab_size=d["vocab_size"],
        position_embedding_type="rope", rotary_base=theta, normalization="RMSNorm",
        layernorm_epsilon=eps, activation="swiglu", add_bias_linear=False,
        untie_embeddings_and_output_weights=not d.get("tie_word_embeddings", False),
        init_method_std=float(d.get("initializer_range", 0.02)),
        attention_dropout=float(d.get("attention_dropout", 0.0)),
        q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
        v_head_dim=d["v_head_dim"], extra={HINT: interleave},
        mtp_num_layers=_mtp_layers(d, layers), **rope, **_moe_fields(d, layers))


def _mtp_layers(d: dict, layers: int) -> int:
    """num_nextn_predict_layers of a config dict (0 when absent)."""
    n = d.get("num_nextn_predict_layers") or 0
    if type(n) is not int or n < 0:
        raise HFConversionError(f"config.json num_nextn_predict_layers {n!r} must be an "
                                f"integer >= 0")
    if n and d.get("first_k_dense_replace", 3) >= layers:
        raise HFConversionError("config.json num_nextn_predict_layers with no MoE layer "
                                "(first_k_dense_replace >= num_hidden_layers) is not supported: "
                                "transformers makes the MTP layer MoE, ours follows the last "
                                "layer; set num_nextn_predict_layers 0")
    return n


def settle_mtp(c: ModelConfig, names) -> ModelConfig:
    """`c` with mtp_num_layers 0 when the files (tensor `names`) hold no MTP layer:
    transformers' DeepseekV3Config says 1 by default, and the models it saves have none."""
    if c.mtp_num_layers and f"model.layers.{c.num_layers}.eh_proj.weight" not in set(names):
        return dataclasses.replace(c, mtp_num_layers=0)
    return c


def _interleaved(c: ModelConfig) -> bool:
    hint = c.extra.get(HINT) if type(c.extra) is dict else None  # untrusted
    return hint is True


def _dense_layers(c: ModelConfig) -> int:
    """first_k_dense_replace of `c` (its MoE layers must be the last ones: `conditions`)."""
    flags = [c.is_moe_layer(i) for i in range(c.num_layers)]
    return flags.index(True) if any(flags) else c.num_layers


def conditions(c: ModelConfig) -> list[str]:
    """Why `c` cannot be exported as DeepSeek-V3 (empty: it can)."""
    if not c.multi_latent_attention:
        return ["no multi-latent attention (kv_lora_rank unset)"]
    out = llama.conditions(dataclasses.replace(c, num_moe_experts=None))
    if abs(c.layernorm_epsilon - _LATENT_NORM_EPS) > 0:
        out.append(f"layernorm_epsilon {c.layernorm_epsilon} (transformers' DeepSeek-V3 latent "
                   f"norms use {_LATENT_NORM_EPS})")
    if c.num_moe_experts is None:
        return out
    k = _dense_layers(c)
    if any(not c.is_moe_layer(i) for i in range(k, c.num_layers)):
        out.append("MoE layers that are not the last ones (DeepSeek-V3 has first_k_dense_replace "
                   "dense layers, then MoE)")
    if c.moe_router_score_function != "sigmoid" or not c.moe_router_enable_expert_bias:
        out.append("a router without sigmoid scores and expert bias (DeepSeek-V3's gate has "
                   "both)")
    if c.moe_router_topk < 2 or c.moe_router_pre_softmax:
        out.append("top-1 or pre-softmax routing (DeepSeek-V3 renormalises its top-k)")
    shared = c.moe_shared_expert_intermediate_size
    if not shared or shared % c.moe_ffn_hidden_size or c.moe_shared_expert_gate:
        out.append(f"shared experts of {shared} (DeepSeek-V3 has n_shared_experts x "
                   f"moe_intermediate_size ungated)")
    if c.moe_expert_capacity_factor is not None:
        out.append("an expert capacity factor (DeepSeek-V3 is dropless)")
    return out


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (model_type included) for `c`."""
    rope = rope_parameters_to_hf(c)
    d = dict(model_type="deepseek_v3", architectures=[ARCHITECTURES["deepseek_v3"]],
             vocab_size=c.vocab_size, hidden_size=c.hidden_size,
             intermediate_size=c.ffn_hidden_size, num_hidden_layers=c.num_layers,
             num_attention_heads=c.num_attention_heads,
             num_key_value_heads=c.num_attention_heads, hidden_act="silu",
             max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.layernorm_epsilon,
             initializer_range=c.init_method_std, attention_bias=False,
             tie_word_embeddings=not c.untie_embeddings_and_output_weights,
             attention_dropout=c.attention_dropout, q_lora_rank=c.q_lora_rank,
             kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
             qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
             rope_interleave=_interleaved(c), rope_parameters=rope,
             first_k_dense_replace=_dense_layers(c),
             num_nextn_predict_layers=c.mtp_num_layers or 0)
    if c.num_moe_experts is not None:
        d.update(n_routed_experts=c.num_moe_experts, num_experts_per_tok=c.moe_router_topk,
                 moe_intermediate_size=c.moe_ffn_hidden_size, norm_topk_prob=True,
                 n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_ffn_hidden_size,
                 routed_scaling_factor=c.moe_router_topk_scaling_factor or 1.0,
                 n_group=c.moe_router_num_groups or 1, topk_group=c.moe_router_group_topk or 1)
    return d


def normalize(name: str) -> str:
    return name


def _rope_rows(block: int, start: int) -> torch.Tensor:
    """Row order within a block of `block` rows whose rows `start..` hold interleaved RoPE
    pairs: those rows de-interleaved (even ones, then odd ones), the others kept."""
    rope = torch.arange(start, block)
    return torch.cat([torch.arange(start), rope[0::2], rope[1::2]])


def _reorder(t, block: int, start: int, inverse: bool):
    """`t [k * block, ...]` with every block's rows reordered by `_rope_rows` (or back)."""
    order = _rope_rows(block, start)
    if inverse:
        order = torch.argsort(order)
    rows = (torch.arange(t.shape[0] // block)[:, None] * block + order).reshape(-1)
    if isinstance(t, QuantizedWeight):
        return t.index_select_rows(rows)
    return t.index_select(0, rows).contiguous()


def _rope_rule(native: str, hf: str, block: int, start: int, interleaved: bool) -> Rule:
    """`same`, with the interleaved RoPE rows of each `block` reordered when `interleaved`."""
    if not interleaved:
        return same(native, hf)
    return Rule(native, (hf,), lambda ts: _reorder(ts[0], block, start, False),
                lambda t: [_reorder(t, block, start, True)])


def attention_rules(c: ModelConfig, ours: str, attn: str) -> list[Rule]:
    """One layer's MLA weights: `ours` our `...self_attention.`, `attn` HF's `...self_attn.`."""
    inter, qk = _interleaved(c), c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        out = [_rope_rule(ours + "linear_q_proj.weight", attn + "q_proj.weight", qk,
                          c.qk_nope_head_dim, inter)]
    else:
        out = [same(ours + "linear_q_down_proj.weight", attn + "q_a_proj.weight"),
               same(ours + "q_layernorm.weight", attn + "q_a_layernorm.weight"),
               _rope_rule(ours + "linear_q_up_proj.weight", attn + "q_b_proj.weight", qk,
                          c.qk_nope_head_dim, inter)]
    return out + [
        _rope_rule(ours + "linear_kv_down_proj.weight", attn + "kv_a_proj_with_mqa.weight",
                   c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank, inter),
        same(ours + "kv_layernorm.weight", attn + "kv_a_layernorm.weight"),
        same(ours + "linear_kv_up_proj.weight", attn + "kv_b_proj.weight"),
        same(ours + "linear_proj.weight", attn + "o_proj.weight")]


def _moe_rules(c: ModelConfig, i: int) -> list[Rule]:
    ours, hf = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    return [same(ours + "router.weight", hf + "gate.weight"),
            same(ours + "router.expert_bias", hf + "gate.e_score_correction_bias"),
            *_expert_rules(ours, hf, c.num_moe_experts,
                           ("gate_proj.weight", "up_proj.weight", "down_proj.weight")),
            concat(ours + "shared_experts.linear_fc1.weight",
                   (hf + "shared_experts.gate_proj.weight", hf + "shared_experts.up_proj.weight")),
            same(ours + "shared_experts.linear_fc2.weight", hf + "shared_experts.down_proj.weight")]


def rules(c: ModelConfig) -> list[Rule]:
    """The conversion table of `c`: the Llama family's norms, embedding and dense MLPs, with
    MLA attention rules and, on MoE layers, the router, experts and shared expert rules."""
    out = []
    if c.mtp_num_layers:
        return _with_mtp_rules(c, rules(dataclasses.replace(c, mtp_num_layers=0)))
    for rule in llama.rules(dataclasses.replace(c, num_moe_experts=None)):
        parts = rule.native.split(".")
        if rule.native.startswith("decoder.layers.") and parts[3] == "self_attention":
            continue  # llama's fused QKV: replaced below
        i = int(parts[2]) if rule.native.startswith("decoder.layers.") else None
        if i is not None and parts[3] == "mlp" and c.is_moe_layer(i):
            if rule.native.endswith("mlp.linear_fc2.weight"):
                out += _moe_rules(c, i)
            continue
        out.append(rule)
        if rule.native.endswith("input_layernorm.weight"):
            out += attention_rules(c, f"decoder.layers.{i}.self_attention.",
                                   f"model.layers.{i}.self_attn.")
    return out


def _copies(rule: Rule, copies: tuple[str, ...]) -> Rule:
    """`rule` (one HF tensor) also written to `copies`; import checks they equal it."""
    def to_native(ts):
        for name, t in zip(copies, ts[1:]):
            if not torch.equal(t, ts[0]):
                raise HFConversionError(f"{name} differs from {rule.hf[0]}: the multi-token-"
                                        f"prediction layer's copy is kept as one weight here")
        return rule.to_native(ts[:1])
    return Rule(rule.native, rule.hf + copies, to_native,
                lambda t: rule.to_hf(t) + [rule.to_hf(t)[0].clone() for _ in copies])


def _with_mtp_rules(c: ModelConfig, main: list[Rule]) -> list[Rule]:
    """`main` (the model's rules) with the MTP depths' (module docstring)."""
    d, n = c.mtp_num_layers, c.num_layers
    freq = c.moe_layer_freq
    if isinstance(freq, list):
        freq = freq + [freq[-1]] * d
    deeper = rules(dataclasses.replace(c, num_layers=n + d, moe_layer_freq=freq,
                                       mtp_num_layers=0))
    tied = not c.untie_embeddings_and_output_weights
    emb = tuple(f"model.layers.{n + j}.{w}" for j in range(d) for w in (
        ("embed_tokens.weight", "shared_head.head.weight") if tied else ("embed_tokens.weight",)))
    head = tuple(f"model.layers.{n + j}.shared_head.head.weight" for j in range(d))
    out = [_copies(r, emb) if r.native == "embedding.word_embeddings.weight" else
           _copies(r, head) if r.native == "output_layer.weight" else r for r in main]
    for j in range(d):
        hf, ours = f"model.layers.{n + j}.", f"mtp.layers.{j}."
        out += [same(ours + f"{w}.weight", hf + f"{w}.weight")
                for w in ("enorm", "hnorm", "eh_proj")]
        layer = f"decoder.layers.{n + j}."
        out += [Rule(ours + "transformer_layer." + r.native[len(layer):], r.hf, r.to_native,
                     r.to_hf) for r in deeper if r.native.startswith(layer)]
        out.append(same(ours + "final_layernorm.weight", hf + "shared_head.norm.weight"))
    return out
