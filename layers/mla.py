"""Multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024, sec. 2.1; DeepSeek-V3
technical report, sec. 2.1.1), with its heads split over TP.

For a token's input `x [h]` (n heads; `d_c` = kv_lora_rank, `d_c'` = q_lora_rank, `d_n` =
qk_nope_head_dim, `d_r` = qk_rope_head_dim, `d_v` = v_head_dim):

- queries: `c_q = norm(W_DQ x) [d_c']`, `q = W_UQ c_q [n (d_n + d_r)]` (low-rank; with
  q_lora_rank None one projection `q = W_Q x`), each head `[q_nope (d_n), q_rope (d_r)]`;
- keys and values: `[c_kv (d_c), k_r (d_r)] = W_DKV x`, `c_kv` normed,
  `W_UKV c_kv [n (d_n + d_v)]`, each head `[k_nope (d_n), v (d_v)]`; the RoPE key `k_r` is
  one head shared by all heads (decoupled RoPE, V2 sec. 2.1.3);
- RoPE (rotate-half layout) on `q_rope` and `k_r`; head i attends with `q_i = [q_nope_i,
  q_rope_i]`, `k_i = [k_nope_i, k_r]` over `d_n + d_r` and returns `d_v` values; softmax scale
  `(d_n + d_r)^-0.5`, times `mscale(factor, mscale_all_dim)^2` under YaRN scaling
  (layers/yarn.py), unless `config.softmax_scale` is set;
- output `W_O [h, n d_v]`, row-parallel.

Tensor parallelism, as Megatron-Core's MLA with its default ("duplicated") down-projections:
the up-projections `W_UQ` (or `W_Q`) and `W_UKV` are column-parallel over heads (a rank
holds whole heads) and `W_O` row-parallel, so the core attention is local to a rank's heads;
the down-projections `W_DQ`, `W_DKV` and the latent norms are replicated (`ReplicatedLinear`).
Replicated, not sharded, because every rank needs the whole latent: sharding their output
dim would need an all-gather of the latents in forward (and a reduce-scatter in backward) for
weights that are small (h x (d_c' + d_c + d_r), about 2% of DeepSeek-V3's attention). Under
sequence parallelism they run on the rank's sequence shard `[s/tp, b, h]` (their weight and
the latent norms' gradients are then partial and summed over TP after backward, tagged
`sequence_parallel`), and the column-parallel up-projections all-gather the normed latents,
as they would gather `x`; the shared RoPE key is all-gathered over the sequence on its own.
Without sequence parallelism every rank computes the latents of the whole sequence, and the
up-projections' input (and the RoPE key's copy) all-reduce the latents' gradients over TP.

Context parallelism: the ring / all-gather attention of layers/context_parallel takes one
head dim for keys and values; there q, k and v are zero-padded to `max(d_n + d_r, d_v)`
(exact: zeros add nothing to a score, and the padded output columns are dropped).

Inference (the engine's paged cache, inference/kv_cache.py), two forms:

- the latent cache (default; a handle with `latent` set, `update_latent`): per token and
  layer only `[c_kv (normed), k_r (after RoPE)]`, `d_c + d_r` values, against
  `2 x n x max(d_n + d_r, d_v)` for full K/V (DeepSeek-V3: 576 against 49,152). A step whose
  tokens are all new (a fresh prefill) expands the latents with `W_UKV` and attends as in
  training. Otherwise the up-projection is absorbed (V2 sec. 2.1.2 and appendix; vLLM's and
  SGLang's MLA decode): head i's query becomes `[W_UK_i^T q_nope_i (d_c), q_rope_i (d_r)]`,
  every head attends to the same cached `[c_kv, k_r]` as one shared key head (multi-query
  attention over `d_c + d_r`, values `c_kv`, the same softmax scale, since
  `q_nope_i . (W_UK_i c) = (W_UK_i^T q_nope_i) . c`), and `W_UV_i` maps head i's `d_c`
  output to `d_v` before `W_O`: the latent is never expanded. Per query and cached key that
  costs `2 d_c + d_r` multiply-adds against `d_n + d_r + d_v` after expanding each cached key
  once (`d_c (d_n + d_v)`), so steps of more than `absorb_max_queries` new tokens per row
  (`d_c (d_n + d_v) / (2 d_c - d_n - d_v)`: 170 for DeepSeek-V3; a long chunk of a chunked
  prefill, a prompt after a prefix-cache hit) expand the cached latents instead, as vLLM's
  MLA prefill does. Absorption needs the plain weight of `W_UKV`: with LoRA adapters, FP8 or
  low-bit weights on it the cached latents are expanded at every step. Under TP each rank
  holds its heads' slices of `W_UKV` and the whole latent: the cache is replicated on every
  TP rank (it has no head dim to shard), so its bytes per token do not fall with tp.
- full K/V (`Engine(mla_latent_cache=False)`; `update(k, v)` of `[b, n/tp, s, d]`, the
  generic cache of SelfAttention): q, k, v zero-padded to one head dim as under CP.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_state import (copy_to_tensor_model_parallel_region,
                            gather_from_sequence_parallel_region,
                            get_tensor_model_parallel_world_size)

from .attention import LAYER_TYPES, CoreAttention, apply_rotary_pos_emb
from .dropout import add_dropout_site
from .linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from .norm import build_norm
from .yarn import yarn_mscale


def mla_softmax_scale(config) -> float:
    """`config.softmax_scale` if set, else `(qk_nope_head_dim + qk_rope_head_dim)^-0.5`, times
    `yarn_mscale(rope_scaling_factor, rope_mscale_all_dim)^2` under YaRN RoPE scaling with a
    non-zero mscale_all_dim (DeepSeek-V2/V3; transformers' `yarn_apply_mscale`)."""
    if config.softmax_scale is not None:
        return config.softmax_scale
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if config.rope_scaling_type == "yarn" and config.rope_mscale_all_dim:
        scale *= yarn_mscale(config.rope_scaling_factor, config.rope_mscale_all_dim) ** 2
    return scale


class MultiLatentAttention(CoreAttention):
    """Causal multi-head latent attention (module docstring), a drop-in for SelfAttention in
    a decoder layer (`config.multi_latent_attention`).

    `forward(x [s, b, h] (SP: [s/tp, b, h]), rotary=(cos, sin), kv_cache=None,
    attention_mask=None, attention_bias=None)` -> same shape as x. `rotary`: RoPE angles of
    `qk_rope_head_dim` for the tokens' positions (`[s, 1, 1, d_r]` or `[s, b, 1, d_r]`;
    required). `attention_mask` `[b, 1, s, s]` bool or additive (packed documents) replaces
    the causal mask. Attention dropout is the keyed dropout of layers/dropout.py at this
    module's site; selective recompute checkpoints the core attention (`checkpoint_fn`).

    `kv_cache`: the engine's per-layer handle: a latent cache's (`latent` set;
    `update_latent`) or the generic one of full padded K/V (module docstring).
    Raises `ValueError` for an `attention_bias`, a `kv_cache` or mask under context
    parallelism, and at construction for a tp that does not divide the heads.
    """

    def __init__(self, config, layer_number: int, sequence_parallel: bool = False,
                 cp_group=None, cp_comm_type: str = "p2p"):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        n = config.num_attention_heads
        if n % tp:
            raise ValueError(f"--num-attention-heads {n} is not divisible by "
                             f"--tensor-model-parallel-size {tp}")
        self.layer_number = layer_number
        self.cp_group, self.cp_comm_type = cp_group, cp_comm_type
        self.causal, self.window_size, self.softcap = True, None, None
        self.sequence_parallel = sp = sequence_parallel and tp > 1
        self.tensor_parallel = tp > 1
        self.num_heads = n // tp
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        # the generic KV cache's view (inference/runner.py): every head its own K and V, both
        # zero-padded to one head dim
        self.num_groups, self.head_dim = self.num_heads, max(self.qk_dim, self.v_dim)
        self.latent_dim = self.kv_lora_rank + self.rope_dim  # the latent cache's, per token
        excess = 2 * self.kv_lora_rank - self.nope_dim - self.v_dim  # see the module docstring
        self.absorb_max_queries = self.kv_lora_rank * (self.nope_dim + self.v_dim) // excess \
            if excess > 0 else 2**31
        self.softmax_scale = mla_softmax_scale(config)
        self.attention_dropout = config.attention_dropout
        add_dropout_site(self)  # set from the module's name (layers/dropout.py)
        h, q_out = config.hidden_size, n * self.qk_dim
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, q_out, bias=False,
                                                      sequence_parallel=sp, init="normal")
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, self.q_lora_rank, sequence_parallel=sp)
            self.q_layernorm = build_norm(config, sequence_parallel=sp,
                                          hidden_size=self.q_lora_rank)
            self.linear_q_up_proj = ColumnParallelLinear(self.q_lora_rank, q_out, bias=False,
                                                         sequence_parallel=sp, init="normal")
        self.linear_kv_down_proj = ReplicatedLinear(h, self.kv_lora_rank + self.rope_dim,
                                                    sequence_parallel=sp)
        self.kv_layernorm = build_norm(config, sequence_parallel=sp,
                                       hidden_size=self.kv_lora_rank)
        self.linear_kv_up_proj = ColumnParallelLinear(
            self.kv_lora_rank, n * (self.nope_dim + self.v_dim), bias=False,
            sequence_parallel=sp, init="normal")
        self.linear_proj = RowParallelLinear(n * self.v_dim, h, bias=False,
                                             sequence_parallel=sp, init="scaled_normal")
        self.checkpoint_fn = None  # selective recompute of the core attention

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """`[s, b, n/tp, d_n + d_r]` queries of this rank's heads (before RoPE)."""
        if self.q_lora_rank is None:
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        return q.view(*q.shape[:2], self.num_heads, self.qk_dim)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache=None, attention_mask: torch.Tensor | None = None,
                attention_bias: torch.Tensor | None = None) -> torch.Tensor:
        if attention_bias is not None or rotary is None or len(rotary) != 2:
            raise ValueError("multi-head latent attention takes one RoPE (cos, sin) pair of "
                             "qk_rope_head_dim and no attention_bias")
        q = self._queries(x)
        s, b = q.shape[:2]
        latent = self.linear_kv_down_proj(x)  # [s(/tp), b, d_c + d_r]
        c_kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_layernorm(c_kv)
        if getattr(kv_cache, "latent", False):
            return self._latent_cache_forward(q, c_kv, k_rope, rotary, kv_cache, attention_mask)
        kv = self.linear_kv_up_proj(c_kv)  # gathers c_kv under SP
        k_nope, v = kv.view(s, b, self.num_heads, -1).split([self.nope_dim, self.v_dim], -1)
        if self.sequence_parallel:  # the shared RoPE key of every token, on every rank
            k_rope = gather_from_sequence_parallel_region(k_rope)
        elif self.tensor_parallel:  # its gradient from this rank's heads is partial
            k_rope = copy_to_tensor_model_parallel_region(k_rope)
        cos, sin = rotary
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rotary_pos_emb(q_rope, cos, sin)
        k_rope = apply_rotary_pos_emb(k_rope.unsqueeze(2), cos, sin)  # [s, b, 1, d_r]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(s, b, self.num_heads, self.rope_dim)], dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n/tp, s, d]
        if self.cp_group is not None and (kv_cache is not None or attention_mask is not None):
            raise ValueError("context-parallel attention is causal over the whole sequence: "
                             "no kv_cache or attention_mask (--reset-attention-mask)")
        one_dim = self.cp_group is not None or kv_cache is not None
        if one_dim:  # q, k, v zero-padded to one head dim (module docstring)
            q, k, v = (F.pad(t, (0, self.head_dim - t.shape[-1])) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        if isinstance(attention_mask, dict):  # the engine's masks per layer kind: no window
            attention_mask = attention_mask[LAYER_TYPES[0]]
        out = self._run_core(q, k, v, attention_mask, None, None)
        if one_dim:
            out = out[..., :self.v_dim]
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.v_dim)
        return self.linear_proj(out)

    def _latent_cache_forward(self, q, c_kv, k_rope, rotary, kv_cache, attention_mask):
        """Inference with the latent cache (module docstring): q `[s, b, n/tp, d_n + d_r]`,
        c_kv `[s, b, d_c]` normed, k_rope `[s, b, d_r]` before RoPE -> `[s, b, h]`."""
        s, b = q.shape[:2]
        cos, sin = rotary
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rotary_pos_emb(q_rope, cos, sin).permute(1, 2, 0, 3)  # [b, n, s, d_r]
        k_rope = apply_rotary_pos_emb(k_rope.unsqueeze(2), cos, sin)  # [s, b, 1, d_r]
        new = torch.cat([c_kv.unsqueeze(2), k_rope.to(c_kv.dtype)], dim=-1)
        cached = kv_cache.update_latent(new.permute(1, 2, 0, 3))  # [b, 1, L, d_c + d_r]
        mask = attention_mask[LAYER_TYPES[0]] if isinstance(attention_mask, dict) \
            else attention_mask
        n, length = self.num_heads, cached.shape[2]
        up = self.linear_kv_up_proj
        if length > s and s <= self.absorb_max_queries and up.lora is None and \
                up.fp8 is None and not up._forward_hooks and isinstance(up.weight, torch.Tensor):
            w_uk, w_uv = up.weight.view(n, self.nope_dim + self.v_dim, self.kv_lora_rank) \
                .split([self.nope_dim, self.v_dim], dim=1)  # [n, d_n, d_c], [n, d_v, d_c]
            q_latent = torch.einsum("sbnd,ndc->bnsc", q_nope, w_uk.to(q_nope.dtype))
            out = self._run_core(torch.cat([q_latent, q_rope], dim=-1), cached,
                                 cached[..., :self.kv_lora_rank], mask, None, None)
            out = torch.einsum("bnsc,nvc->bnsv", out, w_uv.to(out.dtype))  # [b, n, s, d_v]
        else:  # expanded: every cached latent through W_UKV
            c_all, k_rope_all = cached.split([self.kv_lora_rank, self.rope_dim], dim=-1)
            kv = up(c_all[:, 0]).view(b, length, n, -1).transpose(1, 2)  # [b, n, L, d_n + d_v]
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_rope_all.expand(b, n, length, self.rope_dim)], dim=-1)
            q = torch.cat([q_nope.permute(1, 2, 0, 3), q_rope], dim=-1)
            out = self._run_core(q, k, v, mask, None, None)  # [b, n, s, d_v]
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, n * self.v_dim))

    def extra_repr(self) -> str:
        return (f"heads {self.num_heads} per rank, q_lora_rank={self.q_lora_rank}, "
                f"kv_lora_rank={self.kv_lora_rank}, qk {self.nope_dim}+{self.rope_dim}, "
                f"v {self.v_dim}, scale {self.softmax_scale:.4g}")

