"""ModelConfig's checks and counts for DeepSeek-V3-style models: multi-head latent attention
(layers/mla.py), YaRN RoPE scaling (layers/yarn.py) and group-limited MoE routing
(layers/moe/router.py). Fields come from untrusted files too: exact types and bounds."""
from __future__ import annotations

import math

from .config import ConfigError

_MAX = 2**31 - 1
_MLA_SIZES = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive_int(c, name: str) -> None:
    v = getattr(c, name)
    if type(v) is not int or not 1 <= v <= _MAX:
        raise ConfigError(f"{_flag(name)} must be a positive integer below 2**31, got {v!r}")


def validate_mla(c, tp: int) -> None:
    """Raise `ConfigError` for multi-head latent attention fields that do not fit together,
    the model or `tp` (heads split over TP; latents replicated)."""
    for name in _MLA_SIZES:
        _positive_int(c, name)
    if c.q_lora_rank is not None:
        _positive_int(c, "q_lora_rank")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"--qk-rope-head-dim {c.qk_rope_head_dim} must be even (RoPE turns "
                          f"pairs of dimensions)")
    if c.kv_channels != c.qk_nope_head_dim + c.qk_rope_head_dim:
        raise ConfigError(f"--kv-channels {c.kv_channels} must equal --qk-nope-head-dim + "
                          f"--qk-rope-head-dim ({c.qk_nope_head_dim + c.qk_rope_head_dim}), "
                          f"the query/key head dim of multi-latent attention; drop it")
    if c.num_query_groups != c.num_attention_heads:
        raise ConfigError(f"--num-query-groups {c.num_query_groups}: multi-latent attention "
                          f"has one key and value per head (its KV is compressed instead); "
                          f"drop the flag")
    if c.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {c.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}; use a tp that divides the heads")
    if c.model_type != "gpt" or c.position_embedding_type != "rope":
        raise ConfigError("--kv-lora-rank (multi-latent attention) is for decoder-only models "
                          "with --position-embedding-type rope (its decoupled RoPE key)")
    other = [name for name, off in (("add_bias_linear", False), ("add_qkv_bias", False),
                                    ("qk_layernorm", False), ("window_size", None),
                                    ("attn_logit_softcapping", None),
                                    ("rope_local_base_freq", None))
             if getattr(c, name) != off]
    if other:
        raise ConfigError(f"{', '.join(_flag(n) for n in other)} are not built with "
                          f"multi-latent attention (--kv-lora-rank); drop them")


def validate_mla_off(c) -> None:
    """The MLA sizes set without --kv-lora-rank: a config that half-describes MLA."""
    stray = [n for n in ("q_lora_rank", *_MLA_SIZES[1:]) if getattr(c, n) is not None]
    if stray:
        raise ConfigError(f"{', '.join(_flag(n) for n in stray)} configure multi-latent "
                          f"attention, but --kv-lora-rank is not set; set it or drop them")


def validate_yarn(c) -> None:
    """YaRN's fields (rope_scaling_type "yarn")."""
    for name in ("rope_beta_fast", "rope_beta_slow"):
        v = getattr(c, name)
        if not (type(v) in (int, float) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{_flag(name)} must be a positive finite number, got {v!r}")
    for name in ("rope_mscale", "rope_mscale_all_dim"):
        v = getattr(c, name)
        if v is not None and not (type(v) in (int, float) and math.isfinite(v) and v >= 0):
            raise ConfigError(f"{_flag(name)} must be a finite number >= 0 (or unset), got "
                              f"{v!r}")
    n = c.rope_original_max_position_embeddings
    if type(n) is not int or not 1 <= n <= 2**24:
        raise ConfigError(f"--rope-original-max-position-embeddings must be a positive "
                          f"integer (at most 2**24), got {n!r}")


def validate_group_routing(c) -> None:
    """moe_router_num_groups / moe_router_group_topk (DeepSeek-V3's n_group / topk_group)."""
    groups, top = c.moe_router_num_groups, c.moe_router_group_topk
    if groups is None and top is None:
        return
    if groups is None or top is None:
        raise ConfigError("--moe-router-num-groups and --moe-router-group-topk go together "
                          "(group-limited routing); set both or neither")
    e = c.num_moe_experts
    if type(groups) is not int or groups < 1 or e % groups or e // groups < 2:
        raise ConfigError(f"--moe-router-num-groups {groups!r} must divide --num-experts {e} "
                          f"into groups of at least 2 experts (a group's score is its best "
                          f"two)")
    if type(top) is not int or not 1 <= top <= groups:
        raise ConfigError(f"--moe-router-group-topk {top!r} must be in [1, "
                          f"--moe-router-num-groups {groups}]")
    if c.moe_router_topk > top * (e // groups):
        raise ConfigError(f"--moe-router-topk {c.moe_router_topk} is more than the "
                          f"{top * (e // groups)} experts of --moe-router-group-topk {top} "
                          f"groups; raise the group top-k")
    if c.moe_router_score_function != "sigmoid":
        raise ConfigError("group-limited routing (--moe-router-num-groups) is built for "
                          "--moe-router-score-function sigmoid (DeepSeek-V3's)")


def mla_parameters(c) -> int:
    """Parameters of one MLA attention: the down-projections, latent norms, up-projections
    and output projection (no biases)."""
    h, n = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = h * n * qk if c.q_lora_rank is None else \
        h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * qk
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank + \
        c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
    return q + kv + n * c.v_head_dim * h
