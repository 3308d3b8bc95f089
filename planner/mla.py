"""Activation bytes of multi-head latent attention (layers/mla.py), term by term.

For one layer on one rank: `s` tokens (a CP rank's part under context parallelism), `b` micro
batch, `t` TP, `n_t = n / t` heads, `d_c'` q_lora_rank, `d_c` kv_lora_rank, `d_n` / `d_r`
qk_nope / qk_rope head dims, `d_v` v_head_dim, `d_qk = d_n + d_r`, `e` bytes a value, `s_l`
the rows of the replicated down-projections and latent norms (`s / t` under sequence
parallelism, else `s`). What the layer code saves for backward (measured with
training.memory's saved-tensor meter, tests/test_planner_mla.py), beside the layer input `x`
that the down-projections share (planner/activations.py's "qkv and fc1 inputs"):

- query latent (with q_lora_rank): the norm's terms over `d_c'` (`norm_bytes`: the float32
  input, rstd, the normalized values) and `W_UQ`'s input `e s_l b d_c'`;
- KV latent: the down-projection's output `[c_kv, k_r]` `e s_l b (d_c + d_r)` (the norm's
  float32 input is a view of it in float32; in a lower precision the norm keeps a float32
  copy of `c_kv` instead), the norm's rstd and normalized values over `d_c`, and `W_UKV`'s
  input `e s_l b d_c`. RoPE keeps only the shared cos / sin tables of `d_r`
  (planner/activations.py `model_chunk_bytes`);
- the attention core, over `n_t` heads of this rank:
  - selective recompute: the checkpoint's inputs q and k (RoPE's concatenations, `e s b n_t
    d_qk` each) and v (a view of `W_UKV`'s output, `e s b n_t (d_n + d_v)`);
  - SDPA's fused kernel (no dropout) when `d_qk == d_v`: q, k, v as above, the output
    (which the projection views: laid out `[b, s, n, d]`) and the float32 log-sum-exp;
  - SDPA's math kernel when `d_qk != d_v` (DeepSeek: 192 against 128; the fused CPU kernel
    takes one head dim), no dropout, in float32 on CPU: scaled q and k^T copies (`4 s b n_t
    d_qk` each), the softmax `4 b n_t s^2`, and v: the view of `W_UKV`'s output in float32,
    else its float32 copy `4 s b n_t d_v`;
  - the explicit softmax (dropout keyed by sample, layers/attention.py): q reshaped for the
    grouped product (a copy), k viewing RoPE's concatenation, the float32 probabilities,
    the mask and the dropped probabilities (`e` each) and the causal mask's complement
    (bool `s^2`), v's view;
  - context parallelism (layers/context_parallel): q, k, v zero-padded to `d = max(d_qk,
    d_v)` (copies), the output of `d` and the float32 log-sum-exp (selective: the padded
    inputs only);
  and the projection's input `e s b n_t d_v` (the output sliced and laid out `[s, b, n_t
  d_v]`), a copy except where it views a kept output (the fused kernel's; CP's when `d_v ==
  d`).
"""
from __future__ import annotations


def _latent_norm_bytes(config, rows: int, width: int, e: int) -> int:
    """A latent norm's saved bytes over `rows` of `width` (RMSNorm as
    planner.activations.norm_bytes, LayerNorm its input and statistics)."""
    if config.normalization == "RMSNorm":
        return rows * (4 * width + 4 + e * width)
    return e * rows * (width + 2)


def mla_attention_bytes(config, s: int, b: int, t: int = 1, sp: bool = False,
                        recompute: str | None = None, bytes_per_value: int = 4,
                        att_drop: bool = False, keyed_dropout: bool = True,
                        context_parallel: bool = False) -> dict:
    """`{term: bytes}` one MLA layer's attention saves for backward on one rank beyond the
    layer input (module docstring): `s` tokens (a CP rank's part with `context_parallel`),
    micro batch `b`, TP `t`, `sp` sequence parallel, `recompute` None or "selective",
    `att_drop` attention dropout on (`keyed_dropout`: masks keyed by sample, the explicit
    softmax; else SDPA's stream dropout, which this does not model: ValueError naming the
    fix). Raises ValueError for full recompute (the layer keeps only its input then)."""
    if recompute == "full":
        raise ValueError("under --recompute-granularity full a layer keeps only its input: "
                         "use planner.activations.model_layer_bytes")
    if att_drop and not keyed_dropout and recompute != "selective" and not context_parallel:
        raise ValueError("MLA activations with --dropout-masks rank-streams are not "
                         "modelled; use --dropout-masks sample (the default)")
    e, n = bytes_per_value, config.num_attention_heads // t
    d_n, d_r, d_v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    d_c, d_qk = config.kv_lora_rank, d_n + d_r
    rows = (s // t if sp else s) * b  # the down-projections' and latent norms' rows
    out = {}
    if config.q_lora_rank is not None:
        r = config.q_lora_rank
        out["mla query latent"] = _latent_norm_bytes(config, rows, r, e) + e * rows * r
    kv_norm = _latent_norm_bytes(config, rows, d_c, e)
    # RMSNorm in float32: its input is a view of the whole down-projection output [c_kv,
    # k_r]; in a lower precision it keeps a float32 copy of c_kv and the output is not kept
    if config.normalization != "RMSNorm" or e == 4:
        kv_norm += e * rows * d_r
    out["mla kv latent"] = kv_norm + e * rows * d_c
    heads = s * b * n
    kv_up = e * heads * (d_n + d_v)  # W_UKV's output: v (and k_nope) view it
    proj = e * heads * d_v  # the projection's input, when it is a copy
    if context_parallel:
        d = max(d_qk, d_v)
        out["mla attention q, k, v (padded)"] = 3 * e * heads * d
        if recompute != "selective":  # the projection views the output when d_v == d
            out["mla attention output, log-sum-exp"] = e * heads * d + 4 * b * n * s
            proj = proj if d_v != d else 0
    elif recompute == "selective":  # the checkpoint's inputs
        out["mla attention q, k, v"] = 2 * e * heads * d_qk + kv_up
    elif not att_drop and d_qk == d_v:  # the fused kernel; the projection views its output
        out["mla attention q, k, v"] = 2 * e * heads * d_qk + kv_up
        out["mla attention output, log-sum-exp"] = e * heads * d_v + 4 * b * n * s
        proj = 0
    elif not att_drop:  # SDPA's math kernel, float32 on CPU (a lower precision upcast)
        v = kv_up if e == 4 else 4 * heads * d_v  # a view, or v's float32 copy
        out["mla attention q, k, v"] = 2 * 4 * heads * d_qk + v
        out["mla attention s^2 (softmax)"] = 4 * b * n * s * s
    else:  # the explicit softmax with keyed dropout
        out["mla attention q, k, v"] = 2 * e * heads * d_qk + kv_up
        out["mla attention s^2 (softmax, mask, dropped)"] = 4 * b * n * s * s + \
            2 * e * b * n * s * s + s * s
    if proj:
        out["mla projection input"] = proj
    return out
