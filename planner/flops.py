"""Model FLOPs of a decoder-only transformer, for tokens/s -> TFLOP/s and MFU.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC21), sec. 5.1 and appendix: only matrix multiplications are counted (a
`[m, k] x [k, n]` product is `2mkn` FLOPs), and training costs 3x the forward pass (backward
computes the gradients with respect to both the inputs and the weights, 2x forward). Activation
recomputation is *not* counted: these are model FLOPs, so MFU is comparable across
recompute policies (Chowdhery et al. 2022, PaLM, appendix B).

Generalised from the paper's GPT formula to grouped-query attention, SwiGLU and untied sizes.
Per layer and per sequence of `s` tokens, forward:

    2 s (h (q + 2 kv) + q h + h fc1_out + ffn h)      QKV, output projection, fc1, fc2
  + 2 * 2 s^2 q                                       Q K^T and (softmax) V

with `q = heads * d`, `kv = query_groups * d`, `fc1_out = 2 ffn` for SwiGLU (gate and up) and
`ffn` for GeLU; plus the logits `2 s h V` once. An MoE layer (planner/moe.py
`mlp_forward_flops`) counts only what a token uses, as Megatron-LM's
`num_floating_point_operations` (megatron/training/training.py) does: its `k` routed experts
of width `moe_ffn_hidden_size` and the shared experts, plus the router `2 h E`. The attention term is counted over the full
`s x s` score matrix, as in the paper (no discount for the causal mask). Embedding lookups,
norms, activations, softmax and the loss are not matmuls and are not counted. T5 (encoder-
decoder) is counted per encoder token by the same rules (`_t5_flops_per_encoder_token`).

FP8 training (layers/fp8.py `apply_fp8`) runs some of these GEMMs in FP8: the QKV and output
projections and the dense MLP of each transformer layer outside the first / last kept in
higher precision, each in all three of its GEMMs (`fp8_flops_share`). A device with an FP8
peak runs them against it, so MFU divides by the peak that time-weights both
(`blended_peak`: the total FLOPs over the ideal time `(1 - f) / P + f / P_fp8`).
"""
from __future__ import annotations

from layers.mlp import GATED

from .moe import mlp_forward_flops


# Dense (no sparsity) bf16 tensor-core peak of one GPU from NVIDIA's data sheets, TFLOP/s,
# keyed by a part of torch.cuda.get_device_name(); the more specific names come first
# ("NVIDIA H100 PCIe" before the SXM part, "NVIDIA H100 80GB HBM3").
GPU_PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H800": 989.0,
                        "H200": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}
# Dense FP8 tensor-core peak from the same data sheets, same keys; a GPU without FP8 tensor
# cores (A100) is absent: its FP8 GEMMs count at the bf16 peak.
GPU_PEAK_FP8_TFLOPS = {"H100 PCIe": 1513.0, "H100 NVL": 1671.0, "H100": 1979.0, "H800": 1979.0,
                       "H200": 1979.0, "L40S": 733.0, "B200": 4500.0}


def forward_flops_per_token(config, seq_length: int | None = None,
                            vocab_size: int | None = None) -> float:
    """Forward matmul FLOPs per token of `config` (a models.ModelConfig) at `seq_length`.

    Args:
        config: the model shape (`hidden_size`, `num_layers`, `num_attention_heads`,
            `num_query_groups`, `kv_channels`, `ffn_hidden_size`, `activation`).
        seq_length: tokens per sequence (default `config.seq_length`); sets the attention term.
        vocab_size: columns of the output layer (default the real `config.vocab_size`; pass
            the padded size to count padding work as well).
    Returns:
        FLOPs per token (a float; multiply by tokens/s for FLOP/s), the multi-token-
        prediction depths' included (training runs them; DeepSeek-V3 report sec. 2.2).
    """
    s = seq_length or config.seq_length
    v = vocab_size or config.vocab_size
    h, ffn = config.hidden_size, config.ffn_hidden_size
    if getattr(config, "is_encoder_decoder", False):
        q, kv = config.query_projection_size, config.kv_projection_size
        fc1_out = 2 * ffn if config.activation in GATED else ffn
        dense = 2 * (h * (q + 2 * kv) + q * h + h * fc1_out + ffn * h)
        return _t5_flops_per_encoder_token(config, s, dense, v)
    # multi-token prediction (models/mtp.py), per depth: eh_proj [2h -> h], a layer, the head
    mtp = sum(4 * h * h + layer_forward_flops(config, config.num_layers + j, s) + 2 * h * v
              for j in range(getattr(config, "mtp_num_layers", None) or 0))
    return float(sum(layer_forward_flops(config, n, s) for n in range(config.num_layers))
                 + 2 * h * v + mtp)


def layer_forward_flops(config, layer_number: int, seq_length: int | None = None) -> float:
    """Forward matmul FLOPs per token of decoder layer `layer_number` (0-based): QKV and output
    projections `2 h (q + 2 kv) + 2 q h`, attention `4 s q`, and the MLP
    (`planner.moe.mlp_forward_flops`: the dense MLP, or an MoE MLP's active experts, router
    and shared experts)."""
    s = seq_length or config.seq_length
    h = config.hidden_size
    if config.multi_latent_attention:
        return float(mla_forward_flops(config, s) + mlp_forward_flops(config, layer_number))
    q, kv = config.query_projection_size, config.kv_projection_size
    attention = 2 * (h * (q + 2 * kv) + q * h) + core_attention_flops(config, s)
    return float(attention + mlp_forward_flops(config, layer_number))


def core_attention_flops(config, seq_length: int) -> int:
    """Forward FLOPs per token of one layer's core attention over `seq_length` keys: QK^T and
    the weighted values, `2 s q` each (`q` = heads x head dim); under multi-head latent
    attention `2 s n (d_n + d_r)` and `2 s n d_v`."""
    s = seq_length
    if config.multi_latent_attention:
        n = config.num_attention_heads
        return 2 * s * n * (config.qk_nope_head_dim + config.qk_rope_head_dim
                            + config.v_head_dim)
    return 2 * 2 * s * config.query_projection_size


def mla_forward_flops(config, seq_length: int) -> int:
    """Forward matmul FLOPs per token of one multi-head latent attention (layers/mla.py; the
    MLA branch of Megatron-LM's `num_floating_point_operations`), n heads, `d_qk = d_n +
    d_r`: the query `2 h n d_qk` (low-rank: `2 h d_c' + 2 d_c' n d_qk`), the KV down-projection
    `2 h (d_c + d_r)`, its up-projection `2 d_c n (d_n + d_v)`, the output `2 n d_v h`, and
    the attention over `s` keys: scores `2 s n d_qk`, weighted values `2 s n d_v`."""
    h, n, s = config.hidden_size, config.num_attention_heads, seq_length
    d_n, d_r, d_v, d_c = (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim,
                          config.kv_lora_rank)
    d_qk, r_q = d_n + d_r, config.q_lora_rank
    query = 2 * h * n * d_qk if r_q is None else 2 * h * r_q + 2 * r_q * n * d_qk
    return (query + 2 * h * (d_c + d_r) + 2 * d_c * n * (d_n + d_v) + 2 * n * d_v * h
            + core_attention_flops(config, s))


def _t5_flops_per_encoder_token(config, se: int, dense: float, v: int) -> float:
    """T5 forward FLOPs of one sample (`se` encoder, `sd` decoder tokens) per encoder token
    (the unit of tokens/s): the same terms per layer as above, with the decoder's
    cross-attention adding its query and output projections (`2 * 2 h q` per decoder
    token), the K/V projections of the encoder output (`2 * 2 h kv` per encoder token and
    decoder layer) and `4 se q` of scores and weighted values per decoder token."""
    sd, h, q = config.decoder_seq_length, config.hidden_size, config.query_projection_size
    kv = config.kv_projection_size
    encoder = se * config.encoder_num_layers * (dense + 4 * se * q)
    cross_kv = se * config.decoder_num_layers * 4 * h * kv
    decoder = sd * (config.decoder_num_layers * (dense + 4 * h * q + 4 * sd * q + 4 * se * q)
                    + 2 * h * v)
    return float(encoder + cross_kv + decoder) / se


def training_flops_per_token(config, seq_length: int | None = None,
                             vocab_size: int | None = None) -> float:
    """Training (forward + backward) model FLOPs per token: 3x `forward_flops_per_token`.

    Narayanan et al. 2021 (SC21), sec. 5.1: backward costs twice the forward. Arguments as
    `forward_flops_per_token`.
    """
    return 3.0 * forward_flops_per_token(config, seq_length, vocab_size)


def layer_fp8_forward_flops(config, layer_number: int) -> float:
    """Forward FLOPs per token of layer `layer_number`'s GEMMs that FP8 runs when the layer is
    in FP8 (layers/fp8.py `apply_fp8`): the QKV and output projections and a dense MLP
    (`layer_forward_flops` less the attention core `4 s q` and an MoE MLP, which stay in the
    run's precision, as do the logits)."""
    core = 2 * 2 * config.seq_length * config.query_projection_size
    f = layer_forward_flops(config, layer_number) - core
    if config.is_moe_layer(layer_number):
        f -= mlp_forward_flops(config, layer_number)
    return f


def fp8_forward_flops_per_token(config, layers_at_start: int = 0,
                                layers_at_end: int = 0) -> float:
    """Forward FLOPs per token of the FP8 GEMMs (`layer_fp8_forward_flops`) of every layer
    but the first `layers_at_start` and last `layers_at_end`."""
    return float(sum(layer_fp8_forward_flops(config, n)
                     for n in range(layers_at_start, config.num_layers - layers_at_end)))


def fp8_flops_share(config, layers_at_start: int = 0, layers_at_end: int = 0) -> float:
    """The share (0..1) of the model FLOPs (`forward_flops_per_token`; training's are 3x both)
    that the FP8 GEMMs make (`fp8_forward_flops_per_token`)."""
    return fp8_forward_flops_per_token(config, layers_at_start, layers_at_end) / \
        forward_flops_per_token(config)


def blended_peak(peak: float, fp8_peak: float, fp8_share: float) -> float:
    """The peak MFU divides by when a share `fp8_share` of the FLOPs runs at `fp8_peak` and
    the rest at `peak` (same units): FLOPs over the ideal time, `1 / ((1 - f) / peak + f /
    fp8_peak)`; `peak` when f is 0. Raises ValueError for f outside [0, 1] or a peak <= 0."""
    if not 0.0 <= fp8_share <= 1.0 or peak <= 0 or fp8_peak <= 0:
        raise ValueError(f"fp8_share {fp8_share} must be in [0, 1] and the peaks {peak}, "
                         f"{fp8_peak} positive")
    return 1.0 / ((1.0 - fp8_share) / peak + fp8_share / fp8_peak)
