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
`ffn` for GeLU; plus the logits `2 s h V` once. The attention term is counted over the full
`s x s` score matrix, as in the paper (no discount for the causal mask). Embedding lookups,
norms, activations, softmax and the loss are not matmuls and are not counted.
"""
from __future__ import annotations

import time

import torch

# Dense bf16 peak of one GPU from the data sheets (no sparsity), TFLOP/s.
GPU_PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


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
        FLOPs per token (a float; multiply by tokens/s for FLOP/s).
    """
    s = seq_length or config.seq_length
    v = vocab_size or config.vocab_size
    h, ffn = config.hidden_size, config.ffn_hidden_size
    q, kv = config.query_projection_size, config.kv_projection_size
    fc1_out = 2 * ffn if config.activation == "swiglu" else ffn
    dense = 2 * (h * (q + 2 * kv) + q * h + h * fc1_out + ffn * h)
    attention = 2 * 2 * s * q  # per token: one row of QK^T and of AV, each 2 s q
    return float(config.num_layers * (dense + attention) + 2 * h * v)


def training_flops_per_token(config, seq_length: int | None = None,
                             vocab_size: int | None = None) -> float:
    """Training (forward + backward) model FLOPs per token: 3x `forward_flops_per_token`.

    Narayanan et al. 2021 (SC21), sec. 5.1: backward costs twice the forward. Arguments as
    `forward_flops_per_token`.
    """
    return 3.0 * forward_flops_per_token(config, seq_length, vocab_size)


def measured_matmul_peak(dtype: torch.dtype, device: torch.device, n: int = 2048,
                         repeats: int = 8) -> float:
    """Best FLOP/s of `repeats` timed `[n, n] x [n, n]` matmuls in `dtype` on `device`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def peak_flops(device: torch.device) -> dict[str, tuple[float, str]]:
    """`{"fp32"|"bf16": (FLOP/s, how it was obtained)}`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_BF16_TFLOPS.items():
            if key in name:
                # fp32 runs on TF32 tensor cores at half the bf16 rate when allowed; quote bf16.
                return {"bf16": (tflops * 1e12, f"{key} data sheet"),
                        "fp32": (tflops * 1e12 / 2, f"{key} data sheet, TF32")}
        n = 8192
        return {"fp32": (measured_matmul_peak(torch.float32, device, n), f"measured {n}^3"),
                "bf16": (measured_matmul_peak(torch.bfloat16, device, n), f"measured {n}^3")}
    n = 2048
    return {"fp32": (measured_matmul_peak(torch.float32, device, n), f"measured {n}^3 matmul"),
            "bf16": (measured_matmul_peak(torch.bfloat16, device, n), f"measured {n}^3 matmul")}




def measure_peak_tflops(device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """Peak TFLOP/s of one device for MFU: the data sheet on known GPUs, else measured."""
    if device.type == "cuda":
        return peak_flops(device)["bf16" if dtype == torch.bfloat16 else "fp32"][0] / 1e12
    return measured_matmul_peak(dtype, device, 2048, repeats=4) / 1e12
