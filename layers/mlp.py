"""The feed-forward block: column-parallel fc1, activation, row-parallel fc2.

Splitting fc1 by columns and fc2 by rows needs no communication between them, since GeLU, ReLU and
the gated units are elementwise on the split dim (Shoeybi et al. 2019, sec. 3, Fig. 3a). SwiGLU
(Shazeer 2020, eq. 6) fuses gate and up projections into one fc1 weight `[gate; up]` whose two
blocks are split separately, so each rank holds matching gate/up columns.

SwiGLU runs as one autograd function on the fused fc1 output: its backward writes the gate and
up gradients straight into one `[.., 2f]` buffer, instead of autograd's two half-size gradients
concatenated by the split's backward (an extra pass over the largest activation).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ColumnParallelLinear, RowParallelLinear


class _SwiGLU(torch.autograd.Function):
    """`[..., 2f] = [gate; up] -> silu(gate) * up  [..., f]` (Shazeer 2020, eq. 6)."""

    @staticmethod
    def forward(ctx, fused):
        gate, up = fused.chunk(2, dim=-1)
        act = F.silu(gate)
        ctx.save_for_backward(fused, act)
        return act * up

    @staticmethod
    def backward(ctx, grad):
        fused, act = ctx.saved_tensors
        gate, up = fused.chunk(2, dim=-1)
        grad_fused = torch.empty_like(fused)
        grad_gate, grad_up = grad_fused.chunk(2, dim=-1)
        torch.mul(grad, act, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_fused


def swiglu(fused: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused `[..., 2f]` tensor `[gate; up]` -> `[..., f]`."""
    if not torch.is_grad_enabled():  # inference: no autograd.Function call, in place
        gate, up = fused.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    if torch.compiler.is_compiling():  # inductor fuses forward and backward itself
        gate, up = fused.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SwiGLU.apply(fused)


def geglu(fused: torch.Tensor) -> torch.Tensor:
    """GeGLU on a fused `[..., 2f]` tensor `[gate; up]` -> `gelu_tanh(gate) * up [..., f]`
    (Shazeer 2020, eq. 5; T5 v1.1's "gated-gelu" with the tanh approximation, HF's gelu_new)."""
    gate, up = fused.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


QUICK_GELU_ALPHA = 1.702  # x * sigmoid(1.702 x) ~ gelu(x) (Hendrycks & Gimpel 2016, sec. 2)


def quick_geglu(fused: torch.Tensor, clamp: float | None = None,
                offset: float = 0.0) -> torch.Tensor:
    """gpt-oss's gated unit on a fused `[..., 2f]` tensor `[gate; up]` -> `[..., f]`:
    `g * sigmoid(1.702 g) * (u + offset)` with, given `clamp`, `g = min(gate, clamp)` and
    `u = clamp(up, -clamp, clamp)` (transformers' `GptOssExperts._apply_gate`: alpha 1.702,
    limit 7.0, offset 1; Megatron-Core's quick_gelu with `activation_func_clamp_value` and
    `glu_linear_offset`)."""
    gate, up = fused.chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    return gate * torch.sigmoid(gate * QUICK_GELU_ALPHA) * (up + offset)


GATED = ("swiglu", "geglu", "quick_geglu")  # activations whose fc1 is the fused [gate; up]


def gate_args(config) -> tuple[float | None, float]:
    """`(clamp, offset)` of `activate` from a config (gpt-oss's fields; None, 0 elsewhere)."""
    return (getattr(config, "activation_func_clamp_value", None),
            getattr(config, "glu_linear_offset", 0.0))


def activate(y: torch.Tensor, activation: str, clamp: float | None = None,
             offset: float = 0.0) -> torch.Tensor:
    """fc1's output `[..., f]` (`[..., 2f]` fused `[gate; up]` for GATED) through
    `activation` ("gelu": tanh approximation, "relu", "swiglu", "geglu", "quick_geglu" with
    its `clamp` and `offset`) -> `[..., f]`."""
    if activation == "swiglu":
        return swiglu(y)
    if activation == "geglu":
        return geglu(y)
    if activation == "quick_geglu":
        return quick_geglu(y, clamp, offset)
    if activation == "relu":
        return F.relu(y)
    return F.gelu(y, approximate="tanh")


class MLP(nn.Module):
    """`[s, b, h] -> [s, b, h]` (sequence shards `[s/tp, b, h]` under SP).

    `config.activation`: "gelu" (tanh approximation, GPT-2), "relu" (T5 v1.0), or the gated
    "swiglu" (Llama) / "geglu" (T5 v1.1), whose fc1 holds `[gate; up]`. `ffn_hidden_size`
    overrides `config.ffn_hidden_size` (an MoE layer's shared experts).
    """

    def __init__(self, config, sequence_parallel: bool = False,
                 ffn_hidden_size: int | None = None):
        super().__init__()
        self.activation = config.activation
        self.gate_args = gate_args(config)
        gated = self.activation in GATED
        ffn = ffn_hidden_size or config.ffn_hidden_size
        fc1_out = ffn * (2 if gated else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, fc1_out, bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel, num_fused_parts=2 if gated else 1)
        self.linear_fc2 = RowParallelLinear(
            ffn, config.hidden_size, bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel, init="scaled_normal")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activate(self.linear_fc1(x), self.activation, *self.gate_args))
