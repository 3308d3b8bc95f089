"""LayerNorm and RMSNorm over the hidden dim, replicated across TP ranks.

Under sequence parallelism they run on `[s/tp, b, h]` shards, so their weight gradients are
partial sums; the weights are tagged `sequence_parallel` and the trainer sums those gradients
over TP after backward (Korthikanti et al. 2022, sec. 4.2.2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel_state import get_tensor_model_parallel_world_size
from parallel_state.mappings import sum_over_tensor_model_parallel_region

from .sharding import set_tensor_parallel_attributes


class LayerNorm(nn.Module):
    """`y = (x - mean) / sqrt(var + eps) * weight + bias` over the last dim (Ba et al. 2016);
    `zero_centered_gamma`: `* (1 + weight)`, the weight initialized to 0 (Megatron's
    `layernorm_zero_centered_gamma`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 zero_centered_gamma: bool = False):
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias = nn.Parameter(torch.empty(hidden_size))
        set_tensor_parallel_attributes(self.weight, partition_dim=None,
                                       init="zeros" if zero_centered_gamma else "ones",
                                       sequence_parallel=sequence_parallel)
        set_tensor_parallel_attributes(self.bias, partition_dim=None, init="zeros",
                                       sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return F.layer_norm(x, x.shape[-1:], weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """`y = x / sqrt(mean(x^2) + eps) * weight` (Zhang & Sennrich 2019), computed in float32.

    `zero_centered_gamma` (Gemma; Megatron's `layernorm_zero_centered_gamma`): `* (1 +
    weight)`, the weight initialized to 0; as transformers' GemmaRMSNorm, the normalized x
    and `1 + weight` are multiplied in float32 and the product cast to x's dtype once.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 zero_centered_gamma: bool = False):
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(hidden_size))
        set_tensor_parallel_attributes(self.weight, partition_dim=None,
                                       init="zeros" if zero_centered_gamma else "ones",
                                       sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered_gamma:
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection split over TP (OLMo 2's q/k norm: transformers'
    `Olmo2RMSNorm` on `q_proj(x)` / `k_proj(x)`): `x [..., size / tp]`, this rank's
    contiguous columns, -> same shape, `y = x / sqrt(sum(x^2 over all ranks) / size + eps) *
    weight`, computed in float32 and cast to x's dtype once (as Olmo2RMSNorm). The weight
    `[size]` is split over TP as the projection is (partition dim 0). The sum of squares is
    all-reduced over TP forward and backward (each rank's gradient of it is partial), so the
    output and every gradient equal one process's.
    """

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.size, self.eps = size, eps
        self.weight = nn.Parameter(torch.empty(size // get_tensor_model_parallel_world_size()))
        set_tensor_parallel_attributes(self.weight, partition_dim=0, init="ones")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, x = x.dtype, x.float()
        squares = sum_over_tensor_model_parallel_region(x.pow(2).sum(-1, keepdim=True))
        x = x * torch.rsqrt(squares / self.size + self.eps)
        return (self.weight.float() * x).to(dtype)


def build_norm(config, sequence_parallel: bool = False, hidden_size: int | None = None
               ) -> nn.Module:
    """`config.normalization` over `hidden_size` (default `config.hidden_size`; a head's
    `kv_channels` for q/k norms), zero-centred per `config.layernorm_zero_centered_gamma`."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return cls(hidden_size or config.hidden_size, config.layernorm_epsilon,
               sequence_parallel=sequence_parallel,
               zero_centered_gamma=getattr(config, "layernorm_zero_centered_gamma", False))
