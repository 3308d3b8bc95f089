"""Self-attention with a fused, column-parallel QKV projection and grouped-query heads.

Heads are split over TP ranks (Shoeybi et al. 2019, sec. 3, Fig. 3b): each rank owns
`num_query_groups / tp` KV groups and their `num_attention_heads / tp` query heads, runs the
core attention locally, and a row-parallel output projection sums the result.

Fused QKV layout (the dense weight, rows): for each query group g in order,
`[q heads of g (heads_per_group * d), k_g (d), v_g (d)]`. A contiguous split of the rows over
TP then gives each rank whole groups, so the same dense weight works at any TP. Grouped-query
attention is Ainslie et al. 2023; query head i reads KV group i // heads_per_group, as in HF.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from parallel_state import get_rng_tracker, get_tensor_model_parallel_world_size

from . import attention_kernels
from .context_parallel import context_parallel_attention
from .dropout import add_dropout_site, attention_dropout, sample_keyed

from .linear import ColumnParallelLinear, RowParallelLinear
from .norm import ProjectionRMSNorm, build_norm
from .sharding import set_tensor_parallel_attributes
from .yarn import yarn_inv_freq


def rope_inv_freq(dim: int, base: float, scaling_type: str | None = None, factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_position: int = 8192, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True) -> torch.Tensor:
    """RoPE inverse frequencies `[d/2]` float64: `base^(-2i/d)`, optionally scaled.

    "linear" (position interpolation, Chen et al. 2023, eq. 3) divides every frequency by
    `factor`. "llama3" (Llama 3.1, Meta 2024, sec. 3.3 "long context"; HF's
    `_compute_llama3_parameters`) keeps wavelengths shorter than
    `original_max_position / high_freq_factor`, divides those longer than
    `original_max_position / low_freq_factor` by `factor`, and blends linearly in between.
    "yarn" (Peng et al. 2023): layers/yarn.py `yarn_inv_freq` (with `beta_fast`, `beta_slow`,
    `truncate`).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if scaling_type is None:
        return inv_freq
    if scaling_type == "linear":
        return inv_freq / factor
    if scaling_type == "yarn":
        return yarn_inv_freq(inv_freq, dim, base, factor, original_max_position, beta_fast,
                             beta_slow, truncate)
    if scaling_type != "llama3":
        raise ValueError(f"unknown RoPE scaling {scaling_type!r}")
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position / wavelen - low_freq_factor) / \
        (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer, sec. 3.4), "rotate half" layout.

    `forward(seq_len, offset=0)` -> `(cos, sin)`, each `[s, 1, 1, d]` float32 for positions
    offset..offset+s-1, or, given `position_ids [b, s]` (one position per row and token, e.g.
    batched decoding of prompts of different lengths), `[s, b, 1, d]`; with the frequencies of `rope_inv_freq` (`scaling` holds its keyword
    arguments: scaling_type, factor, low/high_freq_factor, original_max_position,
    beta_fast/slow) and `attention_factor` (YaRN's, default 1: cos and sin are multiplied by
    it, so every RoPE score term scales by its square, as transformers' rotary embeddings do).
    """

    def __init__(self, dim: int, base: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        self.dim, self.base, self.scaling = dim, base, dict(scaling or {})
        self.attention_factor = float(self.scaling.pop("attention_factor", 1.0))
        self._table = None  # ((seq_len, offset, device), cos, sin) of the last contiguous call
        self._rows = None  # (cos, sin) `[P, d]` of positions 0..P-1 (CPU, position_ids)
        self._inv_freq = {}  # device -> rope_inv_freq

    def forward(self, seq_len: int, offset: int = 0, device=None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids is None:  # training asks for the same table every microbatch
            key = (seq_len, offset, torch.device(device) if device is not None else None)
            if self._table is None or self._table[0] != key:
                self._table = (key, *self._compute(seq_len, offset, device, None))
            return self._table[1], self._table[2]
        if position_ids.device.type == "cpu" and torch.device(device or "cpu").type == "cpu" \
                and position_ids.numel():
            return self._lookup(position_ids)
        return self._compute(seq_len, offset, device, position_ids)

    def _lookup(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with `position_ids [b, s]` on CPU (inference: a decode step asks for new
        positions every step) as rows of a table of positions 0..P-1, P doubled as positions
        grow: the same values as `_compute` (each row is that position's cos / sin, computed
        the same way), in 2 ops instead of ~10."""
        top = int(position_ids.max()) + 1
        if self._rows is None or self._rows[0].shape[0] < top:
            size = max(256, 1 << (top - 1).bit_length())
            cos, sin = self._compute(size, 0, "cpu", None)  # [P, 1, 1, d]
            self._rows = (cos[:, 0, 0], sin[:, 0, 0])
        pos = position_ids.t()  # [s, b]
        return self._rows[0][pos][:, :, None], self._rows[1][pos][:, :, None]

    def _compute(self, seq_len, offset, device, position_ids):
        key = torch.device(device if device is not None else "cpu")  # None: the CPU
        if key not in self._inv_freq:
            self._inv_freq[key] = rope_inv_freq(self.dim, self.base, **self.scaling).to(device)
        inv_freq = self._inv_freq[key]
        if position_ids is None:
            pos = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float64)
            freqs = torch.outer(pos, inv_freq)[:, None, None, :]  # [s, 1, 1, d/2]
        else:
            pos = position_ids.t().to(device=device, dtype=torch.float64)  # [s, b]
            freqs = (pos[..., None] * inv_freq)[:, :, None, :]  # [s, b, 1, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).float(), \
                (emb.sin() * self.attention_factor).float()
        return emb.cos().float(), emb.sin().float()


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [s, b, ..., d]` by angles given as `cos, sin` float32 broadcastable to it
    (`[s, 1, 1, d]` or `[s, b, 1, d]` for `[s, b, n, d]` heads), computed in float32."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    if x.dtype == cos.dtype:  # float32: no conversions (each is a dispatch in decode's loop)
        return x * cos + rotated * sin
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class CoreAttention(nn.Module):
    """The core attention shared by SelfAttention and MultiLatentAttention (layers/mla.py):
    SDPA or the explicit softmax (`core_attention`), the ring / all-gather attention under
    context parallelism, causal and sliding-window masks, keyed dropout, and the checkpoint
    of selective recompute. A subclass sets `cp_group`, `cp_comm_type`, `causal`,
    `window_size`, `softmax_scale`, `softcap`, `attention_dropout`, `checkpoint_fn` and
    calls `add_dropout_site(self)`; `sinks` (a `[n/tp]` parameter, gpt-oss's attention sinks,
    see `core_attention`) when it has them."""

    @property
    def window_size(self) -> tuple[int, int] | None:
        """`(left, right)` when this layer slides, None when it sees every earlier key. Kept
        as a tuple either way (`()` for None): torch 2.13's check whether one layer may reuse
        another's compiled nested region (compile_transformer_block) takes the length of
        whatever stands where the other layer had a tuple, and fails on a None."""
        return self._window or None

    @window_size.setter
    def window_size(self, value: tuple[int, int] | None) -> None:
        self._window = tuple(value) if value is not None else ()

    def _run_core(self, q, k, v, attention_mask, attention_bias, window):
        """The core attention, checkpointed under selective recompute (training only)."""
        if self.checkpoint_fn is not None and self.training and torch.is_grad_enabled():
            return self.checkpoint_fn(self._core_attention, q, k, v, attention_mask,
                                      attention_bias, window)
        return self._core_attention(q, k, v, attention_mask, attention_bias, window)

    def _core_attention(self, q, k, v, attention_mask=None, attention_bias=None, window=None):
        """Scaled dot-product attention (Vaswani et al. 2017, eq. 1), causal unless built
        with `causal=False`.

        q `[b, n, sq, d]`, k/v `[b, g, sk, d]`; when sk > sq (decoding with a cache) query i
        sits at position sk - sq + i. `attention_mask` `[b, 1, sq, sk]` (bool, or additive
        float), when given, is used instead of the causal mask. `window` `(left, right)` or
        None: keys before i - left are masked too (combined with `attention_mask`).
        `attention_bias` `[1 or b, n, sq, sk]` is added to the scores. Attention dropout:
        layers/dropout.py. Under context parallelism q, k, v are this CP rank's parts and
        the ring (or all-gather) attention of layers/context_parallel runs instead (with the sinks).
        """
        sinks = getattr(self, "sinks", None)
        if self.cp_group is not None:
            return context_parallel_attention(
                q, k, v, group=self.cp_group, comm_type=self.cp_comm_type,
                scale=self.softmax_scale,
                dropout_p=self.attention_dropout if self.training else 0.0,
                dropout_site=self.dropout_site, window_size=window, softcap=self.softcap,
                sinks=sinks)
        sq, sk = q.shape[2], k.shape[2]
        mask = attention_mask
        # square, unbiased, full: the fused kernel's is_causal, no [sq, sk] mask to build
        causal = mask is None and self.causal and sq == sk and attention_bias is None and \
            window is None and sinks is None
        if self.causal and (window is not None or (mask is None and sq > 1 and not causal)):
            band = causal_window_mask(torch.arange(sk - sq, sk, device=q.device), sk, window)
            mask = band if mask is None else _restrict(mask, band)
        return core_attention(q, k, v, mask, attention_bias, self.softmax_scale,
                              self.attention_dropout if self.training else 0.0, causal=causal,
                              dropout_site=self.dropout_site, softcap=self.softcap,
                              sinks=sinks)



class SelfAttention(CoreAttention):
    """Causal (or, with `causal=False`, bidirectional) multi-head / grouped-query self-attention.

    `forward(x [s, b, h] (or [s/tp, b, h] with SP), rotary=(cos, sin) | None, kv_cache=None,
    attention_mask=None, attention_bias=None)` -> `[s, b, h]` (or `[s/tp, b, h]`).
    `rotary` may hold two pairs `(cos, sin, cos_local, sin_local)`: sliding-window layers
    take the second (Gemma 3's `rope_local_base_freq`), the others the first.
    `attention_bias` `[1 or b, n/tp, sq, sk]` float is added to the scores of this rank's heads
    (T5's relative position bias); `softmax_scale` replaces 1/sqrt(d) (T5: 1, no scaling).
    `kv_cache`, when given, is this layer's handle on an inference cache (what the cache's
    `layer(layer_number)` returns; TransformerBlock asks for it), with `update(k, v) ->
    (k_all, v_all)` taking and returning `[b, g, s, d]` local KV heads: how inference appends
    to its cache.
    `attention_mask` `[b, 1, sq, sk]` bool (True = may attend), or float added to the scores
    (0 or -inf, in q's dtype), replaces the causal mask: it is how a batch of rows at
    different positions (padding, a shared cache) is masked.

    Sliding window (`config.layer_window_size(layer_number)`, Megatron's `window_size`
    `(left, right)`; Beltagy et al. 2020, Mistral's SWA): the query at position i attends keys
    i - left .. i, HF's `sliding_window` W = left + 1 keys (transformers' `masking_utils`:
    `q - W < k <= q`). Without a mask the band is built for queries at sk - sq .. sk - 1; a
    tensor `attention_mask` (packed documents) is combined with that band; a dict
    `{"full_attention": mask, "sliding_attention": mask}` (HF's layer types; the engine's
    masks for rows at their own positions) gives each kind of layer its complete mask.

    Context parallelism (`cp_group`, a process group of cp > 1 ranks; Megatron's
    --context-parallel-size): `x` holds this CP rank's load-balanced part of each sequence
    (`layers.context_parallel`: chunks r and 2cp-1-r, `[s/cp, b, h]`), `rotary` the angles
    of those tokens' global positions, and the core attention is
    `layers.context_parallel.context_parallel_attention` over the CP group (`cp_comm_type`
    "p2p": ring; "all_gather"), causal over the whole sequence, with the sliding window,
    soft-cap and attention dropout of the layer. No `attention_mask`, `attention_bias` or
    `kv_cache` then (ValueError: training only, no packed-document masks).

    Attention sinks (`config.softmax_type` "learnable", Megatron-Core's name; gpt-oss,
    OpenAI 2025; Xiao et al. 2023 "StreamingLLM"): `sinks [n/tp]`, one learned logit per
    head, split over TP with the heads, joins each query's softmax denominator
    (`core_attention`).

    Raises `ValueError` when tp neither divides num_query_groups nor is a multiple of it.
    """

    def __init__(self, config, layer_number: int, sequence_parallel: bool = False,
                 causal: bool = True, softmax_scale: float | None = None,
                 cp_group=None, cp_comm_type: str = "p2p"):
        super().__init__()
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type
        if cp_group is not None and not causal:
            raise ValueError("context parallelism splits causal self-attention only; an "
                             "encoder (causal=False) runs at --context-parallel-size 1")
        tp = get_tensor_model_parallel_world_size()
        self.layer_number = layer_number
        self.causal = causal  # False: bidirectional (an encoder)
        # (left, right) when this layer slides (causal only), None: every earlier key
        self.window_size = config.layer_window_size(layer_number) if causal else None
        # None: 1/sqrt(d); T5 uses 1.0; Gemma query_pre_attn_scalar^-0.5 (config.softmax_scale)
        self.softmax_scale = softmax_scale if softmax_scale is not None else \
            getattr(config, "softmax_scale", None)
        self.softcap = getattr(config, "attn_logit_softcapping", None)  # Gemma 2
        self.head_dim = d = config.kv_channels
        groups = config.num_query_groups
        self.num_heads = config.num_attention_heads // tp
        if groups % tp == 0:
            self.num_groups, self.kv_replicas = groups // tp, 1
        elif tp % groups == 0:
            self.num_groups, self.kv_replicas = 1, tp // groups
        else:
            raise ValueError(f"tensor-model-parallel-size {tp} neither divides nor is a multiple "
                             f"of num_query_groups {groups}; use a tp that does")
        self.heads_per_group = self.num_heads // self.num_groups  # local query heads per group
        self.attention_dropout = config.attention_dropout
        add_dropout_site(self)  # set from the module's name (layers/dropout.py)
        local_qkv = (self.num_heads + 2 * self.num_groups) * d
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, local_qkv * tp, bias=config.add_qkv_bias,
            sequence_parallel=sequence_parallel, init="normal")
        if self.kv_replicas > 1:
            for p in self.linear_qkv.parameters():
                p.kv_replicas = self.kv_replicas
                p.qkv_layout = (groups, config.num_attention_heads // groups, d)
        self.linear_proj = RowParallelLinear(
            config.query_projection_size, config.hidden_size, bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel, init="scaled_normal")
        if getattr(config, "softmax_type", "vanilla") == "learnable":  # gpt-oss's sinks
            self.sinks = nn.Parameter(torch.empty(self.num_heads))
            set_tensor_parallel_attributes(self.sinks, partition_dim=0, init="normal")
        self.checkpoint_fn = None  # selective recompute of the core attention (layers/recompute.py)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm and config.qk_norm_over_heads:  # OLMo 2: the whole projection
            self.q_layernorm = ProjectionRMSNorm(config.query_projection_size,
                                                 config.layernorm_epsilon)
            self.k_layernorm = ProjectionRMSNorm(config.kv_projection_size,
                                                 config.layernorm_epsilon)
        elif config.qk_layernorm:  # Qwen3: per head over d, one weight shared by all heads,
            # so each TP rank's gradient is partial: summed over TP like SP norms' (the tag)
            self.q_layernorm, self.k_layernorm = (
                build_norm(config, sequence_parallel=tp > 1, hidden_size=d) for _ in range(2))

    def _norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """q/k norms (`qk_layernorm`) on `qk [s, b, g, hpg + 1, d]` (the q heads of each
        group, then its k head), before RoPE as in Qwen3 and OLMo 2."""
        q, k = qk.split([self.heads_per_group, 1], dim=3)
        if isinstance(self.q_layernorm, ProjectionRMSNorm):  # heads in order: g, then hpg
            s, b = qk.shape[:2]
            q = self.q_layernorm(q.reshape(s, b, -1)).view(q.shape)
            k = self.k_layernorm(k.reshape(s, b, -1)).view(k.shape)
        else:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        return torch.cat([q, k], dim=3)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache=None, attention_mask: torch.Tensor | None = None,
                attention_bias: torch.Tensor | None = None) -> torch.Tensor:
        if rotary is not None and len(rotary) == 4:  # (global pair, sliding layers' pair)
            rotary = rotary[2:] if self.window_size is not None else rotary[:2]
        mixed = self.linear_qkv(x)  # [s, b, groups * (heads_per_group + 2) * d]
        s, b = mixed.shape[:2]
        mixed = mixed.view(s, b, self.num_groups, self.heads_per_group + 2, self.head_dim)
        qk, v = mixed.split([self.heads_per_group + 1, 1], dim=3)
        if self.q_layernorm is not None:
            qk = self._norm_qk(qk)
        if rotary is not None:  # q and k heads rotated in one pass: [s, b, g, hpg + 1, d]
            cos, sin = rotary
            qk = apply_rotary_pos_emb(qk, cos.unsqueeze(-2), sin.unsqueeze(-2))
        q, k = qk.split([self.heads_per_group, 1], dim=3)
        q = q.reshape(s, b, self.num_heads, self.head_dim)
        k = k.squeeze(3)  # [s, b, g, d]
        if rotary is not None and torch.is_grad_enabled():
            # copies: a view would keep all of qk alive for backward
            q, k = q.contiguous(), k.contiguous()
        v = v.squeeze(3)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        window = self.window_size
        if self.cp_group is not None and (kv_cache is not None or attention_bias is not None
                                          or attention_mask is not None):
            raise ValueError("context-parallel attention is causal over the whole sequence: "
                             "no kv_cache, attention_mask (--reset-attention-mask) or "
                             "attention_bias; run at --context-parallel-size 1 for those")
        if isinstance(attention_mask, dict):  # complete masks per layer kind: no band to add
            attention_mask = attention_mask[LAYER_TYPES[window is not None]]
            window = None
        out = self._run_core(q, k, v, attention_mask, attention_bias, window)
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)
        return self.linear_proj(out)

LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names, indexed by "slides"


def _restrict(mask: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`mask` (bool, True = may attend, or additive float) that also hides what `allowed`
    (bool, broadcastable) does not allow."""
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


def window_attention_masks(attention_mask: torch.Tensor | None, seq_length: int,
                           window_size: tuple[int, int], dtype: torch.dtype,
                           device=None) -> dict:
    """The per-layer-kind masks of a forward without a cache (training, a prefill from
    position 0), made once for every layer: `{"full_attention": attention_mask,
    "sliding_attention": additive [1 or b, 1, s, s] float of `dtype`}` (0 or -inf: causal,
    inside `window_size`, and allowed by `attention_mask` `[b, 1, s, s]` bool or additive,
    e.g. packed documents). Additive in the activation dtype, so the attention kernels use it
    as it is: SDPA keeps one shared tensor for backward instead of a converted copy per layer.
    """
    allowed = causal_window_mask(torch.arange(seq_length, device=device), seq_length,
                                 window_size)
    sliding = torch.zeros(allowed.shape, dtype=dtype, device=device)
    sliding = sliding.masked_fill_(~allowed, float("-inf"))[None, None]
    if attention_mask is not None:
        sliding = _restrict(sliding, attention_mask)
    return {LAYER_TYPES[0]: attention_mask, LAYER_TYPES[1]: sliding}


def causal_window_mask(query_positions: torch.Tensor, num_keys: int,
                       window_size: tuple[int, int] | None = None) -> torch.Tensor:
    """Which keys (positions 0..num_keys-1) each query may attend: `[..., sq, num_keys]` bool
    for `query_positions [..., sq]`, True where `key <= query` and, with `window_size`
    `(left, right)` (right is 0), `key >= query - left`: transformers' sliding-window mask
    `query - W < key <= query` for W = left + 1 (masking_utils' `sliding_window_overlay`)."""
    keys = torch.arange(num_keys, device=query_positions.device)
    query = query_positions[..., None]
    allowed = keys <= query
    if window_size is not None:
        allowed = allowed & (keys >= query - window_size[0])
    return allowed


# Under no-grad on CPU, SDPA of these dtypes runs on float32 copies of q, k, v and the mask,
# its output rounded to the input's dtype once: torch's bf16 CPU attention kernel (no bf16
# instructions on AVX2) took a SmolLM2 decode step's attention 5-7x longer than the float32
# kernel plus the copies (9 query heads, 3 KV heads, 100 keys). The result is as accurate as
# the narrow kernel's or more (that one rounds its probabilities to bf16 before P V).
_NARROW = (torch.bfloat16, torch.float16)

# Compiled on CPU without grad, attention over at most this many keys goes through
# `_explicit_attention` in float32 rather than SDPA, whose CPU kernel pays a fixed cost per
# (row, head) block that dominates at short lengths: SmolLM2's prefill of 8 rows x 45
# tokens took 461 vs 779 us a layer in float32 and 591 vs 1,051 in bf16, 8 x 128 tokens
# 2,499 vs 2,845 / 2,975 vs 3,343; at one row x 256 the explicit form was slower (1,495 vs
# 1,116 us); 2-core Zen 4, 2026-12-04.
SHORT_PREFILL_KEYS = 128


def core_attention(q, k, v, mask, bias, scale, dropout_p, causal=False,
                   dropout_site: int = 0, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`softmax(q k^T * scale + bias, masked) v` -> `[b, n, sq, d]`; with `softcap` (Gemma 2's
    attn_logit_softcapping) the scaled scores become `softcap * tanh(scores / softcap)`
    before bias and mask (transformers' eager Gemma attention), in the explicit softmax.

    q `[b, n, sq, d]`; k `[b, g, sk, d]`, v `[b, g, sk, dv]` with n a multiple of g
    (grouped-query heads; dv may differ from d: multi-latent attention's v_head_dim, the
    result then `[b, n, sq, dv]`);
    `mask` broadcastable to `[b, n, sq, sk]`, bool (True = may attend) or float added to the
    scores (0 or -inf; what SDPA makes of a bool mask), or None; `bias` float
    broadcastable to `[b, n, sq, sk]` or None; `scale` None = 1/sqrt(d); `causal` (with mask
    None) lets the fused kernel build the mask. A bias goes through the explicit float32
    softmax (its gradient is needed: T5's position bias is learned); otherwise
    `F.scaled_dot_product_attention`, except one query per row (sq 1) without grad, bias
    or dropout under `torch.compile` on CPU (inference's decode), which takes
    `_decode_attention`, and, under the same conditions, several queries over at most
    `SHORT_PREFILL_KEYS` keys (a short prompt's prefill), which take `_explicit_attention`
    in float32. Dropout (`dropout_p > 0`, training) on the
    probabilities: `layers.dropout.attention_dropout` at `dropout_site`; its masks need the
    probabilities, so they go through the explicit softmax too (as SDPA's CPU math kernel
    does whenever it has dropout).

    `sinks` `[n]` (attention sinks, gpt-oss): head j's logit `sinks[j]` joins every query's
    softmax as one more key with no value, `p_ik = exp(s_ik) / (sum_k' exp(s_ik') +
    exp(sinks[j]))` (transformers' `eager_attention_forward` of GptOss), so a row's
    probabilities sum to less than 1. The explicit softmax computes it (SDPA has no sink).
    """
    compiled_inference = bias is None and dropout_p == 0 and torch.compiler.is_compiling() \
        and q.device.type == "cpu" and not torch.is_grad_enabled()
    if compiled_inference and q.shape[2] == 1 and not causal:
        return _decode_attention(q, k, v, mask, scale, softcap, sinks)
    if compiled_inference and k.shape[2] <= SHORT_PREFILL_KEYS:
        # a short prompt's prefill: float32 matmuls with inductor's fused softmax between
        return _explicit_attention(q.float(), k.float(), v.float(), mask, None, scale, 0.0,
                                   causal, 0, softcap, sinks).to(q.dtype)
    if bias is None and softcap is None and sinks is None and \
            not (dropout_p > 0 and sample_keyed()):
        kwargs = dict(enable_gqa=q.shape[1] != k.shape[1], scale=scale)
        if causal:
            kwargs["is_causal"] = True
        elif mask is not None:
            kwargs["attn_mask"] = mask
        if dropout_p == 0 and q.dtype in _NARROW and q.device.type == "cpu" \
                and not torch.is_grad_enabled():
            # inference in bf16 / fp16 on CPU: SDPA in float32 (see _NARROW), rounded once
            if mask is not None and mask.dtype != torch.bool:
                kwargs["attn_mask"] = mask.float()
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
            return out.to(q.dtype)
        if dropout_p == 0:
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        with get_rng_tracker().fork():  # Megatron's scheme: heads are sharded, the TP stream
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **kwargs)
    return _explicit_attention(q, k, v, mask, bias, scale, dropout_p, causal, dropout_site,
                               softcap, sinks)


def _explicit_attention(q, k, v, mask, bias, scale, dropout_p, causal, dropout_site,
                        softcap, sinks=None) -> torch.Tensor:
    """`core_attention` as two matmuls around `_softmax` (float32 probabilities): the path of
    a bias, dropout masks, softcap, and short compiled prefill. Same arguments and shapes."""
    b, n, sq, d = q.shape
    g, sk = k.shape[1], k.shape[2]
    if causal:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # grouped-query heads without copies of k, v: the n/g query heads of a group as rows
    scores = torch.matmul(q.reshape(b, g, n // g * sq, d), k.transpose(-1, -2))
    wide = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 kept
    probs = _softmax(scores.view(b, n, sq, sk).to(wide), scale, softcap, bias, mask,
                     sinks).to(q.dtype)
    if dropout_p > 0:
        probs = attention_dropout(probs, dropout_p, dropout_site)
    return torch.matmul(probs.view(b, g, n // g * sq, sk), v).view(b, n, sq, v.shape[-1])


def _softmax(scores, scale, softcap, bias, mask, sinks=None) -> torch.Tensor:
    """The explicit softmax's probabilities `[b, n, sq, sk]` from float32 (or float64)
    `scores` of that shape: scaled, soft-capped, biased and masked (bool or additive,
    broadcastable), in that order (transformers' eager attention); with `sinks [n]` each
    head's sink logit joins the denominator (`core_attention`)."""
    if scale != 1.0:
        scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask.to(scores.dtype)
    if sinks is not None:  # one more logit per row; its probability is dropped
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.softmax(scores, dim=-1)


def _decode_attention(q, k, v, mask, scale, softcap, sinks=None) -> torch.Tensor:
    """`core_attention` of one query per row (decode) under `torch.compile` on CPU, written
    as broadcast products and sums that inductor fuses into a few loops over the keys: `q
    [b, n, 1, d]`, `k, v [b, g, sk, d]` (any strides: the paged cache's views), `mask` as
    for `core_attention` -> `[b, n, 1, d]` in q's dtype, computed in float32. SDPA's CPU
    kernel spends ~150-250 us a layer on a SmolLM2 decode step at 8 rows (a small GEMM per
    row and head); these loops took 74-103 us as a compiled call of their own, its ~30-60
    us wrapper included (2-core Zen 4, 2026-12-04).

    Without softcap or sinks, float32 or bf16 with an additive mask, the C++ kernel
    (layers/attention_kernels.py) computes the same in one pass over the keys and values:
    at 64 rows x 130 keys 314 us a layer in bf16 against these loops' 569, 370 against 578
    in float32; 260 keys 583 / 665 against 1,427 / 1,882 (2-core Zen 4, 2026-12-07)."""
    if softcap is None and sinks is None and attention_kernels.supports(q, k, v, mask):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        return attention_kernels.decode_attention(q, k, v, mask, scale)
    b, n, _, d = q.shape
    g, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.float().view(b, g, n // g, 1, d)  # the n/g query heads of group j share its keys
    scores = (qg * k.float()[:, :, None]).sum(-1)  # [b, g, n/g, sk]
    probs = _softmax(scores.view(b, n, 1, sk), scale, softcap, None, mask, sinks)
    out = (probs.view(b, g, n // g, sk, 1) * v.float()[:, :, None]).sum(-2)  # [b, g, n/g, d]
    return out.reshape(b, n, 1, v.shape[-1]).to(q.dtype)


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool,
                             num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of each relative position `key - query` (Raffel et al. 2020, sec. 2.1).

    Half the buckets (per direction when `bidirectional`; a causal decoder folds keys after
    the query onto distance 0) hold the exact distances 0..n/2-1; the rest grow
    logarithmically up to `max_distance`, beyond which all distances share the last bucket.
    Returns int64 buckets in [0, num_buckets), the shape of `relative_position`.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """T5's learned relative position bias: a `[num_buckets, n]` table, heads split over TP
    (each rank holds the columns of its `n/tp` heads, so the bias needs no communication).

    `forward(sq, sk)` -> `[1, n/tp, sq, sk]` float for queries at positions sk-sq..sk-1
    (decoding with a cache) and keys 0..sk-1; with `query_positions [b, sq]` (batched
    decoding, each row at its own position) -> `[b, n/tp, sq, sk]`. Buckets bidirectional or
    causal as built.
    """

    def __init__(self, num_buckets: int, max_distance: int, num_heads: int, bidirectional: bool):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.weight = nn.Parameter(torch.empty(num_buckets, num_heads // tp))
        set_tensor_parallel_attributes(self.weight, partition_dim=1, init="normal")

    def forward(self, sq: int, sk: int, device=None,
                query_positions: torch.Tensor | None = None) -> torch.Tensor:
        device = device or self.weight.device
        key = torch.arange(sk, device=device)
        if query_positions is not None:  # [b, sq]: rows at their own positions (decoding)
            relative = key[None, None, :] - query_positions.to(device)[:, :, None]
            buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets,
                                               self.max_distance)
            return F.embedding(buckets, self.weight).permute(0, 3, 1, 2)  # [b, n/tp, sq, sk]
        query = torch.arange(sk - sq, sk, device=device)[:, None]
        buckets = relative_position_bucket(key[None, :] - query, self.bidirectional,
                                           self.num_buckets, self.max_distance)
        return F.embedding(buckets, self.weight).permute(2, 0, 1).unsqueeze(0)


class CrossAttention(nn.Module):
    """Encoder-decoder attention: queries from the decoder, keys/values from the encoder
    output (Vaswani et al. 2017, sec. 3.2.3), heads split over TP as in SelfAttention.

    `forward(x [sd, b, h], encoder_output [se, b, h], attention_mask=None, kv_cache=None)`
    -> `[sd, b, h]` (under SP both inputs are sequence shards `[s/tp, b, h]` and so is the
    output). `linear_kv` fuses `[K; V]` (two blocks, each split over TP). No position bias
    (T5). `attention_mask` `[b, 1, sd, se]` bool (True = may attend: encoder padding).
    `kv_cache`, when given, is this layer's handle on the cache (as for SelfAttention), with
    `cross(compute) -> (k, v)` returning `[b, n/tp, se, d]` that it computed once (from
    `compute()`) and keeps for every decoding step.
    """

    def __init__(self, config, layer_number: int, sequence_parallel: bool = False,
                 softmax_scale: float | None = None):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.layer_number = layer_number
        self.head_dim = config.kv_channels
        self.num_heads = config.num_attention_heads // tp
        self.softmax_scale = softmax_scale
        self.attention_dropout = config.attention_dropout
        add_dropout_site(self)  # set from the module's name (layers/dropout.py)
        proj = config.query_projection_size
        self.linear_q = ColumnParallelLinear(config.hidden_size, proj, bias=config.add_qkv_bias,
                                             sequence_parallel=sequence_parallel, init="normal")
        self.linear_kv = ColumnParallelLinear(config.hidden_size, 2 * proj,
                                              bias=config.add_qkv_bias, num_fused_parts=2,
                                              sequence_parallel=sequence_parallel, init="normal")
        self.linear_proj = RowParallelLinear(proj, config.hidden_size, bias=config.add_bias_linear,
                                             sequence_parallel=sequence_parallel,
                                             init="scaled_normal")
        self.checkpoint_fn = None

    def key_values(self, encoder_output: torch.Tensor):
        """`[se, b, h]` (or its SP shard) -> k, v `[b, n/tp, se, d]`."""
        kv = self.linear_kv(encoder_output)  # [se, b, 2 * n/tp * d]
        se, b = kv.shape[:2]
        k, v = kv.view(se, b, 2, self.num_heads, self.head_dim).unbind(2)
        return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)

    def forward(self, x, encoder_output, attention_mask=None, kv_cache=None) -> torch.Tensor:
        q = self.linear_q(x)
        s, b = q.shape[:2]
        q = q.view(s, b, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        if kv_cache is not None:
            k, v = kv_cache.cross(lambda: self.key_values(encoder_output))
        else:
            k, v = self.key_values(encoder_output)
        p = self.attention_dropout if self.training else 0.0
        if self.checkpoint_fn is not None and self.training and torch.is_grad_enabled():
            out = self.checkpoint_fn(_cross_core(self.softmax_scale, p, self.dropout_site),
                                     q, k, v, attention_mask)
        else:
            out = core_attention(q, k, v, attention_mask, None, self.softmax_scale, p,
                                 dropout_site=self.dropout_site)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


def _cross_core(scale, p, site):
    def run(q, k, v, mask):
        return core_attention(q, k, v, mask, None, scale, p, dropout_site=site)
    return run
