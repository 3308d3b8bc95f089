"""The feed-forward block: column-parallel fc1, activation, row-parallel fc2.

Splitting fc1 by columns and fc2 by rows needs no communication between them, since GeLU and
SwiGLU are elementwise on the split dim (Shoeybi et al. 2019, sec. 3, Fig. 3a). SwiGLU
(Shazeer 2020, eq. 6) fuses gate and up projections into one fc1 weight `[gate; up]` whose two
blocks are split separately, so each rank holds matching gate/up columns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """`[s, b, h] -> [s, b, h]` (sequence shards `[s/tp, b, h]` under SP)."""

    def __init__(self, config, sequence_parallel: bool = False):
        super().__init__()
        self.swiglu = config.activation == "swiglu"
        fc1_out = config.ffn_hidden_size * (2 if self.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, fc1_out, bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel, num_fused_parts=2 if self.swiglu else 1)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel, init="scaled_normal")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate="tanh")
        return self.linear_fc2(y)
