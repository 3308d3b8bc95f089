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
norms, activations, softmax and the loss are not matmuls and are not counted. T5 (encoder-
decoder) is counted per encoder token by the same rules (`_t5_flops_per_encoder_token`).
"""
from __future__ import annotations

import time

import torch

from layers import gemm

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
    fc1_out = 2 * ffn if config.activation in ("swiglu", "geglu") else ffn
    dense = 2 * (h * (q + 2 * kv) + q * h + h * fc1_out + ffn * h)
    attention = 2 * 2 * s * q  # per token: one row of QK^T and of AV, each 2 s q
    if getattr(config, "is_encoder_decoder", False):
        return _t5_flops_per_encoder_token(config, s, dense, v)
    return float(config.num_layers * (dense + attention) + 2 * h * v)


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


def measured_matmul_peak(dtype: torch.dtype, device: torch.device, n: int = 2048,
                         repeats: int = 8, min_seconds: float = 0.0,
                         max_seconds: float = 2.0) -> tuple[float, int]:
    """Best FLOP/s of timed `[n, n] x [n, n]` matmuls in `dtype` on `device`.

    At least `repeats` of them, and more until `min_seconds` have been spent timing (at most
    8x `repeats`), but never much past `max_seconds`: once two are timed and `max_seconds`
    are spent it stops. After one warm-up matmul, the size grows from 256 by doubling up to
    `n` while one matmul at the current size stays under `max_seconds / 64`, so that a slow dtype (bf16 on a CPU
    without bf16 instructions runs ~40x below fp32) is measured at a smaller size in a
    fraction of a second instead of taking seconds per matmul. The best, not the mean: a busy
    machine only ever makes a matmul slower, so the fastest one is the closest to the
    device's real rate. On CPU in float32 both GEMMs torch has are timed, MKL's
    (`torch.matmul`) and oneDNN's (layers/gemm.py), and the faster counts: the peak is the
    machine's, whichever one the model runs on.

    Returns:
        `(FLOP/s, size)`: the rate and the matrix size it was measured at.
    """
    kernels = [torch.matmul]
    if device.type == "cpu" and dtype == torch.float32 and gemm.available():
        kernels.append(lambda a, b: gemm.linear_nt(a, b.t()))  # oneDNN's (layers/gemm.py)
    flops = [_measured_kernel_peak(k, dtype, device, n, repeats, min_seconds, max_seconds)
             for k in kernels]
    return max(flops)


def _measured_kernel_peak(kernel, dtype, device, n, repeats, min_seconds, max_seconds):
    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        kernel(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    size = min(256, n)
    # its own generator: how many matrices a measurement makes depends on the machine's speed,
    # and no measurement may move a random stream of the run (parallel_state/random.py)
    gen = torch.Generator().manual_seed(0)
    make = lambda: torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    a, b = make(), make()
    timed(a, b)  # warm-up: one-time costs (CUDA context, BLAS handles) are not the rate
    while size < n and timed(a, b) <= max_seconds / 64:
        size *= 2
        a, b = make(), make()
    best, spent, done = float("inf"), 0.0, 0
    while done < repeats or (spent < min_seconds and done < 8 * repeats):
        if done >= 2 and spent >= max_seconds:
            break
        elapsed = timed(a, b)
        best, spent, done = min(best, elapsed), spent + elapsed, done + 1
    return 2.0 * size ** 3 / best, size


class PeakFlops:
    """The per-device peak TFLOP/s that MFU divides by, and the rule that keeps MFU honest.

    The peak is `--peak-tflops` when given, the data sheet on known GPUs (H100, H200, A100),
    else measured here: the best of repeated `n^3` matmuls (`measured_matmul_peak`). A
    measured peak can come out low when the machine is busy while it is measured; then a
    step can achieve more than "the peak". `mfu(achieved)` re-measures in that case and keeps
    the higher peak, and when the achieved rate still exceeds it returns None (MFU unknown)
    rather than a figure over 100%; `note` then says why. `remeasure()` (end of run) keeps
    the higher of the old and a new measurement.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, given: float | None = None):
        self.device, self.dtype = device, dtype
        self.key = "bf16" if dtype == torch.bfloat16 else "fp32"
        self.note: str | None = None
        self.remeasured = False
        if given:
            self.tflops, self.source, self.measured = float(given), "--peak-tflops", False
            return
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            for key, tflops in GPU_PEAK_BF16_TFLOPS.items():
                if key in name:
                    self.tflops = tflops / (1 if self.key == "bf16" else 2)
                    self.source, self.measured = f"{key} data sheet" + (
                        ", TF32" if self.key == "fp32" else ""), False
                    return
        # CPU: many short matmuls (1024^3, ~20 ms on 2 cores) for half a second, so that the
        # best of them likely met an idle moment on a shared machine
        self.n = 8192 if device.type == "cuda" else 1024
        self.measured = True
        self.tflops = self._measure()
        self.source = f"measured: best of repeated {self.n}^3 {self.key} matmuls"

    def _measure(self) -> float:
        flops, self.n = measured_matmul_peak(self.dtype, self.device, self.n, min_seconds=0.5)
        return flops / 1e12

    def remeasure(self) -> float:
        """Measure again (a measured peak only) and keep the higher; returns the peak."""
        if self.measured:
            self.tflops = max(self.tflops, self._measure())
        return self.tflops

    def mfu(self, achieved_tflops: float) -> float | None:
        """`achieved / peak`, or None when the achieved rate exceeds the peak (see class).

        Re-measures at most once per run, so a peak that stays below the achieved rate costs
        one measurement, not one per log line."""
        if achieved_tflops > self.tflops and not self.remeasured:
            self.remeasured = True
            self.remeasure()
        if achieved_tflops <= self.tflops:
            return achieved_tflops / self.tflops
        self.note = (f"the achieved {achieved_tflops:.3g} TFLOP/s per device exceeds the peak "
                     f"{self.tflops:.3g} TFLOP/s ({self.source})" +
                     (": the measured peak came out low (a busy machine, or a matmul kernel slower at "
                      f"{self.n}^3 than at the model's shapes)" if self.measured else "")
                     + "; MFU is not shown, pass --peak-tflops with the device's real peak")
        return None

    def describe(self) -> str:
        return f"{self.tflops:.3g} TFLOP/s per device ({self.source})"

