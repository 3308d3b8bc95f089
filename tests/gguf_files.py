"""Tiny GGUF files for tests, written from a Hugging Face model folder the way llama.cpp's
convert_hf_to_gguf.py writes them (nothing downloads; the `gguf` package's `GGUFWriter`).

`write_gguf(hf_dir, path)` reads `config.json` and `model.safetensors` of a tiny model and
writes `path` as llama.cpp would:

- `general.architecture` is llama.cpp's name for the model type (`ARCHITECTURES`: qwen3moe for
  qwen3_moe, gemma3 for gemma3_text, llama for Mixtral, ...), and the hyperparameters are
  its metadata keys: block_count, context_length, embedding_length, feed_forward_length,
  attention.head_count(_kv), attention.key_length / value_length (when config.json has
  head_dim), rope.freq_base, attention.layer_norm_rms_epsilon, expert_count /
  expert_used_count / expert_feed_forward_length / expert_shared_feed_forward_length,
  attention.sliding_window, Gemma 2's attn / final logit soft-capping, rope.scaling;
- tensor names come from gguf's own map (`gguf.get_tensor_name_map`); the per-expert tensors
  of a layer are stacked into one `[experts, rows, cols]` tensor (`blk.N.ffn_gate_exps`, ...);
  size-1 dimensions are squeezed (Qwen2-MoE's `shared_expert_gate` [1, h] -> [h]), as
  llama.cpp does before writing;
- the transforms transformers' GGUF reader undoes (transformers/modeling_gguf_pytorch_utils.py):
  the "llama" architecture's q/k rows permuted per head (`_permute`), Gemma's norm weights
  stored as `1 + w` (ggml's RMSNorm multiplies by the weight itself);
- an untied `lm_head` becomes `output`; a tied one is not written (transformers then sets
  `tie_word_embeddings`);
- the tokenizer of `tokenizer_dir` (a byte-level BPE tokenizer.json) as `tokenizer.ggml.*`
  (model gpt2: tokens, token types, merges, special ids), which is also where transformers
  takes `vocab_size` from.

Tensors are float32, so what transformers dequantizes is the model's weights exactly (Gemma's
`1 + w` is exact when `w` is a multiple of 2**-12 below 1 in magnitude; the tests round the
norms so). Not a converter: only what the tests' tiny models hold.
"""
from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

# HF model_type -> llama.cpp architecture name (general.architecture); llama.cpp writes
# Mixtral as "llama" with expert_count, and names gemma3_text's architecture gemma3
ARCHITECTURES = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
                 "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3",
                 "olmo2": "olmo2", "olmoe": "olmoe", "mixtral": "llama", "llama": "llama"}
_EXPERT = re.compile(r"(?P<layer>.*\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\."
                     r"(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
# Mixtral's per-expert names -> the stacked tensor's HF name gguf's map knows
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _rope_theta(cfg: dict) -> float | None:
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:  # Gemma 3: per layer type; the global layers' base
        rope = rope["full_attention"]
    return cfg.get("rope_theta", rope.get("rope_theta"))


def _rope_scaling(cfg: dict) -> dict | None:
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        rope = rope["full_attention"]
    kind = rope.get("rope_type", rope.get("type"))
    return rope if kind not in (None, "default") else None


def _metadata(w, cfg: dict, arch: str) -> None:
    """The hyperparameter keys llama.cpp's converter writes for `cfg` (a config.json dict)."""
    import gguf

    w.add_block_count(cfg["num_hidden_layers"])
    if cfg["max_position_embeddings"] < 2**32:
        w.add_context_length(cfg["max_position_embeddings"])
    else:  # past uint32 (hostile files): as uint64
        w.add_uint64(f"{w.arch}.context_length", cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    if _rope_theta(cfg) is not None:
        w.add_rope_freq_base(float(_rope_theta(cfg)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size") is not None:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size") is not None:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch in ("gemma2", "gemma3", "phi3") and cfg.get("sliding_window") is not None:
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "phi3":
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    scaling = _rope_scaling(cfg)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])


def _tokenizer(w, tokenizer_dir: str, model_cfg: dict) -> None:
    """A byte-level BPE `tokenizer.json` as llama.cpp's gpt2 tokenizer keys, with the special
    ids of the tokenizer or of the model's config.json dict `model_cfg`; ids past the
    tokenizer's (the model's vocabulary may be larger) become padding tokens."""
    import gguf

    tok = json.load(open(os.path.join(tokenizer_dir, "tokenizer.json")))
    vocab = dict(tok["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(specials)
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(model_cfg["vocab_size"])]
    types = [gguf.TokenType.CONTROL if t in specials else
             gguf.TokenType.USER_DEFINED if i not in by_id else gguf.TokenType.NORMAL
             for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    tok_cfg = json.load(open(path)) if os.path.exists(path) else {}
    for kind, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id),
                      ("unk", w.add_unk_token_id), ("pad", w.add_pad_token_id)):
        # llama.cpp's SpecialVocab: the tokenizer's special token, else config.json's id
        token = tok_cfg.get(f"{kind}_token")
        if isinstance(token, str) and token in vocab:
            add(vocab[token])
        elif type(model_cfg.get(f"{kind}_token_id")) is int:
            add(model_cfg[f"{kind}_token_id"])


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order for the "llama" architecture (LlamaModel.permute): within
    each head, the two rotate-half halves interleaved; transformers' reader undoes it."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _tensors(cfg: dict, state: dict, arch: str) -> dict[str, np.ndarray]:
    """{GGUF tensor name: float32 array} of HF tensors `state`, as llama.cpp names and
    transforms them (module docstring)."""
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg["num_hidden_layers"])
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, np.ndarray] = {}
    for name, t in state.items():
        t = t.float()
        m = _EXPERT.fullmatch(name)
        if m:  # one stacked tensor per layer and projection, experts in order
            proj = _MIXTRAL_PROJ.get(m["proj"], m["proj"])
            key = f"{m['layer'].replace('block_sparse_moe', 'mlp')}.{proj}"
            stacks.setdefault(key, {})[int(m["e"])] = t
            continue
        base, _, suffix = name.rpartition(".")
        target = names.get_name(base)
        if target is None:
            raise ValueError(f"gguf's {arch} map has no name for {name}")
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = cfg["num_attention_heads"] if base.endswith("q_proj") else \
                cfg.get("num_key_value_heads", cfg["num_attention_heads"])
            t = _permute(t, heads)
        if arch in ("gemma2", "gemma3") and base.endswith("norm"):
            t = t + 1
        out[f"{target}.{suffix}"] = t.squeeze().numpy()
    for key, experts in stacks.items():
        target = names.get_name(key)
        if target is None:
            raise ValueError(f"gguf's {arch} map has no name for {key}")
        out[f"{target}.weight"] = torch.stack([experts[e] for e in sorted(experts)]).numpy()
    return out


def _encode(name: str, array: np.ndarray, kind: str, seed: int) -> tuple[np.ndarray, dict]:
    """`(data, add_tensor kwargs)` of float32 `array` stored as ggml type `kind`: F32 / F16
    as they are; Q8_0 / Q4_0 / Q4_1 by ggml's own rounding (gguf.quants.quantize); Q4_K /
    Q6_K (no Python quantizer) as random blocks of small finite scales
    (test_quant_formats.random_blocks): their values are then not the model's, only the
    file's, which is what the readers are compared on."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("F32", "F16"):
        return array.astype(np.float32 if kind == "F32" else np.float16), {}
    if kind in ("Q4_K", "Q6_K"):
        from test_quant_formats import random_blocks

        rows = int(np.prod(array.shape[:-1]))
        raw = random_blocks(kind.lower(), rows, array.shape[-1], seed).numpy()
        data = raw.reshape(*array.shape[:-1], -1)
    else:
        data = gguf.quants.quantize(np.ascontiguousarray(array, np.float32), qtype)
    return data, {"raw_dtype": qtype}


def write_gguf(hf_dir: str, path: str, tokenizer_dir: str | None = None,
               arch: str | None = None, quant: str | dict | None = None) -> str:
    """Write the model of `hf_dir` (config.json + one model.safetensors) as the float32 GGUF
    file `path`, with the tokenizer of `tokenizer_dir` when given; `arch` overrides
    general.architecture (default: `ARCHITECTURES[model_type]`). `quant`: the ggml type
    (`_encode`) of every tensor of 2 or more dimensions whose rows its blocks divide (the
    rest stay F32, as llama.cpp falls back), or `{GGUF tensor name: type}` overriding that
    per tensor (the default then F32). Returns `path`."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = arch or ARCHITECTURES[cfg["model_type"]]
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, arch)
    w.add_name(os.path.basename(os.path.normpath(hf_dir)))
    _metadata(w, cfg, arch)
    if tokenizer_dir is not None:
        _tokenizer(w, tokenizer_dir, cfg)
    else:
        w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for i, (name, array) in enumerate(_tensors(cfg, state, arch).items()):
        kind = quant.get(name, "F32") if isinstance(quant, dict) else quant or "F32"
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
        if not isinstance(quant, dict) and (array.ndim < 2 or array.shape[-1] % block):
            kind = "F32"
        data, kw = _encode(name, array, kind, i)
        w.add_tensor(name, np.ascontiguousarray(data), **kw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------- the tests' tiny models
VOCAB = 400  # test_finetune's tokenizer has 400 ids
EPS = 2.0 ** -20  # an RMSNorm epsilon float32 holds exactly (GGUF stores it as float32)
SEEDS = {"qwen3": 70, "qwen3_moe": 71, "qwen2_moe": 72, "phi3": 73, "gemma2": 74, "gemma3": 75}


def gguf_configs() -> dict:
    """name -> transformers config of a tiny model llama.cpp can write (no dense layers in
    the MoE models, Gemma's query_pre_attn_scalar 256: GGUF holds neither, and transformers
    takes every layer as MoE and 256); each with a field transformers' reader drops set away
    from its default (tests/test_hf_gguf_families.py's `LOST`)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig)

    common = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, initializer_range=0.2, rms_norm_eps=EPS,
                  bos_token_id=1, eos_token_id=2)
    moe = dict(intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
               num_experts=4, num_experts_per_tok=2, **common)
    gemma = dict(intermediate_size=96, head_dim=16, sliding_window=8, query_pre_attn_scalar=256,
                 pad_token_id=0, **common)
    return {
        "qwen3": Qwen3Config(intermediate_size=96, num_hidden_layers=2, head_dim=32,
                             tie_word_embeddings=False, **common),
        "qwen3_moe": Qwen3MoeConfig(norm_topk_prob=True, tie_word_embeddings=False, **moe),
        # the shared expert and its gate ([1, h], squeezed in the file); tied
        "qwen2_moe": Qwen2MoeConfig(shared_expert_intermediate_size=80, **moe),
        # fused qkv / gate_up, GQA 4:2, a sliding window of 6 < S on every layer
        "phi3": Phi3Config(intermediate_size=96, num_hidden_layers=2, sliding_window=6,
                           tie_word_embeddings=False, pad_token_id=0, **common),
        # layers 0 sliding (window 8 < S), 1 global; soft-caps that bite
        "gemma2": Gemma2Config(num_hidden_layers=2, attn_logit_softcapping=5.0,
                               final_logit_softcapping=3.0, **gemma),
        # llama.cpp's fixed pattern: 5 sliding layers (base 10^4), then a global one (base
        # 10^6, linear scaling x2)
        "gemma3": Gemma3TextConfig(num_hidden_layers=6, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
            **gemma),
    }


def _perturb(model) -> None:
    """Random 1-d weights (norms around 1, Gemma's zero-centred ones around 0, biases), so a
    misplaced one shows; multiples of 2**-12, so Gemma's `1 + w` in the file is exact."""
    gemma = model.config.model_type.startswith("gemma")
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.normal_(1.0 if "norm" in name and not gemma else 0.0, 0.3)
            p.copy_((p * 4096).round() / 4096)
    if gemma:  # test_hf_gemma's reason: else the tied embedding dominates
        model.model.embed_tokens.weight.mul_(model.config.hidden_size ** -0.5)


def tiny_gguf(name: str, root, tokenizer_dir: str | None = None):
    """`(HF folder, GGUF file, original model)` of tiny model `name` of `gguf_configs`
    (random, `_perturb`ed, seed `SEEDS[name]`), saved under `root` and written as
    `root/<name>-gguf/<name>.gguf` (a folder of its own)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEEDS[name])
    model = AutoModelForCausalLM.from_config(gguf_configs()[name]).eval()
    with torch.no_grad():
        _perturb(model)
    hf_dir = os.path.join(str(root), name)
    model.save_pretrained(hf_dir)
    os.makedirs(os.path.join(str(root), f"{name}-gguf"))
    path = os.path.join(str(root), f"{name}-gguf", f"{name}.gguf")
    return hf_dir, write_gguf(hf_dir, path, tokenizer_dir), model


def write_gpt_oss_gguf(model, path: str, rope_scaling: bool = True) -> str:
    """Write transformers `GptOssForCausalLM` `model` as the float32 GGUF file `path` the way
    llama.cpp's convert_hf_to_gguf.py (GptOssModel) writes a gpt-oss checkpoint whose experts
    are not MXFP4: architecture "gpt-oss"; sinks as `blk.N.attn_sinks.weight`; the fused
    `gate_up_proj` [E, H, 2F] (gate and up interleaved: even columns gate) transposed and split
    into `ffn_gate_exps.weight` / `ffn_up_exps.weight` [E, F, H] and its bias into
    `ffn_gate_exps.bias` / `ffn_up_exps.bias` [E, F]; `down_proj` [E, F, H] transposed into
    `ffn_down_exps.weight` [E, H, F]; the router as `ffn_gate_inp`; metadata as
    `_metadata` plus `attention.sliding_window`, `expert_feed_forward_length` and (when
    `rope_scaling`: llama.cpp always writes them) YaRN's `rope.scaling.type` / `.factor` /
    `.original_context_length`. Returns `path`."""
    import gguf

    cfg = model.config.to_dict()
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_name("tiny-gpt-oss")
    _metadata(w, cfg, "gpt-oss")
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    if rope_scaling:
        rope = model.config.rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg["num_hidden_layers"])

    def add(hf_name: str, t: torch.Tensor) -> None:
        base, _, suffix = hf_name.rpartition(".")
        w.add_tensor(f"{names.get_name(base)}.{suffix}",
                     np.ascontiguousarray(t.detach().float().numpy()))

    for name, t in model.state_dict().items():
        experts, _, proj = name.rpartition(".")
        if proj == "gate_up_proj_bias":
            add(f"{experts}.gate_proj.bias", t[..., ::2])
            add(f"{experts}.up_proj.bias", t[..., 1::2])
        elif proj == "gate_up_proj":
            add(f"{experts}.gate_proj.weight", t.transpose(-1, -2)[:, ::2])
            add(f"{experts}.up_proj.weight", t.transpose(-1, -2)[:, 1::2])
        elif proj == "down_proj_bias":
            add(f"{experts}.down_proj.bias", t)
        elif proj == "down_proj":
            add(f"{experts}.down_proj.weight", t.transpose(-1, -2))
        else:
            add(name + ".weight" if proj == "sinks" else name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
