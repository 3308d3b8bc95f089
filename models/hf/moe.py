"""Mixture-of-experts families: MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM,
OlmoeForCausalLM <-> GPTModel with MoE layers (layers/moe/).

Attention, norms, embeddings and any dense MLP are the Llama family's (models/hf/llama.py:
Mixtral's attention is Mistral's, Qwen2-MoE's Qwen2's, Qwen3-MoE's Qwen3's with its per-head
q/k norms, `qk_layernorm`; OLMoE's Llama's with RMSNorms over the whole q and k projections,
`qk_layernorm` + `qk_norm_over_heads`, whose sum of squares is all-reduced over TP:
layers/norm.py ProjectionRMSNorm); this module replaces the MLP of each MoE layer:

- router: HF `gate.weight [E, h]` is our `router.weight`. Mixtral softmaxes over all experts,
  keeps the top k and renormalises them to sum 1, which equals the softmax of the top-k
  logits (our default, `moe_router_pre_softmax` False). Qwen2-MoE, Qwen3-MoE and OLMoE do
  the same when `norm_topk_prob` is true; when it is false (its default) the top-k probabilities of the
  softmax over all experts are kept as they are: `moe_router_pre_softmax` True.
- experts: HF files hold one `[f, h]` gate (w1 / gate_proj), up (w3 / up_proj) and `[h, f]`
  down (w2 / down_proj) tensor per expert; ours are one logical tensor per expert
  (`...mlp.experts.<e>.linear_fc1.weight` = `[gate; up]` `[2f, h]`, `...linear_fc2.weight`
  `[h, f]`, the checkpoint's keys: checkpoint/keys.py), stacked into the layer's
  `[E_local, ...]` weight when a rank loads its experts.
- Qwen2-MoE's shared expert (a SwiGLU MLP of `shared_expert_intermediate_size`) is our
  `shared_experts`, its `shared_expert_gate.weight [1, h]` our gate of the same name (output
  x sigmoid(gate . x)); which layers are MoE: HF's layer i is sparse when it is not in
  `mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`, our `moe_layer_freq` as one
  0/1 per layer (our integer N counts from layer 0, HF's step from layer step - 1); the same
  for Qwen3-MoE, which has no shared expert.
- sliding windows: Mixtral's and Qwen3-MoE's (`use_sliding_window`) slide every layer,
  Qwen2-MoE's the layers its `layer_types` / `max_window_layers` say (as Qwen2).

Refused: Mixtral's `router_jitter_noise` other than 0 (multiplicative noise on the MoE input
in training, not built); OLMoE's `clip_qkv` (clamping q, k, v) and `attention_bias`. Training's load-balancing loss: transformers adds
`router_aux_loss_coef` x its auxiliary loss only with `output_router_logits`; we set
`moe_aux_loss_coeff` the same way (our loss is Switch's, per microbatch: layers/moe/router.py).
"""
from __future__ import annotations

import dataclasses

from layers.attention import LAYER_TYPES
from models.config import ModelConfig

from . import llama
from .rules import HFConversionError, Rule, concat, same

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
IGNORED_SUFFIXES = llama.IGNORED_SUFFIXES
# the Llama-family model whose attention each one has
_ATTENTION = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "olmoe": "llama"}
# config.json fields without a default that describes the weights
REQUIRED = {"mixtral": (), "qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
            "qwen3_moe": ("moe_intermediate_size",), "olmoe": ()}
# the expert count's spelling each writes (transformers maps the other one onto it; its own
# save_pretrained may write either)
EXPERTS = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts",
           "olmoe": "num_experts"}


def _num_experts(d: dict, mt: str) -> int:
    """The expert count of config dict `d`, spelled num_experts or num_local_experts."""
    given = {k: d[k] for k in ("num_experts", "num_local_experts") if d.get(k) is not None}
    if not given:
        raise HFConversionError(f"config.json has no {EXPERTS[mt]}, which a {mt} model needs")
    if len(set(given.values())) > 1:
        raise HFConversionError(f"config.json num_experts={given['num_experts']} and "
                                f"num_local_experts={given['num_local_experts']} disagree; "
                                f"keep one")
    return next(iter(given.values()))


def _moe_layers(d: dict, mt: str, num_layers: int) -> list[int]:
    """One 1 (MoE) or 0 (dense MLP) per layer, as transformers builds them."""
    if mt in ("mixtral", "olmoe"):
        return [1] * num_layers
    step, dense = d.get("decoder_sparse_step", 1), d.get("mlp_only_layers") or []
    if type(step) is not int or step < 1:
        raise HFConversionError(f"config.json decoder_sparse_step {step!r} must be an integer "
                                f">= 1")
    if type(dense) is not list or any(type(i) is not int or not 0 <= i < num_layers
                                      for i in dense):
        raise HFConversionError(f"config.json mlp_only_layers must list layer numbers in "
                                f"[0, {num_layers}) (num_hidden_layers)")
    return [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]


def config_from_hf(d: dict) -> ModelConfig:
    """`ModelConfig` of a Mixtral / Qwen2-MoE `config.json` dict; `HFConversionError` for a
    field this model cannot represent."""
    mt = d["model_type"]
    for key in REQUIRED[mt]:
        if d.get(key) is None:
            raise HFConversionError(f"config.json has no {key}, which a {mt} model needs")
    other = [a for a in d.get("architectures") or [] if a != ARCHITECTURES[mt]]
    if other:
        raise HFConversionError(f"config.json architectures {other} is not {mt}'s "
                                f"{ARCHITECTURES[mt]}; use the model's own config.json")
    for key in ("clip_qkv", "attention_bias") if mt == "olmoe" else ():
        if d.get(key):
            raise HFConversionError(f"config.json {key}={d[key]!r} is not supported for olmoe "
                                    f"(not built); convert a model without it")
    jitter = d.get("router_jitter_noise", 0.0)
    if jitter:
        raise HFConversionError(f"config.json router_jitter_noise={jitter} is not supported "
                                f"(noise on the MoE input in training); set it to 0.0")
    qkv_bias = d.get("qkv_bias", True)
    if type(qkv_bias) is not bool:
        raise HFConversionError(f"config.json qkv_bias {qkv_bias!r} must be true or false")
    attention = dict(d, model_type=_ATTENTION[mt])
    if mt == "qwen3_moe":  # head_dim defaults to hidden / heads (Qwen3's to 128); every
        # layer slides when use_sliding_window (Qwen3's Qwen2-like layer_types do not apply)
        attention.update(head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                         use_sliding_window=False)
    base = llama.config_from_hf(attention)
    if mt == "qwen2_moe" and not qkv_bias:
        base = dataclasses.replace(base, add_qkv_bias=False)
    if mt == "olmoe":  # its q_norm / k_norm span the whole q / k projections
        base = dataclasses.replace(base, qk_layernorm=True, qk_norm_over_heads=True)
    if mt == "qwen3_moe" and d.get("use_sliding_window"):
        base = dataclasses.replace(base, **llama._window_from_hf(d, "mistral", base.num_layers))
    layers = _moe_layers(d, mt, base.num_layers)
    experts = _num_experts(d, mt)
    moe = dict(num_moe_experts=experts, moe_router_topk=d.get("num_experts_per_tok", 2),
               moe_layer_freq=1 if all(layers) else layers,
               moe_aux_loss_coeff=float(d.get("router_aux_loss_coef", 0.0))
               if d.get("output_router_logits") else 0.0)
    if mt in ("mixtral", "olmoe"):  # every layer MoE, experts of intermediate_size
        moe.update(moe_ffn_hidden_size=d["intermediate_size"],
                   moe_router_pre_softmax=mt == "olmoe" and not d.get("norm_topk_prob", False))
    else:
        moe.update(moe_ffn_hidden_size=d["moe_intermediate_size"],
                   moe_router_pre_softmax=not d.get("norm_topk_prob", False))
    if mt == "qwen2_moe":
        moe.update(moe_shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
                   moe_shared_expert_gate=True)
    return dataclasses.replace(base, **moe)


def model_type_for(c: ModelConfig) -> str:
    """Qwen2-MoE when `c` has shared experts, else OLMoE with q/k norms over the whole
    projections, Qwen3-MoE with per-head ones, else Mixtral."""
    if c.moe_shared_expert_intermediate_size:
        return "qwen2_moe"
    if c.qk_layernorm:
        return "olmoe" if c.qk_norm_over_heads else "qwen3_moe"
    return "mixtral"


def _moe_flags(c: ModelConfig) -> list[int]:
    return [int(c.is_moe_layer(i)) for i in range(c.num_layers)]


def conditions(c: ModelConfig) -> list[str]:
    """Why `c` cannot be exported as Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE (empty: it can)."""
    mt = model_type_for(c)
    # Qwen2-MoE's attention is Qwen2's (per-layer windows) with or without its q/k/v biases;
    # OLMoE's is Llama's with q/k norms over the whole projections (checked below)
    out = llama.conditions(dataclasses.replace(
        c, num_moe_experts=None, add_qkv_bias=c.add_qkv_bias or mt == "qwen2_moe",
        qk_layernorm=c.qk_layernorm and mt != "olmoe"))
    if c.moe_router_score_function != "softmax":
        out.append(f"moe_router_score_function={c.moe_router_score_function!r} (the HF MoE "
                   f"families built route by softmax)")
    for field in ("moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
                  "moe_expert_capacity_factor", "moe_z_loss_coeff"):
        if getattr(c, field):
            out.append(f"{field}={getattr(c, field)!r} (Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE "
                       f"have none)")
    name = {"mixtral": "Mixtral", "olmoe": "OLMoE"}.get(mt)
    if mt == "mixtral" and c.moe_router_pre_softmax:
        out.append("moe_router_pre_softmax without q/k norms or shared experts (Mixtral "
                   "renormalises the top-k)")
    if mt == "olmoe":
        if c.window_size is not None:
            out.append(f"window_size={c.window_size} (OLMoE has no sliding window)")
        if c.kv_channels * c.num_attention_heads != c.hidden_size:
            out.append(f"kv_channels {c.kv_channels} x {c.num_attention_heads} heads != hidden "
                       f"{c.hidden_size} (OLMoE has no head_dim)")
    if name:
        if c.add_qkv_bias or c.add_bias_linear:
            out.append(f"biases ({name} has none)")
        if not all(_moe_flags(c)):
            out.append(f"dense-MLP layers (every {name} layer is MoE)")
        if c.moe_ffn_hidden_size != c.ffn_hidden_size:
            out.append(f"moe_ffn_hidden_size {c.moe_ffn_hidden_size} != ffn_hidden_size "
                       f"{c.ffn_hidden_size} ({name} has one intermediate_size)")
    elif mt == "qwen2_moe":
        if not c.moe_shared_expert_gate:
            out.append("shared experts without moe_shared_expert_gate (Qwen2-MoE gates them)")
        if c.add_bias_linear:
            out.append("biases on every linear layer (Qwen2-MoE has q/k/v biases at most)")
    elif c.window_size is not None and not all(llama._sliding_layers(c)):
        out.append(f"window_attn_skip_freq={c.window_attn_skip_freq!r} (Qwen3-MoE slides every "
                   f"layer or none)")
    return out


def config_to_hf(c: ModelConfig) -> dict:
    """transformers config kwargs (model_type included) for `c`."""
    mt = model_type_for(c)
    d = llama.config_to_hf(dataclasses.replace(c, num_moe_experts=None))
    d.update(model_type=mt, architectures=[ARCHITECTURES[mt]],
             num_experts_per_tok=c.moe_router_topk,
             output_router_logits=c.moe_aux_loss_coeff > 0,
             router_aux_loss_coef=c.moe_aux_loss_coeff if c.moe_aux_loss_coeff > 0 else 0.001)
    for key in ("attention_bias", "mlp_bias"):
        d.pop(key, None)
    if mt != "qwen2_moe":  # every layer slides, or none
        for key in ("use_sliding_window", "layer_types", "max_window_layers"):
            d.pop(key, None)
        window = None if c.window_size is None else c.window_size[0] + 1
        d.update(sliding_window=window)
        if mt == "qwen3_moe":
            d["use_sliding_window"] = window is not None
    if mt == "mixtral":
        d.update(num_local_experts=c.num_moe_experts, router_jitter_noise=0.0)
        return d
    if mt == "olmoe":
        for key in ("head_dim", "sliding_window"):
            d.pop(key)
        # OlmoeConfig's own pad / eos ids (1, 50279) are its real tokenizer's; the exported
        # tokenizer's ids replace these (checkpoint/hf.py export_hf)
        d.update(num_experts=c.num_moe_experts, norm_topk_prob=not c.moe_router_pre_softmax,
                 attention_bias=False, clip_qkv=None, pad_token_id=None, eos_token_id=None)
        return d
    if mt == "qwen3_moe":
        d["attention_bias"] = False
    elif "use_sliding_window" not in d:  # llama's or mistral's form: Qwen2's window fields
        d.update(use_sliding_window=c.window_size is not None, layer_types=[
            LAYER_TYPES[x] for x in llama._sliding_layers(c)])
        d.pop("sliding_window", None)
        if c.window_size is not None:
            d.update(sliding_window=c.window_size[0] + 1, max_window_layers=0)
    if mt == "qwen2_moe":
        d.update(shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
                 qkv_bias=c.add_qkv_bias)
    flags = _moe_flags(c)
    d.update(num_experts=c.num_moe_experts, moe_intermediate_size=c.moe_ffn_hidden_size,
             norm_topk_prob=not c.moe_router_pre_softmax, decoder_sparse_step=1,
             mlp_only_layers=[i for i, x in enumerate(flags) if not x])
    return d


def normalize(name: str) -> str:
    return name


def _expert_rules(ours: str, hf: str, num_experts: int, names: tuple[str, str, str]
                  ) -> list[Rule]:
    """Per expert e: our `[gate; up]` fc1 and fc2 <-> HF's (gate, up, down) `names`."""
    gate, up, down = names
    out = []
    for e in range(num_experts):
        mine, theirs = f"{ours}experts.{e}.", f"{hf}experts.{e}."
        out += [concat(mine + "linear_fc1.weight", (theirs + gate, theirs + up)),
                same(mine + "linear_fc2.weight", theirs + down)]
    return out


def rules(c: ModelConfig) -> list[Rule]:
    """The conversion table of `c`: the Llama family's, with each MoE layer's MLP rules
    replaced by the router, experts (and shared expert) rules."""
    mt = model_type_for(c)
    dense = dataclasses.replace(c, num_moe_experts=None)
    out = []
    for rule in llama.rules(dense):
        layer = rule.native.split(".")[2] if rule.native.startswith("decoder.layers.") else None
        if layer is None or ".mlp." not in rule.native or not c.is_moe_layer(int(layer)):
            out.append(rule)
            continue
        if not rule.native.endswith("mlp.linear_fc2.weight"):
            continue  # the MoE rules follow the layer's last MLP rule
        ours, i = f"decoder.layers.{layer}.mlp.", layer
        if mt == "mixtral":
            hf = f"model.layers.{i}.block_sparse_moe."
            out.append(same(ours + "router.weight", hf + "gate.weight"))
            out += _expert_rules(ours, hf, c.num_moe_experts, ("w1.weight", "w3.weight",
                                                                "w2.weight"))
            continue
        hf = f"model.layers.{i}.mlp."
        out.append(same(ours + "router.weight", hf + "gate.weight"))
        out += _expert_rules(ours, hf, c.num_moe_experts, ("gate_proj.weight", "up_proj.weight",
                                                            "down_proj.weight"))
        if mt != "qwen2_moe":
            continue
        out += [concat(ours + "shared_experts.linear_fc1.weight",
                       (hf + "shared_expert.gate_proj.weight", hf + "shared_expert.up_proj.weight")),
                same(ours + "shared_experts.linear_fc2.weight", hf + "shared_expert.down_proj.weight"),
                same(ours + "shared_expert_gate.weight", hf + "shared_expert_gate.weight")]
    return out
